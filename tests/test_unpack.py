"""passes/unpack.py: a recursive call's tuple read by constant indices is unpacked once where it is made."""

import pytest
import torch

import recompile
from test_levels import forest_of_trees, program, recursion


def indexed(xs, left, right, i):
    if left[i] < 0:
        h = torch.tanh(xs[i])
        loss = h.sum() * 0.0
    else:
        lo = indexed(xs, left, right, left[i])
        hi = indexed(xs, left, right, right[i])
        h = torch.tanh(xs[i] + 0.5 * lo[0] - 0.25 * hi[-2])
        loss = lo[1] + hi[1]
    return h, loss + h.pow(2).sum()


def escapes(xs, i):
    if i + 1 >= xs.shape[0]:
        return xs[i], xs[i].sum()
    below = escapes(xs, i + 1)
    if i == 0:
        return below  # (the tuple itself is returned: not unpacked)
    return xs[i] + below[0], below[1]


def by_a_variable(xs, i, k):
    if i + 1 >= xs.shape[0]:
        return xs[i], xs[i] * 2.0
    below = by_a_variable(xs, i + 1, k)
    return xs[i] + below[k], below[1]


def ir_of(fn, stage):
    return recompile.function(fn).dump(stage=stage)


def test_a_recursive_calls_indexed_result_is_unpacked_once():
    before, after = ir_of(indexed, "prune"), ir_of(indexed, "unpack")
    assert before.count("call getitem(%indexed") == 4 and "unpack(%indexed" not in before
    assert after.count("call unpack(%indexed") == 2 and "call getitem(%indexed" not in after


def test_a_result_read_otherwise_is_left_as_it_is():
    assert "unpack(" not in ir_of(escapes, "unpack")
    assert "unpack(" not in ir_of(by_a_variable, "unpack")
    xs = torch.randn(4, 3, dtype=torch.float64)
    for fn, args in ((escapes, (xs, 0)), (by_a_variable, (xs, 0, 0))):
        for got, want in zip(recompile.function(fn)(*args), fn(*args)):
            torch.testing.assert_close(got, want)


def test_the_indexed_spelling_runs_as_a_level_program_with_eagers_values_and_gradients():
    compiled, eager = recursion(indexed), recursion(indexed, compiled=False)
    prog = program(compiled)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    want = [eager(xs, left, right, int(r)) for r in roots]
    (want_grad,) = torch.autograd.grad(sum(h.sum() + loss for h, loss in want), xs)
    for _ in range(2):
        h, loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
        (grad,) = torch.autograd.grad(h.sum() + loss.sum(), xs)
        torch.testing.assert_close(h, torch.stack([w[0] for w in want]))
        torch.testing.assert_close(loss, torch.stack([w[1] for w in want]))
        torch.testing.assert_close(grad, want_grad)
    assert prog is not None and prog.plain.runs == 2, prog


def returned_early(xs, left, right, i):
    """A tuple returned from each branch (an early return at a leaf): the if's outputs are its elements."""
    if left[i] < 0:
        h = torch.tanh(xs[i])
        return h, (h * h).sum()
    hl, loss_l = returned_early(xs, left, right, left[i])
    hr, loss_r = returned_early(xs, left, right, right[i])
    h = torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr)
    return h, loss_l + loss_r + (h * h).sum()


def returned_nested(xs, left, right, i):
    """Returns in an if nested in a branch."""
    if left[i] < 0:
        if xs[i].sum() > 0:
            return torch.tanh(xs[i]), xs[i].max()
        return torch.sigmoid(xs[i]), xs[i].min()
    hl, n_l = returned_nested(xs, left, right, left[i])
    hr, n_r = returned_nested(xs, left, right, right[i])
    return torch.tanh(xs[i] + 0.5 * hl - 0.25 * hr), n_l + n_r


def returned_unlike(xs, i):
    """Tuples of two lengths: left as they are."""
    if i + 1 >= xs.shape[0]:
        return xs[i], xs[i].sum()
    return xs[i], xs[i].sum(), returned_unlike(xs, i + 1)[1]


def returned_and_read(xs, i):
    """The branch's tuple is read there too (its length): left as it is."""
    if i + 1 >= xs.shape[0]:
        pair = (xs[i], xs[i].sum())
        return pair[0] * len(pair), pair[1]
    pair = (xs[i], xs[i].sum())
    return pair if len(pair) == 2 else None


def test_a_tuple_each_branch_returns_becomes_the_ifs_outputs():
    text = recompile.function(returned_early).dump(stage="unpack")
    assert text.count("build_tuple") == 1 and "unpack(%returned_early" in text
    nested = recompile.function(returned_nested).dump(stage="unpack")
    assert nested.count("build_tuple") == 1
    for fn in (returned_unlike, returned_and_read):  # (as the frontend made them)
        f = recompile.function(fn)
        assert f.dump(stage="unpack").count("build_tuple") == f.dump(stage="prune").count("build_tuple") >= 2


def test_early_returns_run_as_a_level_program_with_eagers_values_and_gradients():
    left, right, roots = forest_of_trees()
    for fn in (returned_early, returned_nested):
        compiled = recursion(fn)
        eager = recursion(fn, compiled=False)
        xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
        h, loss = (torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in vs])
                   for vs in zip(*[eager(xs, left, right, int(r)) for r in roots]))
        want = (h, loss), torch.autograd.grad(h.sum() + loss.sum(), xs)
        for _ in range(2):
            got_h, got_loss = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
            got = (got_h, got_loss), torch.autograd.grad(got_h.sum() + got_loss.sum(), xs)
            torch.testing.assert_close(got, want)
        prog = program(compiled)
        assert prog.plain.runs == 2 and prog.fallbacks == 0 and not prog.plain.refused, fn.__name__
        for mode in ("sequential", "threaded"):
            f = recompile.function(fn, mode=mode)
            torch.testing.assert_close(f(xs, left, right, int(roots[1]))[0], h[1])
    xs = torch.randn(4, 3, dtype=torch.float64)
    for fn in (returned_unlike, returned_and_read):
        for mode in ("sequential", "batched"):
            got = recompile.function(fn, mode=mode)(xs, 0)
            torch.testing.assert_close(got, fn(xs, 0))


def both_at_once(xs, left, right, i):
    if left[i] < 0:
        return torch.tanh(xs[i]), xs[i].sum()
    (hl, nl), (hr, nr) = both_at_once(xs, left, right, left[i]), both_at_once(xs, left, right, right[i])
    a, b = hl * 0.5, hr  # (a tuple of plain values, unpacked at once)
    return torch.tanh(a + b + xs[i]), nl + nr


def kept(xs, i):
    pair = xs[i], xs[i] * 2.0
    a, b = pair
    return a + b, pair  # (the tuple is read again: left as it is)


def test_a_tuple_built_and_unpacked_at_once_is_its_items():
    text = recompile.function(both_at_once).dump(stage="unpack")
    assert "build_tuple(%both_at_once" not in text and text.count("call unpack(%both_at_once") == 2
    assert "build_tuple" in recompile.function(kept).dump(stage="unpack")
    xs = torch.randn(3, 2, dtype=torch.float64)
    for got, want in zip(recompile.function(kept)(xs, 1)[1], kept(xs, 1)[1]):
        torch.testing.assert_close(got, want)
    compiled = recursion(both_at_once)
    left, right, roots = forest_of_trees()
    xs = torch.randn(len(left), 3, dtype=torch.float64, requires_grad=True)
    got = recompile.vmap(compiled, in_dims=(None, None, None, 0))(xs, left, right, roots)
    want = [both_at_once(xs, left, right, int(r)) for r in roots]
    for j in range(2):
        torch.testing.assert_close(got[j], torch.stack([w[j] for w in want]))
    torch.testing.assert_close(torch.autograd.grad(got[0].sum() + got[1].sum(), xs),
                               torch.autograd.grad(sum(w[0].sum() + w[1] for w in want), xs))
    assert program(compiled).plain.runs >= 1
    for mode in ("sequential", "threaded"):  # (the rewritten program's derived gradients too)
        namespace = dict(both_at_once.__globals__)
        one = recompile.function(type(both_at_once)(both_at_once.__code__, namespace, "both_at_once"), mode=mode)
        namespace["both_at_once"] = one
        for r in roots.tolist():
            got, want = one(xs, left, right, r), both_at_once(xs, left, right, r)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(torch.autograd.grad(got[0].sum() + got[1], xs),
                                       torch.autograd.grad(want[0].sum() + want[1], xs))


# -- lists a frame builds by appends, and items read off displays


def appended_then_read(x):
    hs, cs = [], []
    for k in (1, 2):  # (a for over a display: its body once per item)
        hs.append(x * k)
        cs.append(x + k)
    a, b = [v.sin() for v in (x, x * 3)]
    return torch.cat(hs) + cs[0].repeat(2) + cs[-1].repeat(2) + a.repeat(2) * b.repeat(2), len(hs), (x, 4)[1]


def read_between_appends(x):
    hs = []
    hs.append(x)
    n = len(hs)  # (the list read before its last append: it stays a list appended to)
    hs.append(x * n)
    return hs


def handed_on_between_appends(x, seen):
    hs = []
    hs.append(x)
    seen.append(hs)  # (the list handed on: whoever holds it may see the next append)
    hs.append(x * 2)
    return hs[1]


def read_past_the_end(x):
    hs = [x]
    return hs[1]


def test_a_list_built_by_appends_is_its_display_and_its_items_are_read_off_it():
    ir = ir_of(appended_then_read, "unpack")
    assert "'append'" not in ir and ir.count("call build_list(") == 2 and "getitem(" not in ir
    x = torch.randn(3, dtype=torch.float64)
    for mode in ("sequential", "batched"):
        got, want = recompile.function(appended_then_read, mode=mode)(x), appended_then_read(x)
        torch.testing.assert_close(got[0], want[0])
        assert got[1:] == want[1:]


def test_a_list_read_or_handed_on_before_its_last_append_keeps_its_appends():
    for fn in (read_between_appends, handed_on_between_appends):
        assert ir_of(fn, "unpack").count("getattr(%hs, 'append')") == 2
    x = torch.randn(3, dtype=torch.float64)
    got, want = recompile.function(read_between_appends)(x), read_between_appends(x)
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    seen_got, seen_want = [], []
    assert torch.equal(recompile.function(handed_on_between_appends)(x, seen_got),
                       handed_on_between_appends(x, seen_want))
    assert len(seen_got[0]) == len(seen_want[0]) == 2


def test_an_item_past_a_displays_end_raises_pythons_index_error():
    assert "getitem(" in ir_of(read_past_the_end, "unpack")
    with pytest.raises(IndexError, match="list index out of range"):
        recompile.function(read_past_the_end)(torch.ones(2))
