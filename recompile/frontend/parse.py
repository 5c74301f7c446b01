"""Source of a Python function -> gast FunctionDef with positions in the user's file."""

from __future__ import annotations

import inspect

import gast

from ..errors import CompileError


class ParsedFunction:
    """A function's gast tree, its file, and what Python knows of its scope."""

    def __init__(self, fn, node, filename):
        self.fn = fn
        self.node = node
        self.filename = filename
        self.globals = fn.__globals__
        code = fn.__code__
        self.freevars = dict(zip(code.co_freevars, fn.__closure__ or ()))
        self.signature = inspect.signature(fn)
        self.params = list(self.signature.parameters)

    def loc(self, node):
        from ..errors import Location

        return Location(self.filename, getattr(node, "lineno", self.node.lineno),
                        getattr(node, "col_offset", 0) + 1)


def _shift_lines(tree, delta):
    for node in gast.walk(tree):
        if getattr(node, "lineno", None) is not None:
            node.lineno += delta
            if getattr(node, "end_lineno", None) is not None:
                node.end_lineno += delta


def parse_function(fn):
    """Parse ``fn``'s source; raise CompileError where it cannot be had."""
    filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise CompileError(f"cannot read the source of {fn.__qualname__}: {exc}",
                           filename, fn.__code__.co_firstlineno, 1, "source") from None
    source = "".join(lines)
    if lines[0][:1] in (" ", "\t"):
        # a method or nested function: parse it inside an `if 1:` so that its lines and columns stay as
        # they are in the file (dedenting would break on multi-line strings)
        tree = gast.parse("if 1:\n" + source)
        _shift_lines(tree, start - 2)
        node = tree.body[0].body[0]
    else:
        tree = gast.parse(source)
        _shift_lines(tree, start - 1)
        node = tree.body[0]
    if isinstance(node, gast.AsyncFunctionDef):
        raise CompileError("async def is not supported in a compiled function",
                           filename, node.lineno, node.col_offset + 1, "async def")
    if not isinstance(node, gast.FunctionDef):
        raise CompileError(f"recompile.function needs a def statement, got {type(node).__name__}",
                           filename, node.lineno, node.col_offset + 1, "def")
    return ParsedFunction(fn, node, filename)
