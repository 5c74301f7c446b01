"""Rows a branch or loop hands on, given back as the very rows they were copied from.

Where a program may change a value in place, a side of a Cond and the instances that stay in a While work on
copies of their rows of each batched argument (``control._take_all``), which ``control.write_back`` copies back
when the Cond joins or the loop ends. A value handed on from such a copy (``w = v if c else v * 1``; ``while
...: w = v``) is, in eager code, the argument itself for those instances: a later change through it (``w += 1``)
changes the argument. So the joined value must hold views of the argument's rows, not the copy, which nothing
writes back any more.

``Copies`` knows, for one Cond or loop, where each copy came from: by object (a copy of several rows; a value
taken, not copied, for instances that left a loop) and by tensor (a view of a copy's rows, one instance's copy
or what a nested Cond handed on). ``Copies.aliased`` maps a value through them.
"""

from __future__ import annotations

import torch

from . import batch as bt
from .batch import Batch


class Copies:
    __slots__ = ("links", "bases")

    def __init__(self, copies, taken=()):
        # copies: (source batch, index, copy, the copy's rows, version) as control._take_all notes them;
        # taken: (source batch, index, what was taken); an index is a LongTensor of the source's instances, read
        # as a list only where a value needs it
        self.links = {}  # id(copy or taken value) -> (source, index)
        self.bases = {}  # id(the copy's rows tensor) -> (source, index, rows)
        for source, index, copy, rows, _ in copies:
            self.links[id(copy)] = (source, index)
            self.bases[id(rows)] = (source, index, rows)
        for source, index, value in taken:
            self.links[id(value)] = (source, index)

    def aliased(self, value):
        """``value`` with what was copied or taken through these Cond's or loop's copies given as views of the
        rows it came from; ``value`` itself where none of it was."""
        rows, root = None, value
        while id(root) in self.links:
            root, index = self.links[id(root)]
            at = index.tolist()
            rows = at if rows is None else [at[r] for r in rows]
        if rows is None:
            if not self._holds_copied_views(value):
                return value
            if type(value) is not Batch:
                return self._through(value)
            rows = range(value.n)
        elif type(root) is Batch and root.owner == "tensor" and not self._holds_copied_views(root):
            return bt.rows_view(root.tensor, list(rows))
        if type(root) is Batch and root.owner == "tensor":
            items = bt.items_of(root)
        elif type(root) is Batch and root.pieces is not None:
            items = bt.pieces_items(root)
        elif isinstance(root, torch.Tensor):
            items = [root]
        else:
            return value
        mapped = [self._through(items[r]) for r in rows]
        return mapped[0] if len(mapped) == 1 else bt.from_items(mapped)

    def _holds_copied_views(self, value):
        """Whether ``value`` (a joined batch's pieces, a batch's tensor or items) holds a view of a copy's rows."""
        if isinstance(value, torch.Tensor):
            return value._base is not None and id(value._base) in self.bases
        if type(value) is not Batch or value.thunk is not None:
            return False
        if value.owner == "tensor":
            return self._holds_copied_views(value.tensor)
        if value.owner == "items":
            return any(self._holds_copied_views(x) for x in value.items)
        if value.pieces is not None and value.items is None:
            return any(self._holds_copied_views(piece) for piece, _ in value.pieces[0])
        return False

    def _through(self, x):
        """Tensor ``x``, a view of one row of a copy (maybe of a copy of a copy), as the view of the row the copy
        was made from; ``x`` itself where it is no such view."""
        while isinstance(x, torch.Tensor) and x._base is not None:
            found = self.bases.get(id(x._base))
            if found is None:
                break
            source, index, rows = found
            step = rows.stride(0)
            if not step or x.shape != rows.shape[1:] or x.stride() != rows.stride()[1:]:
                break
            r, rest = divmod(x.storage_offset() - rows.storage_offset(), step)
            if rest or not 0 <= r < len(index) or type(source) is not Batch or source.owner != "tensor":
                break
            x = source.tensor[int(index[r])]
        return x
