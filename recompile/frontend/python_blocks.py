"""``with``, ``try``, ``match`` and ``class`` statements, run as the plain Python they are.

Such a statement becomes a nested function ``<with>`` (``<try>``, ...) that holds it, called where the
statement stood: a nested scope like any other (``closures``), so Python itself runs ``__enter__`` and
``__exit__`` on every way out, its handlers, ``finally`` clauses and patterns. The function declares
``nonlocal`` (or ``global``) every variable the statement binds, so that they stay the enclosing function's. A
``return`` in it, and a ``break`` or ``continue`` of a loop around it, becomes ``return (jump, value)``; the
enclosing function then returns, breaks or continues itself.
"""

from __future__ import annotations

import gast

from .closures import walk_scope

KINDS = {gast.With: "with", gast.Try: "try", gast.Match: "match", gast.ClassDef: "class"}
if hasattr(gast, "TryStar"):
    KINDS[gast.TryStar] = "try"
FELL_THROUGH, RETURNED, BROKE, CONTINUED = 0, 1, 2, 3
_SCOPES = (gast.FunctionDef, gast.AsyncFunctionDef, gast.ClassDef, gast.Lambda)


def is_python_block(node):
    """Whether ``node`` is the nested function ``lower`` made of such a statement."""
    return getattr(node, "_python_block", False)


def bound_by(node):
    """The names a statement binds in its own scope, in first-binding order (match patterns' captures too;
    not a comprehension's targets)."""
    names = []
    targets = {id(t) for n in walk_scope(node) if isinstance(n, gast.comprehension) for t in gast.walk(n.target)}
    for n in walk_scope(node):
        found = ()
        if isinstance(n, gast.Name) and isinstance(n.ctx, (gast.Store, gast.Del)) and id(n) not in targets:
            found = (n.id,)
        elif isinstance(n, (gast.MatchAs, gast.MatchStar)) and n.name:
            found = (n.name,)
        elif isinstance(n, gast.MatchMapping) and n.rest:
            found = (n.rest,)
        elif isinstance(n, (gast.FunctionDef, gast.ClassDef)):
            found = (n.name,)
        elif isinstance(n, gast.Import):
            found = tuple(a.asname or a.name.partition(".")[0] for a in n.names)
        elif isinstance(n, gast.ImportFrom):
            found = tuple(a.asname or a.name for a in n.names)
        names.extend(x for x in found if x not in names)
    return names


def lower(stmt, n, declared, first_param, at):
    """(the nested function holding ``stmt``, the statements that call it and act on its result).
    ``declared``: the enclosing function's global and nonlocal names; ``first_param``: the name of its first
    parameter, which a zero-argument ``super()`` in it reads; ``at(new, old)`` positions a node."""
    kind = KINDS[type(stmt)]
    jumps = set()
    _rewrite([stmt], False, jumps, at)
    if first_param is not None and not isinstance(stmt, gast.ClassDef):
        _explicit_super(stmt, first_param, at)
    names = bound_by(stmt)
    glob = [x for x in names if declared.get(x) == "global"]
    nonlocal_ = [x for x in names if declared.get(x) != "global"]
    body = ([at(gast.Global(names=glob), stmt)] if glob else []) + \
        ([at(gast.Nonlocal(names=nonlocal_), stmt)] if nonlocal_ else [])
    body += [stmt, _returns(FELL_THROUGH, None, stmt, at)]
    args = gast.arguments(args=[], posonlyargs=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                          defaults=[])
    helper = at(gast.FunctionDef(name=f"<{kind}>", args=args, body=body, decorator_list=[], returns=None,
                                 type_comment=None, type_params=[]), stmt)
    helper._python_block = True
    helper.binds = names  # (the enclosing function's variables, which it binds: ``binds``)
    call = at(gast.Call(func=_name(helper.name, stmt, at), args=[], keywords=[]), stmt)
    if not jumps:
        return helper, [at(gast.Expr(value=call), stmt)]
    result = f".{kind}{n}"
    calls = [at(gast.Assign(targets=[_name(result, stmt, at, store=True)], value=call, type_comment=None), stmt)]

    def part(k):
        index = at(gast.Constant(value=k, kind=None), stmt)
        return at(gast.Subscript(value=_name(result, stmt, at), slice=index, ctx=gast.Load()), stmt)

    for jump in sorted(jumps):
        expected = at(gast.Constant(value=jump, kind=None), stmt)
        test = at(gast.Compare(left=part(0), ops=[gast.Eq()], comparators=[expected]), stmt)
        act = gast.Return(value=part(1)) if jump == RETURNED else gast.Break() if jump == BROKE else gast.Continue()
        calls.append(at(gast.If(test=test, body=[at(act, stmt)], orelse=[]), stmt))
    return helper, calls


def binds(node):
    """The enclosing function's variables that a nested function made by ``lower`` binds, else ()."""
    return getattr(node, "binds", ()) if is_python_block(node) else ()


def _rewrite(stmts, in_loop, jumps, at):
    """Turn the jumps of ``stmts`` that leave the statement into returns of (jump, value)."""
    for i, s in enumerate(stmts):
        if isinstance(s, gast.Return):
            jumps.add(RETURNED)
            stmts[i] = _returns(RETURNED, s.value, s, at)
        elif isinstance(s, (gast.Break, gast.Continue)) and not in_loop:
            jump = BROKE if isinstance(s, gast.Break) else CONTINUED
            jumps.add(jump)
            stmts[i] = _returns(jump, None, s, at)
        elif isinstance(s, (gast.For, gast.While, gast.AsyncFor)):
            _rewrite(s.body, True, jumps, at)
            _rewrite(s.orelse, in_loop, jumps, at)  # (a break in a loop's else leaves the loop around it)
        elif not isinstance(s, _SCOPES):
            for field in ("body", "orelse", "finalbody"):
                _rewrite(getattr(s, field, None) or [], in_loop, jumps, at)
            for part in getattr(s, "handlers", None) or getattr(s, "cases", None) or []:
                _rewrite(part.body, in_loop, jumps, at)


def _explicit_super(stmt, first_param, at):
    """``super()`` finds its class and instance in its own function: in the nested function, name them."""
    for node in walk_scope(stmt):
        if (isinstance(node, gast.Call) and isinstance(node.func, gast.Name) and node.func.id == "super"
                and not node.args and not node.keywords):
            node.args = [_name("__class__", node, at), _name(first_param, node, at)]


def _returns(jump, value, old, at):
    value = value if value is not None else at(gast.Constant(value=None, kind=None), old)
    pair = at(gast.Tuple(elts=[at(gast.Constant(value=jump, kind=None), old), value], ctx=gast.Load()), old)
    return at(gast.Return(value=pair), old)


def _name(ident, old, at, store=False):
    return at(gast.Name(id=ident, ctx=gast.Store() if store else gast.Load(), annotation=None, type_comment=None),
              old)
