"""Which compiled functions may change state their caller can see (an analysis, not a rewrite).

Codegen groups independent Invokes and computes the arguments of a whole group
before its first call runs. That is only the same as Python when the earlier
calls do not mutate what those arguments read, so a call whose program may
mutate (``obj.attr = v``, ``xs[i] = v``, ``x += y``, ``xs.append(v)``,
``t.add_(v)``, ... anywhere in it or in what it invokes) keeps its place.
Calls of undecorated helpers are taken as not mutating what the caller reads; whether a run may share values
computed once for every instance also asks the helpers the program names (``callables_named``). Appends to a
list the function built itself and shows no one else (``local_appends``) do not count.
"""

from __future__ import annotations

import builtins
import dis
import functools
import inspect
import operator
import types

from .. import intrinsics, ir
from ..ops import facts


_COUNTING = (operator.iadd, operator.isub)


def pure_op(op):
    """A pure op (``facts.PURE``; the forward-with-saves program's bookkeeping is pure too) or a read of an outer
    name: it may move across a compiled call, or run again, and mean the same."""
    if isinstance(op, ir.Capture):
        return True
    return isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and facts.among(op.fn.value, facts.PURE)


def op_mutates(op):
    """True when ``op`` itself may change an object in place."""
    if not isinstance(op, ir.Call):
        return False
    if out_target(op) is not None:  # torch.mul(a, b, out=c) writes c
        return True
    if in_place_flag(op):
        return True  # F.relu(x, inplace=True) or F.relu(x, True) writes x, and so does nn.ReLU(inplace=True)
    fn = op.fn
    if isinstance(fn, ir.Const):
        return facts.among(fn.value, facts.MUTATING)
    producer = fn.op
    if ir.is_call(producer, intrinsics.make_function) and isinstance(producer.args[0], ir.Const):
        return code_may_change(producer.args[0].value)  # (a nested function called: a with block's, a lambda's)
    read = attribute_read(fn)
    if read is not None:
        first = op.args[0].value if op.args and isinstance(op.args[0], ir.Const) else None
        return facts.mutating_call(read[1], [key for key, _ in op.kwargs], first)  # obj.append(...)
    if isinstance(producer, ir.Capture):
        if producer.source_kind == "attr":
            return facts.mutating_method(producer.source)  # self.append(...) in a list subclass
        value = build_time_value(producer)  # setattr(...) read as a builtin, heappush imported by name
        return facts.among(value, facts.MUTATING) or facts.mutating_method(ir.safe_getattr(value, "__name__"))
    return False


# (bytecode that sets or deletes an attribute, an item or a global)
_CHANGING_OPS = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE", "DELETE_SLICE",
                           "STORE_GLOBAL", "DELETE_GLOBAL"})
_NAMING_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME"})


@functools.lru_cache(maxsize=None)
def code_may_change(code):
    """Whether the Python code of a nested function (a with, try or match statement's, a lambda's) may change in
    place what it reaches, read by names as the compiled code's calls are: it sets or deletes an attribute, an item
    or a global, makes an augmented assignment (``h += 1`` changes a tensor in place), or names a method or function
    that changes what it is given (``trace.append``, ``z.add_``: ``facts.mutating_method``); its nested code too.
    (Setting the enclosing function's variables is not such a change: ``frame_cells``.)"""
    for ins in dis.get_instructions(code):
        if ins.opname in _CHANGING_OPS or ins.opname.startswith("INPLACE_") or \
                ins.opname == "BINARY_OP" and ins.argrepr.endswith("="):
            return True
        if ins.opname in _NAMING_OPS and facts.mutating_method(ins.argval):
            return True
    return any(code_may_change(c) for c in code.co_consts if isinstance(c, types.CodeType))


def in_place_flag(op):
    """Whether Call ``op`` asks a function with an ``inplace`` parameter to write its first argument (by keyword
    or by position: ``F.leaky_relu(x, 0.2, True)``), or calls a module built with ``inplace=True``."""
    if any(name == "inplace" and not (isinstance(v, ir.Const) and not v.value) for name, v in op.kwargs):
        return True
    fn = resolve(op.fn)
    if fn is None:
        return False
    if facts.built_in_place(fn):  # (``nn.ReLU(inplace=True)``, read at build time)
        return True
    at = facts.inplace_position(fn)
    return at is not None and at < len(op.args) and not (isinstance(op.args[at], ir.Const) and not op.args[at].value)


def out_target(op):
    """The operand Call ``op`` names as ``out=`` (the tensor a torch function writes its result into), or
    None. (``out=None`` is torch's default: no target.)"""
    for name, value in op.kwargs:
        if name == "out" and not (isinstance(value, ir.Const) and value.value is None):
            return value
    return None


def subgraph_may_mutate(sg, may_mutate):
    """Whether running SubGraph ``sg`` (the branches and loops it holds too) may mutate state: an op of its
    own, or an Invoke whose program may (``may_mutate(invoke)``)."""
    unseen = int_counting(sg) | local_appends(sg) | frame_cells(sg)
    return any((op_mutates(o) and o not in unseen) or (isinstance(o, ir.Invoke) and may_mutate(o))
               for s in sg.walk() for o in s.ops)


def int_counting(sg):
    """The ``+=`` / ``-=`` ops (in ``sg`` and what it holds) of a value that is always an int: a counter that
    starts as an int and moves by ints (``t = 0; while ...: t += 1``), in a loop or in a branch of one
    (``if a == 0: i += 1``), or a sum of such. An int's augmented assignment makes a new int, and changes
    nothing in place."""
    ints = _int_values(sg)
    return {o for s in sg.walk() for o in s.ops
            if isinstance(o, ir.Call) and isinstance(o.fn, ir.Const) and o.fn.value in _COUNTING
            and len(o.args) == 2 and not o.kwargs and all(_is_int(a, ints) for a in o.args)}


# ops of two ints that give an int
_INT_ARITHMETIC = (*_COUNTING, operator.add, operator.sub, operator.mul, operator.imul)


def _is_int(operand, ints):
    return type(operand.value) is int if isinstance(operand, ir.Const) else operand in ints


def _int_values(sg):
    """The Values of ``sg`` (and what it holds) that are ints in every run: what int arithmetic of ints gives, and
    what branches and loops pass along of ints. The largest such set: every candidate is taken for an int, then
    those that may not be are dropped until none is left to drop (a loop's counter feeds itself)."""
    made, feeds = {}, {}  # Value -> the operands it is made of, or is given, all of which must be ints
    for s in sg.walk():
        for o in s.ops:
            if isinstance(o, ir.Call) and isinstance(o.fn, ir.Const) and o.fn.value in _INT_ARITHMETIC \
                    and len(o.args) == 2 and not o.kwargs:
                made[o.output] = list(o.args)
            elif isinstance(o, ir.Cond):
                for j, out in enumerate(o.outputs):
                    made[out] = [o.then_sg.outputs[j], o.else_sg.outputs[j]]
                for branch in (o.then_sg, o.else_sg):
                    for given, value in zip(branch.inputs, o.args):
                        feeds.setdefault(given, []).append(value)
            elif isinstance(o, ir.While):
                carried = [*o.loop_vars, *o.invariants]
                for j, out in enumerate(o.outputs):
                    made[out] = [o.loop_vars[j], o.body_sg.outputs[j]]
                for part in (o.cond_sg, o.body_sg):
                    for j, given in enumerate(part.inputs):
                        feeds.setdefault(given, []).append(carried[j])
                        if j < len(o.loop_vars):
                            feeds[given].append(o.body_sg.outputs[j])
    needs = {**made, **feeds}
    ints = set(needs)
    changed = True
    while changed:
        changed = False
        for v in list(ints):
            if not all(_is_int(a, ints) for a in needs[v]):
                ints.discard(v)
                changed = True
    return ints


def build_time_value(capture):
    """What a global or closure Capture reads now (at build time); None when unbound."""
    if capture.source_kind == "closure":
        try:
            return capture.source.cell_contents
        except ValueError:
            return None
    if capture.source_kind == "global":
        if capture.name in capture.source:
            return capture.source[capture.name]
        return getattr(builtins, capture.name, None)
    return None


def subgraph_mutates(sg):
    return any(_changes(sg))


def _changes(sg):
    """The ops of function SubGraph ``sg`` (and what it holds) that may change state in place, in order."""
    unseen = int_counting(sg) | local_appends(sg) | frame_cells(sg)
    return (op for s in sg.walk() for op in s.ops if op_mutates(op) and op not in unseen)


# (the nested functions ``python_blocks`` makes of a statement, each called where the statement stands and kept by
# no one; not a class statement's, whose class may keep its methods' cells)
_IN_PLACE_BLOCKS = frozenset({"<with>", "<try>", "<match>"})


def frame_cells(sg):
    """The ops setting or deleting a variable a nested scope shares (``set_cell``, ``delete_cell``) in function
    SubGraph ``sg`` (and what it holds), where every nested scope that shares one is a ``with``, ``try`` or
    ``match`` statement run as Python: each such function is called where the statement stands and handed to no
    one, so the cells stay the frame's own, which no other call (its recursion's included) reads. Setting one then
    changes nothing another call sees; else (a lambda, a nested def, a class that may outlive the call) none."""
    if sg.kind != "function":
        return set()  # (a branch or loop body alone: the function's other scopes are not in sight)
    uses = ir.uses(sg)
    cells = set()
    for s in sg.walk():
        for o in s.ops:
            if ir.is_call(o, intrinsics.make_function):
                code = o.args[0].value if isinstance(o.args[0], ir.Const) else None
                if getattr(code, "co_name", None) not in _IN_PLACE_BLOCKS or \
                        any(not isinstance(u, ir.Call) or u.fn is not o.output or o.output in u.args
                            for u in uses.get(o.output, ())):
                    return set()
            elif ir.is_call(o, intrinsics.set_cell) or ir.is_call(o, intrinsics.delete_cell):
                cells.add(o)
    return cells


_APPENDING = frozenset({"append", "extend", "insert"})
_ITERATING = facts.FOR_LOOP  # (how a ``for`` reads a list, from its start or from its end)
# what reads a list without keeping it or changing it (and any torch function: ``torch.stack(hs)``)
_LIST_READS = frozenset({operator.getitem, len, intrinsics.as_sequence, intrinsics.has_index, intrinsics.unpack,
                         intrinsics.reversed_sequence, sum, max, min, tuple, list, sorted, any, all,
                         # (``if not kids``, ``kids == []``, ``j in kids``: its truth, an equality, a membership;
                         # ``[nt] + hs + [nt]``, ``hs * 2``: a new list of its items)
                         operator.not_, operator.truth, bool, operator.eq, operator.ne, operator.contains,
                         intrinsics.not_in, operator.add, operator.mul})


def local_appends(sg):
    """The ``xs.append(v)`` calls (``extend``, ``insert``; ``pop`` and ``del xs[i]`` of a list no ``for`` reads: a
    stack; in function SubGraph ``sg`` and what it holds) of a list the function built itself (``xs = []``) and
    hands to nothing but its own appends, reads (``torch.stack(xs)``, ``xs[-1]``, ``len(xs)``, a ``for`` over it), its
    loops and branches, and its result: no one else sees the list while it changes, and no tensor changes, so to
    the rest of the program (and to the caller) the function changes nothing in place."""
    uses = ir.uses(sg)
    found = set()
    for s in sg.walk():
        for o in s.ops:
            if isinstance(o, ir.Call) and isinstance(o.fn, ir.Const) and o.fn.value is intrinsics.build_list:
                changes = _list_changes(o.output, uses, sg)
                if changes is not None:
                    found.update(changes[0])
    return found


def _list_changes(built, uses, sg, fillers=None):
    """(the calls that change list ``built``, the names it has: itself and those loops and branches give it) where
    every use of those names is one ``local_appends`` allows, or its place in a call of ``fillers`` ({Invoke: the
    positions of the lists its function fills}); else None."""
    appends, pending, seen = set(), [built], set()
    popped = iterated = inserted = reversed_ = False
    while pending:
        while pending:
            value = pending.pop()
            if value in seen:
                continue
            seen.add(value)
            for o in uses.get(value, ()):
                if isinstance(o, ir.While):
                    j = (o.loop_vars + o.invariants).index(value)
                    if j < len(o.loop_vars):
                        pending.append(o.outputs[j])
                    pending += [o.body_sg.inputs[j], o.cond_sg.inputs[j]]
                elif isinstance(o, ir.Cond):
                    # (``... if kept else h``: the branch taken reads the list's truth, and keeps nothing)
                    if o.pred is value and not any(a is value for a in o.args):
                        continue
                    j = o.args.index(value)
                    pending += [o.then_sg.inputs[j], o.else_sg.inputs[j]]
                elif isinstance(o, ir.Invoke) and fillers and o in fillers:
                    places = [k for k, a in enumerate(o.args) if a is value]
                    if len(places) != 1 or places[0] not in fillers[o]:
                        return None
                elif _unpacked_only(o, value):
                    iterated = True  # (``zip(*pairs)``: the call gets the items, copied out as it starts)
                elif not isinstance(o, ir.Call) or o.star or o.fn is value or any(v is value for _, v in o.kwargs):
                    return None  # (the list by keyword, ``torch.stack(tensors=hs)``; not other keywords, ``dim=1``)
                elif isinstance(o.fn, ir.Const) and o.fn.value is operator.delitem and o.args[0] is value and \
                        value not in o.args[1:]:
                    appends.add(o)  # (``del stack[-2:]``: it shrinks, as a pop does)
                    popped = True
                elif _is_appender(o, value) or _is_popper(o, value):
                    if _is_popper(o, value):
                        popped = True
                    grown = growing(o)
                    inserted = inserted or (grown is not None and grown[1] == "insert")
                    callers = uses.get(o.output, ())
                    if not all(isinstance(c, ir.Call) and c.fn is o.output and o.output not in c.args
                               and not any(v is o.output for _, v in c.kwargs) for c in callers):
                        return None
                    appends.update(callers)
                elif not (_reads_lists(o) or _returned_in_tuple(o, uses, sg) or _handed_back(o, value)):
                    return None
                elif isinstance(o.fn, ir.Const) and o.fn.value in _ITERATING:
                    iterated = True
                    reversed_ = reversed_ or o.fn.value is intrinsics.reversed_sequence
        # where a loop or branch hands it on: a loop's body gives it back in its own place (else another name
        # could take it); a branch's result that may be it is followed as it is
        for s in sg.walk():
            for o in s.ops:
                if isinstance(o, ir.While):  # (its test may be the list, ``while queue:``: its truth is read)
                    if any(v in seen and v is not o.body_sg.inputs[k] for k, v in enumerate(o.body_sg.outputs)):
                        return None
                elif isinstance(o, ir.Cond):
                    for k, out in enumerate(o.outputs):
                        sides = (o.then_sg.outputs[k], o.else_sg.outputs[k])
                        if out in seen or not any(v in seen for v in sides):
                            continue
                        if not all(v in seen or _not_a_list_of_others(v, uses) for v in sides):
                            return None  # (``s = ext`` on one side: the caller's list, which a change reaches)
                        pending.append(out)
    if popped and iterated:
        return None  # (a ``for`` over a list that also shrinks: the batch's copy of it tells a list that only grew)
    if inserted and reversed_:
        return None  # (a ``for`` from its end over a list that grows in front: the batch's reversed copy is not it)
    return appends, seen


def _unpacked_only(o, value):
    """Whether Call ``o`` takes list ``value`` only unpacked (``f(*xs)``): the callee never holds the list."""
    return isinstance(o, ir.Call) and bool(o.star) and o.fn is not value and \
        not any(v is value for _, v in o.kwargs) and all(k in o.star for k, a in enumerate(o.args) if a is value)


def _not_a_list_of_others(value, uses):
    """Whether a branch's result ``value`` is no list anyone else holds: a constant (``s = None``), or a list the
    branch built and hands on unread (``s = []``)."""
    if isinstance(value, ir.Const):
        return True
    made = value.op
    return isinstance(made, ir.Call) and isinstance(made.fn, ir.Const) and made.fn.value is intrinsics.build_list \
        and not uses.get(value)


def _returned_in_tuple(o, uses, sg):
    """A tuple the function returns as it is (``return total, hs``)."""
    return isinstance(o.fn, ir.Const) and o.fn.value is intrinsics.build_tuple and o.output in sg.outputs \
        and not uses.get(o.output)


def _handed_back(o, value):
    """Whether Call ``o`` hands list ``value`` back (``intrinsics.hand_back``, ``passes.accumulate``): what
    becomes of it is the caller's list's."""
    return ir.is_call(o, intrinsics.hand_back) and len(o.args) == 2 and o.args[1] is value and o.args[0] is not value


def growing(o):
    """(the list, the method's name) of op ``o`` reading ``xs.append`` (``extend``, ``insert``) of a list xs, else
    None."""
    if isinstance(o, ir.Call) and isinstance(o.fn, ir.Const) and o.fn.value is getattr and len(o.args) == 2 \
            and isinstance(o.args[1], ir.Const) and o.args[1].value in _APPENDING:
        return o.args[0], o.args[1].value
    return None


def _is_appender(o, value):
    found = growing(o)
    return found is not None and found[0] is value


def _is_popper(o, value):
    """Whether op ``o`` reads ``xs.pop`` of list ``value`` (a stack's: the item taken is the call's result)."""
    read = attribute_read(o.outputs[0]) if isinstance(o, ir.Call) and o.outputs else None
    return read is not None and read[0] is value and read[1] == "pop"


def _reads_lists(o):
    """A call that reads a list it is given without keeping it: ``_LIST_READS``, or a torch function."""
    fn = resolve(o.fn)
    if fn is None:
        return False
    if facts.among(fn, _LIST_READS):
        return True
    module = getattr(fn, "__module__", None) or ""
    return not isinstance(fn, type) and (module == "torch" or module.startswith("torch.")) and callable(fn) \
        and not hasattr(fn, "parameters")


def invoke_may_mutate(invoke, stage):
    """Whether the program an Invoke runs — its callee and all it may invoke — may mutate state."""
    return not _fills_its_own_list(invoke, stage) and program_may_mutate(invoke.target, stage)


def _fills_its_own_list(invoke, stage):
    """Whether ``invoke`` is a recursive call handed a new list of its own for each list its function fills
    (``passes.accumulate``: its ``fills``) and its program changes nothing else (every call of that function in
    it is handed a new list, or one its caller built and shows no one else, too)."""
    return bool(invoke.fills) and _filled(invoke.target.subgraph(stage)) <= invoke.fills and \
        next(_seen_changes(invoke.target, stage, True), None) is None and not _shows_something(invoke.target, stage)


def _filled(sg):
    """The positions of the lists function SubGraph ``sg`` hands its own list back to (``passes.accumulate``)."""
    return {op.hands_back for op in sg.ops if isinstance(op, ir.Call) and op.hands_back is not None}


def _seen_changes(target, stage, own_unseen=False):
    """The ops by which the program of ``target`` may change state in place, in the order the functions are
    reached, but for the hand-backs by which a function fills the list it is handed (``passes.accumulate``) where
    no caller of ``target`` sees that list: every call of the function in the program hands it a new list, or
    one its caller built and shows no one else. The hand-back of ``target`` itself counts unless ``own_unseen``
    (its caller's list, but for a call handed a new one)."""
    handles = list(ir.reachable(target, stage))
    unseen = _unseen_hand_backs(handles, stage, None if own_unseen else target.ir_name)
    return (op for t in handles for op in _changes(t.subgraph(stage)) if op not in unseen)


def _unseen_hand_backs(handles, stage, skip):
    """The hand-backs by which functions of ``handles`` (but ``skip``) fill the list handed them, where every call
    of the function among them hands it a list made for the call or one its caller keeps to itself."""
    backs = {}  # (function name, the list's position) -> the hand-back
    for t in handles:
        if t.ir_name != skip:
            for op in t.subgraph(stage).ops:
                if isinstance(op, ir.Call) and op.hands_back is not None:
                    backs[t.ir_name, op.hands_back] = op
    if not backs:
        return set()
    filling = {}  # function name -> the positions of its lists
    for name, j in backs:
        filling.setdefault(name, set()).add(j)
    for t in handles:
        sg = t.subgraph(stage)
        calls = {op: filling[op.target.ir_name] for s in sg.walk() for op in s.ops
                 if isinstance(op, ir.Invoke) and op.target.ir_name in filling}
        kept = None
        for op, places in calls.items():
            for j in places - op.fills:
                if kept is None:  # (the lists the function built and keeps, by every name they have in it)
                    uses, kept = ir.uses(sg), set()
                    for s in sg.walk():
                        for o in s.ops:
                            changes = _list_changes(o.output, uses, sg, calls) \
                                if ir.is_call(o, intrinsics.build_list) else None
                            if changes is not None:
                                kept.update(changes[1])
                if op.args[j] not in kept:
                    backs.pop((op.target.ir_name, j), None)
    return set(backs.values())


def program_may_mutate(target, stage):
    """Whether the compiled function ``target`` names (an ``ir.Target``), or anything it may invoke, may
    mutate state."""
    return first_change(target, stage) is not None


def first_change(target, stage):
    """The first op (in the order the functions are reached) by which the program of ``target`` may change state in
    place (what ``program_may_mutate`` found), or None."""
    return next(_seen_changes(target, stage), None)


def recursions_kept_in_order(sg, stage, may_mutate):
    """The recursive Invokes of function SubGraph ``sg`` (their program may run ``sg`` again) that may change state in
    place, where two or more stand in one block, or one in a loop's body: codegen keeps each in its place
    (``codegen.plan``) where it would issue them together (a node's two children), and a loop keeps its
    iterations (``passes.fission`` splits none), so that a batched run runs each instance's calls one after
    another, each batching only with other instances' calls of the same step, not one batch per depth."""
    looped = {b for s in sg.walk() for op in s.ops if isinstance(op, ir.While) for b in op.body_sg.walk()}
    found = []
    for s in sg.walk():
        kept = [op for op in s.ops if isinstance(op, ir.Invoke) and may_mutate(op)
                and any(t.ir_name == sg.name for t in ir.reachable(op.target, stage))]
        if len(kept) >= 2 or kept and s in looped:
            found.extend(kept)
    return found


def recursions_waiting_in_turn(sg, stage, asked_at_once=None):
    """(Invoke, the Invoke it waits for) for each recursive Invoke of function SubGraph ``sg`` (its program may run
    ``sg`` again) in an ``if`` or loop of a block that makes recursive calls at an earlier point too (another ``if``
    or loop holding one, or calls of the block itself): a batched frame runs each such point to its end before
    the next, each instance's first child's whole subtree before its second's, so an instance's calls run one
    after another, each batching only with other instances' calls of the same step, not one batch per depth.
    Not those a block asks for at once (``asked_at_once``: {Invoke: its block}, ``fission.split_blocks``), nor
    those whose test or arguments read what the earlier point gives (a list it appends to included): those wait as
    Python's do."""
    asked_at_once = asked_at_once or {}

    def recursive(op):
        return isinstance(op, ir.Invoke) and any(t.ir_name == sg.name for t in ir.reachable(op.target, stage))

    found = []
    appends = local_appends(sg)
    for s in sg.walk():
        first, given = None, set()  # (an Invoke of the block's first point that calls the recursion; what it gives)
        for op in s.ops:
            inside = [x for b in op.subgraphs() for nested in b.walk() for x in nested.ops if recursive(x)] \
                if isinstance(op, (ir.Cond, ir.While)) else [op] if recursive(op) else []
            if first is None and inside:
                first, first_nested = inside[0], bool(op.subgraphs())
            elif inside and (op.subgraphs() or first_nested):  # (calls side by side in the block go together)
                chained = _reading(op, given)
                found.extend((x, first) for x in inside if x not in chained
                             and asked_at_once.get(x, x) is not asked_at_once.get(first, first))
            if first is not None and (inside or any(x in given for x in op.operands())):
                given.update(op.outputs)
                given.update(appended_lists([op], appends) or ())  # (``hs.append(f(l))``: what reads hs waits)
    return found


def _reading(op, values):
    """The ops ``op`` is or holds whose operands read ``values`` (of its block), or what was computed from them;
    all it holds where its test does."""
    if not op.subgraphs():
        return {op} if any(x in values for x in op.operands()) else set()
    outer = [op.pred, *op.args] if isinstance(op, ir.Cond) else op.loop_vars + op.invariants
    if isinstance(op, ir.Cond) and op.pred in values:
        return {o for s in op.subgraphs() for ss in s.walk() for o in ss.ops}
    found = set()
    for side in op.subgraphs():
        inputs = side.inputs
        read = {v for v, x in zip(inputs, outer[1:] if isinstance(op, ir.Cond) else outer) if x in values}
        while True:
            for o in side.ops:
                hit = _reading(o, read)
                if hit:
                    found |= hit
                    read.update(o.outputs)
            carried = {v for v, out in zip(inputs, side.outputs) if out in read} - read \
                if isinstance(op, ir.While) else ()
            if not carried:  # (a loop: what one step gives, the next reads)
                break
            read |= carried
    if isinstance(op, ir.While) and any(_reading(o, {v for v, x in zip(op.cond_sg.inputs, outer) if x in values})
                                        for o in op.cond_sg.ops):
        return {o for s in op.subgraphs() for ss in s.walk() for o in ss.ops}
    return found


def changed_list(op):
    """The list an append (``xs.append(v)``, ``xs.pop()``, ``del xs[i]``) of ``effects.local_appends`` changes."""
    if ir.is_call(op, operator.delitem):
        return op.args[0]
    method = op.fn.op if isinstance(op.fn, ir.Value) else None
    return method.args[0] if ir.is_call(method, getattr) else None


def nested_appends(op, appends):
    return any(g in appends for s in op.subgraphs() for ss in s.walk() for g in ss.ops)


def appended_lists(ops, appends):
    """The lists the block's ops, or the sides of its ``if``s, append to, as values of the block; None where an
    append lies deeper."""
    changed = set()
    for o in ops:
        if o in appends:
            changed.add(changed_list(o))
        for side in o.subgraphs():
            for g in side.ops:
                if g in appends:
                    found = changed_list(g)
                    if found in side.inputs:  # (else a list of the side's own)
                        outer = o.args if isinstance(o, ir.Cond) else o.loop_vars + o.invariants
                        changed.add(outer[side.inputs.index(found)])
                elif nested_appends(g, appends):
                    return None
    return changed


# Builtins whose call is an effect of its own, seen by the user (output, input, files)
_VISIBLE = frozenset({print, input, open, breakpoint, exec, eval})


def program_runs_again_unseen(target, stage):
    """Whether the compiled function ``target`` names, run again, changes and shows nothing twice: neither it
    nor what it may invoke changes state in place, calls a builtin with an effect of its own (``print``,
    ``open``) or a random draw by name. (A callable it reads at run time, ``self.drop``, is not seen here.)"""
    return not program_may_mutate(target, stage) and not _shows_something(target, stage)


def _shows_something(target, stage):
    """Whether the program of ``target`` calls a builtin with an effect of its own (``print``, ``open``) or a random
    draw by name: the order of its calls shows."""
    return any(shows(op) for t in ir.reachable(target, stage) for sg in t.subgraph(stage).walk() for op in sg.ops)


def shows(op):
    """Whether Call ``op`` is an effect whose order the user sees: a builtin with an effect of its own (``print``,
    ``open``) or a random draw by name."""
    if not isinstance(op, ir.Call):
        return False
    fn = resolve(op.fn)
    return facts.among(fn, _VISIBLE) or facts.among(fn, facts.DRAWS)


def callables_named(target, stage):
    """(callable, class or None) for each object that a Call of the program of ``target`` (and of all it may
    invoke) names, where it is known when the program is built: a global, a closure variable or an attribute of
    one (``resolve``: ``helper(v)``), or in a method, ``self.<name>`` where the owner class defines ``name``
    (``self.bump(v)``: the plain function and that class)."""
    for t in ir.reachable(target, stage):
        owner = getattr(t, "owner", None)
        for sg in t.subgraph(stage).walk():
            for op in sg.ops:
                if isinstance(op, ir.Call):
                    fn = resolve(op.fn)
                    if fn is not None:
                        yield fn, None
                    elif owner is not None:
                        found = _class_attribute(op.fn, owner)
                        if found is not None:
                            yield found


def _class_attribute(operand, owner):
    """(what ``owner`` defines as ``name``, ``owner`` where that is a method bound to the instance, else None)
    where the operand reads ``self.<name>``: a method's plain function, or a static or class method's, examined
    as a plain one; else None."""
    producer = operand.op if isinstance(operand, ir.Value) else None
    if not (isinstance(producer, ir.Capture) and producer.source_kind == "attr" and isinstance(producer.source, str)
            and isinstance(producer.base, ir.Value) and producer.base.is_self):
        return None
    try:
        found = inspect.getattr_static(owner, producer.source)
    except AttributeError:
        return None
    if isinstance(found, (staticmethod, classmethod)):
        return found.__func__, None
    return found, owner


def resolve(operand):
    """The object an operand holds when the program is built, if that is known (a constant, a global or closure
    variable, an attribute of one: ``torch.randn``); else None."""
    if isinstance(operand, ir.Const):
        return operand.value
    producer = operand.op
    if isinstance(producer, ir.Capture) and producer.source_kind in ("global", "closure"):
        return build_time_value(producer)
    read = attribute_read(operand)
    if read is not None:
        base = resolve(read[0])
        return None if base is None else ir.safe_getattr(base, read[1])
    return None


def attribute_read(value):
    """(the object operand, the name) where ``value`` is made by ``getattr(obj, "name")`` of a constant name
    (``obj.name``, and the builtin called by its name), else None."""
    producer = value.op if isinstance(value, ir.Value) else None
    if not (isinstance(producer, ir.Call) and len(producer.args) == 2 and not producer.kwargs and not producer.star
            and isinstance(producer.args[1], ir.Const) and isinstance(producer.args[1].value, str)):
        return None
    fn = producer.fn
    if not (isinstance(fn, ir.Const) and fn.value is getattr or isinstance(fn, ir.Value) and resolve(fn) is getattr):
        return None
    return producer.args[0], producer.args[1].value
