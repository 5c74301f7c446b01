"""The benchmark scripts run end to end (speed itself is measured by running them, not here)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_batching  # noqa: E402
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
    assert "recompile failed" not in out
