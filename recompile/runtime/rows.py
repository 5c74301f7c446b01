"""Each instance's own stretch of one batched tensor's rows (``words[:n]``, ``xs[a:b]``), batched.

``x[:n]`` where n differs per instance gives each instance a view of its own length: no one tensor holds them.
Held one by one, a ``for w in words[:n]`` would test and read them once per instance at every step. ``Rows`` is
the list of those views (each instance's value, the very view eager code makes) that also keeps where they lie
in the one tensor: item t of every instance is then one index of it, the loop's test one comparison of lengths,
an ``nn.Embedding`` of them one lookup, and a recurrent loop (``codegen.recurrent``) reads every step's rows at
once.
"""

from __future__ import annotations

import torch
from torch import nn

from . import batch as bt
from . import sharing
from .batch import Batch


class Rows(list):
    """Instance k's value is ``source[row k][starts[k]:starts[k] + lengths[k]]`` (the list holds those views)."""

    __slots__ = ("source", "rows", "starts", "lengths", "shortest", "longest", "_counts")

    def __init__(self, views, source, rows, starts, lengths):
        super().__init__(views)
        self.source = source  # a tensor whose dim 0 is the rows the instances' stretches lie in
        self.rows = rows  # each instance's row of ``source``, or None: instance k's is row k
        self.starts, self.lengths = starts, lengths
        self.shortest, self.longest = min(lengths), max(lengths)
        self._counts = None

    def taken(self, positions):
        """The Rows of instances ``positions`` (a loop's instances that stay, a side of a branch)."""
        rows = list(positions) if self.rows is None else [self.rows[k] for k in positions]
        return Rows([self[k] for k in positions], self.source, rows, [self.starts[k] for k in positions],
                    [self.lengths[k] for k in positions])

    def counts(self):
        """The lengths as a tensor (a loop's test where some instances end: one comparison)."""
        if self._counts is None:
            self._counts = torch.tensor(self.lengths)
        return self._counts

    def row_index(self, device):
        """Each instance's row of ``source`` as a LongTensor."""
        return torch.tensor(range(len(self)) if self.rows is None else self.rows, device=device)


def of(value):
    """The Rows a Batch holds as its instances' values, in a run that changes nothing in place (elsewhere a view's
    shape or values may have changed since: ``ys.unsqueeze_(0)``), else None."""
    items = value.items if type(value) is Batch else None
    return items if type(items) is Rows and value.owner == "items" and value.thunk is None and \
        sharing.state.fresh else None


def slices(n, fn, args, kwargs):
    """``slice(a, b)`` where a bound differs per instance: each instance's slice, its bounds Python ints where
    they are integer tensors (one host read; an index reads them as ints either way)."""
    if kwargs or not 1 <= len(args) <= 3:
        return NotImplemented
    return bt.from_items([slice(*row) for row in zip(*[_ints(n, a) for a in args])])


def _ints(n, value):
    """Each instance's value of ``value``: Python ints for a batch of integer tensors of one element."""
    if type(value) is not Batch:
        return [value] * n
    t = bt.tensor_of(value)
    if t is not None and t.dim() == 1 and not (t.is_floating_point() or t.is_complex() or t.dtype is torch.bool):
        return t.tolist()
    return bt.items_of(value)


def stretch(n, x, index):
    """``x[s]`` with a slice s per instance (a Batch of slices), step 1, of a batched tensor's rows or a shared
    tensor's: the views, as Rows; NotImplemented otherwise (each instance then slices its own)."""
    if index.owner != "items" or not all(type(s) is slice for s in index.items):
        return NotImplemented
    if type(x) is Batch:
        if x.owner != "tensor" or x.tensor.dim() < 2 or x.thunk is not None:
            return NotImplemented
        source, rows, length = x.tensor, None, x.tensor.shape[1]
    elif type(x) is torch.Tensor and x.dim() >= 1:
        source, rows, length = x.unsqueeze(0), [0] * n, x.shape[0]
    else:
        return NotImplemented
    starts, lengths = [], []
    for s in index.items:
        try:
            start, stop, step = s.indices(length)
        except TypeError:  # (a bound that is not an index: each instance raises its own)
            return NotImplemented
        if step != 1:
            return NotImplemented
        starts.append(start)
        lengths.append(max(0, stop - start))
    views = [x[s] for s in index.items] if rows is not None else \
        [source[k, a:a + m] for k, (a, m) in enumerate(zip(starts, lengths))]
    return Batch(n, items=Rows(views, source, rows, starts, lengths))


def has_index(seq, i):
    """Whether each instance's stretch has an item at the shared position i (≥ 0)."""
    if i < seq.shortest:
        return True
    if i >= seq.longest:
        return False
    return bt.from_tensor(seq.counts() > i)


def item(seq, i):
    """``seq[i]`` of every instance at the shared position i where each has one: a view of the rows where the
    stretches start alike in the source's own rows, else a copy of them (one index); NotImplemented otherwise
    (each instance reads its own view, or raises)."""
    if not 0 <= i < seq.shortest:
        return NotImplemented
    first = seq.starts[0]
    if seq.rows is None and all(a == first for a in seq.starts):
        return bt.from_tensor(seq.source[:, first + i])
    device = seq.source.device
    return bt.from_tensor(seq.source[seq.row_index(device), torch.tensor(seq.starts, device=device) + i])


def items_at(seq, instances, steps):
    """``seq[t]`` for rows of (instance, t) at once (a recurrent loop's steps run ahead, which changes nothing
    in place): one index of the source, a copy; a negative t counts from the end of the instance's stretch. An
    IndexError where a t lies outside its stretch (the written loop then raises it at its step)."""
    which = torch.tensor(instances)
    at = torch.tensor(steps)
    lengths = torch.tensor(seq.lengths)[which]
    if bool(((at >= lengths) | (at < -lengths)).any()):
        raise IndexError("an item outside an instance's stretch of rows")
    at = torch.where(at < 0, at + lengths, at) + torch.tensor(seq.starts)[which]
    device = seq.source.device
    return bt.from_tensor(seq.source[seq.row_index(device)[which.to(device)], at.to(device)])


def embedded(module, seq, lookup):
    """An ``nn.Embedding`` of each instance's stretch of indices: one ``lookup`` of the rows they lie in, whose
    stretches are the instances' results (Rows); None where the module's options make a lookup of rows no
    instance reads differ from none (a norm renormalising the rows it reads, gradients scaled by counts, sparse
    gradients) or the lookup fails (an index out of range: each instance then raises its own, or not)."""
    if type(module) is not nn.Embedding or module.max_norm is not None or module.scale_grad_by_freq \
            or module.sparse:
        return None
    end = max(a + m for a, m in zip(seq.starts, seq.lengths))
    source = seq.source if seq.rows is None else seq.source[seq.row_index(seq.source.device)]
    source = source[:, :end]
    if not source.is_cpu and not bool(((source >= 0) & (source < module.num_embeddings)).all()):
        return None  # (on a device an index out of the table is an assert there, not an error to catch)
    try:
        out = lookup(module, source)
    except (IndexError, RuntimeError):
        return None
    views = [out[k, a:a + m] for k, (a, m) in enumerate(zip(seq.starts, seq.lengths))]
    return Batch(len(seq), items=Rows(views, out, None, seq.starts, seq.lengths))
