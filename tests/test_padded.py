"""Each instance's value of its own length along a dim that is not its first (runtime/padded.py): a text CNN's
``self.embed(words[:n]).t().unsqueeze(0)``, its convolutions, pooling and reductions, run once over the padded
values.

Each function runs through ``recompile.vmap`` over stretches of different lengths (1 to 7) and is compared with
the plain function per instance (float64: values, the parameters' gradients and the input's): ``compare`` of
test_row_wise. Per-instance ops are an error unless a test says otherwise.
"""

import random
import re

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import config
from recompile.runtime import padded
from test_row_wise import HIDDEN, LENGTHS, Model, compare, inputs


@pytest.fixture(autouse=True)
def every_op_batched(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")


def text_cnn(m, words, x, n):
    a = m.embed(words[:n]).t().unsqueeze(0)  # (1, EMBED, n)
    return F.relu(m.conv(a)).max(dim=2)[0].squeeze(0) + torch.tanh(m.strided(a)).amax(-1)[0]


def kim_with_conv2d(m, words, x, n):
    f = F.relu(m.conv2d(m.embed(words[:n]).unsqueeze(0).unsqueeze(1))).squeeze(3)  # (1, HIDDEN, n + 1)
    return F.max_pool1d(f, f.size(2)).squeeze(2)[0] + F.adaptive_avg_pool1d(f, 1).view(-1)


def functional_forms(m, words, x, n):
    a = torch.transpose(x[:n], 0, 1)  # (3, n)
    c = F.conv1d(a, m.conv.weight[:, :3], None, 1, "same")
    d = F.conv1d(a[None], m.conv.weight[:2, :3], m.conv.bias[:2], padding=2, dilation=2)
    pooled = F.max_pool1d(F.gelu(c) * 2.0 - 1.0, 1) + F.avg_pool1d(c, kernel_size=1)
    return pooled.sum(-1) + d.mean(dim=-1).sum() + torch.softmax(c, 1).mul(c).sum(1) + F.log_softmax(c, 0).sum(1)


def moves_and_indices(m, words, x, n):
    a = x[:n].t()  # (3, n)
    b = a[None].permute(0, 2, 1).movedim(1, 2)  # (1, 3, n)
    c = b[0].unsqueeze(2).swapaxes(1, 2).squeeze(1)  # (3, n)
    e = c[:, None][:2][..., 0, :].contiguous()  # (2, n)
    back = e.T.sum(0)  # (the rows' dim first again: Rows)
    return back + torch.squeeze(c.unsqueeze(0), 0).sum(dim=1)[:2] + e.size(1) + e.shape[0] + e.dim() + e.ndim + \
        torch.ones((), dtype=e.dtype, device=e.device)


def elementwise_with_shared_values(m, words, x, n):
    a = x[:n].t()  # (3, n)
    y = (a + m.w[:, :1].t().t()[:3]) * 2.0 - torch.sigmoid(a) + a.neg().abs().clamp(max=0.9) + 1.0 - a
    z = F.leaky_relu(y, 0.1) + y.relu() * m.w[:3, :1] + (y / 2.0) - (3.0 * y)
    return z.sum(1) + z.mean(0).sum() + z.amin(1) + z.max(0).values.sum()


def whole_reductions(m, words, x, n):
    a = x[:n].t() * m.w[:3, :1]  # (3, n)
    return a.sum() + a.mean() + a.max() + a.amin() + torch.max(a) + a.mean(1).sum()


def spreads_and_positions(m, words, x, n):
    a = x[:n].t() * m.w[:3, :1]  # (3, n)
    return a.std(1, correction=0) + a.var(-1, unbiased=False) + torch.std(a, 1, False, True)[:, 0] + a.var(0).sum() + \
        (a + 3.0).prod(1) + a.nanmean(1) + (a.argmax(1) + a.argmin(dim=1) + (a > 0.7).any(1) + a.all(-1)).double()


def matmul_by_shared_matrices(m, words, x, n):
    a = x[:n].t()  # (3, n)
    return (m.w[:3, :3] @ a).sum(-1) + torch.matmul(a.t(), m.w[:3]).sum(0)[:3] + \
        F.linear(a.unsqueeze(-1), m.w[:1, :1]).sum(1).squeeze(-1)


def transformer_encoders(m, words, x, n):
    xs = m.embed(words[:n])[:, :4]  # (n, 4)
    first = m.encoders(xs[None]).mean(1)[0]  # (batch first: (1, n, 4))
    return first + m.encoder(xs).sum(0) + m.encoder(xs.unsqueeze(1))[-1, 0] + m.encoders(xs).amax(0)


def batch_first_rnn(m, words, x, n):
    out, h = m.first_gru(m.embed(words[:n])[None])  # ((1, n, HIDDEN), (1, 1, HIDDEN))
    return out[0, -1] + h[:, 0].sum(0) + out[0, 0] * out.sum(1)[0] + out[:, 1:].sum(1)[0]


def stacked_along_a_later_dim(m, words, x, n):
    hs = []
    for t in range(n):
        hs.append(torch.tanh(x[t] * 2.0))
    return torch.stack(hs, dim=1).sum(1) + torch.stack(hs, -1).amax(-1) + torch.stack([x[0], x[1]], 1).sum(1)


def self_attention(m, words, x, n):
    xs = m.embed(words[:n])[None]  # (1, n, EMBED)
    out, weights = m.attend(xs, xs, xs)
    ys = x[:n]  # (n, 3), unbatched
    both, _ = m.attend_x(ys, ys * 2.0, ys, average_attn_weights=False)
    alone = m.attend_x(ys, ys, ys, need_weights=False)[0]
    return out.mean(1)[0] + both.amax(0).sum() + alone.sum(0).sum()


def attention_weights(m, words, x, n):
    xs = m.embed(words[:n])[None]
    _, weights = m.attend(xs, xs, xs)  # (1, n, n): each instance's own view
    _, each = m.attend_x(x[:n], x[:n], x[:n], average_attn_weights=False)  # (3, n, n)
    return weights.sum((1, 2)) * 2.0 + each.amax((0, 1))[:1]


def padded_to_one_length(m, words, x, n):  # (each stretch padded to one length: one tensor of them)
    a = F.pad(x[:n], (0, 0, 0, 7 - n))  # (7, 3): zeros past each end
    b = F.pad(m.embed(words[:n]).sum(1), (1, 8 - n), value=-1.0)  # (10,): a left pad they share, -1 past each end
    c = F.pad(x[:n].sum(1), (0, 4 - n))  # (4,): a negative pad crops a longer stretch
    d = F.pad(torch.tanh(x[:n]), (1, 2, 0, 7 - n), value=0.5)  # (7, 6): the other dim's pads shared
    return torch.cat([a.flatten(), b, c, d.flatten()])


def joined_with_zeros_to_one_length(m, words, x, n):  # (zeros of each instance's own length: one tensor's rows)
    a = torch.cat([torch.tanh(x[:n]), x.new_zeros(7 - n, 3)])  # (7, 3)
    b = torch.cat([x[:n].sum(1), torch.ones((7 - n,), dtype=x.dtype), torch.zeros(n, dtype=x.dtype)])  # (7 + n,)
    h = torch.sin(x[:n])
    c = torch.cat([h, h.new_ones(7 - n, 3)]) + h.new_zeros(3)  # (a stretch's new tensors: its dtype and device)
    return a.flatten() * 2.0 + b.sum() + c.flatten()


def test_attention_weights_are_each_instances_own_view(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    counts = compare(attention_weights)
    assert "MultiheadAttention" not in counts  # (the attention once; its (n, n) weights read per instance)


def gated_and_normalized(m, words, x, n):
    y = m.frozen_norm(m.conv(m.embed(words[:n]).t()[None]))  # (1, HIDDEN, n)
    gate, value = y.chunk(2, dim=1)
    first, second = torch.split(y, [1, HIDDEN - 1], 1)
    return (torch.sigmoid(gate) * value).sum(-1)[0] + F.glu(y, 1).amax(-1)[0] + first.sum() + second.mean()


@pytest.mark.parametrize("fn", [text_cnn, kim_with_conv2d, transformer_encoders, stacked_along_a_later_dim,
                                self_attention, gated_and_normalized, batch_first_rnn, functional_forms,
                                moves_and_indices, elementwise_with_shared_values, whole_reductions,
                                spreads_and_positions, matmul_by_shared_matrices, padded_to_one_length,
                                joined_with_zeros_to_one_length])
def test_ops_on_values_of_their_own_length_along_a_later_dim_run_once(fn):
    assert compare(fn) == {}


@pytest.mark.parametrize("share", [0.0, 100.0])  # (never, always laid end to end)
@pytest.mark.parametrize("fn", [text_cnn, kim_with_conv2d, functional_forms])
def test_convolutions_over_sequences_padded_or_laid_end_to_end_give_eagers_values(fn, share, monkeypatch):
    monkeypatch.setattr(padded, "_PACKED_SHARE", share)
    assert compare(fn) == {}


def log_of_padding(m, words, x, n):
    return torch.log(x[:n].t()).sum(1)  # (log is not finite at every input: per instance)


def divided_by_them(m, words, x, n):
    a = x[:n].t()
    return (1.0 / a).sum(1) + (a / (a + 1.0)).sum(1)


def too_short_for_the_kernel(m, words, x, n):
    return F.conv1d(x[:n].t(), m.conv.weight[:, :3]).sum(-1)  # (a stretch of 1 or 2: an empty output)


@pytest.mark.parametrize("fn", [log_of_padding, divided_by_them])
def test_ops_not_finite_everywhere_run_per_instance_with_eagers_values(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    assert compare(fn) != {}


def test_a_convolution_with_an_empty_output_raises_as_eager(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    model = Model().double()
    words, x = inputs()
    with pytest.raises(RuntimeError) as eager:
        too_short_for_the_kernel(model, words[2], x[2], int(LENGTHS[2]))
    with pytest.raises(RuntimeError) as got:
        recompile.vmap(recompile.function(too_short_for_the_kernel), in_dims=(None, 0, 0, 0))(model, words, x,
                                                                                            LENGTHS)
    assert str(eager.value) in str(got.value)


def test_past_each_end_a_convolution_reads_zeros_and_reductions_read_nothing():
    t = torch.full((2, 3, 4), 7.0)
    seq = padded.Padded(t, 1, [2, 4])
    assert [v.shape for v in seq] == [(3, 2), (3, 4)]
    assert seq.zeros_past_ends()[0, :, 2:].eq(0).all() and seq.zeros_past_ends()[1].eq(7).all()
    got = padded.reduced(2, "max", padded.Padded(t.neg(), 1, [2, 4]), (), {})
    torch.testing.assert_close(got.tensor, torch.tensor([-7.0, -7.0]))
    taken = seq.taken([1])
    assert taken.lengths == [4] and taken[0].shape == (3, 4)


def log_softmax_squared(x, n, w):
    z = F.log_softmax(x[:n].t(), dim=1)  # (-inf past each end of the softmax's: zeros here)
    return (z * z).sum(1)


def times_a_shared_weight(x, n, w):
    a = x[:n].t()
    return (a * w).sum(1) + (w.t() @ a).sum(-1) + (a * w).sum() + (torch.tanh(a) * w).amax(1)


def conv2d_strided_across(x, n, w):
    y = x[:n][None, None]  # (1, 1, n, 3)
    k = w.view(1, 1, 3, 1).expand(2, 1, 3, 2)
    return F.conv2d(y, k, stride=(1, 2), padding=1).sum((0, 2, 3)) + \
        F.conv2d(y, k, dilation=(1, 2), padding=1).sum((0, 2, 3)) + F.conv2d(y, k, padding=(1, 0)).sum((0, 2, 3))


@pytest.mark.parametrize("fn", [log_softmax_squared, times_a_shared_weight, conv2d_strided_across])
def test_what_lies_past_an_end_reaches_no_value_and_no_gradient(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    _same_as_eager_with_nan_past_each_end(fn)


def _same_as_eager_with_nan_past_each_end(fn):
    _, x = inputs()
    for k, m in enumerate(LENGTHS.tolist()):
        x[k, m:] = float("nan")  # (eager never reads it)
    w = torch.randn(3, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xs, ws, xe, we = (t.clone().requires_grad_() for t in (x, w, x, w))
    got = recompile.vmap(recompile.function(fn), in_dims=(0, 0, None))(xs, LENGTHS, ws)
    got.sum().backward()
    want = torch.stack([fn(xe[k], int(m), we) for k, m in enumerate(LENGTHS.tolist())])
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(xs.grad, xe.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ws.grad, we.grad, rtol=1e-9, atol=1e-12)


def plus_a_vector_as_long_as_the_longest(x, n):
    return (x[:n].t() + torch.ones(7, dtype=x.dtype)).sum(1)  # (the shorter ones: sizes that do not match)


def added_with_alpha(x, n, op):
    return op(torch.ones(3, 1, dtype=x.dtype), x[:n].t(), alpha=2.0).sum(1)


def permuted_out_of_range(x, n):
    return x[:n].t().permute(0, 2)


def pooled_by_stride_zero(x, n):
    return F.max_pool1d(x[:n].t(), 2, 0)


def integers_max_pooled(x, n):
    y = x[:n].t().long()
    return F.max_pool1d(y, y.size(1)).view(-1)


@pytest.mark.parametrize("fn", [plus_a_vector_as_long_as_the_longest, permuted_out_of_range, pooled_by_stride_zero,
                                integers_max_pooled, added_with_alpha])
def test_forms_eager_refuses_or_reads_otherwise_give_eagers_result_or_error(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    _, x = inputs()
    extra = (torch.add,) if fn is added_with_alpha else ()
    try:
        want = torch.stack([fn(x[k], int(m), *extra) for k, m in enumerate(LENGTHS.tolist())])
    except Exception as error:  # (the first instance eager refuses)
        with pytest.raises(type(error)):
            recompile.vmap(recompile.function(fn), in_dims=(0, 0) + (None,) * len(extra))(x, LENGTHS, *extra)
        return
    got = recompile.vmap(recompile.function(fn), in_dims=(0, 0) + (None,) * len(extra))(x, LENGTHS, *extra)
    torch.testing.assert_close(got, want)


def encoded_and_indexed(x, n, w):
    xs = x[:n]  # (n, 3): the rows past each end NaN
    return _ENCODER(xs).sum(0) + _ENCODER(xs.unsqueeze(1)).sum((0, 1)) + (xs[None] * w[0]).sum((0, 1))


_ENCODER = torch.nn.TransformerEncoderLayer(3, 3, 8, 0.0).double()


def test_an_encoder_reads_nothing_past_an_end():
    _same_as_eager_with_nan_past_each_end(encoded_and_indexed)  # (every op batched)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in _ENCODER.parameters())


def test_a_chain_of_ops_on_padded_values_makes_no_instances_views_unless_one_is_read(monkeypatch):
    """The views of each instance's value are made when something first reads one (here a per-instance
    ``log``), not by every op of a chain that reads the padded tensor alone."""
    made = []
    fill = padded.Padded.fill
    monkeypatch.setattr(padded.Padded, "fill", lambda self: made.append(len(self.lengths)) or fill(self))
    assert compare(text_cnn) == {}
    assert made == []
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    assert "torch._VariableFunctionsClass.log" in compare(log_of_padding)
    assert made  # (the per-instance log read each instance's view)


def conv_output_flattened(m, words, x, n):
    y = F.relu(m.conv(m.embed(words[:n]).t().unsqueeze(0)))  # (a tensor of its own in eager: contiguous)
    return y.view(-1).sum() + x[:n].t().reshape(-1).sum()


def test_an_instances_value_read_alone_is_contiguous_where_eagers_is(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    compare(conv_output_flattened)


@recompile.function
def best_row(enc, h):
    s = enc @ h.view(-1)
    return s.argmax(), torch.argmin(s), enc.argmax()


def test_the_place_of_a_stretchs_extreme_is_one_op_over_the_padded_rows():
    rng = random.Random(5)
    encs = [torch.randn(rng.randint(1, 7), 6, dtype=torch.float64) for _ in range(9)]
    hs = [torch.randn(1, 6, dtype=torch.float64) for _ in encs]
    encs[2] = torch.full((3, 6), float("-inf"), dtype=torch.float64)  # (every place ties with the fill)
    got = recompile.map(best_row, encs, hs)
    for g, e, h in zip(got, encs, hs):
        assert [int(v) for v in g] == [int(v) for v in best_row.python(e, h)]
    assert not best_row.stats["per_instance"]


@recompile.function
def place_of_flags(enc):
    return (enc > 0).argmax()


def test_the_place_of_a_bool_stretchs_extreme_raises_eagers_error(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    encs = [torch.randn(k, 3, dtype=torch.float64) for k in (2, 4)]
    with pytest.raises(RuntimeError) as eager:
        place_of_flags.python(encs[0])
    with pytest.raises(RuntimeError, match=re.escape(str(eager.value).split("\n")[0])):
        recompile.map(place_of_flags, encs)
