"""Control flow on a batch of instances: Cond splits by predicate and joins, While runs while any is active.

With n == 1 each is Python's own ``if`` / ``while`` / unpacking on the one
instance's values.
"""

from __future__ import annotations

import torch

from . import aliases
from . import batch as bt
from . import saved_versions, sharing
from .batch import Batch


def truths(n, pred):
    """Each instance's ``bool(pred)``: one host read for a batched tensor predicate."""
    if type(pred) is not Batch:
        return [bool(pred)] * n if n > 1 else [bool(pred)]
    t = bt.tensor_of(pred)
    if t is not None and t.numel() == n:  # one element per instance: bool() of each is its value
        return [bool(x) for x in t.reshape(n).tolist()]
    return [bool(x) for x in bt.items_of(pred)]  # (bool() of each raises as it would one by one)


def split(n, pred):
    """The instances where ``bool(pred)`` holds and where it does not: two (positions, index), where
    index is the positions as a LongTensor, or None (then made when a take needs it). A tensor
    predicate with one element per instance is split on its device (bool of a number is ``!= 0``), so
    the indexes cost no list-to-tensor copy; anything else goes through ``truths``."""
    t = bt.tensor_of(pred) if type(pred) is Batch else None
    if t is None or t.numel() != n:
        yes, no = _split(truths(n, pred))
        return (yes, None), (no, None)
    mask = t.reshape(n)
    if mask.dtype is not torch.bool:
        mask = mask != 0
    yes_index = mask.nonzero().view(-1)  # (the host read: the sizes of the sides)
    yes = yes_index.tolist()
    if not yes or len(yes) == n:
        everyone = (list(range(n)), None)
        return (everyone, ([], None)) if yes else (([], None), everyone)
    no_index = torch.logical_not(mask).nonzero().view(-1)
    return (yes, yes_index), (no_index.tolist(), no_index)


def _split(flags):
    yes = [k for k, f in enumerate(flags) if f]
    no = [k for k, f in enumerate(flags) if not f]
    return yes, no


def _index(positions, like):
    device = None
    for v in like:
        if type(v) is Batch and v.tensor is not None:
            device = v.tensor.device
            break
    return bt.long_tensor(positions, device)


def take_side(values, side):
    """The sub-batches of ``values`` for the instances of ``side`` (one of ``split``'s), in a run that changes
    nothing in place."""
    return tuple(_take_all(values, side))


def _take_all(values, side, copies=None, taken=None, noted=False):
    """The sub-batches of ``values`` for the instances of ``side`` (positions, index). A value given twice is
    taken once, so the side sees one object, as each instance does. With ``copies`` (where the program may
    change a value in place), rows taken out of a batched tensor are always a copy (one instance's row too,
    not a view, whose changes would move the version of the whole batch) and are noted there for
    ``write_back``; ``noted``, rows copied or gathered are noted as copies a later change of the source reaches;
    with ``taken``, each batch taken is noted there as (batch, index, what was taken)."""
    positions, index = side
    if index is None:
        index = _index(positions, values)
    done = {}
    out = []
    for v in values:
        t = done.get(id(v))
        if t is None:
            source = bt.rows_tensor(v) if copies is not None and type(v) is Batch else None
            if source is not None:
                rows = source.index_select(0, bt.index_on(index, source))
                if noted:  # (a later change of the source moves the copy's version: bt.note_rows_copied)
                    bt.note_rows_copied(source, index, rows)
                t = bt.from_tensor(rows)
                # (an inference tensor keeps no version: its rows are copied back whether changed or not)
                copies.append((v, index, t, rows, None if rows.is_inference() else rows._version))
            else:
                t = bt.take(v, index, positions)
                if taken is not None and type(v) is Batch:
                    taken.append((v, index, t))
                if noted:
                    bt.note_taken(v, index, t)
            done[id(v)] = t
        out.append(t)
    return out


def _part_all(values, start, count):
    """Instances start .. start+count-1 of each of ``values`` (a value given twice is cut once)."""
    cut = {}
    out = []
    for v in values:
        t = cut.get(id(v))
        if t is None:
            t = cut[id(v)] = bt.part(v, start, count)
        out.append(t)
    return out


def write_back(copies):
    """Copy rows a branch or loop changed in place back into the batch they were taken from, latest copy
    first: eager code changes the one tensor every name of it sees (``z = y; if c: y += 1``), while a side
    of a split works on a copy of its instances' rows. (``index_put_``: ``index_copy_``'s gradient would
    save the copy, which the side may hand on and the program change again.)"""
    for source, index, _, rows, version in reversed(copies):
        if version is None or rows._version != version:
            target = source.tensor
            at = bt.index_on(index, target)
            changed = _rows_changed(target, at, rows, index) if source.pieces is not None else None
            with saved_versions.writing(target, at, instances=True):
                target.index_put_((at,), rows)
            if changed:
                bt.written_through(source, changed)


def _rows_changed(target, at, rows, index):
    """The instances (of ``index``) whose rows of the copy ``rows`` differ from ``target``'s, where a side
    changed some of them in place (a nested branch may change only some: one version counter covers them all).
    A change that leaves a row's values as they were (``v += 0``) is not seen."""
    differ = bt.rows_differ(target.detach().index_select(0, at), rows)
    return {k for k, d in zip(index.tolist(), differ) if d}


class Branch:
    """A Cond over n instances: ``requests``/``run`` give each branch its instances; ``join`` puts the
    branches' outputs back in instance order."""

    __slots__ = ("n", "sides", "order", "copies", "reached")

    def __init__(self, n, pred, args, changes=False, reached=True, read_reached=True):
        self.n = n
        self.order = None
        # where the program may change a value in place (passes.effects): (batch, index, what a side got,
        # the rows copied for it, their version then), for write_back; and where a change in place may reach
        # what it is given or hands on afterwards (passes.aliasing), what a side hands on of its copies is given
        # back as the arguments' rows (see _aliased); and where one may reach what it is given, the copies the
        # sides read are noted (_take_all)
        self.reached = reached and (changes or not sharing.state.fresh)
        self.copies = [] if changes or self.reached else None
        if n == 1:
            self.sides = [(0 if pred else 1, args, [0])]
            return
        sides, indexes = [], []
        for which, side in enumerate(split(n, pred)):
            positions = side[0]
            if len(positions) == n:
                sides.append((which, args, positions))
            elif positions:
                taken = _take_all(args, side, self.copies, noted=read_reached)
                sides.append((which, tuple(taken), positions))
                indexes.append(side[1])
        self.sides = sides
        if len(sides) > 1:  # one Order for all the outputs
            self.order = bt.Order(n, [p for _, _, p in sides],
                                  None if any(i is None for i in indexes) else indexes)

    def requests(self, then_unit, else_unit, site):
        units = (then_unit, else_unit)
        return tuple((units[which], args, len(positions), site, False) for which, args, positions in self.sides)

    def run(self, then_fn, else_fn):
        fns = (then_fn, else_fn)
        return tuple(fns[which](len(positions), *args) for which, args, positions in self.sides)

    def join(self, results, k):
        if len(self.sides) == 1:
            return results[0]
        if self.copies:
            write_back(self.copies)
        if k == 0:
            return None
        positions = [side[2] for side in self.sides]
        outputs = [list(zip(results, positions))] if k == 1 else \
            [[(r[j], p) for r, p in zip(results, positions)] for j in range(k)]
        sources = self._handed_on(outputs) if self.copies else [None] * k
        if self.copies and self.reached:
            outputs = [sides if s is not None else self._aliased(sides) for s, sides in zip(sources, outputs)]
        joined = [s if s is not None else bt.join(self.n, sides, self.order) for s, sides in zip(sources, outputs)]
        return joined[0] if k == 1 else tuple(joined)

    def _aliased(self, sides):
        """``sides`` with what each side handed on of its copies of the arguments' rows given as those very rows
        of the arguments (``aliases``): write_back brought the copies' changes into them."""
        copies = aliases.Copies(self.copies)
        return [(copies.aliased(value), positions) for value, positions in sides]

    def _handed_on(self, outputs):
        """Per output, the argument whose rows every side hands on, or None. After write_back the argument
        holds the joined value, and eager code would hand on that very object; but not where another output
        joins one of those rows too (``w = v`` on one side, ``w = v = y`` on the other): that join keeps
        the copies, through which a later change to one reaches the other."""
        source_of = {id(copy): source for source, _, copy, _, _ in self.copies}
        sources = []
        for sides in outputs:
            found = None
            for value, _ in sides:
                source = source_of.get(id(value))
                if source is None or (found is not None and source is not found):
                    found = None
                    break
                found = source
            sources.append(found)
        joined_too = {id(value) for s, sides in zip(sources, outputs) if s is None for value, _ in sides}
        return [s if s is not None and not any(id(value) in joined_too for value, _ in sides) else None
                for s, sides in zip(sources, outputs)]


class Loop:
    """A While over n instances: instances leave as their predicate turns false; ``result`` joins their
    final values."""

    __slots__ = ("n", "carried", "k", "positions", "done", "copies", "initial", "handed_on", "left", "noted")

    def __init__(self, n, carried, k, changes=False, reached=True, read_reached=True):
        self.n, self.carried, self.k = n, list(carried), k
        self.positions = list(range(n))
        self.done = []  # (final values, positions)
        self.copies = [] if changes else None  # rows taken for the instances that stay (see write_back)
        # (value, index, what the instances that left got), where a change in place may reach what the loop
        # hands on afterwards (passes.aliasing): see result
        self.left = [] if changes and reached else None
        self.noted = read_reached  # (the copies the staying instances read are noted: see _take_all)
        # per loop variable, whether every step so far handed on the value it was given (see result)
        self.initial = self.carried[:k] if changes else None
        self.handed_on = [type(v) is Batch and v.owner == "tensor" for v in self.initial] if changes else None

    def keep(self, pred):
        if self.n == 1 and not self.done:
            if pred:
                return True
            self.done.append((self.carried[:self.k], self.positions))
            return False
        stay, leave = split(self.n, pred)
        # (the instances that stay are the first ones, as in a loop sorted by its trip counts (``order_by``), and
        # nothing is changed in place: each value's first rows, a view, with no gather)
        first = len(stay[0])
        prefix = self.copies is None and first and leave[0] and stay[0][-1] == first - 1
        if leave[0]:
            values = self.carried[:self.k] if not stay[0] else \
                _part_all(self.carried[:self.k], first, self.n - first) if prefix else \
                _take_all(self.carried[:self.k], leave, taken=self.left)
            self.done.append((values, [self.positions[k] for k in leave[0]]))
        if not stay[0]:
            return False
        if leave[0]:
            self.carried = _part_all(self.carried, 0, first) if prefix else \
                _take_all(self.carried, stay, self.copies, noted=self.noted)
            self.positions = [self.positions[k] for k in stay[0]]
            self.n = first
        return True

    def order_by(self, counts):
        """Put the instances in the order of their trip counts (``counts``, known as the loop starts), the
        longest first, so that those that stay at each step are the first ones (``keep``). The loop's result is
        joined by instance, in their order."""
        if counts is None or self.n < 2 or self.copies is not None:
            return
        order = sorted(range(self.n), key=counts.__getitem__, reverse=True)  # (stable: ties keep their order)
        if order == self.positions:
            return
        self.carried = _take_all(self.carried, (order, None), noted=self.noted)
        self.positions = [self.positions[k] for k in order]

    def step(self, new):
        if self.handed_on is not None:
            self._note_handed_on([new] if self.k == 1 else new)
        if self.k == 1:
            self.carried[0] = new
        elif self.k:
            self.carried[:self.k] = new

    def _note_handed_on(self, new):
        """A loop variable stays handed on while each step gives back the very value it got (``v += 1``),
        and no other variable that did not start as the same object takes it up (``u = v``: u would join
        copies of v's rows)."""
        carried, initial = self.carried, self.initial
        for j in range(self.k):
            if self.handed_on[j] and (new[j] is not carried[j] or any(
                    new[i] is carried[j] and initial[i] is not initial[j] for i in range(self.k))):
                self.handed_on[j] = False

    def result(self):
        handed_on = None
        done = self.done
        if self.copies is not None:
            if self.copies:
                write_back(self.copies)
            handed_on = self.handed_on
            # (what an instance ends the loop with may be an earlier value's rows, which eager code hands on
            # itself: a later change through it must reach them; see ``aliases``)
            if self.left is not None:
                copies = aliases.Copies(self.copies, self.left)
                done = [([copies.aliased(v) for v in vals], p) for vals, p in done]
        n = sum(len(p) for _, p in done)
        values = []
        for j in range(self.k):
            if handed_on is not None and handed_on[j]:
                # write_back brought the rows each instance changed back into the value the loop was given,
                # and eager code ends the loop with that very object (``w = v``, ``while ...: v += 1``)
                values.append(self.initial[j])
            elif len(done) == 1:
                values.append(done[0][0][j])
            else:
                values.append(bt.join(n, [(vals[j], p) for vals, p in done]))
        return values[0] if self.k == 1 else tuple(values)


def unpack(n, value, k):
    """``a, b, c = value`` for n instances (the caller's assignment then unpacks the k values)."""
    if n == 1 or type(value) is not Batch:
        return value
    bt.ready(value)
    if value.struct is not None and value.owner is None:
        parts = bt.struct_items(value)  # (``a, b = d`` of a dict: its keys)
        return parts if len(parts) == k else _unpack_items(n, value, k)
    if value.owner == "tensor" and value.tensor.dim() > 1:
        if value.tensor.shape[1] != k:
            return _unpack_items(n, value, k)
        return [bt.from_tensor(t) for t in value.tensor.unbind(1)]
    return _unpack_items(n, value, k)


def draws_to_unpack(value):
    """Whether unpacking Batch ``value`` draws items from iterators (``hs, cs = zip(*pairs)``), which no run
    may then do again, where it reads containers or tensors."""
    bt.ready(value)
    if value.owner == "tensor" or value.struct is not None and value.owner is None:
        return False
    return any(hasattr(type(x), "__next__") for x in bt.items_of(value))  # (an iterator: nothing made to ask)


def _unpack_items(n, value, k):
    rows = []
    for x in bt.items_of(value):
        a = tuple(x)  # iterating each instance's value, as its unpacking would
        if len(a) != k:
            raise ValueError(f"too many values to unpack (expected {k})" if len(a) > k
                             else f"not enough values to unpack (expected {k}, got {len(a)})")
        rows.append(a)
    return [bt.from_items([r[j] for r in rows]) for j in range(k)]
