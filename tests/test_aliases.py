"""A value a branch or loop hands on is, for the instances that hand on an argument, that argument itself: a
later in-place change through it reaches the argument, under ``vmap`` as in eager code (``runtime.aliases``,
``batch.written_through``). Each program is checked against an eager loop over instances, values and gradients
in float64, and in every mode one instance at a time."""

from __future__ import annotations

import warnings

import pytest
import torch

import recompile
from recompile import config

F64 = torch.float64


def branch_then_change(x, b, c):
    v = x * 1.0
    if b > 0:
        w = v if c > 0 else v * 1.0  # w is v itself where c > 0
        w += 1.0
    return (v * v).sum()


def change_after_the_join(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    w *= 3.0
    return (v * x).sum() + w.sum()


def two_names_then_a_change(x, b, c):
    v = x * 1.0
    if c > 0:
        w = v
        u = v
    else:
        w = v * 1.0
        u = w
    u *= 2.0
    return (v * x).sum() + (w * x).sum()


def loop_hands_on_an_argument(x, b, c):
    v = x * 1.0
    w = v * 2.0
    i = 0
    while i < b:
        w = v  # the instances that run the loop end it with v itself
        i += 1
    w += 1.0
    return (v * x).sum() + w.sum()


def branch_in_a_loop_hands_on(x, b, c):
    v = x * 1.0
    i = 0
    w = v * 2.0
    while i < b:
        if c > 0:
            w = v
        i += 1
    w += 1.0
    return (v * x).sum() + w.sum()


def change_inside_the_loop_after_the_branch(x, b, c):
    v = x * 1.0
    w = v * 2.0
    for _ in range(b):
        if c > 0:
            w = v
        w += 1.0  # the instances that stay change v, through w, in a later step
    return (v * x).sum() + w.sum()


def nested_branches_then_a_change(x, b, c):
    v = x * 1.0
    w = v * 2.0
    if b > 0:
        if c > 0:
            w = v
        else:
            w = v * 3.0
    w += 1.0
    return (v * x).sum() + (w * x).sum()


def either_of_two(x, b, c):
    v = x * 1.0
    u = x * 2.0
    if c > 0:
        w = v
    else:
        w = u
    w += 1.0  # changes v where c > 0, u elsewhere
    return (v * x).sum() + (u * x).sum() * 3.0


def swapped_in_a_loop(x, b, c):
    a = x * 1.0
    d = x * 2.0
    i = 0
    while i < b:
        a, d = d, a
        i += 1
    a += 1.0
    return (a * x).sum() + (d * x).sum() * 3.0


def through_two_joins(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    u = w if b > 0 else w * 3.0
    u.mul_(2.0)  # changes w (v itself where c > 0) where b > 0: w's joined tensor must not be read stale
    return (w * x).sum() + (v * x).sum()


def handed_on_in_a_list(x, b, c):
    v = x * 1.0
    ws = [v] if c > 0 else [v * 3.0]
    ws[0].add_(1.0)
    return (v * x).sum()


def a_part_of_a_row_handed_on(x, b, c):
    v = x * 1.0
    w = v[0] if c > 0 else v[1]
    w.mul_(3.0)
    return (v * x).sum()


def a_view_of_the_joined_value_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    w[0].mul_(3.0)  # (through a view of the joined value's tensor: the change reaches v where c > 0)
    w[1] = w[1] + 1.0
    return (v * x).sum() + (w * x).sum()


def one_value_under_two_names(x, b, c):
    v = x * 1.0
    if c > 0:
        w = v
        z = v
    else:
        w = v * 2.0
        z = v
    w.add_(1.0)
    z.mul_(3.0)
    return (v * x).sum() + (w * x).sum() + (z * x).sum()


def pick(v, c):  # changes nothing itself: the caller changes what it hands on
    if c > 0:
        return v
    return v * 2.0


def a_helper_hands_on(x, b, c):
    v = x * 1.0
    w = pick(v, c)
    w.mul_(2.0)
    return (v * x).sum()


def walk(v, d):
    if d <= 0:
        return v
    w = walk(v, d - 1)
    w.mul_(1.5)
    return w * 1.0 if d == 2 else w


def recursion_hands_on(x, b, c):
    v = x * 1.0
    w = walk(v, b)
    w.add_(1.0)
    return (v * x).sum() + (w * x).sum()


def other_rows_of_the_source_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    y = w * x  # saves w: v itself only where c > 0
    if c <= 0:
        v.add_(1.0)  # changes v only where w is not v: nothing the product saved (one version counter for v)
    return y.sum() + w.sum()



# What ``passes.aliasing`` must see: each hands on the argument itself where c > 0, and a later change in place
# reaches it through a list, a dict, a view, a helper, a module or a function that hands on its input


def stored_in_a_list_then_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    xs = [x * 0.0]
    xs[0] = w  # (the list holds w itself)
    xs[0] += 1.0
    return (v * x).sum()


def a_list_joined_then_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    ys = [w] + [x * 0.0]
    ys[0].mul_(3.0)
    return (v * x).sum()


def appended_then_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    hs = []
    hs.append(w)
    hs[-1].add_(1.0)
    return (v * x).sum() + len(hs)


def changed_through_a_dict(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    d = {"w": w}
    d["w"] += 1.0
    return (v * x).sum()


def bump(z):  # an undecorated helper that changes its argument
    z += 1.0


def changed_by_a_helper(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    bump(w)
    return (v * x).sum()


def the_argument_changed_after_the_join(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    v.add_(1.0)  # (w is v where c > 0: it sees the change)
    return (w * x).sum()


def changed_through_a_view_of_the_joined_value(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    u = w.view(-1)
    u[0] = 5.0
    return (v * x).sum()


HANDS_ON = torch.nn.Identity()


def handed_on_by_a_module_and_a_method(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    u = HANDS_ON(w).to(F64)  # (both hand on w itself)
    u.mul_(2.0)
    return (v * x).sum()


def handed_on_by_dropout_that_does_not_train(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    u = torch.nn.functional.dropout(w, 0.5, training=False)  # (w itself)
    u.add_(1.0)
    return (v * x).sum()


# (v made by arithmetic with a tensor the function made: the analysis knows it for a tensor, and groups no
# method's result with it)


def changed_by_a_torch_function_in_place(x, b, c):
    v = torch.zeros(2, dtype=F64) + x - 0.3
    w = v if c > 0 else v * 2.0
    torch.Tensor.mul_(w, 3.0)
    torch.Tensor.add_(w, 1.0)
    return (v * x).sum()


def the_argument_changed_by_a_torch_function_after_a_loop(x, b, c):
    v = torch.zeros(2, dtype=F64) + x - 0.3
    w = v * 2.0
    i = 0
    while i < b:
        w = v
        i += 1
    torch.relu_(v)  # (w is v where b > 0: it sees the change)
    return (w * x).sum()


def held_by_a_list_repeated_by_a_tensor(x, b, c):
    v = torch.zeros(2, dtype=F64) + x
    w = v if c > 0 else v * 2.0
    ys = [w] * torch.ones((), dtype=torch.long)  # (a list that holds w)
    ys[0].mul_(3.0)
    return (v * x).sum()


RELU_IN_PLACE = torch.nn.ReLU(inplace=True)


def changed_by_an_in_place_flag(x, b, c):
    v = torch.zeros(2, dtype=F64) + x - 0.3
    w = v if c > 0 else v * 2.0
    torch.nn.functional.leaky_relu(w, 0.5, True)  # (its inplace flag by position)
    return (v * x).sum()


def changed_by_an_in_place_module(x, b, c):
    v = torch.zeros(2, dtype=F64) + x - 0.3
    u = v if c > 0 else v * 3.0
    RELU_IN_PLACE(u)
    return (v * x).sum()



@recompile.function
def put_into(xs, d, v, c):  # (compiled apart: what it puts into its caller's list and dict, the caller changes)
    w = v if c > 0 else v * 2.0
    xs.append(w)
    d.update({"w": w})


@recompile.function
def put_after_a_loop(xs, v, b):
    w = v * 2.0
    i = 0
    while i < b:
        w = v
        i += 1
    xs.insert(0, w)


def put_into_the_callers_containers_then_changed(x, b, c):
    v = torch.zeros(2, dtype=F64) + x
    xs, d = [], {}
    put_into(xs, d, v, c)
    xs[0].add_(1.0)
    d["w"].mul_(2.0)
    ys = []
    put_after_a_loop(ys, v, b)
    ys[0].add_(0.5)
    return (v * x).sum()



def changed_through_a_method_read_by_getattr(x, b, c):
    v = torch.zeros(2, dtype=F64) + x
    w = v if c > 0 else v * 2.0
    getattr(w, "add_")(1.0)  # (the builtin called by its name: w.add_)
    return (v * x).sum()



def pick_deep(v, c, d):  # (an undecorated recursion changing nothing: a level program, where its caller does not
    if d <= 0:           # change what it returns)
        return v if c > 0 else v * 2.0
    return pick_deep(v, c, d - 1)


def a_recursion_hands_on_from_a_branch(x, b, c):
    v = torch.zeros(2, dtype=F64) + x
    w = pick_deep(v, c, 2)
    w.add_(1.0)
    return (v * x).sum()


PROGRAMS = [either_of_two, swapped_in_a_loop, branch_then_change, change_after_the_join, two_names_then_a_change,
            loop_hands_on_an_argument, branch_in_a_loop_hands_on, change_inside_the_loop_after_the_branch,
            nested_branches_then_a_change, through_two_joins, handed_on_in_a_list, a_part_of_a_row_handed_on,
            a_view_of_the_joined_value_changed, one_value_under_two_names, a_helper_hands_on, recursion_hands_on,
            other_rows_of_the_source_changed, stored_in_a_list_then_changed, a_list_joined_then_changed,
            appended_then_changed, changed_through_a_dict, changed_by_a_helper, the_argument_changed_after_the_join,
            changed_through_a_view_of_the_joined_value, handed_on_by_a_module_and_a_method,
            handed_on_by_dropout_that_does_not_train, changed_by_a_torch_function_in_place,
            the_argument_changed_by_a_torch_function_after_a_loop, held_by_a_list_repeated_by_a_tensor,
            changed_by_an_in_place_flag, changed_by_an_in_place_module,
            put_into_the_callers_containers_then_changed, changed_through_a_method_read_by_getattr,
            a_recursion_hands_on_from_a_branch]
X = torch.randn(7, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
B = torch.tensor([1, 1, -1, 2, 1, 0, 3])
C = torch.tensor([1, -1, 1, 1, 1, -1, 1])


def eager(fn):
    x = X.clone().requires_grad_()
    out = torch.stack([fn(x[k], B[k], C[k]) for k in range(len(B))])
    out.sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("fn", PROGRAMS)
def test_under_vmap_a_change_through_a_handed_on_value_reaches_the_argument(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")  # (``w += 1`` on a joined value runs per instance)
    want, want_grad = eager(fn)
    x = X.clone().requires_grad_()
    got = recompile.vmap(recompile.function(fn))(x, B, C)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    torch.testing.assert_close(x.grad, want_grad)


# (sequential and threaded mode run an undecorated helper on the leaves of the derived gradient program: one that
# changes its argument in place meets autograd's refusal to change a leaf that requires grad)
HELPER_REFUSED = pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "known: sequential and threaded mode refuse an undecorated helper changing its argument in place with "
    "gradients on"))


@pytest.mark.parametrize("mode, fn", [
    pytest.param(mode, fn, marks=HELPER_REFUSED if fn is changed_by_a_helper and mode != "batched" else ())
    for fn in PROGRAMS for mode in ("sequential", "threaded", "batched")])
def test_one_instance_at_a_time_a_change_through_a_handed_on_value_reaches_the_argument(fn, mode):
    want, want_grad = eager(fn)
    run = recompile.function(fn, mode=mode)
    x = X.clone().requires_grad_()
    if fn in (a_part_of_a_row_handed_on, a_view_of_the_joined_value_changed,
              changed_through_a_view_of_the_joined_value) and mode != "batched":
        # (the derived gradient refuses a change through a view: docs/sharp-bits.md)
        with pytest.raises(NotImplementedError, match="view"):
            run(x[0], B[0], C[0]).backward()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.stack([run(x[k], B[k], C[k]) for k in range(len(B))])
    torch.testing.assert_close(got.detach(), want)
    got.sum().backward()
    torch.testing.assert_close(x.grad, want_grad)


def saved_then_changed_through_a_branchs_result(x, b, c):
    v = torch.tanh(x)  # saves its result
    w = v if c > 0 else v + 0.0
    if b > 0:
        w.mul_(2.0)  # changes v itself where c > 0: tanh's backward refuses, as eager's does
    return (v * x).sum()


def raises_as_eager(fn):
    """Eager's backward of ``fn`` over X, B, C refuses a change in place, and so does ``vmap``'s."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager(fn)
    got = recompile.vmap(recompile.function(fn))(X.clone().requires_grad_(), B, C)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.sum().backward()


def gradient_as_eager(fn, b, c):
    """``vmap``'s gradient of ``fn`` over X, ``b``, ``c`` is eager's."""
    x = X.clone().requires_grad_()
    want = torch.autograd.grad(torch.stack([fn(x[k], b[k], c[k]) for k in range(len(b))]).sum(), x)[0]
    got = recompile.vmap(recompile.function(fn))(x, b, c)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], want)


def test_under_vmap_a_change_through_a_handed_on_value_moves_the_arguments_version(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    raises_as_eager(saved_then_changed_through_a_branchs_result)
    # (no instance both takes the branch and hands v on: every gradient is eager's)
    gradient_as_eager(saved_then_changed_through_a_branchs_result, torch.where(C > 0, torch.zeros_like(B), B), C)


def saved_then_its_source_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0
    y = w * x  # saves w, which is v itself where c > 0
    v.add_(1.0)  # changes what the product saved there: eager's backward raises
    return y.sum()


def test_under_vmap_a_change_of_what_a_joined_value_holds_moves_its_tensors_version(monkeypatch):
    """A value joined from pieces is read through one tensor made from them, which an op saves where eager's
    saved the pieces' own tensors: a change of a piece moves that tensor's version too (``batch.CACHES``)."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    raises_as_eager(saved_then_its_source_changed)
    gradient_as_eager(saved_then_its_source_changed, B, -torch.ones_like(C))  # (no instance hands v on)


@recompile.function
def squares_summed_in_a_loop(v, b):  # (compiled apart; changes nothing itself)
    acc = torch.zeros(2, dtype=F64)
    i = 0
    while i < b:
        acc = acc + v * v  # (saves v: its rows, gathered for the loop's steps)
        i += 1
    return acc.sum()


def read_in_a_callees_loop_then_changed(x, b, c):
    v = torch.zeros(2, dtype=F64) + x
    s = squares_summed_in_a_loop(v, b)
    v.add_(1.0)  # (changes what the callee's products saved: eager's backward raises)
    return s


def read_in_a_recursions_branch(v, c, d):
    if d <= 0:
        u = (v * v) if c > 0 else v * 2.0
        return u.sum()
    return read_in_a_recursions_branch(v, c, d - 1)


def read_in_a_recursion_then_changed(x, b, c):
    v = torch.zeros(2, dtype=F64) + x
    s = read_in_a_recursions_branch(v, c, 2)
    v.add_(1.0)
    return s


@pytest.mark.parametrize("fn", [read_in_a_callees_loop_then_changed, read_in_a_recursion_then_changed])
def test_under_vmap_a_change_of_what_a_callee_read_and_saved_raises_in_the_backward_as_eager_does(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    raises_as_eager(fn)


# a value some instances' loop or branch left in one tensor and others in another, changed in place: the
# instances' tensors are changed by one op on their stack (each op per instance would move the version of rows
# another instance's op saved), and each then holds its row, as eager's own tensor does
def left_a_loop_then_changed(x, b, c):
    v = x * 1.0
    for _ in range(2):
        v = -v
        if b > 0:
            break
    v += c * 0.5
    v.clamp_(min=-0.5)
    v.sigmoid_()
    return torch.maximum(v, x).sum()


def left_a_loop_then_changed_after_a_read(x, b, c):
    v = x * 1.0
    for k in range(3):
        if k >= b:
            break
        v = v * 0.5 - x
    m = v * x  # (saves v: eager's backward raises once v changes)
    v += 1.0
    return (torch.maximum(v, x) + m).sum()


def joined_twice_then_changed(x, b, c):
    v = x * 3.0 if b > 0 else x * 2.0
    v = v * 1.0 if c > 0 else v
    v.relu_()
    return v.sum() + x.sum()


@pytest.mark.parametrize("fn", [left_a_loop_then_changed, joined_twice_then_changed])
def test_under_vmap_an_in_place_change_of_values_held_apart_is_one_op_with_eagers_gradient(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    gradient_as_eager(fn, B, C)


def test_under_vmap_an_in_place_change_of_values_held_apart_after_a_read_raises_as_eager(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    raises_as_eager(left_a_loop_then_changed_after_a_read)


def activated_apart_then_changed(x, b, c):
    v = x * 1.0
    w = v if c > 0 else v * 2.0  # (held apart: v's own row, or a new tensor)
    w.sigmoid_()  # (saves its result: where c > 0, v)
    v.add_(1.0)  # (eager's backward raises where c > 0)
    return w * x


def left_a_loop_activated_then_changed(x, b, c):
    v = x * 1.0
    k = 0
    while k < b and k < 3:  # (the instances leave at their own steps)
        v = v * 0.5 - x
        k += 1
    v.sigmoid_()
    v += 1.0  # (changes what sigmoid_ saved: eager's backward raises)
    return v * x


@pytest.mark.parametrize("fn", [activated_apart_then_changed, left_a_loop_activated_then_changed])
def test_under_vmap_a_change_after_an_activation_of_values_held_apart_raises_as_eager(fn, monkeypatch):
    """The activation ran on the stack of the instances' tensors, which its backward saved: a later change of an
    instance's tensor moves the stack's version too (``batch.note_made_from``, written)."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    raises_as_eager(fn)
