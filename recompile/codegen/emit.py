"""One Python function per SubGraph, built as an AST (then printed and compiled by ``loader``).

A SubGraph that contains Invokes (directly or in a nested SubGraph) becomes a
generator: at each group of independent Invokes it yields
``((callee, args, site), ...)`` to the scheduler and is resumed with the
results. Nested SubGraphs are entered with ``yield from`` (or called, when they
never yield). Each statement carries the user's Location, so that the loaded
code's tracebacks point at the user's source.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import math
import operator
import re

from .. import ir
from .. import intrinsics
from ..naming import Namer
from ..ops import syntax
from .fused import FusedKernel
from .loader import GeneratedCode, Module, load, locate, location
from .plan import plan

_BINARY = syntax.by_fn(syntax.BINARY, ast)
_COMPARE = syntax.by_fn(syntax.COMPARE, ast)
_UNARY = syntax.by_fn(syntax.UNARY, ast)
_LITERALS = {int, str, bool, bytes, type(None)}  # exact types: a subclass (an IntEnum) prints otherwise
_LARGEST_LITERAL = 10 ** 100  # larger ints go by reference (printing them may exceed int->str limits)


def _is_builtin(value):
    try:
        name = getattr(value, "__name__", None)
        return isinstance(name, str) and getattr(builtins, name, None) is value and not name.startswith("_")
    except Exception:  # objects whose __getattr__ raises something else than AttributeError
        return False


class FunctionEmitter:
    """Emits one SubGraph as a Python function (``function``), op by op, into the ``module``'s names."""

    def __init__(self, module, emission):
        self.module = module
        self.emission = emission
        # a variable's name is its hint, unless that names a keyword, a builtin, a module-level name or a
        # function of the module
        self.names = Namer(refuse=lambda name: (keyword.iskeyword(name) or hasattr(builtins, name)
                                                or name.startswith("_rc_") or name in emission.fn_names))

    def var(self, value):
        name = self.names.given_to(value)
        if name is None:
            base = re.sub(r"\W", "_", value.hint or "v").strip("_") or "v"
            name = self.names.name_of(value, "v" + base if base[0].isdigit() else base)
        return name

    def load(self, operand):
        if isinstance(operand, ir.Value):
            return ast.Name(id=self.var(operand), ctx=ast.Load())
        value = operand.value
        kind = type(value)
        if ((kind in _LITERALS and not (kind is int and abs(value) > _LARGEST_LITERAL))
                or (kind is float and math.isfinite(value))):
            if kind in (int, float) and math.copysign(1, value) < 0:  # (-2) ** x: print as a unary minus
                return ast.UnaryOp(op=ast.USub(), operand=ast.Constant(value=-value))
            return ast.Constant(value=value)
        if _is_builtin(value):
            return ast.Name(id=value.__name__, ctx=ast.Load())
        return ast.Name(id=self.module.ref(value, ir.const_repr(value)), ctx=ast.Load())

    def store_targets(self, outputs):
        if len(outputs) == 1:
            return [ast.Name(id=self.var(outputs[0]), ctx=ast.Store())]
        return [ast.Tuple(elts=[ast.Name(id=self.var(v), ctx=ast.Store()) for v in outputs], ctx=ast.Store())]

    def assign(self, outputs, value, loc, unpack=False):
        if unpack:  # `a, = v` unpacks even a single target
            targets = [ast.Tuple(elts=[ast.Name(id=self.var(v), ctx=ast.Store()) for v in outputs], ctx=ast.Store())]
            stmt = ast.Assign(targets=targets, value=value)
        elif not outputs:
            stmt = ast.Expr(value=value)
        else:
            stmt = ast.Assign(targets=self.store_targets(outputs), value=value)
        locate(stmt, loc)
        return stmt

    # -- ops

    def call_expr(self, op):
        fn = op.fn.value if isinstance(op.fn, ir.Const) else None
        args = [self.load(a) for a in op.args]
        plain = not op.star and not op.kwargs
        try:
            hashable_fn = fn if fn is None or hash(fn) is not None else None
        except TypeError:
            hashable_fn = None
        if plain and hashable_fn is not None:
            if fn in _BINARY and len(args) == 2:
                return ast.BinOp(left=args[0], op=_BINARY[fn](), right=args[1])
            if fn in _COMPARE and len(args) == 2:
                return ast.Compare(left=args[0], ops=[_COMPARE[fn]()], comparators=[args[1]])
            if fn is operator.contains and len(args) == 2:
                return ast.Compare(left=args[1], ops=[ast.In()], comparators=[args[0]])
            if fn in _UNARY and len(args) == 1:
                return ast.UnaryOp(op=_UNARY[fn](), operand=args[0])
            if fn is operator.getitem and len(args) == 2:
                return ast.Subscript(value=args[0], slice=args[1], ctx=ast.Load())
            if (fn is getattr and len(args) == 2 and isinstance(op.args[1], ir.Const)
                    and isinstance(op.args[1].value, str) and op.args[1].value.isidentifier()
                    and not keyword.iskeyword(op.args[1].value)):
                return ast.Attribute(value=args[0], attr=op.args[1].value, ctx=ast.Load())
            if fn is intrinsics.build_tuple:
                return ast.Tuple(elts=args, ctx=ast.Load())
            if fn is intrinsics.build_list:
                return ast.List(elts=args, ctx=ast.Load())
            if fn is intrinsics.unpack:
                return args[0]
        args = [ast.Starred(value=a, ctx=ast.Load()) if i in op.star else a for i, a in enumerate(args)]
        keywords = [ast.keyword(arg=k, value=self.load(v)) for k, v in op.kwargs]
        return ast.Call(func=self.load(op.fn), args=args, keywords=keywords)

    def raise_stmt(self, op):
        """A raise statement, so that the traceback ends on the user's raise line."""
        exc = self.load(op.args[0]) if op.args else None
        cause = self.load(op.args[1]) if len(op.args) > 1 else None
        stmt = ast.Raise(exc=exc, cause=cause)
        locate(stmt, op.loc)
        return stmt

    def capture_expr(self, op):
        if op.source_kind == "attr":
            return ast.Attribute(value=self.load(op.base), attr=op.source, ctx=ast.Load())
        helper = intrinsics.read_global if op.source_kind == "global" else intrinsics.read_cell
        return ast.Call(func=self.load(ir.Const(helper)),
                        args=[ast.Name(id=self.module.ref(op.source, "globals" if op.source_kind == "global"
                                                          else "cell_" + op.name), ctx=ast.Load()),
                              ast.Constant(value=op.name)], keywords=[])

    def enter(self, sg, operands):
        """Expression running nested SubGraph ``sg`` on ``operands``."""
        call = ast.Call(func=ast.Name(id=self.emission.fn_name[sg], ctx=ast.Load()),
                        args=[self.load(a) for a in operands], keywords=[])
        return ast.YieldFrom(value=call) if sg in self.emission.generators else call

    def request(self, op):
        """What the scheduler is asked for an Invoke: (callee, args, site)."""
        target = ast.Name(id=self.module.ref(op.target, "callee_" + op.callee), ctx=ast.Load())
        args = ast.Tuple(elts=[self.load(a) for a in op.args], ctx=ast.Load())
        site = ast.Name(id=self.module.ref(op.loc, "site"), ctx=ast.Load())
        return [target, args, site]

    def invoke_group(self, group):
        requests = []
        for op in group:
            requests.append(ast.Tuple(elts=self.request(op), ctx=ast.Load()))
        targets = [ast.Tuple(elts=[ast.Name(id=self.var(op.output), ctx=ast.Store()) for op in group],
                             ctx=ast.Store())]
        stmt = ast.Assign(targets=targets, value=ast.Yield(value=ast.Tuple(elts=requests, ctx=ast.Load())))
        locate(stmt, group[0].loc)
        return stmt

    def fused_kernel(self, op):
        """The fused op's kernel; its code goes with this module's (tracebacks, ``source()``)."""
        code = generate(op.body)
        self.module.attach(code)
        batched = self.fused_members(op)
        return FusedKernel(op, code.entry, batched and batched.entry)

    def fused_members(self, op):
        """Code running a fused op's members one by one, where one call may not fit (batched code)."""
        return None

    def fused_stmts(self, op):
        kernel = self.fused_kernel(op)
        call = ast.Call(func=ast.Name(id=self.module.ref(kernel.entry, kernel.name), ctx=ast.Load()),
                        args=[self.load(a) for a in op.args], keywords=[])
        return [self.assign(op.outputs, call, op.loc, unpack=len(op.outputs) > 1)]

    def op_stmts(self, op):
        if isinstance(op, ir.Fused):
            return self.fused_stmts(op)
        if isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value is intrinsics.raise_exception:
            return [self.raise_stmt(op)]
        if isinstance(op, ir.Call):
            unpack = isinstance(op.fn, ir.Const) and op.fn.value is intrinsics.unpack
            return [self.assign(op.outputs, self.call_expr(op), op.loc, unpack)]
        if isinstance(op, ir.Capture):
            return [self.assign(op.outputs, self.capture_expr(op), op.loc)]
        if isinstance(op, ir.Cond):
            then = self.assign(op.outputs, self.enter(op.then_sg, op.args), op.loc)
            other = self.assign(op.outputs, self.enter(op.else_sg, op.args), op.loc)
            stmt = ast.If(test=self.load(op.pred), body=[then], orelse=[other])
            locate(stmt, op.loc)
            return [stmt]
        if isinstance(op, ir.While):
            init = self.assign(op.outputs, ast.Tuple(elts=[self.load(v) for v in op.loop_vars], ctx=ast.Load())
                               if len(op.outputs) != 1 else self.load(op.loop_vars[0]), op.loc)
            carried = list(op.outputs) + list(op.invariants)
            body = self.assign(op.outputs, self.enter(op.body_sg, carried), op.loc)
            loop = ast.While(test=self.enter(op.cond_sg, carried), body=[body], orelse=[])
            locate(loop, op.loc)
            return ([init] if op.outputs else []) + [loop]
        raise TypeError(f"no code for {op!r}")

    def body(self, sg, items):
        """Statements for ``items`` of SubGraph ``sg`` (ops, and groups of Invokes issued together)."""
        body = []
        for item in items:
            if isinstance(item, list):
                body.append(self.invoke_group(item))
            else:
                body.extend(self.op_stmts(item))
        return body

    def items(self, sg):
        """What ``body`` writes of SubGraph ``sg``: its ops, and its groups of Invokes issued together."""
        return plan(sg.ops, self.emission.may_mutate)

    def function(self, sg):
        body = self.body(sg, self.items(sg))
        if not sg.outputs:
            ret = ast.Return(value=ast.Constant(value=None))
        elif len(sg.outputs) == 1:
            ret = ast.Return(value=self.load(sg.outputs[0]))
        else:
            ret = ast.Return(value=ast.Tuple(elts=[self.load(v) for v in sg.outputs], ctx=ast.Load()))
        locate(ret, sg.outputs[0].op.loc if sg.outputs and getattr(sg.outputs[0], "op", None) else sg.loc)
        body.append(ret)
        if self.emission.release:
            body = _release(body, [self.var(v) for v in sg.inputs])
        args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=self.var(v)) for v in sg.inputs], vararg=None,
                             kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
        fdef = ast.FunctionDef(name=self.emission.fn_name[sg], args=args, body=body, decorator_list=[],
                               returns=None, type_comment=None)
        locate(fdef, sg.loc)
        return fdef


def _release(body, params):
    """``body`` with ``del`` after the last statement that names each variable, so that what a
    variable holds (a gradient's saved values) is freed as soon as it has been used."""
    last, local = {}, set(params)
    for i, stmt in enumerate(body):
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name):
                last[node.id] = i
                if isinstance(node.ctx, ast.Store):
                    local.add(node.id)
    out = []
    for i, stmt in enumerate(body):
        out.append(stmt)
        dead = sorted(n for n, j in last.items() if j == i and n in local)
        if dead and not isinstance(stmt, ast.Return):
            gone = ast.Delete(targets=[ast.Name(id=n, ctx=ast.Del()) for n in dead])
            locate(gone, location(stmt))
            out.append(gone)
    return out


class Emission:
    """What the emitters of one function share: its SubGraphs (``sgs``) and the name of the function each
    becomes (``fn_name``), which of them are generators, ``may_mutate`` (codegen.plan), ``release`` (delete
    each variable after its last use) and ``extra_names``, the names of the functions emitted besides."""

    def __init__(self, sg, may_mutate, release=False):
        self.root = sg
        self.may_mutate = may_mutate
        self.release = release
        self.sgs = list(sg.walk())
        names = Namer(refuse=lambda name: hasattr(builtins, name) or keyword.iskeyword(name))
        self.fn_name = {s: names.fresh(re.sub(r"\W", "_", s.name)) for s in self.sgs}
        self.fn_names = set(self.fn_name.values())
        # the functions emitted besides one per SubGraph (segments, level pieces): named apart from those
        self.extra_names = Namer(suffix=lambda k: "_" * k, start=1, refuse=self.fn_names.__contains__)
        self.generators = set()
        for s in reversed(self.sgs):  # inner SubGraphs first
            if any(isinstance(op, ir.Invoke) or any(x in self.generators for x in op.subgraphs())
                   for op in s.ops):
                self.generators.add(s)


def generate(sg, may_mutate=lambda invoke: False, release=False):
    """Compile the function SubGraph ``sg`` (with its nested SubGraphs).

    ``may_mutate(invoke)`` tells whether a compiled call may change state (see codegen.plan);
    with ``release`` each variable is deleted after its last use.
    """
    emission = Emission(sg, may_mutate, release)
    module = Module()
    return compile_functions(sg, emission, [FunctionEmitter(module, emission) for _ in emission.sgs], module)


def compile_functions(sg, emission, emitters, module):
    """Emit each SubGraph of ``emission`` with its emitter (then every extra function an emitter made), and
    load them (``loader.load``): the GeneratedCode of function SubGraph ``sg``."""
    defs = [emitter.function(s) for emitter, s in zip(emitters, emission.sgs)]
    extra = [d for emitter in emitters for d in getattr(emitter, "extra_defs", ())]  # (batched code's segments)
    source, codes = load(defs + extra, sg, module)
    functions = {s.name: module.namespace[emission.fn_name[s]] for s in emission.sgs}
    return GeneratedCode(source, functions, sg.name, {s.name for s in emission.generators}, codes)
