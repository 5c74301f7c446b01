"""The same Tree-LSTM cell written as users write it batches the same way (issue: every spelling batches).

Each spelling of ``test_batching.lstm_encode`` (hidden size 4, the models of ``test_segments``) runs over a
forest through ``recompile.vmap``: values and parameter gradients equal eager PyTorch's per tree (float64),
no op runs once per instance (``stats["per_instance"]`` is empty), and the recursion runs as a plain level
program (no Batch values between its pieces), as the spelling of the example does.
"""

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile.data import Forest
from test_segments import Params, assert_same, trees

H = 4  # the hidden size of test_segments.Params, as a module constant


def node_loss(self, h, label):
    """A node's loss: a compiled call whose result is only returned, run once for every depth (deferred)."""
    return F.cross_entropy(self.out(h), label)


def chunks(self, tree, i):
    if tree.is_leaf[i]:
        ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(c)
    return h, c, loss + self.node_loss(h, tree.labels[i])


def split_sizes(self, tree, i):
    """``split`` with a list of sizes built from the module's hidden size."""
    hidden = self.out.in_features
    if tree.is_leaf[i]:
        ig, og, u = self.leaf(self.embed(tree.words[i])).split([hidden, hidden, hidden], -1)
        c = torch.sigmoid(ig) * torch.tanh(u)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        gates, forget = self.node(torch.cat([hl, hr], dim=-1)).split([3 * hidden, 2 * hidden], -1)
        ig, og, u = gates.split(hidden, dim=-1)
        fl, fr = torch.split(forget, [hidden, hidden], -1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(c)
    return h, c, loss + self.node_loss(h, tree.labels[i])


def slices_addcmul(self, tree, i):
    """Slices by a module constant and ``torch.addcmul``."""
    if tree.is_leaf[i]:
        z = self.leaf(self.embed(tree.words[i]))
        ig, og, u = z[..., :H], z[..., H:2 * H], z[..., 2 * H:]
        c = torch.sigmoid(ig) * torch.tanh(u)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        z = self.node(torch.cat([hl, hr], dim=-1))
        ig, og, u, fl, fr = z[:H], z[H:2 * H], z[2 * H:3 * H], z[3 * H:4 * H], z[4 * H:]
        c = torch.addcmul(torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr, torch.sigmoid(ig), torch.tanh(u))
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(c)
    return h, c, loss + self.node_loss(h, tree.labels[i])


def unbind_view(self, tree, i):
    """``unbind`` of a view whose shape is the module's hidden size."""
    if tree.is_leaf[i]:
        ig, og, u = self.leaf(self.embed(tree.words[i])).view(3, H).unbind(0)
        c = torch.sigmoid(ig) * torch.tanh(u)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        ig, og, u, fl, fr = self.node(torch.cat([hl, hr], dim=-1)).reshape(5, H).unbind(0)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(c)
    return h, c, loss + self.node_loss(h, tree.labels[i])


def weights_matmul(self, tree, i):
    """The weights as tensors: ``x @ W.t() + b``, and a state of zeros made with ``torch.zeros``."""
    if tree.is_leaf[i]:
        y = self.embed(tree.words[i]) @ self.leaf.weight.t() + self.leaf.bias
        ig, og, u = torch.chunk(y, 3, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.zeros(H, dtype=y.dtype)
        loss = 0.0
    else:
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        y = torch.matmul(torch.cat([hl, hr], dim=-1), self.node.weight.T) + self.node.bias
        ig, og, u, fl, fr = torch.chunk(y, 5, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        loss = loss_l + loss_r
    h = torch.sigmoid(og) * torch.tanh(c)
    return h, c, loss + self.node_loss(h, tree.labels[i])


SPELLINGS = [chunks, split_sizes, slices_addcmul, unbind_view, weights_matmul]


def eager(fn, model, tree_list):
    plain = type("Eager", (Params,), {"encode": fn, "node_loss": node_loss})().double()
    plain.load_state_dict(model.state_dict())
    outs = [plain.encode(t, t.root) for t in tree_list]
    h, c, loss = (torch.stack([o[j] for o in outs]) for j in range(3))
    (h.sum() + c.sum() * 0.5 + loss.sum()).backward()
    return (h.detach(), c.detach(), loss.detach()), {k: p.grad.clone() for k, p in plain.named_parameters()}


@pytest.mark.parametrize("fn", SPELLINGS, ids=[f.__name__ for f in SPELLINGS])
def test_each_spelling_batches_as_the_example_does(fn):
    torch.manual_seed(0)
    cls = type(fn.__name__, (Params,), {"encode": recompile.function(fn), "node_loss": recompile.function(node_loss)})
    model = cls().double()
    forest = Forest.from_trees(trees())
    for _ in range(2):  # (the first call traces the level program's pieces)
        model.zero_grad()
        h, c, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        (h.sum() + c.sum() * 0.5 + loss.sum()).backward()
        got = (h.detach(), c.detach(), loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}
        assert_same(got, eager(fn, model, trees()))
    assert cls.encode.stats.get("per_instance", {}) == {}
    levels = cls.encode.callee(cls).batched_unit.levels
    assert levels.runs == 2 and levels.plain.runs == 2, (levels.runs, levels.plain.runs, levels.plain.refused)


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


def test_a_helper_changing_a_value_computed_once_changes_its_instances_copy():
    x = torch.arange(4.0, dtype=torch.float64).unsqueeze(1).expand(4, 3).clone()
    got = recompile.vmap(recompile.function(zeros_bumped))(x)
    torch.testing.assert_close(got, torch.stack([zeros_bumped(r) for r in x]))


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
