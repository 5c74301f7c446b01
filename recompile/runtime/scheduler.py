"""The sequential scheduler: drives the frames of one compiled call.

A frame is one activation of a function SubGraph: a generator produced by
codegen. Frames form an explicit tree (each knows its parent and the call site
that created it) and live in a list, never on the Python stack, so recursion
depth is bounded by memory, not by the interpreter's recursion limit.

An exception keeps its type; a note lists the chain of compiled calls from
the root to the failing frame (Jeong et al. §4.1's graph execution stack).
"""

from __future__ import annotations

import os

from .. import config



class Frame:
    __slots__ = ("callee", "gen", "parent", "site", "requests", "results", "inbox", "depth")

    def __init__(self, callee, gen, parent, site):
        self.callee = callee
        self.gen = gen
        self.parent = parent
        self.site = site  # Location of the Invoke in the parent that created this frame
        self.requests = None
        self.results = None
        self.inbox = None
        self.depth = 0 if parent is None else parent.depth + 1


class RunStats:
    __slots__ = ("frames", "max_depth")

    def __init__(self):
        self.frames = 0
        self.max_depth = 0


def run(callee, args):
    """Run compiled function ``callee`` (a handle whose ``.code`` is its GeneratedCode) on bound ``args``.

    Returns (result, RunStats).
    """
    stats = RunStats()
    stats.frames = 1
    code = callee.code
    if not code.entry_is_generator:
        try:
            return code.entry(*args), stats
        except BaseException as exc:
            _annotate(exc, [_Leaf(callee, None, None)])
            raise
    stack = [Frame(callee, code.entry(*args), None, None)]
    del args  # the frame has them: what they hold (a gradient's record) goes when the frame is done with it
    while True:
        frame = stack[-1]
        try:
            requests = frame.gen.send(frame.inbox)
        except StopIteration as stop:
            result = stop.value
            requests = None
        except BaseException as exc:
            original = _unwrap_stop_iteration(exc, frame.callee)
            _fail(original, stack)
            if original is not exc:
                raise original from None
            raise
        if requests is None:  # the frame returned (handled outside the except: no exception context)
            stack.pop()
            if not stack:
                return result, stats
            parent = stack[-1]
            parent.results.append(result)
            _next_request(parent, stack, stats)
            continue
        frame.inbox = None
        frame.requests = requests
        frame.results = []
        _next_request(frame, stack, stats)


def _next_request(frame, stack, stats):
    """Start the next pending callee of ``frame``, or hand it its results when all are done."""
    while len(frame.results) < len(frame.requests):
        callee, args, site = frame.requests[len(frame.results)]
        code = callee.code
        stats.frames += 1
        if code.entry_is_generator:
            child = Frame(callee, code.entry(*args), frame, site)
            if child.depth > stats.max_depth:
                stats.max_depth = child.depth
                if child.depth > config.MAX_DEPTH:
                    exc = RecursionError(f"maximum compiled recursion depth exceeded ({config.MAX_DEPTH})")
                    _fail(exc, stack)
                    raise exc
            stack.append(child)
            return
        # a callee that never invokes runs to completion at once
        if frame.depth + 1 > stats.max_depth:
            stats.max_depth = frame.depth + 1
        try:
            frame.results.append(code.entry(*args))
        except BaseException as exc:
            _fail(exc, stack + [_Leaf(callee, frame, site)])
            raise
    frame.inbox = frame.results
    frame.requests = frame.results = None


class _Leaf:
    """Stand-in frame for a callee run as a plain function."""

    def __init__(self, callee, parent, site):
        self.callee, self.parent, self.site, self.gen = callee, parent, site, None


def _unwrap_stop_iteration(exc, callee):
    """The StopIteration that Python (PEP 479) turned into RuntimeError as it left a generated generator
    (not one that left a generator of the user's)."""
    if (type(exc) is RuntimeError and isinstance(exc.__cause__, StopIteration)
            and str(exc) == "generator raised StopIteration"):
        left = exc.__cause__.__traceback__  # its first frame is the generator it left
        if left is not None and left.tb_frame.f_code in callee.code.codes:
            return exc.__cause__
    return exc


def _fail(exc, stack):
    _annotate(exc, stack)
    for frame in stack:  # cancel the rest of the call
        if frame.gen is not None:
            frame.gen.close()


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


def _annotate(exc, stack):
    entries = []
    for i, frame in enumerate(stack):
        name = frame.callee.qualname
        filename = frame.callee.filename
        if i + 1 < len(stack):
            line = stack[i + 1].site.lineno
        else:
            line = _failing_line(exc, frame.callee)
        entries.append(f"  {name} ({os.path.basename(filename)}:{line})" if line else f"  {name} ({filename})")
    shown = config.CHAIN_SHOWN
    if len(entries) > 2 * shown:
        hidden = len(entries) - 2 * shown
        entries = entries[:shown] + [f"  ... {hidden} more compiled calls ..."] + entries[-shown:]
    note = "recompile call chain, root first (depth {}):\n{}".format(len(stack) - 1, "\n".join(entries))
    try:
        exc.add_note(note)
    except TypeError:  # an exception class that refuses notes
        pass
