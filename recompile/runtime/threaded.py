"""The threaded scheduler: the frames of one compiled call run on a pool of worker threads.

The same frames as in sequential mode (generators from codegen, a tree with
parent pointers), driven by the runtime of Jeong et al. §4.1: when a frame
yields its independent Invokes, each becomes a frame of its own; all but the
first go into the pool's ready queue, behind the work already there, and the
worker that ran the parent goes on with the first (no queue round trip for
the common case, as in work-first scheduling). A child that returns hands
its result to its parent; the child that answers the parent's last request
goes on with the parent on the same worker. No worker ever waits inside a
frame: there is no nested executor, so any depth of recursion runs on any
number of threads.

- **Live frames.** ``max_live`` bounds the frames of one call that have
  started and not returned (TensorFlow's parallel iterations, Yu et al.
  §4.3): a request beyond it is held back until a frame returns. When every
  live frame waits on held-back requests, the latest one starts anyway, so a
  call never stalls; these starts go depth-first, so the live frames stay
  within ``max_live`` plus the depth of the recursion.
- **Errors.** The first exception wins: it keeps its type, gets the chain of
  calls from the root (parent pointers) and reaches the caller. Queued work
  of that call is dropped, running steps end, the remaining frames are
  closed, and then the caller raises; the pool goes on serving other calls.
- **Thread state.** Workers run a call's frames under the caller's grad,
  inference and autocast modes (``thread_state``).
- **CUDA.** A frame issues all its steps on the stream of the worker that
  started it, so a frame's own tensors never cross streams; arguments and
  results do, through ``streams.Handoff`` (an event, no host sync).
"""

from __future__ import annotations

import threading
from collections import deque
from functools import partial

import torch

from . import streams
from .. import config
from .frames import RunStats, annotate, too_deep, unwrap_stop_iteration
from .thread_state import ThreadState


class ThreadFrame:
    __slots__ = ("callee", "gen", "parent", "site", "args", "slot", "depth", "inbox", "results", "waiting",
                 "deferred", "handoffs", "stream")

    def __init__(self, callee, args, parent, site, slot):
        self.callee = callee
        self.gen = None  # made on the frame's first step, by the worker that runs it
        self.parent = parent
        self.site = site  # Location of the Invoke in the parent that created this frame
        self.args = args
        self.slot = slot  # which of the parent's requests this frame answers
        self.depth = 0 if parent is None else parent.depth + 1
        self.inbox = None
        self.results = None
        self.waiting = 0  # requests not answered yet
        self.deferred = None  # requests held back by the live-frame limit: [(slot, request)]
        self.handoffs = None  # CUDA handoffs to receive before the next step
        self.stream = None  # on CUDA: the stream all of this frame's steps issue on

    def chain(self):
        frames = []
        f = self
        while f is not None:
            frames.append(f)
            f = f.parent
        return frames[::-1]


def run(callee, args, pool, max_live):
    """Run compiled function ``callee`` (a handle whose ``.code`` is its GeneratedCode) on bound ``args``
    on ``pool``, with at most ``max_live`` frames started and not returned (None: no bound). Returns
    (result, RunStats)."""
    return _Run(pool, max_live, streams.device_of(args)).go(callee, args)


class _Run:
    def __init__(self, pool, max_live, device):
        self.pool = pool
        self.max_live = max_live if max_live is not None else float("inf")
        self.device = device
        self.modes = ThreadState()
        self.stats = RunStats()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.live = set()  # frames started and not returned
        self.deferring = deque()  # frames with requests held back by the limit, in the order they were held
        self.runnable = 0  # frames queued or in a worker's hands: none means only held-back work is left
        self.active = 0  # workers inside ``work`` for this call
        self.failed = False
        self.error = None
        self.result = None
        self.result_handoff = None

    def go(self, callee, args):
        root = ThreadFrame(callee, args, None, None, 0)
        del args
        if self.device is not None:
            root.handoffs = [streams.handoff(self.device, root.args)]
        self.stats.frames = 1
        self.live.add(root)
        self.runnable = 1
        self.pool.submit(partial(self.work, root))
        try:
            self.done.wait()
        except BaseException as exc:  # (KeyboardInterrupt while waiting): cancel the call, then raise
            self.cancel(exc)
            self.done.wait()
            self.close()
            raise
        if self.failed:
            self.close()
            error, self.error = self.error, None  # (the call stays failed: its queued work is dropped)
            raise error
        if self.result_handoff is not None:
            self.result_handoff.receive(torch.cuda.current_stream(self.device))
        return self.result, self.stats

    def close(self):
        """Close the frames a failed call left (no worker is inside one of its steps any more)."""
        for frame in self.live:
            if frame.gen is not None:
                frame.gen.close()
        self.live.clear()
        self.deferring.clear()
        if self.device is not None:  # the caller may reuse its inputs: its stream waits for the workers' work
            current = torch.cuda.current_stream(self.device)
            for worker in self.pool.workers:
                stream = worker.streams.get(self.device)
                if stream is not None:
                    current.wait_stream(stream)

    # -- on the workers

    def work(self, frame, worker):
        with self.lock:
            if self.failed:
                return  # the call failed: its queued work is dropped
            self.active += 1
        try:
            with self.modes.applied():
                while frame is not None and not self.failed:
                    if self.device is None:
                        frame = self.advance(frame)
                    else:
                        if frame.stream is None:
                            frame.stream = worker.stream(self.device)
                        with torch.cuda.stream(frame.stream):
                            frame = self.advance(frame)
                    if frame is None:
                        frame = self.idle()
        except BaseException as exc:  # (a bug of the scheduler's own): the caller gets it
            self.cancel(exc)
        finally:
            with self.lock:
                self.active -= 1
                if self.failed and self.active == 0:
                    self.done.set()

    def advance(self, frame):
        """Step ``frame`` once; return the frame this worker goes on with, or None."""
        if frame.handoffs is not None:
            for h in frame.handoffs:
                h.receive(frame.stream)
            frame.handoffs = None
        if frame.gen is None:
            code = frame.callee.code
            args, frame.args = frame.args, None
            if not code.entry_is_generator:  # a callee that never invokes runs to completion at once
                try:
                    result = code.entry(*args)
                except BaseException as exc:  # (a StopIteration here is the user's own)
                    self.fail(exc, frame)
                    return None
                return self.answer(frame, result)
            frame.gen = code.entry(*args)
            del args
        try:
            requests = frame.gen.send(frame.inbox)
        except StopIteration as stop:
            return self.answer(frame, stop.value)
        except BaseException as exc:
            original = unwrap_stop_iteration(exc, frame.callee.code.codes)
            if original is not exc:  # (as ``raise original from None``)
                original.__cause__, original.__suppress_context__ = None, True
            self.fail(original, frame)
            return None
        frame.inbox = None
        if not requests:
            frame.inbox = []
            return frame
        return self.spawn(frame, requests)

    def spawn(self, frame, requests):
        """Start ``frame``'s requests as child frames, as far as the limit allows: the first on this worker,
        the rest queued."""
        depth = frame.depth + 1
        if depth > config.MAX_DEPTH and any(r[0].code.entry_is_generator for r in requests):
            self.fail(too_deep(), frame)
            return None
        handoff = streams.handoff(self.device, [r[1] for r in requests]) if self.device is not None else None
        frame.results = [None] * len(requests)
        frame.waiting = len(requests)
        started = []
        with self.lock:
            if depth > self.stats.max_depth:
                self.stats.max_depth = depth
            for slot, request in enumerate(requests):
                if len(self.live) < self.max_live:
                    started.append(self._start(frame, slot, request, handoff))
                else:
                    if frame.deferred is None:
                        frame.deferred = deque()
                        self.deferring.append(frame)
                    frame.deferred.append((slot, request, handoff))
            self.runnable += max(0, len(started) - 1)  # (the first is this worker's)
        if not started:
            return None
        for child in started[1:]:
            self.pool.submit(partial(self.work, child))
        return started[0]

    def _start(self, parent, slot, request, handoff):
        # (under the lock)
        callee, args, site = request
        child = ThreadFrame(callee, args, parent, site, slot)
        if handoff is not None:
            child.handoffs = [handoff]
        self.live.add(child)
        self.stats.frames += 1
        return child

    def answer(self, frame, result):
        """``frame`` returned ``result``: hand it to the parent; return the parent if it is ready now."""
        handoff = streams.handoff(self.device, result) if self.device is not None else None
        parent = frame.parent
        started = []
        with self.lock:
            self.live.discard(frame)
            if parent is None:
                self.result, self.result_handoff = result, handoff
                self.done.set()
                return None
            parent.results[frame.slot] = result
            if handoff is not None:
                if parent.handoffs is None:
                    parent.handoffs = []
                parent.handoffs.append(handoff)
            parent.waiting -= 1
            while self.deferring and len(self.live) < self.max_live:
                started.append(self._start_deferred(self.deferring[0]))
            self.runnable += len(started)
            ready = parent.waiting == 0
        for child in started:
            self.pool.submit(partial(self.work, child))
        if ready:
            parent.inbox, parent.results = parent.results, None
            return parent
        return None

    def idle(self):
        """This worker has nothing more of this call in hand. If nothing else of it is queued or running,
        only held-back requests are left: start the latest one here, beyond the limit, so the call goes on
        (depth-first: the live frames then exceed the limit by at most the depth)."""
        with self.lock:
            self.runnable -= 1
            if self.runnable or not self.deferring or self.failed:
                return None
            self.runnable = 1
            return self._start_deferred(self.deferring[-1])

    def _start_deferred(self, parent):
        # (under the lock)
        slot, request, handoff = parent.deferred.popleft()
        if not parent.deferred:
            parent.deferred = None
            self.deferring.remove(parent)
        return self._start(parent, slot, request, handoff)

    def fail(self, exc, frame):
        annotate(exc, frame.chain())
        self.cancel(exc)

    def cancel(self, exc):
        with self.lock:
            if not self.failed:
                self.failed, self.error = True, exc
            if self.active == 0:
                self.done.set()
