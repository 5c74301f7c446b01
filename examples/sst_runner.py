"""Shared driver of the SST examples: data, training loop, progress, dev accuracy, --dump.

Each example file defines its model (the interesting part: a plain recursive
method compiled with ``@recompile.function``) and calls ``main(Model)``.
A model's ``forward(tree)`` returns (summed loss over the tree's nodes,
root logits).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile.data import Forest, load_sst, sample_dir


class SentimentModel(nn.Module):
    """What the SST models share: a classifier ``self.out`` over node states, and the loss at a node.

    ``encode(tree, i)`` returns a tuple whose first item is the node's hidden
    state and whose last is the summed loss over its subtree.
    """

    @recompile.function
    def node_loss(self, h, label):
        return F.cross_entropy(self.out(h).unsqueeze(0), label.unsqueeze(0), reduction="sum")

    def forward(self, tree):
        state = self.encode(tree, tree.root)
        return state[-1], self.out(state[0])

    def forward_many(self, forest):
        """(each tree's summed loss, root logits) for a Forest: all its trees in one batched run."""
        state = recompile.vmap(self.encode, in_dims=(None, 0))(forest, forest.roots)
        return state[-1], self.out(state[0])


def parse_args(description, argv=None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default=None,
                   help="directory with train.txt/dev.txt/test.txt (default: the small sample shipped with recompile)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="use at most this many training trees")
    p.add_argument("--embed", type=int, default=300)
    p.add_argument("--hidden", type=int, default=150)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=25, help="trees per training step (one batched run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", action="store_true", help="print the IR of the compiled encoder before training")
    p.add_argument("--source", action="store_true", help="print the generated Python source before training")
    return p.parse_args(argv)


def progress(done, total, started, loss, width=30, stream=sys.stderr):
    frac = done / max(total, 1)
    bar = "#" * int(frac * width)
    rate = done / max(time.perf_counter() - started, 1e-9)
    stream.write(f"\r  [{bar:<{width}}] {done}/{total}  {rate:6.1f} trees/s  loss/node {loss:.4f}")
    if done == total:
        stream.write("\n")
    stream.flush()


def accuracy(model, trees, batch=256):
    correct = 0
    with torch.no_grad():
        for k in range(0, len(trees), batch):
            forest = Forest.from_trees(trees[k:k + batch])
            _, logits = model.forward_many(forest)
            correct += int((logits.argmax(-1) == forest.labels[forest.roots]).sum())
    return correct / max(len(trees), 1)


def main(model_cls, description, argv=None):
    args = parse_args(description, argv)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    data_dir = args.data or sample_dir()
    sst = load_sst(data_dir)
    train = sst.train[: args.limit] if args.limit else sst.train
    print(f"{model_cls.__name__}: {len(train)} train / {len(sst.dev)} dev trees from {data_dir}, "
          f"vocabulary {len(sst.vocab)}")
    model = model_cls(len(sst.vocab), embed=args.embed, hidden=args.hidden)
    if args.dump:
        print(recompile.dump(type(model).encode, stage="capture"))
    if args.source:
        print(type(model).encode.source())
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    history = []
    for epoch in range(1, args.epochs + 1):
        order = list(range(len(train)))
        random.shuffle(order)
        total_loss, total_nodes, started = 0.0, 0, time.perf_counter()
        print(f"epoch {epoch}")
        for start in range(0, len(order), args.batch):
            forest = Forest.from_trees([train[k] for k in order[start:start + args.batch]])
            losses, _ = model.forward_many(forest)
            loss = losses.sum()
            opt.zero_grad()
            (loss / forest.num_trees).backward()  # the mean over trees of each tree's summed loss
            opt.step()
            total_loss += loss.item()
            total_nodes += forest.num_nodes
            progress(start + forest.num_trees, len(order), started, total_loss / total_nodes)
        dev_acc = accuracy(model, sst.dev)
        history.append((total_loss / total_nodes, dev_acc))
        print(f"  train loss/node {total_loss / total_nodes:.4f}   dev root accuracy {dev_acc:.3f}")
    print(f"build count of {model_cls.__name__}.encode: {type(model).encode.stats['builds']}")
    return history
