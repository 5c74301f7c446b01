"""``recompile.map`` (vmap.py): a function over a list of what users hold, in one batched run, each result as the
function returns it; differential against the plain calls."""

import collections
import dataclasses
import itertools
import warnings
import random
import sys
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import diagnostics

H = 6


class Node:
    def __init__(self, word, label, children):
        self.word, self.label, self.children = word, label, children


def random_tree(rng, depth=0):
    """A tree of Nodes with 0 to 4 children each."""
    arity = 0 if depth >= 3 or (depth and rng.random() < 0.35) else rng.randint(1, 4)
    return Node(torch.tensor(rng.randrange(20)), torch.tensor(rng.randrange(3)),
                [random_tree(rng, depth + 1) for _ in range(arity)])


class ChildSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, H)
        self.iou = nn.Linear(2 * H, 3 * H)
        self.f = nn.Linear(2 * H, H)
        self.out = nn.Linear(H, 3)

    @recompile.function
    def forward(self, node):
        x = self.embed(node.word)
        hs, cs, loss = [], [], 0.0
        for child in node.children:
            h, c, child_loss = self.forward(child)
            hs.append(h)
            cs.append(c)
            loss = loss + child_loss
        h_sum = sum(hs) if hs else torch.zeros(H, dtype=x.dtype)
        i, o, u = torch.chunk(self.iou(torch.cat([x, h_sum])), 3)
        c = torch.sigmoid(i) * torch.tanh(u)
        for h_k, c_k in zip(hs, cs):
            c = c + torch.sigmoid(self.f(torch.cat([x, h_k]))) * c_k
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c, loss + F.cross_entropy(self.out(h), node.label)


def grads(model, loss):
    params = list(model.parameters())
    return torch.autograd.grad(loss, params)


@pytest.fixture
def strict(monkeypatch):
    """Per-instance fallbacks raise (a model that must batch whole)."""
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "error")
    monkeypatch.setattr(diagnostics, "_warned", set())


def test_a_child_sum_over_node_objects_gives_each_trees_values_and_gradients_and_batches(strict):
    torch.manual_seed(0)
    model = ChildSum().double()
    rng = random.Random(1)
    roots = [random_tree(rng) for _ in range(9)]
    want = [model.forward.python(model, root) for root in roots]
    want_grads = grads(model, sum(w[2] for w in want))
    type(model).forward.stats.reset()
    got = recompile.map(model, roots)
    assert type(got) is list and len(got) == len(roots)
    for g, w in zip(got, want):
        assert type(g) is tuple and len(g) == 3
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b.detach())
    for a, b in zip(grads(model, sum(g[2] for g in got)), want_grads):
        torch.testing.assert_close(a, b)
    stats = type(model).forward.stats
    assert not stats.get("per_instance")
    nodes = sum(1 for _ in _walk(roots))
    assert stats["batches"]["ChildSum.forward"]["mean_batch"] > 3  # (a node's children of every tree at once)
    assert stats["frames"] < nodes


def test_each_instances_rows_take_their_gradient_as_one_stack(strict):
    """The rows each instance holds as its own (its children's states, appended to its lists) are views whose
    gradient is one stack of the batch's rows: no row's view makes a zero tensor of the whole batch in the
    backward (a backward that grows with the rows times the batch)."""
    torch.manual_seed(0)
    model = ChildSum().double()
    rng = random.Random(3)
    roots = [random_tree(rng) for _ in range(6)]
    loss = sum(g[2] for g in recompile.map(model, roots))
    seen, stack, kinds = set(), [loss.grad_fn], collections.Counter()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        kinds[type(fn).__name__] += 1
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    # (a view per result read: each tree's loss, and a run of one instance's own values)
    assert kinds["UnbindBackward0"] and kinds["SelectBackward0"] < 2 * len(roots) < sum(1 for _ in _walk(roots))


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def test_sequences_of_their_own_lengths_run_as_rows_with_eagers_gradients(strict):
    torch.manual_seed(0)
    cell = nn.LSTMCell(4, H).double()

    @recompile.function
    def encode(seq):
        h = torch.zeros(H, dtype=seq.dtype)
        c = torch.zeros(H, dtype=seq.dtype)
        for x in seq:
            h, c = cell(x, (h, c))
        return h, seq.sum(0), len(seq)

    seqs = [torch.randn(m, 4, dtype=torch.float64, requires_grad=True) for m in (3, 1, 5, 2, 5)]
    got = recompile.map(encode, seqs)
    want = [encode.python(s) for s in seqs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g[0], w[0])
        torch.testing.assert_close(g[1], w[1])
        assert type(g[2]) is int and g[2] == w[2]
    loss_got = sum(g[0].sum() + g[1].sum() for g in got)
    loss_want = sum(w[0].sum() + w[1].sum() for w in want)
    for a, b in zip(torch.autograd.grad(loss_got, seqs), torch.autograd.grad(loss_want, seqs)):
        torch.testing.assert_close(a, b)
    assert not encode.stats.get("per_instance")


CHARS = {c: k for k, c in enumerate("abcdefghij")}


def test_words_held_as_python_strings_read_their_characters_by_one_lookup_each(strict, monkeypatch):
    """``for ch in word`` of each instance's own str, ``CHARS[ch]`` of a shared dict: each instance's Python
    values, read as Python reads them, and the states stepped for every word at once."""
    torch.manual_seed(3)
    cell = nn.RNNCell(4, H).double()
    embed = nn.Embedding(10, 4).double()

    @recompile.function
    def spelled(word):
        h = torch.zeros(H, dtype=torch.float64)
        for ch in word:
            h = cell(embed.weight[CHARS[ch]], h)
        return h, word[-1:] + word[:1]

    words = ["abc", "j", "", "hgfedcba", "bad"]
    got = recompile.map(spelled, words)
    want = [spelled.python(w) for w in words]
    for g, w in zip(got, want):
        torch.testing.assert_close(g[0], w[0])
        assert g[1] == w[1]
    params = list(cell.parameters()) + [embed.weight]
    for a, b in zip(torch.autograd.grad(sum(g[0].sum() for g in got), params),
                    torch.autograd.grad(sum(w[0].sum() for w in want), params)):
        torch.testing.assert_close(a, b)
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "allow")  # (the instances then read on their own)
    with pytest.raises(KeyError):
        recompile.map(spelled, ["abc", "xyz"])  # (a character the table lacks: Python's own KeyError)


def test_each_sequence_read_backwards_a_step_at_a_time_reads_its_own_stretch(strict):
    """``words[t:t + 1]`` with ``t`` each instance's own (``reversed(range(n))``) over sequences of their own
    lengths: every instance's row at once, from where each sequence lies."""
    torch.manual_seed(4)
    cell = nn.GRUCell(4, H).double()
    embed = nn.Embedding(20, 4).double()

    @recompile.function
    def backwards(words):
        h = torch.zeros(1, H, dtype=torch.float64)
        states = []
        for t in reversed(range(len(words))):
            h = cell(embed(words[t:t + 1]), h)
            states.append(h[0])
        return torch.stack(states[::-1]).sum(0)

    seqs = [torch.randint(0, 20, (k,)) for k in (3, 5, 1, 4)]
    got = recompile.map(backwards, seqs)
    want = [backwards.python(w) for w in seqs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    params = list(cell.parameters()) + [embed.weight]
    for a, b in zip(torch.autograd.grad(sum(g.sum() for g in got), params),
                    torch.autograd.grad(sum(w.sum() for w in want), params)):
        torch.testing.assert_close(a, b)


Decoded = namedtuple("Decoded", "tokens steps")


def test_a_greedy_decoder_returns_each_instances_python_list_and_namedtuple(strict):
    torch.manual_seed(7)
    cell = nn.LSTMCell(4, H)
    proj = nn.Linear(H, 5)
    embed = nn.Embedding(5, 4)
    with torch.no_grad():
        proj.bias[4] = 0.0  # (END is drawn now and then: the instances stop after 0 to 6 tokens)

    @recompile.function
    def decode(h, c, limit):
        tokens, token = [], 0
        while len(tokens) < limit:
            h, c = cell(embed.weight[token], (h, c))
            token = int(proj(h).argmax())
            if token == 4:
                break
            tokens.append(token)
        return Decoded(tokens, len(tokens))

    states = [(torch.randn(H) * 2, torch.randn(H)) for _ in range(24)]
    got = recompile.map(decode, [s[0] for s in states], [s[1] for s in states], itertools.repeat(6))
    want = [decode.python(h, c, 6) for h, c in states]
    assert got == want
    assert all(type(g) is Decoded and type(g.tokens) is list for g in got)
    assert len({len(g.tokens) for g in got}) > 1  # (instances stop at steps of their own)
    assert [b["runs"] for b in decode.stats["batches"].values()] == [1]  # (one run, 24 instances)


def test_an_argument_every_instance_holds_is_shared(monkeypatch):
    @recompile.function
    def scaled(x, table):
        return table[x] * 2.0

    mapping = sys.modules["recompile.vmap"]
    seen = []
    original = mapping._column
    monkeypatch.setattr(mapping, "_column", lambda items: seen.append(original(items)) or seen[-1])
    table = torch.arange(5.0)
    got = recompile.map(scaled, [torch.tensor(1), torch.tensor(3)], [table, table])
    assert seen[1] is table  # (one object for all: given as it is, not as a batch of copies)
    assert [float(g) for g in got] == [2.0, 6.0]


def test_each_instances_own_object_comes_back_as_itself():
    @recompile.function
    def deepest(node):
        for child in node.children:
            return deepest(child)
        return node

    rng = random.Random(4)
    roots = [random_tree(rng) for _ in range(6)]
    assert all(g is deepest.python(r) for g, r in zip(recompile.map(deepest, roots), roots))


def test_lengths_like_pythons_map_and_zip():
    @recompile.function
    def add(a, b):
        return a + b

    xs = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    assert recompile.map(add, xs, xs[:2]) == [torch.tensor(2.0), torch.tensor(4.0)]
    with pytest.raises(ValueError):
        recompile.map(add, xs, xs[:2], strict=True)
    assert recompile.map(add, [], []) == []
    assert recompile.map(add, xs[:1], xs[:1]) == [torch.tensor(2.0)]
    assert recompile.map(add, iter(xs), itertools.repeat(torch.tensor(10.0))) == \
        [torch.tensor(11.0), torch.tensor(12.0), torch.tensor(13.0)]


def test_misuse_raises_pythons_errors():
    @recompile.function
    def one(a):
        return a

    with pytest.raises(TypeError, match="at least one iterable"):
        recompile.map(one)
    with pytest.raises(TypeError, match="recompile.map expects a function"):
        recompile.map(3, [1, 2])
    with pytest.raises(TypeError):
        recompile.map(one, [1, 2], [3, 4])  # (two arguments for one parameter: Python's own message)
    with pytest.raises(ValueError, match="mode='batched'"):
        recompile.map(recompile.function(lambda a: a, mode="sequential"), [1, 2])


def test_an_instances_error_is_raised():
    @recompile.function
    def first_child(node):
        return node.children[0].word

    rng = random.Random(5)
    roots = [random_tree(rng) for _ in range(3)] + [Node(torch.tensor(1), torch.tensor(0), [])]
    with pytest.raises(IndexError):
        recompile.map(first_child, roots)
    with pytest.raises(AttributeError, match="'int' object has no attribute 'children'"):
        recompile.map(first_child, [roots[0], 7])


def test_under_disable_each_instance_is_a_plain_call():
    calls = []

    @recompile.function
    def noted(x):
        calls.append(float(x))
        return x * 2

    with recompile.disable():
        got = recompile.map(noted, [torch.tensor(1.0), torch.tensor(2.0)])
    assert calls == [1.0, 2.0] and got == [torch.tensor(2.0), torch.tensor(4.0)]


Held = namedtuple("Held", "word children")


class HeldLeaf:
    """A leaf of a tree held as objects of two classes, which say what they are by a method."""

    def __init__(self, word):
        self.word = word

    def is_leaf(self):
        return True

    def kids(self):
        return []


class HeldInner(HeldLeaf):
    def __init__(self, word, children):
        super().__init__(word)
        self.children = children

    def is_leaf(self):
        return False

    def kids(self):
        return self.children


def held_tree(rng, kind, depth=0):
    """A tree held as a user's namedtuple, dict, tuple of (word, children), or objects of two classes."""
    arity = 0 if depth >= 3 or (depth and rng.random() < 0.4) else rng.randint(1, 3)
    word, children = rng.randrange(20), [held_tree(rng, kind, depth + 1) for _ in range(arity)]
    if kind == "classes":
        return HeldInner(word, children) if children else HeldLeaf(word)
    return Held(word, children) if kind == "namedtuple" else {"word": word, "children": children} \
        if kind == "dict" else (word, children)


EMBED = nn.Embedding(20, H).double()
COMBINE = nn.Linear(2 * H, H).double()


@recompile.function
def by_fields(node):
    states = [by_fields(child) for child in node.children]
    h_sum = torch.stack(states).sum(0) if states else torch.zeros(H, dtype=torch.float64)
    if not node.children:
        return torch.tanh(EMBED.weight[node.word])
    return torch.tanh(COMBINE(torch.cat([EMBED.weight[node.word], h_sum])))


@recompile.function
def by_keys(node):
    h = torch.zeros(H, dtype=torch.float64)
    for k in range(len(node["children"])):
        h = h + by_keys(node["children"][k])
    return torch.tanh(COMBINE(torch.cat([EMBED.weight[node["word"]], h])))


@recompile.function
def by_places(node):
    word, children = node
    h = sum(by_places(child) for child in children) if children else torch.zeros(H, dtype=torch.float64)
    return torch.tanh(COMBINE(torch.cat([EMBED.weight[word], h])))


@recompile.function
def by_methods(node):
    """A node's class's own methods (``node.is_leaf()``): one call per class; a sum from a shared start."""
    if node.is_leaf():
        return torch.tanh(EMBED.weight[node.word])
    h = sum((by_methods(child) for child in node.kids()), torch.zeros(H, dtype=torch.float64))
    return torch.tanh(COMBINE(torch.cat([EMBED.weight[node.word], h])))


@recompile.function
def pairs_of(node):
    x = EMBED.weight[node[0]]
    if not node[1]:
        return x, torch.sigmoid(x)
    hs, cs = zip(*[pairs_of(child) for child in node[1]])  # (each instance's pairs, transposed)
    h = torch.tanh(COMBINE(torch.cat([x, torch.stack(hs).sum(0)])))
    return h, torch.stack(cs).mean(0) * h


@recompile.function
def by_pairs(node):
    h, c = pairs_of(node)
    return h + c


@recompile.function
def by_tests(node):
    """A sum from each node's own start, and ``any`` of a generator over the children."""
    h = sum((by_tests(child) for child in node["children"]), EMBED.weight[node["word"]])
    if any(child["word"] > 10 for child in node["children"]):
        h = h * 0.5
    return torch.tanh(COMBINE(torch.cat([EMBED.weight[node["word"]], h])))


@pytest.mark.parametrize("fn, kind", [(by_fields, "namedtuple"), (by_keys, "dict"), (by_places, "tuple"),
                                      (by_methods, "classes"), (by_pairs, "tuple"), (by_tests, "dict")])
def test_trees_held_as_namedtuples_dicts_or_tuples_batch_whole(fn, kind, strict):
    """A node's fields, a dict's keys, a tuple's places, its class's methods, ``not node.children``, a
    comprehension over the children and its pairs transposed (``zip(*pairs)``), ``sum`` from a start, ``any``:
    each instance's read in one pass, nothing once per instance; values and gradients as the plain calls'."""
    rng = random.Random(6)
    trees = [held_tree(rng, kind) for _ in range(10)]
    got = recompile.map(fn, trees)
    want = [fn.python(t) for t in trees]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    params = list(COMBINE.parameters())
    for a, b in zip(torch.autograd.grad(sum(g.sum() for g in got), params),
                    torch.autograd.grad(sum(w.sum() for w in want), params)):
        torch.testing.assert_close(a, b)
    assert not fn.stats.get("per_instance")


def doubled_in_place(seq):
    seq.mul_(2.0)


class Holder:
    """Holds a helper the program reads at run time (so each instance runs it on its own tensor)."""

    def __init__(self, f):
        self.f = f


@recompile.function
def summed_around_a_helper(seq, holder):
    before = seq.sum(0)
    holder.f(seq)
    return seq.sum(0) + before, seq[0]


@pytest.mark.parametrize("lengths", [(2, 4), (3, 3)], ids=["ragged", "equal"])
def test_an_argument_a_helper_changes_in_place_is_read_changed(lengths):
    """The padded copy of sequences of their own lengths is made again once a helper run per instance changed
    one in place; the reads after it see the change, as eager's do."""
    def make():
        return [torch.ones(m, 3) * (k + 1) for k, m in enumerate(lengths)]

    holder = Holder(doubled_in_place)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.map(summed_around_a_helper, make(), itertools.repeat(holder))
    want = [summed_around_a_helper.python(s, holder) for s in make()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@recompile.function
def relu_in_place(seq):
    F.relu(seq, inplace=True)
    return seq.sum(0)


@recompile.function
def filled_in_place(seq):
    nn.init.constant_(seq, 2.0)
    return seq.sum(0)


@pytest.mark.parametrize("fn", [relu_in_place, filled_in_place])
def test_a_function_that_changes_an_argument_in_place_changes_each_instances_own(fn):
    """``F.relu(x, inplace=True)``, ``nn.init.constant_(x, c)``: each instance's own tensor is changed, and the
    function reads it changed, as eager code does."""
    got_in = [-torch.ones(2, 3), torch.ones(2, 3)]
    want_in = [-torch.ones(2, 3), torch.ones(2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.map(fn, got_in)
    want = [fn.python(s) for s in want_in]
    for g, w, a, b in zip(got, want, got_in, want_in):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(a, b)


def test_sparse_arguments_of_their_own_shapes_run_as_each_instances_own():
    @recompile.function
    def total(s):
        return s.sum()

    sparse = [torch.ones(2, 2).to_sparse(), torch.ones(3, 2).to_sparse()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        assert [float(t) for t in recompile.map(total, sparse)] == [4.0, 6.0]


class Counted:
    reads = 0

    def __init__(self, value):
        self._value = value

    @property
    def value(self):
        Counted.reads += 1
        if self._value < 0:
            raise ValueError(f"bad {self._value}")
        return self._value


def test_an_attribute_is_read_once_per_instance_and_the_first_error_raised():
    @recompile.function
    def read(obj):
        return obj.value * 2

    Counted.reads = 0
    assert recompile.map(read, [Counted(1), Counted(2), Counted(3)]) == [2, 4, 6]
    assert Counted.reads == 3
    Counted.reads = 0
    with pytest.raises(ValueError, match="bad -2"):
        recompile.map(read, [Counted(1), Counted(-2), Counted(-3)])
    assert Counted.reads == 2  # (as a loop of calls reads them: the first two, once each)


class Dotted:
    def __init__(self, x):
        self.x, self.inner = x, Counted(x)
        setattr(self, "a.b", x * 3)


def test_an_attribute_named_with_a_dot_is_that_attribute_not_a_path():
    @recompile.function
    def read(obj, name):
        return obj.x + getattr(obj, name)

    objs = [Dotted(1), Dotted(2)]
    assert recompile.map(read, objs, ["a.b"] * 2) == [4, 8]
    with pytest.raises(AttributeError, match="inner.value"):  # (as eager: no attribute of that name)
        recompile.map(read, objs, ["inner.value"] * 2)


def test_strict_lengths_that_agree_run():
    @recompile.function
    def add(a, b):
        return a + b

    assert recompile.map(add, [1, 2], [3, 4], strict=True) == [4, 6]


def test_each_instances_own_lists_joined_by_operators_as_python_joins_them(strict):
    """``ll + lr`` of two lists each instance built (a leaf's ``[]`` joined with a node's), ``+ [x]``, ``* 2``,
    ``==`` and a tuple's ``+``: Python's work on each instance's lists, the tensors in them only handed on."""
    torch.manual_seed(5)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    @recompile.function
    def joined(x, n):
        ll, lr = [], [x @ w]
        for k in range(n):
            ll = ll + [x * k]
        both = ll + lr
        twice = both * 2
        pair = (len(both),) + (n,)
        return torch.stack(twice).sum(), pair, both == both, len(ll + [])

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    ns = [2, 0, 3, 1]
    got = recompile.map(joined, xs, ns)
    want = [joined.python(x, n) for x, n in zip(xs, ns)]
    for g, v in zip(got, want):
        torch.testing.assert_close(g[0], v[0])
        assert g[1:] == v[1:]
    torch.testing.assert_close(torch.autograd.grad(sum(g[0] for g in got), w)[0],
                               torch.autograd.grad(sum(v[0] for v in want), w)[0])


VOWELS, SEEN, KNOWN = "aeiou", {"kiwi": 0, "zz": 1}, ["kiwi", "zz", "zz"]


def test_each_instances_strings_read_by_their_methods_and_in_as_python_reads_them(strict):
    """``ch in VOWELS``, ``word not in SEEN`` (a shared str and dict), ``k in (1, 3)``, ``w not in {...}`` (a dict
    the function builds), ``word.upper()`` and its other methods, ``"-".join(...)`` and ``"{}".format(...)`` of a
    shared str, ``SEEN.get(word, -1)`` and a shared list's ``count``: Python's work on each instance's Python values, with no warning (``strict``), as Python does it;
    the tensor work beside it batched."""
    torch.manual_seed(6)
    embed = nn.Embedding(len(VOWELS) + 1, 3).double()

    @recompile.function
    def spelled(word, k):
        n, h = 0, torch.zeros(3, dtype=torch.float64)
        for ch in word.lower():
            if ch in VOWELS:
                n += 1
                h = h + embed.weight[VOWELS.index(ch) if ch in VOWELS else len(VOWELS)]
        told = "{w}:{n}".format(w=word.strip(), n=k)
        return (h, n, word.upper(), word.startswith("a"), len(word.split("-")), word.replace("a", "b"),
                "-".join([word, told]), word not in SEEN, k in (1, 3), word not in {"zz": 1}, word.count("a") + k,
                SEEN.get(word.strip(), -1), KNOWN.count(word.strip()))

    words, ks = ["apple", "Banana-x", "kiwi ", "zz", ""], [1, 2, 3, 4, 5]
    got = recompile.map(spelled, words, ks)
    want = [spelled.python(w, k) for w, k in zip(words, ks)]
    for g, v in zip(got, want):
        torch.testing.assert_close(g[0], v[0])
        assert g[1:] == v[1:]
    torch.testing.assert_close(torch.autograd.grad(sum(g[0].sum() for g in got), embed.weight)[0],
                               torch.autograd.grad(sum(v[0].sum() for v in want), embed.weight)[0])
    assert not spelled.stats["per_instance"]


@dataclasses.dataclass
class Scaler:  # (eq=True, so unhashable: a callable the unpacked call's check must not hash)
    k: float

    def __call__(self, *xs):
        return sum(xs) * self.k


SCALER = Scaler(2.0)


def test_an_unhashable_callable_given_each_instances_list_unpacked_gives_pythons_values(monkeypatch):
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "allow")  # (its Python code runs once per instance)

    @recompile.function
    def scaled(x, n):
        parts = [x * i for i in range(n)]
        return SCALER(*parts) + x

    xs, ns = torch.randn(3, 2, dtype=torch.float64), [1, 2, 3]
    for got, x, n in zip(recompile.map(scaled, xs, ns), xs, ns):
        torch.testing.assert_close(got, scaled.python(x, n))


W_GLOBAL = torch.ones(3)


@pytest.mark.parametrize("strict", [False, True])
def test_a_tensor_computed_once_comes_back_as_each_instances_own_and_a_held_one_as_itself(strict):
    scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    @recompile.function
    def pick(x):
        fresh = torch.zeros(3, dtype=torch.float64) + scale  # (no instance's input in it: computed once)
        held = W_GLOBAL.contiguous()  # (hands back what the caller holds)
        if x.sum() > 0:
            y = x * 2
            return y, [y], held
        return fresh, [fresh], held

    xs = [torch.ones(3, dtype=torch.float64), -torch.ones(3, dtype=torch.float64),
          -2 * torch.ones(3, dtype=torch.float64), -torch.ones(3, dtype=torch.float64)]
    got = recompile.map(pick, xs)
    want = [pick.python(x) for x in xs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g[0], w[0])
        assert g[2] is W_GLOBAL  # (as Python's calls: the one object each time)
    assert all(g[0] is g[1][0] for g in got)  # (each instance's own aliasing, as its call made it)
    assert len({id(g[0]) for g in got}) == len(got)  # (each call made its own zeros: so each instance)
    got[1][0].add_(5.0)
    torch.testing.assert_close(got[2][0], want[2][0])
    torch.testing.assert_close(got[1][1][0], want[1][0] + 5.0)
    grad, = torch.autograd.grad(sum(g[0].sum() for g in got[1:]), scale)
    assert float(grad) == 9.0  # (three instances' zeros + scale, three elements each)


def test_a_view_of_a_held_tensor_and_a_tensor_an_earlier_run_computed_once_come_back_as_the_callers():
    @recompile.function
    def viewed(x):
        return W_GLOBAL.view(-1), W_GLOBAL.detach(), x

    xs = [torch.ones(3), torch.zeros(3), torch.ones(3)]
    got = recompile.map(viewed, xs)
    assert all(g[0].data_ptr() == g[1].data_ptr() == W_GLOBAL.data_ptr() for g in got)  # (eager's: W's memory)

    @recompile.function
    def made(x):
        return torch.zeros(3) + 1.0

    kept = recompile.map(made, xs)[0]  # (computed once in that run; the caller's own tensor from here on)

    @recompile.function
    def handed(x):
        return kept, x

    assert all(g[0] is kept for g in recompile.map(handed, xs))


def word_at(inputs, k):
    return inputs[k] * 2.0


@pytest.mark.parametrize("lengths", [[4, 4, 4, 4], [2, 5, 3, 4]], ids=["as-long", "own-lengths"])
def test_each_instances_tensor_at_its_own_int_is_one_index(lengths):
    """``inputs[tree.idx]``: each instance's own sentence at its own position (from the end too), one index of
    their rows; a position outside a sentence raises its instance's IndexError."""
    g = torch.Generator().manual_seed(2)
    sentences = [torch.randn(n, 3, dtype=torch.float64, generator=g, requires_grad=True) for n in lengths]
    at = [0, -1, 2, 1]
    cf = recompile.function(word_at)
    got = recompile.map(cf, sentences, at)
    assert cf.stats["per_instance"] == {}
    want = [word_at(s, k) for s, k in zip(sentences, at)]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(sum(v.sum() for v in got), sentences),
                               torch.autograd.grad(sum(v.sum() for v in want), sentences))
    with pytest.raises(IndexError):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.PerInstanceWarning)
            recompile.map(cf, sentences, [0, 1, 2, 9])


class SharedStart(nn.Module):
    """A decoder's first input every instance shares (the SOS embedding), through dropout: each instance's own
    mask in training, the value itself out of it; then each instance's own sentence read by its own length."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 6)
        self.dropout = nn.Dropout(0.5)

    @recompile.function
    def forward(self, sentence):
        start = self.dropout(self.embedding(torch.tensor(0)))
        again = F.dropout(self.embedding(torch.tensor(1)), 0.5, self.training)
        n = sentence.size(0)
        return start * sentence[n - 1] + again * float(sentence.size(-1))


def test_dropout_of_a_shared_value_draws_each_instances_own_mask_at_once():
    model = SharedStart().double()
    sentences = [torch.randn(k, 6, dtype=torch.float64) for k in (2, 5, 3, 4)]
    SharedStart.forward.stats.reset()
    model.eval()
    got = recompile.map(model, sentences)
    assert SharedStart.forward.stats["per_instance"] == {}  # (the value itself, once; each one's own size)
    with recompile.disable():
        want = [model(s) for s in sentences]
    torch.testing.assert_close(got, want)
    model.train()
    torch.manual_seed(0)
    got = recompile.map(model, [torch.ones(2, 6, dtype=torch.float64)] * 64)
    assert SharedStart.forward.stats["per_instance"] == {}
    kept = torch.stack([g != 0 for g in got])  # (an element is zero where both masks dropped it: a quarter)
    assert 0.6 < kept.double().mean() < 0.9 and len({tuple(k.tolist()) for k in kept}) > 8  # (masks of their own)
    start = model.embedding.weight
    grad, = torch.autograd.grad(sum(g.sum() for g in got), start)
    assert grad.abs().sum() > 0
