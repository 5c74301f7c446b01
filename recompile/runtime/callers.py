"""Whether the op running now runs for the caller's own instances: ``recompile.map``'s or ``vmap``'s.

The instances of ``recompile.map`` run together, and one may see what another changes of an object both hold
before or after the change (docs/api.md). A compiled call that changes something in place (treelstm.pytorch's
``tree.state = ...``) made for them by the function the map runs, in the outermost batched run's first frame,
may then be one batched run of its own: each instance's calls keep their order inside it, and the instances run
together as the map's do. Made in a frame a recursion made (its instances may be one tree's nodes) or in a run
a helper's call started, its calls keep Python's order: one instance after another.
"""

from __future__ import annotations

import threading


class _Here(threading.local):
    """Per thread: ``runs``, the batched runs open; ``callers``, whether the code running now is the outermost
    run's first frame's (its instances the caller's own)."""

    def __init__(self):
        self.runs = 0
        self.callers = False


here = _Here()


def callers_instances():
    """Whether the op running now runs for the instances the caller of the outermost batched run gave."""
    return here.callers
