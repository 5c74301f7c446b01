"""Load the shipped SST sample, batch trees into a Forest, walk it two ways.

Run from the repository root: python examples/data/sst_forest.py
(with the package installed, e.g. pip install -e ., or PYTHONPATH=.)
"""

import torch

from recompile.data import Forest, load_sst, sample_dir


def subtree_leaves(x, i):
    """Leaves under node i, written recursively against a single tree."""
    if x.is_leaf[i]:
        return 1
    return subtree_leaves(x, x.left[i]) + subtree_leaves(x, x.right[i])


def main():
    sst = load_sst(sample_dir())
    print(f"{len(sst.train)} train trees, {len(sst.dev)} dev, {len(sst.test)} test; vocabulary {len(sst.vocab)}")
    tree = sst.train[0]
    print(tree)
    print(tree.to_ptb()[:80], "...")

    forest = Forest.from_trees(sst.train[:32])
    print(forest)

    # The recursive function runs unchanged on the forest, one root at a time ...
    recursive = [subtree_leaves(forest, root) for root in forest.roots]

    # ... and the same result comes from processing whole levels at once.
    leaves = torch.zeros(forest.num_nodes, dtype=torch.long)
    for level in forest.levels():
        is_leaf = forest.is_leaf[level]
        inner = level[~is_leaf]
        leaves[level[is_leaf]] = 1
        leaves[inner] = leaves[forest.left[inner]] + leaves[forest.right[inner]]
    assert leaves[forest.roots].tolist() == recursive
    print(f"{len(forest.levels())} levels; sentence lengths {recursive[:8]} ...")


if __name__ == "__main__":
    main()
