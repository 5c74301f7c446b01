"""A loop stepping an RNN cell over each sequence runs as torch's own RNN over the packed steps (codegen/recurrent.py).

Each loop below runs through ``recompile.vmap`` over sequences of different lengths, some of none, and is
compared with the plain function run per instance (float64: values and parameter gradients); each counts
whether it ran as one RNN (``RecurrentLoop.runs``) or as written (``declined``), and runs no op once per
instance. Loops that are not a cell stepped over step inputs, and cells or inputs that do not fit, run as
written with the same values, and an error of a step's input is raised from the user's line.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import config
from recompile.codegen import recurrent
from recompile.runtime import control
from recompile.passes.pipeline import FINAL

VOCAB, EMBED, HIDDEN = 11, 3, 4


class Model(nn.Module):
    def __init__(self, cell=nn.LSTMCell, **options):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.proj = nn.Linear(EMBED, EMBED)
        self.cell = cell(EMBED, HIDDEN, **options)


def lstm_while(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    t = 0
    while t < n:
        h, c = m.cell(m.embed(words[t]), (h, c))
        t = t + 1
    return h + c, h * t


def lstm_for(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h, c = m.cell(torch.tanh(m.proj(m.embed(words[t]))), (h, c))
    return h * c


def lstm_state_tuple(m, words, n, h0):
    hc = (h0, torch.ones(HIDDEN, dtype=torch.float64))
    t = 2
    while t < n:
        hc = m.cell(m.embed(words[t - 2]) * 2.0, hc)
        t += 1
    return hc[0] - hc[1]


def cell_while(m, words, n, h0):
    h = h0
    t = 0
    while t < n:
        h = m.cell(m.embed(words[t]), h)
        t = t + 1
    return h


def constant_end(m, words, n, h0):
    h = h0
    for t in range(3):
        h = m.cell(m.embed(words[t]), h)
    return h, h * t


def lengths(*ns):
    return torch.tensor(ns)


def sentences(count, longest, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count, longest), generator=g)


def compare(model, fn, args, in_dims, expect_runs=True, count=1):
    """fn through recompile.vmap against fn per instance: values and gradients (float64), and whether its
    ``count`` loops ran as one RNN (each; the first returned)."""
    compiled = recompile.function(fn)
    model.zero_grad()
    got = recompile.vmap(compiled, in_dims=in_dims)(model, *args)
    flat = got if isinstance(got, tuple) else (got,)
    sum(v.sum() for v in flat if isinstance(v, torch.Tensor) and v.is_floating_point()).backward()
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    instances = args[in_dims.index(0) - 1].shape[0]
    per = [fn(model, *[a[k] if d == 0 else a for a, d in zip(args, in_dims[1:])]) for k in range(instances)]
    per = [p if isinstance(p, tuple) else (p,) for p in per]
    want = tuple(torch.stack([torch.as_tensor(p[j]) for p in per]) for j in range(len(per[0])))
    sum(v.sum() for v in want if v.is_floating_point()).backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    for g, w in zip(flat, want):
        torch.testing.assert_close(torch.as_tensor(g).detach(), w.detach(), rtol=1e-9, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for k in want_grads:
        got_grad, want_grad = got_grads[k], want_grads[k]
        if want_grad.is_sparse:  # (the same rows, however torch accumulated them)
            got_grad, want_grad = got_grad.coalesce(), want_grad.coalesce()
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-12)
    loops = compiled.callee(None).build.batched_code.recurrent
    if expect_runs is None:  # (not a recurrent loop)
        assert loops == []
        return None
    assert len(loops) == count
    for loop in loops:
        assert (loop.runs > 0) is expect_runs, (loop.runs, loop.declined)
    return loops[0]


@pytest.fixture(autouse=True)
def every_op_batched(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")


def test_a_while_loop_of_an_lstm_cell_runs_as_one_lstm_with_its_counter_and_sequences_of_no_words():
    torch.manual_seed(0)
    model = Model().double()
    compare(model, lstm_while, (sentences(6, 7), lengths(3, 7, 0, 5, 1, 7)), (None, 0, 0))


def test_a_for_over_a_range_with_step_inputs_of_several_ops():
    torch.manual_seed(1)
    model = Model().double()
    compare(model, lstm_for, (sentences(5, 6), lengths(6, 2, 2, 0, 4)), (None, 0, 0))


@pytest.mark.parametrize("cell, options", [(nn.GRUCell, {}), (nn.RNNCell, {}),
                                           (nn.RNNCell, {"nonlinearity": "relu"}), (nn.GRUCell, {"bias": False}),
                                           (nn.LSTMCell, {"bias": False})])
def test_each_cell_kind_from_a_state_per_instance(cell, options):
    torch.manual_seed(2)
    model = Model(cell, **options).double()
    if cell is nn.LSTMCell:
        compare(model, lstm_state_tuple, (sentences(4, 5), lengths(7, 3, 1, 5), torch.randn(4, HIDDEN).double()),
                (None, 0, 0, 0))
    else:
        compare(model, cell_while, (sentences(4, 5), lengths(5, 3, 0, 5), torch.randn(4, HIDDEN).double()),
                (None, 0, 0, 0))


@pytest.mark.parametrize("cell, options", [(nn.LSTMCell, {}), (nn.GRUCell, {}), (nn.RNNCell, {"nonlinearity": "relu"}),
                                           (nn.RNNCell, {"bias": False})])
@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_without_grad_the_steps_run_as_torchs_own_rnn(cell, options, no_grad):
    torch.manual_seed(8)
    model = Model(cell, **options).double()
    words, n, h0 = sentences(5, 6), lengths(6, 0, 2, 6, 3), torch.randn(5, HIDDEN).double()
    fn = lstm_while if cell is nn.LSTMCell else cell_while
    args = (words, n) if cell is nn.LSTMCell else (words, n, h0)
    compiled = recompile.function(fn)
    with no_grad():
        got = recompile.vmap(compiled, in_dims=(None,) + (0,) * len(args))(model, *args)
        per = [fn(model, *[a[k] for a in args]) for k in range(5)]
    got = got if isinstance(got, tuple) else (got,)
    per = [p if isinstance(p, tuple) else (p,) for p in per]
    for j, g in enumerate(got):
        torch.testing.assert_close(g, torch.stack([p[j] for p in per]), rtol=1e-9, atol=1e-12)
        # (under no_grad the steps ran in inference mode, but what the caller gets is an ordinary tensor)
        assert g.is_inference() is (no_grad is torch.inference_mode)
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 1


def test_a_range_of_a_constant_length_and_a_shared_start_state():
    torch.manual_seed(3)
    model = Model(nn.GRUCell).double()
    compare(model, constant_end, (sentences(3, 4), lengths(1, 2, 3), torch.randn(HIDDEN).double()),
            (None, 0, 0, None))


def reversed_gru(m, words, n, h0):
    h = h0
    t = n - 1  # (an integer tensor: each instance's n is)
    while t >= 0:
        h = m.cell(m.embed(words[t]), h)
        t = t - 1
    return h * (t + 2)


def reversed_range(m, words, n, h0):
    h = h0
    for t in range(n - 1, -1, -1):
        h = m.cell(m.embed(words[t]), h)
    return h


def reversed_strictly(m, words, n, h0):
    h = h0
    t = n
    while t > 1:
        h = m.cell(m.embed(words[t - 1]), h)
        t = t - 1
    return h


def reversed_builtin(m, words, n, h0):
    h = h0
    for t in reversed(range(n)):
        h = m.cell(m.embed(words[t]), h)
    for t in reversed(range(1, n)):  # (no cell: an update of its own, stepped over the packed step inputs)
        h = h * 0.5 + words[t].double()
    return h


@pytest.mark.parametrize("fn", [reversed_gru, reversed_strictly, reversed_range, reversed_builtin])
def test_a_loop_counting_down_runs_its_sequences_backwards_as_one_rnn(fn):
    torch.manual_seed(10)
    model = Model(nn.GRUCell).double()
    compare(model, fn, (sentences(5, 6), lengths(6, 0, 1, 4, 6), torch.randn(5, HIDDEN).double()), (None, 0, 0, 0),
            count=2 if fn is reversed_builtin else 1)


class Stacked(nn.Module):
    def __init__(self, first=nn.LSTMCell, second=nn.LSTMCell):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.low = first(EMBED, HIDDEN)
        self.high = second(HIDDEN, HIDDEN + 1)


def two_lstm_layers(m, words, n):
    h1 = torch.zeros(HIDDEN, dtype=torch.float64)
    c1 = torch.zeros(HIDDEN, dtype=torch.float64)
    h2 = torch.zeros(HIDDEN + 1, dtype=torch.float64)
    c2 = torch.ones(HIDDEN + 1, dtype=torch.float64)
    t = 0
    while t < n:
        h1, c1 = m.low(m.embed(words[t]), (h1, c1))
        h2, c2 = m.high(h1, (h2, c2))
        t = t + 1
    return h2 * c2, h1 - c1


def gru_under_lstm(m, words, n, h0):
    h1 = h0
    h2 = torch.zeros(HIDDEN + 1, dtype=torch.float64)
    c2 = torch.zeros(HIDDEN + 1, dtype=torch.float64)
    for t in range(n):
        h1 = m.low(m.embed(words[t]), h1)
        h2, c2 = m.high(h1, (h2, c2))
    return h2 + h1.sum()


def test_stacked_cells_each_step_over_the_states_of_the_one_below():
    torch.manual_seed(11)
    compare(Stacked().double(), two_lstm_layers, (sentences(5, 6), lengths(6, 2, 0, 5, 6)), (None, 0, 0))
    compare(Stacked(nn.GRUCell).double(), gru_under_lstm,
            (sentences(4, 5), lengths(1, 5, 3, 0), torch.randn(4, HIDDEN).double()), (None, 0, 0, 0))


def test_stacked_cells_without_grad():
    torch.manual_seed(12)
    model = Stacked().double()
    words, n = sentences(5, 6), lengths(6, 2, 0, 5, 6)
    compiled = recompile.function(two_lstm_layers)
    with torch.no_grad():
        got = recompile.vmap(compiled, in_dims=(None, 0, 0))(model, words, n)
        per = [two_lstm_layers(model, words[k], n[k]) for k in range(5)]
    for j in range(2):
        torch.testing.assert_close(got[j], torch.stack([p[j] for p in per]), rtol=1e-9, atol=1e-12)
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 1


def test_a_cell_reading_the_state_of_the_one_below_from_before_the_step_steps_as_an_update():
    def skewed(m, words, n):
        h1 = torch.zeros(HIDDEN, dtype=torch.float64)
        h2 = torch.zeros(HIDDEN + 1, dtype=torch.float64)
        t = 0
        while t < n:
            h2 = m.high(h1, h2)  # (the state below as it was before this step)
            h1 = m.low(m.embed(words[t]), h1)
            t = t + 1
        return h2

    # (not torch's stacked RNN: both cells' calls step as the loop's update, over the rows still in the loop)
    loop = compare(Stacked(nn.GRUCell, nn.GRUCell).double(), skewed, (sentences(3, 4), lengths(4, 1, 3)),
                   (None, 0, 0))
    assert loop.update is not None and loop.layers == []


class BothWays(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.forth = nn.LSTMCell(EMBED, HIDDEN)
        self.back = nn.GRUCell(EMBED, HIDDEN)

    def read(self, words, n):
        h = torch.zeros(HIDDEN, dtype=torch.float64)
        c = torch.zeros(HIDDEN, dtype=torch.float64)
        for t in range(n):
            h, c = self.forth(self.embed(words[t]), (h, c))
        back = torch.zeros(HIDDEN, dtype=torch.float64)
        t = n - 1
        while t >= 0:
            back = self.back(self.embed(words[t]), back)
            t = t - 1
        return torch.cat([h, back], -1)


def test_a_bidirectional_reader_runs_each_of_its_loops_as_one_rnn():
    torch.manual_seed(13)
    model = BothWays().double()
    compiled = recompile.function(BothWays.read)
    words, n = sentences(5, 6), lengths(6, 3, 0, 1, 6)
    got = recompile.vmap(compiled, in_dims=(None, 0, 0))(model, words, n)
    got.sum().backward()
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    want = torch.stack([BothWays.read(model, words[k], n[k]) for k in range(5)])
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for k, p in model.named_parameters():
        torch.testing.assert_close(got_grads[k], p.grad, rtol=1e-9, atol=1e-12)
    assert [loop.runs for loop in compiled.callee(None).build.batched_code.recurrent] == [1, 1]


class RowReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(EMBED, HIDDEN)

    def rows(self, xs):
        h = torch.zeros(HIDDEN, dtype=torch.float64)
        for x in xs:  # (each instance's rows)
            h = self.cell(torch.tanh(x), h)
        return h + x.sum()  # (x: the last row, as after Python's loop)

    def positions(self, xs):
        h = torch.zeros(HIDDEN, dtype=torch.float64)
        for t in range(xs.shape[0]):
            h = self.cell(xs[t], h)
        return h * t


@pytest.mark.parametrize("name", ["rows", "positions"])
def test_a_for_over_each_instances_rows_runs_as_one_rnn(name):
    torch.manual_seed(14)
    compare(RowReader().double(), getattr(RowReader, name), (torch.randn(4, 5, EMBED, dtype=torch.float64),),
            (None, 0))


def test_a_for_over_each_instances_rows_batches_as_the_rows_of_one_tensor():
    @recompile.function
    def running_max(xs):
        best = xs[0]
        for x in xs:
            best = torch.maximum(best, x * 2.0)
        return best

    xs = torch.randn(6, 4, 3)
    got = recompile.vmap(running_max)(xs)
    torch.testing.assert_close(got, torch.stack([running_max.python(x) for x in xs]))


def test_a_float_end_counts_steps_as_the_comparison_does():
    def fractional(m, words, n, h0):
        h = h0
        t = 0
        half = n * 0.5
        while t < half:
            h = m.cell(m.embed(words[t]), h)
            t = t + 1
        return h

    torch.manual_seed(4)
    model = Model(nn.RNNCell).double()
    compare(model, fractional, (sentences(4, 4), lengths(3, 7, 0, 1), torch.randn(HIDDEN).double()),
            (None, 0, 0, None))


def test_switched_off_or_with_a_hook_the_loop_runs_as_written(monkeypatch):
    torch.manual_seed(5)
    model = Model().double()
    args = (sentences(3, 5), lengths(5, 2, 4))
    monkeypatch.setattr(config, "RECURRENT_LOOPS", False)
    assert compare(model, lstm_while, args, (None, 0, 0), expect_runs=False).declined > 0
    monkeypatch.setattr(config, "RECURRENT_LOOPS", True)
    handle = model.cell.register_forward_hook(lambda mod, inputs, out: (out[0] * 2, out[1]))
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")  # (a module with a hook runs as its instances call it)
    try:
        compare(model, lstm_while, args, (None, 0, 0), expect_runs=False)
    finally:
        handle.remove()


def test_step_inputs_that_draw_random_numbers_run_in_the_written_loop():
    def dropped(m, words, n):
        h = torch.zeros(HIDDEN, dtype=torch.float64)
        c = torch.zeros(HIDDEN, dtype=torch.float64)
        t = 0
        while t < n:
            h, c = m.cell(F.dropout(m.embed(words[t]), 0.0), (h, c))
            t = t + 1
        return h

    torch.manual_seed(6)
    compare(Model().double(), dropped, (sentences(3, 4), lengths(4, 1, 3)), (None, 0, 0), expect_runs=False)


def test_a_body_doing_more_than_stepping_the_cell_steps_as_an_update():
    def decays(m, words, n):
        h = torch.zeros(HIDDEN, dtype=torch.float64)
        total = torch.zeros(HIDDEN, dtype=torch.float64)
        t = 0
        while t < n:
            h = m.cell(m.embed(words[t]), h)
            total = total * 0.5 + h  # (not a sum of the steps' states)
            t = t + 1
        return total

    loop = compare(Model(nn.GRUCell).double(), decays, (sentences(2, 3), lengths(3, 2)), (None, 0, 0))
    assert loop.update is not None


def gru_sum(m, words, n, start):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    total = start
    t = 0
    while t < n:
        h = m.cell(m.embed(words[t]), h)
        total = total + h
        t = t + 1
    return total / (t + 1), h


def lstm_sum_of_h(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    total = torch.zeros_like(h)
    for t in range(n):
        h, c = m.cell(m.embed(words[t]), (h, c))
        total += h  # (``+=`` of a value the function made: written out of place)
    return total, c


def stacked_sums(m, words, n):
    h, c = torch.zeros(HIDDEN, dtype=torch.float64), torch.zeros(HIDDEN, dtype=torch.float64)
    h2 = torch.zeros(HIDDEN, dtype=torch.float64)
    low, high = torch.zeros(HIDDEN, dtype=torch.float64), torch.ones(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h, c = m.cell(m.embed(words[t]), (h, c))
        h2 = m.top(h, h2)
        low = h + low
        high = high + h2
    return low, high


def test_sums_of_the_steps_states_run_with_the_cells_as_one_rnn():
    """``total = total + h`` (or ``+=``, either order) of a cell's new state at each step: the loop runs as one
    RNN and each sum is its start plus the instance's packed states, one ``index_add`` (sentence lengths of
    none included; a start of each instance's or one they share)."""
    torch.manual_seed(7)
    gru = Model(nn.GRUCell).double()
    starts = torch.randn(4, HIDDEN, dtype=torch.float64)
    compare(gru, gru_sum, (sentences(4, 5), lengths(5, 0, 2, 5), starts), (None, 0, 0, 0))
    compare(gru, gru_sum, (sentences(4, 5), lengths(5, 0, 2, 5), starts[0]), (None, 0, 0, None))
    compare(Model().double(), lstm_sum_of_h, (sentences(5, 6), lengths(6, 2, 0, 4, 1)), (None, 0, 0))
    two = Model().double()
    two.top = nn.GRUCell(HIDDEN, HIDDEN).double()
    compare(two, stacked_sums, (sentences(3, 4), lengths(4, 3, 0)), (None, 0, 0))
    with torch.no_grad():
        compare_values = recompile.vmap(recompile.function(lstm_sum_of_h), in_dims=(None, 0, 0))(
            Model().double(), sentences(3, 4), lengths(4, 0, 2))
    assert compare_values[0][1].abs().sum() == 0  # (no steps: the start, zeros)


def loss_per_step(m, words, n, tags):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    scores = torch.zeros(3, dtype=torch.float64)
    for t in range(n):
        h, c = m.cell(m.embed(words[t]), (h, c))
        loss = loss + F.cross_entropy(m.out(torch.tanh(h) * m.proj(m.embed(words[t])).sum()), tags[t])
        scores = scores + m.out(h * t)  # (and the counter)
    return loss, scores


def loss_per_step_of_one_row(m, words, n, tags):
    h = torch.zeros(1, HIDDEN, dtype=torch.float64)
    loss = torch.zeros(1, dtype=torch.float64)
    for t in range(n):
        h = m.cell(m.embed(words[t]).unsqueeze(0), h)
        loss += F.cross_entropy(m.out(h), tags[t].unsqueeze(0), reduction="none")  # (written out of place)
    return loss


def loss_halved(m, words, n, tags):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for t in range(n):
        h = m.cell(m.embed(words[t]), h)
        loss = loss + 0.5 * F.cross_entropy(m.out(h), tags[t])  # (the sum's add kept out of the product's fusion)
    return loss


def loss_of_the_state_before_the_step(m, words, n, tags):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for t in range(n):
        before = h
        h = m.cell(m.embed(words[t]), h)
        loss = loss + (m.out(before) * m.out(h)).sum()  # (reads the state before the step: as written)
    return loss


def loss_of_an_lstms_c(m, words, n, tags):
    h, c = torch.zeros(HIDDEN, dtype=torch.float64), torch.zeros(HIDDEN, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    for t in range(n):
        h, c = m.cell(m.embed(words[t]), (h, c))
        loss = loss + m.out(c).sum()  # (the packed steps hold each step's h, not its c: as written)
    return loss


def loss_started_as_a_number(m, words, n, tags):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    loss = 0.0
    for t in range(n):
        h = m.cell(m.embed(words[t]), h)
        loss = loss + m.out(h).sum()  # (a number's sum: as written)
    return loss


def test_sums_of_values_computed_from_each_steps_state_run_with_the_cells_as_one_rnn():
    """``loss = loss + F.cross_entropy(self.out(h), tags[t])``: what each step adds, computed from the new state,
    the step's inputs and what the loop does not change, runs for every step at once after the cells, each
    instance's values added to its start in step order (a tagger's loss per word)."""
    torch.manual_seed(3)
    model = Model().double()
    model.out = nn.Linear(HIDDEN, 3).double()
    tags = torch.randint(0, 3, (5, 6), generator=torch.Generator().manual_seed(1))
    compare(model, loss_per_step, (sentences(5, 6), lengths(6, 2, 0, 4, 1), tags), (None, 0, 0, 0))
    gru = Model(nn.GRUCell).double()
    gru.out = nn.Linear(HIDDEN, 3).double()
    compare(gru, loss_per_step_of_one_row, (sentences(4, 5), lengths(5, 1, 3, 5), tags[:4, :5]), (None, 0, 0, 0))
    compare(gru, loss_halved, (sentences(4, 5), lengths(5, 1, 3, 5), tags[:4, :5]), (None, 0, 0, 0))
    for fn in (loss_of_the_state_before_the_step, loss_started_as_a_number):
        compare(gru, fn, (sentences(4, 5), lengths(5, 1, 3, 5), tags[:4, :5]), (None, 0, 0, 0),
                expect_runs=None if fn is loss_of_the_state_before_the_step else False)
    compare(model, loss_of_an_lstms_c, (sentences(4, 5), lengths(5, 1, 3, 5), tags[:4, :5]), (None, 0, 0, 0),
            expect_runs=None)
    seen = []
    gru.out.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))  # (as written: a step each)
    compare(gru, loss_halved, (sentences(4, 5), lengths(5, 1, 3, 5), tags[:4, :5]), (None, 0, 0, 0),
            expect_runs=False)
    assert len(seen) == 5 + 14  # (the loop's five steps, then eager's fourteen calls)


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_sums_of_values_computed_from_each_steps_state_in_every_mode(mode, monkeypatch):
    """The same loops called one instance at a time in sequential and threaded mode: eager's values and float64
    gradients (their derived gradient programs, not the batched RNN)."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    torch.manual_seed(3)
    model = Model(nn.GRUCell).double()
    model.out = nn.Linear(HIDDEN, 3).double()
    words, n = sentences(3, 5), lengths(5, 1, 3)
    tags = torch.randint(0, 3, (3, 5), generator=torch.Generator().manual_seed(1))
    for fn in (loss_per_step_of_one_row, loss_halved):
        compiled = recompile.function(fn, mode=mode)
        results = []
        for call in (compiled, fn):
            model.zero_grad()
            out = torch.stack([call(model, words[k], int(n[k]), tags[k]).sum() for k in range(3)])
            out.sum().backward()
            results.append((out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()
                                           if p.grad is not None}))
        (got, got_grads), (want, want_grads) = results
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert got_grads.keys() == want_grads.keys()
        for k in want_grads:
            torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-9, atol=1e-12)


def state_from_none(m, words, n):
    state = None
    for t in range(n):
        state = m.cell(m.embed(words[t]), state)
    return state[0] * state[1]


def state_from_none_or_zeros(m, words, n):
    state = None
    for t in range(n):
        state = m.cell(m.embed(words[t]), state)
    return torch.zeros(HIDDEN, dtype=torch.float64) if state is None else state[0] + state[1]


def one_row_steps(m, words, n, h0):
    h = h0.unsqueeze(0)
    c = torch.zeros(1, HIDDEN, dtype=torch.float64)
    for t in range(n):
        h, c = m.cell(m.embed(words[t]).unsqueeze(0), (h, c))
    return (h * c)[0]


def one_row_from_none(m, words, n):
    h = None
    t = 0
    while t < n:
        h = m.cell(torch.tanh(m.embed(words[t])).view(1, -1), h)
        t += 1
    return h.sum(0)


def test_a_state_starting_as_none_runs_from_zeros_as_one_rnn():
    """``state = None``, then ``state = cell(x, state)``: the cell's zeros, where every instance takes a step;
    a length of none keeps its None (the loop runs as written, and the joined states, None or a tuple, are read
    per instance)."""
    torch.manual_seed(8)
    model = Model().double()
    compare(model, state_from_none, (sentences(4, 5), lengths(5, 1, 3, 5)), (None, 0, 0))
    config.PER_INSTANCE = "allow"
    compare(model, state_from_none_or_zeros, (sentences(4, 5), lengths(5, 0, 3, 2)), (None, 0, 0),
            expect_runs=False)


def test_steps_of_one_row_matrices_run_as_the_rows_of_one_rnn():
    """Each step's input a one-row matrix (``x.unsqueeze(0)``, ``x.view(1, -1)``) with states of one row: the
    instances' rows are the RNN's batch, and each final state one row again."""
    torch.manual_seed(9)
    model = Model().double()
    starts = torch.randn(5, HIDDEN, dtype=torch.float64)
    compare(model, one_row_steps, (sentences(5, 6), lengths(6, 0, 2, 6, 1), starts), (None, 0, 0, 0))
    compare(model, one_row_steps, (sentences(5, 6), lengths(6, 3, 2, 6, 1), starts[0]), (None, 0, 0, None))
    compare(Model(nn.GRUCell).double(), one_row_from_none, (sentences(3, 4), lengths(4, 1, 2)), (None, 0, 0))
    with torch.no_grad():
        compare_values = recompile.vmap(recompile.function(one_row_from_none), in_dims=(None, 0, 0))(
            Model(nn.GRUCell).double(), sentences(3, 4), lengths(4, 1, 2))
    assert compare_values.shape == (3, HIDDEN)


def lstm_states_pooled(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    hs = []
    for t in range(n):
        h, c = m.cell(m.embed(words[t]), (h, c))
        hs.append(h)
    states = torch.stack(hs)
    return states.mean(0) + states.max(0).values * c, states[-1] - h


def gru_states_one_row(m, words, n):
    h = None
    hs = []
    for t in range(n):
        h = m.cell(m.embed(words[t]).unsqueeze(0), h)
        hs.append(h)
    return torch.amax(torch.stack(hs), 0)[0] + torch.stack(hs).sum(dim=0, keepdim=True)[0, 0]


def stacked_states(m, words, n):
    low = torch.zeros(HIDDEN, dtype=torch.float64)
    high = torch.zeros(HIDDEN, dtype=torch.float64)
    highs = []
    t = 0
    while t < n:
        low = m.cell(m.embed(words[t]), low)
        high = m.top(low, high)
        highs.append(high)
        t = t + 1
    return torch.min(torch.stack(highs), dim=0).values


def test_states_appended_to_a_list_run_with_the_cells_as_one_rnn():
    """``hs.append(h)`` of a cell's new state at each step, ``hs = []`` before the loop: each instance's list
    gets its packed states, in step order, and ``torch.stack(hs)`` of them is one index of those states, its
    ``mean(0)``, ``max(0)``, ``[-1]`` ... one op each."""
    torch.manual_seed(10)
    compare(Model().double(), lstm_states_pooled, (sentences(5, 6), lengths(6, 2, 1, 4, 6)), (None, 0, 0))
    compare(Model(nn.GRUCell).double(), gru_states_one_row, (sentences(4, 5), lengths(5, 1, 3, 2)), (None, 0, 0))
    two = Model(nn.GRUCell).double()
    two.top = nn.GRUCell(HIDDEN, HIDDEN).double()
    compare(two, stacked_states, (sentences(3, 4), lengths(4, 3, 1)), (None, 0, 0))


def appends_more(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    hs = [h * 2.0]
    xs = []
    for t in range(n):
        x = m.embed(words[t])
        h = m.cell(x, h)
        hs.append(h)
    for t in range(n):
        x = m.embed(words[t])
        h = m.cell(x, h)
        xs.append(x)
    return torch.stack(hs).sum(0) + torch.stack(xs).mean(0).sum()


def test_a_list_holding_more_than_the_states_or_of_other_values():
    """A list that held a value before the loop gets the states after it (its stack: of its items, one op); a
    list of the step inputs keeps its loop as written."""
    torch.manual_seed(11)
    model = Model(nn.GRUCell, bias=False).double()
    compiled = recompile.function(appends_more)
    words, n = sentences(3, 4), lengths(4, 2, 3)
    got = recompile.vmap(compiled, in_dims=(None, 0, 0))(model, words, n)
    want = torch.stack([appends_more(model, words[k], int(n[k])) for k in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert [loop.runs for loop in compiled.callee(None).build.batched_code.recurrent] == [1]


def test_a_counting_loop_runs_its_instances_longest_first_each_step_keeping_the_first_rows(monkeypatch):
    def written_out(m, words, n):  # (a cell of the user's own: no module to run as one RNN)
        h = torch.zeros(HIDDEN, dtype=torch.float64)
        t = 0
        while t < n:
            h = torch.tanh(m.proj(m.embed(words[t])).sum() + h * 0.5)
            t = t + 1
        return h * t

    monkeypatch.setattr(config, "RECURRENT_LOOPS", False)  # (else it steps as an update of its own)
    taken = []
    take_all = control._take_all
    monkeypatch.setattr(control, "_take_all",
                        lambda *args, **kwargs: taken.append(len(args[1][0])) or take_all(*args, **kwargs))
    torch.manual_seed(9)
    compare(Model().double(), written_out, (sentences(6, 7), lengths(2, 7, 0, 5, 2, 6)), (None, 0, 0),
            expect_runs=False)
    assert taken == [6]  # (the instances put in order once, as the loop starts; no gather as they leave)


def test_an_error_of_a_step_input_is_raised_at_its_step_from_the_users_line():
    words = sentences(3, 5)
    words[1, 3] = VOCAB + 4  # (read at step 3 of the second sentence only)
    compiled = recompile.function(lstm_while)
    with pytest.raises(IndexError) as info:
        recompile.vmap(compiled, in_dims=(None, 0, 0))(Model().double(), words, lengths(5, 5, 2))
    assert "lstm_while" in "".join(getattr(info.value, "__notes__", [])) + str(info.traceback)
    loop = compiled.callee(None).build.batched_code.recurrent[0]
    assert loop.runs == 0 and loop.declined == 1


def test_inputs_the_cell_does_not_take_run_as_written_and_raise_as_the_cell_does():
    model = Model().double()
    model.cell = nn.LSTMCell(EMBED + 1, HIDDEN).double()
    compiled = recompile.function(lstm_while)
    with pytest.raises(RuntimeError):
        recompile.vmap(compiled, in_dims=(None, 0, 0))(model, sentences(2, 3), lengths(3, 2))
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 0


def test_one_instance_in_batched_mode_runs_as_one_rnn():
    torch.manual_seed(7)
    model = Model().double()
    compiled = recompile.function(lstm_while, mode="batched")
    words, n = sentences(1, 6)[0], torch.tensor(6)
    got = compiled(model, words, n)
    want = lstm_while(model, words, n)
    torch.testing.assert_close(got, want)
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 1


def test_plan_reads_the_loop_the_frontend_writes():
    def traced(m, words, n):
        h = torch.zeros(HIDDEN)
        for t in range(n):
            h = m.cell(m.embed(words[t]), h)
        return h

    program = recompile.function(traced).callee(None).subgraph(FINAL)
    loops = [op for sg in program.walk() for op in sg.ops if type(op).__name__ == "While"]
    found = recurrent.plan(loops[0])
    # (its loop variables: the range's position, h; not t, which nothing after the loop reads: passes.prune)
    assert found is not None and found.end[0] == "range" and found.layers == [("one", 1)]


def reads_its_list(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    hs = [torch.ones(HIDDEN, dtype=torch.float64)]
    for t in range(n):
        h = m.cell(m.embed(words[t]) * len(hs) + hs[-1][:EMBED], h)
        hs.append(h)
    return h


def appends_the_whole_state(m, words, n):
    hc = (torch.zeros(HIDDEN, dtype=torch.float64), torch.zeros(HIDDEN, dtype=torch.float64))
    hs = []
    for t in range(n):
        hc = m.cell(m.embed(words[t]), hc)
        hs.append(hc)
    return hs[-1][1] + len(hs)


def test_a_list_the_step_inputs_read_or_an_lstms_whole_state_appended_run_the_loop_as_written():
    """Step inputs reading the list the loop appends to (computed ahead, they would read it before it grows),
    and an LSTM's (h, c) appended whole (the packed states hold h alone), keep the loop as written."""
    torch.manual_seed(12)
    config.PER_INSTANCE = "allow"
    compare(Model(nn.GRUCell).double(), reads_its_list, (sentences(3, 4), lengths(4, 2, 3)), (None, 0, 0),
            expect_runs=None)
    compare(Model().double(), appends_the_whole_state, (sentences(3, 4), lengths(4, 2, 3)), (None, 0, 0),
            expect_runs=False)


def copies_a_tensor_counter(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    i = torch.tensor(0)
    j = torch.tensor(-1)
    while i < n:
        h = m.cell(m.embed(words[i]), h)
        j = i
        i = i + 1
    return h * j.double()


def test_a_variable_taking_the_counter_ends_as_its_value_at_the_last_step_of_the_counters_type():
    torch.manual_seed(13)
    compare(Model(nn.GRUCell).double(), copies_a_tensor_counter, (sentences(3, 6), lengths(4, 2, 5)), (None, 0, 0))


def stacked_and_read(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    hs = []
    for t in range(n):
        h = m.cell(m.embed(words[t]), h)
        hs.append(h)
    return torch.stack(hs).sum(0) * hs[-1] + len(hs)


def touch(t):
    t.add_(0.0)  # (a helper that changes what it is given: the run shares nothing it computes once)
    return t


def stacked_beside_a_changing_helper(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    hs = []
    for t in range(n):
        h = m.cell(m.embed(words[t]), h)
        hs.append(h)
    return torch.stack(hs).mean(0) + touch(torch.ones(HIDDEN, dtype=torch.float64))


def test_lists_read_only_by_their_stack_get_their_rows_when_something_else_needs_them():
    """A list the program reads only by ``torch.stack(hs)`` gets no rows until something needs them (its stack is
    one index of the packed states); read otherwise, or stacked per instance, each list holds its states."""
    torch.manual_seed(14)
    config.PER_INSTANCE = "allow"
    model = Model(nn.GRUCell).double()
    compare(model, stacked_and_read, (sentences(4, 5), lengths(5, 2, 3, 1)), (None, 0, 0))
    compare(model, stacked_beside_a_changing_helper, (sentences(3, 5), lengths(5, 2, 3)), (None, 0, 0))
    f = recompile.function(lstm_states_pooled)
    with pytest.raises(RuntimeError, match="non-empty"):  # (a sentence of no words: its stack raises, as eager's)
        recompile.vmap(f, in_dims=(None, 0, 0))(Model().double(), sentences(3, 4), lengths(4, 0, 2))


def appends_twice_a_step(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    g = torch.zeros(HIDDEN, dtype=torch.float64)
    hs = []
    for t in range(n):
        h = m.cell(m.embed(words[t]), h)
        g = m.top(h, g)
        hs.append(h)
        hs.append(g)
    return torch.stack(hs)[1] + torch.stack(hs).sum(0) * len(hs)


def test_two_appends_a_step_to_one_list_run_the_loop_as_written():
    torch.manual_seed(15)
    two = Model(nn.GRUCell).double()
    two.top = nn.GRUCell(HIDDEN, HIDDEN).double()
    config.PER_INSTANCE = "allow"
    compare(two, appends_twice_a_step, (sentences(3, 4), lengths(4, 1, 2)), (None, 0, 0), expect_runs=None)


# -- loops whose steps are an update of their own (no cell): the update stepped over the rows still in the loop


class Elman(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.ih = nn.Linear(EMBED, HIDDEN)
        self.hh = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, 3)
        self.trans = nn.Parameter(torch.randn(3, 3))
        self.start = nn.Parameter(torch.randn(3))


def elman(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h = torch.tanh(m.ih(m.embed(words[t])) + m.hh(h))
    return h


def elman_pooled(m, words, n, tags):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    total = torch.zeros(HIDDEN, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    hs = []
    for t in range(n):
        h = torch.tanh(m.ih(m.embed(words[t])) + m.hh(h) * 0.5)
        total = total + h
        loss = loss + F.cross_entropy(m.out(h), tags[t])
        hs.append(h)
    return total, loss, torch.stack(hs).sum(0)


def crf(m, words, n, tags):
    """A linear-chain CRF's negative log-likelihood of ``tags[:n]`` over scores of the words: the gold path's
    score read tag by tag, the forward algorithm a ``logsumexp`` a step."""
    emits = m.out(m.ih(m.embed(words[:n])))
    gold = m.start[tags[0]] + emits[0, tags[0]]
    for t in range(1, n):
        gold = gold + m.trans[tags[t - 1], tags[t]] + emits[t, tags[t]]
    alpha = m.start + emits[0]
    for t in range(1, n):
        alpha = torch.logsumexp(alpha.unsqueeze(1) + m.trans, 0) + emits[t]
    return torch.logsumexp(alpha, 0) - gold


def counted_and_scaled(m, words, n, scale):
    h = torch.ones(HIDDEN, dtype=torch.float64)
    t = 0
    while t < n:
        h = h * scale + t * m.embed(words[t]).sum() + m.trans.sum()  # (the counter; a value of each instance's)
        t = t + 1
    return h


def test_a_cell_written_out_steps_as_an_update_over_the_rows_still_in_the_loop():
    """``h = torch.tanh(m.ih(x) + m.hh(h))``: the step inputs for every step at once, then the update step by
    step over the first rows (the instances longest first), sentences of none and of one word included."""
    torch.manual_seed(20)
    loop = compare(Elman().double(), elman, (sentences(6, 7), lengths(3, 7, 0, 5, 1, 7)), (None, 0, 0))
    assert loop.update is not None
    with torch.no_grad():
        got = recompile.vmap(recompile.function(elman), in_dims=(None, 0, 0))(
            Elman().double(), sentences(2, 3), lengths(3, 1))
    assert got.shape == (2, HIDDEN) and not got.requires_grad


def test_an_updates_states_summed_appended_and_scored_at_each_step():
    torch.manual_seed(21)
    tags = torch.randint(0, 3, (5, 6), generator=torch.Generator().manual_seed(2))
    compare(Elman().double(), elman_pooled, (sentences(5, 6), lengths(6, 2, 1, 4, 6), tags), (None, 0, 0, 0))


def test_a_crf_written_as_loops_sums_its_gold_path_and_steps_its_forward_algorithm():
    """``gold = gold + a + b`` of step inputs: one ``index_add`` of each step's a and b, in the order the loop
    adds them; the forward algorithm an update stepped over the sentences still in the loop."""
    torch.manual_seed(22)
    tags = torch.randint(0, 3, (5, 6), generator=torch.Generator().manual_seed(3))
    compare(Elman().double(), crf, (sentences(5, 6), lengths(6, 2, 1, 4, 6), tags), (None, 0, 0, 0), count=2)
    gold, alpha = recompile.function(crf).callee(None).build.batched_code.recurrent
    assert gold.update_sg.ops == [] and [s for s in gold.var_sources if s[0] == "added"] == [("added", (0, 1))]
    assert alpha.update_sg.ops


def summed_in_order(m, words, n, s):
    total = torch.zeros((), dtype=torch.float64)
    for t in range(n):
        total = total + m.embed(words[t]).sum() * 1e-17 + s  # (rounding that depends on the order)
    return total


def test_a_sum_of_several_values_a_step_adds_them_in_the_loops_order():
    torch.manual_seed(28)
    s = torch.tensor([1.0, 3.0, 1e17, 0.5], dtype=torch.float64)
    loop = compare(Elman().double(), summed_in_order, (sentences(4, 5), lengths(5, 0, 2, 5), s), (None, 0, 0, 0))
    assert loop.update_sg.ops == []
    shared = compare(Elman().double(), summed_in_order, (sentences(4, 5), lengths(5, 0, 2, 5), s[2]),
                     (None, 0, 0, None))
    assert shared.runs


def test_an_update_reading_the_counter_and_a_value_of_each_instance():
    torch.manual_seed(23)
    scale = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    compare(Elman().double(), counted_and_scaled, (sentences(4, 5), lengths(5, 0, 2, 5), scale), (None, 0, 0, 0))
    compare(Elman().double(), counted_and_scaled, (sentences(4, 5), lengths(5, 0, 2, 5), scale[0]),
            (None, 0, 0, None))


def grows(m, words, n):
    h = torch.zeros(1, dtype=torch.float64)
    for t in range(n):
        h = torch.cat([h, m.embed(words[t])[:1]])  # (a state of another shape at each step)
    return h.sum()


def widens(m, words, n):
    h = torch.zeros(HIDDEN)  # (float32, made float64 by its first step)
    for t in range(n):
        h = h + m.embed(words[t]).sum()
    return h


def from_a_number(m, words, n):
    r = 0.0
    for t in range(n):
        r = r + m.embed(words[t]).sum()
    return r


def test_an_update_giving_another_shape_or_dtype_or_starting_from_a_number_runs_as_written():
    torch.manual_seed(24)
    config.PER_INSTANCE = "allow"
    for fn in (grows, widens, from_a_number):
        compare(Elman().double(), fn, (sentences(3, 4), lengths(4, 1, 3)), (None, 0, 0), expect_runs=False)


def dropped_update(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h = F.dropout(torch.tanh(m.hh(h) + m.ih(m.embed(words[t]))), 0.0, True)  # (draws: as written)
    return h


def reads_an_earlier_state(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    before = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h, before = torch.tanh(m.hh(h) + before), h  # (a variable taking another's value before the step)
    return h + before


def test_an_update_that_draws_or_keeps_a_value_from_before_the_step_runs_as_written():
    torch.manual_seed(25)
    compare(Elman().double(), dropped_update, (sentences(3, 4), lengths(4, 1, 3)), (None, 0, 0), expect_runs=False)
    compare(Elman().double(), reads_an_earlier_state, (sentences(3, 4), lengths(4, 1, 3)), (None, 0, 0),
            expect_runs=None)


def mismatched(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        h = torch.tanh(h + m.ih(h))  # (ih takes EMBED features, not HIDDEN: raises at the first step)
    return h


def test_an_error_of_an_update_is_raised_from_the_users_line():
    compiled = recompile.function(mismatched)
    with pytest.raises(RuntimeError) as info:
        recompile.vmap(compiled, in_dims=(None, 0, 0))(Elman().double(), sentences(3, 4), lengths(4, 1, 3))
    assert "mismatched" in "".join(getattr(info.value, "__notes__", [])) + str(info.value) + str(info.traceback)
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 0


class Gates(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.ih = nn.Linear(EMBED, 4 * HIDDEN)
        self.hh = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)


def gates_written_out(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        i, f, g, o = (m.ih(m.embed(words[t])) + m.hh(h)).chunk(4)  # (i, f, g, o: written, never read before)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    return h + c, o * 2.0


def test_variables_an_update_only_writes_end_as_their_last_steps_values():
    """A gate read after the loop (a loop variable that starts undefined and that each step writes before it reads
    it) ends as its value at each instance's last step; with a sentence of no words, whose gates stay undefined,
    the loop runs as written."""
    torch.manual_seed(26)
    loop = compare(Gates().double(), gates_written_out, (sentences(5, 6), lengths(6, 2, 1, 4, 6)), (None, 0, 0))
    assert loop.reads_state.count(False) == 1  # (o: not i, f, g, which nothing after the loop reads: passes.prune)
    config.PER_INSTANCE = "allow"
    compiled = recompile.function(gates_written_out)
    with pytest.raises(UnboundLocalError):  # (``o`` of the sentence of no words, as eager)
        recompile.vmap(compiled, in_dims=(None, 0, 0))(Gates().double(), sentences(3, 4), lengths(4, 0, 2))
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 0


def from_a_parameter(m, words, n, s):
    a = m.start  # (a module's parameter: an instance that takes no step ends with it)
    total = m.start * 0.0
    for t in range(n):
        a = a * 0.5 + m.trans[0]
        total = total + s  # (a sum of what the loop does not change)
    return a, total


def test_an_update_from_a_parameter_and_a_sum_of_an_invariant():
    torch.manual_seed(27)
    s = torch.randn(4, 3, dtype=torch.float64)
    loop = compare(Elman().double(), from_a_parameter, (sentences(4, 5), lengths(5, 0, 2, 5), s), (None, 0, 0, 0))
    assert loop.update is not None


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_updates_and_sums_of_several_values_in_every_mode(mode, monkeypatch):
    """The update loops and the sums of several values a step (kept out of fusion groups in every mode) called one
    instance at a time: eager's values and float64 gradients, the parameters' and the scale's."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    torch.manual_seed(29)
    model = Elman().double()
    words, n = sentences(3, 5), lengths(5, 1, 3)
    tags = torch.randint(0, 3, (3, 5), generator=torch.Generator().manual_seed(4))
    scale = torch.tensor([0.5, 2.0, 1e17], dtype=torch.float64, requires_grad=True)
    calls = [(crf, lambda k: (tags[k],)), (elman_pooled, lambda k: (tags[k],)),
             (summed_in_order, lambda k: (scale[k],)), (gates_written_out, None)]
    for fn, extra in calls:
        m = Gates().double() if fn is gates_written_out else model
        compiled = recompile.function(fn, mode=mode)
        results = []
        for call in (compiled, fn):
            m.zero_grad()
            scale.grad = None
            outs = [call(m, words[k], int(n[k]), *(extra(k) if extra else ())) for k in range(3)]
            total = sum(sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))) for out in outs)
            total.backward()
            grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
            results.append((total.detach(), grads, None if scale.grad is None else scale.grad.clone()))
        (got, got_grads, got_scale), (want, want_grads, want_scale) = results
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert got_grads.keys() == want_grads.keys()
        for k in want_grads:
            torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-9, atol=1e-12)
        if want_scale is not None:
            torch.testing.assert_close(got_scale, want_scale)


def whole_rows_while(m, words, n):
    xs = m.embed(words)
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    t = 0
    while t < n:
        h, c = m.cell(xs[t], (h, c))
        t = t + 1
    return h


def whole_rows_from_the_end(m, words, n):
    xs = m.embed(words)
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(-1, -n - 1, -1):
        h, c = m.cell(xs[t], (h, c))
    return h


def test_a_loop_over_a_batched_tensors_rows_past_their_end_raises_as_python_does():
    """Each step's row of every instance is read at once (one gather of the rows flattened): a step past an
    instance's rows raises the IndexError its own loop raises, not the next instance's row."""
    torch.manual_seed(2)
    model = Model().double()
    words = sentences(3, 6)
    with pytest.raises(IndexError):
        whole_rows_while(model, words[0], 7)
    with pytest.raises(IndexError):
        recompile.vmap(recompile.function(whole_rows_while), in_dims=(None, 0, 0))(model, words, lengths(7, 2, 5))


@pytest.mark.parametrize("steps", [(0, 3, 2), (6, 1, 4)])
def test_a_loop_reading_a_batched_tensors_rows_from_their_end(steps):
    """``xs[t]`` with t from -1 down: each instance's rows counted from its end, as eager's (values and
    gradients), whether or not the first instance takes a step."""
    torch.manual_seed(4)
    model = Model().double()
    compare(model, whole_rows_from_the_end, (sentences(3, 6), lengths(*steps)), (None, 0, 0))


class ChildSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(HIDDEN, HIDDEN)


def forget_zipped(m, x, hs, cs):
    c = x
    for h_k, c_k in zip(hs, cs):
        c = c + torch.sigmoid(x + m.f(h_k)) * c_k
    return c


def forget_listed(m, x, hs):
    c = x
    for h in hs:
        c = torch.tanh(c + m.f(h))
    return c


def forget_three_zipped(m, x, hs, cs, ws):
    total = x * 0.0
    for h_k, c_k, w in zip(hs, cs, ws):
        total = total + m.f(h_k) * c_k * w
    return total


def _states(counts, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(HIDDEN, dtype=torch.float64, generator=g) for _ in range(k)] for k in counts]


@pytest.mark.parametrize("fn, lists", [(forget_zipped, 2), (forget_listed, 1), (forget_three_zipped, 3)])
def test_a_for_over_each_instances_own_lists_or_a_zip_of_them_steps_as_an_update(fn, lists):
    """``for h, c in zip(hs, cs)`` over each instance's own lists (a child-sum's children, some with none), under
    recompile.map: the step inputs for every (instance, step) at once, then the update or the sum; values and
    gradients as the plain calls'. A zip runs as long as its shortest list."""
    torch.manual_seed(22)
    m = ChildSum().double()
    counts = [2, 0, 3, 1, 3]
    xs = [torch.randn(HIDDEN, dtype=torch.float64) for _ in counts]
    columns = [_states(counts, seed) for seed in range(lists)]
    if lists == 3:
        columns[2][2] = columns[2][2][:1]  # (one instance's third list is shorter: its zip stops there)
    compiled = recompile.function(fn)
    got = recompile.map(compiled, [m] * len(counts), xs, *columns)
    sum(g.sum() for g in got).backward()
    got_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want = [fn(m, x, *each) for x, *each in zip(xs, *columns)]
    sum(w.sum() for w in want).backward()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    for g, w in zip(got_grads, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(g, w)
    (loop,) = compiled.callee(None).build.batched_code.recurrent
    assert loop.runs == 1 and loop.declined == 0


def child_sum(m, node):
    """A node's children's states (its calls), then a loop over their zip, in the same function."""
    hs, cs = [], []
    for child in node[1]:
        h, c = child_sum(m, child)
        hs.append(h)
        cs.append(c)
    c = node[0]
    for h_k, c_k in zip(hs, cs):
        c = c + torch.sigmoid(node[0] + m.f(h_k)) * c_k
    return torch.tanh(c), c


def test_a_loop_without_calls_in_a_function_that_makes_calls_steps_as_an_update():
    torch.manual_seed(23)
    m = ChildSum().double()

    def tree(depth):
        arity = 0 if depth == 0 else int(torch.randint(0, 4, ()))
        return (torch.randn(HIDDEN, dtype=torch.float64), [tree(depth - 1) for _ in range(arity)])

    trees = [tree(3) for _ in range(6)]
    compiled = recompile.function(child_sum)
    got = recompile.map(compiled, [m] * len(trees), trees)
    want = [child_sum(m, t) for t in trees]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    loops = compiled.callee(None).build.batched_code.recurrent
    assert [loop.runs > 0 for loop in loops] == [True]


def forget_terms(m, x, hs, cs):
    """A child-sum's forget terms over one node's own lists of its children's states (``zip(hs, cs)`` in a frame
    of one instance): every row's items are those lists'."""
    c = torch.zeros(HIDDEN, dtype=torch.float64)
    for h, c_k in zip(hs, cs):
        c = c + torch.sigmoid(m.ih(x) + m.hh(h))[:HIDDEN] * c_k
    return c


def test_the_steps_of_one_instances_own_lists_are_read_at_once():
    torch.manual_seed(28)
    m = Gates().double()
    x = torch.randn(EMBED, dtype=torch.float64)
    hs = [torch.randn(HIDDEN, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    cs = [torch.randn(HIDDEN, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    compiled = recompile.function(forget_terms)
    got = compiled(m, x, hs, cs)
    want = forget_terms(m, x, hs, cs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), hs + cs), torch.autograd.grad(want.sum(), hs + cs))
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 1
    assert compiled.stats["per_instance"] == {}


def values_no_step_reads(m, words, n):
    """Values the loop computes that no step and nothing after the loop reads (``passes.prune`` carries none of
    them): they still run with the steps' inputs."""
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        x = m.embed(words[t])
        position = t + 1
        doubled = x * 2.0
        projected = m.proj(x)
        h = m.cell(x, h)
    return h


def a_read_that_fails(m, words, n):
    h = torch.zeros(HIDDEN, dtype=torch.float64)
    for t in range(n):
        x = m.embed(words[t])
        h = m.cell(x, h)
        missing = x.no_such_attribute  # (read by no one: still raised, at the loop's first step)
    return h


def test_values_no_step_reads_run_with_the_steps_and_raise_where_they_fail():
    torch.manual_seed(29)
    compare(Model(nn.GRUCell).double(), values_no_step_reads, (sentences(4, 6), lengths(6, 2, 0, 4)), (None, 0, 0))
    compiled = recompile.function(a_read_that_fails)
    config.PER_INSTANCE = "allow"  # (the loop as written reads a missing attribute of each instance's tensor)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        recompile.vmap(compiled, in_dims=(None, 0, 0))(Model(nn.GRUCell).double(), sentences(3, 4), lengths(4, 2, 1))
