"""``x += y`` where only this frame holds ``x``'s object is written out of place.

Python's ``x += y`` changes a tensor ``x`` in place. Where the frame made ``x`` itself by arithmetic
(``loss = loss_l + loss_r``, or ``loss = 0.0`` in the other branch) and reads that object nowhere after, a change
in place and a new tensor cannot be told apart. Left in place, the op counts as a change of state: the function
loses the batched fast paths (level programs, changes-nothing sharing) and the op runs once per instance. Such an
op becomes ``intrinsics.AUGMENTED_FRESH[op]``, the out-of-place op as the in-place one gives it (the same
dtype and shape, else the in-place op on a copy, which casts or raises as eager's does).

Only arithmetic makes a value counted as new here, and only ``+``, ``-`` and comparisons may read it before the
change (they keep no reference to it, and their gradients do not read it: where eager refuses a backward
because a saved value changed in place, the program must refuse it too); a branch's output counts where every
branch makes its own.
"""

from __future__ import annotations

import operator

from .. import intrinsics, ir
from ..ops import facts

# Ops whose result is a new object (or an immutable number) that keep no reference to their operands, and
# whose gradient reads no result of theirs (``a ** b`` reads its result: eager refuses a backward through it
# once the result changes in place)
_MAKERS = frozenset({operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                     operator.matmul, operator.neg, *intrinsics.AUGMENTED_FRESH.values()})
# Ops that may read the value before its change: they keep no reference to it and their gradients do not read
# it (``x * w`` saves x: eager refuses a backward through it once x changes in place, and so must the program)
_READERS = frozenset({operator.add, operator.sub, operator.neg, operator.lt, operator.le, operator.gt, operator.ge,
                      operator.eq, operator.ne, intrinsics.iadd_fresh, intrinsics.isub_fresh})


def fresh(sg, parsed=None):
    """Apply the pass to a function SubGraph (in place) and return it."""
    for s in sg.walk():
        for op in s.ops:
            if _calls(op, intrinsics.AUGMENTED_FRESH) and len(op.args) == 2 and _only_here(op.args[0], op, s):
                op.fn = ir.Const(intrinsics.AUGMENTED_FRESH[op.fn.value])
    return sg


def _calls(op, fns):
    return (isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and facts.among(op.fn.value, fns)
            and not op.kwargs and not op.star)


def _only_here(v, user, s):
    """Whether ``v``, which ``user`` (an op of SubGraph ``s``) reads, is an object made in ``s`` that nothing
    but ``_READERS`` reads before ``user``, and nothing at all after it."""
    if isinstance(v, ir.Const):
        return facts.immutable(v.value)
    if not isinstance(v, ir.Value) or v.op is None or v.op not in s.ops or v in s.outputs:
        return False
    at = s.ops.index(user)
    for k, op in enumerate(s.ops):
        if op is not user and v in op.operands() and (k > at or not _calls(op, _READERS)):
            return False
    return _new(v)


def _new(v):
    """Whether ``v`` is a new object: an arithmetic op's result, or a Cond's output every branch makes anew."""
    op = v.op
    if _calls(op, _MAKERS):
        return True
    if isinstance(op, ir.Cond):
        j = op.outputs.index(v)
        return all(_made_in(b.outputs[j], b) for b in op.subgraphs())
    return False


def _made_in(w, branch):
    """Whether a branch's output ``w`` is new, made in the branch and read there by ``_READERS`` only."""
    if isinstance(w, ir.Const):
        return facts.immutable(w.value)
    if not isinstance(w, ir.Value) or w.op is None or w.op not in branch.ops \
            or sum(o is w for o in branch.outputs) != 1:
        return False
    if any(w in op.operands() and not _calls(op, _READERS) for op in branch.ops):
        return False
    return _new(w)
