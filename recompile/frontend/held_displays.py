"""A list or tuple display a name holds, then walked by ``for`` (``children = [tree.left[i], tree.right[i]]``,
``for child in children:``), walked as the display itself.

AST -> AST, before canonicalize. Where the name is a local of the function that no nested scope reads, and
every mention of it after the assignment, up to the first other one, is the iterable of a ``for`` or of a
comprehension's first ``for``, the items are held by names of their own (evaluated in order, before the list is
made, as Python does) and those walks go over a display of those names: the objects the list holds, which
nothing can change, since nothing else reads the list there. A ``for`` over a display of a few items is then its
body once per item (canonicalize), so a node's calls on its children are calls of one block, which a batched
run issues together and a level program takes, where a loop issues one an iteration.
"""

from __future__ import annotations

import itertools

import gast

_NESTED = (gast.FunctionDef, gast.AsyncFunctionDef, gast.Lambda, gast.ClassDef)
# (statements whose bodies run as nested Python functions, found again by the very node: not rewritten)
_KEPT = (gast.With, gast.AsyncWith, gast.Try, gast.Match, *([gast.TryStar] if hasattr(gast, "TryStar") else []))


def walked_displays(body, declared, most):
    """``body`` (the function's statements) with such walks rewritten, of displays of at most ``most`` items (as
    many as canonicalize unrolls: more stay a loop, gaining nothing); ``declared``: its global and nonlocal
    names."""
    closed = {n.id for stmt in body for node in gast.walk(stmt) if isinstance(node, _NESTED)
              for n in gast.walk(node) if isinstance(n, gast.Name)}
    return _block(body, set(declared) | closed, itertools.count(1), most)


def _block(stmts, excluded, counter, most):
    out = []
    for i, s in enumerate(stmts):
        if isinstance(s, (gast.If, gast.For, gast.While)):
            s.body, s.orelse = _block(s.body, excluded, counter, most), _block(s.orelse, excluded, counter, most)
        held = _held_display(s, excluded, most)
        walks = _walks(stmts[i + 1:], held.targets[0].id) if held is not None else []
        if not walks:
            out.append(s)
            continue
        n = next(counter)
        items = [f".held{n}_{k}" for k in range(len(held.value.elts))]
        out += [gast.copy_location(gast.Assign(targets=[_name(item, gast.Store(), e)], value=e, type_comment=None),
                                   e) for item, e in zip(items, held.value.elts)]
        held.value.elts = [_name(item, gast.Load(), e) for item, e in zip(items, held.value.elts)]
        out.append(held)
        for walk in walks:  # (each now walks the display of the held items)
            walk.iter = gast.copy_location(
                gast.Tuple(elts=[_name(item, gast.Load(), walk.iter) for item in items], ctx=gast.Load()), walk.iter)
    return out


def _held_display(s, excluded, most):
    """Assignment ``s`` where it is ``x = [a, b]`` (or a tuple) of a few items, none starred, x a local name."""
    if not isinstance(s, gast.Assign) or len(s.targets) != 1 or not isinstance(s.targets[0], gast.Name):
        return None
    value = s.value
    if not isinstance(value, (gast.List, gast.Tuple)) or not 0 < len(value.elts) <= most or any(
            isinstance(e, gast.Starred) for e in value.elts):
        return None
    return None if s.targets[0].id in excluded else s


def _walks(rest, ident):
    """The ``for`` statements and comprehensions' first ``for`` that walk ``ident`` in the first statements of
    ``rest`` that mention it only so (up to one that mentions it otherwise, or holds a python block)."""
    found = []
    for s in rest:
        mentions = _mentions(s, ident)
        if not mentions:
            continue
        walked = _walked_at(s, ident)
        if _holds_kept(s) or len(mentions) != len(walked):
            break
        found += walked
    return found


def _holds_kept(s):
    """Whether statement ``s`` is or holds (in a branch, a loop's body) a ``with``, ``try`` or ``match``."""
    return any(isinstance(node, _KEPT) for node in gast.walk(s))


def _mentions(s, ident):
    return [n for n in gast.walk(s) if isinstance(n, gast.Name) and n.id == ident]


def _walked_at(s, ident):
    """The ``for`` statements and comprehensions' first ``for`` in ``s`` that walk ``ident`` itself. (Not a
    generator expression's: it may walk the list after a later statement changed it.)"""
    found = []
    for node in gast.walk(s):
        if isinstance(node, gast.For) and _is_name(node.iter, ident):
            found.append(node)
        elif isinstance(node, (gast.ListComp, gast.SetComp, gast.DictComp)) and _is_name(
                node.generators[0].iter, ident):
            found.append(node.generators[0])
    return found


def _is_name(x, ident):
    return isinstance(x, gast.Name) and x.id == ident


def _name(ident, ctx, at):
    return gast.copy_location(gast.Name(id=ident, ctx=ctx, annotation=None, type_comment=None), at)
