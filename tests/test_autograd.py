"""runtime.autograd: one autograd node per compiled call, saved values released, grad modes."""

import gc
import os

import pytest
import torch
from torch import nn

import recompile
from recompile.runtime import autograd

F64 = torch.float64


class Cell(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.leaf = nn.Linear(d, d).double()
        self.comp = nn.Linear(2 * d, d).double()

    @recompile.function(mode="sequential")
    def encode(self, left, right, x, i):
        if left[i] < 0:
            return torch.tanh(self.leaf(x[i]))
        h = torch.cat([self.encode(left, right, x, left[i]), self.encode(left, right, x, right[i])])
        return torch.tanh(self.comp(h))


LEFT, RIGHT = [1, 3, 5, -1, -1, -1, -1], [2, 4, 6, -1, -1, -1, -1]


def _step(model, opt, x):
    loss = model.encode(LEFT, RIGHT, x, 0).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _rss_bytes():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_one_autograd_node_per_call():
    torch.manual_seed(0)
    m = Cell()
    out = m.encode(LEFT, RIGHT, torch.randn(7, 4, dtype=F64), 0)
    assert type(out.grad_fn).__name__ == "CompiledCallBackward"
    # its inputs are the parameters the forward met, not one node per op
    inputs = {id(fn.variable) for fn, _ in out.grad_fn.next_functions if hasattr(fn, "variable")}
    assert inputs == {id(p) for p in m.parameters()}


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read memory use")
def test_memory_after_1000_steps_equals_memory_after_10():
    torch.manual_seed(0)
    m = Cell(8)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(7, 8, dtype=F64)
    for _ in range(10):
        _step(m, opt, x)
    gc.collect()
    after_10 = _rss_bytes()
    for _ in range(990):
        _step(m, opt, x)
    gc.collect()
    grown = _rss_bytes() - after_10
    assert len(autograd.live_contexts) == 0  # every call's saved values were released
    assert grown < 4 * 2 ** 20, f"memory grew by {grown / 2 ** 20:.1f} MiB over 990 steps"


def test_saved_values_released_by_backward_and_with_the_graph():
    torch.manual_seed(0)
    m = Cell()
    x = torch.randn(7, 4, dtype=F64)
    out = m.encode(LEFT, RIGHT, x, 0).sum()
    assert len(autograd.live_contexts) == 1
    out.backward()
    gc.collect()
    assert len(autograd.live_contexts) == 0
    out = m.encode(LEFT, RIGHT, x, 0).sum()  # never backpropagated: freed with its graph
    del out
    gc.collect()
    assert len(autograd.live_contexts) == 0


def test_no_grad_and_inference_mode_save_nothing():
    torch.manual_seed(0)
    m = Cell()
    x = torch.randn(7, 4, dtype=F64, requires_grad=True)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = m.encode(LEFT, RIGHT, x, 0)
        assert not out.requires_grad and out.grad_fn is None
        assert len(autograd.live_contexts) == 0


def test_nothing_requires_grad_gives_a_plain_result():
    @recompile.function(mode="sequential")
    def f(x):
        return torch.tanh(x) * 2

    out = f(torch.ones(3))
    assert not out.requires_grad
    assert f.stats["backwards"] == 0


def test_retain_graph_keeps_a_calls_saved_values_and_a_backward_after_the_last_is_refused_clearly():
    torch.manual_seed(0)
    m = Cell()
    out = m.encode(LEFT, RIGHT, torch.randn(7, 4, dtype=F64), 0).sum()
    out.backward(retain_graph=True)
    first = {k: p.grad.clone() for k, p in m.named_parameters()}
    out.backward()  # (the second, as eager code would: every gradient twice)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[k])
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


def tree_energy(left, right, x, w, i):
    if left[i] < 0:
        return torch.tanh(x[i] @ w)
    return torch.sigmoid(tree_energy(left, right, x, w, left[i]) * tree_energy(left, right, x, w, right[i]))


def dropped(x):
    return (torch.nn.functional.dropout(x, 0.5, training=True) * x).exp().sum()


@pytest.mark.filterwarnings("ignore:recompile. a differentiable backward")
@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_higher_order_gradients_match_eager(mode):
    """create_graph=True runs the call again where torch.autograd records it: double backward, gradgradcheck
    and torch.func.grad give eager's values (a random draw as the forward drew it)."""
    f = recompile.function(tree_energy, mode=mode)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 3, generator=g, dtype=F64), torch.randn(3, dtype=F64, generator=g)
    args = (LEFT, RIGHT)

    def second(fn, x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        gx, gw = torch.autograd.grad(fn(*args, x, w, 0), (x, w), create_graph=True)
        return torch.autograd.grad((gx ** 2).sum() + gw.sum(), (x, w))

    for got, want in zip(second(f, x, w), second(tree_energy, x, w)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.func.grad(lambda w: f(*args, x, w, 0))(w),
                               torch.func.grad(lambda w: tree_energy(*args, x, w, 0))(w))
    assert torch.autograd.gradgradcheck(lambda w: f(*args, x, w, 0), (w.clone().requires_grad_(),))
    d = recompile.function(dropped, mode=mode)
    xd = x.clone().requires_grad_()
    torch.manual_seed(1)
    (got,) = torch.autograd.grad(torch.autograd.grad(d(xd), xd, create_graph=True)[0].sum(), xd)
    torch.manual_seed(1)
    (want,) = torch.autograd.grad(torch.autograd.grad(dropped(xd), xd, create_graph=True)[0].sum(), xd)
    torch.testing.assert_close(got, want)


def test_a_differentiable_backward_warns_once_that_the_call_runs_again(monkeypatch):
    monkeypatch.setattr(autograd, "_warned_replay", set())  # (another test may have warned of this function)
    f = recompile.function(tree_energy, mode="sequential")
    x, w = torch.ones(7, 3, dtype=F64), torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.warns(UserWarning, match="runs the call again on the batched runtime") as seen:
        for _ in range(2):
            torch.autograd.grad(f(LEFT, RIGHT, x, w, 0), w, create_graph=True)
    assert len([m for m in seen if "runs the call again" in str(m.message)]) == 1


def test_a_differentiable_backward_of_a_call_that_changes_values_in_place_is_refused_clearly():
    @recompile.function(mode="sequential")
    def f(x, buf):
        v = buf * 1.0
        v[0] = 1.0  # (``v += 1.0`` or ``v.add_(1.0)`` of a v the frame made is written out of place:
        return (x * v).sum()  # ``passes.fresh``)

    x = torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match='changes values in place.*mode="batched"'):
        torch.autograd.grad(f(x, torch.zeros(3, dtype=F64)), x, create_graph=True)


def test_a_differentiable_backward_of_a_call_that_changes_its_argument_is_eagers():
    """A call that changes a tensor its caller holds runs, with gradients on, as batched mode runs one
    instance (its change carries its gradient there): its double backward is eager's."""
    def bump(x, buf):
        buf += x
        return (x * buf).sum()

    f = recompile.function(bump, mode="sequential")
    got, want = [], []
    for fn, out in ((f, got), (bump, want)):
        x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
        (g,) = torch.autograd.grad(fn(x, torch.ones(3, dtype=F64)), x, create_graph=True)
        out.extend([g, *torch.autograd.grad(g.pow(2).sum(), x)])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_gradients_accumulate_across_calls_like_pytorch():
    torch.manual_seed(0)
    m = Cell()
    x = torch.randn(7, 4, dtype=F64, requires_grad=True)
    m.encode(LEFT, RIGHT, x, 0).sum().backward()
    once = x.grad.clone()
    m.encode(LEFT, RIGHT, x, 0).sum().backward()
    torch.testing.assert_close(x.grad, 2 * once)


def test_gradcheck_passes_through_a_compiled_call():
    @recompile.function(mode="sequential")
    def f(x, n):
        h = x * 0
        for t in range(n):
            h = torch.tanh(h + x[t])
        return h

    x = torch.randn(4, 3, dtype=F64, requires_grad=True, generator=torch.Generator().manual_seed(0))
    assert torch.autograd.gradcheck(lambda x: f(x, 4), (x,))


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()

    @recompile.function(mode="sequential")
    def forward(self, x):
        return torch.tanh(self.lin(x)).sum()


def test_the_gradient_goes_to_the_weight_the_forward_used():
    """A module's weight reassigned between the forward and the backward (as torch.func.functional_call
    does): the gradient goes to the weight the call used, as in eager code."""
    m = Projection()
    used = m.lin.weight
    x = torch.ones(4, 3, dtype=F64)
    out = m(x)
    m.lin.weight = nn.Parameter(used.detach().clone())
    out.backward()
    want = torch.autograd.grad(torch.tanh(torch.nn.functional.linear(x, used, m.lin.bias)).sum(), used)[0]
    torch.testing.assert_close(used.grad, want)
    assert m.lin.weight.grad is None


def scaled(x, w):
    return (x @ w).tanh().sum()


@pytest.mark.filterwarnings("ignore:recompile. a differentiable backward")
def test_a_differentiable_backward_reads_the_sources_the_forward_read():
    """The replay reads what is there now: a weight changed in place, or a parameter functional_call gave
    back, would give a wrong gradient; it raises instead."""
    f = recompile.function(scaled, mode="sequential")
    x, w = torch.ones(2, 3, dtype=F64), torch.ones(3, dtype=F64, requires_grad=True)
    y = f(x, w)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, w, create_graph=True)
    m = Projection()  # (and a parameter functional_call gave back is the one the call used again)
    params = {k: (v.detach() * 2).requires_grad_() for k, v in m.named_parameters()}
    x = torch.randn(4, 3, dtype=F64)
    out = torch.func.functional_call(m, params, (x,))
    (g,) = torch.autograd.grad(out, params["lin.weight"], create_graph=True)
    w = params["lin.weight"].detach().requires_grad_()
    (want,) = torch.autograd.grad(torch.tanh(torch.nn.functional.linear(x, w, params["lin.bias"])).sum(), w)
    torch.testing.assert_close(g, want)
    assert g.requires_grad
