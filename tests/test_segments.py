"""Raw segments (codegen/segments.py): straight runs of batched ops traced once and run on plain tensors.

Each test compares the raw run with the op-by-op run of the same program
(segments disabled when it was built) or with eager PyTorch per instance,
values and gradients, and checks that the raw functions were in fact used,
or that a guard sent a call back to the op-by-op code.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import ir
from recompile.passes.effects import growing
from bound_globals import bound_globals
from test_batching import lstm_encode  # the Tree-LSTM node of the batching tests
from recompile import config
from recompile.codegen import segments
from recompile.data import Forest, Tree, Vocab

G = globals()
WORDS = [f"w{k}" for k in range(10)]


def trees():
    vocab = Vocab(WORDS)
    vocab.freeze()
    nested = [(1, "w1"), (2, (0, "w2"), (1, "w3")), (3, (4, (0, "w4"), (2, "w5")), (1, (0, "w6"), (2, "w7"))),
              (0, (1, (2, (3, "w8"), (4, "w9")), (0, "w0")), (1, "w1"))]
    return [Tree.from_nested(t, vocab) for t in nested]


class Params(nn.Module):
    def __init__(self, embed=5, hidden=4):
        super().__init__()
        self.embed = nn.Embedding(len(WORDS) + 1, embed)
        self.leaf = nn.Linear(embed, 3 * hidden)
        self.node = nn.Linear(2 * hidden, 5 * hidden)
        self.out = nn.Linear(hidden, 5)


def model_class(raw):
    """A Params subclass whose ``encode`` is compiled now, with raw segments or without."""
    return type("RawLSTM" if raw else "PlainLSTM", (Params,), {"encode": recompile.function(lstm_encode)})


@contextlib.contextmanager
def switched(module, on, flag):
    """``module.flag`` set to ``on`` for the block (a switch of ``recompile.config``, a module's threshold)."""
    saved = getattr(module, flag)
    setattr(module, flag, on)
    try:
        yield
    finally:
        setattr(module, flag, saved)


def segments_enabled(on):
    return switched(config, on, "SEGMENTS")


def built(cf, owner=None):
    """The batched code of compiled function ``cf`` (built now, under the current switches)."""
    callee = cf.callee(owner)
    callee.prepare()
    return callee.build.batched_code


def run_forest(model, forest):
    model.zero_grad()
    h, c, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    (h.sum() + c.sum() * 0.5 + loss.sum()).backward()
    return (h.detach(), c.detach(), loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


def eager_forest(model, tree_list):
    """Each tree through the plain Python function: stacked (h, c, loss) and the parameter gradients."""
    plain = type("EagerLSTM", (Params,), {"encode": lstm_encode})().double()
    plain.load_state_dict(model.state_dict())
    outs = [plain.encode(t, t.root) for t in tree_list]
    h, c, loss = (torch.stack([o[j] for o in outs]) for j in range(3))
    (h.sum() + c.sum() * 0.5 + loss.sum()).backward()
    return (h.detach(), c.detach(), loss.detach()), {k: p.grad.clone() for k, p in plain.named_parameters()}


def assert_same(got, want, tol=1e-9):
    (gv, gg), (wv, wg) = got, want
    for a, b in zip(gv, wv):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert gg.keys() == wg.keys()
    for k in wg:
        torch.testing.assert_close(gg[k], wg[k], rtol=tol, atol=tol)


def test_a_tree_lstm_runs_its_segments_raw_and_matches_the_op_by_op_run_and_eager():
    torch.manual_seed(0)
    with segments_enabled(True):
        Raw = model_class(True)
        code = built(Raw.encode, Raw)
    with segments_enabled(False):
        Plain = model_class(False)
        assert built(Plain.encode, Plain).segments == []
    raw, plain = Raw().double(), Plain().double()
    plain.load_state_dict(raw.state_dict())
    forest = Forest.from_trees(trees())
    units = [s for s in code.segments if s not in code.unit.levels.segments]  # (the agenda's; levels has its own)
    with switched(config, False, "LEVELS"):  # (the level program's pieces: tests/test_levels.py)
        for _ in range(3):  # the first call traces; the others run the raw functions
            got = run_forest(raw, forest)
            assert_same(got, run_forest(plain, forest))
            assert_same(got, eager_forest(raw, trees()))
    assert units and all(not s.off for s in units), [(s.name, s.off) for s in units]
    assert all(s.hits > 0 for s in units), [(s.name, s.hits) for s in units]


class Shifted(nn.Linear):
    """A Linear whose call is not its own forward: a raw segment must not run it as F.linear."""

    def forward(self, x):
        return super().forward(x) + 1.0


@pytest.mark.parametrize("change", ["module_type", "forward_hook", "dtype"])
def test_a_call_whose_facts_changed_since_the_trace_is_run_op_by_op_and_stays_right(change, monkeypatch):
    monkeypatch.setattr(config, "PLAIN_LEVELS", False)  # (the level runs' raw segments, on Batch values)
    torch.manual_seed(1)
    with segments_enabled(True):
        Raw = model_class(True)
        code = built(Raw.encode, Raw)
    model = Raw().double()
    forest = Forest.from_trees(trees())
    run_forest(model, forest)
    run_forest(model, forest)
    hits = sum(s.hits for s in code.segments)
    assert hits > 0
    if change == "module_type":
        shifted = Shifted(model.node.in_features, model.node.out_features).double()
        shifted.load_state_dict(model.node.state_dict())
        model.node = shifted
    elif change == "forward_hook":
        model.node.register_forward_hook(lambda mod, args, out: out * 0.5)
    else:  # every tensor of the program in another dtype
        model.float()
    got = run_forest(model, forest)
    tol = 1e-5 if change == "dtype" else 1e-9
    torch.testing.assert_close(got[0][0], eager_on(model, forest), rtol=tol, atol=tol)


def eager_on(model, forest):
    """h of every root by the plain Python function on the same (possibly changed) forest."""
    plain = type("EagerLSTM", (Params,), {"encode": lstm_encode})()
    plain.__dict__.update({k: v for k, v in model.__dict__.items() if k != "_modules"})
    plain._modules = dict(model._modules)
    return torch.stack([plain.encode(forest, r)[0] for r in forest.roots.tolist()]).detach()


def scale_act(x, s):
    y = torch.cat([x, x * s], dim=-1)
    return ACT(y) * 2.0 + s


ACT = torch.tanh


def test_a_rebound_global_a_shared_argument_turned_batched_and_new_ranks_are_each_followed():
    f = recompile.function(scale_act)
    vf = recompile.vmap(f, in_dims=(0, None))
    x = torch.randn(4, 3, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(vf(x, 0.5), torch.stack([scale_act(r, 0.5) for r in x]))
    code = built(f)
    assert sum(s.hits for s in code.segments) > 0
    with bound_globals(G, {"ACT": torch.sigmoid}):  # the raw function checks the callable it traced
        torch.testing.assert_close(vf(x, 0.5), torch.stack([scale_act(r, 0.5) for r in x]))
    s = torch.randn(4, dtype=torch.float64)  # shared at the trace, batched now
    got = recompile.vmap(f, in_dims=(0, 0))(x, s)
    torch.testing.assert_close(got, torch.stack([scale_act(r, k) for r, k in zip(x, s)]))
    for rank in (2, 3, 4, 5):  # more kinds than a segment traces: it ends up op by op, and right
        xr = torch.randn((4,) + (2,) * rank, dtype=torch.float64)
        torch.testing.assert_close(vf(xr, 0.5), torch.stack([scale_act(r, 0.5) for r in xr]))


def centered(y):
    return y - y.mean()  # (over the whole instance: not elementwise)


def product_halves(x, y):
    a, b = torch.chunk(x, 2, dim=0)  # a feature dim of each instance: dim 1 of the batch
    return torch.cat([ACT(a), b * y], dim=-1)  # (ACT alone: no fused op holds it)


@pytest.mark.parametrize("case", ["rebound_to_non_elementwise", "ranks_differ_after_the_trace"])
def test_facts_the_raw_forms_rely_on_are_checked_on_every_call(case):
    f = recompile.function(product_halves)
    vf = recompile.vmap(f)
    x, y = torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(2, 2, 3, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(vf(x, y), torch.stack([product_halves(a, b) for a, b in zip(x, y)]))
    assert sum(s.hits for s in built(f).segments) > 0
    assert "fused" not in recompile.function(product_halves).source()  # (the call of ACT is its own op)
    if case == "rebound_to_non_elementwise":
        with bound_globals(G, {"ACT": centered}):
            torch.testing.assert_close(vf(x, y), torch.stack([product_halves(a, b) for a, b in zip(x, y)]))
    else:  # y of rank 1 now: each instance's y lines up with its own rows, not with another instance's
        y1 = torch.randn(2, 3, dtype=torch.float64)
        torch.testing.assert_close(vf(x, y1), torch.stack([product_halves(a, b) for a, b in zip(x, y1)]))


def joined(x, y):
    z = torch.cat([x, y], dim=0)  # line of the error below
    return torch.tanh(z) * 2.0


def test_an_error_in_a_raw_segment_is_raised_as_the_op_by_op_run_raises_it_from_the_users_line():
    f = recompile.function(joined)
    vf = recompile.vmap(f)
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(vf(x, x), torch.stack([joined(a, a) for a in x]))
    vf(x, x)
    assert sum(s.hits for s in built(f).segments) > 0
    with pytest.raises(RuntimeError) as raw_error:
        vf(x, torch.randn(3, 2, 5))
    with segments_enabled(False):
        g = recompile.function(joined)
        with pytest.raises(RuntimeError) as plain_error:
            recompile.vmap(g)(x, torch.randn(3, 2, 5))
    assert str(raw_error.value) == str(plain_error.value)
    frames = traceback.extract_tb(raw_error.value.__traceback__)
    line = joined.__code__.co_firstlineno + 1
    assert any(fr.filename == __file__ and fr.lineno == line for fr in frames), frames


def bump(x, y):
    y += 1.0
    return torch.tanh(x) * y + x


def test_a_function_that_changes_a_value_in_place_gets_no_segments():
    f = recompile.function(bump)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    want_y = y.clone() + 1.0
    want = torch.tanh(x) * want_y + x
    got = recompile.vmap(f)(x, y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(y, want_y)
    assert built(f).segments == []



def appended_rows(x, w):
    y = torch.tanh(x) * 2.0 + w
    hs = []
    for row in y:
        hs.append(torch.sigmoid(row) * 3.0)
    total = torch.stack(hs).sum(0)
    return torch.tanh(total) * 0.5 + total * y.sum(0)


def test_a_function_whose_only_changes_are_appends_to_its_own_lists_runs_its_other_ops_raw():
    # (child-sum Tree-LSTMs and decoders build lists: the rest of such a function ran op by op)
    x = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def run(f):
        out = recompile.vmap(f, in_dims=(0, None))(x, w)
        return (out.detach(),), dict(zip("xw", torch.autograd.grad(out.sum(), (x, w))))

    with segments_enabled(True):
        f = recompile.function(appended_rows)
        code = built(f)
    with segments_enabled(False):
        plain = recompile.function(appended_rows)
    want = ((torch.stack([appended_rows(r, w) for r in x]).detach(),),
            dict(zip("xw", torch.autograd.grad(torch.stack([appended_rows(r, w) for r in x]).sum(), (x, w)))))
    for _ in range(3):  # the first call traces; the others run the raw functions
        got = run(f)
        assert_same(got, run(plain))
        assert_same(got, want)
    assert code.segments and all(not s.off and s.hits for s in code.segments), \
        [(s.name, s.off, s.hits) for s in code.segments]
    held = [op for s in code.segments for op in s.ops]
    assert not any(growing(op) for op in held)  # (no ``hs.append``, nor its call)
    assert sum(isinstance(op, ir.Fused) for op in held) >= 2  # (``tanh(x) * 2.0 + w``, the loop's and the last)


def walked_between(x):
    y = torch.tanh(x) * 2.0
    total = y[0] * 0.0
    for row in y:  # (the walk's ``as_sequence`` draws items: the ops before it are a segment of their own)
        total = total + row
    return torch.sigmoid(total) * 3.0 + total


def test_a_segment_ends_where_a_walk_draws_its_items_and_both_sides_run_raw():
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    cf = recompile.function(walked_between)
    code = built(cf)
    for _ in range(3):
        torch.testing.assert_close(recompile.vmap(cf)(x), torch.stack([walked_between(r) for r in x]))
    assert code.segments and all(not s.off for s in code.segments), [(s.name, s.off) for s in code.segments]
    assert not any(segments.draws_items(op) for s in code.segments for op in s.ops)


# -- what a trace must not take for granted (each found wrong once)


def split_and_join(x):
    return torch.cat(torch.split(torch.tanh(x), 2, dim=-1), dim=-1) * 3.0  # pieces: width / 2


def batched_keyword(x, s):
    return torch.mul(x, other=torch.tanh(s)) * 2.0


def joined_along(x, d):
    return torch.cat([torch.tanh(x), x], dim=d) * 2.0


def test_piece_counts_keyword_values_and_int_arguments_are_what_they_are_on_each_call():
    x4, x6 = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    f = recompile.vmap(recompile.function(split_and_join))
    for x in (x4, x4, x6):  # traced with two pieces, then three
        torch.testing.assert_close(f(x), torch.stack([split_and_join(r) for r in x]))
    x, s = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    g = recompile.vmap(recompile.function(batched_keyword))
    for _ in range(3):  # a batched value passed by keyword is batched in the raw function too
        torch.testing.assert_close(g(x, s), torch.stack([batched_keyword(a, b) for a, b in zip(x, s)]))
    h = recompile.vmap(recompile.function(joined_along), in_dims=(0, None))
    x = torch.randn(3, 2, 4)
    h(x, 1)
    h(x, 1)
    for bad in (True, 1.0):  # equal to the traced 1, but not an int: refused as eager refuses it
        with pytest.raises(TypeError, match="must be int|invalid combination"):  # (torch < 2.13 words it so)
            h(x, bad)


LEAKY = nn.LeakyReLU(0.5, inplace=True)


def leaky_keyword(x):
    y = F.leaky_relu(x, 0.5, inplace=True)
    return torch.tanh(y) * 2.0 + y


def leaky_module(x):
    y = LEAKY(x)
    return torch.tanh(y) * 2.0 + y


@pytest.mark.parametrize("fn", [leaky_keyword, leaky_module])
def test_an_op_that_changes_its_argument_in_place_is_not_run_twice(fn):
    f = recompile.vmap(recompile.function(fn))
    for _ in range(2):
        x, want_x = -torch.ones(3, 2), -torch.ones(3, 2)
        want = torch.stack([fn(r) for r in want_x])
        torch.testing.assert_close(f(x), want)
        torch.testing.assert_close(x, want_x)


def largest_times(x, it):
    return torch.tanh(x) * max(it) + x


def test_a_builtin_that_consumes_an_iterator_runs_once():
    f = recompile.vmap(recompile.function(largest_times), in_dims=(0, None))
    x = torch.randn(4, 3)
    for _ in range(2):
        torch.testing.assert_close(f(x, iter([1.0, 3.0, 2.0])), torch.tanh(x) * 3.0 + x)


def transposed_pairs(xs, n):
    pairs = [(torch.tanh(xs[t]), xs[t] * 2.0) for t in range(n)]
    hs, cs = zip(*pairs)  # (each instance's iterator, unpacked: no run may draw its items again)
    return torch.stack(hs).sum(0) * 2.0 + torch.stack(cs).mean(0)


def test_an_iterator_unpacked_in_a_segment_is_drawn_once():
    xs = torch.randn(4, 5, 3, dtype=torch.float64)
    n = torch.tensor([5, 2, 3, 1])
    cf = recompile.function(transposed_pairs)
    for _ in range(3):  # (the trace, then its raw function, which gives way to the op-by-op code where it draws)
        torch.testing.assert_close(recompile.vmap(cf)(xs, n), torch.stack([transposed_pairs(x, k) for x, k in
                                                                            zip(xs, n)]))
    assert not cf.stats.get("per_instance")


SCALES = [0.5, 2.0, -1.0]


def scaled_by_index(x, i):
    return torch.tanh(x) * SCALES[i] + x * 2.0  # a list indexed per instance: run once per instance


def test_per_instance_counts_are_the_op_by_op_runs_counts():
    x, i = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    with segments_enabled(False):
        plain = recompile.function(scaled_by_index)
        built(plain)
    raw = recompile.function(scaled_by_index)
    want = torch.stack([scaled_by_index(a, int(k)) for a, k in zip(x, i)])
    for _ in range(3):
        counts = []
        for cf in (plain, raw):
            cf.stats.reset()
            torch.testing.assert_close(recompile.vmap(cf)(x, i), want)
            counts.append(cf.stats["per_instance"])
        assert counts[0] == counts[1] and counts[0], counts


W_MM = torch.randn(5, 2)


def mm_helper(x):
    return torch.mm(x, W_MM)


def via_helper(x):
    return mm_helper(x) * 2.0  # returned only: the call is deferred


def softmax_of_deferred(x):
    y = via_helper(x)
    return torch.softmax(y, dim=-1) * 2.0 + torch.tanh(y)


def test_a_deferred_call_that_fails_when_a_trace_reads_it_raises_its_own_error():
    compiled = {name: recompile.function(G[name]) for name in ("mm_helper", "via_helper")}
    with bound_globals(G, compiled):
        f = recompile.function(softmax_of_deferred)
        with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
            recompile.vmap(f)(torch.randn(4, 3, 4))
    assert "internal error" not in str(info.value)


def test_an_error_of_a_traced_run_is_never_lost():
    """A raw function's error is raised by the op-by-op code from the user's line, or, where it does not
    happen again there (a one-shot fault), as the raw function raised it: never a value instead."""
    ran = []

    def op_by_op_fine(n, x):
        ran.append(x)
        return x

    def op_by_op_raises(n, x):
        raise IndexError("from the user's line")

    with pytest.raises(TimeoutError, match="one-shot"):
        segments._raised_again(TimeoutError("one-shot"), op_by_op_fine, 2, (7,))
    assert ran == [7]
    with pytest.raises(IndexError, match="user's line"):
        segments._raised_again(TimeoutError("one-shot"), op_by_op_raises, 2, (7,))


def reductions_along_dims(x, w):
    y = torch.logsumexp(x.unsqueeze(1) + w, 0) + torch.sum(x * w, (0, 1), True).squeeze(0)
    z = F.softmax(y, -1) * torch.amax(w * x.unsqueeze(0), 1) + torch.log_softmax(x, 0)
    return torch.cumsum(z, 0) + torch.mean(x.unsqueeze(0) * w, dim=1, keepdim=False)


def test_torch_functions_along_given_dims_run_raw_their_dims_moved_past_the_instance_dim():
    f = recompile.function(reductions_along_dims)
    vf = recompile.vmap(f, in_dims=(0, None))
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        got = vf(x, w)
        want = torch.stack([reductions_along_dims(r, w) for r in x])
        torch.testing.assert_close(got, want)
        got_grads = torch.autograd.grad(got.sum(), (x, w))
        want_grads = torch.autograd.grad(want.sum(), (x, w))
        for g, e in zip(got_grads, want_grads):
            torch.testing.assert_close(g, e)
    segs = built(f).segments
    assert sum(s.hits for s in segs) > 0
    source = "".join(src for s in segs for src in s.sources)
    assert "_call(" not in source  # (each by its raw form, none by its batch rule)


def scaled(v):
    """An undecorated helper: a nested run of its own for the group, which a trace runs before its later guards."""
    return torch.tanh(v) * 2.0


def through_a_helper(x):
    return scaled(x) + x.sum()


def test_the_trace_that_served_last_is_tried_first(monkeypatch):
    """A program run in float64 (a check against eager), then in float32: the float64 trace's guard fails only
    after the helper it holds ran, so tried first it would run the helper twice on every float32 call."""
    from recompile.runtime import helpers
    nested = []
    real = helpers.run
    monkeypatch.setattr(helpers, "run", lambda *args, **kw: nested.append(1) or real(*args, **kw))
    cf = recompile.function(through_a_helper)
    rows = torch.randn(4, 3, dtype=torch.float64)
    recompile.vmap(cf)(rows)
    for _ in range(3):
        got = recompile.vmap(cf)(rows.float())
    nested.clear()
    got = recompile.vmap(cf)(rows.float())
    torch.testing.assert_close(got, torch.stack([through_a_helper(r) for r in rows.float()]))
    assert len(nested) == 1
