"""``recompile.disable()``: run compiled code as the plain Python it was written as, for debugging.

Inside ``with recompile.disable():`` (or for a whole process with ``RECOMPILE_DISABLE=1``), a call of a
compiled function calls the function it was made from (``f.python``), so a breakpoint, a ``print`` or a
debugger's step lands in the user's own code, and a recursive call, which names the compiled function, comes
back to it and is plain again. ``recompile.vmap`` becomes a loop over the instances whose results are stacked,
as ``torch.func.vmap`` returns them. Functions are still parsed when decorated (a ``CompileError`` still shows).
The switch is ``config.DISABLED``, one for every thread, as ``jax.disable_jit`` is. ``plain_here`` is one
thread's own: the runtime's per-instance call of a compiled function that changes something (``batch_rules``).
"""

from __future__ import annotations

import contextlib
import threading

from . import config


class _Plain(threading.local):
    active = False


_plain = _Plain()


def disabled():
    """Whether a compiled function called now runs as plain Python: ``disable()``, or ``plain_here`` on this
    thread."""
    return config.DISABLED or _plain.active


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
