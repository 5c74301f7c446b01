"""A loop split in two passes (``passes.fission``), for n instances.

The first pass runs the loop's test and ``pre`` for every iteration, the instances leaving as their test turns
false (``control.Loop``), and keeps, per iteration, how many instances stayed, their calls' arguments and what
``post`` reads. Every iteration's call of one site is then one request, of as many instances as the iterations
held in all (``requests``: a node's children, however many, of every instance of the frame). The second pass
runs ``post`` over the same iterations, each with its rows of the calls' results, the instances leaving where
they left before (the first pass's tests, again), and ``finish`` joins both passes' loop variables.
"""

from __future__ import annotations

from . import batch as bt
from . import sharing
from .control import Loop, split, take_side
from .units import unit_of


class SplitLoop:
    """A split loop for n instances: its first pass (``keep``, ``step``), its calls (``requests``), its second
    pass and result (``finish``)."""

    __slots__ = ("first", "n0", "k", "later", "widths", "guards", "prepares", "initial", "tests", "steps", "arities",
                 "asked", "counts")

    def __init__(self, n, carried, k, later, widths, guards, prepares):
        """``carried``: the loop variables' first values, then its invariants; ``later``: the positions of the
        variables ``post`` computes; per call, ``widths``: how many values ``pre`` hands it, ``guards``: None, or
        the side of an ``if`` whose instances make it (0 then, 1 else), and ``prepares``: None, or what computes
        its arguments from those values, for the instances making it."""
        self.n0, self.k, self.later, self.widths, self.guards = n, k, later, widths, guards
        self.prepares = prepares
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
        self.first.step(out[0] if k == 1 else out[:k])
        calls, at = [], k
        for width, guard, prepare in zip(self.widths, self.guards, self.prepares):
            if guard is None:
                calls.append((out[at:at + width], n))
                at += width
                continue
            given, side = out[at + 1:at + 1 + width], split(n, out[at])[guard]
            at += 1 + width
            count = len(side[0])
            if count:
                args = prepare(count, *(given if count == n else take_side(given, side)))
                calls.append((args, count))
            else:
                calls.append((None, 0))
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
        values = self.first.result()
        values = [values] if self.k == 1 else list(values)
        later = loop.result()
        for i, j in enumerate(self.later):
            values[j] = later if len(self.later) == 1 else later[i]
        return values[0] if self.k == 1 else tuple(values)


def guarded_run(branch, which, called, other, got):
    """``branch.run`` of an ``if`` around a call of a split loop: side ``which`` (``called``) gets the call's
    results ``got`` as its last arguments, the rows of the instances that took it, in their order."""
    return tuple(called(len(positions), *args, *got) if side == which else other(len(positions), *args)
                 for side, args, positions in branch.sides)
