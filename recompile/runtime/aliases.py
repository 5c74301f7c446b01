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


_CONTAINERS = (list, dict, tuple)
_DEPTH = 4  # (how deep in lists, dicts and tuples: a list may hold itself)


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

    def aliased(self, value, depth=0):
        """``value`` with what was copied or taken through these Cond's or loop's copies given as views of the
        rows it came from; ``value`` itself where none of it was. A list or dict (an instance's own, or the
        parts or items of a batch of them) gets its elements so in place: it is the object eager code holds."""
        kind = type(value)
        if kind is list or kind is dict or kind is tuple:
            return self._inside(value, depth)
        if kind is Batch and value.thunk is None and depth < _DEPTH:
            if value.struct is not None and value.owner is None:
                parts = value.struct[1]
                mapped = [self.aliased(p, depth + 1) for p in parts]
                if any(a is not b for a, b in zip(mapped, parts)):
                    value.struct, value.items, value.tensor = (value.struct[0], mapped), None, None
                return value
            if value.owner == "items" and any(type(x) in _CONTAINERS for x in value.items):
                for x in value.items:
                    if type(x) is not tuple:
                        self._inside(x, depth + 1)
                return value
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

    def _inside(self, value, depth):
        if depth >= _DEPTH:
            return value
        if type(value) is tuple:
            mapped = tuple(self.aliased(x, depth + 1) for x in value)
            return value if all(a is b for a, b in zip(mapped, value)) else mapped
        for key in list(value.keys() if type(value) is dict else range(len(value))):
            x = value[key]
            y = self.aliased(x, depth + 1)
            if y is not x:
                value[key] = y
        return value

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
        """Tensor ``x``, a view of (part of) one row of a copy (maybe of a copy of a copy), as the same view of
        the row the copy was made from; ``x`` itself where it is no such view."""
        while isinstance(x, torch.Tensor) and x._base is not None:
            found = self.bases.get(id(x._base))
            if found is None:
                break
            source, index, rows = found
            if type(source) is not Batch or source.owner != "tensor":
                break
            target = source.tensor
            step = rows.stride(0)
            if not step or rows.shape[1:] != target.shape[1:] or rows.stride()[1:] != target.stride()[1:]:
                break  # (the source's rows are laid out otherwise: no view of its row is the same part)
            r, offset = divmod(x.storage_offset() - rows.storage_offset(), step)
            if not 0 <= r < len(index) or offset + bt.span(x) > bt.span(rows[0]):
                break
            row = target[int(index[r])]
            x = row if x.shape == row.shape and x.stride() == row.stride() and not offset else \
                row.as_strided(x.shape, x.stride(), row.storage_offset() + offset)
        return x

