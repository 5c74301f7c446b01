"""A loop split in two passes (``passes.fission``), for n instances.

The first pass runs the loop's test and ``pre`` for every iteration, the instances leaving as their test turns
false (``control.Loop``), and keeps, per iteration, how many instances stayed, their calls' arguments and what
``post`` reads. Every iteration's call of one site is then one request, of as many instances as the iterations
held in all (``requests``: a node's children, however many, of every instance of the frame). The second pass
runs ``post`` over the same iterations, each with its rows of the calls' results, the instances leaving where
they left before (the first pass's tests, again), and ``finish`` joins both passes' loop variables. A second
pass that only takes the results apart, appends and adds up (``passes.fission.at_once``) runs once over every
iteration's rows instead.
"""

from __future__ import annotations

from . import batch as bt
from . import sharing
from .batch import Batch
from .rows import hand_rows
from .control import Loop, split, take_side
from .units import unit_of


class SplitLoop:
    """A split loop for n instances: its first pass (``keep``, ``step``), its calls (``requests``), its second
    pass and result (``finish``)."""

    __slots__ = ("first", "n0", "k", "later", "widths", "guards", "prepares", "initial", "tests", "steps", "arities",
                 "asked", "counts", "at_once", "rows")

    def __init__(self, n, carried, k, later, widths, guards, prepares, at_once=None):
        """``carried``: the loop variables' first values, then its invariants; ``later``: the positions of the
        variables ``post`` computes; per call, ``widths``: how many values ``pre`` hands it, ``guards``: None, or
        the side of an ``if`` whose instances make it (0 then, 1 else), and ``prepares``: None, or what computes
        its arguments from those values, for the instances making it; ``at_once``: how ``post`` runs as one step
        over every iteration's rows (``passes.fission.at_once``), or None."""
        self.n0, self.k, self.later, self.widths, self.guards = n, k, later, widths, guards
        self.prepares = prepares
        self.at_once = at_once if n > 1 else None
        self.rows = []  # (with ``at_once``) per iteration, its instances (positions among the n), in row order
        first = list(carried)
        for j in later:
            first[j] = None  # (the first pass neither reads nor computes them)
        self.first = Loop(n, first, k)
        self.initial = [carried[j] for j in later] + list(carried[k:])
        self.tests, self.steps, self.arities, self.asked = [], [], None, []
        self.counts = None

    def order_by(self, counts):
        """Take the instances longest first in both passes (``Loop.order_by``): the second replays the first's
        tests, so it starts in the same order."""
        self.counts = counts
        self.first.order_by(counts)

    @property
    def n(self):
        return self.first.n

    @property
    def carried(self):
        return self.first.carried

    def keep(self, pred):
        self.tests.append(pred)
        return self.first.keep(pred)

    def step(self, out):
        """``out``: ``pre``'s k loop variables (None where ``post`` computes one); per call, its ``if``'s test
        where it has one, and its arguments; then what ``post`` reads."""
        k, n = self.k, self.first.n
        if self.at_once is not None:
            self.rows.append(self.first.positions)
        self.first.step(out[0] if k == 1 else out[:k])
        calls, at = [], k
        for width, guard, prepare in zip(self.widths, self.guards, self.prepares):
            if guard is None:
                calls.append((out[at:at + width], n))
                at += width
                continue
            calls.append(guarded_arguments(n, out[at], guard, prepare, out[at + 1:at + 1 + width]))
            at += 1 + width
        self.steps.append((n, calls, out[at:]))

    def requests(self, calls):
        """The requests of every iteration's calls: one per call site ((target, site) in ``calls``) that some
        instance made, or None where none did."""
        self.arities = [unit_of(target).arity for target, _ in calls]
        asked = []
        for i, (target, site) in enumerate(calls):
            parts = [made[i] for _, made, _ in self.steps if made[i][1]]
            if parts:
                self.asked.append(i)
                asked.append((target, bt.concat_args(parts), sum(c for _, c in parts), site, False))
        return tuple(asked) or None

    def finish(self, results, post):
        """The loop's final variables: the first pass's, and those ``post`` computes over ``results``."""
        if self.at_once is not None and self.asked == [0]:
            values = self._at_once(results[0])
            if values is not None:
                return values
        by_split = sharing.state.fresh  # (a split's pieces are views no one may change in place)
        parts = []
        for i, arity in enumerate(self.arities or ()):
            counts = [made[i][1] for _, made, _ in self.steps]
            each = iter(bt.cut_result(results[self.asked.index(i)], [c for c in counts if c], arity > 1, by_split)
                        if i in self.asked else ())
            parts.append([next(each) if c else None for c in counts])
        loop = Loop(self.n0, self.initial, len(self.later))
        loop.order_by(self.counts)
        for t, pred in enumerate(self.tests):
            if not loop.keep(pred):
                break
            got = [p[t] for p in parts]
            loop.step(post(loop.n, *loop.carried, *self.steps[t][2], *got))
        later = loop.result()
        return self._with_later([later] if len(self.later) == 1 else list(later))

    def _with_later(self, later):
        """The loop's final variables: the first pass's, with ``later`` (in ``self.later``'s order)."""
        values = self.first.result()
        values = [values] if self.k == 1 else list(values)
        for j, value in zip(self.later, later):
            values[j] = value
        return values[0] if self.k == 1 else tuple(values)

    def _at_once(self, result):
        """``post`` run once over the call's ``result`` for every iteration's rows (``at_once``: it takes the
        result apart, appends elements to lists that start empty, adds elements to loop variables): each list
        given its instance's rows in iteration order (``rows.Appended``), each sum its start plus its instance's
        rows, ``index_add``ed in row order (in iteration order on the CPU, as the loop adds them); None where the
        values are not tensor rows of one shape and dtype, a start of another kind or a list not empty, in a
        run that may change values in place (the rows are views), or on another device than the CPU."""
        length, appends, sums = self.at_once
        if not sharing.state.fresh or type(result) is not Batch:
            return None
        bt.ready(result)
        if length is None:
            elements = [result]
        elif result.struct is not None and result.owner is None and len(bt.struct_items(result)) == length:
            elements = list(bt.struct_items(result))  # (a dict's keys, which then are no rows)
        else:
            return None
        instance = [k for positions in self.rows for k in positions]
        packed = {}
        for e in {e for _, e in appends} | set(sums):
            t = bt.rows_tensor(elements[e]) if type(elements[e]) is Batch else None
            if t is None or t.shape[0] != len(instance) or t.device.type != "cpu":
                return None
            packed[e] = t
        lists = []
        for q, e in appends:
            held = self.initial[len(self.later) + q]
            each = bt.items_of(held) if type(held) is Batch else None
            if each is None or len(each) != self.n0 or not all(type(x) is list and not x for x in each):
                return None
            lists.append((held, each, packed[e]))
        ids = set()
        for _, each, _ in lists:
            ids.update(map(id, each))
        if len(ids) != self.n0 * len(lists):
            return None  # (one list under two names: its appends interleave)
        index = bt.long_tensor(instance)
        starts = []
        for i, e in enumerate(sums):
            start, t = self.initial[i], packed[e]
            if not t.is_floating_point():
                return None
            if type(start) in (int, float):
                rows = t.new_full((self.n0, *t.shape[1:]), start)
            else:
                rows = bt.rows_tensor(start) if type(start) is Batch else None
                if rows is None or rows.shape != (self.n0, *t.shape[1:]) or rows.dtype != t.dtype \
                        or rows.device != t.device:
                    return None
            starts.append((start, rows))
        counts = [0] * self.n0
        for k in instance:
            counts[k] += 1
        step = bt.long_tensor([t for t, positions in enumerate(self.rows) for _ in positions])
        for held, each, rows_of in lists:
            hand_rows(held, each, rows_of, index, step, counts)
        later = []
        for (start, rows), e in zip(starts, sums):
            total = rows.index_add(0, index, packed[e])
            if type(start) is Batch or all(counts):
                later.append(bt.from_tensor(total))
                continue
            ran = [k for k in range(self.n0) if counts[k]]  # (an instance that made no call keeps its start)
            kept = [k for k in range(self.n0) if not counts[k]]
            later.append(bt.join(self.n0, [(bt.from_tensor(total[bt.long_tensor(ran)]), ran), (start, kept)]))
        return self._with_later(later)


def guarded_arguments(n, pred, which, prepare, given):
    """(arguments, count) of a call under an ``if`` for the instances of n whose ``pred`` takes side ``which``:
    ``prepare`` computes them from those instances' ``given`` (None, 0 where none does)."""
    side = split(n, pred)[which]
    count = len(side[0])
    if not count:
        return None, 0
    return prepare(count, *(given if count == n else take_side(given, side))), count


class BlockCalls:
    """The calls of a split block (``passes.fission.split_block``) for n instances, asked for at once: each
    call's arguments and count (``add``, ``guarded``), one request per call some instance makes
    (``requests``), and each call's results, rows of the instances making it, in order (``results``)."""

    __slots__ = ("n", "made")

    def __init__(self, n):
        self.n, self.made = n, []

    def add(self, args):
        self.made.append((args, self.n))

    def guarded(self, pred, which, prepare, given):
        self.made.append(guarded_arguments(self.n, pred, which, prepare, given))

    def requests(self, calls):
        """``calls``: (target, site) per call."""
        return tuple((target, args, count, site, False) for (target, site), (args, count) in zip(calls, self.made)
                     if count)

    def results(self, got):
        each = iter(got)
        return tuple(next(each) if count else None for _, count in self.made)


def guarded_run(branch, which, called, other, got):
    """``branch.run`` of an ``if`` around a call of a split loop: side ``which`` (``called``) gets the call's
    results ``got`` as its last arguments, the rows of the instances that took it, in their order."""
    return tuple(called(len(positions), *args, *got) if side == which else other(len(positions), *args)
                 for side, args, positions in branch.sides)
