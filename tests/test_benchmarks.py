"""The benchmark scripts run end to end (speed itself is measured by running them, not here)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_tree_lstm as bench  # noqa: E402


def test_tree_lstm_benchmark_runs(capsys):
    bench.main(["--trees", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "inference" in out and "training" in out
    assert out.count("x\n") == 2  # one ratio per mode
    assert "calls without a gradient rule: 0" in out  # the Tree-LSTM trains on rules alone
