"""Nested defs a compiled function only calls, compiled as functions of their own (``frontend.lifting``).

Each program is plain Python, compiled in every mode and compared with the plain function: values, gradients
(float64) and the exception Python raises. Which defs are lifted is checked too (``parsed.lifted``): a lifted
recursion runs as Invokes, batched by level under ``recompile.vmap`` with no op once per instance; a def that
breaks a rule stays the Python closure it is, and still gives Python's result.
"""

import warnings

import pytest
import torch
from torch import nn

import recompile
from recompile import config
from test_segments import switched

MODES = ["batched", "sequential", "threaded"]
W = torch.linspace(-1, 1, 16, dtype=torch.float64).reshape(4, 4)


def outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return type(exc), str(exc)


def check(fn, *cases, lifted=()):
    for mode in MODES:
        compiled = recompile.function(mode=mode)(fn)
        assert set(compiled.parsed.lifted) == set(lifted), mode
        for args in cases:
            want, got = outcome(fn, *args), outcome(compiled, *args)
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(got, want)
            else:
                assert got == want, (mode, args)


# -- what is lifted, and gives Python's values

def recursion_reading_the_enclosing_variables(x, n):
    scale = 2.0

    def step(y, k):
        if k == 0:
            return y
        return step(torch.tanh(y @ W) * scale + x, k - 1)

    return step(x, n)


def mutual_recursion(n):
    def even(k):
        return True if k == 0 else odd(k - 1)

    def odd(k):
        return False if k == 0 else even(k - 1)

    return even(n), odd(n)


def rebound_between_calls(x):
    def show(k):
        return x * k + bias

    bias = 1
    first = show(2)
    bias = 10
    return first, show(2), show(k=3)


def sibling_reads_what_the_caller_does_not(x):
    offset = x + 1

    def inner(k):
        return k + offset

    def outer(k):
        return inner(k) * 2

    return outer(x)


def defaults_and_keyword_only(x):
    def scaled(v, k=3, *, m=1):
        return v * k + m

    return scaled(x), scaled(x, 2), scaled(x, m=5)


def scopes_inside_the_lifted_def(xs):
    total = 10

    def ranked(k):  # (its lambda reads none of the enclosing variables; its generator is consumed at once)
        return sorted(xs, key=lambda v: abs(v - k)), sum(v + total for v in xs)

    return ranked(2)


def arguments_before_the_variables(k):
    x = 1

    def g(j):
        return x + j

    return g((x := 10)), g(g((x := 5))), g((v := 3)) + v


def bound_by_import_class_and_match(pair):
    import math

    class K:
        size = 2

    match pair:
        case [first, _]:
            pass

    def g():
        return math.pi, K.size, first

    return g()


def annotations_run_where_the_def_does(x):
    log = []

    def g(k: log.append(1), *, m: log.append(2) = 0) -> log.append(3):
        return k + x

    return g(1), log


def unbound_where_read(flag):
    def read():
        return value

    if flag:
        value = 1
    return read()


def unbound_where_not_read(flag):
    def read(k):
        return value if k else 0

    if flag:
        value = 1
    return read(flag)


@pytest.mark.parametrize("fn,cases,lifted", [
    (recursion_reading_the_enclosing_variables, [(torch.ones(4, dtype=torch.float64), 3)], ["step"]),
    (mutual_recursion, [(4,), (7,)], ["even", "odd"]),
    (rebound_between_calls, [(3,)], ["show"]),
    (sibling_reads_what_the_caller_does_not, [(2,)], ["inner", "outer"]),
    (defaults_and_keyword_only, [(2,)], ["scaled"]),
    (scopes_inside_the_lifted_def, [([1, 5, 2, 3],)], ["ranked"]),
    (arguments_before_the_variables, [(0,)], ["g"]),
    (bound_by_import_class_and_match, [([4, 5],)], ["g"]),
    (annotations_run_where_the_def_does, [(2,)], ["g"]),
    (unbound_where_read, [(True,), (False,)], ["read"]),
    (unbound_where_not_read, [(True,), (False,)], ["read"]),
], ids=lambda v: getattr(v, "__name__", ""))
def test_lifted_defs_give_pythons_results(fn, cases, lifted):
    check(fn, *cases, lifted=lifted)


# -- what stays Python, and still gives Python's values

def passed_as_a_value(xs):
    def key(v):
        return -v

    return sorted(xs, key=key), key(1)


def nonlocal_writer(n):
    count = 0

    def bump():
        nonlocal count
        count += 1
        return count

    for _ in range(n):
        bump()
    return count


def called_before_it_is_defined(flag):
    if flag:
        return early(1)  # noqa: F821 - Python's NameError is the outcome compared

    def early(k):
        return k

    return early(2)


def decorated(x):
    def twice(fn):
        return lambda v: fn(fn(v))

    @twice
    def inc(v):
        return v + 1

    return inc(x)


def generator_def(n):
    def upto(k):
        yield from range(k)

    return list(upto(n))


def shadowed_in_a_caller(x):
    offset = x

    def inner(k):
        return k + offset

    def outer(k):
        offset = 100  # (its own: the closure inner reads the enclosing one)
        return inner(k) + offset

    return outer(1)


def called_in_a_try(x):
    def half(v):
        return v / 2

    try:
        return half(x)
    except ZeroDivisionError:
        return 0


def closure_inside_the_lifted_def(xs):
    total = 10

    def ranked(k):
        return sorted(xs, key=lambda v: abs(v - k) + total)

    return ranked(2)


def a_closure_made_inside_outlives_the_call():
    x = 1

    def g():
        return lambda: x

    h = g()
    x = 2
    return h()


def another_scope_writes_nonlocal():
    count = 0

    def bump():
        nonlocal count
        count += 1

    def read(h):
        h()
        return count

    return read(bump)


def a_generator_walrus_writes_the_variable():
    y = 0
    gen = ((y := k) for k in range(3))

    def read(g):
        list(g)
        return y

    return read(gen)


def shadowed_by_a_comprehension():
    i = 100

    def g():
        return i

    return [g() for i in range(3)]


def undefined_annotation():
    def g(k: Undefined):  # noqa: F821 - Python's NameError is the outcome compared
        return k

    return g(1)


def keyword_arguments_collected(x):
    def g(**kw):
        return x, kw

    return g(x=7)


def a_wrong_call(x):
    def g(k):
        return x + k

    return g(1, 2)


def an_async_def_inside():
    def g():
        async def h():
            return 1

        return h.__name__

    return g()


class Base:
    def m(self):
        return "Base.m"


class Derived(Base):
    def m(self):
        def g():
            self
            return super().m()

        return g()


def zero_argument_super():
    return Derived().m()


def locals_in_a_with_block(x):
    import contextlib

    def g():
        return x

    with contextlib.nullcontext():
        names = sorted(locals())
    return names, g()


def test_a_frame_read_in_a_block_keeps_every_def_python():
    # (the block's locals() are compared nowhere here: inside a with block it lists the block's own names)
    assert recompile.function(locals_in_a_with_block).parsed.lifted == {}


@pytest.mark.parametrize("fn,cases,lifted", [
    (closure_inside_the_lifted_def, [([1, 5, 2, 3],)], []),
    (a_closure_made_inside_outlives_the_call, [()], []),
    (another_scope_writes_nonlocal, [()], []),
    (a_generator_walrus_writes_the_variable, [()], []),
    (shadowed_by_a_comprehension, [()], []),
    (undefined_annotation, [()], ["g"]),
    (keyword_arguments_collected, [(5,)], []),
    (a_wrong_call, [(5,)], []),
    (an_async_def_inside, [()], []),
    (zero_argument_super, [()], []),
    (passed_as_a_value, [([3, 1, 2],)], []),
    (nonlocal_writer, [(3,)], []),
    (called_before_it_is_defined, [(True,), (False,)], []),
    (decorated, [(1,)], []),
    (generator_def, [(3,)], []),
    (shadowed_in_a_caller, [(5,)], []),
    (called_in_a_try, [(4,)], []),
], ids=lambda v: getattr(v, "__name__", ""))
def test_defs_that_break_a_rule_stay_python(fn, cases, lifted):
    check(fn, *cases, lifted=lifted)


# -- a recursion in a method, batched

class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.__w = nn.Parameter(W.clone())  # (a private name: mangled in the lifted def as in the method)

    @recompile.function
    def forward(self, x, depth):
        def down(y, k):
            if k == 0:
                return y.sum()
            return down(torch.tanh(y @ self.__w) + x, k - 1) + y.mean()

        return down(x, depth)


def test_a_lifted_recursion_batches_with_its_gradients():
    model = Cell()
    xs = torch.linspace(-2, 2, 20, dtype=torch.float64).reshape(5, 4)
    depths = torch.tensor([0, 3, 1, 4, 2])
    Cell.forward.stats.reset()
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(model, in_dims=(0, 0))(xs, depths)
    got.sum().backward()
    grad = model._Cell__w.grad.clone()
    model.zero_grad()
    want = torch.stack([Cell.forward.python(model, x, int(d)) for x, d in zip(xs, depths)])  # (plain Python)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, model._Cell__w.grad)
    assert Cell.forward.stats.get("per_instance", {}) == {}
    lift = Cell.forward.parsed.lifted["down"]
    assert lift.params == ("self", "x") and lift.takes_receiver


def test_each_mode_gives_eagers_gradient_through_a_lifted_def():
    x = torch.linspace(-1, 1, 4, dtype=torch.float64)
    for mode in MODES:
        a = x.clone().requires_grad_()
        recompile.function(mode=mode)(recursion_reading_the_enclosing_variables)(a, 3).sum().backward()
        b = x.clone().requires_grad_()
        recursion_reading_the_enclosing_variables(b, 3).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)


def test_an_error_in_a_lifted_recursion_names_its_calls():
    def fails(n):
        def count(k):
            if k == 0:
                raise ValueError("bottom")
            return count(k - 1)

        return count(n)

    for mode in MODES:
        with pytest.raises(ValueError, match="bottom") as info:
            recompile.function(mode=mode)(fails)(3)
        assert "count" in "".join(str(n) for n in getattr(info.value, "__notes__", [])) + str(info.value), mode


def test_a_closure_that_reads_a_lifted_def_keeps_it_python():
    def uses(xs):
        def double(v):
            return 2 * v

        return [double(v) for v in xs], list(map(lambda v: double(v), xs))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(uses, ([1, 2],), lifted=[])
