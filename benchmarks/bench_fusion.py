"""Elementwise fusion on the batched Tree-LSTM: unfused, fused as plain Python, fused with torch.compile.

    python benchmarks/bench_fusion.py [--data DIR] [--trees N] [--hidden 150 512] [--batch 25 256]
                                      [--repeats R] [--threads T] [--compile-cache {fresh,shared}]

The binary Tree-LSTM of examples/tree_lstm.py (embed 300, 5 classes, hidden
size from --hidden) runs over SST minibatches through recompile's batched
runtime, ``recompile.vmap(model.encode, in_dims=(None, 0))(forest,
forest.roots)``; the minibatch loss is the sum of the per-tree losses. Three
variants of the model differ only in how ``encode`` and ``node_loss`` are
compiled (``recompile.function(fn, fusion=...)``):

- unfused: ``fusion=False``, every elementwise op is its own call;
- python: ``fusion="python"`` (what ``fusion=True`` picks): each chain of
  elementwise ops (an LSTM cell's ``sigmoid(i) * tanh(u) + ...``) runs as one
  plain Python function;
- compile: ``fusion="compile"``: each such chain goes through torch.compile,
  compiled on its first large enough call (see recompile/codegen/fused.py).

For each hidden size the variants are compiled once, as new classes (own
builds, own compiled kernels), and checked first: in float64 on a few trees,
each fused variant's per-tree h, c and loss and every parameter gradient of
the minibatch loss must equal the unfused variant's (it raises otherwise; the
check uses classes of its own, so the timed ones start unbuilt). Then, for
each minibatch size and variant, on a fresh model with the same parameters
(all load the state of one TreeLSTM made after torch.manual_seed(0)):

- first call: wall time of the model's first forward under torch.no_grad() on
  the first minibatch, then of its first training step (forward, zero_grad,
  backward, SGD step). At the first minibatch size this includes recompile's
  build and, for compile, torch.compile of the inference and then the training
  graphs. Builds and compiled kernels are kept for the variant's life, so at
  later minibatch sizes it is mostly a warm call, plus torch.compile of the
  fused ops that first reach the size threshold there, or get inputs of other
  strides. torch.compile also caches per process: the float64 check, which
  runs first, pays its one-time start-up (several seconds, in the check's
  printed time), and later hidden sizes reuse some of the first's work.
- trees/s for inference (forward under torch.no_grad()) and training (one
  step per minibatch), best of --repeats passes over the --trees trees, after
  one untimed minibatch. Forests are built once, outside the timing.

One table per hidden size gives trees/s, the ratio of each fused variant to
unfused, and the first-call seconds (inference rows: the first forward;
training rows: the first training step). By default torch.compile writes to
an empty temporary cache (``--compile-cache fresh``), so it reuses nothing
that an earlier run compiled; ``shared`` uses torch's usual on-disk cache,
which a previous run may have filled (faster first calls).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from bench_batching import chunks, gradients, recompile_batched, throughput  # noqa: E402
from sst_runner import SentimentModel  # noqa: E402
from tree_lstm import TreeLSTM  # noqa: E402

import recompile  # noqa: E402
from recompile.data import Forest, load_sst, sample_dir  # noqa: E402

CHECK_TREES = 8  # trees of the float64 checks
VARIANTS = (("unfused", False), ("python", "python"), ("compile", "compile"))  # (name, fusion)
SHARED_SST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "sst")


def add_data_argument(parser):
    parser.add_argument("--data", default=None,
                        help="SST directory (default: ../shared/data/sst next to the repository if there, "
                             "else the shipped sample)")


def data_dir(args):
    """The SST directory ``--data`` names, or its default."""
    return args.data or (SHARED_SST if os.path.isdir(SHARED_SST) else sample_dir())


def variant(name, fusion):
    """A TreeLSTM subclass whose encode and node_loss are compiled anew with ``fusion``."""
    return type("TreeLSTM_" + name, (TreeLSTM,), {
        "encode": recompile.function(TreeLSTM.encode.python, fusion=fusion),
        "node_loss": recompile.function(SentimentModel.node_loss.python, fusion=fusion),
    })


def fresh(cls, base):
    """A ``cls`` model with ``base``'s sizes and parameters."""
    model = cls(base.embed.num_embeddings, embed=base.embed.embedding_dim,
                hidden=base.out.in_features, classes=base.out.out_features)
    model.load_state_dict(base.state_dict())
    return model


def check_fused(base, trees):
    """Raise unless every fused variant gives the unfused variant's per-tree (h, c, loss) and
    parameter gradients of the minibatch loss (float64, variant classes of their own)."""
    forest = Forest.from_trees(trees)
    results = {}
    for name, fusion in VARIANTS:
        model = fresh(variant(name, fusion), base).double()
        h, c, loss = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        results[name] = {"h": h.detach(), "c": c.detach(), "loss": loss.detach(),
                         "grads": gradients(model, loss.sum())}
    for name, _ in VARIANTS[1:]:
        torch.testing.assert_close(results[name], results["unfused"], msg=lambda m, name=name: f"{name}: {m}")


def first_calls(model, forest):
    """Seconds of ``model``'s first forward under no_grad, then of its first training step, on
    ``forest``; and the minibatch loss function (recompile_batched) for the rest of the timing."""
    start = time.perf_counter()
    loss_fn = recompile_batched(model)
    with torch.no_grad():
        loss_fn(forest)
    inference = time.perf_counter() - start
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    loss = loss_fn(forest)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return inference, time.perf_counter() - start, loss_fn


def compiled_graphs():
    """Graphs torch.compile has compiled in this process (None if torch does not say)."""
    try:
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]
    except Exception:
        return None


def measure(base, forests, repeats):
    """{(mode, size, variant name): (trees/s, first-call s)} for one hidden size."""
    classes = {name: variant(name, fusion) for name, fusion in VARIANTS}  # once: builds are kept
    results = {}
    for size, batches in forests.items():
        for name, cls in classes.items():
            model = fresh(cls, base)
            first_inference, first_training, loss_fn = first_calls(model, batches[0])
            for mode, train, first in (("inference", False, first_inference), ("training", True, first_training)):
                results[mode, size, name] = (throughput(loss_fn, model, batches, train, repeats), first)
    return results


def print_table(hidden, sizes, results):
    fused = [name for name, _ in VARIANTS[1:]]
    head = f"{'':10} {'batch':>5} {'unfused':>9}" + "".join(f" {name:>9} {name[:4] + '/unf':>8}" for name in fused)
    print(f"hidden {hidden}: trees/s (ratio: fused / unfused) and first call (s)")
    print(head + "  " + " ".join(f"{name + ' 1st':>11}" for name, _ in VARIANTS))
    for mode in ("inference", "training"):
        for size in sizes:
            row = {name: results[mode, size, name] for name, _ in VARIANTS}
            unfused = row["unfused"][0]
            cells = f"{mode:10} {size:5d} {unfused:9.1f}"
            cells += "".join(f" {row[name][0]:9.1f} {row[name][0] / unfused:7.2f}x" for name in fused)
            cells += "  " + " ".join(f"{row[name][1]:11.3f}" for name, _ in VARIANTS)
            print(cells)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_argument(p)
    p.add_argument("--trees", type=int, default=512, help="trees timed")
    p.add_argument("--hidden", type=int, nargs="+", default=[150, 512], help="hidden sizes")
    p.add_argument("--batch", type=int, nargs="+", default=[25, 256], help="minibatch sizes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3, help="timed passes; the best counts")
    p.add_argument("--compile-cache", choices=("fresh", "shared"), default="fresh",
                   help="torch.compile's on-disk cache: an empty temporary one (default), or torch's usual one")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = data_dir(args)
    sst = load_sst(data, splits=("train",))
    trees = sst.train[: args.trees]
    forests = {size: [Forest.from_trees(chunk) for chunk in chunks(trees, size)] for size in args.batch}
    print(f"Tree-LSTM (embed 300), {len(trees)} SST trees from {os.path.normpath(data)}, "
          f"{args.threads} torch thread(s), best of {args.repeats}, torch.compile cache: {args.compile_cache}")

    saved_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cache = tempfile.mkdtemp(prefix="bench_fusion_inductor_") if args.compile_cache == "fresh" else None
    if cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        for hidden in args.hidden:
            torch.manual_seed(0)
            base = TreeLSTM(len(sst.vocab), hidden=hidden)
            graphs = [compiled_graphs()]
            start = time.perf_counter()
            check_fused(base, trees[:CHECK_TREES])  # raises on a mismatch: no numbers for a wrong model
            seconds = time.perf_counter() - start
            graphs.append(compiled_graphs())
            compiled = "" if None in graphs else f", {graphs[1] - graphs[0]} graph(s) through torch.compile"
            print(f"hidden {hidden} check: ok (float64, {min(CHECK_TREES, len(trees))} trees: per-tree h, c, "
                  f"loss and gradients of python and compile equal unfused; {seconds:.1f} s{compiled})")
            results = measure(base, forests, args.repeats)
            graphs.append(compiled_graphs())
            print_table(hidden, args.batch, results)
            if None not in graphs:
                print(f"graphs through torch.compile in the timed runs: {graphs[2] - graphs[1]}")
    finally:
        if cache:
            if saved_cache is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_cache
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
