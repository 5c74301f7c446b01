"""The ranks of the data-parallel tests (tests/test_distributed.py), each a process of its own.

    python tests/distributed_worker.py OUT SCENARIO...    # with MASTER_ADDR, MASTER_PORT set

starts 2 ranks as forks of itself, once it has imported torch, DDP and FSDP (their imports take seconds), and
sets the variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK). Each scenario trains a small tree model
for a few steps on the rank's trees, through DistributedDataParallel or FSDP2's ``fully_shard``, and the rank
writes what the test checks (parameters, hook events) to ``OUT/rank{RANK}.pt``; ``raise`` and ``kill`` end
the job in the middle of a step. A rank's output goes to ``OUT/rank{RANK}.log``; when it ends, its exit status
and the time go to ``OUT/rank{RANK}.end``. The test trains the same model in one process, eagerly, on the
union of the ranks' trees, and compares: the models and the data are defined here, for both sides.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import recompile
from recompile.data import Forest, load_sst, sample_dir

STEPS = 3
TREES = 2  # per rank and step (or micro-batch)
LR = 0.5
RARE = 40  # words with an id below this take the leaf branch of their own on rank 0 (see ``rare_words``)


class TreeRNN(nn.Module):
    """A tree RNN whose leaves of rare words (an id below ``rare``) go through a layer of their own: where no
    instance takes that branch, ``self.rare`` is a parameter no instance used."""

    def __init__(self, vocab_size, dim=4, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.rare = nn.Linear(dim, dim)
        self.compose = nn.Linear(2 * dim, dim)
        self.out = nn.Linear(dim, classes)

    @recompile.function
    def encode(self, tree, i, rare):
        if tree.is_leaf[i]:
            h = torch.tanh(self.embed(tree.words[i]))
            if tree.words[i] < rare:
                h = torch.tanh(self.rare(h))
        else:
            h = torch.tanh(self.compose(torch.cat([self.encode(tree, tree.left[i], rare),
                                                   self.encode(tree, tree.right[i], rare)], dim=-1)))
        return h

    def states(self, forest, rare):
        return recompile.vmap(self.encode, in_dims=(None, 0, None))(forest, forest.roots, rare)

    def forward(self, forest, rare):
        """The mean over the forest's trees of the root's cross-entropy."""
        return F.cross_entropy(self.out(self.states(forest, rare)), forest.labels[forest.roots])


class SequentialTreeRNN(TreeRNN):
    encode = recompile.function(TreeRNN.encode.python, mode="sequential")

    def states(self, forest, rare):
        return torch.stack([self.encode(forest, root, rare) for root in forest.roots])


MODELS = {"batched": TreeRNN, "sequential": SequentialTreeRNN}


def data():
    """(the sample's training trees of at most 21 nodes, the vocabulary's size): small trees, quick steps."""
    sst = load_sst(sample_dir(), splits=("train",))
    return [t for t in sst.train if t.num_nodes <= 21], len(sst.vocab)


def new_model(mode, vocab_size):
    torch.manual_seed(0)
    return MODELS[mode](vocab_size).double()


def batches(scenario, train, rank, world=2):
    """This rank's trees: per step, a list per micro-batch (two in ``no_sync``, one elsewhere). Rank-major
    slices of ``train``, but in ``uneven``: 7 trees, which 2 ranks do not divide, in a DistributedSampler's
    shuffled order (it repeats a tree so that every rank has as many, and takes as many steps)."""
    if scenario.startswith("uneven"):
        order = list(DistributedSampler(train[:7], num_replicas=world, rank=rank, shuffle=True, seed=0))
        return [[[train[k] for k in order[start:start + TREES]]] for start in range(0, len(order), TREES)]
    micros = 2 if scenario.startswith("no_sync") else 1
    return [[train[((step * micros + micro) * world + rank) * TREES:][:TREES] for micro in range(micros)]
            for step in range(STEPS)]


def rare_words(scenario, step, rank):
    """The id below which a leaf's word takes the rare branch. Every rank's trees have such words, and take it,
    but in two scenarios: in ``unused``, rank 0 alone takes it in the first steps and no rank in the last; in
    ``undeclared`` no rank ever does."""
    if scenario.startswith("unused"):
        return RARE if rank == 0 and step < STEPS - 1 else 0
    return 0 if scenario.startswith("undeclared") else RARE


# -- the single process on the union, eagerly


def one_process(scenario, train, vocab_size, world=2):
    """The parameters after training on the union of every rank's trees in one process, as plain PyTorch."""
    model = new_model(scenario.rsplit("-", 1)[1], vocab_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ranks = [batches(scenario, train, r, world) for r in range(world)]
    with recompile.disable():  # (the recursion as plain Python: vmap a loop over the trees)
        for step, steps in enumerate(zip(*ranks)):
            parts = [(trees, rare_words(scenario, step, r)) for r, micros in enumerate(steps) for trees in micros]
            total = sum(len(trees) for trees, _ in parts)
            loss = sum(model(Forest.from_trees(trees), rare) * len(trees) for trees, rare in parts) / total
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- one rank


def gated(t, model):
    """The parameters whose gradient a lazy weight gate (one per weight and batched run) forms in the autograd
    graph of ``t``."""
    names = {id(p): name for name, p in model.named_parameters()}
    seen, found, todo = set(), [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            if "WeightGate" in node.name():
                found.append(names[id(node.next_functions[0][0].variable)])
            todo.extend(n for n, _ in node.next_functions)
    return sorted(found)


def run_ddp(scenario, train, vocab_size, rank, world):
    """Train through DDP, recording the order in which parameters got their gradients and buckets were reduced."""
    model = new_model(scenario.rsplit("-", 1)[1], vocab_size)
    # a bucket per parameter (tiny buckets), so that a reduction started during the backward shows
    ddp = DDP(model, find_unused_parameters=scenario.startswith("unused"), bucket_cap_mb=1e-6)
    events, found = [], {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("grad", name)))

    def hook(state, bucket):
        events.append(("bucket", bucket.index()))
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    steps = []
    try:
        for step, micros in enumerate(batches(scenario, train, rank, world)):
            opt.zero_grad()
            for micro, trees in enumerate(micros):
                events.clear()
                syncing = micro == len(micros) - 1
                with ddp.no_sync() if not syncing else contextlib.nullcontext():
                    loss = ddp(Forest.from_trees(trees), rare_words(scenario, step, rank)) / len(micros)
                    gates = gated(loss, model)
                    loss.backward()
                steps.append({"step": step, "synced": syncing, "events": list(events), "gates": gates,
                              "no_grad": sorted(n for n, p in model.named_parameters() if p.grad is None)})
            opt.step()
    except RuntimeError as err:
        if not scenario.startswith("undeclared"):
            raise
        found["error"] = str(err)  # (unused parameters DDP was not told of: its documented error)
    found.update(state={k: v.detach().clone() for k, v in model.state_dict().items()}, steps=steps)
    return found


def run_fsdp(scenario, train, vocab_size, rank, world):
    """Train through FSDP2, the whole model one unit: its parameters sharded between the steps."""
    from torch.distributed.fsdp import fully_shard

    mode = scenario.rsplit("-", 1)[1]
    model = new_model(mode, vocab_size)
    fully_shard(model)
    sharded = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (trees,) in enumerate(batches(scenario, train, rank, world)):
        loss = model(Forest.from_trees(trees), rare_words(scenario, step, rank))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"state": {k: v.full_tensor() for k, v in model.state_dict().items()}, "sharded": sharded}


def stop_mid_step(scenario, train, vocab_size, rank, world):
    """Rank 1 stops in the middle of step 1: it raises inside a compiled call (``raise``: a word past the
    vocabulary), or waits after its forward to be killed (``kill``). Rank 0 is then left in its backward's
    reduction, which must end in an error, not a hang."""
    model = new_model("batched", vocab_size)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step, (trees,) in enumerate(batches(scenario, train, rank, world)):
        forest = Forest.from_trees(trees)
        if step == 1 and rank == 1 and scenario == "raise":
            forest.words[forest.words >= 0] += vocab_size
        loss = ddp(forest, RARE)
        if step == 1 and rank == 1 and scenario == "kill":
            print("mid-step", flush=True)
            time.sleep(120)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank}: step {step} done", flush=True)
    return {}


def run_rank(out, scenarios):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    train, vocab_size = data()
    found, scenario = {}, None
    try:
        for scenario in scenarios:
            run = stop_mid_step if scenario in ("raise", "kill") else run_fsdp if scenario.startswith("fsdp") \
                else run_ddp
            found[scenario] = run(scenario, train, vocab_size, rank, world)
            torch.save(found, os.path.join(out, f"rank{rank}.pt"))  # (kept if a later scenario ends the job)
    except Exception as err:
        # what a user of DDP sees on the rank left behind: which rank, where, and the collective's own error
        print(f"rank {rank}: training stopped in {scenario}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        raise
    dist.destroy_process_group()


def fork_ranks(out, scenarios, world=2):
    """Run ``world`` ranks, each a fork of this process; print each one's pid as it starts."""
    for name in ("torch._dynamo", "torch.distributed.fsdp"):  # (what DDP and FSDP import: here once, for all)
        importlib.import_module(name)

    ranks = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            code = 1
            with open(os.path.join(out, f"rank{rank}.log"), "w") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                try:
                    run_rank(out, scenarios)
                    code = 0
                except BaseException:
                    traceback.print_exc()  # (as Python would print it: with recompile's call chain note)
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        ranks[pid] = rank
        print(f"rank {rank} pid {pid}", flush=True)
    while ranks:
        pid, status = os.wait()
        with open(os.path.join(out, f"rank{ranks.pop(pid)}.end"), "w") as end:
            end.write(f"{os.waitstatus_to_exitcode(status)} {time.time()}")


if __name__ == "__main__":
    fork_ranks(sys.argv[1], sys.argv[2:])
