"""Rendering DOT text to an image with Graphviz's ``dot`` program, found on PATH (recompile does not depend on it)."""

from __future__ import annotations

import shutil
import subprocess

from .errors import RecompileError

FORMATS = ("png", "svg")
INSTALL = ("install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; "
           "conda: conda install graphviz; others: https://graphviz.org/download/)")


class GraphvizError(RecompileError):
    """Graphviz's ``dot`` is not installed, or it refused the DOT text."""


def find_dot(fmt="png"):
    """The path of Graphviz's ``dot``; where it is not installed, a GraphvizError that says how to install it."""
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizError(f"drawing {fmt} needs Graphviz's `dot` program, which is not on PATH: {INSTALL}; "
                            f"the DOT text (format \"dot\") needs no Graphviz")
    return exe


def render(dot_text, fmt):
    """The bytes of ``dot_text`` drawn as ``fmt`` (png or svg) by ``dot``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown image format {fmt!r}; use one of {', '.join(FORMATS)}")
    proc = subprocess.run([find_dot(fmt), f"-T{fmt}"], input=dot_text.encode(), capture_output=True)
    if proc.returncode != 0:
        raise GraphvizError(f"`dot -T{fmt}` failed ({proc.returncode}): {proc.stderr.decode(errors='replace')}")
    return proc.stdout
