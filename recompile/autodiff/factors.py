"""Parameter gradients kept as factors and formed once per backward (Cavs §3.4, lazy batching).

A linear layer used at every node of a tree gets, at each node, the gradient
``g^T x`` for its weight: one small matrix product per node. Kept as the
factors (``Outer(g, x)``) until the backward ends, all of a weight's products
become one ``G^T X`` over the stacked rows. An embedding's gradient is kept
as rows (``Rows(index, g)``) and formed by one ``index_add_``.

A rule yields these in place of a tensor cotangent; ``form`` turns a list of
them (with plain tensors) into the gradient.
"""

from __future__ import annotations

import torch


class Outer:
    """The cotangent ``g^T x`` summed over all leading dimensions: (..., out) x (..., in) -> (out, in)."""

    __slots__ = ("g", "x")

    def __init__(self, g, x):
        self.g = g
        self.x = x

    def rows(self):
        return self.g.reshape(-1, self.g.shape[-1]), self.x.reshape(-1, self.x.shape[-1])

    def tensor(self):
        g, x = self.rows()
        return g.T @ x


class Rows:
    """The cotangent of a table: ``grad[index[k]] += rows[k]`` (an embedding's weight)."""

    __slots__ = ("index", "rows", "shape")

    def __init__(self, index, rows, shape):
        self.index = index.reshape(-1)
        self.rows = rows.reshape(-1, *shape[1:])
        self.shape = shape

    def tensor(self):
        out = self.rows.new_zeros(self.shape)
        return out.index_add_(0, self.index, self.rows)


DEFERRED = (Outer, Rows)


def form(parts):
    """The sum of ``parts`` (tensors, Outer and Rows), each kind formed in one operation."""
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    outers = [p for p in parts if type(p) is Outer]
    tables = [p for p in parts if type(p) is Rows]
    total = None
    if outers:
        pairs = [o.rows() for o in outers]
        g = torch.cat([p[0] for p in pairs]) if len(pairs) > 1 else pairs[0][0]
        x = torch.cat([p[1] for p in pairs]) if len(pairs) > 1 else pairs[0][1]
        total = g.T @ x
    if tables:
        out = tables[0].rows.new_zeros(tables[0].shape) if total is None else total
        index = torch.cat([t.index for t in tables]) if len(tables) > 1 else tables[0].index
        rows = torch.cat([t.rows for t in tables]) if len(tables) > 1 else tables[0].rows
        total = out.index_add_(0, index, rows.to(out.dtype))
    if (len(dense) > 2 and dense[0].numel() <= 4096
            and all(d.shape == dense[0].shape and d.dtype == dense[0].dtype for d in dense)):
        dense = [torch.stack(dense).sum(0)]  # small parts (biases): one reduction rather than a chain
    for d in dense:
        total = d if total is None else total + d
    return total
