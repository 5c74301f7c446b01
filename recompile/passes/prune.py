"""Cond outputs that nothing reads, Cond inputs that neither branch reads, and loop variables that nothing after
the loop reads and no iteration reads but to hand on, are dropped.

The frontend passes every variable a branch assigns out of its Cond, and the
capture pass passes every outer value a branch might read in. Values that are
then never read cost little in sequential code, but a batched Cond gathers each
input for each side and joins each output back in instance order (a copy per
value per Cond), and a deferred or cut result is cut per request. The
Tree-LSTM's input gate and update leave its Cond and are not read after it. A loop carries every name its body
binds (a later iteration may read it): a parser's loop whose ``if`` pops the children's states on one side
carried them, and joined them at every step, though no step read an earlier one's.

Only the passing of values goes: the branches keep all their ops, since any
of them may have an effect.
"""

from __future__ import annotations

from .. import ir


def prune(sg, parsed=None):
    """Apply the pass to a function SubGraph (in place) and return it."""
    # (again while something went: a loop's variable dropped leaves unread the output of a Cond that fed only the
    # next Cond's value of it, ``if a: h = x`` then ``if b: h = y``)
    while _pruned(sg):
        pass
    return sg


def _pruned(sg):
    """One pass over ``sg``; whether it dropped anything."""
    dropped = False
    # Outputs outermost first: dropping a branch's output (a loop's variable) may leave a Cond inside it unread.
    for s in sg.walk():
        read = _read_values(s)
        for op in s.ops:
            if isinstance(op, ir.Cond):
                dropped |= _drop_outputs(op, read)
            elif isinstance(op, ir.While):
                dropped |= _drop_loop_variables(op, read)
    # Inputs innermost first: a branch's inner Conds drop theirs before its own are counted.
    for s in reversed(list(sg.walk())):
        for op in s.ops:
            if isinstance(op, ir.Cond):
                dropped |= _drop_inputs(op)
    return dropped


def _read_values(sg):
    """The Values that an op of ``sg`` reads or that ``sg`` returns."""
    read = {v for v in sg.outputs if isinstance(v, ir.Value)}
    for op in sg.ops:
        read.update(v for v in op.operands() if isinstance(v, ir.Value))
    return read


def _drop_outputs(op, read):
    keep = [k for k, v in enumerate(op.outputs) if v in read]
    if len(keep) == len(op.outputs):
        return False
    op.outputs = [op.outputs[k] for k in keep]
    for branch in op.subgraphs():
        branch.outputs = [branch.outputs[k] for k in keep]
    return True


def _drop_loop_variables(op, read):
    """Drop the variables of loop ``op`` that neither what follows it (``read``) nor its test reads, and that its
    body reads only to compute such variables (a value handed on unchanged through an ``if``'s other side)."""
    count = len(op.loop_vars)
    tested = _live_inputs(op.cond_sg, op.cond_sg.outputs)
    live = {k for k in range(count) if op.outputs[k] in read or op.cond_sg.inputs[k] in tested}
    while True:  # (a variable the body reads to compute a live one is live)
        reads = _live_inputs(op.body_sg, [op.body_sg.outputs[k] for k in live])
        more = live | {k for k in range(count) if op.body_sg.inputs[k] in reads}
        if more == live:
            break
        live = more
    if len(live) == count:
        return False
    keep = sorted(live)
    op.loop_vars = [op.loop_vars[k] for k in keep]
    op.outputs = [op.outputs[k] for k in keep]
    op.body_sg.outputs = [op.body_sg.outputs[k] for k in keep]
    for inner in op.subgraphs():
        inner.inputs = [inner.inputs[k] for k in keep] + inner.inputs[count:]
    return True


def _live_inputs(sg, needed):
    """The Values that computing ``needed`` (outputs of ``sg``) and every op of ``sg`` reads: each op's operands
    (any op may have an effect), but of a Cond only the arguments its branches read for its outputs read here."""
    needed = {v for v in needed if isinstance(v, ir.Value)}
    for op in reversed(sg.ops):
        if isinstance(op, ir.Cond):
            wanted = [k for k, v in enumerate(op.outputs) if v in needed]
            reads = [_live_inputs(branch, [branch.outputs[k] for k in wanted]) for branch in op.subgraphs()]
            needed.add(op.pred)
            needed.update(a for k, a in enumerate(op.args)
                          if any(branch.inputs[k] in r for branch, r in zip(op.subgraphs(), reads)))
        else:
            needed.update(v for v in op.operands() if isinstance(v, ir.Value))
    return needed


def _drop_inputs(op):
    read = [_read_values(branch) for branch in op.subgraphs()]
    keep = [k for k in range(len(op.args))
            if any(branch.inputs[k] in r for branch, r in zip(op.subgraphs(), read))]
    if len(keep) == len(op.args):
        return False
    op.args = [op.args[k] for k in keep]
    for branch in op.subgraphs():
        branch.inputs = [branch.inputs[k] for k in keep]
    return True
