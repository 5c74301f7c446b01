"""autodiff.backprop and autodiff.factors: cotangents by tensor, sources, the autograd fallback, lazy parameter grads."""

import dataclasses
import itertools
import operator
import warnings

import pytest
import torch
from torch import nn

import recompile
from recompile.autodiff import backprop as bp
from recompile.autodiff.factors import Outer, Rows, form

F64 = torch.float64


def test_cotangents_accumulate_by_tensor_and_pop_once():
    ctx = bp.GradContext()
    t = torch.ones(2, dtype=F64)
    ctx.add(t, torch.full((2,), 2.0, dtype=F64))
    ctx.add(t, torch.full((2,), 3.0, dtype=F64))
    assert torch.equal(ctx.pop(t), torch.full((2,), 5.0, dtype=F64))
    assert ctx.pop(t) is None


def test_cotangents_go_through_lists_and_tuples():
    ctx = bp.GradContext()
    a, b = torch.zeros(1, dtype=F64), torch.zeros(1, dtype=F64)
    ctx.add([a, (b, 3)], [torch.ones(1, dtype=F64), (torch.ones(1, dtype=F64) * 2, None)])
    assert ctx.pop((a, b)) == (torch.ones(1, dtype=F64), torch.ones(1, dtype=F64) * 2)


def test_integer_tensors_get_no_cotangent():
    ctx = bp.GradContext()
    i = torch.tensor([1, 2])
    ctx.add(i, torch.ones(2))
    assert ctx.pop(i) is None


def test_a_source_collects_its_gradient_and_an_unseen_one_is_an_error():
    ctx = bp.GradContext()
    w = torch.ones(2, requires_grad=True)
    bp.note(ctx, w)
    ctx.add(w, torch.ones(2, dtype=F64))  # other dtype: cast to the source's
    ctx.add(w, torch.ones(3, 2))  # broadcast: summed to the source's shape
    (g,) = ctx.source_grads()
    assert g.dtype == torch.float32 and torch.equal(g, torch.full((2,), 4.0))
    other = torch.ones(2, requires_grad=True)
    try:
        ctx.add(other, torch.ones(2))
    except RuntimeError as exc:
        assert "without being seen" in str(exc)
    else:
        raise AssertionError("expected a RuntimeError")


def test_a_view_taken_without_grad_is_the_programs_own():
    w = torch.ones(3, 2, requires_grad=True)
    with torch.no_grad():
        row = w[0]
    assert row.requires_grad  # what torch reports ...
    assert bp.external(w) and not bp.external(row)  # ... and what recompile makes of it


def test_fallback_records_a_call_without_a_rule():
    ctx = bp.GradContext()
    lin = nn.Linear(2, 2).double()

    def helper(x, scale):
        return torch.erf(lin(x)) * scale

    x = torch.randn(2, dtype=F64)
    with torch.no_grad():
        out, how = bp.call_forward(ctx, helper, x, 3.0)
    assert not out.requires_grad and isinstance(how, bp.Recorded)
    assert set(ctx.sources) == {id(p) for p in lin.parameters()}  # the parameters it used
    assert ctx.fallbacks == {"test_fallback_records_a_call_without_a_rule.<locals>.helper": 1}
    g = torch.randn(2, dtype=F64)
    ctx.add(out, g)
    bp.call_backward(ctx, how, out, helper, x, 3.0)
    xr = x.clone().requires_grad_()
    want = torch.autograd.grad(helper(xr, 3.0), [xr, lin.weight, lin.bias], g)
    torch.testing.assert_close(ctx.pop(x), want[0])
    got_w, got_b = ctx.source_grads()
    torch.testing.assert_close(got_w, want[1])
    torch.testing.assert_close(got_b, want[2])


def test_fallback_gives_back_an_argument_returned_unchanged_and_mutates_the_callers_list():
    ctx = bp.GradContext()
    store = []

    def keep(xs, t):
        xs.append(len(xs))
        return t

    t = torch.ones(2, dtype=F64)
    with torch.no_grad():
        out, _ = bp.call_forward(ctx, keep, store, t)
    assert out is t and store == [0]


def test_plain_calls_run_as_they_are():
    ctx = bp.GradContext()
    xs = [1]
    out, how = bp.call_forward(ctx, xs.append, 2)
    assert out is None and how is None and xs == [1, 2]
    out, how = bp.call_forward(ctx, len, xs)
    assert out == 2 and how is None


def test_in_place_method_without_rule_is_refused_with_advice():
    ctx = bp.GradContext()
    t = torch.ones(2)
    try:
        with torch.no_grad():
            bp.call_forward(ctx, t.clamp_, 0)
    except NotImplementedError as exc:
        assert "clamp_" in str(exc) and "x = x.clamp(" in str(exc)
    else:
        raise AssertionError("expected NotImplementedError")


def test_in_place_arithmetic_methods_run_as_augmented_assignments():
    ctx = bp.GradContext()
    t = torch.ones(2)
    with torch.no_grad():
        out, how = bp.call_forward(ctx, t.mul_, torch.full((2,), 3.0))
    assert out is t and type(how) is bp.InPlace and how.op is operator.imul
    assert torch.equal(how.before, torch.ones(2)) and torch.equal(t, torch.full((2,), 3.0))


def test_deferred_parts_form_the_summed_gradient():
    torch.manual_seed(0)
    g1, x1 = torch.randn(3, 4, dtype=F64), torch.randn(3, 5, dtype=F64)
    g2, x2 = torch.randn(4, dtype=F64), torch.randn(5, dtype=F64)
    dense = torch.randn(4, 5, dtype=F64)
    got = form([Outer(g1, x1), dense, Outer(g2, x2)])
    torch.testing.assert_close(got, g1.T @ x1 + torch.outer(g2, x2) + dense)
    rows = torch.randn(3, 2, dtype=F64)
    index = torch.tensor([1, 4, 1])
    want = torch.zeros(6, 2, dtype=F64).index_add_(0, index, rows)
    torch.testing.assert_close(form([Rows(index, rows, (6, 2))]), want)
    torch.testing.assert_close(form([Rows(index[:2], rows[:2], (6, 2)), Rows(index[2:], rows[2:], (6, 2))]), want)


# --- calls the forward meets at run time, differentiated like eager (regressions from review) ---------

W3 = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(1))


def over_enumerate(x):
    total = x[0] * 0
    for i, row in enumerate(x):
        total = total + row * (i + 1)
    return total


def over_zip_and_list(x, y):
    rows = list(x)
    return torch.stack([a * b for a, b in zip(rows, y)])


def topk_helper(x):
    return torch.topk(x, 2).values.sum() + torch.sort(x).values[0]


def dict_helper(x):
    return _make_dict(x)["t"] * 2


def _make_dict(x):
    return {"t": torch.erf(x @ W3)}


def square_in_place(x):
    h = x * 1.0
    h *= h
    return h


HOOKED = nn.Linear(3, 3).double()
HOOKED.register_forward_hook(lambda module, inputs, out: out * 3)


def hooked_module(x):
    return HOOKED(x).sum()


@pytest.mark.parametrize("fn,args", [
    (over_enumerate, (torch.randn(4, 3, dtype=F64),)),
    (over_zip_and_list, (torch.randn(3, 2, dtype=F64), torch.randn(3, 2, dtype=F64))),
    (topk_helper, (torch.randn(5, dtype=F64),)),
    (dict_helper, (torch.randn(3, dtype=F64),)),
    (hooked_module, (torch.randn(3, dtype=F64),)),
], ids=lambda v: getattr(v, "__name__", ""))
def test_run_time_calls_differentiate_like_eager(fn, args):
    import recompile

    params = [W3, *HOOKED.parameters()]
    results = []
    for f in (fn, recompile.function(fn, mode="sequential")):
        xs = [a.clone().requires_grad_() for a in args]
        ws = [p.detach().clone().requires_grad_() for p in params]
        with torch.no_grad():
            for p, w in zip(params, ws):
                p.requires_grad_(True)
        out = f(*xs)
        out.sum().backward()
        results.append([out.detach()] + [x.grad for x in xs] + [p.grad for p in params])
        for p in params:
            p.grad = None
    for got, want in zip(results[1], results[0]):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_a_tensor_multiplied_by_itself_in_place_is_refused_as_eager_refuses_it(mode):
    """``h *= h``: eager's in-place product saves h as its other operand, then changes it, and refuses the
    backward; so does every mode (the derived gradient read the old h, batched mode wrote it out of place)."""
    import recompile

    x = torch.randn(3, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        square_in_place(x).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        recompile.function(square_in_place, mode=mode)(x).sum().backward()
    with torch.no_grad():  # (without a gradient: the square, as eager computes it)
        torch.testing.assert_close(recompile.function(square_in_place, mode=mode)(x), square_in_place(x))


def relu_module_on_a_view(x):
    h = x * 1.0
    return RELU(h[0]).sum() + h.sum()


RELU = nn.ReLU(inplace=True)


def test_in_place_module_on_a_view_is_refused_clearly():
    import recompile

    with pytest.raises(NotImplementedError, match="ReLU\\(inplace=True\\) on a view"):
        recompile.function(relu_module_on_a_view, mode="sequential")(torch.randn(2, 3, dtype=F64, requires_grad=True))


# -- end to end: the fallback's inputs, and augmented assignment to a number, in every mode against eager


def mul(a, b):
    return a * b


def helper_of_list(xs):
    return xs[0] * xs[1] + xs[0]


def square(a):
    return mul(a, a)  # (an undecorated helper given the call's input twice)


def square_by_alias(a):
    b = a
    return mul(a, b)


def square_in_list(a):
    return helper_of_list([a, a])


def square_by_keyword(a):
    return mul(a, b=a)


def summed(x):
    r = 0.0
    for v in x:
        r += v
    return r


def multiplied(x):
    r = 1.0
    for v in x:
        r *= v
    return r


def mixed_assignments(x):
    r = 2
    r -= x[0]
    s = 3.0
    s /= x[1]
    t = 2.0
    t **= x[2]
    u = 1.5
    u += x[0] * x[1]
    return r + s + t + u


def assigned_once(x):
    r = 0.0
    r += x[0]
    return r


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
@pytest.mark.parametrize("fn, x", [
    (square, 1.5), (square_by_alias, 1.5), (square_in_list, 1.5), (square_by_keyword, 1.5),
    (summed, [1.0, 2.0, 3.0]), (multiplied, [1.0, 2.0, 3.0]), (mixed_assignments, [0.5, 2.0, 1.5]),
    (assigned_once, [1.0, 2.0]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_gradients_of_helpers_given_a_tensor_twice_and_of_numbers_updated_by_tensors_are_eagers(fn, x, mode):
    want_x = torch.tensor(x, dtype=F64, requires_grad=True)
    want = fn(want_x)
    want.backward()
    got_x = torch.tensor(x, dtype=F64, requires_grad=True)
    got = recompile.function(fn, mode=mode)(got_x)
    got.backward()
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(got_x.grad, want_x.grad)


def softsign_helper(x):  # undecorated, without a gradient rule
    return x / (1 + x.abs())


def calls_a_helper_without_a_rule(x):
    return softsign_helper(x).sum()  # MARK: the user's line the warning names


def test_a_call_without_a_gradient_rule_warns_once_at_the_users_line():
    f = recompile.function(calls_a_helper_without_a_rule, mode="sequential")
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with pytest.warns(recompile.GradFallbackWarning, match="softsign_helper at test_backprop.py:") as seen:
        for _ in range(2):
            f(x).backward()
    (warning,) = [w for w in seen if w.category is recompile.GradFallbackWarning]
    assert "MARK" in open(warning.filename).read().splitlines()[warning.lineno - 1]
    assert 'mode="batched"' in str(warning.message)
    torch.testing.assert_close(x.grad, 2 * torch.autograd.grad(calls_a_helper_without_a_rule(x), x)[0])
    assert f.stats["grad_fallbacks"] == {"softsign_helper": 2}


class Holder:
    def __init__(self, v):
        self.v = v


def scale_from_dict(d, t):
    d["seen"] = True  # (a change the caller sees, as in eager code)
    return d["a"] * t


def scale_from_object(b, t):
    return b.v * t


def helper_given_a_dict(x):
    d = {"a": x * 2}
    y = scale_from_dict(d, x)
    return y.sum() + d["a"].sum() * float(d["seen"])


def helper_given_an_object(x):
    return scale_from_object(Holder({"k": [x * 2]}["k"][0]), x).sum()


def helper_given_nested(x):
    return scale_from_dict({"a": Holder(x * 3).v}, x * x).sum()


@pytest.mark.filterwarnings("ignore::recompile.GradFallbackWarning")
@pytest.mark.parametrize("mode", ["sequential", "threaded"])
@pytest.mark.parametrize("fn", [helper_given_a_dict, helper_given_an_object, helper_given_nested],
                         ids=lambda f: f.__name__)
def test_a_helper_reads_the_programs_tensors_inside_dicts_and_objects_for_the_gradient(fn, mode):
    """Tensors of the program's own inside a dict or an object given to a helper without a rule are recorded
    too (they were constants there: the gradient missed their part)."""
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(fn(x), x)[0]
    got = torch.autograd.grad(recompile.function(fn, mode=mode)(x), x)[0]
    torch.testing.assert_close(got, want)


def appends_through_a_helper(hs, box):
    hs.append(hs[-1] * 2)  # (the caller's list: it sees the new item, as in eager code)
    box["hs"].append(box["hs"][-1] * 3)
    return hs[-1].sum()


def grows_lists_in_a_helper(x):
    hs, box = [torch.tanh(x)], {"hs": [x * 1.0]}
    s = appends_through_a_helper(hs, box)
    return s + hs[-1].sum() * len(hs) + box["hs"][-1].sum() * len(box["hs"])


def reads_by_methods_then_changes(x):
    v = x * 2
    s = v.mul(3.0)  # (mul reads v only for a gradient of 3.0: none)
    v.add_(1)
    m = v.detach()
    v.relu_()
    return (s * v).sum() + m.sum()


def where_method_then_changed(x):
    y = x * 2
    z = y.where(x > 0, x)  # (the method's gradient reads only the condition's value)
    y += 1
    return (z * y).sum()


def where_by_keyword_then_changed(x):
    y = x * 2
    z = torch.where(condition=x > 0, input=y, other=x)
    y += 1
    return (z * y).sum()


@pytest.mark.filterwarnings("ignore::recompile.GradFallbackWarning")
@pytest.mark.parametrize("mode", ["sequential", "threaded"])
@pytest.mark.parametrize("fn", [grows_lists_in_a_helper, reads_by_methods_then_changes, where_method_then_changed,
                                where_by_keyword_then_changed], ids=lambda f: f.__name__)
def test_values_and_gradients_where_eager_computes_them(fn, mode):
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    want = fn(x)
    got = recompile.function(fn, mode=mode)(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(fn(x), x)[0])


def where_condition_changed_by_keyword(x):
    c = x > 0
    z = torch.where(condition=c, input=x * 2, other=x)
    c.logical_not_()  # (the condition the gradient reads, changed: eager refuses the backward)
    return z.sum()


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_a_changed_condition_of_where_by_keyword_is_refused_as_eager_refuses_it(mode):
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(where_condition_changed_by_keyword(x), x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(recompile.function(where_condition_changed_by_keyword, mode=mode)(x), x)


def item_read_then_changed(x):
    v = x * 1.0
    m = v[1] * v[1]  # (v[1] shares v's version: torch saved it for the product's gradient)
    v += 1.0
    return m.sum()


def item_scaled_then_changed(x):
    v = x * 1.0
    m = v[1] * 2.0  # (nothing saved for a gradient: eager computes)
    v += 1.0
    return m.sum() + v.sum()



# a view of v read (saved by the product for its gradient, or not: scaled by a number), then v changed in place


def t_read_then_changed(x):
    v = x * 1.0
    m = v.t() * v.t()
    v += 1.0
    return m.sum()


def t_scaled_then_changed(x):
    v = x * 1.0
    m = v.t() * 2.0
    v += 1.0
    return m.sum() + v.sum()


def T_read_then_changed(x):
    v = x * 1.0
    m = v.T * v.T
    v += 1.0
    return m.sum()


def T_scaled_then_changed(x):
    v = x * 1.0
    m = v.T * 2.0
    v += 1.0
    return m.sum() + v.sum()


def narrow_read_then_changed(x):
    v = x * 1.0
    m = v.narrow(0, 1, 1) * v.narrow(0, 1, 1)
    v += 1.0
    return m.sum()


def narrow_scaled_then_changed(x):
    v = x * 1.0
    m = v.narrow(0, 1, 1) * 2.0
    v += 1.0
    return m.sum() + v.sum()


def view_read_then_changed(x):
    v = x * 1.0
    m = v.view(6) * v.view(6)
    v += 1.0
    return m.sum()


def view_scaled_then_changed(x):
    v = x * 1.0
    m = v.view(6) * 2.0
    v += 1.0
    return m.sum() + v.sum()


def transpose_read_then_changed(x):
    v = x * 1.0
    m = torch.transpose(v, 0, 1) * torch.transpose(v, 0, 1)
    v += 1.0
    return m.sum()


def transpose_scaled_then_changed(x):
    v = x * 1.0
    m = torch.transpose(v, 0, 1) * 2.0
    v += 1.0
    return m.sum() + v.sum()


def slice_read_then_changed(x):
    v = x * 1.0
    m = v[:, 1:] * v[:, 1:]
    v += 1.0
    return m.sum()


def slice_scaled_then_changed(x):
    v = x * 1.0
    m = v[:, 1:] * 2.0
    v += 1.0
    return m.sum() + v.sum()


def unsqueeze_of_a_row_read_then_changed(x):
    v = x * 1.0
    m = v[0].unsqueeze(0) * v[0].unsqueeze(0)
    v += 1.0
    return m.sum()


def unsqueeze_of_a_row_scaled_then_changed(x):
    v = x * 1.0
    m = v[0].unsqueeze(0) * 2.0
    v += 1.0
    return m.sum() + v.sum()


def reshape_read_then_changed(x):
    v = x * 1.0
    m = v.reshape(6) * v.reshape(6)  # (a view: v is contiguous)
    v += 1.0
    return m.sum()


def reshape_scaled_then_changed(x):
    v = x * 1.0
    m = v.reshape(6) * 2.0
    v += 1.0
    return m.sum() + v.sum()


# (with an item, ``v[1]``: v[1] * v[1] then v += 1 gave the changed value's gradient, 6 for 4)
VIEWS = {name: (globals()[name + "_read_then_changed"], globals()[name + "_scaled_then_changed"])
         for name in ["item"] + ['t', 'T', 'narrow', 'view', 'transpose', 'slice', 'unsqueeze_of_a_row', 'reshape']}


def reshape_copied_then_changed(x):
    v = x * 1.0
    w = v.t().reshape(6)  # (a copy: v.t() is not contiguous)
    m = w * w
    v += 1.0
    return m.sum() + v.sum()


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_a_reshape_that_copied_reads_its_own_values_as_eager_does(mode):
    """v.t().reshape(6) is a copy: changing v afterwards changes nothing it saved, and eager computes."""
    x = torch.tensor([[1.0, 2.0, -3.0], [0.5, 4.0, 2.0]], dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(reshape_copied_then_changed(x), x)[0]
    got = torch.autograd.grad(recompile.function(reshape_copied_then_changed, mode=mode)(x), x)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_a_view_read_before_its_tensor_changed_in_place_is_checked_like_eager(view, mode):
    """v.t() * v.t() then v += 1: eager refuses the backward, and so does the compiled call (it gave the changed
    value's gradient); v.t() * 2.0 then v += 1: eager computes, and so does the compiled call."""
    x = torch.tensor([[1.0, 2.0, -3.0], [0.5, 4.0, 2.0]], dtype=torch.float64, requires_grad=True)
    read, scaled = VIEWS[view]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(read(x), x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(recompile.function(read, mode=mode)(x), x)
    want = torch.autograd.grad(scaled(x), x)[0]
    got = torch.autograd.grad(recompile.function(scaled, mode=mode)(x), x)[0]
    torch.testing.assert_close(got, want)



@dataclasses.dataclass(frozen=True)
class FrozenPair:
    a: torch.Tensor
    b: torch.Tensor


def _frozen_helper(p):  # (no gradient rule: recorded as it runs, its tensors swapped in place and back)
    return (p.a.sin() * p.b).sum()


def frozen_pair_to_a_helper(x, y):
    p = FrozenPair(x * 2.0, y)
    return _frozen_helper(p) + x.sum()


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_a_frozen_dataclass_of_tensors_made_and_given_to_a_helper_keeps_its_gradients(mode):
    """Made by a call without a rule and read by another: its fields are set as its own __init__ sets them
    (a frozen dataclass refuses setattr, which raised), and each keeps its gradient."""
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1.5, 0.25, -2.0], dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(frozen_pair_to_a_helper(x, y), (x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the helper has no rule: it warns so)
        got = torch.autograd.grad(recompile.function(frozen_pair_to_a_helper, mode=mode)(x, y), (x, y))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def mapped_then_stacked(x):
    return torch.stack(list(map(torch.neg, [x * 2.0, x * x]))).sum()


def mapped_into_a_list(x):
    xs = [x * 1.0]
    xs.extend(map(torch.tanh, [x * 2.0]))
    return torch.stack(xs).sum()


_MAP_CALLS = []


def _counted_double(v):
    _MAP_CALLS.append(v)
    if v.sum() < -100:
        raise ValueError("too small")
    return v * 2.0


def mapped_lazily(x):
    """A map is a map, reads its elements one at a time (the second, which would raise, is never read)."""
    _MAP_CALLS.clear()
    m = map(_counted_double, [x, x * 1000.0])
    return next(m).sum() * len(_MAP_CALLS) * (2.0 if isinstance(m, map) else 3.0)


def mapped_pairs(x):
    return sum(a * b for a, b in zip(map(torch.tanh, [x, x * 2.0]), [x, x])).sum()


@pytest.mark.parametrize("fn", [mapped_then_stacked, mapped_into_a_list, mapped_lazily, mapped_pairs],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_the_elements_a_map_computes_carry_their_gradients(fn, mode):
    """``map(f, xs)`` computes its elements when they are read, where the derived program records nothing: each
    is now recorded by torch.autograd as it is read, the map staying lazy (a lost gradient before: None, or the
    wrong sign)."""
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(fn(x), x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)  # (map has no rule: autograd records it)
        got = torch.autograd.grad(recompile.function(fn, mode=mode)(x), x)[0]
    torch.testing.assert_close(got, want)


def tensor_counter(xs, n):
    h = torch.zeros(2, dtype=xs.dtype)
    t = torch.zeros((), dtype=torch.long)
    while t < n:
        h = torch.tanh(xs[t] + h)
        t += 1  # (the index xs[t] read, changed in place: where the next cotangent would go)
    return h


def tensor_counter_out_of_place(xs, n):
    h = torch.zeros(2, dtype=xs.dtype)
    t = torch.zeros((), dtype=torch.long)
    while t < n:
        h = torch.tanh(xs[t] + h)
        t = t + 1
    return h


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_an_index_tensor_changed_in_place_after_a_read_is_refused_not_miscomputed(mode):
    """``xs[t]`` then ``t += 1``: the derived gradient read ``t`` as it is at the backward, and sent every row's
    cotangent one row on. It is refused now (eager, which reads a 0-d index as an int, computes it; the
    batched runtime records it as eager does); ``t = t + 1`` gives eager's gradient."""
    torch.manual_seed(0)
    xs = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    for fn in (tensor_counter, tensor_counter_out_of_place):
        want = torch.autograd.grad(fn(xs, 4).sum(), xs)[0]
        out = recompile.function(fn, mode=mode)(xs, 4)
        if fn is tensor_counter and mode != "batched":
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(out.sum(), xs)
            continue
        torch.testing.assert_close(torch.autograd.grad(out.sum(), xs)[0], want)


def mapped_over_a_growing_list(x):
    xs = [x * 1.0, x * 2.0]
    m = map(torch.neg, xs)
    xs.append(x * 5.0)
    return torch.stack(list(m)).sum()


def changed_after_the_map(x):
    y = x * 1.0
    m = map(torch.exp, [y])
    y.mul_(2.0)
    return next(m).sum()


@pytest.mark.parametrize("fn", [mapped_over_a_growing_list, changed_after_the_map], ids=lambda f: f.__name__)
def test_a_maps_elements_get_their_gradients_where_they_are_read(fn):
    """A list that grows after the map was made, a tensor in it changed in place: its elements are read later,
    and their gradients run where they were read (they ran where the map was made: too late for what changed
    in between, a silently wrong gradient)."""
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(fn(x), x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)
        got = torch.autograd.grad(recompile.function(fn, mode="sequential")(x), x)[0]
    torch.testing.assert_close(got, want)


def _stacked(it):
    return torch.stack(list(it)).sum()


def mapped_into_a_python_function(x):
    return _stacked(map(torch.exp, [x, x * 2.0]))


def test_a_map_read_inside_a_function_autograd_records_is_refused_clearly():
    """Read inside a call torch.autograd records (a function not compiled here), its elements would be cut from
    what they read (the gradient came back None): refused."""
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings(), pytest.raises(NotImplementedError, match="a map read inside a call"):
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)
        recompile.function(mapped_into_a_python_function, mode="sequential")(x)


def mapped_over_an_opaque_iterator(x):
    return next(map(torch.exp, itertools.repeat(x * 1.0))).sum()


def test_a_map_over_an_iterator_a_recorded_call_made_is_refused_clearly():
    """``itertools.repeat(x)`` has no rule: recorded, it holds a copy of x that no gradient reaches (the gradient
    came back None)."""
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings(), pytest.raises(NotImplementedError, match="a map over what a call"):
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)
        recompile.function(mapped_over_an_opaque_iterator, mode="sequential")(x)


def mapped_over_rows(x):
    return torch.stack(list(map(torch.sin, x * 2.0))).sum()


def mapped_over_a_list_and_a_tuple(x):
    return torch.stack(list(map(torch.mul, [x, x * 2.0], (x * 3.0, x + 1.0)))).sum()


def list_read_by_a_tensor_counter(x):
    hs = [x * 1.0, x * 2.0]
    t = torch.zeros((), dtype=torch.long)
    s = x.sum() * 0.0
    while t < 2:
        s = s + hs[t].sum()
        t += 1  # (a list's item: no index is read for its gradient)
    return s


def summed_map(x):
    return (sum(map(torch.sin, [x, x * 2.0])) + max(map(torch.sum, [x, x * 3.0]))).sum()


@pytest.mark.parametrize("fn", [mapped_over_rows, mapped_over_a_list_and_a_tuple, list_read_by_a_tensor_counter,
                                summed_map], ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_maps_of_rows_and_of_several_iterables_and_a_list_by_a_changed_index_are_eagers(fn, mode):
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    want = fn(x), torch.autograd.grad(fn(x), x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)
        out = recompile.function(fn, mode=mode)(x)
        torch.testing.assert_close((out, torch.autograd.grad(out, x)[0]), want)


def indexed_by_a_tuple_then_changed(x):
    i = torch.tensor([0, 1])
    v = x * 1.0
    y = v[i, 1].sum()
    i += 1  # (an index in the tuple, changed in place: eager refuses the backward)
    return y


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_an_index_in_a_tuple_changed_in_place_after_the_read_is_refused_as_eager_refuses(mode):
    x = torch.arange(6.0, dtype=torch.float64).reshape(3, 2).requires_grad_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(indexed_by_a_tuple_then_changed(x), x)
    out = recompile.function(indexed_by_a_tuple_then_changed, mode=mode)(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, x)


@dataclasses.dataclass
class _Scale:  # (eq=True: an unhashable callable)
    k: float

    def __call__(self, x):
        return x * self.k


_SCALE = _Scale(2.0)


def called_an_unhashable_callable(x):
    return _SCALE(x).sum()


def test_an_unhashable_callable_is_called_in_a_derived_forward():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)
        out = recompile.function(called_an_unhashable_callable, mode="sequential")(x)
    torch.testing.assert_close(torch.autograd.grad(out, x)[0], torch.full((2,), 2.0, dtype=torch.float64))
