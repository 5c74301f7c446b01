"""Fusion: chains of directly linked elementwise Calls become one ``Fused`` op (Cavs §3.4).

In each SubGraph, union-find joins an elementwise Call with the elementwise
Calls that produce its operands (an LSTM cell's ``sigmoid(i) * tanh(u) + ...``).
A Call is elementwise when its callable, resolved while the program is built
(``torch.sigmoid`` through the captured ``torch``), is in ``facts.FUSIBLE`` and it has
neither keyword nor ``*`` arguments. A group becomes one op placed where its
last member was, so a join is refused unless every other op between the
group's first and last member is inert (a name read, a constant attribute
read such as ``torch.sigmoid``, another elementwise op) and uses no member's
result: members then never move past a state change, an effect, or an op
that might raise first.
A member result that something outside the group uses becomes an output of
the fused op: it is computed once, not again.

The fused op keeps its members, with their source lines, in its body; the
gradient program is derived from the members (``unfuse``), and a backend that
bakes the resolved callables in checks them when it runs, so rebinding
``torch.sigmoid`` still takes effect.
"""

from __future__ import annotations

import copy
import operator

from .. import intrinsics, ir
from ..ops import facts
from .effects import resolve
BACKENDS = ("python", "compile")
DEFAULT_BACKEND = "python"  # see docs/fusion.md, "Which backend", for the measurement behind it


def _elementwise_fn(op):
    if not isinstance(op, ir.Call) or op.kwargs or op.star or len(op.outputs) != 1:
        return None
    fn = resolve(op.fn)
    return fn if facts.among(fn, facts.FUSIBLE) else None


def fuse(sg, parsed=None, backend=DEFAULT_BACKEND):
    """The pass: every SubGraph of function SubGraph ``sg`` with its elementwise chains fused (in place).
    (``parsed``, the function's source, is what every pass of the pipeline is given; this one needs none.)"""
    if backend not in BACKENDS:
        raise ValueError(f"unknown fusion backend {backend!r}; available: {', '.join(BACKENDS)}")
    for s in list(sg.walk()):
        _fuse_subgraph(s, backend)
    return sg


class _Groups:
    """Union-find over op positions, each root knowing its members' positions (sorted)."""

    def __init__(self):
        self.parent = {}
        self.members = {}

    def add(self, i):
        self.parent[i] = i
        self.members[i] = [i]

    def find(self, i):
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a, b):
        a, b = self.find(a), self.find(b)
        self.parent[b] = a
        self.members[a] = sorted(self.members[a] + self.members.pop(b))


def _inert(op):
    """An op a member may move past: a name read, a constant attribute read (``torch.sigmoid``), or
    another elementwise op. Anything else (a helper, a print, a method, ``int(s)``) may change state a
    member reads, show an effect, or raise before a member's error: the user's order would not be kept.
    (Moving past another elementwise op can only change which of two arithmetic errors is raised.)"""
    if isinstance(op, ir.Capture) or _elementwise_fn(op) is not None:
        return True
    return (isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value is getattr
            and len(op.args) == 2 and not op.kwargs and isinstance(op.args[1], ir.Const))


_ADDING = (operator.add, intrinsics.iadd_fresh)  # (``total = total + x``, ``total += x`` of a value made here)


def running_sums(s):
    """{loop variable: (the ops adding to it, what each adds)} of a loop body ``s`` for each variable the body only
    adds values to, one after another (``total = total + h``, ``total += h``, ``gold = gold + a + b``): each op
    the only reader of the value before it, the last one's result the variable's new value, read by no op."""
    found = {}
    for j, param in enumerate(s.inputs[:len(s.outputs)]):
        ops, addends, value = [], [], param
        while value not in s.outputs:
            readers = [o for o in s.ops if value in o.operands()]
            o = readers[0] if len(readers) == 1 else None
            if not (isinstance(o, ir.Call) and resolve(o.fn) in _ADDING and len(o.args) == 2 and not o.kwargs
                    and not o.star and o.args[0] is not o.args[1]):
                break
            ops.append(o)
            addends.append(o.args[1] if o.args[0] is value else o.args[0])
            value = o.output
        if ops and value is s.outputs[j] and s.outputs.count(value) == 1 and \
                not any(value in o.operands() for o in s.ops):
            found[j] = (ops, addends)
    return found


def _can_place(ops, members):
    """Whether ``members`` (sorted positions) may run as one op at the last one's position: every op
    between them that is not a member is inert and uses no member's result."""
    inside = set(members)
    produced = {v for i in members for v in ops[i].outputs}
    for j in range(members[0] + 1, members[-1]):
        if j not in inside and (not _inert(ops[j]) or any(
                isinstance(x, ir.Value) and x in produced for x in ops[j].operands())):
            return False
    return True


def _fuse_subgraph(s, backend):
    ops = s.ops
    # (a loop's running sums kept out of fusion groups, so that a loop stepping a cell or an update of its own
    # sees them: ``codegen.recurrent``)
    summing = {o for adds, _ in running_sums(s).values() for o in adds} if s.kind == "body" else set()
    resolved = {i: fn for i, op in enumerate(ops) if (fn := _elementwise_fn(op)) is not None
                and op not in summing}
    producer = {v: i for i, op in enumerate(ops) for v in op.outputs}
    groups = _Groups()
    for i in sorted(resolved):
        groups.add(i)
        for a in ops[i].args:
            j = producer.get(a) if isinstance(a, ir.Value) else None
            if j is None or j not in resolved or groups.find(j) == groups.find(i):
                continue
            merged = sorted(groups.members[groups.find(j)] + groups.members[groups.find(i)])
            if _can_place(ops, merged):
                groups.union(j, i)
    users = {v: set() for v in producer}  # value -> positions of the ops reading it (-1: the SubGraph's result)
    for i, op in enumerate(ops):
        for x in op.operands():
            if isinstance(x, ir.Value) and x in users:
                users[x].add(i)
    for v in s.outputs:
        if isinstance(v, ir.Value) and v in users:
            users[v].add(-1)
    fused_at, gone = {}, set()  # last member's position -> the Fused op; every member's position
    for k, members in enumerate(m for m in groups.members.values() if len(m) > 1):
        fused_at[members[-1]] = _fused_op(s, members, resolved, users, backend, k + 1)
        gone.update(members)
    if fused_at:
        s.ops = [fused_at[i] if i in fused_at else op for i, op in enumerate(ops) if i in fused_at or i not in gone]


def _fused_op(s, positions, resolved, users, backend, k):
    """One Fused op from the member Calls at ``positions``, producing their Values that escape the group."""
    members = [s.ops[i] for i in positions]
    inside = {v for m in members for v in m.outputs}
    outputs = [m.output for m in members if not users[m.output] <= set(positions)]

    body = ir.SubGraph(f"{s.name}.fused{k}", [], members[-1].loc, "fused")
    mapping, args, callables = {}, [], {}
    for m, i in zip(members, positions):
        for x in m.operands():
            if isinstance(x, ir.Value) and x not in inside and x not in mapping:
                mapping[x] = ir.Value(x.hint)
                body.inputs.append(mapping[x])
                args.append(x)
        if isinstance(m.fn, ir.Value):
            callables[body.inputs.index(mapping[m.fn])] = resolved[i]
        body.ops.append(_copy_call(m, mapping, ir.Value(m.output.hint)))
    body.outputs = [mapping[v] for v in outputs]
    fused = ir.Fused(members[-1].loc, body, args, callables, backend)  # (it runs where the last member was)
    fused.outputs = outputs  # the members' Values: their users need no rewiring
    for v in outputs:
        v.op = fused
    return fused


def unfuse(sg):
    """A copy of function SubGraph ``sg`` with each Fused op replaced by its members."""
    sg = ir.clone(sg)
    for s in list(sg.walk()):
        if not any(isinstance(op, ir.Fused) for op in s.ops):
            continue
        new_ops = []
        for op in s.ops:
            if not isinstance(op, ir.Fused):
                new_ops.append(op)
                continue
            mapping = dict(zip(op.body.inputs, op.args))
            mapping.update(zip(op.body.outputs, op.outputs))
            for m in op.body.ops:
                new_ops.append(_copy_call(m, mapping, mapping.get(m.output) or ir.Value(m.output.hint)))
        s.ops = new_ops
    return sg


def _copy_call(call, mapping, output):
    """A copy of member ``call`` reading ``mapping``'s values, producing ``output`` (noted in mapping)."""
    new = copy.copy(call)
    new.map_operands(lambda x: mapping.get(x, x))
    new.outputs = [output]
    output.op = new
    mapping[call.output] = output
    return new
