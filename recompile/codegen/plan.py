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

One side effect moves too: an append to a list the SubGraph built that no
call of the group can reach (``hs.append(self.encode(tree, child))`` for each
child; a comprehension's list). Up to the group's last Invoke, the list is
only appended to, indexed and measured (``_private_lists``); an append that
uses the group's results waits until after it, and so does everything after
it that reads the list, in order.
"""

from __future__ import annotations

import operator

from .. import intrinsics, ir
from ..passes.effects import pure_op


def _private_lists(ops):
    """({list value: the index of its first use that is not an append, an index or ``len``}, {an append's bound
    method value: its list}) of the lists ``ops`` build (``build_list``). Before that index, nothing but its own
    appends reaches the list (not a call's argument, nor a container's item, nor a name outside)."""
    built = {op.outputs[0]: len(ops) for op in ops if ir.is_call(op, intrinsics.build_list)}
    appends = {}
    for k, op in enumerate(ops):
        operands = op.operands()
        for x in operands:
            if not isinstance(x, ir.Value):
                continue
            if x in appends:
                if not (isinstance(op, ir.Call) and op.fn is x and sum(v is x for v in operands) == 1):
                    built[appends[x]] = min(built[appends[x]], k)  # (the bound method itself handed on)
                continue
            if x not in built:
                continue
            if ir.is_call(op, getattr) and len(op.args) == 2 and op.args[0] is x and \
                    isinstance(op.args[1], ir.Const) and op.args[1].value == "append":
                appends[op.outputs[0]] = x
            elif not ((ir.is_call(op, operator.getitem) and op.args[0] is x and op.args[1] is not x)
                      or (ir.is_call(op, len) and len(op.args) == 1)):
                built[x] = min(built[x], k)
    return built, appends


def plan(ops, may_mutate=lambda invoke: False):
    """A list whose items are ops, or lists of Invoke ops issued together."""
    private, appends = _private_lists(ops)
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
        reach = len(ops)  # (the first index where a list an append moved past the group is used otherwise)
        j = i + 1
        while j < len(ops):
            o = ops[j]
            depends = any(isinstance(x, ir.Value) and x in tainted for x in o.operands())
            appended = appends.get(o.fn) if isinstance(o, ir.Call) else None
            if isinstance(o, ir.Invoke) and not depends and not may_mutate(o) and j < reach:
                group.append(o)
                tainted.update(o.outputs)
                last = j
            elif (pure_op(o) or appended is not None and j < private[appended]) and depends:
                deferred.append(o)
                tainted.update(o.outputs)
                if appended is not None:  # (what reads or appends to the list after it: after it, in order)
                    tainted.add(appended)
                    reach = min(reach, private[appended])
            elif pure_op(o):
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
