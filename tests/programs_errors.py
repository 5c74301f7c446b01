"""Functions outside recompile's subset, for tests/test_errors.py.

Nothing here is decorated, so importing this module never fails; the tests
decorate and call.  Every function has exactly one line marked ``# ERR``: the
line a CompileError must point at.  Recursive functions used for runtime
errors mark their recursive call site with ``# CALLSITE``.
"""

import torch

COUNTER = 0


def uses_try(x):
    y = x
    try:  # ERR
        y = x + 1
    except ValueError:
        y = x - 1
    return y


def uses_try_finally(x):
    y = x
    try:  # ERR
        y = x + 1
    finally:
        y = y * 2
    return y


def uses_with(x):
    y = x
    with torch.no_grad():  # ERR
        y = x + 1
    return y


def uses_yield(x):
    for i in range(3):
        yield x + i  # ERR


async def uses_async(x):  # ERR
    return x + 1


def uses_global(x):
    global COUNTER  # ERR
    COUNTER += 1
    return x + COUNTER


def make_uses_nonlocal():
    n = 0

    def uses_nonlocal(x):
        nonlocal n  # ERR
        n += 1
        return x + n

    return uses_nonlocal


def uses_lambda(x):
    y = x
    f = lambda v: v + 1  # ERR
    return f(y)


# ----- runtime errors deep inside recursion ---------------------------------

def rec_boom(n, fail_at):
    if n == fail_at:
        raise ValueError("boom")
    if n == 0:
        return 0
    return rec_boom(n - 1, fail_at) + 1  # CALLSITE


def tree_leaf_sum(left, right, vals, i):
    if left[i] < 0:
        return vals[i]
    return tree_leaf_sum(left, right, vals, left[i]) + tree_leaf_sum(left, right, vals, right[i])  # CALLSITE
