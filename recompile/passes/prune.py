"""Cond outputs that nothing reads, and Cond inputs that neither branch reads, are dropped.

The frontend passes every variable a branch assigns out of its Cond, and the
capture pass passes every outer value a branch might read in. Values that are
then never read cost little in sequential code, but a batched Cond gathers each
input for each side and joins each output back in instance order (a copy per
value per Cond), and a deferred or cut result is cut per request. The
Tree-LSTM's input gate and update leave its Cond and are not read after it.

Only the passing of values goes: the branches keep all their ops, since any
of them may have an effect.
"""

from __future__ import annotations

from .. import ir


def prune(sg, parsed=None):
    """Apply the pass to a function SubGraph (in place) and return it."""
    # Outputs outermost first: dropping a branch's output may leave a Cond inside it unread.
    for s in sg.walk():
        read = _read_values(s)
        for op in s.ops:
            if isinstance(op, ir.Cond):
                _drop_outputs(op, read)
    # Inputs innermost first: a branch's inner Conds drop theirs before its own are counted.
    for s in reversed(list(sg.walk())):
        for op in s.ops:
            if isinstance(op, ir.Cond):
                _drop_inputs(op)
    return sg


def _read_values(sg):
    """The Values that an op of ``sg`` reads or that ``sg`` returns."""
    read = {v for v in sg.outputs if isinstance(v, ir.Value)}
    for op in sg.ops:
        read.update(v for v in op.operands() if isinstance(v, ir.Value))
    return read


def _drop_outputs(op, read):
    keep = [k for k, v in enumerate(op.outputs) if v in read]
    if len(keep) == len(op.outputs):
        return
    op.outputs = [op.outputs[k] for k in keep]
    for branch in op.subgraphs():
        branch.outputs = [branch.outputs[k] for k in keep]


def _drop_inputs(op):
    read = [_read_values(branch) for branch in op.subgraphs()]
    keep = [k for k in range(len(op.args))
            if any(branch.inputs[k] in r for branch, r in zip(op.subgraphs(), read))]
    if len(keep) == len(op.args):
        return
    op.args = [op.args[k] for k in keep]
    for branch in op.subgraphs():
        branch.inputs = [branch.inputs[k] for k in keep]
