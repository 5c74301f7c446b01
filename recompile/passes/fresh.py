"""``x += y`` where only this frame holds ``x``'s object is written out of place.

Python's ``x += y`` changes a tensor ``x`` in place. Where the frame made ``x`` itself by arithmetic
(``loss = loss_l + loss_r``, or ``loss = 0.0`` in the other branch) and reads that object nowhere after, a change
in place and a new tensor cannot be told apart. Left in place, the op counts as a change of state: the function
loses the batched fast paths (level programs, changes-nothing sharing) and the op runs once per instance. Such an
op becomes ``intrinsics.AUGMENTED_FRESH[op]``, the out-of-place op as the in-place one gives it (the same
dtype and shape, else the in-place op on a copy, which casts or raises as eager's does).

Only arithmetic and torch's constructors make a value counted as new here, and only ``+``, ``-`` and comparisons
may read it before the change (they keep no reference to it, and their gradients do not read it: where eager
refuses a backward because a saved value changed in place, the program must refuse it too); a branch's output
counts where every branch makes its own, and a loop's variable where it starts new and each iteration makes its
next value so (``s = torch.zeros(H)``, then ``s += h`` in the loop).

The methods of those ops (``x.mul_(y)``, ``add_``, ``sub_``, ``div_``) of such an ``x``, and its elementwise
in-place methods (``x.relu_()``, ``sigmoid_``, ``clamp_(min=0)``: ``intrinsics.METHODS_FRESH``), are written out of
place too; the ops after one read its result where they read ``x`` (they read the object eager code changed).
Their results count as new only for the arithmetic ops: ``sigmoid``'s backward reads its result, so a later
change of it in place must stay one, which eager's backward refuses.

``x[i] = v`` of a tensor a constructor made here, read by nothing before the write, becomes
``intrinsics.setitem_fresh``: a buffer the function fills (``out[t] = h`` in a loop, which then carries it as a
variable of its own, as PyTorch's seq2seq tutorial fills ``encoder_outputs``). Its first write copies the
buffer, the next ones write that copy in place (nothing else reads it), so a long buffer is not copied per step.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .. import intrinsics, ir
from ..ops import facts
from ..ops.table import torch_callable
from . import aliasing, effects

# Ops whose result is a new object (or an immutable number) that keep no reference to their operands, and
# whose gradient reads no result of theirs (``a ** b`` reads its result: eager refuses a backward through it
# once the result changes in place)
_MAKERS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                     operator.matmul, operator.neg, *intrinsics.AUGMENTED_FRESH.values(), *intrinsics.SETS_FRESH,
                     intrinsics.setitem_fresh})
# Tensor methods whose result is a new tensor of the tensor's dtype and device (``x.new(1, H)``: sizes; given one
# argument, ``new`` may view a tensor or storage it is given instead)
_NEW_METHODS = frozenset({"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"})
# Ops that may read the value before its change: they keep no reference to it and their gradients do not read
# it (``x * w`` saves x: eager refuses a backward through it once x changes in place, and so must the program)
_READERS = frozenset({operator.add, operator.sub, operator.neg, operator.lt, operator.le, operator.gt, operator.ge,
                      operator.eq, operator.ne, intrinsics.iadd_fresh, intrinsics.isub_fresh})


def fresh(sg, parsed=None):
    """Apply the pass to a function SubGraph (in place) and return it."""
    loops = {op.body_sg: (op, s) for s in sg.walk() for op in s.ops if isinstance(op, ir.While)}
    changed = True
    while changed:  # (an op written out of place makes a new value: the next ``+=`` of it may follow)
        changed = False
        for s in sg.walk():
            for op in list(s.ops):
                if _method_out_of_place(op, s, sg) or _setitem_out_of_place(op, s, sg, loops):
                    changed = True
                    continue
                if not (_calls(op, intrinsics.AUGMENTED_FRESH) and len(op.args) == 2):
                    continue
                x = op.args[0]
                if x is op.args[1] and op.fn.value is not operator.iadd and op.fn.value is not operator.isub:
                    continue  # (``h *= h``: eager's in-place op saves h for its gradient, then changes it: refused)
                if _only_here(x, op, s) or s in loops and x in s.inputs and _carried(x, op, s, *loops[s]):
                    op.fn = ir.Const(intrinsics.AUGMENTED_FRESH[op.fn.value])
                    changed = True
    return sg


def _method_out_of_place(op, s, sg):
    """``x.mul_(y)`` (``add_``, ``sub_``, ``div_``: ``facts.AUGMENTED_METHODS``) of a tensor ``x`` only the frame
    holds, as ``x *= y`` written out of place, and ``x.relu_()``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)``
    (``intrinsics.METHODS_FRESH``) as ``x.relu()``: the call becomes the fresh op, its result what the ops after
    it read for ``x`` (they read the one object eager code changed). Whether it was rewritten."""
    if not (isinstance(op, ir.Call) and not op.star and len(op.outputs) == 1) or any(
            key is None for key, _ in op.kwargs):  # (``**options``)
        return False
    found = _in_place_form(op)
    if found is None:
        return False
    x, fresh_op, args, kwargs, method = found
    if method is not None and (method not in s.ops or any(
            op.fn in o.operands() for t in sg.walk() for o in t.ops if o is not op) or op.fn in s.outputs):
        return False
    if x in args or any(x is v for _, v in kwargs) or not isinstance(x, ir.Value):
        return False  # (``h.mul_(h)``: eager's saves h, then changes it)
    at = s.ops.index(op)
    if any(x in o.operands() for t in sg.walk() if t is not s for o in t.ops):
        return False  # (read by a branch's or loop's own ops: not only here)
    if not (_only_here_before(x, op, method, s)):
        return False
    out = op.outputs[0]
    for later in s.ops[at + 1:]:
        later.map_operands(lambda a: out if a is x else a)
    s.outputs = [out if a is x else a for a in s.outputs]
    if method is not None and id(x) in aliasing.known_tensors(sg):
        s.ops.remove(method)  # (else its read stays: a number has no ``mul_``, and raises as eager's does)
    op.fn, op.args, op.kwargs = ir.Const(fresh_op), [x, *args], kwargs
    return True


def _setitem_out_of_place(op, s, sg, loops):
    """``x[i] = v`` of a tensor ``x`` only the frame holds, as ``intrinsics.setitem_fresh``: made here by a
    constructor (or by a write so rewritten: ``out[0] = a`` then ``out[1] = b``), or a buffer a loop fills
    (``out = torch.zeros(n, H)``, then ``out[t] = h`` in its body), which the loop then carries as a variable of
    its own. No op reads ``x`` before the write (it may hold a view of it, which eager's write would change), and
    in a loop's body nothing but its own later writes after it: the next step writes the copy in place, which a
    value read of it (``s = s + out``, kept by the loop's steps run ahead) would see change. The ops after it
    read its result for ``x`` (after the loop, the loop's). Whether it was rewritten."""
    if not (_calls(op, {operator.setitem}) and len(op.args) == 3 and not op.outputs):
        return False
    x, index, value = op.args
    if not isinstance(x, ir.Value) or x in (index, value) or _read_elsewhere(x, op, s, sg):
        return False
    at = s.ops.index(op)
    if x.op in s.ops:
        if not (_tensor_made(x) and _new(x, s)):
            return False
    elif not (s in loops and x in s.inputs and _filled_by_the_loop(x, sg, *loops[s])) or any(
            x in o.operands() and not _writes_only(o, x) for o in s.ops[at + 1:]):
        return False
    out = ir.Value(x.hint, op)
    op.outputs = [out]
    op.fn = ir.Const(intrinsics.setitem_fresh)
    for later in s.ops[at + 1:]:
        later.map_operands(lambda a: out if a is x else a)
    s.outputs = [out if a is x else a for a in s.outputs]
    if x in s.inputs:
        loop, outer = loops[s]
        _carry(loop, outer, s.inputs.index(x) - len(loop.loop_vars), out)
    return True


def _read_elsewhere(v, op, s, sg):
    """Whether an op of the program reads ``v`` before ``op`` in ``s`` or outside ``s``, or another SubGraph
    returns it (after ``op``, the ops of ``s`` and its outputs read its result instead)."""
    at = s.ops.index(op)
    return any(v in o.operands() for o in s.ops[:at]) or any(
        v in t.outputs or any(v in o.operands() for o in t.ops) for t in sg.walk() if t is not s)


def _writes_only(op, v):
    """Whether ``op`` is a write ``v[i] = w`` reading ``v`` nowhere else."""
    return _calls(op, {operator.setitem}) and len(op.args) == 3 and op.args[0] is v and v not in op.args[1:]


def _tensor_made(v):
    """Whether ``v`` is surely a tensor made new: a constructor's, or a write so rewritten (only of one)."""
    op = v.op
    return _constructs(op) or _method_constructs(op) or _calls(op, {intrinsics.setitem_fresh})


def _filled_by_the_loop(x, sg, loop, outer):
    """Whether body input ``x`` is an invariant of While ``loop`` (an op of ``outer``) made new before it (a
    tensor) that nothing but the loop reads before it, and the loop's condition not at all: the loop may carry
    it."""
    k = loop.body_sg.inputs.index(x) - len(loop.loop_vars)
    if k < 0:
        return False
    start = loop.invariants[k]
    test = loop.cond_sg.inputs[len(loop.loop_vars) + k]
    return isinstance(start, ir.Value) and start.op in outer.ops and _tensor_made(start) \
        and _new(start, outer) and not _read_elsewhere(start, loop, outer, sg) \
        and sum(a is start for a in loop.operands()) == 1 \
        and not any(test in o.operands() for o in loop.cond_sg.ops) and test not in loop.cond_sg.outputs


def _carry(loop, outer, k, nxt):
    """Make invariant ``k`` of While ``loop`` a variable it carries, each iteration's next value ``nxt`` (the
    body's output); the ops after the loop in ``outer`` read the loop's final value of it."""
    start = loop.invariants.pop(k)
    n = len(loop.loop_vars)
    loop.loop_vars.append(start)
    for sub in (loop.cond_sg, loop.body_sg):
        sub.inputs.insert(n, sub.inputs.pop(n + k))
    loop.body_sg.outputs.append(nxt)
    final = ir.Value(start.hint, loop)
    loop.outputs.append(final)
    at = outer.ops.index(loop)
    for later in outer.ops[at + 1:]:
        later.map_operands(lambda a: final if a is start else a)
    outer.outputs = [final if a is start else a for a in outer.outputs]


def _in_place_form(op):
    """(``x``, the fresh op, its other arguments and keywords, the ``getattr`` of a method or None) of call ``op``
    where it changes ``x`` in place and has an out-of-place form; else None."""
    fn = effects.resolve(op.fn)
    if fn is None:
        read = effects.attribute_read(op.fn)
        if read is None:
            return None
        if len(op.args) == 1 and not op.kwargs and read[1] in facts.AUGMENTED_METHODS:
            fresh_op = intrinsics.AUGMENTED_FRESH.get(facts.AUGMENTED_METHODS[read[1]])
        elif read[1] in intrinsics.SETTERS_FRESH:
            return _setter_form(op, read)
        else:
            fresh_op = intrinsics.METHODS_FRESH.get(read[1])
        return None if fresh_op is None else (read[0], fresh_op, op.args, op.kwargs, op.fn.op)
    if not op.args:
        return None
    x, args, kwargs = op.args[0], op.args[1:], op.kwargs
    if fn is F.relu:  # (``F.relu(x, inplace=True)``, or True by position)
        flags = [v for key, v in kwargs if key == "inplace"] + list(args)
        if len(flags) != 1 or len(args) + len(kwargs) != 1 or not (
                isinstance(flags[0], ir.Const) and flags[0].value is True):
            return None
        return x, intrinsics.FUNCTIONS_FRESH[torch.relu_], [], [], None
    try:
        fresh_op = intrinsics.FUNCTIONS_FRESH.get(fn)
    except TypeError:  # (an unhashable callable)
        return None
    return None if fresh_op is None else (x, fresh_op, args, kwargs, None)


def _setter_form(op, read):
    """``_in_place_form`` of ``x.fill_(v)``, ``x.zero_()`` and ``x.requires_grad_()`` (or ``(True)``), as they are
    given; None for another call of them (``requires_grad_(False)``, a wrong count: left as eager runs it)."""
    x, name = read
    given = [*op.args, *(v for _, v in op.kwargs)]
    if name == "requires_grad_":
        if len(given) > 1 or op.kwargs and op.kwargs[0][0] != "requires_grad" or given and not (
                isinstance(given[0], ir.Const) and given[0].value is True):
            return None
        return x, intrinsics.requires_grad_fresh, [], [], op.fn.op
    if op.kwargs or len(op.args) != (1 if name == "fill_" else 0):
        return None
    return x, intrinsics.SETTERS_FRESH[name], op.args, [], op.fn.op


def _only_here_before(v, user, method, s):
    """``_only_here`` of ``v`` where the ops after ``user`` are to read ``user``'s result instead, and ``method``
    (its ``getattr``) is ``user``'s own."""
    if not (isinstance(v, ir.Value) and v.op is not None and v.op in s.ops and _new(v, s)):
        return False
    at = s.ops.index(user)
    return not any(o is not method and o is not user and v in o.operands() and not _calls(o, _READERS)
                   for o in s.ops[:at])


def _calls(op, fns):
    return (isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and facts.among(op.fn.value, fns)
            and not op.kwargs and not op.star)


def _read_before(v, user, s):
    """Whether nothing but ``_READERS`` reads ``v`` in ``s`` before ``user``, and nothing after it (nor ``s``'s
    outputs)."""
    if v in s.outputs:
        return False
    at = s.ops.index(user)
    return not any(op is not user and v in op.operands() and (k > at or not _calls(op, _READERS))
                   for k, op in enumerate(s.ops))


def _only_here(v, user, s):
    """Whether ``v``, which ``user`` (an op of SubGraph ``s``) reads, is an object made in ``s`` that nothing
    but ``_READERS`` reads before ``user``, and nothing at all after it."""
    if isinstance(v, ir.Const):
        return facts.immutable(v.value)
    if not isinstance(v, ir.Value) or v.op is None or v.op not in s.ops:
        return False
    return _read_before(v, user, s) and _new(v, s)


def _carried(v, user, body, loop, outer):
    """Whether ``v``, a loop variable of ``body`` that ``user`` changes, holds an object only the loop holds at
    every iteration: it starts as a new object (or a number) that nothing reads after the loop starts, the
    loop's condition and the body read it only by ``_READERS`` (the body before ``user``), and the body's
    next value of it is new (``user``'s own, written out of place), read after by ``_READERS`` only."""
    j = body.inputs.index(v)
    if j >= len(loop.loop_vars) or not _read_before(v, user, body):
        return False
    return _loop_keeps_new(loop, j, outer, user)


def _loop_keeps_new(loop, j, outer, user=None):
    """Whether loop variable ``j`` of While ``loop`` (an op of ``outer``) holds, at every iteration and after
    the loop, an object only the loop holds: it starts as a new object (or a number) that nothing reads after
    the loop starts, the loop's condition reads it only by ``_READERS``, and each iteration's next value of it
    is new (``user``'s own result, where the body's ``+=`` is being written out of place), read after by
    ``_READERS`` only."""
    start = loop.loop_vars[j]
    if sum(a is start for a in loop.operands()) != 1:
        return False  # (``a = b = torch.zeros(3)``: two names of one object)
    if not (_only_here(start, loop, outer) if isinstance(start, ir.Value) else facts.immutable(start.value)):
        return False
    test = loop.cond_sg.inputs[j]
    if test in loop.cond_sg.outputs or any(test in op.operands() and not _calls(op, _READERS)
                                           for op in loop.cond_sg.ops):
        return False
    body = loop.body_sg
    nxt = body.outputs[j]
    return (isinstance(nxt, ir.Value) and nxt.op in body.ops and (user is not None and nxt.op is user
                                                                    or _new(nxt, body))
            and sum(o is nxt for o in body.outputs) == 1
            and not any(nxt in op.operands() and not _calls(op, _READERS) for op in body.ops))


def _new(v, s):
    """Whether ``v``, made by an op of ``s``, is a new object: an arithmetic op's or a constructor's result, a
    Cond's output every branch makes anew, or a loop variable every iteration makes anew."""
    op = v.op
    if _calls(op, _MAKERS) or _constructs(op) or _method_constructs(op):
        return True
    if isinstance(op, ir.Cond):
        j = op.outputs.index(v)
        return all(_made_in(b.outputs[j], b) for b in op.subgraphs())
    if isinstance(op, ir.While):
        return _loop_keeps_new(op, op.outputs.index(v), s)
    return False


def _constructs(op):
    """Whether ``op`` calls one of torch's constructors (``torch.zeros(3, dtype=...)``) for a tensor that needs
    no gradient."""
    return constructor(op) is not None


def _method_constructs(op):
    """Whether ``op`` calls a tensor's method that makes a new tensor (``x.new_zeros(3)``, ``x.new(1, H)``) of an
    ``x`` known to be a tensor (``_a_tensor``: an object of the user's may have a ``new`` of its own)."""
    read = effects.attribute_read(op.fn) if isinstance(op, ir.Call) and not op.star else None
    return read is not None and (read[1] in _NEW_METHODS or read[1] == "new" and (
        len(op.args) >= 2 or op.args and isinstance(op.args[0], ir.Const) and type(op.args[0].value) is int)) \
        and _a_tensor(read[0])


def _a_tensor(v):
    """Whether value ``v`` is surely a tensor: made by one of torch's functions (``torch.zeros``, ``torch.tanh``,
    resolved when the program is built), or by ``detach()`` (``inputs[0].detach()``)."""
    op = v.op if isinstance(v, ir.Value) else None
    if not isinstance(op, ir.Call):
        return False
    fn = effects.resolve(op.fn)
    if fn is not None:
        return torch_callable(fn) and not isinstance(fn, nn.Module)
    read = effects.attribute_read(op.fn)
    return read is not None and read[1] == "detach"


def constructor(op):
    """The torch constructor ``op`` calls (``torch.zeros(3, dtype=...)``) for a tensor that needs no gradient, or
    None."""
    if not isinstance(op, ir.Call) or op.star or any(name in ("requires_grad", "out") for name, _ in op.kwargs):
        return None
    fn = effects.resolve(op.fn)  # (``torch.zeros``: the global's attribute, read at build time)
    return fn if fn is not None and facts.among(fn, facts.CONSTRUCTORS) else None


def _made_in(w, branch):
    """Whether a branch's output ``w`` is new, made in the branch and read there by ``_READERS`` only."""
    if isinstance(w, ir.Const):
        return facts.immutable(w.value)
    if not isinstance(w, ir.Value) or w.op is None or w.op not in branch.ops \
            or sum(o is w for o in branch.outputs) != 1:
        return False
    if any(w in op.operands() and not _calls(op, _READERS) for op in branch.ops):
        return False
    return _new(w, branch)
