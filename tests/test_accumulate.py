"""passes/accumulate.py: a list a recursion is handed only to append to is filled by each call's own list."""

import random
import warnings
from itertools import repeat

import pytest
import torch

import recompile
from recompile import intrinsics, ir
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
            losses.append(h.sum())
            losses.append(h.mean())
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
    assert "%own = call build_list()" in text and text.count("= call build_list(<Filled>)") == 2
    assert "call hand_back(%losses, %own)" in text


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
             and op.fills]
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


class Node:
    def __init__(self, word, children):
        self.word, self.children = word, children


def node_tree(depth, draw):
    children = [] if depth == 0 or draw.random() < 0.3 else \
        [node_tree(depth - 1, draw) for _ in range(draw.randint(1, 3))]
    return Node(torch.tensor(draw.randrange(20)), children)


class ByKeyword(torch.nn.Module):
    """A child-sum over node objects handing its list of node losses down by keyword."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.out = torch.nn.Embedding(20, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, node):
        losses = []
        h = self.walk(node, losses=losses)
        return h, torch.stack(losses).sum(), len(losses)

    def walk(self, node, losses):
        h = self.emb(node.word)
        for child in node.children:
            h = h + self.walk(child, losses=losses)
        h = torch.tanh(self.lin(h))
        losses.append(self.out(h).logsumexp(-1))
        return h


@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_a_list_handed_down_by_keyword_over_node_objects(mode):
    draw = random.Random(0)
    roots = [node_tree(4, draw) for _ in range(6)]
    Compiled = type("Compiled", (ByKeyword,), {name: recompile.function(mode=mode)(getattr(ByKeyword, name))
                                               for name in ("forward", "walk")})
    torch.manual_seed(0)
    eager_model = ByKeyword().double()
    model = Compiled().double()
    model.load_state_dict(eager_model.state_dict())
    assert type(model).walk.dump(stage="accumulate", owner=Compiled).count("call hand_back(") == 1
    want = [eager_model(r) for r in roots]
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        got = recompile.map(model, roots) if mode == "batched" else [model(r) for r in roots]
    for g, w in zip(got, want):
        for a, b in zip(g[:2], w[:2]):
            torch.testing.assert_close(a, b)
        assert g[2] == w[2]
    for a, b in zip(torch.autograd.grad(sum(g[1] for g in got), list(model.parameters())),
                    torch.autograd.grad(sum(w[1] for w in want), list(eager_model.parameters()))):
        torch.testing.assert_close(a, b)


def test_a_call_hands_its_list_back_as_one_item_and_the_outermost_gets_the_items_in_order():
    """Each call's own list goes into the list made for it whole, so a call costs its own items, not its
    subtree's; the list the outermost call was handed gets every item, in order, however deep the nesting."""
    made_for_call = [intrinsics.FILLED]
    own = ["a"]
    intrinsics.hand_back(made_for_call, own)
    assert made_for_call == [intrinsics.FILLED, ["a"]] and made_for_call[1] is own
    deepest = inner = [intrinsics.FILLED]
    for k in range(100_000):  # (a chain of calls, each handing back its item and its call's list)
        outer = [intrinsics.FILLED]
        intrinsics.hand_back(outer, [k, inner])
        inner = outer
    intrinsics.hand_back(deepest, ["end"])
    got = ["before"]
    intrinsics.hand_back(got, [inner, [intrinsics.FILLED]])  # (and a list whose call handed nothing back)
    assert got == ["before", *range(99_999, -1, -1), "end"]


def in_order(node, out):
    if node is None:
        return 0
    left = in_order(node[0], out)
    out.append(node[1])
    return left + in_order(node[2], out) + 1


def test_a_deep_chain_of_calls_fills_the_list_as_python_does():
    chain = None
    for k in range(3000):  # (a tree of sorted keys: every node a right child, 3000 deep)
        chain = (None, 3000 - k, chain)
    plain = in_order
    compiled = recompile.function(mode="sequential")(plain)
    assert "call hand_back(" in compiled.dump(stage="accumulate")
    globals()["in_order"] = compiled  # (its recursive calls read the global name)
    try:
        mine = []
        assert compiled(chain, mine) == 3000
    finally:
        globals()["in_order"] = plain
    assert mine == list(range(1, 3001))


# -- what the pass leaves as it is, or fills as Python does: each checked against the plain recursion

TREE = (((None, 1, None), 2, (None, 3, None)), 4, ((None, 5, None), 6, (None, 7, None)))


def even_between(n, out):  # (an append in an if between the calls: left as it is)
    if n is None:
        return
    even_between(n[0], out)
    if n[1] % 2 == 0:
        out.append(n[1])
    even_between(n[2], out)


def extended_then_changed(n, out):  # (an extend: left as it is; its argument changes after it)
    if n is None:
        return
    buf = [n[1]]
    extended_then_changed(n[0], out)
    out.extend(buf)
    buf.append(-n[1])
    extended_then_changed(n[2], out)


def two_lists(n, a, b):  # (two lists, which may be one: left as they are)
    if n is None:
        return
    a.append(("a", n[1]))
    two_lists(n[0], a, b)
    b.append(("b", n[1]))
    two_lists(n[2], a, b)


def printed(n, out):  # (a print: rewritten, but the calls keep their order, which shows)
    if n is None:
        return
    print(n[1])
    printed(n[0], out)
    out.append(n[1])
    printed(n[2], out)


def appended(n, out):  # (rewritten: the user's collector gets its own append, item by item)
    if n is None:
        return
    appended(n[0], out)
    out.append(n[1])
    appended(n[2], out)


class Collector:
    def __init__(self):
        self.seen = []

    def append(self, x):
        self.seen.append(("got", x))


class Hundredfold(list):
    def append(self, x):
        super().append(x * 100)


@pytest.mark.parametrize("fn, lists, rewritten", [
    (even_between, lambda: ([],), False), (extended_then_changed, lambda: ([],), False),
    (two_lists, lambda: ([], []), False), (printed, lambda: ([],), True), (appended, lambda: ([],), True),
    (appended, lambda: (Collector(),), True), (appended, lambda: (Hundredfold(),), True)])
@pytest.mark.parametrize("mode", MODES)
def test_the_list_ends_as_pythons(fn, lists, rewritten, mode, capsys):
    compiled = recompile.function(mode=mode)(fn)
    assert ("call hand_back(" in compiled.dump(stage="accumulate")) == rewritten
    one_list_as_both = fn is two_lists
    globals()[fn.__name__] = compiled  # (its recursive calls read the global name)
    try:
        mine = lists()
        if one_list_as_both:
            mine = (mine[0], mine[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.PerInstanceWarning)
            compiled(TREE, *mine)
        printed_mine = capsys.readouterr().out
    finally:
        globals()[fn.__name__] = fn
    theirs = lists()
    if one_list_as_both:
        theirs = (theirs[0], theirs[0])
    fn(TREE, *theirs)
    assert capsys.readouterr().out == printed_mine
    for a, b in zip(mine, theirs):
        assert (a.seen if isinstance(a, Collector) else a) == (b.seen if isinstance(b, Collector) else b)
        assert type(a) is type(b)
