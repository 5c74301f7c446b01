"""A loop whose compiled calls wait for nothing the loop computes after them runs in two passes (an analysis).

``for k in range(tree.n_kids[i]): h, c, l = self.encode(tree, tree.kids[i, k]); hs.append(h); ...``: run as
written, a frame asks for one child's call an iteration and waits for it before it asks for the next, so a
node's children run one after the other, each subtree to its leaves. But no call's arguments read what an
earlier iteration's call gave. The loop then splits (loop fission, as Yu et al.'s parallel iterations):

1. the *first pass* runs the loop's test and the ops its calls' arguments and its own counting need
   (``pre``), every iteration, and collects each iteration's arguments;
2. every iteration's calls are one request each (a node's children, however many, of every instance);
3. the *second pass* runs the rest of the body (``post``) iteration by iteration, each with its own calls'
   results, the instances leaving the loop where they did in the first pass.

It applies, in a function that changes nothing in place but lists of its own (``effects.local_appends``; the
caller asks), where (``split``):

- the calls are the body's own, or one side's of an ``if`` of the body whose other side makes none
  (``for child in kids[i]: if child >= 0: ...``: the instances whose test takes that side ask for it, that side's
  ops computing its arguments (pure ones, ``facts.PURE``: they run again) run for them in the first pass, and
  in the second pass the side, run again, gets their results); none reads a call's
  result or a loop variable ``post`` computes, neither does an ``if``'s test, and none may change state
  (``passes.effects``); no other compiled call is in the loop;
- the test reads only loop variables the first pass computes;
- the lists ``post`` appends to are handed to the loop unchanged, and nothing of ``pre``, the test, or the
  loop's other operands reads them (``as_sequence(hs)``: a ``for`` over the list it grows).

Where ``post`` only takes the call's result apart, appends the parts to lists and adds them to its loop variables
(``at_once``), the second pass is one step over every iteration's rows (``SplitLoop._at_once``).

Moved as the batched run moves every op that changes nothing, ``pre`` runs before earlier iterations' calls and
``post`` after later ones: where a later iteration's arguments fail (an index past a tensor's end) and an
earlier iteration's call fails too, the first pass's error comes first.
"""

from __future__ import annotations

import operator

from .. import intrinsics, ir
from .batching import BatchPlan
from .effects import (appended_lists, changed_list, growing, local_appends, nested_appends, pure_op,
                      subgraph_may_mutate)


class LoopSplit:
    """How While ``op`` splits: ``pre`` and ``post`` (body ops, in order), its ``calls``, the loop variables
    ``post`` computes (``later``: positions), and what ``post`` reads of the first pass (``crossing``: values
    of the body, each computed by ``pre`` or a loop variable the first pass carries)."""

    def __init__(self, op, pre, post, calls, later, crossing):
        self.op, self.pre, self.post, self.calls = op, pre, post, calls
        self.later, self.crossing = later, crossing


class LoopCall:
    """A call of a split loop's body: ``invoke``, and what the first pass hands it as values of the body
    (``args``). A call under an ``if`` (``guard``: the Cond, and 0 for its then side or 1 for its else side) is
    asked for by the instances whose test takes that side: ``args`` are then the Cond's operands standing for
    the side's inputs ``given``, from which the side's ops ``prepare`` compute the call's arguments (for those
    instances alone: the test may guard them, ``if k < n: f(kids[i, k])``)."""

    def __init__(self, invoke, args, guard=None, given=(), prepare=()):
        self.invoke, self.args, self.guard = invoke, args, guard
        self.given, self.prepare = list(given), list(prepare)


def _calls(op):
    """Whether ``op`` is or holds a compiled call."""
    return isinstance(op, ir.Invoke) or any(_calls(o) for s in op.subgraphs() for o in s.ops)


def _guarded(op):
    """The LoopCall of Cond ``op`` whose one side makes one compiled call among its own ops (not nested), and
    whose other side makes none; else None."""
    if not isinstance(op, ir.Cond):
        return None
    for which, side in enumerate(op.subgraphs()):
        invokes = [o for o in side.ops if isinstance(o, ir.Invoke)]
        other = op.subgraphs()[1 - which]
        if len(invokes) != 1 or any(_calls(o) for o in side.ops if o is not invokes[0]) or \
                any(_calls(o) for o in other.ops):
            continue
        needed = {x for x in invokes[0].args if isinstance(x, ir.Value)}
        prepare = _needing(side.ops, needed)
        if not all(pure_op(o) or isinstance(o, ir.Fused) for o in prepare):
            return None  # (run again in the second pass: only what gives the same value twice; a fused op's are
            # elementwise)
        given = [x for x in side.inputs if x in needed]
        return LoopCall(invokes[0], [op.args[side.inputs.index(x)] for x in given], (op, which), given,
                        [o for o in side.ops if o in prepare])
    return None


def _needing(ops, needed):
    """The ops of ``ops`` (not calls) that compute what ``needed`` holds, and what those read in turn (``needed``
    grows with it)."""
    found = set()
    for o in reversed(ops):
        if not isinstance(o, ir.Invoke) and any(v in needed for v in o.outputs):
            found.add(o)
            needed.update(x for x in o.operands() if isinstance(x, ir.Value))
    return found


def split(op, appends, may_mutate):
    """The LoopSplit of While ``op``, or None. ``appends``: the function's appends to lists
    no one else sees (``effects.local_appends``)."""
    body, test = op.body_sg, op.cond_sg
    calls = []
    for o in body.ops:
        if isinstance(o, ir.Invoke):
            calls.append(LoopCall(o, list(o.args)))
        elif _calls(o):
            found = _guarded(o)
            if found is None:
                return None
            calls.append(found)
    if not calls or any(may_mutate(c.invoke) for c in calls):
        return None
    k = len(op.loop_vars)
    # what depends on the calls' results: their outputs (an if's around a call), what reads them, and the loop
    # variables they reach
    tainted = {v for c in calls for v in (c.guard[0].outputs if c.guard else c.invoke.outputs)}
    while True:
        for o in body.ops:
            if not isinstance(o, ir.Invoke) and any(x in tainted for x in o.operands() if isinstance(x, ir.Value)):
                tainted.update(o.outputs)
        more = {body.inputs[j] for j in range(k) if body.outputs[j] in tainted} - tainted
        if not more:
            break
        tainted |= more
    later = [j for j in range(k) if body.outputs[j] in tainted]
    needed = {x for c in calls for x in c.args + ([c.guard[0].pred] if c.guard else []) if isinstance(x, ir.Value)}
    if needed & tainted:
        return None  # (a call reads an earlier call's result: the iterations are a chain)
    if any(_reads(test, test.inputs[j]) for j in later):
        return None  # (the test reads what the calls give: how long the loop runs is not known first)
    needed.update(body.outputs[j] for j in range(k) if j not in later and isinstance(body.outputs[j], ir.Value))
    pre = _needing(body.ops, needed)
    guards = {c.guard[0] for c in calls if c.guard}
    post = [o for o in body.ops if o not in pre and not isinstance(o, ir.Invoke)]
    pre = [o for o in body.ops if o in pre]
    if any(_calls(o) for o in pre + test.ops) or any(_calls(o) for o in post if o not in guards):
        return None
    if not _lists_apart(op, pre, post, appends, [x for c in calls if c.guard for x in c.args]):
        return None
    made = {v for o in pre for v in o.outputs} | {body.inputs[j] for j in range(k) if j not in later}
    crossing = []
    for o in post:
        for x in o.operands():
            if x in made and x not in crossing:
                crossing.append(x)
    for j in later:
        x = body.outputs[j]
        if x in made and x not in crossing:
            crossing.append(x)
    return LoopSplit(op, pre, post, calls, later, crossing)


def at_once(found):
    """How LoopSplit ``found``'s second pass runs as one step over every iteration's rows, or None: where its
    one call is unguarded and ``post`` only takes the call's result apart (``h, c, l = self.f(child)``), appends
    those elements to lists (each list once) and adds them to the loop variables ``post`` computes (each once,
    ``loss = loss + l``), as (the result's length where it is unpacked, else None; per append, the list's place
    among the loop's invariants and the element's; per variable of ``later``, in order, the element's place)."""
    if len(found.calls) != 1 or found.calls[0].guard or len(found.calls[0].invoke.outputs) != 1:
        return None
    op, body, post = found.op, found.op.body_sg, found.post
    k = len(op.loop_vars)
    result = found.calls[0].invoke.output
    readers = {}
    for o in post:
        for x in o.operands():
            readers.setdefault(x, []).append(o)
    elements, length, rest = [result], None, post
    (first, *others) = readers.get(result, [None])
    if not others and ir.is_call(first, intrinsics.unpack) and len(first.args) == 2 and first.args[0] is result \
            and isinstance(first.args[1], ir.Const) and len(first.outputs) == first.args[1].value:
        elements, length, rest = list(first.outputs), first.args[1].value, [o for o in post if o is not first]
    later = {body.inputs[j]: i for i, j in enumerate(found.later)}
    appends, sums, methods = [], {}, {}
    outputs = set(body.outputs)
    for o in rest:
        if not isinstance(o, ir.Call) or o.star or o.kwargs:
            return None
        grown = growing(o)
        if grown is not None and grown[1] == "append" and grown[0] in body.inputs[k:] \
                and len(readers.get(o.output, ())) == 1 and o.output not in outputs:
            methods[o.output] = body.inputs.index(grown[0]) - k
        elif o.fn in methods and len(o.args) == 1 and o.args[0] in elements and not readers.get(o.output) \
                and o.output not in outputs:
            appends.append((methods.pop(o.fn), elements.index(o.args[0])))
        elif ir.is_call(o, operator.add) and len(o.args) == 2:
            sides = [(a, b) for a, b in (o.args, o.args[::-1]) if a in later and b in elements]
            if not sides:
                return None
            acc, element = sides[0]
            i = later[acc]
            if i in sums or len(readers[acc]) != 1 or acc in outputs or \
                    o.output is not body.outputs[found.later[i]] or readers.get(o.output):
                return None
            sums[i] = elements.index(element)
        else:
            return None
    lists = [q for q, _ in appends]
    if methods or len(set(lists)) != len(lists) or len(sums) != len(found.later):
        return None
    return length, tuple(appends), tuple(sums[i] for i in range(len(found.later)))


def _reads(sg, value):
    return value in sg.outputs or any(value in o.operands() for s in sg.walk() for o in s.ops)


def _lists_apart(op, pre, post, appends, guarded):
    """Whether the lists ``post`` changes are invariants of the loop that nothing else of it reads: not ``pre``,
    not what a call under an ``if`` is handed (``guarded``: ``if c: f(hs[-1])``), not the test, not another
    operand of the loop made from them (``as_sequence(hs)``)."""
    body = op.body_sg
    operands = op.loop_vars + op.invariants
    if any(nested_appends(o, appends) for o in pre):
        return False  # (the first pass would change it before the second reads it)
    changed = {changed_list(o) for o in post if o in appends}
    for o in post:
        if isinstance(o, ir.Cond):  # (``if child >= 0: hs.append(...)``: the list the branch is given)
            for side in o.subgraphs():
                for g in side.ops:
                    if g in appends:
                        found = changed_list(g)
                        changed.add(o.args[side.inputs.index(found)] if found in side.inputs else None)
                    elif nested_appends(g, appends):
                        return False
        elif nested_appends(o, appends):
            return False  # (a list a nested loop changes)
    for value in changed:
        if value not in body.inputs:
            return False  # (a list of a nested branch's own, or one read off another value)
        j = body.inputs.index(value)
        if j < len(op.loop_vars) or _reads(op.cond_sg, op.cond_sg.inputs[j]) or value in guarded or \
                any(value in o.operands() for o in pre):
            return False
        outer = operands[j]
        for i, other in enumerate(operands):
            if i != j and (other is outer or isinstance(other, ir.Value) and other.op is not None
                           and outer in other.op.operands()):
                return False
    return True


class BlockCalls:
    """Where a split block (``BlockSplit``) asks for its ``calls`` (LoopCall) at once: an item of the block's
    plan (``codegen.plan``), reading the calls' tests and arguments and giving the Invokes' results."""

    def __init__(self, calls):
        self.calls = calls
        self.loc = calls[0].invoke.loc
        self.outputs = [c.invoke.output for c in calls]

    def operands(self):
        return [x for c in self.calls for x in ([c.guard[0].pred] if c.guard else []) + c.args]

    def subgraphs(self):
        return ()


class BlockSplit:
    """How a block's compiled calls are asked for at once: ``pre`` (the ops computing their tests and arguments,
    in order), ``ask`` (BlockCalls) and ``rest`` (the block's other ops, in order, but the calls themselves)."""

    def __init__(self, pre, ask, rest):
        self.pre, self.ask, self.rest = pre, ask, rest


def split_blocks(sg, may_mutate):
    """{SubGraph: its BlockSplit} for the blocks of function SubGraph ``sg`` whose compiled calls, some in ``if``s
    of their own, are asked for at once (``split_block``), in a function that changes nothing in place but lists
    of its own."""
    if subgraph_may_mutate(sg, may_mutate):
        return {}
    appends = local_appends(sg)
    deferrable = BatchPlan(sg, may_mutate).deferrable
    found = {s: split_block(s.ops, appends, may_mutate, deferrable) for s in sg.walk()}
    return {s: b for s, b in found.items() if b is not None}


def split_block(ops, appends, may_mutate, deferrable=()):
    """The BlockSplit of a block's ``ops``, or None.

    ``if left[i] >= 0: total = total + f(left[i])`` then ``if right[i] >= 0: total = total + f(right[i])``: run as
    written, a batched frame runs the first ``if`` to its end (the whole left subtree) before the second asks for
    its call, so an instance's children run one after the other. Neither call's test nor its arguments read what
    the other's ``if`` computes, so both are asked for at once, as a split loop's iterations are (``split``): the
    tests, and the ops computing the arguments (``pre``), run first; then both calls, one request each; then the
    block's other ops in order, each ``if`` given its call's results (``guarded``). What comes before the first
    call runs first, as written; so do the pure ops between the calls (``effects.pure_op``: reads, Python's
    arithmetic; a fused op's elementwise ones) that read neither a call's result nor a list the block appends
    to, as ``codegen.plan`` hoists them before a group of calls.

    It applies to the block's first calls, up to one that reads what an earlier one gives (it waits, as in
    Python) or any other op between them (a helper's or a module's call, a raise, a print, a draw: the later
    calls wait for it, in order), where they are two or more, one at least under an ``if`` (``_guarded``: one
    side calls once, the other not at all; its ops computing the arguments are pure), and none may change state.
    A list the block appends to (``appends``: ``effects.local_appends``) is read only after the calls. A call the
    scheduler may defer (``deferrable``: ``BatchPlan.deferrable``, a node's loss) ends the calls asked for at
    once: deferred, it runs once for every depth."""
    changed = appended_lists(ops, appends)
    if changed is None:
        return None
    calls, tainted, hoisted = [], set(), []  # (the calls asked for at once; what is computed from what they give,
    # or from a list the block appends to; the ops between them computed from neither, which run before them)
    first = last = None
    for k, o in enumerate(ops):
        if isinstance(o, (ir.Invoke, ir.Cond, ir.While)) and _calls(o):
            found = LoopCall(o, list(o.args)) if isinstance(o, ir.Invoke) else _guarded(o)
            if found is None or may_mutate(found.invoke) or o in deferrable or any(
                    isinstance(x, ir.Value) and x in tainted for x in BlockCalls([found]).operands()):
                break  # (a call that reads what an earlier one gives waits for it: it and those after it, in order)
            calls.append(found)
            tainted.update(o.outputs)
            first, last = k if first is None else first, k
        elif first is None:
            continue
        elif not all(pure_op(g) or isinstance(g, ir.Fused) for g in _holding(o) if g is not o or not o.subgraphs()):
            break  # (a call of a helper or a module, a raise, a print, a draw between the calls: the later ones wait)
        elif any(isinstance(x, ir.Value) and (x in tainted or x in changed) for x in o.operands()):
            tainted.update(o.outputs)
        else:
            hoisted.append((k, o))
    if len(calls) < 2 or not any(c.guard for c in calls):
        return None
    pre = set(ops[:first]) | {o for k, o in hoisted if k < last}
    asked = {c.invoke for c in calls}
    return BlockSplit([o for o in ops if o in pre], BlockCalls(calls),
                      [o for o in ops if o not in pre and o not in asked])


def _holding(op):
    return [op] + [o for s in op.subgraphs() for ss in s.walk() for o in ss.ops]
