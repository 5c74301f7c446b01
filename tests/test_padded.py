"""Each instance's value of its own length along a dim that is not its first (runtime/padded.py): a text CNN's
``self.embed(words[:n]).t().unsqueeze(0)``, its convolutions, pooling and reductions, run once over the padded
values.

Each function runs through ``recompile.vmap`` over stretches of different lengths (1 to 7) and is compared with
the plain function per instance (float64: values, the parameters' gradients and the input's): ``compare`` of
test_row_wise. Per-instance ops are an error unless a test says otherwise.
"""

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import config
from recompile.runtime import padded
from test_row_wise import LENGTHS, Model, compare, inputs


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


@pytest.mark.parametrize("fn", [text_cnn, kim_with_conv2d, transformer_encoders, stacked_along_a_later_dim, batch_first_rnn, functional_forms,
                                moves_and_indices, elementwise_with_shared_values, whole_reductions,
                                matmul_by_shared_matrices])
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
