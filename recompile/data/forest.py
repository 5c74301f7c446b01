"""Many trees as one set of node arrays (a batch).

The trees' node arrays are concatenated and child indices shifted by each
tree's offset, so the result is itself children-before-parents and a
function written against a Tree (``t.left[i]``, ``t.is_leaf[i]``, ...)
runs unchanged on a Forest when given ``forest.roots[k]`` as the node.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .nodes import NodeArrays
from .tree import Tree


class Forest(NodeArrays):
    """A batch of trees.

    Node tensors as in :class:`NodeArrays` (``words``, ``left``, ``right``,
    ``is_leaf``, ``labels``, ``heights``; child indices are global), plus
    per-tree LongTensors [B]: ``roots`` (root node of each tree),
    ``offsets`` (first node of each tree) and ``sizes`` (nodes per tree);
    ``tree_of`` (LongTensor [N]) gives the tree each node belongs to, and
    ``tokens`` is the list of each tree's token list (or None).

    Make one with :meth:`Forest.from_trees`.
    """

    _TENSORS = NodeArrays._TENSORS + ("roots", "offsets", "sizes", "tree_of")

    roots: torch.Tensor
    offsets: torch.Tensor
    sizes: torch.Tensor
    tree_of: torch.Tensor
    tokens: list

    @classmethod
    def from_trees(cls, trees: Sequence[Tree]) -> "Forest":
        """Concatenate ``trees`` (all on one device) into one forest, in order."""
        trees = list(trees)
        if not trees:
            return cls._empty()
        device = trees[0].device
        if any(t.device != device for t in trees):
            raise ValueError(f"all trees must be on one device, got {sorted({str(t.device) for t in trees})}")
        forest = cls.__new__(cls)
        forest.sizes = torch.tensor([t.num_nodes for t in trees], dtype=torch.long, device=device)
        forest.offsets = torch.cumsum(forest.sizes, 0) - forest.sizes
        forest.roots = forest.offsets + forest.sizes - 1
        forest.tree_of = torch.repeat_interleave(torch.arange(len(trees), device=device), forest.sizes)
        node_offset = forest.offsets[forest.tree_of]
        for name in ("words", "labels", "is_leaf", "heights"):
            setattr(forest, name, torch.cat([getattr(t, name) for t in trees]))
        for name in ("left", "right"):
            local = torch.cat([getattr(t, name) for t in trees])
            setattr(forest, name, torch.where(local >= 0, local + node_offset, local))
        forest.tokens = [t.tokens for t in trees]
        return forest

    @classmethod
    def _empty(cls) -> "Forest":
        forest = cls.__new__(cls)
        for name in cls._TENSORS:
            setattr(forest, name, torch.zeros(0, dtype=torch.bool if name == "is_leaf" else torch.long))
        forest.tokens = []
        return forest

    @property
    def num_trees(self) -> int:
        return self.roots.shape[0]

    def __len__(self) -> int:
        return self.num_trees

    @property
    def height(self) -> int:
        """Height of the tallest tree (-1 for an empty forest)."""
        return int(self.heights.max()) if self.num_nodes else -1

    def tree(self, k: int) -> Tree:
        """Tree ``k`` as a standalone :class:`Tree` (local indices, same device)."""
        if not -self.num_trees <= k < self.num_trees:
            raise IndexError(f"tree index {k} out of range for a forest of {self.num_trees} trees")
        k %= self.num_trees
        start = int(self.offsets[k])
        nodes = slice(start, start + int(self.sizes[k]))
        tree = Tree.__new__(Tree)  # the slice is a valid tree already: skip re-checking
        for name in ("words", "labels", "is_leaf", "heights"):
            setattr(tree, name, getattr(self, name)[nodes].clone())
        for name in ("left", "right"):
            child = getattr(self, name)[nodes]
            setattr(tree, name, torch.where(child >= 0, child - start, child))
        tree.root = tree.num_nodes - 1
        tree.tokens = list(self.tokens[k]) if self.tokens[k] is not None else None
        return tree

    def trees(self) -> list[Tree]:
        """All trees, as by :meth:`tree`."""
        return [self.tree(k) for k in range(self.num_trees)]

    def __repr__(self) -> str:
        return f"Forest(num_trees={self.num_trees}, num_nodes={self.num_nodes}, height={self.height})"
