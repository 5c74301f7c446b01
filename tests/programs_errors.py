"""Functions outside recompile's subset, for tests/test_errors.py.

Nothing here is decorated, so importing this module never fails; the tests
decorate and call.  Every function has exactly one line marked ``# ERR``: the
line a CompileError must point at.  Recursive functions used for runtime
errors mark their recursive call site with ``# CALLSITE``.
"""


def uses_yield(x):
    for i in range(3):
        yield x + i  # ERR


async def uses_async(x):  # ERR
    return x + 1


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
