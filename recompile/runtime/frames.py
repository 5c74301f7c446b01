"""What the schedulers share: a run's statistics, the call chain an error is annotated with, and the
StopIteration that a generated generator turned into a RuntimeError.

Every scheduler (sequential, threaded, agenda-batched, level runs) keeps its frames in an explicit tree:
each frame knows its ``callee`` (``qualname``, ``filename``, ``code.codes``), its ``parent`` and the
``site`` of the call that created it, so an error names the chain of calls from the root (Jeong et al.
§4.1's graph execution stack).
"""

from __future__ import annotations

import os

from .. import config


class RunStats:
    """Counters of one run: frames made, the deepest frame; in batched mode also ``batches`` (unit name ->
    [executions, instances]), ``per_instance`` (op name -> instances run one by one) and the seconds spent
    computing (``compute_s``) of all (``total_s``)."""

    __slots__ = ("frames", "max_depth", "batches", "per_instance", "compute_s", "total_s")

    def __init__(self):
        self.frames = 0
        self.max_depth = 0
        self.batches = {}
        self.per_instance = {}
        self.compute_s = 0.0
        self.total_s = 0.0


def too_deep():
    """The error of a call deeper than ``config.MAX_DEPTH``, as Python's own recursion limit raises it."""
    return RecursionError(f"maximum compiled recursion depth exceeded ({config.MAX_DEPTH})")


def unwrap_stop_iteration(exc, codes):
    """The StopIteration that Python (PEP 479) turned into RuntimeError as it left a generated generator
    (one of ``codes``; not one that left a generator of the user's)."""
    if (type(exc) is RuntimeError and isinstance(exc.__cause__, StopIteration)
            and str(exc) == "generator raised StopIteration"):
        left = exc.__cause__.__traceback__  # its first frame is the generator it left
        if left is not None and left.tb_frame.f_code in codes:
            return exc.__cause__
    return exc


def _failing_line(exc, callee):
    """The user line the failing frame was at, from the traceback of its generated code."""
    line = None
    tb = exc.__traceback__
    codes = callee.code.codes
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def annotated_by(exc):
    """The run that named its chain of calls on ``exc`` (``mark_annotated``), or None: a batched run names
    it once, and a level run or a traced segment that meets an error so named lets it through."""
    return getattr(exc, "_recompile_chain", None)


def mark_annotated(exc, run):
    try:
        exc._recompile_chain = run
    except AttributeError:  # (an exception type without a __dict__)
        pass


def annotate(exc, chain):
    """Add to ``exc`` a note naming the ``chain`` of frames (root first) that led to the failing one."""
    entries = []
    for i, frame in enumerate(chain):
        name = frame.callee.qualname
        filename = frame.callee.filename
        if i + 1 < len(chain):
            line = chain[i + 1].site.lineno
        else:
            line = _failing_line(exc, frame.callee)
        entries.append(f"  {name} ({os.path.basename(filename)}:{line})" if line else f"  {name} ({filename})")
    shown = config.CHAIN_SHOWN
    if len(entries) > 2 * shown:
        hidden = len(entries) - 2 * shown
        entries = entries[:shown] + [f"  ... {hidden} more compiled calls ..."] + entries[-shown:]
    note = "recompile call chain, root first (depth {}):\n{}".format(len(chain) - 1, "\n".join(entries))
    try:
        exc.add_note(note)
    except TypeError:  # an exception class that refuses notes
        pass
