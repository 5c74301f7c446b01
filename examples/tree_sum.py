"""The smallest recursive program: the sum of a tree's leaf values, the tree held as index tensors.

    python examples/tree_sum.py
    recompile dump examples/tree_sum.py:tree_sum            # the IR the decorator builds
    recompile dump examples/tree_sum.py:tree_sum --source   # the Python it generates
"""

import torch

import recompile


@recompile.function
def tree_sum(left, right, value, i):
    if left[i] < 0:  # a leaf
        return value[i]
    return tree_sum(left, right, value, left[i]) + tree_sum(left, right, value, right[i])


if __name__ == "__main__":
    # two trees, children before parents: nodes 0-4 (root 4) and 5-7 (root 7)
    left = torch.tensor([-1, -1, 0, -1, 2, -1, -1, 5])
    right = torch.tensor([-1, -1, 1, -1, 3, -1, -1, 6])
    value = torch.arange(8.0)
    print("tree 0:", tree_sum(left, right, value, 4))
    print("both trees:", recompile.vmap(tree_sum, in_dims=(None, None, None, 0))(left, right, value,
                                                                                   torch.tensor([4, 7])))
    print(tree_sum.stats)
