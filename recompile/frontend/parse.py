"""Source of a Python function -> gast FunctionDef with positions in the user's file."""

from __future__ import annotations

import inspect
import linecache

import gast

from ..errors import CompileError, Location


class ParsedFunction:
    """A function's gast tree, its file, and what Python knows of its scope."""

    def __init__(self, fn, node, filename):
        self.fn = fn
        self.node = node
        self.filename = filename
        self.globals = fn.__globals__
        code = fn.__code__
        self.freevars = dict(zip(code.co_freevars, fn.__closure__ or ()))
        self.signature = inspect.signature(fn, follow_wrapped=False)
        self.params = list(self.signature.parameters)
        self.lifted = {}  # name -> frontend.lifting.Lift: the nested defs compiled as functions of their own
        # (of a lifted def: its parameters for the enclosing function's variables that may be unbound at a call)
        self.maybe_unbound = frozenset()

    def loc(self, node):
        lineno = getattr(node, "lineno", None) or self.node.lineno
        col = getattr(node, "col_offset", None) or 0
        line = linecache.getline(self.filename, lineno)
        if line:  # the AST counts UTF-8 bytes; a caret counts characters
            col = len(line.encode("utf-8")[:col].decode("utf-8", errors="ignore"))
        return Location(self.filename, lineno, col + 1)

    def demangle(self, name):
        """A variable's name as written, from the name Python compiled it under in a method (``_C__x``)."""
        cls = self.class_name()
        prefix = f"_{cls.lstrip('_')}__" if cls else None
        return "__" + name[len(prefix):] if prefix and cls.strip("_") and name.startswith(prefix) else name

    def class_name(self):
        """The innermost class whose body encloses the function, from its qualname (for private-name
        mangling), or None. In a qualname a function is followed by ``<locals>``, a class is not."""
        parts = self.fn.__qualname__.split(".")[:-1]
        while parts:
            if parts[-1] == "<locals>":
                parts = parts[:-2]  # an enclosing function
            else:
                return parts[-1]
        return None


def _shift_lines(tree, delta):
    for node in gast.walk(tree):
        if getattr(node, "lineno", None) is not None:
            node.lineno += delta
            if getattr(node, "end_lineno", None) is not None:
                node.end_lineno += delta


def parse_function(fn):
    """Parse ``fn``'s source; raise CompileError where it cannot be had."""
    # the source of this very function: a functools.wraps wrapper is compiled as the wrapper,
    # not as the function it wraps (inspect would follow __wrapped__)
    code = fn.__code__
    filename = inspect.getsourcefile(code) or code.co_filename
    if code.co_name == "<lambda>":
        return ParsedFunction(fn, _lambda_as_def(fn, filename), filename)
    try:
        lines, start = inspect.getsourcelines(code)
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


def _lambda_as_def(fn, filename):
    """The lambda expression ``fn`` was made from, as the def it stands for (``def <lambda>(args): return
    body``). Its file is parsed whole (a lambda often sits in a statement that is no statement alone: a dict's
    entry, a call's argument); of the lambdas on its first line, the one whose body holds every position
    Python's code for ``fn`` names (the innermost, where one holds another)."""
    code = fn.__code__
    linecache.checkcache(filename)  # (as inspect reads a def's: the file as it is now)
    lines = linecache.getlines(filename)
    if not lines:
        raise CompileError(f"cannot read the source of {fn.__qualname__}: could not get source code",
                           filename, code.co_firstlineno, 1, "source")
    try:
        tree = gast.parse("".join(lines))
    except SyntaxError as exc:
        raise CompileError(f"cannot read the source of {fn.__qualname__}: {exc.msg}",
                           filename, code.co_firstlineno, 1, "source") from None
    spots = [(line, col) for line, _, col, _ in code.co_positions()
             if line is not None and col is not None and (line, col) != (code.co_firstlineno, 0)]

    def holds(body):
        start, end = (body.lineno, body.col_offset), (body.end_lineno, body.end_col_offset)
        return all(start <= spot < end for spot in spots)

    found = [node for node in gast.walk(tree) if isinstance(node, gast.Lambda)
             and node.lineno == code.co_firstlineno and holds(node.body)]
    if not found:
        raise CompileError(f"cannot find the source of {fn.__qualname__} in its file (changed since it was "
                           "loaded?)", filename, code.co_firstlineno, 1, "lambda")
    node = min(found, key=lambda n: (n.body.end_lineno - n.body.lineno, n.body.end_col_offset - n.body.col_offset))
    ret = gast.Return(value=node.body)
    define = gast.FunctionDef(name="<lambda>", args=node.args, body=[ret], decorator_list=[], returns=None,
                              type_comment=None, type_params=[])
    for made in (ret, define):
        gast.copy_location(made, node)
        made.end_lineno, made.end_col_offset = node.end_lineno, node.end_col_offset
    return define
