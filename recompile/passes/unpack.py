"""A recursive call's tuple read by constant indices is unpacked once, where the call is made.

``left = self.encode(tree, tree.left[i])`` then ``left[0]`` and ``left[1]`` reads the same values as
``hl, loss_l = self.encode(...)``, where the function returns a tuple of a known length (``return h, loss``,
its one ``return``). Written with indices, the level analysis (``passes.levels``), which reads a call's
elements off the unpacking, would not find the tree's recursion; after this pass both spellings are one
program. Only calls of the function itself are rewritten, and only where nothing but constant indices (of that
tuple's length) reads the result, in the SubGraph that makes the call.

A list the frame builds by appends in one block and uses for nothing else before its last append is its
display (``_appended_displays``), an item of a display read by a constant index is that item
(``_display_items``), and a tuple or list built and unpacked at once
(``left, right = self.walk(...), self.walk(...)``) is its items, and a
tuple each branch of an ``if`` builds and hands out (``return h, c, loss`` in both branches, an early return)
becomes as many outputs of the ``if``, the tuple built once after it: the function then returns the tuple it
builds itself, as ``return h, c, loss`` after the ``if`` does, and the branches hand out plain values.
"""

from __future__ import annotations

import operator

from .. import intrinsics, ir


def unpack(sg, parsed=None):
    """Apply the pass to a function SubGraph (in place) and return it."""
    for s in sg.walk():  # (``hs, cs = [], []`` first: its lists, then their appends; then the lists unpacked)
        _direct_tuples(s)
        _appended_displays(s, sg)
        _direct_tuples(s)
        _display_items(s)
    for s in reversed(list(sg.walk())):  # (innermost first: a nested if's tuple, built after it, is its branch's)
        _split_branch_tuples(s)
    k = _returned_length(sg)
    if k is None:
        return sg
    for s in sg.walk():
        for at in reversed(range(len(s.ops))):
            op = s.ops[at]
            if isinstance(op, ir.Invoke) and op.callee == sg.name:
                _unpack_at(s, at, op, k)
    return sg


def _appended_displays(s, sg):
    """``hs = []``, then ``hs.append(a)``, ``hs.append(b)`` in block ``s`` (a node's children, a comprehension over
    a display): where nothing but those appends uses the list before the last of them, the list is its display
    ``[a, b]``, built where the last append was. An append changes nothing else and never raises, so no one can
    tell; and the function no longer changes a list in place, which kept it off traced code and level programs
    (``effects.local_appends``)."""
    uses = ir.uses(sg, outputs=True)  # (an output: a use where its block ends)
    at = {id(op): k for k, op in enumerate(s.ops)}
    for built in [op for op in s.ops if ir.is_call(op, intrinsics.build_list)]:
        appends = []  # (the getattr of ``append``, its call), in order
        for user in uses.get(built.output, ()):
            if not ir.is_call(user, getattr) or id(user) not in at or len(user.args) != 2 or \
                    user.args[0] is not built.output or not _is_const(user.args[1], "append"):
                continue
            calls = uses.get(user.output, ())
            if len(calls) == 1 and calls[0] is not None and id(calls[0]) in at and calls[0].fn is user.output and \
                    len(calls[0].args) == 1 and not calls[0].kwargs and not calls[0].star and \
                    calls[0].args[0] is not built.output and calls[0].args[0] is not user.output and \
                    not uses.get(calls[0].output):
                appends.append((user, calls[0]))
        if not appends:
            continue
        appends.sort(key=lambda pair: at[id(pair[1])])
        last = at[id(appends[-1][1])]
        moved = {id(op) for pair in appends for op in pair}
        if any(user is None or id(user) not in at or at[id(user)] < last
               for user in uses.get(built.output, ()) if id(user) not in moved):
            continue  # (read, handed on or changed otherwise before the last append: it stays a list changed)
        display = ir.Call(built.loc, built.fn, [*built.args, *(call.args[0] for _, call in appends)])
        display.outputs = list(built.outputs)
        s.ops = [display if op is appends[-1][1] else op for op in s.ops
                 if op is not built and (id(op) not in moved or op is appends[-1][1])]
        for v in display.outputs:
            v.op = display
        at = {id(op): k for k, op in enumerate(s.ops)}


def _display_items(s):
    """``cs[0]`` of a tuple display of block ``s``, or of a list display that nothing but such reads, ``len`` and
    unpacking use before: the item itself (an index out of range stays the read, which raises)."""
    item = {}
    for k, op in enumerate(s.ops):
        if not (ir.is_call(op, operator.getitem) and len(op.args) == 2 and isinstance(op.args[1], ir.Const)
                and type(op.args[1].value) is int and isinstance(op.args[0], ir.Value)):
            continue
        shown, index = op.args[0], op.args[1].value
        built = shown.op
        if built not in s.ops[:k] or not (ir.is_call(built, intrinsics.build_tuple) or ir.is_call(
                built, intrinsics.build_list) and all(_only_reads(other, shown) for other in s.ops[:k]
                                                       if shown in other.operands())):
            continue
        if -len(built.args) <= index < len(built.args):
            item[op.output] = built.args[index]
    if not item:
        return
    s.ops = [op for op in s.ops if not (isinstance(op, ir.Call) and op.outputs and op.output in item)]
    for inner in s.walk():
        for op in inner.ops:
            op.map_operands(lambda v: item.get(v, v) if isinstance(v, ir.Value) else v)
        inner.outputs = [item.get(v, v) if isinstance(v, ir.Value) else v for v in inner.outputs]


def _only_reads(op, shown):
    """Whether ``op`` only reads list ``shown``: an item, its length or its items unpacked."""
    return any(ir.is_call(op, fn) for fn in (operator.getitem, len, intrinsics.unpack)) and \
        op.args[0] is shown and shown not in op.args[1:]


def _is_const(v, text):
    return isinstance(v, ir.Const) and type(v.value) is str and v.value == text


def _direct_tuples(s):
    """``a, b = f(), g()``: a tuple built and at once unpacked, read by nothing else, is its items (and so is a
    list: ``a, b = [f(x) for x in (l, r)]``)."""
    for u in [op for op in s.ops if isinstance(op, ir.Call) and isinstance(op.fn, ir.Const)
              and op.fn.value is intrinsics.unpack and not op.kwargs and not op.star]:
        built = u.args[0].op if isinstance(u.args[0], ir.Value) else None
        if built not in s.ops or _tuple_made(s, u.args[0], reader=u, kinds=(intrinsics.build_tuple,
                                                                              intrinsics.build_list)) is None \
                or len(built.args) != len(u.outputs):
            continue
        item = dict(zip(u.outputs, built.args))
        s.ops = [op for op in s.ops if op is not u and op is not built]
        for inner in s.walk():
            for op in inner.ops:
                op.map_operands(lambda v: item.get(v, v) if isinstance(v, ir.Value) else v)
            inner.outputs = [item.get(v, v) if isinstance(v, ir.Value) else v for v in inner.outputs]


def _split_branch_tuples(s):
    """Each Cond output of ``s`` that every branch makes as a tuple of one length (``build_tuple``, read there
    by nothing else) becomes as many outputs, the tuple built after the Cond."""
    for at in reversed(range(len(s.ops))):
        op = s.ops[at]
        if not isinstance(op, ir.Cond):
            continue
        for j in reversed(range(len(op.outputs))):
            builds = [_tuple_made(b, b.outputs[j]) for b in op.subgraphs()]
            if any(b is None for b in builds) or len({len(b.args) for b in builds}) != 1:
                continue
            whole = op.outputs[j]
            elements = [ir.Value(getattr(a, "hint", "") or whole.hint, op) for a in builds[0].args]
            for branch, build in zip(op.subgraphs(), builds):
                branch.outputs[j:j + 1] = build.args
                branch.ops.remove(build)
            op.outputs[j:j + 1] = elements
            built = ir.Call(op.loc, ir.Const(intrinsics.build_tuple), elements, n_outputs=0)
            built.outputs = [whole]
            whole.op = built
            s.ops.insert(at + 1, built)


def _tuple_made(branch, v, reader=None, kinds=(intrinsics.build_tuple,)):
    """The ``build_tuple`` (of ``kinds``) of ``branch`` that makes its output ``v`` (or, given ``reader``, the value
    ``reader`` alone reads), where nothing else there reads it; or None."""
    if not isinstance(v, ir.Value) or sum(o is v for o in branch.outputs) != (reader is None):
        return None
    op = v.op
    if not (isinstance(op, ir.Call) and op in branch.ops and isinstance(op.fn, ir.Const)
            and op.fn.value in kinds and not op.kwargs and not op.star):
        return None
    if any(v in other.operands() for other in branch.ops if other is not reader) or any(
            v in o.operands() or v in inner.outputs for other in branch.ops for inner in other.subgraphs()
            for s in inner.walk() for o in s.ops):
        return None
    return op


def _returned_length(sg):
    """The length of the tuple the function returns, where its one output is a ``build_tuple`` of its own."""
    if len(sg.outputs) != 1 or not isinstance(sg.outputs[0], ir.Value):
        return None
    made = sg.outputs[0].op
    if not (isinstance(made, ir.Call) and isinstance(made.fn, ir.Const) and made.fn.value is intrinsics.build_tuple
            and not made.kwargs and not made.star and made in sg.ops):
        return None
    return len(made.args)


def _index(op, result, k):
    """The element ``op`` reads of ``result`` (``result[j]`` with a constant int j of a k-tuple), or None."""
    if not (isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value is operator.getitem
            and not op.kwargs and not op.star and len(op.args) == 2 and op.args[0] is result
            and isinstance(op.args[1], ir.Const) and type(op.args[1].value) is int):
        return None
    j = op.args[1].value
    return j % k if -k <= j < k else None


def _unpack_at(s, at, call, k):
    """Unpack ``call``'s result (the op at ``at`` of ``s``) where only its constant indices read it."""
    result = call.output
    if result in s.outputs:
        return
    picks = {}
    for op in s.ops:
        if result in op.operands():
            j = _index(op, result, k)
            if j is None:
                return
            picks[op] = j
    for inner in s.walk():
        if inner is not s and (result in inner.outputs or any(result in op.operands() for op in inner.ops)):
            return
    hints = [""] * k
    for op, j in picks.items():
        hints[j] = hints[j] or op.output.hint
    unpacking = ir.Call(call.loc, ir.Const(intrinsics.unpack), [result, ir.Const(k)], n_outputs=k, hints=hints)
    element = {op.output: unpacking.outputs[j] for op, j in picks.items()}
    s.ops = [op for op in s.ops if op not in picks]
    s.ops.insert(s.ops.index(call) + 1, unpacking)
    for inner in s.walk():
        for op in inner.ops:
            op.map_operands(lambda v: element.get(v, v) if isinstance(v, ir.Value) else v)
        inner.outputs = [element.get(v, v) if isinstance(v, ir.Value) else v for v in inner.outputs]
