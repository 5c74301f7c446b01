"""Differential tests of batched mode: batched vs sequential vs plain eager Python, values and gradients.

Every program below is an ordinary, undecorated function (or a method body
assigned to a class). Each is compiled twice, ``mode="batched"`` and
``mode="sequential"``, and the eager side runs the plain function. Programs
that call themselves or each other through a module global run their
compiled side under ``bound_globals`` (the global names bound to the compiled
objects of the mode under test, as in tests/test_grad.py); methods recurse
through ``self.encode`` / ``self.expand``, so each mode is one class.

Layout
  1. helpers: comparing nested results, trees, parameter gradients
  2. recursive tree models (Tree-LSTM-like, Tree-RNN-like): single calls and
     ``recompile.vmap`` over a Forest, on balanced, linear and random trees
  3. a top-down model that generates its own tree from computed values
  4. control flow diverging between instances inside ``recompile.vmap``
  5. stats on SST minibatches with examples/tree_lstm.py
  6. ops without a batch rule
  7. errors: exceptions inside a batched recursion, vmap misuse
  8. per-instance side effects and in-place updates
  9. deferred calls: a call whose result is only returned runs once for every level
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import random
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from bound_globals import bound_globals  # tests/ is on sys.path under pytest
from recompile import config
from recompile.data import Forest, Tree, Vocab, load_sst, sample_dir

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from tree_lstm import TreeLSTM  # noqa: E402

F64 = torch.float64
VAL_TOL = 1e-9
GRAD_TOL = 1e-7
G = globals()


# ---------------------------------------------------------------------------
# 1. helpers
# ---------------------------------------------------------------------------

def assert_close(got, want, tol=VAL_TOL, path="result"):
    """Same structure, same Python types, tensors equal within ``tol`` (shape and dtype too)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__} instead of a tensor"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        if want.numel():
            diff = (got.detach().double() - want.detach().double()).abs().max().item()
            assert diff <= tol, f"{path}: max difference {diff:.3g} > {tol}"
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, tol, f"{path}[{k}]")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def stack_results(results):
    """Per-instance results (tensors or tuples of tensors) stacked along a new dim 0, as vmap returns them."""
    first = results[0]
    if isinstance(first, (tuple, list)):
        return type(first)(stack_results([r[j] for r in results]) for j in range(len(first)))
    return torch.stack(results)


def param_grads(model):
    return {name: (p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}


def assert_grads_close(got, want, tol=GRAD_TOL):
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            # a parameter no instance used: None in eager; allow an explicit zero gradient
            other = g if w is None else w
            assert other is None or not other.abs().any(), f"grad of {name}: {g} vs {w}"
            continue
        assert_close(g, w, tol, f"grad of {name}")


def scalar(out, weights):
    """A fixed weighted sum of every tensor in ``out`` (so that each output gets its own cotangent)."""
    if isinstance(out, (tuple, list)):
        return sum(scalar(o, w) for o, w in zip(out, weights))
    return (out * weights).sum()


def weights_like(out, seed=123):
    gen = torch.Generator().manual_seed(seed)
    if isinstance(out, (tuple, list)):
        return type(out)(weights_like(o, seed + k + 1) for k, o in enumerate(out))
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


# -- trees

WORDS = [f"w{k}" for k in range(12)]


def vocab():
    v = Vocab(WORDS)
    v.freeze()
    return v


def balanced_nested(depth, counter=None):
    counter = counter if counter is not None else [0]
    if depth == 0:
        counter[0] += 1
        return (counter[0] % 5, WORDS[counter[0] % len(WORDS)])
    return (depth % 5, balanced_nested(depth - 1, counter), balanced_nested(depth - 1, counter))


def linear_nested(depth):
    """A degenerate tree: a left spine of ``depth`` internal nodes, each with a leaf on the right."""
    t = (0, WORDS[0])
    for k in range(depth):
        t = (k % 5, t, ((k + 1) % 5, WORDS[(k + 1) % len(WORDS)]))
    return t


def random_nested(seed, leaves):
    rng = random.Random(seed)
    items = [(rng.randrange(5), rng.choice(WORDS)) for _ in range(leaves)]
    while len(items) > 1:
        k = rng.randrange(len(items) - 1)
        items[k:k + 2] = [(rng.randrange(5), items[k], items[k + 1])]
    return items[0]


TREE_SHAPES = {
    "single_leaf": lambda: (3, "w1"),
    "balanced3": lambda: balanced_nested(3),
    "linear200": lambda: linear_nested(200),
    "random7": lambda: random_nested(0, 7),
    "random12": lambda: random_nested(1, 12),
    "random20": lambda: random_nested(2, 20),
}


def make_tree(shape):
    return Tree.from_nested(TREE_SHAPES[shape](), vocab())


# ---------------------------------------------------------------------------
# 2. recursive tree models
# ---------------------------------------------------------------------------

class TreeParams(nn.Module):
    def __init__(self, vocab_size=len(WORDS) + 1, embed=8, hidden=6, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.leaf = nn.Linear(embed, 3 * hidden)
        self.node = nn.Linear(2 * hidden, 5 * hidden)
        self.proj = nn.Linear(embed, hidden)
        self.comb = nn.Linear(2 * hidden, hidden)
        self.out = nn.Linear(hidden, classes)


def lstm_encode(self, tree, i):
    """Tree-LSTM node: (h, c, summed cross-entropy of the subtree)."""
    if tree.is_leaf[i]:
        x = self.embed(tree.words[i])
        ig, og, u = torch.chunk(self.leaf(x), 3, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(c)
    loss = loss + F.cross_entropy(self.out(h), tree.labels[i])
    return h, c, loss


def lstm_keywords_encode(self, tree, i):
    """``lstm_encode`` with its ops' tensors given by keyword (``torch.cat(tensors=...)``, ``input=``)."""
    if tree.is_leaf[i]:
        x = F.embedding(input=tree.words[i], weight=self.embed.weight)
        ig, og, u = torch.chunk(F.linear(input=x, weight=self.leaf.weight, bias=self.leaf.bias), 3, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        ig, og, u, fl, fr = torch.chunk(self.node(input=torch.cat(tensors=[hl, hr], dim=-1)), 5, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(torch.stack(tensors=[c], dim=0)[0])
    loss = loss + F.cross_entropy(self.out(h), tree.labels[i])
    return h, c, loss


def rnn_encode(self, tree, i):
    """Tree-RNN node (Socher 2011 style): h = tanh(W [hl; hr] + b); a leaf is its projected embedding."""
    if tree.is_leaf[i]:
        h = torch.tanh(self.proj(self.embed(tree.words[i])))
    else:
        hl = self.encode(tree, tree.left[i])
        hr = self.encode(tree, tree.right[i])
        h = torch.tanh(self.comb(torch.cat([hl, hr], dim=-1)))
    return h


def model_classes(fn, name):
    """(eager, batched, sequential) subclasses of TreeParams whose ``encode`` is ``fn``."""
    return (type("Eager" + name, (TreeParams,), {"encode": fn}),
            type("Batched" + name, (TreeParams,), {"encode": recompile.function(fn)}),
            type("Sequential" + name, (TreeParams,), {"encode": recompile.function(fn, mode="sequential")}))


MODELS = {"lstm": model_classes(lstm_encode, "LSTM"), "rnn": model_classes(rnn_encode, "RNN"),
          "lstm_keywords": model_classes(lstm_keywords_encode, "LSTMKeywords")}


def three_models(kind, seed=0):
    torch.manual_seed(seed)
    eager_cls, batched_cls, seq_cls = MODELS[kind]
    eager = eager_cls().double()
    batched, seq = batched_cls().double(), seq_cls().double()
    batched.load_state_dict(eager.state_dict())
    seq.load_state_dict(eager.state_dict())
    return eager, batched, seq


def run_with_grads(model, call):
    model.zero_grad()
    out = call(model)
    scalar(out, weights_like(out)).backward()
    return out, param_grads(model)


@pytest.mark.parametrize("shape", list(TREE_SHAPES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_tree_model_single_call(kind, shape):
    tree = make_tree(shape)
    eager, batched, seq = three_models(kind)
    want, want_g = run_with_grads(eager, lambda m: m.encode(tree, tree.root))
    for model in (batched, seq):
        got, got_g = run_with_grads(model, lambda m: m.encode(tree, tree.root))
        assert_close(got, want)
        assert_grads_close(got_g, want_g)


FOREST_SHAPES = ["balanced3", "random7", "single_leaf", "linear200", "random12", "random20", "random7"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_tree_model_vmap_over_forest(kind):
    trees = [make_tree(s) for s in FOREST_SHAPES]
    forest = Forest.from_trees(trees)
    eager, batched, seq = three_models(kind, seed=1)
    want, want_g = run_with_grads(eager, lambda m: stack_results([m.encode(t, t.root) for t in trees]))
    got, got_g = run_with_grads(batched,
                                lambda m: recompile.vmap(m.encode, in_dims=(None, 0))(forest, forest.roots))
    assert_close(got, want)
    assert_grads_close(got_g, want_g)
    # sequential, one tree at a time (on the forest, with each tree's root), agrees too
    got_s, got_sg = run_with_grads(seq, lambda m: stack_results([m.encode(forest, r) for r in forest.roots]))
    assert_close(got_s, want)
    assert_grads_close(got_sg, want_g)


def test_tree_model_vmap_builds_once_and_counts_instances():
    trees = [make_tree(s) for s in ("balanced3", "random7", "random12")]
    forest = Forest.from_trees(trees)
    _, batched, _ = three_models("rnn")
    cls = type(batched)
    cls.encode.stats.reset()
    builds = cls.encode.stats["builds"]
    for _ in range(3):
        with torch.no_grad():
            recompile.vmap(batched.encode, in_dims=(None, 0))(forest, forest.roots)
    stats = cls.encode.stats
    assert stats["builds"] == builds <= 1
    assert stats["calls"] == 3
    entry = stats["batches"][cls.encode.ir_name]
    # every node of every tree is one instance of the function's entry
    assert entry["instances"] == 3 * forest.num_nodes
    assert entry["mean_batch"] == entry["instances"] / entry["runs"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_tree_model_vmap_runs_leaves_once_and_internal_nodes_once_per_height(kind):
    trees = [make_tree(s) for s in FOREST_SHAPES]
    forest = Forest.from_trees(trees)
    _, batched, _ = three_models(kind)
    encode = type(batched).encode
    encode.stats.reset()
    with torch.no_grad():
        recompile.vmap(batched.encode, in_dims=(None, 0))(forest, forest.roots)
    batches = encode.stats["batches"]
    then = [name for name in batches if name.endswith(".then")]
    other = [name for name in batches if name.endswith(".else")]
    assert len(then) == 1 and len(other) == 1, list(batches)
    assert batches[then[0]]["runs"] == 1
    assert batches[then[0]]["instances"] == int(forest.is_leaf.sum())
    assert batches[other[0]]["runs"] == max(t.height for t in trees)
    assert encode.stats["per_instance"] == {}


def test_deep_degenerate_tree_batched():
    """3000 levels: frames live off the Python stack in batched mode too; values and gradients as
    sequential mode's."""
    tree = Tree.from_nested(linear_nested(3000), vocab())
    forest = Forest.from_trees([tree, make_tree("balanced3")])
    _, batched, seq = three_models("rnn", seed=2)
    want, want_g = run_with_grads(seq, lambda m: m.encode(tree, tree.root))
    got, got_g = run_with_grads(batched, lambda m: m.encode(tree, tree.root))
    assert_close(got, want)
    assert_grads_close(got_g, want_g)
    with torch.no_grad():
        got_v = recompile.vmap(batched.encode, in_dims=(None, 0))(forest, forest.roots)
    assert_close(got_v[0], want.detach())


def test_vmap_under_no_grad_and_inference_mode():
    trees = [make_tree(s) for s in ("balanced3", "random12", "single_leaf")]
    forest = Forest.from_trees(trees)
    eager, batched, _ = three_models("lstm", seed=3)
    with torch.no_grad():
        want = stack_results([eager.encode(t, t.root) for t in trees])
        got = recompile.vmap(batched.encode, in_dims=(None, 0))(forest, forest.roots)
    assert_close(got, want)
    assert not any(t.requires_grad for t in got)
    with torch.inference_mode():
        got = recompile.vmap(batched.encode, in_dims=(None, 0))(forest, forest.roots)
    assert_close(got, want)


def test_vmap_out_dims_moves_the_batch_dim():
    trees = [make_tree(s) for s in ("balanced3", "random7", "random12")]
    forest = Forest.from_trees(trees)
    eager, batched, _ = three_models("rnn", seed=4)
    with torch.no_grad():
        want = torch.stack([eager.encode(t, t.root) for t in trees])
        got = recompile.vmap(batched.encode, in_dims=(None, 0), out_dims=1)(forest, forest.roots)
    assert_close(got, want.T.contiguous())


def test_vmap_in_dims_one():
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(9), dtype=F64)  # instances along dim 1
    got = recompile.vmap(COMPILED["batched"]["cf_if"], in_dims=1)(x)
    assert_close(got, torch.stack([cf_if(x[:, k]) for k in range(6)]))


# ---------------------------------------------------------------------------
# 3. top-down, dynamic structure (Jeong et al. Table 3): the tree is generated at run time
# ---------------------------------------------------------------------------

# the top-down model of the idiom suite (benchmarks/bench_sequences.py), small
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_sequences import MAX_DEPTH, TopDown  # noqa: E402

expand = TopDown.expand


class TopDownParams(TopDown):
    def __init__(self, hidden=6):
        super().__init__(hidden)


def count_nodes(self, h, depth):
    p = torch.sigmoid(self.gate(h)).squeeze(-1)
    if depth < MAX_DEPTH and p > 0.5:
        return 1 + self.count(torch.tanh(self.l(h)), depth + 1) + self.count(torch.tanh(self.r(h)), depth + 1)
    return 1


EagerTopDown = type("EagerTopDown", (TopDownParams,), {"expand": expand, "count": count_nodes})
BatchedTopDown = type("BatchedTopDown", (TopDownParams,), {"expand": recompile.function(expand)})
SequentialTopDown = type("SequentialTopDown", (TopDownParams,),
                         {"expand": recompile.function(expand, mode="sequential")})


def topdown_models():
    torch.manual_seed(1)
    eager = EagerTopDown().double()
    with torch.no_grad():
        eager.gate.bias.fill_(0.3)
    others = [cls().double() for cls in (BatchedTopDown, SequentialTopDown)]
    for m in others:
        m.load_state_dict(eager.state_dict())
    starts = 2 * torch.randn(12, 6, generator=torch.Generator().manual_seed(5), dtype=F64)
    return eager, others[0], others[1], starts


def test_topdown_instances_really_differ():
    """Sanity of the fixture: the start states grow trees of different sizes (leaf only, full, in between)."""
    eager, _, _, starts = topdown_models()
    sizes = [eager.count(h, 0) for h in starts]
    assert 1 in sizes and 2 ** (MAX_DEPTH + 1) - 1 in sizes and len(set(sizes)) >= 4, sizes


def test_topdown_single_calls():
    eager, batched, seq, starts = topdown_models()
    for h in starts[:6]:
        want, want_g = run_with_grads(eager, lambda m: m.expand(h, 0))
        for model in (batched, seq):
            got, got_g = run_with_grads(model, lambda m: m.expand(h, 0))
            assert_close(got, want)
            assert_grads_close(got_g, want_g)


def test_topdown_vmap_shared_depth():
    eager, batched, seq, starts = topdown_models()
    want, want_g = run_with_grads(eager, lambda m: torch.stack([m.expand(h, 0) for h in starts]))
    got, got_g = run_with_grads(batched, lambda m: recompile.vmap(m.expand, in_dims=(0, None))(starts, 0))
    assert_close(got, want)
    assert_grads_close(got_g, want_g)
    got_s, got_sg = run_with_grads(seq, lambda m: torch.stack([m.expand(h, 0) for h in starts]))
    assert_close(got_s, want)
    assert_grads_close(got_sg, want_g)


def test_topdown_vmap_per_instance_depth_and_input_grads():
    eager, batched, _, starts = topdown_models()
    depths = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5])
    x_e = starts.clone().requires_grad_(True)
    x_b = starts.clone().requires_grad_(True)
    want = torch.stack([eager.expand(x_e[k], depths[k]) for k in range(len(depths))])
    got = recompile.vmap(batched.expand, in_dims=(0, 0))(x_b, depths)
    assert_close(got, want)
    w = weights_like(want)
    (want * w).sum().backward()
    (got * w).sum().backward()
    assert_close(x_b.grad, x_e.grad, GRAD_TOL)
    assert_grads_close(param_grads(batched), param_grads(eager))


# ---------------------------------------------------------------------------
# 4. control flow diverging between instances, inside recompile.vmap(in_dims=0)
# ---------------------------------------------------------------------------

def cf_if(x):
    if x[0] > 0:
        y = torch.tanh(x) * 2
    elif x[1] > 0:
        y = torch.sigmoid(x)
    else:
        y = -x
    return y + x


def cf_while_count(x, n):
    i = 0
    acc = x
    while i < n:
        acc = acc * 0.9 + torch.sin(acc)
        i += 1
    return acc


def cf_while_data(x):
    """Iterates until a data-dependent condition holds: each instance its own number of steps."""
    acc = x
    steps = 0
    while acc.abs().sum() < 10.0:
        acc = acc * 1.5 + 0.1
        steps += 1
    return acc, acc.sum() * 0 + steps


def cf_for_range(x, n):
    acc = x
    for k in range(n):
        if k == 1:
            continue
        acc = acc + k * torch.tanh(acc)
        if acc.sum() > 4.0:
            break
    return acc


def cf_early_return(x, n):
    acc = x
    k = 0
    while k < n:
        acc = torch.cos(acc) + acc * 0.5
        if acc.max() > 1.2:
            return acc * 10
        k += 1
    if acc.sum() < 0:
        return acc - 1
    return torch.exp(-acc)


def cf_nested(x, n, m):
    acc = x
    for i in range(n):
        j = 0
        while j < m:
            if acc.sum() > 2 and j > i:
                break
            acc = acc * 0.9 + 0.1 * i
            j += 1
        else:
            acc = acc + 1
    return acc


def cf_fan(x, n):
    """Recursion inside a loop whose trip count is per instance."""
    acc = torch.tanh(x)
    k = 0
    while k < n:
        acc = acc + 0.5 * cf_fan(acc * 0.3, k)
        if acc.sum() > 3.0:
            return acc * 0.1
        k += 1
    return acc


def cf_even(x, n):
    if n == 0:
        return x
    return cf_odd(x * 1.1, n - 1)


def cf_odd(x, n):
    if n == 0:
        return -x
    return cf_even(torch.sin(x), n - 1)


def cf_for_tensor(x):
    acc = x[0] * 0
    for v in x:  # over each instance's own tensor
        if v > 0:
            acc = acc + v
        else:
            acc = acc * 0.5
    return acc


def cf_ternary_logic(x):
    y = torch.tanh(x) if x.sum() > 0 else torch.sigmoid(x)
    if 0 < x[0] < 1 or x[1] > 1.5:
        y = y * 3
    if not (x[2] > 0 and x[0] < 0):
        y = y - 1
    return y


def cf_tuple_state(x, n):
    """A loop carrying a tuple, left by the instances at different iterations."""
    state = (x, x * 0)
    k = 0
    while k < n:
        h, c = state
        state = (torch.tanh(h + c), c + h * 0.5)
        k += 1
    return state[0] + state[1]


def cf_default(x, scale=2.0, *, shift=1):
    return x * scale + shift


def cf_calls_default(x):
    if x.sum() > 0:
        return cf_default(x)
    return cf_default(x, 3.0, shift=-1)


def cf_python_values(x):
    """Dicts, f-strings, isinstance/len/max/abs/min/float on per-instance values."""
    assert x.abs().sum() < 100, f"too big: {x.sum():.2f}"
    d = {"h": torch.tanh(x), "n": 2}
    if isinstance(d["h"], torch.Tensor) and len(d) == 2:
        y = d["h"] * d["n"]
    else:
        y = x
    name = f"v{int(x[0] > 0)}"
    if name == "v1":
        y = y + 1
    s = {"a": y}
    s["b"] = y * 2
    return s["a"] + s["b"] + max(x[1], x[2]) + abs(x[0]) + min(float(x[0]), 0.5)


CONTROL = {
    "if": (cf_if, 1, ()),
    "python_values": (cf_python_values, 1, ()),
    "for_over_tensor": (cf_for_tensor, 1, ()),
    "ternary_chained_and_or_not": (cf_ternary_logic, 1, ()),
    "loop_carrying_tuple": (cf_tuple_state, 2, ()),
    "call_with_defaults_and_keywords": (cf_calls_default, 1, ("cf_default",)),
    "while_count": (cf_while_count, 2, ()),
    "while_data": (cf_while_data, 1, ()),
    "for_range_break_continue": (cf_for_range, 2, ()),
    "early_return": (cf_early_return, 2, ()),
    "nested_loops": (cf_nested, 3, ()),
    "recursion_in_loop": (cf_fan, 2, ("cf_fan",)),
    "mutual_recursion": (cf_even, 2, ("cf_even", "cf_odd")),
}
COMPILED = {mode: {name: recompile.function(G[name], mode=mode)
                   for name in ("cf_if", "cf_python_values", "cf_for_tensor", "cf_ternary_logic", "cf_tuple_state", "cf_default",
                                "cf_calls_default", "cf_while_count", "cf_while_data", "cf_for_range", "cf_early_return",
                                "cf_nested", "cf_fan", "cf_even", "cf_odd")}
            for mode in ("batched", "sequential")}


def control_inputs(arity):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 3, generator=gen, dtype=F64)
    counts = [torch.tensor([0, 1, 2, 5, 3, 4, 1, 2]), torch.tensor([3, 0, 2, 5, 1, 4, 2, 0])]
    return [x] + counts[:arity - 1]


@pytest.mark.parametrize("case", list(CONTROL))
def test_control_flow_vmap(case):
    fn, arity, recursive = CONTROL[case]
    inputs = control_inputs(arity)
    n = inputs[0].shape[0]
    x_e = inputs[0].clone().requires_grad_(True)
    want = stack_results([fn(x_e[k], *[a[k] for a in inputs[1:]]) for k in range(n)])
    for mode in ("batched", "sequential"):
        compiled = COMPILED[mode]
        x = inputs[0].clone().requires_grad_(True)
        with bound_globals(G, {name: compiled[name] for name in recursive}):
            cf = compiled[fn.__name__]
            if mode == "batched":
                got = recompile.vmap(cf, in_dims=0)(x, *inputs[1:])
                single = stack_results([cf(inputs[0][k], *[a[k] for a in inputs[1:]]) for k in range(n)])
                assert_close(single, want.detach() if isinstance(want, torch.Tensor) else
                             type(want)(w.detach() for w in want))
            else:
                got = stack_results([cf(x[k], *[a[k] for a in inputs[1:]]) for k in range(n)])
        assert_close(got, want)
        w = weights_like(want)
        gx, = torch.autograd.grad(scalar(got, w), x)
        gx_want, = torch.autograd.grad(scalar(want, w), x_e, retain_graph=True)
        assert_close(gx, gx_want, GRAD_TOL)


def test_control_flow_instances_take_different_paths():
    """Sanity: the inputs make instances diverge (different branches and trip counts)."""
    x, n, _ = control_inputs(3)
    assert len({bool(r[0] > 0) for r in x}) == 2
    steps = [int(cf_while_data(r)[1]) for r in x]
    assert len(set(steps)) >= 3, steps
    assert len(set(n.tolist())) >= 4


def test_vmap_over_tuple_argument():
    cf = recompile.function(tuple_state_step)
    gen = torch.Generator().manual_seed(3)
    h, c, x = (torch.randn(5, 4, generator=gen, dtype=F64) for _ in range(3))
    got = recompile.vmap(cf, in_dims=(0, 0))((h, c), x)
    want = stack_results([tuple_state_step((h[k], c[k]), x[k]) for k in range(5)])
    assert_close(got, want)


def walk_with_depth(left, xs, i, depth=0, scale=1.0):
    if left[i] < 0:
        return xs[i] * (depth + scale)
    return walk_with_depth(left, xs, left[i], depth + 1) + walk_with_depth(left, xs, left[i] + 1, depth + 1)


def test_vmap_of_a_function_with_defaults_binds_them_as_a_call_does():
    """Parameters left out take their defaults (a recursion's ``depth=0``): the level program and every piece
    are given every parameter, as a plain call binds them."""
    cf = recompile.function(walk_with_depth)
    left, xs = torch.tensor([1, 3, -1, -1, -1]), torch.arange(5.0, dtype=F64)
    roots = torch.tensor([0, 1, 2])
    want = torch.stack([walk_with_depth(left, xs, int(r)) for r in roots])
    assert_close(recompile.vmap(cf, in_dims=(None, None, 0))(left, xs, roots), want)
    want = torch.stack([walk_with_depth(left, xs, int(r), 2) for r in roots])
    assert_close(recompile.vmap(cf, in_dims=(None, None, 0, None))(left, xs, roots, 2), want)


def tuple_state_step(state, x):
    h, c = state
    if x.sum() > 0:
        c = c + torch.tanh(x)
    return torch.tanh(c) * h, c


def cf_pred_of(p, x):
    if p:  # a per-instance tensor of any dtype: true where bool() of it is
        return x * 2
    return x - 1


@pytest.mark.parametrize("pred", [
    torch.tensor([0.0, -0.0, 0.5, float("nan"), -2.0, 0.0]),  # (NaN is true, -0.0 false)
    torch.tensor([0, 3, -1, 0, 0, 7]),
    torch.tensor([True, False, True, True, False, False]),
    torch.tensor([[0.0], [1.0], [0.0], [2.0], [0.0], [0.0]]),  # one element of rank 1 per instance
    torch.zeros(6), torch.ones(6, dtype=torch.int64),  # every instance on one side
], ids=["float", "int", "bool", "rank1", "all_false", "all_true"])
def test_cond_splits_a_tensor_predicate_as_bool_would(pred):
    """The batched Cond splits a tensor predicate on its device (nonzero), not through Python bools."""
    cf = recompile.function(cf_pred_of)
    x = torch.arange(12, dtype=F64).view(6, 2).requires_grad_(True)
    got = recompile.vmap(cf)(pred, x)
    want = torch.stack([cf_pred_of(pred[k], x[k]) for k in range(6)])
    assert_close(got, want)
    gx, = torch.autograd.grad(got.pow(2).sum(), x)
    gx_want, = torch.autograd.grad(want.pow(2).sum(), x)
    assert_close(gx, gx_want, GRAD_TOL)


def cf_countdown(n, x):
    while n:  # an int tensor: instances leave the loop at different iterations
        x = x * 2 + 1
        n = n - 1
    return x


def test_while_on_an_int_predicate():
    cf = recompile.function(cf_countdown)
    n = torch.tensor([0, 3, 1, 2, 3])
    x = torch.arange(10, dtype=F64).view(5, 2)
    want = torch.stack([cf_countdown(n[k], x[k]) for k in range(5)])
    assert_close(recompile.vmap(cf)(n, x), want)


def pick(table, i):
    return table[i] * 2


def test_gather_with_negative_and_out_of_range_indices():
    """A shared table indexed by a batched index is one gather; negative indices wrap as in Python,
    and an index out of range raises IndexError, as it does one instance at a time."""
    cf = recompile.function(pick)
    table = torch.arange(5, dtype=F64) * 10
    i = torch.tensor([-1, 0, 2, -5, 4])
    assert_close(recompile.vmap(cf, in_dims=(None, 0))(table, i), table[i] * 2)
    with pytest.raises(IndexError):
        pick(table, torch.tensor(5))
    with pytest.raises(IndexError):
        recompile.vmap(cf, in_dims=(None, 0))(table, torch.tensor([0, 5, 1]))


def apply_layer(layer, x):
    return layer(x)


def test_linear_module_keeps_hooks_and_instance_forward():
    """An nn.Linear runs as F.linear on the batch, unless a hook or an instance's own forward says
    otherwise: then the module is called as it would be."""
    cf = recompile.function(apply_layer)
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=F64)
    plain = nn.Linear(3, 2).double()
    assert_close(recompile.vmap(cf, in_dims=(None, 0))(plain, x), plain(x))
    hooked = nn.Linear(3, 2).double()
    hooked.register_forward_hook(lambda module, inputs, out: out * 3)
    assert_close(recompile.vmap(cf, in_dims=(None, 0))(hooked, x),
                 torch.stack([hooked(x[k]) for k in range(4)]))
    own = nn.Linear(3, 2).double()
    own.forward = lambda v: v.sum(-1, keepdim=True) + 100
    assert_close(recompile.vmap(cf, in_dims=(None, 0))(own, x), torch.stack([own(x[k]) for k in range(4)]))


# ---------------------------------------------------------------------------
# 5. stats: the SST Tree-LSTM of examples/tree_lstm.py over a minibatch
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sst():
    return load_sst(sample_dir(), splits=("train",))


def encode_units(stats):
    names = [name for name in stats["batches"] if name.startswith(TreeLSTM.encode.ir_name + ".")]
    then = [name for name in names if name.endswith(".then")]
    other = [name for name in names if name.endswith(".else")]
    assert len(then) == 1 and len(other) == 1, names
    return then[0], other[0]


@pytest.mark.parametrize("size", [1, 5, 25])
def test_sst_minibatch_stats(sst, size):
    trees = sst.train[:size]
    forest = Forest.from_trees(trees)
    torch.manual_seed(0)
    model = TreeLSTM(len(sst.vocab), embed=8, hidden=6)
    TreeLSTM.encode.stats.reset()
    h, c, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    assert h.shape == (size, 6) and loss.shape == (size,)
    stats = TreeLSTM.encode.stats
    then, other = encode_units(stats)
    leaves = int(forest.is_leaf.sum())
    assert stats["batches"][then] == {"runs": 1, "instances": leaves, "mean_batch": float(leaves)}
    assert stats["batches"][other]["runs"] == max(tree.height for tree in trees)
    assert stats["batches"][other]["instances"] == forest.num_nodes - leaves
    assert stats["per_instance"] == {}
    assert stats["compute_s"] > 0 and stats["scheduling_s"] >= 0
    # the per-node loss (a call whose result is only returned) is deferred and runs for many levels at
    # once: a frame of one instance needs its children's losses as plain values, which runs the
    # deferred calls issued so far (a single tree has several such levels; 25 trees have none)
    node_loss = stats["batches"]["SentimentModel.node_loss"]
    assert node_loss["instances"] == forest.num_nodes
    assert node_loss["runs"] <= {1: 6, 5: 2, 25: 1}[size] < max(tree.height for tree in trees)


def test_sst_stats_reset_and_accumulate(sst):
    trees = sst.train[5:13]
    forest = Forest.from_trees(trees)
    model = TreeLSTM(len(sst.vocab), embed=8, hidden=6)
    TreeLSTM.encode.stats.reset()
    builds = TreeLSTM.encode.stats["builds"]
    with torch.no_grad():
        for _ in range(2):
            recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    stats = TreeLSTM.encode.stats
    then, other = encode_units(stats)
    assert stats["calls"] == 2 and stats["builds"] == builds
    assert stats["batches"][then]["runs"] == 2
    assert stats["batches"][other]["runs"] == 2 * max(t.height for t in trees)
    TreeLSTM.encode.stats.reset()
    assert TreeLSTM.encode.stats["calls"] == 0 and TreeLSTM.encode.stats["builds"] == builds
    assert not TreeLSTM.encode.stats.get("batches")


def eager_tree_lstm():
    plain = {}
    for klass in reversed(TreeLSTM.__mro__):
        plain.update({name: attr.python for name, attr in vars(klass).items()
                      if isinstance(attr, recompile.CompiledFunction)})
    return type("EagerTreeLSTM", (TreeLSTM,), plain)


def test_sst_minibatch_values_and_grads(sst):
    trees = sst.train[:10]
    forest = Forest.from_trees(trees)
    torch.manual_seed(0)
    model = TreeLSTM(len(sst.vocab), embed=8, hidden=6).double()
    eager = eager_tree_lstm()(len(sst.vocab), embed=8, hidden=6).double()
    eager.load_state_dict(model.state_dict())
    want, want_g = run_with_grads(eager, lambda m: stack_results([m.encode(t, t.root) for t in trees]))
    got, got_g = run_with_grads(model, lambda m: recompile.vmap(m.encode, in_dims=(None, 0))(forest, forest.roots))
    assert_close(got, want)
    assert_grads_close(got_g, want_g)


# ---------------------------------------------------------------------------
# 6. ops without a batch rule
# ---------------------------------------------------------------------------

def plain_helper(v):
    """An undecorated Python helper: compiled for the group (runtime.helpers), or with COMPILE_HELPERS off run
    once per instance."""
    return v * v.sum() + v.flip(0)


def uses_helper(x):
    if x[0] > 0:
        return plain_helper(torch.tanh(x)) + 1
    return x * 2


def uses_det(m):
    return torch.linalg.det(m) * m.sum()


def uses_nonzero(x):
    # torch.nonzero has a data-dependent shape: torch.func.vmap cannot batch it
    return torch.nonzero(x > 0).double().mean() + x.sum()


def nonzero_rows(x):
    idx = torch.nonzero(x > 0)
    return idx.trace() + x.sum()  # (``trace`` of each instance's own rows: a method no rule batches)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "per_instance"])
def test_python_helper_is_compiled_for_the_group_or_runs_per_instance_and_is_counted(compiled, monkeypatch):
    """An undecorated helper of per-instance values is compiled and run once for the instances calling it;
    with ``config.COMPILE_HELPERS`` off it runs once per instance, counted. Values and gradients as eager's."""
    monkeypatch.setattr(config, "COMPILE_HELPERS", compiled)
    cf = recompile.function(uses_helper)
    x = torch.tensor([[1., 2, 3], [-1, 2, 0], [2, -1, 1], [0.5, 0.5, 0.5], [-2, 1, 1]], dtype=F64)
    x_b = x.clone().requires_grad_(True)
    x_e = x.clone().requires_grad_(True)
    got = recompile.vmap(cf)(x_b)
    want = torch.stack([uses_helper(r) for r in x_e])
    assert_close(got, want)
    g_b, = torch.autograd.grad(got.sum(), x_b)
    g_e, = torch.autograd.grad(want.sum(), x_e)
    assert_close(g_b, g_e, GRAD_TOL)
    counted = {name: n for name, n in cf.stats["per_instance"].items() if name.endswith("plain_helper")}
    assert list(counted.values()) == ([] if compiled else [3])  # (the three instances with x[0] > 0)
    cf.stats.reset()
    cf(x[0])  # one instance: nothing runs "per instance"
    assert cf.stats["per_instance"] == {}


def test_vmappable_torch_op_without_rule_is_batched():
    cf = recompile.function(uses_det)
    m = torch.randn(5, 3, 3, generator=torch.Generator().manual_seed(2), dtype=F64, requires_grad=True)
    got = recompile.vmap(cf)(m)
    want = torch.stack([uses_det(r) for r in m])
    assert_close(got, want)
    g_b, = torch.autograd.grad(got.sum(), m)
    g_e, = torch.autograd.grad(want.sum(), m)
    assert_close(g_b, g_e, GRAD_TOL)
    assert cf.stats["per_instance"] == {}


def test_unbatchable_torch_op_runs_per_instance():
    cf = recompile.function(uses_nonzero)
    x = torch.tensor([[0.1, 1.2, -1.3], [2., 2.1, -3], [-1., 0., 2.], [5., -5., 1.]], dtype=F64)
    got = recompile.vmap(cf)(x)
    want = torch.stack([uses_nonzero(r) for r in x])
    assert_close(got, want)
    assert cf.stats["per_instance"].get("torch.nonzero", cf.stats["per_instance"].get(
        "torch._VariableFunctionsClass.nonzero")) == 4, cf.stats["per_instance"]


def test_per_instance_method_call_is_named_by_the_method():
    """A method called on per-instance values (``idx.trace()`` where each instance's idx has its own shape)
    is counted under the method's name, not under recompile's internal Batch class."""
    cf = recompile.function(nonzero_rows)
    x = torch.tensor([[0.1, 1.2, -1.3], [2., 2.1, -3], [-1., 0., 2.], [5., -5., 1.]], dtype=F64)
    assert_close(recompile.vmap(cf)(x), torch.stack([nonzero_rows(r) for r in x]))
    names = set(cf.stats["per_instance"])
    assert not any("recompile.runtime" in name for name in names), names
    assert "Tensor.trace" in names, names


# ---------------------------------------------------------------------------
# 7. errors
# ---------------------------------------------------------------------------

BAD_WORD = vocab().lookup("w6", False)  # a word id


def checked_encode(self, tree, i):
    if tree.is_leaf[i]:
        if tree.words[i] == BAD_WORD:
            raise LookupError("bad word at a leaf")
        return torch.tanh(self.proj(self.embed(tree.words[i])))
    hl = self.encode(tree, tree.left[i])
    hr = self.encode(tree, tree.right[i])
    return torch.tanh(self.comb(torch.cat([hl, hr], dim=-1)))


class CheckedBatched(TreeParams):
    encode = recompile.function(checked_encode)


class CheckedEager(TreeParams):
    encode = checked_encode


def test_exception_inside_batched_recursion_reaches_caller_with_chain():
    v = vocab()
    good = [Tree.from_nested((1, (2, (0, "w1"), (1, "w2")), (3, "w3")), v),
            Tree.from_nested((0, (2, "w4"), (1, (2, "w5"), (3, "w0"))), v)]
    bad = Tree.from_nested((1, (2, (0, "w1"), (1, "w2")), (3, (4, "w6"), (0, "w3"))), v)
    assert bad.words.tolist().count(BAD_WORD) == 1 and all(BAD_WORD not in t.words.tolist() for t in good)
    torch.manual_seed(0)
    model = CheckedBatched().double()
    eager = CheckedEager().double()
    eager.load_state_dict(model.state_dict())
    forest = Forest.from_trees(good + [bad])
    for call in (lambda: model.encode(bad, bad.root),
                 lambda: recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)):
        with pytest.raises(LookupError, match="bad word at a leaf") as info:
            call()
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "recompile call chain" in notes
        assert "checked_encode" in notes and "test_batching.py" in notes
        # the traceback points at the user's line
        frames = [tb for tb in info.traceback if tb.path.name == "test_batching.py"]
        lines = [tb.statement.lines[0] if hasattr(tb.statement, "lines") else str(tb.statement) for tb in frames]
        assert any("raise LookupError" in str(line) for line in lines), lines
    # the function works again afterwards
    good_forest = Forest.from_trees(good)
    with torch.no_grad():
        got = recompile.vmap(model.encode, in_dims=(None, 0))(good_forest, good_forest.roots)
        want = torch.stack([eager.encode(t, t.root) for t in good])
        assert_close(got, want)
        assert_close(model.encode(good[0], good[0].root), eager.encode(good[0], good[0].root))


def index_per_instance(x, k):
    if x.sum() > 0:
        return x[k]
    return x[0]


def test_exception_in_one_instance_keeps_its_type():
    cf = recompile.function(index_per_instance)
    x = torch.ones(3, 2)
    with pytest.raises(IndexError) as info:
        recompile.vmap(cf)(x, torch.tensor([0, 5, 1]))
    assert "recompile call chain" in "\n".join(getattr(info.value, "__notes__", []))
    assert_close(recompile.vmap(cf)(x, torch.tensor([0, 1, 1])), torch.ones(3))


def assert_negative(x):
    assert x.sum() < 0, f"positive sum {x.sum().item():.2f}"
    return x


def test_assert_in_one_instance():
    """The first failing instance's message, as a loop over the instances would raise it."""
    cf = recompile.function(assert_negative)
    with pytest.raises(AssertionError, match="positive sum 3.50"):
        recompile.vmap(cf)(torch.tensor([[-1.0, -2], [1.5, 2], [3., 4]]))
    assert_close(recompile.vmap(cf)(torch.tensor([[-1.0, -2], [-1.5, 0]])), torch.tensor([[-1.0, -2], [-1.5, 0]]))


def tree_sum(left, right, value, i):
    if left[i] < 0:
        return value[i]
    return tree_sum(left, right, value, left[i]) + tree_sum(left, right, value, right[i])


def test_readme_tree_sum_on_python_lists():
    left, right = [1, 3, -1, -1, -1, 7, -1, -1, -1], [2, 4, 5, -1, -1, 8, -1, -1, -1]
    left[5], right[5] = 6, 7
    left[2], right[2] = 5, 8
    value = torch.arange(9, dtype=F64)
    want = tree_sum(left, right, value, 0)
    for mode in ("batched", "sequential"):
        cf = recompile.function(tree_sum, mode=mode)
        with bound_globals(G, {"tree_sum": cf}):
            assert_close(cf(left, right, value, 0), want)
            if mode == "batched":
                got = recompile.vmap(cf, in_dims=(None, None, None, 0))(left, right, value, torch.tensor([0, 1, 2, 5]))
                assert_close(got, torch.stack([tree_sum(left, right, value, i) for i in (0, 1, 2, 5)]))


def simple(x, k):
    return x * k


def test_vmap_misuse_errors():
    cf = recompile.function(simple)
    x = torch.ones(3, 2)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        recompile.vmap(cf, in_dims=(0, 0))(x, torch.ones(4))
    with pytest.raises(ValueError, match="at least one argument must be batched"):
        recompile.vmap(cf, in_dims=(None, None))(x, 2.0)
    with pytest.raises(TypeError, match="expects a function"):
        recompile.vmap(torch.tanh)
    with pytest.raises(TypeError, match="expects a function"):
        recompile.vmap(3)
    with pytest.raises(ValueError, match="in_dims has 1 entries for 2 positional arguments"):
        recompile.vmap(cf, in_dims=(0,))(x, 2.0)
    with pytest.raises(ValueError, match="mode='batched'"):
        recompile.vmap(recompile.function(simple, mode="sequential"))
    with pytest.raises(ValueError, match="must be a tensor or a tuple or list of tensors"):
        recompile.vmap(cf, in_dims=(0, 0))(x, 2.0)
    with pytest.raises(ValueError, match="0-d tensor"):
        recompile.vmap(cf, in_dims=(0, None))(torch.tensor(1.0), 2.0)
    with pytest.raises(TypeError, match="in_dims entries must be int or None"):
        recompile.vmap(cf, in_dims=("0", None))(x, 2.0)
    with pytest.raises(TypeError, match="out_dims must be an int"):
        recompile.vmap(cf, out_dims=(0,))
    with pytest.raises(ValueError, match="out_dims=2 is out of range for a result of 1 dims per instance"):
        recompile.vmap(cf, in_dims=(0, None), out_dims=2)(x, 2.0)
    with pytest.raises(TypeError):  # Python's own message for a wrong call
        recompile.vmap(cf, in_dims=(0, None, None))(x, 2.0, 3.0)
    # the function still works
    assert_close(recompile.vmap(cf, in_dims=(0, None))(x, 2.0), 2 * x)


def must_return_tensors(x):
    if x.sum() > 0:
        return 1
    return 2


def test_vmap_non_tensor_result_is_a_clear_error():
    cf = recompile.function(must_return_tensors)
    with pytest.raises(ValueError, match="must return tensors"):
        recompile.vmap(cf)(torch.tensor([[1.0], [-1.0]]))


def branchy_recursion(x, d):
    if d == 0:
        if x.sum() > 100:
            return x * 0
        return x
    return branchy_recursion(x * 2, d - 1) + branchy_recursion(x, d - 1)


def test_vmap_empty_batch():
    """A batch of 0 instances gives an empty result (as torch.func.vmap does) or a clear ValueError, not an
    error from inside the run."""
    cf = recompile.function(branchy_recursion)
    with bound_globals(G, {"branchy_recursion": cf}):
        try:
            out = recompile.vmap(cf, in_dims=(0, None))(torch.ones(0, 2), 2)
        except ValueError as exc:
            assert "recompile.vmap" in str(exc)
        else:
            assert out.shape == (0, 2)
        # and the function still works
        x = torch.ones(3, 2)
        assert_close(recompile.vmap(cf, in_dims=(0, None))(x, 2), 9 * x)


# ---------------------------------------------------------------------------
# 8. per-instance side effects and in-place updates
# ---------------------------------------------------------------------------

def collect_loop(x, n):
    outs = []
    i = 0
    while i < n:
        outs.append(x * (i + 1))
        i += 1
    total = x * 0
    for o in outs:
        total = total + o
    return total, total.sum() * 0 + len(outs)


def walk_append(node, x, acc):
    if node <= 1:
        acc.append(x)
        return x
    a = walk_append(node // 2, x * 0.5, acc)
    b = walk_append(node - 1, x + 1, acc)
    return a + b


def collect_recursive(x, n):
    acc = []
    r = walk_append(n, x, acc)
    return r + torch.stack(acc).sum(0), r.sum() * 0 + len(acc)


def fill(acc, x):
    acc.append(x)
    return x


def fill_two(x):
    left = []
    right = []
    y = x * 2
    fill(left, x)  # two independent calls: issued together, merged into one frame of 2 instances
    fill(right, y)
    return torch.stack(left + right).sum(0), x.sum() * 0 + len(left) + 10 * len(right)


def grow_list(x):
    xs = [x]
    xs.append(x * 2)
    return torch.stack(xs).sum(0), x.sum() * 0 + len(xs)


def set_item(x):
    xs = [x, x + 1]
    xs[0] = x * 10
    return torch.cat(xs, -1)


SIDE_EFFECTS = {
    "list_in_loop": (collect_loop, 2, ()),
    "list_through_recursion": (collect_recursive, 2, ("walk_append",)),
    "two_lists_grouped_calls": (fill_two, 1, ("fill",)),
    "append_to_list_of_batched": (grow_list, 1, ()),
    "setitem_in_list_of_batched": (set_item, 1, ()),
}
SIDE_COMPILED = {mode: {name: recompile.function(G[name], mode=mode)
                        for name in ("collect_loop", "walk_append", "collect_recursive", "fill", "fill_two",
                                     "grow_list", "set_item")}
                 for mode in ("batched", "sequential")}


@pytest.mark.parametrize("case", list(SIDE_EFFECTS))
def test_per_instance_side_effects(case):
    fn, arity, helpers = SIDE_EFFECTS[case]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 3, generator=gen, dtype=F64)
    n = torch.tensor([0, 1, 4, 2, 6]) if case == "list_in_loop" else torch.tensor([1, 2, 4, 2, 6])
    inputs = [x, n][:arity]
    want = stack_results([fn(*[a[k] for a in inputs]) for k in range(5)])
    for mode in ("sequential", "batched"):
        compiled = SIDE_COMPILED[mode]
        cf = compiled[fn.__name__]
        with bound_globals(G, {name: compiled[name] for name in helpers}):
            single = stack_results([cf(*[a[k] for a in inputs]) for k in range(5)])
            assert_close(single, want)
            if mode == "batched":
                got = recompile.vmap(cf, in_dims=0)(*inputs)
                assert_close(got, want)


def alias_across_cond(x):
    y = x * 1.0
    z = y
    if x.sum() > 0:
        y += 1
    return z


def alias_across_loop(x, n):
    y = x * 1.0
    ys = [y]
    i = 0
    while i < n:
        y += 1
        i += 1
    return ys[0]


def inplace_iadd(x):
    h = x * 2
    h += x.sum()
    return h


def inplace_method(x):
    h = x * 2
    h.add_(1)
    return h


def alias_changed_after_cond(x):
    y = x * 1.0
    z = y
    if x.sum() > 0:
        y += 1
    y += 10  # after the join: y is still z
    return z


@pytest.mark.parametrize("fn, arity", [(alias_across_cond, 1), (alias_across_loop, 2), (alias_changed_after_cond, 1),
                                       (inplace_iadd, 1), (inplace_method, 1)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_inplace_updates_seen_through_aliases(fn, arity):
    """``y += 1`` changes the tensor in place: every name bound to it sees the change (no_grad, where
    sequential mode runs in place too)."""
    x = torch.tensor([[1., 2], [3, 4], [-5, -6], [7, 8], [0.5, 0.5]], dtype=F64)
    n = torch.tensor([1, 3, 3, 2, 0])
    inputs = [x, n][:arity]
    with torch.no_grad():
        want = torch.stack([fn(*[a.clone()[k] for a in inputs]) for k in range(5)])
        for mode in ("sequential", "batched"):
            cf = recompile.function(fn, mode=mode)
            single = torch.stack([cf(*[a.clone()[k] for a in inputs]) for k in range(5)])
            assert_close(single, want)
        got = recompile.vmap(recompile.function(fn), in_dims=0)(*[a.clone() for a in inputs])
        assert_close(got, want)


def subtract_into(d, a, b):
    if d:
        b -= a
    return a * 1


def aliased_in_one_branch(s, x, y):
    if s > 0:
        return subtract_into(True, x, x)  # a and b one tensor: b -= a zeroes a too
    return subtract_into(True, x, y)


@pytest.mark.parametrize("grad", [False, True])
def test_requests_that_alias_differently_are_not_merged(grad):
    """The calls of both branches reach one pending group of ``subtract_into``. Arguments are gathered per
    name, so merging ``(x, x)`` with ``(x, y)`` would give ``b -= a`` a copy of ``a``: they run apart."""
    x = torch.tensor([[1., 2], [3, 4], [5, 6]], dtype=F64)
    y, s = torch.ones(3, 2, dtype=F64), torch.tensor([1, -1, 1])
    xs = [x[k].clone().requires_grad_(grad) for k in range(3)]
    want = torch.stack([aliased_in_one_branch(s[k], xs[k] * 1, y[k].clone()) for k in range(3)])
    with bound_globals(G, {"subtract_into": recompile.function(subtract_into)}):
        xb = x.clone().requires_grad_(grad)
        got = recompile.vmap(recompile.function(aliased_in_one_branch))(s, xb * 1, y.clone())
    assert_close(got, want)
    if grad:
        w = torch.arange(6, dtype=F64).view(3, 2)
        assert_close(torch.autograd.grad((got * w).sum(), xb)[0],
                     torch.stack(torch.autograd.grad((want * w).sum(), xs)))


@pytest.mark.parametrize("fn", [inplace_iadd, inplace_method], ids=lambda f: f.__name__)
def test_inplace_updates_with_grad(fn):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    x_e = x.clone().requires_grad_(True)
    x_b = x.clone().requires_grad_(True)
    want = torch.stack([fn(r) for r in x_e])
    got = recompile.vmap(recompile.function(fn))(x_b)
    assert_close(got, want)
    g_e, = torch.autograd.grad(want.sum(), x_e)
    g_b, = torch.autograd.grad(got.sum(), x_b)
    assert_close(g_b, g_e, GRAD_TOL)


# ---------------------------------------------------------------------------
# 9. impure code reached with the same (shared) arguments by several instances of one frame
# ---------------------------------------------------------------------------

def record(log, value):
    """An undecorated helper with a side effect (the caller does not read ``log`` between its calls)."""
    log.append(value)


def count_with_helper(tree, i, log):
    if tree.is_leaf[i]:
        record(log, 1)
        return 1
    return count_with_helper(tree, tree.left[i], log) + count_with_helper(tree, tree.right[i], log)


def random_leaves(tree, i):
    if tree.is_leaf[i]:
        return [random.random()]
    return random_leaves(tree, tree.left[i]) + random_leaves(tree, tree.right[i])


@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_helper_side_effect_runs_once_per_instance(mode):
    """Python semantics: the helper runs at every leaf, even where the leaves of one call are merged into
    one frame and the helper's arguments are the same for all of them."""
    tree = make_tree("balanced3")
    cf = recompile.function(count_with_helper, mode=mode)
    log = []
    with bound_globals(G, {"count_with_helper": cf}):
        assert cf(tree, tree.root, log) == 8
    assert len(log) == 8


@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_random_draws_are_per_instance(mode):
    """``random.random()`` at each leaf draws its own number, as eager code does."""
    tree = make_tree("balanced3")
    cf = recompile.function(random_leaves, mode=mode)
    random.seed(0)
    with bound_globals(G, {"random_leaves": cf}):
        draws = cf(tree, tree.root)
    assert len(draws) == 8
    assert len(set(draws)) == 8, draws


# ---------------------------------------------------------------------------
# 9. deferred calls
# ---------------------------------------------------------------------------

def node_score(self, h, label):
    return F.cross_entropy(self.out(h).unsqueeze(0), label.unsqueeze(0), reduction="sum")


def rnn_loss_encode(self, tree, i):
    """Tree-RNN with a per-node loss from a compiled helper, whose result is only returned."""
    if tree.is_leaf[i]:
        h = torch.tanh(self.proj(self.embed(tree.words[i])))
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        h = torch.tanh(self.comb(torch.cat([hl, hr], dim=-1)))
        loss = loss_l + loss_r
    return h, loss + self.score(h, tree.labels[i])


def rnn_loss_models(seed=0):
    """(eager, batched, sequential) Tree-RNNs with ``score`` as a compiled helper."""
    torch.manual_seed(seed)
    made = []
    for name, wrap in (("Eager", lambda f: f), ("Batched", recompile.function),
                       ("Sequential", lambda f: recompile.function(f, mode="sequential"))):
        cls = type(name + "LossRNN", (TreeParams,), {"encode": wrap(rnn_loss_encode), "score": wrap(node_score)})
        made.append(cls().double())
    for m in made[1:]:
        m.load_state_dict(made[0].state_dict())
    return made


def test_deferred_per_node_loss_runs_once_and_matches_eager():
    trees = [make_tree(s) for s in ("balanced3", "random12", "random7", "random20")]
    forest = Forest.from_trees(trees)
    eager, batched, _ = rnn_loss_models()
    want, want_g = run_with_grads(eager, lambda m: stack_results([m.encode(t, t.root) for t in trees]))
    type(batched).encode.stats.reset()
    got, got_g = run_with_grads(batched, lambda m: recompile.vmap(m.encode, in_dims=(None, 0))(forest, forest.roots))
    assert_close(got, want)
    assert_grads_close(got_g, want_g)
    batches = type(batched).encode.stats["batches"]
    assert batches["node_score"]["instances"] == forest.num_nodes
    # fewer runs than levels: a level whose frame has one instance reads its children's losses
    assert batches["node_score"]["runs"] < batches["rnn_loss_encode"]["runs"], batches
    balanced = Forest.from_trees([make_tree("balanced3")] * 3)  # no level of one instance: one run
    type(batched).encode.stats.reset()
    recompile.vmap(batched.encode, in_dims=(None, 0))(balanced, balanced.roots)
    assert type(batched).encode.stats["batches"]["node_score"] == {
        "runs": 1, "instances": balanced.num_nodes, "mean_batch": float(balanced.num_nodes)}


def test_deferred_loss_along_a_3000_deep_tree():
    """The lazy sums of a 3000-deep tree are computed without Python recursion."""
    deep = Tree.from_nested(linear_nested(3000), vocab())
    trees = [deep, make_tree("balanced3")]
    forest = Forest.from_trees(trees)
    _, batched, seq = rnn_loss_models(seed=1)
    want, want_g = run_with_grads(seq, lambda m: stack_results([m.encode(t, t.root) for t in trees]))
    got, got_g = run_with_grads(batched, lambda m: recompile.vmap(m.encode, in_dims=(None, 0))(forest, forest.roots))
    assert_close(got, want)
    assert_grads_close(got_g, want_g)


def checked_score(self, h, label):
    assert h.abs().sum() < 1e6, "score of a huge state"
    return (self.out(h) * 0).sum() + label * 1.0


def scaled_rnn_encode(self, tree, i):
    if tree.is_leaf[i]:
        h = self.embed(tree.words[i]) * self.scale
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        h = (hl + hr) * self.scale
        loss = loss_l + loss_r
    return h, loss + self.score(h, tree.labels[i])


def scaled_gated_encode(self, tree, i):
    if tree.is_leaf[i]:
        h = self.embed(tree.words[i]) * self.scale
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        if loss_l > loss_r:  # reads the children's deferred losses in this frame
            h = (hl + hr) * self.scale
        else:
            h = (hr + hl) * self.scale
        loss = loss_l + loss_r
    return h, loss + self.score(h, tree.labels[i])


class ScaledRNN(nn.Module):
    score = recompile.function(checked_score)

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(len(WORDS) + 1, 4)
        self.out = nn.Linear(4, 2)
        self.scale = 1.0


SCALED = {"returned": type("ReturnedScaled", (ScaledRNN,), {"encode": recompile.function(scaled_rnn_encode)}),
          "read_in_frame": type("GatedScaled", (ScaledRNN,), {"encode": recompile.function(scaled_gated_encode)})}


@pytest.mark.parametrize("where", list(SCALED))
def test_error_in_a_deferred_call_keeps_its_type_and_names_its_chain(where):
    """The deferred call fails when its group runs: at the end of the call, or inside the frame that
    reads its result; either way with its own type, message and one call chain."""
    trees = [make_tree("balanced3"), make_tree("random7")]
    forest = Forest.from_trees(trees)
    model = SCALED[where]()
    recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)  # fine at scale 1
    model.scale = 1e4  # the deepest levels' states pass the check, the upper ones do not
    with pytest.raises(AssertionError, match="score of a huge state") as info:
        recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    notes = [n for n in getattr(info.value, "__notes__", []) if "recompile call chain" in n]
    assert len(notes) == 1, notes
    assert "checked_score" in notes[0], notes[0]


def gated_rnn_encode(self, tree, i):
    """The children's losses decide a branch: a deferred result read by the frame that gets it."""
    if tree.is_leaf[i]:
        h = self.embed(tree.words[i])
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        if loss_l > loss_r:
            h = hl - hr
        else:
            h = hr * 0.5
        loss = loss_l + loss_r
    return h, loss + self.score(h, tree.labels[i])


def square_score(self, h, label):
    return (self.out(h) ** 2).sum() + label


def test_deferred_result_read_early_gives_the_same_values():
    trees = [make_tree(s) for s in ("balanced3", "random12", "random20")]
    forest = Forest.from_trees(trees)
    torch.manual_seed(3)
    params = nn.ModuleDict({"embed": nn.Embedding(len(WORDS) + 1, 3), "out": nn.Linear(3, 2)}).double()
    eager_cls = type("EagerGated", (nn.Module,), {"encode": gated_rnn_encode, "score": square_score})
    batched_cls = type("BatchedGated", (nn.Module,), {"encode": recompile.function(gated_rnn_encode),
                                                      "score": recompile.function(square_score)})
    models = []
    for cls in (eager_cls, batched_cls):
        m = cls()
        m.embed, m.out = params["embed"], params["out"]
        models.append(m)
    eager, batched = models
    want = stack_results([eager.encode(t, t.root) for t in trees])
    got = recompile.vmap(batched.encode, in_dims=(None, 0))(forest, forest.roots)
    assert_close(got, want)
    assert batched_cls.encode.stats["batches"]["square_score"]["runs"] > 1  # read level by level


def bump(t):
    t.add_(1.0)  # an undecorated helper: recompile takes it as not changing what its caller reads


def scored_pair(x):
    y = x * 2
    return y, total(y)


def total(y):
    return (y * y).sum()


def bumping_caller(x):
    y, s = scored_pair(x)
    bump(y)
    return y, s


def test_in_place_change_to_a_deferred_calls_argument_raises():
    """A deferred call reads its arguments when it runs: one changed in place since it was issued is
    refused with an error naming the call, not computed with the changed value."""
    funcs = {name: recompile.function(G[name]) for name in ("scored_pair", "total", "bumping_caller")}
    x = torch.arange(6, dtype=F64).view(3, 2)
    with bound_globals(G, funcs):
        with pytest.raises(RuntimeError, match="changed in place after the call was issued"):
            recompile.vmap(funcs["bumping_caller"])(x)
        got = recompile.vmap(funcs["scored_pair"])(x)  # nothing changes it: deferred and correct
    assert_close(got, (x * 2, (x * 2).pow(2).sum(1)))


def twice_leaf(x):
    return x * 2


def changes_child_result(x):
    a = twice_leaf(x)
    b = twice_leaf(x + 1)
    a.add_(1.0)  # in place on a call's result: the program changes state, so results are cut by slices
    return a * b


def test_in_place_change_to_a_call_result_with_gradients():
    funcs = {name: recompile.function(G[name]) for name in ("twice_leaf", "changes_child_result")}
    x = torch.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
    want = changes_child_result(x)
    gx_want, = torch.autograd.grad(want.sum(), x)
    with bound_globals(G, funcs):
        got = funcs["changes_child_result"](x)
        gx, = torch.autograd.grad(got.sum(), x)
        xs = torch.stack([x.detach(), x.detach() + 3]).requires_grad_(True)
        got_v = recompile.vmap(funcs["changes_child_result"])(xs)
    assert_close(got, want)
    assert_close(gx, gx_want, GRAD_TOL)
    assert_close(got_v, torch.stack([changes_child_result(r) for r in xs.detach()]))


def sq_score(h):
    return (h * h).sum()


def enc_reads_deferred(h, d):
    if d > 0:
        a, la = enc_reads_deferred(h * 0.5, d - 1)
        b, lb = enc_reads_deferred(h + 1.0, d - 1)
        w = sq_score(la)  # an argument computed from deferred results, to the deferred call's own function
        h2 = torch.tanh(a + b) * w
        return h2, la + lb + sq_score(h2 + lb)
    return torch.sin(h), sq_score(h)


def test_a_call_whose_argument_waits_on_a_deferred_call_of_the_same_function():
    funcs = {name: recompile.function(G[name]) for name in ("sq_score", "enc_reads_deferred")}
    h = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(8))
    want = stack_results([enc_reads_deferred(r, 2) for r in h])
    with bound_globals(G, funcs):
        got = recompile.vmap(funcs["enc_reads_deferred"], in_dims=(0, None))(h, 2)
        single = funcs["enc_reads_deferred"](h[0], 2)
    assert_close(got, want)
    assert_close(single, tuple(w[0] for w in want))


def returns_score(x):
    y = x * 2
    return y, sq_score(x)


def changes_after_deferral(x):
    y, s = returns_score(x)
    t = s + y
    y.add_(100.0)  # visible to the effects analysis: nothing in this run is deferred
    return t


def test_a_program_that_changes_state_defers_nothing():
    funcs = {name: recompile.function(G[name]) for name in ("sq_score", "returns_score", "changes_after_deferral")}
    x = torch.arange(6, dtype=F64).view(3, 2)
    want = torch.stack([changes_after_deferral(r.clone()) for r in x])
    with bound_globals(G, funcs):
        funcs["changes_after_deferral"].stats.reset()
        got = recompile.vmap(funcs["changes_after_deferral"])(x.clone())
        assert funcs["changes_after_deferral"].callee(None).may_mutate
    assert_close(got, want)


def tanh_twice(h):
    return torch.tanh(h) * 2


def same_batch_twice(h):
    return tanh_twice(h) + torch.cat([tanh_twice(h)], -1)


def test_the_same_batch_passed_to_two_calls_of_one_function():
    funcs = {name: recompile.function(G[name]) for name in ("tanh_twice", "same_batch_twice")}
    h = torch.randn(3, 2, dtype=F64, generator=torch.Generator().manual_seed(9))
    with bound_globals(G, funcs):
        got = recompile.vmap(funcs["same_batch_twice"])(h)
    assert_close(got, torch.stack([same_batch_twice(r) for r in h]))


def row_score(h):
    return (h * h).sum(-1)


def bias_score(h, b):
    return row_score(h) + b  # (2,) + (5,): a broadcasting error, in arithmetic on a deferred result


def test_error_in_arithmetic_on_a_deferred_result_names_a_chain():
    funcs = {name: recompile.function(G[name]) for name in ("row_score", "bias_score")}
    with bound_globals(G, funcs), pytest.raises(RuntimeError, match="must match") as info:
        recompile.vmap(funcs["bias_score"], in_dims=(0, None))(torch.randn(3, 2, 3), torch.randn(5))
    notes = [n for n in getattr(info.value, "__notes__", []) if "recompile call chain" in n]
    assert len(notes) == 1 and "bias_score" in notes[0], notes


def fails_deep(x, d):
    if d > 0:
        return fails_deep(x, d - 1) + 1.0
    assert x.sum() < 0, "inner failed"
    return x


def plain_helper_calls(x):
    return fails_deep(x, 2)


def outer_of_plain(x, d):
    if d > 0:
        return outer_of_plain(x, d - 1) * 2.0
    return plain_helper_calls(x)


def test_nested_runs_each_name_their_chain():
    """A compiled function called from plain code inside another compiled call: both chains are named."""
    funcs = {name: recompile.function(G[name]) for name in ("fails_deep", "outer_of_plain")}
    with bound_globals(G, funcs), pytest.raises(AssertionError, match="inner failed") as info:
        funcs["outer_of_plain"](torch.ones(2), 2)
    notes = [n for n in getattr(info.value, "__notes__", []) if "recompile call chain" in n]
    assert len(notes) == 2 and "fails_deep" in notes[0] and "outer_of_plain" in notes[1], notes


def log_call(log, name):
    log.append(name)


def logged_score(x, log):
    log_call(log, "score")
    return x.sum()


def logs_around_unused_call(x, log):
    logged_score(x, log)  # result unused: a call made for what it does keeps its place
    log_call(log, "after")
    return x * 2


def test_a_call_whose_result_is_unused_is_not_deferred():
    funcs = {name: recompile.function(G[name]) for name in ("logged_score", "logs_around_unused_call")}
    log = []
    with bound_globals(G, funcs):
        recompile.vmap(funcs["logs_around_unused_call"], in_dims=(0, None))(torch.ones(2, 3), log)
    assert log == ["score", "score", "after", "after"]


def leaf_sq(h):
    return (h * h).sum()


def adds_into_child_loss(tree, i, E):
    if tree.is_leaf[i]:
        h = torch.tanh(E[tree.words[i]])
        return h, leaf_sq(h)
    a, la = adds_into_child_loss(tree, tree.left[i], E)
    b, lb = adds_into_child_loss(tree, tree.right[i], E)
    t0 = la
    t0 += leaf_sq(b)  # in place on the child's result, as eager code may do
    return torch.tanh(a + b), t0 * torch.tanh(t0)


def test_in_place_add_to_a_childs_result_under_vmap_with_gradients():
    """(Was known: the rows a batched call returns are views of one tensor with one version counter; an in-place
    change to one request's rows moved the version of rows another frame saved: runtime/saved_versions.py.)"""
    funcs = {name: recompile.function(G[name]) for name in ("leaf_sq", "adds_into_child_loss")}
    trees = [make_tree(s) for s in ("random7", "random12", "random20", "balanced3")]
    forest = Forest.from_trees(trees)
    E = torch.randn(len(WORDS) + 1, 3, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want = torch.stack([adds_into_child_loss(t, t.root, E)[1] for t in trees])
    gE_want, = torch.autograd.grad(want.sum(), E)
    with bound_globals(G, funcs):
        got = recompile.vmap(funcs["adds_into_child_loss"], in_dims=(None, 0, None))(forest, forest.roots, E)[1]
    assert_close(got, want)
    gE, = torch.autograd.grad(got.sum(), E)
    assert_close(gE, gE_want, GRAD_TOL)


# an argument changed in place inside a branch or a loop whose instances part ways, or by a call that serves
# several requests at once: the caller's tensor sees the change, as in eager code
def bump_down(y, d):
    if d > 0:
        y += 1.0
        return bump_down(y, d - 1)
    return y.sum()


def bumped_by_a_call(x, d):
    y = x * 1.0
    s = bump_down(y, d)
    return y * s


def bump_once(y):
    y *= 2.0
    return y.sum()


def bumped_in_either_branch(x):
    y = x * 1.0
    z = y
    if x.sum() > 0:
        s = bump_once(y)  # the two branches' calls are served by one frame
    else:
        s = bump_once(y) * 3.0
    return z * s


@pytest.mark.parametrize("with_grad", [False, True], ids=["no_grad", "grad"])
def test_a_change_in_place_inside_a_split_reaches_the_callers_tensor(with_grad):
    x = torch.tensor([[1., 2], [3, 4], [-5, -6], [7, 8], [0.5, -0.5]], dtype=F64)
    d = torch.tensor([0, 1, 3, 2, 1])
    names = ("bump_down", "bumped_by_a_call", "bump_once", "bumped_in_either_branch")
    cases = [("bumped_by_a_call", (x, d)), ("bumped_in_either_branch", (x,))]
    funcs = {name: recompile.function(G[name]) for name in names}
    with bound_globals(G, funcs):
        for name, inputs in cases:
            x_e, x_b = x.clone().requires_grad_(with_grad), x.clone().requires_grad_(with_grad)
            with torch.set_grad_enabled(with_grad):
                want = torch.stack([G[name](x_e[k], *[a[k] for a in inputs[1:]]) for k in range(5)])
                funcs[name].stats.reset()
                got = recompile.vmap(funcs[name], in_dims=0)(x_b, *inputs[1:])
            assert_close(got, want)
            if name == "bumped_in_either_branch":  # (both branches' calls ran as one batch)
                runs = [(v["runs"], v["instances"]) for k, v in funcs[name].stats["batches"].items()
                        if k.startswith("bump_once")]
                assert runs == [(1, 5)], funcs[name].stats["batches"]
            if with_grad:
                g_e, = torch.autograd.grad((want * want).sum(), x_e)
                g_b, = torch.autograd.grad((got * got).sum(), x_b)
                assert_close(g_b, g_e, GRAD_TOL)


def written_through_out_in_a_branch(x, o):
    if x[0] > 0.5:
        torch.mul(x, 2.0, out=o)  # out= changes o in place, as o.copy_(x * 2.0) would
    return o + 0.0


def test_a_write_through_out_inside_a_split_reaches_the_callers_tensor():
    x = torch.tensor([[1., 2], [-3, 4], [5, 6], [-7, 8]], dtype=F64)
    o_e, o_b = torch.zeros(4, 2, dtype=F64), torch.zeros(4, 2, dtype=F64)
    want = torch.stack([written_through_out_in_a_branch(x[k], o_e[k]) for k in range(4)])
    got = recompile.vmap(recompile.function(written_through_out_in_a_branch))(x, o_b)
    assert_close(got, want)
    assert_close(o_b, o_e)


# more of the same, with gradients: rows copied back without making autograd see a change eager code does not
# make, arguments handed back or given twice, a branch that changes nothing handing on an argument
def wb_loop_then_setitem(x):
    v = x * 1.0
    c = x[2] * 1.0
    while c < 2.0:  # instances leave at different iterations
        v *= 1.5
        c = c + 0.6
    v[2] = x[1] * 0.61  # (the copy back must not be a tensor the gradient of the loop saved)
    return v


def wb_one_instance_side_saves_its_row(x):
    v = x * 1.0
    if x[0] > -0.5:
        v += 1.0
        s = v * 1.0
    else:  # one instance: its row must not share a version with the other side's rows
        s = v.sin()
    return torch.stack([v, s])


def wb_changes_some(a):
    if a[0] > 1.5:
        a += 1.0
    return a * 1.0


def wb_call_changes_other_requests_rows(x):
    v = x * 1.0
    if x[0] > 0.5:
        s = v * 1.0
        wb_changes_some(v)
    else:
        s = v.sin()  # saved for the gradient; the call changes none of these rows
        wb_changes_some(v)
    return torch.stack([v, s])


def wb_same(a):
    return a


def wb_argument_handed_back(x):
    v = x * 1.0
    if x[0] > 0.5:
        w = wb_same(v)  # w is v: the two branches' calls are served together
        w.mul_(2.0)
    else:
        w = wb_same(v)
        w.add_(1.0)
    return v


def wb_changes_both(a, b):
    a += 1.0
    b *= 2.0
    return a * 1.0


def wb_argument_given_twice(x):
    v = x * 1.0
    if x[0] > 0.5:
        wb_changes_both(v, v)
    else:
        wb_changes_both(v, v)
    return v


def wb_unchanging_branch_hands_on(x):
    v = x * 1.0
    if x[0] > 0.5:
        w = v
    else:
        w = v
    w += 1  # the branch changes nothing, the function does
    return v


def wb_one_side_rebinds(x):
    v = x * 1.0
    if x[0] > 0.5:
        w = v
        v = v * 2.0
    else:
        w = v  # here v is w after the branch too
    w += 1
    return torch.stack([v, w])


def wb_loop_hands_on(x):
    v = x * 1.0
    w = v
    c = x[0] * 1.0
    while c < 2.0:  # instances leave at different iterations
        v += x
        c = c + 1.0
    v *= 3.0  # eager: v is still w
    return w


def wb_loop_rebinds(x):
    v = x * 1.0
    w = v
    c = x[0] * 1.0
    while c < 2.0:
        v += 1.0
        v = v * x  # v is a new object from here on: the loop must not hand on w
        c = c + 1.0
    v += 10.0
    return torch.stack([v, w])


def wb_loop_hands_on_two_names(x):
    v = x * 1.0
    u = v
    c = x[0] * 1.0
    while c < 2.0:
        v += 1.0
        u = v  # the same object, as it was before the loop
        c = c + 1.0
    u *= 2.0
    return torch.stack([u, v])


def wb_loop_other_takes_up(x):
    v = x * 1.0
    u = x * 2.0
    c = x[0] * 1.0
    while c < 2.0:
        v += 1.0
        u = v  # u joins v's rows: handing on v alone would part the two
        c = c + 1.0
    v *= 3.0
    return torch.stack([u, v])


PICKED_FROM = torch.tensor([0.5, -1.0, 0.25], dtype=F64)
PICKS = torch.tensor([2, 0, 2])


def wb_picked_rows_then_setitem(x):
    v = PICKED_FROM[PICKS]  # (a new tensor, the same for every instance: each must change its own)
    v[1] = x.amax()
    return v * x


def wb_picked_rows_then_add_in_a_loop(x):
    v = PICKED_FROM[[2, 0, 2]]
    y = torch.tanh(x)
    for i in range(2):
        v[i] += (y + v).amax()
    return v * 1.0 + y


WRITE_BACK_PROGRAMS = ["wb_picked_rows_then_setitem", "wb_picked_rows_then_add_in_a_loop",
                       "wb_loop_then_setitem", "wb_one_instance_side_saves_its_row",
                       "wb_call_changes_other_requests_rows", "wb_argument_handed_back", "wb_argument_given_twice",
                       "wb_unchanging_branch_hands_on", "wb_one_side_rebinds", "wb_loop_hands_on",
                       "wb_loop_rebinds", "wb_loop_hands_on_two_names", "wb_loop_other_takes_up"]


@pytest.mark.parametrize("name", WRITE_BACK_PROGRAMS)
def test_changes_in_place_across_splits_and_shared_calls_match_eager(name):
    X = torch.tensor([[0., 1, 1], [1., 1, 1], [2., 1, 0.2], [-3., 1, 0.4], [1, 1, 1.5]], dtype=F64)
    helpers = ("wb_changes_some", "wb_same", "wb_changes_both")
    funcs = {n: recompile.function(G[n]) for n in (name, *helpers)}
    with bound_globals(G, funcs):
        with torch.no_grad():
            want = torch.stack([G[name](X[k].clone()) for k in range(len(X))])
            assert_close(recompile.vmap(funcs[name])(X.clone()), want)
        x_e, x_b = X.clone().requires_grad_(), X.clone().requires_grad_()
        want = torch.stack([G[name](x_e[k]) for k in range(len(X))])
        got = recompile.vmap(funcs[name])(x_b)
    assert_close(got, want)
    g_e, = torch.autograd.grad((want * want).sum(), x_e)
    g_b, = torch.autograd.grad((got * got).sum(), x_b)
    assert_close(g_b, g_e, GRAD_TOL)


COUNTED = torch.tensor([[0.5, -1.0], [2.0, 0.25], [1.0, 1.5], [-0.5, 0.75], [0.25, 2.0]], dtype=F64,
                       requires_grad=True)


def counted_down(xs, n):
    t = n - 1
    s = xs[0] * 0.0
    while t >= 0:
        s = s + torch.tanh(xs[t]) * COUNTED[t]
        t -= 1  # (in place on each instance's 0-d index, after xs[t] and COUNTED[t] read it as an int)
    return s


def test_an_index_changed_in_place_after_a_gather_keeps_the_gathers_gradient():
    """Eager reads a 0-d index as an int, which no gradient keeps; the batch's gather keeps its own copy of the
    index rows, so ``t -= 1`` after ``xs[t]`` leaves the backward as eager's."""
    xs_e = torch.randn(3, 5, 2, dtype=F64, requires_grad=True)
    xs_b = xs_e.detach().clone().requires_grad_()
    n = torch.tensor([5, 2, 3])
    want = torch.stack([counted_down(xs_e[k], n[k]) for k in range(3)])
    want_grads = torch.autograd.grad(want.sum(), (xs_e, COUNTED))
    got = recompile.vmap(recompile.function(counted_down))(xs_b, n)
    assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.sum(), (xs_b, COUNTED)), want_grads):
        assert_close(g, w, GRAD_TOL)


def joined_then_set_from_a_loop(x, w):
    if x.sum() > 0:
        v = x.sum() * torch.tanh(x)
    else:
        v = torch.softmax(PICKED_FROM * 0.25 + 2.0, 0)  # (the same for every instance, needing no gradient)
    for row in w:
        v[1] = torch.logsumexp(row, 0)  # (a value needing a gradient, into each instance's row of the join)
    return v * x


def test_rows_of_a_join_are_changed_in_place_with_values_that_need_a_gradient():
    """Each instance's row of a joined value is a view autograd lets be changed in place (not unbind's)."""
    x = torch.tensor([[1.0, 2, 3], [-1.0, -2, 0], [2.0, 1, 1], [-1.0, -2, 0]], dtype=F64)
    vmap_matches_eager(joined_then_set_from_a_loop, x, torch.tensor([[0.5, -1.0, 2.0], [2.0, 0.25, 0.0]], dtype=F64))


def vmap_matches_eager(fn, x, shared):
    """``recompile.vmap`` of ``fn`` over the rows of ``x``, ``shared`` given whole, against eager calls: values
    and the gradients of their squares' sum."""
    x_e, s_e = (t.clone().requires_grad_() for t in (x, shared))
    x_b, s_b = (t.clone().requires_grad_() for t in (x, shared))
    want = torch.stack([fn(r, s_e) for r in x_e])
    got = recompile.vmap(recompile.function(fn), in_dims=(0, None))(x_b, s_b)
    assert_close(got, want)
    for g_b, g_e in zip(torch.autograd.grad(got.square().sum(), (x_b, s_b)),
                        torch.autograd.grad(want.square().sum(), (x_e, s_e))):
        assert_close(g_b, g_e, GRAD_TOL)


def joined_then_divided(x, y):
    if x.sum() > 0:
        v = x.max() * 1.0
    else:
        v = torch.tanh(PICKED_FROM.amax())  # (made once for every instance, needing no gradient)
    v /= y[1] * y[1] + 1.0  # (each instance's own op: the rows of the value made once come to need a gradient)
    return v * x


def test_rows_of_a_value_made_once_are_each_changed_in_place_with_a_value_that_needs_a_gradient(monkeypatch):
    """Random program 46075: the second instance's row, viewed before the first instance's op made their tensor
    need a gradient, counted as a leaf, and its op raised where eager computes."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = torch.tensor([[1.0, 2, 3], [-1.0, -2, 0], [2.0, 1, 1], [-1.0, -2, 0.5]], dtype=F64)
    vmap_matches_eager(joined_then_divided, x, torch.tensor([0.5, -1.0, 2.0], dtype=F64))


def copied_into_zeros(x, w):
    h = x * w
    z = torch.zeros_like(h)
    z.index_copy_(0, torch.tensor([2, 0, 1]), h)  # (each instance's own: no batching rule of vmap's)
    return z * h


def test_rows_of_a_batchs_tensor_are_each_changed_in_place_with_a_value_that_needs_a_gradient(monkeypatch):
    """The rows of the batch's own tensor, viewed before the first instance's op made their tensor need a
    gradient, counted as leaves that autograd lets no one change: the op raised where eager computes."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = torch.tensor([[1.0, 2, 3], [-1.0, -2, 0], [2.0, 1, 1], [-1.0, -2, 0.5]], dtype=F64)
    vmap_matches_eager(copied_into_zeros, x, torch.tensor([0.5, -1.0, 2.0], dtype=F64))


ACTIVATE = torch.nn.ReLU(inplace=True)
TREE_W = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(4))


def activated_by_a_module_in_place(xs, left, right, i):
    """A node's state activated by a module built in place: each frame's state a row of one tensor of the
    batch, which the module changes."""
    if left[i] < 0:
        h = xs[i] @ TREE_W
    else:
        h = activated_by_a_module_in_place(xs, left, right, left[i]) + \
            activated_by_a_module_in_place(xs, left, right, right[i])
    h = ACTIVATE(h)
    return h * 1.0


def test_a_row_activated_in_place_by_each_frame_keeps_eagers_gradient():
    """Each frame's ``relu_`` (one frame at a time) saved its result, a row of one tensor whose version the
    next frame's ``relu_`` moved: the backward raised where eager's computes. The op now changes a copy of the
    row, written into it after."""
    left, right = torch.tensor([-1, -1, 0, -1, 2, -1, -1, 5]), torch.tensor([-1, -1, 1, -1, 3, -1, -1, 6])
    roots = torch.tensor([4, 7, 2])
    xs = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    want = torch.stack([activated_by_a_module_in_place(xs, left, right, int(r)) for r in roots])
    want_grad, = torch.autograd.grad(want.sum(), xs)
    got = recompile.vmap(recompile.function(activated_by_a_module_in_place), in_dims=(None, None, None, 0))(
        xs, left, right, roots)
    assert_close(got, want)
    assert_close(torch.autograd.grad(got.sum(), xs)[0], want_grad)


DICT_CELL = torch.nn.LSTMCell(3, 3).double()


def stepped_with_a_dict_state(xs, n):
    s = {"h": torch.zeros(3, dtype=F64), "c": xs[0] * 0.5}
    for t in range(n):
        h, c = DICT_CELL(xs[t], (s["h"], s["c"]))
        s = {"h": h, "c": c}  # (a new dict each step: nothing changes a dict)
    return s["h"] + s["c"]


@dataclasses.dataclass
class CellState:
    h: torch.Tensor
    c: torch.Tensor
    steps: int = 0


def stepped_with_a_dataclass(xs, n):
    s = CellState(torch.zeros(3, dtype=F64), xs[0] * 0.5)
    for t in range(n):
        h, c = DICT_CELL(xs[t], (s.h, s.c))
        s = CellState(h, c=c, steps=s.steps + 1)
    return s.h + s.c * s.steps


def dataclass_changed_in_a_branch(xs, n):
    s = CellState(xs[0] * 1.0, xs[1] * 2.0)
    if n > 2:
        s.h = s.h + 1.0  # (a change of the object: each instance's own)
    return s.h * s.c


@pytest.mark.parametrize("fn, batches", [(stepped_with_a_dict_state, True), (stepped_with_a_dataclass, True),
                                         (dataclass_changed_in_a_branch, False)])
def test_a_dict_or_dataclass_the_program_builds_is_held_as_its_values(fn, batches, monkeypatch):
    """``{"h": h, "c": c}`` and ``State(h, c)`` of a plain dataclass are their values, as a namedtuple is (a loop's
    instances leaving at their own steps take their part of them: no dict, and no read of one, per instance);
    one the program changes becomes each instance's own object."""
    monkeypatch.setattr(config, "PER_INSTANCE", "error" if batches else "allow")
    xs = torch.randn(4, 5, 3, dtype=F64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    ns = torch.tensor([3, 5, 1, 2])
    want = torch.stack([fn(xs[k], ns[k]) for k in range(4)])
    got = recompile.vmap(recompile.function(fn))(xs, ns)
    assert_close(got, want)
    assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def item_changed_in_place(x, w):
    h = x * w
    h[0] += 1.0  # (``h[0]`` changed, then written onto itself)
    h[1:] *= 2.0
    return h * h


def joined_item_changed_in_place(x, w):
    h = x * w if x.sum() > 0 else x * 3.0  # (held apart where the instances part ways)
    h[0] += 1.0
    h[1:] *= 2.0
    return h * h


@pytest.mark.parametrize("fn", [item_changed_in_place, joined_item_changed_in_place])
def test_an_augmented_write_of_an_item_is_one_write_for_every_instance(fn, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    x = torch.tensor([[1.0, 2, 3], [-1.0, -2, 0], [2.0, 1, 1], [-1.0, -2, 0.5]], dtype=F64)
    vmap_matches_eager(fn, x, torch.tensor([0.5, -1.0, 2.0], dtype=F64))


def product_in_a_branch_then_set(x, w):
    v = w * x
    u = (x @ v) if x.sum() > 0 else x * 2.0  # (the product saves v: a copy of the instances' rows here)
    v[1] = u  # (eager's backward through x @ v then raises)
    return v


@pytest.mark.parametrize("positive", [True, False])
def test_a_change_in_place_of_what_a_branch_read_raises_in_the_backward_as_eager_does(positive):
    """Random program 46501: a side of a branch read its copy of v's rows, where eager reads v; a change of v
    after the join must move that copy's version, or the backward misses eager's refusal."""
    x = torch.tensor([[1.0, 2.0], [-1.0, -2.0], [2.0, 0.5]], dtype=F64)
    x = (x if positive else -x.abs()).requires_grad_()
    w = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=F64, requires_grad=True)
    run = recompile.vmap(recompile.function(product_in_a_branch_then_set), in_dims=(0, None))
    want = torch.stack([product_in_a_branch_then_set(r, w) for r in x])
    got = run(x, w)
    assert_close(got, want)
    if positive:  # (some instances took the product)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(want.sum(), (x, w))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(got.sum(), (x, w))
        return
    for g_b, g_e in zip(torch.autograd.grad(got.sum(), (x, w)), torch.autograd.grad(want.sum(), (x, w))):
        assert_close(g_b, g_e, GRAD_TOL)

# ---------------------------------------------------------------------------
# per-instance runs are never silent
# ---------------------------------------------------------------------------

def scaled_by_numpy(x):
    s = float(x.sum().numpy())  # a Python value per instance (``.item()`` would be one ``tolist`` for the group)
    return x * s


def test_an_op_run_once_per_instance_warns_once_with_the_users_line_why_and_what_instead(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "warn")
    f = recompile.function(scaled_by_numpy)
    x = torch.arange(6.0).reshape(3, 2)
    line = scaled_by_numpy.__code__.co_firstlineno + 1
    with pytest.warns(recompile.PerInstanceWarning) as caught:
        out = recompile.vmap(f)(x)
    assert torch.equal(out, torch.stack([scaled_by_numpy(r) for r in x]))
    [w] = [w for w in caught if issubclass(w.category, recompile.PerInstanceWarning) and "numpy" in str(w.message)]
    text = str(w.message)
    assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)
    assert f"test_batching.py:{line}" in text and "Tensor.numpy" in text and "3 instances" in text
    assert "a Python value of each instance's tensor" in text and "torch.where" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        recompile.vmap(f)(x)  # (once per program point: no second warning)


def test_per_instance_runs_can_be_refused_or_allowed(monkeypatch):
    f = recompile.function(scaled_by_numpy)
    x = torch.arange(6.0).reshape(3, 2)
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    with pytest.raises(recompile.PerInstanceError, match="Tensor.numpy runs once per instance") as info:
        recompile.vmap(f)(x)
    assert "recompile call chain" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recompile.vmap(f)(x)
    assert f.stats["per_instance"]["Tensor.numpy"] == 3


# -- namedtuples in and out of recompile.vmap, as torch.func.vmap takes and gives them

State = collections.namedtuple("State", "h c")


def step_state(s, x):
    h = torch.tanh(s.h + x)
    return State(h, s.c + h * 2)


def test_vmap_takes_and_gives_namedtuples_with_eagers_values_and_gradients(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    g = torch.Generator().manual_seed(0)
    s = State(torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True), torch.randn(4, 3, generator=g, dtype=F64))
    x = torch.randn(4, 3, generator=g, dtype=F64)
    compiled = recompile.function(step_state)
    got = recompile.vmap(compiled)(s, x)
    want = torch.func.vmap(step_state)(s, x)
    assert type(got) is State
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    got_grad, = torch.autograd.grad(got.c.sum(), s.h)
    want_grad, = torch.autograd.grad(want.c.sum(), s.h)
    torch.testing.assert_close(got_grad, want_grad)


def joined_then_changed(x, a, b):
    if a > 0:
        v = x.amin(0)  # saves its result
    else:
        v = torch.exp(x).sum(0)
    if b > 0:
        v += 1.0  # changes amin's result where a > 0 too: eager's backward raises
    return v.sum()


@pytest.mark.parametrize("a, b, raises", [((0, 1, 1, 0), (0, 1, 0, 0), True), ((0, 1, 1, 0), (1, 0, 0, 1), False),
                                          ((1, 1, 0, 0), (0, 0, 1, 0), False)])
def test_a_change_in_place_of_a_value_joined_from_branches_moves_the_version_of_what_the_branch_made(a, b, raises):
    """A value joined from the branches' outputs is a copy of them: an in-place change of it, later, in a
    branch, also marks changed the tensor the instances' own branch made, so that ``amin``'s backward, which
    saved that tensor, raises as eager's does (for an instance of the ``amin`` branch; for one of the other
    branch nothing it saved changed)."""
    x = torch.randn(4, 3, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    a, b = torch.tensor(a), torch.tensor(b)
    xe = x.clone().requires_grad_()
    eager = [joined_then_changed(xe[k], a[k], b[k]) for k in range(4)]
    compiled = recompile.vmap(recompile.function(joined_then_changed))
    xb = x.clone().requires_grad_()
    got = compiled(xb, a, b)
    assert_close(got, torch.stack(eager).detach())
    if raises:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.stack(eager).sum().backward()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            got.sum().backward()
        return
    torch.stack(eager).sum().backward()
    got.sum().backward()
    assert_close(xb.grad, xe.grad)


def joined_then_changed_in_a_nested_branch(x, a, b, c):
    if a > 0:
        v = x.amin(0)
    else:
        v = torch.exp(x).sum(0)
    if b > 0:
        if c > 0:  # only some of the outer side's instances change v
            v += 1.0
    return v.sum()


@pytest.mark.parametrize("c, raises", [((1, 0, 0), False), ((0, 1, 0), True)])
def test_a_nested_branch_changing_some_instances_moves_only_their_branchs_tensors(c, raises):
    """The outer side's copy of the rows moves its one version counter when a nested side changes one row:
    only the instances whose rows changed mark their branch's tensor changed (eager computes when the amin
    instance is not among them)."""
    x = torch.randn(3, 3, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    a, b, c = torch.tensor([0, 1, 0]), torch.tensor([1, 1, 0]), torch.tensor(c)
    xe, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = torch.stack([joined_then_changed_in_a_nested_branch(xe[k], a[k], b[k], c[k]) for k in range(3)])
    got = recompile.vmap(recompile.function(joined_then_changed_in_a_nested_branch))(xb, a, b, c)
    assert_close(got, eager.detach())
    if raises:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            eager.sum().backward()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            got.sum().backward()
        return
    eager.sum().backward()
    got.sum().backward()
    assert_close(xb.grad, xe.grad)


def joined_read_then_changed(x, w, a):
    if a > 0:
        v = w.amin(0)  # w shared: computed once for the instances of this branch; saves its result
    else:
        v = x.sum(0)
    v += torch.softmax(v, 0)  # each instance's own, after the softmax read the joined value whole
    return v.sum()


def test_a_value_joined_from_branches_changed_in_place_by_each_instance_moves_what_its_branch_made(monkeypatch):
    """The in-place change runs per instance on rows of the joined value's one tensor (a copy of the branches'
    outputs): the tensors the branches made are marked changed too, so that ``amin``'s backward raises as
    eager's does."""
    x = torch.randn(3, 4, 2, dtype=F64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(4, 2, dtype=F64, generator=torch.Generator().manual_seed(3))
    a = torch.tensor([0, 1, 0])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        joined_read_then_changed(x[1], w.clone().requires_grad_(), a[1]).backward()
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")  # (the change in place runs per instance, and says so)
    got = recompile.vmap(recompile.function(joined_read_then_changed), in_dims=(0, None, 0))(
        x, w.clone().requires_grad_(), a)
    assert_close(got, torch.stack([joined_read_then_changed(x[k], w, a[k]) for k in range(3)]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.sum().backward()


def joined_changed_by_its_own_element(x):
    if x[-1] > 0.5:
        v = x * 2.0
    else:
        v = x * 3.0
    v.add_(v[0], alpha=-1.0)  # (v[0] a view of v: torch refuses to change a tensor by what shares its memory)
    return v


def joined_changed_by_other_elements(x):
    v = x * 2.0 if x[-1] > 0.5 else x * 3.0
    v[0] = v[1]  # (no element both read and written: eager changes it)
    v.add_(v)  # (the very elements: eager changes them)
    w = v[0]
    v[-1] = w
    return v


def test_a_value_joined_from_branches_changed_by_other_elements_of_itself_stays_one_op(monkeypatch):
    x = torch.tensor([[0.1, 0.2, 0.9], [0.3, 0.2, 0.1]], dtype=F64, requires_grad=True)
    cf = recompile.function(joined_changed_by_other_elements)
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    got = recompile.vmap(cf)(x)
    want = torch.stack([joined_changed_by_other_elements(r) for r in x])
    assert_close(got, want)
    assert_close(torch.autograd.grad(got.sum(), x), torch.autograd.grad(want.sum(), x))


@pytest.mark.parametrize("with_grad", [True, False])
def test_a_value_joined_from_branches_changed_by_a_view_of_itself_raises_as_eager(with_grad, monkeypatch):
    """``v[0]`` of a value joined from a branch's sides is read from the tensor joined of them: the change in place
    by it runs on each instance's own tensor, where torch refuses it as eager's (once it computed it)."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = torch.tensor([[0.1, 0.2, 0.9], [0.3, 0.2, 0.1]], dtype=F64, requires_grad=with_grad)
    with pytest.raises(RuntimeError, match="single memory location"):
        joined_changed_by_its_own_element(x[0].detach().clone())
    with pytest.raises(RuntimeError, match="single memory location"):
        recompile.vmap(recompile.function(joined_changed_by_its_own_element))(x)


def held_as_items_then_changed(x, w):
    v = w.min(0)[0]  # each instance's own tensor (w shared; the program changes values in place)
    r = torch.minimum(v[2] * v[2], x)  # (v[2] per instance, views of v's; the product reads them stacked)
    v /= 2.0  # each instance's own tensor, whose view the product saved: eager's backward raises
    return r.sum() + v.sum()


def held_as_items_then_changed_unread(x, w):
    v = w.min(0)[0]
    r = v[2] + x  # (the sum saves nothing)
    v /= 2.0
    return r.sum() + v.sum()


@pytest.mark.parametrize("fn", [held_as_items_then_changed, held_as_items_then_changed_unread])
def test_a_change_in_place_of_tensors_held_as_items_moves_what_was_stacked_from_them(fn, monkeypatch):
    """An op that read a value held as each instance's own tensor read them stacked: a later change in place of
    one of them moves the stack's version too (``batch.changed_in_place``), so that a backward that saved the
    stack raises as eager's does; one that saved nothing computes eager's gradient."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(4))
    w = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(5))
    backward_as_eager(fn, x, w, raises=fn is held_as_items_then_changed)


def backward_as_eager(fn, x, w, raises):
    """``vmap`` of ``fn`` over the rows of ``x``, ``w`` given whole, against eager calls: both backwards refuse a
    change in place (``raises``), or give the same gradients of ``x`` and ``w``."""
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = recompile.vmap(recompile.function(fn), in_dims=(0, None))(xb, wb)
    want = torch.stack([fn(xe[k], we) for k in range(len(x))])
    if raises:
        for out in (want, got):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
        return
    want.sum().backward()
    got.sum().backward()
    assert_close(wb.grad, we.grad)
    assert_close(xb.grad, xe.grad)


TIES = torch.tensor([1.0, 3.0, 3.0], dtype=F64)


def viewed_then_changed(x, w):
    v = w.amin(0) - x
    v /= (v[torch.argmax(TIES)] * v[torch.argmax(TIES)] + 1.0)  # (the product saved views of v: eager raises)
    return v.sum()


def viewed_then_changed_unsaved(x, w):
    v = w.amin(0) - x
    v /= (v[torch.argmax(TIES)] + 1.0)  # (the sum saved nothing)
    return v.sum()


def indexed_by_each_then_changed(x, w):
    v = x * 2.0
    k = torch.argmax(x)  # (each instance's own: the rows are gathered)
    y = v[k] * v[k]
    v /= 2.0
    return y + v.sum()


@pytest.mark.parametrize("fn", [viewed_then_changed, viewed_then_changed_unsaved, indexed_by_each_then_changed])
def test_a_change_in_place_of_a_value_whose_rows_were_read_by_each_instances_index_moves_what_was_read(
        fn, monkeypatch):
    """Each instance's ``v[k]`` (k its own 0-d tensor) is a view of its v in eager code, a row read out of the
    batch's tensor here: a later change of v in place moves the version of what was made of those rows too
    (``batch.after_in_place``), so that a backward that saved it raises as eager's does."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(6))
    w = torch.randn(3, 3, dtype=F64, generator=torch.Generator().manual_seed(7))
    backward_as_eager(fn, x, w, raises=fn is not viewed_then_changed_unsaved)


def changed_in_some_branches(x, s):
    y = torch.sigmoid(x)  # saves its result
    if s > 0:
        y += 1.0  # only these instances change it; their gradient does not go through y
        return x.sum()
    return y.sum()


def test_a_change_in_place_in_some_branches_of_a_saved_value_keeps_eagers_gradient():
    """(Was known: the copy back of the changed rows moved the version of the group's tensor, and sigmoid's
    backward raised for every instance: runtime/saved_versions.py.)"""
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    s = torch.tensor([1, -1, 1, -1])
    xe = x.clone().requires_grad_()
    want = torch.autograd.grad(torch.stack([changed_in_some_branches(xe[k], s[k]) for k in range(4)]).sum(), xe)[0]
    xb = x.clone().requires_grad_()
    got = recompile.vmap(recompile.function(changed_in_some_branches))(xb, s)
    assert_close(torch.autograd.grad(got.sum(), xb)[0], want)


ATTEND = {first: torch.nn.MultiheadAttention(4, 2, batch_first=first).double() for first in (True, False)}


def attended(x, keep, first, weights, own_batch):
    """Self-attention over one instance's sequence x (6, 4): as the module's own batch of one (``x[None]``) or
    unbatched, its padding mask each instance's own."""
    mha = ATTEND[first]
    seq = (x[None] if first else x[:, None]) if own_batch else x
    mask = (keep < 0.5)[None] if own_batch else keep < 0.5
    out, w = mha(seq, seq, seq, key_padding_mask=mask, need_weights=weights)
    out = (out[0] if first else out[:, 0]) if own_batch else out
    return out.sum(-1) + (w.sum() if weights else 0.0)


@pytest.mark.parametrize("first", [True, False], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("weights", [True, False], ids=["weights", "fused"])
@pytest.mark.parametrize("own_batch", [True, False], ids=["own_batch", "unbatched"])
def test_multihead_attention_over_each_instances_sequence_is_one_call(first, weights, own_batch, monkeypatch):
    """``need_weights=False`` takes torch's fused attention, which torch.func.vmap cannot batch: it ran per
    instance."""
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    ATTEND[first].eval()
    x = torch.randn(4, 6, 4, dtype=F64, generator=torch.Generator().manual_seed(7))
    keep = torch.tensor([[1.0, 1, 1, 1, 0, 0], [1.0, 1, 1, 1, 1, 1], [1.0, 1, 0, 0, 0, 0], [1.0, 1, 1, 0, 0, 0]],
                        dtype=F64)
    fn = functools.partial(attended, first=first, weights=weights, own_batch=own_batch)
    xe, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.stack([fn(xe[k], keep[k]) for k in range(4)])
    got = recompile.vmap(recompile.function(attended), in_dims=(0, 0, None, None, None))(
        xb, keep, first, weights, own_batch)
    assert_close(got, want)
    assert_close(torch.autograd.grad(got.sum(), xb)[0], torch.autograd.grad(want.sum(), xe)[0])


torch.manual_seed(0)
ENCODE = {first: torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=first).double()
          for first in (True, False)}
STACKED = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 2,
                                      enable_nested_tensor=False).double()


def encoded(x, keep, first, own_batch, stacked):
    """A Transformer encoder layer (or two) over one instance's sequence x (6, 4): as the module's own batch of one
    or unbatched, its padding mask each instance's own (none for the stack)."""
    seq = (x[None] if first else x[:, None]) if own_batch else x
    if stacked:
        out = STACKED(seq, mask=torch.zeros(6, 6, dtype=F64))
    else:
        out = ENCODE[first](seq, src_key_padding_mask=(keep < 0.5)[None] if own_batch else keep < 0.5)
    out = (out[0] if first else out[:, 0]) if own_batch else out
    return out.sum(-1)


@pytest.mark.parametrize("first, stacked", [(True, False), (False, False), (True, True)],
                         ids=["batch_first", "sequence_first", "two_layers"])
@pytest.mark.parametrize("own_batch", [True, False], ids=["own_batch", "unbatched"])
@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_a_transformer_encoder_over_each_instances_sequence_is_one_call(first, stacked, own_batch, training,
                                                                         monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    for module in (*ENCODE.values(), STACKED):
        module.train(training)
    x = torch.randn(4, 6, 4, dtype=F64, generator=torch.Generator().manual_seed(7))
    keep = torch.tensor([[1.0, 1, 1, 1, 0, 0], [1.0, 1, 1, 1, 1, 1], [1.0, 1, 0, 0, 0, 0], [1.0, 1, 1, 0, 0, 0]],
                        dtype=F64)
    fn = functools.partial(encoded, first=first, own_batch=own_batch, stacked=stacked)
    xe, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = torch.stack([fn(xe[k], keep[k]) for k in range(4)])
    got = recompile.vmap(recompile.function(encoded), in_dims=(0, 0, None, None, None))(
        xb, keep, first, own_batch, stacked)
    assert_close(got, want)
    assert_close(torch.autograd.grad(got.sum(), xb)[0], torch.autograd.grad(want.sum(), xe)[0])


class Doubler(torch.nn.Module):
    def forward(self, x, k):
        return x * 2 if k > 0 else x


def test_vmap_compiles_a_plain_function_a_lambda_a_method_and_a_module_once():
    x, k = torch.randn(4, 3), torch.tensor([1, 0, 2, -1])
    want = torch.stack([simple(a, b) for a, b in zip(x, k)])
    assert torch.equal(recompile.vmap(simple)(x, k), want)
    vmap_module = sys.modules["recompile.vmap"]  # (the module: the package's name is the function)
    assert vmap_module._compiled(simple) is vmap_module._compiled(simple)  # (compiled once)
    twice = lambda v, j: simple(v, j) * 2  # noqa: E731
    assert torch.equal(recompile.vmap(twice)(x, k), want * 2)
    m = Doubler()
    want = torch.stack([m(a, b) for a, b in zip(x, k)])
    assert torch.equal(recompile.vmap(m)(x, k), want)
    assert torch.equal(recompile.vmap(m.forward)(x, k), want)


def test_vmap_of_throwaway_functions_keeps_no_compiled_program_alive():
    import gc
    import weakref

    def make(k):
        return lambda v: v * k

    gone = []
    for k in range(3):
        fn = make(k)
        assert torch.equal(recompile.vmap(fn)(torch.ones(2, 2)), torch.full((2, 2), float(k)))
        gone.append(weakref.ref(sys.modules["recompile.vmap"]._compiled(fn)))
        del fn
    gc.collect()
    assert all(ref() is None for ref in gone)
