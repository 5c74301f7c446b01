"""passes/holding.py: which changes of a call reach objects its caller holds, and the gradients of such calls
in sequential and threaded mode (eager's, where the derived program alone would lose them)."""

import warnings

import pytest
import torch

import recompile
from recompile import diagnostics
from recompile.passes.holding import caller_visible_change
from recompile.passes.pipeline import FINAL

F64 = torch.float64
W = torch.tensor([[0.5, -0.2, 0.1], [0.3, 0.8, -0.6], [-0.4, 0.2, 0.9]], dtype=F64, requires_grad=True)
STORED = []  # a global list a program appends to


class Node:
    def __init__(self, x, kids=()):
        self.x, self.kids, self.state = x, list(kids), None


def encode_storing_states(node):
    h = node.x
    for k in node.kids:
        h = h + encode_storing_states(k)
    node.state = torch.tanh(h @ W)
    return node.state


def append_to_argument(xs, out):
    h = xs[0] * 0.0
    for x in xs:
        h = torch.tanh(h @ W + x)
        out.append(h)
    return h


def write_into_argument(buf, x):
    buf[0] = torch.tanh(x @ W)
    return x * 2.0


def add_into_argument(buf, x):
    buf.add_(torch.tanh(x @ W))
    return x * 2.0


def append_to_global(x):
    STORED.append(torch.tanh(x @ W))
    return x * 2.0


def returned_argument_changed(node):
    if node.kids:
        h = returned_argument_changed(node.kids[0])
        h += 1.0  # (the leaf's own x, handed back up)
        return h
    return node.x


def own_list(xs):
    hs = []
    v = xs[0] * 1.0
    v += 1.0
    for x in xs:
        hs.append(torch.tanh(x @ W) + v)
    return torch.stack(hs).sum(0)


def child_sum(node):
    hs = []
    for k in node.kids:
        hs.append(child_sum(k))
    h = sum(hs) if hs else node.x
    return torch.tanh(h @ W)


def counter(xs):
    r, t = 0.0, 0
    for x in xs:
        r += x.sum()
        t += 1
    return r / t


def filled_by_a_call(node, out):
    out.append(node.x * 2.0)
    for k in node.kids:
        filled_by_a_call(k, out)


def gathers(node):
    out = []
    filled_by_a_call(node, out)
    return torch.stack(out).sum(0)


def item_of_own_list_changed(node):
    hs = [node.x]
    hs[0].add_(1.0)  # (hs is the call's own, its item the caller's tensor)
    return hs[0] * 1.0


def through_concatenation(node):
    for k in node.kids + []:
        k.state = k.x * 2.0
    return node.x * 1.0


def depth(node):
    return len(node.kids)


def popped_off_own_stack(node):
    stack = [node]
    total = node.x * 0.0
    while stack:
        n = stack.pop()
        n.state = torch.tanh(n.x @ W)  # (an item of the call's own list: the caller's node)
        total = total + n.state
        stack.extend(n.kids)
    return total


def deepest_kid(node):
    best = max(node.kids, key=depth)  # (max hands back one of its arguments' items)
    best.state = torch.tanh(best.x @ W)
    return node.x * 1.0


def kids_added_to_own_list(node):
    out = []
    out += node.kids
    for k in out:
        k.state = torch.tanh(k.x @ W)
    return node.x * 1.0


def kids_repeated(node):
    for k in node.kids * 1:
        k.state = torch.tanh(k.x @ W)
    return node.x * 1.0


def kid_in_a_nested_own_list(node):
    groups = [[]]
    groups[0].append(node.kids[0])
    for k in groups[0]:
        k.state = torch.tanh(k.x @ W)
    return node.x * 1.0


class Scale:
    """A callable object (unhashable: it defines __eq__)."""

    def __init__(self, w):
        self.w = w

    def __eq__(self, other):
        return isinstance(other, Scale) and other.w == self.w

    def __call__(self, x):
        return x * self.w


SCALE = Scale(2.0)


def scaled(x):
    return torch.tanh(SCALE(x))


def line_of(fn, *, owner=None):
    """The line of the change ``caller_visible_change`` finds in ``fn``, or None."""
    op = caller_visible_change(recompile.function(fn, mode="sequential")._ready_callee(owner), FINAL)
    return None if op is None else op.loc.lineno


def first_line_with(fn, text):
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("fn, text", [
    (encode_storing_states, "node.state ="), (append_to_argument, "out.append"), (write_into_argument, "buf[0]"),
    (add_into_argument, "buf.add_"), (append_to_global, "STORED.append"), (returned_argument_changed, "h += 1.0"),
    (item_of_own_list_changed, "hs[0].add_"), (through_concatenation, "k.state ="),
    (popped_off_own_stack, "n.state ="), (deepest_kid, "best.state ="), (kids_added_to_own_list, "k.state ="),
    (kids_repeated, "k.state ="), (kid_in_a_nested_own_list, "k.state ="),  # (``groups[0]`` is the own ``[]``)
])
def test_a_change_the_caller_can_see_is_found_at_its_line(fn, text):
    assert line_of(fn) == first_line_with(fn, text)


@pytest.mark.parametrize("fn", [own_list, child_sum, counter, gathers, scaled])
def test_changes_to_the_calls_own_objects_are_not_the_callers(fn):
    assert line_of(fn) is None


def test_a_module_of_self_may_hand_back_its_argument():
    """``self.lin(x)`` may be an ``nn.Identity`` (or an eval-mode Dropout) handing ``x`` back: a change of its
    result counts, where ``x`` is the caller's; a module's result from the call's own values does not."""
    class Cell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)
            y += 1.0
            return y

        def own(self, x):
            y = self.lin(x * 2.0)
            y += 1.0
            return y

        def remembered(self, x):
            y = self.lin(x)
            self.last = y
            return y

    assert line_of(Cell.forward, owner=Cell) == first_line_with(Cell.forward, "y += 1.0")
    assert line_of(Cell.own, owner=Cell) is None
    assert line_of(Cell.remembered, owner=Cell) == first_line_with(Cell.remembered, "self.last =")


def tree():
    leaves = [Node(torch.tensor([0.3, -0.5, 0.9], dtype=F64, requires_grad=True)),
              Node(torch.tensor([-1.2, 0.4, 0.1], dtype=F64, requires_grad=True))]
    return Node(torch.tensor([0.2, 0.2, -0.7], dtype=F64, requires_grad=True), leaves), leaves


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_states_stored_on_nodes_carry_eagers_gradient(mode):
    results = []
    for fn in (encode_storing_states, recompile.function(encode_storing_states, mode=mode)):
        root, leaves = tree()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.GradFallbackWarning)
            r = fn(root)
        loss = r.sum() + 3.0 * leaves[0].state.sum() - leaves[1].state.pow(2).sum()
        results.append(grads_of(loss, [W, root.x, *(n.x for n in leaves)]))
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [write_into_argument, add_into_argument])
@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_a_tensor_changed_in_the_callers_hands_carries_eagers_gradient(fn, mode):
    results = []
    for f in (fn, recompile.function(fn, mode=mode)):
        x = torch.tensor([0.3, -0.5, 0.9], dtype=F64, requires_grad=True)
        buf = torch.ones(2, 3, dtype=F64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.GradFallbackWarning)
            r = f(buf, x)
        results.append((buf.detach().clone(), grads_of(r.sum() + 3.0 * buf.sum(), [x, W])))
    (got_buf, got), (want_buf, want) = results[1], results[0]
    torch.testing.assert_close(got_buf, want_buf)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_appended_and_global_tensors_carry_eagers_gradient():
    xs = [torch.tensor([0.3, -0.5, 0.9], dtype=F64, requires_grad=True) for _ in range(3)]
    results = []
    for f in (append_to_argument, recompile.function(append_to_argument, mode="sequential")):
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.GradFallbackWarning)
            f(xs, out)
        results.append(grads_of(sum(o.sum() * (k + 1) for k, o in enumerate(out)), [W, *xs]))
    for fn in (append_to_global, recompile.function(append_to_global, mode="sequential")):
        STORED.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.GradFallbackWarning)
            fn(xs[0])
        results.append(grads_of(STORED[0].sum(), [W, xs[0]]))
    for got, want in ((results[1], results[0]), (results[3], results[2])):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_the_fallback_warns_once_at_the_users_line(monkeypatch):
    monkeypatch.setattr(diagnostics, "_warned", set())  # (an earlier test may have warned of this line)
    f = recompile.function(append_to_global, mode="sequential")
    x = torch.tensor([0.3, -0.5, 0.9], dtype=F64, requires_grad=True)
    with pytest.warns(recompile.GradFallbackWarning, match="may put a value into an object its caller holds") as seen:
        f(x)
        f(x)
    stored = [w for w in seen if "caller holds" in str(w.message)]
    assert len(stored) == 1 and stored[0].lineno == first_line_with(append_to_global, "STORED.append")
    STORED.clear()


def test_without_gradients_the_derived_program_runs_and_nothing_warns():
    f = recompile.function(append_to_global, mode="sequential")
    x = torch.tensor([0.3, -0.5, 0.9], dtype=F64)
    STORED.clear()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", recompile.GradFallbackWarning)
        torch.testing.assert_close(f(x), x * 2.0)
    assert len(STORED) == 1
    STORED.clear()


def test_a_call_changing_only_its_own_objects_keeps_the_derived_program():
    f = recompile.function(own_list, mode="sequential")
    xs = [torch.tensor([0.3, -0.5, 0.9], dtype=F64, requires_grad=True) for _ in range(3)]
    before = f.stats["backwards"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.GradFallbackWarning)
        got = grads_of(f(xs).sum(), xs)
    assert f.stats["backwards"] > before
    for a, b in zip(got, grads_of(own_list(xs).sum(), xs)):
        torch.testing.assert_close(a, b)


def swapped_lists(a, b, d):
    if d > 0:
        swapped_lists(b, a, d - 1)  # (fills its own parameters in turn: the reading grows while it reads)
    b.append(a)
    return d


def test_a_recursion_that_fills_its_parameters_in_turn_is_read_to_the_end():
    assert line_of(swapped_lists) == first_line_with(swapped_lists, "b.append")


def test_popped_states_carry_eagers_gradient():
    results = []
    for fn in (popped_off_own_stack, recompile.function(popped_off_own_stack, mode="sequential")):
        root, leaves = tree()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.GradFallbackWarning)
            r = fn(root)
        results.append(grads_of(r.sum() + 3.0 * leaves[0].state.sum(), [W, root.x, *(n.x for n in leaves)]))
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want)
