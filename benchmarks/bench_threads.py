"""Threaded mode on Tree-LSTM and Tree-RNN, one tree per call: sequential vs threaded with 1, 2, 4 workers.

    python benchmarks/bench_threads.py [--data DIR] [--trees N] [--repeats R] [--threads 1 2 4]
                                       [--models TreeLSTM TreeRNN] [--shapes moderate balanced linear]
                                       [--embed E] [--hidden H] [--torch-threads T]
                                       [--max-live-frames M] [--quick]

The setting of Jeong et al. (EuroSys'18), Table 1: the binary Tree-LSTM of
examples/tree_lstm.py and the Tree-RNN of examples/tree_rnn.py (embed 300,
hidden 150, 5 classes; a tree's loss is the summed cross-entropy of every
node) run on the first --trees SST train sentences, each sentence in three
tree shapes over the same words:

- moderate: the SST parse tree as given;
- balanced: a balanced binary tree (the left half gets the extra word);
- linear: a left-leaning chain, ((w1 w2) w3) ...

Every shape of a sentence has its 2n - 1 nodes. Leaves keep their SST labels;
in balanced and linear, every internal node gets the sentence's (root) label.

Modes are variants of one model class (``encode`` and ``node_loss`` compiled
anew with ``recompile.function(fn.python, mode=...)``): sequential (frames
one at a time, the baseline) and threaded with ``threads=N`` for each N of
--threads (independent frames on a pool of N workers). Every variant loads
the parameters of one model made after torch.manual_seed(0). Each call
handles one tree: ``model(tree)``, i.e. ``encode(tree, tree.root)`` (no vmap).

Before timing, for each model and shape, on the first two trees in float64:
each threaded variant's encode outputs (h, [c,] loss), with and without
gradients, and every parameter gradient of the loss must equal sequential's
(it raises otherwise). Then trees/s for inference (forward under
torch.no_grad()) and training (forward, zero_grad, backward, SGD step; one
step per tree), best of --repeats passes after one untimed tree, and each
threaded variant's ratio to sequential: one row per (model, phase, shape).

--threads are threaded mode's worker threads; --torch-threads is torch's
intra-op thread count (default 1, as in the other benchmarks: with more,
each worker's ops start intra-op threads of their own and the cores are
oversubscribed).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from bench_batching import gradients, throughput  # noqa: E402
from bench_fusion import add_data_argument, data_dir, fresh  # noqa: E402
from sst_runner import SentimentModel  # noqa: E402
from tree_lstm import TreeLSTM  # noqa: E402
from tree_rnn import TreeRNN  # noqa: E402

import recompile  # noqa: E402
from recompile.data import TreeBuilder, load_sst  # noqa: E402
from recompile.runtime import pool  # noqa: E402

MODELS = {cls.__name__: cls for cls in (TreeLSTM, TreeRNN)}
SHAPES = ("moderate", "balanced", "linear")
CHECK_TREES = 2  # trees per shape of the float64 checks
QUICK = {"trees": 4, "repeats": 1, "embed": 16, "hidden": 16}  # --quick: a smoke run of a few seconds


# -- tree shapes -------------------------------------------------------------------------------


def reshape(tree, shape):
    """``tree``'s sentence as a tree of ``shape`` (see the module docstring)."""
    if shape == "moderate":
        return tree
    leaves = tree.is_leaf.nonzero().flatten().tolist()  # post-order: the words in sentence order
    words, labels = tree.words.tolist(), tree.labels.tolist()
    tokens = tree.tokens or [str(words[i]) for i in leaves]
    label = labels[tree.root]
    b = TreeBuilder()

    def leaf(k):
        return b.leaf(labels[leaves[k]], tokens[k], words[leaves[k]])

    if shape == "linear":
        node = leaf(0)
        for k in range(1, len(leaves)):
            node = b.node(label, node, leaf(k))
    else:
        def balanced(lo, hi):  # (recursion depth log2 of the sentence length)
            if hi - lo == 1:
                return leaf(lo)
            mid = (lo + hi + 1) // 2
            left = balanced(lo, mid)  # post-order: the left subtree, the right one, then the node
            return b.node(label, left, balanced(mid, hi))

        balanced(0, len(leaves))
    return b.build()


# -- model variants ----------------------------------------------------------------------------


def variant(model_cls, mode, **options):
    """A ``model_cls`` subclass whose encode and node_loss are compiled anew in ``mode`` with ``options``."""
    name = f"{model_cls.__name__}_{mode}{options.get('threads', '')}"
    return type(name, (model_cls,), {
        "encode": recompile.function(model_cls.encode.python, mode=mode, **options),
        "node_loss": recompile.function(SentimentModel.node_loss.python, mode=mode, **options),
    })


def check(base, classes, trees):
    """Raise unless every threaded class gives sequential's encode outputs (with and without
    gradients) and parameter gradients on each of ``trees`` (float64)."""
    reference = fresh(classes["sequential"], base).double()
    models = {name: fresh(cls, base).double() for name, cls in classes.items() if name != "sequential"}

    def outputs(model, tree):
        with torch.no_grad():
            no_grad = model.encode(tree, tree.root)
        out = model.encode(tree, tree.root)
        grads = gradients(model, out[-1])  # out[-1]: the tree's summed loss
        return {"no_grad": no_grad, "outputs": [t.detach() for t in out], "grads": grads}

    for k, tree in enumerate(trees):
        want = outputs(reference, tree)
        for name, model in models.items():
            torch.testing.assert_close(outputs(model, tree), want,
                                       msg=lambda m, name=name, k=k: f"{name} != sequential on tree {k}: {m}")


# -- main --------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(p)
    p.add_argument("--trees", type=int, default=100, help="sentences timed (each in every shape)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes; the best counts")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="threaded mode's worker threads")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--embed", type=int, default=300)
    p.add_argument("--hidden", type=int, default=150)
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--max-live-frames", type=int, default=None,
                   help="threaded mode's bound on live frames per call (default: recompile's)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items()) + " (overriding them)")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    torch.set_num_threads(args.torch_threads)
    data = data_dir(args)
    sst = load_sst(data, splits=("train",))
    sentences = sst.train[: args.trees]
    trees = {shape: [reshape(t, shape) for t in sentences] for shape in args.shapes}
    # (None would mean no bound at all, so recompile's default is kept unless the flag is given)
    live = {} if args.max_live_frames is None else {"max_live_frames": args.max_live_frames}
    names = ["sequential"] + [f"threaded{n}" for n in args.threads]

    print(f"{' and '.join(args.models)} (embed {args.embed}, hidden {args.hidden}), {len(sentences)} SST "
          f"sentences from {os.path.normpath(data)} (mean {statistics.mean(t.num_leaves for t in sentences):.1f} "
          f"words), one tree per call, best of {args.repeats}")
    print(f"torch threads: {torch.get_num_threads()}, CPU cores: {pool.default_threads()}, "
          f"threaded mode workers: {', '.join(map(str, args.threads))}")
    print("tree height mean/max: " + ", ".join(
        f"{shape} {statistics.mean(t.height for t in ts):.1f}/{max(t.height for t in ts)}"
        for shape, ts in trees.items()))

    start = time.perf_counter()
    results = {}
    for model_name in args.models:
        model_cls = MODELS[model_name]
        torch.manual_seed(0)
        base = model_cls(len(sst.vocab), embed=args.embed, hidden=args.hidden)
        classes = {"sequential": variant(model_cls, "sequential")}
        classes.update({f"threaded{n}": variant(model_cls, "threaded", threads=n, **live) for n in args.threads})
        for shape, ts in trees.items():  # raises on a mismatch: no numbers for a wrong model
            check(base, classes, ts[:CHECK_TREES])
        print(f"{model_name} check: ok (float64, {min(CHECK_TREES, len(sentences))} trees per shape: "
              f"threaded outputs and gradients equal sequential's)")
        models = {name: fresh(cls, base) for name, cls in classes.items()}
        for phase, train in (("inference", False), ("training", True)):
            for shape, ts in trees.items():
                for name, model in models.items():
                    # one tree per call: each "batch" of throughput() is a list of one tree
                    results[model_name, phase, shape, name] = throughput(
                        lambda batch, model=model: model(batch[0])[0], model, [[t] for t in ts], train,
                        args.repeats)

    print("trees/s (ratio: threaded / sequential); threadedN: threads=N")
    print(f"{'model':9} {'phase':10} {'shape':9} {'sequential':>10}"
          + "".join(f" {name:>10} {'/seq':>6}" for name in names[1:]))
    for model_name in args.models:
        for phase in ("inference", "training"):
            for shape in args.shapes:
                row = [results[model_name, phase, shape, name] for name in names]
                print(f"{model_name:9} {phase:10} {shape:9} {row[0]:10.1f}"
                      + "".join(f" {r:10.1f} {r / row[0]:5.2f}x" for r in row[1:]))
    print(f"checks and timing: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
