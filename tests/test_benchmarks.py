"""The benchmark scripts run end to end (speed itself is measured by running them, not here)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from recompile.data import sample_dir  # noqa: E402

import bench_batching  # noqa: E402
import bench_fusion  # noqa: E402
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
