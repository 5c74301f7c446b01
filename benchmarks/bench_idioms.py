"""The same tree models spelled as users write them, each against hand-batched PyTorch, in one process.

    python benchmarks/bench_idioms.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R] [--only NAME ...]

Each spelling is a subclass of ``examples/tree_lstm.py``'s TreeLSTM with the same parameters and another
``encode``: the example's ``chunk``; ``split`` by a list of sizes (the hidden size read from the module); slices
by a module constant and ``torch.addcmul``; ``view(...).unbind(0)``; the weights as tensors (``x @ W.t() + b``);
the node's loss written inline (``loss + F.cross_entropy(...)``), added with ``loss += ...``, and as
``loss - log_softmax(...)[label]``, their ops deferred as a call is; a leaf's early return, each branch returning
its own tuple and adding its own node loss; the example's ``node_loss`` left undecorated (compiled as a helper);
a node's children unpacked from a row of one stacked tensor, with ``cat``/``chunk`` along their default dim and
``stack(...).sum(0)``; states kept as (1, H) rows with ``F.linear`` and tensor methods; a leaf's loss started as
``torch.zeros(())`` and the forget terms pooled by ``torch.maximum``; the tree read through
Python numbers (``bool(tree.is_leaf[i])``, ``int(tree.left[i])``, ``.item()``); an ``encode`` that is not
recursive calling ``self.walk(tree, i, 0)``, the recursion with a depth argument; the recursion a nested def of
``encode`` reading ``self`` and ``tree`` from it (``def walk(j): ...``); the recursion returning a dict
read by key, and its state as a namedtuple read by field; the children visited in a loop over ``(tree.left[i],
tree.right[i])``, their states appended to lists and their losses added up, as a list comprehension over them, and
by a ``for`` over a list of them the node builds.
Before it is timed, each is checked against its eager twin (float64: per-tree h, c and loss, and the parameter
gradients) and its per-instance ops are counted (``stats["per_instance"]``, which should be empty). Each is timed
through
``recompile.vmap(model.encode, in_dims=(None, 0))`` over minibatches of SST trees, beside
``bench_batching.hand_batched`` (TensorFlow Fold's height batching, written by hand) on the same parameters, the
runs taking turns; the table gives trees/s and recompile / hand-batched. The RNTN of ``examples/rntn.py`` (its
bilinear form with ``torch.einsum`` on the shared tensor V) and the same form written
``F.linear(x, V.view(...)).view(...) @ x`` go the same way, beside an RNTN batched by hand by height, and so
does the Tree-LSTM written with modules (an ``nn.LSTMCell`` over the projected children, their summed state its
state), beside the same model batched by hand, and a module network: a Tree-RNN whose nodes pick their
composition module from an ``nn.ModuleList`` by the data (which children are leaves), beside the same model batched
by hand by height, each kind one call. Last, three spellings that run one batch per depth on the agenda, not as a
level program, timed to say how far that falls: every node's loss appended to a list the recursion is handed
(DyNet's way: each call fills a list of its own, ``passes.accumulate``), every node's losses returned as lists
the parents join, and the children filtered into a list the node builds (``kids = [j for j in (tree.left[i],
tree.right[i]) if j >= 0]``, a leaf told by ``if not kids``), visited by a ``for`` over it.
"""

import copy
import os
import sys
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from bench_batching import (arguments, by_reader, check_hand_batched, chunks, eager_twin, gradients,  # noqa: E402
                            hand_batched, inputs, level_plan, on_cpu, sst_trees, throughputs)
from rntn import RNTN  # noqa: E402
from sst_runner import SentimentModel  # noqa: E402
from tree_lstm import TreeLSTM  # noqa: E402
from tree_rnn import TreeRNN  # noqa: E402

import recompile  # noqa: E402
from recompile.data import Forest  # noqa: E402

H = 150  # the hidden size, as a module constant (the slices spelling)


class SplitSizes(TreeLSTM):
    @recompile.function
    def encode(self, tree, i):
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
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class SlicesAddcmul(TreeLSTM):
    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            z = self.leaf(self.embed(tree.words[i]))
            ig, og, u = z[..., :H], z[..., H:2 * H], z[..., 2 * H:]
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            z = self.node(torch.cat([hl, hr], dim=-1))
            ig, og, u, fl, fr = z[..., :H], z[..., H:2 * H], z[..., 2 * H:3 * H], z[..., 3 * H:4 * H], z[..., 4 * H:]
            c = torch.addcmul(torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr, torch.sigmoid(ig), torch.tanh(u))
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class UnbindView(TreeLSTM):
    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = self.leaf(self.embed(tree.words[i])).view(3, H).unbind(0)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            ig, og, u, fl, fr = self.node(torch.cat([hl, hr], dim=-1)).view(5, H).unbind(0)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class WeightsMatmul(TreeLSTM):
    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            y = self.embed(tree.words[i]) @ self.leaf.weight.t() + self.leaf.bias
            ig, og, u = torch.chunk(y, 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            y = torch.cat([hl, hr], dim=-1) @ self.node.weight.t() + self.node.bias
            ig, og, u, fl, fr = torch.chunk(y, 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class InlineLoss(TreeLSTM):
    """The node's loss written where it is added, not a call of a compiled ``node_loss``."""

    @recompile.function
    def encode(self, tree, i):
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
        loss = loss + F.cross_entropy(self.out(h).view(1, -1), tree.labels[i].view(1), reduction="sum")
        return h, c, loss


class PlusEquals(TreeLSTM):
    """The node's loss added with ``+=`` (an in-place op on the loss the frame made: ``passes.fresh``)."""

    @recompile.function
    def encode(self, tree, i):
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
        loss += F.cross_entropy(self.out(h).unsqueeze(0), tree.labels[i].unsqueeze(0), reduction="sum")
        return h, c, loss


class MinusLogProbability(TreeLSTM):
    """The node's loss as its log-probability subtracted, ``loss - log_softmax(...)[label]``."""

    @recompile.function
    def encode(self, tree, i):
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
        log_p = F.log_softmax(self.out(h), -1)
        return h, c, loss - log_p[tree.labels[i]]


class EarlyReturn(TreeLSTM):
    """A leaf returns early; each branch returns its own tuple and adds its own node loss."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            h = torch.sigmoid(og) * torch.tanh(c)
            return h, c, self.node_loss(h, tree.labels[i])
        hl, cl, loss_l = self.encode(tree, tree.left[i])
        hr, cr, loss_r = self.encode(tree, tree.right[i])
        ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
        c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        h = torch.sigmoid(og) * torch.tanh(c)
        return h, c, loss_l + loss_r + self.node_loss(h, tree.labels[i])


class PythonNumbers(TreeLSTM):
    """The tree read through Python numbers: ``if bool(tree.is_leaf[i])``, ``int(tree.left[i])``,
    ``tree.right[i].item()``."""

    @recompile.function
    def encode(self, tree, i):
        if bool(tree.is_leaf[i]):
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, int(tree.left[i]))
            hr, cr, loss_r = self.encode(tree, tree.right[i].item())
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class UnpackedChildren(TreeLSTM):
    """The children as a row of one stacked tensor, unpacked (``l, r = children[i]``); ``cat`` and ``chunk`` along
    their default dim; the forget mix as ``torch.stack([...]).sum(0)``."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            left, right = torch.stack([tree.left, tree.right], 1)[i]
            hl, cl, loss_l = self.encode(tree, left)
            hr, cr, loss_r = self.encode(tree, right)
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat((hl, hr))), 5)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.stack([torch.sigmoid(fl) * cl, torch.sigmoid(fr) * cr]).sum(0)
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class RowStates(TreeLSTM):
    """States kept as (1, H) rows; ``F.linear`` with the modules' weights; the methods ``.sigmoid()``, ``.tanh()``;
    the node's loss inline on a (1,) label."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            x = self.embed(tree.words[i].view(1))
            ig, og, u = F.linear(x, self.leaf.weight, self.leaf.bias).chunk(3, dim=1)
            c = ig.sigmoid() * u.tanh()
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            ig, og, u, fl, fr = F.linear(torch.cat([hl, hr], 1), self.node.weight, self.node.bias).chunk(5, dim=1)
            c = ig.sigmoid() * u.tanh() + fl.sigmoid() * cl + fr.sigmoid() * cr
            loss = loss_l + loss_r
        h = og.sigmoid() * c.tanh()
        loss = loss + F.cross_entropy(self.out(h), tree.labels[i].view(1), reduction="sum")
        return h, c, loss


class ZeroTensorMaximum(TreeLSTM):
    """A leaf's loss started as ``torch.zeros(())``; the children's forget terms pooled by ``torch.maximum``."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = torch.zeros(())
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.maximum(torch.sigmoid(fl) * cl, torch.sigmoid(fr) * cr)
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class UndecoratedLoss(TreeLSTM):
    """The example's ``encode`` with its ``node_loss`` an undecorated method (``runtime.helpers`` compiles it)."""

    def node_loss(self, h, label):
        return F.cross_entropy(self.out(h).unsqueeze(0), label.unsqueeze(0), reduction="sum")


class DepthWalk(TreeLSTM):
    """A ``forward``-style entry that is not recursive, calling the recursion with a depth argument."""

    @recompile.function
    def encode(self, tree, i):
        return self.walk(tree, i, 0)

    @recompile.function
    def walk(self, tree, i, depth):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hl, cl, loss_l = self.walk(tree, tree.left[i], depth + 1)
            hr, cr, loss_r = self.walk(tree, tree.right[i], depth + 1)
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class NestedWalk(TreeLSTM):
    """The recursion a nested def inside ``encode``, reading ``self`` and ``tree`` from it."""

    @recompile.function
    def encode(self, tree, i):
        def walk(j):
            if tree.is_leaf[j]:
                ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[j])), 3, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u)
                loss = 0.0
            else:
                hl, cl, loss_l = walk(tree.left[j])
                hr, cr, loss_r = walk(tree.right[j])
                ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
                loss = loss_l + loss_r
            h = torch.sigmoid(og) * torch.tanh(c)
            return h, c, loss + self.node_loss(h, tree.labels[j])

        return walk(i)


class DictResults(TreeLSTM):
    """The recursion returning a dict, read by key."""

    @recompile.function
    def encode(self, tree, i):
        out = self.walk(tree, i)
        return out["h"], out["c"], out["loss"]

    @recompile.function
    def walk(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            left, right = self.walk(tree, tree.left[i]), self.walk(tree, tree.right[i])
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([left["h"], right["h"]], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * left["c"] + torch.sigmoid(fr) * right["c"]
            loss = left["loss"] + right["loss"]
        h = torch.sigmoid(og) * torch.tanh(c)
        return {"h": h, "c": c, "loss": loss + self.node_loss(h, tree.labels[i])}


class ChildrenLooped(TreeLSTM):
    """The children visited in a loop over ``(tree.left[i], tree.right[i])``, each one's state appended to lists
    and its loss added up."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hs, cs, loss = [], [], 0.0
            for child in (tree.left[i], tree.right[i]):
                h, c, child_loss = self.encode(tree, child)
                hs.append(h)
                cs.append(c)
                loss = loss + child_loss
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat(hs, dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cs[0] + torch.sigmoid(fr) * cs[1]
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class ChildrenComprehended(TreeLSTM):
    """The children's results a list comprehension over ``(tree.left[i], tree.right[i])``, unpacked."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            (hl, cl, loss_l), (hr, cr, loss_r) = [self.encode(tree, j) for j in (tree.left[i], tree.right[i])]
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class ChildrenListed(TreeLSTM):
    """The children a list the node builds, ``children = [tree.left[i], tree.right[i]]``, visited by a ``for`` over
    it: walked as the display itself (``frontend.held_displays``), its body once per child."""

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            children = [tree.left[i], tree.right[i]]
            hs, cs, loss = [], [], 0.0
            for child in children:
                h, c, child_loss = self.encode(tree, child)
                hs.append(h)
                cs.append(c)
                loss = loss + child_loss
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat(hs, dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cs[0] + torch.sigmoid(fr) * cs[1]
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class ChildrenFiltered(TreeLSTM):
    """The children a list the node filters (``kids = [j for j in (tree.left[i], tree.right[i]) if j >= 0]``), a leaf
    told by ``if not kids``, the children's states from a ``for`` over it: one batch per depth on the agenda (its
    calls in a loop, not a level program's branch)."""

    @recompile.function
    def encode(self, tree, i):
        kids = [j for j in (tree.left[i], tree.right[i]) if j >= 0]
        if not kids:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hs, cs, loss = [], [], 0.0
            for j in kids:
                h, c, child_loss = self.encode(tree, j)
                hs.append(h)
                cs.append(c)
                loss = loss + child_loss
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat(hs, dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cs[0] + torch.sigmoid(fr) * cs[1]
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class ChildrenInIfs(TreeLSTM):
    """Each child's call in an ``if`` of its own (``if tree.left[i] >= 0:``), the leaf told after them: both calls
    asked for at once (``passes.fission.split_block``), one batch per depth on the agenda."""

    @recompile.function
    def encode(self, tree, i):
        loss = 0.0
        if tree.left[i] >= 0:
            hl, cl, left_loss = self.encode(tree, tree.left[i])
            loss = loss + left_loss
        if tree.right[i] >= 0:
            hr, cr, right_loss = self.encode(tree, tree.right[i])
            loss = loss + right_loss
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
        else:
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


class AppendedLosses(TreeLSTM):
    """Each node's loss appended to a list the recursion is handed (as DyNet users collect theirs), summed at the
    root by ``torch.stack(losses).sum()``: each call fills a list of its own, which its caller extends its own by
    (``passes.accumulate``), so a node's calls run together; the recursion still changes a list, so it runs on
    the agenda, not as a level program."""

    @recompile.function
    def encode(self, tree, i):
        losses = []
        h, c = self.walk(tree, i, losses)
        return h, c, torch.stack(losses).sum()

    @recompile.function
    def walk(self, tree, i, losses):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
        else:
            hl, cl = self.walk(tree, tree.left[i], losses)
            hr, cr = self.walk(tree, tree.right[i], losses)
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        h = torch.sigmoid(og) * torch.tanh(c)
        losses.append(self.node_loss(h, tree.labels[i]))
        return h, c


class ReturnedLosses(TreeLSTM):
    """Each node's losses returned as a list, the children's concatenated up the tree, summed at the root by
    ``torch.stack(losses).sum()``: each instance's own lists, joined as Python joins them (on the agenda: a list
    result is no level program's)."""

    @recompile.function
    def encode(self, tree, i):
        h, c, losses = self.walk(tree, i)
        return h, c, torch.stack(losses).sum()

    @recompile.function
    def walk(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            losses = []
        else:
            hl, cl, ll = self.walk(tree, tree.left[i])
            hr, cr, lr = self.walk(tree, tree.right[i])
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            losses = ll + lr
        h = torch.sigmoid(og) * torch.tanh(c)
        return h, c, losses + [self.node_loss(h, tree.labels[i])]


State = namedtuple("State", "h c")


class NamedStates(TreeLSTM):
    """The recursion returning its state as a namedtuple, read by field."""

    @recompile.function
    def encode(self, tree, i):
        state, loss = self.walk(tree, i)
        return state.h, state.c, loss

    @recompile.function
    def walk(self, tree, i):
        if tree.is_leaf[i]:
            ig, og, u = torch.chunk(self.leaf(self.embed(tree.words[i])), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            left, loss_l = self.walk(tree, tree.left[i])
            right, loss_r = self.walk(tree, tree.right[i])
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([left.h, right.h], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * left.c + torch.sigmoid(fr) * right.c
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        return State(h, c), loss + self.node_loss(h, tree.labels[i])


class RNTNLinear(RNTN):
    @recompile.function
    def encode(self, tree, i):
        """The RNTN's bilinear form as a Linear of V viewed as a matrix, then a product with x."""
        if tree.is_leaf[i]:
            h = torch.tanh(self.leaf(self.embed(tree.words[i])))
            loss = 0.0
        else:
            hl, loss_l = self.encode(tree, tree.left[i])
            hr, loss_r = self.encode(tree, tree.right[i])
            x = torch.cat([hl, hr], dim=-1)
            d, two_d = self.V.shape[0], self.V.shape[1]
            bilinear = F.linear(x, self.V.view(d * two_d, two_d)).view(d, two_d) @ x
            h = torch.tanh(bilinear + self.W(x))
            loss = loss_l + loss_r
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, loss


def hand_batched_rntn(model, forest):
    """Summed loss over every node of ``forest`` under RNTN ``model``, one batch per height (as
    ``bench_batching.hand_batched`` batches the Tree-LSTM)."""
    plan = level_plan(forest)
    hidden = model.out.in_features
    h = torch.tanh(model.leaf(model.embed(plan.leaf_words)))
    hs, blocks = [h], [by_reader(plan, h, 0)]
    for level, children in enumerate(plan.children, 1):
        x = inputs(blocks, level).index_select(0, children).view(-1, 2 * hidden)
        h = torch.tanh(torch.einsum("bi,kij,bj->bk", x, model.V, x) + model.W(x))
        hs.append(h)
        blocks.append(by_reader(plan, h, level))
    return F.cross_entropy(model.out(torch.cat(hs)), plan.labels, reduction="sum")


class ModuleNetwork(TreeRNN):
    """``examples/tree_rnn.py``'s Tree-RNN with a composition the data chooses, as syntactically untied models pick
    theirs by category: each internal node applies ``self.compose[kind]``, its kind which of its children are
    leaves (four kinds, ``nn.ModuleList``)."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        self.compose = nn.ModuleList([nn.Linear(2 * hidden, hidden) for _ in range(4)])

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            h = torch.tanh(self.leaf(self.embed(tree.words[i])))
            loss = 0.0
        else:
            hl, loss_l = self.encode(tree, tree.left[i])
            hr, loss_r = self.encode(tree, tree.right[i])
            kind = 2 * tree.is_leaf[tree.left[i]].long() + tree.is_leaf[tree.right[i]].long()
            h = torch.tanh(self.compose[kind](torch.cat([hl, hr], dim=-1)))
            loss = loss_l + loss_r
        return h, loss + self.node_loss(h, tree.labels[i])


def hand_batched_modules(model, forest):
    """Summed loss over every node of ``forest`` under ModuleNetwork ``model``, one batch per height, each kind's
    nodes of a height one call of its module."""
    plan = level_plan(forest)
    hidden = model.out.in_features
    h = torch.tanh(model.leaf(model.embed(plan.leaf_words)))
    hs, blocks = [h], [by_reader(plan, h, 0)]
    for level, children in enumerate(plan.children, 1):
        x = inputs(blocks, level).index_select(0, children).view(-1, 2 * hidden)
        leaves = (children < plan.uses[0][level]).view(-1, 2).long()  # (level 0's rows come first in the inputs)
        kind = 2 * leaves[:, 0] + leaves[:, 1]
        h = x.new_empty(x.shape[0], hidden)
        for k, module in enumerate(model.compose):
            at = (kind == k).nonzero().view(-1)
            if at.numel():
                h = h.index_copy(0, at, module(x.index_select(0, at)))
        h = torch.tanh(h)
        hs.append(h)
        blocks.append(by_reader(plan, h, level))
    return F.cross_entropy(model.out(torch.cat(hs)), plan.labels, reduction="sum")


class CellTreeLSTM(SentimentModel):
    """The Tree-LSTM written with modules: an ``nn.LSTMCell`` reads the projection of the children's states,
    their summed (h, c) its state; a leaf runs the cell from a zero state."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.proj = nn.Linear(2 * hidden, embed)
        self.cell = nn.LSTMCell(embed, hidden)
        self.out = nn.Linear(hidden, classes)

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            h, c = self.cell(self.embed(tree.words[i]))
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            h, c = self.cell(self.proj(torch.cat([hl, hr], dim=-1)), (hl + hr, cl + cr))
            loss = loss_l + loss_r
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


def hand_batched_cells(model, forest):
    """Summed loss over every node of ``forest`` under CellTreeLSTM ``model``, one batch per height."""
    plan = level_plan(forest)
    hidden = model.out.in_features
    h, c = model.cell(model.embed(plan.leaf_words))
    hs, h_blocks, c_blocks = [h], [by_reader(plan, h, 0)], [by_reader(plan, c, 0)]
    for level, children in enumerate(plan.children, 1):
        n = plan.sizes[level]
        hlr = inputs(h_blocks, level).index_select(0, children).view(n, 2, hidden)
        clr = inputs(c_blocks, level).index_select(0, children).view(n, 2, hidden)
        h, c = model.cell(model.proj(hlr.view(n, 2 * hidden)), (hlr.sum(1), clr.sum(1)))
        hs.append(h)
        h_blocks.append(by_reader(plan, h, level))
        c_blocks.append(by_reader(plan, c, level))
    return F.cross_entropy(model.out(torch.cat(hs)), plan.labels, reduction="sum")


SPELLINGS = {"chunk (the example)": TreeLSTM, "split by sizes": SplitSizes, "slices, addcmul": SlicesAddcmul,
             "view, unbind": UnbindView, "x @ W.t() + b": WeightsMatmul, "loss inline": InlineLoss,
             "loss +=": PlusEquals, "loss - log p": MinusLogProbability, "early return": EarlyReturn,
             "node_loss undecorated": UndecoratedLoss, "children unpacked": UnpackedChildren,
             "(1, H) rows, F.linear": RowStates, "zeros(()) loss, maximum": ZeroTensorMaximum,
             "int(), bool(), .item()": PythonNumbers, "forward, depth argument": DepthWalk,
             "nested def walk": NestedWalk,
             "dict results": DictResults, "namedtuple states": NamedStates,
             "children in a for, appended": ChildrenLooped, "children comprehended": ChildrenComprehended,
             "children in a list, looped": ChildrenListed}
RNTN_SPELLINGS = {"RNTN einsum (example)": RNTN, "RNTN linear of V.view": RNTNLinear}
CELL_SPELLINGS = {"nn.LSTMCell": CellTreeLSTM}
MODULE_SPELLINGS = {"modules chosen by kind": ModuleNetwork}
# Spellings that run one batch per depth on the agenda, not as a level program: timed to say how far that falls.
LIST_SPELLINGS = {"losses appended": AppendedLosses, "losses returned": ReturnedLosses}
FILTERED_SPELLINGS = {"children filtered": ChildrenFiltered, "children in ifs of their own": ChildrenInIfs}


def check(cls, base, trees, device="cpu"):
    """Raise unless ``cls``, over a forest through recompile.vmap (on ``device``), gives its eager twin's per-tree
    values and parameter gradients (float64, on the CPU); returns its per-instance op counts."""
    eager = eager_twin(cls)(base.embed.num_embeddings).double()
    eager.load_state_dict(base.state_dict())
    model = cls(base.embed.num_embeddings).double().to(device)
    model.load_state_dict(base.state_dict())
    cls.encode.stats.reset()
    want = [eager.encode(tree, tree.root) for tree in trees]
    want_grads = gradients(eager, sum(w[-1] for w in want))
    forest = Forest.from_trees(trees).to(device)
    got = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    for value, wanted in zip(got, zip(*want)):
        assert value.device.type == torch.device(device).type
        torch.testing.assert_close(value.cpu(), torch.stack(wanted).detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(on_cpu(gradients(model, got[-1].sum())), want_grads, rtol=1e-7, atol=1e-9)
    return dict(cls.encode.stats.get("per_instance", {}))


def recompile_loss(model):
    """forest -> minibatch loss through ``recompile.vmap`` (the loss is the last of what encode returns)."""
    encode = recompile.vmap(model.encode, in_dims=(None, 0))
    return lambda forest: encode(forest, forest.roots)[-1].sum()


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--only", nargs="+", default=None, help="time only the spellings whose names hold one of these")
    args = parser.parse_args(argv)
    data, sst, trees = sst_trees(args)
    forests = {size: [Forest.from_trees(chunk) for chunk in chunks(trees, size)] for size in args.batch}
    print(f"{len(trees)} SST trees from {data}, {args.threads} torch thread(s); each spelling checked against "
          "eager (float64: every value returned per tree, and the parameter gradients) before it is timed")
    for family, spellings, hand_loss in (("Tree-LSTM (embed 300, hidden 150)", SPELLINGS, hand_batched),
                                         ("RNTN (embed 300, hidden 50)", RNTN_SPELLINGS, hand_batched_rntn),
                                         ("Tree-LSTM of module cells (embed 300, hidden 150)", CELL_SPELLINGS,
                                          hand_batched_cells),
                                         ("Tree-RNN of modules chosen by the data (embed 300, hidden 150)",
                                          MODULE_SPELLINGS, hand_batched_modules),
                                         ("Tree-LSTM, node losses in lists", LIST_SPELLINGS, hand_batched),
                                         ("Tree-LSTM, children filtered or in ifs", FILTERED_SPELLINGS,
                                          hand_batched)):
        torch.manual_seed(0)
        base = next(iter(spellings.values()))(len(sst.vocab))
        if args.only:
            spellings = {name: cls for name, cls in spellings.items() if any(part in name for part in args.only)}
            if not spellings:
                continue
        print(family)
        check_hand_batched(base, trees[:8], hand_loss)
        print(f"  {'hand-batched':22} matches eager (float64: the loss and its gradients)")
        for name, cls in spellings.items():
            counts = check(cls, base, trees[:8])
            print(f"  {name:22} matches eager; per-instance ops: {counts or 'none'}")
        models = {name: cls(len(sst.vocab)) for name, cls in spellings.items()}
        for model in models.values():
            model.load_state_dict(base.state_dict())
        hand = copy.deepcopy(base)
        print(f"{'':22} {'mode':>9} {'batch':>5} {'hand trees/s':>13} {'recompile trees/s':>18} {'rec/hand':>9}")
        for mode, train in (("inference", False), ("training", True)):
            for size in args.batch:
                runs = {"hand": (lambda forest, hand=hand: hand_loss(hand, forest), hand, forests[size])}
                runs.update({name: (recompile_loss(m), m, forests[size]) for name, m in models.items()})
                best = throughputs(runs, train, args.repeats)
                for name in spellings:
                    rec = best[name]
                    if isinstance(rec, Exception):
                        print(f"{name:22} {mode:>9} {size:5d} {best['hand']:13.1f} {type(rec).__name__:>18} "
                              f"{'-':>9}")
                        continue
                    print(f"{name:22} {mode:>9} {size:5d} {best['hand']:13.1f} {rec:18.1f} "
                          f"{rec / best['hand']:8.2f}x")


if __name__ == "__main__":
    main()
