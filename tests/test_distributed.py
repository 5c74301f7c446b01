"""Data-parallel training of compiled models with torch.distributed: 2 processes on the loopback address (gloo, CPU).

The ranks run ``tests/distributed_worker.py``; each of their results is compared with one process training
eagerly, in plain PyTorch, on the union of the ranks' trees.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import distributed_worker as worker  # noqa: E402

# (processes of their own, about 20 s in all: with the slow tests, which CI runs after the default run)
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = ["batched", "sequential"]
TIMEOUT = 90  # seconds a launch may take before its processes are killed and the test fails


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """2 ranks started by ``distributed_worker.py``, forks of one process, on the loopback address."""

    def __init__(self, out, scenarios):
        self.out = out
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        # (a session of its own: a launch that runs past its time is killed whole, ranks included)
        self.driver = subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_worker.py"), str(out),
                                        *scenarios], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True)
        self.deadline = time.monotonic() + TIMEOUT

    def pid(self, rank):
        while True:
            line = self.driver.stdout.readline()  # (printed at once, after the driver's imports)
            if not line:
                self.fail("the driver ended before starting its ranks")
            if line.startswith(f"rank {rank} pid "):
                return int(line.split()[-1])

    def wait_for(self, rank, text):
        """Wait until rank ``rank`` printed ``text``."""
        log = self.out / f"rank{rank}.log"
        while not (log.exists() and text in log.read_text()):
            if time.monotonic() > self.deadline or (self.out / f"rank{rank}.end").exists():
                self.fail(f"rank {rank} did not print {text!r}")
            time.sleep(0.05)

    def finish(self):
        """Each rank's (exit status, output, the time it ended)."""
        try:
            self.driver.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.fail(f"the ranks did not end within {TIMEOUT} s")
        ended = []
        for rank in range(2):
            status, when = (self.out / f"rank{rank}.end").read_text().split()
            ended.append((int(status), (self.out / f"rank{rank}.log").read_text(), float(when)))
        return ended

    def fail(self, why):
        if self.driver.poll() is None:
            os.killpg(self.driver.pid, signal.SIGKILL)
        logs = [p.read_text() for p in sorted(self.out.glob("rank*.log"))]
        pytest.fail(f"{why}: {self.driver.communicate()}\n" + "\n".join(logs))


@pytest.fixture(scope="module")
def train():
    return worker.data()


KINDS = ["plain", "no_sync", "unused", "uneven", "fsdp", "undeclared"]
SCENARIOS = [f"{kind}-{mode}" for kind in KINDS for mode in MODES]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch of 2 ranks for every scenario, ended by ``raise`` (rank 1 raises in a compiled call): what each
    rank found, and each rank's (exit status, output, the time it ended)."""
    out = tmp_path_factory.mktemp("ranks")
    ended = Launch(out, SCENARIOS + ["raise"]).finish()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], ended


@pytest.fixture(scope="module")
def ranks(launched):
    return launched[0]


def assert_state_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-10, msg=k)


@pytest.mark.parametrize("kind", KINDS[:-1])
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_train_as_one_process_on_the_union_of_their_trees(ranks, train, kind, mode):
    scenario = f"{kind}-{mode}"
    want = worker.one_process(scenario, *train)
    for found in ranks:
        assert_state_equal(found[scenario]["state"], want)


@pytest.mark.parametrize("mode", MODES)
def test_buckets_are_reduced_while_the_backward_runs_and_every_parameter_reached_fires_its_hook(ranks, mode):
    names = {name for name, _ in worker.new_model(mode, 10).named_parameters()}
    for found in ranks:
        steps = found[f"plain-{mode}"]["steps"]
        for step in steps:
            events = step["events"]
            grads = [k for k, (kind, _) in enumerate(events) if kind == "grad"]
            assert {events[k][1] for k in grads} == names
            # in batched mode, lazy weight gradients: one gate per weight of few-row products, formed once
            assert step["gates"] == (["compose.weight", "embed.weight", "rare.weight"] if mode == "batched" else [])
        for step in steps[1:]:  # (DDP's first step reduces one bucket; then the buckets of the order seen)
            events = step["events"]
            buckets = [k for k, (kind, _) in enumerate(events) if kind == "bucket"]
            last_grad = max(k for k, (kind, _) in enumerate(events) if kind == "grad")
            assert len(buckets) == len(names) and buckets[0] < last_grad  # (a reduction began mid-backward)


@pytest.mark.parametrize("mode", MODES)
def test_no_sync_accumulates_locally_and_reduces_on_the_next_backward(ranks, mode):
    for found in ranks:
        steps = found[f"no_sync-{mode}"]["steps"]
        assert [s["synced"] for s in steps] == [False, True] * worker.STEPS
        for s in steps:
            reduced = [e for e in s["events"] if e[0] == "bucket"]
            assert bool(reduced) == s["synced"]
    # (the parameters equal one process's on all the micro-batches: test_two_ranks_train_as_one_process_...)


@pytest.mark.parametrize("mode", MODES)
def test_unused_parameters_behave_as_ddp_documents(ranks, mode):
    rare = ["rare.bias", "rare.weight"]
    for rank, found in enumerate(ranks):
        steps = found[f"unused-{mode}"]["steps"]
        # used on rank 0 only: both ranks get the averaged gradient; used on no rank: .grad stays None on all
        assert [s["no_grad"] for s in steps] == [[], [], rare]
        grads = {name for s in steps for kind, name in s["events"] if kind == "grad"}
        assert ("rare.weight" in grads) == (rank == 0)  # (the other rank's hook never fired: DDP reduced zeros)
        # without find_unused_parameters=True, DDP's own error at the next forward, on every rank
        undeclared = found[f"undeclared-{mode}"]
        assert "find_unused_parameters=True" in undeclared["error"] and len(undeclared["steps"]) == 1


def test_fsdp2_shards_the_parameters_between_the_steps(ranks):
    for found in ranks:
        sharded = found["fsdp-batched"]["sharded"]
        assert sharded["compose.weight"][0] == 2 and sharded["embed.weight"][1] == 4  # (4 rows of 8 in 2 shards)


def test_a_killed_rank_ends_the_other_with_an_error_within_bounded_time(tmp_path):
    launch = Launch(tmp_path, ["kill"])
    pid = launch.pid(1)
    launch.wait_for(1, "mid-step")  # rank 1 is between its forward and its backward; rank 0 in its backward
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    (rc0, log0, ended0), (rc1, _, _) = launch.finish()
    assert rc1 == -signal.SIGKILL
    assert rc0 != 0 and ended0 - killed < 30
    assert "rank 0: step 0 done" in log0 and "step 1 done" not in log0
    assert "rank 0: training stopped in kill" in log0 and "peer" in log0  # (gloo: connection closed by peer)


def test_a_rank_raising_in_a_compiled_call_shows_its_call_chain_and_ends_the_other(launched):
    found, ((rc0, log0, ended0), (rc1, log1, ended1)) = launched
    assert rc1 != 0 and "IndexError: index out of range" in log1
    assert "TreeRNN.encode" in log1.split("recompile call chain")[1]
    assert rc0 != 0 and ended0 - ended1 < 30  # (rank 0 was in its backward's reduction: no hang)
    assert "rank 0: training stopped in raise" in log0 and "peer" in log0
    assert set(found[0]) == set(SCENARIOS)  # (every scenario before it ran to its end)


# -- examples/distributed.py

sys.path.insert(0, str(ROOT / "examples"))

import distributed as example  # noqa: E402  (examples/distributed.py)

TINY = ["--limit", "8", "--embed", "8", "--hidden", "6", "--lr", "0.1"]


def weights(checkpoint):
    return torch.load(checkpoint, weights_only=False)["model"]


def test_the_example_trains_without_a_launcher_and_goes_on_from_its_checkpoint(tmp_path, capsys):
    straight, stopped = str(tmp_path / "straight.pt"), str(tmp_path / "stopped.pt")
    history = example.main(TINY + ["--batch", "4", "--epochs", "2", "--checkpoint", straight])
    example.main(TINY + ["--batch", "4", "--epochs", "1", "--checkpoint", stopped])
    assert example.main(TINY + ["--batch", "4", "--epochs", "2", "--checkpoint", stopped, "--resume"]) == history
    assert_state_equal(weights(stopped), weights(straight))
    out = capsys.readouterr().out
    assert "on 1 ranks (gloo)" in out and "resumed from" in out and out.count("dev root accuracy") == 4


@pytest.mark.slow
def test_the_example_under_torchrun_trains_as_one_process_on_the_ranks_trees_and_resumes_on_any_world_size(
        tmp_path):
    """2 ranks of 2 trees a step train as one process of 4 trees a step (float32); the checkpoint they write
    goes on in one process."""
    ran, straight = str(tmp_path / "ran.pt"), str(tmp_path / "straight.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "examples" / "distributed.py"), *TINY, "--batch", "2", "--epochs", "1",
                           "--checkpoint", ran], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "on 2 ranks (gloo)" in done.stdout and done.stdout.count("dev root accuracy") == 1  # (rank 0 logs)
    example.main(TINY + ["--batch", "4", "--epochs", "2", "--checkpoint", ran, "--resume"])
    example.main(TINY + ["--batch", "4", "--epochs", "2", "--checkpoint", straight])
    for k, want in weights(straight).items():
        torch.testing.assert_close(weights(ran)[k], want, rtol=0, atol=1e-5, msg=k)
