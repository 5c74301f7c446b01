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
from .control import Loop
from .units import unit_of


class SplitLoop:
    __slots__ = ("first", "n0", "k", "later", "widths", "initial", "tests", "steps", "arities")

    def __init__(self, n, carried, k, later, widths):
        """``carried``: the loop variables' first values, then its invariants; ``later``: the positions of the
        variables ``post`` computes; ``widths``: how many arguments each call takes."""
        self.n0, self.k, self.later, self.widths = n, k, later, widths
        first = list(carried)
        for j in later:
            first[j] = None  # (the first pass neither reads nor computes them)
        self.first = Loop(n, first, k)
        self.initial = [carried[j] for j in later] + list(carried[k:])
        self.tests, self.steps, self.arities = [], [], None

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
        """``out``: ``pre``'s k loop variables (None where ``post`` computes one), each call's arguments, and
        what ``post`` reads."""
        k = self.k
        self.first.step(out[0] if k == 1 else out[:k])
        args, at = [], k
        for width in self.widths:
            args.append(out[at:at + width])
            at += width
        self.steps.append((self.first.n, args, out[at:]))

    def requests(self, calls):
        """The requests of every iteration's calls: one per call site ((target, site) in ``calls``), or None
        where no instance ran an iteration."""
        if not self.steps:
            return None
        total = sum(n for n, _, _ in self.steps)
        self.arities = [unit_of(target).arity for target, _ in calls]
        return tuple((target, bt.concat_args([(args[i], n) for n, args, _ in self.steps]), total, site, False)
                     for i, (target, site) in enumerate(calls))

    def finish(self, results, post):
        """The loop's final variables: the first pass's, and those ``post`` computes over ``results``."""
        counts = [n for n, _, _ in self.steps]
        split = sharing.state.fresh  # (a split's pieces are views no one may change in place)
        parts = [bt.cut_result(r, counts, arity > 1, split) for r, arity in zip(results, self.arities or ())]
        loop = Loop(self.n0, self.initial, len(self.later))
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
