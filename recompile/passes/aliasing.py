"""Which branches and loops hand on values that a later change in place may reach (an analysis).

Where a program may change a value in place, a batched ``if`` or ``while`` works on copies of its instances'
rows, and a value a side hands on from those copies is given back as views of the argument's own rows
(``runtime.aliases``): in eager code it *is* the argument, so a later ``w += 1`` must reach ``v``, and a later
``v += 1`` must show in ``w``. Those views are each instance's own tensors, which later ops read stacked; where
no change in place can reach the handed-on value or the argument afterwards, the copy holds the same values and
serves as well.

``reached`` groups the function's values by what may share memory (a union of the values an op may hand
on or view: an item of its list, a view, an attribute; not arithmetic, whose results are new), marks the groups
a change in place may reach (its target; what a call of unknown code or of a compiled function that may change
state is given; globals, where such a call is made; what the function returns, which its caller may change) and
answers, per Cond and While, whether one of its operands or outputs is in such a group.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .. import intrinsics, ir
from ..ops import facts, syntax
from . import effects

# Operators whose result holds nothing of its operands (a new tensor, number or bool; never a container of
# them): ``a - b`` of tensors, comparisons, ``@``
_NEW_ALWAYS = frozenset({operator.truediv, operator.floordiv, operator.mod, operator.pow, operator.matmul,
                         operator.neg, operator.invert, operator.not_, operator.truth, operator.lt, operator.le,
                         operator.gt, operator.ge, operator.eq, operator.ne, operator.is_, operator.is_not,
                         operator.contains, intrinsics.not_in, operator.lshift, operator.rshift,
                         intrinsics.itruediv_fresh, len, isinstance, int, float, bool, abs, range, slice, str,
                         intrinsics.format_value, intrinsics.join_str, operator.index})
# ... and those whose result is new where an operand is a tensor (of lists, sets, dicts it may hold their items:
# ``xs + [v]``, ``[v] * 2``, ``{v} | s``), or where the value changed is one (``xs += [v]`` is ``xs``)
_NEW_OF_A_TENSOR = frozenset({operator.add, operator.sub, operator.mul, operator.and_, operator.or_, operator.xor})
_NEW_OF_A_CHANGED_TENSOR = frozenset(intrinsics.AUGMENTED_FRESH.values()) | frozenset(
    intrinsics.OUT_OF_PLACE) | frozenset(intrinsics.SETS_FRESH) | {intrinsics.setitem_fresh}
# torch functions whose result is a new tensor (or a tuple of new ones), never a view of or the very input
# (not ``F.dropout``: the input itself where it does not train; not ``einsum``, ``reshape``: views where they can)
_NEW_TENSORS = frozenset(f for f in facts.FUSIBLE | facts.ELEMENTWISE | facts.CONSTRUCTORS
                         if getattr(f, "__module__", None) not in ("operator", "_operator")) - facts.DRAWS | frozenset({
    torch.cat, torch.stack, torch.sum, torch.mean, torch.prod, torch.logsumexp, torch.softmax, torch.log_softmax,
    F.softmax, F.log_softmax, torch.matmul, torch.mm, torch.bmm, torch.mv, torch.dot, torch.addmm, F.linear,
    F.cross_entropy, F.nll_loss, F.mse_loss, F.binary_cross_entropy_with_logits, torch.max, torch.min,
    torch.amax, torch.amin, torch.argmax, torch.argmin, torch.norm, torch.cumsum, torch.clone, torch.outer,
    torch.gather, torch.index_select, torch.masked_select, torch.sort, torch.topk})
_TUPLES = frozenset({torch.max, torch.min, torch.sort, torch.topk, torch.where})  # (a tuple, given a dim or alone)
# Tensor methods whose result is a new tensor where the receiver is one
_NEW_METHODS = frozenset({"sum", "mean", "prod", "max", "min", "amax", "amin", "argmax", "argmin", "norm", "exp",
                          "log", "tanh", "sigmoid", "relu", "sqrt", "abs", "neg", "clone", "softmax",
                          "log_softmax", "logsumexp", "matmul", "mm", "bmm", "mv", "dot", "new_zeros", "new_ones",
                          "new_empty", "new_full", "new_tensor", "cumsum", "gather", "index_select", "masked_fill",
                          "clamp", "pow", "add", "sub", "mul", "div", "item", "tolist", "size", "dim", "numel",
                          "eq", "ne", "lt", "le", "gt", "ge", "any", "all", "sort", "topk", "std", "var"})
_TENSOR_METHODS = _NEW_METHODS - {"max", "min", "sort", "topk", "item", "tolist", "size", "dim", "numel"}
# nn modules that hand on their input itself (where they do not train: dropout) or run others (a Sequential of them)
_HANDING_ON_MODULES = facts.HANDING_ON_MODULES + (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Flatten,
                                                  nn.Unflatten)


class _Groups:
    """Union-find over values (by object), with the marks of the groups a change in place may reach."""

    def __init__(self):
        self.parent = {}
        self.marked = set()
        self.stored = []  # containers something was put into (``xs.append(v)``): see ``reached``

    def find(self, v):
        parent = self.parent
        root = v
        while parent.get(id(root), root) is not root:
            root = parent[id(root)]
        while v is not root:  # (path halving keeps the chains short)
            nxt = parent.get(id(v), v)
            parent[id(v)] = root
            v = nxt
        return root

    def union(self, *values):
        values = [v for v in values if v is not None and not isinstance(v, ir.Const)]
        if len(values) < 2:
            return
        roots = [self.find(v) for v in values]
        first = roots[0]
        for r in roots[1:]:
            if r is not first:
                self.parent[id(r)] = first
                if id(r) in self.marked:
                    self.marked.add(id(first))

    def mark(self, *values):
        for v in values:
            if v is not None and not isinstance(v, ir.Const):
                self.marked.add(id(self.find(v)))

    def is_marked(self, v):
        return not isinstance(v, ir.Const) and id(self.find(v)) in self.marked


def _ops(sg):
    """(op, resolve) for each op of function SubGraph ``sg`` and of what it holds, the ops of a fused group's body
    too (after the group), ``resolve`` reading a body's callables where the group holds them."""
    for s in sg.walk():
        for op in s.ops:
            yield op, effects.resolve
            if isinstance(op, ir.Fused):
                body, callables = op.body, op.callables
                at = {id(v): k for k, v in enumerate(body.inputs)}

                def resolve(x, at=at, callables=callables):
                    k = at.get(id(x))
                    return callables.get(k) if k is not None else effects.resolve(x)
                for inner in body.ops:
                    yield inner, resolve


def _joins(sg):
    """(value, the values it is one of) for what a Cond joins, a While carries and a fused group hands in and out."""
    for op, _ in _ops(sg):
        if isinstance(op, ir.Cond):
            for j, a in enumerate(op.args):
                yield (op.then_sg.inputs[j], [a])
                yield (op.else_sg.inputs[j], [a])
            for j, out in enumerate(op.outputs):
                yield (out, [b.outputs[j] for b in op.subgraphs()])
        elif isinstance(op, ir.While):
            k = len(op.loop_vars)
            for j, v in enumerate(op.loop_vars):
                sources = [v, op.body_sg.outputs[j]]
                for x in (op.body_sg.inputs[j], op.cond_sg.inputs[j], op.outputs[j]):
                    yield (x, sources)
            for i, v in enumerate(op.invariants):
                yield (op.body_sg.inputs[k + i], [v])
                yield (op.cond_sg.inputs[k + i], [v])
        elif isinstance(op, ir.Fused):
            for a, x in zip(op.args, op.body.inputs):
                yield (x, [a])
            for out, x in zip(op.outputs, op.body.outputs):
                yield (out, [x])


def _method(op):
    """(receiver, name) of a Call of ``obj.name`` (its callable a ``getattr`` of a constant name), else None."""
    return effects.attribute_read(op.fn)


def known_tensors(sg):
    """The ids of the values of function SubGraph ``sg`` known to be tensors: made by torch's constructors and
    functions of new tensors, by arithmetic with a tensor, indexing one, its views and methods, changed in place,
    and joined or carried from tensors alone (a loop's ``out = torch.zeros(...)``)."""
    joins = list(_joins(sg))
    assumed = {id(v) for v, _ in joins}  # (an optimistic fixpoint: a join is a tensor until a source is not)
    while True:
        known = set(assumed)
        for op, resolve in _ops(sg):
            if isinstance(op, ir.Call) and _makes_a_tensor(op, known, resolve):
                known.update(id(v) for v in op.outputs)
        still = {id(v) for v, sources in joins if id(v) in assumed
                 and all(isinstance(x, ir.Value) and id(x) in known for x in sources)}
        if still == assumed:
            return known
        assumed = still


def _new_of_tensors(fn, args, known):
    """Whether ``fn(*args)``, an operator, makes a new tensor (or number) of its operands: ``x += y`` of a tensor
    x; ``x * y`` where neither may be a list or tuple (``[w] * k`` of an integer tensor k holds w), or of a float;
    ``x + y``, ``x - y``, ``x & y`` of a tensor (a list with a tensor is an error there)."""
    def tensor(v):
        return isinstance(v, ir.Value) and id(v) in known

    if facts.among(fn, syntax.AUGMENTED) or facts.among(fn, _NEW_OF_A_CHANGED_TENSOR):
        return bool(args) and tensor(args[0])
    if fn is operator.mul:
        if any(isinstance(a, ir.Const) and type(a.value) in (float, complex) for a in args):
            return True  # (no list or tuple takes a float: ``x * 2.0`` is new, or an error)
        return any(tensor(a) for a in args) and all(
            tensor(a) or isinstance(a, ir.Const) and type(a.value) in (int, float, bool, complex) for a in args)
    return any(tensor(a) for a in args)


def _makes_a_tensor(op, known, resolve):
    def tensor(v):
        return isinstance(v, ir.Value) and id(v) in known

    fn = resolve(op.fn)
    if fn is not None:
        if fn is operator.getitem:
            return bool(op.args) and tensor(op.args[0])
        if facts.among(fn, syntax.AUGMENTED) or facts.among(fn, _NEW_OF_A_CHANGED_TENSOR) or fn is operator.mul:
            return _new_of_tensors(fn, op.args, known)
        if getattr(fn, "__module__", None) in ("operator", "_operator"):
            return any(tensor(a) for a in op.args)  # (``x < 0`` of a tensor; of numbers, a bool)
        return facts.among(fn, _NEW_TENSORS) and not facts.among(fn, _TUPLES)
    method = _method(op)
    if method is None or not tensor(method[0]):
        return False
    name = method[1]
    return name in _TENSOR_METHODS or name in facts.VIEW_METHODS or name.endswith("_") and not name.endswith("__")


class Reached:
    """Of one function's Cond and While ops (nested ones too): ``outputs``, those whose outputs (and what they may
    hand on) a later change in place may reach; ``operands``, those whose operands one may reach (what the
    function was given too: its caller may change it after the call, where an op saved a side's copy); and whether
    what the function returns may hold (views of) what it was given (``hands_on_inputs``)."""

    def __init__(self, outputs, operands, hands_on_inputs):
        self.outputs, self.operands, self.hands_on_inputs = outputs, operands, hands_on_inputs


def reached(sg, may_mutate):
    """The Reached of function SubGraph ``sg``; ``may_mutate(invoke)``: whether an Invoke's program may change
    state."""
    groups = _Groups()
    tensors = known_tensors(sg)
    for value, sources in _joins(sg):
        groups.union(value, *sources)
    world_reached = False
    for op, resolve in _ops(sg):
        if isinstance(op, (ir.Cond, ir.While, ir.Fused)):
            continue  # (joined above; a fused group's ops are its body's)
        if isinstance(op, ir.Capture):
            groups.union(op.outputs[0], op.base if op.base is not None else _WORLD_VALUE)
        elif isinstance(op, ir.Invoke):
            groups.union(*op.outputs, *_operands(op))
            if may_mutate(op):
                groups.mark(*_operands(op))
                world_reached = True
        elif isinstance(op, ir.Call):
            world_reached |= _call(op, groups, tensors, resolve)
        else:
            groups.union(*op.outputs, *_operands(op))
    if world_reached:
        groups.mark(_WORLD_VALUE)
    groups.mark(*(v for v in sg.outputs if isinstance(v, ir.Value)))  # (the caller may change what it gets)
    # (what is put into a container the caller holds, or a global one, the caller may change later)
    outside = {id(groups.find(v)) for v in (*sg.inputs, _WORLD_VALUE)}
    groups.mark(*(c for c in groups.stored if id(groups.find(c)) in outside))
    ops = [op for op, _ in _ops(sg) if isinstance(op, (ir.Cond, ir.While))]
    # (an output is grouped with the operands a side may hand on; an operand no side hands on is only written
    # back, and the copies of its rows a side read follow a later change of it (``control``) only where one may
    # reach it)
    given = {id(groups.find(v)) for v in sg.inputs}

    def read_reached(v):  # (the caller may change what it gave after the call: a copy read may have been saved)
        return groups.is_marked(v) or id(groups.find(v)) in given

    return Reached({op for op in ops if any(groups.is_marked(v) for v in op.outputs)},
                   {op for op in ops if any(read_reached(v) for v in _operands(op))},
                   any(isinstance(v, ir.Value) and id(groups.find(v)) in given for v in sg.outputs))


_WORLD_VALUE = ir.Value("world")  # (the group of what globals and closure cells hold)


def _operands(op):
    return [x for x in op.operands() if isinstance(x, ir.Value)]


def _call(op, groups, tensors, resolve):
    """Group and mark what Call ``op`` may hand on and change; True where it runs code that may reach globals."""
    outs = op.outputs
    fn = resolve(op.fn)
    method = _method(op)
    # (what the call is given: its callable too where that is not known, a bound method of a value)
    given = [x for x in (*op.args, *(v for _, v in op.kwargs)) if isinstance(x, ir.Value)]
    if fn is None:
        given.append(op.fn)

    def is_tensor(v):
        return isinstance(v, ir.Value) and id(v) in tensors

    if effects.op_mutates(op):
        return _change(op, fn, method, given, groups, is_tensor)
    if fn is not None:
        if facts.among(fn, _NEW_ALWAYS) or facts.among(fn, _NEW_TENSORS):
            return False
        if facts.among(fn, _NEW_OF_A_TENSOR) or facts.among(fn, _NEW_OF_A_CHANGED_TENSOR):
            if not _new_of_tensors(fn, op.args, tensors):
                groups.union(*outs, *given)
            return False
        if isinstance(fn, nn.Module) and type(fn).__module__.startswith("torch.nn") \
                and not isinstance(fn, _HANDING_ON_MODULES) and not getattr(fn, "inplace", False):
            return False
        if facts.among(fn, facts.PURE) or _is_torch_function(fn):
            groups.union(*outs, *given)  # (``getitem``, ``build_list``, ``max``: may hand on an operand)
            return False
    elif method is not None:
        # (a method that changes nothing by its name, as ``effects`` reads it: it may hand on its receiver)
        if not (is_tensor(method[0]) and method[1] in _NEW_METHODS):
            groups.union(*outs, *given)
        return False
    elif isinstance(op.fn, ir.Value) and isinstance(op.fn.op, ir.Capture) and op.fn.op.source_kind == "attr":
        # (``self.cell(v, h)``: a module or a method of the object, taken to change nothing it is given, as
        # ``effects`` takes it; it may hand on what it is given, not itself)
        groups.union(*outs, *(x for x in given if x is not op.fn))
        return False
    # (code the program does not see: it may hand on, keep or change what it is given, and reach globals)
    groups.union(*outs, *given)
    groups.mark(*given)
    return True


def _change(op, fn, method, given, groups, is_tensor):
    """``_call`` of an op that changes something in place: its target is marked, and joins what it holds."""
    outs = op.outputs
    target = effects.out_target(op)
    if target is not None:  # (``out=t``: t is written, the result is t)
        groups.union(*outs, target)
        groups.mark(target)
        return False
    if fn is operator.setitem and len(op.args) == 3:
        groups.mark(op.args[0])
        if not is_tensor(op.args[0]):  # (a list or dict then holds the value: ``xs[i] = v``)
            groups.union(op.args[0], op.args[2])
        return False
    if facts.among(fn, syntax.AUGMENTED) and len(op.args) == 2:
        groups.union(*outs, op.args[0])
        groups.mark(op.args[0])
        if not is_tensor(op.args[0]):  # (``xs += [v]``: the list then holds v)
            groups.union(op.args[0], op.args[1])
        return False
    if fn is None and method is not None:  # (a method of a value: ``t.add_(v)``, ``xs.append(v)``)
        receiver, name = method
        groups.union(*outs, receiver)
        if name.endswith("_") and not name.endswith("__"):
            groups.mark(receiver)  # (a tensor's in-place method: it copies v's values)
        else:
            groups.union(receiver, *given)  # (the list, dict or set then holds v: nothing of a tensor changed)
            groups.stored.append(receiver)
        return False
    if effects.in_place_flag(op) and op.args:  # (``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)(x)``)
        groups.union(*outs, op.args[0])
        groups.mark(op.args[0])
        return False
    # (``torch.relu_(w)``, ``nn.init.zeros_(w)``, setattr, a global's write, ...: whatever it is given may change)
    groups.union(*outs, *given)
    groups.mark(*given)
    return not _is_torch_function(fn)


def _is_torch_function(fn):
    module = getattr(fn, "__module__", None) or ""
    return (module == "torch" or module.startswith("torch.")) and callable(fn) and not isinstance(fn, type)
