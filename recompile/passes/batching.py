"""The batching pass: where a batched program yields to the scheduler, and which units it is made of.

In batched mode a frame runs one SubGraph for many instances, and the
scheduler merges frames waiting at the same program point. The program points
are the *units*: each function's entry SubGraph, and each branch of a Cond
one of whose branches invokes (the leaf and internal-node cases of a tree
function), so that the branches taken by different frames — siblings,
depths, samples — are merged, and the leaf work of a whole minibatch runs
once. Everything else (a Cond whose branches invoke nothing, a loop's
predicate and body) runs inline in its unit's frame: a yield there would
cost the frame a resume for no call.

Each op's batch rule is found by its callable when it runs
(``runtime.batch_rules``): most callables of model code (``torch.tanh``,
``self.linear``) are values read at run time. Invokes that do not depend on
one another are issued together (``codegen.plan``), so that a node's two
children are one request each, merged into one frame.

``successors``: per unit, what its frames may request (the SubGraphs of
other units, the targets of Invokes), from which the scheduler's agenda knows
which pending groups may still grow. Codegen makes a ``runtime.units.Unit``
of each unit.

``deferrable``: the Invokes of a unit whose results its frame does not need
before it returns. Their outputs flow, through arithmetic (``+ - * /``, unary ``-``) and
tuple building only, into the SubGraph's outputs, and neither the callee nor
the function they are in changes state. The scheduler may answer such a
request at once with a lazy value and run the call later, merged with the
same call from other depths (``runtime.agenda``): the per-node loss of a
tree model then runs once per minibatch instead of once per level.
"""

from __future__ import annotations

from .. import ir
from ..ops import facts
from .effects import subgraph_mutates


class BatchPlan:
    """Which SubGraphs of a function yield (``generators``), its units (``units``: SubGraphs, the function's
    first), what each unit's frames may request (``successors``: unit SubGraph -> unit SubGraphs and Invoke
    targets) and the Invokes that may be ``deferrable``."""

    def __init__(self, sg, may_mutate=lambda invoke: False):
        self.generators = set()
        for s in reversed(list(sg.walk())):  # inner SubGraphs first
            if any(isinstance(op, ir.Invoke) or any(x in self.generators for x in op.subgraphs()) for op in s.ops):
                self.generators.add(s)
        self.units = [sg]
        for s in sg.walk():
            if s in self.generators:
                for op in s.ops:
                    if self.yields_branches(op):
                        self.units.extend(op.subgraphs())
        self.successors = {s: tuple(self._requested(s)) for s in self.units}
        self.deferrable = set()
        if not subgraph_mutates(sg):  # (a caller's in-place change could reach a deferred call's arguments)
            for s in self.units:  # (a unit's outputs go back to the frames that asked for it)
                self.deferrable.update(_deferrable_invokes(s, may_mutate))

    def yields_branches(self, cond):
        """Whether Cond ``cond`` sends its branches to the scheduler: where a branch invokes (a tree function's
        leaf and internal-node cases), so that the branches taken by different frames merge. A Cond whose
        branches invoke nothing runs inline, in its frame's group, as in code that never invokes: a yield
        there would cost the frame a resume for no call."""
        return any(s in self.generators for s in cond.subgraphs())

    def _requested(self, sg):
        for op in sg.ops:
            if isinstance(op, ir.Invoke):
                yield op.target
            elif isinstance(op, ir.Cond) and self.yields_branches(op):
                yield op.then_sg
                yield op.else_sg
            else:
                for nested in op.subgraphs():
                    yield from self._requested(nested)


def _flows_lazily(op):
    if not isinstance(op, ir.Call) or op.kwargs or op.star or not isinstance(op.fn, ir.Const):
        return False
    return facts.among(op.fn.value, facts.LAZY_FLOW)


def _deferrable_invokes(sg, may_mutate):
    """The Invokes of ``sg`` whose outputs reach nothing but ``sg``'s outputs, through ``facts.LAZY_FLOW`` ops."""
    users = {}
    for op in sg.ops:
        for x in op.operands():
            if isinstance(x, ir.Value):
                users.setdefault(x, []).append(op)

    returned = {v for v in sg.outputs if isinstance(v, ir.Value)}

    def only_returned(values):
        if not any(users.get(v) or v in returned for v in values):
            return False  # (a call whose result nobody uses is made for what it does: it keeps its place)
        pending, seen = list(values), set()
        while pending:
            v = pending.pop()
            if v in seen:
                continue
            seen.add(v)
            for op in users.get(v, ()):
                if not _flows_lazily(op):
                    return False
                pending.extend(op.outputs)
        return True

    return [op for op in sg.ops if isinstance(op, ir.Invoke) and not may_mutate(op) and only_returned(op.outputs)]
