"""recompile.runtime.scheduler: frames off the Python stack, run statistics, the call-chain note, threads.

Expected line numbers come from ``# L:<name>`` markers.
"""

from __future__ import annotations

import os
import random
import re
import sys

import pytest

import recompile
from recompile import config
from concurrency import run_threads  # tests/ is on sys.path under pytest
from index_trees import random_index_tree
from source_lines import marker

HERE = os.path.basename(__file__)
SHOWN = config.CHAIN_SHOWN



# ---------------------------------------------------------------------------
# functions under test


@recompile.function(mode="sequential")
def sch_depth(n):
    if n == 0:
        return 0
    return sch_depth(n - 1) + 1


@recompile.function(mode="sequential")
def sch_fail_at(n, k):
    if n == k:
        return 10 // (n - k)  # L:fail
    return sch_fail_at(n + 1, k)  # L:call


@recompile.function(mode="sequential")
def sch_tree(left, right, vals, i):
    if left[i] < 0:
        return vals[i]
    return sch_tree(left, right, vals, left[i]) + sch_tree(left, right, vals, right[i])


class PlainCounter:
    """Runs the plain recursion, counting activations and the deepest one (root = depth 0)."""

    def __init__(self):
        self.calls = 0
        self.max_depth = 0

    def tree(self, left, right, vals, i, depth=0):
        self.calls += 1
        self.max_depth = max(self.max_depth, depth)
        if left[i] < 0:
            return vals[i]
        return (self.tree(left, right, vals, left[i], depth + 1)
                + self.tree(left, right, vals, right[i], depth + 1))


@recompile.function(mode="sequential")
def sch_even(n):
    if n == 0:
        return 1 // n  # L:fail
    return sch_odd(n - 1)  # L:call


@recompile.function(mode="sequential")
def sch_odd(n):
    return sch_even(n - 1)  # L:call


@recompile.function(mode="sequential")
def sch_leaf(x):
    return 10 // x  # L:fail


@recompile.function(mode="sequential")
def sch_walk(n, x):
    if n == 0:
        return sch_leaf(x)  # L:leaf
    return sch_walk(n - 1, x)  # L:call


def sch_walk_plain(n, x):
    if n == 0:
        return 10 // x
    return sch_walk_plain(n - 1, x)


# a small tree:          0
#                     1     2
#                   3   4
#                  5 6
LEFT = [1, 3, -1, 5, -1, -1, -1]
RIGHT = [2, 4, -1, 6, -1, -1, -1]
VALS = [0, 10, 20, 30, 40, 50, 60]


def random_tree(rnd, n_leaves):
    return random_index_tree(rnd, n_leaves, values=True)


# ---------------------------------------------------------------------------
# deep recursion


def test_recursion_100000_deep():
    limit = sys.getrecursionlimit()
    assert limit < 100_000
    before = dict(sch_depth.stats)
    assert sch_depth(100_000) == 100_000
    assert sys.getrecursionlimit() == limit
    assert sch_depth.stats["max_depth"] >= 100_000
    assert sch_depth.stats["frames"] - before["frames"] == 100_001
    assert sch_depth(3) == 3  # and it still works on small input
    assert sys.getrecursionlimit() == limit


def test_error_100000_deep_is_reported_and_truncated():
    limit = sys.getrecursionlimit()
    with pytest.raises(ZeroDivisionError) as info:
        sch_fail_at(0, 100_000)
    assert sys.getrecursionlimit() == limit
    (note,) = info.value.__notes__
    lines = note.splitlines()
    assert lines[0] == "recompile call chain, root first (depth 100000):"
    assert len(lines) == 1 + 2 * SHOWN + 1
    assert lines[1 + SHOWN] == f"  ... {100_001 - 2 * SHOWN} more compiled calls ..."


# ---------------------------------------------------------------------------
# statistics


def test_stats_frames_and_max_depth_of_a_small_tree():
    counter = PlainCounter()
    want = counter.tree(LEFT, RIGHT, VALS, 0)
    assert (counter.calls, counter.max_depth) == (7, 3)
    g = _fresh_tree()
    assert g.stats == {"builds": 0, "calls": 0, "frames": 0, "max_depth": 0, "backwards": 0, "grad_fallbacks": {}}
    assert g(LEFT, RIGHT, VALS, 0) == want
    assert g.stats == {"builds": 1, "calls": 1, "frames": 7, "max_depth": 3, "backwards": 0, "grad_fallbacks": {}}
    assert g(LEFT, RIGHT, VALS, 1) == VALS[5] + VALS[6] + VALS[4]  # a subtree: 5 frames, depth 2
    assert g.stats == {"builds": 1, "calls": 2, "frames": 12, "max_depth": 3, "backwards": 0, "grad_fallbacks": {}}
    assert g(LEFT, RIGHT, VALS, 2) == VALS[2]  # a leaf: one frame at depth 0
    assert g.stats == {"builds": 1, "calls": 3, "frames": 13, "max_depth": 3, "backwards": 0, "grad_fallbacks": {}}


def _fresh_tree():
    """A compiled tree function of its own (fresh stats) whose recursion is an Invoke of itself."""

    @recompile.function(mode="sequential")
    def tree(left, right, vals, i):
        if left[i] < 0:
            return vals[i]
        return tree(left, right, vals, left[i]) + tree(left, right, vals, right[i])

    return tree


@pytest.mark.parametrize("seed", range(5))
def test_stats_match_the_plain_call_tree(seed):
    rnd = random.Random(seed)
    left, right, vals = random_tree(rnd, rnd.randint(1, 40))
    g = _fresh_tree()
    counter = PlainCounter()
    assert g(left, right, vals, 0) == counter.tree(left, right, vals, 0)
    assert g.stats["frames"] == counter.calls
    assert g.stats["max_depth"] == counter.max_depth
    assert g.stats["calls"] == 1 and g.stats["builds"] == 1


def test_stats_of_a_function_without_compiled_calls():
    @recompile.function(mode="sequential")
    def add(x, y):
        return x + y

    assert add(1, 2) == 3 and add(3, 4) == 7
    assert add.stats == {"builds": 1, "calls": 2, "frames": 2, "max_depth": 0, "backwards": 0,
                         "grad_fallbacks": {}}


def test_stats_count_a_plain_leaf_callee_as_a_frame():
    @recompile.function(mode="sequential")
    def walk(n):
        if n == 0:
            return sch_leaf(1)
        return walk(n - 1)

    assert walk(2) == 10
    assert walk.stats["frames"] == 4  # walk(2), walk(1), walk(0), sch_leaf(1)


def test_stats_max_depth_counts_a_plain_leaf_callee():
    @recompile.function(mode="sequential")
    def walk(n):
        if n == 0:
            return sch_leaf(1)
        return walk(n - 1)

    assert walk(2) == 10
    assert walk.stats["max_depth"] == 3


# ---------------------------------------------------------------------------
# the call-chain note


def chain(exc):
    notes = [n for n in getattr(exc, "__notes__", []) if n.startswith("recompile call chain")]
    assert len(notes) == 1, getattr(exc, "__notes__", None)
    lines = notes[0].splitlines()
    m = re.fullmatch(r"recompile call chain, root first \(depth (\d+)\):", lines[0])
    assert m, lines[0]
    return int(m.group(1)), lines[1:]


@pytest.mark.parametrize("k", [0, 1, 3, 10, 2 * SHOWN - 1])
def test_chain_lists_every_frame_root_first(k):
    with pytest.raises(ZeroDivisionError, match="by zero"):
        sch_fail_at(0, k)
    exc = _last_error(sch_fail_at, 0, k)
    depth, entries = chain(exc)
    assert depth == k
    assert len(entries) == k + 1
    call, fail = marker(sch_fail_at, "call"), marker(sch_fail_at, "fail")
    assert entries[:k] == [f"  sch_fail_at ({HERE}:{call})"] * k
    assert entries[-1] == f"  sch_fail_at ({HERE}:{fail})"


def _last_error(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no exception")


@pytest.mark.parametrize("k", [2 * SHOWN, 2 * SHOWN + 1, 100])
def test_long_chain_is_truncated(k):
    exc = _last_error(sch_fail_at, 0, k)
    depth, entries = chain(exc)
    assert depth == k
    call, fail = marker(sch_fail_at, "call"), marker(sch_fail_at, "fail")
    hidden = k + 1 - 2 * SHOWN
    assert len(entries) == 2 * SHOWN + 1
    assert entries[SHOWN] == f"  ... {hidden} more compiled calls ..."
    assert entries[:SHOWN] == [f"  sch_fail_at ({HERE}:{call})"] * SHOWN
    assert entries[SHOWN + 1:-1] == [f"  sch_fail_at ({HERE}:{call})"] * (SHOWN - 1)
    assert entries[-1] == f"  sch_fail_at ({HERE}:{fail})"


def test_chain_across_mutually_recursive_functions():
    exc = _last_error(sch_even, 4)
    assert isinstance(exc, ZeroDivisionError)
    depth, entries = chain(exc)
    assert depth == 4
    ec, oc, ef = marker(sch_even, "call"), marker(sch_odd, "call"), marker(sch_even, "fail")
    assert entries == [f"  sch_even ({HERE}:{ec})", f"  sch_odd ({HERE}:{oc})",
                       f"  sch_even ({HERE}:{ec})", f"  sch_odd ({HERE}:{oc})",
                       f"  sch_even ({HERE}:{ef})"]


def test_chain_ends_in_a_plain_leaf_callee():
    exc = _last_error(sch_walk, 2, 0)
    assert isinstance(exc, ZeroDivisionError)
    depth, entries = chain(exc)
    assert depth == 3
    wc, wl, lf = marker(sch_walk, "call"), marker(sch_walk, "leaf"), marker(sch_leaf, "fail")
    assert entries == [f"  sch_walk ({HERE}:{wc})", f"  sch_walk ({HERE}:{wc})",
                       f"  sch_walk ({HERE}:{wl})", f"  sch_leaf ({HERE}:{lf})"]


def test_chain_of_a_function_without_compiled_calls():
    exc = _last_error(sch_leaf, 0)
    depth, entries = chain(exc)
    assert depth == 0
    assert entries == [f"  sch_leaf ({HERE}:{marker(sch_leaf, 'fail')})"]


def test_error_keeps_type_and_message():
    plain = _last_error(sch_walk_plain, 3, 0)
    exc = _last_error(sch_walk, 3, 0)
    assert type(exc) is type(plain) and str(exc) == str(plain)


def test_function_works_again_after_an_error():
    for k in (0, 5, 50):
        exc = _last_error(sch_fail_at, 0, k)
        assert isinstance(exc, ZeroDivisionError)
        assert sch_depth(k) == k
        assert sch_walk(k, 5) == sch_walk_plain(k, 5) == 2
        assert sch_tree(LEFT, RIGHT, VALS, 0) == PlainCounter().tree(LEFT, RIGHT, VALS, 0)
        # a fresh error gets a fresh, single note
        depth, entries = chain(_last_error(sch_walk, k, 0))
        assert depth == k + 1


# ---------------------------------------------------------------------------
# threads


def test_concurrent_calls_from_threads():
    g = _fresh_tree()  # first call (and build) happens concurrently in all threads

    def work(t):
        rnd = random.Random(1000 + t)
        out = []
        for _ in range(20):
            left, right, vals = random_tree(rnd, rnd.randint(1, 30))
            out.append((g(left, right, vals, 0), PlainCounter().tree(left, right, vals, 0)))
        return out

    results = run_threads(8, work)
    pairs = [p for r in results for p in r]
    assert len(pairs) == 160
    assert all(got == want for got, want in pairs)
    assert g.stats["builds"] == 1
    assert g.stats["calls"] == 160


def test_concurrent_errors_report_their_own_chain():
    def work(t):
        out = []
        for i in range(20):
            k = (t * 7 + i) % 15
            if i % 2:
                out.append(("ok", k, sch_depth(k)))
            else:
                out.append(("err", k, chain(_last_error(sch_fail_at, 0, k))[0]))
        return out

    results = run_threads(8, work)
    for r in results:
        assert len(r) == 20
        for kind, k, value in r:
            assert value == k, (kind, k, value)
