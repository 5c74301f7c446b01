"""Which recursive functions run as level programs (``codegen.levels``, ``runtime.levels``).

A function qualifies when it changes nothing in place and its body is

    pre ops ; cond pred (branches) ; post ops (calls of other functions only deferred)

where each branch either invokes nothing (a *leaf* branch) or invokes the
function itself, with arguments computed from the branch's own inputs, not
from another invoke's result (``tree.left[i]``, ``tree.right[i]``): its call
tree is then known on the way down, before any call's result is.
"""

from __future__ import annotations

from .. import ir


def level_shape(sg, batch_plan, changes):
    """The LevelShape of function SubGraph ``sg``, or None where it does not qualify."""
    if changes:
        return None
    generators = batch_plan.generators
    conds = [op for op in sg.ops if isinstance(op, ir.Cond) and any(s in generators for s in op.subgraphs())]
    if len(conds) != 1:
        return None
    cond = conds[0]
    at = sg.ops.index(cond)
    pre, post = sg.ops[:at], sg.ops[at + 1:]
    if any(isinstance(op, ir.Invoke) or _yields(op, generators) for op in pre):
        return None
    if any(_yields(op, generators) or isinstance(op, ir.Invoke) and (op.callee == sg.name
                                                                      or op not in batch_plan.deferrable)
           for op in post):
        return None
    branches = []
    for b in cond.subgraphs():
        if b not in generators:
            branches.append(None)
            continue
        invokes = [op for op in b.ops if isinstance(op, ir.Invoke)]
        if any(op.callee != sg.name for op in invokes) or any(_yields(op, generators) for op in b.ops):
            return None
        needed = {x for op in invokes for x in op.operands() if isinstance(x, ir.Value)}
        down = set()
        for op in reversed(b.ops):
            if not isinstance(op, ir.Invoke) and any(v in needed for v in op.outputs):
                down.add(op)
                needed.update(x for x in op.operands() if isinstance(x, ir.Value))
        if any(inv.output in needed for inv in invokes):
            return None  # an argument reads another call's result: the tree is not known on the way down
        branches.append(BranchShape(b, [op for op in b.ops if op in down], invokes,
                                    [op for op in b.ops if op not in down and not isinstance(op, ir.Invoke)]))
    if all(br is None for br in branches):
        return None
    return LevelShape(sg, cond, pre, post, branches)


def _yields(op, generators):
    return any(s in generators for s in op.subgraphs())


class BranchShape:
    def __init__(self, sg, down, invokes, up):
        self.sg, self.down, self.invokes, self.up = sg, down, invokes, up


class LevelShape:
    def __init__(self, sg, cond, pre, post, branches):
        self.sg, self.cond, self.pre, self.post, self.branches = sg, cond, pre, post, branches
