"""The same Tree-LSTM spelled as users write it, each against hand-batched PyTorch, in one process.

    python benchmarks/bench_idioms.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R]

Each spelling is a subclass of ``examples/tree_lstm.py``'s TreeLSTM with the same parameters and another
``encode``: the example's ``chunk``; ``split`` by a list of sizes (the hidden size read from the module);
slices by a module constant and ``torch.addcmul``; ``view(...).unbind(0)``; the weights as tensors
(``x @ W.t() + b``). Before it is timed, each is checked against its eager twin (float64: per-tree h, c and
loss, and the parameter gradients) and its per-instance ops are counted (``stats["per_instance"]``, which
should be empty). Each is timed through ``recompile.vmap(model.encode, in_dims=(None, 0))`` over minibatches
of SST trees, beside ``bench_batching.hand_batched`` (TensorFlow Fold's height batching, written by hand) on
the same parameters, the runs taking turns; the table gives trees/s and recompile / hand-batched.
"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from bench_batching import (check_per_tree, chunks, eager_twin, hand_batched, recompile_batched,  # noqa: E402
                            throughputs)
from tree_lstm import TreeLSTM  # noqa: E402

import recompile  # noqa: E402
from recompile.data import Forest, load_sst, sample_dir  # noqa: E402

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
            fl, fr = forget.split([hidden, hidden], -1)
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


SPELLINGS = {"chunk (the example)": TreeLSTM, "split by sizes": SplitSizes, "slices, addcmul": SlicesAddcmul,
             "view, unbind": UnbindView, "x @ W.t() + b": WeightsMatmul}


def check(cls, base, trees):
    """Raise unless ``cls`` gives eager's per-tree values and gradients; its per-instance op counts."""
    model = cls(base.embed.num_embeddings)
    model.load_state_dict(base.state_dict())
    cls.encode.stats.reset()
    check_per_tree(model, trees, lambda twin, forest: recompile.vmap(twin.encode, in_dims=(None, 0))(
        forest, forest.roots), eager_cls=eager_twin(cls))
    return dict(cls.encode.stats.get("per_instance", {}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="SST directory (default: the shipped sample)")
    p.add_argument("--trees", type=int, default=512, help="trees timed")
    p.add_argument("--batch", type=int, nargs="+", default=[25, 256], help="minibatch sizes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3, help="timed passes; the best counts")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = args.data or sample_dir()
    sst = load_sst(data, splits=("train",))
    trees = sst.train[: args.trees]
    torch.manual_seed(0)
    base = TreeLSTM(len(sst.vocab))
    print(f"Tree-LSTM (embed 300, hidden {H}) spelled {len(SPELLINGS)} ways, {len(trees)} SST trees from {data}, "
          f"{args.threads} torch thread(s)")
    for name, cls in SPELLINGS.items():
        counts = check(cls, base, trees[:8])
        print(f"  {name:22} matches eager (float64: h, c, loss, gradients); per-instance ops: {counts or 'none'}")
    forests = {size: [Forest.from_trees(chunk) for chunk in chunks(trees, size)] for size in args.batch}
    models = {name: cls(len(sst.vocab)) for name, cls in SPELLINGS.items()}
    for model in models.values():
        model.load_state_dict(base.state_dict())
    hand = copy.deepcopy(base)
    print(f"{'':22} {'mode':>9} {'batch':>5} {'hand trees/s':>13} {'recompile trees/s':>18} {'rec/hand':>9}")
    for mode, train in (("inference", False), ("training", True)):
        for size in args.batch:
            runs = {"hand": (lambda forest: hand_batched(hand, forest), hand, forests[size])}
            runs.update({name: (recompile_batched(m), m, forests[size]) for name, m in models.items()})
            best = throughputs(runs, train, args.repeats)
            for name in SPELLINGS:
                rec = best[name]
                if isinstance(rec, Exception):
                    print(f"{name:22} {mode:>9} {size:5d} {best['hand']:13.1f} {type(rec).__name__:>18} {'-':>9}")
                    continue
                print(f"{name:22} {mode:>9} {size:5d} {best['hand']:13.1f} {rec:18.1f} {rec / best['hand']:8.2f}x")


if __name__ == "__main__":
    main()
