"""passes/accumulate.py: a list a recursion is handed only to append to is filled by each call's own list."""

import warnings
from itertools import repeat

import pytest
import torch

import recompile
from recompile import ir
from recompile.passes import effects
from recompile.passes.pipeline import FINAL

MODES = ["sequential", "threaded", "batched"]

# two trees over the rows of xs: 0 <- (1, 2), 2 <- (3, 4); 5 <- (6, 7), 6 <- (8, 9); the rest leaves
LEFT = torch.tensor([1, -1, 3, -1, -1, 6, 8, -1, -1, -1])
RIGHT = torch.tensor([2, -1, 4, -1, -1, 7, 9, -1, -1, -1])
ROOTS = [0, 5, 2, 4]


WALKS = ["post", "pre", "middle", "looped"]


class Walks:
    """Trees walked with a list of losses handed down, each order of appending; ``encode`` sums the list with
    weights by position, so that the order of its items shows."""

    def __init__(self):
        torch.manual_seed(0)
        self.w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def encode(self, xs, i, walk):
        losses = []
        if walk == 0:
            h = self.post(xs, i, losses)
        elif walk == 1:
            h = self.pre(xs, i, losses)
        elif walk == 2:
            h = self.middle(xs, i, losses)
        else:
            h = self.looped(xs, i, losses)
        total = h.sum() * 0.0
        for k, loss in enumerate(losses):
            total = total + (k + 1.0) * loss
        return h, total, len(losses)

    def post(self, xs, i, losses):
        if LEFT[i] < 0:
            h = torch.tanh(xs[i] @ self.w)
        else:
            hl = self.post(xs, LEFT[i], losses)
            hr = self.post(xs, RIGHT[i], losses)
            h = torch.tanh((hl - 0.5 * hr + xs[i]) @ self.w)
        losses.append(h.pow(2).sum() + float(i))
        return h

    def pre(self, xs, i, losses):
        losses.append(xs[i].sum() * float(i + 1))
        if LEFT[i] < 0:
            return torch.tanh(xs[i] @ self.w)
        hl = self.pre(xs, LEFT[i], losses)
        hr = self.pre(xs, RIGHT[i], losses)
        return torch.tanh((hl * hr + xs[i]) @ self.w)

    def middle(self, xs, i, losses):
        if LEFT[i] < 0:
            h = torch.tanh(xs[i] @ self.w)
            losses.extend([h.sum(), h.mean()])
            return h
        hl = self.middle(xs, LEFT[i], losses)
        losses.append(hl.sum() * float(i))
        hr = self.middle(xs, RIGHT[i], losses)
        return torch.tanh((hl + hr) @ self.w)


    def looped(self, xs, i, losses):
        h = xs[i] @ self.w
        if LEFT[i] >= 0:
            for child in (LEFT[i], RIGHT[i]):
                h = h + self.looped(xs, child, losses)
                losses.append(h.sum())
        return torch.tanh(h)


def compiled(mode):
    class Compiled(Walks):
        pass
    for name in ["encode", *WALKS]:
        setattr(Compiled, name, recompile.function(mode=mode)(getattr(Walks, name)))
    return Compiled()


def xs_():
    torch.manual_seed(1)
    return torch.randn(10, 3, dtype=torch.float64, requires_grad=True)


def test_the_list_is_the_functions_own_and_each_recursive_call_is_handed_a_new_one():
    model = compiled("sequential")
    model.encode(xs_(), 0, 0)
    text = type(model).post.dump(stage="accumulate", owner=type(model))
    assert "%own = call build_list()" in text and text.count("%filled") >= 4
    assert "extend')" in text


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("mode", MODES)
def test_values_order_and_gradients_are_eagers(mode, walk):
    model, reference, k = compiled(mode), Walks(), WALKS.index(walk)
    for root in ROOTS:
        xs, xs2 = xs_(), xs_()
        got, want = model.encode(xs, root, k), reference.encode(xs2, root, k)
        assert got[2] == want[2]
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        got_grads = torch.autograd.grad(got[1], (xs, model.w))
        want_grads = torch.autograd.grad(want[1], (xs2, reference.w))
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("walk", WALKS)
def test_a_batched_run_gives_each_instance_its_list_in_order_with_no_warning(walk):
    model, reference, k = compiled("batched"), Walks(), WALKS.index(walk)
    xs = xs_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = recompile.map(model.encode, repeat(xs), ROOTS, repeat(k))
    for root, one in zip(ROOTS, got):
        want = reference.encode(xs, root, k)
        assert one[2] == want[2]
        torch.testing.assert_close(one[1], want[1])


def test_the_calls_of_a_node_run_together_and_the_caller_keeps_its_list():
    model = compiled("batched")
    model.encode(xs_(), 0, 0)  # (builds the program)
    walk_sg = type(model).encode.program(owner=type(model)).subgraphs
    calls = [op for sg in walk_sg.values() for s in sg.walk() for op in s.ops if isinstance(op, ir.Invoke)
             and getattr(op, "fills", None) is not None]
    # (two calls in each walk: the loop over a display of two is its body once per item, held_displays)
    assert len(calls) == 4 * 2 and not any(effects.invoke_may_mutate(op, FINAL) for op in calls)
    assert not type(model).encode.callee(type(model)).may_mutate  # (its list its own)
    assert type(model).post.callee(type(model)).may_mutate  # (called by the user: the user's list)


def test_a_walk_called_by_the_user_fills_the_users_list():
    model, reference = compiled("sequential"), Walks()
    xs = xs_()
    mine, theirs = ["start"], ["start"]
    model.post(xs, 0, mine)
    reference.post(xs, 0, theirs)
    assert mine[0] == "start" and len(mine) == len(theirs)
    for a, b in zip(mine[1:], theirs[1:]):
        torch.testing.assert_close(a, b)


def reads_it(xs, i, losses):
    losses.append(xs[i].sum() * float(len(losses) + 1))  # (reads the list: left as it is)
    if LEFT[i] >= 0:
        reads_it(xs, LEFT[i], losses)
        reads_it(xs, RIGHT[i], losses)
    return xs[i]


def returns_it(xs, i, losses):
    losses.append(xs[i].sum())
    if LEFT[i] >= 0:
        returns_it(xs, LEFT[i], losses)
        returns_it(xs, RIGHT[i], losses)
    return losses


def swaps_it(xs, i, losses, other):
    losses.append(xs[i].sum())
    if LEFT[i] >= 0:
        swaps_it(xs, LEFT[i], other, losses)  # (another place: left as it is)
        swaps_it(xs, RIGHT[i], losses, other)
    return xs[i]


@pytest.mark.parametrize("fn", [reads_it, returns_it, swaps_it])
def test_a_list_used_otherwise_is_left_as_it_is_with_pythons_values(fn):
    cf = recompile.function(mode="sequential")(fn)
    assert "%own" not in cf.dump(stage="accumulate")
    xs = xs_()
    extra = ([[]] if fn is swaps_it else [])
    mine, theirs = [], []
    globals()[fn.__name__] = cf
    try:
        cf(xs, 0, mine, *[list(e) for e in extra])
    finally:
        globals()[fn.__name__] = fn
    fn(xs, 0, theirs, *[list(e) for e in extra])
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)
