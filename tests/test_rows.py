"""Each instance's stretch of one tensor's rows, ``words[:n]`` with n per instance, batched (runtime/rows.py).

Every function below runs through ``recompile.vmap`` and is compared with the plain function run per instance
(float64: values, and gradients where there are any). Per-instance ops are an error here (``PER_INSTANCE``), so
each test also shows that the slice, the loop over it, its items and an embedding of it ran batched.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import config
from recompile.runtime import rows, sharing
from test_recurrent import EMBED, HIDDEN, VOCAB, Model, compare, lengths, sentences
from test_segments import switched


@pytest.fixture(autouse=True)
def every_op_batched(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")


def for_over_prefix(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for w in words[:n]:
        h, c = m.cell(m.embed(w), (h, c))
    return h * c


def embedded_first(m, words, n):
    xs = m.embed(words[:n])
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h, c = m.cell(xs[t], (h, c))
    return h + c


def for_over_embedded(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for x in m.embed(words[:n]):
        h, c = m.cell(x, (h, c))
    return h - c


def embedded_then_sliced(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for x in m.embed(words)[:n]:
        h, c = m.cell(x, (h, c))
    return h


@pytest.mark.parametrize("fn", [for_over_prefix, embedded_first, for_over_embedded, embedded_then_sliced])
def test_a_loop_over_each_instances_prefix_runs_as_one_rnn(fn):
    torch.manual_seed(0)
    compare(Model().double(), fn, (sentences(6, 7), lengths(3, 7, 0, 5, 1, 7)), (None, 0, 0))


def test_a_prefix_longer_than_the_rows_or_counted_from_the_end_is_cut_as_python_cuts_it():
    torch.manual_seed(1)
    compare(Model().double(), for_over_prefix, (sentences(5, 4), lengths(9, -1, -4, 2, -9)), (None, 0, 0))


def stretches_written(m, words, a, b):
    total = torch.zeros(EMBED, dtype=torch.float64)
    for x in m.embed(words[a:b]):
        total = total + torch.tanh(x) * 2.0
    return total * len(words[a:b])


def test_stretches_starting_apart_in_a_loop_run_as_one_sum():
    torch.manual_seed(2)
    model = Model().double()
    compare(model, stretches_written, (sentences(5, 8), lengths(0, 2, 1, 5, 3), lengths(4, 8, 1, 7, 6)),
            (None, 0, 0, 0))  # (each step's item of every stretch read at once: a sum of its step inputs)


def test_items_of_stretches_starting_apart_are_read_per_instance_where_the_program_changes_values():
    @recompile.function
    def bumped(xs, a, b):
        total = torch.zeros(3, dtype=torch.float64)
        for x in xs[a:b]:
            x.mul_(2.0)
            total = total + x
        return total

    xs = torch.randn(4, 6, 3, dtype=torch.float64)
    a, b = lengths(0, 1, 2, 0), lengths(3, 5, 6, 2)
    want_xs = xs.clone()
    want = torch.stack([bumped.python(want_xs[k], int(a[k]), int(b[k])) for k in range(4)])
    config.PER_INSTANCE = "allow"
    got = recompile.vmap(bumped)(xs, a, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xs, want_xs)  # (the rows each instance changed are the caller's, as in eager code)


def test_a_loop_over_prefixes_that_changes_its_items_changes_the_callers_rows():
    @recompile.function
    def scaled(xs, n):
        total = torch.zeros(3, dtype=torch.float64)
        for x in xs[:n]:
            x += 1.0
            total = total + x
        return total

    xs = torch.randn(4, 5, 3, dtype=torch.float64)
    n = lengths(2, 5, 0, 3)
    want_xs = xs.clone()
    want = torch.stack([scaled.python(want_xs[k], int(n[k])) for k in range(4)])
    config.PER_INSTANCE = "allow"  # (``zeros`` made per instance, for a program that changes values in place)
    got = recompile.vmap(scaled)(xs, n)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xs, want_xs)


def test_a_shared_tensors_prefixes_and_a_step_other_than_one():
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)

    @recompile.function
    def read(n):
        total = torch.zeros(3, dtype=torch.float64)
        for x in table[:n]:
            total = total * 0.5 + x
        return total

    n = lengths(0, 6, 2, 4)
    got = recompile.vmap(read)(n)
    want = torch.stack([read.python(int(k)) for k in n])
    torch.testing.assert_close(got, want)
    (grad,) = torch.autograd.grad(got.sum(), table)
    (want_grad,) = torch.autograd.grad(want.sum(), table)
    torch.testing.assert_close(grad, want_grad)

    @recompile.function
    def every_other(xs, n):
        return xs[:n:2].sum(0)

    xs = torch.randn(4, 6, 3, dtype=torch.float64)
    config.PER_INSTANCE = "allow"  # (a step other than 1: each instance slices its own)
    torch.testing.assert_close(recompile.vmap(every_other)(xs, n),
                               torch.stack([every_other.python(xs[k], int(n[k])) for k in range(4)]))


def test_an_index_out_of_the_table_in_rows_no_instance_reads_is_not_looked_up():
    torch.manual_seed(3)
    model = Model().double()
    words = sentences(4, 5)
    words[:, 3:] = -1  # (padding no instance reads: each instance's own lookup never sees it)
    config.PER_INSTANCE = "allow"
    compare(model, embedded_first, (words, lengths(3, 1, 2, 3)), (None, 0, 0))


def test_an_embedding_with_options_that_reads_differ_looks_up_each_instances_own():
    torch.manual_seed(4)
    model = Model().double()
    model.embed = nn.Embedding(VOCAB, EMBED, scale_grad_by_freq=True).double()
    config.PER_INSTANCE = "allow"
    compare(model, embedded_first, (sentences(4, 6), lengths(6, 1, 4, 2)), (None, 0, 0))


def test_an_embedding_with_sparse_gradients_looks_up_the_stretches_alone():
    """A sparse gradient has a row for each index looked up: the stretches' own indices, laid end to end, one
    lookup, none of the rows past an end (the gradient's rows are each instance's own lookup's)."""
    torch.manual_seed(5)
    model = Model().double()
    model.embed = nn.Embedding(VOCAB, EMBED, sparse=True).double()
    words, n = sentences(4, 6), lengths(6, 1, 0, 2)
    compare(model, embedded_first, (words, n), (None, 0, 0))
    got = recompile.vmap(recompile.function(embedded_first), in_dims=(None, 0, 0))(model, words, n)
    model.zero_grad()
    got.sum().backward()
    read = {int(w) for k in range(4) for w in words[k, :n[k]]}
    assert set(model.embed.weight.grad.coalesce().indices()[0].tolist()) == read


def test_rows_keep_where_they_lie_when_instances_are_taken(monkeypatch):
    monkeypatch.setattr(sharing.state, "fresh", True)  # (as in a run that changes nothing in place)
    xs = torch.arange(24.0).view(4, 6).clone()
    index = recompile.runtime.batch.from_items([slice(None, 5), slice(1, 3), slice(None, 0), slice(2, None)])
    found = rows.of(rows.stretch(4, recompile.runtime.batch.from_tensor(xs), index))
    assert found.starts == [0, 1, 0, 2] and found.lengths == [5, 2, 0, 4]
    assert not found.made and list(found) == [None] * 4  # (the views made when first read)
    assert not found.taken([3, 1]).made
    found.fill()
    for k, s in enumerate(index.items):
        assert found[k]._base is xs and torch.equal(found[k], xs[k][s])
    taken = found.taken([3, 1])
    assert taken.rows == [3, 1] and taken.lengths == [4, 2] and taken[0] is found[3]
    assert rows.has_index(taken, 1) is True and rows.has_index(taken, 4) is False
    torch.testing.assert_close(recompile.runtime.batch.tensor_of(rows.has_index(taken, 3)),
                               torch.tensor([True, False]))


def read_past_the_end(m, words, n, k):
    ys = m.embed(words[:n])
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(k):
        h = m.cell(ys[t], h)
    return h


def test_a_recurrent_loop_reading_past_a_stretch_raises_as_python_does():
    torch.manual_seed(5)
    model = Model(nn.GRUCell).double()
    f = recompile.function(read_past_the_end)
    words, k = sentences(3, 6), lengths(2, 2, 2)
    config.PER_INSTANCE = "allow"
    with pytest.raises(IndexError):
        read_past_the_end(model, words[0], 1, 2)
    with pytest.raises(IndexError):
        recompile.vmap(f, in_dims=(None, 0, 0, 0))(model, words, lengths(3, 1, 2), k)


def last_two(m, words, n):
    ys = m.embed(words[:n])
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    t = -1
    while t >= -2:  # (the stretch's last two rows, last first: counted from its end, not its source row's)
        h = m.cell(ys[t], h)
        t -= 1
    return h


def test_a_recurrent_loop_counting_from_the_end_of_each_stretch():
    torch.manual_seed(6)
    compare(Model(nn.GRUCell).double(), last_two, (sentences(4, 6), lengths(3, 4, 2, 6)), (None, 0, 0))


def test_a_stretch_changed_in_shape_in_place_is_read_per_instance():
    @recompile.function
    def reshaped(xs, n):
        ys = xs[:n]
        ys.unsqueeze_(-1)
        total = torch.zeros(3, 1, dtype=torch.float64)
        for y in ys:
            total = total + y
        return total + ys[0]

    xs = torch.randn(3, 5, 3, dtype=torch.float64)
    n = lengths(2, 5, 1)
    config.PER_INSTANCE = "allow"  # (a program that changes values in place: each instance's own views)
    want = torch.stack([reshaped.python(xs[k], int(n[k])) for k in range(3)])
    torch.testing.assert_close(recompile.vmap(reshaped)(xs, n), want)


def collected(xs, n):
    hs = []
    t = 0
    while t < n:
        hs.append(torch.tanh(xs[t]) * (t + 1))
        t += 1
    states = torch.stack(hs)
    low = torch.min(states, dim=0, keepdim=True)
    return (states.mean(0) + states.sum(dim=0) + states.max(0).values * low.values[0] + low.indices[0]
            + torch.amax(states, 0) - states.amin(0) + states[-1] * states[0] + states[-2:].sum(0)
            + states[1:].mean(0) * states[1:-1].sum(0))


def same_as_each(fn, xs, n):
    """``fn`` through recompile.vmap over rows ``xs`` and lengths ``n`` against each instance's own call:
    values, and the gradient of ``xs``."""
    got = recompile.vmap(recompile.function(fn))(xs, n)
    want = torch.stack([fn(xs[k], int(n[k])) for k in range(len(n))])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def test_each_instances_list_of_its_own_length_stacked_and_reduced_along_its_rows():
    xs = torch.randn(5, 6, 3, dtype=torch.float64, requires_grad=True)
    n = lengths(6, 2, 3, 6, 4)
    same_as_each(collected, xs, n)


def pooled(xs, n):
    hs = []
    for t in range(n):
        hs.append(xs[t] * 2.0)
    states = torch.stack(hs)
    return states.mean(0) + states.max(dim=0)[0] + states[-1]


def test_stacked_lists_of_their_own_lengths_run_batched_with_ties_and_infinities_as_eager():
    xs = torch.tensor([[[1.0, 5.0], [1.0, float("-inf")], [0.0, 0.0]],
                       [[2.0, 2.0], [2.0, 2.0], [9.0, 9.0]],
                       [[float("-inf"), 1.0], [0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    n = lengths(2, 2, 1)  # (an instance's ties; rows past an end hold larger values)
    same_as_each(pooled, xs, n)


def concatenated(xs, n):
    outs = []
    for t in range(n):
        outs.append(xs[t].unsqueeze(0) * (t + 1))
        if t == 1:
            outs.append(xs[:2] - 1.0)  # (two rows at once: each instance's tensors of one shape but dim 0)
    states = torch.cat(outs, 0)
    return states[-1] + states.sum(0) / states.shape[0] + states.ndim + torch.cat(outs).mean(0)


def test_each_instances_list_of_its_own_length_concatenated_with_its_shape():
    xs = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    n = lengths(5, 1, 2, 3)
    same_as_each(concatenated, xs, n)
    config.PER_INSTANCE = "allow"
    with pytest.raises(Exception) as eager:
        concatenated(xs[1], 0)
    with pytest.raises(eager.type, match="non-empty"):
        # (an empty list: torch.cat raises, as each instance's)
        recompile.vmap(recompile.function(concatenated))(xs, lengths(2, 0, 4, 1))
    with pytest.raises(TypeError):
        recompile.vmap(recompile.function(concatenated_along_a_float))(xs, n)  # (a dim of 0.0: torch refuses it)


def framed(xs, n):  # (each instance's stack of its own length between rows of its own and a shared row)
    hs = []
    for t in range(n):
        hs.append(torch.tanh(xs[t]))
    first = xs[0] * 2.0
    states = torch.cat([first[None], torch.stack(hs), first.unsqueeze(0), torch.ones(1, 3, dtype=xs.dtype)])
    return states.sum(0) + states.shape[0] + states[-2]


def test_a_cat_of_each_instances_stack_of_its_own_length_with_its_own_rows_is_one_cat():
    """``torch.cat([nt[None], torch.stack(hs), nt[None]])``: the stretches laid end to end with each instance's
    own rows and a shared one, as each instance's cat gives them (``join_along``, ``rows.concatenated``)."""
    xs = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    same_as_each(framed, xs, lengths(5, 1, 2, 3))


def joined_along_features(xs, n):  # (each instance's list of n states, cat along their last dim and their first)
    hs = []
    for t in range(n):
        hs.append(torch.tanh(xs[t]).view(1, 3) * (t + 1))
    return torch.cat(hs, dim=-1).sum(-1) + torch.cat(hs, 1)[0, -1] + torch.cat(hs, dim=-2).sum()


def test_a_cat_along_another_dim_of_each_instances_list_as_long_is_one_cat():
    """``torch.cat(hs, dim=-1)`` of each instance's own list (a node's children's states), every list as long: one
    stack of them, laid out as each instance's cat lays them (``batch_rules._cat_along``); lists of their own
    lengths each cat their own (torch's shapes differ), with the same values."""
    xs = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    same_as_each(joined_along_features, xs, lengths(3, 3, 3, 3))
    config.PER_INSTANCE = "allow"
    same_as_each(joined_along_features, xs, lengths(2, 3, 5, 1))


def concatenated_along_a_float(xs, n):
    outs = []
    for t in range(n):
        outs.append(xs[t].unsqueeze(0))
    return torch.cat(outs, 0.0).sum(0)


def test_an_empty_list_stacked_raises_as_torch_does_and_lists_alike_stack_as_one_tensor():
    f = recompile.function(pooled)
    config.PER_INSTANCE = "allow"
    with pytest.raises(RuntimeError, match="non-empty"):
        recompile.vmap(f)(torch.randn(3, 4, 2), lengths(2, 0, 4))
    config.PER_INSTANCE = "error"
    xs = torch.randn(3, 4, 2)
    torch.testing.assert_close(recompile.vmap(f)(xs, lengths(3, 3, 3)),
                               torch.stack([pooled(xs[k], 3) for k in range(3)]))


@pytest.mark.parametrize("kind, options", [(nn.LSTM, {}), (nn.GRU, {"num_layers": 2}),
                                           (nn.LSTM, {"bidirectional": True, "num_layers": 2}),
                                           (nn.RNN, {"batch_first": True})])
def test_an_rnn_module_over_each_instances_stretch_runs_once_over_them_packed(kind, options):
    torch.manual_seed(7)
    embed, rnn = nn.Embedding(VOCAB, EMBED).double(), kind(EMBED, HIDDEN, **options).double()
    start = torch.randn(rnn.num_layers * (2 if rnn.bidirectional else 1), HIDDEN, dtype=torch.float64)

    def read(words, n, h0):
        out, ends = rnn(embed(words[:n]), (h0, h0 * 2.0) if kind is nn.LSTM else h0)
        h = ends[0] if kind is nn.LSTM else ends
        return out.mean(0) + out[-1] + h[-1].sum() + out.max(0).values

    f = recompile.function(read)
    words, n = sentences(4, 6), lengths(6, 2, 5, 1)
    starts = torch.stack([start * k for k in range(4)])
    got = recompile.vmap(f)(words, n, starts)
    want = torch.stack([read(words[k], int(n[k]), starts[k]) for k in range(4)])
    torch.testing.assert_close(got, want)
    params = [*rnn.parameters(), embed.weight]
    for g, w in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(g, w)


def spreads(xs, n):
    s = xs[:n]
    return s.std(0) + s.var(0, unbiased=False) + torch.var(s, 0, correction=0, keepdim=True)[0] + \
        torch.std(s, 0, False) + s.var(0, True, True)[0] + s.std(dim=-2, correction=0) + s.var(-2, correction=0.5)


def products_and_nans(xs, n):
    s = xs[:n]
    return (s + 10.0).prod(0) + torch.prod(s + 9.0, 0, keepdim=True)[0] + s.nansum(0) + s.nanmean(dim=0) + \
        torch.nansum(s, -2)  # (no zero in any instance: a product with zeros in some runs per instance, below)


def positions(xs, n):
    s = xs[:n]
    return (s.argmax(0) + s.argmin(dim=0, keepdim=True)[0] * 10 + (s > 0).any(0) * 100 +
            torch.all(s > -1, 0) * 1000 + torch.argmax(s, 0) * 10000).double()


def nothing_needed(xs, n):
    s = xs[:n]
    return s.prod(0) + s.nansum(0) + s.any(0) + torch.all(s, 0)


def running(xs, n):
    s = xs[:n]
    return (s.cumprod(0) + torch.cummax(s, 0).values * s.cummin(dim=0)[0] + s.cummax(0).indices +
            torch.cumprod(s, dim=0) + s.cumsum(0)).sum(0)


@pytest.mark.parametrize("fn", [spreads, products_and_nans, positions, nothing_needed, running])
def test_spreads_products_and_positions_along_each_stretch_run_once_as_eager(fn):
    xs = torch.tensor([[[1.0, 5.0], [1.0, float("nan")], [3.0, 0.0], [-2.0, 1.0]],  # (ties, a nan)
                       [[2.0, 2.0], [2.0, 2.0], [9.0, 9.0], [9.0, 9.0]],  # (two rows alike: a std of 0)
                       [[float("-inf"), 1.0], [0.0, -3.0], [0.0, -3.0], [0.0, 0.0]],  # (an inf, its grad nan)
                       [[0.5, -0.5], [0.25, 4.0], [-1.0, 0.0], [7.0, -7.0]]], dtype=torch.float64,  # (one row)
                      requires_grad=fn is not nothing_needed)  # (its empty stretch: the values alone)
    n = lengths(3, 2, 4, 0 if fn is nothing_needed else 1)
    f = recompile.function(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = recompile.vmap(f)(xs, n)
        want = torch.stack([fn(xs[k], int(n[k])) for k in range(4)])
    said = [str(w.message) for w in caught if "degrees of freedom" in str(w.message)]
    assert len(said) == (4 if fn is spreads else 0)  # (one row, a correction of 1: eager's warning, from each)
    torch.testing.assert_close(got, want, equal_nan=True)
    if want.requires_grad:
        torch.testing.assert_close(torch.autograd.grad(got.nansum(), xs)[0], torch.autograd.grad(want.nansum(), xs)[0],
                                   equal_nan=True)


def spread_of_nothing_left(xs, n):
    s = xs[:n]
    return s.var(0, correction=2) + s.std(0, correction=1.5) * 0.0 + s.var(0, correction=1.5)


def product(xs, n):
    return xs[:n].prod(0) + torch.prod(xs[:n], 0)


@pytest.mark.parametrize("fn", [spread_of_nothing_left, product])
def test_where_nothing_is_left_or_a_zero_takes_torchs_other_way_gradients_are_eagers(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")  # (a product: the zeros of some instances, per instance)
    xs = torch.tensor([[[float("inf"), 1.0], [2.0, 1.0], [1.0, 3.0]],
                       [[0.0, 2.0], [1.0, 2.0], [5.0, 1.0]],
                       [[1.0, 4.0], [2.0, 5.0], [7.0, 6.0]]], dtype=torch.float64, requires_grad=True)
    for n in (lengths(2, 2, 1), lengths(2, 3, 3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = recompile.vmap(recompile.function(fn))(xs, n)
            want = torch.stack([fn(xs[k], int(n[k])) for k in range(3)])
        torch.testing.assert_close(got, want, equal_nan=True)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0],
                                   equal_nan=True)


def test_a_spread_of_each_stretch_differentiates_twice_as_eager():
    xs = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    n = lengths(4, 2, 3)
    f = recompile.vmap(recompile.function(spreads))
    torch.autograd.gradgradcheck(lambda v: f(v, n), (xs,))


def test_a_spread_of_an_integer_stretch_or_an_empty_one_raises_as_eager(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    ints, n = torch.arange(12).view(2, 3, 2), lengths(2, 3)
    with pytest.raises(RuntimeError) as eager:
        spreads(ints[0], 2)
    with pytest.raises(eager.type, match="std and var"):
        recompile.vmap(recompile.function(spreads))(ints, n)
    with pytest.raises(Exception) as eager:
        positions(ints[0], 0)
    with pytest.raises(eager.type):
        recompile.vmap(recompile.function(positions))(ints, lengths(2, 0))


def counted_and_zipped(xs, n):
    s = xs[:n]
    weighted = torch.stack([x * (i + 1) for i, x in enumerate(s)]).sum(0)
    paired = torch.stack([a * b for a, b in zip(s, s.flip(0))]).sum(0)
    return weighted + paired + sum(x for _, x in enumerate(s, 2))


def read_at_each_ones_own_place(xs, n):
    s = xs[:n]
    return s[len(s) - 1] * s[s.size(0) // 2] + s[-n] + s[n - 1] + s[torch.tensor(0)]


@pytest.mark.parametrize("fn", [counted_and_zipped, read_at_each_ones_own_place])
def test_comprehensions_over_enumerate_and_zip_and_a_place_per_instance_read_each_stretch_at_once(fn):
    xs = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
    n = lengths(6, 1, 3, 4)
    same_as_each(fn, xs, n)


TRANSITIONS = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


def crf_loss(xs, n):
    """A linear-chain CRF's negative log-likelihood, tags as the argmax of each row's first 4 values."""
    emits = xs[:n]
    tags = emits[:, :4].argmax(1)
    gold = emits[0, tags[0]] + emits[-1][tags[-1]] * 0.0
    for t in range(1, n):
        gold = gold + TRANSITIONS[tags[t - 1], tags[t]] + emits[t, tags[t]] + TRANSITIONS[tags[t], 0] * 0.5
    alpha = emits[0, :4]
    for t in range(1, n):
        alpha = torch.logsumexp(alpha.unsqueeze(1) + TRANSITIONS, 0) + emits[t, :4]
    return torch.logsumexp(alpha, 0) - gold + xs[n - 1, tags[n - 1]] + xs[tags[0], tags[-1]]


def test_a_crf_reads_each_instances_points_by_its_own_tags_in_one_index():
    xs = torch.randn(5, 7, 5, dtype=torch.float64, requires_grad=True)
    same_as_each(crf_loss, xs, lengths(7, 1, 4, 6, 2))


def at_a_place_from_a_branch(xs, n):
    i = n - 1 if n > 2 else 0  # (each instance's int, joined from two branches)
    return xs[:n][i] + xs[:n][i, 1]


def point_changed_in_place(x, n):
    r = x[n, n % 2]  # (eager's is a view of x: the change reaches x)
    r.add_(1.0)
    return x * 1.0


def test_a_place_from_a_branch_reads_as_eager_and_a_point_changed_in_place_changes_its_tensor(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    xs = torch.randn(4, 5, 2, dtype=torch.float64, requires_grad=True)
    same_as_each(at_a_place_from_a_branch, xs, lengths(5, 1, 3, 2))
    x, n = torch.zeros(3, 4, 2, dtype=torch.float64), lengths(0, 1, 2)
    want = torch.stack([point_changed_in_place(x.clone()[k], int(n[k])) for k in range(3)])
    torch.testing.assert_close(recompile.vmap(recompile.function(point_changed_in_place))(x.clone(), n), want)


def past_its_end(xs, n):
    s = xs[:n]
    return s[len(s)]


def by_a_mask(xs, n):
    s = xs[:n]
    return s[n > 2].sum()


def point_past_its_end(xs, n):
    s = xs[:n]
    return s[n, 0] + s[0, n]


def test_a_place_per_instance_past_an_end_raises_and_a_mask_selects_as_eager(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    xs, n = torch.randn(3, 5, 2, dtype=torch.float64), lengths(5, 2, 3)
    for fn in (past_its_end, point_past_its_end):
        with pytest.raises(IndexError):
            fn(xs[0], 5)
        with pytest.raises(IndexError):
            recompile.vmap(recompile.function(fn))(xs, n)
    torch.testing.assert_close(recompile.vmap(recompile.function(by_a_mask))(xs, n),
                               torch.stack([by_a_mask(xs[k], n[k]) for k in range(3)]))


def test_the_amax_of_an_inf_tying_with_the_rows_past_an_end_shares_its_gradient_as_eager():
    @recompile.function
    def largest(xs, n):
        hs = []
        for t in range(n):
            hs.append(xs[t] * 1.0)
        return torch.stack(hs).amax(0)

    xs = torch.tensor([[[1.0], [2.0]], [[float("-inf")], [7.0]]], dtype=torch.float64, requires_grad=True)
    n = lengths(2, 1)
    config.PER_INSTANCE = "allow"
    got = recompile.vmap(largest)(xs, n)
    want = torch.stack([largest.python(xs[k], int(n[k])) for k in range(2)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def test_an_rnn_module_given_a_state_over_stretches_of_a_shared_tensor_or_of_instances_taken():
    torch.manual_seed(8)
    gru = nn.GRU(EMBED, HIDDEN).double()
    shared = torch.randn(5, EMBED, dtype=torch.float64)
    h0 = torch.randn(1, HIDDEN, dtype=torch.float64)
    n = lengths(4, 2, 5)

    def of_shared(x, n, h0):
        _, h = gru(x[:n], h0)
        return h

    def in_a_loop(xs, n, h0):
        s = xs[:n]
        h = h0
        for k in range(n):  # (instances leave at their own steps: the stretches of the ones that stay)
            _, h = gru(s[k:], h)
        return h

    f = recompile.function(of_shared)
    torch.testing.assert_close(recompile.vmap(f, in_dims=(None, 0, None))(shared, n, h0),
                               torch.stack([of_shared(shared, int(k), h0) for k in n]))
    xs = torch.randn(3, 5, EMBED, dtype=torch.float64)
    g = recompile.function(in_a_loop)
    torch.testing.assert_close(recompile.vmap(g, in_dims=(0, 0, None))(xs, n, h0),
                               torch.stack([in_a_loop(xs[k], int(n[k]), h0) for k in range(3)]))


def enumerated_words(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    t = -1
    for t, w in enumerate(words[:n]):
        h = m.cell(m.embed(w) * (t + 1), h)
    return h * t


def test_a_loop_over_an_enumerated_stretch_runs_as_one_rnn_its_index_ending_as_pythons():
    torch.manual_seed(9)
    compare(Model(nn.GRUCell).double(), enumerated_words, (sentences(5, 6), lengths(6, 2, 0, 4, 1)), (None, 0, 0))


def reversed_words(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for w in reversed(words[:n]):
        h = m.cell(m.embed(w), h)
    return h


def flipped_embeddings(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for x in m.embed(words[:n]).flip(0):
        h = m.cell(x, h)
    return h


@pytest.mark.parametrize("fn", [reversed_words, flipped_embeddings])
def test_a_loop_over_each_instances_stretch_reversed_runs_as_one_rnn(fn):
    torch.manual_seed(10)
    compare(Model(nn.GRUCell).double(), fn, (sentences(5, 6), lengths(6, 2, 3, 4, 1)), (None, 0, 0))


def test_stretches_flipped_or_reversed_are_copies_as_eagers():
    @recompile.function
    def flips(xs, n, k):
        ys = xs[:n]
        a = torch.flip(ys, [0])
        b = ys.flip(dims=(0,))
        c = reversed(xs)
        d = xs[k:n].flip(0)
        return a.sum(0) + b[0] * 2.0 + c[0] + d.sum(0)

    xs = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    n, k = lengths(5, 1, 3, 2), lengths(5, 0, 1, 2)  # (stretches of none too, one at a row's end)
    got = recompile.vmap(flips)(xs, n, k)
    want = torch.stack([flips.python(xs[i], int(n[i]), int(k[i])) for i in range(4)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def tagged(m, words, tags, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for w, tag in zip(words[:n], tags[:n]):
        h = m.cell(m.embed(w), h)
        loss = loss + F.cross_entropy(h, tag)
    return loss


def test_a_tagger_stepping_over_words_and_tags_zipped_runs_batched():
    torch.manual_seed(11)
    model = Model(nn.GRUCell).double()
    words, tags = sentences(4, 5), torch.randint(0, HIDDEN, (4, 5))
    # (a ``for`` over a zip steps the cell as one RNN, as one over a range does)
    compare(model, tagged, (words, tags, lengths(5, 2, 0, 3)), (None, 0, 0, 0), expect_runs=True)


def flip_dims_keyword(xs, n):
    return xs[:n].flip(dims=0).sum(0)


def flip_of_an_int(xs, n):
    return torch.flip(xs[:n], 0).sum(0)


def flip_of_a_float(xs, n):
    return xs[:n].flip(0.0).sum(0)


def flip_of_floats(xs, n):
    return xs[:n].flip([0.0]).sum(0)


def flip_of_false(xs, n):
    return xs[:n].flip(False).sum(0)


def last_of_flipped(xs, n):
    return xs[:n].flip(0)[-1]


def flipped_twice(xs):
    return xs.flip(0, 1)


@pytest.mark.parametrize("fn", [flip_dims_keyword, flip_of_an_int, flip_of_a_float, flip_of_floats, flip_of_false])
def test_flips_of_stretches_refuse_the_forms_torch_refuses(fn):
    xs, n = torch.randn(3, 4, 2), lengths(4, 1, 3)
    config.PER_INSTANCE = "allow"
    with pytest.raises(TypeError):
        fn(xs[0], 4)
    with pytest.raises(TypeError):
        recompile.vmap(recompile.function(fn))(xs, n)


def test_flips_of_empty_stretches_and_of_two_dims_as_eager():
    xs = torch.randn(3, 4, 2)
    config.PER_INSTANCE = "allow"
    with pytest.raises(IndexError):
        recompile.vmap(recompile.function(last_of_flipped))(xs, lengths(0, 0, 0))
    torch.testing.assert_close(recompile.vmap(recompile.function(flipped_twice))(xs),
                               torch.stack([flipped_twice(x) for x in xs]))


@pytest.mark.parametrize("kind, options", [(nn.LSTM, {}), (nn.GRU, {}), (nn.RNN, {"nonlinearity": "relu"}),
                                           (nn.GRU, {"bias": False}), (nn.LSTM, {"num_layers": 2})])
def test_with_grad_a_one_layer_rnn_modules_steps_are_written_out_over_the_packed_rows(kind, options, monkeypatch):
    """Trained, a one-layer, one-direction module with biases over each instance's stretch steps as a cell of its
    parameters (``lazy_weights.module_steps``): eager's values and gradients, the module's final states in
    instance order; other modules, and runs without grad, run the module itself."""
    from recompile.runtime import lazy_weights
    stepped = []
    steps = lazy_weights.packed_steps
    monkeypatch.setattr(lazy_weights, "packed_steps", lambda *a: stepped.append(1) or steps(*a))
    torch.manual_seed(9)
    embed, rnn = nn.Embedding(VOCAB, EMBED).double(), kind(EMBED, HIDDEN, **options).double()

    def read(words, n):
        out, ends = rnn(embed(words[:n]))
        h = ends[0] if kind is nn.LSTM else ends
        return out.sum(0) * 0.5 + h[-1] * out[-1]

    f = recompile.function(read)
    words, n = sentences(4, 6), lengths(6, 2, 5, 1)
    got = recompile.vmap(f)(words, n)
    want = torch.stack([read(words[k], int(n[k])) for k in range(4)])
    torch.testing.assert_close(got, want)
    params = [*rnn.parameters(), embed.weight]
    for g, w in zip(torch.autograd.grad(got.sum(), params), torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(g, w)
    assert bool(stepped) is (rnn.num_layers == 1 and rnn.bias)
    stepped.clear()
    with torch.no_grad():
        torch.testing.assert_close(recompile.vmap(f)(words, n), want.detach())
    assert not stepped


def test_a_one_layer_rnn_module_given_states_of_two_layers_raises_as_torch_does():
    gru = nn.GRU(EMBED, HIDDEN).double()
    h0 = torch.zeros(2, HIDDEN, dtype=torch.float64, requires_grad=True)  # (two layers' worth: torch refuses)

    def read(xs, n, h0):
        return gru(xs[:n], h0)[1][0]

    xs = torch.randn(3, 5, EMBED, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Expected hidden size"):
        read(xs[0], 3, h0)
    with pytest.raises(RuntimeError, match="Expected hidden size"):
        recompile.vmap(recompile.function(read), in_dims=(0, 0, None))(xs, lengths(3, 5, 1), h0)


def scored_rows(m, words, n, tags):
    out, _ = m.lstm(m.proj(m.embed(words[:n])).view(n, 1, -1))
    return F.nll_loss(F.log_softmax(m.out(out.view(n, -1)), dim=1), tags[:n], reduction="sum")


def test_a_chain_of_row_ops_makes_no_instance_view(monkeypatch):
    """``words[:n]``, its embedding, a linear map, ``view``, an LSTM, its outputs scored and their loss summed:
    each op reads where the rows lie, so no instance's view is made (``Rows.fill``) in the whole chain."""
    torch.manual_seed(3)
    model = Model().double()
    model.lstm = nn.LSTM(EMBED, HIDDEN).double()
    model.out = nn.Linear(HIDDEN, 5).double()
    fills = []
    made = rows.Rows.fill
    monkeypatch.setattr(rows.Rows, "fill", lambda seq: fills.append(seq.made) or made(seq))
    tags = torch.randint(0, 5, (4, 7))
    with torch.no_grad():
        got = recompile.vmap(recompile.function(scored_rows), in_dims=(None, 0, 0, 0))(
            model, sentences(4, 7), lengths(7, 2, 5, 3), tags)
    assert fills == []
    compare(model, scored_rows, (sentences(4, 7), lengths(7, 2, 5, 3), tags), (None, 0, 0, 0), expect_runs=None)
    want = torch.stack([scored_rows(model, w, n, t) for w, n, t in zip(sentences(4, 7), lengths(7, 2, 5, 3), tags)])
    torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-12)


def test_rows_of_the_same_lengths_share_their_index_tensors(monkeypatch):
    monkeypatch.setattr(rows, "_LAYOUTS", {})  # (a full cache is cleared by the next one: earlier tests' lengths)
    first = rows.layout_of([3, 1, 2])
    assert rows.layout_of((3, 1, 2)) is first and rows.layout_of([3, 1]) is not first
    k, i = first.where(torch.device("cpu"))
    assert k.tolist() == [0, 0, 0, 1, 2, 2] and i.tolist() == [0, 1, 2, 0, 0, 1]
    assert first.mask(torch.device("cpu")).tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    seq = rows.packed_rows(3, torch.arange(6.0).view(6, 1), [3, 1, 2])
    assert seq.layout() is first and seq.counts() is first.counts


@pytest.mark.parametrize("laid", ["contiguous", "rows of a transpose"])
def test_gathered_rows_equal_two_indices(laid):
    source = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
    held = source if laid == "contiguous" else source.transpose(0, 1).contiguous().transpose(0, 1)
    r, t = torch.tensor([3, 0, 2, 2]), torch.tensor([5, 1, 0, 4])
    got = rows.gather_rows(held, r, t)
    torch.testing.assert_close(got, held[r, t])
    grid = rows.gather_rows(held, r[:, None].expand(-1, 2), torch.tensor([[0, 1]] * 4))
    torch.testing.assert_close(grid, held[r[:, None], torch.tensor([[0, 1]] * 4)])
    (g,) = torch.autograd.grad((got * got).sum() + grid.sum(), source)
    (want,) = torch.autograd.grad((held[r, t] ** 2).sum() + held[r[:, None], torch.tensor([[0, 1]] * 4)].sum(), source)
    torch.testing.assert_close(g, want)


def test_index_tensors_kept_from_an_inference_run_serve_a_run_with_grad():
    """The index tensors of a minibatch's lengths, made in a run under ``torch.inference_mode`` and kept, are not
    inference tensors: a training run of the same lengths saves them for its backward."""
    torch.manual_seed(6)
    model = Model().double()
    model.lstm = nn.LSTM(EMBED, HIDDEN).double()
    model.out = nn.Linear(HIDDEN, 5).double()
    words, n, tags = sentences(3, 6), lengths(3, 6, 2), torch.randint(0, 5, (3, 6))
    f = recompile.vmap(recompile.function(scored_rows), in_dims=(None, 0, 0, 0))
    rows._LAYOUTS.clear()
    with torch.inference_mode():
        evaluated = f(model, words, n, tags)
    compare(model, scored_rows, (words, n, tags), (None, 0, 0, 0), expect_runs=None)
    torch.testing.assert_close(f(model, words, n, tags).detach(), evaluated.clone())


def test_appended_rows_are_read_where_they_lie():
    # (three lists: rows 0-2 the first step's items of instances 0, 2 and 1, rows 3-4 the second's of 0 and 2)
    packed = torch.arange(10.0).reshape(5, 2)
    lists = rows.Appended([[], [], []], packed, torch.tensor([0, 2, 1, 0, 2]), torch.tensor([0, 0, 0, 1, 1]),
                          [2, 1, 2], pending=True)
    lists.fill()
    assert [len(x) for x in lists] == [2, 1, 2] and torch.equal(lists[2][1], packed[4])
    assert lists.rows_at([0, 2, 1, 0, 2], [0, 0, 0, 1, 1]) is packed  # (laid out as they were appended)
    torch.testing.assert_close(lists.rows_at([1, 2, 0], [0, 1, 1]), packed[[2, 4, 3]])
    assert lists.rows_at([1], [1]) is None  # (instance 1's list holds one item)
    lists[0].append(packed[0])
    assert not lists.holds_its_rows_alone()  # (its readers then read the lists themselves)


class Kid:
    def __init__(self, x, children):
        self.x, self.children = x, children


def kid_tree(rng, depth=0):
    arity = 0 if depth >= 3 or (depth and rng.random() < 0.4) else rng.randint(1, 4)
    return Kid(torch.randn(3, generator=rng_torch(rng)), [kid_tree(rng, depth + 1) for _ in range(arity)])


def rng_torch(rng):
    return torch.Generator().manual_seed(rng.randrange(2 ** 31))


@recompile.function
def summed_over_kids(node, extra):
    hs = []
    for child in node.children:
        hs.append(summed_over_kids(child, extra))
    if extra:
        hs.append(node.x * 2.0)  # (a list that holds more than the loop's rows: each instance's own sum)
    s = sum(hs) if hs else node.x * 1.5
    return s * 0.5 + node.x


@pytest.mark.parametrize("extra", [False, True])
def test_the_sum_of_each_nodes_childrens_rows_adds_as_python_in_one_index_add(extra, monkeypatch):
    """``sum(hs)`` of the lists a loop over a node's children appended the calls' rows to (``rows.Appended``),
    on the side of an ``if hs`` that the nodes with children take (``Appended.taken``): one ``index_add`` of the
    rows (``batch_rules._summed_rows``), equal to Python's sum bit for bit in float32 (the same order of adds),
    gradients as eager's; with an item appended after the loop, each list is summed as it stands."""
    import random

    from recompile.runtime import batch_rules
    ran = []
    summed = batch_rules._summed_rows

    def spy(n, lists):
        out = summed(n, lists)
        ran.append(out is not NotImplemented)
        return out

    monkeypatch.setattr(batch_rules, "_summed_rows", spy)
    rng = random.Random(4)
    trees = [kid_tree(rng) for _ in range(6)]
    for t in trees:
        for node in _walk(t):
            node.x.requires_grad_(True)
    got = recompile.map(summed_over_kids, trees, [extra] * len(trees))
    want = [summed_over_kids.python(t, extra) for t in trees]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    leaves = [node.x for t in trees for node in _walk(t)]
    for a, b in zip(torch.autograd.grad(sum(g.sum() for g in got), leaves),
                    torch.autograd.grad(sum(w.sum() for w in want), leaves)):
        torch.testing.assert_close(a, b)
    assert any(ran) != extra  # (rows summed at once only while the lists hold just them)


def _walk(node):
    yield node
    for c in node.children:
        yield from _walk(c)


W4 = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


def summed_children(x, kids):
    """A leaf's one row of zeros, or its children's rows: each instance's stretch joined from the two sides, then
    reduced with keepdim, multiplied, and x's row repeated to each instance's own count."""
    if len(kids) == 0:
        hs = x.new_zeros(1, 4)
    else:
        hs = torch.cat([torch.tanh(k).unsqueeze(0) for k in kids], dim=0)
    total = torch.sum(hs, dim=0, keepdim=True)
    gates = torch.sigmoid(hs @ W4 + x.unsqueeze(0).repeat(len(hs), 1))
    return total + torch.sum(gates * hs, dim=0, keepdim=True)


def test_stretches_a_branch_joins_with_the_other_sides_rows_batch_whole():
    g = torch.Generator().manual_seed(5)
    counts = [0, 2, 3, 0, 1, 2]
    xs = [torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True) for _ in counts]
    kids = [[torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(c)] for c in counts]
    leaves = xs + [k for each in kids for k in each]
    want = [summed_children(x, k) for x, k in zip(xs, kids)]
    want_grads = torch.autograd.grad(sum(w.sum() for w in want), leaves)
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.map(recompile.function(summed_children), xs, kids)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(sum(v.sum() for v in got), leaves), want_grads)


def test_a_row_repeated_to_each_instances_own_count_is_its_stretch():
    x = torch.randn(5, 1, 3, dtype=torch.float64)
    counts = torch.tensor([2, 0, 3, 1, 2])

    def repeated(row, k):
        return row.repeat(int(k), 1) * 2.0

    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.map(recompile.function(repeated), list(x), counts.tolist())
    for g, row, k in zip(got, x, counts.tolist()):
        torch.testing.assert_close(g, row.repeat(k, 1) * 2.0)
