"""A full max, min or median (no dim) shares its cotangent among tied elements as torch's does (runtime/extremes.py,
and the derived gradient's rule in autodiff/rules.py): on the CPU an inf cotangent leaves the other elements 0,
not ``0 * inf``, NaN, as an amax over the same dims would give them."""

import pytest
import torch

import recompile


def scaled_max(x):
    return x.max() * 1e308 * 1e308 + x.min() + x.median() * 1e308 * 10.0  # (cotangents: inf, 1, inf)


def stretch_max(x, n):
    return x[:n].max() * 1e308 * 1e308 - x[:n].min()


X = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 2.0, 0.0]], dtype=torch.float64)


def _eager_grads(fn, *args):
    x = X.clone().requires_grad_()
    torch.stack([fn(x[k], *(a[k] for a in args)) for k in range(len(X))]).sum().backward()
    return x.grad


@pytest.mark.parametrize("mode", ["batched", "sequential", "threaded"])
def test_a_full_max_with_an_inf_cotangent_gives_the_others_zero_in_every_mode(mode):
    want = _eager_grads(scaled_max)
    assert not want.isnan().any()
    compiled = recompile.function(scaled_max, mode=mode)
    x = X.clone().requires_grad_()
    if mode == "batched":
        recompile.vmap(compiled)(x).sum().backward()
    else:
        torch.stack([compiled(x[k]) for k in range(len(X))]).sum().backward()
    torch.testing.assert_close(x.grad, want)


def test_a_full_max_of_each_instances_stretch_shares_as_eager():
    n = torch.tensor([2, 4, 3])
    want = _eager_grads(stretch_max, n.tolist())
    x = X.clone().requires_grad_()
    recompile.vmap(recompile.function(stretch_max))(x, n).sum().backward()
    torch.testing.assert_close(x.grad, want)
