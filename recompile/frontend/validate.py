"""Refuse, with the user's line and a caret, what the compiled subset does not cover.

Runs before any conversion so that nothing is half-compiled: the first
unsupported construct in source order is reported.
"""

from __future__ import annotations

import gast

from .closures import walk_scope

# node type -> (construct named in the message, why / what to do instead)
_REFUSED = {
    gast.AsyncWith: ("async with", "async with is not supported in a compiled function"),
    gast.AsyncFor: ("async for", "async for is not supported in a compiled function"),
    gast.AsyncFunctionDef: ("async def", "async def is not supported in a compiled function"),
    gast.Await: ("await", "await is not supported in a compiled function"),
    gast.Yield: ("yield", "yield (a generator function) is not supported in a compiled function"),
    gast.YieldFrom: ("yield from", "yield from (a generator function) is not supported in a compiled function"),
}
for _name in ("TypeAlias",):
    if hasattr(gast, _name):
        _REFUSED[getattr(gast, _name)] = (_name.lower(), f"{_name.lower()} is not supported in a compiled function")



def refused(node):
    """Whether ``node`` is a construct outside the subset."""
    return type(node) in _REFUSED


def validate(parsed):
    """Raise CompileError at the first construct outside the subset."""
    # only the body is compiled: decorators and defaults ran, as Python, when the def did; a nested function,
    # lambda or generator expression in it runs as the plain Python it is (``closures``)
    for node in (n for stmt in parsed.node.body for n in walk_scope(stmt)):
        refused = _REFUSED.get(type(node))
        if refused:
            construct, message = refused
            raise parsed.loc(node).error(message, construct)

