"""The same models written as users write them batch the same way (issue: every spelling batches).

Each spelling ``benchmarks/bench_idioms.py`` times (the Tree-LSTM five ways, the RNTN two ways), with the sizes
of ``test_segments``' trees, runs over a forest through ``recompile.vmap``: every value it returns and the
parameter gradients equal eager PyTorch's per tree (float64), no op runs once per instance
(``stats["per_instance"]`` is empty), and the recursion runs as a plain level program (no Batch values
between its pieces), as the spelling of the example does (a node looping over a list of its children: on the
agenda, one run per depth; a module chosen by the data: a level program on Batch values). Then cases where computing a value once for
every instance would be wrong, each checked against eager; recurrent cells in a tree; and idioms beyond the
benchmark's models (views, fields of what an op returns, ``sum`` of a list, mixed dtypes, ...), each batched
with no op once per instance and each instance's values and dtypes.
"""

import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import config, diagnostics
from recompile.data import Forest
from test_segments import WORDS, assert_same, switched, trees

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_copied  # noqa: E402  (models as users copy them)
import bench_idioms  # noqa: E402  (the spellings the benchmark times)
from bench_batching import eager_twin  # noqa: E402

SPELLINGS = {**bench_idioms.SPELLINGS, **bench_idioms.RNTN_SPELLINGS, **bench_idioms.CELL_SPELLINGS,
             **bench_idioms.MODULE_SPELLINGS}
# a dict the recursion returns with a node's deferred loss in it: no late split (a tuple's elements only), so no
# plain run; a level program on Batch values
STRUCT_RESULTS = set()
# spellings calling a module the data chooses (runtime.chosen): a level program, its pieces on Batch values (a plain
# piece has no form for each kind's own call)
CHOSEN_MODULES = {"modules chosen by kind"}


def small(cls):
    """A model of spelling ``cls`` with the sizes of test_segments' trees (embedding 5, hidden 4), float64."""
    hidden = 4 if issubclass(cls, bench_idioms.TreeLSTM) else 2  # (an RNTN's tensor is hidden x (2 hidden)^2)
    return cls(len(WORDS) + 1, embed=5, hidden=hidden).double()


def run(model, forest):
    model.zero_grad()
    out = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    (out[0].sum() + out[-1].sum()).backward()
    return tuple(v.detach() for v in out), grads(model)


def eager(cls, model, tree_list):
    plain = eager_twin(cls)(len(WORDS) + 1, embed=5, hidden=model.out.in_features).double()
    plain.load_state_dict(model.state_dict())
    outs = [plain.encode(t, t.root) for t in tree_list]
    values = tuple(torch.stack([o[j] for o in outs]) for j in range(len(outs[0])))
    (values[0].sum() + values[-1].sum()).backward()
    return tuple(v.detach() for v in values), grads(plain)


def grads(model):
    """Each parameter's gradient; none where the trees never reach it (a module the data never chooses)."""
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_each_spelling_batches_as_the_example_does(name, monkeypatch):
    cls = SPELLINGS[name]
    monkeypatch.setattr(bench_idioms, "H", 4)  # (the slices' module constant, read when the program runs)
    torch.manual_seed(0)
    model = small(cls)
    forest = Forest.from_trees(trees())
    cls.encode.stats.reset()
    for _ in range(2):  # (the first call traces the level program's pieces)
        assert_same(run(model, forest), eager(cls, model, trees()))
    assert cls.encode.stats.get("per_instance", {}) == {}
    recursion = getattr(cls, "walk", cls.encode)  # (an encode that is not recursive calls ``walk``)
    lifted = cls.encode.parsed.lifted.get("walk")  # (or a nested def of that name: frontend.lifting)
    recursion = lifted.function if lifted is not None else recursion
    levels = recursion.callee(cls).batched_unit.levels
    if name in STRUCT_RESULTS or name in CHOSEN_MODULES:
        assert levels.runs >= 2 and levels.fallbacks == 0, (levels.runs, levels.fallbacks)
    else:
        assert levels.plain.runs >= 2, (levels.runs, levels.plain.runs, levels.plain.refused)


# -- what is computed once stays right: each a case where sharing one value would be wrong


def bump(z):  # an undecorated helper that changes its argument in place
    z += 1
    return z


def zeros_bumped(x):
    z = torch.zeros(3, dtype=x.dtype)
    return x + bump(z)


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3).double()

    def count(self, x):
        return x * len(list(self.parameters()))  # (a generator per instance: each consumes its own)


def draws(x, w):
    return x + torch.dropout(w, 0.5, True) + torch.distributions.Normal(0.0, 1.0).sample((3,)).double()


SHAPE = [2, 3]


def view_by_list(x):
    return (x * 2).view(SHAPE).sum(-1)


def index_by(x, i):
    return (x * 2)[i] + 1


AGENDA_SPELLINGS = {**bench_idioms.LIST_SPELLINGS, **bench_idioms.FILTERED_SPELLINGS}


@pytest.mark.parametrize("name", list(AGENDA_SPELLINGS))
def test_spellings_on_the_agenda_batch_by_depth_with_eagers_values_and_no_warning(name, monkeypatch):
    """A node's calls run together (each call appending to a list of its own, ``passes.accumulate``; each
    instance's lists joined as Python joins them; the children filtered into a list, ``if not kids``), one batch
    per depth, with no op once per instance and nothing warned."""
    cls = AGENDA_SPELLINGS[name]
    monkeypatch.setattr(diagnostics, "_warned", set())  # (an earlier run may have warned of these lines)
    torch.manual_seed(0)
    model = small(cls)
    forest = Forest.from_trees(trees())
    cls.encode.stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        got = run(model, forest)
    assert_same(got, eager(cls, model, trees()))
    assert cls.encode.stats.get("per_instance", {}) == {}
    depths = 1 + max(depth_of(t, t.root) for t in trees())
    assert cls.encode.stats["batches"][cls.encode.callee(cls).qualname]["runs"] <= depths


def depth_of(tree, i):
    return 0 if tree.is_leaf[i] else 1 + max(depth_of(tree, tree.left[i]), depth_of(tree, tree.right[i]))


def test_a_helper_changing_a_value_computed_once_changes_its_instances_copy():
    x = torch.arange(4.0, dtype=torch.float64).unsqueeze(1).expand(4, 3).clone()
    got = recompile.vmap(recompile.function(zeros_bumped))(x)
    torch.testing.assert_close(got, torch.stack([zeros_bumped(r) for r in x]))


def bump_only(z):  # an undecorated helper that changes its argument and hands nothing back
    z += 1


def product_bumped(x, w):
    v = w[0] * w[1]  # (computed once for every instance where nothing changes it in place)
    bump_only(v)
    return x * v


def bump_returned(z):
    z += 1
    return {"z": z.unsqueeze(0)}  # (a view of the changed copy, handed back in a dict)


BY_NAME = {"bump": bump_only, "returned": bump_returned}  # (helpers read at run time: not known when built)


def product_bumped_by_name(x, w):
    v = w[0] * w[1]
    BY_NAME["bump"](v)
    return x * v


def product_bumped_and_handed_back(x, w):
    return x * BY_NAME["returned"](w[0] * w[1])["z"][0]


class Bumping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.full((2, 3), 2.0, dtype=torch.float64)

    def bump(self, z):
        z += 1

    def forward(self, x):
        v = self.w[0] * self.w[1]
        self.bump(v)
        return x * v


def bump_through(z):  # (changes its argument through another helper)
    bump_only(z)


def product_bumped_through(x, w):
    v = w[0] * w[1]
    bump_through(v)
    return x * v


class StaticBump(Bumping):
    @staticmethod
    def bump(z):
        z += 1


def bumped_down(d, x, w):
    v = w[0] * w[1]
    bump_only(v)
    if d > 0:
        return bumped_down(d - 1, x * 0.5, w) + bumped_down(d - 2, x, w) * v
    return x * v


def test_a_helper_changing_a_value_computed_once_changes_the_value_eager_code_changes():
    """A helper of the user's that changes what it is given (``bump(v)``, ``self.bump(v)``, a static method,
    a helper that calls one that does) makes the run compute ``v`` for each instance, so the code after the
    call reads the changed value, recursion and a single call included."""
    x, w = torch.ones(4, 3, dtype=torch.float64), torch.full((2, 3), 2.0, dtype=torch.float64)
    got = recompile.vmap(recompile.function(product_bumped), in_dims=(0, None))(x, w)
    torch.testing.assert_close(got, torch.stack([product_bumped(r, w) for r in x]))
    m = Bumping()
    compiled = recompile.function(Bumping.forward).__get__(m)
    torch.testing.assert_close(recompile.vmap(compiled)(x), torch.stack([m(r) for r in x]))
    got = recompile.vmap(recompile.function(product_bumped_through), in_dims=(0, None))(x, w)
    torch.testing.assert_close(got, torch.stack([product_bumped_through(r, w) for r in x]))
    m = StaticBump()
    compiled = recompile.function(StaticBump.forward).__get__(m)
    torch.testing.assert_close(recompile.vmap(compiled)(x), torch.stack([m(r) for r in x]))
    f, d = recompile.function(bumped_down), torch.tensor([3, 2, 4, 1])
    torch.testing.assert_close(recompile.vmap(f, in_dims=(0, 0, None))(d, x, w),
                               torch.stack([bumped_down(int(k), r, w) for k, r in zip(d, x)]))
    torch.testing.assert_close(f(3, x[0], w), bumped_down(3, x[0], w))


def test_a_helper_changing_a_value_computed_once_without_handing_it_back_warns():
    """A helper the program reads at run time (from a dict) is not known when the run starts: each instance's
    call changes its own copy, which the code after the call does not see, where eager code reads the changed
    value. It warns, naming the helper (a copy handed back, a view of it in a dict too, is what the caller
    reads)."""
    x, w = torch.ones(4, 3, dtype=torch.float64), torch.full((2, 3), 2.0, dtype=torch.float64)
    with pytest.warns(recompile.SharedChangeWarning, match="bump_only changed in place a tensor of shape \\(3,\\)"):
        recompile.vmap(recompile.function(product_bumped_by_name), in_dims=(0, None))(x, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.SharedChangeWarning)
        got = recompile.vmap(recompile.function(product_bumped_and_handed_back), in_dims=(0, None))(x, w)
        torch.testing.assert_close(got, torch.stack([product_bumped_and_handed_back(r, w) for r in x]))
        with torch.inference_mode():  # (no version to compare: no warning, no error)
            recompile.vmap(recompile.function(product_bumped_and_handed_back), in_dims=(0, None))(x, w)


class Counted:
    """An iterable of the program's own (no iterator): each iteration draws its next number."""

    def __init__(self):
        self.k = 0

    def __iter__(self):
        self.k += 1
        return iter([self.k, 0])


COUNTED, SEEN, LISTS, SETTINGS_OF_LISTS = Counted(), [], [[1], [2, 3]], {"sizes": [1, 2]}


def builtins_running_the_programs_code(x):  # (a builtin that runs the program's code runs for each instance)
    drawn = list(COUNTED)[0]
    order = sorted([2, 1], key=lambda s: (SEEN.append(s), s)[1])
    return x * drawn + order[0]  # (not len(SEEN): the instances' effects interleave in a batch)


def builtins_handing_back_what_exists(x):  # (a list a builtin hands back is the one that exists, not a copy)
    same = (max(LISTS) is LISTS[1]) + (SETTINGS_OF_LISTS.get("sizes") is SETTINGS_OF_LISTS["sizes"])
    return x * same


def test_a_builtin_of_shared_values_runs_once_only_where_python_would_give_every_instance_the_same():
    xs = torch.randn(4, 3, dtype=torch.float64)
    for fn, once in ((builtins_running_the_programs_code, False), (builtins_handing_back_what_exists, True)):
        COUNTED.k = 0
        SEEN.clear()
        want = torch.stack([fn(x) for x in xs])
        COUNTED.k = 0
        SEEN.clear()
        compiled = recompile.function(fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if not once else "error", recompile.PerInstanceWarning)
            got = recompile.vmap(compiled)(xs)
        torch.testing.assert_close(got, want)
        assert (compiled.stats.get("per_instance", {}) == {}) is once
        assert len(SEEN) == (0 if once else 2 * len(xs))  # (each instance's key calls)


def test_a_method_of_a_module_and_random_draws_run_for_each_instance():
    m = TwoLinears()
    m.count = recompile.function(TwoLinears.count).__get__(m)
    x = torch.ones(4, 3, dtype=torch.float64)
    torch.testing.assert_close(recompile.vmap(m.count)(x), x * 4)
    out = recompile.vmap(recompile.function(draws), in_dims=(0, None))(torch.zeros(4, 3, dtype=torch.float64),
                                                                       torch.ones(3))
    assert len({tuple(row.tolist()) for row in out}) == 4  # (each instance its own draws)


def test_a_trace_relying_on_a_list_or_an_index_checks_it_on_every_call():
    f = recompile.function(view_by_list)
    x = torch.arange(24.0, dtype=torch.float64).view(4, 6)
    for _ in range(2):
        torch.testing.assert_close(recompile.vmap(f)(x), torch.stack([view_by_list(r) for r in x]))
    SHAPE[:] = [3, 2]  # (the very list the trace read, changed in place)
    try:
        torch.testing.assert_close(recompile.vmap(f)(x), torch.stack([view_by_list(r) for r in x]))
    finally:
        SHAPE[:] = [2, 3]
    g = recompile.vmap(recompile.function(index_by), in_dims=(0, None))
    x = torch.arange(30.0, dtype=torch.float64).view(5, 6)
    for i in (1, 1, True, 2, slice(1, 3), (Ellipsis, 1)):  # (True after 1: equal, but not the same index)
        torch.testing.assert_close(g(x, i), torch.stack([index_by(r, i) for r in x]))


class CellTree(torch.nn.Module):
    """A binary tree model written with a recurrent cell: a node's cell reads its children's summed state."""

    def __init__(self, cell):
        super().__init__()
        self.embed = torch.nn.Embedding(len(WORDS) + 1, 5)
        self.proj = torch.nn.Linear(8, 5)
        self.cell = cell(5, 4)
        self.out = torch.nn.Linear(4, 5)

    def node_loss(self, h, label):
        return torch.nn.functional.cross_entropy(self.out(h), label)


def gru_cell_tree(self, tree, i):
    if tree.is_leaf[i]:
        h = self.cell(self.embed(tree.words[i]))
        loss = 0.0
    else:
        hl, _, loss_l = self.encode(tree, tree.left[i])
        hr, _, loss_r = self.encode(tree, tree.right[i])
        h = self.cell(self.proj(torch.cat([hl, hr], dim=-1)), hl + hr)
        loss = loss_l + loss_r
    return h, h, loss + self.node_loss(h, tree.labels[i])


@pytest.mark.parametrize("cell", [torch.nn.GRUCell, torch.nn.RNNCell])
def test_a_tree_of_recurrent_cells_runs_as_a_plain_level_program(cell):
    """(The LSTMCell's tree is a spelling of the benchmark's, above.)"""
    torch.manual_seed(0)
    encode = gru_cell_tree
    cls = type(f"Tree{cell.__name__}", (CellTree,), {"encode": recompile.function(encode),
                                                     "node_loss": recompile.function(CellTree.node_loss)})
    model = cls(cell).double()
    plain = type("Eager", (CellTree,), {"encode": encode})(cell).double()
    plain.load_state_dict(model.state_dict())
    forest = Forest.from_trees(trees())
    for _ in range(2):
        model.zero_grad()
        h, c, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        (h.sum() + c.sum() + loss.sum()).backward()
        want = [plain.encode(t, t.root) for t in trees()]
        plain.zero_grad()
        sum(w[0].sum() + w[1].sum() + w[2] for w in want).backward()
        for got, k in zip((h, c, loss), range(3)):
            torch.testing.assert_close(got, torch.stack([w[k] for w in want]).detach())
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert cls.encode.stats.get("per_instance", {}) == {}
    assert cls.encode.callee(cls).batched_unit.levels.plain.runs >= 2


class PoolTree(torch.nn.Module):
    """A Tree-RNN's parameters, for cells written with ops the level pieces have no raw form of."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(len(WORDS) + 1, 5)
        self.leaf = torch.nn.Linear(5, 4)
        self.compose = torch.nn.Linear(8, 4)
        self.mix = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.norm = torch.nn.LayerNorm(4)
        self.out = torch.nn.Linear(4, 5)

    def node_loss(self, h, label):
        return torch.nn.functional.cross_entropy(self.out(h), label)


def pooled_children(self, tree, i):
    """The children stacked and pooled by ``sum(0)`` and ``max(0).values``."""
    if tree.is_leaf[i]:
        h = torch.tanh(self.leaf(self.embed(tree.words[i])))
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        kids = torch.stack([hl, hr])
        h = torch.tanh(self.compose(torch.cat([kids.sum(0), kids.max(0).values], -1)))
        loss = loss_l + loss_r
    return h, loss + self.node_loss(h, tree.labels[i])


def attended_children(self, tree, i):
    """The children weighted by ``torch.softmax`` over them of their norms."""
    if tree.is_leaf[i]:
        h = torch.tanh(self.leaf(self.embed(tree.words[i])))
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        a = torch.softmax(torch.stack([hl.norm(dim=-1), hr.norm(dim=-1)]), dim=0)
        h = torch.tanh(self.compose(torch.cat([a[0] * hl + a[1] * hr, hl - hr], dim=-1)))
        loss = loss_l + loss_r
    return h, loss + self.node_loss(h, tree.labels[i])


def sequential_normed(self, tree, i):
    """An ``nn.Sequential`` and an ``nn.LayerNorm`` after the composition; the word's row read off the
    embedding's weight (a Parameter indexed by each leaf's word)."""
    if tree.is_leaf[i]:
        h = self.norm(torch.tanh(self.leaf(self.embed.weight[tree.words[i]])))
        loss = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        h = self.norm(self.mix(self.compose(torch.cat([hl, hr], dim=-1))))
        loss = loss_l + loss_r
    return h, loss + self.node_loss(h, tree.labels[i])


def zero_children(self, tree, i):
    """One cell for every node: a leaf's children are zero states made from the weight (``new_zeros``), shared
    by every leaf (``a * b`` of them once); ``chunk`` along its default dim, as a method."""
    if tree.is_leaf[i]:
        hl = hr = self.compose.weight.new_zeros(4)
        x = self.leaf(self.embed(tree.words[i]))
        below = 0.0
    else:
        hl, loss_l = self.encode(tree, tree.left[i])
        hr, loss_r = self.encode(tree, tree.right[i])
        x = self.compose.weight.new_zeros(4)
        below = loss_l + loss_r
    z = torch.cat([hl * hr, hl - hr]).chunk(2)
    h = torch.tanh(self.compose(torch.cat(z)) + x)
    return h, below + self.node_loss(h, tree.labels[i])


@pytest.mark.parametrize("encode", [pooled_children, attended_children, sequential_normed, zero_children],
                         ids=lambda f: f.__name__)
def test_cells_of_ops_without_a_raw_form_run_as_a_plain_level_program(encode):
    torch.manual_seed(0)
    cls = type(f"Tree_{encode.__name__}", (PoolTree,), {"encode": recompile.function(encode),
                                                        "node_loss": recompile.function(PoolTree.node_loss)})
    model = cls().double()
    plain = type("Eager", (PoolTree,), {"encode": encode})().double()
    plain.load_state_dict(model.state_dict())
    forest = Forest.from_trees(trees())
    for _ in range(2):
        model.zero_grad()
        h, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        (h.pow(2).sum() + loss.sum()).backward()
        want = [plain.encode(t, t.root) for t in trees()]
        plain.zero_grad()
        sum(w[0].pow(2).sum() + w[1] for w in want).backward()
        for got, k in zip((h, loss), range(2)):
            torch.testing.assert_close(got, torch.stack([w[k] for w in want]).detach())
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert cls.encode.stats.get("per_instance", {}) == {}
    levels = cls.encode.callee(cls).batched_unit.levels
    assert levels.plain.runs >= 2 and not levels.plain.refused, (levels.plain.runs, levels.plain.refused)


# -- idioms beyond the benchmark's models: each op of a vector per instance batches (no op once per instance),
# with each instance's values and dtypes

H = 4
_g = torch.Generator().manual_seed(3)
W = torch.randn(H, H, generator=_g, dtype=torch.float64)
B = torch.randn(H, generator=_g, dtype=torch.float64)
NORM = torch.nn.LayerNorm(H).double()


def idiom_stack_sum(x, k):
    return torch.stack([x, x * 2]).sum(0)


def idiom_where(x, k):
    return torch.where(x > 0, x, x * 0.1)


def idiom_like(x, k):
    return torch.zeros_like(x) + x.new_zeros(H) + x.new_ones(x.shape)


def idiom_views(x, k):
    return x.unsqueeze(0).squeeze(0).view(-1).reshape(2, 2).t().transpose(0, 1).permute(1, 0).flatten()


def idiom_softmax(x, k):
    return torch.nn.functional.softmax(x, dim=-1) + torch.nn.functional.log_softmax(x, -1)


def idiom_fields(x, k):
    return x.max(dim=-1).values + x.argmax(-1) + x.max(-1)[1] + torch.sort(x).values + torch.topk(x, 2).values.sum()


def idiom_addmm(x, k):
    return torch.addmm(B, x.unsqueeze(0), W).squeeze(0)


def idiom_indexing(x, k):
    return x[..., None].squeeze(-1) + x[None, :][0] + x[1:3].sum() + x[-1]


def idiom_norms(x, k):
    return torch.nn.functional.gelu(NORM(x)) + torch.nn.functional.layer_norm(x, (H,))


def idiom_bmm(x, k):
    return torch.bmm(x.view(1, 2, 2), W[:2, :2].unsqueeze(0)).view(-1)


def idiom_reductions(x, k):
    return torch.cat([x[:2], x[2:]]) * x.norm() + x.mean() - x.std() + x.cumsum(0)


def idiom_chain(x, k):
    return torch.tanh(x @ W + B).clamp(-0.5, 0.5).pow(2).sqrt()


def idiom_pad(x, k):
    return torch.nn.functional.pad(x, (1, 1))[1:-1] + torch.nn.functional.normalize(x, dim=-1)


def idiom_select(x, k):
    return x.narrow(0, 1, 2).sum() + x.index_select(0, torch.tensor([0, 2])).sum() + x.gather(0, torch.tensor([1]))


def idiom_python_sum(x, k):
    hs = [x, x * 2, x * 3]
    return sum(hs) + torch.stack(hs).mean(0) + sum(hs, x)


def idiom_einsum_outer(x, k):
    return torch.einsum("i,ij->j", x, W) + x.outer(x).sum(0)


def idiom_repeat(x, k):
    return x.expand(2, H).sum(0) + x.repeat(2)[:H] + x.flip(0) + x.roll(1)


def idiom_masks(x, k):
    return x.masked_fill(x > 0, 0.0) + x.abs().log1p() + torch.nn.functional.cosine_similarity(x, x * 2, dim=0)


def idiom_mixed_dtypes(x, k):
    return (x.max(-1).values + k, x.sum() * k.double(), (x > 0) + k, k / 2 + x[0], x[0].float() * x,
            x.float()[0] * x.double())


def idiom_bitwise(x, k):
    m = (x > 0) & (x < 1) | ~(x > 2)
    return m.float() + x % 0.5 + x // 0.3 + k % 2 + ((x > 0) ^ (x < 0.5)) + torch.logical_or(x > 1, x < -1)


def idiom_sizes_and_constants(x, k):
    return x * len(x) + x / math.sqrt(H) + x * math.log(H) + x * x.size(-1)


def idiom_list_and_tensor_index(x, k):
    return x[[0, 2]].sum() * x + x[torch.tensor([1, 3])].sum() + W[[0, 1]].sum() * x


LAYERS = torch.nn.ModuleList([torch.nn.Linear(H, H).double() for _ in range(2)])


def idiom_module_list(x, k):
    for layer in LAYERS:
        x = torch.tanh(layer(x))
    return x * x.numel() + x.view(2, 2).T.reshape(-1) + x.view(1, 2, 2).mT.reshape(-1)


def idiom_reversed_module_list(x, k):
    for layer in reversed(LAYERS):  # (a list every instance shares, read from its end: each layer once for all)
        x = torch.tanh(layer(x))
    for j, layer in enumerate(reversed(LAYERS)):
        x = x + layer(x) * j
    return x


def idiom_filtered_list(x, k):  # (each instance's own list, kept where its test holds; a branch on its truth)
    hs = [x * (j + 1) for j in range(k)]
    kept = [h for h in hs if h.sum() > 0]
    return (torch.stack(kept).sum(0) if kept else x * 3) + len(kept)


SIZES, NAMES, SETTINGS = [1, 3], ("a", "b"), {"scale": 2.0}


def idiom_builtins_of_shared_values(x, k):  # (Python's builtins and a container's reads of shared values: once)
    n = sum(SIZES) + round(H / 3) + divmod(7, 2)[0] + sorted(SIZES, reverse=True)[0] + min([3, H, 5])
    n = n + NAMES.index("b") + len("-".join(NAMES)) + any([s > 2 for s in SIZES]) + pow(H, 2)
    return x * n * SETTINGS.get("scale", 1.0) + pow(x, 2) + x[:sum(SIZES)].sum() + x.split(SIZES)[1].sum()


def idiom_built_lists(x, k):
    hs = [h * 2 for h in (x, x + 1)]  # (a comprehension: appends to a list the program built)
    ones = [1.0] * H
    return torch.stack(list(x.split(2)) + list(x.split(2))).sum(0).repeat(2) + torch.cat(hs)[:H] * x.new_tensor(ones)


def zeros_of(size):  # an undecorated helper given only shared values (a state's start)
    return torch.zeros(size, dtype=torch.float64)


def idiom_helper_of_shared_values(x, k):
    h, c = zeros_of(H), zeros_of(H)
    for _ in range(2):
        h, c = torch.tanh(x + h), c + h
    return h.add(c)


def idiom_helper_of_shared_values_changed(x, k):
    h = zeros_of(H)
    h += x  # (an in-place change of the helper's result: each instance its own row)
    return h * 2 + zeros_of(H)


def idiom_items_of_each_instances_list(x, k):
    hs = [x * (j + 1) for j in range(k)]  # (each instance's own length)
    return hs[-1] + hs[0] + tuple(hs)[-1]


def list_appended_in_a_branch(x, k):
    hs = [x]
    if x.sum() > 0:
        hs.append(x * 2)
    else:
        hs.append(x * 3)
    hs.append(x.view(2, 2).T.reshape(-1) + x.view(1, 2, 2).mT.reshape(-1))
    return torch.stack(hs).sum(0)


def idiom_joined_then_iterated(x, k):  # (a value the instances' branches made apart: its rows, its shape)
    h = x * 2.0 if k > 2 else x - 1.0
    acc = h.sum() * h.size()[0] + h.dim() + h.numel()
    for j, v in enumerate(h):
        acc = acc + v * j
    return acc


def idiom_joined_then_activated_in_place(x, k):
    h = x * 2.0 if k > 2 else x - 1.0
    h.relu_()
    g = torch.tanh(x) if k > 3 else x * 0.5
    g.sin_()  # (held apart, and not only the frame's: the tensors' stack, changed by vmap's batching rule)
    g[0] += 1.0
    return h + g


def idiom_python_numbers(x, k):  # (each instance's Python numbers, as Python computes them: no torch op per instance)
    s = float(x[0].item()) + round(float(x[1]), 2) + math.exp(float(x[2])) + k.item() / 2
    if x.sum().item() > 0:
        s = s * 2
    return abs(x) * s


def idiom_pointer_mask(x, k):  # (each instance's own position: one write of every instance's row)
    j = torch.argmax(x)
    used = torch.zeros(H, dtype=x.dtype)
    used[j] = 1.0
    h = x * 1.0
    h[j] += 2.0
    return h * (1.0 - used)


def idiom_data(x, k):  # (its values, detached: the batch's rows')
    return x * 2.0 + x.data.sum()


def idiom_index_add_into_zeros(x, k):
    z = torch.zeros_like(x)
    z.index_add_(0, torch.tensor([0, 0, 1, 1]), x * k)
    return z


def idiom_table_of_constants(x, k):  # (a nested list of shared numbers: one tensor, made once)
    return x.view(2, 2) @ torch.tensor([[1.0, 0.0], [0.5, 2.0]], dtype=torch.float64)


def idiom_lists_of_numbers(x, k):  # (shared lists repeated and set; each instance's Python numbers, one tensor)
    scale = torch.tensor([0.5] * H, dtype=torch.float64)
    hs = [None] * 3
    hs[0], hs[-1] = x * scale, x.tanh()
    numbers = torch.tensor([float(v) * 2 for v in x], dtype=torch.float64) + torch.tensor(x.tolist())
    return hs[0] + hs[2] + numbers


BAG = torch.nn.EmbeddingBag(7, H, mode="sum").double()


def idiom_losses_and_bags_vmap_has_no_rule_for(x, k):
    words = (x.abs() * 3).long().clamp(max=6)
    columns = torch.column_stack([x, x * k, x.sin()])
    nll = F.gaussian_nll_loss(x, x.flip(0), x.abs() + 0.5) + F.multi_margin_loss(columns, k % 3 + words * 0)
    return BAG(words, torch.tensor([0, 2])).sum(0) * nll + torch.isin(words, torch.tensor([1, 2])) + x.real


IDIOMS = [v for name, v in dict(globals()).items() if name.startswith("idiom_")]


@pytest.mark.parametrize("fn", IDIOMS, ids=lambda f: f.__name__[len("idiom_"):])
def test_each_idiom_batches_with_each_instances_values_and_dtypes(fn):
    xs = torch.randn(5, H, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ks = torch.tensor([1, 2, 3, 4, 5])
    compiled = recompile.function(fn)
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled, in_dims=(0, 0))(xs, ks)
    want = [fn(x, k) for x, k in zip(xs, ks)]
    got, want = (got, tuple(torch.stack(v) for v in zip(*want))) if type(want[0]) is tuple \
        else ((got,), (torch.stack(want),))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


def test_a_list_appended_to_in_a_branch_is_each_instances_own_list():
    """A built list split by a branch becomes each instance's own list (appends to it then run per instance), so
    what the branch appended is in the list the caller reads after the ``if``."""
    xs = torch.randn(5, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ks = torch.tensor([1, 2, 3, 4, 5])
    compiled = recompile.function(list_appended_in_a_branch)
    with switched(config, "allow", "PER_INSTANCE"):
        got = recompile.vmap(compiled, in_dims=(0, 0))(xs, ks)
    torch.testing.assert_close(got, torch.stack([list_appended_in_a_branch(x, k) for x, k in zip(xs, ks)]))


@pytest.mark.parametrize("kind", [torch.nn.GRU, torch.nn.LSTM, torch.nn.RNN])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("shape", ["sequence", "batch of sequences"])
@pytest.mark.parametrize("start", ["zeros", "given"])
def test_an_rnn_module_over_each_instances_sequences_is_one_call(kind, batch_first, shape, start):
    """``nn.GRU`` / ``LSTM`` / ``RNN`` (two layers, both ways) over each instance's sequence (L, D) or batch of
    them: one call of the module over every instance's sequences, values and gradients as each instance's."""
    torch.manual_seed(0)
    module = kind(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first).double()
    lstm = kind is torch.nn.LSTM

    def read(x, h, c):
        if start == "zeros":
            out, ends = module(x)
        else:
            out, ends = module(x, (h, c) if lstm else h)
        last = ends[0] * ends[1] if lstm else ends
        return out.sum(-1), last

    n, length, rows = 3, 5, 2
    seq = (n, length, 3) if shape == "sequence" else (n, rows, length, 3) if batch_first else (n, length, rows, 3)
    state = (n, 4, 4) if shape == "sequence" else (n, 4, rows, 4)
    g = torch.Generator().manual_seed(1)
    x, h, c = (torch.randn(*sh, generator=g, dtype=torch.float64, requires_grad=True) for sh in (seq, state, state))
    compiled = recompile.function(read)
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled)(x, h, c)
    want = [read(x[k], h[k], c[k]) for k in range(n)]
    want = tuple(torch.stack([w[j] for w in want]) for j in range(2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    grads = torch.autograd.grad(sum(v.sum() for v in got), (x, h, c) if start == "given" else (x,), allow_unused=True)
    wants = torch.autograd.grad(sum(v.sum() for v in want), (x, h, c) if start == "given" else (x,), allow_unused=True)
    for a, b in zip(grads, wants):
        if b is not None:
            torch.testing.assert_close(a, b)


def dict_of_states(x, k):
    d = {"h": torch.tanh(x), "c": x * 2, 1: x.sum()}
    assert isinstance(d, dict)
    return {"out": d["h"] * d["c"] + d[1], "h": d["h"]}


def dict_changed(x, k):
    d = {"h": torch.tanh(x)}
    d["c"] = d["h"] * 2  # (a change: each instance's own dict)
    return d["c"] + len(d)


def test_a_dict_with_shared_keys_is_held_as_its_values_and_vmap_returns_dicts():
    xs = torch.randn(5, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ks = torch.arange(5)
    compiled = recompile.function(dict_of_states)
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled, in_dims=(0, 0))(xs, ks)
    want = [dict_of_states(x, k) for x, k in zip(xs, ks)]
    assert type(got) is dict and list(got) == ["out", "h"]
    for key in got:
        torch.testing.assert_close(got[key], torch.stack([w[key] for w in want]))
    changed = recompile.function(dict_changed)
    with switched(config, "error", "PER_INSTANCE"):  # (a key set: the struct's own change, every instance's)
        got = recompile.vmap(changed, in_dims=(0, 0))(xs, ks)
    torch.testing.assert_close(got, torch.stack([dict_changed(x, k) for x, k in zip(xs, ks)]))


def vmapped_as_eager(fn, xs, per_instance="error"):
    """``recompile.vmap`` of ``fn`` over ``xs`` (which requires grad) against eager's loop: values and the
    gradient of their sum, with ``config.PER_INSTANCE`` set to ``per_instance``."""
    with switched(config, per_instance, "PER_INSTANCE"):
        got = recompile.vmap(recompile.function(fn))(xs)
    want = torch.stack([torch.as_tensor(fn(x)) for x in xs])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


@recompile.function
def scale_its_h(s, v):
    s["h"] = s["h"] * v
    return v


def dict_set_and_read(x):
    s = {"h": x, "c": x * 2}
    s["h"] = s["h"] + s["c"]
    return s["h"].sum()


def dict_set_through_another_name(x):
    s = {"h": x}
    t = s
    t["h"] = x * 3
    return s["h"].sum()


def dict_set_by_a_compiled_callee(x):
    s = {"h": x, "c": x}
    scale_its_h(s, 2.0)
    return s["h"].sum() + s["c"].sum()


def dict_set_while_a_list_holds_it(x):
    s = {"h": x}
    held = [s]
    s["h"] = x * 4
    return held[0]["h"].sum()


def dict_given_new_keys(x):
    s = {1: x}
    s["new"] = x * 3
    s[True] = x * 2  # (the key 1's place: Python keeps its first key)
    s["w"] = 2.0
    return (s["new"] + s[1]).sum() * s["w"] + len(s)


def dict_set_in_a_loop(x):
    s = {"acc": x * 0, "inner": {"h": x}}
    for i in range(3):
        s["acc"] = s["acc"] + x * i
    s["inner"]["h"] = x * 2
    return s["acc"].sum() + s["inner"]["h"].sum()


def dict_set_after_a_read(x):
    s = {"h": x}
    old = s["h"]
    s["h"] = old * 2
    return old.sum() + s["h"].sum()


def dict_set_in_a_branch_and_copied(x):
    s = {"h": x}
    copies = dict(s), s.copy(), {**s}
    if x.sum() > 0:  # (some instances: each instance's own dict from here on, as its own call changes it)
        s["h"] = x * 5
    return s["h"].sum() + sum(c["h"].sum() for c in copies)


@pytest.mark.parametrize("fn, per_instance", [
    (dict_set_and_read, "error"), (dict_set_through_another_name, "error"), (dict_set_by_a_compiled_callee, "error"),
    (dict_set_while_a_list_holds_it, "error"), (dict_given_new_keys, "error"), (dict_set_in_a_loop, "error"),
    (dict_set_after_a_read, "error"), (dict_set_in_a_branch_and_copied, "allow")],
    ids=lambda v: getattr(v, "__name__", v))
def test_a_key_set_in_a_dict_the_program_built_changes_the_dict_every_name_of_it_sees(fn, per_instance):
    """``d[key] = v`` (a key every instance shares) of a dict display held as its values changes that struct,
    batched: its other names (another variable, a list holding it, a compiled callee's parameter) see it."""
    xs = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    vmapped_as_eager(fn, xs, per_instance)


def dict_walk(left, xs, i):
    if left[i] < 0:
        out = {"h": xs[i] * 2.0, "n": xs[i].sum()}  # (a leaf's own dict: one instance's is a plain dict)
    else:
        a, b = dict_walk(left, xs, left[i]), dict_walk(left, xs, left[i] + 1)
        out = {"h": torch.tanh(a["h"] + b["h"]), "n": a["n"] + b["n"]}
    return out


def dict_walk_changed(left, xs, i):
    a = dict_walk(left, xs, i)
    a["h"] = a["h"] * 3.0  # (a change to the callee's dict: each instance's own)
    a["n"] = a["n"] + 1.0
    return a["h"] * a["n"]


def test_dicts_a_recursion_returns_are_held_as_their_values_and_changed_as_each_instances_own():
    """Joined by the cond and cut for the calls that asked, a dict the recursion builds stays its values (no
    dict per instance until one is needed, no ``getitem`` once per instance); a caller that changes it changes
    its instance's own dict."""
    left = torch.tensor([1, 3, -1, -1, -1, -1])
    xs = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    roots = torch.tensor([0, 1, 2, 5])
    walk = recompile.function(dict_walk)
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(walk, in_dims=(None, None, 0))(left, xs, roots)
    want = [dict_walk(left, xs, int(r)) for r in roots]
    assert type(got) is dict and list(got) == ["h", "n"]
    for key in got:
        torch.testing.assert_close(got[key], torch.stack([w[key] for w in want]))
    torch.testing.assert_close(torch.autograd.grad(got["h"].sum(), xs),
                               torch.autograd.grad(sum(w["h"].sum() for w in want), xs))
    namespace = dict(dict_walk_changed.__globals__, dict_walk=walk)
    changed = recompile.function(type(dict_walk_changed)(dict_walk_changed.__code__, namespace, "dict_walk_changed"))
    with switched(config, "allow", "PER_INSTANCE"):
        got = recompile.vmap(changed, in_dims=(None, None, 0))(left, xs, roots)
    torch.testing.assert_close(got, torch.stack([dict_walk_changed(left, xs, int(r)) for r in roots]))


def dict_aliased(x, k):
    d = {"h": x}
    if k > 1:
        out = d
    else:
        out = {"h": x * 2.0}
    out["h"] = out["h"] + 1.0  # (where out is d, d changes too)
    return d["h"] + out["h"]


def test_a_dict_one_branch_hands_on_stays_that_dict_where_the_program_changes_it():
    xs = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ks = torch.tensor([0, 2, 1, 3])
    with switched(config, "allow", "PER_INSTANCE"):
        got = recompile.vmap(recompile.function(dict_aliased))(xs, ks)
    torch.testing.assert_close(got, torch.stack([dict_aliased(x, k) for x, k in zip(xs, ks)]))


class InPlaceInSequence(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = torch.nn.Sequential(torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.Linear(4, 4))

    def forward(self, x):
        z = self.seq(x)
        return z + sum([z, z])  # (``sum`` of a list: the traced segment stops there, after the Sequential ran)


def test_a_sequential_changing_its_input_in_place_is_run_once():
    """A module that changes its input in place (``inplace=True``) is not run again by a trace that gives up:
    the caller's tensor is changed once, as eager changes it."""
    torch.manual_seed(0)
    model = InPlaceInSequence().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    want_x = x.clone()
    want = torch.stack([model(want_x[k]) for k in range(3)])
    got_x = x.clone()
    got = recompile.vmap(recompile.function(InPlaceInSequence.forward).__get__(model))(got_x)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got, want)


def noise_of(size):  # an undecorated helper that draws: each call its own numbers
    return torch.rand(size, dtype=torch.float64)


def noisy(x):
    return x + noise_of(H)


def test_a_helper_of_shared_values_that_draws_draws_for_each_instance():
    """A helper given only shared values runs once for the group, and the draw inside it, as eager code makes
    it, is each instance's own."""
    got = recompile.vmap(recompile.function(noisy))(torch.zeros(5, H, dtype=torch.float64))
    assert len({tuple(row.tolist()) for row in got}) == 5


# -- a run that changes values in place: what it changes is each instance's own, or the caller's, as in eager code

def two_zeros():  # (helpers of no argument, their results changed in place by the caller)
    return [torch.zeros(H, dtype=torch.float64), {"h": torch.zeros(H, dtype=torch.float64)}]


def zeros_row():
    return torch.zeros(2, H, dtype=torch.float64)[0]  # (a view of a tensor the helper made)


def helper_results_changed(x):
    hs = two_zeros()
    hs[0].add_(x)
    hs[1]["h"].add_(x * 2)
    v = zeros_row()
    v.add_(x)
    return hs[0] + hs[1]["h"] + v


def test_what_a_helper_of_shared_values_hands_back_is_each_instances_own_to_change():
    xs = torch.arange(4 * H, dtype=torch.float64).reshape(4, H)
    got = recompile.vmap(recompile.function(helper_results_changed))(xs)
    torch.testing.assert_close(got, torch.stack([helper_results_changed(x) for x in xs]))


def changes_the_shared_argument(x, w):
    d = w.to(torch.float64)  # (w itself, as eager's)
    d.add_(1.0)
    m = max([w, w * 0.5], key=lambda t: float(t.sum()))  # (w again)
    m.mul_(1.0)
    return x + 0.0 * d


def changes_a_leaf(x):
    z = torch.zeros(H, dtype=torch.float64, requires_grad=True)
    z.add_(x)  # (eager refuses: a leaf that requires grad)
    return z


def changes_what_exp_saved(x, w):
    v = torch.exp(input=w)  # (by keyword: exp's backward reads its result)
    v.mul_(2.0)
    return x * v


def test_a_shared_result_that_is_an_argument_or_a_leaf_or_saved_is_changed_as_eager_changes_it():
    xs = torch.arange(3 * H, dtype=torch.float64).reshape(3, H)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        recompile.vmap(recompile.function(changes_the_shared_argument), in_dims=(0, None))(xs, w)
    assert torch.equal(w, torch.tensor([4.0, 5.0, 6.0, 7.0], dtype=torch.float64))  # (each instance's add_)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        recompile.vmap(recompile.function(changes_a_leaf))(xs)
    w = w.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        recompile.vmap(recompile.function(changes_what_exp_saved), in_dims=(0, None))(xs, w).sum().backward()


W_ROWS = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(8))


def masked_sum_and_mean(x):
    m = x > 0.3
    return x[m].sum() + (x[m].mean() if m.any() else x.sum() * 0.0)


def masked_rows_pooled(x):
    keep = x.sum(1) > 0  # (rows of x: each instance's stretch of rows)
    chosen = x[keep]
    return chosen.sum(0) * 2.0 + chosen.abs().sum(0) + len(chosen)


def masked_elements_of_a_matrix(x):
    return torch.softmax(x[x < 0.5], 0).max() + x[x < 0.5].numel()


def masked_rows_of_a_shared_tensor(x):
    return (W_ROWS[x[:, 0] > 0] * 3.0).sum(0) + x[0]


@pytest.mark.parametrize("fn", [masked_sum_and_mean, masked_rows_pooled, masked_elements_of_a_matrix,
                                masked_rows_of_a_shared_tensor], ids=lambda f: f.__name__)
def test_a_mask_of_each_instances_own_chooses_its_stretch_batched(fn):
    """``x[x > 0]``: each instance's chosen elements (or rows), a length of its own, one index of the batch's
    rows, and what reduces them (``sum``, ``mean``, ``max`` along them, ``len``) batched; an instance that
    chooses none gets eager's empty tensor."""
    xs = torch.randn(6, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    xs[0] = -1.0  # (none chosen)
    xs = xs.requires_grad_()
    vmapped_as_eager(fn, xs)


def masked_select_of_each(x):
    return torch.masked_select(x, x > 0.2).sum() + x.masked_select(W_ROWS[:, :1] > 0).sum()


def places_of_a_shared_pair_of_indices(x):
    pairs = torch.tril_indices(4, 3)
    return x[pairs[0], pairs[1]].sum() + x[[0, 2], 1].sum() + x[1, [0, 2]].sum()


def element_chosen_by_each_instances_int(x):
    k = int(x.argmax()) % 3 - 1  # (-1, 0 or 1: a negative index too)
    return [x[0] * 2.0, x[1], W_ROWS[2]][k].sum() + (x[0], x[2])[k % 2][1]


@pytest.mark.parametrize("fn", [masked_select_of_each, places_of_a_shared_pair_of_indices,
                                element_chosen_by_each_instances_int], ids=lambda f: f.__name__)
def test_selections_of_each_instances_own_or_shared_places_are_batched(fn):
    """``masked_select`` (each instance's stretch, as ``x[m]``), a tuple of shared index tensors side by side
    (the places every instance picks), and a list the program built indexed by each instance's int (one gather
    from the elements' stack): one op for the group, eager's values and gradients."""
    xs = torch.randn(5, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9), requires_grad=True)
    vmapped_as_eager(fn, xs)


def element_past_the_end(x):
    return [x, x * 2.0][int(x.sum() > 0) * 2]  # (2 for some instances: Python's IndexError for them)


def test_a_list_index_past_the_end_raises_pythons_index_error():
    xs = torch.tensor([[1.0], [-1.0], [2.0]], dtype=torch.float64)
    with pytest.raises(IndexError, match="list index out of range"):
        element_past_the_end(xs[0])
    with pytest.raises(IndexError, match="list index out of range"):
        recompile.vmap(recompile.function(element_past_the_end))(xs)


def gumbel_hard(x):
    return F.gumbel_softmax(x, tau=0.5, hard=True)


def gumbel_along_dim_zero(x):
    return F.gumbel_softmax(x, 1.0, False, 1e-10, 0)


def test_gumbel_softmax_draws_for_every_instance_at_once_along_each_instances_dim():
    torch.manual_seed(0)
    x = torch.randn(2000, 5, requires_grad=True)
    with switched(config, "error", "PER_INSTANCE"):
        y = recompile.vmap(recompile.function(gumbel_hard))(x)
        soft = recompile.vmap(recompile.function(gumbel_along_dim_zero))(torch.randn(3, 5, 2))
    assert y.shape == (2000, 5) and torch.equal(y.sum(-1), torch.ones(2000))
    # (the noise is each instance's own: the largest logit wins about as often as Gumbel's argmax says, not always)
    assert 0.4 < (y.argmax(-1) == x.argmax(-1)).float().mean() < 0.9
    torch.testing.assert_close(soft.sum(1), torch.ones(3, 2))
    (grad,) = torch.autograd.grad((y * torch.arange(5.0)).sum(), x)
    assert grad.abs().sum() > 0


def pytorch_tree(idx, children=()):
    """A tree as treelstm.pytorch holds it (``bench_copied.Tree``): ``idx`` the word's position, its children."""
    tree = bench_copied.Tree()
    tree.idx = idx
    for child in children:
        tree.add_child(child)
    return tree


def pytorch_trees():
    leaf = pytorch_tree
    return [pytorch_tree(0, [leaf(1), pytorch_tree(2, [leaf(3), leaf(0), leaf(1)])]), leaf(2),
            pytorch_tree(1, [leaf(0)]), pytorch_tree(3, [pytorch_tree(1, [leaf(2), leaf(3)]), leaf(0)]),
            pytorch_tree(2, [leaf(0), leaf(1)])]


def test_treelstm_pytorchs_cell_as_users_copy_it_batches_whole_with_eagers_values_and_gradients():
    """Each op of it batched: the leaf's states made by a tensor's methods (written anew: nothing changes in
    place), the children's states of each node's own count (stretches, a leaf's one row among them), the cell
    an undecorated helper run once for the group on them."""
    torch.manual_seed(0)
    model = bench_copied.ChildSumTreeLSTM(3, 4).double()  # (treelstm.pytorch's, states returned)
    trees = pytorch_trees()
    sentences = [torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
                 for k in range(len(trees))]
    with switched(config, "error", "PER_INSTANCE"):
        for _ in range(2):
            got = recompile.map(model, trees, sentences)
    loss = sum((c * 0.5 + h).sum() for c, h in got)
    got_grads = torch.autograd.grad(loss, list(model.parameters()))
    with recompile.disable():
        want = [model(t, s) for t, s in zip(trees, sentences)]
    want_grads = torch.autograd.grad(sum((c * 0.5 + h).sum() for c, h in want), list(model.parameters()))
    for (gc, gh), (wc, wh) in zip(got, want):
        torch.testing.assert_close((gc, gh), (wc, wh))
    torch.testing.assert_close(got_grads, want_grads)
