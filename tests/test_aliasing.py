"""passes.aliasing: which branches and loops hand on values a later change in place may reach. Where none can,
a batched run hands on the copy of the rows a side worked on (the same values) instead of each instance's view
of the argument's rows: the program stays on batched tensors. Where one can, ``tests/test_aliases.py`` checks
that the change reaches the argument (each of its programs fails with the analysis finding nothing)."""

from __future__ import annotations

import pytest
import torch

import recompile
from recompile import ir
from recompile.passes import aliasing
from recompile.passes.pipeline import FINAL

F64 = torch.float64


def written_into_a_buffer(x, n):
    out = torch.zeros(6, 2, dtype=F64)
    base = out.sum()  # (read first by an op that is no ``+``: the writes below stay in place, ``passes.fresh``)
    for t in range(n):
        v = x[t] if x[t].sum() > 0 else x[t] * 2.0
        out[t] = v  # (copies v's values into out)
    return out.sum(0) + base


def scaled_in_place(x, n):
    acc = torch.zeros(2, dtype=F64)
    for t in range(n):
        v = x[t] if x[t].sum() > 0 else x[t] * 2.0
        acc = acc + v
        acc.clamp_(-1.5, 1.5)  # (in place: ``acc.mul_(0.5)`` would be written out of place, ``passes.fresh``)
    return acc


def added_in_place(x, n):
    acc = torch.zeros(2, dtype=F64)
    for t in range(n):
        v = x[t] if x[t].sum() > 0 else x[t] * 2.0
        acc += v
        acc.clamp_(max=2.0)
    return acc * 1.0


def hands_on_the_argument(x, n):
    w = x if n > 2 else x * 2.0
    w.mul_(2.0)  # (changes x where n > 2)
    return w


def returns_what_it_joined(x, n):
    return x if n > 2 else x * 2.0  # (the caller may change what it gets)


def list_appended_then_changed(x, n):
    hs = [x[0] * 0.0]
    w = x if n > 2 else x * 2.0
    hs.append(w[0])
    hs[1] += 1.0  # (a change through the list reaches w, and x where n > 2)
    return hs[0] + x.sum()


def changed_after_the_join(x, n):
    w = x if n > 2 else x * 2.0
    x.add_(1.0)  # (w sees it where it is x)
    return w.sum()


def conds_and_whiles(fn):
    sg = recompile.function(fn).callee(None).subgraph(FINAL)
    return [op for s in sg.walk() for op in s.ops if isinstance(op, (ir.Cond, ir.While))], sg


@pytest.mark.parametrize("fn", [written_into_a_buffer, scaled_in_place, added_in_place])
def test_a_branch_whose_result_no_later_change_reaches_hands_on_its_copy(fn):
    ops, sg = conds_and_whiles(fn)
    found = aliasing.reached(sg, lambda invoke: True).outputs
    assert any(isinstance(op, ir.Cond) for op in ops) and not any(isinstance(op, ir.Cond) for op in found)
    # (the loop hands on ``acc``, which the function returns and its caller may change; ``out`` it only writes)
    assert found == ({op for op in ops if isinstance(op, ir.While)} if fn is not written_into_a_buffer else set())


@pytest.mark.parametrize("fn", [hands_on_the_argument, returns_what_it_joined, list_appended_then_changed,
                                changed_after_the_join])
def test_what_a_later_change_may_reach_needs_the_arguments_rows(fn):
    ops, sg = conds_and_whiles(fn)
    assert aliasing.reached(sg, lambda invoke: True).outputs == set(ops)


@pytest.mark.parametrize("fn", [written_into_a_buffer, scaled_in_place, added_in_place])
def test_under_vmap_the_copies_handed_on_give_eager_values_and_gradients(fn):
    xs = torch.randn(5, 6, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    n = torch.tensor([6, 1, 3, 0, 4])
    leaf = xs.clone().requires_grad_()
    want = torch.stack([fn(leaf[k], int(n[k])) for k in range(5)])
    want_grad, = torch.autograd.grad(want.sum(), leaf)
    leaf = xs.clone().requires_grad_()
    got = recompile.vmap(recompile.function(fn))(leaf, n)
    got_grad, = torch.autograd.grad(got.sum(), leaf)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def test_a_loop_carried_tensor_is_known_as_one_and_a_list_is_not():
    _, sg = conds_and_whiles(written_into_a_buffer)
    known = aliasing.known_tensors(sg)
    loop = next(op for s in sg.walk() for op in s.ops if isinstance(op, ir.While))
    buffer = next(j for j, v in enumerate(loop.invariants) if isinstance(v, ir.Value) and "zeros" in v.hint)
    assert id(loop.body_sg.inputs[len(loop.loop_vars) + buffer]) in known  # (``out``, written in the loop)
    _, sg = conds_and_whiles(list_appended_then_changed)
    lists = [op.outputs[0] for s in sg.walk() for op in s.ops if isinstance(op, ir.Call) and "build_list" in
             repr(op.fn)]
    assert lists and not any(id(v) in known for v in lists)


def read_then_set(x, n):
    v = x * 1.0
    u = (x @ v.t()) if n > 2 else x * 2.0  # (reads v; a later change of v must reach what the product saved)
    v[0] = u[0]
    return v * 1.0


def kept_to_itself(x, n):
    y = x * 2.0
    u = (y * y) if n > 2 else y * 3.0  # (reads y, which nothing changes and the caller never sees)
    out = torch.zeros(2, dtype=F64)
    out[0] = u.sum()
    return out


def test_a_branch_or_loop_reading_what_a_later_change_reaches_notes_the_copies_it_reads():
    """(What the function was given counts: its caller may change it after the call.)"""
    ops, sg = conds_and_whiles(read_then_set)
    assert aliasing.reached(sg, lambda invoke: True).operands == set(ops)
    ops, sg = conds_and_whiles(written_into_a_buffer)
    assert aliasing.reached(sg, lambda invoke: True).operands == set(ops)  # (``out`` is written; x given)
    ops, sg = conds_and_whiles(kept_to_itself)
    assert ops and aliasing.reached(sg, lambda invoke: True).operands == set()


@pytest.mark.parametrize("fn, hands_on", [(returns_what_it_joined, True), (hands_on_the_argument, True),
                                          (scaled_in_place, False), (written_into_a_buffer, False)])
def test_whether_what_a_function_returns_may_hold_what_it_was_given(fn, hands_on):
    """(A level run joins copies: a recursion that may return its argument's rows runs on the agenda where its
    caller may change what it returns.)"""
    _, sg = conds_and_whiles(fn)
    assert aliasing.reached(sg, lambda invoke: True).hands_on_inputs is hands_on
