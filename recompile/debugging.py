"""``recompile.disable()``: run compiled code as the plain Python it was written as, for debugging.

Inside ``with recompile.disable():`` (or for a whole process with ``RECOMPILE_DISABLE=1``), a call of a
compiled function calls the function it was made from (``f.python``), so a breakpoint, a ``print`` or a
debugger's step lands in the user's own code, and a recursive call, which names the compiled function, comes
back to it and is plain again. ``recompile.vmap`` becomes a loop over the instances whose results are stacked,
as ``torch.func.vmap`` returns them. Functions are still parsed when decorated (a ``CompileError`` still shows).
The switch is ``config.DISABLED``, one for every thread, as ``jax.disable_jit`` is. ``plain_here`` is one
thread's own: the runtime's per-instance call of a compiled function that changes something (``batch_rules``),
whose calls of compiled functions run plain up to ``PLAIN_DEPTH`` deep (``recompile.vmap`` and ``map`` run
their own batched runs).
"""

from __future__ import annotations

import contextlib
import threading

from . import config


class _Plain(threading.local):
    active = False  # (inside ``plain_here``)
    depth = 0  # (plain calls of compiled functions going on)


_plain = _Plain()
# Nested plain calls past which a compiled function runs its program (off the Python stack) instead: a deep
# recursion, which Python's stack would refuse, runs as the compiled function runs it
PLAIN_DEPTH = 64


def plain():
    """Whether a compiled function called now on this thread runs as plain Python (``plain_here``)."""
    return _plain.active


def plain_call(python, args, kwargs, compiled):
    """``python(*args, **kwargs)``, a compiled function's plain Python called inside ``plain_here``; deeper than
    ``PLAIN_DEPTH`` such calls, ``compiled()`` (its program, where compiled functions it calls run theirs)."""
    if _plain.depth >= PLAIN_DEPTH:
        _plain.active = False
        try:
            return compiled()
        finally:
            _plain.active = True
    _plain.depth += 1
    try:
        return python(*args, **kwargs)
    finally:
        _plain.depth -= 1


@contextlib.contextmanager
def disable():
    """Run every compiled function as plain Python inside the ``with`` block; restored on leaving it."""
    saved = config.DISABLED
    config.DISABLED = True
    try:
        yield
    finally:
        config.DISABLED = saved


@contextlib.contextmanager
def plain_here():
    """Run every compiled function called on this thread as plain Python inside the ``with`` block: a call run
    once per instance that changes something in place (``tree.state = ...``) does in turn what plain Python does,
    at eager's speed, not as a batched run of one instance."""
    saved = _plain.active
    _plain.active = True
    try:
        yield
    finally:
        _plain.active = saved
