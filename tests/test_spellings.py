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
