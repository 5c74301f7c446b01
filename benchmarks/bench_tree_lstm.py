"""Tree-LSTM on SST trees, one tree at a time: eager PyTorch recursion vs the same code compiled by recompile
in sequential mode (derived gradient program), in one process. (bench_batching.py measures batched mode.)

    python benchmarks/bench_tree_lstm.py [--data DIR] [--trees N] [--threads T]

Prints trees/s for inference and training (forward + backward + SGD step) and
the ratio compiled / eager. Both run the same model class: the eager twin
replaces the compiled method by the undecorated function. The compiled model's
backward is recompile's derived gradient program (torch.autograd records no op
of it), and its weight gradients are formed once per backward.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from tree_lstm import TreeLSTM  # noqa: E402

import recompile  # noqa: E402
from recompile.data import load_sst, sample_dir  # noqa: E402


def sequential_twin(model_cls):
    """The model with ``encode`` compiled in sequential mode (one tree node at a time, derived gradient)."""
    return type("Sequential" + model_cls.__name__, (model_cls,),
                {"encode": recompile.function(model_cls.encode.python, mode="sequential")})


def eager_twin(model_cls):
    return type("Eager" + model_cls.__name__, (model_cls,), {"encode": model_cls.encode.python})


def throughput(model, trees, train, repeats):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for tree in trees:
            if train:
                loss, _ = model(tree)
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                with torch.no_grad():
                    model(tree)
        best = max(best, len(trees) / (time.perf_counter() - start))
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="SST directory (default: the shipped sample)")
    p.add_argument("--trees", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sst = load_sst(args.data or sample_dir(), splits=("train",))
    trees = sst.train[: args.trees]
    torch.manual_seed(0)
    compiled = sequential_twin(TreeLSTM)(len(sst.vocab))
    eager = eager_twin(TreeLSTM)(len(sst.vocab))
    eager.load_state_dict(compiled.state_dict())
    print(f"Tree-LSTM (embed 300, hidden 150), {len(trees)} SST trees, {args.threads} torch thread(s)")
    print(f"{'':10} {'eager trees/s':>14} {'recompile trees/s':>18} {'ratio':>7}")
    for mode, train in (("inference", False), ("training", True)):
        throughput(compiled, trees[:20], train, 1)  # warm-up (and the one build)
        throughput(eager, trees[:20], train, 1)
        e = throughput(eager, trees, train, args.repeats)
        c = throughput(compiled, trees, train, args.repeats)
        print(f"{mode:10} {e:14.1f} {c:18.1f} {c / e:7.2f}x")
    stats = type(compiled).encode.stats
    print(f"builds of TreeLSTM.encode: {stats['builds']}; calls without a gradient rule: "
          f"{sum(stats['grad_fallbacks'].values())}")


if __name__ == "__main__":
    main()
