"""Nested scopes of a compiled function (``lambda``, a nested ``def``, a generator expression) as Python code.

A nested scope runs as plain Python. Python compiles its code, at its own lines in the user's file, inside a
stand-in for the enclosing function that declares the enclosing function's variables, so Python itself says
which of them the scope reads or writes (its ``co_freevars``). The compiled function keeps each such variable
in a cell that the scope's function object shares (``intrinsics.make_function``): the scope sees later
assignments, and its ``nonlocal`` writes are seen, as with Python's own closures.
"""

from __future__ import annotations

import __future__
import ast
import copy
import inspect

import gast

NESTED = (gast.Lambda, gast.FunctionDef, gast.GeneratorExp)
_SCOPES = NESTED + (gast.ClassDef,)  # (a class body is a scope of its own too)
_FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag


COMPREHENSIONS = (gast.ListComp, gast.SetComp, gast.DictComp)  # (converted in place: no scope of their own)


def walk_scope(root):
    """The nodes of ``root`` that run in its scope: of a nested scope, only what the enclosing scope
    evaluates for it (and the targets of a walrus in a generator expression, which bind there)."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES):
            parts = enclosing_parts(node)
            if isinstance(node, gast.GeneratorExp):
                parts = parts + [n.target for n in gast.walk(node) if isinstance(n, gast.NamedExpr)]
            stack.extend(reversed(parts))
        else:
            stack.extend(reversed(list(gast.iter_child_nodes(node))))


def declarations(body):
    """{name: "global" or "nonlocal"}: what the function's own statements declare."""
    found = {}
    for node in (n for stmt in body for n in walk_scope(stmt)):
        if isinstance(node, (gast.Global, gast.Nonlocal)):
            found.update(dict.fromkeys(node.names, "global" if isinstance(node, gast.Global) else "nonlocal"))
    return found


def written_from_inside(body):
    """Names that a nested scope in ``body`` (at any depth) declares nonlocal: it may rebind them."""
    return {name for stmt in body for node in gast.walk(stmt) if isinstance(node, gast.Nonlocal)
            for name in node.names}


def nested_scopes(body):
    """(nested scope, targets of the comprehensions around it) for each nested scope in the statements
    ``body``, not those inside another one (a comprehension is converted in place, so its targets are
    variables of the enclosing function where the scope reads them)."""
    found = []

    def scan(node, around):
        if isinstance(node, NESTED):
            found.append((node, around))
            for part in enclosing_parts(node):
                scan(part, around)
            return
        if isinstance(node, COMPREHENSIONS):
            around = around | {n.id for g in node.generators for n in gast.walk(g.target) if isinstance(n, gast.Name)}
        for child in gast.iter_child_nodes(node):
            scan(child, around)

    for stmt in body:
        scan(stmt, frozenset())
    return found


def enclosing_parts(node):
    """The parts of a nested scope that run in the enclosing scope: decorators, defaults, annotations, a
    generator expression's first iterable, a class's bases."""
    if isinstance(node, gast.GeneratorExp):
        return [node.generators[0].iter]
    if isinstance(node, gast.ClassDef):
        return list(node.decorator_list) + list(node.bases) + [k.value for k in node.keywords]
    args = node.args
    parts = list(getattr(node, "decorator_list", [])) + list(args.defaults) + [d for d in args.kw_defaults if d]
    if isinstance(node, gast.FunctionDef):
        everything = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
        parts += [a.annotation for a in everything if a.annotation is not None]
        parts += [node.returns] if node.returns is not None else []
    return parts


def scope_code(node, outer_names, fn, class_name=None):
    """The code object of nested scope ``node`` of function ``fn``, compiled where ``outer_names`` are the
    enclosing scope's variables (its ``co_freevars`` are the ones it uses) under ``fn``'s ``__future__``
    imports, in a class ``class_name`` where ``fn`` is a method (for private names). Decorators, defaults and
    annotations are left out: the enclosing scope evaluates them."""
    filename, qualname = fn.__code__.co_filename, fn.__qualname__
    node = _bare(copy.deepcopy(node))
    stmt = node if isinstance(node, gast.FunctionDef) else gast.Expr(value=node)
    # (each outer name bound, so that Python makes it a cell of the stand-in when the scope reads it)
    binds = [gast.Assign(targets=[gast.Name(id=n, ctx=gast.Store(), annotation=None, type_comment=None)],
                         value=gast.Constant(value=None, kind=None), type_comment=None)
             for n in sorted(outer_names) if n.isidentifier()]
    outer_name = qualname.rpartition(".")[2]
    stand_in = gast.FunctionDef(name=outer_name, args=_no_args(), body=binds + [stmt], decorator_list=[],
                                returns=None, type_comment=None, type_params=[])
    # (the binds take the stand-in's position: fix_missing_locations)
    stand_in.lineno, stand_in.end_lineno = node.lineno, getattr(node, "end_lineno", None) or node.lineno
    stand_in.col_offset = stand_in.end_col_offset = 0
    top = stand_in
    if class_name is not None:
        top = gast.ClassDef(name=class_name, bases=[], keywords=[], body=[stand_in], decorator_list=[],
                            type_params=[])
        top.lineno, top.end_lineno, top.col_offset, top.end_col_offset = stand_in.lineno, stand_in.end_lineno, 0, 0
    module = gast.gast_to_ast(gast.Module(body=[top], type_ignores=[]))
    ast.fix_missing_locations(module)
    code = compile(module, filename, "exec", flags=fn.__code__.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    for _ in range(3 if class_name is not None else 2):  # (module -> [class body ->] stand-in -> scope)
        outer, (code,) = code, [c for c in code.co_consts if hasattr(c, "co_freevars")]
    code = _requalified(code, outer.co_qualname, qualname)
    if isinstance(node, gast.FunctionDef) and node.name.startswith("<"):
        # the function a statement runs in (``python_blocks``): what it defines is the enclosing function's
        inside = f"{code.co_qualname}.<locals>."
        consts = tuple(_requalified(c, inside, f"{qualname}.<locals>.") if hasattr(c, "co_freevars") else c
                       for c in code.co_consts)
        code = code.replace(co_consts=consts)
    return code


def _bare(node):
    """The scope without what the enclosing scope evaluates (its code does not depend on them)."""
    if isinstance(node, gast.GeneratorExp):
        return node
    args = node.args
    args.defaults = []
    args.kw_defaults = [None] * len(args.kwonlyargs)
    for a in args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]:
        a.annotation = None
    if isinstance(node, gast.FunctionDef):
        node.decorator_list = []
        node.returns = None
    return node


def _no_args():
    return gast.arguments(args=[], posonlyargs=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                          defaults=[])


def _requalified(code, old, new):
    """``code`` and the code nested in it with qualnames under ``new`` instead of ``old`` (the stand-in's); a
    class body's ``__qualname__`` (a constant equal to its code's qualname) too."""
    qualname = new + code.co_qualname[len(old):] if code.co_qualname.startswith(old) else code.co_qualname
    is_class_body = not code.co_flags & inspect.CO_OPTIMIZED
    consts = tuple(_requalified(c, old, new) if hasattr(c, "co_freevars")
                   else qualname if is_class_body and type(c) is str and c == code.co_qualname else c
                   for c in code.co_consts)
    return code.replace(co_consts=consts, co_qualname=qualname)


def postponed_annotations(fn):
    """Whether ``fn``'s module has ``from __future__ import annotations`` (annotations are kept as text)."""
    return bool(fn.__code__.co_flags & __future__.annotations.compiler_flag)


def annotation_text(node):
    return ast.unparse(gast.gast_to_ast(copy.deepcopy(node)))
