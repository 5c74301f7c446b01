"""Where a generated SubGraph yields: groups of Invokes that do not depend on one another.

Scanning the ops in order, an Invoke opens a group; a later Invoke that uses
nothing the group produces joins it. In between, a pure op that does not use
the group's results is hoisted before the group (it computes the next call's
arguments: ``tree.right[i]``); a pure op that does use them waits until after
the group; anything else (a side effect, control flow) closes the group, so
the order of side effects is the user's. Only ops between the group's first
and last Invoke move. A call that may change state (``passes.effects``) is a
group of its own: the calls of a group may run at the same time (threaded and
batched modes), and what follows such a call must see its change.
"""

from __future__ import annotations

from .. import ir
from ..runtime.backprop import check_unchanged, note, note_all, version
from ..intrinsics import PURE

# the forward-with-saves program notes the gradient's sources as it meets them, reads tensors' versions and
# checks that a view's tensor was not changed since (passes.grad): that changes nothing the program reads,
# and the calls of a group change nothing in place, so these move like pure ops (and a node's two children
# are still issued together)
_MOVABLE = PURE | {note, note_all, version, check_unchanged}


def _pure(op):
    if isinstance(op, ir.Capture):
        return True
    if isinstance(op, ir.Call) and isinstance(op.fn, ir.Const):
        try:
            return op.fn.value in _MOVABLE
        except TypeError:  # unhashable callable
            return False
    return False


def plan(ops, may_mutate=lambda invoke: False):
    """A list whose items are ops, or lists of Invoke ops issued together."""
    out = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if not isinstance(op, ir.Invoke):
            out.append(op)
            i += 1
            continue
        if may_mutate(op):  # a call that may change state runs alone: what follows it must see the change
            out.append([op])
            i += 1
            continue
        group, hoisted, deferred = [op], [], []
        tainted = set(op.outputs)
        last = i  # index of the group's last Invoke: only ops before it move
        j = i + 1
        while j < len(ops):
            o = ops[j]
            depends = any(isinstance(x, ir.Value) and x in tainted for x in o.operands())
            if isinstance(o, ir.Invoke) and not depends and not may_mutate(o):
                group.append(o)
                tainted.update(o.outputs)
                last = j
            elif _pure(o) and depends:
                deferred.append(o)
                tainted.update(o.outputs)
            elif _pure(o):
                hoisted.append(o)
            else:
                break
            j += 1
        between = set(map(id, ops[i + 1:last]))
        out.extend(o for o in hoisted if id(o) in between)
        out.append(group)
        out.extend(o for o in deferred if id(o) in between)
        i = last + 1
    return out
