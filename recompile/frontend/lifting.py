"""Nested defs that a compiled function only calls, compiled as functions of their own ("lifted").

A recursive helper written inside the function that uses it (``def walk(i): ... walk(tree.left[i]) ...`` in
``encode``) would run as the plain Python of a nested scope: one instance at a time, its recursion Python's. Where
the nested def is a plain function that the enclosing function, and the defs lifted with it, only call by name,
it is compiled as a function of its own whose first parameters are the enclosing function's variables it reads
(``tree``, ``self``). Each call passes their values as they are at the call. That is what the closure would read:
no scope rebinds them (nothing declares ``nonlocal``), and the enclosing function's code does not run while the
nested one does. Its calls are then Invokes, batched like a method's recursion.

What is lifted: a ``def`` statement directly in the function's body, with no decorators and only constant
defaults, that is no generator and declares nothing ``nonlocal``; its name bound by that ``def`` alone, and read
only as the callee of calls (no ``*args`` or ``**kwargs``) in the function's own code after the last lifted
``def``, or in the bodies of the lifted defs. Anything else keeps running as Python (``closures``).
"""

from __future__ import annotations

import copy
import types

import gast

from . import closures, python_blocks

# statements run as nested Python functions (``python_blocks``): a call of a lifted def in one would need a function
_BLOCKS = tuple(python_blocks.KINDS)
# names whose calls read or run the scope's variables by name: no def of such a function is lifted
_FRAME_READERS = {"locals", "vars", "eval", "exec", "dir"}


class Lift:
    """A nested def compiled as a function of its own: ``node`` (the def in the enclosing function's source),
    ``params`` (the enclosing function's variables it reads, passed first at each call: its receiver first, where
    it reads that), ``takes_receiver`` (whether its first parameter is the enclosing method's ``self``), and
    ``callee(owner)``, its handle."""

    def __init__(self, node, index, passed, calls, own_locals):
        self.node, self.index = node, index
        self.passed, self.calls, self.own_locals = passed, calls, own_locals
        self.params = ()
        self.takes_receiver = False
        self.maybe_unbound = frozenset()  # (params that may be unbound at a call: read with Python's check)
        self.function = None  # (made on first use: ``program.Function.lifted``)
        self.make = None

    def callee(self, owner):
        if self.function is None:
            self.function = self.make(self)
        return self.function.callee(owner)


def visible(parsed):
    """The names a nested scope of ``parsed`` may read of it: its variables and free variables."""
    from .convert import stored_names

    declared = closures.declarations(parsed.node.body)
    return (set(stored_names(parsed.node.body)) | set(parsed.params) | set(parsed.freevars)) - set(declared)


def find(parsed, visible):
    """{name: Lift} of the nested defs of ``parsed`` (a ParsedFunction) that are lifted; ``visible``: what
    ``visible(parsed)`` gives."""
    body = parsed.node.body
    declared = closures.declarations(body)
    own = [n for stmt in body for n in _own_scope(stmt)]
    if any(isinstance(n, gast.Name) and n.id in _FRAME_READERS for n in own):
        return {}
    defs = {}
    for index, stmt in enumerate(body):
        if isinstance(stmt, gast.FunctionDef) and _plain(stmt) and stmt.name not in declared:
            defs[stmt.name] = (stmt, index)
    bindings = {}
    for stmt in body:
        for name in python_blocks.bound_by(stmt):
            bindings[name] = bindings.get(name, 0) + 1
    lifts = {}
    for name, (node, index) in defs.items():
        if bindings.get(name) != 1:
            continue
        code = closures.scope_code(node, visible, parsed.fn, parsed.class_name())
        free = [_demangled(parsed, n) for n in code.co_freevars]
        own_locals = set(code.co_varnames) | set(code.co_cellvars)
        lifts[name] = Lift(node, index, [n for n in free if n in visible and n not in parsed.freevars],
                           [n for n in free if n in defs], own_locals)
    while True:  # (drop what breaks a rule, until nothing does: a dropped def is a plain function again)
        dropped = _breaking(parsed, body, own, lifts)
        if not dropped:
            break
        for name in dropped:
            del lifts[name]
    receiver = parsed.params[0] if parsed.params else None
    bound = _surely_bound(parsed, body, max((lift.index for lift in lifts.values()), default=0))
    for name, lift in lifts.items():
        params = sorted(_params(name, lifts, set()) - set(lifts))
        lift.takes_receiver = receiver in params
        lift.params = tuple([receiver] * lift.takes_receiver + [p for p in params if p != receiver])
        lift.maybe_unbound = frozenset(params) - bound
    return lifts


def _surely_bound(parsed, body, last):
    """The variables of ``parsed`` bound wherever a lifted def is called: its parameters, and what a statement of its
    body before the last lifted def assigns (its calls come after), unless some ``del`` unbinds them."""
    names = set(parsed.params)
    for stmt in body[:last]:
        targets = stmt.targets if isinstance(stmt, gast.Assign) else \
            [stmt.target] if isinstance(stmt, gast.AnnAssign) and stmt.value is not None else []
        names.update(n.id for t in targets for n in gast.walk(t) if isinstance(n, gast.Name))
    deleted = {n.id for stmt in body for n in closures.walk_scope(stmt)
               if isinstance(n, gast.Name) and isinstance(n.ctx, gast.Del)}
    return names - deleted


def _plain(node):
    """A def with nothing the enclosing function evaluates for it but constants, no generator, no ``nonlocal``."""
    args = node.args
    if node.decorator_list or not all(isinstance(d, gast.Constant) for d in args.defaults) or \
            not all(d is None or isinstance(d, gast.Constant) for d in args.kw_defaults):
        return False
    inside = [n for stmt in node.body for n in closures.walk_scope(stmt)]
    if any(isinstance(n, (gast.Yield, gast.YieldFrom, gast.Await)) for n in inside):
        return False
    return not any(isinstance(n, gast.Nonlocal) for n in gast.walk(node))


def _breaking(parsed, body, own, lifts):
    """The names of ``lifts`` that break a rule, given the others."""
    allowed = {id(n) for n in own}
    for lift in lifts.values():
        allowed.update(id(n) for stmt in lift.node.body for n in _own_scope(stmt))
    callees = {id(n.func) for n in gast.walk(parsed.node) if isinstance(n, gast.Call) and isinstance(n.func, gast.Name)
               and not any(isinstance(a, gast.Starred) for a in n.args) and all(k.arg for k in n.keywords)}
    last = max((lift.index for lift in lifts.values()), default=-1)
    before = {id(n) for stmt in body[:last] for n in _own_scope(stmt)}
    broken = set()
    for node in gast.walk(parsed.node):
        if not (isinstance(node, gast.Name) and node.id in lifts):
            continue
        if isinstance(node.ctx, gast.Load) and id(node) in allowed and id(node) in callees and id(node) not in before:
            continue
        if not isinstance(node.ctx, gast.Load) and id(node) not in allowed:
            continue  # (another scope's variable of that name: a parameter of a lambda, say)
        broken.add(node.id)
    for name, lift in lifts.items():  # (a sibling it calls must be lifted too, and its variables not shadowed)
        needs = _params(name, lifts, set())
        if any(callee not in lifts for callee in lift.calls) or needs & lift.own_locals:
            broken.add(name)
    return broken


def _params(name, lifts, seen):
    """The variables ``lifts[name]`` passes on: its own, and those of the lifted defs it calls."""
    seen.add(name)
    lift = lifts[name]
    out = set(lift.passed)
    for callee in lift.calls:
        if callee in lifts and callee not in seen:
            out |= _params(callee, lifts, seen)
    return out


def _own_scope(stmt):
    """The nodes of ``stmt`` that run in its function's own scope: not nested scopes' bodies, nor the statements
    run as Python functions (``python_blocks``)."""
    stack = [stmt]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, closures.NESTED + (gast.ClassDef,)):
            stack.extend(reversed(closures.enclosing_parts(node)))
        elif not isinstance(node, _BLOCKS):
            stack.extend(reversed(list(gast.iter_child_nodes(node))))


def _demangled(parsed, name):
    cls = parsed.class_name()
    prefix = f"_{cls.lstrip('_')}__" if cls else None
    return "__" + name[len(prefix):] if prefix and cls.strip("_") and name.startswith(prefix) else name


def function_of(parsed, name, lift, visible):
    """(the Python function, its ParsedFunction) of ``lift``, the nested def ``name`` of ``parsed``: the def with
    ``lift.params`` first, compiled at its lines in the user's file; the enclosing function's free variables it
    reads are the enclosing function's own cells."""
    from .parse import ParsedFunction

    node = copy.deepcopy(lift.node)
    args = node.args
    added = [gast.copy_location(gast.Name(id=p, ctx=gast.Param(), annotation=None, type_comment=None), node)
             for p in lift.params]
    if args.posonlyargs:
        args.posonlyargs = added + args.posonlyargs
    else:
        args.args = added + args.args
    for a in args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]:
        a.annotation = None  # (evaluated by the def, which no longer runs: a function's own code ignores them)
    node.returns = None
    code = closures.scope_code(node, visible, parsed.fn, parsed.class_name())
    cells = tuple(parsed.freevars.get(n) or types.CellType() for n in code.co_freevars)  # (a sibling: unread)
    defaults = tuple(d.value for d in args.defaults) or None
    python = types.FunctionType(code, parsed.globals, code.co_name, defaults, cells)
    kw = {a.id: d.value for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    if kw:
        python.__kwdefaults__ = kw
    inner = ParsedFunction(python, node, parsed.filename)
    # (the lifted defs it reads as free variables; one of its own variables of such a name is its own)
    inner.lifted = {n: other for n, other in parsed.lifted.items() if n in inner.freevars}
    inner.maybe_unbound = lift.maybe_unbound
    return python, inner
