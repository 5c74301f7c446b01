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
run and is raised as it is, once, with the chain of calls that led there as
the agenda names it: per depth the function and the branch its first call
came through (``_Link``), down to the piece that failed. Nothing runs twice.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time

import torch

from . import batch as bt
from . import batch_rules, sharing
from .. import config, intrinsics
from .control import Branch
from .frames import annotate, annotated_by, mark_annotated, too_deep
from .units import Deferred, unit_of


_active = threading.local()  # .run: the LevelRun whose ``post`` is running (for ``defer``)


class Descent:
    """An invoking branch's pieces: ``down``, ``up`` (and ``up_late`` with a late split), and per invoke its
    argument count and target."""

    __slots__ = ("down", "up", "arities", "targets", "up_late", "sites")

    def __init__(self, down, up, arities, targets, up_late=None, sites=None):
        self.down, self.up, self.arities, self.targets, self.up_late = down, up, arities, targets, up_late
        self.sites = sites  # per invoke its source location (for error chains)


class Late:
    """A late split (``passes.levels.LateSplit``): ``post_late``, the result's ``size`` (its elements), the
    ``positions`` of its late elements, of the cond's ``k`` outputs the late ones (``outputs``), the count
    of the calls whose requests ``post`` collects, ``sums`` (``passes.levels.TreeSums``, or None), and a dict
    result's ``keys`` (None for a tuple)."""

    __slots__ = ("post_late", "size", "positions", "outputs", "ndeferred", "early", "early_outputs", "sums", "keys")

    def __init__(self, post_late, size, positions, outputs, k, ndeferred, sums=None, keys=None):
        self.post_late, self.size, self.positions, self.outputs = post_late, size, positions, outputs
        self.keys = keys
        self.ndeferred = ndeferred  # how many deferred calls ``post`` makes
        self.sums = sums if config.TREE_SUMS else None
        self.early = [j for j in range(size) if j not in positions]
        self.early_outputs = [j for j in range(k) if j not in outputs]


class _Link:
    """A frame of a level run's call chain, as ``frames.annotate`` reads the agenda's: the unit (``callee``),
    the ``site`` of the call that made it, and its ``parent`` link (None at the root)."""

    __slots__ = ("callee", "site", "parent")

    def __init__(self, callee, site, parent):
        self.callee, self.site, self.parent = callee, site, parent


def _chain(link):
    chain = []
    while link is not None:
        chain.append(link)
        link = link.parent
    return chain[::-1]


class TooDeep(Exception):
    """The call tree is deeper than the agenda allows: its run raises the RecursionError."""


class Deopt(Exception):
    """A guard of a raw segment (``codegen.segments``) failed: the facts its trace relied on do not hold for
    this call."""


class NotPlain(Exception):
    """A value or an op a plain level run cannot hold: the run goes on Batch values instead."""


class PlainPieces:
    """A level program's pieces as ``segments.Plain``, run on plain tensors: ``pre``, per branch ``down`` and
    ``up`` (None for a leaf branch) or ``leaves`` (a leaf branch's), and ``post``; ``early``, the positions
    among the cond's outputs of those ``up`` gives (all of them, or with a late split the ones that are not
    late); ``deferred``, per deferred call of ``post`` its target (a piece of its own at the positions
    ``slices``: the ops of an inline node loss, ``passes.levels.SliceCall``), argument count (whose arguments
    ``post`` hands on after the elements) and source location; ``late``, the Late of their split (with no
    ``post_late``), or None."""

    def __init__(self, pre, down, up, leaves, post, early, deferred, late=None, slices=frozenset()):
        self.pre, self.down, self.up, self.post, self.early, self.deferred = pre, down, up, post, early, deferred
        self.late, self.slices = late, slices
        self.leaves = leaves  # per branch: a leaf branch's own ops (None for an invoking branch)
        self.branches = None  # per branch: its Descent, or None for a leaf branch here (set with the program's)
        self.nargs = sum(a for _, a, _ in deferred)
        self.refused = set()  # which arguments were batched, in calls a plain run could not hold: not tried again
        self.on = True
        self.failures = 0
        self.runs = 0

    def pieces(self):
        return [x for x in (self.pre, *self.down, *self.up, *self.leaves, self.post) if x is not None]


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
        self.plain = None  # PlainPieces, or None
        self.site = None  # the cond's source location (for error chains)
        # whether what the function returns may hold (views of) its arguments (``passes.aliasing``), which a
        # level run joins as copies: see ``applies``
        self.hands_on_inputs = True

    def applies(self):
        """Whether every invoke still reaches this very function (a method overridden in a subclass
        does not), and what it returns is its own: not views of its arguments' rows where the caller, a run
        that changes values in place, may change them (``sharing.unshared``), for a level run's join copies."""
        return all(unit_of(t) is self.unit for d in self.branches if d is not None for t in d.targets) and \
            not (self.hands_on_inputs and sharing.state.never)

    def run(self, agenda_run, args, n, parent=None, site=None, depth=0):
        """The call's result for ``n`` instances; a call the agenda makes for a frame's requests gives that frame
        (``parent``), the call's ``site`` and the frame's depth plus one (``depth``: error chains, the depth
        limit)."""
        saved = getattr(_active, "run", None)
        level_run = _active.run = LevelRun(self, agenda_run, _Link(self.unit, site, parent), depth)
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
    def __init__(self, program, agenda_run, root, depth=0):
        self.p = program
        self.agenda = agenda_run
        self.root = root  # the link of the function's call at the top depth
        self.depth = depth  # that call's frame depth below the run's first frame
        self.pending = {}  # deferred unit -> [(cell, args, count, site, the depth that made it)]
        self.collected = None  # with a late split: the requests of the ``post`` running (``collect``)
        self.prepared = {}  # (a plain run) per trace of a piece, what its ``prep`` gave (``segments.Plain.__call__``)
        # where the run is, for an error's chain: per depth the function's link, and (depth, the branch
        # running or None for the function's own pieces, a deferred call's (unit, site) or None)
        self.links = []
        self.where = (0, None, None)
        self.first_leaf = {}  # branch -> the depth of its first leaf request
        self.called = False  # a callee ran (``run_group``, ``defer``): a failed plain run is not run again

    def go(self, args, n):
        try:
            return self.go_levels(args, n)
        except TooDeep:
            exc = too_deep()
        except Exception as exc:
            self.annotate(exc)
            raise
        self.annotate(exc)
        raise exc

    def annotate(self, exc):
        """Name on ``exc`` the chain of calls to where the run failed (``where``), once. (An error a compiled
        function called from plain code raised names its own chain, and gets this one too, as in the agenda.)"""
        if annotated_by(exc) is not self.agenda.token:
            annotate(exc, _chain(self.link()))
            mark_annotated(exc, self.agenda.token)

    def nested(self, target, args, n, site):
        """A callee that yields, run by the agenda below this run's frame at ``where``; its error names the
        whole chain, and is this run's."""
        self.called = True
        try:
            result, stats = self.agenda.nested(target, args, n, self.link().parent, site)
        except Exception as exc:
            mark_annotated(exc, self.agenda.token)
            raise
        self.merge(stats)
        return result

    def link(self):
        """The link of the frame running at ``where``: the function's at that depth, or its branch's, or the
        deferred call's."""
        depth, which, deferred = self.where
        link = self.links[min(depth, len(self.links) - 1)] if self.links else self.root
        if which is not None:
            link = _Link(self.p.units[which], self.p.site, link)
        if deferred is not None:
            link = _Link(deferred[0], deferred[1], link)
        return link

    def deeper(self, first):
        """The link of the next depth's function, made at the start of each depth: its parent is the branch
        of the first invoking side (``first``) at the depth above, whose first call made it."""
        if not self.links:
            self.links.append(self.root)
            return
        d = self.p.branches[first]
        self.links.append(_Link(self.p.unit, d.sites[0] if d.sites else None,
                                _Link(self.p.units[first], self.p.site, self.links[-1])))

    def go_levels(self, args, n):
        plain = self.p.plain
        entry = None if plain is None else tuple(type(a) is bt.Batch for a in args)  # (it decides every kinds)
        if plain is not None and plain.on and config.PLAIN_LEVELS and entry not in plain.refused:
            saved = self.snapshot()
            try:
                result = self.go_plain(args, n)
                plain.runs += 1
                return result
            except NotPlain:
                plain.refused.add(entry)
            except TooDeep:
                raise  # (as deep on Batch values)
            except Deopt:  # (a guard that failed: what the traces relied on does not hold for this call)
                plain.failures += 1
                plain.on = plain.failures < config.PLAIN_FAILURES
                for piece in plain.pieces():  # (the next call traces them again, for what holds then)
                    piece.traces.clear()
            except Exception as exc:
                if annotated_by(exc) is self.agenda.token or self.called:
                    raise  # (a callee ran, with its effects: the error is raised as it is, with its chain)
                # the program's own error, in pure traced code: the run on Batch values raises it from the
                # user's line; where it does not happen again (a one-shot fault), it is raised as it was
                self.annotate(exc)
                self.restore(saved)
                self.links, self.first_leaf = [], {}
                self.go_batches(args, n)
                raise exc
            self.restore(saved)
            self.links, self.first_leaf = [], {}
        return self.go_batches(args, n)

    def go_batches(self, args, n):
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
        p, record, stats = self.p, self.agenda.record, self.agenda.stats
        ncargs = 1 + p.nargs
        levels, leaves = [], [[] for _ in p.units]
        count, first = n, None
        while True:
            self.deeper(first)
            self.where = (len(levels), None, None)
            record(p.unit, count)
            stats.frames += 1
            out = self.timed(p.pre, count, args)
            branch = Branch(count, out[0], out[1:ncargs])
            sides, children, first = [], [], None
            for which, side_args, positions in branch.sides:
                c = len(positions)
                d = p.branches[which]
                if d is None:
                    leaves[which].append((side_args, c))
                    self.first_leaf.setdefault(which, len(levels))
                    sides.append((which, c, len(leaves[which]) - 1))
                    continue
                if first is None and d.arities:  # (the next depth's calls come from a branch that calls)
                    first = which
                self.where = (len(levels), which, None)
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
            if self.depth + 2 * len(levels) > config.MAX_DEPTH:
                raise TooDeep()
            count = sum(c for _, c in children)
            args = bt.concat_args(children)
        stats.max_depth = max(stats.max_depth, self.depth + 2 * (len(levels) - 1))  # (the deepest call's frame)
        leaf_results = [self.run_leaves(which, requests) for which, requests in enumerate(leaves)]
        return levels, leaf_results

    def run_leaves(self, which, requests):
        if not requests:
            return None
        self.where = (self.first_leaf[which], which, None)
        return self.run_group(self.p.units[which], requests)

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
                self.where = (at, which, None)
                got = self.timed(d.up, c, (*data, *[next(below) for _ in d.arities]))
                results.append(got[0] if p.k == 1 else got)
            joined = branch.join(results, p.k)
            self.where = (at, None, None)
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
                self.where = (at, which, None)
                got = self.timed(d.up, c, (*data, *[x for _ in d.arities for x in next(below)]))
                results.append(got[:k_early])
                handed.append(got[k_early:])
            self.collected = [None] * late.ndeferred
            self.where = (at, None, None)
            out = self.timed(p.post, count, (*live, *_join(branch, results, k_early)))
            early = out[:len(late.early)]
            kept.append((at, handed, out[len(late.early):], self.collected))
            if at:
                below = iter(_rows(early, levels[at - 1][4]))
        ran = self.run_collected([requests for _, _, _, requests in kept], [at for at, _, _, _ in kept])
        lates = None
        if late.sums is not None:
            lates = self.tree_sums(late.sums, levels[0][0], [at for at, _, _, _ in kept], ran,
                                   lambda device: _roots(p.branches, levels[0][0], _batch_sides(levels), device))
        if lates is None:
            lates = self.ascend_late(levels, kept, ran)
        return _result(levels[0][0], late, early, lates)

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
                self.where = (at, which, None)
                results.append(data if d is None else
                               self.timed(d.up_late, c, (*data, *[x for _ in d.arities for x in next(below)])))
            self.where = (at, None, None)
            lates = self.timed(late.post_late, count, (*post_live, *_join(branch, results, k_late), *answered))
            if at:
                below = iter(_rows(lates, levels[at - 1][4]))
        return lates

    def tree_sums(self, sums, n, depth_of, ran, make_roots):
        """The late elements as sums over each call tree (``sums``, ``passes.levels.TreeSums``): each deferred result's
        rows (``run_collected``'s, ``depth_of`` each of its depths) added into the row of their call's root
        (``make_roots(device)``), by one ``index_add`` where a callee's run serves one deferred call, in the
        dtype eager code's ``0.0 + t`` gives. None where a result is not a tensor, or the results an element
        adds differ in row shape or dtype (the second way up then runs instead)."""
        parts = {}  # deferred index -> [(rows, the depths (positions in depth_of) they are of, in order)]
        for entries, value, _ in ran:
            if isinstance(value, torch.Tensor):  # (one value for every row: one row, or shared by all)
                t = value.unsqueeze(0).expand(sum(count for _, _, count in entries), *value.shape)
            else:
                t = bt.tensor_of(value) if type(value) is bt.Batch else None
            if t is None:
                return None
            if len({j for _, j, _ in entries}) == 1:
                parts.setdefault(entries[0][1], []).append((t, [d for d, _, _ in entries]))
                continue
            start = 0
            for d, j, count in entries:
                parts.setdefault(j, []).append((t.narrow(0, start, count), [d]))
                start += count
        roots, totals = None, []
        for terms, zeros, signs in zip(sums.terms, sums.zeros, sums.signs):
            total = None
            for j, alpha in zip(terms, signs):
                for t, depths in parts[j]:
                    if alpha < 0 and t.dtype is torch.bool:
                        return None  # (``loss - flags``: eager refuses it, one by one)
                    if total is None:
                        dtype = t.dtype
                        for z in zeros:  # (every call tree has a leaf: its zero is in every sum, 0.0 + t)
                            if z is not None:  # (promoted with one instance's value, as eager's ``z + t``)
                                dtype = torch.result_type(t[0], _zero(z))
                        total, shape = t.new_zeros((n, *t.shape[1:]), dtype=dtype), (t.shape[1:], t.dtype)
                        roots = roots or make_roots(t.device)
                    elif (t.shape[1:], t.dtype) != shape:
                        return None  # (a sum of different dtypes or shapes: broadcast and promoted one by one)
                    index = torch.cat([roots[depth_of[d]] for d in depths]) if len(depths) > 1 else \
                        roots[depth_of[depths[0]]]
                    total = total.index_add(0, index, t.to(dtype), alpha=alpha)
            totals.append(bt.from_tensor(total))
        self.p.summed += 1
        return totals

    # -- plain runs: every batched value a plain tensor (dim 0 the instance, one row too) and each piece's
    # traced code (``segments.Plain``) run on them; the cond's split and join, gathering and cutting rows are
    # index ops. What they cannot hold raises NotPlain, a guard that fails Deopt, and the run goes on Batch
    # values instead; any other error is the program's own, raised as it is.

    def go_plain(self, args, n):
        p = self.p
        unrecorded = not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        # Nothing records the pure way down and up without grad: in inference mode torch skips its
        # per-op version counter and view bookkeeping too. What leaves it is made an ordinary tensor
        # (``_ordinary``), so the caller may change it in place or use it where autograd records.
        mode = torch.inference_mode if unrecorded else contextlib.nullcontext
        with mode():
            levels, leaves = self.descend_plain(*_plain_args(args), n)
            leaf_results = []
            for which, requests in enumerate(leaves):
                leaf_results.append(self.run_leaves_plain(which, requests) if requests else None)
            top, deferred = self.ascend_plain(levels, leaf_results)
        elements = [_handed_out(v, k, n) for v, k in zip(*top)]
        late = p.plain.late
        if late is None:
            return elements[0]
        ran = self.run_deferred_plain(deferred, mode)
        lates = self.tree_sums(late.sums, n, [at for at, _ in deferred], ran,
                               lambda device: _roots(p.plain.branches, n, _plain_sides(levels), device))
        if lates is None:
            lates = self.sums_by_depth(levels, deferred, ran)
        return _result(n, late, elements, lates)

    def descend_plain(self, values, kinds, n):
        """``descend`` on plain values: per depth (count, sides [(branch, index of its instances or None for
        all, count, its leaf request's position or what ``down`` hands to ``up``)], what ``pre`` hands to
        ``post`` and its kinds, the counts of the calls made); per branch its leaf requests. (The hot loop of
        a plain run: its Python is kept to what each depth needs, the pieces called and timed inline.)"""
        p, plain, prepared = self.p, self.p.plain, self.prepared
        pre, downs, branches, units, unit = plain.pre, plain.down, plain.branches, p.units, p.unit
        record, clock = self.agenda.record, time.perf_counter
        ncargs = 1 + p.nargs
        levels, leaves = [], [[] for _ in units]
        count, frames, compute, first = n, 0, 0.0, None
        while True:
            self.deeper(first)
            self.where = (len(levels), None, None)
            record(unit, count)
            frames += 1
            t = clock()
            out, ok = pre(count, kinds, values, prepared)
            compute += clock() - t
            cargs, ckinds = out[1:ncargs], ok[1:ncargs]
            sides, children, first = [], [], None
            for which, index, c in _plain_split(count, out[0], ok[0]):
                side = cargs if index is None else _plain_take(cargs, ckinds, index)
                d = branches[which]
                if d is None:
                    leaves[which].append((side, ckinds, c))
                    self.first_leaf.setdefault(which, len(levels))
                    sides.append((which, index, c, len(leaves[which]) - 1))
                    continue
                if first is None:
                    first = which
                self.where = (len(levels), which, None)
                record(units[which], c)
                frames += 1
                t = clock()
                o, k = downs[which](c, ckinds, side, prepared)
                compute += clock() - t
                at = 0
                for a in d.arities:
                    children.append((o[at:at + a], k[at:at + a], c))
                    at += a
                sides.append((which, index, c, (o[at:], k[at:])))
            levels.append((count, sides, out[ncargs:], ok[ncargs:], [c for _, _, c in children]))
            if not children:
                break
            if self.depth + 2 * len(levels) > config.MAX_DEPTH:
                raise TooDeep()
            values, kinds = _plain_concat(children, pre.unread)
            count = sum(c for _, _, c in children)
        stats = self.agenda.stats
        stats.frames += frames
        stats.compute_s += compute
        stats.max_depth = max(stats.max_depth, self.depth + 2 * (len(levels) - 1))
        return levels, leaves

    def run_leaves_plain(self, which, requests):
        """Leaf branch ``which`` once for its ``requests`` of every depth: per request, its rows of the
        branch's outputs that ``up`` gives too, and their kinds. (Its traced code: only pure ops, so that a
        plain run given up and run again on Batch values runs no effect twice.)"""
        self.where = (self.first_leaf[which], which, None)
        values, kinds = _plain_concat(requests, self.p.plain.leaves[which].unread)
        counts = [c for _, _, c in requests]
        total = sum(counts)
        self.note(self.p.units[which], total)
        return _plain_cut(*self.timed(self.p.plain.leaves[which], total, (kinds, values, self.prepared)), counts)

    def ascend_plain(self, levels, leaf_results):
        """``ascend`` on plain values, for the cond's early outputs: the top depth's elements and their kinds,
        and per depth (deepest first) the arguments of ``post``'s deferred calls."""
        plain, prepared = self.p.plain, self.prepared
        post, ups, branches, nargs, deferring = plain.post, plain.up, plain.branches, plain.nargs, bool(plain.deferred)
        clock = time.perf_counter
        below, deferred, compute = None, [], 0.0
        for at in range(len(levels) - 1, -1, -1):
            count, sides, live, live_kinds, _ = levels[at]
            parts = []
            for which, index, c, data in sides:
                d = branches[which]
                if d is None:
                    parts.append((index, c, *leaf_results[which][data]))
                    continue
                ins, kinds = data
                for _ in d.arities:
                    v, k = next(below)
                    ins, kinds = ins + v, kinds + k
                self.where = (at, which, None)
                t = clock()
                got, got_kinds = ups[which](c, kinds, ins, prepared)
                compute += clock() - t
                parts.append((index, c, got, got_kinds))
            joined, joined_kinds = _plain_join(parts)
            self.where = (at, None, None)
            t = clock()
            out, ok = post(count, live_kinds + joined_kinds, live + joined, prepared)
            compute += clock() - t
            ne = len(out) - nargs
            if deferring:
                deferred.append((at, (out[ne:], ok[ne:], count)))
            if at:
                below = iter(_plain_cut(out[:ne], ok[:ne], levels[at - 1][4]))  # (the rows its parents asked for)
        self.agenda.stats.compute_s += compute
        return (out[:ne], ok[:ne]), deferred

    def run_deferred_plain(self, deferred, mode):
        """``post``'s deferred calls, each callee once for every depth: ``run_collected``'s result. (Their
        arguments made ordinary tensors: the calls run outside the way down and up's inference mode.) An inline
        loss's piece runs once for every depth too, as the way up ran, in ``mode``."""
        plain = self.p.plain
        groups = {}
        for d, (_, (values, kinds, count)) in enumerate(deferred):
            at = 0
            for j, (target, nargs, _) in enumerate(plain.deferred):
                entry = (d, j, values[at:at + nargs], kinds[at:at + nargs], count)
                key = target if j in plain.slices else unit_of(target)
                groups.setdefault(key, (target, []))[1].append(entry)
                at += nargs
        gathered = []
        for key, (target, entries) in groups.items():
            j = entries[0][1]
            values, kinds = _plain_concat([(v, k, c) for _, _, v, k, c in entries],
                                          target.unread if j in plain.slices else frozenset())
            total = sum(c for *_, c in entries)
            if j not in plain.slices:
                values = tuple(_handed_out(v, k, total) for v, k in zip(values, kinds))
            gathered.append((key, target, entries, values, kinds, total))
        ran = []
        for key, target, entries, values, kinds, total in gathered:
            d, j = entries[0][:2]
            counts = [(d, j, c) for d, j, _, _, c in entries]
            if j in plain.slices:
                self.where = (deferred[d][0], None, None)
                with mode():
                    (out,), (kind,) = self.timed(target, total, (kinds, values, self.prepared))
                ran.append((counts, _handed_out(out, "B" if kind == "N" else kind, total), False))
                continue
            self.where = (deferred[d][0], None, (key, plain.deferred[j][2]))
            ran.append((counts, self.run_group(key, [(values, total)], target, cut=False), key.arity > 1))
        return ran

    def sums_by_depth(self, levels, deferred, ran):
        """The tree sums of a plain run where ``tree_sums`` cannot add them at once (results that are not
        tensors, or of different row shapes or dtypes): up depth by depth on Batch values, each late element
        a leaf's zero or its calls' same elements added, then the node's deferred results, one ``+`` at a
        time as eager code adds them."""
        p, sums = self.p, self.p.plain.late.sums
        answers = _answers([p.plain.deferred] * len(deferred), ran)
        below = None
        for d, (at, _) in enumerate(deferred):
            count, sides, _, _, _ = levels[at]
            parts = []
            for which, index, c, _ in sides:
                positions = list(range(count)) if index is None else index.tolist()
                descent = p.plain.branches[which]
                if descent is None:
                    parts.append(([_zero(zeros[which]) for zeros in sums.zeros], positions))
                    continue
                kids = [next(below) for _ in descent.arities]
                summed = []
                for e in range(len(sums.terms)):
                    v = kids[0][e]
                    for kid in kids[1:]:
                        v = batch_rules.call(c, operator.add, (v, kid[e]))
                    summed.append(v)
                parts.append((summed, positions))
            values = []
            for e, terms in enumerate(sums.terms):
                v = parts[0][0][e] if len(parts) == 1 else bt.join(count, [(part[e], pos) for part, pos in parts])
                for j, fn in zip(terms, sums.ops[e]):
                    v = batch_rules.call(count, fn, (v, answers[d][j]))
                values.append(v)
            if at:
                below = iter(_rows(values, levels[at - 1][4]))
        return values

    def note(self, unit, count):
        self.agenda.record(unit, count)
        self.agenda.stats.frames += 1

    def snapshot(self):
        """What a failed plain run may have counted (the Batch run counts again): stats and per-instance ops."""
        stats = self.agenda.stats
        return (stats.frames, stats.max_depth, {k: list(v) for k, v in stats.batches.items()},
                dict(batch_rules.counters.per_instance))

    def restore(self, saved):
        stats = self.agenda.stats
        stats.frames, stats.max_depth, stats.batches, per_instance = saved
        batch_rules.counters.per_instance.clear()
        batch_rules.counters.per_instance.update(per_instance)

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
        self.called = True
        if unit.is_generator:
            result = self.nested(target, args, total, self.link().site)
        else:
            self.agenda.record(unit, total)
            self.agenda.stats.frames += 1
            try:
                result = self.timed(unit.fn, total, args)
            except Exception as exc:  # (named here: code that reads a deferred result lets a named error through)
                self.annotate(exc)
                raise
        if not cut:
            return result
        return bt.cut_result(result, counts, unit.arity > 1) if len(requests) > 1 else [result]

    def defer(self, requests):
        results = []
        for target, args, count, site, deferrable in requests:
            unit = unit_of(target)
            for a in args:  # (a lazy argument could wait on a deferred call of this very group)
                bt.ready_all(a)
            if deferrable and count > 1 and not unit.is_generator:
                cell = Deferred(self, unit, args)
                self.pending.setdefault(unit, []).append((cell, args, count, site, self.where[0]))
                results.append(bt.Batch(count, thunk=cell))
                continue
            self.where = (*self.where[:2], (unit, site))
            results.append(self.nested(target, args, count, site))
            self.where = (*self.where[:2], None)
        return tuple(results)

    def collect(self, requests, at):
        """Requests of ``post`` with a late split: kept at their positions ``at`` among the deferred calls;
        their results are only read by ``post_late`` (the None each gets here is read by nothing). Unlike
        ``defer``, no check that the arguments are unchanged when the call runs: this function changes
        nothing in place (``passes.levels``) and a deferrable callee neither (``passes.batching``)."""
        for request, j in zip(requests, at):
            self.collected[j] = request
        return (None,) * len(requests)

    def run_collected(self, depths, depth_of):
        """Run the requests collected at every depth (``depth_of`` each its level), each unit's once: per unit,
        its entries [(depth, position among that depth's requests, count)], its result (not cut) and whether it
        has several outputs."""
        groups = {}
        for d, requests in enumerate(depths):
            for j, request in enumerate(requests):
                groups.setdefault(unit_of(request[0]), []).append((d, j, request))
        ran = []
        for unit, entries in groups.items():
            d, _, request = entries[0]
            self.where = (depth_of[d], None, (unit, request[3]))
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
        """A lazy result is read: run its whole group now (``units.Deferred.compute``)."""
        if not any(r[0] is cell for r in self.pending.get(cell.unit, ())):
            raise RuntimeError("recompile: a deferred call's result was read before its call ran (internal error)")
        self.run_deferred_group(cell.unit)

    def run_deferred_group(self, unit):
        requests = self.pending.pop(unit)
        for cell, _, _, site, _ in requests:
            cell.check_arguments(site)
        self.where = (requests[0][4], None, (unit, requests[0][3]))
        results = self.run_group(unit, [(args, count) for _, args, count, _, _ in requests])
        for (cell, _, _, _, _), value in zip(requests, results):
            cell.value, cell.done = value, True


def _ordinary(v):
    """``v``, or where it is an inference tensor and the caller is not in inference mode (a plain run's own
    inference mode made it), a copy of it as an ordinary tensor."""
    if isinstance(v, torch.Tensor) and v.is_inference() and not torch.is_inference_mode_enabled():
        return v.clone()
    return v


def _plain_args(args):
    """A call's arguments as plain values and their kinds (B: a batched tensor, S: shared)."""
    values, kinds = [], []
    for a in args:
        v, k = _plain_value(a)
        values.append(v)
        kinds.append(k)
    return tuple(values), tuple(kinds)


def _plain_value(v):
    if type(v) is not bt.Batch:
        return v, "S"
    t = None if bt.is_lazy(v) else bt.tensor_of(v)
    if t is None:
        raise NotPlain("a batch that is not one tensor")
    return t, "B"


def _plain_split(n, pred, kind):
    """The cond's sides on a plain predicate: [(branch, LongTensor of its instances or None for all, count)]."""
    if kind == "S":
        return [(0 if pred else 1, None, n)]
    if pred.numel() != n:
        raise NotPlain("a predicate of more than one element per instance")
    mask = pred if pred.dim() == 1 else pred.reshape(n)
    if mask.dtype is not torch.bool:
        mask = mask != 0
    yes = mask.nonzero().view(-1)
    k = yes.numel()
    if k == n or k == 0:
        return [(0 if k else 1, None, n)]
    return [(0, yes, k), (1, torch.logical_not(mask).nonzero().view(-1), n - k)]


def _plain_take(values, kinds, index):
    """The rows ``index`` of each batched value of ``values``; shared ones as they are."""
    device = index.device
    out = []
    for v, k in zip(values, kinds):
        if type(k) is tuple:  # (a struct: its elements' rows)
            v = _plain_take(v, k[2], index)
        elif k != "S":  # (rows: a tensor's, or numbers', kind N)
            v = v.index_select(0, index if v.device == device else index.to(v.device))
        out.append(v)
    return tuple(out)


def _plain_rows(v, kind, count):
    """``v`` as ``count`` rows: a batched tensor (or numbers' rows) as it is, a shared tensor repeated (a view)."""
    if kind != "S":
        return v
    if isinstance(v, torch.Tensor):
        return v.unsqueeze(0).expand(count, *v.shape)
    raise NotPlain("a shared value that is not a tensor, joined with other values")


def _plain_column(column, numbers=False):
    """Values [(value, kind, count)] of one position, one after the other: one shared value, or rows. With
    ``numbers``, a Python float beside floating rows of each instance's 0-d tensor becomes rows of their dtype,
    of kind ``N`` (a number per instance, which the next piece may only add to a tensor of that dtype:
    ``segments._Tracer.numbers``)."""
    first = column[0][0]
    if all(k == "S" and v is first for v, k, _ in column):
        return first, "S"
    structs = {k for _, k, _ in column if type(k) is tuple}
    if structs:  # (structs of one kind: element by element; a shared one of that kind, its elements shared)
        kind = next(iter(structs))
        column = [_as_struct(v, k, c, kind) for v, k, c in column]
        if any(type(k) is not tuple or k[1] is not kind[1] or len(k[2]) != len(kind[2]) for _, k, _ in column):
            raise NotPlain("a struct joined with values of another kind")
        parts = [_plain_column([(v[j], k[2][j], c) for v, k, c in column], numbers) for j in range(len(kind[2]))]
        return tuple(v for v, _ in parts), _struct_of(kind[1], [k for _, k in parts])
    # (rows standing for numbers beside a tensor's rows: numbers still, which a trace for numbers reads as the
    # tensor's rows would be read: an index)
    kind = "N" if any(k == "N" for _, k, _ in column) and all(k != "S" for _, k, _ in column) else "B"
    if numbers and any(k == "S" and type(v) is float for v, k, _ in column):
        like = next((v for v, k, _ in column if k == "B"), None)
        if like is None or not like.is_floating_point() or like.dim() != 1 or any(k == "S" and (
                type(v) is not float or torch.tensor(v, dtype=like.dtype).item() != v) for v, k, _ in column):
            # (a number the rows' dtype holds exactly: ``t * 0.1`` computes with more of 0.1 than float16 has)
            raise NotPlain("a number joined with values that are not floating rows")
        column = [(torch.full((c, *like.shape[1:]), v, dtype=like.dtype, device=like.device) if k == "S" else v,
                   "B", c) for v, k, c in column]
        kind = "N"
    rows = [_plain_rows(v, k, c) for v, k, c in column]
    if not _same_rows(rows):
        raise NotPlain("instances of different shapes or dtypes")  # (Batch values keep them apart)
    return torch.cat(rows), kind


def _as_struct(v, k, count, like):
    """(value, kind, count) of a column, a shared tuple or namedtuple of the kind of struct ``like`` (or a dict
    of its keys) made a struct of shared elements."""
    if k != "S":
        return v, k, count
    kind = like[1]
    if type(v) is kind and isinstance(v, tuple) or type(v) is dict and issubclass(kind, bt.Keyed) and \
            tuple(v) == kind.keys_:
        items = tuple(v.values()) if type(v) is dict else tuple(v)
        return items, _struct_of(kind, ["S"] * len(items)), count
    return v, k, count


def _same_rows(rows):
    """Whether ``cat`` of ``rows`` keeps each row's dtype (different shapes or devices it refuses itself)."""
    dtype = rows[0].dtype
    for r in rows:
        if r.dtype is not dtype:
            return False
    return True


def _plain_concat(parts, unread=frozenset()):
    """Arguments [(values, kinds, count)] of several requests as one batch: (values, kinds). At the positions
    ``unread`` (which the piece they go to does not read) the first request's value stands for all."""
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    if len(parts) == 2 and parts[0][1] == parts[1][1]:  # (a node's two calls, their arguments alike)
        values = _concat_alike(parts[0][0], parts[1][0], parts[0][1])
        if values is not None:
            return values, parts[0][1]
    out = [(parts[0][0][j], parts[0][1][j]) if j in unread else _plain_column([(p[0][j], p[1][j], p[2]) for p in parts])
           for j in range(len(parts[0][0]))]
    return tuple(v for v, _ in out), tuple(k for _, k in out)


def _concat_alike(values_a, values_b, kinds):
    """``values_a`` then ``values_b`` (of the same ``kinds``): batched tensors of one dtype concatenated, one
    shared value kept; None where a position is neither."""
    out = []
    for a, b, k in zip(values_a, values_b, kinds):
        if type(k) is tuple:
            both = _concat_alike(a, b, k[2])
            if both is None:
                return None
            out.append(both)
        elif k != "S" and a.dtype is b.dtype:
            out.append(torch.cat((a, b)))
        elif k == "S" and a is b:
            out.append(a)
        else:
            return None
    return tuple(out)


def _plain_join(parts, inverse=None):
    """The cond's sides' outputs [(index, count, values, kinds)] back in instance order: (values, kinds).
    (``inverse``: the order that puts the sides' rows back, where a struct's elements are joined.)"""
    if len(parts) == 1:
        return parts[0][2], parts[0][3]
    (index_a, count_a, values_a, kinds_a), (index_b, count_b, values_b, kinds_b) = parts  # (a cond's two sides)
    if inverse is None:
        inverse = torch.argsort(torch.cat([index_a, index_b]))
    if kinds_a == kinds_b and all(k == "B" or k == "N" for k in kinds_a):  # (the usual case: rows alike)
        device, values = inverse.device, []
        for a, b in zip(values_a, values_b):
            if a.dtype is not b.dtype:
                break
            v = torch.cat((a, b))
            values.append(v.index_select(0, inverse if v.device == device else inverse.to(v.device)))
        else:
            return tuple(values), kinds_a
    values, kinds = [], []
    for a, b, kind_a, kind_b in zip(values_a, values_b, kinds_a, kinds_b):
        if type(kind_a) is tuple or type(kind_b) is tuple:  # (structs: element by element)
            like = kind_a if type(kind_a) is tuple else kind_b
            a, kind_a, _ = _as_struct(a, kind_a, count_a, like)
            b, kind_b, _ = _as_struct(b, kind_b, count_b, like)
            if type(kind_a) is not tuple or type(kind_b) is not tuple or kind_a[1] is not kind_b[1] or \
                    len(kind_a[2]) != len(kind_b[2]):
                raise NotPlain("a struct joined with values of another kind")
            v, k = _plain_join([(index_a, count_a, a, kind_a[2]), (index_b, count_b, b, kind_b[2])], inverse)
            values.append(v)
            kinds.append(_struct_of(kind_a[1], k))
            continue
        if kind_a == "B" and kind_b == "B" and _same_rows((a, b)):
            v, k = torch.cat((a, b)), "B"
        else:
            v, k = _plain_column(((a, kind_a, count_a), (b, kind_b, count_b)), numbers=True)
        values.append(v if k == "S" else v.index_select(0, inverse.to(v.device)))
        kinds.append(k)
    return tuple(values), tuple(kinds)


def _plain_cut(values, kinds, counts):
    """Per request (its instance count in ``counts``), its rows of ``values``: [(values, kinds)]."""
    if len(counts) == 1:
        return [(values, kinds)]
    pieces = [_cut_value(v, k, counts) for v, k in zip(values, kinds)]
    return [(rows, kinds) for rows in zip(*pieces)] if pieces else [((), kinds)] * len(counts)


def _cut_value(v, k, counts):
    """One value's rows per request: a tensor's by one split, a struct's element by element, a shared value
    as it is."""
    if type(k) is tuple:
        return list(zip(*[_cut_value(e, ek, counts) for e, ek in zip(v, k[2])]))
    return v.split_with_sizes(counts) if k != "S" else (v,) * len(counts)


def _struct_of(kind, kinds):
    """The kind of a plain run's struct value (a tuple, a namedtuple, a dict the program built: ``kind``, as
    ``batch.build`` makes it) of elements of ``kinds``: ("T", kind, kinds). Its value is the tuple of its
    elements."""
    return ("T", kind, tuple(kinds))


def _handed_out(v, k, n):
    """A plain run's value of kind ``k`` as the rest of the run holds it: rows as a Batch, a struct as a Batch
    of its elements, a shared value as it is (each made an ordinary tensor)."""
    if type(k) is tuple:  # (one instance's: its own struct, as ``from_tensor`` gives one instance its row)
        parts = [_handed_out(e, ek, n) for e, ek in zip(v, k[2])]
        return bt.build(k[1], parts) if n == 1 else bt.from_struct(k[1], parts, n)
    return bt.from_tensor(_ordinary(v)) if k == "B" else _ordinary(v)


def _batch_sides(levels):
    """``_roots``' sides of a level run on Batch values (``LevelRun.descend``'s levels)."""
    return [[(which, None if c == count else _side_index(branch, k)) for k, (which, c, _) in enumerate(sides)]
            for count, branch, _, sides, _ in levels]


def _zero(z):
    """A leaf branch's zero (``TreeSums.zeros``) as the branch makes it: a number, or a tensor made now."""
    return z() if callable(z) else z


def _plain_sides(levels):
    """``_roots``' sides of a plain level run (``LevelRun.descend_plain``'s levels)."""
    return [[(which, index) for which, index, _, _ in sides] for _, sides, _, _, _ in levels]


def _roots(branches, n, sides, device):
    """Per depth, the LongTensor of the row (among the ``n`` of the top depth) of each instance's root call;
    ``sides``: per depth, per side of its cond (branch, the LongTensor of its instances or None for all);
    ``branches``: per branch its Descent, None for a leaf branch."""
    roots = [torch.arange(n, device=device)]
    for level in sides[:-1]:
        parts = []
        for which, index in level:
            d = branches[which]
            if d is not None:
                mine = roots[-1] if index is None else roots[-1].index_select(0, index.to(device))
                parts.extend([mine] * len(d.arities))
        roots.append(torch.cat(parts) if len(parts) > 1 else parts[0])
    return roots


def _result(n, late, early, lates):
    """A late split's result: the tuple (or the dict, ``late.keys``) of its ``early`` and ``lates`` elements,
    each at its position."""
    elements = [None] * late.size
    for j, v in zip(late.early, early):
        elements[j] = v
    for j, v in zip(late.positions, lates):
        elements[j] = v
    if late.keys is not None:
        return batch_rules.call(n, intrinsics.build_dict, tuple(x for pair in zip(late.keys, elements) for x in pair))
    return batch_rules.call(n, intrinsics.build_tuple, tuple(elements))


def _answers(depths, ran):
    """``run_collected``'s results cut per request: per depth, its requests' results in order."""
    answers = [[None] * len(requests) for requests in depths]
    for entries, value, several in ran:
        values = bt.cut_result(value, [count for _, _, count in entries], several) if len(entries) > 1 else [value]
        for (d, j, _), v in zip(entries, values):
            answers[d][j] = v
    return answers


def _side_index(branch, k):
    """The positions of the instances of the cond's side ``k``, as a LongTensor."""
    indexes = branch.order.indexes
    return indexes[k] if indexes is not None else torch.tensor(branch.sides[k][2])


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
