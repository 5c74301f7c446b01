"""Each instance's own stretch of one batched tensor's rows (``words[:n]``, ``xs[a:b]``), batched.

``x[:n]`` where n differs per instance gives each instance a view of its own length: no one tensor holds them.
Held one by one, a ``for w in words[:n]`` would test and read them once per instance at every step. ``Rows`` is
the list of those views (each instance's value, the very view eager code makes) that also keeps where they lie
in the one tensor: item t of every instance is then one index of it, the loop's test one comparison of lengths,
an ``nn.Embedding`` of them one lookup, and a recurrent loop (``codegen.recurrent``) reads every step's rows at
once. The views are made only when something reads them (``Rows.fill``, through a lazy batch: ``bt.Views``):
a chain of ops on the rows (``self.out(self.lstm(self.embed(words[:n]))[0])``) reads where they lie and makes
none.
"""

from __future__ import annotations

import operator
import warnings
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from . import batch as bt
from . import lazy_weights, sharing, spreads
from .batch import Batch


class Rows(list):
    """Instance k's value is ``source[row k][starts[k]:starts[k] + lengths[k]]`` (the list holds those views, once
    ``fill`` made them: until then, None for each)."""

    __slots__ = ("source", "rows", "starts", "lengths", "shortest", "longest", "made", "_layout", "packed", "_at",
                 "_alike", "versions")

    def __init__(self, views, source, rows, starts, lengths):
        super().__init__([None] * len(lengths) if views is None else views)
        self.made = views is not None
        self.source = source  # a tensor whose dim 0 is the rows the instances' stretches lie in
        self.rows = rows  # each instance's row of ``source``, or None: instance k's is row k
        self.starts, self.lengths = starts, lengths
        self.shortest, self.longest = min(lengths), max(lengths)
        self._layout = self._at = self._alike = None
        self.packed = None  # the stretches end to end, once ``row_wise.packed`` made them
        # (Rows of each instance's own tensors, ``_ragged``: their versions when the source was copied from them)
        self.versions = None

    def fill(self):
        """Make each instance's view (where they are not made yet): the views eager indexing makes."""
        if not self.made:
            source, starts, lengths = self.source, self.starts, self.lengths
            if self.packed is not None and self.rows is not None and source.shape[0] == 1 and \
                    starts == offsets(lengths):  # (an op's rows laid end to end, as ``packed_rows`` made them)
                self[:] = source[0, :starts[-1] + lengths[-1]].split(lengths)
            else:
                rows = range(len(lengths)) if self.rows is None else self.rows
                self[:] = [source[k, a:a + m] for k, a, m in zip(rows, starts, lengths)]
            self.made = True
        return self

    def taken(self, positions):
        """The Rows of instances ``positions`` (a loop's instances that stay, a side of a branch). The first
        instances of Rows in their own rows keep them so (a view of the source's first rows, read at every step
        of a loop the longest first)."""
        if type(positions) is range and positions.start == 0 and positions.step == 1:
            k = len(positions)
            views = self[:k] if self.made else None
            if self.rows is None:
                first = Rows(views, self.source[:k], None, self.starts[:k], self.lengths[:k])
            else:
                first = Rows(views, self.source, self.rows[:k], self.starts[:k], self.lengths[:k])
                first._at = None if self._at is None else (self._at[0][:k], self._at[1][:k])
            first.versions = None if self.versions is None else self.versions[:k]
            return first
        rows = list(positions) if self.rows is None else [self.rows[k] for k in positions]
        taken = Rows([self[k] for k in positions] if self.made else None, self.source, rows,
                     [self.starts[k] for k in positions], [self.lengths[k] for k in positions])
        taken.versions = None if self.versions is None else [self.versions[k] for k in positions]
        return taken

    def layout(self):
        """The tensors of the lengths, shared by every Rows of the same lengths (``Layout``)."""
        if self._layout is None:
            self._layout = layout_of(self.lengths)
        return self._layout

    def counts(self):
        """The lengths as a tensor (a loop's test where some instances end: one comparison)."""
        return self.layout().counts

    def mask(self, device):
        """(n, longest) bools: which of the first ``longest`` rows from each stretch's start are in it."""
        return self.layout().mask(device)

    def where(self, device):
        """(k, i) LongTensors: for each row of the stretches laid end to end, its instance and its place in its
        stretch (what a padded (n, longest) tensor's rows are at)."""
        return self.layout().where(device)

    def same_layout(self, other):
        """Share ``other``'s tensors of the lengths (Rows of the same lengths), without looking them up."""
        self._layout = other._layout

    def row_index(self, device):
        """Each instance's row of ``source`` as a LongTensor."""
        return self._places(device)[0]

    def alike(self):
        """Whether every stretch starts at the same place of its row."""
        if self._alike is None:
            first = self.starts[0]
            self._alike = all(a == first for a in self.starts)
        return self._alike

    def start_index(self, device):
        """Each instance's start in its row as a LongTensor."""
        return self._places(device)[1]

    def _places(self, device):
        if self._at is None or self._at[0].device != device:  # (read at every step of a loop over the rows)
            self._at = (bt.long_tensor(range(len(self)) if self.rows is None else self.rows, device),
                        bt.long_tensor(self.starts, device))
        return self._at


class Layout:
    """Index tensors of one list of lengths, each made once: the minibatch's Rows of one sentence length each
    (the words, their embeddings, an RNN's outputs, the tags) share them, within a run and across runs. Made
    outside inference mode, which a later run with grad could not save for its backward."""

    __slots__ = ("lengths", "counts", "_masks", "_wheres", "_offsets")

    def __init__(self, lengths):
        self.lengths = lengths
        with torch.inference_mode(False):
            self.counts = bt.long_tensor(lengths)
        self._masks, self._wheres, self._offsets = {}, {}, None

    def offsets(self):
        """Where each stretch starts, laid end to end (a list: Rows' starts, which no one changes)."""
        if self._offsets is None:
            self._offsets = offsets(self.lengths)
        return self._offsets

    def mask(self, device):
        found = self._masks.get(device)
        if found is None:
            with torch.inference_mode(False):
                found = self._masks[device] = (torch.arange(max(self.lengths)) < self.counts[:, None]).to(device)
        return found

    def where(self, device):
        found = self._wheres.get(device)
        if found is None:
            with torch.inference_mode(False):
                k, i = spread(self.counts)
                found = self._wheres[device] = (k.to(device), i.to(device))
        return found


_LAYOUTS = {}  # tuple of lengths -> Layout: a few kept (a training loop's minibatches differ; its evaluation's repeat)


def layout_of(lengths):
    """The Layout of ``lengths`` (a list of ints)."""
    key = tuple(lengths)
    found = _LAYOUTS.get(key)
    if found is None:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.clear()
        found = _LAYOUTS[key] = Layout(key)
    return found


def gather_rows(source, rows, places):
    """``source[rows, places]`` (index tensors of one shape, on ``source``'s device; each place in
    ``[0, source.shape[1])``, which the caller checked: a flat index past a row's end reads the next row): one
    ``index_select`` of its first two dims flattened where that is a view (several times faster on the CPU than
    two indices), else the indexing itself. A copy either way."""
    if source.dim() >= 2 and source.stride(0) == source.shape[1] * source.stride(1):
        flat = rows * source.shape[1] + places
        return source.flatten(0, 1).index_select(0, flat.reshape(-1)).view(*flat.shape, *source.shape[2:])
    return source[rows, places]


def of(value):
    """The Rows a Batch holds as its instances' values (their views made or not: ``Rows.fill``), in a run that
    changes nothing in place (elsewhere a view's shape or values may have changed since: ``ys.unsqueeze_(0)``),
    else None. Each instance's own tensor of a length of its own (``recompile.map`` over sequences) is read as
    Rows too."""
    found = bt.held(value, Rows)
    if found is None and type(value) is Batch and value.thunk is None and sharing.state.fresh:
        if joined(value):
            # (a branch's stretches joined with the other side's tensors: ``child_h`` a leaf's (1, H) zeros or the
            # children's ``torch.cat``, as treelstm.pytorch writes it) one padded tensor of the pieces
            found = _joined_rows(value)
            if found is not None:
                value.thunk, value.pieces = bt.Views(found, True), None  # (the same values, held as Rows)
                return found
            bt.items_of(value)  # (else each instance's value its own, then Rows of them)
            value.owner = "items"  # (nothing changes in place here: the views are as true as the pieces)
        if type(value.items) is list and value.owner == "items":
            found = _ragged(value)
    return found


def _joined_rows(value):
    """The Rows of the pieces ``value`` joins (``joined``): each piece's rows (a batch's tensor, a shared tensor's
    for each of its instances, a stretch's padded rows with zeros past its end) padded with zeros to the longest,
    put in instance order by one index. None where the pieces differ in dtype, device or the rest of their
    shape."""
    pieces, order = value.pieces
    parts, lengths = [], []
    for v, count in pieces:
        seq = bt.held(v, Rows)
        if seq is not None:
            padded = as_padded(seq)
            mask = seq.mask(padded.device).view(*padded.shape[:2], *[1] * (padded.dim() - 2))
            parts.append(torch.where(mask, padded, padded.new_zeros(())))
            lengths.extend(seq.lengths)
            continue
        t = v.tensor if type(v) is Batch else v.expand(count, *v.shape)
        parts.append(t)
        lengths.extend([t.shape[1]] * count)
    rest = {(p.shape[2:], p.dtype, p.device) for p in parts}
    if len(rest) != 1:
        return None
    longest = max(lengths)
    side_by_side = torch.cat([F.pad(p, (0, 0) * (p.dim() - 2) + (0, longest - p.shape[1])) for p in parts])
    inverse = order.inverse(side_by_side.device)
    return padded_rows(value.n, side_by_side.index_select(0, inverse), [lengths[k] for k in inverse.tolist()])


def _ragged(value):
    """The Rows of Batch ``value`` whose items are (strided) tensors of one dtype, device and shape but dim 0,
    not all as long: the instances' own tensors, kept as their values, and a zero-padded copy of them as the
    source the rules read (from which a gradient reaches them), with their versions (a helper run per instance
    may change one in place: ``forget_stale_copy``). None for other items."""
    items = value.items
    if type(items[0]) not in bt.PLAIN_TENSORS:  # (at once: asked of every batch of items a rule reads)
        return None
    if not all(type(t) in bt.PLAIN_TENSORS and t.dim() and t.layout is torch.strided and not t.is_quantized
               for t in items) or not bt.same_kind(items, 1):
        return None
    lengths = [t.shape[0] for t in items]
    if min(lengths) == max(lengths):
        return None  # (one tensor holds them: ``tensor_of``)
    try:
        padded = torch.nn.utils.rnn.pad_sequence(items, batch_first=True)
    except RuntimeError:
        return None
    found = padded_rows(value.n, padded, lengths)
    found[:] = items
    found.made = True
    found.versions = [None if t.is_inference() else t._version for t in items]
    value.items = found
    return found


def forget_stale_copy(value):
    """After an op ran per instance on Batch ``value`` (a helper may change each instance's tensor in place):
    where it holds Rows of the instances' own tensors (``_ragged``) one of which changed since their copy was
    made, their plain list again (``of`` copies them again when next read)."""
    found = value.items
    if type(found) is Rows and found.versions is not None and any(
            version is not None and t._version != version for t, version in zip(found, found.versions)):
        value.items = list(found)


def holds(value):
    """Whether ``value`` is a batch of Rows (their views made or not), or of stretches a branch joined (``joined``)."""
    return bt.holds(value, Rows) or joined(value)


def joined(value):
    """Whether Batch ``value`` is the pieces a branch or loop joined, stretches of each instance's own length: one
    of them Rows, or tensors whose instances differ in length alone (a leaf's (1, H) zeros, two children's
    (2, H)); ``of`` reads them as Rows."""
    if not (type(value) is Batch and value.owner is None and value.pieces is not None and value.struct is None
            and value.thunk is None):
        return False
    shapes = set()
    for v, _ in value.pieces[0]:
        if bt.holds(v, Rows):
            return True
        t = v.tensor if type(v) is Batch and v.owner == "tensor" else v if type(v) in bt.PLAIN_TENSORS else None
        if t is None:
            return False
        shapes.add(t.shape[1:] if type(v) is Batch else t.shape)
    return len(shapes) > 1 and len({(len(shape), shape[1:]) for shape in shapes}) == 1 and all(shapes)


def batch(n, found):
    """The Batch of Rows ``found``: its views made when something first reads them, in a run that changes
    nothing in place (else now: a view made later would see a shape changed in place since)."""
    if found.made or not sharing.state.fresh:
        return Batch(n, items=found.fill())
    return Batch(n, thunk=bt.Views(found, found.shortest != found.longest))


def slices(n, fn, args, kwargs):
    """``slice(a, b)`` where a bound differs per instance: each instance's slice, its bounds Python ints where
    they are integer tensors (one host read; an index reads them as ints either way)."""
    if kwargs or not 1 <= len(args) <= 3:
        return NotImplemented
    return bt.from_items([slice(*row) for row in zip(*[bt.instance_ints(n, a) for a in args])])


def stretch(n, x, index):
    """``x[s]`` with a slice s per instance (a Batch of slices), step 1, of a batched tensor's rows, a shared
    tensor's or each instance's stretch (``of``): the views, as Rows; NotImplemented otherwise (each instance
    then slices its own)."""
    if index.owner != "items" or not all(type(s) is slice for s in index.items):
        return NotImplemented
    found = of(x) if type(x) is Batch and x.owner != "tensor" else None
    if found is not None:  # (``words[t:t + 1]`` of each instance's own sequence: within its stretch)
        source, rows, offsets, lengths_of = found.source, found.rows, found.starts, found.lengths
    elif type(x) is Batch:
        if x.owner != "tensor" or x.tensor.dim() < 2 or x.thunk is not None:
            return NotImplemented
        source, rows, offsets, lengths_of = x.tensor, None, [0] * n, [x.tensor.shape[1]] * n
    elif type(x) is torch.Tensor and x.dim() >= 1:
        source, rows, offsets, lengths_of = x.unsqueeze(0), [0] * n, [0] * n, [x.shape[0]] * n
    else:
        return NotImplemented
    starts, lengths = [], []
    for s, offset, length in zip(index.items, offsets, lengths_of):
        try:
            start, stop, step = s.indices(length)
        except TypeError:  # (a bound that is not an index: each instance raises its own)
            return NotImplemented
        if step != 1:
            return NotImplemented
        starts.append(offset + start)
        lengths.append(max(0, stop - start))
    return batch(n, Rows(None, source, rows, starts, lengths))


def sliced(n, seq, s):
    """``x[s]`` of each instance's stretch with a slice every instance shares (``states[-2:]``), step 1: each
    instance's view of it, kept as Rows of the same source; NotImplemented for other steps."""
    try:
        bounds = [s.indices(m) for m in seq.lengths]
    except TypeError:  # (a bound that is not an index: each instance raises its own)
        return NotImplemented
    if any(step != 1 for _, _, step in bounds):
        return NotImplemented
    return batch(n, Rows(None, seq.source, seq.rows, [a + start for a, (start, _, _) in zip(seq.starts, bounds)],
                         [max(0, stop - start) for start, stop, _ in bounds]))


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
    if seq.rows is None and seq.alike():
        return bt.from_tensor(seq.source[:, seq.starts[0] + i])
    device = seq.source.device
    if seq.source.shape[0] == 1:  # (laid end to end in one row: one index_select, cheaper than two indices)
        return bt.from_tensor(seq.source[0].index_select(0, seq.start_index(device) + i))
    return bt.from_tensor(gather_rows(seq.source, seq.row_index(device), seq.start_index(device) + i))


def counted(places, lengths):
    """Integer tensor ``places`` in stretches of ``lengths`` (a tensor, or one int for all), a negative place
    counted from its stretch's end, as Python indexes; None where one lies outside its stretch."""
    if bool(((places >= lengths) | (places < -lengths)).any()):
        return None
    return torch.where(places < 0, places + lengths, places)


def item_each(seq, index):
    """``xs[i]`` with an int i per instance (``xs[len(xs) - 1]``, ``xs[n // 2]``), Python ints or 0-d integer
    tensors: each instance's row, one index of the source (a copy, in a run that changes nothing in place);
    NotImplemented where an i is no index of its stretch (each instance raises its own) or is not an int."""
    at = bt.instance_index(index)
    if at is None or len(at) != len(seq):
        return NotImplemented
    at = counted(at, seq.counts())
    if at is None:
        return NotImplemented
    device = seq.source.device
    place = (at + seq.start_index(torch.device("cpu"))).to(device)
    return bt.from_tensor(gather_rows(seq.source, seq.row_index(device), place))


def items_at(seq, instances, steps):
    """``seq[t]`` for rows of (instance, t) at once (a recurrent loop's steps run ahead, which changes nothing
    in place): one index of the source, a copy; a negative t counts from the end of the instance's stretch. An
    IndexError where a t lies outside its stretch (the written loop then raises it at its step)."""
    which = instances if type(instances) is torch.Tensor else bt.long_tensor(instances)
    places = counted(bt.long_tensor(steps), seq.counts()[which])
    if places is None:
        raise IndexError("an item outside an instance's stretch of rows")
    steps = places + seq.start_index(torch.device("cpu"))[which]
    device = seq.source.device
    return bt.from_tensor(gather_rows(seq.source, seq.row_index(device)[which.to(device)], steps.to(device)))


def embedded(module, seq, lookup):
    """An ``nn.Embedding`` of each instance's stretch of indices: one ``lookup`` of the rows they lie in, whose
    stretches are the instances' results (Rows); with sparse gradients, of the stretches' indices alone, laid end
    to end (a sparse gradient has a row for each index read); None where the module's options make a lookup of
    rows no instance reads differ from none (a norm renormalising the rows it reads, gradients scaled by counts)
    or the lookup fails (an index out of range: each instance then raises its own, or not)."""
    if type(module) is not nn.Embedding or module.max_norm is not None or module.scale_grad_by_freq:
        return None
    if module.sparse:
        device = seq.source.device
        k, i = seq.where(device)
        source = gather_rows(seq.source, seq.row_index(device)[k], seq.start_index(device)[k] + i)
    else:
        end = max(a + m for a, m in zip(seq.starts, seq.lengths))
        source = seq.source if seq.rows is None else seq.source[seq.row_index(seq.source.device)]
        source = source[:, :end]
    if not source.is_cpu and not bool(((source >= 0) & (source < module.num_embeddings)).all()):
        return None  # (on a device an index out of the table is an assert there, not an error to catch)
    try:
        out = lookup(module, source)
    except (IndexError, RuntimeError):
        return None
    if module.sparse:
        return batch(len(seq), packed_rows(len(seq), out, seq.lengths, seq))
    return batch(len(seq), Rows(None, out, None, seq.starts, seq.lengths))


def stacked(n, seqs, args, kwargs):
    """``torch.stack(xs)`` of each instance's own list of tensors of one shape, of a length of its own
    (``hs.append(h)`` in a loop), in a run that changes nothing in place: one stack of every instance's tensors,
    laid out in one tensor padded with zeros, whose stretches are the instances' results (Rows); one tensor of
    them where every list is as long."""
    if not sharing.state.fresh or len(args) > 2 or set(kwargs) - {"dim"} or \
            not _dim_zero(kwargs.get("dim", args[1] if len(args) > 1 else 0)):
        if type(seqs.items) is Appended:
            seqs.items.fill()
        return NotImplemented
    lists = bt.items_of(seqs)
    if type(lists) is Appended and lists.pending and not (lists.holds_its_rows_alone() and all(lists.lengths)):
        lists.fill()  # (what the stack of each instance's own list needs)
    if type(lists) is Appended and lists.holds_its_rows_alone() and all(lists.lengths):
        data, instance, position, lengths = lists.packed, lists.instance, lists.step, lists.lengths
    else:
        if not all(type(s) in (list, tuple) and s for s in lists):
            return NotImplemented  # (an empty one: its instance raises, as torch.stack does)
        lengths = [len(s) for s in lists]
        flat = [t for s in lists for t in s]
        if not all(type(t) is torch.Tensor for t in flat) or not bt.same_kind(flat, 0):
            return NotImplemented
        data = torch.stack(flat)
        instance, position = spread(bt.long_tensor(lengths))
    longest = max(lengths)
    if min(lengths) == longest and type(lists) is not Appended:
        return bt.from_tensor(data.view(n, longest, *data.shape[1:]))
    device = data.device
    padded = data.new_zeros(n, longest, *data.shape[1:]).index_put((instance.to(device), position.to(device)), data)
    return batch(n, padded_rows(n, padded, lengths))


def concatenated(n, seqs, args, kwargs):
    """``torch.cat(xs)`` (along dim 0) of each instance's own list of tensors of one shape but dim 0, of a length
    of its own (``outs.append(h.unsqueeze(0))`` in a loop), in a run that changes nothing in place: one cat of every
    instance's tensors, each instance's result its stretch of it (Rows, laid end to end)."""
    if not sharing.state.fresh or len(args) > 2 or set(kwargs) - {"dim"} or \
            not _dim_zero(kwargs.get("dim", args[1] if len(args) > 1 else 0)):
        return NotImplemented
    lists = bt.items_of(seqs)
    if type(lists) is Appended:
        lists.fill()
    if not all(type(s) in (list, tuple) and s for s in lists):
        return NotImplemented  # (an empty one: its instance raises, as torch.cat does)
    flat = [t for s in lists for t in s]
    if not all(type(t) in bt.PLAIN_TENSORS and t.dim() for t in flat) or not bt.same_kind(flat, 1):
        return NotImplemented  # (a learned row among them, an nn.Parameter, is a tensor too)
    return batch(n, packed_rows(n, torch.cat(flat), [sum(t.shape[0] for t in s) for s in lists]))


def _dim_zero(dim):
    """Whether a join's ``dim`` is the int 0 (not ``0.0`` or ``False``, which torch refuses)."""
    return type(dim) is int and dim == 0


def padded_rows(n, padded, lengths):
    """The Rows whose instance k's value is the first ``lengths[k]`` rows of ``padded``'s row k (views not made)."""
    return Rows(None, padded, None, [0] * n, list(lengths))


def rows_reshaped(n, seq, rest, method="view"):
    """Each instance's stretch with each row reshaped to ``rest`` (``xs.view(n, 1, -1)``): the source's rows
    reshaped alike (and the rows laid end to end, where they are), views where ``method`` is ``view``; None where
    the source does not take it."""
    try:
        source = getattr(seq.source, method)(*seq.source.shape[:2], *rest)
        flat = getattr(seq.packed, method)(seq.packed.shape[0], *rest) if seq.packed is not None else None
    except RuntimeError:  # (a view of memory laid out otherwise)
        return None
    out = Rows(None, source, seq.rows, seq.starts, seq.lengths)
    out.packed = flat
    out.same_layout(seq)
    return batch(n, out)


def spread(counts):
    """(k, i) LongTensors of stretches of ``counts`` rows laid end to end: each row's instance, and its place in
    its stretch."""
    k = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return k, torch.arange(len(k)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)


def offsets(lengths):
    """Where each of stretches of ``lengths`` laid end to end starts."""
    out, at = [], 0
    for m in lengths:
        out.append(at)
        at += m
    return out


def packed_rows(n, flat, lengths, like=None):
    """The Rows of stretches of ``lengths`` laid end to end in ``flat``'s rows (views not made); with ``like``,
    Rows of the same lengths, its layout shared."""
    layout = like.layout() if like is not None else layout_of(lengths)
    found = Rows(None, flat.unsqueeze(0), [0] * n, layout.offsets(), lengths)
    found.packed = flat
    found._layout = layout
    return found


class Appended(list):
    """Each instance's list (a Batch's items) that a loop run as one RNN (``codegen.recurrent``) appended each
    step's state to, starting empty: the lists hold rows of one packed tensor of states, and while they hold
    those alone, ``torch.stack`` of them is one index of it (``stacked``). Where the program reads the lists
    only by that stack (``recurrent.plan``), the rows are not put in them until something else needs them
    (``pending``, ``fill``): a Python append per row, and the views, cost more than the steps without grad."""

    __slots__ = ("packed", "instance", "step", "lengths", "pending", "_held_rows", "_where")

    def __init__(self, lists, packed, instance, step, lengths, pending=False):
        super().__init__(lists)
        self.packed = packed  # the states, a row each, in the loop's packed order
        self.instance, self.step = instance, step  # each row's instance and step (LongTensors)
        self.lengths = lengths  # each instance's number of rows
        self.pending = pending  # the rows not in the lists yet
        self._held_rows = None if pending else _held(self)
        self._where = None

    def rows_at(self, instances, steps):
        """The rows of item ``steps[r]`` of instance ``instances[r]``'s list for each r, while the lists hold their
        rows alone: the packed rows themselves where they are those, in that order (a loop over the lists laid
        out as the loop that appended them), else one index of them; None where an item is not there."""
        if self._where is None:
            order = list(zip(self.instance.tolist(), self.step.tolist()))
            self._where = (order, {pair: r for r, pair in enumerate(order)})
        order, where = self._where
        wanted = list(zip(instances, steps))
        if wanted == order:
            return self.packed
        index = [where.get(pair) for pair in wanted]
        if None in index:
            return None
        return self.packed.index_select(0, torch.tensor(index, device=self.packed.device))

    def fill(self):
        """Put the rows in the lists, each instance's in step order (where they are pending)."""
        if self.pending:
            states = self.packed.unbind(0)
            for r, k in enumerate(self.instance.tolist()):
                self[k].append(states[r])
            self.pending = False
            self._held_rows = _held(self)

    def taken(self, positions):
        """The lists of instances ``positions`` (a side of a branch), the same list objects: an Appended of their
        rows where the lists still hold those alone, else a plain list of them."""
        positions = list(positions)
        self.fill()  # (the rows in the lists: the two Appended could not each put them there)
        lists = [self[k] for k in positions]
        if not any(self.lengths[k] for k in positions) or not self.holds_its_rows_alone():
            return lists  # (no rows among them: a leaf's empty lists)
        device = self.instance.device
        new = torch.full((len(self),), -1, dtype=torch.long, device=device)  # (each instance's place among them)
        new[torch.tensor(positions, device=device)] = torch.arange(len(positions), device=device)
        instance = new[self.instance]
        kept = (instance >= 0).nonzero().squeeze(1)
        return Appended(lists, self.packed.index_select(0, kept.to(self.packed.device)), instance[kept],
                        self.step[kept], [self.lengths[k] for k in positions])

    def holds_its_rows_alone(self):
        """Whether each list still holds just the rows appended to it (nothing appended, inserted or taken
        since), or none while they are pending. Every item is compared (once, where a stack reads them): a list
        the function keeps to itself may shrink too (``hs.pop()``), so that ends alike tell nothing."""
        if self.pending:
            return all(not x for x in self)
        lengths, rows = self._held_rows
        return list(map(len, self)) == lengths and all(map(operator.is_, chain.from_iterable(self), rows))


def hand_rows(held, lists, packed, instance, step, lengths, fill=True):
    """Give Batch ``held`` of each instance's own empty ``lists`` the ``packed`` rows a loop appended to them, row
    r its ``instance[r]``'s item ``step[r]`` (``Appended``): put in the lists now with ``fill``, else where the
    program reads them otherwise than by their stack."""
    found = Appended(lists, packed, instance, step, lengths, pending=True)
    held.items = found
    if fill:
        found.fill()
    return found


def _held(lists):
    """What ``lists`` hold now, as each one's length and all their items in a row (``Appended.holds_its_rows_alone``
    compares it: two C loops)."""
    return list(map(len, lists)), list(chain.from_iterable(lists))


def _ends_of(lists):
    """Each list's length, first and last item: what ``_unchanged`` compares (a list that only grows)."""
    return [(len(x), x[0], x[-1]) if x else (0, None, None) for x in lists]


def _unchanged(lists, ends):
    """Whether each list still holds what it held at ``ends`` (``_ends_of``)."""
    return all(len(x) == m and (not m or x[0] is first and x[-1] is last) for x, (m, first, last) in zip(lists, ends))


class Listed(list):
    """Each instance's own list of tensors (a Batch's items) that a ``for`` iterates (``for h in hs``), with the
    same tensors stacked (``stacked``) where each has one of a shape and dtype: while every list holds just what
    it held when the loop began (in a run that changes nothing in place, a list only grows), the loop's test is a
    comparison of lengths and item i of every instance one index of the stack (a copy, as ``Rows`` items are);
    after an append, each instance reads its own list."""

    __slots__ = ("stack", "_ends")

    def __init__(self, lists, stack, ends=None):
        super().__init__(lists)
        self.stack = stack  # a Batch: every instance's tensor, or Rows of them
        self._ends = ends if ends is not None else _ends_of(lists)

    def taken(self, positions):
        """The Listed of instances ``positions`` (a loop's instances that stay)."""
        positions = list(positions)
        stack = bt.take(self.stack, bt.long_tensor(positions), positions)
        return Listed([self[k] for k in positions], stack, [self._ends[k] for k in positions])

    def unchanged(self):
        return _unchanged(self, self._ends)


def listed(n, seq):
    """What a ``for`` over each instance's own list iterates (``as_sequence``): the lists, kept with their stack
    (``Listed``); NotImplemented where they are no lists of tensors one stack holds (each instance then iterates
    its own)."""
    lists = seq.items if type(seq) is Batch and seq.owner == "items" and seq.thunk is None else None
    if lists is None or type(lists) not in (list, Appended) or not all(type(x) is list for x in lists):
        return NotImplemented
    if type(lists) is Appended:
        lists.fill()  # (the loop's items are the lists' own)
    stack = stacked(n, seq, (), {})
    if stack is NotImplemented:
        return NotImplemented
    return Batch(n, items=Listed(lists, stack))


def listed_item(n, seq, i):
    """``seq[i]`` of each instance's list at the shared position i (``Listed``), or NotImplemented."""
    if not seq.unchanged():
        return NotImplemented
    stack = seq.stack
    if stack.owner == "tensor":
        return bt.from_tensor(stack.tensor[:, i]) if -stack.tensor.shape[1] <= i < stack.tensor.shape[1] \
            else NotImplemented
    return item(of(stack), i) if i >= 0 else last_items(of(stack), i)


def listed_has_index(seq, i):
    """Whether each instance's list (``Listed``) has an item at the shared position i (≥ 0), or NotImplemented."""
    if not seq.unchanged():
        return NotImplemented
    stack = seq.stack
    if stack.owner == "tensor":
        return i < stack.tensor.shape[1]
    return has_index(of(stack), i)


def last_items(seq, i):
    """``seq[i]`` of every instance at a shared position i counted from its end (``hs[-1]``), where each has one:
    one index of the rows (a copy; the program changes nothing in place)."""
    if not -seq.shortest <= i < 0:
        return NotImplemented
    device = seq.source.device
    last = torch.tensor([a + m + i for a, m in zip(seq.starts, seq.lengths)], device=device)
    return bt.from_tensor(gather_rows(seq.source, seq.row_index(device), last))


# Reductions along a dim that run on the padded rows, what lies past each end left out (``reduced_within``).
REDUCTIONS = frozenset({"sum", "mean", "max", "min", "amax", "amin", "std", "var", "prod", "argmax", "argmin",
                        "any", "all", "nansum", "nanmean"})
_SOFTMAXES = {"softmax", "log_softmax"}
# Running ops along the rows, and what fills the rows past each end (never read: what is finite there, and adds
# nothing to a gradient through a zero cotangent).
_RUNNING = {"cumsum": 0, "cumprod": 1, "cummax": 0, "cummin": 0}
ALONG_ROWS = frozenset({*REDUCTIONS, *_SOFTMAXES, *_RUNNING, "flip", "logsumexp"})  # (Tensor methods it runs)
# (the torch functions of these names, and F's softmaxes)
REDUCING = {getattr(torch, name): name for name in ALONG_ROWS} | {F.softmax: "softmax", F.log_softmax: "log_softmax"}


def along_rows(n, name, seq, args, kwargs, method=False):
    """``x.flip(0)`` (the Tensor ``method``, or ``torch.flip(x, [0])``) or a reduction along the rows
    (``reduced``) of each instance's stretch; NotImplemented for other ops, dims and forms."""
    if name == "flip":
        rank = seq.source.dim() - 1
        if set(kwargs) - {"dims"} or (kwargs and args) or len(args) > 1:
            return NotImplemented
        dims = kwargs["dims"] if kwargs else args[0] if args else None
        if type(dims) is Batch and dims.struct is not None and dims.owner is None and dims.struct[0] is list \
                and not any(type(d) is Batch for d in dims.struct[1]):
            dims = list(dims.struct[1])  # (``[0]``, a list the program built of what every instance shares)
        if method and args and type(dims) is int:  # (``x.flip(0)``: the method's ``*dims``)
            dims = (dims,)
        if type(dims) not in (tuple, list) or len(dims) != 1 or type(dims[0]) is not int or dims[0] not in (0, -rank):
            return NotImplemented
        return flipped(n, seq)
    if name in _SOFTMAXES:
        return softmaxed(n, name, seq, args, kwargs)
    if name == "logsumexp" or name in _RUNNING:
        return _running_or_log_summed(n, name, seq, args, kwargs)
    return reduced(n, name, seq, args, kwargs)


def _running_or_log_summed(n, name, seq, args, kwargs):
    """``xs.cumsum(0)``, ``cumprod``, ``cummax``, ``cummin`` (each instance's running values, Rows of a new
    tensor; its row t reads none past t) and ``torch.logsumexp(xs, 0)`` of each instance's stretch along its
    rows: over the rows they lie in, those past an end filled (``_RUNNING``) or -inf (taking no share, and no
    gradient). NotImplemented for other dims and forms."""
    found = _along(args, kwargs) if name == "logsumexp" or len(args) <= 1 and set(kwargs) <= {"dim"} else None
    rank = seq.source.dim() - 1
    if found is None or found[0] not in (0, -rank) or seq.shortest == 0 or not seq.source.is_floating_point():
        return NotImplemented
    padded = as_padded(seq)
    mask = seq.mask(padded.device).view(n, -1, *[1] * (rank - 1))
    if name == "logsumexp":
        return bt.from_tensor(torch.where(mask, padded, padded.new_full((), float("-inf"))).logsumexp(1, found[1]))
    out = getattr(torch.where(mask, padded, padded.new_full((), _RUNNING[name])), name)(1)
    if type(out) is torch.Tensor:
        return batch(n, _same_rows(n, out, seq))
    return bt.from_struct(type(out), [batch(n, _same_rows(n, part, seq)) for part in out], n)


def _same_rows(n, padded, seq):
    """The Rows of ``padded``'s first rows, as long as ``seq``'s."""
    found = padded_rows(n, padded, seq.lengths)
    found.same_layout(seq)
    return found


def softmaxed(n, name, seq, args, kwargs):
    """``torch.softmax(xs, 0)``, ``xs.log_softmax(dim=0)`` of each instance's stretch, along its rows: over the
    rows they lie in, those past an instance's end filled with -inf (they take no share, and get no gradient).
    NotImplemented for other dims and options, and for an empty stretch (its instance's own op says)."""
    dim = kwargs["dim"] if set(kwargs) == {"dim"} and not args else args[0] if len(args) == 1 and not kwargs \
        else None
    rank = seq.source.dim() - 1
    if type(dim) is not int or dim not in (0, -rank) or seq.shortest == 0 or not seq.source.is_floating_point():
        return NotImplemented
    padded = as_padded(seq)
    out = softmax_within(name, padded, 1, seq.mask(padded.device).view(n, -1, *[1] * (rank - 1)))
    return batch(n, _same_rows(n, out, seq))


def softmax_within(name, padded, dim, mask):
    """``softmax``/``log_softmax`` along ``dim`` of ``padded`` where ``mask`` (broadcast) marks each instance's
    places: the rest filled with -inf (they take no share, and get no gradient)."""
    return getattr(torch, name)(torch.where(mask, padded, padded.new_full((), float("-inf"))), dim)


def reduced(n, name, seq, args, kwargs):
    """``x.sum(0)``, ``x.mean(0)``, ``x.max(0)``, ``torch.amin(x, 0)`` ... of each instance's stretch, along its
    rows: over the rows they lie in, the rows past an instance's end left out (``torch.where``: none of their
    values, not even an inf, reaches a result or a gradient; an amax with grad of an inf, whose gradient a tie
    with the fill would share, runs per instance). NotImplemented for other ops and dims."""
    if name not in REDUCTIONS:
        return NotImplemented
    found = reduction_args(name, args, kwargs)
    rank = seq.source.dim() - 1  # (each instance's)
    if found is None or type(found[0]) is not int or found[0] not in (0, -rank) or rank < 1:
        return NotImplemented
    keepdim, correction = found[1], found[2]
    if name not in EMPTY_SAFE and seq.shortest == 0:
        return NotImplemented  # (an empty stretch: its instance's own op says what it gives or raises)
    if name in ("sum", "mean") and seq.packed is not None and seq.packed.is_cpu and (
            seq.packed.is_floating_point() or seq.packed.is_complex()):  # (an int sum: int64; CUDA's index_add
        # adds in no fixed order)
        flat = seq.packed  # (laid end to end: each instance's rows added into its own row, one op)
        device = flat.device
        total = flat.new_zeros(n, *flat.shape[1:]).index_add(0, seq.where(device)[0], flat)
        if name == "mean":
            total = total / seq.counts().to(device=device, dtype=total.dtype).view(n, *[1] * (total.dim() - 1))
        return bt.from_tensor(total.unsqueeze(1) if keepdim else total)
    padded = as_padded(seq)
    return reduced_within(n, name, padded, 1, seq.mask(padded.device).view(n, -1, *[1] * (rank - 1)), seq.counts(),
                          keepdim, correction)


# Reductions that give what eager gives of an empty value (a sum's 0, a product's 1): the rest refuse one.
EMPTY_SAFE = frozenset({"sum", "nansum", "prod", "any", "all"})
# What fills the places past each end for a reduction that reads them as the value had nothing there.
_NEUTRAL = {"prod": 1, "any": 0, "all": 1, "nansum": 0, "nanmean": float("nan")}


def reduced_within(n, name, padded, dim, mask, counts, keepdim, correction=1):
    """Reduction ``name`` (``REDUCTIONS``) along ``dim`` of ``padded`` (the batch's tensor) where ``mask``
    (broadcast) marks each instance's places, ``counts`` (a LongTensor) how many each has there: the rest left
    out (``torch.where``: none of their values, not even an inf, reaches a result or a gradient; an amax with
    grad of an inf, whose gradient a tie with the fill would share, is NotImplemented). ``correction``: a
    ``std``'s or ``var``'s, subtracted from each count."""
    device = padded.device
    if name in ("std", "var"):
        return _spread_within(n, name, padded, dim, mask, counts, keepdim, correction)
    if name in _NEUTRAL:
        if padded.is_complex() or (name in ("nansum", "nanmean") and not padded.is_floating_point()):
            return NotImplemented
        filled = torch.where(mask, padded, padded.new_full((), _NEUTRAL[name]))
        if name == "prod" and not spreads.zeros_alike(filled):
            return NotImplemented
        return bt.from_tensor(getattr(filled, name)(dim, keepdim=keepdim))
    if name in ("sum", "mean"):
        if name == "mean" and not (padded.is_floating_point() or padded.is_complex()):
            return NotImplemented
        total = torch.where(mask, padded, padded.new_zeros(())).sum(dim, keepdim=keepdim)
        if name == "sum":
            return bt.from_tensor(total)
        lengths = counts.to(device=device, dtype=total.dtype)
        return bt.from_tensor(total / lengths.view(n, *[1] * (total.dim() - 1)))
    if padded.dtype is torch.bool or padded.is_complex():
        return NotImplemented
    fill = extreme_fill(padded, name in ("max", "amax", "argmax"))
    filled = torch.where(mask, padded, padded.new_full((), fill))
    if name in ("amax", "amin") and padded.requires_grad and torch.is_grad_enabled() and \
            bool((torch.where(mask, padded, 0) == fill).any()):
        return NotImplemented  # (an inf tying with the fill: amax's gradient, shared by ties, would reach it)
    out = getattr(filled, name)(dim, keepdim=keepdim)
    if name in ("amax", "amin", "argmax", "argmin"):  # (an arg's ties: the first, within the value, as eager's)
        return bt.from_tensor(out)
    return bt.from_struct(type(out), [bt.from_tensor(out.values), bt.from_tensor(out.indices)], n)


def _spread_within(n, name, padded, dim, mask, counts, keepdim, correction):
    """``std``/``var`` along int ``dim`` as ``reduced_within`` reduces, each instance's mean and spread over its
    own places, with eager's gradient (``spreads.RowSpread``) and eager's warning where nothing is left."""
    if not padded.is_floating_point() or type(dim) is not int:
        return NotImplemented
    if bool((counts <= correction).any()):  # (eager's warning, once per op as eager gives it)
        warnings.warn(f"{name}(): degrees of freedom is <= 0. Correction should be strictly less than the "
                      "reduction factor (input numel divided by output numel).", UserWarning, stacklevel=2)
    shape = [n] + [1] * (padded.dim() - 1)
    shape[dim] = 1
    at = counts.to(device=padded.device, dtype=padded.dtype).view(shape)
    out = spreads.RowSpread.apply(padded, mask, at, dim, keepdim, correction)
    return bt.from_tensor(spreads.SpreadRoot.apply(out) if name == "std" else out)


def extreme_fill(t, highest):
    """What fills the places past each end of ``t`` for a max (``highest``) or a min: the lowest (highest) value
    of its dtype, which no instance's value loses to."""
    if t.is_floating_point():
        return float("-inf") if highest else float("inf")
    info = torch.iinfo(t.dtype)
    return info.min if highest else info.max


def reduction_args(name, args, kwargs):
    """(dim, keepdim, correction) of a reduction's arguments, the dim as given (None where none is; a ``std``'s
    or ``var``'s correction, or ``unbiased`` by name or place; else 1), or None for other arguments (a dtype)."""
    spread = name in ("std", "var")
    names = ("dim", "unbiased", "keepdim") if spread else ("dim", "keepdim")
    if len(args) > len(names) or set(kwargs) - {*names, *(("correction",) if spread else ())}:
        return None
    found = dict(zip(names, args))
    if found.keys() & kwargs.keys() or {"unbiased", "correction"} <= {*found, *kwargs}:
        return None
    found.update(kwargs)
    unbiased, keepdim = found.get("unbiased", True), found.get("keepdim", False)
    correction = found.get("correction", 1 if unbiased else 0)
    if type(unbiased) is not bool or type(keepdim) is not bool or type(correction) not in (int, float) or \
            type(found.get("dim")) is bool:  # (``x.var(False)``: unbiased, by place, over everything)
        return None
    return found.get("dim"), keepdim, correction


def _along(args, kwargs):
    """(dim, keepdim) of a reduction's arguments, or None where they are others (a dtype, a dim tuple)."""
    found = reduction_args("sum", args, kwargs)
    return found[:2] if found is not None and type(found[0]) is int else None


def as_padded(seq):
    """Each instance's stretch as the first rows of one (n, longest, ...) tensor, the rest of each row whatever
    lies there: a view where the stretches start alike in the source's own rows, else one index (a copy)."""
    first = seq.starts[0]
    if seq.rows is None and seq.alike():
        return seq.source[:, first:first + seq.longest]
    device = seq.source.device
    if seq.packed is not None:  # (laid end to end: each stretch put in its row, zeros past its end)
        flat = seq.packed
        return flat.new_zeros(len(seq), seq.longest, *flat.shape[1:]).index_put(seq.where(device), flat)
    places = (seq.start_index(device)[:, None] + torch.arange(seq.longest, device=device)).clamp(
        max=seq.source.shape[1] - 1)
    return gather_rows(seq.source, seq.row_index(device)[:, None].expand(-1, seq.longest), places)


def through_rnn(n, module, seq, states):
    """An ``nn.RNN``, ``LSTM`` or ``GRU`` over each instance's stretch (an unbatched sequence of its own length):
    one run over them packed, the module's states given as (layers, n, H); each instance's output its stretch of
    the outputs (Rows, laid end to end, made when first read), and its final states (layers, H) a batch. Rows laid
    end to end already go into the packed sequence by one index (else they are packed from the padded rows)."""
    if seq.shortest == 0:
        return NotImplemented  # (an empty sequence: its instance's own call says what it does)
    lengths = seq.counts()
    if seq.packed is not None:
        device = seq.packed.device
        order = torch.sort(lengths, descending=True, stable=True).indices
        sizes = torch.bincount(lengths - 1, minlength=seq.longest).flip(0).cumsum(0).flip(0)  # (rows at step t)
        at = _stepwise(lengths, sizes, order).to(device)
        packed = nn.utils.rnn.PackedSequence(seq.packed.index_select(0, at), sizes, order.to(device),
                                             torch.argsort(order).to(device))
    else:
        packed = nn.utils.rnn.pack_padded_sequence(as_padded(seq), lengths, batch_first=True, enforce_sorted=False)
    # (with grad, a one-layer module's steps written out as its cell's: faster to train than its packed run)
    out, ends = lazy_weights.module_steps(module, packed, states) or module(packed, states)
    outputs = Batch(n, thunk=_Unpacked(n, out, seq))  # (``_, (h, c) = ...``: never laid out)
    finals = [bt.from_tensor(e.transpose(0, 1)) for e in (ends if type(module) is nn.LSTM else (ends,))]
    return bt.from_struct(tuple, [outputs, bt.from_struct(tuple, finals, n) if len(finals) == 2 else finals[0]], n)


def _stepwise(lengths, sizes, order):
    """For each row of a PackedSequence (step by step, the sequences of each step in ``order``), its row among
    the sequences of ``lengths`` laid end to end."""
    step = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    place = torch.arange(len(step)) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)
    return (lengths.cumsum(0) - lengths)[order[place.to(order.device)].cpu()] + step


class _Unpacked:
    """An RNN module's packed outputs as each instance's stretch of them (Rows laid end to end, of the layout of
    ``seq``, the module's input), computed when first read."""

    __slots__ = ("n", "out", "seq")

    def __init__(self, n, out, seq):
        self.n, self.out, self.seq = n, out, seq

    def depends_on(self):
        return []

    def compute(self):
        out, seq = self.out, self.seq
        k, t = seq.where(torch.device("cpu"))  # (each row's instance and step, the rows end to end)
        sizes = out.batch_sizes
        # (at step t the sequences still running lie in sorted order: instance k's row is the step's first plus
        # k's place in that order)
        back = ((sizes.cumsum(0) - sizes)[t] + out.unsorted_indices.cpu()[k]).to(out.data.device)
        return batch(self.n, packed_rows(self.n, out.data.index_select(0, back), seq.lengths, seq))


def reversed_rows(n, fn, args, kwargs):
    """``reversed(xs)`` of each instance's rows (a tensor's ``__reversed__``: its rows flipped, a new tensor): one
    flip of the batch's tensor, or of each instance's stretch (Rows of a new tensor)."""
    if kwargs or len(args) != 1 or type(args[0]) is not Batch:
        return NotImplemented
    x = args[0]
    if x.owner == "tensor" and x.thunk is None and x.tensor.dim() >= 2:
        return bt.from_tensor(x.tensor.flip(1))
    seq = of(x)
    return NotImplemented if seq is None else flipped(n, seq)


def flipped(n, seq):
    """Each instance's stretch with its rows in reverse order, copies (``x.flip(0)``), as Rows of a new tensor
    (the rows past an end a copy of some row of the stretch, never read)."""
    if seq.longest == 0:
        return NotImplemented
    device = seq.source.device
    last = torch.tensor([a + max(m, 1) - 1 for a, m in zip(seq.starts, seq.lengths)], device=device)
    first = seq.start_index(device)
    places = torch.maximum(last[:, None] - torch.arange(seq.longest, device=device), first[:, None]).clamp(
        max=seq.source.shape[1] - 1)  # (a stretch of none may start at the row's end)
    out = gather_rows(seq.source, seq.row_index(device)[:, None].expand(-1, seq.longest), places)
    return batch(n, padded_rows(n, out, seq.lengths))
