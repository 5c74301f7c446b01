"""The sequential scheduler: drives the frames of one compiled call.

A frame is one activation of a function SubGraph: a generator produced by
codegen. Frames form an explicit tree (each knows its parent and the call site
that created it) and live in a list, never on the Python stack, so recursion
depth is bounded by memory, not by the interpreter's recursion limit.

An exception keeps its type; a note lists the chain of compiled calls from
the root to the failing frame (Jeong et al. §4.1's graph execution stack).
"""

from __future__ import annotations

from .. import config
from .frames import RunStats, annotate, too_deep, unwrap_stop_iteration


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
            annotate(exc, [_Leaf(callee, None, None)])
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
            original = unwrap_stop_iteration(exc, frame.callee.code.codes)
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
                    exc = too_deep()
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


def _fail(exc, stack):
    annotate(exc, stack)
    for frame in stack:  # cancel the rest of the call
        if frame.gen is not None:
            frame.gen.close()
