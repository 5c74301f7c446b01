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

With a late split (``passes.levels``) nothing is lazy: the way up runs for
the result's elements that no deferred call feeds, ``post`` collecting the
deferred calls' requests; those calls then run once, for every depth; and a
second way up runs the late halves (``up_late``, ``post_late``: the loss
chain ``loss_l + loss_r``, ``+ node_loss``) on their results.

This is the agenda's own schedule for such a function (``runtime.agenda``),
without frames, generators or choosing: the run records the same executions
per program point (with a late split, fewer runs of a deferred call where the
agenda reads its lazy result early, in a fused op). An error stops the level
run; the agenda then runs the call again, which raises it with the chain of
calls that led there (the function changes nothing in place, so running it
again is safe).
"""

from __future__ import annotations

import threading
import time

import torch

from . import batch as bt
from . import batch_rules
from . import semantics as sem
from .control import Branch

ENABLED = True  # (off: every call goes through the agenda; for measuring one against the other)
SUMS_ENABLED = True  # (read when a level program is built; off: late elements always take the second way up)

_active = threading.local()  # .run: the LevelRun whose ``post`` is running (for ``defer``)


class Descent:
    """An invoking branch's pieces: ``down``, ``up`` (and ``up_late`` with a late split), and per invoke its
    argument count and target."""

    __slots__ = ("down", "up", "arities", "targets", "up_late")

    def __init__(self, down, up, arities, targets, up_late=None):
        self.down, self.up, self.arities, self.targets, self.up_late = down, up, arities, targets, up_late


class Late:
    """A late split (``passes.levels.LateSplit``): ``post_late``, the result's ``size`` (its elements), the
    ``positions`` of its late elements, of the cond's ``k`` outputs the late ones (``outputs``), the count
    of the calls whose requests ``post`` collects, and ``sums`` (``passes.levels.TreeSums``, or None)."""

    __slots__ = ("post_late", "size", "positions", "outputs", "ndeferred", "early", "early_outputs", "sums")

    def __init__(self, post_late, size, positions, outputs, k, ndeferred, sums=None):
        self.post_late, self.size, self.positions, self.outputs = post_late, size, positions, outputs
        self.ndeferred = ndeferred  # how many deferred calls ``post`` makes
        self.sums = sums if SUMS_ENABLED else None
        self.early = [j for j in range(size) if j not in positions]
        self.early_outputs = [j for j in range(k) if j not in outputs]


class TooDeep(Exception):
    """The call tree is deeper than the agenda allows: its run raises the RecursionError."""


class LevelProgram:
    def __init__(self, unit, pre, post, units, branches, nargs, k, late=None):
        self.unit, self.pre, self.post, self.late = unit, pre, post, late
        self.nargs = nargs  # the cond's arguments, after its predicate in what ``pre`` returns
        self.units = units  # the cond's branch units (then, else)
        self.branches = branches  # per branch: Descent, or None for a leaf branch
        self.k = k  # the cond's outputs
        self.runs = 0  # calls run as levels, and calls whose level run failed and went to the agenda
        self.fallbacks = 0
        self.summed = 0  # level runs whose late elements were tree sums (``LevelRun.tree_sums``)

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
        self.collected = None  # with a late split: the requests of the ``post`` running (``collect``)

    def go(self, args, n):
        levels, leaf_results = self.descend(args, n)
        result = self.ascend(levels, leaf_results) if self.p.late is None else self.ascend_split(levels, leaf_results)
        while self.pending:
            unit = next(iter(self.pending))
            self.run_deferred_group(unit)
        bt.ready_all(result)
        return result

    def descend(self, args, n):
        """Down the call tree depth by depth, then each leaf branch once: (per depth (count, Branch, what
        ``pre`` hands to ``post``, per side (branch, count, its leaf request or what ``down`` hands to
        ``up``), the counts of the calls made), per branch the leaf results cut per request)."""
        from .scheduler import MAX_DEPTH
        p, record, stats = self.p, self.agenda.record, self.agenda.stats
        ncargs = 1 + p.nargs
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
        leaf_results = [self.run_group(p.units[which], requests) if requests else None
                        for which, requests in enumerate(leaves)]
        return levels, leaf_results

    def ascend(self, levels, leaf_results):
        """Up, deepest first: ``up`` per invoking side, the join, ``post``; the top depth's result."""
        p = self.p
        arity = p.unit.arity
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
        return result

    def ascend_split(self, levels, leaf_results):
        """Up twice with a late split: first the elements that are not late, collecting the deferred calls'
        requests; then, once those calls ran for every depth, the late elements. The top depth's result."""
        p, late = self.p, self.p.late
        k_early = len(late.early_outputs)
        below, kept = None, []
        for at in range(len(levels) - 1, -1, -1):
            count, branch, live, sides, _ = levels[at]
            results, handed = [], []  # per side: its early outputs, and what its late half reads
            for which, c, data in sides:
                d = p.branches[which]
                if d is None:
                    got = leaf_results[which][data]
                    got = (got,) if p.k == 1 else got
                    results.append(tuple(got[j] for j in late.early_outputs))
                    handed.append(tuple(got[j] for j in late.outputs))
                    continue
                got = self.timed(d.up, c, (*data, *[x for _ in d.arities for x in next(below)]))
                results.append(got[:k_early])
                handed.append(got[k_early:])
            self.collected = [None] * late.ndeferred
            out = self.timed(p.post, count, (*live, *_join(branch, results, k_early)))
            early = out[:len(late.early)]
            kept.append((at, handed, out[len(late.early):], self.collected))
            if at:
                below = iter(_rows(early, levels[at - 1][4]))
        ran = self.run_collected([requests for _, _, _, requests in kept])
        lates = self.tree_sums(levels, kept, ran) if late.sums is not None else None
        if lates is None:
            lates = self.ascend_late(levels, kept, ran)
        elements = [None] * late.size
        for j, v in zip(late.early, early):
            elements[j] = v
        for j, v in zip(late.positions, lates):
            elements[j] = v
        return batch_rules.call(levels[0][0], sem.build_tuple, tuple(elements))

    def ascend_late(self, levels, kept, ran):
        """The second way up: the late halves on the deferred calls' results; the top depth's late elements."""
        p, late = self.p, self.p.late
        k_late = len(late.outputs)
        answers = _answers([requests for _, _, _, requests in kept], ran)
        below = None
        for (at, handed, post_live, _), answered in zip(kept, answers):
            count, branch, _, sides, _ = levels[at]
            results = []
            for (which, c, _), data in zip(sides, handed):
                d = p.branches[which]
                results.append(data if d is None else
                               self.timed(d.up_late, c, (*data, *[x for _ in d.arities for x in next(below)])))
            lates = self.timed(late.post_late, count, (*post_live, *_join(branch, results, k_late), *answered))
            if at:
                below = iter(_rows(lates, levels[at - 1][4]))
        return lates

    def tree_sums(self, levels, kept, ran):
        """The late elements as sums over each call tree (``passes.levels.TreeSums``): each deferred result's
        rows added into the row of their call's root by one ``index_add``. None where a result is not a
        floating tensor of one row shape and dtype per element (the second way up then runs instead)."""
        sums, n = self.p.late.sums, levels[0][0]
        depth_of = [at for at, _, _, _ in kept]
        rows, roots = {}, None  # deferred index -> [(rows tensor, its depth's position in kept)]
        for entries, value, _ in ran:
            if isinstance(value, torch.Tensor):  # (one value for every row: one row, or shared by all)
                t = value.unsqueeze(0).expand(sum(count for _, _, count in entries), *value.shape)
            else:
                t = bt.tensor_of(value) if type(value) is bt.Batch else None
            if t is None or not (t.is_floating_point() or t.is_complex()):
                return None
            start = 0
            for d, j, count in entries:
                rows.setdefault(j, []).append((t, start, count, d))
                start += count
        totals = []
        for terms in sums.terms:
            total = None
            for j in terms:
                for t, start, count, d in rows[j]:
                    if total is None:
                        total = t.new_zeros((n, *t.shape[1:]))
                        if roots is None:
                            roots = self.roots(levels, t.device)
                    elif t.shape[1:] != total.shape[1:] or t.dtype != total.dtype:
                        return None
                    total = total.index_add(0, roots[depth_of[d]], t.narrow(0, start, count))
            totals.append(bt.from_tensor(total))
        self.p.summed += 1
        return totals

    def roots(self, levels, device):
        """Per depth, the LongTensor of the row (among the top depth's) of each instance's root call."""
        p = self.p
        roots = [torch.arange(levels[0][0], device=device)]
        for count, branch, _, sides, _ in levels[:-1]:
            parts = []
            for k, (which, c, _) in enumerate(sides):
                d = p.branches[which]
                if d is None:
                    continue
                mine = roots[-1] if c == count else roots[-1].index_select(0, _side_index(branch, k, device))
                parts.extend([mine] * len(d.arities))
            roots.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        return roots

    def timed(self, fn, n, args):
        """``fn(n, *args)``, its time counted as compute (the rest of the run is the schedule's)."""
        t = time.perf_counter()
        try:
            return fn(n, *args)
        finally:
            self.agenda.stats.compute_s += time.perf_counter() - t

    def run_group(self, unit, requests, target=None, cut=True):
        """Run ``unit`` once for ``requests`` [(args, count)]; its result cut per request (or, without ``cut``,
        not). A yielding unit (a recursive callee of a deferred call, ``target``) is run by the agenda, for all
        of them at once."""
        counts = [c for _, c in requests]
        total = sum(counts)
        args = bt.concat_args(requests)
        if unit.is_generator:
            from .agenda import run as agenda_run
            result, stats = agenda_run(target, args, total)
            self.merge(stats)
        else:
            self.agenda.record(unit, total)
            self.agenda.stats.frames += 1
            result = self.timed(unit.fn, total, args)
        if not cut:
            return result
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

    def collect(self, requests, at):
        """Requests of ``post`` with a late split: kept at their positions ``at`` among the deferred calls;
        their results are only read by ``post_late`` (the None each gets here is read by nothing). Unlike
        ``defer``, no check that the arguments are unchanged when the call runs: this function changes
        nothing in place (``passes.levels``) and a deferrable callee neither (``passes.batching``)."""
        for request, j in zip(requests, at):
            self.collected[j] = request
        return (None,) * len(requests)

    def run_collected(self, depths):
        """Run the requests collected at every depth, each unit's once: per unit, its entries [(depth, position
        among that depth's requests, count)], its result (not cut) and whether it has several outputs."""
        from .agenda import _unit_of
        groups = {}
        for d, requests in enumerate(depths):
            for j, request in enumerate(requests):
                groups.setdefault(_unit_of(request[0]), []).append((d, j, request))
        ran = []
        for unit, entries in groups.items():
            value = self.run_group(unit, [(request[1], request[2]) for _, _, request in entries], entries[0][2][0],
                                   cut=False)
            ran.append(([(d, j, request[2]) for d, j, request in entries], value, unit.arity > 1))
        return ran

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
        results = self.run_group(unit, [(args, count) for _, args, count, _ in requests])
        for (cell, _, _, _), value in zip(requests, results):
            cell.value, cell.done = value, True


def _answers(depths, ran):
    """``run_collected``'s results cut per request: per depth, its requests' results in order."""
    answers = [[None] * len(requests) for requests in depths]
    for entries, value, several in ran:
        values = bt.cut_result(value, [count for _, _, count in entries], several) if len(entries) > 1 else [value]
        for (d, j, _), v in zip(entries, values):
            answers[d][j] = v
    return answers


def _side_index(branch, k, device):
    """The positions of the instances of the cond's side ``k``, as a LongTensor on ``device``."""
    indexes = branch.order.indexes
    index = indexes[k] if indexes is not None else torch.tensor(branch.sides[k][2])
    return index.to(device)


def _rows(values, counts):
    """Per request (its instance count in ``counts``), its rows of each of ``values``: a tuple."""
    if not values:
        return [()] * len(counts)
    return bt.cut_result(tuple(values), counts, True)


def _join(branch, parts, k):
    """The Cond's sides' ``parts`` (per side a tuple of k values) joined, as a tuple of k."""
    if k == 0:
        return ()
    if len(parts) == 1:
        return tuple(parts[0])
    if k == 1:
        return (branch.join([part[0] for part in parts], 1),)
    return branch.join(parts, k)


def collect(requests, at):
    """The requests of a level program's ``post`` with a late split, kept for once all depths made theirs
    (``LevelRun.collect``)."""
    return _active.run.collect(requests, at)


def defer(requests):
    """The results of ``requests`` (deferrable calls of a level program's ``post``): lazy values, run
    once for every depth when read (``LevelRun.defer``)."""
    return _active.run.defer(requests)
