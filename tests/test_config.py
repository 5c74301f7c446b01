"""recompile.config: one switch or limit, read where it is used, seen by every scheduler."""

import pytest
import torch

import recompile
from recompile import config


def chain(n, x):
    if n == 0:
        return x
    return chain(n - 1, x) + 1.0


def tree_sum(left, right, value, i):
    if left[i] < 0:  # a leaf
        return value[i]
    return tree_sum(left, right, value, left[i]) + tree_sum(left, right, value, right[i])


def comb(depth):
    """A tree whose left spine is ``depth`` calls deep: node 2k's children are 2k+1 (a leaf) and 2k+2."""
    left, right = [], []
    for k in range(depth):
        left += [2 * k + 2, -1]
        right += [2 * k + 1, -1]
    return left + [-1], right + [-1]


@pytest.mark.parametrize("mode, threads", [("sequential", None), ("threaded", 2), ("batched", None)])
def test_max_depth_is_read_by_every_scheduler_when_a_call_runs(mode, threads, monkeypatch):
    f = recompile.function(chain, mode=mode, threads=threads)
    x = torch.zeros(2)
    assert torch.equal(f(40, x), x + 40)
    monkeypatch.setattr(config, "MAX_DEPTH", 30)
    assert torch.equal(f(10, x), x + 10)  # (batched frames count a call's branch too: two per level)
    with pytest.raises(RecursionError, match=r"exceeded \(30\)"):
        f(31, x)


def test_max_depth_stops_a_level_run_too(monkeypatch):
    f = recompile.function(tree_sum)
    left, right = comb(20)
    value = torch.arange(float(len(left)))
    want = value[[k for k in range(len(left)) if left[k] < 0]].sum()
    torch.testing.assert_close(f(left, right, value, 0), want)
    assert f.callee(None).batched_unit.levels.runs == 1  # (it ran as a level program)
    monkeypatch.setattr(config, "MAX_DEPTH", 10)
    with pytest.raises(RecursionError, match=r"exceeded \(10\)"):
        f(left, right, value, 0)


def test_chain_shown_is_read_when_the_note_is_written(monkeypatch):
    f = recompile.function(chain, mode="sequential")
    monkeypatch.setattr(config, "CHAIN_SHOWN", 2)
    with pytest.raises(TypeError) as info:
        f(9, "not a tensor")  # (str + 1.0 fails in chain(1), at depth 8: nine calls)
    note = "".join(info.value.__notes__)
    assert "... 5 more compiled calls ..." in note and note.count("chain (") == 4


def test_the_default_bound_on_live_frames_is_read_when_a_call_starts(monkeypatch):
    f = recompile.function(chain, mode="threaded", threads=2)
    assert f.max_live_frames == config.MAX_LIVE_FRAMES
    monkeypatch.setattr(config, "MAX_LIVE_FRAMES", 7)
    assert f.max_live_frames == 7 and torch.equal(f(20, torch.zeros(1)), torch.full((1,), 20.0))
    assert recompile.function(chain, mode="threaded", max_live_frames=3).max_live_frames == 3


def count_leaves(left, right, i):
    if left[i] < 0:
        return torch.ones(())
    return count_leaves(left, right, left[i]) + count_leaves(left, right, right[i])


def test_switching_level_programs_off_is_seen_by_the_next_call(monkeypatch):
    f = recompile.function(count_leaves)
    left, right = comb(6)
    assert float(f(left, right, 0)) == 7
    program = f.callee(None).batched_unit.levels
    runs = program.runs
    monkeypatch.setattr(config, "LEVELS", False)
    assert float(f(left, right, 0)) == 7 and program.runs == runs  # (the agenda ran it)
    monkeypatch.setattr(config, "LEVELS", True)
    assert float(f(left, right, 0)) == 7 and program.runs == runs + 1


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched", "vmap"])
def test_a_cycle_in_a_trees_indices_ends_in_recursion_error_in_every_mode(mode, monkeypatch):
    """Node 3's left child is node 2, whose left child is node 3: plain Python raises RecursionError; so does
    every mode, at the depth limit (whose default a cycle reaches in seconds: see config.MAX_DEPTH)."""
    assert config.MAX_DEPTH <= 200_000
    monkeypatch.setattr(config, "MAX_DEPTH", 2000)
    left, right, value = torch.tensor([-1, -1, 3, 2]), torch.tensor([-1, -1, 1, 1]), torch.arange(4.0)
    with pytest.raises(RecursionError):
        tree_sum(left, right, value, 3)
    f = recompile.function(tree_sum, mode="batched" if mode == "vmap" else mode)
    with pytest.raises(RecursionError, match=r"exceeded \(2000\)"):
        if mode == "vmap":
            recompile.vmap(f, in_dims=(None, None, None, 0))(left, right, value, torch.tensor([3, 2]))
        else:
            f(left, right, value, 3)
