"""recompile.passes.prune: Cond outputs nothing reads, Cond inputs no branch reads, and loop variables no one reads
but to hand them on are dropped; every op stays."""

from __future__ import annotations

import pytest
import torch

import recompile
from recompile import ir

MODES = ("sequential", "batched", "threaded")


def conds(fn, stage="prune", kind=ir.Cond):
    return [op for sg in fn.program(stage).all_subgraphs() for op in sg.ops if isinstance(op, kind)]


def hints(values):
    return sorted(v.hint for v in values)


# ---------------------------------------------------------------------------
# functions under test (plain; compiled inside the tests)


def gates(x, leaf):
    if leaf:
        ig, og, u = torch.chunk(x, 3, dim=-1)  # ig and u leave the Cond but nothing reads them after it
        c = torch.sigmoid(ig) * torch.tanh(u)
    else:
        ig, og, u = torch.chunk(x * 2, 3, dim=-1)
        c = torch.tanh(ig) + u
    return torch.sigmoid(og) * torch.tanh(c)


def nested(x, a, b):
    if a:
        if b:  # y is read only as the outer branch's y, which nothing reads
            y = x + 1
            z = x * 3
        else:
            y = x - 1
            z = x * 5
        w = z + 1
    else:
        y, w = x, x * 7
    return w


def passed_through(x, h, k):
    if k > 0:
        h = torch.tanh(x)  # the else branch passes the old h through; nothing reads h after the Cond
        out = x + k
    else:
        out = x - k
    return out


def effect_in_dropped_output(log, x, flag):
    if flag:
        dropped = log.append(("then", x))  # the output is dropped; the call is not
        kept = x + 1
    else:
        dropped = log.append(("else", x))
        kept = x - 1
    return kept


def one_branch_reads(x, s, k):
    if k > 0:
        out = x * s
    else:
        out = x
    return out


def parser(xs, leaves):
    """A shift-reduce loop: the popped states are bound on one side of the ``if`` and handed on by the other, at
    every step, though no step reads an earlier one's and nothing after the loop reads them."""
    stack, total = [], 0.0
    for t in range(len(leaves)):
        if leaves[t]:
            h = xs[t] * 2.0
        else:
            right = stack.pop()
            left = stack.pop()
            h = left * right
        total = total + h.sum()
        stack.append(h)
    return total, stack


def chained(xs):
    """b is read after the loop; a only to compute b; t by the test; d only by the op computing its next value,
    which stays (every op does), and so does d; c by nothing but the op computing d."""
    a, b, c, d, t = xs[0], xs[0], xs[0], xs[0], 0
    while t < len(xs):
        b = a * 2.0
        a = xs[t]
        c = xs[t] * 3.0  # (computed, not read: dropped as a variable, still computed)
        d = d + c
        t = t + 1
    return b


def bound_twice(xs):
    """h bound under two ``if``s at each step, read by nothing after the loop: the first ``if``'s h fed only the
    second's (dropped once the loop's h went)."""
    total = 0.0
    for x in xs:
        if x.sum() > 0:
            h = x * 2
        if x.sum() > 1:
            h = x * 3
        total = total + x.sum()
    return total


def unpacked_unread(pairs):
    for a, b in pairs:  # (a and b are read by nothing: the unpacking still raises where it fails)
        pass
    return len(pairs)


# ---------------------------------------------------------------------------
# 1. what the pass drops, and what it keeps


def test_cond_outputs_nothing_reads_are_dropped():
    f = recompile.function(gates)
    (before,) = conds(f, "capture")
    (after,) = conds(f)
    assert hints(before.outputs) == ["c", "ig", "og", "u"]
    assert hints(after.outputs) == ["c", "og"]
    for branch in after.subgraphs():
        assert len(branch.outputs) == 2
        # the branch's ops all stay: ig and u are still computed, for c
        assert [type(op) for op in branch.ops] == [type(op) for op in
                                                   next(b for b in before.subgraphs() if b.name == branch.name).ops]


def test_an_inner_cond_whose_output_fed_only_a_dropped_output_drops_it_too():
    f = recompile.function(nested)
    # (the outer z is bound on one path only: an output, unbound on the other path, until nothing reads it)
    assert sorted(hints(op.outputs) for op in conds(f, "capture")) == [["w", "y", "z"], ["y", "z"]]
    outputs = sorted(hints(op.outputs) for op in conds(f))
    assert outputs == [["w"], ["z"]]  # y went from both, the outer z too


def test_cond_inputs_no_branch_reads_are_dropped_and_inputs_one_branch_reads_are_kept():
    f = recompile.function(passed_through)
    (before,) = conds(f, "capture")
    (after,) = conds(f)
    assert hints(before.args) == ["h", "k", "x"]
    assert hints(after.args) == ["k", "x"]  # h was read only to be passed out again, and that output went
    assert hints(after.outputs) == ["out"]
    for branch in after.subgraphs():
        assert hints(branch.inputs) == ["k", "x"]
    g = recompile.function(one_branch_reads)
    (op,) = conds(g)
    assert hints(op.args) == ["s", "x"]  # s: only the then branch reads it


def test_loop_variables_read_only_to_hand_them_on_are_dropped():
    f = recompile.function(parser)
    (before,) = conds(f, "capture", ir.While)
    (after,) = conds(f, "prune", ir.While)
    assert {"t", "h", "right", "left"} <= set(hints(before.outputs))
    assert hints(after.outputs) == ["idx1", "total"]  # (the position in the range, and what the loop returns)
    (branch,) = [op for op in after.body_sg.ops if isinstance(op, ir.Cond)]
    assert hints(branch.outputs) == ["h"]
    g = recompile.function(chained)
    (loop,) = conds(g, "prune", ir.While)
    assert hints(loop.outputs) == ["a", "b", "d", "t"]
    assert len(loop.body_sg.inputs) == 4 + len(loop.invariants) == len(loop.cond_sg.inputs)
    (loop,) = conds(recompile.function(bound_twice), "prune", ir.While)
    assert "h" not in hints(loop.outputs)
    assert all("h" not in hints(op.outputs) for op in loop.body_sg.ops if isinstance(op, ir.Cond))


def test_capture_stage_is_not_modified():
    f = recompile.function(gates)
    f.program("prune")
    (before,) = conds(f, "capture")
    assert len(before.outputs) == 4


# ---------------------------------------------------------------------------
# 2. the program means the same: values, gradients and effects, in each mode


@pytest.mark.parametrize("mode", MODES)
def test_pruned_programs_compute_what_python_does(mode):
    torch.manual_seed(0)
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    for leaf in (True, False):
        got = recompile.function(gates, mode=mode)(x, leaf)
        want = gates(x, leaf)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    for a in (True, False):
        for b in (True, False):
            torch.testing.assert_close(recompile.function(nested, mode=mode)(x, a, b), nested(x, a, b))
    for k in (2, -2):
        torch.testing.assert_close(recompile.function(passed_through, mode=mode)(x, x * 3, k),
                                   passed_through(x, x * 3, k))
        torch.testing.assert_close(recompile.function(one_branch_reads, mode=mode)(x, 1.5, k),
                                   one_branch_reads(x, 1.5, k))


@pytest.mark.parametrize("mode", MODES)
def test_an_effect_computing_a_dropped_output_still_happens(mode):
    f = recompile.function(effect_in_dropped_output, mode=mode)
    log, want = [], []
    assert f(log, 1, True) == effect_in_dropped_output(want, 1, True)
    assert f(log, 2, False) == effect_in_dropped_output(want, 2, False)
    assert log == want == [("then", 1), ("else", 2)]


@pytest.mark.parametrize("mode", MODES)
def test_loops_without_their_unread_variables_compute_what_python_does(mode):
    torch.manual_seed(2)
    xs = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    leaves = [True, True, False, True, False]
    got, want = recompile.function(parser, mode=mode)(xs, leaves), parser(xs, leaves)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got[0], xs)[0], torch.autograd.grad(want[0], xs)[0])
    torch.testing.assert_close(recompile.function(chained, mode=mode)(xs), chained(xs))
    torch.testing.assert_close(recompile.function(bound_twice, mode=mode)(xs), bound_twice(xs))
    f = recompile.function(unpacked_unread, mode=mode)
    assert f([(1, 2), (3, 4)]) == 2
    with pytest.raises(ValueError, match="too many values to unpack"):
        f([(1, 2, 3)])


def test_a_batched_parser_loop_without_its_unread_variables():
    torch.manual_seed(3)
    xs = torch.randn(4, 5, 3, dtype=torch.float64)
    leaves = torch.tensor([[True, True, False, True, False]] * 2 + [[True, True, True, False, False]] * 2)
    got = recompile.vmap(recompile.function(lambda x, l: parser(x, l)[0]), in_dims=(0, 0))(xs, leaves)
    want = torch.stack([parser(x, l)[0] for x, l in zip(xs, leaves)])
    torch.testing.assert_close(got, want)


def test_batched_cond_over_diverging_instances_with_dropped_values():
    torch.manual_seed(1)
    xs = torch.randn(5, 6, dtype=torch.float64)
    leaves = torch.tensor([True, False, False, True, False])
    got = recompile.vmap(recompile.function(gates), in_dims=(0, 0))(xs, leaves)
    want = torch.stack([gates(x, bool(leaf)) for x, leaf in zip(xs, leaves)])
    torch.testing.assert_close(got, want)
