"""One labelled binary tree as index tensors.

Nodes are numbered in post-order (left subtree, right subtree, node), so
children come before parents, the root is the last node and the leaves,
taken in index order, are the sentence's words in order.  Everything here
walks trees with loops and explicit stacks, never Python recursion, so
degenerate trees thousands of levels deep are fine.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from .nodes import NodeArrays
from .vocab import Vocab

# Leaf: (label, word).  Internal node: (label, left, right).
Nested = Union[tuple, list]


class Tree(NodeArrays):
    """A binary tree with an integer label on every node.

    Tensors (see :class:`NodeArrays`): ``words``, ``left``, ``right``,
    ``is_leaf``, ``labels``, ``heights``.  Also ``root`` (int, ``N - 1``) and
    ``tokens`` (the leaf words in sentence order, or None if not given).

    Build one with :func:`recompile.data.parse_tree`,
    :meth:`Tree.from_nested`, :class:`TreeBuilder`, or directly from arrays:
    the constructor checks that they describe one tree in post-order.
    """

    def __init__(self, words, left, right, labels, tokens: Sequence[str] | None = None):
        words = torch.as_tensor(words, dtype=torch.long)
        left = torch.as_tensor(left, dtype=torch.long, device=words.device)
        right = torch.as_tensor(right, dtype=torch.long, device=words.device)
        labels = torch.as_tensor(labels, dtype=torch.long, device=words.device)
        _check_shapes(words, left, right, labels)
        heights = _check_post_order(words.tolist(), left.tolist(), right.tolist())
        is_leaf = left < 0
        num_leaves = int(is_leaf.sum())
        if tokens is not None and len(tokens) != num_leaves:
            raise ValueError(f"tree has {num_leaves} leaves but {len(tokens)} tokens were given")
        self.words, self.left, self.right, self.labels = words, left, right, labels
        self.is_leaf = is_leaf
        self.heights = torch.tensor(heights, dtype=torch.long, device=words.device)
        self.root = len(heights) - 1
        self.tokens = list(tokens) if tokens is not None else None

    @classmethod
    def from_nested(cls, nested: Nested, vocab: Vocab, *, grow: bool = True) -> "Tree":
        """Build a tree from nested tuples, mainly for tests and examples.

        A leaf is ``(label, word)``, an internal node ``(label, left, right)``::

            Tree.from_nested((2, (1, "a"), (3, "b")), vocab)

        Words get ids from ``vocab`` (added if ``grow``, else unknown -> 0).
        """
        builder = TreeBuilder()
        built: list[int] = []  # finished subtrees, innermost last
        # Post-order with an explicit stack: an item is (node, children_done).
        stack: list[tuple[Nested, bool]] = [(nested, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                right = built.pop()
                left = built.pop()
                built.append(builder.node(node[0], left, right))
                continue
            _check_nested(node)
            if len(node) == 2:
                label, word = node
                built.append(builder.leaf(label, word, vocab.lookup(word, grow)))
            else:
                stack += [(node, True), (node[2], False), (node[1], False)]
        return builder.build()

    @property
    def height(self) -> int:
        """Height of the root (0 for a single leaf)."""
        return int(self.heights[self.root])

    @property
    def num_leaves(self) -> int:
        return int(self.is_leaf.sum())

    def to_ptb(self, vocab: Vocab | None = None) -> str:
        """The tree in PTB bracket format, e.g. ``(2 (1 a) (3 b))``.

        Words come from ``tokens``, so parsing and writing back gives the
        input (with single spaces).  With ``vocab`` they come from the word
        ids instead, showing what a model sees (unknown words as ``<unk>``).
        """
        words = self._leaf_words(vocab)
        labels, left, right = self.labels.tolist(), self.left.tolist(), self.right.tolist()
        pieces: list[str] = []
        # Stack of pending output: a str is written as is, an int is a node
        # to expand.  Items are pushed in reverse order of output.
        stack: list[str | int] = [self.root]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                pieces.append(item)
            elif left[item] < 0:
                pieces.append(f"({labels[item]} {words[item]})")
            else:
                stack += [")", right[item], " ", left[item], f"({labels[item]} "]
        return "".join(pieces)

    def to_nested(self) -> Nested:
        """The inverse of :meth:`from_nested` (words from ``tokens``)."""
        words = self._leaf_words(None)
        labels, left, right = self.labels.tolist(), self.left.tolist(), self.right.tolist()
        built: list[Nested] = []
        for i in range(self.num_nodes):  # post-order: children are already built
            if left[i] < 0:
                built.append((labels[i], words[i]))
            else:
                built.append((labels[i], built[left[i]], built[right[i]]))
        return built[self.root]

    def _leaf_words(self, vocab: Vocab | None) -> dict[int, str]:
        """Node index -> word to print, for every leaf."""
        leaves = self.is_leaf.nonzero().flatten().tolist()
        if vocab is not None:
            return {i: vocab.itos[w] for i, w in zip(leaves, self.words[self.is_leaf].tolist())}
        if self.tokens is None:
            raise ValueError("this tree has no tokens; pass the vocabulary to write words from their ids")
        return dict(zip(leaves, self.tokens))

    def __repr__(self) -> str:
        text = " ".join(self.tokens) if self.tokens is not None else "<no tokens>"
        if len(text) > 60:
            text = text[:57] + "..."
        return f"Tree(num_nodes={self.num_nodes}, height={self.height}, tokens={text!r})"


class TreeBuilder:
    """Collects nodes in post-order and makes a :class:`Tree`.

    Add every node after its children; each call returns the new node's
    index, to be passed as a child of a later node::

        b = TreeBuilder()
        a = b.leaf(1, "a", vocab.add("a"))
        c = b.leaf(3, "b", vocab.add("b"))
        b.node(2, a, c)
        tree = b.build()
    """

    def __init__(self):
        self._words: list[int] = []
        self._left: list[int] = []
        self._right: list[int] = []
        self._labels: list[int] = []
        self._tokens: list[str] = []

    def leaf(self, label: int, token: str, word_id: int) -> int:
        self._tokens.append(token)
        return self._append(word_id, -1, -1, label)

    def node(self, label: int, left: int, right: int) -> int:
        return self._append(-1, left, right, label)

    def _append(self, word: int, left: int, right: int, label: int) -> int:
        self._words.append(word)
        self._left.append(left)
        self._right.append(right)
        self._labels.append(label)
        return len(self._words) - 1

    def build(self) -> Tree:
        """The tree of the nodes added so far (checked by ``Tree``)."""
        return Tree(self._words, self._left, self._right, self._labels, self._tokens)


def _check_shapes(words, left, right, labels) -> None:
    """Raise unless the four arrays are 1-D, non-empty and of one length."""
    shapes = {"words": words.shape, "left": left.shape, "right": right.shape, "labels": labels.shape}
    n = words.shape[0] if words.dim() == 1 else None
    if n is None or any(shape != (n,) for shape in shapes.values()):
        shapes = {name: list(shape) for name, shape in shapes.items()}
        raise ValueError(f"node arrays must be 1-D and of equal length, got shapes {shapes}")
    if n == 0:
        raise ValueError("a tree needs at least one node")


def _check_post_order(words: list[int], left: list[int], right: list[int]) -> list[int]:
    """Check that the arrays are one binary tree in post-order; return heights.

    In post-order, node i's right child is node i-1 and its left child is
    the node just before the right child's subtree.  Checking that for every
    node, plus that the root's subtree spans all nodes, proves the arrays
    are exactly one tree.
    """
    n = len(words)
    sizes = [0] * n  # number of nodes in the subtree rooted at i
    heights = [0] * n
    for i in range(n):
        l, r = left[i], right[i]
        if l < 0 and r < 0:
            if words[i] < 0:
                raise ValueError(f"leaf {i} has word id {words[i]}; leaves need a vocabulary id >= 0")
            sizes[i] = 1
            continue
        if words[i] != -1:
            raise ValueError(f"internal node {i} has word id {words[i]}; internal nodes must have -1")
        expected_left = r - sizes[r] if 0 <= r == i - 1 else None
        if expected_left is None or expected_left < 0 or l != expected_left:
            raise ValueError(
                f"node {i} has children ({l}, {r}), which is not post-order: the right child must "
                f"be node {i - 1} and the left child the node just before the right child's subtree"
            )
        sizes[i] = 1 + sizes[l] + sizes[r]
        heights[i] = 1 + max(heights[l], heights[r])
    if sizes[-1] != n:
        raise ValueError(f"the last node (the root) spans {sizes[-1]} of {n} nodes; the arrays hold more than one tree")
    return heights


def _check_nested(node) -> None:
    """Raise if ``node`` is not ``(label, word)`` or ``(label, left, right)``."""
    ok = isinstance(node, (tuple, list)) and isinstance(node[0] if node else None, int)
    if ok and len(node) == 2:
        ok = isinstance(node[1], str)
    elif ok:
        ok = len(node) == 3
    if not ok:
        raise ValueError(f"expected (label, word) or (label, left, right) with an int label, got {node!r}")
