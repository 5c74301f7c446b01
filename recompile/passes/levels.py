"""Which recursive functions run as level programs (``codegen.levels``, ``runtime.levels``).

A function qualifies when it changes nothing in place and its body is

    pre ops ; cond pred (branches) ; post ops (calls of other functions only deferred)

where each branch either invokes nothing (a *leaf* branch) or invokes the
function itself, with arguments computed from the branch's own inputs, not
from another invoke's result (``tree.left[i]``, ``tree.right[i]``): its call
tree is then known on the way down, before any call's result is.

Where the function returns a tuple (``return h, c, loss``) and its deferred
calls (a node's loss) feed only some of its elements, those elements are
*late* (``LateSplit``): the way back up runs twice, first for the other
elements, then, once the deferred calls ran for every depth, for the late ones,
so that no value waits on a deferred call.

Where each late element only adds up — the node's deferred results, the
cond's output of that element, which an invoking branch adds up from its
calls' same element, and a leaf branch's zero (``loss = 0.0``, ``loss_l +
loss_r``, ``loss + node_loss``) — the element at the root is the sum of the
deferred results over the whole call tree (``TreeSums``): the second way up is
then one ``index_add`` by each call's root, not one pass per depth.
"""

from __future__ import annotations

import functools
import math
import operator
import types

import torch

from .. import ir
from .. import intrinsics
from ..ops import facts
from . import effects
from .fresh import constructor
from .pipeline import FINAL


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
    pre, post = [_as_call(op, sg) for op in sg.ops[:at]], sg.ops[at + 1:]
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
        ops = [_as_call(op, sg) for op in b.ops]
        invokes = [op for op in ops if isinstance(op, ir.Invoke)]
        if any(op.callee != sg.name for op in invokes) or any(_yields(op, generators) for op in ops):
            return None
        needed = {x for op in invokes for x in op.operands() if isinstance(x, ir.Value)}
        down = set()
        for op in reversed(ops):
            if not isinstance(op, ir.Invoke) and any(v in needed for v in op.outputs):
                down.add(op)
                needed.update(x for x in op.operands() if isinstance(x, ir.Value))
        if any(inv.output in needed for inv in invokes):
            return None  # an argument reads another call's result: the tree is not known on the way down
        branches.append(BranchShape(b, [op for op in ops if op in down], invokes,
                                    [op for op in ops if op not in down and not isinstance(op, ir.Invoke)]))
    if all(br is None for br in branches):
        return None
    shape = LevelShape(sg, cond, pre, post, branches)
    shape.split = late_split(shape)
    shape.plain_split = plain_split(shape)
    return shape


def _as_call(op, sg):
    """An Invoke of another compiled function that, run again, changes and shows nothing and never reaches
    ``sg`` again (a cell written as ``self.compose(hl, hr)``), as a Call of it (``intrinsics.CompiledCall``: its
    own program, for its owner class) on the same arguments, its result the same Value: the level program's
    pieces run it as a helper (``runtime.helpers``: traced in their place, or one batched run). Any other op
    as it is."""
    if not isinstance(op, ir.Invoke) or op.callee == sg.name or not getattr(op.target, "runs_again_unseen", False):
        return op
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in op.target.signature.parameters.values()):
        return op  # (its operands are its parameters' values: positional ones pass as they are)
    if any(t.ir_name == sg.name for t in ir.reachable(op.target, FINAL)):
        return op  # (it calls this function again: its calls are the call tree's)
    call = ir.Call(op.loc, ir.Const(intrinsics.CompiledCall(op.target)), op.args)
    call.outputs = list(op.outputs)  # (the Value the ops after it read; its producer stays the Invoke)
    return call


def _spread(ops, late):
    """Add to ``late`` the outputs of ``ops`` (in order) that read a late value."""
    for op in ops:
        if not isinstance(op, ir.Invoke) and any(x in late for x in op.operands()):
            late.update(op.outputs)


def _result_build(shape):
    """The ``build_tuple`` call of ``post`` that makes the function's one result, or its dict display with
    constant string keys (``{"h": h, "loss": loss}``), read by nothing else; or None."""
    sg, post = shape.sg, shape.post
    if len(sg.outputs) != 1 or not isinstance(sg.outputs[0], ir.Value):
        return None
    ret = sg.outputs[0]
    builds = [op for op in post if ret in op.outputs]
    if len(builds) != 1 or any(ret in op.operands() for op in post):
        return None
    if ir.is_call(builds[0], intrinsics.build_tuple) or _result_keys(builds[0]) is not None:
        return builds[0]
    return None


def _result_keys(build):
    """The keys of a dict display ``build`` whose keys are distinct constant strings, in order; else None."""
    if not ir.is_call(build, intrinsics.build_dict) or len(build.args) % 2:
        return None
    keys = build.args[::2]
    if not all(isinstance(k, ir.Const) and type(k.value) is str for k in keys):
        return None
    keys = [k.value for k in keys]
    return keys if len(set(keys)) == len(keys) else None


def _result_elements(build):
    """The values a result ``build`` holds: a tuple's items, a dict display's values."""
    return list(build.args) if _result_keys(build) is None else list(build.args[1::2])


class KeyReads:
    """A call's dict result read by key, each key once (``left["h"]``): in the dict's order, the Value read for
    each key (a Value nothing reads where no op reads that key), and the reading ops, as an ``unpack`` of a
    tuple result gives its ``outputs``."""

    def __init__(self, outputs, ops):
        self.outputs, self.ops = outputs, ops


def _key_reads(result, users, keys):
    """The KeyReads of an invoke's ``result`` read only by ``users``, each a ``getitem`` of one key; or None."""
    found = {}
    for op in users:
        if not ir.is_call(op, operator.getitem) or len(op.args) != 2 or op.args[0] is not result \
                or not isinstance(op.args[1], ir.Const) or op.args[1].value not in keys or op.args[1].value in found:
            return None
        found[op.args[1].value] = op
    return KeyReads([found[k].output if k in found else ir.Value("unread") for k in keys], list(users))


def late_split(shape, slices=()):
    """The LateSplit of ``shape``, or None: where the function returns the tuple a ``build_tuple`` in
    ``post`` makes, each self-invoke's result is unpacked into as many elements once, and the deferred
    calls' arguments read no late value. ``slices`` (SliceCalls) are deferred beside the calls."""
    cond, post = shape.cond, shape.post
    build = _result_build(shape)
    if build is None:
        return None
    elements, keys = _result_elements(build), _result_keys(build)
    unpacks = []  # per branch: per invoke, the unpack of its result, or its KeyReads (None for a leaf branch)
    for br in shape.branches:
        if br is None:
            unpacks.append(None)
            continue
        found = []
        for inv in br.invokes:
            users = [op for op in br.sg.ops if inv.output in op.operands()]
            if inv.output in br.sg.outputs or not users:
                return None
            if keys is not None:
                reads = _key_reads(inv.output, users, keys)
                if reads is None:
                    return None
                found.append(reads)
                continue
            if len(users) != 1 or not ir.is_call(users[0], intrinsics.unpack) or len(users[0].outputs) != len(elements):
                return None
            found.append(users[0])
        unpacks.append(found)
    deferred = [op for op in post if isinstance(op, ir.Invoke)] + list(slices)
    late = {op.output for op in deferred}
    sliced = {op for sl in slices for op in sl.ops}
    rest = [op for op in post if op is not build and op not in sliced]
    while True:  # (an element is late in the callers' results too: until nothing more turns late)
        size = len(late)
        _spread(rest, late)
        positions = [j for j, e in enumerate(elements) if e in late]
        for br, found in zip(shape.branches, unpacks):
            if br is not None:
                late.update(u.outputs[j] for u in found for j in positions)
                _spread(br.up, late)
        late.update(out for j, out in enumerate(cond.outputs)
                    if any(br is not None and br.sg.outputs[j] in late for br in shape.branches))
        if len(late) == size:
            break
    if any(x in late for inv in deferred for x in inv.operands()):
        return None  # (a deferred call fed by another's result: the lazy way)
    late_outputs = [j for j, out in enumerate(cond.outputs) if out in late]
    split = LateSplit(elements, positions, late_outputs, late, build, unpacks, deferred, keys)
    split.sums = tree_sums(shape, split)
    return split


def plain_split(shape):
    """The late split a plain level run uses (``codegen.levels``): ``shape.split`` with the SliceCalls of
    ``post`` deferred too, where there are some and the late elements are then tree sums; else
    ``shape.split``."""
    build = _result_build(shape)
    if build is None:
        return shape.split
    post = shape.post
    made = {v: op for op in post for v in op.outputs}
    readers = {}
    for op in post:
        for x in op.operands():
            readers.setdefault(x, set()).add(op)
    slices, seen = [], set()
    for element in _result_elements(build):
        for addend, _ in _addends(element, post, _NODE_TERMS):
            sl = None if addend in seen else _slice(addend, post, made, readers, set(shape.sg.outputs))
            if sl is not None:
                slices.append(sl)
                seen.add(addend)
    if not slices:
        return shape.split
    split = late_split(shape, slices)
    return split if split is not None and split.sums is not None else shape.split


def _slice(addend, post, made, readers, outputs):
    """The SliceCall making ``addend`` in ``post``, or None: its producer and, back through ``post``, every op
    whose outputs only ops already taken read (each op's readers come after it). None where ``addend`` is
    not made by such an op, or is read by more than the ``+`` that adds it."""
    top = made.get(addend)
    if top is None or not _movable(top) or len(readers.get(addend, ())) != 1 or addend in outputs \
            or any(v is not addend and (v in outputs or v in readers) for v in top.outputs):
        return None
    taken = {top}
    for op in reversed(post[:post.index(top)]):
        if not _movable(op) or any(v in outputs for v in op.outputs):
            continue
        users = set().union(*(readers.get(v, set()) for v in op.outputs))
        if users and users <= taken:
            taken.add(op)
    ops = [op for op in post if op in taken]
    made_here = {v for op in ops for v in op.outputs}
    args = []
    for op in ops:
        for x in op.operands():
            if isinstance(x, ir.Value) and x not in made_here and x not in args:
                args.append(x)
    return SliceCall(ops, args, addend)


def _movable(op):
    """Whether ``op`` may run later and once for every depth: an op of this function's own, with no nested
    SubGraph (the function changes nothing in place)."""
    return not isinstance(op, ir.Invoke) and not list(op.subgraphs())


# What brings a node's own terms into its loss, and with which sign: ``loss + t``, ``loss - t``, and ``loss += t``,
# ``loss -= t`` of a loss the frame made (``passes.fresh``); the two families apart (``+=`` keeps the loss's dtype)
_NODE_TERMS = {operator.add: 1, operator.sub: -1, intrinsics.iadd_fresh: 1, intrinsics.isub_fresh: -1}
_FAMILIES = ({operator.add, operator.sub}, {intrinsics.iadd_fresh, intrinsics.isub_fresh})


def _addends(value, ops, signs=None):
    """``value`` as the list of what is added up to make it through ``a + b`` calls among ``ops`` (a value no
    such call makes is its own one term), left to right, each with the callable that brings it in (None for
    the first). ``signs`` ({callable: 1 or -1}) names other such calls: ``a - b`` brings b in by subtracting it
    (b itself one term)."""
    signs = signs or {operator.add: 1}
    made = {v: op for op in ops for v in op.outputs}
    found, stack = [], [(value, None, True)]
    while stack:
        v, how, descend = stack.pop()
        op = made.get(v)
        fn = op.fn.value if descend and isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) else None
        if fn is not None and facts.among(fn, signs) and ir.is_call(op, fn) and len(op.args) == 2 \
                and len(op.outputs) == 1:
            stack.append((op.args[1], fn, signs[fn] > 0))
            stack.append((op.args[0], how, True))
        else:
            found.append((v, how))
    return found


def _is_zero(x):
    return isinstance(x, ir.Const) and type(x.value) in (int, float) and x.value == 0


_NOT_CONSTANT = object()


def _constant(x):
    """The value of operand ``x`` where it is a constant or a tuple built of constants (``torch.zeros(())``'s
    ``()``), else _NOT_CONSTANT."""
    if isinstance(x, ir.Const):
        return x.value
    if isinstance(x, ir.Value) and ir.is_call(x.op, intrinsics.build_tuple):
        items = [_constant(a) for a in x.op.args]
        return _NOT_CONSTANT if any(a is _NOT_CONSTANT for a in items) else tuple(items)
    if isinstance(x, ir.Value) and ir.is_call(x.op, getattr) \
            and isinstance(effects.resolve(x.op.args[0]), types.ModuleType):
        # (``torch.float64``: a module's, read at build time as ``constructor`` reads ``torch.zeros``; not an
        # object's, which the program may set again)
        value = effects.resolve(x)
        return value if isinstance(value, (torch.dtype, torch.device)) else _NOT_CONSTANT
    return _NOT_CONSTANT


# The constructors whose 0-d zero starts tree sums (not ``torch.empty``: memory that happened to hold 0), and
# the dtypes of such a zero that ``index_add`` sums as eager's ``zero + t`` adds
_ZERO_MAKERS = (torch.zeros, torch.tensor, torch.full)
_ZERO_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                          torch.int32, torch.int64, torch.uint8, torch.bool})


def _absorbs(zero, number):
    """Whether adding Python ``number`` to a leaf's ``zero`` (a number, or a call making a 0-d tensor) keeps its
    type, so that a sum started at ``number`` is the sum started at the leaves' zeros."""
    if callable(zero):
        made = zero()
        return torch.result_type(made, number) == made.dtype
    rank = {bool: 0, int: 1, float: 2}
    return type(number) in rank and type(zero) in rank and rank[type(zero)] >= rank[type(number)]


def _zero_of(x, branch):
    """A leaf branch's output ``x`` as the zero its tree sums start from: ``0``, ``0.0``, or the call that makes
    a 0-d zero tensor of torch constants (``torch.zeros(())``, ``torch.tensor(0.0)``: a ``partial`` a run calls,
    as the branch would, its dtype the default one of then; not -0.0: ``-0.0 + t`` keeps t's sign, where the sums
    start from 0.0), or None."""
    if _is_zero(x):
        return None if type(x.value) is float and math.copysign(1.0, x.value) < 0 else x.value
    op = x.op if isinstance(x, ir.Value) and x.op in branch.ops else None
    fn = None if op is None else constructor(op)
    if fn is None or not facts.among(fn, _ZERO_MAKERS):
        return None
    args, kwargs = [_constant(a) for a in op.args], {k: _constant(v) for k, v in op.kwargs}
    if any(a is _NOT_CONSTANT for a in (*args, *kwargs.values())):
        return None
    zero = functools.partial(fn, *args, **kwargs)
    try:
        made = zero()
        ok = isinstance(made, torch.Tensor) and made.dim() == 0 and made.dtype in _ZERO_DTYPES \
            and made.device.type == "cpu" and not made.requires_grad and bool(made == 0) \
            and not bool(torch.signbit(made))
    except Exception:  # (the program's error: raised when the branch runs, as it was)
        return None
    # (on the CPU: a 0-d CPU zero goes where the losses are, as the sums' rows do)
    return zero if ok else None


def tree_sums(shape, split):
    """The TreeSums of a late split, or None: where every late element ``p`` is, in ``post``, the cond's
    output ``q`` plus deferred results, an invoking branch's output ``q`` the sum of its calls' element
    ``p`` (each once; a sum may start at a zero: ``loss = 0.0``, then ``loss = loss + l`` for each child), and a
    leaf branch's output ``q`` a zero, the element at the root is the sum of its deferred results over the call
    tree."""
    post = [op for op in shape.post if split.is_late(op)]
    deferred = {inv.output: k for k, inv in enumerate(split.deferred)}
    terms, zeros, ops = [], [], []
    for p in split.positions:
        found = _addends(split.elements[p], post, _NODE_TERMS)
        met = {how for _, how in found if how is not None}
        family = next((f for f in _FAMILIES if met <= f), None)
        if family is None:
            return None  # (``+`` and ``+=`` of one element: each adds as its dtype rules say)
        outs = [(x, how) for x, how in found if x not in deferred]
        if len(outs) != 1 or outs[0][0] not in shape.cond.outputs or _NODE_TERMS.get(outs[0][1]) == -1:
            return None
        q = list(shape.cond.outputs).index(outs[0][0])
        zeros.append([])
        dropped = []
        for br, sg, unpacks in zip(shape.branches, shape.cond.subgraphs(), split.unpacks):
            out = sg.outputs[q]
            leaf = br is None or not br.invokes  # (one whose calls are all a helper's: a leaf, ``_as_call``)
            zeros[-1].append(_zero_of(out, sg) if leaf else None)
            if leaf:
                if zeros[-1][-1] is None:
                    return None
                continue
            wanted = sorted(id(u.outputs[p]) for u in unpacks)
            # (a sum started at zero, ``loss = 0.0`` then ``loss = loss + l`` for each child: the calls' elements)
            found_here = _addends(out, [op for op in br.up if split.is_late(op)])
            started = [x for x, how in found_here if _is_zero(x) and _NODE_TERMS.get(how, 1) == 1]
            if sorted(id(x) for x, _ in found_here if x not in started) != wanted:
                return None
            dropped.extend(started)
        if not all(_absorbs(z, x.value) for z in zeros[-1] if z is not None for x in dropped):
            return None  # (``0.0 + l`` of int losses is a float, where the leaves' zero ``0`` keeps them ints)
        if any(_NODE_TERMS.get(how) == -1 for _, how in found) and \
                any(callable(z) and z().dtype is torch.bool for z in zeros[-1]):
            return None  # (``flag - t`` of a bool zero: eager refuses it, one by one)
        terms.append([deferred[x] for x, _ in found if x in deferred])
        adding = operator.add if operator.add in family else intrinsics.iadd_fresh
        ops.append([how or adding for x, how in found if x in deferred])
    return TreeSums(list(split.positions), terms, zeros, ops)


def _yields(op, generators):
    return any(s in generators for s in op.subgraphs())


class SliceCall:
    """Ops of ``post`` (in order) that only make ``output``, an addend of a late element (an inline node loss),
    deferred as if a call: ``args``, the values they read from outside."""

    def __init__(self, ops, args, output):
        self.ops, self.args, self.output = ops, args, output
        self.loc = ops[-1].loc

    def operands(self):
        return list(self.args)


class BranchShape:
    def __init__(self, sg, down, invokes, up):
        self.sg, self.down, self.invokes, self.up = sg, down, invokes, up


class LevelShape:
    def __init__(self, sg, cond, pre, post, branches):
        self.sg, self.cond, self.pre, self.post, self.branches = sg, cond, pre, post, branches
        self.split = None
        self.plain_split = None


class LateSplit:
    """The function's result as ``elements`` (the ``build`` tuple's), the ``late`` values (fed by the
    ``deferred`` calls of ``post``, here and through the self-invokes' results, which ``unpacks`` unpack),
    the ``positions`` of the late elements and the cond's ``late_outputs`` (positions)."""

    def __init__(self, elements, positions, late_outputs, late, build, unpacks, deferred, keys=None):
        self.elements, self.positions, self.late_outputs, self.late = elements, positions, late_outputs, late
        self.build, self.unpacks, self.deferred = build, unpacks, deferred
        self.keys = keys  # (a dict result's keys, in order; None for a tuple)

    def is_late(self, op):
        return not isinstance(op, ir.Invoke) and any(x in self.late for x in op.operands())

    def readers(self, k):
        """The ops of branch ``k`` that take its calls' results apart (unpacks, or reads by key)."""
        return {op for u in self.unpacks[k] for op in (u.ops if isinstance(u, KeyReads) else (u,))}


class TreeSums:
    """Late elements that are sums over the call tree: for each of ``positions``, the indexes (among the
    split's deferred calls, one per time it is added) of the deferred results it adds up, and per branch the
    zero a leaf branch starts from (``0``, ``0.0`` or the call making a 0-d zero tensor: what it adds to the
    result's dtype, as ``0.0 + t``; None for an invoking branch); per position, per term the callable that brings
    it in (``operator.add``, ``operator.sub``, or ``intrinsics.iadd_fresh`` and ``isub_fresh`` for ``loss += t``,
    ``loss -= t``) and its sign (``signs``: -1 where it is subtracted)."""

    def __init__(self, positions, terms, zeros, ops):
        self.positions, self.terms, self.zeros, self.ops = positions, terms, zeros, ops
        self.signs = [[_NODE_TERMS[fn] for fn in fns] for fns in ops]
