"""Ops acting on each row of an instance's stretch alone, run once over every instance's rows (runtime/row_wise.py).

Each function runs through ``recompile.vmap`` over instances whose stretches (``words[:n]``, ``x[:n]``) differ in
length, and is compared with the plain function run per instance (float64: values, and the gradients of the
parameters and of the float input). Per-instance ops are an error here unless a test says otherwise.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import config
from recompile.runtime import row_wise, rows

VOCAB, EMBED, HIDDEN = 11, 5, 4
LENGTHS = torch.tensor([3, 7, 1, 5, 2, 7])


@pytest.fixture(autouse=True)
def every_op_batched(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.norm = nn.LayerNorm(HIDDEN)
        self.att = nn.Linear(HIDDEN, 1)
        self.cell = nn.LSTMCell(EMBED, HIDDEN)
        self.w = nn.Parameter(torch.randn(HIDDEN, 3))
        self.q = nn.Linear(EMBED, HIDDEN)
        self.lstm = nn.LSTM(EMBED, HIDDEN)
        self.gru = nn.GRU(EMBED, HIDDEN, num_layers=2)
        self.tags = nn.Linear(HIDDEN, 3)
        self.conv = nn.Conv1d(EMBED, HIDDEN, 3, padding=1)  # (test_padded's)
        self.strided = nn.Conv1d(EMBED, HIDDEN, 2, stride=2, padding=1, dilation=1)
        self.conv2d = nn.Conv2d(1, HIDDEN, (2, EMBED), padding=(1, 0))
        self.first_gru = nn.GRU(EMBED, HIDDEN, batch_first=True)
        self.attend = nn.MultiheadAttention(EMBED, 1, batch_first=True)
        self.attend_x = nn.MultiheadAttention(3, 3)
        self.frozen_norm = nn.BatchNorm1d(HIDDEN).eval()  # (by its running statistics)
        self.frozen_norm.running_mean.uniform_(-1, 1)
        self.frozen_norm.running_var.uniform_(0.5, 2)
        self.encoder = nn.TransformerEncoderLayer(EMBED - 1, 2, 8, dropout=0.0)
        self.encoders = nn.TransformerEncoder(nn.TransformerEncoderLayer(EMBED - 1, 2, 6, 0.0, batch_first=True), 2)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, VOCAB, (len(LENGTHS), 7), generator=g)
    x = torch.rand(len(LENGTHS), 7, 3, generator=g, dtype=torch.float64) + 0.5
    x[1:, 5:] = 0.0  # (padding past the shorter stretches: a log there would be -inf)
    return words, x


def compare(fn, per_instance=False):
    """``fn(m, words, x, n)`` through recompile.vmap against per instance: values and gradients (float64)."""
    torch.manual_seed(0)
    model = Model().double()
    words, x = inputs()
    compiled = recompile.function(fn)
    xs = x.clone().requires_grad_()
    got = recompile.vmap(compiled, in_dims=(None, 0, 0, 0))(model, words, xs, LENGTHS)
    got.sum().backward()
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    xw = x.clone().requires_grad_()
    want = torch.stack([fn(model, words[k], xw[k], int(LENGTHS[k])) for k in range(len(LENGTHS))])
    want.sum().backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-9, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-9, atol=1e-12)
    assert (xs.grad is None) == (xw.grad is None)
    if xw.grad is not None:
        torch.testing.assert_close(xs.grad, xw.grad, rtol=1e-9, atol=1e-12)  # (no NaN from the padding either)
    return dict(compiled.stats.get("per_instance", {}))


def mlp_then_max(m, words, x, n):
    return m.mlp(m.embed(words[:n])).max(0).values


def attention(m, words, x, n):
    hs = m.norm(m.mlp(m.embed(words[:n])))
    a = torch.softmax(m.att(hs).squeeze(-1), 0)
    return (a[:, None] * hs).sum(0)


def log_of_padded_input(m, words, x, n):
    return torch.log(x[:n]).sum(0) + x[:n].sqrt().mean(0)


def by_each_instances_query(m, words, x, n):
    xs = m.embed(words[:n])
    q = m.q(xs[0])  # (an instance's own vector, broadcast along its rows)
    scores = (m.q(xs) * q).sum(-1)
    return F.log_softmax(scores, dim=0)[0] + (torch.tanh(m.q(xs)) @ m.w).sum(0).sum()


def methods(m, words, x, n):
    xs = x[:n]
    y = xs.tanh().unsqueeze(1).squeeze(1).softmax(-1) + xs.log_softmax(dim=0) + xs.clamp(max=1.2).mul(2.0)
    return y.sum(-1).sum(0) + xs[:, None].sum(0).sum() + xs[..., :2].sum(0).sum() + xs[:, 1].mean(0)


def elementwise_with_shared_and_numbers(m, words, x, n):
    xs = m.embed(words[:n])
    y = torch.where(xs > 0, xs * 2.0, F.relu(xs) - m.q.weight[0]) / 3.0
    return F.linear(y, m.q.weight, m.q.bias).sum(0)


def dot_product_attention(m, words, x, n):
    hs = m.q(m.embed(words[:n]))
    a = torch.softmax(hs @ m.q(m.embed(words[0])), 0)  # (a score per row: by each instance's own query)
    return a @ hs + torch.matmul(a, x[:n]).sum() + a @ a


def norms_and_running_sums(m, words, x, n):
    xs = m.embed(words[:n])
    unit = F.normalize(xs, dim=-1)
    near = F.cosine_similarity(xs, m.embed(words[0])[None], dim=-1)  # (each instance's own word against its rows)
    lengths = xs.norm(dim=1) + torch.linalg.vector_norm(xs, 2, dim=-1) + torch.norm(xs, 2, 1) + xs.norm(1, -1)
    return unit.sum(0) + (near * lengths).sum() + xs.cumsum(1).sum(0) + torch.cumsum(xs, dim=0)[-1] + \
        torch.logsumexp(xs, 0) + xs.logsumexp(-1).mean() + x[:n].cumsum(0).sum(0).sum()


def products_by_shared_and_own(m, words, x, n):
    a, w = x[:n], m.w[:3, :2]  # (n, 3), a shared (3, 2)
    attended = F.softmax(a[0] @ a.t(), dim=-1) @ a  # (each instance's own query)
    return a.mm(w).sum(0) + torch.mm(a, w).amax(0) + a.matmul(w[:, 0]).sum() + \
        torch.einsum("nd,de->ne", a, w).mean(0) + torch.einsum("n d, d e -> n e", a, w).sum(0) + attended[:2] + \
        torch.bmm(a[-1].view(1, 1, -1), a.t().unsqueeze(0)).sum() + (a[-1] @ a.t().unsqueeze(0)).amax()


def marked_at_both_ends(m, words, x, n):
    a, bos = x[:n], m.w[:1, :3]  # (n, 3); a shared (1, 3), its gradient the model's
    marked = torch.cat([bos, a, bos * 2.0], 0)
    pieces = torch.cat((a[:1], a, a * 0.5), dim=0)
    return marked.sum(0) + marked[-1] * marked[0] + pieces.amax(0) + torch.cat([a, m.w[:2, :3]], -2).mean(0) + \
        len(marked)


def joined_row_by_row(m, words, x, n):
    a, b = m.embed(words[:n]), x[:n]  # (two stretches of the same lengths, from two tensors)
    both = torch.cat([a, b * 2.0], 1)
    return both.amax(0)[:3] + torch.stack([b, b.flip(0)], -1).sum((0, 2)) + torch.cat((b, b), dim=-1).mean(0)[1:4] + \
        torch.concat([b.unsqueeze(1), b.unsqueeze(1)], 1).sum(0)[1]


@pytest.mark.parametrize("fn", [mlp_then_max, attention, dot_product_attention, norms_and_running_sums,
                                log_of_padded_input, joined_row_by_row, products_by_shared_and_own,
                                marked_at_both_ends,
                                by_each_instances_query, methods, elementwise_with_shared_and_numbers])
def test_ops_on_each_row_run_once_over_the_rows_packed(fn):
    assert compare(fn) == {}


def packed_twice(m, words, x, n):
    xs = x[:n]
    return (xs * 2.0).sum(0) + (xs + 1.0).mean(0, keepdim=True)[0] + torch.sum(xs - 1.0, dim=0, keepdim=True)[0]


def test_the_rows_are_packed_once_and_a_packed_result_is_a_view():
    words, x = inputs()
    seq = rows.Rows([x[k, :m] for k, m in enumerate(LENGTHS.tolist())], x, None, [0] * 6, LENGTHS.tolist())
    flat = row_wise.packed(seq)
    assert row_wise.packed(seq) is flat and flat.shape == (int(LENGTHS.sum()), 3)
    torch.testing.assert_close(flat, torch.cat([x[k, :m] for k, m in enumerate(LENGTHS.tolist())]))
    out = row_wise.from_packed(6, flat * 2.0, seq).items
    again = row_wise.packed(out)
    assert again.data_ptr() == out.source.data_ptr()  # (laid end to end already: no copy)
    assert compare(packed_twice) == {}


def tagged(m, words, x, n):
    """PyTorch's LSTM tagger tutorial, written as it writes it: an ``nn.LSTM`` over the sentence as a batch of
    one (``view(n, 1, -1)``), a tag's score per word, the loss summed over the words."""
    embeds = m.embed(words[:n])
    lstm_out, _ = m.lstm(embeds.view(n, 1, -1))
    tag_space = m.tags(lstm_out.view(n, -1))
    tag_scores = F.log_softmax(tag_space, dim=1)
    return F.nll_loss(tag_scores, words[:n] % 3, reduction="sum")


def tagged_by_gru_averaged(m, words, x, n):
    out, h = m.gru(m.embed(words[:n]).view(-1, 1, EMBED), torch.zeros(2, 1, HIDDEN, dtype=torch.float64))
    scores = m.tags(out.reshape(n, HIDDEN))
    targets = torch.where(words[:n] > 9, -100, words[:n] % 3)  # (-100: ignored, and left out of the mean)
    losses = F.cross_entropy(scores, targets, reduction="none")
    return F.cross_entropy(scores, targets) + losses.sum(0) + h[-1, 0].sum()


def last_output_of_a_batch_of_one(m, words, x, n):
    out, (h, c) = m.lstm(m.embed(words[:n]).unsqueeze(1))
    return out[-1, 0] + h[0, 0] * c[0, 0] + out[0, 0, :2].sum()  # (a row of each stretch, then in it)


def outputs_read_by_index(m, words, x, n):
    out, _ = m.lstm(m.embed(words[:n]))  # (laid out when first read: here by an index)
    ends, _ = m.lstm(m.embed(words[:n]).view(n, 1, -1))
    return out[-1] + out[0, :2].sum() + ends[-1][0]


def reshaped_rows(m, words, x, n):
    xs = x[:n]
    return xs.reshape(-1, 3, 1).squeeze(-1).sum(0) + xs.view(n, 1, 3).view(n, -1).mean(0) + xs.reshape(-1, 3).sum(0)


def test_a_tagger_as_pytorchs_tutorial_writes_it_runs_once_over_the_words():
    assert compare(tagged) == {}
    assert compare(tagged_by_gru_averaged) == {}
    assert compare(reshaped_rows) == {}
    assert compare(last_output_of_a_batch_of_one) == {}
    assert compare(outputs_read_by_index) == {}


def rows_flattened(m, words, x, n):
    return x[:n].view(-1).cumsum(0).sum() + x[:n].reshape(n * 3, 1).sum()  # (across the rows: not each alone)


def rows_squeezed(m, words, x, n):
    return x[:n].squeeze(0).sum()  # (a stretch of one row loses its rows: not each row alone)


@pytest.mark.parametrize("fn", [rows_squeezed, rows_flattened])  # (``W @ xs.t()``: test_padded)
def test_ops_that_reach_across_the_rows_run_per_instance_with_eagers_values(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    assert compare(fn) != {}


def zero_dim_promotes(m, words, x, n):
    xs = x[:n].float()
    return (xs * x[0, 0]).sum(0).double()  # (a 0-d float64 tensor per instance gives way to float32 rows)


def test_an_instances_zero_dim_tensor_keeps_its_type_promotion(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    torch.manual_seed(0)
    words, x = inputs()
    got = recompile.vmap(recompile.function(zero_dim_promotes), in_dims=(None, 0, 0, 0))(None, words, x, LENGTHS)
    want = torch.stack([zero_dim_promotes(None, words[k], x[k], int(LENGTHS[k])) for k in range(6)])
    torch.testing.assert_close(got, want)


class Scaled:
    """A callable the program calls that cannot be hashed (``__eq__`` without ``__hash__``)."""

    def __init__(self, k):
        self.k = k

    def __eq__(self, other):
        return isinstance(other, Scaled) and other.k == self.k

    def __call__(self, a, b):
        return a * self.k + b


class Centred(nn.ReLU):
    def forward(self, x):
        return x - x.mean(0)  # (across the rows: not each row alone)


RELU_IN_PLACE, CENTRED = nn.ReLU(inplace=True), Centred()


def changed_in_place_by_a_module(m, words, x, n):
    z = x.detach() - 1.0  # (the values: each instance's relu_ of a view of one batched tensor moves its version)
    RELU_IN_PLACE(z[:n])
    return z.sum(0) * m.w[0, :3]


def changed_in_place_by_position(m, words, x, n):
    z = x - 1.0
    xs = z[:n]
    F.hardtanh(xs, -0.1, 0.1, True)
    return z.sum(0) + xs[0] + xs[-1]


def a_subclass_with_its_own_forward(m, words, x, n):
    return CENTRED(x[:n]).sum(0)


def a_shared_tensor_by_keyword(m, words, x, n):
    return torch.clamp(x[:n], min=m.w[:3, :3].unsqueeze(1)).sum(1).sum(0) + x[:n].mul(other=m.w[:1, :3]).sum(0)


def an_instances_value_the_op_does_not_broadcast(m, words, x, n):
    xs = x[:n]
    return xs.masked_fill(xs > 1.0, x[0, 0]).sum(0) + F.layer_norm(xs, (3,), x[1]).sum(0)


def indices_of_a_condition(m, words, x, n):
    return torch.where(x[:n] > 0.7)[0].sum().double() + Scaled(2.0)(1.0, x[:n]).sum()


@pytest.mark.parametrize("fn", [changed_in_place_by_a_module, changed_in_place_by_position,
                                a_subclass_with_its_own_forward, a_shared_tensor_by_keyword,
                                an_instances_value_the_op_does_not_broadcast, indices_of_a_condition])
def test_ops_that_change_in_place_reach_across_rows_or_take_no_rows_run_per_instance(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    compare(fn)


def integer_rows_summed(m, words, x, n):
    return (words.int()[:n] + 1).sum(0)  # (torch sums int32 to int64)


def test_integer_rows_summed_along_them_give_torchs_dtype(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    words, x = inputs()
    got = recompile.vmap(recompile.function(integer_rows_summed), in_dims=(None, 0, 0, 0))(None, words, x, LENGTHS)
    want = torch.stack([integer_rows_summed(None, words[k], x[k], int(LENGTHS[k])) for k in range(6)])
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["batched", "sequential", "threaded"])
def test_row_wise_programs_called_one_instance_at_a_time_in_every_mode_give_eagers_gradients(mode, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    torch.manual_seed(0)
    model = Model().double()
    words, x = inputs()
    for fn in (attention, log_of_padded_input, by_each_instances_query, methods, tagged, tagged_by_gru_averaged,
               reshaped_rows, last_output_of_a_batch_of_one, outputs_read_by_index):
        compiled = recompile.function(fn, mode=mode)
        for call in (compiled, fn):
            model.zero_grad()
            xs = x.clone().requires_grad_()
            out = torch.stack([call(model, words[k], xs[k], int(LENGTHS[k])) for k in range(len(LENGTHS))])
            out.sum().backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            if call is compiled:
                got, got_grads, got_x = out.detach(), grads, xs.grad
        torch.testing.assert_close(got, out.detach(), rtol=1e-9, atol=1e-12)
        assert got_grads.keys() == grads.keys()
        for k in grads:
            torch.testing.assert_close(got_grads[k], grads[k], rtol=1e-9, atol=1e-12)
        assert (got_x is None) == (xs.grad is None)
        if xs.grad is not None:
            torch.testing.assert_close(got_x, xs.grad, rtol=1e-9, atol=1e-12)


def dropped(m, x, y, n, drop):
    return torch.stack([drop(x[:n]).sum(0), F.dropout(y[:n] * 1.0, 0.5, m.training).sum(0)])


@pytest.mark.parametrize("training", [False, True])
def test_dropout_of_each_instances_rows_draws_one_mask_for_all_of_them_at_once(training):
    torch.manual_seed(3)
    model, drop = Model().double().train(training), nn.Dropout(0.5).train(training)
    _, x = inputs()
    xs, ys = x.clone().requires_grad_(), (x + 1.0).requires_grad_()
    f = recompile.function(dropped)
    got = recompile.vmap(f, in_dims=(None, 0, 0, 0, None))(model, xs, ys, LENGTHS, drop)
    assert f.stats.get("per_instance", {}) == {}
    gx, gy = torch.autograd.grad(got.sum(), (xs, ys))
    inside = (torch.arange(7) < LENGTHS[:, None]).unsqueeze(-1).double()
    if not training:
        torch.testing.assert_close(gx, inside.expand_as(gx))
    else:  # (each element dropped or kept and doubled: its gradient 0 or 2, as often as not)
        for g in (gx, gy):
            assert set(g.unique().tolist()) <= {0.0, 2.0} and not (g * (1 - inside)).any()
            assert 0.25 < float((g == 2.0).double().sum() / (inside.sum() * 3)) < 0.75
    torch.testing.assert_close(got[:, 0], (xs * gx).sum(1).detach())
    torch.testing.assert_close(got[:, 1], (ys * gy).sum(1).detach())


def rows_summed_by_einsum(m, words, x, n):
    a = x[:n]
    return torch.einsum("nd,nd->d", a, a) + torch.einsum("nd->d", a)  # (the rows' subscript summed over)


def joined_to_a_vector(m, words, x, n):
    return torch.cat([x[:n], m.w[0, :3]]).sum(0)


def mm_by_a_vector(m, words, x, n):
    return x[:n].mm(m.w[:3, 0])


def bmm_that_does_not_meet(m, words, x, n):
    return torch.bmm(x[:n][-1].view(1, 1, -1), x[:n].t().unsqueeze(0).expand(2, -1, -1))


def test_products_across_the_rows_batch_and_shapes_that_do_not_meet_raise_as_eager(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "ignore")
    assert compare(rows_summed_by_einsum) == {}  # (the rows padded with zeros: ``runtime.ragged_products``)
    for fn in (mm_by_a_vector, bmm_that_does_not_meet, joined_to_a_vector):
        with pytest.raises(RuntimeError) as eager:
            fn(Model().double(), None, inputs()[1][0], 3)
        with pytest.raises(eager.type):
            compare(fn)
