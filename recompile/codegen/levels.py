"""Level programs: a recursion whose call tree its arguments decide, cut into pieces run depth by depth.

Which functions qualify is ``passes.levels``'s to say. Their call
tree is known before any result is: ``runtime.levels`` walks it down
depth by depth running only what the calls' arguments need, runs each leaf
branch once for every depth, and comes back up running the rest of each depth
once. That is the schedule the agenda finds by itself for such a function,
without its per-frame bookkeeping.

The pieces are plain batched functions (``codegen.batched``), emitted from the
function's own ops:

- ``pre(_n, *inputs) -> (pred, *cond args, *live)``: the ops before the cond;
- per invoking branch, ``down(_n, *branch inputs) -> (*each invoke's args, *live)``:
  the ops the invokes' arguments need, and ``up(_n, *live, *invoke results) ->
  branch outputs``: the others, in their order;
- ``post(_n, *live, *cond outputs) -> outputs``: the ops after the cond, where a
  deferrable call is answered at once with a lazy value (``runtime.levels.defer``).

With a late split (``passes.levels.LateSplit``) the function's result is its
tuple's elements, each self-invoke's result is its elements (its unpacking is
not emitted), and ``up`` and ``post`` are each cut in two: the first half
(``up``, ``post``) computes the elements that are not late and hands on what
the second (``up_late``, ``post_late``) reads; ``post`` only collects the
deferred calls' arguments (``runtime.levels.collect``), and ``post_late``
takes their results after them.
"""

from __future__ import annotations

from .. import config, ir
from ..passes.levels import SliceCall
from ..runtime import levels as rt_levels
from . import segments


def _values(xs):
    return [x for x in xs if isinstance(x, ir.Value)]


def _live(ops, outputs, available):
    """Values of ``available`` (in its order) that ``ops`` or ``outputs`` read."""
    read = {x for op in ops for x in op.operands()} | set(outputs)
    return [v for v in available if v in read]


def _defined(inputs, ops):
    seen, out = set(), []
    for v in list(inputs) + [v for op in ops for v in op.outputs]:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _post_live(shape):
    """What ``post`` reads of the function's inputs and ``pre``'s values (the cond's outputs apart), in order."""
    after = _values(list(shape.cond.outputs))
    return [v for v in _live(shape.post, _values(shape.sg.outputs), _defined(shape.sg.inputs, shape.pre))
            if v not in after]


def _branch_values(br):
    """An invoking branch's calls' arguments, and what its ``up`` reads of its inputs and ``down``'s values."""
    invoke_outs = [inv.output for inv in br.invokes]
    up_live = [v for v in _live(br.up, _values(br.sg.outputs), _defined(br.sg.inputs, br.down))
               if v not in invoke_outs]
    return [a for inv in br.invokes for a in inv.args], up_live


def _early_inputs(split, k):
    """With a late split, the elements of branch ``k``'s calls' results that are not late, call by call."""
    return [u.outputs[j] for u in split.unpacks[k] for j in range(len(split.elements)) if j not in split.positions]


def emit_pieces(emitter_class, module, emission, batch_plan, shape):
    """Emit ``shape``'s pieces; returns (emitter holding their FunctionDefs, build(namespace) -> LevelProgram)."""
    em = emitter_class(module, emission, batch_plan)
    sg, cond, split = shape.sg, shape.cond, shape.split
    base = emission.fn_name[sg]
    after = _values(list(cond.outputs))
    post_live = _post_live(shape)
    pre_out = [cond.pred, *cond.args, *post_live]
    names = {"pre": em.piece(f"{base}_lv_pre", sg, shape.pre, list(sg.inputs), pre_out)}
    if split is None:
        names["post"] = em.piece(f"{base}_lv_post", sg, shape.post, post_live + after, list(sg.outputs))
    else:
        early_out = [out for j, out in enumerate(cond.outputs) if j not in split.late_outputs]
        late_out = [cond.outputs[j] for j in split.late_outputs]
        results = [inv.output for inv in split.deferred]
        names["post"], names["post_late"] = _halves(
            em, f"{base}_lv_post", sg, [op for op in shape.post if op is not split.build], split,
            post_live + early_out, split.elements, late_out + results, at_late=split.positions,
            collected=split.deferred)
    branch_info = []
    for k, br in enumerate(shape.branches):
        if br is None:
            branch_info.append(None)
            continue
        args, up_live = _branch_values(br)
        down = em.piece(f"{base}_lv_down{k}", br.sg, br.down, list(br.sg.inputs), args + up_live)
        if split is None:
            up = em.piece(f"{base}_lv_up{k}", br.sg, br.up, up_live + [inv.output for inv in br.invokes],
                          list(br.sg.outputs))
            branch_info.append((down, up, None, [len(inv.args) for inv in br.invokes]))
            continue
        unpacks, readers = split.unpacks[k], split.readers(k)
        early_in = _early_inputs(split, k)
        late_in = [u.outputs[j] for u in unpacks for j in split.positions]
        up, up_late = _halves(em, f"{base}_lv_up{k}", br.sg, [op for op in br.up if op not in readers], split,
                              up_live + early_in, list(br.sg.outputs), late_in, at_late=split.late_outputs)
        branch_info.append((down, up, up_late, [len(inv.args) for inv in br.invokes]))

    plain = _plain_pieces(em, shape)

    def build(namespace):
        units = [emission.units[b] for b in cond.subgraphs()]
        branches = [None if info is None else rt_levels.Descent(
                        namespace[info[0]], namespace[info[1]], info[3], [inv.target for inv in br.invokes],
                        namespace[info[2]] if info[2] else None, [inv.loc for inv in br.invokes])
                    for info, br in zip(branch_info, shape.branches)]
        late = None
        if split is not None:
            late = rt_levels.Late(namespace[names["post_late"]], len(split.elements), split.positions,
                                  split.late_outputs, len(cond.outputs), len(split.deferred), split.sums, split.keys)
        prog = rt_levels.LevelProgram(emission.units[sg], namespace[names["pre"]], namespace[names["post"]],
                                      units, branches, len(cond.args), len(cond.outputs), late)
        prog.segments = list(em.segments.values())  # (the pieces' raw segments: tests, inspection)
        prog.plain = plain
        if plain is not None:
            plain.branches = [None if leaf is not None else d for leaf, d in zip(plain.leaves, branches)]
        prog.site = cond.loc
        return prog

    return em, build


def _halves(em, name, sg, ops, split, inputs, outputs, late_inputs, at_late, collected=None):
    """A piece's ops cut in two: ``name(_n, *inputs) -> (*outputs not at_late, *live)`` runs the ops
    reading no late value, ``name_late(_n, *live, *late_inputs) -> outputs at_late`` the others, ``live``
    being what the second reads of the first's values. Returns both names."""
    late_ops = [op for op in ops if split.is_late(op)]
    early_ops = [op for op in ops if op not in late_ops]
    late_outputs = [outputs[j] for j in at_late]
    needed = _live(late_ops, late_outputs, _defined(inputs, early_ops))
    live = [v for v in needed if v not in split.late]
    early = em.piece(name, sg, early_ops, inputs, [o for j, o in enumerate(outputs) if j not in at_late] + live,
                     collected)
    late = em.piece(name + "_late", sg, late_ops, live + late_inputs, late_outputs)
    return early, late


def _fused_within(ops):
    """The fused ops of ``ops`` and of the SubGraphs nested in them."""
    for op in ops:
        if isinstance(op, ir.Fused):
            yield op
        for sg in op.subgraphs():
            yield from (inner for s in sg.walk() for inner in s.ops if isinstance(inner, ir.Fused))


def _plain_pieces(em, shape):
    """The pieces again as ``segments.Plain`` (run on plain tensors by ``runtime.levels``), or None: where the
    function has no late split and ``post`` calls nothing, or its late elements are tree sums (``post``
    then hands on the deferred calls' arguments, which run once, and the late halves are not needed). Its
    split is ``shape.plain_split``: an inline node loss's ops are deferred there too, each as a piece of its own
    (``passes.levels.SliceCall``)."""
    sg, cond, split = shape.sg, shape.cond, shape.plain_split
    if not config.SEGMENTS:
        return None
    deferred = [] if split is None else split.deferred
    if split is None and any(isinstance(op, ir.Invoke) for op in shape.post) \
            or split is not None and (split.sums is None or not config.TREE_SUMS):  # (``Late`` reads it too)
        return None

    def piece(name, ops, inputs, outputs, hands_numbers=False):
        # (a leaf branch's fused ops were emitted with its SubGraph's function, and those of a Cond's branches
        # with theirs (a trace runs the branch taken inline): their kernels are made here)
        kernels = {op: em.kernels[op] if op in em.kernels else em.fused_kernel(op) for op in _fused_within(ops)}
        return segments.Plain(name, ops, inputs, outputs, kernels, hands_numbers)

    base = em.emission.fn_name[sg]
    after = _values(list(cond.outputs))
    post_live = _post_live(shape)
    pre = piece(f"{base}_lv_pre", shape.pre, list(sg.inputs), [cond.pred, *cond.args, *post_live], True)
    early = list(range(len(cond.outputs))) if split is None else \
        [j for j in range(len(cond.outputs)) if j not in split.late_outputs]
    if split is None:
        post = piece(f"{base}_lv_post", shape.post, post_live + after, list(sg.outputs))
    else:
        sliced = {op for sl in deferred if isinstance(sl, SliceCall) for op in sl.ops}
        ops = [op for op in shape.post if op is not split.build and not isinstance(op, ir.Invoke)
               and not split.is_late(op) and op not in sliced]
        elements = [e for j, e in enumerate(split.elements) if j not in split.positions]
        post = piece(f"{base}_lv_post", ops, post_live + [cond.outputs[j] for j in early],
                     elements + [a for inv in deferred for a in inv.args])
    downs, ups, leaves = [], [], []
    for k, (br, b) in enumerate(zip(shape.branches, cond.subgraphs())):
        # (a branch whose calls are all of other functions, run as helpers (``passes.levels._as_call``), is a
        # leaf branch here: run once for every depth's requests, not as a way up with no children per depth)
        leaf_ops = b.ops if br is None else None if br.invokes else br.up
        leaves.append(None if leaf_ops is None else
                      piece(f"{base}_lv_leaf{k}", leaf_ops, list(b.inputs), [b.outputs[j] for j in early]))
        if leaf_ops is not None:
            downs.append(None)
            ups.append(None)
            continue
        args, up_live = _branch_values(br)
        downs.append(piece(f"{base}_lv_down{k}", br.down, list(br.sg.inputs), args + up_live, True))
        if split is None:
            ups.append(piece(f"{base}_lv_up{k}", br.up, up_live + [inv.output for inv in br.invokes],
                             list(br.sg.outputs)))
            continue
        readers = split.readers(k)
        ops = [op for op in br.up if op not in readers and not split.is_late(op)]
        ups.append(piece(f"{base}_lv_up{k}", ops, up_live + _early_inputs(split, k), [br.sg.outputs[j] for j in early]))
    calls = [(piece(f"{base}_lv_slice{j}", inv.ops, inv.args, [inv.output]) if isinstance(inv, SliceCall)
              else inv.target, len(inv.args), inv.loc) for j, inv in enumerate(deferred)]
    late = None if split is None else rt_levels.Late(None, len(split.elements), split.positions,
                                                     split.late_outputs, len(cond.outputs), len(deferred),
                                                     split.sums, split.keys)
    return rt_levels.PlainPieces(pre, downs, ups, leaves, post, early, calls, late,
                                 frozenset(j for j, inv in enumerate(deferred) if isinstance(inv, SliceCall)))
