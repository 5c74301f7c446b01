"""Compiled functions are opaque to ``torch.compile``: where a compiled region calls one, dynamo breaks the graph
and the call runs as it runs without torch.compile, rather than dynamo tracing into the runtime (seconds per
call, and a recompilation for each new trace of a piece of the program).

``torch.compiler.disable`` does that, but applied when recompile is imported it would import dynamo (a second
more for every program that never uses torch.compile). So an entry point (``@opaque``) hands dynamo a disabled
copy of itself while dynamo traces it; the first such run puts disabled copies of every entry point in their
places, so that dynamo does not trace the entry points it meets next (a backward run by autograd's engine is a
frame of its own, which dynamo would otherwise compile).
"""

from __future__ import annotations

import functools
import sys

import torch

_entries = []  # the functions marked @opaque (each found in its place by its qualname)
_disabled = {}  # function -> the same, run with dynamo off
_in_place = False  # whether the disabled copies stand where the entries were
_copies = set()  # the disabled copies put in place


def opaque(fn):
    """``fn``, an entry point into recompile (a call, a backward), run with dynamo off under torch.compile,
    recursively: nothing it calls is compiled either. Outside torch.compile it costs one flag read a call."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if torch.compiler.is_compiling():  # true only while dynamo traces this call
            return _with_dynamo_off(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    _entries.append(fn)
    return entry


def is_opaque(obj):
    """Whether ``obj`` (a function, or a staticmethod of one) is an entry point marked @opaque, or its
    disabled copy in its place."""
    fn = obj.__func__ if isinstance(obj, staticmethod) else obj
    return fn in _copies or getattr(fn, "__wrapped__", None) in _entries


def _with_dynamo_off(fn):
    off = _disabled.get(fn)
    if off is None:  # (dynamo breaks its graph at this call, and runs it)
        off = _disabled[fn] = torch.compiler.disable(functools.partial(_first_in_place, fn), recursive=True)
    return off


def _first_in_place(fn, *args, **kwargs):
    if not _in_place:
        _put_in_place()
    return fn(*args, **kwargs)


def _put_in_place():
    global _in_place
    for fn in list(_entries):
        owner, name = _owner_of(fn)
        off = torch.compiler.disable(fn, recursive=True)
        _copies.add(off)
        setattr(owner, name, staticmethod(off) if isinstance(vars(owner)[name], staticmethod) else off)
    _in_place = True


def _owner_of(fn):
    """The module or class that holds ``fn`` and its attribute name there, from its qualname."""
    owner = sys.modules[fn.__module__]
    *path, name = fn.__qualname__.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name
