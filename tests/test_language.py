"""Differential tests of the compiled language subset.

Every program below is an ordinary, *undecorated* Python function.  The tests
compile it with ``recompile.function`` and check that the compiled version
returns exactly what the plain function returns: same values, same Python
types (recursively through tuples / lists / dicts), the same exception type
when the plain function raises.

Nothing here decorates at import time, so the module collects even while the
compiler is incomplete; programs that call themselves (or each other) through a
module global get the compiled object installed under that global name while
the compiled side runs (``rec=...`` in the registry), which is exactly the
situation of a module-level ``@recompile.function`` def.

Layout
  1. helpers (assert_same, registry, compile_fn, installed)
  2. fixtures: tensors and small trees (plain Python lists, -1 = no child)
  3. programs, grouped by feature, each followed by ``register(...)``
  4. tests over the registry (differential, build counter, recovery after errors)
  5. hand-written tests: keyword args / wrong calls / options, globals and
     closures, nn.Module and class methods, deep recursion
  6. OPTIONAL features (f-strings, comprehensions, walrus, ...), kept apart so
     a failure there says "optional feature missing" and nothing more.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from torch import nn

import recompile  # only attributes are looked up inside tests (see module doc)
from bound_globals import bound_globals  # tests/ is on sys.path under pytest

THIS = sys.modules[__name__]
F64 = torch.float64

MODES = [None, "sequential"]
MODE_IDS = ["default", "sequential"]


# ---------------------------------------------------------------------------
# 1. helpers
# ---------------------------------------------------------------------------

def compile_fn(fn, mode=None):
    """``@recompile.function`` (mode None) or ``@recompile.function(mode=...)``."""
    if mode is None:
        return recompile.function(fn)
    return recompile.function(mode=mode)(fn)


def deco_for(mode):
    return lambda fn: compile_fn(fn, mode)


def identity(fn):
    return fn


def assert_same(got, want, approx=False, path="result"):
    """Equal values AND identical Python types, recursively.

    ``approx`` allows float64 round-off of a few ulps in floating tensors /
    floats; it is used only for programs whose float ops (matmul, tanh,
    sigmoid) may legitimately run batched across recursive calls.
    """
    assert type(got) is type(want), (
        f"{path}: compiled gave {type(got).__name__} {got!r}, plain gave {type(want).__name__} {want!r}")
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.device == want.device, f"{path}: device {got.device} != {want.device}"
        if approx and want.is_floating_point():
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"{path}: {got} != {want}"
        else:
            assert torch.equal(got, want), f"{path}: {got} != {want}"
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, approx, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], approx, f"{path}[{k!r}]")
    elif isinstance(want, float) and approx:
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: compiled gave {got!r}, plain gave {want!r}"


class Call:
    """One set of call arguments: ``Call(x, 3, scale=2.0)``."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs

    def copy(self):
        return copy.deepcopy(self.args), copy.deepcopy(self.kwargs)

    def __repr__(self):
        parts = [_short(a) for a in self.args] + [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return f"Call({', '.join(parts)})"


def _short(v):
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    r = repr(v)
    return r if len(r) < 30 else r[:27] + "..."


class Program:
    def __init__(self, fn, cases, approx, rec):
        self.fn = fn
        self.name = fn.__name__
        self.cases = [c if isinstance(c, Call) else Call(*c) for c in cases]
        self.approx = approx
        # global names that must refer to the compiled objects while the compiled side runs
        self.rec = tuple(dict.fromkeys((self.name,) + tuple(rec)))


PROGRAMS: dict[str, Program] = {}


def register(fn, *cases, approx=False, rec=(), registry=None):
    registry = PROGRAMS if registry is None else registry
    assert fn.__name__ not in registry, fn.__name__
    assert cases, fn.__name__
    registry[fn.__name__] = Program(fn, cases, approx, rec)


def installed(objs):
    """Temporarily bind this module's globals ``name -> obj`` (restored afterwards)."""
    return bound_globals(globals(), objs)


def compile_program(prog, mode):
    """Fresh compiled objects for ``prog.rec`` (plain functions taken from module globals)."""
    return {name: compile_fn(globals()[name], mode) for name in prog.rec}


def run_plain(prog, case):
    args, kwargs = case.copy()
    try:
        return prog.fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - we compare exception types
        return None, exc


def check_case(prog, compiled, case):
    """Run plain and compiled on ``case``; compare results or exception types."""
    want, want_exc = run_plain(prog, case)
    args, kwargs = case.copy()
    with installed(compiled):
        f = compiled[prog.name]
        if want_exc is None:
            got = f(*args, **kwargs)
        else:
            try:
                got = f(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                assert type(exc) is type(want_exc), (
                    f"plain raised {type(want_exc).__name__}({want_exc}), "
                    f"compiled raised {type(exc).__name__}({exc})")
                return want_exc
            pytest.fail(f"plain raised {type(want_exc).__name__}({want_exc}); compiled returned {got!r}")
    assert_same(got, want, prog.approx)
    return None


# ---------------------------------------------------------------------------
# 2. fixtures
# ---------------------------------------------------------------------------

torch.manual_seed(0)


def T(*vals):
    return torch.tensor(vals, dtype=F64)


X3 = torch.randn(3, dtype=F64)
POS = X3.abs() + 0.1           # positive sum
NEG = -POS                     # negative sum
MIX = T(1.0, -2.0, 0.5)        # sum -0.5, mixed signs
BIG = T(5.0, 6.0, 7.0)
V4 = torch.randn(4, dtype=F64)
M23 = torch.randn(2, 3, dtype=F64)
M43 = torch.randn(4, 3, dtype=F64)
M43P = M43.abs() + 0.05        # all rows positive
H0 = torch.zeros(3, dtype=F64)
C0 = torch.randn(3, dtype=F64)
SEQ = [torch.randn(3, dtype=F64) for _ in range(4)]

# Trees as parallel lists, -1 = no child.  Leaves have left == right == -1.
#        0                 0
#      1   2             1   2
#     3 4 5 6          3   4
#                     5 6
BAL = ([1, 3, 5, -1, -1, -1, -1], [2, 4, 6, -1, -1, -1, -1])
SKEW = ([1, 3, -1, 5, -1, -1, -1], [2, 4, -1, 6, -1, -1, -1])
LEAF = ([-1], [-1])
EMB7 = torch.randn(7, 3, dtype=F64)
EMB1 = torch.randn(1, 3, dtype=F64)
VALS7 = [3, -1, 4, 1, -5, 9, 2]


# ---------------------------------------------------------------------------
# 3. programs
# ---------------------------------------------------------------------------

# ----- 3a. conditionals ----------------------------------------------------

def if_tensor_pred(x):
    if x.sum() > 0:
        y = x * 2
    else:
        y = -x
    return y


register(if_tensor_pred, (POS,), (NEG,), (MIX,))


def if_elif_chain(n):
    if n < 0:
        r = -1
    elif n == 0:
        r = 0
    elif n < 10:
        r = 1
    else:
        r = 2
    return r


register(if_elif_chain, (-5,), (0,), (7,), (12,))


def if_without_else(x, n):
    y = x
    if n > 2:
        y = y + n
    if x.sum() > 0:
        y = y * 3
    return y


register(if_without_else, (POS, 1), (POS, 5), (NEG, 5), (NEG, 0))


def nested_if(x, n):
    if x.sum() > 0:
        if n > 0:
            out = x + n
        else:
            out = x - n
    else:
        if n > 0:
            out = x * n
        else:
            out = x / 2
    return out


register(nested_if, (POS, 2), (POS, -2), (NEG, 2), (NEG, -2))


def ternary_tensor(x):
    return x * 2 if x.sum() > 0 else x - 1


register(ternary_tensor, (POS,), (NEG,))


def ternary_int(n):
    return n // 2 if n % 2 == 0 else 3 * n + 1


register(ternary_int, (10,), (7,), (0,))


def ternary_nested(n):
    return -1 if n < 0 else (0 if n == 0 else 1)


register(ternary_nested, (-3,), (0,), (8,))


def if_bool_flag(flag, x):
    if flag:
        return x + 1
    return x - 1


register(if_bool_flag, (True, POS), (False, POS))


def truthiness_int_and_list(n, xs):
    a = 1 if n else 2
    b = 10 if xs else 20
    return a + b


register(truthiness_int_and_list, (0, []), (3, [1]), (0, [1, 2]), (-1, []))


def float_predicate(a, b):
    if a * 2.0 > b:
        return a - b
    return b / 2


register(float_predicate, (1.5, 2.0), (0.25, 3.0), (-1.0, -4.0))


def not_operator(n, x):
    return not n, not (x.sum() > 0), not not n


register(not_operator, (0, POS), (2, NEG))


def or_value(n):
    return n or 5


register(or_value, (0,), (3,), (-2,))


def and_value(n, m):
    return n and m


register(and_value, (0, 4), (2, 4), (3, 0))


def or_chain_value(a, b, c):
    return a or b or c


register(or_chain_value, (0, 0, 0), (0, 0, 7), (0, 2, 7), (1, 2, 3))


def and_or_mixed(a, b, c):
    return a and b or c


register(and_or_mixed, (1, 2, 3), (0, 2, 3), (1, 0, 3), (1, 0, 0))


def and_or_tensor(x, y):
    p = x.sum() > 0
    return (p and x.sum()) or y.sum(), x.sum() > 0 or y.sum() > 0


register(and_or_tensor, (POS, NEG), (NEG, POS), (NEG, NEG))


def or_none_default(x, s):
    s = s or 2.0
    return x * s


register(or_none_default, (POS, None), (POS, 3.0), (NEG, 0.0))


def and_side_effect(a):
    log = []
    r = a and (log.append(a) is None)
    return r, len(log)


register(and_side_effect, (0,), (3,))


def bump(log, v):
    log.append(v)
    return v + 100


def and_or_side_effect_helper(a, b):
    log = []
    r = a and bump(log, b)
    s = b or bump(log, a)
    return r, s, len(log)


register(and_or_side_effect_helper, (0, 0), (0, 5), (4, 0), (4, 5))


def explode(x):
    raise RuntimeError("explode() must not be called")


def none_and_call(x):
    # `None and f()` must not call f; a truthy x does call it (and it raises)
    return x and explode(x)


register(none_and_call, (None,), (0,), (False,), (5,))


def guard_is_not_none(x):
    return x is not None and x.sum() > 0


register(guard_is_not_none, (None,), (POS,), (NEG,))


def chained_compare(a, b, c):
    return a < b < c, a <= b != c, a < b > c


register(chained_compare, (1, 2, 3), (1, 3, 2), (3, 2, 1), (2, 2, 2))


def chained_compare_short_circuit(xs, i):
    # xs[i] is only evaluated when the range check holds (i=5 would IndexError)
    return 0 <= i < len(xs) and xs[i] > 0


register(chained_compare_short_circuit, ([1, -2, 3], 0), ([1, -2, 3], 1), ([1, -2, 3], 5),
         ([1, -2, 3], -1))


def is_none_default(x, y=None):
    if y is None:
        y = x * 2
    return x + y


register(is_none_default, (POS,), (POS, NEG), Call(NEG, y=None))


def isinstance_dispatch(v):
    if isinstance(v, torch.Tensor):
        return v.sum()
    elif isinstance(v, (list, tuple)):
        return len(v)
    elif isinstance(v, bool):
        return not v
    return v * 2


register(isinstance_dispatch, (POS,), ([1, 2],), ((1,),), (True,), (4,))


def one_element_tensor_predicates(x):
    out = 0
    if x[0] > x[1]:
        out = out + 1
    if (x > 0).any():
        out = out + 10
    if x.max() == x[2]:
        out = out + 100
    return out


register(one_element_tensor_predicates, (POS,), (NEG,), (MIX,), (T(3.0, 1.0, 7.0),))


# ----- 3b. while loops -----------------------------------------------------

def while_tensor_pred(x):
    x = x.abs() + 0.1
    n = 0
    while x.sum() < 10:
        x = x * 2
        n += 1
    return x, n


register(while_tensor_pred, (POS,), (NEG,), (BIG,))


def while_collatz(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


register(while_collatz, (1,), (6,), (27,))


def while_break_continue(n):
    i = 0
    total = 0
    while True:
        i += 1
        if i > n:
            break
        if i % 3 == 0:
            continue
        total += i
    return total, i


register(while_break_continue, (0,), (1,), (10,))


def while_else(n, limit):
    i = 0
    found = -1
    while i < limit:
        if i * i == n:
            found = i
            break
        i += 1
    else:
        found = -2
    return found, i


register(while_else, (16, 10), (15, 10), (0, 0), (0, 3))


def while_tensor_counter(x, limit):
    count = torch.zeros((), dtype=torch.int64)
    while count < limit and x.sum() > 0:
        x = x - 0.5
        count = count + 1
    return x, count


register(while_tensor_counter, (POS, 2), (POS, 50), (NEG, 5))


# ----- 3c. for loops -------------------------------------------------------

def for_range_sum(n):
    acc = 0
    for i in range(n):
        acc += i * i
    return acc


register(for_range_sum, (0,), (1,), (6,))


def for_range_start_stop_step(a, b, s):
    acc = 0
    count = 0
    last = -999
    for i in range(a, b, s):
        acc += i
        count += 1
        last = i
    return acc, count, last


register(for_range_start_stop_step, (0, 10, 3), (10, 0, -2), (5, 5, 1), (-3, 4, 1))


def for_range_tensor_bound(x, n):
    # n is a one-element integer tensor; the loop variable is a Python int
    total = 0
    for i in range(n):
        x = x * 0.5 + i
        total += i
    return x, total


register(for_range_tensor_bound, (POS, torch.tensor(3)), (NEG, torch.tensor(0)),
         (POS, torch.tensor([4])))


def for_range_two_tensor_bounds(a, b):
    out = []
    for i in range(a, b):
        out.append(i * 2)
    return out


register(for_range_two_tensor_bounds, (torch.tensor(1), torch.tensor(4)), (torch.tensor(2), torch.tensor(2)))


def for_range_shape(x):
    acc = x[0] * 0
    for i in range(x.shape[0]):
        acc = acc + x[i] * (i + 1)
    return acc


register(for_range_shape, (M23,), (M43,))


def for_range_len(xs):
    acc = 0
    for i in range(len(xs)):
        acc = acc * 10 + xs[i]
    return acc


register(for_range_len, ([],), ([1, 2, 3],), ([7],))


def for_tensor_rows(m):
    acc = torch.zeros(m.shape[1], dtype=m.dtype)
    for row in m:
        acc = acc + row * row
    return acc


register(for_tensor_rows, (M23,), (M43,))


def for_list_of_tensors(xs):
    total = xs[0] * 0
    for t in xs:
        total = total + t.sum() * t
    return total


register(for_list_of_tensors, ([POS, NEG, MIX],), ([POS],), (SEQ,))


def for_tuple_values(xs):
    best = xs[0]
    for v in xs:
        if v > best:
            best = v
    return best


register(for_tuple_values, ((3, 9, 2),), ((1, -2),), ((5,),))


def for_break(xs, stop):
    total = 0
    for v in xs:
        if v == stop:
            break
        total += v
    return total


register(for_break, ([1, 2, 3, 4], 3), ([1, 2, 3, 4], 9), ([], 1))


def for_continue(xs):
    evens = 0
    odds = 0
    for v in xs:
        if v % 2 == 0:
            evens += v
            continue
        odds += 1
    return evens, odds


register(for_continue, ([1, 2, 3, 4, 6],), ([],), ([5, 7],))


def for_else(xs, target):
    pos = -1
    for i in range(len(xs)):
        if xs[i] == target:
            pos = i
            break
    else:
        pos = len(xs) + 100
    return pos


register(for_else, ([4, 5, 6], 5), ([4, 5, 6], 9), ([], 1))


def for_else_tensor_rows(rows):
    hit = -1
    k = 0
    for row in rows:
        if row.sum() < 0:
            hit = k
            break
        k += 1
    else:
        hit = 100 + k
    return hit


register(for_else_tensor_rows, (M43,), (M43P,), (-M43P,))


def nested_loops(n, m):
    total = 0
    for i in range(n):
        for j in range(m):
            total += i * j + 1
    return total


register(nested_loops, (3, 4), (0, 4), (4, 0), (1, 1))


def nested_loops_break_inner(n):
    pairs = 0
    for i in range(n):
        for j in range(n):
            if j > i:
                break
            pairs += 1
    return pairs


register(nested_loops_break_inner, (0,), (1,), (5,))


def nested_while_in_for(xs):
    out = []
    for v in xs:
        steps = 0
        while v > 1:
            v = v // 2
            steps += 1
        out.append(steps)
    return out


register(nested_while_in_for, ([1, 2, 17, 1024],), ([],))


def loop_var_after_loop_preset(n):
    i = -1
    for i in range(n):
        pass
    return i


register(loop_var_after_loop_preset, (0,), (1,), (5,))


def loop_var_after_loop(xs):
    # the loop target (not a body variable) keeps its last value; xs is never empty here
    for v in xs:
        pass
    return v


register(loop_var_after_loop, ([3],), ([3, 1, 4],))


def loop_var_after_loop_rows(m):
    for row in m:
        pass
    return row * 2


register(loop_var_after_loop_rows, (M23,), (M43,))


def lstm_like_cell(x, h, c):
    g = torch.sigmoid(x + h)
    c = g * c + (1 - g) * torch.tanh(x)
    h = torch.tanh(c) * g
    return h, c


def loop_tuple_state(xs, h, c):
    for x in xs:
        h, c = lstm_like_cell(x, h, c)
    return h, c


register(loop_tuple_state, (SEQ, H0, C0), (SEQ[:1], C0, H0), ([], H0, C0), approx=True)


def loop_tuple_state_rows(m, h, c):
    for i in range(m.shape[0]):
        h, c = lstm_like_cell(m[i], h, c)
    return h, c


register(loop_tuple_state_rows, (M43, H0, C0), (M23, C0, H0), approx=True)


def append_then_stack(x, n):
    outs = []
    for i in range(n):
        x = x * 0.5 + i
        outs.append(x)
    return torch.stack(outs)


# n == 0: torch.stack([]) raises RuntimeError in both versions
register(append_then_stack, (POS, 3), (NEG, 1), (POS, 0))


def append_nested_then_cat(m):
    pieces = []
    for row in m:
        for j in range(2):
            pieces.append(row * j)
    return torch.cat(pieces), len(pieces)


register(append_nested_then_cat, (M23,), (M43,))


def list_accumulate_return_list(xs):
    out = []
    for v in xs:
        if v > 0:
            out.append(v * 2)
    return out


register(list_accumulate_return_list, ([1, -2, 3],), ([],), ([-1],))


# ----- 3d. early return ----------------------------------------------------

def early_return_if(x):
    if x.sum() > 0:
        return x * 2
    y = x - 1
    return y


register(early_return_if, (POS,), (NEG,))


def early_return_while(n):
    i = 0
    while True:
        if i * i >= n:
            return i
        i += 1


register(early_return_while, (0,), (10,), (16,))


def early_return_for(xs, target):
    for i in range(len(xs)):
        if xs[i] == target:
            return i
    return -1


register(early_return_for, ([5, 6, 7], 6), ([5, 6, 7], 8), ([], 0))


def early_return_for_tensor(m):
    for row in m:
        if row.sum() > 0:
            return row
    return m[0] * 0


register(early_return_for_tensor, (M43,), (-M43P,), (M43P,))


def early_return_nested(m, thresh):
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            if m[i, j] > thresh:
                return i, j
    return -1, -1


register(early_return_nested, (M43, 0.5), (M43, 100.0), (M23, -100.0))


def early_return_deep(n):
    total = 0
    for i in range(n):
        j = 0
        while j < i:
            if i * j > 12:
                if j % 2 == 1:
                    return total, i, j
            total += j
            j += 1
    return total, -1, -1


register(early_return_deep, (3,), (8,), (0,))


def early_return_multiple_exits(x, n):
    if n == 0:
        return x
    elif n == 1:
        return x + 1
    for i in range(n):
        if x.sum() > 100:
            return x
        x = x * 2
    return -x


register(early_return_multiple_exits, (POS, 0), (POS, 1), (POS, 3), (BIG, 20))


# ----- 3e. expressions, assignment, data ------------------------------------

def aug_assign_ints(a, b):
    a += b
    a -= 1
    a *= 3
    a //= 2
    a %= 7
    a **= 2
    b -= a
    return a, b


register(aug_assign_ints, (5, 3), (0, 0), (-4, 9))


def aug_assign_floats(a, b):
    a += b
    a *= 1.5
    a /= 4
    a -= b
    return a


register(aug_assign_floats, (1.0, 2.5), (-3.25, 0.5))


def aug_assign_tensor(x):
    acc = torch.zeros_like(x)
    acc += x
    acc *= 2
    acc -= 1
    acc /= 4
    return acc


register(aug_assign_tensor, (POS,), (M23,))


def tuple_unpacking(a, b, c):
    a, b = b, a
    (p, q), r = (a, b), c
    x, y, z = [r, q, p]
    return x, y, z, a


register(tuple_unpacking, (1, 2, 3), (POS, NEG, MIX))


def unpack_tensor_rows(m):
    top, bottom = m
    return bottom - top


register(unpack_tensor_rows, (M23,))


def minmax(x):
    return x.min(), x.max()


def unpack_from_call(x):
    lo, hi = minmax(x)
    return hi - lo, lo


register(unpack_from_call, (POS,), (M43,))


def subscripts_lists(xs):
    return xs[0], xs[-1], xs[1:3], xs[::2], xs[:-1]


register(subscripts_lists, ([1, 2, 3, 4],), ([5, 6],))


def subscripts_tuples(t):
    return t[1], t[-2:], t[::-1]


register(subscripts_tuples, ((1, 2.5, 3),), ((POS, NEG),))


def subscripts_tensor(m):
    return m[0], m[-1, 1], m[:, 0], m[1:], m[:, ::2], m[0, 1:]


register(subscripts_tensor, (M23,), (M43,))


def subscript_dynamic(xs, x, i, j):
    return xs[i] + xs[i - 1], x[i], x[j]


# j is a 0-d int64 tensor index
register(subscript_dynamic, ([1, 2, 3], POS, 1, torch.tensor(2)), ([4, 5], NEG, 0, torch.tensor(0)))


def attribute_access(m):
    return m.shape[0], m.ndim, m.T, m.dtype == torch.float64, m.numel()


register(attribute_access, (M23,), (M43,))


def tensor_methods(x):
    return x.sum(), x.mean(), x.abs().max(), x.clamp(min=0.0), x.reshape(-1, 1), x.sum(dim=0)


register(tensor_methods, (POS,), (MIX,), (M43,))


def torch_functions(x, y):
    return (torch.cat([x, y]), torch.stack([x, y]), torch.relu(x - y), torch.where(x > y, x, y),
            torch.maximum(x, y), torch.zeros(2, dtype=x.dtype))


register(torch_functions, (POS, NEG), (MIX, POS))


def matmul_ops(m, v):
    return m @ v, torch.mm(m, m.T), torch.matmul(v, v)


register(matmul_ops, (M23, POS), (M43, MIX))


def literals(x, n):
    lst = [x, x * 2, n]
    tup = (n, n + 1)
    d = {"a": x, "b": n}
    return lst[1] + d["a"], tup[1] + d["b"], len(lst) + len(d) + len(tup)


register(literals, (POS, 2), (NEG, -1))


def return_nested_structure(x, n):
    return (x, [x + 1, n], (n * 1.5, None, True, n > 2))


register(return_nested_structure, (POS, 1), (NEG, 3))


def return_none(x):
    y = x + 1


register(return_none, (POS,), (3,))


def return_bare(n):
    if n > 0:
        return
    return n


register(return_bare, (1,), (-1,))


def int_float_types(n, f):
    return n / 2, n // 2, n * 1.0, float(n), int(f), bool(n), n % 3, -n, abs(-n), f * n


register(int_float_types, (7, 2.75), (0, -1.5), (-5, 0.0))


def builtins_misc(xs, a, b):
    return len(xs), min(a, b), max(a, b), abs(a - b), sum(xs), min(xs), max(xs)


register(builtins_misc, ([3, 1, 2], 4, 9), ([-1], 2.5, -2.5))


def tensor_to_python(x):
    return x.sum().item(), int(x.argmax()), float(x.max()), bool(x.sum() > 0), x.tolist(), len(x)


register(tensor_to_python, (POS,), (NEG,))


def comparisons(a, b):
    return a == b, a != b, a < b, a >= b, a is None, b is not None


register(comparisons, (1, 2), (2, 2), (3.5, 1))


def scale_add(x, s, b=0.0):
    return x * s + b


def helper_with_kwargs(x):
    return scale_add(x, 3.0) + scale_add(x, s=0.5, b=2.0) + scale_add(b=1.0, s=2.0, x=x)


register(helper_with_kwargs, (POS,), (4.0,))


def kwonly_helper(x, *, n, shift=0):
    return x * n + shift


def call_kwonly_helper(x, n):
    return kwonly_helper(x, n=n) + kwonly_helper(x, n=1, shift=2)


register(call_kwonly_helper, (POS, 3), (5, 0))


# ----- 3f. globals and module attributes -----------------------------------

GLOBAL_SCALE = 3
GLOBAL_VEC = T(1.0, -1.0, 2.0)
GLOBAL_TABLE = [10, 20, 30]


def uses_globals(x, i):
    return x * GLOBAL_SCALE + GLOBAL_VEC + GLOBAL_TABLE[i]


register(uses_globals, (POS, 0), (NEG, 2))


def uses_module_attributes(x):
    return x * math.pi, torch.float64 == x.dtype, math.sqrt(2.0)


register(uses_module_attributes, (POS,))


# ----- 3g. calls: compiled -> compiled, compiled -> plain helper ------------

def inner_compiled(x, k):
    return x * k + 1


def outer_calls_compiled(x):
    return inner_compiled(x, 2) + inner_compiled(x, k=3)


# inner_compiled is itself compiled and installed as the global
register(outer_calls_compiled, (POS,), (5,), rec=("inner_compiled",))


def plain_helper_loop(x, n):
    for i in range(n):
        x = x * 2 - i
    return x


def outer_calls_plain_helper(x, n):
    y = plain_helper_loop(x, n)
    if y.sum() > 0:
        return plain_helper_loop(y, 1)
    return y


register(outer_calls_plain_helper, (POS, 2), (NEG, 3), (POS, 0))


# ----- 3h. recursion -------------------------------------------------------

def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


register(fact, (0,), (1,), (5,), (20,))


def fib(n):
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


register(fib, (0,), (1,), (12,))


def gcd(a, b):
    return a if b == 0 else gcd(b, a % b)


register(gcd, (12, 18), (17, 5), (0, 4))


def power_tensor(x, n):
    if n == 0:
        return torch.ones_like(x)
    half = power_tensor(x, n // 2)
    if n % 2 == 0:
        return half * half
    return half * half * x


register(power_tensor, (POS, 0), (POS, 5), (MIX, 8))


def ackermann(m, n):
    if m == 0:
        return n + 1
    if n == 0:
        return ackermann(m - 1, 1)
    return ackermann(m - 1, ackermann(m, n - 1))


register(ackermann, (0, 3), (2, 3), (3, 2))


def rec_list_sum(xs, i):
    return 0 if i >= len(xs) else xs[i] + rec_list_sum(xs, i + 1)


register(rec_list_sum, ([1, 2, 3, 4], 0), ([], 0), ([2.5, 1.0], 0))


def binary_search(xs, target, lo, hi):
    if lo >= hi:
        return -1
    mid = (lo + hi) // 2
    if xs[mid] == target:
        return mid
    if xs[mid] < target:
        return binary_search(xs, target, mid + 1, hi)
    return binary_search(xs, target, lo, mid)


register(binary_search, ([1, 3, 5, 7, 9, 11], 7, 0, 6), ([1, 3, 5, 7, 9, 11], 4, 0, 6), ([], 1, 0, 0))


def rec_tensor_pred(x, n):
    # data-dependent branch inside recursion
    if n == 0:
        return x
    if x.sum() > 0:
        return rec_tensor_pred(x - 1.5, n - 1) * 2
    return rec_tensor_pred(x + 1, n - 1) + 1


register(rec_tensor_pred, (POS, 0), (POS, 4), (NEG, 6))


def tree_sum(left, right, vals, i):
    if left[i] < 0:
        return vals[i]
    return vals[i] + tree_sum(left, right, vals, left[i]) + tree_sum(left, right, vals, right[i])


register(tree_sum, (*BAL, VALS7, 0), (*SKEW, VALS7, 0), (*LEAF, [5], 0), (*BAL, VALS7, 2))


def tree_sum_tensor(left, right, emb, i):
    if left[i] < 0:
        return emb[i]
    return emb[i] + tree_sum_tensor(left, right, emb, left[i]) * 0.5 - tree_sum_tensor(left, right, emb, right[i])


register(tree_sum_tensor, (*BAL, EMB7, 0), (*SKEW, EMB7, 0), (*LEAF, EMB1, 0))


def tree_depth(left, right, i):
    if i < 0:
        return 0
    return 1 + max(tree_depth(left, right, left[i]), tree_depth(left, right, right[i]))


register(tree_depth, (*BAL, 0), (*SKEW, 0), (*LEAF, 0), (*SKEW, -1))


def tree_encode(left, right, emb, i):
    if left[i] < 0:
        return torch.tanh(emb[i])
    l = tree_encode(left, right, emb, left[i])
    r = tree_encode(left, right, emb, right[i])
    return torch.tanh(l + 0.5 * r + emb[i])


register(tree_encode, (*BAL, EMB7, 0), (*SKEW, EMB7, 0), (*LEAF, EMB1, 0), approx=True)


def tree_signed(left, right, emb, i):
    h = emb[i]
    if left[i] >= 0:
        h = h + tree_signed(left, right, emb, left[i]) * 0.5 - tree_signed(left, right, emb, right[i]) * 0.25
    if h.sum() > 0:
        return h * 2
    return -h


register(tree_signed, (*BAL, EMB7, 0), (*SKEW, EMB7, 0), (*BAL, -EMB7, 0), (*LEAF, EMB1, 0))


def tree_leaf_count_tuple(left, right, i):
    # returns a tuple (leaves, nodes) through the recursion
    if left[i] < 0:
        return 1, 1
    a, b = tree_leaf_count_tuple(left, right, left[i])
    c, d = tree_leaf_count_tuple(left, right, right[i])
    return a + c, b + d + 1


register(tree_leaf_count_tuple, (*BAL, 0), (*SKEW, 0), (*LEAF, 0))


def is_even(n):
    return True if n == 0 else is_odd(n - 1)


def is_odd(n):
    return False if n == 0 else is_even(n - 1)


register(is_even, (0,), (7,), (10,), rec=("is_odd",))
register(is_odd, (0,), (7,), (10,), rec=("is_even",))


def tree_even_level(left, right, emb, i):
    if left[i] < 0:
        return emb[i] * 2
    return emb[i] + tree_odd_level(left, right, emb, left[i]) - tree_odd_level(left, right, emb, right[i])


def tree_odd_level(left, right, emb, i):
    if left[i] < 0:
        return emb[i] - 1
    return emb[i] * tree_even_level(left, right, emb, left[i]) + tree_even_level(left, right, emb, right[i])


register(tree_even_level, (*BAL, EMB7, 0), (*SKEW, EMB7, 0), (*LEAF, EMB1, 0), rec=("tree_odd_level",))


# ----- 3i. runtime errors: same exception type as plain Python --------------

def index_error_list(xs, i):
    return xs[i] * 2


register(index_error_list, ([1, 2, 3], 1), ([1, 2, 3], 10), ([1, 2, 3], -4))


def index_error_tensor(x, i):
    return x[i] + 1


register(index_error_tensor, (POS, 2), (POS, 10))


def raise_value_error(n):
    if n < 0:
        raise ValueError("negative input")
    return n * 2


register(raise_value_error, (3,), (-1,))


def zero_division(a, b):
    return a // b, a % b, a / b


register(zero_division, (7, 2), (7, 0), (-7, 3))


def zero_division_float(a, b):
    return a / b


register(zero_division_float, (1.0, 4.0), (1.0, 0.0))


def raise_in_loop(xs):
    total = 0
    for v in xs:
        if v < 0:
            raise ValueError("negative element")
        total += v
    return total


register(raise_in_loop, ([1, 2],), ([1, -2, 3],))


def shape_mismatch(x, y):
    return x + y


register(shape_mismatch, (POS, NEG), (POS, V4))


def countdown_fail(n, fail):
    if n == fail:
        raise ArithmeticError("hit")
    if n == 0:
        return 0
    return countdown_fail(n - 1, fail) + 1


register(countdown_fail, (5, -1), (5, 2), (3, 0))


ERROR_PROGRAMS = {
    # name: (good case, bad case, expected exception type)
    "index_error_list": (Call([1, 2, 3], 1), Call([1, 2, 3], 10), IndexError),
    "index_error_tensor": (Call(POS, 2), Call(POS, 10), IndexError),
    "raise_value_error": (Call(3), Call(-1), ValueError),
    "zero_division": (Call(7, 2), Call(7, 0), ZeroDivisionError),
    "zero_division_float": (Call(1.0, 4.0), Call(1.0, 0.0), ZeroDivisionError),
    "raise_in_loop": (Call([1, 2]), Call([1, -2, 3]), ValueError),
    "shape_mismatch": (Call(POS, NEG), Call(POS, V4), RuntimeError),
    "countdown_fail": (Call(5, -1), Call(5, 2), ArithmeticError),
    "none_and_call": (Call(None), Call(5), RuntimeError),
    "append_then_stack": (Call(POS, 3), Call(POS, 0), RuntimeError),
}


# ---------------------------------------------------------------------------
# 4. tests over the registry
# ---------------------------------------------------------------------------

def test_registry_is_large_enough():
    assert len(PROGRAMS) >= 70, len(PROGRAMS)


_COMPILED_CACHE: dict = {}


def cached_compiled(prog, mode):
    """One compiled object per (function, mode), shared by all cases (like real use)."""
    out = {}
    for name in prog.rec:
        key = (name, mode)
        if key not in _COMPILED_CACHE:
            _COMPILED_CACHE[key] = compile_fn(globals()[name], mode)
        out[name] = _COMPILED_CACHE[key]
    return out


_CASE_PARAMS = [pytest.param(name, i, id=f"{name}-{i}")
                for name, prog in PROGRAMS.items() for i in range(len(prog.cases))]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name,index", _CASE_PARAMS)
def test_program(name, index, mode):
    prog = PROGRAMS[name]
    check_case(prog, cached_compiled(prog, mode), prog.cases[index])


def _type_signature(case):
    return (tuple(type(a).__name__ for a in case.args),
            tuple(sorted((k, type(v).__name__) for k, v in case.kwargs.items())))


def _has_mixed_input_types(prog):
    return len({_type_signature(c) for c in prog.cases}) > 1


def _check_builds_once(name, mode):
    prog = PROGRAMS[name]
    compiled = compile_program(prog, mode)
    for case in prog.cases:
        check_case(prog, compiled, case)
    assert compiled[name].stats["builds"] == 1


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", [n for n, p in PROGRAMS.items() if not _has_mixed_input_types(p)])
def test_builds_once(name, mode):
    """A fresh compiled function, called on all its inputs (different values, shapes,
    list lengths, recursion depths; same argument types), is built exactly once."""
    _check_builds_once(name, mode)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", [n for n, p in PROGRAMS.items() if _has_mixed_input_types(p)])
def test_builds_once_mixed_input_types(name, mode):
    """Same, for programs whose cases pass different Python types (None / int / tensor ...):
    the spec says one build after many calls with different inputs, types included."""
    _check_builds_once(name, mode)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", list(ERROR_PROGRAMS))
def test_works_again_after_exception(name, mode):
    prog = PROGRAMS[name]
    good, bad, exc_type = ERROR_PROGRAMS[name]
    compiled = compile_program(prog, mode)
    for _ in range(2):
        assert check_case(prog, compiled, good) is None
        plain_exc = check_case(prog, compiled, bad)
        assert type(plain_exc) is exc_type  # the program really raises that type in plain Python
    assert check_case(prog, compiled, good) is None
    assert compiled[name].stats["builds"] == 1


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_raise_statement_keeps_message(mode):
    f = compile_fn(raise_value_error, mode)
    with pytest.raises(ValueError) as ei:
        f(-3)
    assert type(ei.value) is ValueError
    assert "negative input" in str(ei.value)
    assert f(4) == 8


def test_python_attribute_is_the_plain_function():
    f = compile_fn(fact)
    assert f.python is fact
    assert f.python(5) == 120


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_compiled_does_not_mutate_inputs(mode):
    f = compile_fn(for_list_of_tensors, mode)
    xs = [POS.clone(), NEG.clone()]
    f(xs)
    assert len(xs) == 2 and torch.equal(xs[0], POS) and torch.equal(xs[1], NEG)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_builds_once_over_many_shapes_and_values(mode):
    f = compile_fn(loop_tuple_state, mode)
    g = compile_fn(for_range_shape, mode)
    torch.manual_seed(1)
    for n in range(6):
        for d in (1, 2, 5):
            xs = [torch.randn(d, dtype=F64) for _ in range(n)]
            h, c = torch.randn(d, dtype=F64), torch.randn(d, dtype=F64)
            assert_same(f(xs, h, c), loop_tuple_state(xs, h, c), approx=True)
            if n:
                m = torch.randn(n, d, dtype=F64)
                assert_same(g(m), for_range_shape(m))
    assert f.stats["builds"] == 1
    assert g.stats["builds"] == 1


# ---------------------------------------------------------------------------
# 5. hand-written tests
# ---------------------------------------------------------------------------

# ----- 5a. keyword args, defaults, wrong calls, options --------------------

def kw_prog(x, y=2, *, scale=1.5, shift=None):
    if shift is None:
        out = x * y * scale
    else:
        out = x * y * scale + shift
    return out


def required_kwonly(x, *, n):
    return x * n


KW_CALLS = [
    Call(3), Call(3, 4), Call(3, scale=2.0), Call(3, 4, scale=0.5, shift=1),
    Call(y=5, x=2), Call(POS, shift=NEG), Call(POS, y=3, shift=1.0), Call(x=NEG, scale=3),
]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", KW_CALLS, ids=repr)
def test_keyword_and_default_arguments(case, mode):
    prog = Program(kw_prog, [case], False, ())
    check_case(prog, {"kw_prog": compile_fn(kw_prog, mode)}, case)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_keyword_calls_build_once(mode):
    f = compile_fn(kw_prog, mode)
    for case in KW_CALLS:
        args, kwargs = case.copy()
        assert_same(f(*args, **kwargs), kw_prog(*args, **kwargs))
    assert f.stats["builds"] == 1


WRONG_CALLS = [
    (kw_prog, Call()),                      # missing x
    (kw_prog, Call(1, 2, 3)),               # scale is keyword-only
    (kw_prog, Call(1, bogus=2)),            # unexpected keyword
    (kw_prog, Call(1, x=2)),                # multiple values for x
    (required_kwonly, Call(3)),             # missing keyword-only n
    (required_kwonly, Call(3, 4)),          # n given positionally
]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("fn,case", WRONG_CALLS, ids=lambda v: v.__name__ if callable(v) else repr(v))
def test_wrong_call_raises_type_error(fn, case, mode):
    with pytest.raises(TypeError):
        fn(*case.args, **case.kwargs)          # the plain function does
    f = compile_fn(fn, mode)
    with pytest.raises(TypeError):
        f(*case.args, **case.kwargs)
    good = Call(3, n=2) if fn is required_kwonly else Call(3)   # a correct call still works
    assert_same(f(*good.args, **good.kwargs), fn(*good.args, **good.kwargs))


def test_unknown_option_raises_type_error():
    with pytest.raises(TypeError):
        deco = recompile.function(no_such_option=True)
        deco(fact)


def test_bare_and_parenthesised_decorator_agree():
    a = recompile.function(fact)
    b = recompile.function(mode="sequential")(fact)
    with installed({"fact": a}):
        ra = a(10)
    with installed({"fact": b}):
        rb = b(10)
    assert_same(ra, fact(10))
    assert_same(rb, fact(10))


# ----- 5b. globals and closures --------------------------------------------

REBIND_K = 2
REBIND_T = T(1.0, 2.0, 3.0)


def rebind_helper(x):
    return x + 1


def uses_rebound_globals(x):
    return x * REBIND_K + REBIND_T


def rebind_helper_alt(x):
    return x - 1


def uses_rebound_function(x):
    return rebind_helper(x) * 2


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_global_rebound_between_calls_is_seen(mode, monkeypatch):
    f = compile_fn(uses_rebound_globals, mode)
    assert_same(f(POS), uses_rebound_globals(POS))
    monkeypatch.setattr(THIS, "REBIND_K", 5)
    monkeypatch.setattr(THIS, "REBIND_T", T(-1.0, 0.0, 1.0))
    want = uses_rebound_globals(POS)
    assert_same(f(POS), want)
    assert torch.equal(want, POS * 5 + T(-1.0, 0.0, 1.0))  # sanity: plain sees the new value
    monkeypatch.setattr(THIS, "REBIND_K", 7)
    assert_same(f(NEG), uses_rebound_globals(NEG))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_global_function_rebound_between_calls_is_seen(mode, monkeypatch):
    f = compile_fn(uses_rebound_function, mode)
    assert f(3) == 8
    monkeypatch.setattr(THIS, "rebind_helper", rebind_helper_alt)
    assert f(3) == uses_rebound_function(3) == 4


def make_closure_program(deco, k, w):
    offset = k * 2

    def helper(v):
        return v * k

    def program(x, n):
        acc = x * 0
        for i in range(n):
            acc = acc + helper(x) + w * i
        return acc + offset

    return deco(program)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_closure_cells(mode):
    for k, w in [(2, POS), (-1, MIX)]:
        plain = make_closure_program(identity, k, w)
        compiled = make_closure_program(deco_for(mode), k, w)
        for x, n in [(NEG, 3), (POS, 0), (MIX, 1)]:
            assert_same(compiled(x, n), plain(x, n))
        assert compiled.stats["builds"] == 1


def make_closure_recursion(deco, base):
    @deco
    def tri(n):
        # recursion through a closure cell (tri is the decorated object)
        return base if n == 0 else n + tri(n - 1)

    @deco
    def uses_tri(x, n):
        return x * tri(n)

    return tri, uses_tri


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_closure_recursion_and_compiled_callee(mode):
    p_tri, p_uses = make_closure_recursion(identity, 7)
    c_tri, c_uses = make_closure_recursion(deco_for(mode), 7)
    for n in (0, 1, 10, 50):
        assert_same(c_tri(n), p_tri(n))
        assert_same(c_uses(POS, n), p_uses(POS, n))
    assert c_tri.stats["builds"] == 1


# ----- 5c. nn.Module and class methods --------------------------------------

def make_net_class(deco):
    class Net(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.leaf = nn.Linear(d, d).double()
            self.comp = nn.Linear(2 * d, d).double()
            self.bias = nn.Parameter(torch.randn(d, dtype=F64))
            self.scale = 0.5
            self.limit = 3

        @deco
        def forward(self, xs, h):
            for x in xs:
                h = torch.tanh(self.leaf(x) + self.scale * h + self.bias)
            return h

        @deco
        def encode(self, left, right, emb, i):
            if left[i] < 0:
                return torch.tanh(self.leaf(emb[i]) + self.bias)
            l = self.encode(left, right, emb, left[i])
            r = self.encode(left, right, emb, right[i])
            return torch.tanh(self.comp(torch.cat([l, r])) * self.scale)

        @deco
        def gated(self, x, n):
            steps = 0
            while steps < self.limit and (self.bias * x).sum() > 0:
                x = x - self.bias
                steps += 1
            if n > steps:
                return self.leaf(x), steps
            return x * self.scale, steps

    return Net


def make_net_pair(mode, d=3):
    torch.manual_seed(123)
    plain = make_net_class(identity)(d)
    compiled = make_net_class(deco_for(mode))(d)
    compiled.load_state_dict(plain.state_dict())
    return plain, compiled


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_module_forward_with_submodules_params_constants(mode):
    plain, compiled = make_net_pair(mode)
    for xs, h in [(SEQ, H0), (SEQ[:1], C0), ([], C0)]:
        assert_same(compiled(xs, h), plain(xs, h), approx=True)
    assert type(compiled).__dict__["forward"].stats["builds"] == 1


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_module_recursive_method(mode):
    plain, compiled = make_net_pair(mode)
    for left, right, emb in [(*BAL, EMB7), (*SKEW, EMB7), (*LEAF, EMB1)]:
        assert_same(compiled.encode(left, right, emb, 0), plain.encode(left, right, emb, 0), approx=True)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_module_method_data_dependent(mode):
    plain, compiled = make_net_pair(mode)
    for x, n in [(POS, 0), (POS, 5), (NEG, 5), (-plain.bias.detach(), 1), (plain.bias.detach() * 0.1, 9)]:
        assert_same(compiled.gated(x, n), plain.gated(x, n), approx=True)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_module_sees_parameter_updates(mode):
    plain, compiled = make_net_pair(mode)
    compiled(SEQ, H0)
    with torch.no_grad():
        plain.bias.add_(1.0)
        compiled.bias.add_(1.0)
        compiled.scale = plain.scale = 2.0
    assert_same(compiled(SEQ, H0), plain(SEQ, H0), approx=True)


def make_poly_class(deco):
    class Poly:
        def __init__(self, coeffs, offset):
            self.coeffs = coeffs
            self.offset = offset

        @deco
        def evaluate(self, x):
            acc = x * 0
            for c in self.coeffs:
                acc = acc * x + c
            return acc + self.offset

        @deco
        def rec(self, x, n):
            if n == 0:
                return x * 0 + self.offset
            return self.rec(x, n - 1) * x + self.coeffs[n % len(self.coeffs)]

    return Poly


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_plain_class_methods_and_descriptor_binding(mode):
    P = make_poly_class(identity)
    C = make_poly_class(deco_for(mode))
    for coeffs, offset in [([1, 2, 3], 1), ([0.5, -1.0], POS)]:
        p, c = P(coeffs, offset), C(coeffs, offset)
        for x in (2, 1.5, MIX):
            want = p.evaluate(x)
            assert_same(c.evaluate(x), want)      # obj.method(x)
            bound = c.evaluate                     # bound method object
            assert_same(bound(x), want)
            assert_same(C.evaluate(c, x), want)   # Class.method(obj, x)
            for n in (0, 1, 4):
                assert_same(c.rec(x, n), p.rec(x, n))


def test_decorator_syntax_in_class_body():
    class Scaler(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(T(1.0, 2.0, 3.0))
            self.k = 3

        @recompile.function
        def forward(self, x):
            if (x * self.w).sum() > 0:
                return x * self.w * self.k
            return x - self.k

    s = Scaler()
    fwd = Scaler.__dict__["forward"]
    for x in (POS, NEG, MIX):
        assert_same(s(x), fwd.python(s, x))
    assert fwd.stats["builds"] == 1


# ----- 5d. deep recursion ----------------------------------------------------

DEEP_N = 100_000


def deep_sum(nxt, vals, i):
    return 0 if i < 0 else vals[i] + deep_sum(nxt, vals, nxt[i])


def _deep_inputs(kind):
    nxt = list(range(-1, DEEP_N - 1))            # node i -> i - 1, node 0 -> -1
    if kind == "int":
        vals = [(i * 7919) % 1001 - 500 for i in range(DEEP_N)]
    else:
        vals = [((i * 7919) % 1001 - 500) / 7.0 for i in range(DEEP_N)]
    expected = 0
    for i in range(DEEP_N):                       # same association order as the recursion
        expected = vals[i] + expected
    return nxt, vals, expected


@pytest.mark.slow  # (about 3 s each; tests/test_scheduler.py's 100 000-deep recursion runs by default)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", ["int", "float"])
def test_recursion_100k_deep_without_raising_recursion_limit(kind, mode):
    nxt, vals, expected = _deep_inputs(kind)
    limit = sys.getrecursionlimit()
    assert limit < DEEP_N
    with pytest.raises(RecursionError):           # plain Python cannot go that deep
        deep_sum(nxt, vals, DEEP_N - 1)
    f = compile_fn(deep_sum, mode)
    with installed({"deep_sum": f}):
        got = f(nxt, vals, DEEP_N - 1)
        assert sys.getrecursionlimit() == limit
        assert_same(got, expected)
        assert_same(f(nxt, vals, 10), _small_reference(vals, 10))   # a shallow call afterwards
    assert sys.getrecursionlimit() == limit
    assert f.stats["builds"] == 1


def _small_reference(vals, i):
    acc = 0
    for k in range(i + 1):
        acc = vals[k] + acc
    return acc


# ---------------------------------------------------------------------------
# 6. OPTIONAL features (failures here mean "optional feature not supported")
# ---------------------------------------------------------------------------

OPTIONAL: dict[str, Program] = {}


def opt_fstring(n, x):
    return f"n={n} sum={x.sum().item():.3f}"


register(opt_fstring, (3, POS), (-1, NEG), registry=OPTIONAL)


def opt_list_comprehension(xs):
    return [v * 2 for v in xs if v > 0]


register(opt_list_comprehension, ([1, -2, 3],), ([],), registry=OPTIONAL)


def opt_list_comprehension_tensors(m):
    return torch.stack([row * i for i, row in enumerate(m)])


register(opt_list_comprehension_tensors, (M23,), (M43,), registry=OPTIONAL)


def opt_walrus(xs):
    total = 0
    for v in xs:
        if (d := v * 2) > 3:
            total += d
    return total


register(opt_walrus, ([1, 2, 3],), ([],), registry=OPTIONAL)


def opt_enumerate_zip(xs, ys):
    acc = 0
    for i, (a, b) in enumerate(zip(xs, ys)):
        acc += i * a * b
    return acc


register(opt_enumerate_zip, ([1, 2, 3], [4, 5, 6]), ([], []), registry=OPTIONAL)


def opt_return_dict(x, n):
    return {"x": x, "n": n, "nested": {"t": (n, None)}}


register(opt_return_dict, (POS, 1), registry=OPTIONAL)


def opt_dict_lookup_key_error(k):
    d = {"a": 1, "b": 2}
    return d[k]


register(opt_dict_lookup_key_error, ("a",), ("zzz",), registry=OPTIONAL)


def opt_assigned_with_other_branch_returning(x, n):
    # y is bound on every path that reaches the read (the else branch returns)
    if x.sum() > 0:
        y = x + n
    else:
        return x
    return y * 2


register(opt_assigned_with_other_branch_returning, (POS, 1), (NEG, 1), registry=OPTIONAL)


def opt_type_changing_variable(xs):
    last = None
    for v in xs:
        last = v
    return last


register(opt_type_changing_variable, ([1, 2],), ([],), registry=OPTIONAL)


def opt_subscript_store(xs, i):
    ys = xs[:]
    ys[i] += 10
    ys[0] = -1
    return ys


register(opt_subscript_store, ([1, 2, 3], 2), registry=OPTIONAL)


def opt_bigint_fact(n):
    return 1 if n <= 1 else n * opt_bigint_fact(n - 1)


register(opt_bigint_fact, (30,), registry=OPTIONAL)


def opt_assert_statement(n):
    assert n >= 0, "n must be non-negative"
    return n + 1


register(opt_assert_statement, (1,), (-1,), registry=OPTIONAL)


def opt_return_shape(x):
    return x.shape, x.size()


register(opt_return_shape, (M23,), registry=OPTIONAL)


def opt_tree_collect_into_shared_list(left, right, i, out):
    # mutating an argument list across recursive calls; returns the list
    if left[i] >= 0:
        opt_tree_collect_into_shared_list(left, right, left[i], out)
        opt_tree_collect_into_shared_list(left, right, right[i], out)
    out.append(i)
    return out


register(opt_tree_collect_into_shared_list, (*BAL, 0, []), (*SKEW, 0, []), registry=OPTIONAL)


_OPT_PARAMS = [pytest.param(name, i, id=f"{name}-{i}")
               for name, prog in OPTIONAL.items() for i in range(len(prog.cases))]


@pytest.mark.parametrize("name,index", _OPT_PARAMS)
def test_optional_program(name, index):
    prog = OPTIONAL[name]
    compiled = {n: compile_fn(globals()[n]) for n in prog.rec}
    check_case(prog, compiled, prog.cases[index])


def test_optional_gradients_match_plain():
    torch.manual_seed(5)
    plain = make_net_class(identity)(3)
    compiled = make_net_class(recompile.function)(3)
    compiled.load_state_dict(plain.state_dict())
    for net in (plain, compiled):
        net.zero_grad()
        net.encode(*BAL, EMB7, 0).sum().backward()
    for (n, p), (_, c) in zip(plain.named_parameters(), compiled.named_parameters()):
        assert c.grad is not None, n
        assert torch.allclose(c.grad, p.grad, rtol=1e-10, atol=1e-12), n
