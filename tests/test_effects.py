"""passes.effects: which programs may change state in place. A list the function builds and only appends to,
reads and returns (``hs = []; ...; hs.append(h); torch.stack(hs)``) changes nothing anyone else sees: such a
program still shares what it computes once and runs its loops as programs that change nothing do, with the
values of eager code."""

import pytest
import torch

import recompile
from bound_globals import bound_globals  # (tests/ is on sys.path under pytest)
from recompile import config
from recompile.passes import effects
from test_segments import switched
from recompile.passes.pipeline import FINAL


def collected(xs, n):
    h = torch.zeros(3, dtype=torch.float64)
    hs = []
    for t in range(n):
        h = torch.tanh(h + xs[t])
        hs.append(h)
    return torch.stack(hs).mean(0) + len(hs)


def collected_in_branches(xs, n):
    hs = []
    t = 0
    while t < n:
        if t % 2 == 0:
            hs.append(xs[t] * 2.0)
        else:
            hs.extend([xs[t], xs[t] + 1.0])
        t += 1
    return sum(hs) + hs[-1], hs


def comprehension(xs, n):
    squares = [x * x for x in xs[:n]]
    return torch.stack(squares).sum(0)


def stacked_by_keywords(xs, n):
    hs = []
    for t in range(n):
        hs.append(xs[t])
    return torch.stack(hs, dim=1).sum(1)


def given_by_keyword(xs, n):
    hs = []
    for t in range(n):
        hs.append(xs[t])
    return torch.stack(tensors=hs).sum(0)


def handed_to_a_helper(xs, n):
    hs = []
    for t in range(n):
        hs.append(xs[t])
    keep(hs)
    return torch.stack(hs).sum(0)


def keep(hs):
    return len(hs)


def filtered_then_tested(xs, n):  # (a branch taken by the list's truth: a read)
    kept = [xs[t] for t in range(n) if xs[t].sum() > 0]
    return torch.stack(kept).sum(0) if kept else xs[0]


def filtered_then_negated(xs, n):  # (``if not kept``, ``kept == []``: reads)
    kept = [xs[t] for t in range(n) if xs[t].sum() > 0]
    if not kept or kept == []:
        return xs[0]
    return torch.stack(kept).sum(0)


def framed_by_operators(xs, n):  # (``[x] + hs + [x]``, ``hs * 2``: new lists of its items)
    hs = [xs[t] for t in range(n)]
    return torch.stack([xs[0]] + hs + [xs[0]]).sum(0) + torch.stack(hs * 2).sum(0)


def drained_as_a_queue(xs, n):  # (``while queue:``: the loop's test reads its truth)
    queue, total = [0], xs[0] * 0
    while queue:
        t = queue.pop(0)
        total = total + xs[t]
        if t + 1 < n:
            queue.append(t + 1)
    return total


def reversed_then_iterated(xs, n):  # (a for over it from its end: a read)
    hs = []
    for t in range(n):
        hs.append(xs[t])
    for h in reversed(hs):
        xs = xs + h
    return xs


def appended_to_an_argument(xs, out):
    out.append(xs * 2.0)
    return xs


def renamed_in_the_loop(xs, n):
    hs, other = [], []
    for t in range(n):
        hs.append(xs[t])
        hs, other = other, hs
    return len(hs) + len(other)


def stored(self, xs):
    hs = []
    self.memory = hs
    hs.append(xs)
    return xs


@pytest.mark.parametrize("fn, local", [(collected, True), (collected_in_branches, True), (comprehension, True),
                                       (stacked_by_keywords, True), (given_by_keyword, False),
                                       (filtered_then_tested, True), (reversed_then_iterated, True),
                                       (filtered_then_negated, True), (framed_by_operators, True),
                                       (drained_as_a_queue, True),
                                       (handed_to_a_helper, False), (appended_to_an_argument, False),
                                       (renamed_in_the_loop, False), (stored, False)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_list_built_and_only_appended_to_changes_nothing_in_place(fn, local):
    f = recompile.function(fn)
    assert f.callee(None).may_mutate is not local
    sg = f.callee(None).subgraph(FINAL)
    assert bool(effects.local_appends(sg)) is local


@pytest.mark.parametrize("fn", [collected, collected_in_branches, comprehension, filtered_then_negated,
                                framed_by_operators, drained_as_a_queue])
def test_programs_collecting_lists_under_vmap_give_eager_values_and_gradients(fn):
    xs = torch.randn(5, 6, 3, dtype=torch.float64, requires_grad=True)
    n = torch.tensor([6, 1, 3, 6, 2])
    f = recompile.function(fn)
    got = recompile.vmap(f, out_dims=0)(xs, n) if fn is not collected_in_branches else None
    if fn is collected_in_branches:  # (a list per instance of its own length: each instance called alone)
        for k in range(5):
            value, hs = f(xs[k], n[k])
            want, want_hs = fn(xs[k], int(n[k]))
            torch.testing.assert_close(value, want)
            assert len(hs) == len(want_hs)
        return
    want = torch.stack([fn(xs[k], int(n[k])) for k in range(5)])
    torch.testing.assert_close(got, want)
    (grad,) = torch.autograd.grad(got.sum(), xs)
    (want_grad,) = torch.autograd.grad(want.sum(), xs)
    torch.testing.assert_close(grad, want_grad)
    assert "zeros" not in str(f.stats["per_instance"])  # (computed once: the run changes nothing in place)


def grown(xs, n):
    if n == 0:
        return []
    hs = []
    hs.extend(grown(xs, n - 1))
    hs.append(xs[0] * n)
    return hs


def counted(xs, n):
    return xs[0] * len(grown(xs, n))


def test_lists_of_their_own_lengths_returned_by_a_recursion_reach_their_callers():
    """Each request of a batched call gets its part of the results, an empty list too (``batch.cut``)."""
    funcs = {name: recompile.function(globals()[name]) for name in ("grown", "counted")}
    xs, n = torch.randn(3, 2), torch.tensor([2, 1, 0])
    with bound_globals(globals(), funcs):
        got = recompile.vmap(funcs["counted"])(xs, n)
    torch.testing.assert_close(got, torch.stack([counted(xs[k], int(n[k])) for k in range(3)]))


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
@pytest.mark.parametrize("fn", [collected, comprehension])
def test_programs_collecting_lists_give_eager_gradients_in_every_mode(fn, mode):
    xs = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    f = recompile.function(fn, mode=mode)
    for n in (6, 1, 3):
        got = f(xs, n)
        want = fn(xs, n)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def sorted_tensor(xs, opts):
    return xs.sort(descending=True).values + xs.sort(dim=0).values + xs.add(xs, alpha=2.0) + xs.sort(0)[0] + \
        xs.sort(-1).values


def sorted_list(xs, opts):
    order = [3, 1, 2]
    order.sort()
    return xs * order[0]


def sorted_by_options(xs, opts):
    order = [3, 1, 2]
    order.sort(**opts)
    return xs * order[0]


def sorted_unbound(xs, opts):
    order = [3, 1, 2]
    list.sort(order, reverse=True)
    return xs * order[0]


class Bag:
    def __init__(self):
        self.items = []

    def add(self, v, w):
        self.items.append(v * w)


def added_to_a_bag(xs, opts):
    bag = Bag()
    bag.add(xs, 2.0)
    return xs * len(bag.items)


def added_to_a_set(xs, opts):
    seen = set()
    seen.add(1)
    return xs * len(seen)


@pytest.mark.parametrize("fn, mutates", [(sorted_tensor, False), (sorted_list, True), (sorted_by_options, True),
                                         (sorted_unbound, True), (added_to_a_bag, True), (added_to_a_set, True)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_method_a_tensor_shares_with_a_list_or_set_changes_something_only_as_theirs_can(fn, mutates):
    f = recompile.function(fn)
    assert f.callee(None).may_mutate is mutates
    x = torch.tensor([2.0, 1.0, 3.0])
    torch.testing.assert_close(f(x, {"reverse": True}), fn(x, {"reverse": True}))


@recompile.function
def sort_unbound(order):
    list.sort(order)
    return 1.0


@recompile.function
def doubled(v):
    return v * 2.0


def read_after_a_helper_sorts(x):
    order = [5, 3, 2]
    a = sort_unbound(order)
    return a * doubled(x * order[0])  # (order[0] is 2 once sorted: read after the helper ran)


def test_a_helper_that_sorts_a_list_keeps_its_place_before_what_reads_the_list():
    x = torch.tensor([1.0, 2.0])
    compiled = recompile.function(read_after_a_helper_sorts)
    torch.testing.assert_close(compiled(x[0]), read_after_a_helper_sorts(x[0]))
    torch.testing.assert_close(recompile.vmap(compiled)(x), torch.stack([read_after_a_helper_sorts(v) for v in x]))


RELU_IN_PLACE = torch.nn.ReLU(inplace=True)
LAYER_IN_PLACE = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ReLU(inplace=True))
LAYER_AFTER = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(inplace=True))  # (writes its own)


def leaky_by_position(x):
    y = x * 1.0
    torch.nn.functional.leaky_relu(y, 0.5, True)  # (``inplace`` given by position)
    return y


def leaky_out_of_place(x):
    y = x * 1.0
    return torch.nn.functional.leaky_relu(y, 0.5, False)


def relu_module_in_place(x):
    y = x * 1.0
    RELU_IN_PLACE(y)
    return y


def sequential_in_place(x):
    y = x * 1.0
    LAYER_IN_PLACE(y)
    return y


def sequential_writing_its_own(x):
    y = x * 1.0
    return LAYER_AFTER(y) + y


@pytest.mark.parametrize("fn, mutates", [(leaky_by_position, True), (leaky_out_of_place, False),
                                         (relu_module_in_place, True), (sequential_in_place, True),
                                         (sequential_writing_its_own, False)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_an_inplace_flag_by_position_or_a_module_built_in_place_changes_its_argument(fn, mutates):
    f = recompile.function(fn)
    assert f.callee(None).may_mutate is mutates
    x = torch.tensor([[2.0, -1.0, 3.0], [-2.0, 1.0, -0.5]])
    torch.testing.assert_close(recompile.vmap(f)(x), torch.stack([fn(r) for r in x]))


# -- a stack the function keeps (a shift-reduce parser's), and ints a branch moves

CELL = torch.nn.Linear(3, 3).double()


def shift_reduce(xs, acts):
    """A shift-reduce parser's stack: shift pushes the next word, reduce pops two and pushes their parent."""
    stack = []
    i = 0
    for a in acts:
        if a == 0:
            stack.append(xs[i])
            i += 1
        elif len(stack) >= 2:
            right = stack.pop()
            left = stack.pop()
            stack.append(torch.tanh(CELL(left + right)))
    return torch.stack(stack).sum(0) + stack[-1]


def shift_reduce_sliced(xs, acts):
    """The stack cut by slices and grown by ``+``: each instance's new list each time."""
    stack = []
    i = 0
    for a in acts:
        if a == 0:
            stack = stack + [xs[i]]
            i += 1
        elif len(stack) >= 2:
            left, right = stack[-2:]
            stack = stack[:-2] + [torch.tanh(CELL(left + right))]
    return torch.stack(stack).sum(0) + stack[-1]


def shift_reduce_deleted(xs, acts):
    """The stack read by index and cut by ``del``."""
    stack = []
    i = 0
    for a in acts:
        if a == 0:
            stack.append(xs[i])
            i += 1
        elif len(stack) >= 2:
            left, right = stack[-2], stack[-1]
            del stack[-2:]
            stack.append(torch.tanh(CELL(left + right)))
            del stack[0]
            stack.insert(0, xs[0])
    return torch.stack(stack).sum(0) + stack[-1]


def popped_while_iterated(xs, acts):
    stack = [xs[0], xs[1], xs[2]]
    total = xs[0] * 0
    for v in stack:
        total = total + v
        if len(stack) > 1:
            stack.pop()
    return total


def counted_in_a_branch(xs, n):
    t = 0
    k = 0
    while t < n:
        if xs[t].sum() > 0:
            k += 2
        t += 1
    return xs[k // 4] * 1.0


def moved_by_a_tensor(xs, n):
    k = 0
    for t in range(n):
        k += xs[t, 0]  # (an int plus a tensor: no int from here on)
    return xs[0] * k


@pytest.mark.parametrize("fn, local", [(shift_reduce, True), (shift_reduce_sliced, True), (shift_reduce_deleted, True),
                                       (popped_while_iterated, False)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_stack_the_function_keeps_changes_nothing_in_place_unless_a_for_reads_it(fn, local):
    f = recompile.function(fn)
    assert f.callee(None).may_mutate is not local


@pytest.mark.parametrize("fn, ints", [(counted_in_a_branch, 2), (moved_by_a_tensor, 0)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_an_int_moved_by_ints_in_a_branch_changes_nothing_in_place(fn, ints):
    f = recompile.function(fn)
    assert len(effects.int_counting(f.callee(None).subgraph(FINAL))) == ints
    if ints:
        assert not f.callee(None).may_mutate


ACTS = [[0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1], [0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1], [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("parse", [shift_reduce, shift_reduce_sliced, shift_reduce_deleted],
                         ids=lambda v: v.__name__)
def test_a_shift_reduce_parser_under_vmap_batches_and_gives_eager_values_and_gradients(parse):
    xs = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
    acts = torch.tensor(ACTS)
    f = recompile.function(parse)
    with switched(config, "error", "PER_INSTANCE"):  # (every op batched: none runs once per instance)
        got = recompile.vmap(f)(xs, acts)
    want = torch.stack([parse(xs[k], acts[k]) for k in range(4)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])
    assert f.stats["per_instance"] == {}
    xs = torch.randn(4, 6, 3, dtype=torch.float64)
    n = torch.tensor([1, 3, 6, 2])
    got = recompile.vmap(recompile.function(counted_in_a_branch))(xs, n)
    torch.testing.assert_close(got, torch.stack([counted_in_a_branch(xs[k], int(n[k])) for k in range(4)]))


def popped_regardless(xs, acts):
    stack = []
    for a in acts:
        if a == 0:
            stack.append(xs[0])
        else:
            stack.pop()
    return xs[0] * len(stack)


def test_a_pop_of_an_empty_stack_raises_pythons_index_error():
    xs = torch.randn(3, 2)
    f = recompile.vmap(recompile.function(popped_regardless))
    torch.testing.assert_close(f(xs, torch.tensor([[0, 0, 1], [0, 1, 0], [0, 0, 0]])),
                               xs[:, 0] * torch.tensor([1.0, 1.0, 3.0]))
    with pytest.raises(IndexError, match="pop from empty list"):
        f(xs, torch.tensor([[0, 0, 1], [0, 1, 1], [0, 0, 0]]))


def take_last_of(x, ext):
    s = [x * 0]
    if x.sum() > -100:
        s = ext  # (the caller's list on this side: a del through s reaches it)
    v = s[-1]
    del s[-1]
    return v


def take_twice(x, ext):
    return take_last_of(x, ext) * 10 + take_last_of(x * 2, ext)


def test_a_list_a_branch_may_give_the_callers_is_not_the_functions_own():
    assert recompile.function(take_last_of).callee(None).may_mutate
    ext = [torch.ones(2)] * 6
    recompile.vmap(recompile.function(take_twice), in_dims=(0, None))(torch.randn(2, 2), ext)
    assert len(ext) == 2  # (two calls for each of two instances, each deleting one item, as eager's)


STEP = torch.nn.GRUCell(3, 3).double()


def collected_then_swapped(xs, n):
    h = torch.zeros(3, dtype=torch.float64)
    hs = []
    for t in range(n):
        h = STEP(xs[t], h)
        hs.append(h)
    last = hs.pop()
    hs.pop()
    hs.append(h * 2)  # (the same length, first and last item as before: the middle changed)
    hs.append(last)
    return torch.stack(hs).sum(0)


def collected_then_cut(xs, n):
    h = torch.zeros(3, dtype=torch.float64)
    hs = []
    for t in range(n):
        h = STEP(xs[t], h)
        hs.append(h)
    hs.insert(1, h * 0)
    del hs[2]
    return torch.stack(hs).sum(0)


@pytest.mark.parametrize("fn", [collected_then_swapped, collected_then_cut], ids=lambda f: f.__name__)
def test_states_a_loop_collected_then_popped_or_cut_stack_as_the_lists_hold_them(fn):
    xs = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    n = torch.tensor([5, 3, 4, 5])
    got = recompile.vmap(recompile.function(fn))(xs, n)
    want = torch.stack([fn(xs[k], int(n[k])) for k in range(4)])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], torch.autograd.grad(want.sum(), xs)[0])


def filled_in_a_block(x):
    zs = [torch.zeros(3, dtype=torch.float64)]  # (nothing of an instance's: computed once where nothing changes)
    with torch.no_grad():
        zs[0].add_(x)
    return zs[0] * 1


def traced_in_a_block(xs, left, right, i, trace):
    if left[i] < 0:
        h = xs[i].sum()
    else:
        h = traced_in_a_block(xs, left, right, left[i], trace) + traced_in_a_block(xs, left, right, right[i], trace)
    with torch.no_grad():
        trace.append(float(h))
    return h


def read_in_a_block(xs, left, right, i):
    if left[i] < 0:
        h = xs[i].sum()
    else:
        h = read_in_a_block(xs, left, right, left[i]) + read_in_a_block(xs, left, right, right[i])
    with torch.no_grad():
        scale = h.abs() + 1.0
    return h / scale


@pytest.mark.parametrize("fn, mutates", [(filled_in_a_block, True), (traced_in_a_block, True),
                                         (read_in_a_block, False)])
def test_what_a_with_block_changes_in_place_counts_as_the_functions_change(fn, mutates):
    """A with block runs as Python: its code is read for changes (``effects.code_may_change``), an item's method
    ending in ``_`` or a list's ``append`` there as anywhere in the function; a block that only reads and sets
    the function's variables changes nothing another call sees."""
    compiled = recompile.function(fn)
    assert effects.program_may_mutate(compiled.callee(None), FINAL) is mutates


def test_a_with_block_changing_values_in_place_gives_eagers_values_and_order(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    xs = [torch.full((3,), float(k), dtype=torch.float64) for k in range(1, 5)]
    got = recompile.map(recompile.function(filled_in_a_block), xs)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, filled_in_a_block(x))
    left, right = torch.tensor([1, 3, -1, -1, -1]), torch.tensor([2, 4, -1, -1, -1])
    values = torch.arange(5.0, dtype=torch.float64).unsqueeze(1).repeat(1, 2)
    want = []
    traced_in_a_block(values, left, right, 0, want)
    compiled = recompile.function(traced_in_a_block)
    monkeypatch.setitem(traced_in_a_block.__globals__, "traced_in_a_block", compiled)
    got = []
    compiled(values, left, right, 0, got)
    assert got == want  # (each instance's own calls in Python's order: the block's appends say so)
