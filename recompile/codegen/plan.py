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
from ..ops import facts


def _pure(op):
    """A pure op (``facts.PURE``; the forward-with-saves program's bookkeeping is pure too, so a node's two
    children are still issued together when their gradients are derived) or a read of an outer name."""
    if isinstance(op, ir.Capture):
        return True
    return isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and facts.among(op.fn.value, facts.PURE)


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
