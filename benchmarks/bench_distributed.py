"""Data-parallel training throughput: the Tree-LSTM of examples/ on 1 process and on 2 (DDP, gloo), 1 thread each.

    python benchmarks/bench_distributed.py [--data DIR] [--batch 25] [--trees 200] [--repeats 5]

Every process trains on trees of its own (--trees of them, the first process the first ones, the next the
next), --batch trees a step in one batched run of the compiled encoder, forward, backward and an SGD step:
the same model and minibatch per rank, so 2 processes do twice the work of 1 in each step. Printed: trees/s
of 1 process alone, of 1 process under DDP (world size 1: DDP's own cost), and of 2 processes under DDP (all
their trees over the slower one's time); the scaling efficiency is the 2 processes' trees/s over twice the
1 process's. Trees per CPU-second (the processes' CPU time, all their threads) leave out the time a rank
waits, for the other or for a core that another process holds.

Each process is a fork of this one, with the rendezvous on the loopback address. The runs take turns over
--repeats rounds, each the best of 2 timed passes over its trees after one pass of warm-up. Before timing, 2
ranks train a float64 copy of the model for 2 steps, which must end with the parameters of one process
training on the union of their minibatches (1e-10).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from distributed import Minibatch  # noqa: E402  (examples/distributed.py: what DDP wraps)
from tree_lstm import TreeLSTM  # noqa: E402

from recompile.data import Forest, load_sst, sample_dir  # noqa: E402

TIMEOUT = 600  # seconds a run's processes may take


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_ranks(world, fn, *args):
    """``fn(rank, world, *args)`` in ``world`` processes forked from this one, in one process group; their
    results. Raises if a rank fails (its traceback is on stderr) or the ranks run past ``TIMEOUT``."""
    url, out = f"tcp://127.0.0.1:{free_port()}", tempfile.mkdtemp(prefix="bench_distributed")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)
                dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,
                                        timeout=datetime.timedelta(seconds=TIMEOUT))
                torch.save(fn(rank, world, *args), os.path.join(out, f"{rank}.pt"))
                dist.destroy_process_group()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    deadline, failed = time.monotonic() + TIMEOUT, []
    for pid in pids:
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            for other in pids:  # (the job is over: none of its ranks may go on)
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.waitpid(pid, 0)
            failed.append(f"{pid}: timed out")
        elif os.waitstatus_to_exitcode(done[1]) != 0:
            failed.append(f"{pid}: exit status {os.waitstatus_to_exitcode(done[1])}")
    if failed:
        raise RuntimeError(f"{world} ranks of {fn.__name__} failed: {failed}")
    return [torch.load(os.path.join(out, f"{rank}.pt"), weights_only=False) for rank in range(world)]


def new_model(vocab_size, args, dtype):
    torch.manual_seed(0)
    return Minibatch(TreeLSTM(vocab_size, embed=args.embed, hidden=args.hidden).to(dtype))


def step(net, opt, trees):
    losses, _ = net(Forest.from_trees(trees))
    opt.zero_grad()
    (losses.sum() / len(trees)).backward()  # (DDP averages the ranks' mean over trees)
    opt.step()


def check_rank(rank, world, trees, vocab_size, args):
    """2 steps of a float64 model under DDP on this rank's part of each step's trees: its parameters."""
    net = new_model(vocab_size, args, torch.float64)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for batch in trees:
        step(ddp, opt, batch[rank::world])
    return net.state_dict()


def check(trees, vocab_size, args):
    """The largest difference between 2 ranks' parameters and one process's on the union of their trees."""
    steps = [trees[k * 8:(k + 1) * 8] for k in range(2)]
    ranks = fork_ranks(2, check_rank, steps, vocab_size, args)
    net = new_model(vocab_size, args, torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for batch in steps:  # (rank r's trees are batch[r::2]: the union is the batch, in another order)
        step(net, opt, batch[0::2] + batch[1::2])
    return max((r[k] - v).abs().max().item() for r in ranks for k, v in net.state_dict().items())


def time_rank(rank, world, trees, vocab_size, args, ddp):
    """(wall-clock seconds, CPU seconds of the process) of the pass over this rank's trees, --batch a step, that
    took the least time (after a pass of warm-up)."""
    net = new_model(vocab_size, args, torch.float32)
    wrapped = DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    mine = trees[rank * args.trees:(rank + 1) * args.trees]
    best = (float("inf"), 0.0)
    for timed in (False, True, True):
        dist.barrier()  # (the ranks start each pass together)
        start, cpu = time.perf_counter(), time.process_time()
        for k in range(0, len(mine), args.batch):
            step(wrapped, opt, mine[k:k + args.batch])
        if timed:
            best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="SST directory (default: the shipped sample)")
    p.add_argument("--trees", type=int, default=200, help="trees per process and pass")
    p.add_argument("--batch", type=int, default=25, help="trees per process and step")
    p.add_argument("--embed", type=int, default=300)
    p.add_argument("--hidden", type=int, default=150)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # (before any op: the ranks are forks of this process)
    sst = load_sst(args.data or sample_dir(), splits=("train",))
    trees, vocab_size = sst.train, len(sst.vocab)
    if len(trees) < 2 * args.trees:
        p.error(f"--trees {args.trees}: 2 processes need {2 * args.trees} trees, the data has {len(trees)}")
    print(f"Tree-LSTM (embed {args.embed}, hidden {args.hidden}), SST train trees, {args.trees} per process and "
          f"pass, {args.batch} per process and step; 1 torch thread per process, gloo")
    diff = check(trees, vocab_size, args)
    if not diff <= 1e-10:
        raise AssertionError(f"2 ranks differ from one process on their union by {diff:.3g}")
    print(f"check: 2 ranks train as one process on the union of their minibatches (float64, max diff {diff:.1e})")
    runs = {"1 process": (1, False), "1 process, DDP": (1, True), "2 processes, DDP": (2, True)}
    best, per_cpu, rounds = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0.0), []
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):  # (the runs take turns: a machine's slow spell hits them alike)
        rates = {}
        for name, (world, ddp) in runs.items():
            timed = fork_ranks(world, time_rank, trees, vocab_size, args, ddp)
            rates[name] = world * args.trees / max(wall for wall, _ in timed)
            best[name] = max(best[name], rates[name])
            per_cpu[name] = max(per_cpu[name], world * args.trees / sum(cpu for _, cpu in timed))
        rounds.append(rates["2 processes, DDP"] / (2 * rates["1 process"]))
    loads.append(os.getloadavg()[0])
    one = best["1 process"]
    print(f"{'':18} {'trees/s':>9} {'/ 1 process':>12} {'trees/CPU-s':>12}")
    for name, rate in best.items():
        print(f"{name:18} {rate:9.1f} {rate / one:11.2f}x {per_cpu[name]:12.1f}")
    cpu = per_cpu["2 processes, DDP"] / per_cpu["1 process"]
    print(f"scaling efficiency of 2 processes: {best['2 processes, DDP'] / (2 * one):.2f} (each round's: "
          f"{min(rounds):.2f}-{max(rounds):.2f}); per CPU-second: {cpu:.2f}")
    print(f"load average {loads[0]:.2f} before, {loads[1]:.2f} after ({os.cpu_count()} CPU cores; other processes on "
          "them slow 2 ranks most)")
    return best


if __name__ == "__main__":
    main()
