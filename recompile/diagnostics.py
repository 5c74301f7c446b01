"""Warnings that name the user's line: what recompile does more slowly than it could is never silent.

Generated code runs under the user's file and line numbers, so the user's line of an op is the first frame
outside the package (``user_line``). ``warn_once`` warns once per (file, line, what).
"""

from __future__ import annotations

import os
import contextlib
import sys
import threading
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # recompile/
_warned = set()  # (file, line, what) already warned of
_tracing = threading.local()  # .where: (file, line) of the op a trace is running now (``tracing_at``)


def user_line(depth=2):
    """(filename, line) of the first frame outside recompile, from ``depth`` frames above the caller; a
    traced segment's frame names the user's line of the op it runs (its ``_LINES``, ``codegen.segments``)."""
    where = getattr(_tracing, "where", None)
    if where is not None:
        return where
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<recompile"):
            where = frame.f_globals.get("_LINES", {}).get(frame.f_lineno)
            if where is not None:
                return where
        elif not filename.startswith(_HERE):
            return filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


def warn_once(where, what, message, category):
    """Warn ``message`` at ``where`` (filename, line) unless already warned of ``what`` there."""
    key = (*where, what)
    if key not in _warned:
        _warned.add(key)
        warnings.warn_explicit(message, category, *where)


@contextlib.contextmanager
def tracing_at(filename, line):
    """While a trace runs the op of the user's ``filename``:``line`` (``codegen.segments``), what it warns of is
    told at that line."""
    before = getattr(_tracing, "where", None)
    _tracing.where = (filename, line)
    try:
        yield
    finally:
        _tracing.where = before
