"""What the generated forward-with-saves and gradient code call (see ``passes.grad``).

A ``GradContext`` lives for one compiled call that needs gradients:

- ``sources``: the tensors from outside the program that require grad
  (arguments, parameters, captured tensors), noted by the forward as it
  meets them; they become the inputs of the call's autograd node;
- ``cotangents``: during the gradient, the cotangent of each tensor the
  program made, by identity. A rule pops the cotangent of its result and adds
  to those of its inputs; a source's cotangent goes to ``grads``.

The forward runs under ``torch.no_grad()``, so a tensor that requires grad is
always one from outside; that is how sources are recognised.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
import types

import torch
from torch import nn

from .. import intrinsics
from ..diagnostics import user_line, warn_once
from ..errors import GradFallbackWarning
from ..ops import facts, syntax
from ..ops.table import BOUND_BUILTIN
from .factors import DEFERRED, form
from .rules import ALONG_A_DIM, ITEM_READS, Rule, lookup, seen, written_cotangent

_Tensor = torch.Tensor


def external(t):
    """Whether tensor ``t`` comes from outside the program: it requires grad. (Not a view the no-grad
    forward took of such a tensor: that one reports requires_grad too, and is the program's own.)"""
    return t.requires_grad and (t.grad_fn is not None or not t._is_view() or not t._base.requires_grad)


class _Carried(threading.local):
    """Per thread, while one op's gradient runs: the refusal its popped cotangents carry (``GradContext.refuse``),
    which every cotangent it adds carries on: (error, the id of the one argument it spares, or None)."""

    def __init__(self):
        self.refusal = None


_carried = _Carried()


class GradContext:
    __slots__ = ("sources", "grads", "cotangents", "refusals", "fallbacks", "modules", "lock", "__weakref__")

    def __init__(self):
        self.sources = {}  # id -> tensor
        self.grads = {}  # id -> accumulated gradient of a source
        self.cotangents = {}  # id -> (tensor, cotangent); the tensor keeps its id from being reused
        self.refusals = {}  # id -> (the error a cotangent carries towards the sources, spared id): ``refuse``
        self.fallbacks = {}  # callable name -> calls recorded for torch.autograd
        self.modules = {}  # id -> a module whose parameters are noted, and (submodule, name, parameter) of each
        self.lock = threading.Lock()

    # -- forward


    def note_module(self, module):
        self.modules[id(module)] = (module, [(m, name, p) for m in module.modules()
                                             for name, p in m._parameters.items() if p is not None])
        for p in module.parameters():
            if p.requires_grad:
                self.sources.setdefault(id(p), p)

    def note_tree(self, value):
        """Note the tensors in (nested) tuples, lists and dicts: the arguments of a call."""
        for t in tensors_in(value):
            note(self, t)

    # -- gradient

    def add(self, obj, g):
        """Add cotangent ``g`` to ``obj``: a tensor, or a tuple/list of them with a matching ``g``."""
        if g is None:
            return
        if type(g) in DEFERRED and not (isinstance(obj, _Tensor) and external(obj)):
            g = g.tensor()  # only a source's gradient waits to be formed
        if isinstance(obj, _Tensor):
            carried = _carried.refusal
            refusal = None if carried is None or carried[1] == id(obj) else carried[0]
            if obj.requires_grad and external(obj):
                if refusal is not None:
                    raise refusal
                self._add_source(obj, g)
            elif obj.is_floating_point() or obj.is_complex():
                key = id(obj)
                with self.lock:
                    entry = self.cotangents.get(key)
                    self.cotangents[key] = (obj, g if entry is None else entry[1] + g)
                    if refusal is not None:
                        self.refusals[key] = (refusal, None)
        elif isinstance(obj, (tuple, list)) and isinstance(g, (tuple, list)):
            for o, go in zip(obj, g):
                self.add(o, go)

    def _add_source(self, tensor, g):
        # kept as parts and summed once at the end: factors of a weight's gradient become one matmul
        key = id(tensor)
        if key not in self.sources:
            raise RuntimeError(
                "recompile: a tensor that requires grad reached the gradient without being seen by the forward "
                f"(shape {tuple(tensor.shape)}); please report this with the compiled function")
        if type(g) not in DEFERRED and g.shape != tensor.shape:
            g = g.sum_to_size(tensor.shape)
        with self.lock:
            parts = self.grads.get(key)
            if parts is None:
                self.grads[key] = [g]
            else:
                parts.append(g)

    def source_grads(self):
        """The gradient of each source (None where it got none), in the order of ``sources``."""
        out = []
        for key, tensor in self.sources.items():
            parts = self.grads.get(key)
            if parts is None:
                out.append(None)
                continue
            g = form(parts)
            if g.shape != tensor.shape:
                g = g.sum_to_size(tensor.shape)
            out.append(g.to(tensor.dtype) if g.dtype != tensor.dtype else g)
        return out

    def pop(self, out):
        """The cotangent of a result (None if it got none), removing it."""
        if isinstance(out, _Tensor):
            with self.lock:
                entry = self.cotangents.pop(id(out), None)
                if self.refusals and id(out) in self.refusals:
                    _carried.refusal = self.refusals.pop(id(out))
            return None if entry is None else entry[1]
        if isinstance(out, (tuple, list)):
            gs = tuple(self.pop(o) for o in out)
            return gs if any(g is not None for g in gs) else None
        return None

    def reaches(self, out):
        """Whether a cotangent waits for result ``out`` (a tensor, or a tuple or list of them)."""
        if isinstance(out, _Tensor):
            return id(out) in self.cotangents
        if isinstance(out, (tuple, list)):
            return any(self.reaches(o) for o in out)
        return True  # (not known here: check)

    def refuse(self, out, refusal, spare=None):
        """Let the cotangent of ``out`` (a tensor, or a tuple or list of them) carry ``refusal`` through every
        gradient it reaches, raised where it would reach a source: as torch raises for a node it recorded, which
        it did only where an input requires grad (``TIE.min()`` needs none: its cotangent reaches nothing).
        ``spare``: the op's one argument whose own gradient does not read the changed value (``v * c`` with v
        changed: torch saves v only where c requires grad), whose cotangent from this op carries nothing."""
        if isinstance(out, _Tensor):
            with self.lock:
                found = self.refusals.get(id(out))
                if found is None or (found[1] is not None and found[1] != id(spare)):
                    # (a refusal from later ops reaches every argument: it stays, whatever this one spares)
                    self.refusals[id(out)] = (refusal if found is None else found[0],
                                              None if found is not None or spare is None else id(spare))
        elif isinstance(out, (tuple, list)):
            for o in out:
                self.refuse(o, refusal, spare)

    def peek(self, tensor):
        entry = self.cotangents.get(id(tensor))
        return None if entry is None else entry[1]


def plain_object(value):
    """An object of the user's whose attributes may hold tensors (``Pair(h, c)``): not a module or class."""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type, types.FunctionType,
                                                                   types.ModuleType, types.MethodType))
            and not isinstance(value, _Tensor))


def tensors_in(value, depth=0):
    """The tensors in ``value``: itself, or inside its tuples, lists, dicts and plain objects' attributes."""
    if isinstance(value, _Tensor):
        yield value
    elif depth < 8 and isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v, depth + 1)
    elif depth < 8 and isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v, depth + 1)
    elif depth < 8 and plain_object(value):
        for v in vars(value).values():
            yield from tensors_in(v, depth + 1)


# ----------------------------------------------------------------------------
# forward

# (The forward's bookkeeping, ``note``, ``note_all``, ``version`` and ``check_unchanged``, changes nothing the
# program reads: declared pure, it moves like a pure op between the calls of a group, ``codegen.plan``, and
# a node's two children are still issued together.)


@facts.pure
def note(ctx, value):
    """Make ``value`` a source of the call if it is a tensor from outside that requires grad."""
    if isinstance(value, _Tensor) and external(value):
        ctx.sources.setdefault(id(value), value)
    return value


@facts.pure
def note_all(ctx, *values):
    for v in values:
        note(ctx, v)
    return values


_BINARY_OF = {row.in_place: row.fn for row in syntax.BINARY}  # ``a += b`` -> ``a + b``

# (the facts every forward call tests, as names of this module: one global lookup each)
_NO_GRADIENT, _NO_GRADIENT_METHODS, _CONTAINERS = facts.NO_GRADIENT, facts.NO_GRADIENT_METHODS, facts.CONTAINERS
_AUGMENTED_METHODS, _ITERATING = facts.AUGMENTED_METHODS, facts.ITERATING


def _differentiable(x):
    return isinstance(x, _Tensor) and (x.is_floating_point() or x.is_complex())


def _takes_differentiable(args, kwargs):
    """Whether a floating tensor is among the arguments (or directly in a list / tuple argument)."""
    for a in (*args, *kwargs.values()):
        if _differentiable(a) or (type(a) in (list, tuple) and any(_differentiable(v) for v in a)):
            return True
    return False


def _no_gradient(fn, args, kwargs):
    """Whether ``fn(*args, **kwargs)`` runs as it is, with no gradient to derive."""
    try:
        if fn in _NO_GRADIENT:
            return True
    except TypeError:
        return False
    if type(fn) is BOUND_BUILTIN:
        owner = fn.__self__
        if isinstance(owner, _Tensor):
            return fn.__name__ in _NO_GRADIENT_METHODS
        if isinstance(owner, _CONTAINERS):  # list.append, dict.get: they move objects, compute nothing
            return True
    if _takes_differentiable(args, kwargs):
        return False
    # a torch function given no floating tensor (torch.zeros, arange) makes no gradient; a Python function
    # might still read parameters, and a class might compute from them: those are recorded
    return type(fn) is BOUND_BUILTIN and (getattr(fn, "__module__", None) or "").startswith("torch")


class _Stacks(threading.local):
    """Per thread: ``sinks``, per call_forward running the map elements read during it (None until one is);
    ``recording``, the callables of the calls torch.autograd is recording (``Recorded.forward``), outermost
    first (a map read by a builtin among them, ``list(m)``, ``next(m)``, records its elements itself; inside a
    Python function it would cut them from what they read)."""

    def __init__(self):
        self.sinks, self.recording = [], []


_stacks = _Stacks()


def call_forward(ctx, fn, *args, **kwargs):
    """Run ``fn`` for the forward: ``(result, how to differentiate it)``. The elements of a map read during the
    call (``list(m)``, ``next(m)``) get their gradients with the call's, where the call stands: after the
    gradients of every op after it, so a change in place of what they read, or a list they read growing, comes
    first, as in the forward."""
    stack = _stacks.sinks
    stack.append(None)  # (made a list when a map's element is read during the call)
    try:
        if (fn is sum or fn is max or fn is min or fn is sorted) and any(type(a) is RecordingMap for a in args):
            # (sum(m) adds the elements where nothing records it: it is given them as a list, which it reads)
            args = tuple(list(a) if type(a) is RecordingMap else a for a in args)
        out, how = _call_forward(ctx, fn, *args, **kwargs)
    finally:
        sink = stack.pop()
    return out, (WithElements(how, sink) if sink else how)


class WithElements:
    """A call's way to its gradient (``how``, or None) and the map elements it read (``Recorded`` calls), run
    after it, the last read first. (A map's own call has no ``how``: it holds the elements no call read.)"""

    __slots__ = ("how", "elements")

    def __init__(self, how, elements):
        self.how, self.elements = how, elements

    def backward(self, ctx):
        if self.how is not None:
            self.how.backward(ctx)
        for element in reversed(self.elements):
            element.backward(ctx)


def _call_forward(ctx, fn, *args, **kwargs):
    if fn is intrinsics.requires_grad_fresh:  # (a tensor the frame made, now a leaf that needs a gradient: a source)
        return note(ctx, fn(*args, **kwargs)), None
    if kwargs and kwargs.get("out") is not None and _takes_differentiable(args, kwargs):
        # (torch refuses it too where an argument requires grad, and the derived program cannot tell)
        raise NotImplementedError(
            f"recompile cannot differentiate {_name(fn)}(..., out=...) on floating tensors (PyTorch derives no "
            f"gradient through out= either); write y = {_name(fn)}(...) instead, or run the call under "
            "torch.no_grad()")
    if type(fn) is BOUND_BUILTIN and len(args) == 1 and not kwargs and isinstance(fn.__self__, _Tensor):
        op = _AUGMENTED_METHODS.get(fn.__name__)
        if op is not None:  # x.div_(y) is x /= y: the old x is kept where the gradient needs it
            return in_place(ctx, op, fn.__self__, args[0])
    rule = lookup(fn)
    if rule is not None:
        if isinstance(fn, nn.Module):
            if id(fn) not in ctx.modules:
                ctx.note_module(fn)
            if getattr(fn, "inplace", False) is True and args and isinstance(args[0], _Tensor):
                _check_in_place(args[0], f"{type(fn).__name__}(inplace=True)")
        elif kwargs.get("inplace") is True and args:
            _check_in_place(args[0], f"{rule.name}(inplace=True)")
        elif type(fn) is BOUND_BUILTIN and fn.__name__.endswith("_"):
            target = fn.__self__ if isinstance(fn.__self__, _Tensor) else args[0] if args else None
            if isinstance(target, _Tensor):
                _check_in_place(target, fn.__name__)
        out = fn(*args, **kwargs)
        return out, Applied(rule, seen(fn, rule) if isinstance(fn, nn.Module) else fn, out, args, kwargs)
    try:
        iterating = fn in _ITERATING
    except TypeError:
        iterating = False
    if iterating and _takes_differentiable(args, kwargs):
        return TakenRows.forward(fn, args, kwargs)
    if _no_gradient(fn, args, kwargs):
        out = fn(*args, **kwargs)
        note(ctx, out)
        return out, None
    if type(fn) is BOUND_BUILTIN and isinstance(fn.__self__, _Tensor) and fn.__name__.endswith("_"):
        return _in_place(ctx, fn, args, kwargs)
    if kwargs.get("inplace") is True:
        raise NotImplementedError(
            f"recompile cannot differentiate {_name(fn)}(..., inplace=True) (no gradient rule); "
            "drop inplace=True, or run the call under torch.no_grad()")
    if fn is map and len(args) >= 2 and not kwargs:
        if any(isinstance(it, _Tensor) for it in args[1:]):
            # (a tensor's rows: taken where torch.autograd records them, all at once, as the rows are known)
            out, how = Recorded.forward(ctx, _mapped, args, kwargs)
            return iter(out), how
        # (a map computes its elements when they are read, after its own call: each is recorded then)
        record = WithElements(None, [])
        return RecordingMap(ctx, record, *args), record
    return Recorded.forward(ctx, fn, args, kwargs)


def _mapped(fn, *iterables):
    return list(map(fn, *iterables))


_mapped.__name__ = _mapped.__qualname__ = "map"  # (as the warning that it has no rule names it)


def _items(*items):
    return items


class RecordingMap(map):
    """``map(fn, *iterables)`` in a derived forward: lazy as a map is, each element computed when it is read,
    as a call recorded by torch.autograd (``Recorded``), so that its gradient reaches what ``fn`` read."""

    def __new__(cls, ctx, record, fn, *iterables):
        self = super().__new__(cls, _items, *iterables)
        self.ctx, self.record, self.fn = ctx, record, fn
        # (a list it reads may grow after the map was made: an element made later would get its cotangent after
        # its own gradient ran, where the map's call stands)
        self.known = [{id(v) for v in it} if type(it) is list else None for it in iterables]
        return self

    def __next__(self):
        if any(not isinstance(f, (types.BuiltinFunctionType, type)) for f in _stacks.recording):
            raise NotImplementedError(
                "recompile cannot differentiate a map read inside a call torch.autograd records (a function it "
                "does not compile, given the map): its elements would be cut from what they read; pass it "
                "list(map(...)) instead")
        items = super().__next__()
        if any(isinstance(v, _Tensor) and external(v) and id(v) not in self.ctx.sources for v in items):
            raise NotImplementedError(
                "recompile cannot differentiate a map over what a call torch.autograd records gave (an iterator "
                "made by a function it has no rule for, itertools.repeat(x)): its elements hold copies the "
                "gradient cannot reach; map over a list or the tensors themselves")
        stack = _stacks.sinks
        if stack and stack[-1] is None:
            stack[-1] = []
        if not stack and any(known is not None and _differentiable(v) and id(v) not in known
                             for v, known in zip(items, self.known)):
            # (read by no call, its gradient runs where the map was made: before the tensor was added)
            raise NotImplementedError(
                "recompile cannot differentiate a map over a list that got a tensor after the map was made (its "
                "gradient would come too late); make the map after the list is complete, or write "
                "[f(v) for v in xs]")
        out, how = Recorded.forward(self.ctx, self.fn, items, {})
        (stack[-1] if stack else self.record.elements).append(how)
        return out


class Applied:
    """A call whose rule was found when it ran: what the rule needs (the record keeps only this, so a
    call that needs no gradient keeps nothing of its result alive)."""

    __slots__ = ("rule", "fn", "out", "args", "kwargs")

    def __init__(self, rule, fn, out, args, kwargs):
        self.rule, self.fn, self.out, self.args, self.kwargs = rule, fn, out, args, kwargs

    def backward(self, ctx):
        g = ctx.pop(self.out)
        if g is not None:
            for x, gx in self.rule(self.fn, g, self.out, self.args, self.kwargs):
                ctx.add(x, gx)


class TakenRows:
    """``enumerate(x)``, ``zip(x, y)``, ``list(x)`` over tensors: they iterate the tensors' rows, taken
    here (``unbind``) so that the rows the program gets are known and their cotangents come back."""

    __slots__ = ("taken",)

    def __init__(self, taken):
        self.taken = taken  # [(tensor, its rows)]

    @staticmethod
    def forward(fn, args, kwargs):
        taken = []

        def rows(x):
            if _differentiable(x) and x.dim() > 0:
                r = x.unbind(0)
                taken.append((x, r))
                return r
            return x

        out = fn(*[rows(a) for a in args], **kwargs)
        return out, TakenRows(taken)

    def backward(self, ctx):
        for tensor, rows in self.taken:
            gs = [ctx.pop(r) for r in rows]
            if any(g is not None for g in gs):
                ctx.add(tensor, torch.stack([torch.zeros_like(r) if g is None else g for g, r in zip(gs, rows)]))


def _in_place(ctx, fn, args, kwargs):
    target = fn.__self__
    if target.is_floating_point() or target.is_complex():
        raise NotImplementedError(
            f"recompile cannot differentiate the in-place method Tensor.{fn.__name__} (no gradient rule); "
            f"write x = x.{fn.__name__[:-1]}(...) instead, or run the call under torch.no_grad()")
    return fn(*args, **kwargs), None


def _check_in_place(target, what, defer=False):
    """Refuse, as torch would or where the cotangents by tensor could not follow, an in-place change. With
    ``defer``, the refusal of a change to a view is returned instead, for the gradient to raise if one comes
    through the change (none may: ``x = V[i]; x += 1`` of a tensor nobody differentiates)."""
    if not (target.is_floating_point() or target.is_complex()):
        return None
    if external(target):
        if target.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        raise NotImplementedError(
            f"recompile cannot differentiate {what} on a tensor from outside the compiled call that requires "
            "grad; use an out-of-place operation")
    if target._is_view():
        refusal = NotImplementedError(
            f"recompile cannot differentiate {what} on a view of another tensor (row = h[0]; row *= 2, or "
            "h[i] += x): the change reaches the tensor viewed. Write it out of place (h = h * 2, or build "
            "the rows in a list and torch.stack them), or run it under torch.no_grad()")
        if not defer:
            raise refusal
        return refusal
    return None


class InPlace:
    """``a op= b`` on a tensor, done in place as in Python, with the old ``a`` where its gradient needs it
    (a later in-place change to ``a`` must not reach the gradient: it reads ``before``, never ``a``)."""

    __slots__ = ("op", "target", "other", "before", "other_version", "refusal")

    def __init__(self, op, target, other, before, other_version, refusal=None):
        self.op = op
        self.target = target
        self.other = other
        self.before = before
        self.other_version = other_version  # (b's value is read by a's gradient, as torch reads it)
        self.refusal = refusal  # (a change to a view: refused once a gradient comes through it)

    def backward(self, ctx):
        g = ctx.pop(self.target)
        if self.refusal is not None and (g is not None or ctx.peek(self.target._base) is not None):
            raise self.refusal  # (a gradient comes through the view, or through the tensor it changed)
        if g is None:
            return
        a, b, op = self.target, self.other, self.op
        if op is not operator.iadd and op is not operator.isub and isinstance(b, _Tensor) \
                and b._version != self.other_version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: the right-hand side of an augmented assignment (shape {tuple(b.shape)}) was "
                "changed in place afterwards")
        if op is operator.iadd:
            ga, gb = g, g
        elif op is operator.isub:
            ga, gb = g, -g
        elif op is operator.imul:
            factor = b
            ga, gb = g * factor, (g * self.before if isinstance(b, _Tensor) else None)
        elif op is operator.itruediv:
            ga, gb = g / b, (-g * (self.before / b) / b if isinstance(b, _Tensor) else None)
        else:  # ipow
            ga = g * b * self.before ** (b - 1)
            gb = g * self.before ** b * torch.log(self.before) if isinstance(b, _Tensor) else None
        ctx.add(a, ga)  # the same tensor: now the cotangent of its old value
        if gb is not None and isinstance(b, _Tensor):
            ctx.add(b, gb.sum_to_size(b.shape) if gb.shape != b.shape else gb)


def in_place(ctx, op, a, b):
    """``a op= b``: for a tensor, in place with what its gradient needs; for a number and a tensor, the new
    tensor ``a op b`` (what Python makes of it: a number has no in-place form), with its rule; else Python's
    own."""
    if not isinstance(a, _Tensor):
        if type(a) in facts.NUMBERS and isinstance(b, _Tensor):
            return call_forward(ctx, _BINARY_OF[op], a, b)
        return op(a, b), None
    refusal = _check_in_place(a, "an augmented assignment", defer=True)
    if op in (operator.itruediv, operator.ipow) and b is a:
        raise NotImplementedError("recompile cannot differentiate x /= x or x **= x in place; write it out of place")
    before = a.clone() if op is operator.ipow or (op in (operator.imul, operator.itruediv)
                                                  and isinstance(b, _Tensor)) else None
    other_version = version(b)  # (before the op: ``h *= h`` changes what its gradient reads, as eager refuses)
    out = op(a, b)
    if out is not a:  # not done in place after all (an integer tensor divided): like a @ b
        return out, None
    return out, InPlace(op, a, b, before, other_version, refusal)


def set_item(obj, index, value):
    """``obj[index] = value``; refused on a tensor the gradient could not follow (see _check_in_place)."""
    if isinstance(obj, _Tensor):
        _check_in_place(obj, "an item assignment")
    obj[index] = value


@facts.pure
def version(t):
    return t._version if isinstance(t, _Tensor) else None


def check_version(ctx, out, t, expected, where, how, is_result, *args):
    """Raise, as torch does, when a value an op's gradient needs was changed in place after the op ran
    (``out``: the op's result; ``args``: its arguments, when the check is given them)."""
    if not isinstance(t, _Tensor) or t._version == expected:
        return
    kwargs = ()
    if type(how) is WithElements:
        how = how.how
    if type(how) is Applied:
        # (a method's rule reads the tensor it is bound to as its first argument: ``v.mul(w)`` is mul(v, w))
        args = (how.fn.__self__, *how.args) if how.rule.method else how.args
        how, out, kwargs = how.rule, how.out, how.kwargs
    if not ctx.reaches(out):
        return  # no cotangent comes back through the op (its result is unused): its gradient reads nothing
    if type(how) is not Rule or not (how.reads_out if is_result else how.reads_inputs):
        return  # its gradient needs no value (x + y), or it is autograd's to check (a recorded call)
    if not is_result and how.read_for_others and not _read_for_a_gradient(t, args, kwargs, how.read_for_others):
        return  # (x * 0.5: only the other arguments' gradients would read x)
    if not is_result and how.reads_only is not None and (args or kwargs) and \
            not any(a is t or type(a) is tuple and any(e is t for e in a) for a in _read_only(how, args, kwargs)):
        return  # (torch.where(c, x, y) with x changed: only c's value is read)
    if not is_result and how.vjp in ITEM_READS and args and not isinstance(args[0], _Tensor):
        return  # (a list's item by a tensor index: the item is the object itself, no index is read)
    if not is_result and how.vjp in ALONG_A_DIM and _along_a_dim(args, kwargs):
        return  # (torch.max(v, 0): its gradient reads the indices it found, not v)
    mine = [k for k, a in enumerate(args) if a is t]  # (t read only for the other arguments' gradients: not its own)
    spare = t if not is_result and how.read_for_others and not kwargs and len(mine) == 1 and \
        mine[0] in how.read_for_others else None
    ctx.refuse(out, RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a tensor of shape {tuple(t.shape)} used at {where} was changed in place afterwards"), spare)


def _along_a_dim(args, kwargs):
    """Whether ``torch.max`` / ``torch.min`` (a method's receiver first) was given an int dim and no other
    tensor: values and indices along it."""
    kwargs = dict(kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis"))
    return type(dim) is int and "other" not in kwargs


def _read_only(rule, args, kwargs):
    """The arguments at ``rule.reads_only`` (the only ones its gradient reads the value of), by position or by
    keyword."""
    kwargs = dict(kwargs)
    return [args[k] if k < len(args) else kwargs.get(name) for k, name in zip(rule.reads_only, rule.reads_only_names)]


@facts.pure
def check_unchanged(t, made, where):
    """Refuse to read a view whose tensor was changed in place after the view was made: the derived gradient
    would send the view's cotangent to the tensor's old value. (The same tensor under another name is
    fine: cotangents follow the tensor object.)"""
    if isinstance(t, _Tensor) and t._version != made and t._is_view():
        raise NotImplementedError(
            f"recompile cannot differentiate this read at {where}: it reads a view (shape {tuple(t.shape)}) of a "
            "tensor changed in place after the view was taken; take the view after the change, or change a "
            "copy (x = x.clone())")


def _read_for_a_gradient(t, args, kwargs, read_for_others):
    """Whether some argument's gradient reads ``t``: an argument ``t`` is not read for itself (see
    Rule.read_for_others), or another argument may need a gradient (a floating tensor)."""
    mine = [k for k, a in enumerate(args) if a is t]
    if not mine or kwargs or any(k not in read_for_others for k in mine):
        return True
    others = [a for k, a in enumerate(args) if k not in mine or len(mine) > 1]  # (x * x reads x for x)
    # (in the no-grad forward a tensor of the program's own and a constant look alike: both may need one)
    return any(_differentiable(a) for a in others)


# ----------------------------------------------------------------------------
# gradient


def _one_op(backward):
    """``backward`` is one op's gradient: the refusal its popped cotangents carry goes to the ones it adds, and
    no further. (A helper's gradient, recorded by torch.autograd, may run another compiled call's gradient
    inside this one, on this thread: the outer op's refusal is back when the inner one is done.)"""
    def run(ctx, *args, **kwargs):
        outer = _carried.refusal
        _carried.refusal = None
        try:
            return backward(ctx, *args, **kwargs)
        finally:
            _carried.refusal = outer
    run.__name__, run.__qualname__, run.__doc__ = backward.__name__, backward.__qualname__, backward.__doc__
    return run


@_one_op
def backward_of(ctx, how):
    """The gradient of a call whose way to differentiate was decided when it ran (see call_forward)."""
    if how is not None:
        how.backward(ctx)


@_one_op
def call_backward(ctx, how, out, fn, *args, **kwargs):
    """Apply the gradient of one forward call: ``how`` is its Rule, a Recorded call, or None."""
    if how is None:
        return
    if type(how) is not Rule:
        how.backward(ctx)
        return
    g = ctx.pop(out)
    if g is not None:
        for x, gx in how(fn, g, out, args, kwargs):
            ctx.add(x, gx)


def read_backward(ctx, how, out, fn, obj, *args):
    """The gradient of a read (``obj[i]``, ``a, b = obj``, ``obj.T``): only a tensor's read makes a new
    tensor; an item of a list or tuple is the object itself and keeps its cotangent."""
    if isinstance(obj, _Tensor):
        call_backward(ctx, how, out, fn, obj, *args)


@_one_op
def setitem_backward(ctx, obj, index, value, version=None):
    """``obj[index] = value`` on a tensor: value gets the cotangent of that region, which the old obj loses. An
    index tensor changed in place since the write (``version``: its version then) is refused, as eager's
    backward refuses it."""
    if not isinstance(obj, _Tensor):
        return
    g = ctx.peek(obj)
    if g is None:
        return
    if version is not None and isinstance(index, _Tensor) and index._version != version:
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: the index tensor of shape {tuple(index.shape)} of an item assignment was "
                           "changed in place afterwards")
    _carried.refusal = ctx.refusals.get(id(obj))
    if isinstance(value, _Tensor):
        ctx.add(value, written_cotangent(g[index], value))
    g = g.clone()
    g[index] = 0
    with ctx.lock:
        ctx.cotangents[id(obj)] = (obj, g)


# ----------------------------------------------------------------------------
# the fallback: a call with no rule, recorded by torch.autograd


def _set_field(obj, name, value):
    """``obj.name = value``, also where ``obj`` refuses assignment (a frozen dataclass: its own ``__init__``
    assigns so). The object's tensors are swapped for the recorded copies and back, or for what the call
    recorded: a field held as a constant would lose its gradient."""
    try:
        setattr(obj, name, value)
    except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
        object.__setattr__(obj, name, value)


class Recorded:
    """A call run with torch.autograd recording, for a callable that has no rule."""

    __slots__ = ("outputs", "results", "inputs", "targets")

    def __init__(self, outputs, results, inputs, targets):
        self.outputs = outputs  # the tensors the autograd graph ends in
        self.results = results  # the tensors the program got in their place (cotangents come to these)
        self.inputs = inputs  # what to differentiate for
        self.targets = targets  # where each input's gradient goes

    @staticmethod
    def forward(ctx, fn, args, kwargs):
        copies = {}  # id(original) -> detached copy that records
        swapped = []  # (dict or object, key, original, copy): what a dict or an object holds, during the call

        def detach(x, depth=0):
            if isinstance(x, _Tensor):
                if external(x) or not (x.is_floating_point() or x.is_complex()):
                    return x
                c = copies.get(id(x))
                if c is None:
                    c = x.detach().requires_grad_()
                    copies[id(x)] = (x, c)
                    return c
                return c[1]
            if depth >= 8:
                return x
            if type(x) is tuple:  # a copy only when it holds tensors to record (cat of a tuple)
                items = [detach(v, depth + 1) for v in x]
                return tuple(items) if any(a is not b for a, b in zip(items, x)) else x
            # a list, a dict or an object is the caller's own (the helper may change it: append to it): its
            # tensors are swapped for their copies in place during the call, then put back
            if type(x) is list:
                for k, v in enumerate(x):
                    c = detach(v, depth + 1)
                    if c is not v:
                        x[k] = c
                        swapped.append((x, k, v, c))
            elif type(x) is dict and "__builtins__" not in x:  # (not a module's namespace: eval's globals)
                for k, v in list(x.items()):
                    c = detach(v, depth + 1)
                    if c is not v:
                        x[k] = c
                        swapped.append((x, k, v, c))
            elif plain_object(x):
                for k, v in list(vars(x).items()):
                    c = detach(v, depth + 1)
                    if c is not v:
                        _set_field(x, k, c)
                        swapped.append((x, k, v, c))
            return x

        if type(fn) is BOUND_BUILTIN and isinstance(fn.__self__, _Tensor):  # x.f(...): x is an input too
            args = (fn.__self__, *args)
            fn = getattr(type(fn.__self__), fn.__name__)
        try:
            call_args = [detach(a) for a in args]
            call_kwargs = {k: detach(v) for k, v in kwargs.items()}
            calls = _stacks.recording
            calls.append(fn)
            try:
                with torch.enable_grad():
                    out = fn(*call_args, **call_kwargs)
            finally:
                calls.pop()
        finally:
            for holder, k, original, copy in reversed(swapped):  # (unless the call put something else there)
                if type(holder) is list:  # (where the copy is now: the call may have moved the items)
                    for j, v in enumerate(holder):
                        if v is copy:
                            holder[j] = original
                elif type(holder) is dict:
                    if holder.get(k) is copy:
                        holder[k] = original
                elif getattr(holder, k, None) is copy:
                    _set_field(holder, k, original)
        back = {id(c): x for x, c in copies.values()}
        outputs, results = [], []

        def settle(x):
            if isinstance(x, _Tensor):
                if id(x) in back:  # an argument given back as it was
                    original = back[id(x)]
                    outputs.append(x)
                    results.append(original)
                    return original
                if x.grad_fn is not None:
                    r = x.detach()
                    outputs.append(x)
                    results.append(r)
                    return r
                note(ctx, x)
                return x
            if type(x) is tuple:
                return tuple(settle(v) for v in x)
            if type(x) is list:  # (in place: it may be the caller's own list)
                for k, v in enumerate(x):
                    r = settle(v)
                    if r is not v:
                        x[k] = r
                return x
            if isinstance(x, tuple):
                items = [settle(v) for v in x]
                return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # namedtuple; topk's
            if type(x) is dict:  # (in place, as an object's attributes: it may be the caller's own dict)
                for k, v in list(x.items()):
                    r = settle(v)
                    if r is not v:
                        x[k] = r
                return x
            if plain_object(x):  # an object made by the call (Normal(mu, sigma), a user's class)
                for k, v in list(vars(x).items()):
                    r = settle(v)
                    if r is not v:
                        _set_field(x, k, r)
            return x

        result = settle(out)
        for holder in {id(h): h for h, _, _, _ in swapped}.values():  # (what the call stored in the caller's
            settle(holder)  # lists, dicts and objects is its result too: ``hs.append(hs[-1] * 2)``)
        if not outputs:
            return result, None
        inputs = [c for _, c in copies.values()]
        targets = [x for x, _ in copies.values()]
        stop = set()
        own = {id(c) for c in inputs}
        for a in (*args, *kwargs.values()):
            for t in tensors_in(a):
                if external(t) and id(t) not in own:  # (given twice, ``mul(a, a)``: one input, its gradient once)
                    own.add(id(t))
                    inputs.append(t)
                    targets.append(t)
                    if t.grad_fn is not None:
                        stop.add(t.grad_fn)
        for leaf in _leaves(outputs, stop):
            if id(leaf) not in own:
                own.add(id(leaf))
                note(ctx, leaf)
                inputs.append(leaf)
                targets.append(leaf)
        name = _name(fn)
        with ctx.lock:
            ctx.fallbacks[name] = ctx.fallbacks.get(name, 0) + 1
        filename, line = where = user_line()
        warn_once(where, name, f"recompile: {name} at {os.path.basename(filename)}:{line} has no gradient rule: "
                  "torch.autograd records it on the spot, op by op (slower than a rule, and its backward runs "
                  "apart from the derived program); write it with ops that have rules (docs/gradients.md), or "
                  "compile the function with mode=\"batched\", where torch.autograd records every op",
                  GradFallbackWarning)
        return result, Recorded(outputs, results, inputs, targets)

    def backward(self, ctx):
        outs, grads = [], []
        for o, r in zip(self.outputs, self.results):
            gr = ctx.pop(r)
            if gr is not None:
                outs.append(o)
                grads.append(gr)
        if not outs or not self.inputs:
            return
        try:
            found = self._grads(outs, self.inputs, grads)
        except RuntimeError as error:
            if "modified by an inplace operation" not in str(error):
                raise
            self._input_by_input(ctx, outs, grads)
            return
        for target, gi in zip(self.targets, found):
            ctx.add(target, gi)

    @staticmethod
    def _grads(outs, inputs, grads):
        with torch.enable_grad():
            # (retain_graph: the walk may have reached into a graph of the caller's, which must survive)
            return torch.autograd.grad(outs, inputs, grads, allow_unused=True, retain_graph=True)

    def _input_by_input(self, ctx, outs, grads):
        """torch refused a gradient (a value it reads changed in place): each input's gradient alone, where the
        refusal is on its way only to the inputs its walk reaches, and goes on with their cotangents towards the
        sources (``GradContext.refuse``): an input no gradient needs (a constant's min) refuses nothing."""
        carried = _carried.refusal
        for inp, target in zip(self.inputs, self.targets):
            try:
                gi, = self._grads(outs, [inp], grads)
            except RuntimeError as error:
                if "modified by an inplace operation" not in str(error):
                    raise
                _carried.refusal = (error, None)
                ctx.add(target, torch.zeros_like(inp))
                _carried.refusal = carried
                continue
            ctx.add(target, gi)


def _name(fn):
    """How stats name a callable: torch.cat, Tensor.sum, Embedding, SentimentModel.node_loss."""
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    name = getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None) or ""
    if isinstance(name, str) and (module.startswith("torch") or getattr(fn, "__self__", None) is None
                                  and module == ""):
        return ("torch." if module.startswith("torch") else "") + name
    if getattr(fn, "__objclass__", None) is not None and issubclass(fn.__objclass__, torch._C.TensorBase):
        return "Tensor." + fn.__name__
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _leaves(outputs, stop):
    """The leaf tensors (parameters) the autograd graph of ``outputs`` reaches, not past ``stop`` nodes."""
    seen, pending, found = set(), [o.grad_fn for o in outputs if o.grad_fn is not None], []
    while pending:
        node = pending.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.append(variable)
            continue
        pending.extend(n for n, _ in node.next_functions)
    return found
