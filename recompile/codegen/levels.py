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
"""

from __future__ import annotations

from .. import ir
from ..runtime import levels as rt_levels


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


def emit_pieces(emitter_class, module, gen, batch_plan, shape):
    """Emit ``shape``'s pieces; returns (emitter holding their FunctionDefs, build(namespace) -> LevelProgram)."""
    em = emitter_class(module, gen, batch_plan)
    sg, cond = shape.sg, shape.cond
    base = gen.fn_name[sg]
    after = _values(list(cond.outputs))
    post_live = _live(shape.post, _values(sg.outputs), _defined(sg.inputs, shape.pre))
    post_live = [v for v in post_live if v not in after]
    pre_out = [cond.pred, *cond.args, *post_live]
    names = {"pre": em.piece(f"{base}_lv_pre", sg, shape.pre, list(sg.inputs), pre_out),
             "post": em.piece(f"{base}_lv_post", sg, shape.post, post_live + after, list(sg.outputs))}
    branch_info = []
    for k, br in enumerate(shape.branches):
        if br is None:
            branch_info.append(None)
            continue
        invoke_outs = [inv.output for inv in br.invokes]
        up_live = [v for v in _live(br.up, _values(br.sg.outputs), _defined(br.sg.inputs, br.down))
                   if v not in invoke_outs]
        args = [a for inv in br.invokes for a in inv.args]
        down = em.piece(f"{base}_lv_down{k}", br.sg, br.down, list(br.sg.inputs), args + up_live)
        up = em.piece(f"{base}_lv_up{k}", br.sg, br.up, up_live + invoke_outs, list(br.sg.outputs))
        branch_info.append((down, up, [len(inv.args) for inv in br.invokes]))

    def build(namespace):
        units = [batch_plan.units[b] for b in cond.subgraphs()]
        branches = [None if info is None else rt_levels.Descent(namespace[info[0]], namespace[info[1]], info[2],
                                                                  [inv.target for inv in br.invokes])
                    for info, br in zip(branch_info, shape.branches)]
        prog = rt_levels.LevelProgram(batch_plan.units[sg], namespace[names["pre"]], namespace[names["post"]],
                                      units, branches, len(cond.args), len(cond.outputs))
        prog.segments = list(em.segments.values())  # (the pieces' raw segments: tests, inspection)
        return prog

    return em, build
