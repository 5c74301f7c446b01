"""The node arrays that Tree and Forest share.

Both store nodes as parallel index tensors numbered children-before-parents,
so code written against one (``x.left[i]``, ``x.is_leaf[i]``, ...) runs
unchanged on the other.  This base holds what they have in common.
"""

from __future__ import annotations

import copy

import torch


class NodeArrays:
    """Parallel per-node tensors of one or more binary trees.

    ``words``   LongTensor [N]: vocabulary id of a leaf, -1 for internal nodes
    ``left``    LongTensor [N]: index of the left child, -1 for leaves
    ``right``   LongTensor [N]: index of the right child, -1 for leaves
    ``is_leaf`` BoolTensor [N]
    ``labels``  LongTensor [N]
    ``heights`` LongTensor [N]: 0 for leaves, 1 + max(child heights) otherwise

    Every child has a smaller index than its parent.
    """

    # Names of the tensor attributes that ``to`` moves; subclasses extend it.
    _TENSORS: tuple[str, ...] = ("words", "left", "right", "is_leaf", "labels", "heights")

    words: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    is_leaf: torch.Tensor
    labels: torch.Tensor
    heights: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.words.shape[0]

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device: torch.device | str):
        """A copy whose tensors are on ``device`` (tensors already there are
        shared, as with ``Tensor.to``); token lists are shared, not copied."""
        moved = copy.copy(self)
        for name in self._TENSORS:
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def levels(self) -> list[torch.Tensor]:
        """Node indices grouped by height: ``levels()[h]`` holds, in increasing
        order, every node of height ``h``, for ``h = 0 .. max height``.

        All children of a level-h node are in lower levels, so processing
        the levels in order is a valid bottom-up schedule.
        """
        if self.num_nodes == 0:
            return []
        # A stable sort keeps node order inside each level; every height from
        # 0 to the maximum occurs (a root's path down passes through them all),
        # so bincount gives one non-empty group per level.
        order = torch.argsort(self.heights, stable=True)
        counts = torch.bincount(self.heights)
        return list(torch.split(order, counts.tolist()))
