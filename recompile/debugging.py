"""``recompile.disable()``: run compiled code as the plain Python it was written as, for debugging.

Inside ``with recompile.disable():`` (or for a whole process with ``RECOMPILE_DISABLE=1``), a call of a
compiled function calls the function it was made from (``f.python``), so a breakpoint, a ``print`` or a
debugger's step lands in the user's own code, and a recursive call, which names the compiled function, comes
back to it and is plain again. ``recompile.vmap`` becomes a loop over the instances whose results are stacked,
as ``torch.func.vmap`` returns them. Functions are still parsed when decorated (a ``CompileError`` still shows).
The switch is ``config.DISABLED``, one for every thread, as ``jax.disable_jit`` is.
"""

from __future__ import annotations

import contextlib

from . import config


@contextlib.contextmanager
def disable():
    """Run every compiled function as plain Python inside the ``with`` block; restored on leaving it."""
    saved = config.DISABLED
    config.DISABLED = True
    try:
        yield
    finally:
        config.DISABLED = saved
