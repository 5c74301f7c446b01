"""A Linear weight's gradient formed once per backward (runtime/lazy_weights.py): the products of a level run's
pieces keep their rows, and one gate per weight and run forms the weight's gradient from all of them."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile.data import Forest
from recompile.runtime import lazy_weights
from test_batching import TreeLSTM, eager_tree_lstm
from test_segments import WORDS, switched, trees

F64 = torch.float64


def products(lazy_on, xs, weight, bias):
    """The sum of ``tanh`` of each ``x @ weight.T + bias``: through one LazyWeight, or by ``F.linear``."""
    lazy = lazy_weights.LazyWeight()
    outs = [lazy_weights.linear(x, weight, bias, lazy) if lazy_on else F.linear(x, weight, bias) for x in xs]
    return sum(torch.tanh(o).sum() for o in outs)


def gates(t):
    """The weights of the weight gates in the autograd graph of ``t``, one for each gate."""
    seen, found, todo = set(), [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "WeightGate" in node.name():
            found.append(node.next_functions[0][0].variable)
        todo.extend(n for n, _ in node.next_functions)
    return found


def node_names(t):
    """The names of the nodes in the autograd graph of ``t``."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {node.name() for node in seen}


def test_deferred_weight_gradients_equal_torchs_and_are_differentiable_again():
    torch.manual_seed(0)
    weight = torch.randn(4, 3, dtype=F64, requires_grad=True)
    bias = torch.randn(4, dtype=F64, requires_grad=True)
    xs = [torch.randn(k, 3, dtype=F64, requires_grad=True) for k in (1, 5, 2)]
    loss = products(True, xs, weight, bias)
    assert len(gates(loss)) == 1  # (one gate for the three products)
    got = torch.autograd.grad(loss, [weight, bias, *xs])
    want = torch.autograd.grad(products(False, xs, weight, bias), [weight, bias, *xs])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    inputs = (weight, bias, *xs)
    assert torch.autograd.gradcheck(lambda w, b, *x: products(True, x, w, b), inputs)
    assert torch.autograd.gradgradcheck(lambda w, b, *x: products(True, x, w, b), inputs)


def test_a_backward_that_does_not_reach_the_gate_leaves_nothing_for_the_next():
    """``autograd.grad`` of the rows only runs the products' backwards, not the gate: a later backward of the
    same graph (retain_graph) forms the weight's gradient from its own rows, not twice as many."""
    torch.manual_seed(0)
    weight = torch.randn(4, 3, dtype=F64, requires_grad=True)
    xs = [torch.randn(k, 3, dtype=F64, requires_grad=True) for k in (3, 2)]
    loss = products(True, xs, weight, None)
    torch.autograd.grad(loss, xs, retain_graph=True)
    loss.backward()
    want, = torch.autograd.grad(products(False, xs, weight, None), [weight])
    torch.testing.assert_close(weight.grad, want)


def test_without_grad_or_with_many_rows_a_product_is_plain_linear():
    weight = torch.randn(4, 3, requires_grad=True)
    many = torch.randn(lazy_weights.FEW_ROWS + 1, 3)
    few = torch.randn(2, 3)
    assert not gates(products(True, [many], weight, None))
    assert gates(products(True, [few], weight, None))
    with torch.no_grad():
        assert products(True, [few], weight, None).grad_fn is None
    frozen = weight.detach()
    assert products(True, [few.requires_grad_()], frozen, None).grad_fn.name() != "_DeferredLinearBackward"


def test_a_level_runs_linears_share_one_gate_per_weight_and_train_as_eager():
    """The Tree-LSTM's node and leaf products of a plain level run, and its node losses' (run once for every
    depth): one gate per weight (none with deferral off; the embedding's lookups keep theirs), and the same
    values and parameter gradients either way."""
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4).double()
    forest = Forest.from_trees(trees())
    encode = recompile.vmap(model.encode, in_dims=(None, 0))

    def run():
        model.zero_grad()
        h, c, loss = encode(forest, forest.roots)
        total = h.sum() + c.sum() * 0.5 + loss.sum()
        found = gates(total)
        total.backward()
        return found, (h.detach(), loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}

    for _ in range(2):  # (the pieces traced: a trace runs each op itself; before it, a guard of another
        run()           # test's trace may fail once, for float64)
    found, values, grads = run()
    with switched(lazy_weights, -1, "FEW_ROWS"):
        off, want_values, want_grads = run()
    weights = [model.embed.weight, model.leaf.weight, model.node.weight, model.out.weight]
    assert sorted(map(id, found)) == sorted(map(id, weights)) and off == [model.embed.weight]
    for a, b in zip(values, want_values):
        torch.testing.assert_close(a, b)
    assert grads.keys() == want_grads.keys()
    for k in want_grads:
        torch.testing.assert_close(grads[k], want_grads[k])


def test_a_weight_changed_in_place_before_the_backward_is_refused_as_torch_refuses_it():
    weight = torch.randn(4, 3, requires_grad=True)
    loss = products(True, [torch.randn(2, 3, requires_grad=True)], weight, None)
    with torch.no_grad():
        weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_a_product_of_few_rows_without_grad_is_linears_by_a_transposed_copy_kept_for_the_next_run(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(7, 3, dtype=dtype), torch.randn(7, dtype=dtype)
    first, second = lazy_weights.LazyWeight(), lazy_weights.LazyWeight()  # (two runs' handles)
    with torch.inference_mode():
        for rows in (1, 5, lazy_weights.SMALL_ROWS):
            x = torch.randn(rows, 3, dtype=dtype)
            torch.testing.assert_close(lazy_weights.linear(x, weight, bias, first), F.linear(x, weight, bias))
            torch.testing.assert_close(lazy_weights.linear(x, weight, None, first), F.linear(x, weight))
        copy = first.flipped[2]
        assert copy.is_contiguous() and copy.shape == (3, 7) and not copy.is_inference()
        x = torch.randn(2, 3, dtype=dtype)
        torch.testing.assert_close(lazy_weights.linear(x, weight, bias, second), F.linear(x, weight, bias))
        assert second.flipped[2] is copy  # (the thread's buffer for this weight, copied into again)
        many = torch.randn(lazy_weights.SMALL_ROWS + 1, 3, dtype=dtype)
        third = lazy_weights.LazyWeight()
        torch.testing.assert_close(lazy_weights.linear(many, weight, bias, third), F.linear(many, weight, bias))
        assert third.flipped is None
        with pytest.raises(RuntimeError):  # (a bias of another dtype refused, as ``F.linear`` refuses it)
            lazy_weights.linear(x, weight, bias.to(torch.float32), second)


def test_a_weight_changed_between_runs_even_through_data_is_copied_again(monkeypatch):
    """torch's version counter does not see a change through ``.data``: each run copies its weights anew."""
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4).double()
    eager = eager_tree_lstm()(len(WORDS) + 1, embed=5, hidden=4).double()
    forest = Forest.from_trees(trees())
    encode = recompile.vmap(model.encode, in_dims=(None, 0))
    copies = []
    transposed = lazy_weights._transposed
    monkeypatch.setattr(lazy_weights, "_transposed", lambda w: copies.append(w) or transposed(w))

    def check():
        eager.load_state_dict(model.state_dict())
        with torch.no_grad():
            got = encode(forest, forest.roots)
            want = [eager.encode(t, t.root) for t in forest.trees()]
        for g, w in zip(got, zip(*want)):
            torch.testing.assert_close(g, torch.stack(w))

    for _ in range(2):  # (traced on the first run)
        check()
    copies.clear()
    model.node.weight.data.mul_(-2.0)
    check()
    assert any(w is model.node.weight for w in copies)
    with torch.no_grad():
        model.node.weight.add_(0.5)
    check()


def test_a_run_leaves_its_weights_storage_resizable_as_fsdp_needs_it():
    """FSDP frees an unsharded parameter between its uses by resizing its storage to 0: the transposed copies a run
    makes must not mark the weight's storage as fixed (``Tensor.numpy()`` does, for good)."""
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4)
    forest = Forest.from_trees(trees())
    encode = recompile.vmap(model.encode, in_dims=(None, 0))
    with torch.no_grad():
        before = encode(forest, forest.roots)[0]  # (products without grad: by the transposed copies)
    encode(forest, forest.roots)[2].sum().backward()
    assert all(p.untyped_storage().resizable() for p in model.parameters())
    for p in model.parameters():  # what FSDP does between a backward and the next forward
        saved = p.detach().clone()
        p.untyped_storage().resize_(0)
        p.untyped_storage().resize_(saved.numel() * saved.element_size())
        p.detach().copy_(saved)
    with torch.no_grad():
        torch.testing.assert_close(encode(forest, forest.roots)[0], before)


def test_a_run_with_grad_after_one_without_trains_as_eager():
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4).double()
    eager = eager_tree_lstm()(len(WORDS) + 1, embed=5, hidden=4).double()
    eager.load_state_dict(model.state_dict())
    forest = Forest.from_trees(trees())
    encode = recompile.vmap(model.encode, in_dims=(None, 0))
    with torch.no_grad():
        encode(forest, forest.roots)  # (its copies made inside inference mode)
    for _ in range(2):
        model.zero_grad()
        h, c, loss = encode(forest, forest.roots)
        (h.sum() + loss.sum()).backward()
    eager.zero_grad()
    want = [eager.encode(t, t.root) for t in forest.trees()]
    (sum(s[0].sum() for s in want) + sum(s[2] for s in want)).backward()
    torch.testing.assert_close(loss.detach(), torch.stack([s[2] for s in want]).detach())
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class Reader(torch.nn.Module):
    """An embedding looked up at every step of a loop, as a sentence model reads its words."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 3, padding_idx=padding_idx)
        self.mix = torch.nn.Linear(3, 3)

    def read(self, words, n):
        h = torch.zeros(3, dtype=self.mix.weight.dtype)
        for t in range(n):
            h = torch.tanh(self.mix(h) + self.embed(words[t]))
        return h


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_a_loops_lookups_share_one_gate_and_give_eagers_gradients(padding_idx):
    """Each step's lookup keeps its indices and gradient, and one gate per table and run adds them up (an
    embedding with options, ``padding_idx``, is torch's own); second derivatives too."""
    torch.manual_seed(0)
    eager = Reader(padding_idx).double()
    model = type("Compiled", (Reader,), {"read": recompile.function(Reader.read)})(padding_idx).double()
    model.load_state_dict(eager.state_dict())
    words = torch.tensor([[1, 2, 0, 3, 4], [5, 0, 6, 1, 2], [3, 3, 3, 0, 0]])
    n = torch.tensor([5, 2, 3])
    got = recompile.vmap(model.read, in_dims=(0, 0))(words, n)
    found = gates(got.sum())
    want = torch.stack([eager.read(words[k], int(n[k])) for k in range(3)])
    torch.testing.assert_close(got, want)
    assert any(w is model.embed.weight for w in found) == (padding_idx is None)
    # (the last two steps run one instance alone: its lookups share the gate too)
    assert ("EmbeddingBackward0" in node_names(got.sum())) == (padding_idx is not None)
    for m, out in ((model, got), (eager, want)):  # (a gradient of the gradient: the gate's backward records)
        g, = torch.autograd.grad((out ** 2).sum(), m.embed.weight, create_graph=True)
        m.zero_grad()
        (g ** 2).sum().backward()
    torch.testing.assert_close(model.embed.weight.grad, eager.embed.weight.grad)
    torch.testing.assert_close(model.mix.weight.grad, eager.mix.weight.grad)


def test_a_table_changed_in_place_before_the_backward_is_refused_as_torch_refuses_it():
    table = torch.randn(5, 3, requires_grad=True)
    out = lazy_weights.embedding(torch.tensor([1, 2]), table, lazy_weights.LazyEmbedding())
    with torch.no_grad():
        table.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _cells():
    yield torch.nn.LSTMCell(5, 4)
    yield torch.nn.GRUCell(5, 4)
    yield torch.nn.RNNCell(5, 4)
    yield torch.nn.RNNCell(5, 4, nonlinearity="relu")


@pytest.mark.parametrize("module", list(_cells()), ids=lambda m: f"{type(m).__name__}-{getattr(m, 'nonlinearity', '')}")
@pytest.mark.parametrize("with_state", [False, True])
def test_a_cell_written_out_gives_torchs_values_and_gradients(module, with_state):
    """``lazy_weights.cell``: the cell as torch computes it, its products' weight gradients by gates; first
    and second derivatives as torch's."""
    torch.manual_seed(0)
    module = module.double()
    x = torch.randn(7, 5, dtype=F64, requires_grad=True)
    state = None
    if with_state:
        h = torch.randn(7, 4, dtype=F64, requires_grad=True)
        state = (h, torch.randn(7, 4, dtype=F64)) if isinstance(module, torch.nn.LSTMCell) else h
    args = (x,) if state is None else (x, state)
    want, got = module(*args), lazy_weights.cell(module, *args)
    want, got = (w if type(w) is tuple else (w,) for w in (want, got))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert len(gates(sum(g.sum() for g in got))) == 2
    inputs = [x, module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh]

    def derivatives(outs):
        grads = torch.autograd.grad(sum((o ** 2).sum() for o in outs), inputs, create_graph=True)
        module.zero_grad()
        sum((g ** 2).sum() for g in grads).backward()
        return [g.detach() for g in grads], [p.grad.clone() for p in module.parameters()]

    for a, b in zip(derivatives(got), derivatives(want)):
        torch.testing.assert_close(a, b)


def test_under_autocast_products_and_cells_are_torchs_own():
    """Autocast runs a product in a lower precision; a deferred backward would mix the dtypes, so there the
    product, and a cell, are torch's own (values, dtypes and gradients as torch gives them)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
    x = torch.randn(2, 4)
    cell = torch.nn.LSTMCell(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lazy_weights.linear(x, weight, bias, lazy_weights.LazyWeight())
        want = F.linear(x, weight, bias)
        got_h, got_c = lazy_weights.cell(cell, x)
        want_h, want_c = cell(x)
    assert got.dtype == want.dtype == torch.bfloat16 and got_h.dtype == want_h.dtype and got_c.dtype == want_c.dtype
    torch.testing.assert_close(got, want)
    g = torch.autograd.grad(got.float().sum() + got_h.float().sum(), [weight, cell.weight_ih])
    w = torch.autograd.grad(want.float().sum() + want_h.float().sum(), [weight, cell.weight_ih])
    for a, b in zip(g, w):
        torch.testing.assert_close(a, b)


def test_a_cell_given_a_state_it_cannot_take_raises_as_torch_does():
    cell = torch.nn.LSTMCell(4, 3)
    x = torch.randn(2, 4)
    bad = (torch.randn(2, 3), torch.randn(2, 1))
    with pytest.raises(RuntimeError) as want:
        cell(x, bad)
    with pytest.raises(RuntimeError, match=re.escape(str(want.value).splitlines()[0])):
        lazy_weights.cell(cell, x, bad)
