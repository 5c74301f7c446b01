"""The batched scheduler: merges frames waiting at the same program point and runs each group once.

A frame runs one unit (a function's SubGraph, or a Cond branch: see
``passes.batching``) for n instances. When it yields requests — the children
of a tree node, the branches of a Cond — they go to the *pending* group of
the unit they ask for; the frame waits until every request is answered. When
no frame is ready, the agenda merges a whole pending group into one frame
(its inputs concatenated once, at entry) and runs it; the result is cut back
into each request's instances.

Which group runs first (Neubig et al. §3.2): a group that may still grow waits
while a pending group that may feed it (one from whose unit its unit can be
reached) runs. For a minibatch of trees this runs the descent level by level,
then all leaves at once, then the internal nodes bottom-up, once per level —
what hand-batching by depth or height does, derived from the program.

Frames keep the requests that created them (their parents), so an error names
the chain of calls that led to it, as in sequential mode.

A function with a level program (``codegen.levels``: its call tree known from
its arguments) runs this same schedule by ``runtime.levels`` instead, without
frames; an error there names the chain of calls these frames would have.

A request the frame does not need before it returns (``deferrable``, from
``passes.batching``: the per-node loss of a tree model) is answered at once
with a lazy value, and the frame goes on. Its group runs when that value is
first read (in the frame that reads it), when the agenda has nothing else to
run, or when the call ends: by then the same request has come from every
level of the tree, and it runs once.

With a pool of worker threads (``threads`` > 1), frames that are ready at the
same time step concurrently, one per worker, and pending groups that cannot
feed one another are launched together, so independent batched groups
overlap. The agenda itself (grouping, gathering inputs, cutting results back)
stays on the calling thread; on CUDA the workers issue on the caller's
stream.
"""

from __future__ import annotations

import contextlib
import threading
import time
from functools import partial

import torch

from . import batch as bt
from . import batch_rules, lazy_weights, saved_versions, sharing, streams
from .. import config
from .frames import RunStats, annotate, annotated_by, mark_annotated, too_deep, unwrap_stop_iteration
from .units import Deferred, unit_of
from .thread_state import ThreadState

# what a step of a frame came to
_YIELDED, _RETURNED, _FAILED = range(3)


class BatchFrame:
    __slots__ = ("unit", "gen", "n", "sources", "results", "waiting", "inbox", "depth", "site", "parent", "args",
                 "given")

    def __init__(self, unit, gen, n, sources, depth, site, parent):
        self.unit, self.gen, self.n, self.sources = unit, gen, n, sources
        self.args = None  # a launched frame of a unit that never yields: its arguments, until it runs
        self.results = None
        self.waiting = 0
        self.inbox = None
        self.depth = depth
        self.site = site  # of the first request it serves; ``parent`` its frame (for error chains)
        self.parent = parent
        self.given = None  # arguments gathered from several requests, to copy changes back (see _give_back)

    @property
    def callee(self):
        return self.unit


def reaches(a, b):
    """Whether a frame of unit ``a`` may (through its requests) lead to a request of unit ``b``."""
    reach = a.reach
    if reach is None:
        reach, pending = set(), [a]
        while pending:
            u = pending.pop()
            for s in u.successors:
                s = unit_of(s)
                if s not in reach:
                    reach.add(s)
                    pending.append(s)
        a.reach = reach
    return b in reach


def _choosable(u, units):
    """Whether no other pending unit may still feed pending unit ``u``."""
    return not any(o is not u and reaches(o, u) and not reaches(u, o) for o in units)


def _choose(pending):
    """The pending unit to run: one that no other pending unit may still feed."""
    units = list(pending)
    if len(units) == 1:
        return units[0]
    for u in units:
        if _choosable(u, units):
            return u
    return units[0]  # (cannot happen: reachability is a preorder; kept for safety)


def _independent(pending):
    """Pending units to launch together: the chosen one, and others that may run now and that cannot
    reach it or one another (so running them together splits no group that could have grown)."""
    chosen = [_choose(pending)]
    units = list(pending)
    for u in units:
        if (u not in chosen and _choosable(u, units)
                and not any(reaches(u, c) or reaches(c, u) for c in chosen)):
            chosen.append(u)
    return chosen


def run(target, args, n=1, pool=None, parent=None, site=None):
    """Run compiled function ``target`` (a Callee) for ``n`` instances on ``args`` (plain values or
    batches), on the calling thread or with the workers of ``pool``. Returns (result, RunStats). A call of a
    level run's (``nested``) names the frames above it in errors: ``parent``, and its call's ``site``."""
    started = time.perf_counter()
    stats = RunStats()
    counters = batch_rules.counters
    saved, counters.per_instance = counters.per_instance, {}
    mutates = getattr(target, "may_mutate", True)
    saved_sharing, sharing.state.fresh = sharing.state.fresh, getattr(target, "shares_computed_once", not mutates) \
        and not sharing.state.never
    saved_weights, lazy_weights.runs.weights = lazy_weights.runs.weights, {}
    try:
        run = _Run.of(stats, pool, args, mutates)
        unit = unit_of(target)
        levels = getattr(unit, "levels", None)
        if run.defer and levels is not None and config.LEVELS and levels.applies():
            return levels.run(run, args, n, parent, site), stats  # (an error there comes with its chain of calls)
        with saved_versions.watching(mutates, n):
            result = run.go(unit, args, n, parent, site)
    finally:
        stats.per_instance, counters.per_instance = counters.per_instance, saved
        sharing.state.fresh = saved_sharing
        lazy_weights.runs.weights = saved_weights
        stats.total_s = time.perf_counter() - started
    return result, stats


class _Run:
    def __init__(self, stats, pool=None, device=None):
        self.stats = stats
        self.pool = pool
        self.device = device
        self.pending = {}  # unit -> [(frame, slot, args, count, site)]
        self.ready = []
        self.live = set()
        self.defer = False  # whether requests may be deferred (see run)
        self.split_results = False  # whether a result is cut for its requests by one split (see deliver)
        self.copy_back = False  # whether arguments a frame changed in place are copied back (see _give_back)
        self.token = object()  # marks the errors this run has annotated
        self.stepping = False  # inside a frame's step: nested work is already timed as compute

    @classmethod
    def of(cls, stats, pool, args, mutates):
        run = cls(stats, pool, streams.device_of(args) if pool is not None else None)
        # a deferred call reads its arguments late: only where no function of the run changes state in place
        # (a caller, or another callee, could change them in between), and not with workers
        run.defer = pool is None and not mutates
        run.split_results = not mutates
        run.copy_back = mutates
        return run

    @staticmethod
    def nested(target, args, n, parent=None, site=None):
        """A call of its own for ``n`` instances (a level run's callee that yields), below the level run's frame
        ``parent`` at ``site``: (result, RunStats)."""
        return run(target, args, n, None, parent, site)

    def record(self, unit, n):
        entry = self.stats.batches.get(unit.name)
        if entry is None:
            self.stats.batches[unit.name] = [1, n]
        else:
            entry[0] += 1
            entry[1] += n

    def go(self, unit, args, n, parent=None, site=None):
        self.record(unit, n)
        self.stats.frames = 1
        root = BatchFrame(unit, None, n, (), 0, site, parent)
        if not unit.is_generator:
            t = time.perf_counter()
            try:
                return unit.fn(n, *args)
            except BaseException as exc:
                self.annotate(exc, root)
                raise
            finally:
                self.stats.compute_s += time.perf_counter() - t
        self.outcome = None
        self.start(root, args)
        del args
        while True:
            while self.ready:
                if self.pool is not None and len(self.ready) > 1:
                    frames, self.ready = self.ready, []
                    self.wave(frames)
                else:
                    self.step(self.ready.pop())
                if root.gen is None:
                    self.finish()
                    try:
                        bt.ready_all(self.outcome)  # (arithmetic on deferred results: its errors get a chain)
                    except BaseException as exc:
                        self.fail(exc, root)
                        raise
                    return self.outcome
            if not self.pending:
                raise RuntimeError("recompile: batched run stalled with frames waiting (internal error)")
            if self.pool is None:
                self.launch(_choose(self.pending))
            else:
                for unit in _independent(self.pending):
                    self.launch(unit)

    def start(self, frame, args):
        t = time.perf_counter()
        try:
            frame.gen = frame.unit.fn(frame.n, *args)
        finally:
            self.stats.compute_s += time.perf_counter() - t
        self.live.add(frame)
        self.ready.append(frame)

    def step(self, frame):
        while True:  # (a frame whose requests were all answered at once goes on in the same step)
            t = time.perf_counter()
            self.stepping = True
            try:
                kind, value = self.advance(frame)
            finally:
                self.stepping = False
            self.stats.compute_s += time.perf_counter() - t
            if not self.settle(frame, kind, value):
                return

    @staticmethod
    def advance(frame):
        """Run ``frame`` up to its next requests or its end: (what happened, requests / result / error)."""
        if frame.gen is None:  # a launched unit that never yields: run it (a StopIteration is the user's)
            args, frame.args = frame.args, None
            try:
                return _RETURNED, frame.unit.fn(frame.n, *args)
            except BaseException as exc:
                return _FAILED, exc
        try:
            return _YIELDED, frame.gen.send(frame.inbox)
        except StopIteration as stop:
            return _RETURNED, stop.value
        except BaseException as exc:
            return _FAILED, exc

    def wave(self, frames):
        """Step ``frames`` concurrently: all but the first on the workers, the first here; then settle
        each, in order."""
        t = time.perf_counter()
        outcomes = [None] * len(frames)
        left = [len(frames) - 1]
        lock, done = threading.Lock(), threading.Event()
        modes = ThreadState()
        stream = torch.cuda.current_stream(self.device) if self.device is not None else None

        share, weights = sharing.state.fresh, lazy_weights.runs.weights

        def task(i, worker):
            counters, state, runs = batch_rules.counters, sharing.state, lazy_weights.runs
            saved, counters.per_instance = counters.per_instance, {}
            saved_sharing, state.fresh = state.fresh, share  # (this run's, on the worker's thread too)
            saved_weights, runs.weights = runs.weights, weights
            on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            try:
                with modes.applied(), on_stream:
                    kind, value = self.advance(frames[i])
                outcomes[i] = (kind, value, counters.per_instance)
            except BaseException as exc:  # (setting the thread up failed): the frame's step fails with it
                outcomes[i] = (_FAILED, exc, counters.per_instance)
            finally:
                counters.per_instance, state.fresh, runs.weights = saved, saved_sharing, saved_weights
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        for i in range(1, len(frames)):
            self.pool.submit(partial(task, i))
        kind, value = self.advance(frames[0])
        done.wait()
        self.stats.compute_s += time.perf_counter() - t
        counts = batch_rules.counters.per_instance
        for frame, outcome in zip(frames[1:], outcomes[1:]):
            for name, k in outcome[2].items():
                counts[name] = counts.get(name, 0) + k
        for frame, (kind, value) in zip(frames, [(kind, value)] + [o[:2] for o in outcomes[1:]]):
            if self.settle(frame, kind, value):
                self.ready.append(frame)

    def settle(self, frame, kind, value):
        """Act on what a step of ``frame`` came to: hand on its result, raise its error, or queue its
        requests. True when every request was answered at once (deferred): the frame may go on now."""
        if kind == _RETURNED:
            frame.gen = None
            self.live.discard(frame)
            if frame.given:
                _give_back(frame.given, [count for _, _, count in frame.sources])
            self.deliver(frame, value)
            return
        if kind == _FAILED:
            original = unwrap_stop_iteration(value, frame.unit.code.codes)
            self.fail(original, frame)
            if original is not value:
                raise original from None
            raise value
        requests = value
        frame.inbox = None
        frame.results = [None] * len(requests)
        frame.waiting = len(requests)
        for slot, (target, args, count, site, deferrable) in enumerate(requests):
            unit = unit_of(target)
            if self.defer:  # (a lazy argument could wait on a deferred call of this very group)
                for a in args:
                    bt.ready_all(a)
            if deferrable and count > 1 and self.defer and not unit.is_generator:
                cell = Deferred(self, unit, args)
                frame.results[slot] = bt.Batch(count, thunk=cell)
                frame.waiting -= 1
                slot = cell
            self.pending.setdefault(unit, []).append((frame, slot, args, count, site))
        if frame.waiting == 0:
            frame.inbox = tuple(frame.results)
            frame.results = None
            return True
        return False

    def launch(self, unit):
        requests = self.pending.pop(unit)
        if self.copy_back and len(requests) > 1:
            requests = self.same_aliasing(unit, requests)
        for r in requests:
            if type(r[1]) is Deferred:
                r[1].check_arguments(r[4])
        if len(requests) == 1:
            frame0, slot, args, n, site = requests[0]
        else:
            n = sum(r[3] for r in requests)
            width = len(requests[0][2])
            t = time.perf_counter()
            if self.copy_back:  # (an argument given twice is gathered once: a change through one name
                # reaches the other, as in eager code)
                gathered = {}
                args = tuple(_gather_once(gathered, [(r[2][j], r[3]) for r in requests]) for j in range(width))
            else:
                args = bt.concat_args([(r[2], r[3]) for r in requests])
            if not self.stepping:
                self.stats.compute_s += time.perf_counter() - t
            frame0, site = requests[0][0], requests[0][4]
        frame = BatchFrame(unit, None, n, [(f, slot, count) for f, slot, _, count, _ in requests],
                           frame0.depth + 1, site, frame0)
        if frame.depth > self.stats.max_depth:
            self.stats.max_depth = frame.depth
            if frame.depth > config.MAX_DEPTH:
                exc = too_deep()
                self.fail(exc, frame)
                raise exc
        levels = unit.levels if self.defer and unit.is_generator else None
        if levels is not None and config.LEVELS and levels.applies():
            # (a recursive callee's calls of every frame at once, run depth by depth as a call of the whole run is)
            try:
                result = levels.run(self, args, n, frame0, site, frame.depth)
            except BaseException as exc:
                self.fail(exc, frame)
                raise
            self.deliver(frame, result)
            return
        self.record(unit, n)
        self.stats.frames += 1
        if self.copy_back and len(requests) > 1:
            frame.given = _gathered(args, requests)
        if unit.is_generator:
            self.start(frame, args)
            return
        frame.args = args  # run by its first step, as any frame
        self.live.add(frame)
        self.ready.append(frame)

    def same_aliasing(self, unit, requests):
        """The requests of ``requests`` that give one tensor under the same names as the first does; the rest
        wait for a later launch. Arguments are gathered per name, so a frame serving requests that alias
        differently (``f(x, x)`` merged with ``f(x, y)``) would give ``b -= a`` a copy of ``a`` to change."""
        first = _aliasing(requests[0][2])
        alike = [r for r in requests if _aliasing(r[2]) == first]
        if len(alike) < len(requests):
            self.pending[unit] = [r for r in requests if _aliasing(r[2]) != first]
        return alike

    def deliver(self, frame, result):
        if not frame.sources:
            self.outcome = result
            return
        if len(frame.sources) == 1:
            values = [result]
        else:
            counts = [count for _, _, count in frame.sources]
            several = frame.unit.arity > 1
            if frame.given:
                cuts = [self.cut_given(frame, v, counts) for v in (result if several else (result,))]
                values = list(zip(*cuts)) if several else cuts[0]
            else:
                values = bt.cut_result(result, counts, several, self.split_results)
        for (parent, slot, count), value in zip(frame.sources, values):
            if type(slot) is Deferred:
                slot.value, slot.done = value, True
                continue
            parent.results[slot] = value
            parent.waiting -= 1
            if parent.waiting == 0:
                parent.inbox = tuple(parent.results)
                parent.results = None
                self.ready.append(parent)

    def cut_given(self, frame, value, counts):
        """``value`` cut into the parts of the requests ``frame`` served, where it gathered arguments: one
        handed back (``return y`` after ``y += 1``) gives each request its own value, which _give_back brought
        up to date, as eager code returns the caller's very tensor."""
        parts = bt.cut(value, counts, self.split_results)
        for a, _, values in frame.given:
            if a is value:
                return [own if _kept_in_step(own, count) else part
                        for own, part, count in zip(values, parts, counts)]
        return parts

    def run_deferred(self, cell):
        """Run the group of deferred request ``cell`` now: a frame is reading its lazy result. An error
        is raised here, in the reading frame's step, with the deferred call's own chain."""
        requests = self.pending.get(cell.unit, ())
        if not any(r[1] is cell for r in requests):
            raise RuntimeError("recompile: a deferred call's result was read before its call ran (internal error)")
        self.launch(cell.unit)
        frame = self.ready.pop()  # (the frame launch made: a unit that never yields runs in one step)
        t = time.perf_counter()
        kind, value = self.advance(frame)
        if not self.stepping:  # (inside a step, the step's own time counts it)
            self.stats.compute_s += time.perf_counter() - t
        if kind == _FAILED:
            original = unwrap_stop_iteration(value, frame.unit.code.codes)
            self.fail(original, frame)
            raise original
        self.settle(frame, kind, value)  # (it returned: a unit that never yields has no requests)

    def finish(self):
        """The call has its result: run the deferred groups still pending (each once, for every level)."""
        while self.pending:
            self.launch(_choose(self.pending))
            while self.ready:
                self.step(self.ready.pop())

    def annotate(self, exc, frame):
        """Name the chain of calls that led to ``frame`` on ``exc``, once per run: an error that reaches a
        frame reading a deferred result already names the deferred call's chain. (An enclosing run, of a
        compiled function that called this one through plain code, adds its own.)"""
        if annotated_by(exc) is self.token:
            return
        chain = []
        f = frame
        while f is not None:
            chain.append(f)
            f = f.parent
        annotate(exc, list(reversed(chain)))
        mark_annotated(exc, self.token)

    def fail(self, exc, frame):
        self.annotate(exc, frame)
        for f in list(self.live):  # cancel the rest of the call
            if f.gen is not None and not f.gen.gi_running:  # (the running one ends with the error)
                f.gen.close()
        self.live.clear()


def _aliasing(args):
    """For each argument, the first position giving the same tensor (its own position where none does)."""
    first = {}
    return tuple(first.setdefault(id(a), j) if type(a) is torch.Tensor or type(a) is bt.Batch else j
                 for j, a in enumerate(args))


def _gather_once(gathered, parts):
    key = tuple(id(v) for v, _ in parts)
    found = gathered.get(key)
    if found is None:
        found = gathered[key] = bt.concat(parts)
    return found


def _gathered(args, requests):
    """[(gathered argument, its version, each request's value)]: the arguments of a frame serving several
    requests whose rows were copied together from theirs (``batch.concat``). An inference tensor keeps no
    version (None): its rows are copied back whether changed or not."""
    found, seen = [], set()
    for j, a in enumerate(args):
        if type(a) is bt.Batch and a.owner == "tensor" and id(a) not in seen:
            seen.add(id(a))
            found.append((a, None if a.tensor.is_inference() else a.tensor._version, [r[2][j] for r in requests]))
    return found


def _give_back(given, counts):
    """Copy what a frame changed in place in its gathered arguments back into each request's own value, as
    eager code changes the caller's tensor; only where it changed, so that a request whose rows it did not
    change keeps the version of its tensor (autograd may have saved it). A value that all instances of a
    request share is left as it was: its instances' rows may differ (docs/batching.md, Limits)."""
    for a, version, values in given:
        if version is not None and a.tensor._version == version:
            continue
        start = 0
        for value, count in zip(values, counts):
            rows = a.tensor[start:start + count]
            start += count
            if _kept_in_step(value, count):
                target = value.tensor if type(value) is bt.Batch else value.unsqueeze(0)
                if not torch.equal(target, rows):
                    with saved_versions.writing(target, instances=type(value) is bt.Batch):
                        target.copy_(rows)


def _kept_in_step(value, count):
    """Whether a request's argument ``value`` takes back the rows of its ``count`` instances: a batched tensor,
    or one instance's own tensor (not one that all instances of the request share)."""
    if type(value) is bt.Batch:
        return value.owner == "tensor"
    return count == 1 and type(value) is torch.Tensor
