"""runtime/saved_versions.py: a batched run that changes values in place keeps each instance's saved values
apart, as eager code's own tensors are. Each program is run under ``recompile.vmap`` beside an eager loop over
its instances (float64: values and gradients), and where eager's backward refuses, so must the batched one."""

import gc
import weakref

import pytest
import torch

import recompile
from recompile.runtime import saved_versions

F64 = torch.float64
X = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
S = torch.tensor([1, -1, 1, -1, -1, 1])
W = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(1))


def eager_loop(fn, x, s, *rest):
    return torch.stack([fn(x[k], s[k], *rest) for k in range(len(s))])


def grads_of(run, fn, s, *rest):
    """The values and the gradients of the input and of each floating argument after it (the weights)."""
    x = X.clone().requires_grad_()
    rest = [r.clone().requires_grad_() if r.is_floating_point() else r for r in rest]
    out = run(fn, x, s, *rest)
    leaves = [x, *(r for r in rest if r.requires_grad)]
    return (out.detach(), *torch.autograd.grad(out.square().sum(), leaves))


def batched(fn, x, s, *rest):
    return recompile.vmap(recompile.function(fn), in_dims=(0, 0) + (None,) * len(rest))(x, s, *rest)


def as_eager(fn, s=S, *rest):
    want = grads_of(eager_loop, fn, s, *rest)
    got = grads_of(batched, fn, s, *rest)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def refused_as_eager(fn, s=S, *rest):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads_of(eager_loop, fn, s, *rest)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads_of(batched, fn, s, *rest)


# the instances that change the value in place do not need what the op saved of it: eager computes
def tanh_changed_where_unread(x, s):
    y = torch.tanh(x)  # (saves its result)
    if s > 0:
        y.mul_(2.0)
        return x.sum() * 3.0
    return y.sum()


def exp_changed_in_a_loop_where_unread(x, s):
    y = torch.exp(x)
    t = 0
    while t < s:
        y += 1.0
        t += 1
    return x.sum() if s > 0 else y.sum()


def product_saved_then_changed_where_unread(x, s, w):
    y = x * 1.0
    q = (y * x) @ w  # (saves y, for x's gradient)
    if s > 0:
        y[0] = 5.0
        return x.sum()
    return q.sum()


def changed_on_the_sides_copy_then_dropped(x, s):
    v = x * 1.0
    y = torch.tanh(x)
    if s > 0:
        v += v * v  # (the product saves the side's copy of v, changed after; the changed v is dropped)
        v = y.mean() * x
    return v.sum()


@pytest.mark.parametrize("fn", [tanh_changed_where_unread, exp_changed_in_a_loop_where_unread])
def test_a_change_in_place_by_some_instances_of_what_an_op_saved_keeps_eagers_gradient(fn):
    as_eager(fn)


def changed_in_a_loop_then_dropped_where_others_left(x, s):
    v = x * 0.25 + 0.25
    for i in range(3):
        v -= v.max()  # (the max saves v, one instance's row where the others left: changed, then dropped)
        v = x * -1.0 + 0.25 * i
        if (v * s).sum() > 0:
            break
    return v * v


@pytest.mark.parametrize("fn", [changed_on_the_sides_copy_then_dropped,
                                changed_in_a_loop_then_dropped_where_others_left])
def test_a_change_of_what_an_op_saved_then_dropped_keeps_eagers_gradient(fn):
    # (a side's copy written back, a loop's rows joined with those of the instances that left, lead the backward
    # to the node that saved the changed value, with a gradient of zeros for the instances that changed it:
    # eager's never reaches it)
    as_eager(fn)


def test_a_change_in_place_of_what_a_product_saved_by_instances_that_do_not_read_it_keeps_eagers_gradient():
    as_eager(product_saved_then_changed_where_unread, S, W)


# the instances that change it read what the op made from it: eager's backward refuses, and so does this one
def tanh_changed_then_read(x, s):
    y = torch.tanh(x)
    if s > 0:
        y.mul_(2.0)
    return y.sum()


def product_saved_then_changed_and_read(x, s, w):
    y = x * 1.0
    q = y * x  # (saves y, for x's gradient)
    if s > 0:
        y[0] = 5.0
    return q.sum()


def weighted_then_changed_and_read(x, s, w):
    y = x * 1.0
    q = y * w[0]  # (saves y for w's gradient: with w zero, y's own gradient is zero, w's is not)
    if s > 0:
        y[0] = 5.0
    return q.sum() + x.sum()


@pytest.mark.parametrize("fn, rest", [(tanh_changed_then_read, ()), (product_saved_then_changed_and_read, (W,)),
                                      (weighted_then_changed_and_read, (torch.zeros(3, 3, dtype=F64),))])
def test_a_change_in_place_of_what_an_op_saved_is_refused_where_the_instance_needs_it(fn, rest):
    refused_as_eager(fn, S, *rest)


def test_where_no_instance_changes_it_the_gradient_is_eagers():
    as_eager(tanh_changed_then_read, -torch.ones_like(S))


def changed_then_activated(x, s):
    v = x * 1.0
    if s > 0:
        v[0] = 2.0
    return torch.sigmoid(v)  # (saves its result)


def test_a_change_after_the_call_of_what_the_backward_saved_is_refused():
    """A change the runtime did not make (the caller's, after the call) is torch's refusal, as eager's."""
    x = X[0].clone().requires_grad_()
    out = changed_then_activated(x, S[0])
    out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    x = X.clone().requires_grad_()
    out = batched(changed_then_activated, x, S)
    out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_run_that_changes_values_in_place_leaves_nothing_alive():
    """The packed saved values hold no tensor that holds its node: nothing outlives the run's graph (no cycle
    the collector cannot see)."""
    gc.collect()
    gc.disable()
    try:
        x = X.clone().requires_grad_()
        out = batched(changed_then_activated, x, S)  # (sigmoid's result, which its node saved)
        refs = [weakref.ref(out)]
        del out
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_calls_that_change_values_in_place_keep_no_input_alive():
    """Nothing of a call outlives it: a table of what each callable asks (``facts.inplace_position``) once kept
    every batch of methods a call made, and with it the call's tensors and graph."""
    f = recompile.function(tanh_changed_where_unread)
    refs = []
    for _ in range(3):
        x = X.clone().requires_grad_()
        recompile.vmap(f)(x, S).sum().backward()
        refs.append(weakref.ref(x))
        del x
    gc.collect()
    assert all(r() is None for r in refs)


def test_under_the_callers_own_saved_tensor_hooks_those_hooks_see_the_saves():
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = X.clone().requires_grad_()
        out = batched(tanh_changed_where_unread, x, -torch.ones_like(S))
    assert seen
    out.sum().backward()
    torch.testing.assert_close(x.grad, 1.0 - torch.tanh(X).square())


def test_under_torch_func_grad_the_run_takes_no_hooks_and_computes():
    """torch.func's transforms refuse saved-tensor hooks: there torch checks versions as before (a change by
    some instances of what an op saved is refused for the whole group; docs/batching.md, Limits)."""
    installed = []

    def loss(x):
        installed.append(saved_versions.watching(True, 2).hooks)
        return fn(x, -torch.ones_like(S)).sum()

    fn = recompile.vmap(recompile.function(tanh_changed_where_unread))
    got = torch.func.grad(loss)(X.clone())
    assert installed == [None]
    torch.testing.assert_close(got, 1.0 - torch.tanh(X).square())


def test_a_second_derivative_through_a_run_that_changes_values_in_place_is_eagers():
    x = X.clone().requires_grad_()
    g, = torch.autograd.grad(eager_loop(tanh_changed_where_unread, x, S).square().sum(), x, create_graph=True)
    want = torch.autograd.grad(g.sum(), x)[0]
    x = X.clone().requires_grad_()
    g, = torch.autograd.grad(batched(tanh_changed_where_unread, x, S).square().sum(), x, create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(g.sum(), x)[0], want)


def test_a_saved_tensor_is_given_back_as_it_was_before_the_noted_writes():
    base = torch.arange(12, dtype=F64).reshape(4, 3)
    ledger = saved_versions.Ledger(4)
    packed = ledger.pack(base[1:])
    saved_versions._state.ledger = ledger
    try:
        with torch.enable_grad(), saved_versions.writing(base, torch.tensor([2]), instances=True):
            base[2] = -1.0
        with torch.enable_grad(), saved_versions.writing(base[3]):
            base[3].fill_(-2.0)
    finally:
        saved_versions._state.ledger = None
    assert base[2].eq(-1.0).all() and base[3].eq(-2.0).all()
    torch.testing.assert_close(ledger.unpack(packed), torch.arange(3, 12, dtype=F64).reshape(3, 3))
    base.add_(1.0)  # (a change no write noted: torch's refusal)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ledger.unpack(packed)
