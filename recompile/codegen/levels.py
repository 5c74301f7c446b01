"""Level programs: a recursion whose call tree its arguments decide, cut into pieces run depth by depth.

A function qualifies when it changes nothing in place and its body is

    pre ops ; cond pred (branches) ; post ops (calls of other functions only deferred)

where each branch either invokes nothing (a *leaf* branch) or invokes the
function itself, with arguments computed from the branch's own inputs, not
from another invoke's result (``tree.left[i]``, ``tree.right[i]``). Its call
tree is then known before any result is: ``runtime.levels`` walks it down
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

import ast

from .. import ir
from ..runtime import levels as rt_levels


def shape_of(sg, batch_plan, changes):
    """The LevelShape of function SubGraph ``sg``, or None where it does not qualify."""
    if changes:
        return None
    generators = batch_plan.generators
    conds = [op for op in sg.ops if isinstance(op, ir.Cond) and any(s in generators for s in op.subgraphs())]
    if len(conds) != 1:
        return None
    cond = conds[0]
    at = sg.ops.index(cond)
    pre, post = sg.ops[:at], sg.ops[at + 1:]
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
        invokes = [op for op in b.ops if isinstance(op, ir.Invoke)]
        if any(op.callee != sg.name for op in invokes) or any(_yields(op, generators) for op in b.ops):
            return None
        needed = {x for op in invokes for x in op.operands() if isinstance(x, ir.Value)}
        down = set()
        for op in reversed(b.ops):
            if not isinstance(op, ir.Invoke) and any(v in needed for v in op.outputs):
                down.add(op)
                needed.update(x for x in op.operands() if isinstance(x, ir.Value))
        if any(inv.output in needed for inv in invokes):
            return None  # an argument reads another call's result: the tree is not known on the way down
        branches.append(BranchShape(b, [op for op in b.ops if op in down], invokes,
                                    [op for op in b.ops if op not in down and not isinstance(op, ir.Invoke)]))
    if all(br is None for br in branches):
        return None
    return LevelShape(sg, cond, pre, post, branches)


def _yields(op, generators):
    return any(s in generators for s in op.subgraphs())


class BranchShape:
    def __init__(self, sg, down, invokes, up):
        self.sg, self.down, self.invokes, self.up = sg, down, invokes, up


class LevelShape:
    def __init__(self, sg, cond, pre, post, branches):
        self.sg, self.cond, self.pre, self.post, self.branches = sg, cond, pre, post, branches


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


def piece_function(em, name, sg, ops, inputs, outputs):
    """``def name(_n, *inputs): <ops>; return (*outputs,)`` with ``em``'s batched statements."""
    em.current = None  # (no Cond of a piece yields its branches: they run inline)
    em.live_out = set(_values(outputs))
    try:
        stmts = em.body(sg, em.plan_items(ops))
    finally:
        em.live_out = None
    ret = ast.Return(value=ast.Tuple(elts=[em.load(v) for v in outputs], ctx=ast.Load()))
    ret._rc_loc = ops[-1].loc if ops else sg.loc
    params = [ast.arg(arg=em.n)] + [ast.arg(arg=em.var(v)) for v in inputs]
    fdef = ast.FunctionDef(name=name, args=ast.arguments(posonlyargs=[], args=params, vararg=None, kwonlyargs=[],
                                                         kw_defaults=[], kwarg=None, defaults=[]),
                           body=stmts + [ret], decorator_list=[], returns=None, type_comment=None)
    fdef._rc_loc = ops[0].loc if ops else sg.loc
    return fdef
