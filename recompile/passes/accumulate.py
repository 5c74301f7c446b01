"""A list a recursion is handed only to append to is filled by each call's own list, handed back at its end.

DyNet users collect a tree's node losses so::

    def walk(self, tree, i, losses):
        ...  # h from self.walk(tree, tree.left[i], losses) and self.walk(tree, tree.right[i], losses)
        losses.append(self.node_loss(h, tree.labels[i]))
        return h

Each call changes the list its caller holds, so the calls of a node would have to run one after another, each
instance's tree one node at a time. Where the function's parameter ``losses`` is only appended to (``append``) and
handed, in its own place, to the function's own recursive calls (through its branches and loops), the function
changes nothing else in place and has no other such parameter (two may be one list), and no branch or loop stands
between two recursive calls of one block, the function is rewritten to fill a list of its own instead: it starts
``own = []`` and appends there, gives each recursive call a new list made for it (``[intrinsics.FILLED]``) and
appends that list to ``own`` once the call returned, and at its end hands ``own`` back (``intrinsics.hand_back``):
into a list made for it as one item, into any other (the outermost call's) as the items, read in order through the
lists of the calls. The list ends as Python's does, item for item in the same order, each call costing its own items
(a deep tree's calls do not copy their subtrees' items); a call then changes nothing but the list made for it, which
no other call sees (``Invoke.fills``, read by ``passes.effects``), so a node's calls run together, one batch per
depth (unless the program prints or draws: then the order of its calls shows, and they keep it). A list of another
class gets its own ``append`` for each item, in Python's order.

Where a block makes two or more recursive calls, the appends to ``own`` between its first and last call move after
the last (with the calls' own lists), in their order (nothing else reads ``own``): the ops between the calls then
only compute the next call's arguments, and the calls are issued together (``codegen.plan``).

What differs from Python: while the recursion runs, ``losses`` does not grow item by item (nothing in the function
reads it by that name; code that holds the same list under another name, ``self.log``, sees it grow at the end),
and a call that raises leaves ``losses`` without the items of the calls it was in.
"""

from __future__ import annotations

from .. import intrinsics, ir
from . import effects

_GROWING = ("append",)


def accumulate(sg, parsed=None):
    """Apply the pass to a function SubGraph (in place) and return it."""
    found = [(j, param, aliases) for j, param in enumerate(sg.inputs)
             for aliases in [_only_grown_and_handed_down(sg, j, param)] if aliases is not None]
    if len(found) != 1:
        return sg  # (two such lists may be one list: their appends would no longer interleave)
    j, param, aliases = found[0]
    growers = {op for s in sg.walk() for op in s.ops if _grows(op, set(aliases))}
    if any(effects.op_mutates(op) and op not in growers for s in sg.walk() for op in s.ops):
        return sg  # (another change the function makes may reach the same list by another name)
    if all(_calls_stay_together(s, j, set(aliases)) for s in sg.walk()):
        _rewrite(sg, j, param, aliases)
    return sg


def _only_grown_and_handed_down(sg, j, param):
    """The names ``param`` (input j of function ``sg``) has in ``sg`` and its branches and loop bodies, where every
    use of them is an append to it, or the same place j of a recursive call, and at least one of each is made;
    else None."""
    uses = ir.uses(sg, outputs=True)
    aliases, pending = [], [param]
    appended = recursed = False
    while pending:
        value = pending.pop()
        aliases.append(value)
        for op in uses.get(value, ()):
            if op is None:
                return None  # (returned: the caller sees it)
            if isinstance(op, ir.Invoke):
                if op.callee != sg.name or len(op.args) != len(sg.inputs) or \
                        [k for k, a in enumerate(op.args) if a is value] != [j]:
                    return None
                recursed = True
            elif isinstance(op, ir.Cond):
                if op.pred is value:
                    return None
                pending += [s.inputs[k] for k, a in enumerate(op.args) if a is value for s in op.subgraphs()]
            elif isinstance(op, ir.While):
                if value in op.loop_vars:
                    return None  # (a name the loop may bind again)
                pending += [s.inputs[len(op.loop_vars) + k] for k, a in enumerate(op.invariants) if a is value
                            for s in op.subgraphs()]
            elif _grown_by(op, value, uses):
                appended = True
            else:
                return None
    return aliases if appended and recursed else None


def _grown_by(op, value, uses):
    """Whether op ``op`` reads ``value.append`` and that bound method is only called, with one argument, its result
    unread."""
    if _append_read(op) is not value:
        return False
    bound = op.outputs[0]
    return all(isinstance(c, ir.Call) and c.fn is bound and len(c.args) == 1 and not c.kwargs and not c.star
               and c.args[0] is not bound and not uses.get(c.outputs[0]) for c in uses.get(bound, ()))


def _calls_stay_together(s, j, aliases):
    """Whether block ``s``'s ops between its first and last recursive call handing the list hold no branch or loop
    (whose appends, or calls, could not move after the last call with the block's own appends)."""
    calls = [k for k, op in enumerate(s.ops) if isinstance(op, ir.Invoke) and _hands_on(op, j, aliases)]
    return not calls or not any(op.subgraphs() for op in s.ops[calls[0]:calls[-1]])


def _rewrite(sg, j, param, aliases):
    """``own = []`` where ``sg`` starts, read where it read ``param``; each recursive call handed a new list; and
    ``hand_back(param, own)`` where it ends."""
    own_op = ir.Call(sg.loc, ir.Const(intrinsics.build_list), hints=["own"])
    own = own_op.outputs[0]
    for s in sg.walk():
        for op in s.ops:
            op.map_operands(lambda x: own if x is param else x)
    sg.ops.insert(0, own_op)
    named = set(aliases) - {param} | {own}
    for s in sg.walk():
        _give_calls_lists(s, j, named)
    handed = ir.Call(sg.loc, ir.Const(intrinsics.hand_back), [param, own], hints=["handed"])
    handed.hands_back = j  # (the one change of state the function's calls make: ``passes.effects``)
    sg.ops.append(handed)


def _give_calls_lists(s, j, aliases):
    """In block ``s``: each recursive call handed a new list, extended into the block's own after it (after the
    block's last call, with the appends between, where it makes two or more)."""
    calls = [k for k, op in enumerate(s.ops) if isinstance(op, ir.Invoke) and _hands_on(op, j, aliases)]
    if not calls:
        return
    first, last = calls[0], calls[-1]
    between = set(range(first, last))
    moved = []
    ops = []
    for k, op in enumerate(s.ops):
        if k in calls:
            alias = op.args[j]
            made = ir.Call(op.loc, ir.Const(intrinsics.build_list), [ir.Const(intrinsics.FILLED)], hints=["filled"])
            op.args[j] = made.outputs[0]
            op.fills = op.fills | {j}
            ops += [made, op]
            grow = ir.Call(op.loc, ir.Const(getattr), [alias, ir.Const("append")], hints=["append"])
            moved += [grow, ir.Call(op.loc, grow.outputs[0], [made.outputs[0]])]
            if k == last:
                ops += moved
        elif k in between and _grows(op, aliases):
            moved.append(op)
        else:
            ops.append(op)
    s.ops = ops


def _hands_on(invoke, j, aliases):
    """Whether recursive call ``invoke`` is handed the list (a name of it) in its place j."""
    return len(invoke.args) > j and invoke.args[j] in aliases


def _grows(op, aliases):
    """Whether ``op`` appends to the list (a name of it in ``aliases``), or reads its bound ``append``."""
    fn = op.fn if isinstance(op, ir.Call) else None
    made = fn.op if isinstance(fn, ir.Value) else None
    return _append_read(op) in aliases or made is not None and _append_read(made) in aliases


def _append_read(op):
    """The list whose ``append`` op ``op`` reads, else None."""
    found = effects.growing(op)
    return found[0] if found is not None and found[1] in _GROWING else None
