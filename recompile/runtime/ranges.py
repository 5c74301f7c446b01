"""A ``for`` over ranges that differ per instance (``for t in range(n)``), batched.

A lowered ``for`` (frontend.canonicalize) reads ``as_sequence(range(n))``, then ``has_index(seq, i)`` and
``seq[i]`` with a counter i that every instance shares. A batch of ranges keeps its instances' lengths,
so the test costs a comparison per instance only in the steps where some instances end and others go
on, and the item is one int every instance shares while the ranges start and step alike: the body then
sees the same ``t`` in every instance, as in the ``while t < n`` form, and ``x[t]`` stays one op.
"""

from __future__ import annotations

import math

import torch

from ..ops import facts
from . import batch as bt
from . import dicts, rows, sharing
from .batch import Batch


class Ranges(list):
    """Each instance's ``range`` (a Batch's items), with what the loop's test and item read."""

    __slots__ = ("lengths", "counts", "shortest", "longest", "start", "step")

    def __init__(self, ranges):
        super().__init__(ranges)
        self.lengths = [len(r) for r in ranges]
        self.counts = bt.long_tensor(self.lengths)  # (the test of a step where some instances end: one comparison)
        self.shortest, self.longest = min(self.lengths), max(self.lengths)
        first = ranges[0]
        alike = all(r.start == first.start and r.step == first.step for r in ranges)
        # (None where the instances differ: then an item differs per instance too)
        self.start, self.step = (first.start, first.step) if alike else (None, None)


def of(value):
    """The Ranges of Batch ``value`` when each of its instances is a range, else None. (A sub-batch taken
    when instances leave a loop holds a plain list of the same ranges: it is read again once.)"""
    items = value.items
    if items is None or value.thunk is not None:
        return None
    if type(items) is Ranges:
        return items
    if not all(type(r) is range for r in items):
        return None
    try:
        value.items = Ranges(items)
    except (OverflowError, RuntimeError):  # a length beyond sys.maxsize (or int64): each instance's own range
        return None
    return value.items


def build(n, fn, args, kwargs):
    """``range(*args)`` where an argument differs per instance: a batch of ranges."""
    if kwargs or not args:
        return NotImplemented
    try:
        ranges = [range(*row) for row in zip(*[bt.instance_ints(n, a) for a in args])]
    except (TypeError, ValueError):
        return NotImplemented  # each instance raises its own error, as Python would
    value = bt.from_items(ranges)
    return value if of(value) is not None else NotImplemented


def as_sequence(n, fn, args, kwargs):
    """What a ``for`` over a batch of ranges iterates: the ranges as they are; over a batch of tensors (each
    instance's rows: ``for x in xs``), the batched tensor, whose item i is every instance's row i at once."""
    (seq,) = args
    if type(seq) is Batch and len(bt.instance_shape(seq) or ()) >= 1:  # (a joined value's too: as it is)
        return seq
    if _built(seq) or rows.of(seq) is not None:  # (a tuple or list the program built, ``words[:n]``: as it is)
        return seq
    if type(seq) is Batch and of(seq) is not None:
        return seq
    keys = dicts.iterated(seq)  # (``for k in d`` of a dict built with shared keys: its keys)
    if keys is not None:
        return keys
    out = rows.listed(n, seq) if sharing.state.fresh else NotImplemented  # (``for h in hs``, each its own list)
    if out is NotImplemented and own_sequences(seq):
        # (``for ch in node.children``, each instance's list of anything: as it is, since a lowered ``for`` reads
        # a list or tuple as Python's iterator does, by position, its length again at each step)
        return seq
    return out


_SEQUENCES = (list, tuple, str)  # (what a lowered ``for`` reads by position, as Python's iterator reads it)


def own_sequences(seq):
    """Whether Batch ``seq`` holds each instance's own list, tuple or str as its items."""
    return type(seq) is Batch and seq.owner == "items" and bt.own_lists(seq, _SEQUENCES) is not None


def has_index(n, fn, args, kwargs):
    """Whether each instance's range (or tensor) has an item at the shared position i."""
    seq, i = args
    shape = bt.instance_shape(seq) if type(seq) is Batch and type(i) is int and i >= 0 else None
    if shape:
        return i < shape[0]
    if _built(seq) and type(i) is int and i >= 0:
        return i < len(seq.struct[1])
    stretches = rows.of(seq)
    if stretches is not None and type(i) is int and i >= 0:
        return rows.has_index(stretches, i)
    if type(seq) is Batch and type(seq.items) is rows.Listed and type(i) is int and i >= 0:
        return rows.listed_has_index(seq.items, i)
    ranges = of(seq) if type(seq) is Batch and type(i) is int and i >= 0 else None
    if ranges is None:
        return _list_has_index(seq, i)
    if i < ranges.shortest:
        return True
    if i >= ranges.longest:
        return False
    return bt.from_tensor(ranges.counts > i)


def _list_has_index(seq, i):
    """Whether each instance's own list, tuple or str (a Batch's items) has an item at the shared position i: one answer
    where all agree."""
    lists = seq.items if type(seq) is Batch and seq.owner == "items" and seq.thunk is None else None
    if lists is None or type(i) is not int or i < 0 or not all(type(x) in _SEQUENCES for x in lists):
        return NotImplemented
    found = [i < len(x) for x in lists]
    return found[0] if all(f is found[0] for f in found) else bt.from_tensor(torch.tensor(found))


def _built(seq):
    """A Batch of a tuple or list the program built, held as its elements (``[h * 2 for h in (x, y)]``)."""
    return type(seq) is Batch and seq.struct is not None and seq.owner is None and seq.thunk is None \
        and seq.struct[0] in (tuple, list)


def item(seq, i):
    """``seq[i]`` of a batch of ranges at the shared position i where every range has an item there: one shared
    int where every range starts and steps alike, else each instance's int (``range(start[i], start[i + 1])``);
    NotImplemented otherwise (each instance then indexes its own)."""
    ranges = of(seq)
    if ranges is None or not 0 <= i < ranges.shortest:
        return NotImplemented
    if ranges.start is None:
        return bt.from_items([r[i] for r in ranges])
    return ranges.start + i * ranges.step


def items(seq, positions):
    """Each instance's ``seq[i]`` at its own position i (a batch of ranges): their ints, as Python indexes."""
    found = of(seq)
    if found is None:
        return NotImplemented
    try:
        return bt.from_items([r[i] for r, i in zip(found, positions)])
    except IndexError:
        return NotImplemented  # (each instance raises its own, as Python would)


# -- how many steps a counting loop takes


def counter_values(n, value):
    """Each instance's Python int of a loop's counter ``value`` (an int, or an integer tensor of one element:
    ``t = n - 1`` of a length ``n``), or None."""
    if counter_dtype(value) is not None:
        t = bt.tensor_of(value) if type(value) is Batch else value
        return t.reshape(-1).tolist() if type(value) is Batch else [int(t)] * n
    items = bt.items_of(value) if type(value) is Batch else [value] * n
    return items if all(type(v) is int for v in items) else None


def counter_dtype(value):
    """The dtype of a counter held as integer tensors of one element each (0-d), or None."""
    t = bt.tensor_of(value) if type(value) is Batch and value.owner != "items" else \
        value if type(value) is torch.Tensor else None
    if t is None or t.dtype not in facts.INTEGER_INDEX or t.dim() != (1 if type(value) is Batch else 0):
        return None
    return t.dtype


def counter_like(value, counts):
    """Counter values ``counts`` (ints, one per instance) in the form of counter ``value``: Python ints, or
    integer tensors of its dtype and device."""
    dtype = counter_dtype(value)
    if dtype is None:
        return counts[0] if len(counts) == 1 else bt.from_items(counts)
    t = torch.tensor(counts, dtype=dtype, device=(bt.tensor_of(value) if type(value) is Batch else value).device)
    return bt.from_tensor(t)


def direction(kind):
    """How a counting loop's counter moves (``trip_counts``): up by 1, or down by 1 for ``>`` and ``>=``."""
    return -1 if kind in ("gt", "ge") else 1


def trip_counts(n, starts, kind, end):
    """Each instance's number of steps of a loop whose counter goes by 1 from ``starts`` (``counter_values``):
    up while ``counter < end`` (kind ``"lt"``), while a ``for`` over the range ``end`` has an item at it
    (``"range"``) or one over ``zip(*end)`` has (``"zip"``), down while ``counter > end`` (``"gt"``) or
    ``counter >= end`` (``"ge"``), as Python's test would count them; None where that is not known here."""
    if starts is None:
        return None
    if kind in ("range", "zip"):
        # (``zip``: a ``for`` over several sequences at once, ``for h, c in zip(hs, cs)``, as long as the shortest)
        found = [_lengths(n, seq) for seq in (end if kind == "zip" else (end,))]
        if any(each is None for each in found) or min(starts) < 0:
            return None
        lengths = [min(each) for each in zip(*found)]
        return [max(0, length - s) for length, s in zip(lengths, starts)]
    ends = _numbers(n, end)
    if ends is None or not all(type(e) is int or math.isfinite(e) for e in ends):
        return None
    if kind == "lt":
        return [max(0, math.ceil(e - s)) for e, s in zip(ends, starts)]
    if kind == "gt":
        return [max(0, math.ceil(s - e)) for e, s in zip(ends, starts)]
    return [max(0, math.floor(s - e) + 1) for e, s in zip(ends, starts)]


def _lengths(n, seq):
    """Each instance's length of what a ``for`` iterates: a range, a tensor's rows, each instance's own range,
    rows, stretch of rows, list or tuple; None where that is not known here."""
    if type(seq) in (range, list, tuple) or (type(seq) is torch.Tensor and seq.dim()):
        return [len(seq)] * n  # (one every instance shares)
    if type(seq) is not Batch:
        return None
    if seq.owner == "tensor":
        return [seq.tensor.shape[1]] * n if seq.tensor.dim() >= 2 else None
    found = rows.of(seq) or of(seq)
    if found is not None:
        return found.lengths
    return [len(x) for x in seq.items] if own_sequences(seq) else None


def _numbers(n, value):
    """Each instance's Python number of ``value`` (an int, a float, a tensor of one real number), or None."""
    if type(value) is Batch:
        t = bt.tensor_of(value)
        if t is not None:
            if t.numel() != n or t.is_complex() or t.dtype is torch.bool:
                return None
            return t.reshape(n).tolist()
        items = bt.items_of(value)
    else:
        if type(value) is torch.Tensor:
            if value.numel() != 1 or value.is_complex() or value.dtype is torch.bool:
                return None
            value = value.item()
        items = [value] * n
    return items if all(type(v) in (int, float) for v in items) else None
