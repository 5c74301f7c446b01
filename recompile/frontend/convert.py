"""Conversion of a canonical gast function into IR SubGraphs.

Every statement and expression becomes ops in the current SubGraph; ``if``,
ternaries, ``and``/``or`` and chained comparisons become ``Cond`` ops whose
branches are SubGraphs; ``while`` (and ``for``, lowered by canonicalize)
becomes a ``While`` op; a call of a compiled function becomes an ``Invoke``.
Branch and loop SubGraphs read the values of their enclosing SubGraph freely
here; the capture pass makes those reads explicit inputs.

Variables are tracked in an environment of bindings, each DEF (bound on every
path) or MAYBE (its value is UNDEFINED on the paths that did not bind it: a read
checks it and raises UnboundLocalError there, as Python does). A local with no
binding at all is unbound on every path. A variable that a nested function,
lambda or generator expression uses lives in a cell instead (``closures``),
read and written where the code reads and writes it.
"""

from __future__ import annotations

import copy
import inspect
import operator

import gast

from .. import ir
from .. import intrinsics
from ..naming import Namer
from ..ops import syntax
from . import canonicalize as canon
from . import closures, python_blocks

DEF, MAYBE = "def", "maybe"

BINOPS = syntax.by_node(syntax.BINARY, gast)
INPLACE = syntax.by_node(syntax.BINARY, gast, in_place=True)
UNARY = syntax.by_node(syntax.UNARY, gast)
COMPARE = syntax.by_node(syntax.COMPARE, gast)
_SET = ".set"  # (a set comprehension's empty set, whatever the user calls set)
# (builtins a ``for`` over reads as its index loop, or as a counter; builtins a generator given to is a list
# comprehension: canonicalize)
_LOWERED_BUILTINS = frozenset({"enumerate", "zip", "reversed", "range", *canon.CONSUMERS, *canon.DECIDERS})
INTERNAL = {canon.AS_SEQUENCE: intrinsics.as_sequence, canon.HAS_INDEX: intrinsics.has_index,
            canon.REVERSED_SEQUENCE: intrinsics.reversed_sequence,
            canon.BUILTIN_READ: intrinsics.builtin_read, canon.INDEX: operator.index,
            canon.ASSERTION_ERROR: AssertionError, _SET: set, canon.IMPORT: intrinsics.import_module,
            canon.IMPORT_FROM: intrinsics.import_from}


class Binding:
    __slots__ = ("value", "state")

    def __init__(self, value, state=DEF):
        self.value = value
        self.state = state


def stored_names(nodes):
    """Names a list of statements (or one node) binds or deletes, in first-binding order, comprehension targets
    excluded."""
    if not isinstance(nodes, list):
        nodes = [nodes]
    skip = set()
    names = []
    for root in nodes:
        for node in closures.walk_scope(root):
            if isinstance(node, gast.comprehension):
                skip.update(id(n) for n in gast.walk(node.target))
        for node in closures.walk_scope(root):
            if (isinstance(node, gast.Name) and isinstance(node.ctx, (gast.Store, gast.Param, gast.Del))
                    and id(node) not in skip and node.id not in names):
                names.append(node.id)
            elif isinstance(node, gast.FunctionDef):  # (and what a with, try or match statement binds)
                names.extend(n for n in (node.name, *python_blocks.binds(node)) if n not in names)
    return names


def _method_call(obj, method, args, at):
    """The statement ``obj.method(*args)`` at ``at``'s position."""
    func = canon.located(gast.Attribute(value=canon.name(obj, at=at), attr=method, ctx=gast.Load()), at)
    return canon.located(gast.Expr(value=canon.located(gast.Call(func=func, args=args, keywords=[]), at)), at)


class Converter:
    """Builds the SubGraphs of one function.

    ``callee_of(obj, owner)`` returns the handle an Invoke names (an ``ir.Target``:
    its ``ir_name`` and ``signature`` are used) when ``obj`` is a compiled
    function, else None.
    """

    def __init__(self, parsed, name, owner, callee_of):
        self.p = parsed
        self.name = name
        self.owner = owner
        self.callee_of = callee_of
        self.sg = None
        self.env = None
        self.sg_names = Namer(reserved=(name,))  # the SubGraphs' names: branches and loops get unique ones
        self.comprehensions = 0
        self.builtins = frozenset()  # (the builtin names a ``for`` lowers, that no scope of the function binds)

    # -- entry

    def convert(self):
        self.declared = closures.declarations(self.p.node.body)  # global and nonlocal names
        bound = {x for st in self.p.node.body for x in python_blocks.bound_by(st)} | set(self.p.params) | \
            set(self.p.freevars) | set(self.p.globals)  # (imports and match captures bind names too)
        # (a comprehension's target names a builtin inside it, nested comprehensions too: ``[[a for i, a in
        # enumerate(x)] for enumerate in fs]``; any one counts, as the name may be that one wherever it is read)
        bound |= {x for node in gast.walk(self.p.node) if isinstance(node, gast.comprehension)
                  for x in stored_names(node.target)}
        self.builtins = _LOWERED_BUILTINS - bound
        fdef = canon.canonicalize(copy.deepcopy(self.p.node), self.declared, self.builtins)
        self.locals = (set(stored_names(fdef.body)) | set(self.p.params)) - set(self.declared)
        # (locals() lists parameters first, then variables in the order they are first bound)
        self.frame_order = [n for n in dict.fromkeys([*self.p.params, *stored_names(self.p.node.body)])
                            if n.isidentifier() and n not in self.declared]
        self.self_name = self.p.params[0] if (self.owner is not None and self.p.params) else None
        inputs = [ir.Value(p) for p in self.p.params]
        if self.self_name is not None:
            inputs[0].is_self = True
        sg = ir.SubGraph(self.name, inputs, self.p.loc(fdef), "function")
        self.sg = sg
        self.env = {p: Binding(v, MAYBE if p in self.p.maybe_unbound else DEF) for p, v in zip(self.p.params, inputs)}
        self._prepare_cells(fdef)
        self.block(fdef.body)
        return sg

    def _prepare_cells(self, fdef):
        """Python's code for each nested scope, and a cell for each variable one of them uses (``closures``).
        A parameter that nothing rebinds keeps its value: the scope gets a cell of that value; any other
        such variable lives in its cell, read and written there by the function too."""
        self.scope_codes, self.cells, self.fixed_cells, self.captured = {}, {}, {}, set()
        # (a variable declared nonlocal is the enclosing function's, which a scope here reads through its cell)
        visible = (self.locals | set(self.p.freevars)) - {n for n, k in self.declared.items() if k == "global"}
        for node, around in closures.nested_scopes(fdef.body):
            if isinstance(node, gast.FunctionDef) and node.name in self.p.lifted:
                continue  # (lifted: its variables are passed at each call, no cells of theirs)
            code = closures.scope_code(node, visible | around, self.p.fn, self.p.class_name())
            self.scope_codes[id(node)] = code
            self.captured.update(self.demangle(n) for n in code.co_freevars)
        rebound = set(stored_names(fdef.body)) | closures.written_from_inside(fdef.body)
        for name in sorted(self.captured & self.locals):
            if name in self.env and name not in rebound:
                self.fixed_cells[name] = self.call(fdef, intrinsics.fixed_cell, [self.env[name].value], hint=name)
                continue
            cell = self.cells[name] = self.call(fdef, intrinsics.new_cell, [], hint=name)
            if name in self.env:  # a parameter: its value moves into the cell
                self.call(fdef, intrinsics.set_cell, [cell, self.env.pop(name).value], n_outputs=0)

    # -- helpers

    def loc(self, node):
        return self.p.loc(node)

    def emit(self, op):
        self.sg.ops.append(op)
        return op

    def call(self, node, fn, args=(), kwargs=(), star=(), n_outputs=1, hint=""):
        fn = fn if isinstance(fn, (ir.Value, ir.Const)) else ir.Const(fn)
        op = self.emit(ir.Call(self.loc(node), fn, args, kwargs, star, n_outputs, (hint,) * n_outputs))
        return op.outputs[0] if n_outputs == 1 else op.outputs

    def new_subgraphs(self, kind, node, parts):
        """SubGraphs named ``<current>.<kind><line>.<part>``, one per part, the base unique."""
        name = self.sg_names.fresh(f"{self.sg.name}.{kind}{node.lineno}")
        return [ir.SubGraph(f"{name}.{part}", [], self.loc(node), part) for part in parts]

    def inside(self, sg, env, build):
        """Run ``build()`` with ``sg`` and ``env`` current; return its result."""
        saved = self.sg, self.env
        self.sg, self.env = sg, env
        try:
            return build()
        finally:
            self.sg, self.env = saved

    def mangle(self, attr):
        """``self.__x`` in a method of class C reads ``_C__x``, as Python compiles it."""
        cls = self.p.class_name()
        if cls and attr.startswith("__") and not attr.endswith("__") and cls.strip("_"):
            return f"_{cls.lstrip('_')}{attr}"
        return attr

    def demangle(self, name):
        return self.p.demangle(name)

    # -- variables

    def load(self, ident, node):
        if ident in INTERNAL:
            return ir.Const(INTERNAL[ident])
        if ident == canon.GLOBALS:
            return ir.Const(self.p.globals)
        if ident in self.cells:
            return self.call(node, intrinsics.read_local_cell, [self.cells[ident], ir.Const(ident)], hint=ident)
        b = self.env.get(ident)
        if b is not None:
            if b.state == DEF:
                return b.value
            free = [ir.Const(True)] if ident in self.p.maybe_unbound else []  # (Python's error of a free variable)
            value = self.call(node, intrinsics.check_bound, [b.value, ir.Const(ident), *free], hint=ident)
            self.env[ident] = Binding(value)
            return value
        if ident in self.locals:  # bound on no path that reaches here: raises when (if ever) it runs
            return self.call(node, intrinsics.check_bound, [ir.Const(intrinsics.UNDEFINED), ir.Const(ident)],
                             hint=ident)
        return self.emit(ir.Capture(self.loc(node), self.mangle(ident))).output

    def store(self, target, value):
        if isinstance(target, gast.Name):
            if isinstance(value, ir.Value) and not value.hint:
                value.hint = target.id.lstrip(".")
            if target.id in self.cells:
                self.call(target, intrinsics.set_cell, [self.cells[target.id], value], n_outputs=0)
            elif self.declared.get(target.id) == "global":
                self.call(target, intrinsics.write_global, [ir.Const(self.p.globals), ir.Const(self.mangle(target.id)),
                                                            value], n_outputs=0)
            elif self.declared.get(target.id) == "nonlocal":
                cell = ir.Const(self.p.freevars[self.mangle(target.id)])
                self.call(target, intrinsics.set_cell, [cell, value], n_outputs=0)
            else:
                self.env[target.id] = Binding(value)
        elif isinstance(target, (gast.Tuple, gast.List)):
            n = len(target.elts)
            starred = [i for i, elt in enumerate(target.elts) if isinstance(elt, gast.Starred)]
            if starred:  # `a, *rest, z = xs`: the middle becomes a list, then all unpack as usual
                value = self.call(target, intrinsics.unpack_starred, [value, ir.Const(starred[0]),
                                                                      ir.Const(n - starred[0] - 1)])
            outs = self.call(target, intrinsics.unpack, [value, ir.Const(n)], n_outputs=n)
            outs = [outs] if n == 1 else outs
            for elt, v in zip(target.elts, outs):
                self.store(elt.value if isinstance(elt, gast.Starred) else elt, v)
        elif isinstance(target, gast.Attribute):
            obj = self.expr(target.value)
            self.call(target, setattr, [obj, ir.Const(self.mangle(target.attr)), value], n_outputs=0)
        elif isinstance(target, gast.Subscript):
            obj = self.expr(target.value)
            idx = self.expr(target.slice)
            self.call(target, operator.setitem, [obj, idx, value], n_outputs=0)
        else:
            raise self.loc(target).error(f"cannot assign to {type(target).__name__}", "assignment")

    # -- statements

    def block(self, stmts):
        for s in stmts:
            method = getattr(self, "stmt_" + type(s).__name__, None)
            if method is None:
                raise self.loc(s).error(f"{type(s).__name__} statement is not supported in a compiled function",
                                        type(s).__name__)
            method(s)
        return canon.always_jumps(stmts)

    def stmt_Assign(self, s):
        value = self.expr(s.value)
        for t in s.targets:
            self.store(t, value)

    def stmt_AnnAssign(self, s):
        if s.value is not None:
            self.store(s.target, self.expr(s.value))

    def stmt_AugAssign(self, s):
        fn = INPLACE[type(s.op)]
        t = s.target
        if isinstance(t, gast.Name):
            cur = self.load(t.id, t)
            self.store(t, self.call(s, fn, [cur, self.expr(s.value)], hint=t.id))
        elif isinstance(t, gast.Attribute):
            obj = self.expr(t.value)
            attr = ir.Const(self.mangle(t.attr))
            cur = self.call(t, getattr, [obj, attr], hint=t.attr)
            new = self.call(s, fn, [cur, self.expr(s.value)], hint=t.attr)
            self.call(s, setattr, [obj, attr, new], n_outputs=0)
        elif isinstance(t, gast.Subscript):
            obj = self.expr(t.value)
            idx = self.expr(t.slice)
            cur = self.call(t, operator.getitem, [obj, idx])
            new = self.call(s, fn, [cur, self.expr(s.value)])
            self.call(s, operator.setitem, [obj, idx, new], n_outputs=0)
        else:
            raise self.loc(t).error("unsupported augmented assignment target", "assignment")

    def stmt_Delete(self, s):
        for t in s.targets:
            self.delete(t)

    def delete(self, target):
        if isinstance(target, gast.Name):
            ident = target.id
            if ident in self.cells:
                self.call(target, intrinsics.delete_cell, [self.cells[ident], ir.Const(ident), ir.Const(False)],
                          n_outputs=0)
            elif self.declared.get(ident) == "global":
                self.call(target, intrinsics.delete_global, [ir.Const(self.p.globals), ir.Const(self.mangle(ident))],
                          n_outputs=0)
            elif self.declared.get(ident) == "nonlocal":
                cell = ir.Const(self.p.freevars[self.mangle(ident)])
                self.call(target, intrinsics.delete_cell, [cell, ir.Const(ident), ir.Const(True)], n_outputs=0)
            else:
                self.load(ident, target)  # deleting an unbound name raises as reading it does
                self.env.pop(ident, None)  # unbound from here on
        elif isinstance(target, (gast.Tuple, gast.List)):
            for elt in target.elts:
                self.delete(elt)
        elif isinstance(target, gast.Attribute):
            obj = self.expr(target.value)
            self.call(target, delattr, [obj, ir.Const(self.mangle(target.attr))], n_outputs=0)
        elif isinstance(target, gast.Subscript):
            obj = self.expr(target.value)
            self.call(target, operator.delitem, [obj, self.expr(target.slice)], n_outputs=0)
        else:
            raise self.loc(target).error(f"cannot delete {type(target).__name__}", "del")

    def stmt_Global(self, s):
        pass  # (``self.declared``)

    def stmt_Nonlocal(self, s):
        pass

    def stmt_FunctionDef(self, s):
        """A nested def: its decorators, then the function object, decorated, bound to its name. A def lifted
        out (``lifting``) makes nothing here: its calls are Invokes of its own program."""
        if s.name in self.p.lifted:
            self._annotations(s)  # (evaluated where the def runs, as Python does, though nothing keeps them)
            return
        decorators = [self.expr(d) for d in s.decorator_list]
        fn = self._function(s)
        for d in reversed(decorators):
            fn = self.call(s, d, [fn], hint=s.name)
        self.store(canon.name(s.name, store=True, at=s), fn)

    def stmt_Expr(self, s):
        self.expr(s.value)

    def stmt_Pass(self, s):
        pass

    def stmt_Return(self, s):
        self.sg.outputs = [self.expr(s.value)]

    def stmt_Raise(self, s):
        if s.exc is None:
            self.call(s, intrinsics.raise_exception, [], n_outputs=0)
        elif s.cause is None:
            self.call(s, intrinsics.raise_exception, [self.expr(s.exc)], n_outputs=0)
        else:
            exc = self.expr(s.exc)
            self.call(s, intrinsics.raise_exception, [exc, self.expr(s.cause), ir.Const(True)], n_outputs=0)

    def stmt_If(self, s):
        if isinstance(s.test, gast.Constant):
            # a literal predicate (`if True:`, `if 0:`) is decided now: only its branch exists
            self.block(s.body if s.test.value else s.orelse)
            return
        pred = self.test(s.test)
        assigned = [n for n in stored_names(s.body + s.orelse) if n in self.locals and n not in self.cells]
        branches = []
        sgs = self.new_subgraphs("if", s, ("then", "else"))
        for sg, body in zip(sgs, (s.body, s.orelse)):
            env = dict(self.env)
            jumped = self.inside(sg, env, lambda: self.block(body))
            branches.append((env, jumped))
        # the empty else of a guard that canonicalize put after a jump is reached only by jumping
        branches[1] = (branches[1][0], branches[1][1] or canon.is_guard(s))
        outs, states = [], []
        for name in assigned:
            before = self.env.get(name)
            sides = [(env.get(name), jumped) for env, jumped in branches]
            if before is not None and all(b is before for b, _ in sides):
                continue  # not changed on either path
            state = self._merge(sides)
            if state is not None:
                outs.append(name)
                states.append(state)
        for sg, (env, _) in zip(sgs, branches):
            sg.outputs = [self._value_of(env.get(n)) for n in outs]
        op = self.emit(ir.Cond(self.loc(s), pred, sgs[0], sgs[1], [], len(outs), outs))
        for name, value, state in zip(outs, op.outputs, states):
            self.env[name] = Binding(value, state)

    @staticmethod
    def _merge(sides):
        """State of a name after a branch point whose sides end with these (binding, jumped) pairs:
        DEF where every side bound it, MAYBE where some may not have, None where none did.
        """
        if all(b is None for b, _ in sides):
            return None
        return DEF if all(b is not None and b.state == DEF for b, _ in sides) else MAYBE

    @staticmethod
    def _value_of(binding):
        return ir.Const(intrinsics.UNDEFINED) if binding is None else binding.value

    def stmt_While(self, s):
        # every name the body binds is carried: a value from an earlier iteration may be read
        # (checked when read, like the first iteration of a name bound only in the body)
        carried = [n for n in stored_names(s.body) if n in self.locals and n not in self.cells]
        init, init_states = [], []
        for n in carried:
            b = self.env.get(n)
            if b is not None:
                init.append(b.value)
                init_states.append(b.state)
            else:
                init.append(ir.Const(intrinsics.UNDEFINED))
                init_states.append(MAYBE)

        def entry_env(sg):
            env = dict(self.env)
            for n, v, st in zip(carried, sg.inputs, init_states):
                env[n] = Binding(v, st)
            return env

        cond_sg, body_sg = self.new_subgraphs("while", s, ("cond", "body"))
        cond_sg.inputs = [ir.Value(n) for n in carried]
        body_sg.inputs = [ir.Value(n) for n in carried]

        def build_cond():
            cond_sg.outputs = [self.test(s.test)]

        self.inside(cond_sg, entry_env(cond_sg), build_cond)
        body_env = entry_env(body_sg)
        self.inside(body_sg, body_env, lambda: self.block(s.body))
        body_sg.outputs = [self._value_of(body_env.get(n)) for n in carried]
        op = self.emit(ir.While(self.loc(s), cond_sg, body_sg, init, (), carried))
        for n, v, st0 in zip(carried, op.outputs, init_states):
            end = body_env.get(n)
            before = self.env.get(n)
            # bound after the loop where it was before and every pass keeps it bound; a name bound only in
            # the body (a for target too) keeps its last value, unbound if the body never ran
            state = DEF if (before is not None and st0 == DEF and end is not None and end.state == DEF) else MAYBE
            self.env[n] = Binding(v, state)

    # -- expressions

    def expr(self, node):
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            raise self.loc(node).error(f"{type(node).__name__} expressions are not supported in a compiled function",
                                       type(node).__name__)
        return method(node)

    def expr_Constant(self, node):
        return ir.Const(node.value)

    def expr_Name(self, node):
        return self.load(node.id, node)

    def expr_Attribute(self, node):
        return self.call(node, getattr, [self.expr(node.value), ir.Const(self.mangle(node.attr))], hint=node.attr)

    def expr_Subscript(self, node):
        return self.call(node, operator.getitem, [self.expr(node.value), self.expr(node.slice)])

    def expr_Slice(self, node):
        parts = [self.expr(p) if p is not None else ir.Const(None) for p in (node.lower, node.upper, node.step)]
        return self.call(node, slice, parts)

    def expr_BinOp(self, node):
        return self.call(node, BINOPS[type(node.op)], [self.expr(node.left), self.expr(node.right)])

    def expr_UnaryOp(self, node):
        fn = UNARY[type(node.op)]
        if (isinstance(node.operand, gast.Constant) and type(node.operand.value) in (int, float, complex)
                and fn in (operator.neg, operator.pos)):
            return ir.Const(fn(node.operand.value))  # -1 is a constant, as Python folds it
        return self.call(node, fn, [self.expr(node.operand)])

    def _elements(self, elts):
        args, star = [], []
        for i, e in enumerate(elts):
            if isinstance(e, gast.Starred):
                star.append(i)
                e = e.value
            args.append(self.expr(e))
        return args, star

    def expr_Tuple(self, node):
        args, star = self._elements(node.elts)
        return self.call(node, intrinsics.build_tuple, args, star=star)

    def expr_List(self, node):
        args, star = self._elements(node.elts)
        return self.call(node, intrinsics.build_list, args, star=star)

    def expr_Set(self, node):
        args, star = self._elements(node.elts)
        return self.call(node, intrinsics.build_set, args, star=star)

    def expr_Dict(self, node):
        items = []
        for k, v in zip(node.keys, node.values):
            items.append(self.expr(k) if k is not None else ir.Const(intrinsics.MERGE))
            items.append(self.expr(v))
        return self.call(node, intrinsics.build_dict, items)

    def expr_JoinedStr(self, node):
        parts = [self.expr(v) for v in node.values]
        return self.call(node, intrinsics.join_str, parts)

    def expr_FormattedValue(self, node):
        value = self.expr(node.value)  # before the spec, as Python evaluates them
        spec = self.expr(node.format_spec) if node.format_spec is not None else ir.Const("")
        return self.call(node, intrinsics.format_value, [value, ir.Const(node.conversion), spec])

    def expr_NamedExpr(self, node):
        value = self.expr(node.value)
        self.store(node.target, value)
        return value

    def expr_Starred(self, node):
        raise self.loc(node).error("a starred expression is only supported in calls and literals", "starred")

    # conditional expressions: each becomes a Cond with one output

    def cond_value(self, node, kind, pred, then_build, else_build):
        """The value of ``then_build()`` if pred else ``else_build()``, as a Cond op.

        Names bound by ``:=`` inside the branches are outputs too: bound after the Cond where both
        sides bind them, checked when read where only one does (as in Python).
        """
        sgs = self.new_subgraphs(kind, node, ("then", "else"))
        envs = []
        for sg, build in zip(sgs, (then_build, else_build)):
            env = dict(self.env)
            sg.outputs = [self.inside(sg, env, build)]
            envs.append(env)
        walrus = [n for n in stored_names(node) if n in self.locals
                  and any(env.get(n) is not self.env.get(n) for env in envs)]
        states = []
        for n in walrus:
            sides = [env.get(n) for env in envs]
            states.append(DEF if all(b is not None and b.state == DEF for b in sides) else MAYBE)
            for sg, b in zip(sgs, sides):
                sg.outputs.append(self._value_of(b))
        op = self.emit(ir.Cond(self.loc(node), pred, sgs[0], sgs[1], [], 1 + len(walrus), ("",) + tuple(walrus)))
        for n, v, st in zip(walrus, op.outputs[1:], states):
            self.env[n] = Binding(v, st)
        return op.output

    def expr_IfExp(self, node):
        pred = self.test(node.test)
        return self.cond_value(node, "ifexp", pred, lambda: self.expr(node.body), lambda: self.expr(node.orelse))

    def test(self, node):
        """A predicate: like expr, but ``and``/``or``/``not``/chained comparisons may give a plain bool
        instead of an operand's value, so that each operand's truth is taken exactly once, as Python's
        ``if a and b:`` does."""
        if isinstance(node, gast.BoolOp):
            is_and = isinstance(node.op, gast.And)
            kind = "and" if is_and else "or"

            def chain(values):
                first = self.test(values[0])
                if len(values) == 1:
                    return first
                rest = lambda: chain(values[1:])  # noqa: E731
                decided = lambda: ir.Const(not is_and)  # noqa: E731
                return self.cond_value(node, kind, first, *((rest, decided) if is_and else (decided, rest)))

            return chain(node.values)
        if isinstance(node, gast.UnaryOp) and isinstance(node.op, gast.Not):
            return self.call(node, operator.not_, [self.test(node.operand)])
        if isinstance(node, gast.Compare) and len(node.ops) > 1:
            return self.expr_Compare(node, if_false=lambda result: ir.Const(False))
        return self.expr(node)

    def expr_BoolOp(self, node):
        kind = "and" if isinstance(node.op, gast.And) else "or"

        def chain(values):
            first = self.expr(values[0])
            if len(values) == 1:
                return first
            rest = lambda: chain(values[1:])  # noqa: E731
            keep = lambda: first  # noqa: E731
            if kind == "and":
                return self.cond_value(node, kind, first, rest, keep)
            return self.cond_value(node, kind, first, keep, rest)

        return chain(node.values)

    def _compare_one(self, node, op, left, right):
        if isinstance(op, gast.In):
            return self.call(node, operator.contains, [right, left])
        return self.call(node, COMPARE[type(op)], [left, right])

    def expr_Compare(self, node, if_false=lambda result: result):
        def chain(left, i):
            right = self.expr(node.comparators[i])
            result = self._compare_one(node, node.ops[i], left, right)
            if i + 1 == len(node.ops):
                return result
            # a < b < c: the next comparison runs only when this one holds, and b is evaluated once
            return self.cond_value(node, "compare", result, lambda: chain(right, i + 1), lambda: if_false(result))

        return chain(self.expr(node.left), 0)

    def expr_ListComp(self, node):
        if getattr(node, "decides", None):
            return self._decided(node)
        return self._comprehension(node, "list", gast.List(elts=[], ctx=gast.Load()),
                                   lambda acc: _method_call(acc, "append", [node.elt], node))

    def _decided(self, node):
        """``any(e for x in xs)`` (``all``), marked by the canonicalizer: a loop that sets the result and breaks at
        the first item whose truth decides it, so that the items after it are not computed, as in Python."""
        is_all = node.decides == "all"

        def decide(acc):
            test = canon.not_(node.elt, node) if is_all else node.elt
            return canon.located(gast.If(test=test, body=[canon.assign(acc, canon.const(not is_all, node), node),
                                                          canon.located(gast.Break(), node)], orelse=[]), node)

        return self._comprehension(node, node.decides, canon.const(is_all, node), decide)

    def expr_SetComp(self, node):
        return self._comprehension(node, "set", gast.Call(func=canon.name(_SET, at=node), args=[], keywords=[]),
                                   lambda acc: _method_call(acc, "add", [node.elt], node))

    def expr_DictComp(self, node):
        def put(acc):  # the key is evaluated before the value, as in Python 3.8+
            target = gast.Subscript(value=canon.name(acc, at=node), slice=node.key, ctx=gast.Store())
            return canon.located(gast.Assign(targets=[canon.located(target, node)], value=node.value,
                                             type_comment=None), node)

        return self._comprehension(node, "dict", gast.Dict(keys=[], values=[]), put)

    def _comprehension(self, node, kind, empty, add):
        """A comprehension lowered to a loop that adds to an accumulator (``add(acc)``, a statement),
        converted in place: its targets do not leak, a walrus inside binds in the function."""
        self.comprehensions += 1
        acc = f".{kind}comp{self.comprehensions}"
        body = add(acc)
        for gen in reversed(node.generators):
            for cond in reversed(gen.ifs):
                body = canon.located(gast.If(test=cond, body=[body], orelse=[]), cond)
            body = canon.located(gast.For(target=gen.target, iter=gen.iter, body=[body], orelse=[],
                                       type_comment=None), node)
        stmts = [canon.assign(acc, canon.located(empty, node), node), body]
        # (``[f(i, x) for i, x in enumerate(xs)]`` is an index loop over xs, as the ``for`` statement is)
        lowering = canon.Canonicalizer(builtins=self.builtins)
        lowering.counter = 100000 * self.comprehensions  # keep its synthetic names apart from the function's
        stmts = lowering.block(stmts)
        # the comprehension's own names (targets, synthetic); a walrus inside binds in the function
        scoped = [n for gen in node.generators for n in stored_names(gen.target)]
        scoped += [n for n in stored_names(stmts) if n.startswith(".")]
        saved = {n: self.env.get(n) for n in scoped}
        saved_locals, saved_cells = set(self.locals), dict(self.cells)
        self.locals |= set(scoped)
        for n in scoped:  # a target a nested scope inside uses gets a cell of this comprehension's own
            if n in self.captured:
                self.cells[n] = self.call(node, intrinsics.new_cell, [], hint=n)
            else:
                self.cells.pop(n, None)
        self.block(stmts)  # a walrus inside (`[last := x for x in xs]`) is bound after it if xs was not empty
        result = self.load(acc, node)
        self.locals, self.cells = saved_locals, saved_cells
        for n, b in saved.items():  # comprehension variables do not leak, as in Python 3
            if b is None:
                self.env.pop(n, None)
            else:
                self.env[n] = b
        return result

    # nested scopes: plain Python functions sharing the cells of the variables they use (``closures``)

    def expr_Lambda(self, node):
        return self._function(node)

    def expr_GeneratorExp(self, node):
        # the first iterable is evaluated here, and iterated, as Python does before the generator runs
        first = self.call(node, iter, [self.expr(node.generators[0].iter)])
        return self.call(node, self._function(node), [first], hint="genexpr")

    def _function(self, node):
        """The function object of a nested scope, made as Python's MAKE_FUNCTION makes it: defaults, then
        keyword-only defaults, then annotations, are evaluated here."""
        code = self.scope_codes[id(node)]
        defaults = kwdefaults = annotations = ir.Const(None)
        if not isinstance(node, gast.GeneratorExp):
            args = node.args
            if args.defaults:
                defaults = self.call(node, intrinsics.build_tuple, [self.expr(d) for d in args.defaults])
            kw = [(a.id, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            if kw:
                kwdefaults = self.call(node, intrinsics.build_dict,
                                       [x for name, d in kw for x in (ir.Const(name), self.expr(d))])
            if isinstance(node, gast.FunctionDef):
                annotations = self._annotations(node)
        cells = [self._cell_for(name, node) for name in code.co_freevars]
        return self.call(node, intrinsics.make_function,
                         [ir.Const(code), ir.Const(self.p.globals), defaults, kwdefaults, annotations, *cells],
                         hint=code.co_name)

    def _annotations(self, node):
        args = node.args
        every = args.posonlyargs + args.args + [args.vararg] * bool(args.vararg) + args.kwonlyargs + \
            [args.kwarg] * bool(args.kwarg)
        pairs = [(a.id, a.annotation) for a in every if a.annotation is not None]
        pairs += [("return", node.returns)] if node.returns is not None else []
        if not pairs:
            return ir.Const(None)
        as_text = closures.postponed_annotations(self.p.fn)
        items = [x for name, a in pairs
                 for x in (ir.Const(name), ir.Const(closures.annotation_text(a)) if as_text else self.expr(a))]
        return self.call(node, intrinsics.build_dict, items)

    def _cell_for(self, name, node):
        """The cell for ``name``, a free variable of a nested scope's code (its private names mangled)."""
        plain = self.demangle(name)
        if plain in self.cells:
            return self.cells[plain]
        if plain in self.fixed_cells:
            return self.fixed_cells[plain]
        if name in self.p.freevars:
            return ir.Const(self.p.freevars[name])
        raise self.loc(node).error(f"the variable '{name}' that this nested function uses is not found in the "
                                   f"enclosing function", "closure")

    # calls

    def expr_Call(self, node):
        lift = self.p.lifted.get(node.func.id) if isinstance(node.func, gast.Name) else None
        if lift is not None:  # (its arguments first; then the variables it reads, as it would read them)
            args, kwargs = self._call_args(node)
            passed = [self._value_or_undefined(name, node.func) for name in lift.params]
            return self._invoke(node, lift.callee(self.owner if lift.takes_receiver else None), passed + args, kwargs)
        resolved = self._compiled_callee(node.func)
        if resolved is not None:
            handle, prefix = resolved
            if self._has_star_args(node):
                return self._invoke_unpacked(node, handle, prefix)
            if self._binds(node, handle, len(prefix)):
                args, kwargs = self._call_args(node)
                return self._invoke(node, handle, prefix + args, kwargs)
            # a wrong call: run it as an ordinary call, which raises Python's TypeError
        method = self._method_of_owner(node.func)
        if method is not None and not self._has_star_args(node) and self._binds(node, method, 1):
            return self._dispatch(node, method)
        if self._is_zero_arg_super(node):
            # super() finds its class and instance from the calling frame, which is generated
            # code here: pass them explicitly, as Python does implicitly
            cls = self.emit(ir.Capture(self.loc(node), "__class__")).output
            return self.call(node, self.load("super", node), [cls, self.load(self.p.params[0], node)], hint="super")
        if self._is_globals(node):
            return ir.Const(self.p.globals)  # the function's module, not the generated code's
        reader = self._frame_reader(node)
        if reader is not None:
            return reader
        fn = self.expr(node.func)
        args, star = self._elements(node.args)
        kwargs = [(k.arg, self.expr(k.value)) for k in node.keywords]
        hint = node.func.attr if isinstance(node.func, gast.Attribute) else getattr(node.func, "id", "")
        return self.call(node, fn, args, kwargs, star, hint=hint)

    def _is_zero_arg_super(self, node):
        return (isinstance(node.func, gast.Name) and node.func.id == "super" and not node.args
                and not node.keywords and "super" not in self.locals and "__class__" in self.p.freevars
                and bool(self.p.params))

    def _frame_reader(self, node):
        """``locals()``, ``vars()``, ``dir()`` and one-argument ``eval``/``exec`` read the calling frame, which
        is generated code here: they get the function's own variables (those bound on the path taken), as
        Python gives them, and eval and exec its globals too. None for any other call."""
        name = node.func.id if isinstance(node.func, gast.Name) else None
        arity = {"locals": 0, "vars": 0, "dir": 0, "eval": 1, "exec": 1}.get(name)
        if (arity is None or len(node.args) != arity or node.keywords or name in self.locals
                or name in self.p.globals or name in self.p.freevars
                or any(isinstance(a, gast.Starred) for a in node.args)):
            return None
        items = []
        for ident in self.frame_order:
            b = self.env.get(ident)
            if ident in self.cells:
                value = self.call(node, intrinsics.cell_or_undefined, [self.cells[ident]], hint=ident)
            elif b is None:
                continue  # (bound on no path that reaches here)
            else:
                value = b.value  # (UNDEFINED where a path left it unbound: frame_locals leaves it out)
            items += [ir.Const(ident), value]
        frame = self.call(node, intrinsics.frame_locals, items, hint="locals")
        if name in ("locals", "vars"):
            return frame
        if name == "dir":
            return self.call(node, ir.Const(sorted), [frame], hint="dir")
        return self.call(node, ir.Const(eval if name == "eval" else exec),
                         [self.expr(node.args[0]), ir.Const(self.p.globals), frame], hint=name)

    def _is_globals(self, node):
        return (isinstance(node.func, gast.Name) and node.func.id == "globals" and not node.args
                and not node.keywords and "globals" not in self.locals and "globals" not in self.p.globals
                and "globals" not in self.p.freevars)

    def _self_value(self):
        """The bound instance of a method, unless the code rebound its name."""
        if self.self_name is None:
            return None
        b = self.env.get(self.self_name)
        if b is None or b.state != DEF or not getattr(b.value, "is_self", False):
            return None
        return b.value

    def _compiled_callee(self, func):
        """(handle, prefix operands) when ``func`` names a compiled function at build time."""
        if isinstance(func, gast.Name) and func.id == self.self_name and self._self_value() is not None:
            func_name, on_self = "__call__", True  # self(...) of a class with a compiled __call__
        elif (isinstance(func, gast.Attribute) and isinstance(func.value, gast.Name)
              and func.value.id == self.self_name and self._self_value() is not None):
            func_name, on_self = self.mangle(func.attr), True
        elif isinstance(func, gast.Name) and func.id not in self.locals and func.id not in INTERNAL:
            func_name, on_self = func.id, False
        else:
            return None
        if on_self:
            try:
                obj = inspect.getattr_static(self.owner, func_name)
            except AttributeError:
                return None
            handle = self.callee_of(obj, self.owner)
            return (handle, [self._self_value()]) if handle is not None else None
        if func_name in self.p.freevars:
            try:
                obj = self.p.freevars[func_name].cell_contents
            except ValueError:
                return None
        elif func_name in self.p.globals:
            obj = self.p.globals[func_name]
        else:
            return None
        handle = self.callee_of(obj, None)
        return (handle, []) if handle is not None else None

    def _value_or_undefined(self, ident, node):
        """Variable ``ident``'s value, UNDEFINED where it is unbound (what a lifted def's call passes: the def
        raises Python's error where it reads it, as the closure would)."""
        if ident in self.cells:
            return self.call(node, intrinsics.cell_or_undefined, [self.cells[ident]], hint=ident)
        b = self.env.get(ident)
        if b is not None:
            return b.value
        return ir.Const(intrinsics.UNDEFINED) if ident in self.locals else self.load(ident, node)

    def _method_of_owner(self, func):
        """For ``x.m(...)`` in a method of class C whose ``m`` is compiled: the handle of C.m."""
        if self.owner is None or not isinstance(func, gast.Attribute):
            return None
        try:
            obj = inspect.getattr_static(self.owner, self.mangle(func.attr))
        except AttributeError:
            return None
        return self.callee_of(obj, self.owner)

    def _dispatch(self, node, handle):
        """``x.m(...)``: an Invoke of C.m when x is exactly a C without an instance attribute m (a tree
        of C objects recursing through its children runs in the frame tree), else the ordinary call."""
        obj = self.expr(node.func.value)
        attr = self.mangle(node.func.attr)
        is_owner = self.call(node, intrinsics.finds_in_class, [obj, ir.Const(self.owner), ir.Const(attr)])

        def invoke():
            args, kwargs = self._call_args(node)
            return self._invoke(node, handle, [obj] + args, kwargs)

        def ordinary():  # the method is looked up before the arguments are evaluated, as in Python
            method = self.call(node, getattr, [obj, ir.Const(attr)], hint=node.func.attr)
            args, kwargs = self._call_args(node)
            return self.call(node, method, args, list(kwargs.items()), hint=node.func.attr)

        return self.cond_value(node, "dispatch", is_owner, invoke, ordinary)

    @staticmethod
    def _has_star_args(node):
        return any(isinstance(a, gast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)

    def _invoke_unpacked(self, node, handle, prefix):
        """``f(*args, **kwargs)`` of a compiled f: the arguments are bound to f's parameters when the call
        runs (by f's binder, which raises Python's own TypeError for a wrong call), then invoked."""
        args, star = self._elements(node.args)
        kwargs = [(k.arg, self.expr(k.value)) for k in node.keywords]
        n = len(handle.signature.parameters)
        values = self.call(node, handle.function.bind, prefix + args, kwargs, [len(prefix) + i for i in star],
                           n_outputs=n)
        values = [values] if n == 1 else list(values)
        hint = getattr(node.func, "attr", None) or getattr(node.func, "id", "")
        return self.emit(ir.Invoke(self.loc(node), handle.ir_name, handle, values, (hint,))).output

    @staticmethod
    def _binds(node, handle, n_prefix):
        """Whether the call's arguments fit the compiled function's signature."""
        try:
            handle.signature.bind(*([None] * n_prefix), *node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError:
            return False
        return True

    def _call_args(self, node):
        return [self.expr(a) for a in node.args], {k.arg: self.expr(k.value) for k in node.keywords}

    def _invoke(self, node, handle, args, kwargs):
        """An Invoke of ``handle`` with evaluated operands, bound to its parameters as Python binds them."""
        bound = handle.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        operands = []
        for pname, param in handle.signature.parameters.items():
            value = bound.arguments[pname]
            if param.kind is inspect.Parameter.VAR_POSITIONAL:
                value = self.call(node, intrinsics.build_tuple, list(value))
            elif param.kind is inspect.Parameter.VAR_KEYWORD:
                value = self.call(node, dict, [], list(value.items()))
            elif not isinstance(value, (ir.Value, ir.Const)):
                value = ir.Const(value)  # a default: the very object Python would pass
            operands.append(value)
        hint = getattr(node.func, "attr", None) or getattr(node.func, "id", "")
        return self.emit(ir.Invoke(self.loc(node), handle.ir_name, handle, operands, (hint,))).output


def convert(parsed, name, owner, callee_of):
    """The function SubGraph (with its nested SubGraphs) of ``parsed``."""
    return Converter(parsed, name, owner, callee_of).convert()
