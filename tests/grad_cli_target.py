"""Target of the CLI test in test_grad.py: a decorated recursive function over tensors."""

import torch

import recompile


@recompile.function(mode="sequential")
def grad_tree_sum(left, right, value, i):
    if left[i] < 0:
        return torch.tanh(value[i])
    return grad_tree_sum(left, right, value, left[i]) * grad_tree_sum(left, right, value, right[i])
