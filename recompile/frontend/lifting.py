"""Nested defs that a compiled function only calls, compiled as functions of their own ("lifted").

A recursive helper written inside the function that uses it (``def walk(i): ... walk(tree.left[i]) ...`` in
``encode``) would run as the plain Python of a nested scope: one instance at a time, its recursion Python's. Where
the nested def is a plain function that the enclosing function, and the defs lifted with it, only call by name,
it is compiled as a function of its own whose first parameters are the enclosing function's variables it reads
(``tree``, ``self``). Each call passes their values as they are at the call. That is what the closure would read:
no scope rebinds them (nothing declares ``nonlocal``), and the enclosing function's code does not run while the
nested one does. Its calls are then Invokes, batched like a method's recursion.

What is lifted: a ``def`` statement directly in the function's body, with no decorators, only constant defaults
and no ``**kwargs``, that is no generator and reads no ``locals()``, ``super()`` or ``__class__``; its name bound
by that ``def`` alone, and read only as the callee of calls that fit its parameters (no ``*args`` or
``**kwargs``), in the function's own code after the last lifted ``def`` or in the bodies of the lifted defs, where
no comprehension's target hides a variable it reads. No scope of the function declares ``nonlocal`` or binds with
``:=`` in a generator expression, nothing in it reads ``locals()``, and no lambda, def, class or generator
expression inside the def (one consumed at once by ``sum``, ``sorted`` ... aside) reads a variable passed: each
could see the variable change. Anything else keeps running as Python (``closures``).
"""

from __future__ import annotations

import copy
import inspect
import types

import gast

from . import closures, python_blocks
from .validate import refused

# statements run as nested Python functions (``python_blocks``): a call of a lifted def in one would need a function
_BLOCKS = tuple(python_blocks.KINDS)
# names whose calls read or run the scope's variables by name, or the function's class cell: no def is lifted out
# of a function that reads them, nor one that reads them itself
_FRAME_READERS = {"locals", "vars", "eval", "exec", "dir", "super", "__class__"}
# builtins that consume a generator expression given to them at once (it cannot outlive the call)
_CONSUMERS = {"sum", "min", "max", "sorted", "tuple", "list", "set", "frozenset", "any", "all", "dict"}


class Lift:
    """A nested def compiled as a function of its own: ``node`` (the def in the enclosing function's source),
    ``params`` (the enclosing function's variables it reads, passed first at each call: its receiver first, where
    it reads that), ``takes_receiver`` (whether its first parameter is the enclosing method's ``self``), and
    ``callee(owner)``, its handle."""

    def __init__(self, node, index, passed, calls, own_locals, signature):
        self.node, self.index = node, index
        self.passed, self.calls, self.own_locals = passed, calls, own_locals
        self.signature = signature  # (the def's own, without the passed parameters)
        self.params = ()
        self.takes_receiver = False
        self.maybe_unbound = frozenset()  # (params that may be unbound at a call: read with Python's check)
        self.function = None  # (made on first use by ``make(self)``: ``program.Function._lifted``, which sets it)
        self.make = None

    def callee(self, owner):
        return (self.function or self.make(self)).callee(owner)


def visible(parsed):
    """The names a nested scope of ``parsed`` may read of it: its variables and free variables."""
    body = parsed.node.body
    bound = {name for stmt in body for name in python_blocks.bound_by(stmt)}
    declared = closures.declarations(body)
    return (bound - set(declared) | set(parsed.params) | set(parsed.freevars)) - \
        {n for n, kind in declared.items() if kind == "global"}


def find(parsed, visible):
    """{name: Lift} of the nested defs of ``parsed`` (a ParsedFunction) that are lifted; ``visible``: what
    ``visible(parsed)`` gives."""
    body = parsed.node.body
    everything = list(gast.walk(parsed.node))
    generators = [g for g in everything if isinstance(g, gast.GeneratorExp)]
    if any(isinstance(n, gast.Nonlocal) for n in everything) or \
            any(isinstance(n, gast.NamedExpr) for g in generators for n in gast.walk(g)):
        return {}  # (a scope that rebinds the function's variables: what a closure reads may change during a call)
    scope = [n for stmt in body for n in closures.walk_scope(stmt)]
    if any(isinstance(n, gast.Name) and n.id in _FRAME_READERS for n in scope):
        return {}
    declared = closures.declarations(body)
    bindings = {}
    for stmt in body:
        for name in python_blocks.bound_by(stmt):
            bindings[name] = bindings.get(name, 0) + 1
    candidates = {}
    for index, stmt in enumerate(body):
        if isinstance(stmt, gast.FunctionDef) and stmt.name not in declared and bindings.get(stmt.name) == 1 \
                and _plain(stmt):
            candidates[stmt.name] = (stmt, index)
    lifts = {}
    for name, (node, index) in candidates.items():
        code = closures.scope_code(node, visible, parsed.fn, parsed.class_name())
        free = [parsed.demangle(n) for n in code.co_freevars]
        passed = [n for n in free if n in visible and n not in parsed.freevars and n not in candidates]
        if _read_by_inner_scopes(node, passed):
            continue
        args = node.args
        stand_in = types.FunctionType(code, {}, name, tuple(d.value for d in args.defaults) or None,
                                      tuple(types.CellType() for _ in code.co_freevars))
        stand_in.__kwdefaults__ = {a.id: d.value for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
        lifts[name] = Lift(node, index, passed, [n for n in free if n in candidates],
                           set(code.co_varnames) | set(code.co_cellvars), inspect.signature(stand_in))
    while True:  # (drop what breaks a rule, until nothing does: a dropped def is a plain function again)
        dropped = _breaking(parsed, body, lifts)
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
    """A def with nothing the enclosing function evaluates for it but constants and its annotations, no
    ``**kwargs`` (a keyword named as a passed variable is its own there), and in its own code nothing outside
    the compiled subset (a generator, ``await``), nor ``locals()``, ``super()`` or ``__class__``, which would see
    the passed variables as parameters."""
    args = node.args
    if node.decorator_list or args.kwarg is not None or \
            not all(isinstance(d, gast.Constant) for d in args.defaults) or \
            not all(d is None or isinstance(d, gast.Constant) for d in args.kw_defaults):
        return False
    inside = [n for stmt in node.body for n in closures.walk_scope(stmt)]
    return not any(refused(n) or isinstance(n, gast.Name) and n.id in _FRAME_READERS for n in inside)


def _read_by_inner_scopes(node, passed):
    """Whether a scope inside def ``node`` that may outlive a call (a lambda, a def, a class, a generator
    expression not consumed at once) reads one of the ``passed`` variables: it would keep the value passed, where
    the closure reads the variable as it is when the scope runs."""
    passed = set(passed)
    consumed = {id(n.args[0]) for n in gast.walk(node) if isinstance(n, gast.Call) and isinstance(n.func, gast.Name)
                and n.func.id in _CONSUMERS and len(n.args) == 1 and not n.keywords}
    for inner, _ in closures.nested_scopes(node.body):
        if isinstance(inner, gast.GeneratorExp) and id(inner) in consumed:
            continue
        if any(isinstance(n, gast.Name) and n.id in passed for n in gast.walk(inner)):
            return True
    return False


def _breaking(parsed, body, lifts):
    """The names of ``lifts`` that break a rule, given the others."""
    scopes = [n for stmt in body for n in _own_scope(stmt)]
    for lift in lifts.values():
        scopes += [n for stmt in lift.node.body for n in _own_scope(stmt)]
    allowed = {id(n) for n in scopes}
    calls = {id(n.func): n for n in gast.walk(parsed.node) if isinstance(n, gast.Call) and
             isinstance(n.func, gast.Name) and not any(isinstance(a, gast.Starred) for a in n.args) and
             all(k.arg for k in n.keywords)}
    last = max((lift.index for lift in lifts.values()), default=-1)
    before = {id(n) for stmt in body[:last] for n in _own_scope(stmt)}
    targets = {n.id for c in scopes if isinstance(c, gast.comprehension) for n in gast.walk(c.target)
               if isinstance(n, gast.Name)}
    broken = set()
    for node in gast.walk(parsed.node):
        if not (isinstance(node, gast.Name) and node.id in lifts):
            continue
        call = calls.get(id(node))
        if isinstance(node.ctx, gast.Load) and id(node) in allowed and call is not None and id(node) not in before \
                and _binds(lifts[node.id].signature, call):
            continue
        broken.add(node.id)
    for name, lift in lifts.items():  # (a sibling it calls must be lifted too, and its variables not shadowed)
        needs = _params(name, lifts, set())
        if any(callee not in lifts for callee in lift.calls) or needs & lift.own_locals or needs & targets:
            broken.add(name)
    return broken


def _binds(signature, call):
    """Whether ``call``'s arguments fit the def's own parameters (a wrong call raises Python's TypeError as the
    closure's call would: it stays Python)."""
    try:
        signature.bind(*call.args, **{k.arg: k.value for k in call.keywords})
    except TypeError:
        return False
    return True


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
