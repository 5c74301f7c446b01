"""The benchmark scripts run end to end (speed itself is measured by running them, not here)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

from recompile.data import sample_dir  # noqa: E402

import bench_batching  # noqa: E402
import bench_copied  # noqa: E402
import bench_dynet  # noqa: E402
import bench_fusion  # noqa: E402
import bench_in_place  # noqa: E402
import bench_objects  # noqa: E402
import bench_idioms  # noqa: E402
import bench_memory  # noqa: E402
import bench_parsers  # noqa: E402
import bench_sequences  # noqa: E402
import bench_threads  # noqa: E402
import bench_tree_lstm as bench  # noqa: E402


def test_tree_lstm_benchmark_runs(capsys):
    bench.main(["--trees", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "inference" in out and "training" in out
    assert out.count("x\n") == 2  # one ratio per mode
    assert "calls without a gradient rule: 0" in out  # the Tree-LSTM trains on rules alone


def test_batching_benchmark_runs(capsys):
    bench_batching.main(["--trees", "8", "--eager-trees", "8", "--batch", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "hand-batched matches eager" in out  # (main raises before the table otherwise)
    rows = [line.split() for line in out.splitlines() if line.startswith(("inference", "training"))]
    assert [row[:2] for row in rows] == [["inference", "4"], ["training", "4"]]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows)  # eager and hand-batched trees/s
    assert "recompile matches eager" in out  # the batched column works and agrees with eager
    assert all(float(row[4]) > 0 and row[5].endswith("x") for row in rows)
    assert "schedule matches eager" in out  # the schedule column computes what eager does
    for row in rows:  # mode batch | eager hand recompile rec/hand rec/eager | schedule sched/hand rec/sched
        assert len(row) == 10 and float(row[7]) > 0
        assert float(row[8][:-1]) == pytest.approx(float(row[7]) / float(row[3]), rel=0.02, abs=0.01)
        assert float(row[9][:-1]) == pytest.approx(float(row[4]) / float(row[7]), rel=0.02, abs=0.01)
    assert "recompile failed" not in out


def test_objects_benchmark_checks_and_times_every_model(capsys):
    bench_objects.main(["--trees", "6", "--batch", "3", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.count("recompile.map and hand-batched match eager") == 3  # (main raises before a table otherwise)
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("inference", "training"))]
    assert [row[:2] for row in rows] == [["inference", "3"], ["training", "3"]] * 3
    for row in rows:  # mode batch | hand recompile rec/hand
        assert float(row[2]) > 0 and float(row[3]) > 0
        assert float(row[4][:-1]) == pytest.approx(float(row[3]) / float(row[2]), rel=0.02, abs=0.01)


@pytest.mark.slow  # (about 20 s: three models built and checked in float64)
def test_copied_benchmark_checks_and_times_every_model(capsys):
    bench_copied.main(["--trees", "6", "--batch", "3", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.count("recompile.map matches eager") == 3  # (main raises before a table otherwise)
    assert out.count("per-instance ops: none") >= 1  # (the Tree-LSTM returning its states batches whole)
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("inference", "training"))]
    assert [row[:2] for row in rows] == [["inference", "3"], ["training", "3"]] * 3
    for row in rows:  # mode batch | eager recompile rec/eager
        assert float(row[2]) > 0 and float(row[3]) > 0
        assert float(row[4][:-1]) == pytest.approx(float(row[3]) / float(row[2]), rel=0.02, abs=0.01)


@pytest.mark.slow  # (about 6 s: every spelling checked in float64)
def test_idioms_benchmark_checks_and_times_every_spelling(capsys):
    bench_idioms.main(["--trees", "8", "--batch", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    spellings = len(bench_idioms.SPELLINGS) + len(bench_idioms.RNTN_SPELLINGS) + len(bench_idioms.CELL_SPELLINGS) \
        + len(bench_idioms.MODULE_SPELLINGS) + len(bench_idioms.LIST_SPELLINGS) + len(bench_idioms.FILTERED_SPELLINGS)
    assert out.count("matches eager") == spellings + 6  # (and each family's hand-batched code; main raises before
    # the table otherwise)
    assert out.count("per-instance ops: none") == spellings
    rows = [line for line in out.splitlines() if line.rstrip().endswith("x") and " 4 " in line]
    assert len(rows) == 2 * spellings  # each spelling, inference and training


@pytest.mark.slow  # (about 3 s)
def test_sequences_benchmark_checks_and_times_the_lstms_and_the_top_down_model(capsys):
    bench_sequences.main(["--trees", "8", "--batch", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert out.count("matches eager; per-instance ops: none") == 18  # (main raises before a table otherwise)
    rows = [line for line in out.splitlines() if line.rstrip().endswith("x") and " 4 " in line]
    assert len(rows) == 2 * 18  # five LSTM spellings, two pooled, two layers, attention, both directions, two
    # recurrences written out, two text CNNs, two taggers, a CRF, the top-down model; both modes


@pytest.mark.slow  # (about 3 s with DyNet)
def test_dynet_benchmark_checks_and_times_every_model_or_says_dynet_is_missing(capsys):
    bench_dynet.main(["--trees", "8", "--batch", "4", "--repeats", "1", "--dynet-mem", "256", "--sparse"])
    out = capsys.readouterr().out
    if "DyNet is not installed" in out:
        return
    assert out.count("DyNet matches eager PyTorch") == 7  # (main raises before the table otherwise)
    rows = [line for line in out.splitlines() if line.rstrip().endswith("x") and " 4 " in line]
    assert len(rows) == 2 * 7


@pytest.mark.slow  # (about 4 s: a process per measure)
def test_in_place_benchmark_checks_and_times_every_program(capsys):
    bench_in_place.main(["--instances", "4", "--steps", "6", "--repeats", "1"])
    out = capsys.readouterr().out
    assert sum(line.count("x") and line.rstrip().endswith("x") for line in out.splitlines()) == \
        2 * len(bench_in_place.PROGRAMS)


def test_memory_benchmark_checks_gradients_and_measures_each_mode_in_a_process_of_its_own(capsys):
    bench_memory.main(["--lengths", "300", "--modes", "sequential"])
    out = capsys.readouterr().out
    assert "every mode's gradient matches eager (sequential)" in out  # (main raises before the table otherwise)
    (row,) = [line for line in out.splitlines() if line.startswith("    300")]
    cells = re.findall(r"(\d+\.\d) \( *(\d+\.\d)x\) +(\d+\.\d\d)s", row)  # MB (ratio) seconds, per mode
    assert len(cells) == 2 and cells[0][1] == "1.0"  # eager, and sequential


def test_batching_benchmark_times_its_runs_in_turns():
    order = []

    def loss_fn(name):
        def run(batch):
            order.append(name)
            return bench_batching.torch.zeros((), requires_grad=True)
        return run

    model = bench_batching.torch.nn.Linear(1, 1)
    best = bench_batching.throughputs({name: (loss_fn(name), model, [[0], [1]]) for name in "ab"}, False, 2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 2  # warm-up on the first batch, then one pass each
    assert all(best[name] > 0 for name in "ab")


def test_fusion_benchmark_runs(capsys):
    # Hidden 8 keeps every fused op below codegen.fused.COMPILE_MIN_ELEMENTS: the compile variant runs its
    # plain function, so no torch.compile here (the full run compiles).
    bench_fusion.main(["--data", str(sample_dir()), "--trees", "8", "--hidden", "8", "--batch", "4", "8",
                       "--repeats", "1"])
    out = capsys.readouterr().out
    # float64: per-tree h, c, loss and every gradient of both fused variants equal unfused (main raises otherwise)
    assert "hidden 8 check: ok" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("inference", "training"))]
    assert [row[:2] for row in rows] == [["inference", "4"], ["inference", "8"], ["training", "4"], ["training", "8"]]
    for row in rows:  # mode batch | unfused python ratio compile ratio | first call: unfused python compile
        assert len(row) == 10
        assert all(float(row[k]) > 0 for k in (2, 3, 5, 7, 8, 9))
        assert row[4].endswith("x") and row[6].endswith("x")
        assert abs(float(row[4][:-1]) - float(row[3]) / float(row[2])) < 0.01


@pytest.mark.slow  # (about 4 s)
def test_threads_benchmark_runs(capsys):
    bench_threads.main(["--data", str(sample_dir()), "--quick", "--threads", "1", "2"])
    out = capsys.readouterr().out
    # float64: threaded outputs and gradients equal sequential's (main raises otherwise)
    assert "TreeLSTM check: ok" in out and "TreeRNN check: ok" in out
    assert "torch threads: 1, CPU cores: " in out
    rows = [row for row in map(str.split, out.splitlines()) if row[1:2] in (["inference"], ["training"])]
    assert [row[:3] for row in rows] == [[model, phase, shape] for model in ("TreeLSTM", "TreeRNN")
                                         for phase in ("inference", "training")
                                         for shape in ("moderate", "balanced", "linear")]
    for row in rows:  # model phase shape | sequential | threaded1 ratio | threaded2 ratio
        assert len(row) == 8
        assert all(float(row[k]) > 0 for k in (3, 4, 6))
        assert row[5].endswith("x") and row[7].endswith("x")
        # (the ratio is of the unrounded rates: tiny quick-run rates printed to 0.1 differ by a little more)
        assert float(row[5][:-1]) == pytest.approx(float(row[4]) / float(row[3]), rel=0.02, abs=0.01)


def test_threads_benchmark_tree_shapes():
    sentence = bench_threads.load_sst(sample_dir(), splits=("train",)).train[0]
    for shape in bench_threads.SHAPES:
        tree = bench_threads.reshape(sentence, shape)
        assert tree.tokens == sentence.tokens and tree.num_nodes == sentence.num_nodes
        assert tree.words[tree.is_leaf].tolist() == sentence.words[sentence.is_leaf].tolist()
    n = sentence.num_leaves
    assert bench_threads.reshape(sentence, "linear").height == n - 1
    assert bench_threads.reshape(sentence, "balanced").height == (n - 1).bit_length()  # ceil(log2 n)


@pytest.mark.slow  # (about 8 s: its processes import torch.distributed and build the model afresh)
def test_distributed_benchmark_checks_and_times_one_and_two_processes():
    # (in a process of its own: the benchmark's ranks are forks of the process that runs it)
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_distributed.py"), "--trees", "8",
                           "--batch", "4", "--embed", "8", "--hidden", "6", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "check: 2 ranks train as one process on the union of their minibatches" in out
    rows = {line[:18].strip(): line[18:].split() for line in out.splitlines() if line.startswith(("1 ", "2 "))}
    assert list(rows) == ["1 process", "1 process, DDP", "2 processes, DDP"]
    assert rows["1 process"][1] == "1.00x"
    assert all(float(rate) > 0 and ratio.endswith("x") and float(per_cpu) > 0 for rate, ratio, per_cpu in rows.values())
    efficiency = float(out.split("scaling efficiency of 2 processes: ")[1].split()[0])
    assert efficiency == pytest.approx(float(rows["2 processes, DDP"][0]) / (2 * float(rows["1 process"][0])),
                                       abs=0.01)


@pytest.mark.slow  # (about 6 s: every spelling checked in float64)
def test_parsers_benchmark_checks_and_times_every_stack_spelling(capsys):
    bench_parsers.main(["--trees", "6", "--batch", "3", "--repeats", "1"])
    out = capsys.readouterr().out
    spellings = len(bench_parsers.SPELLINGS)
    assert out.count("matches eager and the Tree-LSTM; per-instance ops: none") == spellings  # (main raises
    # before the table otherwise)
    assert "SPINN batched by hand      matches eager" in out
    rows = [line for line in out.splitlines() if line.rstrip().endswith("x") and " 3 " in line]
    assert len(rows) == 2 * spellings  # each spelling, inference and training
