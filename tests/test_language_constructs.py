"""Python as people write it: constructs that compile as Python runs them.

Each program is an ordinary, undecorated function. It runs plain, and compiled in sequential, threaded and
batched mode (and under ``recompile.vmap`` where instances may take different paths): the same values of the
same Python types, or the same exception (type and message), and the same float64 gradients where the program
is differentiable.

Layout
  1. helpers
  2. variables bound on some paths only
  3. del, set and dict comprehensions, starred targets, *args and **kwargs in calls of compiled functions
  4. lambda, nested def, closures, nonlocal, global, generator expressions
  5. with, try, match; for over enumerate(...)
  6. for over reversed(range(...))
  7. a generator a builtin consumes whole
  8. a for over a display of a few items, or over a range of a few
"""

from __future__ import annotations

import copy
import itertools
import types
import warnings

import pytest
import torch

import recompile
from bound_globals import bound_globals  # tests/ is on sys.path under pytest

F64 = torch.float64
MODES = ["sequential", "threaded", "batched"]
G = globals()


# ---------------------------------------------------------------------------
# 1. helpers
# ---------------------------------------------------------------------------

def outcome(fn, args):
    """("ok", value) or ("raise", exception type, message), on a deep copy of ``args``."""
    args = copy.deepcopy(args)
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - type and message are what is compared
        return ("raise", type(exc), str(exc))


def assert_same(got, want, path="result"):
    """Equal values and identical Python types, recursively."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} {got!r} != {type(want).__name__} {want!r}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: {got} != {want}"
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True), f"{path}: {got} != {want}"
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: {got!r} != {want!r}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def assert_outcome(got, want):
    assert got[0] == want[0], f"compiled: {got}, plain: {want}"
    if want[0] == "ok":
        assert_same(got[1], want[1])
    else:
        assert got[1:] == want[1:], f"compiled raised {got[1:]}, plain raised {want[1:]}"


def compiled(fn, mode, rec=()):
    """``fn`` compiled in ``mode``, and the globals ``rec`` (names of plain functions, for recursion)
    compiled alike, to be bound while the compiled side runs."""
    installed = {name: recompile.function(mode=mode)(G[name]) for name in rec}
    return installed.get(fn.__name__) or recompile.function(mode=mode)(fn), installed


def check(fn, *cases, rec=()):
    """Plain vs compiled in every mode, on each tuple of arguments in ``cases``."""
    for mode in MODES:
        f, installed = compiled(fn, mode, rec)
        with bound_globals(G, installed):
            for args in cases:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", recompile.PerInstanceWarning)
                    assert_outcome(outcome(f, args), outcome(fn, args))


def check_vmap(fn, in_dims, *args, rec=(), per_instance=False):
    """``recompile.vmap`` vs the plain function on each instance, results stacked; where an instance raises,
    the batched run raises the same. Unless ``per_instance``, no op may run once per instance."""
    n = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    plain = []
    for k in range(n):
        one = outcome(fn, tuple(a if d is None else a.select(d, k) for a, d in zip(args, in_dims)))
        if one[0] == "raise":
            want = one
            break
        plain.append(one[1])
    else:
        want = ("ok", torch.stack(plain))
    f, installed = compiled(fn, "batched", rec)
    with bound_globals(G, installed), warnings.catch_warnings():
        if not per_instance:
            warnings.simplefilter("error", recompile.PerInstanceWarning)
        assert_outcome(outcome(recompile.vmap(f, in_dims=in_dims), args), want)


def check_grad(fn, *args):
    """Float64 gradients of ``fn(*args).sum()`` for the tensor arguments, plain vs every mode."""
    def grads(f):
        leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
        out = f(*leaves)
        return torch.autograd.grad(out.sum(), [a for a in leaves if isinstance(a, torch.Tensor)])

    want = grads(fn)
    for mode in MODES:
        for g, w in zip(grads(recompile.function(mode=mode)(fn)), want):
            assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (mode, g, w)


def T(*vals):
    return torch.tensor(vals, dtype=F64)


POS, NEG = T(1.0, 2.0), T(-1.0, -3.0)
ROWS = T([1.0, 2.0], [-1.0, -3.0], [0.5, 0.25])  # one row per instance: positive, negative, positive


# ---------------------------------------------------------------------------
# 2. variables bound on some paths only: UnboundLocalError where a path that did not bind one reads it
# ---------------------------------------------------------------------------

def bound_in_one_branch(x):
    if x.sum() > 0:
        y = x * 2
    return y


def bound_in_one_branch_read_on_the_other(x):
    if x.sum() > 0:
        y = x * 2
    else:
        z = x - 1
    if x.sum() > 0:
        return y
    return z


def bound_in_elif(n):
    if n > 2:
        kind = "big"
    elif n > 0:
        kind = "small"
    return kind


def bound_in_for_body(n):
    for i in range(n):
        last = i * 10
    return last


def bound_in_while_body(x):
    while x.sum() > 0:
        before = x
        x = x - 1
    return before


def read_before_bound(flag):
    if flag:
        return late  # noqa: F821 - bound below, unbound here: UnboundLocalError as in Python
    late = 1
    return late


def bound_then_rebound_in_a_branch(x):
    if x.sum() > 0:
        y = x
    if x.sum() > 1:
        y = x * 3
    return y


def bound_by_break(xs, target):
    for x in xs:
        if x == target:
            found = x
            break
    return found


def bound_in_one_branch_unread(n):
    if n > 0:
        unused = n  # noqa: F841 - bound on one path and never read: no error on any path
    return n + 1


@pytest.mark.parametrize("fn,cases", [
    (bound_in_one_branch, [(POS,), (NEG,)]),
    (bound_in_one_branch_read_on_the_other, [(POS,), (NEG,)]),
    (bound_in_elif, [(3,), (1,), (0,)]),
    (bound_in_for_body, [(3,), (0,)]),
    (bound_in_while_body, [(POS,), (NEG,)]),
    (read_before_bound, [(True,), (False,)]),
    (bound_then_rebound_in_a_branch, [(POS,), (T(0.25, 0.25),), (NEG,)]),
    (bound_by_break, [([1, 2, 3], 2), ([1, 2, 3], 5)]),
    (bound_in_one_branch_unread, [(1,), (0,)]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_variables_bound_on_some_paths(fn, cases):
    check(fn, *cases)


def count_down_bound_at_the_leaf(x, n):
    if n == 0:
        if x.sum() > 0:
            leaf = x * 2
        return leaf
    return count_down_bound_at_the_leaf(x, n - 1) + 1


def test_variables_bound_on_some_paths_batched():
    # only the instances that take the path that leaves y unbound raise; when none does, nothing raises
    check_vmap(bound_in_one_branch, (0,), ROWS)
    check_vmap(bound_in_one_branch, (0,), ROWS.abs())
    check_vmap(bound_in_while_body, (0,), ROWS)
    check_vmap(bound_in_while_body, (0,), ROWS.abs())
    check_vmap(count_down_bound_at_the_leaf, (0, 0), ROWS.abs(), torch.tensor([0, 2, 1]),
               rec=("count_down_bound_at_the_leaf",))
    check_vmap(count_down_bound_at_the_leaf, (0, 0), ROWS, torch.tensor([0, 2, 1]),
               rec=("count_down_bound_at_the_leaf",))
    check(count_down_bound_at_the_leaf, (POS, 2), (NEG, 2), rec=("count_down_bound_at_the_leaf",))


def test_variables_bound_on_some_paths_gradients():
    check_grad(bound_in_one_branch, POS)
    check_grad(bound_in_while_body, T(2.0, 0.5))


# ---------------------------------------------------------------------------
# 3. del, set and dict comprehensions, starred targets, *args and **kwargs in compiled calls
# ---------------------------------------------------------------------------

def del_then_read(x, again):
    y = x * 2
    z = y + 1
    del y
    if again:
        y = x
    return z + y


def del_unbound(flag):
    if flag:
        v = 1
    del v
    return flag


def del_in_loop(xs):
    last = None
    for x in xs:
        last = x
        if x > 1:
            del last
    return last


def del_items_and_attributes(xs, d):
    del xs[0], d["a"]
    del xs[-1:]
    box = Box(1)
    box.extra = 2
    del box.extra
    return xs, d, hasattr(box, "extra")


def del_missing_key(d):
    del d["missing"]
    return d


class Box:
    def __init__(self, v):
        self.v = v


def set_and_dict_comprehensions(xs):
    squares = {x * x for x in xs if x != 0}
    index = {x: i for i, x in enumerate(xs)}
    nested = {(i, j): i * j for i in range(len(xs)) for j in range(i)}
    return sorted(squares), index, nested


def comprehension_names_do_not_leak(xs):
    x = "outer"
    s = {x for x in xs}
    d = {x: x for x in xs}
    return x, len(s), len(d)


def dict_comprehension_of_tensors(x):
    parts = {k: x * k for k in range(3)}
    return parts[2] + parts[1]


def starred_targets(xs):
    a, *rest = xs
    *init, z = xs
    p, *mid, q = xs
    [u, *v] = xs
    return a, rest, init, z, p, mid, q, u, v


def starred_too_short(xs):
    a, b, *rest = xs
    return a, b, rest


def starred_non_iterable(n):
    a, *rest = n
    return a


def starred_in_for(pairs):
    out = []
    for first, *others in pairs:
        out.append(first + sum(others))
    return out


def starred_tensor_rows(m):
    top, *others = m
    return top + others[-1], len(others)


def callee_abc(a, b, c=10, *more, d=100, **options):
    return a + b + c + sum(more) + d + sum(options.values())


def calls_compiled_unpacked(xs, kw):
    return callee_abc(*xs), callee_abc(*xs, **kw), callee_abc(1, *xs[1:], d=3), callee_abc(**{"a": 1, "b": 2})


def calls_compiled_unpacked_wrongly(xs):
    return callee_abc(*xs)


def recursive_unpacked(args):
    n, acc = args
    if n == 0:
        return acc
    return recursive_unpacked(*[(n - 1, acc + n)])


@pytest.mark.parametrize("fn,cases", [
    (del_then_read, [(POS, True), (POS, False)]),
    (del_unbound, [(True,), (False,)]),
    (del_in_loop, [([1, 0],), ([0, 2],), ([],)]),
    (del_items_and_attributes, [([1, 2, 3, 4], {"a": 1, "b": 2})]),
    (del_missing_key, [({"a": 1},)]),
    (set_and_dict_comprehensions, [([3, 0, -3, 2],), ([],)]),
    (comprehension_names_do_not_leak, [([1, 2, 2],)]),
    (dict_comprehension_of_tensors, [(POS,)]),
    (starred_targets, [([1, 2, 3, 4],), ((1, 2),), ("abc",)]),
    (starred_too_short, [([1],), ([1, 2],)]),
    (starred_non_iterable, [(5,)]),
    (starred_in_for, [([(1, 2, 3), (4,)],)]),
    (starred_tensor_rows, [(ROWS,)]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_del_comprehensions_and_starred_targets(fn, cases):
    check(fn, *cases)


def test_star_args_in_calls_of_compiled_functions():
    check(calls_compiled_unpacked, ([1, 2], {"d": 0, "e": 5}), ([1, 2, 3, 4], {"z": 1}), rec=("callee_abc",))
    check(calls_compiled_unpacked_wrongly, ([1],), ([],), rec=("callee_abc",))
    check(recursive_unpacked, ((3, 0),), rec=("recursive_unpacked",))


def starred_split(x):
    first, *rest = x.chunk(3, -1)
    return first + rest[0] * rest[1]


def del_after_use(x):
    y = x.sin()
    out = y * 2
    del y
    return out


def test_starred_and_del_batched_and_gradients():
    check_vmap(starred_split, (0,), torch.randn(4, 6, dtype=F64))
    check_vmap(starred_tensor_rows_first, (0,), torch.randn(4, 3, 2, dtype=F64))
    check_vmap(del_after_use, (0,), ROWS)
    check_grad(starred_split, torch.randn(6, dtype=F64))
    check_grad(del_after_use, POS)


def starred_tensor_rows_first(m):
    top, *others = m
    return top + others[-1]


# ---------------------------------------------------------------------------
# 4. lambda, nested def, closures, nonlocal, global, generator expressions
# ---------------------------------------------------------------------------

COUNTER = 0


def lambda_sort_key(pairs):
    return sorted(pairs, key=lambda t: t[0]), max(pairs, key=lambda t: (t[1], -t[0]))


def lambda_defaults_and_kwonly(x):
    scale = 3
    f = lambda v, k=scale * 2, *, m=1: v * k + m  # noqa: E731 - the construct under test
    scale = 100
    return f(x), f(x, 1), f(x, m=5), scale


def closures_bind_late(n):
    fs = []
    for i in range(n):
        fs.append(lambda: i * 10)
    gs = [lambda: j for j in range(n)]
    return [f() for f in fs], [g() for g in gs]


def closure_sees_later_assignment(x):
    def show():
        return label + str(x)

    label = "a"
    first = show()
    label = "b"
    return first, show()


def closure_reads_unbound(flag):
    def read():
        return value

    if flag:
        value = 1
    return read()


def nonlocal_counter(n):
    count = 0

    def bump(k=1):
        nonlocal count
        count += k
        return count

    for _ in range(n):
        bump()
    return bump(k=10), count


def nested_recursion(n):
    def fact(k):
        return 1 if k <= 1 else k * fact(k - 1)

    return fact(n)


def decorate_times_ten(fn):
    def wrapper(*args):
        return fn(*args) * 10

    return wrapper


def nested_decorated_with_annotations(x):
    @decorate_times_ten
    def add(y: int, z: float = x) -> float:
        return y + z

    def plain(a: list, *rest, b: "int" = 0, **kw) -> None:
        pass

    return add(1), add.__name__, plain.__annotations__, plain.__kwdefaults__, plain.__qualname__


def nested_raises(x):
    def check(v):
        if v < 0:
            raise ValueError(f"negative: {v}")
        return v

    return check(x)


def global_statement(v):
    global COUNTER
    COUNTER += v
    before = COUNTER
    del COUNTER
    try_again = "COUNTER" in globals()
    COUNTER = before * 2
    return before, try_again, COUNTER


def global_deleted_twice():
    global COUNTER
    del COUNTER
    del COUNTER


def make_nonlocal_user():
    total = [0]
    step = 1

    def add(v):
        nonlocal step
        step = step + v
        total[0] += step
        return step, total[0]

    return add


def make_nonlocal_reader():
    z = 1

    def set_and_read(v):
        nonlocal z
        z = v
        read = lambda: z  # noqa: E731 - a nested scope reading the enclosing function's variable
        return read(), [read][0]()

    return set_and_read


def generator_expressions(xs):
    return (sum(x * x for x in xs), any(x > 2 for x in xs), tuple(x for x in xs if x % 2),
            sorted((x for x in xs), reverse=True), sum(x * y for x in xs for y in xs if x < y))


def generator_is_lazy(xs):
    seen = []

    def note(v):
        seen.append(v)
        return v

    found = any(note(x) > 1 for x in xs)
    first = next(i for i in itertools.count() if i * i > 10)
    gen = (note(x) for x in xs)
    before = list(seen)
    next(gen)
    return found, first, before, seen


def generator_first_iterable_is_read_at_once(n):
    return (x for x in n)


def generator_variables_do_not_leak(xs):
    x = "outer"
    total = sum(x for x in xs)
    return x, total


class Scaler:
    def __init__(self, k):
        self.k = k

    def helper(self, v):
        return v * self.k

    def scaled_sorted(self, xs):
        return sorted(xs, key=lambda t: -self.helper(t)), [self.helper(t) for t in xs]


def scaled_sorted(xs):
    return Scaler(2).scaled_sorted(xs)


@pytest.mark.parametrize("fn,cases", [
    (lambda_sort_key, [([(2, "a"), (1, "b"), (3, "a")],)]),
    (lambda_defaults_and_kwonly, [(2,)]),
    (closures_bind_late, [(3,), (0,)]),
    (closure_sees_later_assignment, [(1,)]),
    (closure_reads_unbound, [(True,), (False,)]),
    (nonlocal_counter, [(3,)]),
    (nested_recursion, [(5,)]),
    (nested_decorated_with_annotations, [(2.5,)]),
    (nested_raises, [(1,), (-1,)]),
    (generator_expressions, [([1, 2, 3, 4],), ([],)]),
    (generator_is_lazy, [([0, 5, 1],)]),
    (generator_first_iterable_is_read_at_once, [(3,)]),
    (generator_variables_do_not_leak, [([1, 2],)]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_nested_scopes(fn, cases):
    check(fn, *cases)


def test_nested_scopes_in_a_method():
    for mode in MODES:
        scaler = Scaler(3)
        compiled = recompile.function(mode=mode)(Scaler.scaled_sorted)
        assert compiled(scaler, [1, 3, 2]) == Scaler.scaled_sorted(scaler, [1, 3, 2])


def test_global_and_nonlocal_statements():
    global COUNTER
    for mode in MODES:
        COUNTER = 1
        want = outcome(global_statement, (2,))
        COUNTER = 1
        assert_outcome(outcome(recompile.function(mode=mode)(global_statement), (2,)), want)
        want = outcome(global_deleted_twice, ())
        COUNTER = 1
        assert_outcome(outcome(recompile.function(mode=mode)(global_deleted_twice), ()), want)
        # a compiled function that is itself a closure writes its enclosing function's variable
        plain = make_nonlocal_user()
        compiled = recompile.function(mode=mode)(make_nonlocal_user())
        assert [compiled(2), compiled(3)] == [plain(2), plain(3)]
        # its nested scope reads that variable through the enclosing function's cell
        plain = make_nonlocal_reader()
        compiled = recompile.function(mode=mode)(make_nonlocal_reader())
        assert [compiled(2), compiled(5)] == [plain(2), plain(5)]
    COUNTER = 0


def closure_of_a_tensor(x):
    s = x * 2
    g = lambda t: t * s  # noqa: E731
    return g(x)


def nonlocal_accumulates(x):
    acc = x

    def times(t):
        nonlocal acc
        acc = acc * t

    times(x)
    times(x.sin())
    return acc


def generator_sum(x):
    hs = [x * 2, x.sin()]
    return sum(h * h for h in hs)


def lambda_of_a_parameter(x):
    g = lambda t: t * x  # noqa: E731
    return g(x) + x


def test_nested_scopes_batched_and_gradients():
    # a nested function runs once per instance in a batched run, and says so
    for fn in (closure_of_a_tensor, nonlocal_accumulates, lambda_of_a_parameter):
        with pytest.warns(recompile.PerInstanceWarning, match="nested function, lambda or generator"):
            check_vmap(fn, (0,), ROWS, per_instance=True)
        check_grad(fn, T(1.5, -0.5))
    # a generator that sum consumes whole is its list comprehension: batched
    check_vmap(generator_sum, (0,), ROWS)
    check_grad(generator_sum, T(1.5, -0.5))


# ---------------------------------------------------------------------------
# 5. with, try, match: run as the Python they are (a nested function sharing the function's variables)
# ---------------------------------------------------------------------------

class Recorder:
    """A context manager that logs its enters and exits into ``log`` and suppresses what it is told to."""

    def __init__(self, log, name, suppress=()):
        self.log, self.name, self.suppress = log, name, suppress

    def __enter__(self):
        self.log.append(("enter", self.name))
        return self.name.upper()

    def __exit__(self, kind, exc, tb):
        self.log.append(("exit", self.name, kind.__name__ if kind else None))
        return kind is not None and issubclass(kind, self.suppress)


def with_every_way_out(n):
    log = []
    out = []
    for i in range(n):
        with Recorder(log, f"m{i}") as name:
            if i == 1:
                continue
            if i == 3:
                break
            out.append(name)
    with Recorder(log, "a") as a, Recorder(log, "b", suppress=(KeyError,)) as b:
        {}["missing"]
    with Recorder(log, "ret"):
        if n > 2:
            return log, out, a + b
        total = len(out)
    return log, out, total


def with_exception_propagates(x):
    log = []
    with Recorder(log, "outer"):
        with Recorder(log, "inner", suppress=(ZeroDivisionError,)):
            x = x / 0
        log.append("after inner")
        raise ValueError(f"bad {x}")


def with_binds_for_later(pairs):
    with Recorder([], "m") as (first, *rest):
        total = len(rest)
        del pairs[0]
    return first, rest, total, pairs


def with_grad_modes(x):
    with torch.no_grad():
        y = x * 2
    with torch.enable_grad():
        z = x * 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = (x.unsqueeze(0) @ x.unsqueeze(1)).dtype
    return y, y.requires_grad, z, w


def try_except_else_finally(xs, i):
    log = []
    try:
        v = xs[i]
    except IndexError as e:
        log.append(f"index: {e}")
        v = -1
    except (KeyError, TypeError):
        log.append("key or type")
        v = -2
    else:
        log.append("else")
    finally:
        log.append("finally")
    try:
        e  # noqa: B018 - unbound after its except clause, as in Python
        bound = True
    except NameError:
        bound = False
    return v, log, bound


def try_returns(x):
    try:
        if x > 0:
            return "try"
        raise ValueError(x)
    except ValueError:
        return "except"
    finally:
        if x > 5:
            return "finally"


def try_in_loop(xs):
    out = []
    for x in xs:
        try:
            if x == 0:
                continue
            if x < 0:
                break
            out.append(10 // x)
        finally:
            out.append("f")
    return out


def try_raise_from(x):
    try:
        return {"a": 1}[x]
    except KeyError as err:
        raise ValueError(f"no {x}") from err


def try_reraise(x):
    try:
        return 1 / x
    except ZeroDivisionError:
        x = "handled"
        raise


def try_catches_a_compiled_call(n):
    try:
        return countdown_fails(n)
    except RuntimeError as e:
        return f"caught {e}"


def countdown_fails(n):
    if n == 0:
        raise RuntimeError("bottom")
    return countdown_fails(n - 1) + 1


def try_star(x):
    try:
        raise ExceptionGroup("group", [ValueError(x), TypeError(x)])
    except* ValueError as eg:
        got = [str(e) for e in eg.exceptions]
    except* TypeError:
        got2 = "type"
    return got, got2


def matching(v):
    match v:
        case 0 | 1:
            return "small"
        case [x, *rest] if x > 0:
            return ("seq", x, rest)
        case {"k": k, **others}:
            return ("map", k, others)
        case Recorder(name="m") as r:
            return ("recorder", r.name)
        case str() as s:
            kind = f"text {s}"
        case _:
            kind = "other"
    return kind, v


@pytest.mark.parametrize("fn,cases", [
    (with_every_way_out, [(5,), (2,)]),
    (with_exception_propagates, [(1.0,)]),
    (with_binds_for_later, [([1, 2],)]),
    (try_except_else_finally, [([1, 2], 0), ([1, 2], 5), ({"a": 1}, "b"), ({"a": 1}, "a")]),
    (try_returns, [(1,), (-1,), (9,)]),
    (try_in_loop, [([1, 0, 2, -1, 3],)]),
    (try_raise_from, [("a",), ("b",)]),
    (try_reraise, [(2,), (0,)]),
    (try_star, [(1,)]),
    (matching, [(1,), ([3, 4, 5],), ([-3],), ({"k": 1, "j": 2},), (Recorder([], "m"),), ("s",), (2.5,)]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_with_try_match(fn, cases):
    check(fn, *cases)


def test_with_try_match_details():
    check(with_grad_modes, (T(1.0, 2.0),))
    check(try_catches_a_compiled_call, (3,), rec=("countdown_fails",))
    for mode in MODES:  # the cause of ``raise ... from ...`` is kept, and a bare raise re-raises the same
        with pytest.raises(ValueError) as info:
            recompile.function(mode=mode)(try_raise_from)("b")
        assert type(info.value.__cause__) is KeyError


def with_no_grad_part(x):
    with torch.no_grad():
        scale = x.sum()
    return x * scale


def try_per_instance(x):
    try:
        y = x.sqrt() if x.sum() > 0 else x.log()
        if y.isnan().any():
            raise ValueError("nan")
    except ValueError:
        y = x * 0
    return y


def test_with_try_batched_and_gradients():
    for fn in (with_no_grad_part, try_per_instance):
        with pytest.warns(recompile.PerInstanceWarning, match="with, try, match, class or import statement"):
            check_vmap(fn, (0,), ROWS, per_instance=True)
        check_grad(fn, T(1.5, 0.5))


class Described:
    def describe(self):
        return "described"


class Private(Described):
    def __init__(self):
        self.__k = 3

    def run(self, xs):
        __scale = 2
        try:
            out = sorted(xs, key=lambda t: -t * self.__k * __scale)
        finally:
            __scale = 5
        with Recorder([], "m"):
            name = super().describe()
        return out, __scale, name


def test_private_names_and_super_in_nested_scopes_of_a_method():
    for mode in MODES:
        assert recompile.function(mode=mode)(Private.run)(Private(), [1, 3, 2]) == Private().run([1, 3, 2])


def class_and_import(x):
    import math
    from collections import OrderedDict as OD

    class Point:
        scale = x

        def norm(self):
            return math.sqrt(self.scale)

    with Recorder([], "m"):
        def inside():
            return 1

    return Point().norm(), type(OD()).__name__, Point.__qualname__, Point.norm.__qualname__, inside.__qualname__


def compiled_identity(v):
    return v


def cell_read_between_compiled_calls(n):
    count = n

    def bump():
        nonlocal count
        count += 1

    a = compiled_identity(count)
    bump()
    b = compiled_identity(count)
    return a, b


def test_class_and_import_statements_and_cells_between_compiled_calls():
    check(class_and_import, (4.0,))
    check(cell_read_between_compiled_calls, (0,), rec=("compiled_identity",))


def imports_every_form(x):
    import os.path
    import os.path as osp
    import collections.abc as cabc
    from os import path as p, sep
    from importlib import util  # (a submodule, found among the package's attributes or imported)
    return (os.path.basename("a/b"), osp is os.path, p is os.path, sep, cabc.Mapping.__name__,
            util.__name__, x * 2)


def imports_a_missing_name(x):
    from math import no_such_name  # noqa: F401
    return x


def imports_a_missing_module(x):
    import no_such_module_of_recompiles  # noqa: F401
    return x


def imports_relatively(x):
    from . import anything  # noqa: F401 - tests/ is no package: Python's ImportError
    return x


def imports_in_one_branch(x, k):
    if k > 0:
        import math as m
    else:
        m = None
    return x * (m.pi if m is not None else 1.0)


def test_import_statements_bind_what_python_binds_and_raise_its_errors():
    check(imports_every_form, (3,))
    check(imports_a_missing_name, (1,))
    check(imports_a_missing_module, (1,))
    check(imports_relatively, (1,))
    check(imports_in_one_branch, (2.0, 1), (2.0, 0))


def scaled_by_an_imported_constant(x):
    import math
    from torch.nn import functional as fn
    return fn.relu(x) * math.sqrt(2.0)


def test_an_import_statement_runs_once_for_a_batch():
    # (it reads nothing of an instance's: the module and its names are shared, as a global's read is)
    check_vmap(scaled_by_an_imported_constant, (0,), torch.randn(5, 3, dtype=torch.float64))


def test_instances_dump_marks_a_statement_run_as_python_per_instance():
    text = recompile.function(with_no_grad_part).dump(instances=())
    (cell,) = [line for line in text.splitlines() if "new_cell()" in line]
    (call,) = [line for line in text.splitlines() if "call %<with>()" in line]
    assert "[batched]" in cell  # (each instance's own cell, made without a warning)
    assert "[per instance: it is a nested function" in call


# ---------------------------------------------------------------------------
# frame readers: locals(), vars(), dir(), eval and exec without namespaces


def reads_its_locals(x, k):
    y = x * 2
    if k > 0:
        z = y + 1  # noqa: F841 - bound on one path: locals() lists it only there
    return locals()


def reads_vars_and_dir(x):
    h = x + 1  # noqa: F841
    return vars()["h"] * 2, dir()


def evaluates(x, k):
    y = x * k
    return eval("y.sum() + x.sum() * k")


def executes(x):
    out = {}
    exec("out['v'] = x * 3")
    return out["v"]


def reads_a_cell(x):
    h = x + 1

    def inner():
        return h * 2
    return locals()["h"] + inner()


@pytest.mark.filterwarnings("ignore::recompile.GradFallbackWarning")
@pytest.mark.parametrize("fn, cases", [(reads_its_locals, [(T(1.0, 2.0), 1), (T(1.0, 2.0), 0)]),
                                       (reads_vars_and_dir, [(T(1.0, 2.0),)]),
                                       (evaluates, [(T(1.0, 2.0), 3)]), (executes, [(T(1.0, 2.0),)]),
                                       (reads_a_cell, [(T(1.0, 2.0),)])],
                         ids=lambda v: getattr(v, "__name__", "cases"))
def test_frame_readers_see_the_functions_own_variables(fn, cases):
    """locals(), vars() and dir() list the variables bound on the path taken, in Python's order; eval and exec
    without namespaces read them and the function's globals."""
    check(fn, *cases)


@pytest.mark.filterwarnings("ignore::recompile.GradFallbackWarning")
def test_frame_readers_gradients():
    check_grad(evaluates, T(1.0, -2.0), 3)


# ---------------------------------------------------------------------------
# 5. for over enumerate(...): an index loop over the sequence itself
# ---------------------------------------------------------------------------

def enumerated_rows(xs):
    total = xs[0] * 0.0
    for i, x in enumerate(xs):
        total = total + x * (i + 1)
    return total, i


def enumerated_from_a_start(xs):
    out = []
    for i, x in enumerate(xs, 3):
        if i == 5:
            break
        out.append((i, x))
    else:
        out.append("no break")
    return out, i


def enumerated_from_a_start_of_a_name(xs, k):
    return [(i, x) for i, x in enumerate(xs, k)], [i for i, _ in enumerate(xs, start=-1)]


def enumerated_generator(n):
    seen = []
    for i, sq in enumerate(x * x for x in range(n)):
        seen.append(i + sq)
    return seen


def enumerated_nothing(xs):
    for i, x in enumerate(xs):
        pass
    return i


def enumerated_one_name(xs):
    pairs = []
    for pair in enumerate(xs):
        pairs.append(pair)
    return pairs


def zipped(xs, ys):
    out = []
    for x, y in zip(xs, ys):
        out.append((x, y))
    return out


def zipped_draws_in_turn(n, m):
    drawn = []

    def gen(tag, k):
        for i in range(k):
            drawn.append((tag, i))
            yield i

    pairs = [p for p in zip(gen("a", n), gen("b", m))]
    for a, (b, c) in zip(gen("x", n), zip(gen("y", m), gen("z", 2))):
        pairs.append(a + b + c)
    return pairs, drawn


def zipped_and_enumerated(xs, ys):
    out = []
    for i, (x, y) in enumerate(zip(xs, ys), 1):
        out.append(i * x + y)
    for (i, x), y in zip(enumerate(xs), ys):
        out.append(i - x * y)
    for (x,) in zip(xs):
        out.append(x)
    return out, i


def comprehended(xs, d):
    return [i * x for i, x in enumerate(xs)], {k: v for k, v in zip(d, xs)}, [p for p in enumerate(d, 1)], \
        [(i, c) for i, c in enumerate(x * 2 for x in xs) if c > 2], {(a, b) for a, b in zip(xs, reversed(xs))}


def shadowed_by_an_outer_comprehension(xs, fs):
    return [[a for i, a in enumerate(xs)] for enumerate in fs], [[p for p in zip(xs)] for zip in fs], \
        [sum(a for a in xs) for sum in [len]]


def zipped_unpacked_wrongly(xs):
    for a, b in zip(xs, xs, xs):
        pass


def enumerated_rows_total(xs):
    return enumerated_rows(xs)[0]


def test_for_over_enumerate_runs_as_python_does():
    for fn, cases in [(enumerated_from_a_start, [([1, 2, 3, 4],), ([7],)]),
                      (enumerated_from_a_start_of_a_name, [([1, 2], 4), ("ab", -2)]),
                      (enumerated_generator, [(4,), (0,)]), (enumerated_nothing, [([],), ([5, 6],)]),
                      (enumerated_one_name, [("xyz",)]), (enumerated_rows, [(ROWS,)]),
                      (zipped, [([1, 2, 3], "ab"), ([], [1]), (ROWS, ROWS)]), (zipped_draws_in_turn, [(3, 2), (2, 3)]),
                      (zipped_and_enumerated, [([1, 2, 3], [4, 5])]), (zipped_unpacked_wrongly, [([1, 2],)]),
                      (comprehended, [([1, 2, 3], {"a": 1, "b": 2}), ([], {}), ("xy", "abc")]),
                      (shadowed_by_an_outer_comprehension, [([1, 2, 3], [lambda v: zip(v, v), reversed])])]:
        check(fn, *cases)


def test_for_over_enumerate_batches():
    xs = torch.randn(4, 3, 2, dtype=F64)
    check_vmap(enumerated_rows_total, (0,), xs, rec=("enumerated_rows",))
    check_grad(enumerated_rows_total, xs[0].clone().requires_grad_())


def test_an_enumerate_the_function_binds_is_called_as_written():
    def local_enumerate(xs):
        enumerate = reversed
        return [x for x in enumerate(xs)], [i for i in enumerate(xs)]

    def closure_enumerate(xs):
        return [p for p in enumerate(xs)]

    def outer():
        enumerate = lambda xs: zip(xs, xs)  # noqa: E731
        def inner(xs):
            out = []
            for a, b in enumerate(xs):
                out.append(a * b)
            return out
        return inner

    check(local_enumerate, ([1, 2, 3],))
    check(closure_enumerate, ("ab",))
    check(outer(), ([1, 2, 3],))
    # (a module whose globals bind enumerate: its loops call that one)
    shadowed = types.FunctionType(closure_enumerate.__code__, {**G, "enumerate": lambda xs: zip(xs, xs)})
    check(shadowed, ("ab",))
    assert shadowed("ab") == [("a", "a"), ("b", "b")]


def imported_enumerate(xs):
    from builtins import reversed as enumerate
    return [p for p in enumerate(xs)], [q for q in [1]]


def enumerate_rebound_later(xs):
    out = []
    for p in enumerate(xs):
        out.append(p)
    return out


def test_an_enumerate_imported_or_rebound_after_compiling():
    check(imported_enumerate, ("ab",))
    f = recompile.function(enumerate_rebound_later, mode="sequential")
    assert f("ab") == [(0, "a"), (1, "b")]
    G["enumerate"] = lambda v: zip(v, v)  # (a module's own, bound after the function was compiled)
    try:
        with pytest.raises(RuntimeError, match="compiled as Python's builtin enumerate"):
            f("ab")
    finally:
        del G["enumerate"]


# ---------------------------------------------------------------------------
# 6. for over reversed(range(...)): a counter counting down
# ---------------------------------------------------------------------------

def counted_down(n):
    out = []
    for t in reversed(range(n)):
        out.append(t * t)
    return out, t


def counted_down_between(a, b):
    out = []
    for t in reversed(range(a, b)):
        if t == 5:
            break
        out.append(t)
        t = -100  # (the next item is not the changed name's: the counter stays the loop's)
    else:
        out.append("done")
    return out


def counted_down_nothing(n):
    out = [t for t in reversed(range(n))]
    for t in reversed(range(n)):
        out.append(t)
    return out


def counted_down_from_a_tensor(n):
    total = 0.0
    for t in reversed(range(n)):
        total = total * 0.5 + t  # (t a Python int, as range gives it)
    return total, type(t).__name__


def counted_down_unpacked_wrongly(n):
    for a, b in reversed(range(n)):
        pass


def test_for_over_reversed_range_runs_as_python_does():
    for fn, cases in [(counted_down, [(4,), (1,)]), (counted_down_between, [(2, 9), (-3, 2), (4, 4), (7, 3)]),
                      (counted_down_nothing, [(0,), (3,), (-2,)]),
                      (counted_down_from_a_tensor, [(torch.tensor(3),), (2.5,), (torch.tensor(2.0),)]),
                      (counted_down_unpacked_wrongly, [(2,)])]:
        check(fn, *cases)


def reversed_rows_total(xs, n):
    h = torch.zeros(xs.shape[1], dtype=xs.dtype)
    for t in reversed(range(n)):
        h = torch.tanh(xs[t] + 0.5 * h)
    return h


def test_for_over_reversed_range_batches():
    xs = torch.randn(4, 5, 3, dtype=F64)
    check_vmap(reversed_rows_total, (0, 0), xs, torch.tensor([5, 2, 3, 1]))
    check_grad(reversed_rows_total, xs[0].clone().requires_grad_(), 4)


def reversed_rebound_later(n):
    out = []
    for t in reversed(range(n)):
        out.append(t)
    return out


def test_a_reversed_or_range_rebound_after_compiling():
    f = recompile.function(reversed_rebound_later, mode="sequential")
    assert f(3) == [2, 1, 0]
    for ident, value in (("reversed", lambda r: r), ("range", lambda k: [k])):
        G[ident] = value  # (a module's own, bound after the function was compiled)
        try:
            with pytest.raises(RuntimeError, match=f"compiled as Python's builtin {ident}"):
                f(3)
        finally:
            del G[ident]


def reversed_list_growing(x):
    hs = [x, x * 2, x * 3]
    out = x * 0
    for h in reversed(hs):  # (a reverse iterator never reaches what the loop appends)
        out = out * 2 + h
        hs.append(h * 10)
    return out, len(hs)


def reversed_list_shrinking(x):
    hs = [x, x * 2, x * 3, x * 4]
    out = x * 0
    for h in reversed(hs):  # (it stops where its next index lies past the list's end)
        out = out * 2 + h
        hs.pop()
        if len(hs) > 2:
            hs.pop()
    return out, len(hs)


def reversed_list_set(x):
    hs = [x, x * 2, x * 3]
    out = x * 0
    for i, h in enumerate(reversed(hs)):  # (an item set ahead of the loop is the one it reads)
        out = out * 2 + h
        hs[0] = x * 7
    return out, i


def reversed_sequences(x):
    out = x
    for k in reversed((1.0, 2.0)):
        out = out * k + 1
    for c in reversed("ab"):
        out = out + (1 if c == "a" else 2)
    for j in reversed(range(1, 6, 2)):
        out = out * j
    for k in reversed({"a": 1.0, "b": 2.0}):
        out = out + len(k)
    for a, b in zip(reversed([x, x * 2, x * 3]), [1.0, 2.0]):
        out = out * 3 + a * b
    return out


def reversed_not_a_sequence(x, kind):
    for k in reversed({1, 2} if kind == 0 else iter([1, 2]) if kind == 1 else x.sum()):
        x = x * k
    return x


def reversed_else(x):
    for h in reversed([x, x + 1]):
        if h.sum() > 100:
            break
    else:
        h = h * 5
    return h, type(reversed).__name__


def test_for_over_reversed_of_a_sequence_runs_as_python_does():
    x = T(1.0, -2.0)
    for fn in (reversed_list_growing, reversed_list_shrinking, reversed_list_set, reversed_sequences,
               reversed_else):
        check(fn, (x,))
    check(reversed_not_a_sequence, (x, 0), (x, 1), (x, 2))


def reversed_own_states(xs, n):
    hs = [torch.tanh(xs[t]) for t in range(n)]
    out = torch.zeros_like(xs[0])
    for h in reversed(hs):  # (each instance's own list, of its own length)
        out = torch.sin(out + h)
    for t in range(len(hs) - 1, -1, -1):  # (and read by each instance's own index)
        out = torch.cos(out * hs[t] + hs[t - 1])
    return out


def reversed_display(xs, n):
    out = xs[0] * 0
    for a, w in zip(reversed([xs[0], xs[1] * 2, xs[2]]), [1.0, 2.0, 3.0]):
        out = torch.tanh(out + a * w)
    return out


def reversed_own_list_inserted_in_front(xs, n):
    hs = [xs[t] for t in range(n)]
    out = xs[0] * 0
    for h in reversed(hs):  # (the reverse iterator reads what the insert shifted: each instance its own list)
        out = out * 3 + h
        hs.insert(0, xs[0] * 10)
    return out


def test_for_over_reversed_of_a_list_batches():
    xs = torch.randn(4, 5, 3, dtype=F64)
    for fn in (reversed_own_states, reversed_display):
        check_vmap(fn, (0, 0), xs, torch.tensor([5, 2, 3, 1]))
        check_grad(fn, xs[0].clone().requires_grad_(), 4)
    check_vmap(reversed_own_list_inserted_in_front, (0, 0), xs, torch.tensor([5, 2, 3, 1]), per_instance=True)


def powers_by_the_builtin(x, k):
    return pow(x, 2) + pow(2.0, x) + pow(x, k) * x.sum()  # (``pow(a, b)`` is ``a ** b``, its gradient too)


def test_the_builtin_pow_has_eagers_gradient_in_every_mode():
    check_grad(powers_by_the_builtin, T(0.5, -1.5, 2.0), 3)
    check_vmap(powers_by_the_builtin, (0, None), T([0.5, -1.5], [2.0, 0.25]), 3)


def losses_listed(xs, n):
    losses = []
    for t in range(n):
        if t % 2 == 0:
            losses.extend([xs[t] * 2.0, xs[t].sin()])
        else:
            losses.append(xs[t].cos())
    return sum(losses)


def test_lists_extended_in_a_loop_and_summed_batch():
    """Each instance's list of its own length (instances leave the loop at different steps), extended and
    appended to, then ``sum``: no op once per instance."""
    xs = torch.randn(4, 5, 3, dtype=F64)
    check_vmap(losses_listed, (0, 0), xs, torch.tensor([5, 2, 3, 1]))
    check_grad(losses_listed, xs[0].clone().requires_grad_(), 4)


# ---------------------------------------------------------------------------
# 7. a generator a builtin consumes whole: its list comprehension
# ---------------------------------------------------------------------------

def generators_consumed(xs, k):
    pairs = sum(x * y for x in xs for y in xs if x < y)
    nested = sum(sum(x for x in xs[:j]) for j in range(k))
    return (pairs, nested, sum((x for x in xs), 10), min(x for x in xs if x > 0), max((x for x in xs), default=-1),
            sorted((x for x in xs), key=lambda v: -v), tuple(2 * x for x in xs), list(x for x in xs if x % 2),
            set(x % 3 for x in xs), frozenset(x for x in xs), sum(v for v in (x for x in xs)))


def generators_still_lazy(xs):
    seen = []
    found = any(seen.append(x) or x > 1 for x in xs)
    return found, seen, all(x < 2 for x in xs), (lambda v: sum(y for y in v))(xs)


def generator_raising_midway(xs):
    return sum(10 // x for x in xs)


def test_a_generator_consumed_whole_is_a_list_comprehension():
    check(generators_consumed, ([3, 1, 4, 1, 5], 3), ([2], 0))
    check(generators_still_lazy, ([0, 5, 1],), ([],))
    check(generator_raising_midway, ([1, 2, 0, 5],), ([5, 2],))
    assert "genexpr" not in recompile.function(generator_sum).dump()


def stepped_states_summed(xs, n):
    hs = []
    h = torch.zeros(xs.shape[1], dtype=xs.dtype)
    for t in range(n):
        h = torch.tanh(xs[t] + 0.5 * h)
        hs.append(h)
    return sum(h * h for h in hs) + sum(h.sum() for h in hs) + torch.stack(tuple(h.sin() for h in hs)).sum(0)


def test_a_generator_consumed_whole_batches():
    xs = torch.randn(4, 5, 3, dtype=F64)
    check_vmap(stepped_states_summed, (0, 0), xs, torch.tensor([5, 2, 3, 1]))
    check_grad(stepped_states_summed, xs[0].clone().requires_grad_(), 4)


def decided_by_a_generator(xs):
    seen = []
    first = any(seen.append(x) or 10 // x > 3 for x in xs)  # (stops before a later 0 divides)
    every = all(seen.append(-x) or x != 0 for x in xs if x % 2 == 0)
    last = any((y := x) > 2 for x in xs)  # (a walrus binds in the function: the last item tested)
    return first, every, seen, y, any(x for x in xs), all(x for x in xs), any(x for x in []), all(x for x in [])


def decided_shadowed(xs):
    any = sum  # noqa: F841 - a local that is not the builtin: no lowering
    return any(x for x in xs)


def decided_in_python_blocks(xs):
    with torch.no_grad():  # (the with statement runs as Python, and the generator in it stays one)
        inside = any(x > 1 for x in xs)
    return inside, any(x > a for x in xs for a in xs)  # (two fors stay a generator)


def decided_by_next(xs):  # (a StopIteration in a generator's item is its RuntimeError, PEP 479: not lowered)
    it = iter(xs[:1])
    return any(next(it) > 5 for x in xs)


def summed_by_next(xs):
    it = iter(xs[:1])
    return sum(next(it) for x in xs)


def test_any_and_all_of_a_generator_stop_at_the_first_item_that_decides():
    check(decided_by_a_generator, ([1, 2, 3, 0, 4],), ([4, 0],), ([],), ([2, 4, 6],))
    check(decided_shadowed, ([1, 2],))
    check(decided_in_python_blocks, ([0, 2],), ([],))
    check(decided_by_next, ([1, 2],), ([7],), ([3, 4],))  # (a RuntimeError, True, a RuntimeError)
    check(summed_by_next, ([1, 2],), ([7],))
    dumped = recompile.function(decided_by_a_generator).dump()
    assert "genexpr" not in dumped and "call %any(" not in dumped and "call %all(" not in dumped


def children_tested(xs, n):
    h = torch.zeros(xs.shape[1], dtype=xs.dtype)
    hs = []
    for t in range(n):
        h = torch.tanh(xs[t] + 0.5 * h)
        if any(g.sum() > h.sum() for g in hs) and not all(g.sum() < 3.0 for g in hs):
            h = h * 2.0
        hs.append(h)
    return h


def test_any_and_all_of_a_generator_batch():
    xs = torch.randn(6, 5, 3, dtype=F64)
    check_vmap(children_tested, (0, 0), xs, torch.tensor([5, 2, 3, 1, 0, 4]))
    check_grad(children_tested, xs[0].clone().requires_grad_(), 5)


def decided_rebound_later(xs):
    return any(x for x in xs)


def test_a_deciding_builtin_rebound_after_compiling():
    f = recompile.function(decided_rebound_later, mode="sequential")
    assert f([0, 1]) is True
    G["any"] = lambda v: "own"
    try:
        with pytest.raises(RuntimeError, match="compiled as Python's builtin any"):
            f([1, 2])
    finally:
        del G["any"]


def summed_rebound_later(xs):
    return sum(x for x in xs)


def test_a_consuming_builtin_rebound_after_compiling():
    f = recompile.function(summed_rebound_later, mode="sequential")
    assert f([1, 2]) == 3
    G["sum"] = lambda v: "own"  # (a module's own, bound after the function was compiled)
    try:
        with pytest.raises(RuntimeError, match="compiled as Python's builtin sum"):
            f([1, 2])
    finally:
        del G["sum"]


# ---------------------------------------------------------------------------
# 8. a for over a display of a few items (or a range of a few) runs its body once per item (the items evaluated
# first, in order)
# ---------------------------------------------------------------------------

def over_a_display(x, log):
    for v in (log.append(1) or x, log.append(2) or x * 2):  # (both items first, then the body for each)
        log.append(v * 10)
    for a, (b, c) in [(1, (x, 2)), (3, (x, 4))]:
        log.append(a + b * c)
    total = 0
    for w in [x]:
        total = total + w
        w = w * 3  # (rebinding the target: the next item rebinds it again)
    return log, total, v, w, [u * 2 for u in (x, x + 1) if u is not None]


def over_a_display_jumping(x):
    for v in (x, x + 1, x + 2):
        if v > 2:
            break  # (a jump keeps the loop a loop)
    else:
        v = -1
    for k in (0, 1, 2, 3, 4, 5, 6, 7, 8):  # (more items than are unrolled)
        x = x + k
    return v, x


def over_a_small_range(x):
    out = []
    for k in range(3):
        out.append(x * k)
    for k in range(4, 0, -2):
        out.append(x - k)
    for k in range(0):
        out.append(k)
    for k in range(2, 5, 0):  # (a step of 0: Python's ValueError, at the loop)
        out.append(k)
    return out


def over_an_enumerated_display(x):
    out = []
    for k, v in enumerate((x, x * 2)):
        out.append(v * k)
    for k, v in enumerate([x, -x], -1):
        out.append(v + k)
    return out, [k * v for k, v in enumerate((x, x + 1), 5)]


def over_a_range_shadowed(x):
    range = lambda n: [x, x + 1]  # noqa: E731 - a name of the function's own, not the builtin
    return [v * 2 for v in range(2)]


def over_a_display_unpacked_wrongly(x):
    for a, b in (x, x):
        pass


def test_a_for_over_a_display_runs_its_body_once_per_item_as_python_does():
    check(over_a_display, (2, []), (T(1.0, -2.0), []))
    check(over_a_display_jumping, (1,), (2.5,), (5,))
    check(over_a_display_unpacked_wrongly, (3,), ((1, 2),))
    check(over_a_small_range, (2,), (T(1.0, 2.0),))
    ir = recompile.function(over_a_small_range).dump(stage="frontend")
    assert ir.count(" = while ") == 2  # (``range(3)``, ``range(4, 0, -2)``: their bodies; no items, a step of 0)
    check(over_an_enumerated_display, (2,), (T(1.0, 2.0),))
    assert " = while " not in recompile.function(over_an_enumerated_display).dump(stage="frontend")
    check(over_a_range_shadowed, (2,))


def children_summed(x, k):
    hs = []
    for h in (x * 2, x.sin()):
        hs.append(torch.tanh(h) + k)
    return sum([h * h for h in (hs[0], hs[1])])


def test_a_for_over_a_display_batches():
    xs = torch.randn(4, 3, dtype=F64)
    check_vmap(children_summed, (0, 0), xs, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64))
    check_grad(children_summed, xs[0].clone().requires_grad_(), torch.tensor(2.0, dtype=F64))
