"""Loops whose compiled calls wait for nothing the loop computes after them (passes/fission.py, runtime/split_loops.py).

Each model is a plain method body, compiled into a batched and a sequential class and run as plain Python in a
third; values and gradients must agree (float64). The loops that split must also run their calls together: one
run of the function per depth of the trees, not one per child.
"""

from __future__ import annotations

from itertools import repeat

import pytest
import torch
from torch import nn

import recompile
from recompile import config, diagnostics, ir
from recompile.passes import fission
from recompile.passes.effects import invoke_may_mutate, local_appends
from recompile.passes.pipeline import FINAL
from recompile.runtime import rows, split_loops
from test_segments import switched

LINES = open(__file__, encoding="utf-8").read().splitlines()

# Trees as index tensors: node i has n_kids[i] children, kids[i, :n_kids[i]] (-1 past them).
KIDS = torch.tensor([[1, 2, 3], [4, 5, -1], [-1, -1, -1], [6, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1],
                     [8, 9, -1], [10, -1, -1], [-1, -1, -1], [-1, -1, -1]])
N_KIDS = (KIDS >= 0).sum(1)
STARTS = torch.cat([torch.zeros(1, dtype=torch.long), N_KIDS.cumsum(0)])  # (the same trees as one flat list)
FLAT = KIDS[KIDS >= 0]
WORDS = torch.arange(11) % 7
ROOTS = torch.tensor([0, 7, 2, 1, 3])  # subtrees of 3, 3, 1, 2 and 2 levels


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 4)


def child_sum(self, kids, n_kids, words, i):
    h = self.embed(words[i])
    for k in range(n_kids[i]):
        h = h + self.encode(kids, n_kids, words, kids[i, k])
    return torch.tanh(self.mix(h))


def appended(self, kids, n_kids, words, i):
    hs = [self.embed(words[i])]
    fs = []
    for k in range(n_kids[i]):
        child = kids[i, k]
        h = self.encode(kids, n_kids, words, child)
        hs.append(h)
        fs.append(torch.sigmoid(self.gate(h)) * child.double())
    total = torch.stack(hs).sum(0)
    if fs:
        total = total + torch.stack(fs).max(0).values
    return torch.tanh(self.mix(total))


def flat_list(self, kids, n_kids, words, i):
    """The children read from one flat list, node i's at STARTS[i] up to STARTS[i + 1] (each node its own start)."""
    h = self.embed(words[i])
    for j in range(STARTS[i], STARTS[i + 1]):
        h = h + self.encode(kids, n_kids, words, FLAT[j]) * 0.5
    return torch.tanh(self.mix(h))


def row_stretch(self, kids, n_kids, words, i):
    """A ``for`` over each node's own stretch of its row, ``kids[i, :n_kids[i]]``."""
    h = self.embed(words[i])
    for child in kids[i, :n_kids[i]]:
        h = h + self.encode(kids, n_kids, words, child) * 0.5
    return torch.tanh(self.mix(h))


def summed(self, kids, n_kids, words, i):
    """Tai et al.'s child sum: ``sum`` of a comprehension's list, a leaf's empty (Python's 0)."""
    hs = [self.encode(kids, n_kids, words, kids[i, k]) for k in range(n_kids[i])]
    return torch.tanh(self.mix(self.embed(words[i]) + sum(hs)))


def summed_apart(self, kids, n_kids, words, i):
    """A leaf's 0 beside a (2, 1) tensor is (2, 1), a node's children's sum (2, 4): each instance's own."""
    hs = [self.encode(kids, n_kids, words, kids[i, k]) for k in range(n_kids[i])]
    total = torch.ones(2, 1, dtype=torch.float64) * words[i] + sum(hs)
    return torch.tanh(self.mix(self.embed(words[i]) + total.sum(0)))


def two_calls(self, kids, n_kids, words, i):
    h = self.embed(words[i])
    loss = torch.zeros((), dtype=torch.float64)
    for k in range(n_kids[i]):
        a, la = self.encode(kids, n_kids, words, kids[i, k])
        b, lb = self.encode(kids, n_kids, words, kids[i, 0])
        h = h + a * b if k % 2 == 0 else h - a
        loss = loss + la + lb.sum() * 0.5
    return torch.tanh(self.mix(h)), loss + h.pow(2).sum()


def chained(self, kids, n_kids, words, i):
    """Which child is called reads the previous call's result: the iterations are a chain, and the loop stays one."""
    h = self.embed(words[i])
    for k in range(n_kids[i]):
        child = kids[i, k] if h.sum() > 0 else kids[i, n_kids[i] - 1 - k]
        h = self.encode(kids, n_kids, words, child) * torch.sigmoid(h)
    return torch.tanh(self.mix(h))


def run_until(self, kids, n_kids, words, i):
    """The test reads what the calls give: how long the loop runs is not known first."""
    h = self.embed(words[i])
    k = 0
    while k < n_kids[i] and h.sum() < 100.0:
        h = h + self.encode(kids, n_kids, words, kids[i, k]).abs()
        k += 1
    return torch.tanh(self.mix(h))


def stops_early(self, kids, n_kids, words, i):
    """A ``break`` on the counter and a ``for`` over a tensor's row: the first pass knows where each loop ends."""
    h = self.embed(words[i])
    for k, child in enumerate(kids[i][:n_kids[i]]):
        h = h * 0.5 + self.encode(kids, n_kids, words, child)
        if k == 1:
            break
    return torch.tanh(self.mix(h))


def guarded(self, kids, n_kids, words, i):
    """A call under an ``if`` in the loop (a padded row of children): the instances taking it ask for it."""
    h = self.embed(words[i])
    for child in kids[i]:
        if child >= 0:
            h = h + self.encode(kids, n_kids, words, child)
    return torch.tanh(self.mix(h))


def guarded_appends(self, kids, n_kids, words, i):
    """The call on the ``else`` side, its result appended there to the frame's own list."""
    hs = [self.embed(words[i])]
    for child in kids[i]:
        if child < 0:
            hs.append(hs[0] * 0.0)
        else:
            hs.append(torch.sigmoid(self.encode(kids, n_kids, words, child)))
    return torch.tanh(self.mix(torch.stack(hs).sum(0) / len(hs)))


def guarded_computed(self, kids, n_kids, words, i):
    """The side computes its call's argument, guarded by the test (past a node's children, ``kids[i, k]`` would
    read past the row): only the instances taking it compute it, and again in the second pass."""
    h = self.embed(words[i])
    for k in range(3):
        if k < n_kids[i]:
            h = h + self.encode(kids, n_kids, words, kids[i, k + 3 * (k >= n_kids[i])] * 1)
    return torch.tanh(self.mix(h))


def guarded_noise(self, kids, n_kids, words, i):
    """The side computes its call's argument from a random draw, which running it again would not give: the
    loop stays one."""
    h = self.embed(words[i])
    for child in kids[i]:
        if child >= 0:
            h = h + self.encode(kids, n_kids, words, child + torch.randint(1, (), dtype=child.dtype))
    return torch.tanh(self.mix(h))


def guarded_by_results(self, kids, n_kids, words, i):
    """The test around the call reads an earlier call's result: the loop stays one."""
    h = self.embed(words[i])
    for child in kids[i]:
        if child >= 0 and h.sum() > -100.0:
            h = h + self.encode(kids, n_kids, words, child)
    return torch.tanh(self.mix(h))


def handed_on(self, kids, n_kids, words, i, seen):
    """The list the calls append to is their argument (the order of a depth-first walk), only appended to: each
    call fills a list of its own (``passes.accumulate``), extended into the frame's after it; the loop splits."""
    seen.append(int(i))
    h = self.embed(words[i])
    for k in range(n_kids[i]):
        h = h + self.encode(kids, n_kids, words, kids[i, k], seen)
    return torch.tanh(self.mix(h))


def handed_on_and_read(self, kids, n_kids, words, i, seen):
    """The list the calls append to is their argument, and read (its length): the loop stays one."""
    seen.append(int(i) + 0 * len(seen))
    h = self.embed(words[i])
    for k in range(n_kids[i]):
        h = h + self.encode(kids, n_kids, words, kids[i, k], seen)
    return torch.tanh(self.mix(h))


def grows_what_it_reads(self, kids, n_kids, words, i):
    """A ``for`` over the very list its body appends to: the loop stays one."""
    hs = [self.embed(words[i])]
    for h in hs:
        if len(hs) <= n_kids[i]:
            hs.append(self.encode(kids, n_kids, words, kids[i, len(hs) - 1]) + h)
    return torch.tanh(self.mix(torch.stack(hs).sum(0)))


def guarded_reads_list(self, kids, n_kids, words, i):
    """The side reads the list the loop appends to after its call: in the second pass, in order."""
    hs = [self.embed(words[i])]
    for child in kids[i]:
        if child >= 0:
            hs.append(self.encode(kids, n_kids, words, child) + hs[-1])
        else:
            hs.append(hs[-1] * 0.5)
    return torch.tanh(self.mix(torch.stack(hs).sum(0)))


def taken_apart(self, kids, n_kids, words, i):
    """The loop only takes each call's result apart, appends its parts and adds one up (``fission.at_once``): one
    step over every child's rows; a leaf's sum stays Python's 0.0, and the lists are read every way after it."""
    x = self.embed(words[i])
    hs, gs, total = [], [], 0.0
    for k in range(n_kids[i]):
        h, g, t = self.encode(kids, n_kids, words, kids[i, k])
        hs.append(h)
        gs.append(g)
        total = total + t
    h = torch.tanh(self.mix(x + (torch.stack(hs).sum(0) if hs else 0.0)))
    g = torch.sigmoid(self.gate(h)) + (sum(gs) if gs else 0.0) * 0.5
    for h_k, g_k in zip(hs, gs):
        g = g + h_k * g_k
    if hs:
        g = g + hs[-1] * len(hs) + torch.cat(gs).mean()
    return h, g, total + h.sum() * 0.25


def summed_onto_rows(self, kids, n_kids, words, i):
    """A sum that starts from each node's own tensor, its term added on the left (``t + total``)."""
    x = self.embed(words[i])
    total, hs = x.sum() * 0.5, []
    for k in range(n_kids[i]):
        h, t = self.encode(kids, n_kids, words, kids[i, k])
        total = t + total
        hs.append(h)
    h = torch.tanh(self.mix(x + (torch.stack(hs).sum(0) if hs else 0.0)))
    return h, total + h.sum()


def appended_whole(self, kids, n_kids, words, i):
    """Each call's result appended as it is; a list appended to again after the loop."""
    hs = []
    for k in range(n_kids[i]):
        hs.append(self.encode(kids, n_kids, words, kids[i, k]))
    hs.append(self.embed(words[i]))
    return torch.tanh(self.mix(torch.stack(hs).sum(0)))


def counted(self, kids, n_kids, words, i):
    """An int count added up beside a float sum: no float rows for it, the loop runs as written."""
    h = self.embed(words[i])
    hs, size = [], torch.tensor(1)
    for k in range(n_kids[i]):
        h_k, n_k = self.encode(kids, n_kids, words, kids[i, k])
        hs.append(h_k)
        size = size + n_k
    if hs:
        h = h + torch.stack(hs).sum(0)
    return torch.tanh(self.mix(h)) * size, size


def blocks_summed(self, kids, n_kids, words, i):  # (each child's call in an if of its own: asked for at once)
    h = self.embed(words[i])
    if n_kids[i] > 0:
        h = h + self.encode(kids, n_kids, words, kids[i, 0])
    if n_kids[i] > 1:
        h = h + torch.sigmoid(self.gate(self.encode(kids, n_kids, words, kids[i, 1])))
    return torch.tanh(self.mix(h))


def blocks_appended(self, kids, n_kids, words, i):  # (the ifs append to a list of the block's, in their order)
    hs = [self.embed(words[i])]
    if n_kids[i] > 2:
        hs.append(self.encode(kids, n_kids, words, kids[i, 2]) * 2.0)
    if n_kids[i] > 0:
        hs.append(self.encode(kids, n_kids, words, kids[i, 0]))
    return torch.tanh(self.mix(torch.stack(hs).sum(0) * hs[-1]))


def blocks_bare(self, kids, n_kids, words, i):  # (a call of the block itself, then one under an if)
    if n_kids[i] == 0:
        return torch.tanh(self.embed(words[i]))
    h = self.encode(kids, n_kids, words, kids[i, 0])
    if n_kids[i] > 1:
        h = h * self.encode(kids, n_kids, words, kids[i, 1])
    return torch.tanh(self.mix(h))


def blocks_chained(self, kids, n_kids, words, i):  # (the second if's test reads the first call's result)
    h = self.embed(words[i])
    if n_kids[i] > 0:
        h = h + self.encode(kids, n_kids, words, kids[i, 0])
    if n_kids[i] > 1 and h.sum() > -100.0:
        h = h + self.encode(kids, n_kids, words, kids[i, 1])
    return torch.tanh(self.mix(h))


def blocks_read_list(self, kids, n_kids, words, i):  # (the second call's argument reads the list the first grows)
    hs = [self.embed(words[i])]
    if n_kids[i] > 0:
        hs.append(self.encode(kids, n_kids, words, kids[i, 0]))
    if n_kids[i] > 1:
        hs.append(self.encode(kids, n_kids, words, kids[i, len(hs) - 1]))
    return torch.tanh(self.mix(torch.stack(hs).sum(0)))


MODELS = {"child_sum": child_sum, "appended": appended, "flat_list": flat_list, "summed": summed,
          "row_stretch": row_stretch, "summed_apart": summed_apart, "two_calls": two_calls, "chained": chained,
          "run_until": run_until, "stops_early": stops_early, "guarded": guarded,
          "guarded_appends": guarded_appends, "guarded_computed": guarded_computed,
          "guarded_by_results": guarded_by_results, "guarded_noise": guarded_noise,
          "guarded_reads_list": guarded_reads_list,
          "grows_what_it_reads": grows_what_it_reads, "taken_apart": taken_apart,
          "summed_onto_rows": summed_onto_rows, "appended_whole": appended_whole, "counted": counted,
          "blocks_summed": blocks_summed, "blocks_appended": blocks_appended, "blocks_bare": blocks_bare,
          "blocks_chained": blocks_chained, "blocks_read_list": blocks_read_list}


def three(body):
    plain = type("Plain", (Base,), {"encode": body})().double()
    batched = type("Batched", (Base,), {"encode": recompile.function(body, mode="batched")})().double()
    seq = type("Seq", (Base,), {"encode": recompile.function(body, mode="sequential")})().double()
    return plain, batched, seq


def flat(result):
    return list(result) if isinstance(result, tuple) else [result]


def grads_of(model, outputs):
    total = sum(o.sum() for o in outputs)
    return torch.autograd.grad(total, list(model.parameters()), allow_unused=True)


def assert_all_close(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
            continue
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", list(MODELS))
def test_batched_and_sequential_give_plain_values_and_gradients(name):
    plain, batched, seq = three(MODELS[name])
    per_root = [flat(plain.encode(KIDS, N_KIDS, WORDS, r)) for r in ROOTS]
    want = [torch.stack(col) for col in zip(*per_root)]
    want_grads = grads_of(plain, want)
    got = flat(recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS))
    assert_all_close(got, want)
    assert_all_close(grads_of(batched, got), want_grads)
    for r, w in zip(ROOTS, per_root):  # one instance at a time, each mode
        for model in (batched, seq):
            assert_all_close(flat(model.encode(KIDS, N_KIDS, WORDS, r)), w)


@pytest.mark.parametrize("name", ["child_sum", "appended", "flat_list", "summed", "row_stretch", "two_calls",
                                  "stops_early", "guarded", "guarded_appends", "guarded_computed",
                                  "blocks_summed", "blocks_appended", "blocks_bare"])
def test_a_split_loop_runs_each_depth_of_every_tree_once(name):
    _, batched, _ = three(MODELS[name])
    encode = type(batched).encode
    encode.stats.reset()
    with switched(config, "error", "PER_INSTANCE"):
        recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS)
    runs = encode.stats["batches"][encode.ir_name]["runs"]
    assert runs == 3  # (the roots, then each level below: every node's children asked for at once)


def splits_of(body):
    """The LoopSplit (or None) of each loop of ``body``'s compiled encode."""
    _, batched, _ = three(body)
    sg = type(batched).encode.build_for(type(batched)).stages[FINAL]
    appends = local_appends(sg)
    return [fission.split(op, appends, lambda invoke: invoke_may_mutate(invoke, FINAL))
            for s in sg.walk() for op in s.ops if isinstance(op, ir.While)]


def split_of(body):
    """The LoopSplit of ``body``'s one loop that splits."""
    (found,) = [f for f in splits_of(body) if f is not None]
    return found


@pytest.mark.parametrize("name, splits", [("child_sum", True), ("appended", True), ("two_calls", True),
                                          ("stops_early", True), ("chained", False), ("run_until", False),
                                          ("grows_what_it_reads", False), ("handed_on", True),
                                          ("handed_on_and_read", False),
                                          ("guarded", True), ("guarded_appends", True),
                                          ("guarded_computed", True), ("guarded_by_results", False),
                                          ("guarded_noise", False), ("guarded_reads_list", True)])
def test_which_loops_split(name, splits):
    found = splits_of(MODELS.get(name) or {"handed_on": handed_on, "handed_on_and_read": handed_on_and_read}[name])
    assert found
    assert any(f is not None for f in found) == splits




@pytest.mark.parametrize("name, splits", [("blocks_summed", True), ("blocks_appended", True), ("blocks_bare", True),
                                          ("blocks_chained", False), ("blocks_read_list", False),
                                          ("guarded", False), ("two_calls", False)])
def test_which_blocks_ask_for_their_calls_at_once(name, splits):
    _, batched, _ = three(MODELS[name])
    sg = type(batched).encode.build_for(type(batched)).stages[FINAL]
    found = fission.split_blocks(sg, lambda invoke: invoke_may_mutate(invoke, FINAL))
    assert bool(found) == splits
    for block in found.values():
        assert len(block.ask.calls) == 2 and not any(isinstance(o, ir.Invoke) for o in block.pre + block.rest)


@pytest.mark.parametrize("name, shape", [
    ("taken_apart", (3, [0, 1], (2,))), ("summed_onto_rows", (2, [0], (1,))), ("appended_whole", (None, [0], ())),
    ("child_sum", (None, [], (0,))), ("counted", (2, [0], (1,))), ("appended", None), ("two_calls", None),
    ("guarded_appends", None)])
def test_which_second_passes_run_at_once(name, shape):
    """(the result's length where it is unpacked, the elements appended, each sum's element), or None."""
    found = fission.at_once(split_of(MODELS[name]))
    assert (found and (found[0], [e for _, e in found[1]], found[2])) == shape
    if found:  # (each list its own invariant of the loop)
        assert len({q for q, _ in found[1]}) == len(found[1])


def at_once_results(monkeypatch):
    """A list that gets what every split loop's second pass at once gave (None where it ran as written)."""
    ran = []
    real = split_loops.SplitLoop._at_once

    def noted(self, result):
        ran.append(real(self, result))
        return ran[-1]

    monkeypatch.setattr(split_loops.SplitLoop, "_at_once", noted)
    return ran


@pytest.mark.parametrize("name, at_once", [("taken_apart", True), ("summed_onto_rows", True),
                                           ("appended_whole", True), ("child_sum", True), ("counted", False)])
def test_a_second_pass_at_once_runs_where_its_rows_are_tensors_alike(name, at_once, monkeypatch):
    ran = at_once_results(monkeypatch)
    plain, batched, _ = three(MODELS[name])
    got = flat(recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS))
    assert_all_close(got, [torch.stack(col) for col in zip(*[flat(plain.encode(KIDS, N_KIDS, WORDS, r))
                                                             for r in ROOTS])])
    assert ran and all((r is not None) == at_once for r in ran)


def test_a_loop_over_lists_a_loop_filled_at_once_reads_their_rows_where_they_lie(monkeypatch):
    read = []
    real = rows.Appended.rows_at

    def noted(self, instances, steps):
        read.append(real(self, instances, steps) is self.packed)
        return self.packed if read[-1] else real(self, instances, steps)

    monkeypatch.setattr(rows.Appended, "rows_at", noted)
    plain, batched, _ = three(taken_apart)  # (``for h_k, g_k in zip(hs, gs)``, a leaf's lists empty beside them)
    got = flat(recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS))
    want = [torch.stack(col) for col in zip(*[flat(plain.encode(KIDS, N_KIDS, WORDS, r)) for r in ROOTS])]
    assert_all_close(got, want)
    assert_all_close(grads_of(batched, got), grads_of(plain, want))
    assert read and all(read)


def test_a_leaf_keeps_the_start_of_a_sum_the_loop_added_to_at_once(monkeypatch):
    def total_of(self, kids, n_kids, words, i):
        total = 0.0
        for k in range(n_kids[i]):
            v, _ = self.encode(kids, n_kids, words, kids[i, k])
            total = total + v
        return self.embed(words[i]).sum() * 0.5, total  # (a leaf's total is Python's 0.0, its parent's a tensor)

    ran = at_once_results(monkeypatch)
    plain, batched, _ = three(total_of)
    roots = torch.tensor([0, 1, 7, 3, 2])  # (node 1's children are leaves: a leaf beside them in their frame)
    want = [plain.encode(KIDS, N_KIDS, WORDS, r) for r in roots]
    got = recompile.map(batched.encode, repeat(KIDS), repeat(N_KIDS), repeat(WORDS), list(roots))
    assert [type(g[1]) for g in got] == [type(w[1]) for w in want] and float in {type(w[1]) for w in want}
    for g, w in zip(got, want):
        assert g[1] == w[1] if type(w[1]) is float else torch.equal(g[1], w[1])
    assert any(r is not None for r in ran)


@pytest.mark.parametrize("fn", [handed_on, handed_on_and_read])
def test_calls_handed_the_list_they_append_to_keep_their_order(fn):
    plain, batched, seq = three(fn)
    for model in (plain, batched, seq):
        seen = []
        model.encode(KIDS, N_KIDS, WORDS, 0, seen)
        assert seen == [0, 1, 4, 5, 2, 3, 6]


def test_no_instance_runs_an_iteration():
    plain, batched, _ = three(child_sum)
    leaves = torch.tensor([2, 4, 6])
    got = recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, leaves)
    torch.testing.assert_close(got, torch.stack([plain.encode(KIDS, N_KIDS, WORDS, r) for r in leaves]))


def test_threads_give_the_same_values():
    plain, _, _ = three(appended)
    threaded = type("Threaded", (Base,), {"encode": recompile.function(appended, mode="batched", threads=2)})()
    threaded = threaded.double()
    threaded.load_state_dict(plain.state_dict())
    got = recompile.vmap(threaded.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS)
    want = torch.stack([plain.encode(KIDS, N_KIDS, WORDS, r) for r in ROOTS])
    torch.testing.assert_close(got, want)
    assert_all_close(grads_of(threaded, [got]), grads_of(plain, [want]))


def test_an_error_in_a_split_loop_names_its_chain():
    bad = KIDS.clone()
    bad[8, 0] = 11  # (node 8's child is past the end: its call fails reading its word)
    _, batched, _ = three(child_sum)
    with pytest.raises(IndexError) as info:
        recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(bad, N_KIDS, WORDS, ROOTS)
    chain = "\n".join(n for n in getattr(info.value, "__notes__", []) if "recompile call chain" in n)
    lines = chain.splitlines()[1:]
    assert len(lines) == 3 and all("child_sum" in line for line in lines)  # (root 7, node 8, node 11)
    assert "self.embed(words[i])" in LINES[int(lines[-1].rsplit(":", 1)[1].rstrip(")")) - 1]


def test_a_function_changing_a_value_in_place_keeps_its_loop():
    def in_place(self, kids, n_kids, words, i):
        h = self.embed(words[i]).clone()
        for k in range(n_kids[i]):
            h += self.encode(kids, n_kids, words, kids[i, k])
        return torch.tanh(self.mix(h))

    plain, batched, _ = three(in_place)
    encode = type(batched).encode
    encode.stats.reset()
    got = recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS)
    torch.testing.assert_close(got, torch.stack([plain.encode(KIDS, N_KIDS, WORDS, r) for r in ROOTS]))
    assert encode.stats["batches"][encode.ir_name]["runs"] > 3


def test_a_sum_of_no_children_beside_a_tensor_it_does_not_fit_runs_per_instance(monkeypatch):
    monkeypatch.setattr(diagnostics, "_warned", set())  # (warned once per program point: again here)
    plain, batched, _ = three(summed_apart)
    with pytest.warns(recompile.PerInstanceWarning, match="add"):
        got = recompile.vmap(batched.encode, in_dims=(None, None, None, 0))(KIDS, N_KIDS, WORDS, ROOTS)
    torch.testing.assert_close(got, torch.stack([plain.encode(KIDS, N_KIDS, WORDS, r) for r in ROOTS]))


class Chained(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))


def hand_on_last(self, kids, i, prev):
    """The call under the ``if`` is handed the last item of the list the loop appends to."""
    hs = [self.emb[i] + prev]
    for child in kids[i]:
        if child >= 0:
            hs.append(self.encode(kids, child, hs[-1]))
    return torch.tanh(torch.stack(hs).sum(0))


def test_a_call_under_an_if_handed_the_list_the_loop_grows_keeps_the_loop():
    plain = type("P", (Chained,), {"encode": hand_on_last})()
    batched = type("B", (Chained,), {"encode": recompile.function(hand_on_last, mode="batched")})()
    kids, prev = torch.tensor([[1, 2], [-1, -1], [3, -1], [-1, -1]]), torch.zeros(3, dtype=torch.float64)
    want = plain.encode(kids, 0, prev)
    got = batched.encode(kids, 0, prev)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), batched.emb)[0],
                               torch.autograd.grad(want.sum(), plain.emb)[0])


def test_a_number_where_torch_refuses_one_raises_as_python_does():
    def fn(x, n):
        hs = [x * k for k in range(n)]
        return torch.maximum(x, sum(hs))

    compiled = recompile.function(fn)
    xs = torch.arange(8.0).reshape(4, 2)
    with pytest.raises(TypeError):
        fn(xs[0], 0)
    with pytest.raises(TypeError):
        recompile.vmap(compiled)(xs, torch.tensor([0, 2, 0, 1]))


def checked_first(vals, left, right, i):  # (a check before the calls: it still stops the recursion first)
    if vals[i] < 0:
        raise ValueError(f"negative at node {int(i)}")
    total = vals[i]
    if left[i] >= 0:
        total = total + checked_first(vals, left, right, left[i])
    if right[i] >= 0:
        total = total + checked_first(vals, left, right, right[i])
    return total


def checked_between(vals, left, right, i):  # (a check between the ifs: the right call waits for it)
    total = vals[i]
    if left[i] >= 0:
        total = total + checked_between(vals, left, right, left[i])
    if vals[i] < 0:
        raise ValueError(f"negative at node {int(i)}")
    if right[i] >= 0:
        total = total + checked_between(vals, left, right, right[i])
    return total


def _check(v, i):
    if v < 0:
        raise ValueError(f"negative at node {int(i)}")


def checked_by_helper(vals, left, right, i):  # (a helper's check between the ifs: the right call waits for it)
    total = vals[i]
    if left[i] >= 0:
        total = total + checked_by_helper(vals, left, right, left[i])
    _check(vals[i], i)
    if right[i] >= 0:
        total = total + checked_by_helper(vals, left, right, right[i])
    return total


@pytest.mark.parametrize("fn", [checked_first, checked_between, checked_by_helper])
def test_a_raise_before_or_between_calls_asked_at_once_comes_where_python_raises_it(fn, monkeypatch):
    """Node 1 fails its check and so does node 6 below it on the right: Python raises node 1's error (its check
    comes before its right child's call); so must batched mode, alone or among other instances."""
    left = torch.tensor([1, 3, -1, 5, -1, -1, -1, -1])
    right = torch.tensor([2, 4, -1, 6, 7, -1, -1, -1])
    vals = torch.tensor([1., -1., 2., 3., 4., 5., -6., 7.], dtype=torch.float64)
    with pytest.raises(ValueError) as plain:
        fn(vals, left, right, 0)
    compiled = recompile.function(fn)
    monkeypatch.setitem(fn.__globals__, fn.__name__, compiled)
    for run in (lambda: compiled(vals, left, right, torch.tensor(0)),
                lambda: recompile.vmap(compiled, in_dims=(None, None, None, 0))(vals, left, right,
                                                                                torch.tensor([2, 0, 4]))):
        with pytest.raises(ValueError) as got:
            run()
        assert str(got.value) == str(plain.value)
    sg = compiled.build_for(None).stages[FINAL]
    found = fission.split_blocks(sg, lambda invoke: invoke_may_mutate(invoke, FINAL))
    assert bool(found) == (fn.__name__ == "checked_first")  # (else the right call waits for the check)
