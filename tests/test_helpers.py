"""Undecorated helpers of per-instance values (runtime/helpers.py): compiled and run once for the group.

Each test compares a batched run (``recompile.vmap``) with eager PyTorch per instance, values and gradients,
and checks what ran once per instance (``stats["per_instance"]``): nothing, where the helper changes nothing
in place; the helper itself, counted and warned of, where it changes something, where the compiler refuses
it, or with ``config.COMPILE_HELPERS`` off.
"""

from __future__ import annotations

import json
import os
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import config
from recompile.data import Forest
from recompile.runtime import helpers
from test_levels import program
from test_segments import WORDS, trees

F64 = torch.float64


def scale_rows(v, k=2.0):
    """A helper of a helper: both compiled."""
    return squashed(v) * k


def squashed(v):
    return torch.tanh(v) + v.sum() * 0.1


def uses_helpers(x):
    if x[0] > 0:
        return scale_rows(x, k=3.0) + 1.0
    return scale_rows(x)


def run_both(f, x):
    """(vmap of f compiled, eager loop) on ``x``'s rows: values and x's gradients, and the compiled stats."""
    cf = recompile.function(f)
    x_b, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = recompile.vmap(cf)(x_b)
    want = torch.stack([f(row) for row in x_e])
    grads = [torch.autograd.grad(v.sum(), leaf)[0] for v, leaf in ((got, x_b), (want, x_e))]
    return (got, grads[0]), (want, grads[1]), cf.stats


X = torch.tensor([[1., 2, 3], [-1, 2, 0], [2, -1, 1], [0.5, 0.5, 0.5], [-2, 1, 1]], dtype=F64)


def test_a_helper_of_per_instance_values_runs_once_for_the_group():
    (got, got_grad), (want, want_grad), stats = run_both(uses_helpers, X)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    assert stats["per_instance"] == {}
    compiled = helpers.compiled(scale_rows)
    assert not isinstance(compiled, Exception)


def test_with_compile_helpers_off_a_helper_runs_once_per_instance(monkeypatch):
    monkeypatch.setattr(config, "COMPILE_HELPERS", False)
    with pytest.warns(recompile.PerInstanceWarning, match="scale_rows runs once per instance"):
        (got, got_grad), (want, want_grad), stats = run_both(uses_helpers, X)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    assert sum(stats["per_instance"].values()) == len(X)


SEEN = []


def noted(v):
    """A helper that changes something (a global list): each instance's change before the next one's read."""
    SEEN.append(len(SEEN))
    return v * len(SEEN)


def uses_noted(x):
    return noted(x) + 1.0


def test_a_helper_that_changes_something_runs_once_per_instance_in_order():
    SEEN.clear()
    cf = recompile.function(uses_noted)
    with pytest.warns(recompile.PerInstanceWarning, match="noted runs once per instance"):
        got = recompile.vmap(cf)(X)
    SEEN.clear()
    want = torch.stack([uses_noted(row) for row in X])
    torch.testing.assert_close(got, want)  # (instance k saw k + 1 entries, as one call after another)
    assert sum(cf.stats["per_instance"].values()) == len(X)


def per_instance_inside(v):
    return v * sum(v.tolist())  # (a Python list of each instance's tensor: once per instance, inside)


def uses_per_instance_inside(x):
    return per_instance_inside(x) - 1.0


def test_what_a_compiled_helper_runs_once_per_instance_counts_in_the_callers_stats():
    with pytest.warns(recompile.PerInstanceWarning, match="test_helpers.py"):
        (got, _), (want, _), stats = run_both(uses_per_instance_inside, X)
    torch.testing.assert_close(got, want)
    assert stats["per_instance"] and all("per_instance_inside" not in name for name in stats["per_instance"])


def test_a_helper_whose_source_cannot_be_read_runs_once_per_instance_and_the_warning_says_why(tmp_path):
    path = tmp_path / "gone.py"
    namespace = {}
    exec(compile("def gone(v):\n    return v * 2.0\n", str(path), "exec"), namespace)  # (no file behind it)
    gone = namespace["gone"]
    assert helpers.user_function(gone) is gone
    global _GONE
    _GONE = gone
    cf = recompile.function(uses_gone)
    with pytest.warns(recompile.PerInstanceWarning, match="that recompile does not compile .*cannot read"):
        got = recompile.vmap(cf)(X)
    torch.testing.assert_close(got, X * 2.0 + 1.0)


_GONE = None


def uses_gone(x):
    return _GONE(x) + 1.0


@pytest.mark.parametrize("fn", [F.softmax, json.dumps, os.path.join, torch.tanh, lambda v: v, len, nn.Linear(2, 2)])
def test_only_the_users_own_functions_are_helpers(fn):
    assert helpers.user_function(fn) is None


def helper_generator(v):
    yield v


def helper_varargs(*vs):
    return vs[0]


def helper_keyword_only(v, *, k=1.0):
    return v * k


def test_generators_star_parameters_and_keyword_only_ones_are_not_helpers():
    for fn in (helper_generator, helper_varargs, helper_keyword_only):
        assert helpers.user_function(fn) is None, fn


class Scorer(nn.Module):
    """A Tree-RNN whose node loss is an undecorated method, as users write it: compiled, deferred, and the
    recursion a plain level run."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(len(WORDS) + 1, 4)
        self.node = nn.Linear(8, 4)
        self.out = nn.Linear(4, 5)

    def node_loss(self, h, label):
        return F.cross_entropy(self.out(h).unsqueeze(0), label.unsqueeze(0), reduction="sum")

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
        return h, loss + self.node_loss(h, tree.labels[i])


def test_an_undecorated_node_loss_method_batches_and_the_tree_runs_as_a_plain_level_program():
    torch.manual_seed(0)
    model = Scorer().double()
    forest = Forest.from_trees(trees())
    Scorer.encode.stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        for _ in range(2):
            model.zero_grad()
            h, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
            loss.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = [Scorer.encode.python(model, t, t.root) for t in trees()]
    sum(loss for _, loss in eager).backward()
    torch.testing.assert_close(h, torch.stack([e[0] for e in eager]).detach())
    torch.testing.assert_close(loss, torch.stack([e[1] for e in eager]).detach())
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert Scorer.encode.stats["per_instance"] == {}
    prog = program(Scorer.encode, Scorer)
    assert prog.plain.runs >= 2 and prog.fallbacks == 0


class CellHelper(nn.Module):
    """A Tree-RNN whose cell is an undecorated method with a default parameter, and a module-level helper of a
    keyword: a plain level run traces both in its pieces' own places (no nested run per depth)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(len(WORDS) + 1, 4)
        self.node = nn.Linear(8, 4)
        self.out = nn.Linear(4, 5)
        self.k = 1

    def compose(self, hl, hr, scale=1):
        return torch.tanh(self.node(torch.cat([hl, hr], -1))) * self.k * scale

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            h = torch.tanh(self.embed(tree.words[i]))
            loss = 0.0
        else:
            hl, loss_l = self.encode(tree, tree.left[i])
            hr, loss_r = self.encode(tree, tree.right[i])
            h = self.compose(hl, hr)
            loss = loss_l + loss_r
        return h, loss + squared_error(h, target=self.out.bias[:4])


def squared_error(h, target):
    return ((h - target) ** 2).sum()


def nested_runs(monkeypatch):
    """The helpers ``helpers.run`` runs from here on (each a nested run), listed as they run."""
    nested = []
    real = helpers.run
    monkeypatch.setattr(helpers, "run", lambda *args: nested.append(args[1]) or real(*args))
    return nested


def test_a_pure_helper_is_traced_in_the_plain_pieces_own_place(monkeypatch):
    nested = nested_runs(monkeypatch)
    torch.manual_seed(0)
    model = CellHelper().double()
    forest = Forest.from_trees(trees())
    CellHelper.encode.stats.reset()
    for k in (1, 3):  # (the cell reads self.k: a trace made with 1 must not have baked it, nor the default in)
        model.k = k
        model.zero_grad()
        h, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        (h.sum() + loss.sum()).backward()
        got = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        eager = [CellHelper.encode.python(model, t, t.root) for t in trees()]
        want_h, want_loss = (torch.stack(v) for v in zip(*eager))
        (want_h.sum() + want_loss.sum()).backward()
        torch.testing.assert_close((h, loss), (want_h.detach(), want_loss.detach()))
        for g, p in zip(got, model.parameters()):
            assert (g is None) == (p.grad is None)
            if g is not None:
                torch.testing.assert_close(g, p.grad)
    prog = program(CellHelper.encode, CellHelper)
    assert prog.plain.runs >= 2 and not prog.plain.refused and prog.fallbacks == 0
    assert nested == [] and CellHelper.encode.stats["per_instance"] == {}


def looped(h, n):
    """A helper with a loop: no plain form, so the piece runs it by its rule (a nested run), dropping what it
    traced of it."""
    for _ in range(n):
        h = torch.tanh(h)
    return h


def walk_looped(xs, i):
    if i + 1 >= xs.shape[0]:
        return torch.tanh(xs[i])
    return looped(xs[i] + 0.5 * walk_looped(xs, i + 1), 2)


def test_a_helper_the_piece_cannot_trace_runs_by_its_rule():
    compiled = recompile.function(walk_looped)
    xs = torch.randn(6, 3, dtype=F64)
    starts = torch.tensor([0, 2, 5])
    want = torch.stack([walk_looped(xs, int(i)) for i in starts])
    for _ in range(2):
        torch.testing.assert_close(recompile.vmap(compiled, in_dims=(None, 0))(xs, starts), want)
    assert compiled.stats["per_instance"] == {}


class Node:
    """A tree as users hold it: a word and a list of child nodes."""

    def __init__(self, word, kids=()):
        self.word, self.kids = torch.tensor(word), list(kids)


def node_trees():
    leaf = Node
    return [Node(1, [leaf(2), Node(3, [leaf(4), leaf(5), leaf(1)])]), leaf(6), Node(2, [leaf(3)]),
            Node(4, [Node(5, [leaf(6)]), leaf(1)])]


class ChildSumEncoder(nn.Module):
    """A compiled module of its own, recursive over node objects; ``scale`` a default (bound as Python binds it)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.node = nn.Linear(4, 4)

    @recompile.function
    def forward(self, node, scale=1.0):
        h = self.node(self.embed(node.word))
        for kid in node.kids:
            h = h + self.forward(kid)
        return torch.tanh(h) * scale


class StoringEncoder(ChildSumEncoder):
    """The same, storing each node's state on the node, as treelstm.pytorch does."""

    @recompile.function
    def forward(self, node, scale=1.0):
        h = self.node(self.embed(node.word))
        for kid in node.kids:
            self.forward(kid)
            h = h + kid.state
        node.state = torch.tanh(h) * scale
        return node.state


class Classifier(nn.Module):
    """A compiled model that calls its encoder module, as models compose: ``self.encoder(tree)``, or its compiled
    method bound to it (``self.encoder.forward(tree)``)."""

    def __init__(self, encoder, bound):
        super().__init__()
        self.encoder, self.bound = encoder, bound
        self.out = nn.Linear(4, 3)

    @recompile.function
    def forward(self, tree):
        h = self.encoder.forward(tree) if self.bound else self.encoder(tree)
        return self.out(h).logsumexp(-1)


def classify_both(encoder, bound):
    """(recompile.map's losses and gradients, eager's), and the classifier's stats."""
    torch.manual_seed(0)
    model = Classifier(encoder, bound).double()
    Classifier.forward.stats.reset()
    got = recompile.map(model, node_trees())
    got_grads = torch.autograd.grad(sum(got), list(model.parameters()))
    with recompile.disable():
        want = [model(t) for t in node_trees()]
    want_grads = torch.autograd.grad(sum(want), list(model.parameters()))
    return (torch.stack(got), got_grads), (torch.stack(want), want_grads), Classifier.forward.stats


@pytest.mark.parametrize("bound", [False, True], ids=["module", "bound-method"])
def test_a_module_whose_forward_is_compiled_runs_its_program_once_for_the_group(bound):
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        got, want, stats = classify_both(ChildSumEncoder(), bound)
    torch.testing.assert_close(got, want)
    assert stats["per_instance"] == {}


def test_a_compiled_module_that_stores_on_its_nodes_runs_once_per_instance_and_says_why():
    """Each instance's call in turn, its changes before the next one's reads, as the plain Python it is made of
    (at eager's speed: a batched run of one instance would make its calls wait on each other's changes)."""
    StoringEncoder.forward.stats.reset()
    with pytest.warns(recompile.PerInstanceWarning, match="StoringEncoder runs once per instance .* changes something "
                      "in place .*instead of storing it"):
        got, want, stats = classify_both(StoringEncoder(), False)
    torch.testing.assert_close(got, want)
    assert stats["per_instance"] == {"StoringEncoder": len(node_trees())}
    assert StoringEncoder.forward.stats["calls"] == 0  # (its program never ran: plain Python did)
    tree = node_trees()[0]
    StoringEncoder().double()(tree)  # (called by the user, outside a run: its program, as ever)
    assert StoringEncoder.forward.stats["calls"] == 1 and tree.state is not None


class StoringCell(nn.Module):
    """A cell that stores its state on the node it is given."""

    def __init__(self):
        super().__init__()
        self.node = nn.Linear(4, 4)

    @recompile.function
    def forward(self, node, h):
        node.state = torch.tanh(self.node(h))
        return node.state


class CellsOnEveryNode(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.cell = StoringCell()

    @recompile.function
    def forward(self, node):
        h = self.embed(node.word)
        for kid in node.kids:
            h = h + self.forward(kid)
        return self.cell(node, h)


def test_a_compiled_module_that_stores_on_nodes_runs_once_per_instance_in_a_recursion_and_says_why():
    """Called by a recursion's frames (its instances may be one tree's nodes), each instance's call in turn."""
    torch.manual_seed(0)
    model = CellsOnEveryNode().double()
    CellsOnEveryNode.forward.stats.reset()
    with pytest.warns(recompile.PerInstanceWarning, match="StoringCell runs once per instance .* changes something "
                      "in place .*instead of storing it"):
        got = recompile.map(model, node_trees())
    with recompile.disable():
        want = [model(t) for t in node_trees()]
    torch.testing.assert_close(got, want)
    assert CellsOnEveryNode.forward.stats["per_instance"].get("StoringCell", 0) > 0


def test_plain_here_runs_compiled_functions_as_plain_python_on_its_own_thread_only():
    """``debugging.plain_here``, the per-instance run of a compiled function that changes something: plain Python
    on this thread, restored after (an error included); another thread's calls run their programs."""
    from recompile import debugging

    def double(x):
        return x * 2.0

    cf = recompile.function(double)
    seen = []
    with pytest.raises(ValueError), debugging.plain_here():
        assert debugging.plain()
        cf(torch.ones(2))
        other = threading.Thread(target=lambda: seen.append((debugging.plain(), cf(torch.ones(2)))))
        other.start()
        other.join()
        raise ValueError("leaves the block")
    assert not debugging.plain()
    assert seen[0][0] is False
    assert cf.stats["calls"] == 1  # (the other thread's call only)


class Gate(nn.Module):
    """A module of the user's with an undecorated forward that torch.func.vmap cannot batch (an if on a value):
    compiled as a helper is."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, v):
        if v.sum() > 0:
            return torch.tanh(self.lin(v))
        return -v


def gated_by(gate, x):  # (a name of its own: stats name a function by its name, test_fallbacks' gated too)
    return gate(x) * 2.0


def test_a_users_module_vmap_cannot_batch_runs_its_forward_compiled():
    gate = Gate().double()
    cf = recompile.function(gated_by)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        got = recompile.vmap(cf, in_dims=(None, 0))(gate, X)
    torch.testing.assert_close(got, torch.stack([gated_by(gate, row) for row in X]))
    assert cf.stats["per_instance"] == {}


class CellModule(nn.Module):
    """A pure cell module with a compiled forward, as a tree's compose step."""

    def __init__(self):
        super().__init__()
        self.node = nn.Linear(8, 4)

    @recompile.function
    def forward(self, hl, hr, scale=1.0):
        return torch.tanh(self.node(torch.cat([hl, hr], -1))) * scale


class ModuleCell(CellHelper):
    def __init__(self):
        super().__init__()
        self.cell = CellModule()

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            h = torch.tanh(self.embed(tree.words[i]))
        else:
            h = self.cell(self.encode(tree, tree.left[i]), self.encode(tree, tree.right[i]))
        return h


def test_a_compiled_cell_module_is_traced_in_the_plain_pieces_own_place(monkeypatch):
    nested = nested_runs(monkeypatch)
    torch.manual_seed(0)
    model = ModuleCell().double()
    forest = Forest.from_trees(trees())
    ModuleCell.encode.stats.reset()
    for _ in range(2):
        got = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    want = torch.stack([ModuleCell.encode.python(model, t, t.root) for t in trees()])
    torch.testing.assert_close(got, want.detach())
    prog = program(ModuleCell.encode, ModuleCell)
    assert prog.plain.runs >= 2 and not prog.plain.refused and prog.fallbacks == 0
    assert nested == [] and ModuleCell.encode.stats["per_instance"] == {}
    model.cell.register_forward_hook(lambda m, args, out: out * 0.0)  # (a hook added later: the trace stands down)
    got = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    assert float(got[[not t.is_leaf[t.root] for t in trees()]].detach().abs().sum()) == 0.0


class StarredEncoder(nn.Module):
    """A compiled forward taking ``*xs`` and ``**options``: no helper (its instances' values would be bound into one
    tuple), each instance's own call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @recompile.function
    def forward(self, *xs, **options):
        return torch.tanh(self.lin(sum(xs))) * options.get("scale", 1.0)


class Hooked(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    @recompile.function
    def forward(self, x):
        return self.inner(x, x * 2.0, scale=3.0).sum() if isinstance(self.inner, StarredEncoder) else \
            self.inner(x).sum()


@pytest.mark.parametrize("inner", ["starred", "backward hook", "linear with a backward hook"])
def test_a_module_whose_call_no_group_run_may_replace_runs_for_each_instance(inner):
    """A compiled forward with ``*xs`` (each instance's own call), and a module with a backward hook (a compiled
    one, or torch's own ``nn.Linear``): each instance's call of the module itself, so the hook runs for each, as
    eager's does, and changes the gradient as it does there."""
    torch.manual_seed(0)
    module = StarredEncoder() if inner == "starred" else ChildSumEncoderOfRows() if inner == "backward hook" else \
        nn.Linear(3, 3)
    calls = []
    if inner != "starred":
        module.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(1) or (grad_in[0] * 5.0,))
    model = Hooked(module).double()
    xs = [torch.randn(3, dtype=F64, requires_grad=True) for _ in range(3)]
    with recompile.disable():
        want = [model(x) for x in xs]
    want_grads = torch.autograd.grad(sum(want), xs)
    eager_calls, calls[:] = len(calls), []
    got = recompile.map(model, xs)
    torch.testing.assert_close(torch.stack(got), torch.stack(want).detach())
    torch.testing.assert_close(torch.autograd.grad(sum(got), xs), want_grads)
    assert len(calls) == eager_calls


class ChildSumEncoderOfRows(nn.Module):
    """A compiled module of a tensor (a backward hook's module)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @recompile.function
    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_a_deep_recursion_run_plain_per_instance_goes_on_as_the_compiled_program_past_plain_depth():
    """A chain deeper than Python's stack allows, stored on its nodes by an encoder a classifier calls: plain
    Python up to ``debugging.PLAIN_DEPTH`` calls deep, its program below (as eager's, a RecursionError)."""
    import sys

    torch.manual_seed(0)
    model = Classifier(StoringEncoder(), False).double()
    chain = None
    for k in range(sys.getrecursionlimit() + 200):
        chain = Node(k % 8, [chain] if chain is not None else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.map(model, [chain, node_trees()[0]])
    assert chain.state is not None and torch.isfinite(got[0])
    with recompile.disable():
        torch.testing.assert_close(got[1], model(node_trees()[0]))


def halves(r):
    return {"a": r * 2.0}


class MapsInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.log = []

    @recompile.function
    def forward(self, x):
        d = recompile.vmap(halves)(x)  # (inside a plain per-instance call: a batched run of its own)
        self.log.append(1)  # (a change: each instance's call runs as plain Python)
        return d["a"].sum(0)


class CallsMapsInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = MapsInside()

    @recompile.function
    def forward(self, x):
        return self.inner(x).sum()


def test_a_vmap_inside_a_plain_per_instance_call_runs_as_ever():
    model = CallsMapsInside()
    xs = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[0.5, 0.5], [1.0, -1.0]])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.map(model, xs)
    torch.testing.assert_close(got, [x.sum() * 2.0 for x in xs])
    assert model.inner.log == [1, 1]
