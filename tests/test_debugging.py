"""recompile.disable() and RECOMPILE_DISABLE: compiled functions run as the plain Python they were made from."""

import collections
import importlib
import traceback

import pytest
import torch
from torch import nn

import recompile
from recompile import config

visits = []


@recompile.function
def tree_sum(left, right, value, i):
    visits.append(int(i))  # (plain Python order: depth first, left before right)
    if left[i] < 0:
        return value[i]
    return tree_sum(left, right, value, left[i]) + tree_sum(left, right, value, right[i])


LEFT, RIGHT, VALUE = torch.tensor([1, 3, -1, -1, -1]), torch.tensor([2, 4, -1, -1, -1]), torch.arange(5.0)


def test_recursion_runs_as_plain_python_inside_the_block_only():
    visits.clear()
    calls = tree_sum.stats["calls"]
    with recompile.disable():
        assert float(tree_sum(LEFT, RIGHT, VALUE, 0)) == 9.0
        assert config.DISABLED
    assert visits == [0, 1, 3, 4, 2]  # every call went through plain Python
    assert tree_sum.stats["calls"] == calls  # and none through the compiled program
    assert not config.DISABLED
    assert float(tree_sum(LEFT, RIGHT, VALUE, 0)) == 9.0 and tree_sum.stats["calls"] == calls + 1


class Node(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2).double()

    @recompile.function
    def encode(self, left, right, x, i):
        if left[i] < 0:
            return self.lin(x[i])
        return torch.tanh(self.encode(left, right, x, left[i]) + self.encode(left, right, x, right[i]))


def test_a_method_recursing_through_self_is_plain_too_and_an_error_has_a_plain_traceback():
    m = Node()
    x = torch.randn(5, 2, dtype=torch.float64)
    want = m.encode(LEFT, RIGHT, x, 0)
    with recompile.disable():
        torch.testing.assert_close(m.encode(LEFT, RIGHT, x, 0), want)
        with pytest.raises(IndexError) as info:
            m.encode(LEFT, RIGHT, x[:3], 0)  # rows 3 and 4 are missing
    assert not any("recompile call chain" in n for n in getattr(info.value, "__notes__", []))
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.name == "encode"]
    assert len(frames) >= 3 and frames[-1].line == "return self.lin(x[i])"  # the user's own frames


Pair = collections.namedtuple("Pair", "total first")


@recompile.function
def total_and_first(left, right, value, i):
    return Pair(tree_sum(left, right, value, i), value[i])


def test_vmap_is_a_loop_over_instances_stacked_as_vmap_returns_them():
    roots = torch.tensor([0, 1, 2])
    want = recompile.vmap(total_and_first, in_dims=(None, None, None, 0))(LEFT, RIGHT, VALUE, roots)
    visits.clear()
    with recompile.disable():
        got = recompile.vmap(total_and_first, in_dims=(None, None, None, 0), out_dims=0)(LEFT, RIGHT, VALUE, roots)
        moved = recompile.vmap(tree_sum, in_dims=(None, None, 0, 0), out_dims=1)(
            LEFT, RIGHT, VALUE[:, None].expand(3, 5, 2), roots)  # (each instance's values (5, 2): a (2,) result)
    assert type(got) is Pair
    torch.testing.assert_close(got.total, want.total)
    torch.testing.assert_close(got.first, want.first)
    assert visits[:5] == [0, 1, 3, 4, 2]  # instance 0's whole recursion first: one plain call per instance
    assert moved.shape == (2, 3)


def test_the_switch_is_restored_after_an_error():
    with pytest.raises(ZeroDivisionError):
        with recompile.disable():
            1 / 0
    assert not config.DISABLED


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False), ("no", False)])
def test_the_environment_variable_sets_the_switch(monkeypatch, value, on):
    monkeypatch.setenv("RECOMPILE_DISABLE", value)
    try:
        importlib.reload(config)
        assert config.DISABLED is on
    finally:
        monkeypatch.delenv("RECOMPILE_DISABLE")
        importlib.reload(config)
    assert config.DISABLED is False
