"""Level programs (codegen/levels.py, runtime/levels.py): a recursion whose call tree its arguments decide,
run down depth by depth and back up, without the agenda.

Each test compares the level run with the agenda's run of the same program
(levels disabled at run time) and with eager PyTorch per instance, values and
gradients, and checks that the level program ran without falling back to the
agenda (a failed level run is run again by the agenda, which would hide it).
"""

from __future__ import annotations

import collections
import re
import traceback

import pytest
import torch

import recompile
from recompile import config
from recompile.data import Forest
from test_batching import BatchedTopDown, TreeLSTM, topdown_models
from test_segments import WORDS, Params, assert_same, built, eager_forest, model_class, run_forest, switched, trees


def levels_enabled(on):
    return switched(config, on, "LEVELS")


def program(cf, owner=None):
    return built(cf, owner).unit.levels


def both_ways(call):
    """call() with level programs, then with the agenda."""
    with levels_enabled(True):
        got = call()
    with levels_enabled(False):
        want = call()
    return got, want


def test_a_tree_lstm_runs_as_levels_and_matches_the_agenda_and_eager():
    torch.manual_seed(0)
    Model = model_class(True)
    prog = program(Model.encode, Model)
    # (h, c, loss) as its elements, none late: no call is deferred (the loss is computed inline)
    assert prog is not None and prog.late is not None and prog.late.positions == []
    model = Model().double()
    forest = Forest.from_trees(trees())
    with plain_enabled(False):  # (on Batch values: the pieces' raw segments; plain runs below)
        for _ in range(2):  # (the first call traces the pieces' segments, the second runs them raw)
            got, want = both_ways(lambda: run_forest(model, forest))
            assert_same(got, want)
            assert_same(got, eager_forest(model, trees()))
    assert prog.runs == 2 and prog.fallbacks == 0
    pieces = prog.segments
    assert pieces and all(s.hits > 0 for s in pieces), [(s.name, s.hits) for s in pieces]


def test_the_schedule_is_the_agendas():
    """The same executions per program point: each depth once, each leaf branch once, the loss once."""
    Model = model_class(True)
    model = Model().double()
    forest = Forest.from_trees(trees())
    stats = []
    for on in (True, False):
        Model.encode.stats.reset()
        with levels_enabled(on):
            run_forest(model, forest)
        stats.append({k: Model.encode.stats[k] for k in ("batches", "frames", "max_depth")})
    assert stats[0] == stats[1]
    then = [name for name in stats[0]["batches"] if name.endswith(".then")]
    assert len(then) == 1 and stats[0]["batches"][then[0]]["runs"] == 1


def test_a_top_down_model_whose_tree_its_computed_states_decide():
    """The predicate and the calls' arguments are computed (gates, states), yet come before any result."""
    eager, batched, _, starts = topdown_models()
    prog = program(BatchedTopDown.expand, BatchedTopDown)
    assert prog is not None

    def run():
        batched.zero_grad()
        out = recompile.vmap(batched.expand, in_dims=(0, None))(starts, 0)
        out.sum().backward()
        return out.detach(), {k: p.grad.clone() for k, p in batched.named_parameters()}

    got, want = both_ways(run)
    eager.zero_grad()
    outs = torch.stack([eager.expand(h, 0) for h in starts])
    outs.sum().backward()
    assert_same(got, want)
    assert_same(got, (outs.detach(), {k: p.grad.clone() for k, p in eager.named_parameters()}))
    assert prog.fallbacks == 0 and prog.runs >= 1
    # the ``and`` is a Cond of a predicate every instance of a depth shares: each branch a trace of the piece,
    # and the run stays on plain tensors (the leaves' ``depth``, which they do not read, differs between depths)
    assert prog.plain.runs >= 1 and prog.plain.failures == 0 and (False, True, False) not in prog.plain.refused
    assert max(len(t) for piece in prog.plain.pieces() for t in piece.traces.values()) >= 2


def test_every_trace_of_a_piece_is_tried_before_its_call_gives_up_plain_tensors():
    """With as many traces as a piece may make (one per branch of its ``and``), a depth that takes the second
    branch runs it: no call of the top-down model leaves the plain run."""
    eager, batched, _, starts = topdown_models()
    prog = program(BatchedTopDown.expand, BatchedTopDown)
    with switched(config, 2, "SEGMENT_TRACES"):
        for _ in range(3):
            recompile.vmap(batched.expand, in_dims=(0, None))(starts, 0)
    assert prog.plain.failures == 0 and prog.plain.runs >= 3


def grow(self, h, depth):
    """The top-down model with ``or`` and a per-instance operand first: its Cond splits by instance."""
    p = torch.sigmoid(self.gate(h)).squeeze(-1)
    if not (p <= 0.5 or depth >= 3):
        return torch.tanh(self.merge(torch.cat([self.grow(self.l(h), depth + 1), self.grow(self.r(h), depth + 1)])))
    return torch.tanh(self.leaf(h)) * p


def grow_depth_first(self, h, depth):
    """The same with the operand every instance of a depth shares first, and no ``not`` (whose Python bool
    per instance a plain tensor cannot hold): a plain level run."""
    p = torch.sigmoid(self.gate(h)).squeeze(-1)
    if depth >= 3 or p <= 0.5:
        return torch.tanh(self.leaf(h)) * p
    return torch.tanh(self.merge(torch.cat([self.grow(self.l(h), depth + 1), self.grow(self.r(h), depth + 1)])))


def grow_bitwise(self, h, depth):
    """The same with ``&`` of the shared test and the gate's: one batched ``&``, a plain level run."""
    p = torch.sigmoid(self.gate(h)).squeeze(-1)
    if (depth < 3) & (p > 0.5):
        return torch.tanh(self.merge(torch.cat([self.grow(self.l(h), depth + 1), self.grow(self.r(h), depth + 1)])))
    return torch.tanh(self.leaf(h)) * p


@pytest.mark.parametrize("fn", [grow, grow_depth_first, grow_bitwise], ids=lambda f: f.__name__)
def test_or_and_not_in_a_top_down_predicate_give_eagers_values_and_gradients(fn):
    eager, _, _, starts = topdown_models()
    plain_cls = type("Plain", (type(eager),), {"grow": fn})
    compiled_cls = type("Compiled", (type(eager),), {"grow": recompile.function(fn)})
    plain, model = plain_cls().double(), compiled_cls().double()
    plain.load_state_dict(eager.state_dict())
    model.load_state_dict(eager.state_dict())
    for _ in range(2):  # (the second call runs the traced pieces)
        model.zero_grad()
        out = recompile.vmap(model.grow, in_dims=(0, None))(starts, 0)
        out.sum().backward()
    plain.zero_grad()
    want = torch.stack([plain.grow(h, 0) for h in starts])
    want.sum().backward()
    torch.testing.assert_close(out, want)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert compiled_cls.grow.stats["per_instance"] == {}
    if fn is not grow:
        assert program(compiled_cls.grow, compiled_cls).plain.runs >= 1


def walk(xs, i):
    """Linear recursion over a sequence: the call tree is a chain as long as the sequence's rest."""
    if i + 1 >= xs.shape[0]:
        return torch.tanh(xs[i])
    return torch.tanh(xs[i] + 0.5 * walk(xs, i + 1))


def test_linear_recursion_over_a_sequence():
    compiled = recompile.function(walk)
    xs = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    starts = torch.tensor([0, 3, 6, 5])

    def run():
        xs.grad = None
        out = recompile.vmap(compiled, in_dims=(None, 0))(xs, starts)
        out.sum().backward()
        return (out.detach(),), {"xs": xs.grad.clone()}

    got, want = both_ways(run)
    assert_same(got, want)
    xs.grad = None
    eager = torch.stack([walk(xs, int(i)) for i in starts])
    eager.sum().backward()
    assert_same(got, ((eager.detach(),), {"xs": xs.grad.clone()}))
    prog = program(compiled)
    assert prog.runs >= 1 and prog.fallbacks == 0


def early_return(xs, i):
    """After the early return, the rest is the else branch: a call, then a cond of its own inline."""
    if i <= 0:
        return xs[0]
    a = early_return(xs, i - 1)
    if i > 2:
        return a * 2
    return a + xs[i]


def test_a_branch_with_a_cond_of_its_own_after_the_call():
    compiled = recompile.function(early_return)
    xs = torch.randn(5, 3, dtype=torch.float64)
    starts = torch.tensor([0, 2, 4, 3])
    got, want = both_ways(lambda: recompile.vmap(compiled, in_dims=(None, 0))(xs, starts))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, torch.stack([early_return(xs, int(i)) for i in starts]))
    prog = program(compiled)
    assert prog.runs == 1 and prog.fallbacks == 0


def score(x):
    return (x * x).sum()


compiled_score = recompile.function(score)


def scored(xs, i):
    """A pair (state, loss), the loss summing a deferred call per node: a late split, whose second half of
    the branch reads values of the first (w, a value of ``pre``, and g, computed from a call's state)."""
    w = xs[i].sum()
    if i + 1 >= xs.shape[0]:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        h2, loss2 = scored(xs, i + 1)
        g = h2.mean()
        h = torch.tanh(xs[i] + 0.5 * h2)
        loss = loss2 * w + g
    return h, loss + score(h)


def scored_twice(xs, i):
    """Two deferred calls of one function per node: collected at their own positions, run as one group."""
    if i + 1 >= xs.shape[0]:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        h2, loss = scored_twice(xs, i + 1)
        h = torch.tanh(xs[i] + 0.5 * h2)
    return h, loss + score(h) - score(xs[i] * 2)


def scored_late_argument(xs, i):
    """The deferred call's argument reads the loss, which waits on the deferred calls below: no split."""
    if i + 1 >= xs.shape[0]:
        h = torch.tanh(xs[i])
        loss = xs[i].sum()
    else:
        h2, loss = scored_late_argument(xs, i + 1)
        h = torch.tanh(xs[i] + 0.5 * h2)
    return h, loss + score(h * loss)


def scored_sum(xs, i):
    """One value returned, not a tuple: no split, the deferred calls' results wait as lazy values."""
    if i + 1 >= xs.shape[0]:
        s = xs[i].sum()
    else:
        s = 0.5 * scored_sum(xs, i + 1)
    return s + score(xs[i])


@pytest.mark.parametrize("fn, late", [(scored, [1]), (scored_twice, [1]), (scored_late_argument, None),
                                      (scored_sum, None)])
def test_deferred_calls_run_once_and_what_waits_on_them_runs_after(fn, late):
    """With a late split the deferred calls run once, after the way up for the other elements, and the late
    elements are computed on a second way up; without one their results are lazy. Both match."""
    namespace = dict(fn.__globals__, score=compiled_score)
    compiled = recompile.function(type(fn)(fn.__code__, namespace, fn.__name__))
    namespace[fn.__name__] = compiled
    xs = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    starts = torch.tensor([0, 3, 5, 2])

    def run():
        xs.grad = None
        out = recompile.vmap(compiled, in_dims=(None, 0))(xs, starts)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in outs).backward()
        return tuple(o.detach() for o in outs), {"xs": xs.grad.clone()}

    got, want = both_ways(run)
    assert_same(got, want)
    xs.grad = None
    eager = [fn(xs, int(i)) for i in starts]
    outs = tuple(torch.stack(o) for o in zip(*eager)) if isinstance(eager[0], tuple) else (torch.stack(eager),)
    sum(o.sum() for o in outs).backward()
    assert_same(got, (tuple(o.detach() for o in outs), {"xs": xs.grad.clone()}))
    prog = program(compiled)
    assert prog.runs >= 1 and prog.fallbacks == 0
    assert (prog.late.positions if prog.late is not None else None) == late
    runs = []
    for on in (True, False):
        compiled.stats.reset()
        with levels_enabled(on):
            run()
        runs.append(compiled.stats["batches"]["score"]["runs"])
    # split: every depth's at once (the agenda, forcing the lazy loss in ``loss2 * w + g``, a fused op, runs
    # them depth by depth); lazy: as the agenda runs them
    assert runs[0] == (1 if late else runs[1]), runs


def chained(xs, i):
    """The second call's argument is the first call's result: the tree is not known on the way down."""
    if i <= 0:
        return xs[0]
    a = chained(xs, i - 1)
    return chained(xs, (a.sum() > 100).long() * 0) + xs[i] * a


def mutating(xs, i):
    if i <= 0:
        return xs[0].clone()
    y = mutating(xs, i - 1)
    y.mul_(0.5)
    return y + xs[i]


def two_conds(xs, i):
    if i <= 0:
        a = xs[0]
    else:
        a = two_conds(xs, i - 1)
    if i <= 1:
        return a
    return a + two_conds(xs, i - 2)


@pytest.mark.parametrize("fn", [chained, mutating, two_conds])
def test_what_does_not_qualify_runs_on_the_agenda(fn):
    compiled = recompile.function(fn)
    assert program(compiled) is None
    xs = torch.randn(5, 3, dtype=torch.float64)
    got = recompile.vmap(compiled, in_dims=(None, 0))(xs, torch.tensor([0, 2, 4]))
    want = torch.stack([fn(xs, i) for i in (0, 2, 4)])
    torch.testing.assert_close(got, want)


def test_an_error_is_raised_once_with_the_chain_the_agenda_names():
    def deep(xs, i):
        if i <= 0:
            return xs[i + 100]  # out of range: at the bottom of every chain
        return deep(xs, i - 1) + xs[i]

    compiled = recompile.function(deep)
    xs = torch.randn(5, 3)
    errors = []
    for on in (True, False):
        with levels_enabled(on), pytest.raises(IndexError) as info:
            recompile.vmap(compiled, in_dims=(None, 0))(xs, torch.tensor([2, 3]))
        errors.append((str(info.value), getattr(info.value, "__notes__", None),
                       traceback.extract_tb(info.value.__traceback__)[-1].line))
    assert errors[0] == errors[1]
    assert "recompile call chain" in "".join(errors[0][1])
    assert program(compiled).fallbacks == 1


_flaky_calls = []


def flaky_leaf(x):
    """Raises on its first call only, as a timeout a signal handler raises would."""
    _flaky_calls.append(x)
    if len(_flaky_calls) == 1:
        raise TimeoutError("one-shot")
    return x


def sum_with_flaky_leaves(left, right, value, i):
    if left[i] < 0:
        return flaky_leaf(value[i])
    return sum_with_flaky_leaves(left, right, value, left[i]) + sum_with_flaky_leaves(left, right, value, right[i])


@pytest.mark.parametrize("vmapped", [False, True])
def test_an_error_that_does_not_happen_twice_is_raised(vmapped):
    """The level run raises what failed, as it failed: it does not run the call again (which would lose a
    one-shot error, return a value, and run every effect before it twice)."""
    left, right, value = torch.tensor([1, -1, 3, -1, -1]), torch.tensor([2, -1, 4, -1, -1]), torch.arange(5.0)
    f = recompile.function(sum_with_flaky_leaves)
    _flaky_calls.clear()
    with pytest.raises(TimeoutError, match="one-shot") as info:
        if vmapped:
            recompile.vmap(f, in_dims=(None, None, None, 0))(left, right, value, torch.tensor([0, 2]))
        else:
            f(left, right, value, 0)
    assert len(_flaky_calls) == 1
    notes = [n for n in getattr(info.value, "__notes__", []) if "recompile call chain" in n]
    assert len(notes) == 1 and re.fullmatch(r"  sum_with_flaky_leaves(#\d+)?\.if\d+\.then \(test_levels\.py:\d+\)",
                                            notes[0].splitlines()[-1]), notes
    assert program(f).fallbacks == 1 and program(f).runs == 0
    assert float(f(left, right, value, 0)) == 8.0  # (it raised once: the next call runs)


def test_an_overriding_subclass_sends_its_calls_to_the_agenda():
    """``self.encode`` in a subclass with its own ``encode`` is not this function: the level program steps
    aside, and the calls reach the override."""
    Model = model_class(True)
    prog = program(Model.encode, Model)

    class Sub(Model):
        def encode(self, tree, i):
            h, c, loss = Model.encode(self, tree, i)
            return h * 0.5, c, loss

    model = Sub().double()
    tree = trees()[2]
    runs = prog.runs
    h, _, _ = Model.encode(model, tree, tree.root)
    assert prog.runs == runs
    eager = type("E", (Params,), {"encode": Model.encode.python})().double()
    eager.load_state_dict(model.state_dict())
    assert not torch.allclose(h, eager.encode(tree, tree.root)[0])


def test_segments_disabled_level_pieces_still_match():
    with switched(config, False, "SEGMENTS"):
        Model = model_class(False)
        prog = program(Model.encode, Model)
    model = Model().double()
    forest = Forest.from_trees(trees())
    got, want = both_ways(lambda: run_forest(model, forest))
    assert_same(got, want)
    assert prog.runs == 1 and prog.fallbacks == 0


def vector(x):
    return x * 2.0


def count(x):
    return (x > 0).sum()


def binary(xs, left, right, i):
    """A loss summing a deferred call per node of a binary tree: a tree sum (``score`` is the callee the test
    gives it: a scalar, a vector, or an int per node, which ``0.0 +`` makes a float)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = binary(xs, left, right, left[i])
        hr, loss_r = binary(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def binary_twice(xs, left, right, i):
    """Two deferred results added (one of them twice), the leaf's zero an int: a tree sum of three terms.
    (Compiled without fusion, which would join the adds into one fused op, which no call's result is
    deferred through.)"""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0
    else:
        hl, loss_l = binary_twice(xs, left, right, left[i])
        hr, loss_r = binary_twice(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_r + loss_l
    s = score(xs[i] * 2)
    return h, s + (loss + score(h)) + s


def binary_mixed(xs, left, right, i):
    """An int zero, and an int and a float deferred result in one sum (compiled without fusion): 0 + an int
    count is an int, and the float score makes the sum a float; not one index_add (the results' dtypes
    differ), summed depth by depth."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0
    else:
        hl, loss_l = binary_mixed(xs, left, right, left[i])
        hr, loss_r = binary_mixed(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + count(h) + score(h)


def binary_one(xs, left, right, i):
    """The leaf's loss is not zero: each leaf would add it once, which a tree sum of deferred results misses."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 1.0
    else:
        hl, loss_l = binary_one(xs, left, right, left[i])
        hr, loss_r = binary_one(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def binary_left(xs, left, right, i):
    """Only the left child's loss is added: not a sum over the tree."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = binary_left(xs, left, right, left[i])
        hr, loss_r = binary_left(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_l
    return h, loss + score(h)


def recursion(fn, compiled=True, fusion=True, **callees):
    """``fn`` calling itself and ``callees`` by name (``score=vector``; by default ``score`` and ``count``):
    each compiled, or with ``compiled`` False the plain functions, for eager references."""
    callees = {"score": score, "count": count, **callees}
    namespace = dict(fn.__globals__)
    for name, callee in callees.items():
        namespace[name] = _compiled_callee(callee) if compiled else callee
    this = type(fn)(fn.__code__, namespace, fn.__name__)
    namespace[fn.__name__] = recompile.function(this, fusion=fusion) if compiled else this
    return namespace[fn.__name__]


_callees = {score: compiled_score}


def _compiled_callee(fn):
    """One compiled function per callee for the whole module (its stats carry the callee's name)."""
    if fn not in _callees:
        _callees[fn] = recompile.function(fn)
    return _callees[fn]


def forest_of_trees():
    """Index lists of several binary trees in one index space (-1 at a leaf) and their roots: a lone leaf, a
    deep chain, a balanced tree, so that leaves and inner nodes share depths."""
    left, right = [], []

    def build(shape):
        k = len(left)
        left.append(-1)
        right.append(-1)
        if shape is not None:
            left[k], right[k] = build(shape[0]), build(shape[1])
        return k

    shapes = [None, ((None, None), ((None, (None, None)), None)), ((None, None), (None, None)),
              (None, (None, (None, (None, None))))]
    roots = [build(s) for s in shapes]
    return torch.tensor(left), torch.tensor(right), torch.tensor(roots)


def binary_zero_tensor(xs, left, right, i):
    """A leaf's zero made by a torch constructor: float32 (the default dtype), which the float64 losses promote."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = torch.zeros(())
    else:
        hl, loss_l = binary_zero_tensor(xs, left, right, left[i])
        hr, loss_r = binary_zero_tensor(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def binary_float64_zero(xs, left, right, i):
    """A leaf's zero of float64, which an int count per node takes up (an int zero would keep it int)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = torch.tensor(0.0, dtype=torch.float64)
    else:
        hl, loss_l = binary_float64_zero(xs, left, right, left[i])
        hr, loss_r = binary_float64_zero(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


class ZeroConfig:
    dtype = torch.float64


ZERO_CONFIG = ZeroConfig()


def zero_complex(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = torch.zeros((), dtype=torch.complex64)
    else:
        hl, loss_l = zero_complex(xs, left, right, left[i])
        hr, loss_r = zero_complex(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def zero_of_an_objects_dtype(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = torch.zeros((), dtype=ZERO_CONFIG.dtype)
    else:
        hl, loss_l = zero_of_an_objects_dtype(xs, left, right, left[i])
        hr, loss_r = zero_of_an_objects_dtype(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def bool_zero_minus(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = torch.zeros((), dtype=torch.bool)
    else:
        hl, loss_l = bool_zero_minus(xs, left, right, left[i])
        hr, loss_r = bool_zero_minus(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss - score(h)


def test_zeros_that_start_no_tree_sum_give_eagers_values_dtypes_and_errors():
    """A complex zero, a dtype read from an object (which the program may set again) and a bool zero with a
    subtracted term are not tree sums: each gives eager's values and dtype, or eager's error."""
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float32)

    def both(fn):
        compiled, eager = recursion(fn), recursion(fn, compiled=False)
        want = [eager(xs, left, right, int(r)) for r in roots]
        got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        assert got[1].dtype == want[0][1].dtype
        torch.testing.assert_close(got[1], torch.stack([w[1] for w in want]))
        return compiled

    assert program(both(zero_complex)).late.sums is None
    compiled = both(zero_of_an_objects_dtype)
    assert program(compiled).late.sums is None
    saved = ZERO_CONFIG.dtype
    try:
        ZERO_CONFIG.dtype = torch.float16
        both(zero_of_an_objects_dtype)
    finally:
        ZERO_CONFIG.dtype = saved
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with a bool tensor"):
        recursion(bool_zero_minus, compiled=False)(xs, left, right, int(roots[1]))
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator, with a bool tensor"):
        recompile.vmap(recursion(bool_zero_minus), in_dims=(None, None, None, 0))(xs, left, right, roots)


@recompile.function
def leaf_cell(x):
    return torch.tanh(x) * 0.5


def binary_helper_leaf(xs, left, right, i):
    """A leaf calling a compiled helper (a leaf branch of the level program all the same), its loss a zero."""
    if left[i] < 0:
        h = leaf_cell(xs[i])
        loss = 0.0
    else:
        hl, loss_l = binary_helper_leaf(xs, left, right, left[i])
        hr, loss_r = binary_helper_leaf(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def binary_started_at_a_float_over_int_leaves(xs, left, right, i):
    """A sum started at 0.0 over int losses and a leaf's int zero: a float at every inner node, where the leaves'
    zero keeps a tree sum an int; not summed."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0
    else:
        loss = 0.0
        hs = []
        for child in (left[i], right[i]):
            h, child_loss = binary_started_at_a_float_over_int_leaves(xs, left, right, child)
            hs.append(h)
            loss = loss + child_loss
        h = torch.tanh(xs[i] + 0.5 * hs[0] - 0.25 * hs[1])
    return h, loss + score(h)


def binary_leaves_of_negative_zero(xs, left, right, i):
    """A leaf's loss ``-0.0``: not a zero tree sums may start from (``-0.0 + t`` keeps t's sign)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = -0.0
    else:
        hl, loss_l = binary_leaves_of_negative_zero(xs, left, right, left[i])
        hr, loss_r = binary_leaves_of_negative_zero(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + score(h)


def negative_zero(x):
    return -(x * 0.0).sum()


def test_a_leafs_negative_zero_keeps_the_sign_eager_gives():
    compiled = recursion(binary_leaves_of_negative_zero, score=negative_zero)
    eager = recursion(binary_leaves_of_negative_zero, compiled=False, score=negative_zero)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)[1]
    want = torch.stack([eager(xs, left, right, int(r))[1] for r in roots])
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_a_sum_started_at_a_float_over_int_losses_stays_a_float_as_eagers():
    compiled = recursion(binary_started_at_a_float_over_int_leaves, score=count)
    eager = recursion(binary_started_at_a_float_over_int_leaves, compiled=False, score=count)
    assert program(compiled).late.sums is None
    left, right, roots = torch.tensor([1, -1, 3, -1, -1]), torch.tensor([2, -1, 4, -1, -1]), torch.tensor([0, 2])
    xs = torch.randn(5, 3, dtype=torch.float64)
    got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)[1]
    want = torch.stack([eager(xs, left, right, int(r))[1] for r in roots])
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("fn, callee, terms, summed", [
    (binary, score, [[0]], True), (binary_twice, score, [[0, 0, 1]], True), (binary, vector, [[0]], True),
    (binary, count, [[0]], True), (binary_mixed, score, [[0, 1]], True), (binary_one, score, None, False),
    (binary_left, score, None, False), (scored, score, None, False), (binary_zero_tensor, score, [[0]], True),
    (binary_float64_zero, count, [[0]], True), (binary_helper_leaf, score, [[0]], True)])
def test_late_elements_that_only_add_up_are_summed_by_each_calls_root(fn, callee, terms, summed):
    """A late element made only of ``+``: the deferred results, the children's same element, a leaf's zero, is
    the sum of the deferred results over the call tree, added into each root's row at once (depth by depth
    where the results differ in dtype). It matches the second way up (the agenda too) and eager, values,
    dtype and gradients."""
    compiled = recursion(fn, fusion=fn not in (binary_twice, binary_mixed), score=callee)
    eager = recursion(fn, compiled=False, score=callee)
    prog = program(compiled)
    assert ([sorted(t) for t in prog.late.sums.terms] if prog.late.sums is not None else None) == terms
    left, right, roots = forest_of_trees()
    if fn is scored:
        args, in_dims, starts = (), (None, 0), torch.tensor([0, 3, 5, 2])
    else:
        args, in_dims, starts = (left, right), (None, None, None, 0), roots
    xs = torch.randn(max(len(left), 6), 3, dtype=torch.float64, requires_grad=True)

    def run():
        xs.grad = None
        h, loss = recompile.vmap(compiled, in_dims=in_dims)(xs, *args, starts)
        (h.sum() + (loss.sum() if loss.is_floating_point() else 0)).backward()
        return (h.detach(), loss.detach()), {"xs": xs.grad.clone()}

    before = prog.summed
    got = run()
    assert prog.summed - before == (1 if summed and fn is not binary_mixed else 0)
    with switched(config, True, "LEVELS"), plain_enabled(False):  # (the second way up: on Batch values)
        saved, prog.late.sums = prog.late.sums, None
        try:
            second_way_up = run()
        finally:
            prog.late.sums = saved
    with levels_enabled(False):
        agenda = run()
    xs.grad = None
    outs = [eager(xs, *args, int(i)) for i in starts]
    h, loss = torch.stack([e[0] for e in outs]), torch.stack([torch.as_tensor(e[1]) for e in outs])
    (h.sum() + (loss.sum() if loss.is_floating_point() else 0)).backward()
    for want in (second_way_up, agenda, ((h.detach(), loss.detach()), {"xs": xs.grad.clone()})):
        assert got[0][1].dtype == want[0][1].dtype
        assert_same(got, want)
    assert prog.fallbacks == 0
    compiled.stats.reset()
    run()
    assert compiled.stats["batches"][callee.__name__]["runs"] == 1  # (once for every depth, summed or not)


def test_a_tree_sum_of_one_instance_and_of_a_lone_leaf():
    """A plain call (one instance) and a one-instance vmap of each tree, a lone leaf among them, sum as eager."""
    compiled = recursion(binary)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    for root in roots.tolist():
        summed = prog.summed
        eager_h, eager_loss = binary(xs, left, right, root)
        h, loss = compiled(xs, left, right, root)
        torch.testing.assert_close((h, loss), (eager_h, eager_loss))
        _, one = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, torch.tensor([root]))
        torch.testing.assert_close(one, eager_loss.reshape(1))
        assert prog.summed == summed + 2 and prog.fallbacks == 0
    assert prog.plain.runs == 2 * len(roots)  # (a plain call: every value shared, its one instance's)


def plain_enabled(on):
    return switched(config, on, "PLAIN_LEVELS")


def three_ways(call):
    """call() as a plain level run, as a level run on Batch values, and on the agenda."""
    with plain_enabled(False):
        batch = call()
    got, agenda = both_ways(call)
    return got, batch, agenda


def test_plain_runs_match_batch_values_and_the_agenda():
    """A level run on plain tensors (every piece traced again as one plain function, the cond's split and join
    as index ops) gives what the run on Batch values gives, and the agenda, for the examples' Tree-LSTM (its
    node loss deferred: a tree sum), another tree sum and a linear recursion returning one value. (The
    top-down model's ``p.squeeze(-1)``, a method of a batched tensor, has no raw form: it runs on Batch
    values.)"""
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4).double()
    forest = Forest.from_trees(trees())
    cases = [(program(TreeLSTM.encode, TreeLSTM), lambda: run_forest(model, forest))]
    compiled = recursion(binary)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)

    def run_binary():
        xs.grad = None
        h, loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        (h.sum() + loss.sum()).backward()
        return (h.detach(), loss.detach()), {"xs": xs.grad.clone()}

    cases.append((program(compiled), run_binary))
    walker = recompile.function(walk)

    def run_walk():
        xs.grad = None
        out = recompile.vmap(walker, in_dims=(None, 0))(xs, torch.tensor([0, 3, 6, 5, 9]))
        out.sum().backward()
        return (out.detach(),), {"xs": xs.grad.clone()}

    cases.append((program(walker), run_walk))
    for prog, run in cases:
        # (the Tree-LSTM's program is the class's: other tests may have changed the model's dtype before, a
        # guard that fails once)
        runs, failures, fallbacks = prog.plain.runs, prog.plain.failures, prog.fallbacks
        for k in range(3):
            got, batch, agenda = three_ways(run)
            assert_same(got, batch)
            assert_same(got, agenda)
        assert prog.plain.runs - runs >= 2 and prog.plain.failures - failures <= 1, prog.plain
        assert prog.fallbacks == fallbacks
        assert all(piece.traces for piece in prog.plain.pieces())


def helped(xs, i):
    """A Python helper in the branch: no plain form, so the level run goes on Batch values for good."""
    if i + 1 >= xs.shape[0]:
        return torch.tanh(xs[i])
    return torch.tanh(xs[i] + 0.5 * helped(xs, i + 1)) * halve(1.0)


def halve(x):
    return x / 2


def kept_number(xs, left, right, i):
    """The leaf's ``loss = 0.0`` joined with the nodes' tensors, then scaled by a Python number: the leaf's stays a
    Python float until ``+ (h * h).sum()``, which a plain run's rows cannot stand for."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = kept_number(xs, left, right, left[i])
        hr, loss_r = kept_number(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss * 2.0 + (h * h).sum()


def inline_loss(xs, left, right, i):
    """The loss computed inline (no call to defer): the leaf's ``loss = 0.0`` joined with the nodes' tensors as
    rows of their dtype, which the next piece adds to a tensor."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = inline_loss(xs, left, right, left[i])
        hr, loss_r = inline_loss(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + (h * h).sum()


def inline_fused_loss(xs, left, right, i):
    """``inline_loss`` whose addition joins a fused chain (``neg``, ``*``, ``-``): its members traced one by one."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = inline_fused_loss(xs, left, right, left[i])
        hr, loss_r = inline_fused_loss(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss - -(h * h).sum() * 0.5


def vector_losses(xs, left, right, i):
    """The leaf's ``loss = 0.0`` joined with the nodes' vector losses: a leaf's ``loss + s`` is 0-d, a node's a
    vector, so the number is no row of the vectors' shape (it would be summed three times)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = vector_losses(xs, left, right, left[i])
        hr, loss_r = vector_losses(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    t = loss + (h * h).sum()
    return h, h * torch.sum(t)


@pytest.mark.parametrize("plain", [True, False])
def test_a_number_joined_with_vectors_keeps_its_own_shape(plain):
    compiled = recursion(vector_losses)
    eager = recursion(vector_losses, compiled=False)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    want = [torch.stack(v) for v in zip(*[eager(xs, left, right, int(r)) for r in roots])]
    with plain_enabled(plain):
        for _ in range(2):
            got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
            torch.testing.assert_close(list(got), want)


def test_what_a_plain_run_cannot_hold_runs_on_batch_values():
    """A Python helper has no plain form; a leaf's ``loss = 0.0``, joined with the nodes' tensors, met by
    anything but a tensor of their dtype (``loss * 2.0``) is not rows of a tensor. Those calls run on Batch
    values, and the next ones with the same arguments batched go there at once."""
    compiled = recompile.function(helped)
    prog = program(compiled)
    xs = torch.randn(5, 3, dtype=torch.float64)
    starts = torch.tensor([0, 2, 4])
    want = torch.stack([helped(xs, int(i)) for i in starts])
    for _ in range(2):
        torch.testing.assert_close(recompile.vmap(compiled, in_dims=(None, 0))(xs, starts), want)
    assert prog.plain.runs == 0 and prog.plain.refused and prog.runs == 2 and prog.fallbacks == 0
    compiled = recursion(kept_number)
    eager = recursion(kept_number, compiled=False)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    want = [torch.stack(v) for v in zip(*[eager(xs, left, right, int(r)) for r in roots])]
    for _ in range(2):
        torch.testing.assert_close(list(recompile.vmap(compiled, in_dims=(None, None, None, 0))(
            xs, left, right, roots)), want)
    assert prog.plain.runs == 0 and len(prog.plain.refused) == 1 and prog.fallbacks == 0


@pytest.mark.parametrize("fn", [inline_loss, inline_fused_loss], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_leafs_number_joined_with_the_nodes_tensors_runs_as_their_rows(dtype, fn):
    """The loss computed inline: the leaf's ``0.0`` joined with the nodes' losses as rows of their dtype, then
    added to a tensor of that dtype, as eager's ``0.0 + t``: a plain run, values, dtypes and gradients as
    eager's."""
    compiled = recursion(fn)
    eager = recursion(fn, compiled=False)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=dtype, requires_grad=True)
    h, loss = (torch.stack(v) for v in zip(*[eager(xs, left, right, int(r)) for r in roots]))
    want_grad, = torch.autograd.grad(h.sum() + loss.sum(), xs)
    runs = prog.plain.runs
    for _ in range(2):
        got_h, got_loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        assert got_loss.dtype is dtype
        torch.testing.assert_close((got_h, got_loss), (h, loss))
        got_grad, = torch.autograd.grad(got_h.sum() + got_loss.sum(), xs)
        torch.testing.assert_close(got_grad, want_grad)
    assert prog.plain.runs == runs + 2 and not prog.plain.refused and prog.fallbacks == 0



def sliced_loss(xs, left, right, i):
    """The node's loss written inline, from the node's state and a shared weight (``w``): its ops make nothing
    else, so a plain run defers them as a call (``passes.levels.SliceCall``)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = sliced_loss(xs, left, right, left[i])
        hr, loss_r = sliced_loss(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    w = xs.sum(0)
    return h, loss + torch.log_softmax(h * w, -1)[0].neg()


def sliced_twice_and_called(xs, left, right, i):
    """An inline addend beside a compiled call's result, both deferred. (Compiled without fusion, which would
    join the adds into one fused op: ``binary_twice``.)"""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = sliced_twice_and_called(xs, left, right, left[i])
        hr, loss_r = sliced_twice_and_called(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    a = (h * h).sum()
    return h, loss + score(h) + a


def sliced_and_kept(xs, left, right, i):
    """The loss's logits are the state's too (``z``): only ``z.sum()`` is the loss's own."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = sliced_and_kept(xs, left, right, left[i])
        hr, loss_r = sliced_and_kept(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    z = h * 2.0
    return torch.tanh(z), loss + z.sum()


def reads_its_own_loss(xs, left, right, i):
    """The addend reads the loss of the calls below: it cannot wait for every depth (each depth adds it)."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = reads_its_own_loss(xs, left, right, left[i])
        hr, loss_r = reads_its_own_loss(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + (h * loss).sum()



def sliced_minus(xs, left, right, i):
    """The node's log-likelihood subtracted, ``loss - log_p``: a term brought in with a minus sign."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = sliced_minus(xs, left, right, left[i])
        hr, loss_r = sliced_minus(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss - torch.log_softmax(h, -1)[0]


def sliced_plus_equals(xs, left, right, i):
    """``loss += t`` then ``loss -= u`` of a loss the frame made (``passes.fresh``): two terms, in order."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = sliced_plus_equals(xs, left, right, left[i])
        hr, loss_r = sliced_plus_equals(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    loss += (h * h).sum()
    loss -= h[1] * 0.5
    return h, loss


def counted_plus_equals(xs, left, right, i):
    """An int count added with ``+=`` from an int zero: int sums, as eager's."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        n = 0
    else:
        hl, n_l = counted_plus_equals(xs, left, right, left[i])
        hr, n_r = counted_plus_equals(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        n = n_l + n_r
    n += (h > 0).sum()
    return h, n

class _Counted:
    """A piece of a plain run, its calls counted."""

    def __init__(self, piece):
        self.piece, self.unread, self.calls = piece, piece.unread, 0

    def __call__(self, *args):
        self.calls += 1
        return self.piece(*args)


@pytest.mark.parametrize("fn, slices", [(sliced_loss, 1), (sliced_twice_and_called, 1), (sliced_and_kept, 1),
                                        (sliced_minus, 1), (sliced_plus_equals, 2), (counted_plus_equals, 1),
                                        (reads_its_own_loss, 0)], ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_inline_node_loss_runs_once_for_every_depth_in_a_plain_run(fn, slices, dtype):
    """The ops that only make an addend of the loss (a node's loss written inline) are deferred in a plain
    run as a call is: they run once, on the rows of every depth, and their results are summed by each call's
    root. Values, dtypes and gradients as eager's, as the run on Batch values and as the agenda."""
    compiled = recursion(fn, fusion=fn is not sliced_twice_and_called)
    eager = recursion(fn, compiled=False)
    prog = program(compiled)
    assert len(prog.plain.slices) == slices
    counted = []
    for j in prog.plain.slices:
        piece, nargs, loc = prog.plain.deferred[j]
        counted.append(_Counted(piece))
        prog.plain.deferred[j] = (counted[-1], nargs, loc)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=dtype, requires_grad=True)

    def total(h, loss):
        return h.sum() + (loss.sum() if loss.is_floating_point() else 0)

    def run():
        h, loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        grad, = torch.autograd.grad(total(h, loss), xs)
        return (h.detach(), loss.detach()), grad

    h, loss = (torch.stack([torch.as_tensor(v) for v in vs])
               for vs in zip(*[eager(xs, left, right, int(r)) for r in roots]))
    want = (h.detach(), loss.detach()), torch.autograd.grad(total(h, loss), xs)[0]
    runs, summed = prog.plain.runs, prog.summed
    for _ in range(2):
        got = run()
        assert got[0][1].dtype is loss.dtype
        torch.testing.assert_close(got, want)
        with torch.no_grad():
            got_h, got_loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        torch.testing.assert_close((got_h, got_loss), want[0])
    assert prog.plain.runs == runs + 4 and not prog.plain.refused and prog.fallbacks == 0
    assert [c.calls for c in counted] == [4] * slices  # (once a call, for every depth)
    assert prog.plain.late.positions == ([1] if slices else []) and prog.summed == summed + 4
    for way in three_ways(run)[1:]:
        torch.testing.assert_close(way, want)


def sliced_error(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = sliced_error(xs, left, right, left[i])
        hr, loss_r = sliced_error(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
        loss = loss_l + loss_r
    return h, loss + (h * xs[i + 100]).sum()  # out of range at every node


def test_an_inline_losss_error_is_raised_from_its_line_with_the_chain():
    compiled = recursion(sliced_error)
    assert len(program(compiled).plain.slices) == 1
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3)
    errors = []
    for on in (True, False):
        with levels_enabled(on), pytest.raises(IndexError) as info:
            recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        notes = getattr(info.value, "__notes__", [])
        assert "recompile call chain" in "".join(notes)
        assert any("xs[i + 100]" in f.line for f in traceback.extract_tb(info.value.__traceback__))
        errors.append((str(info.value), notes))
    assert errors[0] == errors[1]

def test_a_failed_guard_traces_the_piece_again_for_what_holds_now():
    compiled = recompile.function(walk)
    prog = program(compiled)
    starts = torch.tensor([0, 3, 4])
    for dtype, runs in ((torch.float64, 1), (torch.float32, 2), (torch.float32, 3), (torch.float64, 4)):
        xs = torch.randn(5, 3, dtype=dtype)
        got = recompile.vmap(compiled, in_dims=(None, 0))(xs, starts)
        torch.testing.assert_close(got, torch.stack([walk(xs, int(i)) for i in starts]))
        assert (prog.plain.runs, prog.plain.failures) == (runs, 0)
    assert max(len(p.sources) for p in prog.plain.pieces()) == 2  # (one trace per dtype, where it matters)


def test_a_failed_guard_with_no_trace_left_runs_that_call_on_batch_values_and_the_next_traces_again():
    compiled = recompile.function(walk)
    prog = program(compiled)
    starts = torch.tensor([0, 3, 4])
    with switched(config, 1, "SEGMENT_TRACES"):
        for dtype, runs, failures in ((torch.float64, 1, 0), (torch.float32, 1, 1), (torch.float32, 2, 1)):
            xs = torch.randn(5, 3, dtype=dtype)
            got = recompile.vmap(compiled, in_dims=(None, 0))(xs, starts)
            torch.testing.assert_close(got, torch.stack([walk(xs, int(i)) for i in starts]))
            assert (prog.plain.runs, prog.plain.failures) == (runs, failures)
    assert prog.plain.on


calls = []


def note():
    """An undecorated helper with an effect (the callees' own ``calls.append`` would be an in-place change,
    which keeps a call from being deferred)."""
    calls.append(1)


def logged_score(x):
    note()
    return (x * x).sum()


def logged_count(x):
    note()
    return (x > 0).sum()


@pytest.mark.parametrize("fn, per_node", [(binary, 1), (binary_mixed, 2)])
def test_a_plain_run_makes_each_calls_effects_once(fn, per_node):
    """The deferred callees make an effect once per instance: once per node of every tree, in a vmap and in a
    plain call of one tree (also where the sum goes depth by depth, after the callees ran)."""
    compiled = recursion(fn, fusion=False, score=logged_score, count=logged_count)
    prog = program(compiled)
    assert prog.plain is not None
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    eager = [recursion(fn, compiled=False)(xs, left, right, int(r))[1] for r in roots]
    sizes = torch.diff(roots, append=torch.tensor([len(left)])).tolist()  # (each tree's nodes are consecutive)
    for _ in range(2):
        calls.clear()
        _, loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        assert len(calls) == per_node * len(left)
        torch.testing.assert_close(loss, torch.stack(eager))
        for r, size, want in zip(roots.tolist(), sizes, eager):
            calls.clear()
            _, got = compiled(xs, left, right, r)
            assert len(calls) == per_node * size and got.dtype == want.dtype
            torch.testing.assert_close(got, want)
    assert prog.plain.runs == 2 * (1 + len(roots)) and prog.plain.failures == 0 and prog.fallbacks == 0


def test_a_plain_piece_holds_its_fused_ops_members():
    """A fused op of plain Python inside a plain piece is traced member by member: the piece's code calls
    ``sigmoid`` and ``tanh`` and multiplies infix, never the fused kernel, and builds no list it does not
    read; it computes what the run on Batch values and the agenda compute, gradients included."""
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4).double()
    forest = Forest.from_trees(trees())
    prog = program(TreeLSTM.encode, TreeLSTM)
    got, batch, agenda = three_ways(lambda: run_forest(model, forest))
    assert_same(got, batch)
    assert_same(got, agenda)
    fused = [p for p in prog.plain.pieces() if p.kernels and p.traces]
    assert fused  # (the node's and the leaf's cell updates, and post's ``sigmoid(og) * tanh(c)``)
    for piece in fused:
        entries = {id(k.entry) for k in piece.kernels.values()}
        for _, body, _, _ in (e for traces in piece.traces.values() for e in traces):
            assert not entries & {id(v) for v in body.__globals__.values()}, piece.name
        source = "\n".join(piece.sources)
        assert " * " in source and "_mul" not in source, source
        assert not re.search(r"^\s*v\d+ = \[", source, re.M), source  # (``cat``'s list is written in place)


def test_a_plain_run_reads_modules_and_parameters_anew_each_call():
    """What a plain piece reads of shared values (a module, its parameters, a global) is read once per level
    run: a module or parameter replaced between calls, or a hook added, is seen by the next call."""
    torch.manual_seed(0)
    model = TreeLSTM(len(WORDS) + 1, embed=5, hidden=4).double()
    forest = Forest.from_trees(trees())
    prog = program(TreeLSTM.encode, TreeLSTM)
    eager = eager_twin(model)

    def check():
        eager.load_state_dict(model.state_dict())
        got = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        want = [torch.stack(x) for x in zip(*[eager.encode(t, t.root) for t in trees()])]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)

    check()
    runs = prog.plain.runs
    model.node = torch.nn.Linear(8, 20).double()
    check()
    model.node.weight = torch.nn.Parameter(torch.randn(20, 8, dtype=torch.float64))
    check()
    assert prog.plain.runs == runs + 2
    handle = model.node.register_forward_hook(lambda m, args, out: out * 0.5)
    try:
        got = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
        eager.load_state_dict(model.state_dict())
        eager.node.register_forward_hook(lambda m, args, out: out * 0.5)
        want = [torch.stack(x) for x in zip(*[eager.encode(t, t.root) for t in trees()])]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        assert prog.plain.runs == runs + 2  # (the hook: a guard of prep failed, the call ran on Batch values)
    finally:
        handle.remove()


def eager_twin(model):
    """A TreeLSTM whose encode and node_loss are the plain Python functions, with ``model``'s sizes."""
    plain = {name: attr.python for klass in type(model).__mro__ for name, attr in vars(klass).items()
             if isinstance(attr, recompile.CompiledFunction)}
    twin = type("EagerTreeLSTM", (type(model),), plain)(len(WORDS) + 1, embed=5, hidden=4).double()
    return twin


def methods(xs, left, right, i):
    """Tensor methods on batched values (a dim moved past the instance dim, a reshape keeping it first) and an
    operator on shared values (``2 < 3``): still a plain run."""
    if left[i] < 0:
        h = xs[i].tanh()
    else:
        hl = methods(xs, left, right, left[i])
        hr = methods(xs, left, right, right[i])
        both = torch.stack([hl, hr]).mean(0)
        s = both.reshape(3, 1).squeeze(-1).sum(dim=0, keepdim=True)
        h = (xs[i] * s + both.unsqueeze(0).sum(0)).sigmoid() * float(2 < 3)
    return h


def test_tensor_methods_run_in_plain_pieces():
    compiled = recompile.function(methods)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)

    def run():
        xs.grad = None
        out = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        out.sum().backward()
        return (out.detach(),), {"xs": xs.grad.clone()}

    for _ in range(2):
        got, batch, agenda = three_ways(run)
        assert_same(got, batch)
        assert_same(got, agenda)
    xs.grad = None
    eager = torch.stack([methods(xs, left, right, int(r)) for r in roots])
    eager.sum().backward()
    assert_same(got, ((eager.detach(),), {"xs": xs.grad.clone()}))
    assert prog.plain.runs == 2 and not prog.plain.refused, prog.plain.refused
    sources = "".join(src for piece in prog.plain.pieces() for src in piece.sources)
    for text in (".squeeze(-1)", ".sum(dim=1, keepdim=True)", ".unsqueeze(1)", ".reshape((", ".sigmoid()", ".tanh()"):
        assert text in sources, text


class _InferenceModeSeen(torch.overrides.TorchFunctionMode):
    """Records, per torch function called, whether inference mode was on."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append((getattr(func, "__name__", str(func)), torch.is_inference_mode_enabled()))
        return func(*args, **(kwargs or {}))


kept = []


def keep(x):
    """An undecorated helper keeping what it is given (a tensor of the run reaches the caller this way too)."""
    kept.append(x)


def kept_score(x):
    keep(x)
    return (x * x).sum()


@pytest.mark.parametrize("starts", ["forest", "lone leaf"])
def test_without_grad_a_plain_run_goes_down_and_up_in_inference_mode_and_hands_out_ordinary_tensors(starts):
    """Under ``torch.no_grad()`` the pure way down and up runs in inference mode; its results, the deferred
    calls' arguments (one depth: no ``cat`` that would copy them) and the sums are ordinary tensors, which the
    caller may change in place or use where autograd records. A call with gradients after it (the pieces
    traced in inference mode) and one under the caller's own ``torch.inference_mode()`` compute as eager."""
    compiled = recursion(binary, score=kept_score)
    prog = program(compiled)
    assert prog.plain is not None and prog.plain.deferred
    left, right, roots = forest_of_trees()
    if starts == "lone leaf":
        roots = roots[:1]
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    eager = [recursion(binary, compiled=False, score=kept_score)(xs, left, right, int(r)) for r in roots]
    want_h = torch.stack([h for h, _ in eager]).detach()
    want_loss = torch.stack([loss for _, loss in eager]).detach()
    batched = recompile.vmap(compiled, in_dims=(None, None, None, 0))
    runs = prog.plain.runs
    modes = _InferenceModeSeen()
    kept.clear()
    with torch.no_grad(), modes:
        h, loss = batched(xs, left, right, roots)
    assert prog.plain.runs == runs + 1
    assert kept and not any(x.is_inference() for x in kept)  # (the deferred calls' arguments)
    assert any(on for _, on in modes.seen) and not all(on for _, on in modes.seen), modes.seen
    torch.testing.assert_close((h, loss), (want_h, want_loss))
    assert not h.is_inference() and not loss.is_inference()
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (h * w).sum().backward()  # (h saved for the backward: an inference tensor could not be)
    h.add_(1.0)
    loss.mul_(2.0)

    xs.grad = None
    h, loss = batched(xs, left, right, roots)  # (with gradients: the pieces traced above, nothing of the mode)
    (h.sum() + loss.sum()).backward()
    got_grad = xs.grad.clone()
    xs.grad = None
    sum(h.sum() + loss for h, loss in eager).backward()
    torch.testing.assert_close((h.detach(), loss.detach(), got_grad), (want_h, want_loss, xs.grad))

    with torch.inference_mode():  # (the caller's own mode: its results are inference tensors, as eager's)
        h, loss = batched(xs, left, right, roots)
    assert h.is_inference() and loss.is_inference()
    torch.testing.assert_close((h, loss), (want_h, want_loss))
    assert prog.plain.runs == runs + 3 and prog.plain.failures == 0 and prog.fallbacks == 0


class Pooling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
        self.norm = torch.nn.LayerNorm(3)


def pooled(model, xs, left, right, i):
    """A tree cell of ops no raw form covers: its children stacked, pooled by ``sum`` and ``max(0).values``,
    weighted by ``torch.softmax(..., dim=0)`` of their norms, through an ``nn.Sequential`` and a LayerNorm."""
    if left[i] < 0:
        return torch.tanh(xs[i])
    kids = torch.stack([pooled(model, xs, left, right, left[i]), pooled(model, xs, left, right, right[i])])
    weights = torch.softmax(kids.norm(dim=-1), dim=0)
    mixed = torch.cat([(weights.unsqueeze(-1) * kids).sum(0), kids.max(0).values], dim=-1)
    return model.norm(model.mix(mixed) + xs[i])


def test_ops_without_a_raw_form_run_by_their_rules_in_a_plain_run():
    """A plain piece runs an op with no raw form by its batch rule on its tensors wrapped (a depth of one row
    as that instance's own op), where before the whole level run went on Batch values: values and gradients
    are eager's, and the run stays plain."""
    torch.manual_seed(0)
    model = Pooling().double()
    compiled, eager = recursion(pooled), recursion(pooled, compiled=False)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)

    def run(fn):
        xs.grad = None
        model.zero_grad()
        out = fn()
        out.pow(2).sum().backward()
        return out.detach(), xs.grad.clone(), [p.grad.clone() for p in model.parameters()]

    want = run(lambda: torch.stack([eager(model, xs, left, right, int(r)) for r in roots]))
    encode = recompile.vmap(compiled, in_dims=(None, None, None, None, 0))
    for _ in range(2):
        got = run(lambda: encode(model, xs, left, right, roots))
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        torch.testing.assert_close(got[2], want[2])
    assert prog.plain.runs == 2 and prog.plain.failures == 0 and not prog.plain.refused, prog.plain
    assert not compiled.stats.get("per_instance")


def dropped_walk(xs, i):
    """A linear recursion handing back its state and the state dropped out (the state goes on undropped)."""
    if i + 1 >= xs.shape[0]:
        h = torch.tanh(xs[i])
    else:
        below, _ = dropped_walk(xs, i + 1)
        h = torch.tanh(xs[i] + 0.5 * below)
    return h, torch.nn.functional.dropout(h, 0.5, True)


def test_dropout_of_a_batched_value_runs_in_the_plain_run_with_a_mask_per_instance():
    """Dropout draws one number per element: in a plain run it draws every instance's at once, each instance
    its own mask (instances of equal inputs drop differently), and the gradient goes through that mask."""
    torch.manual_seed(0)
    compiled = recursion(dropped_walk)
    prog = program(compiled)
    xs = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    starts = torch.tensor([0, 0, 0, 1])
    for _ in range(2):
        xs.grad = None
        h, dropped = recompile.vmap(compiled, in_dims=(None, 0))(xs, starts)
        weights = torch.arange(4, dtype=torch.float64)[:, None]
        (dropped * weights).sum().backward()
        mask = (dropped != 0).double()
        torch.testing.assert_close(dropped, h.detach() * 2 * mask)
        assert not torch.equal(mask[0], mask[1]) and not torch.equal(mask[1], mask[2])
        eager = recursion(dropped_walk, compiled=False)
        want_h = torch.stack([eager(xs, int(s))[0] for s in starts])
        (want,) = torch.autograd.grad((want_h * 2 * mask * weights).sum(), xs)
        torch.testing.assert_close(xs.grad, want)
    assert prog.plain.runs == 2 and not prog.plain.refused, prog.plain


HALF = torch.full((3,), 0.5, dtype=torch.float64)


def clipped(xs, left, right, i):
    """A cell with ``if``s of each node's own predicate (a norm clipped, a nested ``elif``, a branch giving a
    shared tensor): in a plain run each branch runs on the rows that take it."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = clipped(xs, left, right, left[i])
        hr, loss_r = clipped(xs, left, right, right[i])
        h = torch.tanh(xs[i] + hl - 0.5 * hr) * 2.0
        if h.norm() > 2.0:
            h = h * (2.0 / h.norm())
        elif h.sum() < -1.0:
            h = h.flip(0)
        if h[0] > 0.9:
            g = HALF
        else:
            g = h * h
        h = h + g
        loss = loss_l + loss_r
    return h, loss + score(h)


def test_an_if_of_each_instances_own_predicate_runs_its_branches_on_their_rows_in_a_plain_run():
    """Each branch of a per-node ``if`` runs on the rows taking it (all, some or none at a depth), the outputs
    joined back in the rows' order (a shared tensor given its rows); values and gradients as eager's, and as
    the run on Batch values and the agenda's. Without gradients too."""
    torch.manual_seed(0)
    compiled = recursion(clipped)
    eager = recursion(clipped, compiled=False)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = (torch.randn(len(left), 3, dtype=torch.float64) * 1.5).requires_grad_()

    def run():
        xs.grad = None
        h, loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        (h.sum() + loss.sum()).backward()
        return (h.detach(), loss.detach()), {"xs": xs.grad.clone()}

    xs.grad = None
    want = [eager(xs, left, right, int(r)) for r in roots]
    h, loss = (torch.stack(v) for v in zip(*want))
    (h.sum() + loss.sum()).backward()
    eager_run = ((h.detach(), loss.detach()), {"xs": xs.grad.clone()})
    for _ in range(2):
        got, batch, agenda = three_ways(run)
        assert_same(got, eager_run)
        assert_same(got, batch)
        assert_same(got, agenda)
    with torch.no_grad():
        h, loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
    torch.testing.assert_close((h, loss), eager_run[0])
    assert prog.plain.runs >= 3 and prog.plain.failures == 0 and not prog.plain.refused, prog.plain
    assert any(piece.conds for piece in prog.plain.pieces())


def clipped_number(xs, i):
    """A branch giving a Python number where the other gives a tensor: each instance's own value, which a plain
    run cannot hold as rows (the run goes on Batch values); a branch that raises for the rows taking it."""
    if i + 1 >= xs.shape[0]:
        return torch.tanh(xs[i])
    h = torch.tanh(xs[i] + 0.5 * clipped_number(xs, i + 1))
    if xs[i].sum() > 10.0:
        raise ValueError("too large")
    if h.sum() > 0.0:
        scale = 2.0
    else:
        scale = h
    return h * scale


def test_an_if_whose_branches_give_a_number_and_a_tensor_runs_on_batch_values():
    compiled = recompile.function(clipped_number)
    prog = program(compiled)
    torch.manual_seed(1)
    xs = torch.randn(6, 3, dtype=torch.float64)
    starts = torch.tensor([0, 2, 4, 5])
    want = torch.stack([clipped_number(xs, int(i)) for i in starts])
    for _ in range(2):
        torch.testing.assert_close(recompile.vmap(compiled, in_dims=(None, 0))(xs, starts), want)
    assert prog.plain.runs == 0 and prog.plain.refused and prog.fallbacks == 0
    xs[3] = 20.0
    with pytest.raises(ValueError, match="too large"):
        recompile.vmap(compiled, in_dims=(None, 0))(xs, starts)


@recompile.function
def composed(hl, hr, xs_i):
    """A compiled cell called from the recursion's branch: it changes nothing and calls nothing."""
    return torch.tanh(xs_i + 0.5 * hl - 0.25 * hr)


def binary_composed(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = binary_composed(xs, left, right, left[i])
        hr, loss_r = binary_composed(xs, left, right, right[i])
        h = composed(hl, hr, xs[i])
        loss = loss_l + loss_r
    return h, loss + score(h)


NOTED = []


@recompile.function
def composed_noted(hl, hr, xs_i):
    """As ``composed``, but it appends to a global list: its calls keep their place (no level program)."""
    NOTED.append(1)
    return torch.tanh(xs_i + 0.5 * hl - 0.25 * hr)


def binary_noted(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = 0.0
    else:
        hl, loss_l = binary_noted(xs, left, right, left[i])
        hr, loss_r = binary_noted(xs, left, right, right[i])
        h = composed_noted(hl, hr, xs[i])
        loss = loss_l + loss_r
    return h, loss + score(h)


def test_a_compiled_cell_called_from_the_branch_runs_in_the_level_program():
    """A call of another compiled function in the recursion's branch that changes and shows nothing is no
    invoke of the call tree: the level program runs it as a helper (traced into its pieces), values and
    gradients as eager's. One that changes something keeps the recursion on the agenda."""
    left, right, roots = forest_of_trees()
    for fn, levels in ((binary_composed, True), (binary_noted, False)):
        compiled = recursion(fn)
        eager = recursion(fn, compiled=False)
        xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
        h, loss = (torch.stack(v) for v in zip(*[eager(xs, left, right, int(r)) for r in roots]))
        want_grad, = torch.autograd.grad(h.sum() + loss.sum(), xs)
        for _ in range(2):
            got_h, got_loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
            torch.testing.assert_close((got_h, got_loss), (h, loss))
            got_grad, = torch.autograd.grad(got_h.sum() + got_loss.sum(), xs)
            torch.testing.assert_close(got_grad, want_grad)
        prog = program(compiled)
        if levels:
            assert prog.plain.runs >= 2 and not prog.plain.refused and prog.fallbacks == 0
        else:
            assert prog is None


def binary_leaf_scores(xs, left, right, i):
    """Early returns, each branch adding its own node's score: the leaf branch calls ``score`` too."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        return h, score(h)
    hl, loss_l = binary_leaf_scores(xs, left, right, left[i])
    hr, loss_r = binary_leaf_scores(xs, left, right, right[i])
    h = composed(hl, hr, xs[i])
    return h, loss_l + loss_r + score(h)


def test_a_branch_calling_only_other_functions_runs_as_a_leaf_branch_once_for_every_depth():
    """The leaf branch's call of ``score`` is a helper's (no invoke of the call tree): in a plain run that branch
    is a leaf piece, run once for the requests of every depth, not once per depth; values and gradients as
    eager's."""
    left, right, roots = forest_of_trees()
    compiled = recursion(binary_leaf_scores)
    eager = recursion(binary_leaf_scores, compiled=False)
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    h, loss = (torch.stack(v) for v in zip(*[eager(xs, left, right, int(r)) for r in roots]))
    want_grad, = torch.autograd.grad(h.sum() + loss.sum(), xs)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            got_h, got_loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        torch.testing.assert_close((got_h, got_loss), (h, loss))
        if grad:
            got_grad, = torch.autograd.grad(got_h.sum() + got_loss.sum(), xs)
            torch.testing.assert_close(got_grad, want_grad)
    prog = program(compiled)
    assert prog.plain.runs == 2 and not prog.plain.refused and prog.fallbacks == 0
    leaf = [k for k, piece in enumerate(prog.plain.leaves) if piece is not None]
    assert leaf and all(prog.branches[k] is not None and not prog.branches[k].arities for k in leaf)
    assert all(prog.plain.branches[k] is None for k in leaf)
    assert sum(len(traces) for traces in prog.plain.leaves[leaf[0]].traces.values()) >= 1
    assert prog.plain.up[leaf[0]] is None and prog.plain.down[leaf[0]] is None


@recompile.function
def checked_cell(x):
    if x.sum() > 100:
        raise ValueError("too big")
    return x * 3


def binary_checked_leaf(xs, left, right, i):
    if left[i] < 0:
        return checked_cell(xs[i])
    return torch.tanh(xs[i] + binary_checked_leaf(xs, left, right, left[i]) * binary_checked_leaf(xs, left, right,
                                                                                                right[i]))


def test_an_error_in_a_leafs_helper_is_raised_with_the_chain_through_the_branches_that_call():
    """The chain names the depths' calls through the branch that makes them, not the leaf branch beside it."""
    compiled = recompile.function(binary_checked_leaf)
    left, right = torch.tensor([1, -1, -1, -1]), torch.tensor([2, -1, -1, -1])
    xs = torch.zeros(4, 2, dtype=torch.float64)
    xs[2] = 80.0
    with pytest.raises(ValueError, match="too big") as info:
        recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, torch.tensor([0, 3]))
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "checked_cell" in notes and "binary_checked_leaf.if" in notes and "(None)" not in notes


def binary_python_numbers(xs, left, right, i):
    """The tree read through Python numbers: ``bool(...)`` as the predicate, ``int(...)`` and ``.item()`` as
    the children's indices."""
    if bool(left[i] < 0):
        return torch.tanh(xs[i])
    hl = binary_python_numbers(xs, left, right, int(left[i]))
    hr = binary_python_numbers(xs, left, right, right[i].item())
    return torch.tanh(xs[i] + hl * hr)


def binary_int_arithmetic(xs, left, right, i):
    """An int of a tensor used as a Python int beyond an index (``k / 2`` is a Python float, of float64)."""
    if bool(left[i] < 0):
        return torch.tanh(xs[i])
    k = int(left[i])
    hl = binary_int_arithmetic(xs, left, right, k)
    hr = binary_int_arithmetic(xs, left, right, int(right[i]))
    return torch.tanh(xs[i] + hl * hr) * (k / 2)


def counted_up(xs, i):
    j = int(i)
    if bool(i >= 2):
        return torch.tanh(xs[j])
    return torch.tanh(xs[j] + counted_up(xs, i + 1))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_an_int_of_each_instances_small_integer_reads_the_row_it_names(dtype):
    """``int(i)`` of a uint8 is the row it names, not a mask of its rows (a plain run takes only int32 and int64
    rows as numbers)."""
    xs = torch.arange(4.0, dtype=torch.float64).unsqueeze(1)
    roots = torch.tensor([2, 3, 0], dtype=dtype)
    want = torch.stack([counted_up(xs, r) for r in roots])
    got = recompile.vmap(recompile.function(counted_up), in_dims=(None, 0))(xs, roots)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn, plain", [(binary_python_numbers, True), (binary_int_arithmetic, False)])
def test_python_numbers_of_each_instance_as_indices_and_predicates_run_in_the_plain_run(fn, plain):
    """``int(t)``, ``t.item()`` and ``bool(t)`` are rows standing for the numbers, which an index, the predicate
    and the calls' arguments take in a plain run; any other use (``k / 2``) runs on Batch values: eager's
    values and gradients either way."""
    left, right, roots = forest_of_trees()
    compiled = recompile.function(fn)
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    want = torch.stack([fn(xs, left, right, int(r)) for r in roots])
    want_grad, = torch.autograd.grad(want.sum(), xs)
    for _ in range(2):
        got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], want_grad)
    prog = program(compiled)
    assert (prog.plain.runs == 2) is plain and prog.fallbacks == 0
    # (``k / 2`` of Python ints: each instance's Python number, computed as Python does, no torch op per instance)
    assert compiled.stats.get("per_instance", {}) == {}


def binary_pairs(xs, pairs, i):
    """The children unpacked from a row of one tensor of pairs: ``l, r = pairs[i]``."""
    if pairs[i][0] < 0:
        return torch.tanh(xs[i])
    left, right = pairs[i]
    return torch.tanh(xs[i] + binary_pairs(xs, pairs, left) * binary_pairs(xs, pairs, right))


def test_a_row_of_each_instance_unpacked_runs_in_the_plain_run_and_a_wrong_length_raises_as_eager():
    left, right, roots = forest_of_trees()
    pairs = torch.stack([left, right], 1)
    compiled = recompile.function(binary_pairs)
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    want = torch.stack([binary_pairs(xs, pairs, int(r)) for r in roots])
    want_grad, = torch.autograd.grad(want.sum(), xs)
    for _ in range(2):
        got = recompile.vmap(compiled, in_dims=(None, None, 0))(xs, pairs, roots)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], want_grad)
    prog = program(compiled)
    assert prog.plain.runs == 2 and not prog.plain.refused
    triples = torch.cat([pairs, pairs[:, :1]], 1)  # (three values to unpack into two names)
    with pytest.raises(ValueError, match="too many values to unpack"):
        binary_pairs(xs, triples, int(roots[1]))
    with pytest.raises(ValueError, match="too many values to unpack"):
        recompile.vmap(compiled, in_dims=(None, None, 0))(xs, triples, roots)


class MethodCells(torch.nn.Module):
    """A compiled cell method calling another compiled method of its class: the cell runs as a helper with its
    own program, for its class (the method it calls stays an invoke there, not a per-instance call)."""

    def __init__(self):
        super().__init__()
        self.node = torch.nn.Linear(6, 3)

    @recompile.function
    def squash(self, z):
        return torch.tanh(z) * 0.5

    @recompile.function
    def compose(self, hl, hr):
        return self.squash(self.node(torch.cat([hl, hr], -1)))

    @recompile.function
    def encode(self, xs, left, right, i):
        if left[i] < 0:
            h = torch.tanh(xs[i])
        else:
            h = self.compose(self.encode(xs, left, right, left[i]), self.encode(xs, left, right, right[i]))
        return h


@pytest.mark.parametrize("helpers_on", [True, False])
def test_a_compiled_cell_method_runs_with_its_own_program_for_its_class(helpers_on, monkeypatch):
    """``self.compose`` calls ``self.squash``: run as a helper, the cell is its own compiled program for the
    class, whatever ``config.COMPILE_HELPERS`` says (it is compiled already): no op once per instance."""
    monkeypatch.setattr(config, "COMPILE_HELPERS", helpers_on)
    torch.manual_seed(0)
    model = MethodCells().double()
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    want = torch.stack([MethodCells.encode.python(model, xs, left, right, int(r)) for r in roots])
    want_grad, = torch.autograd.grad(want.sum(), xs)
    MethodCells.encode.stats.reset()
    for _ in range(2):
        got = recompile.vmap(model.encode, in_dims=(None, None, None, 0))(xs, left, right, roots)
        torch.testing.assert_close(got, want)
        got_grad, = torch.autograd.grad(got.sum(), xs)
        torch.testing.assert_close(got_grad, want_grad)
    prog = program(MethodCells.encode, MethodCells)
    assert prog.plain.runs >= 2 and not prog.plain.refused and prog.fallbacks == 0
    assert MethodCells.encode.stats["per_instance"] == {}


def walked(xs, w, left, right, i, depth):
    """A recursion with a depth argument, below a function that is not recursive (``forward`` calling it)."""
    if left[i] < 0:
        h = torch.tanh(xs[i] * w)
    else:
        h = torch.tanh(walked(xs, w, left, right, left[i], depth + 1) * w
                       + walked(xs, w, left, right, right[i], depth + 1)) + 0.1 * depth
    return h


def forward(xs, w, left, right, i):
    h = walked(xs, w, left, right, i, 0)
    return h.sum() * 2.0, h


@pytest.mark.parametrize("grad", [False, True])
def test_a_recursion_called_from_a_function_that_is_not_recursive_runs_as_levels(grad):
    """The calls of every instance's frame of ``forward`` reach ``walked`` together: its level program runs
    them depth by depth, as it runs a call of its own (before, the agenda ran them frame by frame)."""
    compiled_walk = recompile.function(walked)
    namespace = dict(forward.__globals__, walked=compiled_walk)
    outer = recompile.function(type(forward)(forward.__code__, namespace, "forward"))
    left, right, roots = forest_of_trees()
    torch.manual_seed(0)
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=grad)
    w = torch.randn(3, dtype=torch.float64, requires_grad=grad)
    want = [torch.stack(v) for v in zip(*[forward(xs, w, left, right, int(r)) for r in roots])]
    prog = program(compiled_walk)
    runs = prog.runs
    got, agenda = both_ways(lambda: recompile.vmap(outer, in_dims=(None, None, None, None, 0))(xs, w, left, right,
                                                                                             roots))
    assert prog.runs == runs + 1 and prog.fallbacks == 0 and prog.plain.runs >= 1
    for g, a, v in zip(got, agenda, want):
        torch.testing.assert_close(g, v)
        torch.testing.assert_close(a, v)
    if grad:
        want_grads = torch.autograd.grad(want[0].sum(), (xs, w))
        for g in (got, agenda):
            torch.testing.assert_close(torch.autograd.grad(g[0].sum(), (xs, w)), want_grads)


def broken_walk(xs, left, right, i):
    if left[i] < 0:
        return xs[i + 100]  # out of range: at the bottom of every chain
    return broken_walk(xs, left, right, left[i]) + broken_walk(xs, left, right, right[i])


def calls_broken_walk(xs, left, right, i):
    return broken_walk(xs, left, right, i) * 2.0


def test_an_error_below_a_function_that_is_not_recursive_names_the_chain_from_the_outer_call():
    inner = recompile.function(broken_walk)
    namespace = dict(calls_broken_walk.__globals__, broken_walk=inner)
    outer = recompile.function(type(calls_broken_walk)(calls_broken_walk.__code__, namespace, "calls_broken_walk"))
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3)
    errors = []
    for on in (True, False):
        with levels_enabled(on), pytest.raises(IndexError) as info:
            recompile.vmap(outer, in_dims=(None, None, None, 0))(xs, left, right, roots[1:2])
        errors.append((str(info.value), info.value.__notes__[-1]))
    assert errors[0] == errors[1]
    chain = errors[0][1].splitlines()
    assert chain[1].startswith("  calls_broken_walk (") and chain[2].startswith("  broken_walk (")
    assert program(inner).fallbacks == 1


def test_the_depth_limit_counts_the_frames_above_a_recursion_run_as_levels(monkeypatch):
    inner = recompile.function(broken_walk)
    namespace = dict(calls_broken_walk.__globals__, broken_walk=inner)
    outer = recompile.function(type(calls_broken_walk)(calls_broken_walk.__code__, namespace, "calls_broken_walk"))
    left = torch.tensor([1, 0])  # (a cycle: 0 -> 1 -> 0 ...)
    monkeypatch.setattr(config, "MAX_DEPTH", 40)
    for on in (True, False):
        with levels_enabled(on), pytest.raises(RecursionError, match=r"exceeded \(40\)"):
            recompile.vmap(outer, in_dims=(None, None, None, 0))(torch.zeros(2, 3), left, left, torch.tensor([0, 1]))


Pair = collections.namedtuple("Pair", "h c")


def pair_in_post(xs, w, left, right, i):
    """A namedtuple built after the cond, read by field by the calls' caller (``post`` hands it on)."""
    if left[i] < 0:
        h, c = torch.tanh(xs[i]), xs[i] * 0.5
    else:
        a, b = pair_in_post(xs, w, left, right, left[i]), pair_in_post(xs, w, left, right, right[i])
        h, c = torch.tanh(a.h * w + b.h), a.c + b[1]
    return Pair(h, c)


def pair_in_branches(xs, w, left, right, i):
    """Each branch returns its own namedtuple, a shared element at the leaves (``w``), rows at the nodes: the
    cond joins them element by element."""
    if left[i] < 0:
        return Pair(torch.tanh(xs[i]), w)
    a, b = pair_in_branches(xs, w, left, right, left[i]), pair_in_branches(xs, w, left, right, right[i])
    return Pair(torch.tanh(a.h * a.c + b.h), a.c + b.c * 0.5)


def nested_tuples(xs, w, left, right, i):
    """``return (h, c), n``: a tuple in the result, unpacked by the caller."""
    if left[i] < 0:
        return (xs[i] * 2.0, torch.tanh(xs[i])), xs[i].sum()
    (hl, cl), nl = nested_tuples(xs, w, left, right, left[i])
    (hr, cr), nr = nested_tuples(xs, w, left, right, right[i])
    return (torch.tanh(hl * w + hr), cl * cr), nl + nr


def state_down(xs, w, left, right, i, state):
    """A namedtuple handed down to the calls as an argument (the descent gathers and joins it)."""
    h = torch.tanh(state.h * w + xs[i])
    if left[i] < 0:
        return h * state.c
    return state_down(xs, w, left, right, left[i], Pair(h, state.c * 0.5)) + \
        state_down(xs, w, left, right, right[i], Pair(h * 2.0, state.c))


@pytest.mark.parametrize("fn", [pair_in_post, pair_in_branches, nested_tuples, state_down])
def test_tuples_and_namedtuples_between_the_pieces_run_in_the_plain_run(fn):
    """A namedtuple or tuple of rows the pieces hand one another (the function's result, a branch's, a call's
    argument) is held as the tuple of its elements' rows: the plain run takes, joins and cuts it element by
    element, and hands it out as a Batch of the struct. Values and gradients are eager's."""
    compiled = recompile.function(fn)
    left, right, roots = forest_of_trees()
    torch.manual_seed(1)
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    extra = (Pair(torch.ones(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)),) \
        if fn is state_down else ()
    dims = (None, None, None, None, 0) + (None,) * len(extra)
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled, in_dims=dims)(xs, w, left, right, roots, *extra)
    want = [fn(xs, w, left, right, int(r), *extra) for r in roots]
    flat_got, flat_want = _leaves(got), [_leaves(v) for v in want]
    assert len(flat_got) == len(flat_want[0])
    for g, per in zip(flat_got, zip(*flat_want)):
        torch.testing.assert_close(g, torch.stack([torch.as_tensor(p, dtype=g.dtype) for p in per]))
    total = sum(g.sum() for g in flat_got)
    want_total = sum(torch.as_tensor(p).sum() for v in flat_want for p in v)
    torch.testing.assert_close(torch.autograd.grad(total, (xs, w)), torch.autograd.grad(want_total, (xs, w)))
    prog = program(compiled)
    assert prog.plain.runs >= 1 and not prog.plain.refused and prog.fallbacks == 0, prog.plain.refused


@pytest.mark.parametrize("fn", [pair_in_post, nested_tuples])
def test_one_instances_struct_from_a_plain_run_is_its_own(fn):
    """A single call (or a vmap of one instance) gets its own namedtuple or tuple of tensors back, as eager
    code does, not a batch of one."""
    compiled = recompile.function(fn)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)
    for r in roots[1:3]:
        got, want = compiled(xs, w, left, right, int(r)), fn(xs, w, left, right, int(r))
        assert type(got) is type(want) and type(got[0]) is type(want[0])
        for g, v in zip(_leaves(got), _leaves(want)):
            torch.testing.assert_close(g, v)
    assert program(compiled).plain.runs >= 1


class Normalized(collections.namedtuple("NormalizedBase", "h c")):
    """A namedtuple subclass whose ``__new__`` changes what it is given, and whose ``c`` is a property."""

    __slots__ = ()

    def __new__(cls, h, c):
        return super().__new__(cls, torch.tanh(h), c * 2.0)

    @property
    def c(self):
        return self[1] * 10.0


def normalized(xs, w, left, right, i):
    if left[i] < 0:
        return Normalized(xs[i], xs[i] * 0.5)
    a, b = normalized(xs, w, left, right, left[i]), normalized(xs, w, left, right, right[i])
    return Normalized(a.h * w + b.c, a.c + b.h)


def test_a_namedtuple_subclass_keeps_its_own_construction_and_properties():
    """Only plain namedtuple classes are held as their fields: a subclass's ``__new__`` and properties run as
    in eager code."""
    compiled = recompile.function(normalized)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)
    with switched(config, "allow", "PER_INSTANCE"):
        got = recompile.vmap(compiled, in_dims=(None, None, None, None, 0))(xs, w, left, right, roots)
    want = [normalized(xs, w, left, right, int(r)) for r in roots]
    torch.testing.assert_close(got[0], torch.stack([v[0] for v in want]))
    torch.testing.assert_close(got[1], torch.stack([v[1] for v in want]))


def _leaves(value):
    """The tensors and numbers of a nested tuple, in order."""
    if isinstance(value, tuple):
        return [x for v in value for x in _leaves(v)]
    return [value]


def dict_tree(xs, left, right, i):
    if left[i] < 0:
        h, loss = torch.tanh(xs[i]), 0.0
    else:
        a, b = dict_tree(xs, left, right, left[i]), dict_tree(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * a["h"] - 0.25 * b["h"])
        loss = a["loss"] + b["loss"]
    return {"h": h, "loss": loss + (h * h).sum()}


@pytest.mark.parametrize("tree_sums", [True, False])
@pytest.mark.parametrize("fn", [binary, dict_tree])
def test_late_elements_of_a_tuple_or_a_dict_with_tree_sums_on_and_off(fn, tree_sums, monkeypatch):
    """A returned dict's elements split as a tuple's; with ``config.TREE_SUMS`` off (read when the program is
    built) the late elements take the second way up on Batch values, with no plain run that would need sums."""
    monkeypatch.setattr(config, "TREE_SUMS", tree_sums)
    compiled = recursion(fn)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
    want = [fn(xs, left, right, int(r)) for r in roots]
    got, want = (list(got.values()), [list(w.values()) for w in want]) if fn is dict_tree else (got, want)
    for j in range(2):
        torch.testing.assert_close(got[j], torch.stack([torch.as_tensor(w[j], dtype=xs.dtype) for w in want]))
    torch.testing.assert_close(torch.autograd.grad(got[0].sum() + got[1].sum(), xs),
                               torch.autograd.grad(sum(w[0].sum() + w[1] for w in want), xs))
    prog = program(compiled)
    assert prog.late is not None and prog.fallbacks == 0 and (prog.plain is not None) == tree_sums
