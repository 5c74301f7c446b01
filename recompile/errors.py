"""Error types that carry the user's source location.

A CompileError points at the construct in the user's file (not at generated
code); runtime errors keep their own type and get the chain of compiled calls
attached as a note (see runtime.scheduler).
"""

from __future__ import annotations

import linecache


class RecompileError(Exception):
    """Base class of recompile's own errors."""


class PerInstanceWarning(UserWarning):
    """An op of a batched run ran once per instance, not once for the group (``config.PER_INSTANCE``)."""


class GradFallbackWarning(UserWarning):
    """An op without a gradient rule was recorded for torch.autograd in a sequential or threaded call."""


class SharedChangeWarning(UserWarning):
    """A helper run for one instance changed in place its copy of a tensor every instance of the batch shares,
    without handing it back: code after the call that reads the tensor reads the unchanged one."""


class PerInstanceError(RecompileError):
    """An op of a batched run would run once per instance, and ``config.PER_INSTANCE`` is "error"."""


class CompileError(RecompileError):
    """The function uses Python that recompile cannot compile.

    Carries ``filename``, ``lineno`` (line in the user's file) and ``offset``
    (1-based column), like SyntaxError, plus ``text`` (the source line) and
    ``construct`` (what was refused).
    """

    def __init__(self, message, filename=None, lineno=None, offset=None, construct=None, text=None):
        self.reason = message
        self.filename = filename
        self.lineno = lineno
        self.offset = offset
        self.construct = construct
        if text is None and filename and lineno:
            text = linecache.getline(filename, lineno).rstrip("\n")
        self.text = text
        super().__init__(self._format())

    def _format(self):
        where = ""
        if self.filename:
            where = f"{self.filename}:{self.lineno}:{self.offset}: "
        lines = [where + self.reason]
        if self.text:
            stripped = self.text.lstrip()
            indent = len(self.text) - len(stripped)
            lines.append("    " + stripped)
            col = max((self.offset or 1) - 1 - indent, 0)
            lines.append("    " + " " * col + "^")
        return "\n".join(lines)


class Location:
    """A place in the user's source: file, 1-based line, 1-based column."""

    __slots__ = ("filename", "lineno", "col")

    def __init__(self, filename, lineno, col=1):
        self.filename = filename
        self.lineno = lineno
        self.col = col

    def __repr__(self):
        return f"{self.filename}:{self.lineno}:{self.col}"

    def error(self, message, construct=None):
        return CompileError(message, self.filename, self.lineno, self.col, construct)
