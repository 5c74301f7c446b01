"""Batched code: one Python function per SubGraph, running it for ``_n`` instances at once.

The same statements as sequential code (``codegen.emit``), with three changes:
every ``Call`` goes through ``batch_rules.call(_n, fn, args, kwargs)``; a Cond
splits the instances by predicate and joins the branches' results (a Cond in a
SubGraph that invokes yields its branches to the scheduler, to be merged with
other frames'); a While runs while any instance is active. Invoke groups yield
``((callee, args, count, site), ...)`` as Cond branches do.
"""

from __future__ import annotations

import ast
import operator

from .. import config, intrinsics, ir
from ..passes import aliasing, fission
from ..passes.batching import BatchPlan
from ..passes.effects import frame_cells, local_appends, subgraph_may_mutate
from ..passes.levels import level_shape
from ..runtime import batch_rules, control, levels as rt_levels, ranges, split_loops
from ..runtime.units import Unit
from . import emit, levels, recurrent, segments
from .loader import Module, locate
from .plan import plan


class _BatchedEmitter(emit.FunctionEmitter):
    def __init__(self, module, emission, batch_plan):
        super().__init__(module, emission)
        self.batch_plan = batch_plan
        self.kernels = {}  # Fused op -> its kernel (a segment's trace runs the very kernel its code calls)
        self.extra_defs = []  # the segments' op-by-op functions
        self.segments = {}  # function name -> Segment
        self.live_out = None  # a level piece's outputs (codegen.levels): what its last segment must hand on
        self.recurrent = []  # codegen.recurrent.RecurrentLoop of each loop run as one RNN where it can
        self.guarded = {}  # an if around a call of a split loop, in its second pass: its side making the call
        self.n = "_n"
        self.names.reserve(self.n)

    def helper(self, fn, hint):
        return ast.Name(id=self.module.ref(fn, hint), ctx=ast.Load())

    def n_load(self):
        return ast.Name(id=self.n, ctx=ast.Load())

    def call_expr(self, op):
        if op.star or any(k is None for k, _ in op.kwargs):
            # f(*xs, **kw): the whole call per instance (the unpacking itself may differ between them)
            inner = super().call_expr(op)
            fn = ast.Lambda(args=_no_args(), body=inner)
            return self._per_instance_thunk(op, fn, self.load(op.fn))
        fn = op.fn.value if isinstance(op.fn, ir.Const) else None
        if not op.kwargs and len(op.args) == 2 and (fn is getattr and isinstance(op.args[1], ir.Const)
                                                     or fn is operator.getitem):
            helper = batch_rules.attr if fn is getattr else batch_rules.item
            return ast.Call(func=self.helper(helper, helper.__name__),
                            args=[self.n_load(), *[self.load(a) for a in op.args]], keywords=[])
        args = ast.Tuple(elts=[self.load(a) for a in op.args], ctx=ast.Load())
        call_args = [self.n_load(), self.load(op.fn), args]
        if op.kwargs:
            call_args.append(ast.Dict(keys=[ast.Constant(value=k) for k, _ in op.kwargs],
                                      values=[self.load(v) for _, v in op.kwargs]))
        return ast.Call(func=self.helper(batch_rules.call, "call"), args=call_args, keywords=[])

    def _per_instance_thunk(self, op, fn, callee):
        names = sorted({self.var(v) for v in op.operands() if isinstance(v, ir.Value)})
        params = ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in names], vararg=None, kwonlyargs=[],
                               kw_defaults=[], kwarg=None, defaults=[])
        fn.args = params
        values = ast.Tuple(elts=[ast.Name(id=n, ctx=ast.Load()) for n in names], ctx=ast.Load())
        return ast.Call(func=self.helper(batch_rules.per_instance_or_once, "per_instance"),
                        args=[self.n_load(), fn, values, callee], keywords=[])

    def fused_kernel(self, op):
        kernel = super().fused_kernel(op)
        self.kernels[op] = kernel
        return kernel

    def body(self, sg, items):
        """Maximal runs of plain ops (calls, captures, fused ops) become ``segments.Segment`` calls, in a
        function that changes nothing in place but its own lists (whose appends no segment holds), each run ending
        where a walk draws an iterator's items; the rest as ``emit`` writes it."""
        if self.emission.changes or not config.SEGMENTS:
            return super().body(sg, items)
        used_after = [set() for _ in range(len(items) + 1)]
        used_after[-1] = self.live_out if self.live_out is not None else \
            {v for v in sg.outputs if isinstance(v, ir.Value)}
        for k in range(len(items) - 1, -1, -1):
            ops = items[k] if isinstance(items[k], list) else [items[k]]
            used_after[k] = used_after[k + 1] | {x for op in ops for x in op.operands() if isinstance(x, ir.Value)}
        out, run = [], []
        for k, item in enumerate(items + [None]):
            if item is not None and _segmentable(item) and item not in self.emission.kept_out \
                    and not segments.draws_items(item):
                run.append(item)
                continue
            if sum(_dispatches(op) for op in run) >= 2:
                out.append(self.segment(sg, run, used_after[k]))
            else:
                out.extend(super().body(sg, run))
            run = []
            if item is not None:
                out.extend(super().body(sg, [item]))
        return out

    def segment(self, sg, ops, used_after):
        """``outs = _rc_seg(_n, ins)``, and the function running ``ops`` one by one (``extra_defs``)."""
        defined, inputs = set(), []
        for op in ops:
            for x in op.operands():
                if isinstance(x, ir.Value) and x not in defined and x not in inputs:
                    inputs.append(x)
            defined.update(op.outputs)
        outputs = [v for op in ops for v in op.outputs if v in used_after]
        stmts = super().body(sg, ops)
        # (a level piece's emitter numbers its segments for the same SubGraph: the names still differ)
        fn_name = self.emission.fn_name[sg]
        name = self.emission.extra_names.fresh(f"{fn_name}_seg{len(self.extra_defs) + 1}")
        kernels = {op: self.kernels[op] for op in ops if isinstance(op, ir.Fused)}
        seg = segments.Segment(name, ops, inputs, outputs, kernels)
        self.segments[name] = seg
        self.extra_def(name, inputs, stmts, outputs, ops[0].loc, ops[-1].loc, as_tuple=False)
        call = ast.Call(func=self.helper(seg, "seg"), args=[self.n_load()] + [self.load(v) for v in inputs],
                        keywords=[])
        return self.assign(outputs, call, ops[0].loc, unpack=len(outputs) > 1)

    def extra_def(self, name, inputs, stmts, outputs, loc, last_loc, as_tuple):
        """``def name(_n, *inputs): stmts; return outputs`` into ``extra_defs`` (one output bare unless
        ``as_tuple``)."""
        loads = [self.load(v) for v in outputs]
        ret = ast.Return(value=loads[0] if len(loads) == 1 and not as_tuple else ast.Tuple(elts=loads, ctx=ast.Load()))
        locate(ret, last_loc)
        params = [ast.arg(arg=self.n)] + [ast.arg(arg=self.var(v)) for v in inputs]
        fdef = ast.FunctionDef(name=name, args=ast.arguments(posonlyargs=[], args=params, vararg=None, kwonlyargs=[],
                                                             kw_defaults=[], kwarg=None, defaults=[]),
                               body=stmts + [ret], decorator_list=[], returns=None, type_comment=None)
        locate(fdef, loc)
        self.extra_defs.append(fdef)

    def fused_members(self, op):
        code = generate_batched(op.body)  # (batch_rules.fused: when one call would not mean the same)
        self.module.attach(code)
        return code

    def fused_stmts(self, op):
        kernel = self.fused_kernel(op)
        call = ast.Call(func=self.helper(batch_rules.fused, "fused"),
                        args=[self.n_load(), self.helper(kernel, kernel.name),
                              ast.Tuple(elts=[self.load(a) for a in op.args], ctx=ast.Load())], keywords=[])
        return [self.assign(op.outputs, call, op.loc, unpack=len(op.outputs) > 1)]

    def op_stmts(self, op):
        if isinstance(op, ir.Call):
            if isinstance(op.fn, ir.Const) and op.fn.value is intrinsics.raise_exception:
                return [self.assign([], self.call_expr(op), op.loc)]
            if len(op.outputs) > 1 or (isinstance(op.fn, ir.Const) and op.fn.value is intrinsics.unpack):
                value = self.call_expr(op) if not (isinstance(op.fn, ir.Const) and op.fn.value is intrinsics.unpack) \
                    else self.load(op.args[0])
                unpacked = ast.Call(func=self.helper(control.unpack, "unpack"),
                                    args=[self.n_load(), value, ast.Constant(value=len(op.outputs))], keywords=[])
                return [self.assign(op.outputs, unpacked, op.loc, unpack=True)]
            return [self.assign(op.outputs, self.call_expr(op), op.loc)]
        if isinstance(op, ir.Capture) and op.source_kind == "attr":
            value = ast.Call(func=self.helper(batch_rules.attr, "attr"),
                             args=[self.n_load(), self.load(op.base), ast.Constant(value=op.source)], keywords=[])
            return [self.assign(op.outputs, value, op.loc)]
        if isinstance(op, ir.Cond):
            return self.guarded_cond(op) if op in self.guarded else self.cond_stmts(op)
        if isinstance(op, fission.BlockCalls):
            return self.block_calls(op)
        if isinstance(op, ir.While):
            return self.while_stmts(op)
        return super().op_stmts(op)

    def results(self, outputs, value, loc):
        """``outputs = value`` where value is the tuple of a nested SubGraph's outputs."""
        if not outputs:
            return self.assign([], value, loc)
        return self.assign(outputs, value, loc, unpack=len(outputs) > 1)

    def changes(self, op):
        """``True`` for a Cond or While of a function that may change a value in place (``passes.effects``),
        in a branch or after it: the sides of a split then copy their changed rows back, and a side handing
        on its rows of an argument hands on the argument (``control.write_back``); then whether a change in
        place may reach what it hands on afterwards, and what it is given (``passes.aliasing``): where none
        can, a copy handed on serves as the argument's rows, and a copy read needs no note."""
        reached = self.emission.reached
        return [ast.Constant(value=self.emission.changes), ast.Constant(value=op in reached.outputs),
                ast.Constant(value=op in reached.operands)]

    def cond_stmts(self, op):
        branch = ast.Call(func=self.helper(control.Branch, "Branch"),
                          args=[self.n_load(), self.load(op.pred),
                                ast.Tuple(elts=[self.load(a) for a in op.args], ctx=ast.Load()),
                                *self.changes(op)], keywords=[])
        b = self.var(ir.Value("_branch"))
        first = ast.Assign(targets=[ast.Name(id=b, ctx=ast.Store())], value=branch)
        locate(first, op.loc)
        if self.batch_plan.yields_branches(op):
            units = [self.helper(self.emission.units[s], "unit_" + s.name) for s in op.subgraphs()]
            request = ast.Call(func=ast.Attribute(value=ast.Name(id=b, ctx=ast.Load()), attr="requests",
                                                  ctx=ast.Load()),
                               args=[*units, self.helper(op.loc, "site")], keywords=[])
            ran = ast.Yield(value=request)
        else:
            fns = [ast.Name(id=self.emission.fn_name[s], ctx=ast.Load()) for s in op.subgraphs()]
            ran = ast.Call(func=ast.Attribute(value=ast.Name(id=b, ctx=ast.Load()), attr="run", ctx=ast.Load()),
                           args=fns, keywords=[])
        joined = ast.Call(func=ast.Attribute(value=ast.Name(id=b, ctx=ast.Load()), attr="join", ctx=ast.Load()),
                          args=[ran, ast.Constant(value=len(op.outputs))], keywords=[])
        return [first, self.results(op.outputs, joined, op.loc)]

    def while_stmts(self, op):
        found = fission.split(op, self.emission.appends, self.emission.may_mutate) \
            if not self.emission.changes and op.body_sg in self.batch_plan.generators else None
        if found is not None:
            return self.split_loop(found)
        loop = self.var(ir.Value("_loop"))
        carried = ast.Tuple(elts=[self.load(v) for v in op.loop_vars] + [self.load(v) for v in op.invariants],
                            ctx=ast.Load())
        start = ast.Assign(targets=[ast.Name(id=loop, ctx=ast.Store())],
                           value=ast.Call(func=self.helper(control.Loop, "Loop"),
                                          args=[self.n_load(), carried, ast.Constant(value=len(op.loop_vars)),
                                                *self.changes(op)],
                                          keywords=[]))
        locate(start, op.loc)

        def run(sg):
            call = ast.Call(func=ast.Name(id=self.emission.fn_name[sg], ctx=ast.Load()),
                            args=[ast.Attribute(value=ast.Name(id=loop, ctx=ast.Load()), attr="n", ctx=ast.Load()),
                                  ast.Starred(value=ast.Attribute(value=ast.Name(id=loop, ctx=ast.Load()),
                                                                  attr="carried", ctx=ast.Load()),
                                              ctx=ast.Load())], keywords=[])
            return ast.YieldFrom(value=call) if sg in self.batch_plan.generators else call

        def method(name, arg):
            return ast.Call(func=ast.Attribute(value=ast.Name(id=loop, ctx=ast.Load()), attr=name, ctx=ast.Load()),
                            args=[arg], keywords=[])

        ordered = self.ordered(op, loop)
        step = ast.Expr(value=method("step", run(op.body_sg)))
        locate(step, op.loc)
        body = ast.While(test=method("keep", run(op.cond_sg)), body=[step], orelse=[])
        locate(body, op.loc)
        result = ast.Call(func=ast.Attribute(value=ast.Name(id=loop, ctx=ast.Load()), attr="result", ctx=ast.Load()),
                          args=[], keywords=[])
        written = [start, *ordered, body] + ([self.results(op.outputs, result, op.loc)] if op.outputs else [])
        return self.as_one_rnn(op, written)

    def split_loop(self, found):
        """A loop whose calls wait for nothing it computes after them (``passes.fission``), in two passes
        (``runtime.split_loops``): the first runs its test and ``pre``, then every iteration's calls are asked
        for at once, then the second runs ``post``."""
        op, body = found.op, found.op.body_sg
        k = len(op.loop_vars)
        later = [body.inputs[j] for j in found.later]
        pre_out = [body.outputs[j] if j not in found.later else ir.Const(None) for j in range(k)]
        pre_out += [x for c in found.calls for x in ([c.guard[0].pred] if c.guard else []) + c.args] + found.crossing
        pre = self.plain_piece(body, "pre", found.pre, body.inputs, pre_out, as_tuple=True)
        prepares = [ast.Name(id=self.plain_piece(c.guard[0].subgraphs()[c.guard[1]], "args", c.prepare, c.given,
                                                 c.invoke.args, as_tuple=True), ctx=ast.Load())
                    if c.guard else ast.Constant(value=None) for c in found.calls]
        saved, self.guarded = self.guarded, {c.guard[0]: (c.guard[1], c.invoke) for c in found.calls if c.guard}
        try:
            post = self.plain_piece(body, "post", found.post, later + body.inputs[k:] + found.crossing +
                                    [c.invoke.output for c in found.calls],
                                    [body.outputs[j] for j in found.later], as_tuple=False)
        finally:
            self.guarded = saved
        name = self.var(ir.Value("_split"))

        def at(attr):
            return ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr=attr, ctx=ast.Load())

        def method(attr, *args):
            return ast.Call(func=at(attr), args=list(args), keywords=[])

        def call(fn):
            return ast.Call(func=ast.Name(id=fn, ctx=ast.Load()),
                            args=[at("n"), ast.Starred(value=at("carried"), ctx=ast.Load())], keywords=[])

        start = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Call(
            func=self.helper(split_loops.SplitLoop, "SplitLoop"),
            args=[self.n_load(), ast.Tuple(elts=[self.load(v) for v in op.loop_vars + op.invariants], ctx=ast.Load()),
                  ast.Constant(value=k), ast.Constant(value=tuple(found.later)),
                  ast.Constant(value=tuple(len(c.args) for c in found.calls)),
                  ast.Constant(value=tuple(c.guard[1] if c.guard else None for c in found.calls)),
                  ast.Tuple(elts=prepares, ctx=ast.Load()), ast.Constant(value=fission.at_once(found))], keywords=[]))
        first = ast.While(test=method("keep", call(self.emission.fn_name[op.cond_sg])),
                          body=[ast.Expr(value=method("step", call(pre)))], orelse=[])
        asked, got = self.var(ir.Value("_asked")), self.var(ir.Value("_got"))
        # (each call's target and site; its arguments and count are the first pass's: not this class's request)
        calls = ast.Tuple(elts=[ast.Tuple(elts=[t, s], ctx=ast.Load()) for t, _, s in
                                (emit.FunctionEmitter.request(self, c.invoke) for c in found.calls)], ctx=ast.Load())
        ask = ast.Assign(targets=[ast.Name(id=asked, ctx=ast.Store())], value=method("requests", calls))
        answer = ast.Assign(targets=[ast.Name(id=got, ctx=ast.Store())], value=ast.IfExp(
            test=ast.Name(id=asked, ctx=ast.Load()), body=ast.Yield(value=ast.Name(id=asked, ctx=ast.Load())),
            orelse=ast.Tuple(elts=[], ctx=ast.Load())))
        # (where each instance's trip count is known as the loop starts, both passes take the instances longest
        # first, so that those that stay at each step are the first rows: views, no gather)
        stmts = [start, *self.ordered(op, name), first, ask, answer]
        for stmt in stmts:
            locate(stmt, op.loc)
        finish = method("finish", ast.Name(id=got, ctx=ast.Load()), ast.Name(id=post, ctx=ast.Load()))
        return stmts + ([self.results(op.outputs, finish, op.loc)] if op.outputs else [self.assign([], finish, op.loc)])

    def items(self, sg):
        """A block whose calls, some in ``if``s of their own, wait for nothing it computes after them
        (``passes.fission.split_block``): the ops computing their tests and arguments, the calls asked for at
        once (``block_calls``), the rest in order, each such ``if`` given its call's results (``guarded_cond``)."""
        found = self.emission.blocks.get(sg)
        if found is None:
            return super().items(sg)
        self.guarded.update((c.guard[0], (c.guard[1], c.invoke)) for c in found.ask.calls if c.guard)
        return found.pre + [found.ask] + plan(found.rest, self.emission.may_mutate)

    def block_calls(self, ask):
        """``_block = BlockCalls(_n)``, each call's arguments added (those under an ``if`` for the instances its
        test sends there), every call asked for in one yield, and each Invoke's output its results."""
        block = self.var(ir.Value("_block"))

        def method(attr, *args):
            return ast.Expr(value=ast.Call(func=ast.Attribute(value=ast.Name(id=block, ctx=ast.Load()), attr=attr,
                                                              ctx=ast.Load()), args=list(args), keywords=[]))

        def loads(values):
            return ast.Tuple(elts=[self.load(v) for v in values], ctx=ast.Load())

        stmts = [ast.Assign(targets=[ast.Name(id=block, ctx=ast.Store())],
                            value=ast.Call(func=self.helper(split_loops.BlockCalls, "BlockCalls"),
                                           args=[self.n_load()], keywords=[]))]
        for c in ask.calls:
            if c.guard is None:
                stmts.append(method("add", loads(c.args)))
                continue
            cond, which = c.guard
            prepare = self.plain_piece(cond.subgraphs()[which], "args", c.prepare, c.given, c.invoke.args,
                                       as_tuple=True)
            stmts.append(method("guarded", self.load(cond.pred), ast.Constant(value=which),
                                ast.Name(id=prepare, ctx=ast.Load()), loads(c.args)))
        asked = self.var(ir.Value("_asked"))
        calls = ast.Tuple(elts=[ast.Tuple(elts=[t, s], ctx=ast.Load()) for t, _, s in
                                (emit.FunctionEmitter.request(self, c.invoke) for c in ask.calls)], ctx=ast.Load())
        stmts.append(ast.Assign(targets=[ast.Name(id=asked, ctx=ast.Store())], value=method("requests", calls).value))
        got = ast.IfExp(test=ast.Name(id=asked, ctx=ast.Load()), body=ast.Yield(value=ast.Name(id=asked,
                                                                                                ctx=ast.Load())),
                        orelse=ast.Tuple(elts=[], ctx=ast.Load()))
        stmts.append(self.assign(ask.outputs, method("results", got).value, ask.loc, unpack=True))
        for stmt in stmts:
            locate(stmt, ask.loc)
        return stmts

    def guarded_cond(self, op):
        """An ``if`` around a call of a split loop, in its second pass: the side making the call gets its results
        (``runtime.split_loops.guarded_run``)."""
        which, invoke = self.guarded[op]
        side, other = op.subgraphs()[which], op.subgraphs()[1 - which]
        called = self.plain_piece(side, "called", [o for o in side.ops if o is not invoke],
                                  side.inputs + [invoke.output], side.outputs, as_tuple=False)
        b = self.var(ir.Value("_branch"))
        first = ast.Assign(targets=[ast.Name(id=b, ctx=ast.Store())], value=ast.Call(
            func=self.helper(control.Branch, "Branch"),
            args=[self.n_load(), self.load(op.pred), ast.Tuple(elts=[self.load(a) for a in op.args], ctx=ast.Load()),
                  *self.changes(op)], keywords=[]))
        locate(first, op.loc)
        ran = ast.Call(func=self.helper(split_loops.guarded_run, "guarded_run"), args=[
            ast.Name(id=b, ctx=ast.Load()), ast.Constant(value=which), ast.Name(id=called, ctx=ast.Load()),
            ast.Name(id=self.emission.fn_name[other], ctx=ast.Load()),
            ast.Tuple(elts=[self.load(invoke.output)], ctx=ast.Load())], keywords=[])
        joined = ast.Call(func=ast.Attribute(value=ast.Name(id=b, ctx=ast.Load()), attr="join", ctx=ast.Load()),
                          args=[ran, ast.Constant(value=len(op.outputs))], keywords=[])
        return [first, self.results(op.outputs, joined, op.loc)]

    def plain_piece(self, sg, name, ops, inputs, outputs, as_tuple):
        """``def name(_n, *inputs): ops; return outputs`` of some of SubGraph ``sg``'s ops, none yielding."""
        fn = self.emission.extra_names.fresh(f"{self.emission.fn_name[sg]}_{name}")
        saved = self.current, self.live_out
        self.current, self.live_out = None, {v for v in outputs if isinstance(v, ir.Value)}
        try:
            stmts = self.body(sg, plan(ops, self.emission.may_mutate))
        finally:
            self.current, self.live_out = saved
        self.extra_def(fn, inputs, stmts, outputs, ops[0].loc if ops else sg.loc, ops[-1].loc if ops else sg.loc,
                       as_tuple)
        return fn

    def ordered(self, op, loop):
        """``loop.order_by(trip counts)`` for a loop that counts up to an end (``recurrent.counting``): its
        instances, longest first, leave it from the end, and those that stay are a view of the first rows."""
        found = recurrent.counting(op) if not self.emission.changes else None
        if found is None:
            return []
        counter, (kind, end) = found
        starts = ast.Call(func=self.helper(ranges.counter_values, "counter_values"),
                          args=[self.n_load(), self.load(op.loop_vars[counter])], keywords=[])
        ends = ast.Tuple(elts=[self.load(op.invariants[p]) for p in end], ctx=ast.Load()) if kind == "zip" else \
            self.load(end if isinstance(end, ir.Const) else op.invariants[end])
        counts = ast.Call(func=self.helper(ranges.trip_counts, "trip_counts"),
                          args=[self.n_load(), starts, ast.Constant(value=kind), ends], keywords=[])
        stmt = ast.Expr(value=ast.Call(func=ast.Attribute(value=ast.Name(id=loop, ctx=ast.Load()), attr="order_by",
                                                          ctx=ast.Load()), args=[counts], keywords=[]))
        locate(stmt, op.loc)
        return [stmt]

    def as_one_rnn(self, op, written):
        """A loop stepping an RNN cell (``codegen.recurrent``): ``out = loop(_n, vars, invariants)``, and the
        loop as written where that declines."""
        # (in a function that makes calls too, a loop that makes none: ``for h, c in zip(hs, cs)`` after the
        # children's calls)
        generators = self.batch_plan.generators
        found = recurrent.plan(op, self.current) if not self.emission.changes and \
            op.body_sg not in generators and op.cond_sg not in generators else None
        if found is None:
            return written
        found.compile(generate_batched)
        self.recurrent.append(found)
        out = self.var(ir.Value("_rnn"))
        call = ast.Call(func=self.helper(found, "rnn_loop"),
                        args=[self.n_load(), ast.Tuple(elts=[self.load(v) for v in op.loop_vars], ctx=ast.Load()),
                              ast.Tuple(elts=[self.load(v) for v in op.invariants], ctx=ast.Load())], keywords=[])
        first = ast.Assign(targets=[ast.Name(id=out, ctx=ast.Store())], value=call)
        locate(first, op.loc)
        declined = ast.Compare(left=ast.Name(id=out, ctx=ast.Load()), ops=[ast.Is()],
                               comparators=[self.helper(NotImplemented, "NotImplemented")])
        ran = self.results(op.outputs, ast.Name(id=out, ctx=ast.Load()) if len(op.outputs) > 1 else
                           ast.Subscript(value=ast.Name(id=out, ctx=ast.Load()), slice=ast.Constant(value=0),
                                         ctx=ast.Load()), op.loc)
        test = ast.If(test=declined, body=written, orelse=[ran])
        locate(test, op.loc)
        return [first, test]

    def request(self, op):
        """(unit, args, instance count, site, deferrable): every instance of the frame makes the call;
        deferrable when the frame does not need its result before returning (``passes.batching``)."""
        target, args, site = super().request(op)
        return [target, args, self.n_load(), site, ast.Constant(value=op in self.batch_plan.deferrable)]

    def function(self, sg):
        self.current = sg
        fdef = super().function(sg)
        fdef.args.args.insert(0, ast.arg(arg=self.n))
        return fdef


class _LevelEmitter(_BatchedEmitter):
    """Emits the pieces of a level program (``codegen.levels``): plain functions, where a Cond runs its
    branches inline and a deferrable call is answered at once by ``runtime.levels.defer`` (or collected by
    ``runtime.levels.collect``, with a late split)."""

    def piece(self, name, sg, ops, inputs, outputs, collected=None):
        """Emit ``ops`` as ``name(_n, *inputs) -> outputs``. A deferrable call is answered by
        ``runtime.levels.defer``, or, with ``collected`` (Invokes), only has its request collected
        (``runtime.levels.collect``, with its position in ``collected``)."""
        name = self.emission.extra_names.fresh(name)
        self.current = None  # (no Cond of a piece yields its branches: they run inline)
        self.live_out = {v for v in outputs if isinstance(v, ir.Value)}
        self.collected = collected
        try:
            stmts = self.body(sg, plan(ops, self.emission.may_mutate))
        finally:
            self.live_out = self.collected = None
        loc = ops[0].loc if ops else sg.loc
        self.extra_def(name, inputs, stmts, outputs, loc, ops[-1].loc if ops else sg.loc, as_tuple=True)
        return name

    def invoke_group(self, group):
        requests = ast.Tuple(elts=[ast.Tuple(elts=self.request(op), ctx=ast.Load()) for op in group],
                             ctx=ast.Load())
        if self.collected is None:
            answer = ast.Call(func=self.helper(rt_levels.defer, "defer"), args=[requests], keywords=[])
        else:
            at = ast.Tuple(elts=[ast.Constant(value=self.collected.index(op)) for op in group], ctx=ast.Load())
            answer = ast.Call(func=self.helper(rt_levels.collect, "collect"), args=[requests, at], keywords=[])
        targets = [ast.Tuple(elts=[ast.Name(id=self.var(op.output), ctx=ast.Store()) for op in group],
                             ctx=ast.Store())]
        stmt = ast.Assign(targets=targets, value=answer)
        locate(stmt, group[0].loc)
        return stmt


def _appending(appends):
    """The ops a segment leaves out of a function whose only changes are its own lists' appends (``appends``):
    those calls and the reads of their methods (``hs.append``), so that every segment is pure, as traced code
    (which replays torch ops alone) must be."""
    return set(appends) | {op.fn.op for op in appends if isinstance(op, ir.Call) and isinstance(op.fn, ir.Value)}


def _segmentable(item):
    """An op a segment may hold: a call (not a raise, not one unpacking ``*args``), a capture, a fused op."""
    if isinstance(item, (ir.Capture, ir.Fused)):
        return True
    return (isinstance(item, ir.Call) and not item.star and not any(k is None for k, _ in item.kwargs)
            and not (isinstance(item.fn, ir.Const) and item.fn.value is intrinsics.raise_exception))


def _dispatches(op):
    """Whether ``op`` goes through a batch rule (not a capture, not reading a constant attribute)."""
    if isinstance(op, ir.Capture):
        return False
    if isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value is getattr \
            and isinstance(op.args[1], ir.Const):
        return False
    return True


def _no_args():
    return ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                         defaults=[])


def _units(batch_plan):
    """A runtime Unit for each unit SubGraph of ``batch_plan`` (passes.batching), its successors resolved."""
    units = {s: Unit(s.name, s.loc.filename if s.loc is not None else "<unknown>", len(s.outputs))
             for s in batch_plan.units}
    for s, unit in units.items():
        unit.is_generator = s in batch_plan.generators
        unit.successors = tuple(units[x] if isinstance(x, ir.SubGraph) else x for x in batch_plan.successors[s])
    return units


def generate_batched(sg, may_mutate=lambda invoke: False):
    """Batched code of function SubGraph ``sg``: GeneratedCode whose ``unit`` is the function's entry Unit
    (``runtime.units``), where its frames merge."""
    batch_plan = BatchPlan(sg, may_mutate)
    emission = emit.Emission(sg, may_mutate)
    emission.generators = set(batch_plan.generators)
    emission.changes = subgraph_may_mutate(sg, may_mutate)
    emission.reached = aliasing.reached(sg, may_mutate)
    # (a list the function builds and appends to changes nothing others see, but traced code, which replays
    # torch ops alone, would drop the appends: its segments leave them out, and it gets no level program)
    emission.appends = local_appends(sg)
    # (nor where it sets a variable a with or try block shares: a trace would drop the setting)
    emission.replays = not emission.changes and not emission.appends and not frame_cells(sg)
    emission.kept_out = _appending(emission.appends)
    emission.units = _units(batch_plan)  # SubGraph -> Unit
    emission.blocks = fission.split_blocks(sg, may_mutate)
    module = Module()
    emitters = [_BatchedEmitter(module, emission, batch_plan) for _ in emission.sgs]
    shape = level_shape(sg, batch_plan, not emission.replays)
    build_levels = None
    if shape is not None:
        level_emitter, build_levels = levels.emit_pieces(_LevelEmitter, module, emission, batch_plan, shape)
        emitters.append(level_emitter)  # (compile_functions emits one function per SubGraph, then every extra)
    code = emit.compile_functions(sg, emission, emitters, module)
    code.segments = []
    code.recurrent = [found for emitter in emitters for found in emitter.recurrent]
    for emitter in emitters:
        for name, seg in emitter.segments.items():
            seg.generic = module.namespace[name]
            code.segments.append(seg)
    for s, unit in emission.units.items():
        unit.fn = code.functions[s.name]
        unit.code = code
    code.unit = emission.units[sg]
    if build_levels is not None:
        code.unit.levels = build_levels(module.namespace)
        code.unit.levels.hands_on_inputs = emission.reached.hands_on_inputs
    return code

