"""Saved tensors whose rows the runtime changed for some instances: their backward reads them as they were saved.

torch keeps one version counter per tensor and its views, and a backward raises when a tensor it saved has
moved on since. A batch's tensor holds every instance's value as its rows, and the runtime writes some
instances' rows into it: a join's write-back of the rows a branch changed in place, the rows a call's frame
changed given back to each request, a change in place of values held apart given back to their rows. In eager
code each of those is a change of each instance's own tensor, and another instance's op, which saved its own
tensor, computes its gradient; here the other instances' ops saved the same batch tensor, and torch refused
their backward where eager's computes.

So a batched run with gradients that may change values in place (``watching``) packs each tensor an op saves
with its version (``torch.autograd.graph.saved_tensors_hooks``: torch then leaves the version check to the
unpack hook), and the runtime notes its writes into a storage something saved, with what they overwrote
(``writing``; ``moved`` for a copy of instances' tensors whose version moves with theirs). At unpack, a saved
tensor whose version moved only by such writes is given back as it was saved (on a copy with their rows
restored), and the node that reads it raises torch's error after it ran where its gradient is not zero in a
written instance's row (or in a gradient with no row per instance, a shared weight's): that instance's own
backward may need what its op saved, as eager's refuses.

An op of the program that changes a batch's tensor in place is noted too (``program``: a later runtime write
still follows it). Run for every instance of the run (``whole``), it keeps torch's check where it reaches the
saved tensor: the node raises when it runs, as eager's does for an instance that reaches it. Run for some of
them (a side of a branch, a loop's instances that went on, a recursion's deeper calls), it is noted with what
it overwrote and the gradient decides, as for the runtime's writes: a node that saved one instance's tensor,
or a tensor every instance of which was written, raises after it ran where any gradient it computed is not
zero. There the batch's plumbing can lead the backward to the node with a gradient of zeros where eager's
never runs it (a loop's rows that an instance changed and dropped, joined with the rows of instances that
left; a side's copy written back); eager's may run it with those zeros too and refuse (``y - y``, a ``min``
that drops the slot). The two cannot be told apart: a gradient of zeros computes (the gradient of what was
computed, from what was saved), which keeps the plumbing from refusing what eager computes. A run of one
instance (``alone``: its graph is eager's) raises wherever eager's does.

Not installed where gradients are off, where the program changes nothing in place, inside torch.func's
transforms (which refuse saved-tensor hooks) or under the caller's own hooks (one pair is active at a time):
there torch checks versions as before (docs/batching.md, Limits).
"""

from __future__ import annotations

import threading

import torch
from torch.autograd.graph import saved_tensors_hooks


class _State(threading.local):
    ledger = None  # the Ledger of the run this thread is in, or None


_state = _State()
_next_sequence_nr = torch._C._autograd._get_sequence_nr


class _Write:
    """One noted write: versions before and after, where it wrote (a view's geometry on the storage, and the
    index along its first dim, a LongTensor or a list, or None for the whole view) and the values it overwrote
    (None where it moved the version alone: a copy whose source changed, ``moved``)."""

    __slots__ = ("before", "after", "size", "stride", "offset", "index", "old", "target", "instances", "whole")

    def __init__(self, target, index, keeps_values, instances, whole=False):
        self.target = target.detach()  # (keeps the storage, so no other tensor reuses its address meanwhile)
        self.before = target._version
        self.after = None
        self.size, self.stride, self.offset = target.size(), target.stride(), target.storage_offset()
        self.index = index
        self.instances = instances  # (whether the target's dim 0 is the batch's instances, one row each)
        self.whole = whole  # (a program's op run for every instance of the run: it keeps torch's check)
        self.old = None
        if not keeps_values:
            with torch.no_grad():
                self.old = (target if index is None else target[index]).detach().clone()

    def span(self):
        return _span(self.size, self.stride, self.offset)

    def mask(self, like):
        """Where this write wrote, as a bool tensor of ``like``'s shape (``like`` a view of the same storage)."""
        marks = _whole(like, torch.zeros, dtype=torch.bool)
        region = marks.as_strided(self.size, self.stride, self.offset)
        if self.index is None:
            region.fill_(True)
        else:
            region[self.index] = True
        return marks.as_strided(like.size(), like.stride(), like.storage_offset())


def _whole(like, make, dtype=None, **options):
    """A new 1-D tensor as long as ``like``'s storage (in ``like``'s elements), made by ``make``."""
    return make((like.untyped_storage().nbytes() // like.element_size(),), dtype=dtype or like.dtype,
                device=like.device, **options)


def _span(size, stride, offset):
    """The first and last element of the storage a view of this geometry reaches (None if it reaches none)."""
    if any(s == 0 for s in size):
        return None
    low = high = offset
    for s, st in zip(size, stride):
        if st >= 0:
            high += (s - 1) * st
        else:
            low += (s - 1) * st
    return low, high


class Ledger:
    """The writes of one run, by storage. ``alone``: the run is one instance's, its graph the one eager records
    (a node that runs is that instance's)."""

    def __init__(self, n):
        self.writes = {}  # storage address -> [_Write], in order
        self.saved = set()  # the addresses of the storages of what was saved (a write elsewhere needs no note)
        self.n = n  # (the run's instances)
        self.alone = n == 1

    def pack(self, t):
        # (an op's own output, whose node was made last, is kept detached: the node holding the tensor that holds
        # the node would be a cycle no collector sees; an input is kept itself, as torch keeps it: what watches
        # its Python object, ``batch.MADE_FROM``, sees it live as long as the backward may read it)
        self.saved.add(t.untyped_storage().data_ptr())
        made_by = t.grad_fn
        if made_by is not None and made_by._sequence_nr() == _next_sequence_nr() - 1:
            return t.detach(), t._version
        return t, t._version

    def unpack(self, packed):
        saved, version = packed
        now = saved._version
        if now == version:
            return saved
        writes = self._writes_since(saved, version, now)
        if writes is None:
            raise _changed(saved, version, now)
        saved_span = _span(saved.size(), saved.stride(), saved.storage_offset())
        masks = [(w, w.mask(saved)) for w in writes if _meet(w.span(), saved_span)]
        masks = [(w, m) for w, m in masks if bool(m.any())]
        if not masks:
            return saved
        node = torch._C._current_autograd_node()
        if node is not None:  # (None: read outside a backward, ``grad_fn._saved_self``)
            if self.alone or any(w.whole for w, _ in masks):
                raise _changed(saved, version, now)  # (the node runs for a written instance: eager's refusal)
            _refuse_where_written_rows_need_it(node, saved, version, now, _rows_written(saved, masks))
        restoring = [w for w, _ in masks if w.old is not None]
        return _as_saved(saved, restoring) if restoring else saved

    def _writes_since(self, saved, version, now):
        """The noted writes that moved ``saved``'s version from ``version`` to ``now``, or None where a step was
        not noted."""
        found = []
        at = version
        for w in self.writes.get(saved.untyped_storage().data_ptr(), ()):
            if w.before == at and w.after is not None and w.after <= now:
                found.append(w)
                at = w.after
        return found if at == now else None


def _rows_written(saved, masks):
    """Where in ``saved`` the written instances are: (the dim of ``saved`` that runs over instances, the
    positions along it that the writes wrote), where only some of its instances were written; None where
    ``saved`` is one instance's (a row, an op run per instance) or every instance of it was written (also where
    the instances lie along several of its dims): any gradient of the node that saved it is then a written
    instance's. The instances are read from the storage: each write that wrote instances' rows (dim 0 of its
    target) numbers the elements it reaches by their row."""
    laid = next((w for w, _ in masks if w.instances), None)
    if laid is None or saved.dim() == 0:
        return None
    ids = _whole(saved, torch.full, fill_value=-1, dtype=torch.long)
    region = ids.as_strided(laid.size, laid.stride, laid.offset)
    region.copy_(torch.arange(laid.size[0], device=saved.device).reshape(-1, *([1] * (len(laid.size) - 1)))
                 .expand(laid.size))
    ids = ids.as_strided(saved.size(), saved.stride(), saved.storage_offset())
    varying = [d for d in range(saved.dim()) if saved.shape[d] > 1 and bool((ids.narrow(d, 0, 1) != ids).any())]
    if len(varying) != 1:
        return None
    dim = varying[0]
    written = masks[0][1]
    for _, m in masks[1:]:
        written = written | m
    rows = written.movedim(dim, 0).reshape(saved.shape[dim], -1).any(1)
    return None if bool(rows.all()) else (dim, rows.nonzero().squeeze(1))  # (every instance of it written)


def _refuse_where_written_rows_need_it(node, saved, version, now, rows):
    """After ``node`` (running in a backward, reading ``saved``) computed its gradients: raise torch's error
    where one of them is not zero in a written instance's row (``rows``: the dim of the instances, the written
    positions along it; None: every row is a written instance's), or where one with no row per instance (a
    shared weight's) is not zero. The batch's ops keep each instance apart, so a gradient in a written
    instance's row is that instance's: its backward needs what its op saved, which eager refuses. A node of the
    batch's graph may run with a gradient of zeros where eager's would not run (the rows of a join whose
    instances all went elsewhere); so may a written instance whose gradient is zero there, which eager refuses:
    it gets the gradient of what was computed (docs/batching.md, Limits)."""
    dim, at = rows if rows is not None else (None, None)

    def check(grad_inputs, grad_outputs):
        if rows is None:  # (every instance of the node written: any gradient is a written instance's)
            if any(g is not None and bool(g.ne(0).any()) for g in grad_inputs):
                raise _changed(saved, version, now)
            return
        aligned, shared = [], []
        for g in grad_inputs:  # (a reduction's input has more dims)
            if g is not None:
                (aligned if g.dim() > dim and g.shape[dim] == saved.shape[dim] else shared).append(g)
        if not aligned or any(bool(g.ne(0).any()) for g in shared) or any(
                bool(g.index_select(dim, at.to(g.device)).ne(0).any()) for g in aligned):
            raise _changed(saved, version, now)

    node.register_hook(check)


def _changed(saved, version, now):
    """torch's own error for a saved tensor changed in place."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{saved.type()} {list(saved.shape)}] is at version {now}; expected version {version} instead. Hint: "
        "the value an op saved for its gradient was changed in place after it, as eager's backward refuses")


def _meet(a, b):
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def _as_saved(saved, writes):
    """``saved`` as it was before ``writes`` (latest last): a copy of its storage with their regions restored."""
    with torch.no_grad():
        whole = torch.empty(0, dtype=saved.dtype, device=saved.device)
        whole.set_(saved.untyped_storage(), 0, (saved.untyped_storage().nbytes() // saved.element_size(),), (1,))
        copy = whole.clone()
        for w in reversed(writes):
            region = copy.as_strided(w.size, w.stride, w.offset)
            if w.index is None:
                region.copy_(w.old)
            else:
                region[w.index] = w.old
        return copy.as_strided(saved.size(), saved.stride(), saved.storage_offset())


class watching:
    """Around a batched run: the saved-tensor hooks and a ledger of the runtime's writes, where ``active`` (the
    run may change values in place) and gradients are recorded (see the module's docstring)."""

    __slots__ = ("hooks", "outer")

    def __init__(self, active, n):
        self.hooks = None
        if (active and _state.ledger is None and torch.is_grad_enabled()
                and torch._C._autograd._saved_tensors_hooks_is_enabled()
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
            self.hooks = Ledger(n)

    def __enter__(self):
        ledger = self.hooks
        if ledger is not None:
            _state.ledger = ledger
            self.outer = saved_tensors_hooks(ledger.pack, ledger.unpack)
            self.outer.__enter__()
        return self

    def __exit__(self, *exc):
        if self.hooks is not None:
            _state.ledger = None
            self.outer.__exit__(*exc)
        return False


def watched():
    """Whether this thread's run notes its writes."""
    return _state.ledger is not None


class writing:
    """Around the runtime's write into ``target`` (at ``index`` along its first dim, or the whole of it): the
    write noted in the run's ledger, if one watches. ``keeps_values``: the write moves the version alone."""

    __slots__ = ("write",)

    def __init__(self, target, index=None, keeps_values=False, instances=False, program=False, group=None):
        ledger = _state.ledger
        self.write = None
        if ledger is not None:
            address = target.untyped_storage().data_ptr()
            if address in ledger.saved:  # (no op saved a tensor of this storage yet: none needs the note)
                whole = program and (group is None or group >= ledger.n)  # (what it overwrote is never read)
                self.write = _Write(target, index, keeps_values or whole, instances, whole)
                ledger.writes.setdefault(address, []).append(self.write)

    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        if self.write is not None and kind is None:
            self.write.after = self.write.target._version
        return False


def moved(t, positions=None):
    """Move the version of ``t``, a copy of instances' tensors, one of which changed in place (``positions``:
    the rows of ``t`` that copy it, a list; None for all): what an op saved of ``t`` is what eager's saved of
    that instance's own tensor, so a backward that reads it must refuse as eager's does. Its values stay."""
    ledger = _state.ledger
    write = None
    if ledger is not None and t.untyped_storage().data_ptr() in ledger.saved:
        writes = ledger.writes.setdefault(t.untyped_storage().data_ptr(), [])
        write = writes[-1] if writes else None
        if (write is not None and write.old is None and write.after == t._version and positions is not None
                and type(write.index) is list and (write.size, write.stride, write.offset) == (
                    t.size(), t.stride(), t.storage_offset())):
            write.index.extend(positions)  # (the rows of one copy moved one after another: one write)
        else:
            write = _Write(t, None if positions is None else list(positions), True, True)
            writes.append(write)
    torch.autograd.graph.increment_version(t)
    if write is not None:
        write.after = t._version
