"""``for t in range(n)`` with n per instance, batched (runtime.ranges): the same values, gradients and Python
types as a loop over instances, no op once per instance, and the loop body sees one shared int ``t``."""

import pytest
import torch

import recompile
from recompile import config
from recompile.runtime import batch as bt
from recompile.runtime import ranges
from test_segments import switched

F64 = torch.float64


def running_sum(xs, n):
    h = torch.zeros(xs.shape[-1], dtype=xs.dtype)
    for t in range(n):
        h = torch.tanh(h + xs[t])
    return h


def stepped(xs, n):
    h = xs[0] * 0.0
    for t in range(1, n, 2):
        h = h * 0.5 + xs[t] * t  # (t as a number: the shared int)
    return h


def with_break(xs, n):
    h = xs[0] * 0.0
    for t in range(n):
        if t >= 3:
            break
        h = h + xs[t]
    else:
        h = h * 10.0
    return h


def count_kinds(xs, n):
    kinds = 0
    last = -1
    for t in range(n):
        kinds += type(t) is int
        last = t
    return xs[0] * kinds + last


def per_instance_start(xs, n):
    h = xs[0] * 0.0
    for t in range(n, 5):  # (the start differs per instance: each instance's t is its own)
        h = h + xs[t]
    return h


PROGRAMS = [running_sum, stepped, with_break, count_kinds]


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(6, 5, 3, generator=g, dtype=F64, requires_grad=True)
    n = torch.tensor([0, 5, 2, 3, 5, 1])
    return xs, n


def both(fn, compiled, xs, n):
    xs.grad = None
    got = recompile.vmap(compiled, in_dims=(0, 0))(xs, n)
    got.sum().backward()
    got_grad = xs.grad.clone()
    xs.grad = None
    want = torch.stack([fn(xs[k], int(n[k])) for k in range(len(n))])
    want.sum().backward()
    return (got.detach(), got_grad), (want.detach(), xs.grad.clone())


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_a_for_over_per_instance_ranges_batches_with_values_and_gradients_of_eager(fn):
    compiled = recompile.function(fn)
    xs, n = inputs()
    got, want = both(fn, compiled, xs, n)
    torch.testing.assert_close(got, want)
    assert compiled.stats["per_instance"] == {}


def test_the_range_of_a_per_instance_start_gives_each_instance_its_own_int():
    compiled = recompile.function(per_instance_start)
    xs, n = inputs()
    with switched(config, False, "RECURRENT_LOOPS"), switched(config, "error", "PER_INSTANCE"):
        got, want = both(per_instance_start, compiled, xs, n)  # (the loop as written: each instance's own t)
    torch.testing.assert_close(got, want)
    compiled = recompile.function(per_instance_start)
    with switched(config, "error", "PER_INSTANCE"):  # (a sum of its step inputs: every step's item read at once)
        got, want = both(per_instance_start, compiled, xs, n)
    torch.testing.assert_close(got, want)
    assert compiled.callee(None).build.batched_code.recurrent[0].runs == 1


def test_a_bad_range_argument_raises_as_python_does():
    compiled = recompile.function(running_sum)
    xs, _ = inputs()
    lengths = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(TypeError) as eager:
        running_sum(xs[0], lengths[0])
    with switched(config, "allow", "PER_INSTANCE"):
        with pytest.raises(TypeError, match=str(eager.value)):
            recompile.vmap(compiled, in_dims=(0, 0))(xs, lengths)


def test_a_batch_of_ranges_knows_its_lengths_and_shared_start():
    value = ranges.build(3, range, (bt.from_items([4, 0, 2]),), {})
    found = ranges.of(value)
    assert list(found) == [range(4), range(0), range(2)] and found.lengths == [4, 0, 2]
    assert (found.shortest, found.longest, found.start, found.step) == (0, 4, 0, 1)
    assert ranges.has_index(3, None, (value, 5), {}) is False
    assert ranges.item(value, 0) is NotImplemented  # (the second instance has no item 0)
    starts = ranges.build(2, range, (bt.from_items([3, 5]), bt.from_items([6, 7])), {})
    assert bt.items_of(ranges.item(starts, 1)) == [4, 6]  # (``range(start[i], start[i + 1])``: each its own)
    assert ranges.item(starts, 2) is NotImplemented
    steps = ranges.build(2, range, (1, bt.from_items([9, 7]), 3), {})
    assert ranges.item(steps, 1) == 4 and ranges.has_index(2, None, (steps, 1), {}) is True
    two = ranges.build(2, range, (bt.from_items([2, 9]),), {})
    assert ranges.has_index(2, None, (two, 1), {}) is True  # (every instance has an item 1)
    assert bt.items_of(ranges.has_index(2, None, (two, 3), {})) == [torch.tensor(False), torch.tensor(True)]
