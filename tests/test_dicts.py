"""A dict the program built with keys every instance shares, read and changed batched (runtime/dicts.py):
``get``, ``in``, ``keys()``, ``values()``, ``items()``, a ``for`` over it, against each instance's eager call."""

from __future__ import annotations

import warnings

import pytest
import torch

import recompile
from recompile import config, diagnostics
from recompile.runtime import batch as bt
from recompile.runtime import dicts
from test_segments import switched  # tests/ is on sys.path under pytest

F64 = torch.float64


def summed_losses(x):
    losses = {"ce": x.sum(), "l2": (x * x).sum()}
    return sum(losses.values())


def items_walked(x):
    state = {"h": x, "c": x * 2.0}
    out = x.new_zeros(())
    for name, value in state.items():
        out = out + value.sum() * len(name)
    return out


def keys_walked(x):
    state = {"h": x, "c": torch.tanh(x)}
    return sum(state[k].sum() for k in state) + sum(state[k].mean() for k in state.keys())


def read_by_get_and_in(x):
    state = {"h": x, 1: x * 3.0}
    missing = state.get("z", x * 0.5)
    flags = ("h" in state) + (2 not in state) + ("z" in state)
    return state.get("h").sum() + state.get(1).sum() + missing.sum() + flags + (state.get("w") is None)


def values_after_a_change(x):
    state = {"h": x}
    state["c"] = x * 2.0  # (a run that changes a dict: each view is each instance's own, as Python's)
    view = state.values()
    state["z"] = x * 5.0
    return sum(v.sum() for v in view) + ("z" in state)


def chart_read_by_each_instances_key(x, n):  # (a chart keyed by spans, read at each instance's own span)
    chart = {(i, i + 1): x * (i + 1) for i in range(3)}
    chart[0, 2] = chart[0, 1] + chart[1, 2]
    chart[0, 3] = torch.tanh(chart[0, 2] + chart[2, 3])
    return chart[0, int(n)] + chart[int(n) - 1, int(n)]


def keys_unpacked(x):  # (a dict unpacks to its keys: found giving its values, the wrong value in silence)
    state = {"h": x * 2.0, "cc": x + 1.0}
    first, second = state
    return state[first] * len(second) + state[second]


def keys_unpacked_starred(x):  # (found raising a TypeError where Python gives the keys)
    state = {"h": x * 2.0, "cc": x + 1.0, "ddd": x * 3.0}
    first, *rest = state
    return state[first] * len("".join(rest)) + state[rest[-1]]


def keys_of_a_callee_unpacked(x):
    first, second = pair_state(x)
    return x * len(first + second)


def pair_state(x):
    return {"h": x * 2.0, "cc": x + 1.0}


@pytest.mark.parametrize("fn, per_instance", [
    (summed_losses, "error"), (items_walked, "error"), (keys_walked, "error"), (read_by_get_and_in, "error"),
    (values_after_a_change, "allow"), (keys_unpacked, "error"), (keys_unpacked_starred, "error"),
    (keys_of_a_callee_unpacked, "allow")], ids=lambda v: getattr(v, "__name__", v))
def test_a_dict_with_shared_keys_is_read_as_eager_reads_each_instances(fn, per_instance):
    xs = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with switched(config, per_instance, "PER_INSTANCE"):
        got = recompile.vmap(recompile.function(fn))(xs)
    want = torch.stack([torch.as_tensor(fn(x), dtype=F64) for x in xs])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def value_read_by_each_instances_key_changed(x, n):  # (the very value: its change is the dict's)
    d = {(0, 1): x * 1.0, (0, 2): x * 2.0, (0, 3): x * 3.0}
    y = d[0, int(n)]
    y.add_(1.0)
    return d[0, int(n)] + y + d[0, 1]


@pytest.mark.parametrize("fn", [chart_read_by_each_instances_key, value_read_by_each_instances_key_changed],
                         ids=lambda f: f.__name__)
def test_a_key_of_each_instances_own_reads_each_instances_value(fn):
    xs = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    for ns in ([2, 3, 1, 3, 2], [3] * 5):
        ns = torch.tensor(ns)
        with switched(config, "error", "PER_INSTANCE"):
            got = recompile.vmap(recompile.function(fn))(xs, ns)
        want = torch.stack([fn(x, n) for x, n in zip(xs, ns)])
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


KEY = torch.tensor(1)


def read_by_a_tensor(x):
    return {1: x, "b": x * 2.0}[KEY]  # (a tensor hashes by identity: Python finds no key 1 by it)


def test_a_tensor_key_finds_no_int_key_as_python_looks_it_up():
    xs = torch.randn(3, 2, dtype=F64)
    with pytest.raises(KeyError):
        read_by_a_tensor(xs[0])
    with pytest.raises(KeyError):
        recompile.vmap(recompile.function(read_by_a_tensor))(xs)


def test_a_key_no_instance_can_share_is_left_to_each_instance():
    kind = bt.dict_kind(("h",))
    d = bt.from_struct(kind, [torch.zeros(2, 3)], 2)
    assert dicts.method(2, d, "get", ([1],), {}) is NotImplemented  # (unhashable: each instance raises)
    assert dicts.set_field(d, [1], 0.0) is NotImplemented
    assert dicts.method(2, d, "get", ("h",), {}) is d.struct[1][0]


def test_a_view_of_each_instances_own_dict_warns_what_to_write_instead():
    with pytest.warns(recompile.PerInstanceWarning, match=r"dict\.values runs once per instance .*each instance "
                                                          r"holds a dict of its own.*read it by key"):
        recompile.vmap(recompile.function(values_after_a_change))(torch.randn(3, 2, dtype=F64))


CELL = torch.nn.LSTMCell(3, 3)


def stacked_dict(x):
    return torch.stack({"h": x * 2.0, "c": x + 1.0})


def catted_dict(x):
    return torch.cat({"h": x * 2.0, "c": x + 1.0})


def dict_state(x):
    return CELL(x, {"h": x * 2.0, "c": x + 1.0})[0]


def dict_operands(x):
    return torch.einsum("i,i->", {"h": x * 2.0, "c": x + 1.0})


def summed_keys(x):
    return sum({"h": x * 2.0, "c": x + 1.0})


def dict_state_stepped(xs):  # (a cell stepped from a dict state: the loop run as one RNN read its values)
    state = {"h": xs[0] * 1.0, "c": xs[0] * 2.0}
    for t in range(xs.shape[0]):
        state = CELL(xs[t], state)
    return state[0]


@pytest.mark.parametrize("fn", [stacked_dict, catted_dict, dict_state, dict_operands, summed_keys, dict_state_stepped],
                         ids=lambda f: f.__name__)
def test_a_dict_where_a_sequence_is_wanted_raises_as_eager_does(fn, monkeypatch):
    # (a dict iterates its keys: its values, read as its items, were stacked, summed and handed to a cell)
    monkeypatch.setattr(diagnostics, "_warned", set())
    x = torch.randn(4, 3) if fn is not dict_state_stepped else torch.randn(4, 5, 3)
    with pytest.raises(Exception) as eager:
        fn(x[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        with pytest.raises(type(eager.value)):
            recompile.vmap(recompile.function(fn))(x)
