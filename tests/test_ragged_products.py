"""runtime.ragged_products: attention over each sequence's own encoder states, spelled every way, batched,
with eager's values and gradients."""

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import diagnostics
from recompile.errors import PerInstanceWarning

H = 6


@pytest.fixture
def strict(monkeypatch):
    """Per-instance fallbacks raise: each spelling must batch whole."""
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "error")
    monkeypatch.setattr(diagnostics, "_warned", set())


# (enc: each instance's (length, H) states; h: its (1, H) query)
@recompile.function
def scores_by_at_then_sum(enc, h):
    a = F.softmax(enc @ h.t(), dim=0)
    return (a * enc).sum(0, keepdim=True)


@recompile.function
def scores_by_mv_then_at(enc, h):
    a = F.softmax(torch.mv(enc, h.view(-1)), dim=0)
    return a @ enc


@recompile.function
def scores_by_product_sum(enc, h):
    a = F.softmax((enc * h).sum(1), dim=0)
    return a @ enc


@recompile.function
def context_by_transposed_weights(enc, h):
    a = F.softmax(enc @ h.t(), dim=0)
    return a.t() @ enc


@recompile.function
def by_mm(enc, h):
    a = F.softmax(torch.mm(enc, h.t()), dim=0)
    return torch.mm(a.t(), enc)


@recompile.function
def by_mm_methods(enc, h):
    a = F.softmax(enc.mm(h.t()), dim=0)
    return a.t().mm(enc)


@recompile.function
def by_matmul(enc, h):
    a = F.softmax(torch.matmul(enc, h.t()).squeeze(1), dim=0)
    return torch.matmul(a, enc)


@recompile.function
def by_bmm(enc, h):
    s = torch.bmm(enc.unsqueeze(0), h.unsqueeze(2)).squeeze(0)
    a = F.softmax(s, dim=0)
    return torch.bmm(a.t().unsqueeze(0), enc.unsqueeze(0)).squeeze(0)


@recompile.function
def by_einsum(enc, h):
    a = F.softmax(torch.einsum("ld,kd->lk", enc, h), dim=0)
    return torch.einsum("lk,ld->kd", a, enc)


@recompile.function
def scores_as_a_row(enc, h):
    a = F.softmax(h @ enc.t(), dim=1)  # (1, length): the lengths along the result's second dim
    return a @ enc


SPELLINGS = [scores_by_at_then_sum, scores_by_mv_then_at, scores_by_product_sum, context_by_transposed_weights,
             by_mm, by_mm_methods, by_matmul, by_bmm, by_einsum, scores_as_a_row]


def _inputs(seed=0, count=9, dtype=torch.float64):
    rng = random.Random(seed)
    encs = [torch.randn(rng.randint(1, 7), H, dtype=dtype, requires_grad=True) for _ in range(count)]
    hs = [torch.randn(1, H, dtype=dtype, requires_grad=True) for _ in range(count)]
    return encs, hs


@pytest.mark.parametrize("fn", SPELLINGS, ids=lambda f: f.__name__)
def test_each_spelling_of_attention_over_own_lengths_batches_with_eagers_values_and_gradients(fn, strict):
    encs, hs = _inputs()
    fn.stats  # (a fresh count: each test's own function)
    got = recompile.map(fn, [torch.tanh(e) for e in encs], hs)
    want = [fn.python(torch.tanh(e), h) for e, h in zip(encs, hs)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    grads = torch.autograd.grad(sum((g * g).sum() for g in got), encs + hs)
    expected = torch.autograd.grad(sum((w * w).sum() for w in want), encs + hs)
    for g, w in zip(grads, expected):
        torch.testing.assert_close(g, w)
    assert not fn.stats["per_instance"]


@recompile.function
def rows_by_rows(enc, h):
    return (enc @ enc.t()).sum() + h.sum()  # (lengths along two dims of the product)


@recompile.function
def mixed_types(enc, h):
    return enc @ h.t().float()  # (float64 by float32: eager's own error)


def test_products_that_do_not_fit_run_per_instance_with_a_warning_or_raise_as_eager(monkeypatch):
    monkeypatch.setattr(diagnostics, "_warned", set())
    encs, hs = _inputs(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = recompile.map(rows_by_rows, encs, hs)
    for g, e, h in zip(got, encs, hs):
        torch.testing.assert_close(g, rows_by_rows.python(e, h))
    assert any(issubclass(w.category, PerInstanceWarning) for w in seen)
    with pytest.raises(RuntimeError):
        mixed_types.python(encs[0], hs[0])
    with pytest.raises(RuntimeError):
        recompile.map(mixed_types, encs, hs)


def test_a_query_per_row_of_each_instances_own_keeps_the_lengths():
    """``enc @ W_k`` with W_k (H, 3) each instance's own: each row by its instance's matrix, the lengths kept."""
    @recompile.function
    def projected(enc, w):
        return torch.tanh(enc @ w).sum(0)

    encs, _ = _inputs(2)
    ws = [torch.randn(H, 3, dtype=torch.float64, requires_grad=True) for _ in encs]
    got = recompile.map(projected, encs, ws)
    want = [projected.python(e, w) for e, w in zip(encs, ws)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    grads = torch.autograd.grad(sum(g.sum() for g in got), ws)
    expected = torch.autograd.grad(sum(w.sum() for w in want), ws)
    for g, w in zip(grads, expected):
        torch.testing.assert_close(g, w)
    assert not projected.stats["per_instance"]


@recompile.function
def matrix_product(enc, b):
    return enc @ b


@recompile.function
def mm_product(enc, b):
    return torch.mm(enc, b)


@recompile.function
def vector_by_method(enc, q):
    return torch.softmax(enc.mv(q), dim=0)


@pytest.mark.parametrize("fn", [matrix_product, mm_product], ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(1, H), (1, 1), (3, 2)])
def test_sizes_that_do_not_meet_raise_eagers_error_not_a_broadcast(fn, shape, monkeypatch):
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "ignore")
    encs, _ = _inputs(3)
    bs = [torch.randn(*shape, dtype=torch.float64) for _ in encs]
    with pytest.raises(RuntimeError) as eager:
        fn.python(encs[0], bs[0])
    with pytest.raises(RuntimeError) as batched:
        recompile.map(fn, encs, bs)
    assert str(batched.value).split("\n")[0] == str(eager.value).split("\n")[0]


def test_a_tensor_method_of_the_stretch_batches(strict):
    encs, hs = _inputs(4)
    got = recompile.map(vector_by_method, encs, [h.view(-1) for h in hs])
    for g, e, h in zip(got, encs, hs):
        torch.testing.assert_close(g, vector_by_method.python(e, h.view(-1)))
    assert not vector_by_method.stats["per_instance"]
