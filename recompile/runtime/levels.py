"""Runs a level program (``codegen.levels``): the call tree walked down depth by depth, back up once.

Down: at each depth one batch of every call made there runs ``pre`` (the
cond's predicate and arguments), the cond splits it, and each invoking branch
runs ``down``: its calls' arguments, which together are the next depth's
batch. A leaf branch only collects its instances. Then every leaf branch runs
once, for the instances of all depths. Up, deepest first: each invoking
branch runs ``up`` on the results of the depth below (its calls' instances are
consecutive rows there, as they were issued), the cond joins the branches, and
``post`` gives the depth's results. A deferrable call in ``post`` (a node's
loss) is answered with a lazy value and runs once, for every depth, when read
or at the end, as the agenda runs it.

This is the agenda's own schedule for such a function (``runtime.agenda``),
without frames, generators or choosing: the run records the same executions
per program point. An error stops the level run; the agenda then runs the call
again, which raises it with the chain of calls that led there (the function
changes nothing in place, so running it again is safe).
"""

from __future__ import annotations

import threading
import time

from . import batch as bt
from . import batch_rules
from .control import Branch

ENABLED = True  # (off: every call goes through the agenda; for measuring one against the other)

_active = threading.local()  # .run: the LevelRun whose ``post`` is running (for ``defer``)


class Descent:
    """An invoking branch's pieces: ``down`` and ``up``, and per invoke its argument count and target."""

    __slots__ = ("down", "up", "arities", "targets")

    def __init__(self, down, up, arities, targets):
        self.down, self.up, self.arities, self.targets = down, up, arities, targets


class TooDeep(Exception):
    """The call tree is deeper than the agenda allows: its run raises the RecursionError."""


class LevelProgram:
    def __init__(self, unit, pre, post, units, branches, nargs, k):
        self.unit, self.pre, self.post = unit, pre, post
        self.nargs = nargs  # the cond's arguments, after its predicate in what ``pre`` returns
        self.units = units  # the cond's branch units (then, else)
        self.branches = branches  # per branch: Descent, or None for a leaf branch
        self.k = k  # the cond's outputs
        self.runs = 0  # calls run as levels, and calls whose level run failed and went to the agenda
        self.fallbacks = 0

    def applies(self):
        """Whether every invoke still reaches this very function (a method overridden in a subclass
        does not)."""
        from .agenda import _unit_of
        return all(_unit_of(t) is self.unit for d in self.branches if d is not None for t in d.targets)

    def run(self, agenda_run, args, n):
        saved = getattr(_active, "run", None)
        level_run = _active.run = LevelRun(self, agenda_run)
        try:
            result = level_run.go(args, n)
            self.runs += 1
            return result
        except Exception:
            self.fallbacks += 1
            raise
        finally:
            _active.run = saved


class LevelRun:
    def __init__(self, program, agenda_run):
        self.p = program
        self.agenda = agenda_run
        self.pending = {}  # deferred unit -> [(cell, args, count, site)]

    def go(self, args, n):
        from .scheduler import MAX_DEPTH
        p, record, stats = self.p, self.agenda.record, self.agenda.stats
        arity, ncargs = p.unit.arity, 1 + p.nargs
        levels, leaves = [], [[] for _ in p.units]
        count = n
        while True:
            record(p.unit, count)
            stats.frames += 1
            out = self.timed(p.pre, count, args)
            branch = Branch(count, out[0], out[1:ncargs])
            sides, children = [], []
            for which, side_args, positions in branch.sides:
                c = len(positions)
                d = p.branches[which]
                if d is None:
                    leaves[which].append((side_args, c))
                    sides.append((which, c, len(leaves[which]) - 1))
                    continue
                record(p.units[which], c)
                stats.frames += 1
                o = self.timed(d.down, c, side_args)
                at = 0
                for a in d.arities:
                    children.append((o[at:at + a], c))
                    at += a
                sides.append((which, c, o[at:]))
            levels.append((count, branch, out[ncargs:], sides, [c for _, c in children]))
            if not children:
                break
            if 2 * len(levels) > MAX_DEPTH:
                raise TooDeep()
            count = sum(c for _, c in children)
            args = bt.concat_args(children)
        stats.max_depth = max(stats.max_depth, 2 * (len(levels) - 1))  # (the deepest call's frame, as the agenda's)
        leaf_results = [self.run_group(p.units[which], requests, record) if requests else None
                        for which, requests in enumerate(leaves)]
        below = None
        for at in range(len(levels) - 1, -1, -1):
            count, branch, live, sides, _ = levels[at]
            results = []
            for which, c, data in sides:
                d = p.branches[which]
                if d is None:
                    results.append(leaf_results[which][data])
                    continue
                got = self.timed(d.up, c, (*data, *[next(below) for _ in d.arities]))
                results.append(got[0] if p.k == 1 else got)
            joined = branch.join(results, p.k)
            out = self.timed(p.post, count, (*live, *((joined,) if p.k == 1 else joined or ())))
            result = out[0] if arity == 1 else out
            if at:
                below = iter(bt.cut_result(result, levels[at - 1][4], arity != 1))  # (the rows its parents asked for)
        while self.pending:
            unit = next(iter(self.pending))
            self.run_deferred_group(unit)
        bt.ready_all(result)
        return result

    def timed(self, fn, n, args):
        """``fn(n, *args)``, its time counted as compute (the rest of the run is the schedule's)."""
        t = time.perf_counter()
        try:
            return fn(n, *args)
        finally:
            self.agenda.stats.compute_s += time.perf_counter() - t

    def run_group(self, unit, requests, record):
        """Run non-yielding ``unit`` once for ``requests`` [(args, count)]; its result cut per request."""
        counts = [c for _, c in requests]
        total = sum(counts)
        args = bt.concat_args(requests)
        record(unit, total)
        self.agenda.stats.frames += 1
        result = self.timed(unit.fn, total, args)
        return bt.cut_result(result, counts, unit.arity > 1) if len(requests) > 1 else [result]

    def defer(self, requests):
        from .agenda import _Deferred, _unit_of, run as agenda_run
        results = []
        for target, args, count, site, deferrable in requests:
            unit = _unit_of(target)
            for a in args:  # (a lazy argument could wait on a deferred call of this very group)
                bt.ready_all(a)
            if deferrable and count > 1 and not unit.is_generator:
                cell = _Deferred(self, unit, args)
                self.pending.setdefault(unit, []).append((cell, args, count, site))
                results.append(bt.Batch(count, thunk=cell))
                continue
            value, stats = agenda_run(target, args, count)
            self.merge(stats)
            results.append(value)
        return tuple(results)

    def merge(self, stats):
        mine = self.agenda.stats
        mine.frames += stats.frames
        for name, (runs, instances) in stats.batches.items():
            entry = mine.batches.setdefault(name, [0, 0])
            entry[0] += runs
            entry[1] += instances
        counts = batch_rules.counters.per_instance
        for name, k in stats.per_instance.items():
            counts[name] = counts.get(name, 0) + k

    def run_deferred(self, cell):
        """A lazy result is read: run its whole group now (``_Deferred.compute``)."""
        if not any(r[0] is cell for r in self.pending.get(cell.unit, ())):
            raise RuntimeError("recompile: a deferred call's result was read before its call ran (internal error)")
        self.run_deferred_group(cell.unit)

    def run_deferred_group(self, unit):
        requests = self.pending.pop(unit)
        for cell, _, _, site in requests:
            cell.check_arguments(site)
        results = self.run_group(unit, [(args, count) for _, args, count, _ in requests], self.agenda.record)
        for (cell, _, _, _), value in zip(requests, results):
            cell.value, cell.done = value, True


def defer(requests):
    """The results of ``requests`` (deferrable calls of a level program's ``post``): lazy values, run
    once for every depth when read (``LevelRun.defer``)."""
    return _active.run.defer(requests)
