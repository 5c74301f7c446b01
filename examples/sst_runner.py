"""Shared driver of the SST examples: data, training loop, progress, dev accuracy, checkpoints, curve, --dump.

Each example file defines its model (the interesting part: a plain recursive
method compiled with ``@recompile.function``) and calls ``main(Model)``.
A model's ``forward(tree)`` returns (summed loss over the tree's nodes,
root logits).

A progress bar (trees/s, loss) needs tqdm and the training curve matplotlib:
``pip install -e ".[examples]"``. Without them, each epoch still ends with its
log line.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile.data import Forest, load_sst, sample_dir

try:
    from tqdm import tqdm
except ImportError:  # an optional extra: the per-epoch log line is printed all the same
    tqdm = None

log = logging.getLogger("sst_runner")


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


def parser(description):
    """The options every SST example takes (an example may add its own before ``parse_args``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None,
                   help="directory with train.txt/dev.txt/test.txt (default: the small sample shipped with recompile)")
    p.add_argument("--epochs", type=int, default=2, help="train until this many epochs are done (with --resume: "
                                                         "in all, the checkpoint's counted)")
    p.add_argument("--limit", type=int, default=None, help="use at most this many training trees")
    p.add_argument("--embed", type=int, default=300)
    p.add_argument("--hidden", type=int, default=150)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=25, help="trees per training step (one batched run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the order of the trees")
    p.add_argument("--checkpoint", metavar="PATH", help="save the model, optimizer and random state here after "
                                                        "each epoch")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint where it exists: the run goes on "
                                                         "as if it had not stopped")
    p.add_argument("--curve", metavar="PATH", help="draw the training curve (loss, dev accuracy per epoch) to this "
                                                   "PNG (needs matplotlib)")
    p.add_argument("--dump", action="store_true", help="print the IR of the compiled encoder before training")
    p.add_argument("--source", action="store_true", help="print the generated Python source before training")
    return p


def parse_args(description, argv=None, p=None):
    p = p or parser(description)
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint PATH")
    if args.curve and importlib.util.find_spec("matplotlib") is None:  # said now, not after the training
        p.error('--curve needs matplotlib: pip install matplotlib (or pip install -e ".[examples]")')
    return args


def correct(model, trees, batch=256, device=None):
    """How many of ``trees`` the model labels right at the root."""
    right = 0
    with torch.no_grad():
        for k in range(0, len(trees), batch):
            forest = Forest.from_trees(trees[k:k + batch])
            forest = forest.to(device) if device is not None else forest
            _, logits = model.forward_many(forest)
            right += int((logits.argmax(-1) == forest.labels[forest.roots]).sum())
    return right


def accuracy(model, trees, batch=256):
    return correct(model, trees, batch) / max(len(trees), 1)


def save_checkpoint(path, model, opt, history):
    """Everything a resumed run needs to go on as this one would: weights, optimizer, history, random state."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "history": history,
             "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a run stopped while saving leaves the last checkpoint whole


def load_checkpoint(path, model, opt, map_location=None):
    state = torch.load(path, weights_only=False, map_location=map_location)  # (the random states are Python objects)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["history"]


def draw_curve(path, history, title):
    import matplotlib
    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    epochs = range(1, len(history) + 1)
    fig, loss_ax = plt.subplots(figsize=(6, 4))
    loss_ax.plot(epochs, [loss for loss, _ in history], "o-", color="tab:blue")
    loss_ax.set_xlabel("epoch")
    loss_ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    loss_ax.set_ylabel("train loss / node", color="tab:blue")
    acc_ax = loss_ax.twinx()
    acc_ax.plot(epochs, [acc for _, acc in history], "s--", color="tab:orange")
    acc_ax.set_ylabel("dev root accuracy", color="tab:orange")
    loss_ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _log_to_stdout():
    # the example's own lines, on this run's stdout (INFO, whatever the root logger is set to)
    log.handlers[:] = [logging.StreamHandler(sys.stdout)]
    log.setLevel(logging.INFO)
    log.propagate = False


def main(model_cls, description, argv=None):
    args = parse_args(description, argv)
    _log_to_stdout()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    data_dir = args.data or sample_dir()
    sst = load_sst(data_dir)
    train = sst.train[: args.limit] if args.limit else sst.train
    log.info("%s: %d train / %d dev trees from %s, vocabulary %d", model_cls.__name__, len(train), len(sst.dev),
             data_dir, len(sst.vocab))
    model = model_cls(len(sst.vocab), embed=args.embed, hidden=args.hidden)
    if args.dump:
        print(recompile.dump(type(model).encode, stage="capture"))
    if args.source:
        print(type(model).encode.source())
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    history = []
    if args.resume and os.path.exists(args.checkpoint):
        history = load_checkpoint(args.checkpoint, model, opt)
        log.info("resumed from %s after epoch %d", args.checkpoint, len(history))
    for epoch in range(len(history) + 1, args.epochs + 1):
        order = list(range(len(train)))
        random.shuffle(order)
        total_loss, total_nodes, started = 0.0, 0, time.perf_counter()
        # (tqdm draws on a terminal only: a log file gets the epoch's line alone)
        bar = tqdm(total=len(order), desc=f"epoch {epoch}", unit="tree", leave=False, disable=None) if tqdm else None
        for start in range(0, len(order), args.batch):
            forest = Forest.from_trees([train[k] for k in order[start:start + args.batch]])
            losses, _ = model.forward_many(forest)
            loss = losses.sum()
            opt.zero_grad()
            (loss / forest.num_trees).backward()  # the mean over trees of each tree's summed loss
            opt.step()
            total_loss += loss.item()
            total_nodes += forest.num_nodes
            if bar is not None:
                bar.set_postfix({"loss/node": f"{total_loss / total_nodes:.4f}"}, refresh=False)
                bar.update(forest.num_trees)
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - started
        dev_acc = accuracy(model, sst.dev)
        history.append((total_loss / total_nodes, dev_acc))
        log.info("epoch %d  train loss/node %.4f  dev root accuracy %.3f  %.1f trees/s  %.1f s", epoch,
                 total_loss / total_nodes, dev_acc, len(order) / seconds, seconds)
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, opt, history)
    if args.curve:
        draw_curve(args.curve, history, f"{model_cls.__name__} on {os.path.basename(os.path.normpath(data_dir))}")
        log.info("training curve: %s", args.curve)
    log.info("build count of %s.encode: %d", model_cls.__name__, type(model).encode.stats["builds"])
    return history
