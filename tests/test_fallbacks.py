"""runtime.fallbacks: why an op ran once per instance, and what to write instead."""

import inspect
import operator
import re
import warnings

import pytest
import torch

import recompile
from recompile.runtime import fallbacks


@pytest.mark.parametrize("fn, why", [(operator.iadd, fallbacks.WRITES), (operator.imul, fallbacks.WRITES),
                                     (slice, fallbacks.UNVMAPPABLE), (float, fallbacks.PYTHON_VALUE),
                                     (len, fallbacks.PYTHON), (operator.getitem, fallbacks.PYTHON)],
                         ids=lambda v: getattr(v, "__name__", "why"))
def test_each_reason_says_what_to_write_instead(fn, why):
    assert fallbacks.reason(fn) is why


@pytest.mark.parametrize("fn, instead", [(max, "torch.maximum"), (min, "torch.minimum"), (any, ".any()"),
                                         (round, "torch.round")], ids=lambda v: getattr(v, "__name__", "instead"))
def test_a_python_builtin_of_tensors_names_the_torch_op_to_write(fn, instead):
    why, write = fallbacks.reason(fn)
    assert fn.__name__ in why and instead in write


def test_a_method_of_each_instances_own_tensor_is_not_called_a_callable_chosen_by_the_data():
    from recompile.runtime.batch import Batch
    methods = Batch(2, items=[torch.ones(2).sum, torch.ones(3).sum])  # (tensors of their own shapes)
    assert fallbacks.reason(methods) is fallbacks.UNVMAPPABLE
    assert fallbacks.reason(Batch(2, items=[torch.ones(2).add_, torch.ones(3).add_])) is fallbacks.WRITES
    assert fallbacks.reason(Batch(2, items=[len, sorted])) is fallbacks.CHOSEN


def prefix(x, k):
    return x[:k]  # a shape of each instance's own


def test_a_prefix_per_instance_batches_and_results_of_their_own_shapes_are_named():
    f = recompile.function(prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)  # (runtime.rows: each one's view, batched)
        with pytest.raises(ValueError) as info:
            recompile.vmap(f)(torch.ones(3, 4), torch.tensor([1, 2, 3]))
    # (the results differ in shape: vmap says which)
    assert "Tensor(1,) float32, Tensor(2,) float32, Tensor(3,) float32" in str(info.value)


def masked_tree(xs, left, right, i):
    """A level program whose node piece runs ``h.nonzero()`` (a shape per instance, that of its values) by its
    rule, which runs it once per instance."""
    if left[i] < 0:
        return torch.tanh(xs[i])
    h = torch.tanh(masked_tree(xs, left, right, left[i]) + masked_tree(xs, left, right, right[i]))
    return h * h.nonzero().sum()  # (the masked line)


def test_a_fallback_inside_a_traced_piece_names_the_users_line(monkeypatch):
    """The warning of an op run once per instance from a traced piece (generated code, whose frames are
    recompile's own) names the line of the op, not the line that called the compiled function."""
    import inspect

    from recompile import diagnostics

    monkeypatch.setattr(diagnostics, "_warned", set())
    f = recompile.function(masked_tree)
    namespace = dict(masked_tree.__globals__, masked_tree=f)
    f = recompile.function(type(masked_tree)(masked_tree.__code__, namespace, "masked_tree"))
    namespace["masked_tree"] = f
    left, right = torch.tensor([1, 3, -1, -1, -1]), torch.tensor([2, 4, -1, -1, -1])
    xs = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    with pytest.warns(recompile.PerInstanceWarning, match="nonzero runs once per instance") as seen:
        for _ in range(2):
            recompile.vmap(f, in_dims=(None, None, None, 0))(xs, left, right, torch.tensor([0, 1, 0]))
    lines, start = inspect.getsourcelines(masked_tree)
    masked = start + next(k for k, line in enumerate(lines) if "(the masked line)" in line)
    assert {(w.filename, w.lineno) for w in seen if "nonzero" in str(w.message)} == {(__file__, masked)}


def collect(xs, left, right, i, out):  # (a recursion appending to, and reading, the list its caller holds)
    if left[i] < 0:
        h = torch.tanh(xs[i])
    else:
        h = torch.tanh(collect(xs, left, right, left[i], out) + collect(xs, left, right, right[i], out))
    out.append(h.sum() * len(out))
    return h


def collected(xs, left, right, i):
    out = []
    h = collect(xs, left, right, i, out)
    return h + len(out)


def test_a_recursion_changing_what_its_caller_holds_says_its_calls_keep_their_order(monkeypatch):
    """Its calls run one after another within each instance (the changes in their order), not one batch per
    depth: each recursive call's line is warned of, naming the change, with what to write instead (a recursion of
    one call a frame, which has no batch per depth to lose, is not)."""
    from recompile import diagnostics

    monkeypatch.setattr(diagnostics, "_warned", set())
    left, right = torch.tensor([1, 3, -1, -1, -1]), torch.tensor([2, 4, -1, -1, -1])
    xs = torch.randn(5, 3, dtype=torch.float64)
    want = torch.stack([collected(xs, left, right, i) for i in (0, 1, 2)])
    monkeypatch.setitem(collected.__globals__, "collect", recompile.function(collect))
    lines, start = inspect.getsourcelines(collect)
    calls = start + next(k for k, line in enumerate(lines) if "tanh(collect(" in line)
    change = start + next(k for k, line in enumerate(lines) if "out.append" in line)
    with pytest.warns(recompile.PerInstanceWarning, match=r"the calls of collect at test_fallbacks\.py:\d+ run one "
                                                          r"after another .*may change a value in place "
                                                          r"\(test_fallbacks\.py:\d+\).*return what the calls make") \
            as seen:
        got = recompile.vmap(recompile.function(collected), in_dims=(None, None, None, 0))(
            xs, left, right, torch.tensor([0, 1, 2]))
    torch.testing.assert_close(got, want)
    warned = [w for w in seen if "run one after another" in str(w.message)]
    assert {(w.filename, w.lineno) for w in warned} == {(__file__, calls)}  # (both calls stand on one line)
    assert all(f"test_fallbacks.py:{change})" in str(w.message) for w in warned)
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        chain = recompile.function(counted_down)
        assert chain(xs[0], 3) == counted_down(xs[0], 3)


def collect_looped(xs, left, right, i, out):  # (the same, its calls made by a loop over the children)
    h = torch.tanh(xs[i])
    kids = [j for j in (left[i], right[i]) if j >= 0]
    for j in kids:
        h = h + collect_looped(xs, left, right, j, out)
    out.append(h.sum() * len(out))
    return h


def collected_looped(xs, left, right, i):
    out = []
    return collect_looped(xs, left, right, i, out) + len(out)


def test_a_recursion_changing_what_its_caller_holds_from_a_loop_says_its_calls_keep_their_order(monkeypatch):
    """One recursive call in a loop's body keeps its iterations in order too, and says so."""
    from recompile import diagnostics

    monkeypatch.setattr(diagnostics, "_warned", set())
    left, right = torch.tensor([1, 3, -1, -1, -1]), torch.tensor([2, 4, -1, -1, -1])
    xs = torch.randn(5, 3, dtype=torch.float64)
    want = torch.stack([collected_looped(xs, left, right, i) for i in (0, 1, 2)])
    monkeypatch.setitem(collected_looped.__globals__, "collect_looped", recompile.function(collect_looped))
    with pytest.warns(recompile.PerInstanceWarning, match=r"the calls of collect_looped at test_fallbacks\.py:\d+ "
                                                          r"run one after another"):
        got = recompile.vmap(recompile.function(collected_looped), in_dims=(None, None, None, 0))(
            xs, left, right, torch.tensor([0, 1, 2]))
    torch.testing.assert_close(got, want)


def counted_down(x, d):  # (one recursive call a frame, changing a tensor of its own: no batch per depth to lose)
    if d <= 0:
        return x.sum()
    buf = torch.zeros(2, dtype=x.dtype)
    buf[0] = x.sum()
    return counted_down(x + buf[0], d - 1)


def guarded_sizes(left, right, i):  # (each child's call in an if of its own: asked for at once)
    total = torch.ones((), dtype=torch.float64)
    if left[i] >= 0:
        total = total + guarded_sizes(left, right, left[i])
    if right[i] >= 0:
        total = total + guarded_sizes(left, right, right[i])
    return total


def chained_sizes(left, right, i):  # (the second if's test reads the first call's result: it waits, as in Python)
    total = torch.ones((), dtype=torch.float64)
    if left[i] >= 0:
        total = total + chained_sizes(left, right, left[i])
    if right[i] >= 0 and total < 100:
        total = total + chained_sizes(left, right, right[i])
    return total


def appended_sizes(left, right, i):  # (the second if's test reads the list the first appends to: it waits too)
    hs = [torch.ones((), dtype=torch.float64)]
    if left[i] >= 0:
        hs.append(appended_sizes(left, right, left[i]))
    if right[i] >= 0 and len(hs) < 3:
        hs.append(appended_sizes(left, right, right[i]))
    return torch.stack(hs).sum()


def paired_sizes(left, right, i):  # (an if making two calls, then one making another: that one waits)
    total = torch.ones((), dtype=torch.float64)
    if left[i] >= 0 and right[i] >= 0:
        total = total + paired_sizes(left, right, left[i]) + paired_sizes(left, right, right[i])
    if (left[i] >= 0) != (right[i] >= 0):
        total = total + paired_sizes(left, right, torch.maximum(left[i], right[i]))
    return total


def listed_sizes(left, right, i):  # (the same children, a loop over a list of them: one batch per depth)
    kids = [j for j in (left[i], right[i]) if j >= 0]
    if not kids:
        return torch.ones((), dtype=torch.float64)
    total = torch.ones((), dtype=torch.float64)
    for j in kids:
        total = total + listed_sizes(left, right, j)
    return total


def test_calls_that_wait_in_turn_say_so_and_calls_in_ifs_of_their_own_batch(monkeypatch):
    """A recursion whose calls stand in ifs that cannot ask for them at once (the first if makes two) runs an
    instance's calls one after another: the later call's line is warned of, naming the first's, with what to write
    instead. Each child's call in an if of its own, and a loop over a list of the children, run one batch per
    depth, with no warning; a second call whose test reads the first's result, or the list the first appends to,
    waits, as in Python, with no warning either."""
    from recompile import diagnostics

    monkeypatch.setattr(diagnostics, "_warned", set())
    left = torch.tensor([1, 3, -1, 5, -1, -1, -1])
    right = torch.tensor([2, 4, -1, -1, -1, -1, -1])
    roots = torch.tensor([0, 1, 3])
    want = torch.stack([guarded_sizes(left, right, int(i)) for i in roots])
    lines, start = inspect.getsourcelines(paired_sizes)
    first = start + next(k for k, line in enumerate(lines) if "left[i]) + paired" in line)
    second = start + next(k for k, line in enumerate(lines) if "torch.maximum" in line)
    paired = recompile.function(paired_sizes)
    monkeypatch.setitem(paired_sizes.__globals__, "paired_sizes", paired)
    with pytest.warns(recompile.PerInstanceWarning, match=rf"the calls of paired_sizes at test_fallbacks\.py:"
                                                          rf"{second} wait within each instance for its calls at "
                                                          rf"test_fallbacks\.py:{first}.*loop over a list") as seen:
        got = recompile.vmap(paired, in_dims=(None, None, 0))(left, right, roots)
    torch.testing.assert_close(got, want)
    assert {(w.filename, w.lineno) for w in seen if "wait within" in str(w.message)} == {(__file__, second)}
    for fn in (guarded_sizes, listed_sizes, chained_sizes, appended_sizes):
        compiled = recompile.function(fn)
        monkeypatch.setitem(fn.__globals__, fn.__name__, compiled)
        with warnings.catch_warnings():
            warnings.simplefilter("error", recompile.PerInstanceWarning)
            torch.testing.assert_close(recompile.vmap(compiled, in_dims=(None, None, 0))(left, right, roots), want)
        if fn.__name__ in ("guarded_sizes", "listed_sizes"):
            assert compiled.stats["batches"][fn.__name__]["runs"] <= 4  # (one per depth)


def gated(xs, left, right, i):  # (a with block reads h: h is a cell the with block shares)
    if left[i] < 0:
        h = torch.tanh(xs[i])
    else:
        h = gated(xs, left, right, left[i]) + gated(xs, left, right, right[i])
    with torch.no_grad():
        scale = h.abs().max()
    return h * scale


def kept(xs, left, right, i):  # (a lambda reads h: it may outlive the call, and see h change)
    if left[i] < 0:
        h = torch.tanh(xs[i])
    else:
        h = kept(xs, left, right, left[i]) + kept(xs, left, right, right[i])
    scaled = [lambda: h * 2.0]  # (held in a list: a function any code could keep)
    return scaled[0]()


def test_a_variable_a_with_block_shares_keeps_no_calls_in_order_one_a_lambda_shares_does_and_says_so(monkeypatch):
    """A ``with`` block's nested function runs where it stands and no one keeps it: the variables it shares are
    the frame's own, and the calls batch by depth (the block alone runs per instance). A lambda may outlive the
    call: the write of a variable it shares keeps the calls in order, and the warning says so."""
    from recompile import diagnostics

    monkeypatch.setattr(diagnostics, "_warned", set())
    left, right = torch.tensor([1, 3, -1, -1, -1]), torch.tensor([2, 4, -1, -1, -1])
    xs = torch.randn(5, 3, dtype=torch.float64)
    roots = torch.tensor([0, 1, 0, 1])
    for fn in (gated, kept):
        want = torch.stack([fn(xs, left, right, int(i)) for i in roots])
        compiled = recompile.function(fn)
        monkeypatch.setitem(fn.__globals__, fn.__name__, compiled)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        torch.testing.assert_close(got, want)
        in_order = [str(w.message) for w in seen if "run one after another" in str(w.message)]
        if fn.__name__ == "gated":  # (the module's name now stands for the compiled function)
            assert not in_order
            assert compiled.stats["batches"]["gated"]["runs"] <= 3  # (one per depth)
        else:
            assert len(in_order) == 1
            assert re.search(r"a variable it sets at test_fallbacks\.py:\d+ is shared with a with, try or match "
                             r"block, a nested def or a lambda", in_order[0])
