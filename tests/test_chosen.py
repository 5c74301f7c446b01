"""Callables the data chooses (runtime/chosen.py): ``self.ops[k](x)`` with k each instance's, one batched call per
module, against eager PyTorch (float64 values and gradients), with no op once per instance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile import config, diagnostics
from test_segments import built, switched

ACTIVATIONS = [torch.tanh, torch.sigmoid, F.relu]


class ModuleNet(nn.Module):
    """A module network: each step applies the module its program names."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ops = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.named = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        self.out = nn.Linear(4, 2)

    def run(self, x, program):
        h = x
        for step in range(program.shape[0]):
            h = ACTIVATIONS[program[step] % 3](self.ops[program[step]](h))
        return self.out(h)

    def tree(self, left, right, op, leaf, i):
        """A node's module chosen by its op, over its children's results (a leaf's is its vector)."""
        if left[i] < 0:
            return leaf[i]
        return torch.tanh(self.ops[op[i]](self.tree(left, right, op, leaf, left[i])
                                          + self.tree(left, right, op, leaf, right[i])))

    def kinds(self, left, right, op, leaf, i):
        """A node's module and activation chosen by its op, over its children's joined results (a leaf's is its
        vector), with a loss per node: a level program, its pieces on plain tensors."""
        if left[i] < 0:
            return leaf[i], leaf[i].sum()
        hl, loss_l = self.kinds(left, right, op, leaf, left[i])
        hr, loss_r = self.kinds(left, right, op, leaf, right[i])
        h = ACTIVATIONS[op[i] % 3](self.ops[op[i]](hl + hr))
        return h, loss_l + loss_r + self.out(h).sum()


def models():
    plain = ModuleNet().double()
    compiled = ModuleNet().double()
    compiled.load_state_dict(plain.state_dict())
    type(compiled).run_c = recompile.function(ModuleNet.run)
    type(compiled).tree_c = recompile.function(ModuleNet.tree)
    type(compiled).kinds_c = recompile.function(ModuleNet.kinds)
    return plain, compiled


def grads(model, value):
    return torch.autograd.grad(value.sum(), list(model.parameters()), allow_unused=True)


def assert_grads(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_each_instance_applies_the_modules_its_program_names():
    plain, compiled = models()
    torch.manual_seed(1)
    xs = torch.randn(7, 4, dtype=torch.float64)
    programs = torch.randint(0, 3, (7, 3))
    want = torch.stack([plain.run(x, p) for x, p in zip(xs, programs)])
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled.run_c)(xs, programs)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert_grads(grads(compiled, got), grads(plain, want))


def test_a_tree_whose_nodes_choose_their_module():
    plain, compiled = models()
    left = torch.tensor([-1, -1, 0, -1, 2, -1, -1, 5])
    right = torch.tensor([-1, -1, 1, -1, 3, -1, -1, 6])
    op = torch.tensor([0, 0, 2, 0, 1, 0, 0, 1])
    torch.manual_seed(2)
    leaf = torch.randn(8, 4, dtype=torch.float64)
    roots = torch.tensor([4, 7, 2])
    want = torch.stack([plain.tree(left, right, op, leaf, r) for r in roots])
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled.tree_c, in_dims=(None, None, None, None, 0))(left, right, op, leaf, roots)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert_grads(grads(compiled, got), grads(plain, want))


def kinds_forest(op):
    """Three trees (depths 1, 2 and 4: the deepest levels hold one node) over 13 nodes, each node's op ``op``."""
    left = torch.tensor([-1, -1, 0, -1, 2, -1, -1, 5, -1, -1, 8, 7, 10])
    right = torch.tensor([-1, -1, 1, -1, 3, -1, -1, 6, -1, -1, 9, 4, 11])
    return left, right, torch.tensor(op), torch.tensor([2, 12, 7])


@pytest.mark.parametrize("op", [[0] * 13, [0, 0, 2, 0, 1, 0, 0, 1, 0, 0, -2, 2, 0],
                                [1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]])
def test_a_level_program_choosing_modules_runs_on_plain_tensors(op):
    """``self.ops[op[i]]`` and ``ACTIVATIONS[op[i] % 3]`` in a recursion that is a level program: each depth's
    rows grouped by the callable they pick, one call each, in the pieces on plain tensors (every row picking
    one, rows picking each, a negative pick, depths of one row), as eager computes it."""
    plain, compiled = models()
    left, right, op, roots = kinds_forest(op)
    torch.manual_seed(3)
    leaf = torch.randn(13, 4, dtype=torch.float64)
    pairs = [plain.kinds(left, right, op, leaf, r) for r in roots]
    want = torch.stack([h for h, _ in pairs]), torch.stack([loss for _, loss in pairs])
    pieces = built(ModuleNet.kinds_c, ModuleNet).unit.levels.plain
    runs, failures = pieces.runs, pieces.failures
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled.kinds_c, in_dims=(None, None, None, None, 0))(left, right, op, leaf, roots)
    assert pieces.runs == runs + 1 and pieces.failures == failures
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    assert_grads(grads(compiled, got[0] + got[1][:, None]), grads(plain, want[0] + want[1][:, None]))


def test_a_pick_past_the_list_in_a_level_program_raises_as_python_does():
    plain, compiled = models()
    left, right, op, roots = kinds_forest([0, 0, 2, 0, 1, 0, 0, 1, 0, 0, 3, 2, 0])
    leaf = torch.zeros(13, 4, dtype=torch.float64)
    with pytest.raises(IndexError) as eager:
        plain.kinds(left, right, op, leaf, roots[1])
    pieces = built(ModuleNet.kinds_c, ModuleNet).unit.levels.plain
    failures = pieces.failures
    with pytest.raises(IndexError) as got:
        recompile.vmap(compiled.kinds_c, in_dims=(None, None, None, None, 0))(left, right, op, leaf, roots)
    assert str(got.value) == str(eager.value)
    assert pieces.failures == failures + 1  # (the pieces on plain tensors gave the run to Batch values, which raised)


def test_a_pick_past_the_list_raises_as_python_does():
    _, compiled = models()
    xs = torch.zeros(2, 4, dtype=torch.float64)
    with pytest.raises(IndexError):
        recompile.vmap(compiled.run_c)(xs, torch.tensor([[0, 1], [1, 3]]))


def test_closures_chosen_by_the_data_run_per_instance_and_say_so(monkeypatch):
    monkeypatch.setattr(diagnostics, "_warned", set())

    def scaled(x, k):
        fns = [lambda v: v * 2.0, lambda v: v - 1.0]  # (each instance's own closures, for all we know)
        return fns[k](x)

    compiled = recompile.function(scaled)
    xs = torch.arange(6.0).reshape(3, 2)
    ks = torch.tensor([0, 1, 0])
    with pytest.warns(recompile.PerInstanceWarning, match="<lambda> runs once per instance"):
        got = recompile.vmap(compiled)(xs, ks)
    torch.testing.assert_close(got, torch.stack([scaled(x, k) for x, k in zip(xs, ks)]))


class Squash:
    """Data objects whose own class's method computes an instance's value (``op.apply(h)``)."""

    def __init__(self, scale):
        self.scale = torch.tensor(scale, dtype=torch.float64)

    def apply(self, h):
        return torch.tanh(h) * self.scale


class Shift(Squash):
    def apply(self, h):
        return h + self.scale

    def record(self, h):
        self.seen = h  # (a change each instance makes to its own object)
        return h * 2.0


@recompile.function
def applied_by_objects(op, x):
    return op.apply(x * 3.0) - x


@recompile.function
def recorded_by_objects(op, x):
    return op.record(x)


def test_methods_of_the_instances_objects_run_once_per_class_with_eagers_gradients(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    ops = [Squash(0.5), Shift(2.0), Shift(-1.0), Squash(3.0), Shift(0.25)]
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    got = recompile.map(applied_by_objects, ops, x)
    want = [applied_by_objects.python(op, row) for op, row in zip(ops, x)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(torch.autograd.grad(sum(g.sum() for g in got), x)[0],
                               torch.autograd.grad(sum(w.sum() for w in want), x)[0])
    assert not applied_by_objects.stats.get("per_instance")


def test_a_method_that_changes_its_object_still_changes_each_instances_own(monkeypatch):
    monkeypatch.setattr(diagnostics, "_warned", set())
    ops = [Shift(1.0), Shift(2.0), Shift(3.0)]
    x = torch.randn(3, 2, dtype=torch.float64)
    with pytest.warns(recompile.PerInstanceWarning, match="record"):
        got = recompile.map(recorded_by_objects, ops, x)
    for op, row, g in zip(ops, x, got):
        torch.testing.assert_close(op.seen, row)
        torch.testing.assert_close(g, row * 2.0)


def combined(a, b=1.0):
    return getattr(a, "scale", a) * b


class Combining(Squash):
    combined = combined  # (the module-level function, as a method: bound, its object first)


@recompile.function
def called_plain_or_bound(op, x, bound):
    fn = op.combined if bound else combined
    return fn(x)


def test_a_function_called_plain_by_some_instances_and_bound_by_others_groups_apart():
    ops = [Combining(1.0), Combining(2.0), Combining(3.0), Combining(4.0)]
    x = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float64)
    bound = [0, 1, 0, 1]
    got = recompile.map(called_plain_or_bound, ops, x, bound)
    want = [called_plain_or_bound.python(op, row, b) for op, row, b in zip(ops, x, bound)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
