"""The SST examples trained on several processes and machines with torch.distributed (DDP, or FSDP2).

    torchrun --nproc_per_node=2 examples/distributed.py             # 2 processes here, on the SST sample
    torchrun --nproc_per_node=2 examples/distributed.py --epochs 4 --checkpoint run.pt --resume
        # goes on from run.pt after each epoch it holds, with any number of processes
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=sst \\
        examples/distributed.py --data DIR                           # the same command on each of 2 machines
    python examples/distributed.py                                   # one process, without a launcher

Each process (rank) trains on its share of the training trees (a DistributedSampler: a different part of each
epoch's shuffled order on each rank, trees repeated where the ranks do not divide them), its --batch trees of
a step in one batched run of the compiled encoder. DistributedDataParallel averages the ranks' gradients,
reducing buckets of them while the backward still runs, so every rank takes the same step: the model trains
as one process would on a minibatch of world size x --batch trees. The ranks evaluate the dev trees between
them; rank 0 logs, draws the curve and writes the checkpoint, which holds nothing of the world size. gloo on
CPU, nccl on CUDA (one GPU per process, the LOCAL_RANK-th). --fsdp shards the parameters and the optimizer's
state between the ranks instead (FSDP2's fully_shard). See docs/distributed.md.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import recompile
import sst_runner
from recompile.data import Forest, load_sst, sample_dir
from rntn import RNTN
from sst_runner import log
from tree_lstm import TreeLSTM
from tree_rnn import TreeRNN

MODELS = {"tree_lstm": TreeLSTM, "tree_rnn": TreeRNN, "rntn": RNTN}


class Minibatch(nn.Module):
    """What DDP or FSDP wraps: their hooks run around a module's forward, so the forward runs a minibatch."""

    def __init__(self, model, sequential=False):
        super().__init__()
        self.model = model
        self.sequential = sequential

    def forward(self, forest):
        """(each tree's summed loss, root logits) of a Forest."""
        if not self.sequential:
            return self.model.forward_many(forest)  # every tree in one batched run
        states = [self.model.encode(forest, root) for root in forest.roots]  # one compiled call a tree
        return torch.stack([s[-1] for s in states]), self.model.out(torch.stack([s[0] for s in states]))

    def forward_many(self, forest):
        return self.forward(forest)  # (what ``sst_runner.correct`` calls: no wrapper's hooks, no collective)


def sequential(model_cls):
    """The model class with its encoder compiled in sequential mode."""
    encode = recompile.function(model_cls.encode.python, mode="sequential")
    return type(model_cls.__name__, (model_cls,), {"encode": encode})


def parse_args(argv=None):
    p = sst_runner.parser(__doc__)
    p.add_argument("--model", choices=MODELS, default="tree_lstm")
    p.add_argument("--mode", choices=("batched", "sequential"), default="batched",
                   help="how the encoder is compiled (sequential: one compiled call per tree)")
    p.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state between the ranks "
                                                       "(FSDP2's fully_shard) instead of replicating them (DDP)")
    p.add_argument("--drop-last", action="store_true", help="drop the last trees where the ranks do not divide "
                                                            "them (default: repeat a few, as DistributedSampler does)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a rank waits for the others at a collective")
    return sst_runner.parse_args(__doc__, argv, p)


def start(timeout):
    """Join the job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment), or
    make a job of this process alone; the device this rank trains on."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    options = dict(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    if "RANK" not in os.environ:  # (python examples/distributed.py)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options.update(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.init_process_group(**options)
    return device


def wrap(net, device, fsdp):
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        return fully_shard(net)  # (the whole model one unit: see docs/distributed.md#fsdp2)
    return DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)


def save_checkpoint(path, net, opt, history):
    """Weights, optimizer state and history, whole (gathered where FSDP shards them), written by rank 0."""
    model_state, opt_state = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optimizer": opt_state, "history": history}, path + ".tmp")
        os.replace(path + ".tmp", path)  # a run stopped while saving leaves the last checkpoint whole
    dist.barrier()


def load_checkpoint(path, net, opt):
    """Every rank reads the checkpoint (on several machines, put it where they all see it)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    return state["history"]


def dev_accuracy(net, trees, device):
    """Root accuracy on ``trees``, shared out between the ranks (each counts its own, exactly; no tree twice)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = trees[rank::world]
    fsdp = hasattr(net, "unshard")  # (fully_shard made the module an FSDPModule)
    if fsdp:
        net.unshard()  # the whole weights once, whatever the number of batches on each rank
    right = sst_runner.correct(net, mine, device=device)
    if fsdp:
        net.reshard()
    counts = torch.tensor([right, len(mine)], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    return (counts[0] / counts[1].clamp(min=1)).item()


def train(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    sst_runner._log_to_stdout()
    if rank != 0:
        log.setLevel("WARNING")  # (rank 0 logs for the job)
    torch.manual_seed(args.seed)  # the same weights on every rank (DDP broadcasts rank 0's all the same)
    data_dir = args.data or sample_dir()
    sst = load_sst(data_dir)
    trees = sst.train[: args.limit] if args.limit else sst.train
    model_cls = MODELS[args.model] if args.mode == "batched" else sequential(MODELS[args.model])
    model = model_cls(len(sst.vocab), embed=args.embed, hidden=args.hidden).to(device)
    log.info("%s (%s mode) on %d ranks (%s): %d train / %d dev trees from %s, %d a step", model_cls.__name__,
             args.mode, world, dist.get_backend(), len(trees), len(sst.dev), data_dir, world * args.batch)
    if rank == 0 and args.dump:
        print(recompile.dump(model_cls.encode, stage="capture"))
    if rank == 0 and args.source:
        print(model_cls.encode.source())
    net = Minibatch(model, sequential=args.mode == "sequential")
    wrapped = wrap(net, device, args.fsdp)
    opt = torch.optim.Adagrad(wrapped.parameters(), lr=args.lr)
    history = []
    if args.resume and os.path.exists(args.checkpoint):
        history = load_checkpoint(args.checkpoint, net, opt)
        log.info("resumed from %s after epoch %d", args.checkpoint, len(history))
    sampler = DistributedSampler(trees, shuffle=True, seed=args.seed, drop_last=args.drop_last)
    loader = DataLoader(trees, batch_size=args.batch, sampler=sampler, collate_fn=Forest.from_trees)
    for epoch in range(len(history) + 1, args.epochs + 1):
        sampler.set_epoch(epoch)  # (each epoch its own order, the same on every rank and for any world size)
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nodes, trees
        started = time.perf_counter()
        bar = sst_runner.tqdm(total=len(sampler) * world, desc=f"epoch {epoch}", unit="tree", leave=False,
                              disable=None if rank == 0 else True) if sst_runner.tqdm else None
        for forest in loader:
            forest = forest.to(device)
            losses, _ = wrapped(forest)
            loss = losses.sum()
            opt.zero_grad()
            (loss / forest.num_trees).backward()  # (DDP averages the ranks' mean over trees)
            opt.step()
            sums += torch.tensor([loss.item(), forest.num_nodes, forest.num_trees], dtype=torch.float64,
                                 device=device)
            if bar is not None:
                bar.update(forest.num_trees * world)
        if bar is not None:
            bar.close()
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dev_acc = dev_accuracy(net, sst.dev, device)
        loss_per_node, seconds = (sums[0] / sums[1]).item(), seconds.item()
        history.append((loss_per_node, dev_acc))
        log.info("epoch %d  train loss/node %.4f  dev root accuracy %.3f  %.1f trees/s  %.1f s", epoch,
                 loss_per_node, dev_acc, sums[2].item() / seconds, seconds)
        if args.checkpoint:
            save_checkpoint(args.checkpoint, net, opt, history)
    if rank == 0 and args.curve:
        sst_runner.draw_curve(args.curve, history, f"{model_cls.__name__} on {world} ranks")
        log.info("training curve: %s", args.curve)
    return history


def main(argv=None):
    args = parse_args(argv)
    device = start(args.timeout)
    try:
        history = train(args, device)
    except Exception as err:
        # the rank and the error in one line: a rank left waiting at a collective fails with its own error
        print(f"rank {dist.get_rank()} stopped: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        raise
    dist.destroy_process_group()
    return history


if __name__ == "__main__":
    record(main)()  # (under torchrun: this rank's error and traceback go into the job's report)
