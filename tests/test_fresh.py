"""``x += y`` of an x only the frame holds, written out of place (passes/fresh.py).

Each program is compared with plain Python (eager PyTorch) in every mode and under ``recompile.vmap``: values,
dtypes, gradients in float64, and the same exception type where eager raises.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import config
from recompile.data import Forest
from test_segments import WORDS, built, switched, trees

MODES = ["sequential", "threaded", "batched"]
F64 = torch.float64


def rewritten(fn):
    """Whether the program of ``fn`` holds an augmented op written out of place, and one left in place."""
    text = recompile.function(fn).dump(stage="fresh")
    return "_fresh(" in text, "call iadd(" in text or "call isub(" in text or "call imul(" in text


def tree_loss(xs, left, right, i):
    """A tree's summed loss written ``loss += ...`` (a leaf's ``loss = 0.0``, a node's ``loss_l + loss_r``)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = tree_loss(xs, left, right, left[i])
        hr, loss_r = tree_loss(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    loss += torch.log_softmax(h, -1)[0].neg()
    return h, loss


def forest():
    left = torch.tensor([1, 3, -1, -1, -1, 6, -1, -1])
    right = torch.tensor([2, 4, -1, -1, -1, 7, -1, -1])
    return left, right, torch.tensor([0, 5, 2, 1])


def test_a_loss_added_with_plus_equals_is_written_out_of_place_and_runs_as_levels():
    assert rewritten(tree_loss) == (True, False)
    compiled = recompile.function(tree_loss)
    left, right, roots = forest()
    xs = torch.randn(8, 3, dtype=F64, requires_grad=True)
    h, loss = (torch.stack([torch.as_tensor(v) for v in vs])
               for vs in zip(*[tree_loss(xs, left, right, int(r)) for r in roots]))
    want = (h, loss), torch.autograd.grad(h.sum() + loss.sum(), xs)
    with switched(config, "error", "PER_INSTANCE"):
        for _ in range(2):
            got_h, got_loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
            got = (got_h, got_loss), torch.autograd.grad(got_h.sum() + got_loss.sum(), xs)
            torch.testing.assert_close(got, want)
    levels = built(compiled).unit.levels
    assert levels is not None and levels.plain.runs == 2 and levels.plain.late.positions == [1]
    for mode in MODES:
        f = recompile.function(tree_loss, mode=mode)
        got_h, got_loss = f(xs, left, right, 0)
        torch.testing.assert_close((got_h, got_loss), (h[0], loss[0]))


def made_then_scaled(x, w):
    v = x * 2.0
    y = v * w  # (its gradient reads v: eager refuses the backward once v changes in place)
    v += 1.0
    return y.sum() + v.sum()


def argument_changed(x, y):
    x += y  # (the caller's tensor: changed in place, as in Python)
    return x * 1.0


def kept_before(x):
    v = x + 1.0
    kept = v
    v += 1.0
    return kept * 1.0  # (the same object: its change shows)


def listed_before(x):
    v = x + 1.0
    held = [v]
    v += 1.0
    return held[0] * 1.0


def compared_before(x):
    v = x + 1.0
    big = v > 1.5
    v += 1.0
    return torch.where(big, v, -v)


def chosen(x, d):
    if d > 0:
        v = x + x
    else:
        v = 0.0
    v += x
    return v * 1.0


def extended(x):
    xs = [x] + [x * 2.0]
    xs += (x * 3.0,)  # (a list's ``+=`` takes any iterable; its ``+`` would refuse the tuple)
    return torch.stack(xs).sum(0)


def counted(x):
    n = 1 + 1
    n += 2
    return x * n


def pooled(xs, n):
    s = torch.zeros(xs.shape[1], dtype=xs.dtype)
    total = 0.0
    for t in range(n):
        s += xs[t]
        total += (xs[t] * xs[t]).sum()
    return s * total


def pooled_while(xs, n):
    s = xs[0] * 0.0
    t = 0
    while t < n:
        s -= xs[t] * 0.5
        t += 1  # (an int counter that ``xs[t]`` reads: left as it is, ``passes.effects.int_counting``)
    return s * 1.0


def pooled_and_kept(xs, n):
    s = torch.zeros(xs.shape[1], dtype=xs.dtype)
    seen = []
    for t in range(n):
        s += xs[t]
        seen.append(s)  # (every step's s is the one object, changed in place: eager's list holds it n times)
    return torch.stack(seen).sum(0)


def pooled_and_scaled(xs, n):
    s = torch.zeros(xs.shape[1], dtype=xs.dtype)
    out = 0.0
    for t in range(n):
        out = out + (s * xs[t]).sum()  # (its gradient reads s, which the next step changes: eager refuses it)
        s += xs[t]
    return out + s.sum()


def pooled_then_changed(xs, n):
    s = torch.zeros_like(xs[0])
    for t in range(n):
        s += torch.tanh(xs[t])
    s -= xs[0]  # (the loop's result: an object only the loop held)
    return s * 2.0


def one_object_twice(xs, n):
    a = b = torch.zeros(xs.shape[1], dtype=xs.dtype)
    for t in range(n):
        a += xs[t]  # (b is the same object: it changes too)
    return a + b


PROGRAMS = [(made_then_scaled, (False, True)), (argument_changed, (False, True)), (kept_before, (False, True)),
            (listed_before, (False, True)), (compared_before, (True, False)), (chosen, (True, False)),
            (extended, (True, False)), (counted, (True, False)), (pooled, (True, False)),
            (pooled_while, (True, True)), (pooled_and_kept, (False, True)), (pooled_and_scaled, (False, True)),
            (pooled_then_changed, (True, False)), (one_object_twice, (False, True))]


def _args(fn):
    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    if fn is made_then_scaled:
        return x, torch.tensor([1.5, 0.2, -0.3], dtype=F64, requires_grad=True)
    if fn is argument_changed:
        return x * 1.0, torch.tensor([1.5, 0.2, -0.3], dtype=F64)
    if fn is chosen:
        return x, 1
    if fn in (pooled, pooled_while, pooled_and_kept, pooled_and_scaled, pooled_then_changed, one_object_twice):
        return torch.tensor([[0.5, -1.0], [2.0, 0.25], [1.5, -0.5]], dtype=F64, requires_grad=True), 3
    return (x,)


def _outcome(call, args):
    """(value, gradients of the float tensors among args that need them) of ``call``, or the exception type."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf]
    try:
        out = call(*args)
        return out.detach(), torch.autograd.grad(out.sum(), leaves) if leaves else ()  # (older torch refuses none)
    except RuntimeError as exc:
        return type(exc)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn, expected", PROGRAMS, ids=lambda x: getattr(x, "__name__", ""))
def test_what_is_written_out_of_place_and_what_stays_in_place_gives_eagers_values_and_gradients(fn, expected, mode):
    """Written out of place only where no other reference to the object is read after, and no gradient reads
    the value before (``made_then_scaled``: eager refuses its backward, and so must the program)."""
    assert rewritten(fn) == expected
    want = _outcome(fn, _args(fn))
    if fn is made_then_scaled:
        assert want is RuntimeError
    got = _outcome(recompile.function(fn, mode=mode), _args(fn))
    if isinstance(want, type):
        assert got is want
    else:
        torch.testing.assert_close(got, want)


def float32_plus_float64(x, y):
    v = x * 1.0
    v += y  # in place, v keeps its float32
    return v


def scalar_plus_vector(x, y):
    v = x * 1.0
    v += y  # in place, a 0-d v cannot grow to y's shape: eager raises
    return v


def long_plus_float(x, y):
    v = x * 1
    v += y  # in place, a long v cannot hold a float: eager raises
    return v


@pytest.mark.parametrize("mode", MODES + ["vmap"])
@pytest.mark.parametrize("fn, x, y", [
    (float32_plus_float64, torch.tensor([0.5, 1.5]), torch.tensor([0.25, 1e-9], dtype=F64)),
    (scalar_plus_vector, torch.tensor(0.5), torch.tensor([0.25])),
    (long_plus_float, torch.tensor([1, 2]), torch.tensor([0.5, 0.5]))], ids=lambda x: getattr(x, "__name__", ""))
def test_the_out_of_place_op_gives_the_in_place_ops_dtype_shape_and_errors(fn, x, y, mode):
    assert rewritten(fn) == (True, False)
    try:
        want = fn(x, y)
    except RuntimeError:
        want = RuntimeError
    if mode == "vmap":
        xs, ys = torch.stack([x, x + 1]), torch.stack([y, y * 2])
        compiled = recompile.vmap(recompile.function(fn), in_dims=(0, 0))
        if want is RuntimeError:
            with pytest.raises(RuntimeError):
                compiled(xs, ys)
            return
        got = compiled(xs, ys)
        assert got.dtype is want.dtype
        torch.testing.assert_close(got, torch.stack([fn(x, y), fn(x + 1, y * 2)]))
        return
    compiled = recompile.function(fn, mode=mode)
    if want is RuntimeError:
        with pytest.raises(RuntimeError):
            compiled(x, y)
        return
    got = compiled(x, y)
    assert got.dtype is want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_a_tree_lstm_written_with_plus_equals_batches_whole():
    """The SST Tree-LSTM with its node loss added ``loss += ...`` runs with no op once per instance (it ran
    ``+=`` per instance and off the level program: 0.12x of hand-batched)."""
    import torch.nn.functional as F

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(len(WORDS) + 1, 4)
            self.node = torch.nn.Linear(8, 4)
            self.out = torch.nn.Linear(4, 5)

        @recompile.function
        def encode(self, tree, i):
            if tree.is_leaf[i]:
                h = torch.tanh(self.embed(tree.words[i]))
                loss = 0.0
            else:
                hl, loss_l = self.encode(tree, tree.left[i])
                hr, loss_r = self.encode(tree, tree.right[i])
                h = torch.tanh(self.node(torch.cat([hl, hr], -1)))
                loss = loss_l + loss_r
            loss += F.cross_entropy(self.out(h).unsqueeze(0), tree.labels[i].unsqueeze(0))
            return h, loss

    model = Model().double()
    batch = Forest.from_trees(trees())
    with switched(config, "error", "PER_INSTANCE"):
        h, loss = recompile.vmap(model.encode, in_dims=(None, 0))(batch, batch.roots)
    grads = torch.autograd.grad(loss.sum() + h.sum(), list(model.parameters()))
    with recompile.disable():
        eager = [model.encode(batch, r) for r in batch.roots]
    eager_loss = torch.stack([e[1] for e in eager])
    eager_h = torch.stack([e[0] for e in eager])
    torch.testing.assert_close((h, loss), (eager_h, eager_loss))
    torch.testing.assert_close(grads, torch.autograd.grad(eager_loss.sum() + eager_h.sum(),
                                                          list(model.parameters())))


def test_a_loop_summing_with_plus_equals_batches_over_instances_of_different_lengths():
    """``s += xs[t]`` over each instance's own number of steps: no op once per instance (``s`` started as
    ``torch.zeros`` each instance had its own of, and ``+=`` ran once per instance)."""
    torch.manual_seed(0)
    xs = torch.randn(4, 5, 2, dtype=F64, requires_grad=True)
    ns = torch.tensor([5, 2, 0, 3])
    want = torch.stack([pooled(x, int(n)) for x, n in zip(xs, ns)])
    want_grad, = torch.autograd.grad(want.sum(), xs)
    f = recompile.vmap(recompile.function(pooled), in_dims=(0, 0))
    with switched(config, "error", "PER_INSTANCE"):
        for _ in range(2):
            got = f(xs, ns)
            torch.testing.assert_close((got, torch.autograd.grad(got.sum(), xs)[0]), (want, want_grad))


def grows_a_number_row(xs, left, right, i):
    """A leaf's ``c = 0.0`` joined with the nodes' 0-d tensors (rows standing for numbers, in a plain level run):
    ``c *= h`` grows a number to h's shape, but a node's 0-d tensor cannot grow in place (eager raises)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        c = 0.0
    else:
        hl, _ = grows_a_number_row(xs, left, right, left[i])
        hr, _ = grows_a_number_row(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        c = hl @ hr
    c *= h
    return h, c.sum()


@pytest.mark.parametrize("mode", MODES + ["vmap"])
def test_an_in_place_op_that_would_grow_a_tensor_raises_as_eager_where_numbers_and_tensors_meet(mode):
    left = torch.tensor([-1, 2, -1, 4, -1, -1])
    right = torch.tensor([-1, 3, -1, 5, -1, -1])
    xs = torch.randn(6, 3, dtype=F64)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        grows_a_number_row(xs, left, right, 1)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"), warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        if mode == "vmap":
            recompile.vmap(recompile.function(grows_a_number_row), in_dims=(None, None, None, 0))(
                xs, left, right, torch.tensor([0, 1]))
        else:
            recompile.function(grows_a_number_row, mode=mode)(xs, left, right, 1)


def extended_by_range(x):
    xs = [x * 1.0] + []
    xs += range(2)
    return xs[0].sum() + xs[1] + xs[2]


def extended_by_map(x):
    xs = [x * 1.0] + []
    xs += map(torch.neg, [x * 2.0])
    return torch.stack(xs).sum()


def extended_by_rows(x):
    xs = [x * 1.0] + []
    xs += torch.stack([x * 3.0, x * x])
    return torch.stack(xs).sum()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [extended_by_range, extended_by_map, extended_by_rows], ids=lambda f: f.__name__)
def test_a_list_extended_by_any_iterable_gives_each_element_its_gradient(fn, mode):
    assert rewritten(fn) == (True, False)
    x = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    want = fn(x), torch.autograd.grad(fn(x), x)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.GradFallbackWarning)  # (map has no rule: autograd records it)
        out = recompile.function(fn, mode=mode)(x)
        torch.testing.assert_close((out, torch.autograd.grad(out, x)[0]), want)


W = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(3))


def tree_activated_in_place(xs, left, right, i):
    """A node's state activated in place after its branches (``nn.ReLU(inplace=True)``'s habit), each instance's
    a row of one tensor: per instance, each ``relu_`` moved the version of rows another's saved."""
    if left[i] < 0:
        h = xs[i] @ W
    else:
        h = tree_activated_in_place(xs, left, right, left[i]) + tree_activated_in_place(xs, left, right, right[i])
    h.relu_()
    return h


def test_a_tree_activated_in_place_is_written_out_of_place_and_runs_as_levels():
    compiled = recompile.function(tree_activated_in_place)
    assert "relu_fresh(" in compiled.dump(stage="fresh")
    left, right, roots = forest()
    xs = torch.randn(8, 3, dtype=F64, requires_grad=True)
    want = torch.stack([tree_activated_in_place(xs, left, right, int(r)) for r in roots])
    want = want, torch.autograd.grad(want.sum(), xs)
    with switched(config, "error", "PER_INSTANCE"):
        for _ in range(2):
            got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
            torch.testing.assert_close((got, torch.autograd.grad(got.sum(), xs)), want)
    assert built(compiled).unit.levels.plain.runs == 2


# ``x.mul_(y)`` (``add_``, ``sub_``, ``div_``) of a tensor only the frame holds: written out of place as ``x *= y``
# is, the ops after it reading its result


def scaled_by_its_methods(x):
    v = x + 1.0
    v.mul_(2.0)
    v.add_(x)  # (the new v, only the frame holds it too)
    return v * 1.0


def joined_then_divided_by_its_method(x, d):
    v = x * 2.0 if d > 0 else x + 1.0
    v.div_(4.0)
    return v


def method_of_an_argument(x, y):
    y.mul_(2.0)  # (the caller's tensor: it changes)
    return x * y


def method_after_a_read_that_saves(x):
    v = x + 1.0
    w = v * x  # (saves v: eager's backward refuses it once v changes, and so must the program)
    v.mul_(2.0)
    return w + v


def method_of_itself(x):
    v = x + 1.0
    v.sub_(v)
    return v + x


def activated_by_its_methods(x):
    v = x * 2.0 - 0.5
    v.relu_()
    v = v + x
    v.clamp_(min=-0.25, max=1.5)
    return v * 1.0


def activated_by_torchs_functions(x):
    v = x * 2.0 - 0.5
    torch.sigmoid_(v)
    u = v - x
    u = F.relu(u, inplace=True)
    return u * 1.0


def zeros_made_by_its_methods(x):
    """treelstm.pytorch's leaf state: a new tensor of x's dtype and device, filled, made to require grad."""
    c = x.detach().new(1, 3).fill_(0.).requires_grad_()
    z = torch.tanh(x).new_zeros(3)  # (a tensor's method of a value surely a tensor: torch's function's result)
    z.zero_()
    return (c * x).sum(0) + z + x


def filled_with_a_value(x):
    v = x.detach().new_empty(2, 3).fill_(x.sum())  # (a gradient reaches x through the value, none through v's)
    return v * x


def new_of_one_size(x):
    v = x.new(x.shape[0])  # (given one value, ``new`` may view a tensor it is given: v is not counted new)
    v.fill_(1.0)
    return v * x


def filled_argument(x, y):
    y.fill_(0.5)  # (the caller's tensor: changed in place)
    return x * y


def made_to_need_no_grad(x):
    v = x.new_zeros(3).requires_grad_(False)  # (as eager runs it: only ``requires_grad_()`` is written anew)
    return v + x


METHODS = [(scaled_by_its_methods, True), (joined_then_divided_by_its_method, True), (method_of_an_argument, False),
           (method_after_a_read_that_saves, False), (method_of_itself, False), (activated_by_its_methods, True),
           (activated_by_torchs_functions, True), (zeros_made_by_its_methods, True), (filled_with_a_value, True),
           (filled_argument, False)]


@pytest.mark.parametrize("fn", [fn for fn, _ in METHODS if fn not in (method_of_an_argument, filled_argument)],
                         ids=lambda f: f.__name__)
def test_an_in_place_method_under_vmap_gives_eagers_values_and_gradients(fn, monkeypatch):
    """(Not ``method_of_an_argument``: an eager loop over the rows of one tensor changes views of one base.)"""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], dtype=F64)
    other = (torch.tensor([1, 0]),) if fn is joined_then_divided_by_its_method else ()
    want = _outcome(lambda x: torch.stack([fn(x[k], *(v[k] for v in other)) for k in range(len(x))]),
                    (x.clone().requires_grad_(),))
    got = _outcome(lambda x: recompile.vmap(recompile.function(fn))(x, *other), (x.clone().requires_grad_(),))
    if isinstance(want, type):
        assert got is want
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn, out_of_place", METHODS, ids=lambda x: getattr(x, "__name__", ""))
def test_an_in_place_method_of_what_only_the_frame_holds_is_written_out_of_place(fn, out_of_place, mode):
    text = recompile.function(fn).dump(stage="fresh")
    assert ("_fresh(" in text) is out_of_place
    args = {joined_then_divided_by_its_method: lambda x: (x, 1), method_of_an_argument: lambda x: (x, x * 1.5),
            filled_argument: lambda x: (x, x * 1.5)}
    make = args.get(fn, lambda x: (x,))
    want = _outcome(fn, make(torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)))
    got = _outcome(recompile.function(fn, mode=mode), make(torch.tensor([0.5, -1.0, 2.0], dtype=F64,
                                                                          requires_grad=True)))
    if isinstance(want, type):
        assert got is want
    else:
        torch.testing.assert_close(got, want)
    if out_of_place:
        assert not recompile.function(fn).callee(None).may_mutate  # (it changes nothing in place now)


class Pool:
    """An object of the user's whose ``new`` hands back a buffer it keeps: not a tensor's method."""

    def __init__(self):
        self.buffer = torch.ones(3, dtype=F64)

    def new(self, *sizes):
        return self.buffer


POOL = Pool()


def new_of_a_users_object(x):
    v = POOL.new(1, 3)
    v.zero_()  # (the pool's buffer, changed in place)
    return x + v.sum()


@pytest.mark.parametrize("fn", [new_of_one_size, made_to_need_no_grad, new_of_a_users_object],
                         ids=lambda f: f.__name__)
def test_what_may_not_be_a_new_tensor_stays_changed_in_place(fn):
    """``x.new(y)`` may view y, ``requires_grad_(False)`` is no flag a new tensor takes, and ``pool.new(...)`` is
    a method of the user's own object: each change stays in place, and a batched run gives eager's values."""
    assert "_fresh(" not in recompile.function(fn).dump(stage="fresh")
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], dtype=F64)
    POOL.buffer.fill_(1.0)
    want = torch.stack([fn(row) for row in x])
    POOL.buffer.fill_(1.0)
    with switched(config, "allow", "PER_INSTANCE"):
        got = recompile.vmap(recompile.function(fn))(x)
    torch.testing.assert_close(got, want)
    assert float(POOL.buffer.sum()) == (0.0 if fn is new_of_a_users_object else 3.0)


def method_of_a_number(x):
    v = 0.5 + 1.0
    v.mul_(2.0)  # (a float has no ``mul_``: eager raises)
    return x * v


@pytest.mark.parametrize("mode", MODES + ["vmap"])
def test_an_in_place_method_of_a_number_raises_as_eager(mode):
    x = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=F64)
    with pytest.raises(AttributeError):
        method_of_a_number(x[0])
    with pytest.raises(AttributeError):
        if mode == "vmap":
            recompile.vmap(recompile.function(method_of_a_number))(x)
        else:
            recompile.function(method_of_a_number, mode=mode)(x[0])


def changed_after_its_activation(x):
    v = x * 2.0
    v.sigmoid_()  # (out of place: sigmoid's backward reads its result...)
    v.mul_(2.0)  # (...which this changes, in place still: eager's backward refuses, and so must the program)
    return v


def activated_int(x):
    v = (x > 0).long() * 3
    v.sigmoid_()  # (an int tensor's sigmoid is a float one, which the in-place op cannot store: eager raises)
    return x * v


@pytest.mark.parametrize("mode", MODES + ["vmap"])
def test_an_activation_written_out_of_place_keeps_eagers_refusals(mode):
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], dtype=F64)
    for fn in (changed_after_its_activation, activated_int):
        assert "sigmoid_fresh(" in recompile.function(fn).dump(stage="fresh")
        want = _outcome(lambda x: torch.stack([fn(r) for r in x]), (x.clone().requires_grad_(),))
        compiled = recompile.vmap(recompile.function(fn)) if mode == "vmap" else \
            (lambda x: torch.stack([recompile.function(fn, mode=mode)(r) for r in x]))
        assert want is RuntimeError and _outcome(compiled, (x.clone().requires_grad_(),)) is RuntimeError


def filled_with_each_instances_value(x, k, v):
    a = x.detach().new_zeros(3)
    a.fill_(k)  # (each instance's own Python number)
    b = torch.zeros(3, dtype=x.dtype).fill_(v.sum())  # (each instance's own tensor, whose gradient it gets)
    return a * x + b


def test_a_new_tensor_filled_with_each_instances_own_value_is_one_op():
    xs = [torch.tensor([0.5, -1.0, 2.0], dtype=F64) * k for k in (1, 2, 3)]
    vs = [torch.tensor([0.25, 1.0 - k], dtype=F64, requires_grad=True) for k in (1, 2, 3)]
    ks = [1, 2.5, -3]
    cf = recompile.function(filled_with_each_instances_value)
    got = recompile.map(cf, xs, ks, vs)
    want = [filled_with_each_instances_value(*a) for a in zip(xs, ks, vs)]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(sum(g.sum() for g in got), vs),
                               torch.autograd.grad(sum(w.sum() for w in want), vs))
    assert cf.stats["per_instance"] == {}


# ``x[i] = v`` of a tensor only the frame holds (``intrinsics.setitem_fresh``)

def buffer_filled(xs, n):  # (a loop's buffer, as PyTorch's seq2seq tutorial fills its encoder's outputs)
    out = torch.zeros(4, xs.shape[1], dtype=xs.dtype)
    h = torch.zeros(xs.shape[1], dtype=xs.dtype)
    for t in range(n):
        h = torch.tanh(xs[t] + 0.5 * h)
        out[t] = h
        out[t, 0] = h[1] * 2.0  # (a second write of the step's buffer: the first one's result)
    return (out * torch.arange(1.0, 5.0, dtype=xs.dtype)[:, None]).sum()


def buffer_written_straight(xs, n):  # (writes outside a loop: a broadcast value, a slice, a Python number)
    out = torch.zeros(3, 2, dtype=xs.dtype)
    out[0] = xs[0, 0]
    out[1:] = xs[1:3] * 2.0
    out[2, 1] = n
    return out.sum(0)


def buffer_read_in_the_loop(xs, n):  # (a view read after the write, which a later write changes: stays in place)
    out = torch.zeros(4, xs.shape[1], dtype=xs.dtype)
    seen = xs[0] * 0.0
    for t in range(n):
        out[t] = xs[t]
        seen = seen + out[:2].sum(0)
    return seen


def buffer_given(xs, n):  # (the caller's tensor: stays in place)
    for t in range(n):
        xs[t] = xs[t] * 2.0
    return xs.sum(0)


def buffer_viewed(xs, n):  # (a view of a tensor made here: its writes reach the tensor; stays in place)
    base = torch.zeros(4, xs.shape[1], dtype=xs.dtype)
    out = base[1:]
    for t in range(n):
        out[t] = xs[t]
    return base.sum(0) + out.sum(0)


def buffer_read_first(xs, n):  # (a view read before the write sees it, in eager: stays in place)
    out = torch.zeros(4, xs.shape[1], dtype=xs.dtype)
    first = out[0]
    for t in range(n):
        out[t] = xs[t]
    return first * 1.0


def buffer_summed_each_step(xs, n):  # (the whole buffer read after the write: stays in place, each step's sum
    out = torch.zeros(4, xs.shape[1], dtype=xs.dtype)  # its own, which a later write in place would change)
    s = torch.zeros(4, xs.shape[1], dtype=xs.dtype)
    for t in range(n):
        out[t] = xs[t]
        s = s + out
    return s


def buffer_first_row_shared(xs, n):  # (a first write every instance makes alike, computed once: then each's own)
    out = torch.zeros(4, xs.shape[1], dtype=xs.dtype)
    out[0] = 1.0
    for t in range(n):
        out[t + 1] = xs[t]
    return out


def buffer_of_numbers(xs, n):  # (each instance's Python number, written as a float64 write converts it)
    out = torch.zeros(3, 2, dtype=torch.float64)
    out[1] = xs[0]
    out[n - 1, 0] = 0.1 * n
    out[n - 1, 1] = xs[1, 0].float()  # (a float32 value: cast as the write casts it)
    return out


BUFFERS = [(buffer_filled, True), (buffer_written_straight, True), (buffer_read_in_the_loop, False),
           (buffer_given, False), (buffer_viewed, False), (buffer_summed_each_step, False),
           (buffer_first_row_shared, True), (buffer_of_numbers, True)]


def _buffer_args(fn):
    """Each instance's (xs, n): xs a leaf's copy where ``fn`` changes it (an argument changed in place is no
    leaf); and the leaves."""
    leaves = [torch.tensor([[0.5, -1.0], [2.0, 0.25], [1.5, -0.5]], dtype=F64).mul(k + 1).requires_grad_()
              for k in range(3)]
    return [(xs * 1.0 if fn is buffer_given else xs, n) for xs, n in zip(leaves, [3, 1, 2])], leaves


@pytest.mark.parametrize("mode", MODES + ["vmap"])
@pytest.mark.parametrize("fn, written", BUFFERS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_buffer_only_the_frame_holds_is_written_out_of_place_with_eagers_values_and_gradients(fn, written, mode):
    """``out[t] = h`` of a tensor made here, read before only by ``+``/``-``/comparisons and after the write only
    so in the loop: a copy written, the loop carrying it; else the write stays in place."""
    assert ("setitem_fresh(" in recompile.function(fn).dump(stage="fresh")) is written
    given, leaves = _buffer_args(fn)
    want = [fn(*args) for args in given]
    want_grads = torch.autograd.grad(sum(w.sum() for w in want), leaves)
    given, leaves = _buffer_args(fn)
    cf = recompile.function(fn, mode="batched" if mode == "vmap" else mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.map(cf, *zip(*given)) if mode == "vmap" else [cf(*args) for args in given]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(sum(g.sum() for g in got), leaves), want_grads)
    if mode == "vmap" and written:
        assert cf.stats["per_instance"] == {}


def test_a_buffer_a_view_was_read_of_before_its_writes_stays_written_in_place():
    """``first = out[0]`` sees the writes that follow, in eager: they stay changes of ``out``."""
    assert "setitem_fresh(" not in recompile.function(buffer_read_first).dump(stage="fresh")
    (xs, n), = _buffer_args(buffer_read_first)[0][:1]
    torch.testing.assert_close(recompile.function(buffer_read_first)(xs, n), buffer_read_first(xs, n))


def buffer_saved_then_written(x):
    out = torch.zeros(3, dtype=x.dtype)
    out += x  # (out of place: a new tensor)
    y = out * x  # (saves out for x's gradient)
    out[0] = 2.0  # (changes what the product saved: eager's backward refuses, and so must the program)
    return y + out


@pytest.mark.parametrize("mode", MODES + ["vmap"])
def test_a_buffer_a_gradient_saved_stays_written_in_place_and_refused_as_eager(mode):
    assert "setitem_fresh(" not in recompile.function(buffer_saved_then_written).dump(stage="fresh")
    x = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], dtype=F64)
    want = _outcome(lambda x: torch.stack([buffer_saved_then_written(r) for r in x]), (x.clone().requires_grad_(),))
    compiled = recompile.vmap(recompile.function(buffer_saved_then_written)) if mode == "vmap" else \
        (lambda x: torch.stack([recompile.function(buffer_saved_then_written, mode=mode)(r) for r in x]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        assert want is RuntimeError and _outcome(compiled, (x.clone().requires_grad_(),)) is RuntimeError


def buffer_of_wrong_value(x):
    out = torch.zeros(2, 3, dtype=torch.long)
    out[0] = x  # (a float written into a long tensor: eager truncates)
    out[1] = torch.ones(2)  # (a shape that does not fit: eager raises)
    return out


@pytest.mark.parametrize("mode", MODES + ["vmap"])
def test_a_buffer_written_out_of_place_casts_and_raises_as_eager(mode):
    assert "setitem_fresh(" in recompile.function(buffer_of_wrong_value).dump(stage="fresh")
    x = torch.tensor([[0.5, -1.5, 2.7], [1.5, 0.25, -0.5]], dtype=F64)
    with pytest.raises(RuntimeError):
        buffer_of_wrong_value(x[0])
    with pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        if mode == "vmap":
            recompile.vmap(recompile.function(buffer_of_wrong_value))(x)
        else:
            recompile.function(buffer_of_wrong_value, mode=mode)(x[0])


def test_setitem_fresh_copies_a_tensor_it_did_not_make_and_writes_its_own_copies_in_place():
    """The first write of a buffer copies it (a value computed once may be every instance's); the next ones write
    that copy, which nothing else reads, in place (no copy of the whole buffer per step), also through a view of
    just its memory (a loop's steps run ahead hand one instance's value on so)."""
    from recompile import intrinsics

    zeros = torch.zeros(3, 2)
    first = intrinsics.setitem_fresh(zeros, 0, 1.0)
    assert zeros.abs().sum() == 0 and intrinsics.owned(first) and not intrinsics.owned(zeros)
    second = intrinsics.setitem_fresh(first.unsqueeze(0)[0], 1, torch.tensor([2.0, 3.0]))
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    torch.testing.assert_close(second, torch.tensor([[1.0, 1.0], [2.0, 3.0], [0.0, 0.0]]))
    rows = intrinsics.setitem_fresh(second[1:], 0, 5.0)  # (a view of one may be another instance's: copied)
    assert rows.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() and second[1, 0] == 2.0
    xs = [1, 2]
    assert intrinsics.setitem_fresh(xs, 0, 7) is xs and xs == [7, 2]  # (no tensor: written itself)


def buffer_by_an_index_changed_after(x):
    idx = torch.zeros(2, dtype=torch.long)
    idx[0] = 1
    out = torch.zeros(3, dtype=x.dtype)
    out[idx] = x  # (its gradient reads idx: where the cotangent goes)
    idx[1] = 2  # (changed after: eager's backward refuses, and so must the program's)
    return out * 2.0


def written_by_an_index_changed_after(x):
    idx = torch.tensor([1, 0])
    out = x * 0.0  # (no constructor's: the write stays in place, ``set_item``)
    out[idx] = x[:2]
    idx[1] = 2
    return out * 2.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [buffer_by_an_index_changed_after, written_by_an_index_changed_after],
                         ids=lambda f: f.__name__)
def test_a_write_by_an_index_changed_after_it_is_refused_at_backward_as_eager(fn, mode):
    """The derived gradient reads the index where the cotangent goes: one changed since the write is refused (it
    sent the cotangent elsewhere: a wrong gradient where eager raises)."""
    rewritten = "setitem_fresh(" in recompile.function(fn).dump(stage="fresh")
    assert rewritten is (fn is buffer_by_an_index_changed_after)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=F64)[:2 if fn is buffer_by_an_index_changed_after else 3]
    want = _outcome(fn, (x.clone().requires_grad_(),))
    got = _outcome(recompile.function(fn, mode=mode), (x.clone().requires_grad_(),))
    assert want is RuntimeError and got is RuntimeError


def written_with_a_leading_one(x, a):
    out = a * 1.0  # (no constructor's: the write stays in place, ``set_item``)
    out[0] = x  # (x of shape (1, 3) into a row of 3: the write drops the leading 1)
    fresh = torch.zeros(2, 3, dtype=x.dtype)
    fresh[1] = x  # (``setitem_fresh``)
    return (out + fresh) * torch.arange(1.0, 7.0, dtype=x.dtype).view(2, 3)


@pytest.mark.parametrize("mode", MODES + ["vmap"])
def test_a_value_with_leading_ones_written_into_a_row_gets_its_gradient_as_eager(mode):
    """The derived gradient gave the value's cotangent the region's shape, which ``sum_to_size`` refused for a
    value of more dims (leading 1s): it raised where eager computes."""
    x = torch.tensor([[[1.0, 2.0, 3.0]], [[0.5, -1.0, 2.0]]], dtype=F64)
    a = torch.zeros(2, 2, 3, dtype=F64)
    want = _outcome(lambda x, a: torch.stack([written_with_a_leading_one(x[k], a[k]) for k in range(2)]),
                    (x.clone().requires_grad_(), a.clone().requires_grad_()))
    compiled = recompile.vmap(recompile.function(written_with_a_leading_one)) if mode == "vmap" else (
        lambda x, a: torch.stack([recompile.function(written_with_a_leading_one, mode=mode)(x[k], a[k])
                                  for k in range(2)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = _outcome(compiled, (x.clone().requires_grad_(), a.clone().requires_grad_()))
    torch.testing.assert_close(got, want)
