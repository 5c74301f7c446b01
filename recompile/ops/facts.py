"""Named sets of what recompile knows about callables, one definition each.

Every stage reasons about the same callables: which ones change nothing (and may move), which change
state in place, which need no gradient, which act elementwise, which pass a lazy value on. Each fact is
defined here once and read by its consumers (the frontend, the passes, the emitters, the gradient
library, the batch rules); a fact that refines another is derived from it. A callable of recompile's
own that belongs to a fact declares it where it is written (``@pure``), as rules are filed where they
are written (``ops.table``).
"""

from __future__ import annotations

import collections
import inspect
import math
import operator
import types

import torch
import torch.nn.functional as F
from torch import nn

from .. import intrinsics
from . import syntax
from .table import BOUND_BUILTIN

# -- what a call changes


def _pure_operators():
    return {row.fn for row in (*syntax.BINARY, *syntax.UNARY, *syntax.COMPARE)
            if row.fn is not intrinsics.not_in}  # (not ``in``: on an iterator it consumes items)


# Calls that read and build but change nothing the program reads: one may move across a compiled call
# (``codegen.plan`` hoists them between the calls of a group), run once for instances that share their
# arguments, or run again when a traced segment is cut short. Mutable (``pure``): the gradient library
# declares its bookkeeping calls pure where it writes them.
PURE = _pure_operators() | {
    operator.getitem, getattr, len, isinstance, slice, range, int, float, bool, abs, min, max, tuple,
    intrinsics.finds_in_class, intrinsics.build_tuple, intrinsics.build_list, intrinsics.build_dict,
    intrinsics.build_set, intrinsics.unpack, intrinsics.check_bound, intrinsics.as_sequence,
    intrinsics.has_index, intrinsics.format_value, intrinsics.join_str, intrinsics.builtin_read, operator.index,
    intrinsics.reversed_sequence,
    *intrinsics.AUGMENTED_FRESH.values(),  # (``x += y`` written out of place: a new object, x unchanged)
    *intrinsics.OUT_OF_PLACE,  # (``x.relu_()``, ``torch.relu_(x)`` so written)
    *intrinsics.SETTERS_FRESH.values(),  # (``x.fill_(0.0)``, ``x.requires_grad_()`` of a tensor only its frame holds)
    intrinsics.setitem_fresh,  # (``x[i] = v`` of a buffer only its next write reads: a copy, or that copy again)
}


# Python's math functions: numbers in, a number out (``math.sqrt(H)`` of a constant runs once for every instance)
MATH = frozenset(getattr(math, name) for name in dir(math)
                 if not name.startswith("_") and callable(getattr(math, name)))
PURE |= MATH


def pure(fn):
    """Declare ``fn`` pure (see ``PURE``) where it is defined: ``@facts.pure``."""
    PURE.add(fn)
    return fn


# Calls whose result, given the same arguments, every instance of a batch may share as one object: reads
# of what exists (an attribute, an item, a global), immutable builds, and a nested function or a cell made of
# values every instance shares.
SHAREABLE = frozenset({
    getattr, operator.getitem, intrinsics.unpack, intrinsics.build_tuple, intrinsics.check_bound,
    intrinsics.builtin_read, intrinsics.read_global, intrinsics.read_cell, intrinsics.finds_in_class, isinstance,
    len, type, intrinsics.fixed_cell, intrinsics.make_function, operator.index, intrinsics.import_module,
    intrinsics.import_from,
})

# Builtins whose result is a function of their arguments' values alone and that change nothing, given no
# iterator (which they would consume): a batch runs them once for instances that share their arguments
# (``sum(self.sizes)``, ``round(self.d / 3)``, ``sorted(self.names)``), as every instance would get the same.
VALUE_BUILTINS = frozenset({
    sum, round, divmod, pow, sorted, any, all, min, max, abs, len, str, repr, format, ascii, chr, ord, bin, hex,
    oct, int, float, bool, complex, tuple, list, frozenset, hash,
})
# Methods of a builtin container that read it and change nothing: ``self.config.get("scale", 1.0)``,
# ``self.names.index(name)``. (Every method of an immutable value changes nothing.)
READING_METHODS = frozenset({"get", "index", "count", "keys", "values", "items", "__contains__", "__getitem__",
                             "__len__", "isdisjoint", "issubset", "issuperset"})


# Calls that change their arguments in place (``passes.effects``: a compiled call that may run one keeps
# its place among its group).
MUTATING = frozenset({
    setattr, delattr, operator.setitem, operator.delitem, next, operator.iconcat, *syntax.AUGMENTED,
    intrinsics.set_cell, intrinsics.delete_cell, intrinsics.write_global, intrinsics.delete_global,
    intrinsics.hand_back,
})
# Method names (and module functions named alike) that change their receiver or argument: ``xs.append``,
# ``heapq.heappush``; any name ending in one ``_`` (``t.add_``) changes it too (``mutating_method``).
MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard", "setdefault",
    "popitem", "sort", "reverse", "put", "write", "send", "__setitem__", "__delitem__", "__setattr__",
    "__iadd__", "__imul__",
    # module functions that mutate their argument: operator.setitem, heapq.heappush, random.shuffle, ...
    "setitem", "delitem", "setattr", "delattr", "iadd", "isub", "imul", "heappush", "heappop", "heapify",
    "heapreplace", "heappushpop", "shuffle",
    # deque, set, array and autograd state
    "appendleft", "extendleft", "popleft", "rotate", "difference_update", "intersection_update",
    "symmetric_difference_update", "fill", "resize", "itemset", "backward", "zero_grad", "step",
    "register_buffer", "register_parameter", "add_module", "next", "insort", "insort_left", "insort_right",
    "move_to_end", "subtract",
})


def mutating_method(name):
    """Whether a method (or module function) of this name may change what it is called on."""
    return isinstance(name, str) and (name in MUTATING_METHODS or (name.endswith("_") and not name.endswith("__")))


# Mutating methods whose name a Tensor method shares, and keywords only the Tensor method takes: with one of them
# the call is a tensor's, which changes nothing (``s.sort(descending=True)``, ``x.add(y, alpha=2)``); any other
# call may be the list's, the set's, or another object's that changes it (``list.sort(xs)``, ``bag.add(v, w)``).
_TENSOR_KEYWORDS = {"sort": {"dim", "descending", "stable"}, "add": {"alpha"}}
# ... and the same for a first positional argument: ``xs.sort(0)`` sorts along a dim, where a list's sort takes
# no positional argument and ``list.sort(xs)`` is given the list.
_TENSOR_FIRST_ARGUMENT = {"sort": int}


def mutating_call(name, keywords, first=None):
    """Whether a call of a method of this name, given these ``keywords`` (and ``first``, its first positional
    argument where the program gives it as a constant), may change what it is called on (``mutating_method``,
    less the calls only a tensor's method takes)."""
    if name in _TENSOR_KEYWORDS and _TENSOR_KEYWORDS[name] & set(keywords):
        return False
    if name in _TENSOR_FIRST_ARGUMENT and type(first) is _TENSOR_FIRST_ARGUMENT[name]:
        return False
    return mutating_method(name)


_INPLACE_AT = {}


_UNKNOWN = object()


def inplace_position(fn):
    """The position of callable ``fn``'s ``inplace`` parameter (``F.relu``, ``F.leaky_relu``), or None."""
    key = _inplace_key(fn)
    try:
        at = _INPLACE_AT.get(key, _UNKNOWN)  # (read once per key: this runs for every op a batched run calls)
    except TypeError:  # (an unhashable callable)
        key, at = None, _UNKNOWN
    if at is _UNKNOWN:
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        at = names.index("inplace") if "inplace" in names else None
        if key is not None:
            _INPLACE_AT[key] = at
    return at


def _inplace_key(fn):
    """What ``fn``'s parameters are read by in ``_INPLACE_AT``: something that lives as long as the program (a
    function, a class, a module's type; a bound method's function, or the type and name of the object a builtin
    method is bound to: ``hs.append``), never a call's own values, which the table would keep alive; None for
    what has none (a batch of callables)."""
    if isinstance(fn, nn.Module):
        return type(fn)
    kind = type(fn)
    if kind is types.MethodType:
        return kind, fn.__func__  # (its parameters but the first: not the function's own positions)
    if kind is types.BuiltinMethodType:
        bound = fn.__self__
        return fn if bound is None or isinstance(bound, (type, types.ModuleType)) else (type(bound), fn.__name__)
    return fn if isinstance(fn, (type, types.FunctionType)) else None


def built_in_place(fn):
    """Whether ``fn`` is a module built to write its input: ``nn.ReLU(inplace=True)``, or an ``nn.Sequential``
    whose input reaches such a module (``nn.Sequential(nn.Dropout(0.1), nn.ReLU(inplace=True))``: dropout hands
    its input on where it does not train). One that writes only what an earlier layer made
    (``nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))``) leaves its input as it was."""
    if not isinstance(fn, nn.Module):
        return False
    if getattr(fn, "inplace", False) is True:
        return True
    if type(fn) is nn.Sequential:
        for layer in fn:
            if built_in_place(layer):
                return True
            if not isinstance(layer, HANDING_ON_MODULES):
                return False
    return False


# modules that may hand on their input itself (dropout where it does not train)
HANDING_ON_MODULES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                      nn.FeatureAlphaDropout)


def asks_in_place(fn, args, kwargs):
    """Whether ``fn(*args, **kwargs)`` writes its first argument by an ``inplace`` flag (``F.relu(x, True)``,
    ``inplace=True``) or is a module built with ``inplace=True``."""
    if kwargs and kwargs.get("inplace"):
        return True
    if built_in_place(fn):
        return True
    at = inplace_position(fn)
    if at is None or at >= len(args):
        return False
    return type(args[at]) in (bool, int) and bool(args[at])


# torch's constructors: each call a new tensor (``requires_grad=True`` makes a leaf, which eager refuses to change)
CONSTRUCTORS = frozenset({torch.zeros, torch.ones, torch.full, torch.empty, torch.zeros_like, torch.ones_like,
                          torch.full_like, torch.empty_like, torch.tensor, torch.eye, torch.arange})

# Augmented assignments a tensor takes in place, with the gradient of its old value (``autodiff.backprop``)
# and, batched, on the batch's tensor (``runtime.batch_rules``).
IN_PLACE = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow)
# In-place Tensor methods that are an augmented assignment when given one operand and no option.
AUGMENTED_METHODS = {"add_": operator.iadd, "sub_": operator.isub, "mul_": operator.imul, "div_": operator.itruediv,
                     "true_divide_": operator.itruediv, "pow_": operator.ipow}

# -- gradients

# Calls that hand on the very objects they are given (an attribute, a dict of them): no gradient of their
# own, but what they hand on carries its own.
MOVES = frozenset({getattr, setattr, delattr, dict, set, frozenset})
# Calls that compute nothing differentiable: what they return is no function of a tensor's values that a
# gradient flows through (a bool, an int, a str), or the very objects they were given (``MOVES``, a tuple
# built), whose cotangents follow those objects. The grad pass emits no gradient for them (a read such as
# getattr is noted first: ``READS``), and the gradient library runs them as they are.
NO_GRADIENT = MOVES | {
    intrinsics.build_tuple, intrinsics.build_list, intrinsics.build_dict, intrinsics.build_set,
    intrinsics.check_bound, intrinsics.builtin_read, intrinsics.has_index, intrinsics.format_value,
    intrinsics.join_str, intrinsics.finds_in_class, intrinsics.not_in, intrinsics.raise_exception,
    intrinsics.read_global, intrinsics.read_cell, intrinsics.new_cell, intrinsics.fixed_cell, intrinsics.set_cell,
    intrinsics.read_local_cell, intrinsics.cell_or_undefined, intrinsics.delete_cell, intrinsics.make_function,
    intrinsics.write_global, intrinsics.delete_global, intrinsics.import_module, intrinsics.import_from,
    intrinsics.hand_back,  # (moves a call's list's items, as list.extend: each tensor the very object)
    *(row.fn for row in syntax.COMPARE), operator.not_, operator.contains, operator.truth,
    print, len, isinstance, issubclass, slice, range, str, repr, format, int, float, bool, id, hash, type,
    callable, hasattr, chr, ord, divmod, round, any, all, operator.index,
}
# Tensor methods whose result carries no gradient: sizes, tests, integer results, conversions out of torch.
NO_GRADIENT_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "item", "tolist", "nelement", "element_size", "stride",
    "is_contiguous", "data_ptr", "storage_offset", "get_device", "argmax", "argmin", "argsort", "eq",
    "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "nonzero", "numpy", "equal", "any", "all",
    "is_floating_point", "is_complex", "sign", "__bool__", "__len__", "__int__", "__float__", "__index__",
    "bool", "long", "int", "byte", "logical_not", "logical_and", "logical_or", "count_nonzero",
})
# The calls a lowered ``for`` makes (``frontend.canonicalize``): its sequence (read from its end for ``reversed``),
# the test of each step.
FOR_LOOP = frozenset({intrinsics.as_sequence, intrinsics.has_index, intrinsics.reversed_sequence})
# Calls whose result may be a tensor from outside the program (a parameter): the forward notes it.
READS = frozenset({getattr, operator.getitem, intrinsics.unpack})
# Calls that build a container of the very values given.
BUILDERS = (intrinsics.build_tuple, intrinsics.build_list, intrinsics.build_set, intrinsics.build_dict)
# Calls that iterate what they are given: a tensor gives its rows (as ``for row in x`` does).
ITERATING = frozenset({enumerate, zip, list, tuple, reversed, iter, sorted, intrinsics.reversed_sequence})
# Python's containers: their methods move objects and compute nothing.
CONTAINERS = (list, dict, set, frozenset, tuple, str, bytes, bytearray, collections.deque)
# Tensor attributes whose read is differentiable; other attribute reads are bound methods or data.
DIFFERENTIABLE_ATTRS = frozenset({"T", "mT", "H", "mH", "real"})
# Tensor attributes that describe a tensor and hand on none of its values.
DATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout"})

# -- elementwise ops and batches

# Elementwise with broadcasting, the same rank and dtype rules in one instance and a batch of them, no
# randomness, no state: chains of them fuse (``passes.fusion``). Comparisons are left out: their results
# mostly feed predicates.
FUSIBLE = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.maximum, torch.minimum,
    torch.sigmoid, torch.tanh, torch.relu, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.abs,
    torch.sin, torch.cos, torch.square, torch.log1p, torch.expm1, torch.erf, torch.where,
    F.relu, F.gelu, F.silu, F.softplus, F.sigmoid, F.tanh,
})
# Elementwise with broadcasting (FUSIBLE, and the comparisons, roundings and ops with options or random
# draws that do not fuse): a batch runs them on its tensor, instance dims lined up (``runtime.batch_rules``).
ELEMENTWISE = FUSIBLE | {
    operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne,
    torch.where, torch.clamp, torch.lt, torch.gt, torch.eq, torch.logical_not, torch.logical_and,
    F.elu, F.leaky_relu, F.dropout, torch.floor, torch.ceil, torch.round, torch.sign,
    torch.addcmul, torch.addcdiv, torch.lerp,
    # ``&``, ``|``, ``^``, ``~``, ``//``, ``%`` (of tensors: a Python value per instance stays per instance)
    operator.and_, operator.or_, operator.xor, operator.invert, operator.floordiv, operator.mod,
    torch.le, torch.ge, torch.ne, torch.logical_or, torch.logical_xor, torch.bitwise_and, torch.bitwise_or,
    torch.bitwise_xor, torch.bitwise_not, torch.remainder, torch.fmod, torch.floor_divide, torch.trunc,
    torch.isnan, torch.isinf, torch.isfinite,
    F.relu6, F.hardtanh, F.hardsigmoid, F.hardswish, F.logsigmoid, F.softsign, F.tanhshrink, F.mish, F.selu,
    F.celu, F.hardshrink, F.softshrink, F.threshold, torch.fmax, torch.fmin,
}
# Module types whose call acts elementwise.
ELEMENTWISE_MODULES = (nn.Sigmoid, nn.Tanh, nn.ReLU, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus,
                       nn.Dropout, nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.LogSigmoid, nn.Softsign,
                       nn.Tanhshrink, nn.Mish, nn.SELU, nn.CELU, nn.Hardshrink, nn.Softshrink, nn.Threshold,
                       nn.Identity)
# Calls that draw random numbers: run twice they are not the same as run once. (Tensor methods that draw
# change their tensor in place: ``uniform_``, ``bernoulli_``.)
DRAWS = frozenset({
    F.dropout, nn.Dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    F.rrelu, F.gumbel_softmax, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
    nn.RReLU, torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson,
})
# Draws of one number per element of their input (dropout): a batch's tensor draws every instance's at once
ELEMENT_DRAWS = frozenset({F.dropout, F.alpha_dropout})
ELEMENT_DRAW_MODULES = (nn.Dropout, nn.AlphaDropout)
DRAWING_METHODS = frozenset({"bernoulli", "multinomial", "sample", "rsample"})  # (a distribution's draws too)
# Tensor methods that draw into their tensor in place (each instance's draws are its own, in its own order)
DRAWING_IN_PLACE = frozenset({"bernoulli_", "normal_", "uniform_", "random_", "exponential_", "geometric_",
                              "cauchy_", "log_normal_"})
# Calls finite at every finite input, with finite gradients there (and the Tensor methods of such ops, by name):
# ``runtime.padded`` runs them on what lies past each instance's end too, which then stays finite, so that a
# zero cotangent there adds nothing to a gradient (``log`` or a division by such values would not).
FINITE_EVERYWHERE = frozenset({
    torch.relu, F.relu, torch.tanh, F.tanh, torch.sigmoid, F.sigmoid, F.gelu, F.silu, F.elu, F.selu, F.celu,
    F.leaky_relu, F.hardtanh, F.relu6, F.softplus, F.mish, F.logsigmoid, F.softsign, F.hardsigmoid, F.hardswish,
    torch.neg, torch.abs, torch.clamp, torch.sin, torch.cos, torch.add, torch.sub, torch.mul, operator.add,
    operator.sub, operator.mul, operator.neg, operator.truediv, torch.div,
    # (comparisons and logic: a bool at every input, no gradient)
    operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne, torch.lt, torch.le, torch.gt,
    torch.ge, torch.eq, torch.ne, operator.and_, operator.or_, operator.invert, torch.logical_not,
    torch.logical_and, torch.logical_or})
FINITE_METHODS = frozenset({"relu", "tanh", "sigmoid", "neg", "abs", "clamp", "clamp_min", "clamp_max", "clip",
                            "sin", "cos", "add", "sub", "mul", "div", "float", "double", "clone", "__add__",
                            "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                            "lt", "le", "gt", "ge", "eq", "ne", "logical_not", "logical_and", "logical_or"})
# Tensor methods (and torch functions of the same name) whose result is a view of the tensor, sharing its
# version, or may be (``reshape``, ``flatten``, ``contiguous`` copy where they must)
VIEW_METHODS = frozenset({"view", "view_as", "t", "transpose", "swapaxes", "permute", "narrow", "select", "squeeze",
                          "unsqueeze", "expand", "expand_as", "movedim", "moveaxis", "diagonal", "unfold",
                          "as_strided", "T", "mT", "H", "mH", "real", "imag", "reshape", "reshape_as", "flatten",
                          "unflatten", "ravel", "contiguous"})
# Tensor methods of no argument that keep the shape: a batch's tensor runs them whole.
UNARY_METHODS = ("sigmoid", "tanh", "relu", "exp", "log", "sqrt", "abs", "neg", "clone", "detach", "float",
                 "double", "long", "contiguous")
# Tensor methods taking a dim: name -> (the position of ``dim`` among their arguments, whether no dim
# means every dim); a batch's tensor runs them with the dim moved past the instance dim.
DIM_METHODS = {"sum": (0, True), "mean": (0, True), "softmax": (0, False), "log_softmax": (0, False),
               "unsqueeze": (0, False), "squeeze": (0, False), "chunk": (1, False), "split": (1, False),
               "unbind": (0, False), "max": (0, False), "argmax": (0, False),
               "index_select": (0, False)}
# Arithmetic that leaves a lazy (deferred) argument lazy: its result is computed when read
# (``runtime.batch_rules.LazyOp``); with tuple building, what ``passes.batching`` lets a deferred result flow
# through.
LAZY = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.neg})
LAZY_FLOW = LAZY | {intrinsics.build_tuple, intrinsics.build_dict}

# -- values

NUMBERS = (int, float, bool)  # Python's numbers, by exact type
# Values no call can change: every instance may share one (a tuple too, when its items are: ``immutable``).
IMMUTABLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice, range,
             frozenset, type(Ellipsis),
             intrinsics.ReversedSequence)  # (a view of a sequence, changed by nothing: as shared as the sequence is)
# dtypes of integer indices (not uint8: torch reads a uint8 index as a mask)
INTEGER_INDEX = (torch.long, torch.int, torch.int16, torch.int8)


def immutable(value):
    """Whether no call can change ``value``: an IMMUTABLE value, or a tuple of them (``(..., slice(0, 4))``)."""
    kind = type(value)
    if kind is tuple:
        return all(immutable(v) for v in value)
    return kind in IMMUTABLE


def among(fn, fact):
    """``fn in fact``, False for an unhashable callable."""
    try:
        return fn in fact
    except TypeError:
        return False


# Python's containers whose items a builtin reads as data (``plain_data``, a read of what one holds)
PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)


def value_call(fn, args, kwargs):
    """Whether ``fn(*args, **kwargs)`` computes its result from the arguments' values alone and changes nothing:
    a ``VALUE_BUILTINS`` builtin, a method of an immutable value, a ``READING_METHODS`` method of a list, tuple,
    dict or set, given plain data (``plain_data``: no iterator it would consume, no ``key=`` callable or object of
    the program's own whose methods it would call)."""
    if not among(fn, VALUE_BUILTINS):
        owner = getattr(fn, "__self__", None) if type(fn) is BOUND_BUILTIN else None
        if owner is None or not (immutable(owner) or type(owner) in PLAIN_CONTAINERS
                                 and fn.__name__ in READING_METHODS):
            return False
    return all(plain_data(a) for a in args) and (not kwargs or all(plain_data(v) for v in kwargs.values()))


def plain_data(value, depth=2, items=64):
    """Whether ``value`` is data a builtin reads without running the program's code: an immutable value, a tensor,
    or a list, tuple, dict or set of such values (nested ``depth`` deep, at most ``items`` of each)."""
    if immutable(value) or isinstance(value, torch.Tensor):
        return True
    kind = type(value)
    if depth == 0 or kind not in PLAIN_CONTAINERS or len(value) > items:
        return False
    parts = (*value.keys(), *value.values()) if kind is dict else value
    return all(plain_data(v, depth - 1, items) for v in parts)
