"""Warnings that name the user's line: what recompile does more slowly than it could is never silent.

Generated code runs under the user's file and line numbers, so the user's line of an op is the first frame
outside the package (``user_line``). ``warn_once`` warns once per (file, line, what).
"""

from __future__ import annotations

import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # recompile/
_warned = set()  # (file, line, what) already warned of


def user_line(depth=2):
    """(filename, line) of the first frame outside recompile, from ``depth`` frames above the caller."""
    frame = sys._getframe(depth)
    while frame is not None and (frame.f_code.co_filename.startswith(_HERE)
                                 or frame.f_code.co_filename.startswith("<recompile")):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)


def warn_once(where, what, message, category):
    """Warn ``message`` at ``where`` (filename, line) unless already warned of ``what`` there."""
    key = (*where, what)
    if key not in _warned:
        _warned.add(key)
        warnings.warn_explicit(message, category, *where)
