"""Differential tests for the corners of Python's semantics: each program runs plain and compiled,
and must give the same value and type, or raise the same exception type, with the same side effects."""

import copy
import functools
import itertools
import sys

import pytest
import torch

import recompile
from recompile import config


def outcome(fn, *args):
    """(kind, value-or-exception-type, deep copy of the arguments afterwards)."""
    args = copy.deepcopy(args)
    try:
        result = ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        result = ("raise", type(exc))
    return result, args


def same(result_a, result_b):
    (ka, va), (kb, vb) = result_a, result_b
    assert ka == kb, (result_a, result_b)
    assert type(va) is type(vb), (va, vb)
    if isinstance(va, torch.Tensor):
        assert torch.equal(va, vb)
    else:
        assert va == vb


def check(fn, *args):
    plain, plain_args = outcome(fn, *args)
    compiled, compiled_args = outcome(recompile.function(fn), *args)
    same(compiled, plain)
    assert repr(compiled_args) == repr(plain_args)  # same mutations of the arguments


# -- jumps out of loops and their else clauses


def loop_else_return(n):
    while n > 0:
        n -= 1
        if n == 2:
            return "hit"
    else:
        return "else"
    return "after"


def for_else_continue_outer(xs, k):
    out = []
    for x in xs:
        for y in xs:
            if y == k:
                return out
        else:
            continue
        out.append(x)
    return out


def search_with_for_else(xs, k):
    for i, x in enumerate(xs):
        if x == k:
            r = i
            break
    else:
        r = -1
    return r


def assigned_after_a_guard(c, xs):
    if c:
        for x in xs:
            if x < 0:
                return "negative"
        y = 1
    else:
        y = 2
    return y


def previous_iteration(xs):
    out = []
    for i, x in enumerate(xs):
        if i > 0:
            out.append(prev + x)  # noqa: F821 - bound by the previous iteration
        prev = x
    return out


def infinite_iterator_with_break(n):
    out = []
    for i in itertools.count():
        if i > n:
            break
        out.append(i)
    return out, i


@pytest.mark.parametrize("fn,args", [
    (loop_else_return, (5,)), (loop_else_return, (1,)), (loop_else_return, (0,)),
    (for_else_continue_outer, ([1, 2, 3], 2)), (for_else_continue_outer, ([1, 2, 3], 9)),
    (search_with_for_else, ([4, 5, 6], 5)), (search_with_for_else, ([4, 5, 6], 7)),
    (assigned_after_a_guard, (True, [1, 2])), (assigned_after_a_guard, (True, [1, -2])),
    (assigned_after_a_guard, (False, [])),
    (previous_iteration, ([1, 2, 3, 4],)), (previous_iteration, ([],)),
    (infinite_iterator_with_break, (3,)),
])
def test_jumps(fn, args):
    check(fn, *args)


# -- walrus


def walrus_in_while(xs):
    out = []
    while (v := xs.pop()) != 0:
        out.append(v)
    return out, v


def walrus_in_and(xs):
    if xs and (first := xs[0]) > 0:
        return first
    return None


def walrus_in_ternary(x):
    return (z := x + 1) if x else (z := -1), z


def walrus_in_comprehension(xs):
    total = 0
    ys = [total := total + x for x in xs]
    return total, ys


@pytest.mark.parametrize("fn,args", [
    (walrus_in_while, ([0, 1, 2],)), (walrus_in_and, ([3],)), (walrus_in_and, ([],)), (walrus_in_and, ([-1],)),
    (walrus_in_ternary, (2,)), (walrus_in_ternary, (0,)), (walrus_in_comprehension, ([1, 2, 3],)),
])
def test_walrus(fn, args):
    check(fn, *args)


# -- truth values are taken once per operand, as Python's `if a and b:` does


class Truth:
    log = []

    def __init__(self, v):
        self.v = v

    def __bool__(self):
        Truth.log.append(self.v)
        return bool(self.v)


def if_and(x, y):
    if x and y:
        return 1
    return 0


def ternary_or(x, y):
    return 1 if (x or y) else 2


def not_and(x, y):
    if not (x and y):
        return 1
    return 0


@pytest.mark.parametrize("fn", [if_and, ternary_or, not_and])
@pytest.mark.parametrize("a,b", [(0, 1), (1, 0), (1, 1), (0, 0)])
def test_truth_taken_once(fn, a, b):
    Truth.log = []
    want = fn(Truth(a), Truth(b))
    plain_log = Truth.log
    Truth.log = []
    assert recompile.function(fn)(Truth(a), Truth(b)) == want
    assert Truth.log == plain_log


# -- literals, unpacking, iteration


def dict_with_none_key(k):
    return {None: "x", k: 1, **{"a": 2}}


def single_unpack(t, xs):
    n, = t.shape
    (a,) = xs
    return n, a


class Reversed(list):
    def __iter__(self):
        return iter(self[::-1])


def collect(xs):
    out = []
    for x in xs:
        out.append(x)
    return out


def collect_zip(a, b):
    out = []
    for x in zip(a, b):
        out.append(x)
    return out


def iterate_zero_dim(t):
    for x in t:
        return x
    return None


@pytest.mark.parametrize("fn,args", [
    (dict_with_none_key, (None,)), (dict_with_none_key, ("k",)),
    (single_unpack, (torch.zeros(3), [5])), (single_unpack, (torch.zeros(3), [5, 6])),
    (collect, (Reversed([1, 2, 3]),)), (collect_zip, ("ab", [1, 2, 3])), (collect, ({1: 2, 3: 4},)),
    (iterate_zero_dim, (torch.tensor(3),)), (iterate_zero_dim, (torch.arange(3),)),
])
def test_literals_and_iteration(fn, args):
    check(fn, *args)


class Tiny(int):
    pass


def tiny_default(c=Tiny(5)):
    return c, type(c).__name__


def calls_tiny_default():
    return tiny_default()


def test_default_of_an_int_subclass_keeps_its_type():
    global tiny_default
    plain = calls_tiny_default()
    saved, tiny_default = tiny_default, recompile.function(tiny_default)
    try:
        assert recompile.function(calls_tiny_default)() == plain
    finally:
        tiny_default = saved


# -- calls that mutate, and reads around them


def ident(xs):
    return xs


def setfirst(xs):
    xs[0] = 100
    return xs


def read_between_calls(xs):
    a = ident(xs)
    y = a[0]
    b = setfirst(xs)
    return y, b


class Box:
    pass


def set_v(o, v):
    setattr(o, "v", v)
    return v


def read_attr_between_calls(o):
    a = set_v(o, 1)
    b = o.v
    c = set_v(o, 2)
    return a, b, c


def test_reads_between_mutating_calls_see_python_order():
    global ident, setfirst, set_v
    plain = read_between_calls([1, 2])
    box = Box()
    plain_attr = read_attr_between_calls(box)
    saved = ident, setfirst, set_v
    ident, setfirst, set_v = (recompile.function(f) for f in saved)
    try:
        assert recompile.function(read_between_calls)([1, 2]) == plain
        assert recompile.function(read_attr_between_calls)(Box()) == plain_attr
    finally:
        ident, setfirst, set_v = saved


class Stack(list):
    @recompile.function
    def push(self, x):
        self.append(x)
        return len(self)

    @recompile.function
    def two(self):
        a = self.push(1)
        b = self[-1]
        c = self.push(2)
        return a, b, c


def test_mutating_method_of_a_list_subclass():
    assert Stack().two() == (1, 1, 2)


# -- exceptions


def first_item(xs, n):
    if n == 0:
        return next(iter(xs))
    return first_item(xs, n - 1)


def reraise(x):
    if x:
        raise
    return 1


def test_stop_iteration_keeps_its_type():
    with pytest.raises(StopIteration):
        first_item([], 1)
    with pytest.raises(StopIteration):
        recompile.function(first_item)([], 2)
    assert recompile.function(first_item)([7], 2) == 7


def test_bare_raise_reraises_the_handled_exception():
    compiled = recompile.function(reraise)
    with pytest.raises(KeyError):
        try:
            {}["k"]
        except KeyError:
            compiled(1)
    with pytest.raises(RuntimeError):
        compiled(1)


# -- classes: private names, recursion through other instances, wrappers


class Private:
    def __init__(self):
        self.__secret = 42

    def __hidden(self, n):
        return n + 1

    @recompile.function
    def get(self, n):
        self.__secret += 1
        return self.__secret + self.__hidden(n)


def test_private_names_are_mangled():
    assert Private().get(1) == 45


class Node:
    def __init__(self, v, nxt):
        self.v, self.nxt = v, nxt

    @recompile.function
    def total(self):
        if self.nxt is None:
            return self.v
        return self.v + self.nxt.total()


class ShortNode(Node):
    def total(self):
        return -1000


class Countdown:
    @recompile.function
    def __call__(self, n):
        return 0 if n == 0 else 1 + self(n - 1)


def test_recursion_through_other_instances_runs_off_the_python_stack():
    limit = sys.getrecursionlimit()
    head = None
    for i in range(20000):
        head = Node(i, head)
    assert head.total() == sum(range(20000))
    assert Node(1, ShortNode(5, None)).total() == -999  # a subclass's own method is called
    assert Countdown()(20000) == 20000
    assert sys.getrecursionlimit() == limit


def times10(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) * 10

    return wrapper


@times10
def wrapped(x):
    return x + 1


def test_a_wrapper_is_compiled_as_itself():
    assert recompile.function(wrapped)(1) == wrapped(1) == 20


def key_default(xs, key=lambda v: -v):
    return sorted(xs, key=key)


def module_global_read():
    return globals()["GLOBAL_FOR_GLOBALS"]


GLOBAL_FOR_GLOBALS = 17


def test_defaults_may_use_lambda_and_globals_is_the_module():
    check(key_default, [3, 1, 2])
    assert recompile.function(module_global_read)() == 17


def reads_locals(x):
    return locals()


def test_frame_readers_see_the_functions_variables():
    check(reads_locals, 3)


def unicode_then_yield():
    s = "ééé"; yield s  # noqa: E702


def test_offsets_count_characters():
    with pytest.raises(recompile.CompileError) as info:
        recompile.function(unicode_then_yield)
    line = info.value.text
    assert line[info.value.offset - 1:].startswith("yield s")


class Multiline:
    @recompile.function
    def text(self, x):
        s = """line1
line2"""
        return s + str(x)


def test_method_with_a_multiline_string():
    assert Multiline().text(1) == "line1\nline21"


# -- from review: evaluation order, exception identity, loops


def users_bad_generator():
    yield 1
    next(iter([]))


def consume(n):
    if n == 0:
        return list(users_bad_generator())
    return consume(n - 1)


def test_a_users_generator_stop_iteration_stays_runtime_error():
    with pytest.raises(RuntimeError, match="generator raised StopIteration"):
        recompile.function(consume)(2)


def walrus_while_else(xs):
    i = 0
    x = -1
    while (x := xs[i]) > 0:
        i += 1
    else:
        x = x * 10
    return x, i


def walrus_while_else_binds(xs):
    while (v := xs.pop()) > 2:
        pass
    else:
        w = v * 10
    return w


def walrus_while_else_with_break(xs):
    w = 0
    while (v := xs.pop()) > 2:
        if v == 4:
            break
    else:
        w = v * 10
    return w


def underscore_names_run(xs):
    __ignored = xs.append(1)
    return len(xs)


ORDER = []


def noted(v):
    ORDER.append(v)
    return v


def fstring_order():
    return f"{noted(3):{noted('02d')}}"


def huge_range():
    for i in range(10 ** 20):
        if i == 3:
            break
    return i


def loop_variables_after_loops(xs):
    ys = [last := x for x in xs]
    for i in range(3):
        for j in range(2):
            pass
    return last, j, ys


@pytest.mark.parametrize("fn,args", [
    (walrus_while_else, ([3, 2, 0, 5],)), (underscore_names_run, ([],)), (huge_range, ()),
    (walrus_while_else_binds, ([1, 0, 5, 4],)), (walrus_while_else_with_break, ([1, 0, 5, 4],)),
    (walrus_while_else_with_break, ([1, 0, 5],)),
    (loop_variables_after_loops, ([1, 2],)), (loop_variables_after_loops, ([],)),
])
def test_review_programs(fn, args):
    check(fn, *args)


def test_fstring_evaluates_value_before_spec():
    ORDER.clear()
    want = fstring_order()
    plain_order = list(ORDER)
    ORDER.clear()
    assert recompile.function(fstring_order)() == want
    assert ORDER == plain_order == [3, "02d"]


class Counted:
    def __init__(self, kids):
        self.kids = kids

    @recompile.function
    def count(self):
        total = 1
        for k in self.kids:
            total += k.count()
        return total


class Other:
    pass


def test_instance_attribute_shadows_a_compiled_method_of_another_instance():
    shadowed = Counted([])
    shadowed.count = lambda: 100
    assert Counted([shadowed, Counted([])]).count() == 102


class Caller:
    @recompile.function
    def m(self, x, xs):
        return x.m(xs[10], xs)


def test_method_lookup_comes_before_its_arguments():
    with pytest.raises(AttributeError):
        Caller().m(Other(), [1])


def put_first(xs, v):
    import operator as op  # noqa: F401 - a helper's own import is fine: it is not compiled
    op.setitem(xs, 0, v)
    return 0


def reads_after_module_mutator(xs):
    a = put_first(xs, 9)
    b = xs[0]
    c = put_first(xs, 7)
    return a, b, c


def test_module_function_mutation_is_seen():
    global put_first
    plain = reads_after_module_mutator([1])
    saved, put_first = put_first, recompile.function(_put_first_operator)
    try:
        assert recompile.function(reads_after_module_mutator)([1]) == plain == (0, 9, 0)
    finally:
        put_first = saved


def _put_first_operator(xs, v):
    operator_module.setitem(xs, 0, v)
    return 0


import operator as operator_module  # noqa: E402


def _Mangler__helper():
    return "mangled"


class Mangler:
    def m(self):
        return __helper()  # noqa: F821 - Python reads _Mangler__helper


def test_private_global_names_are_mangled_in_methods():
    assert recompile.function(Mangler.m)(Mangler()) == Mangler().m() == "mangled"


# -- second review round


def negative_literals(x):
    return (-2) ** 2, (-2) ** x, (-1.5) ** 2


def users_dunder_names(xs):
    out = []
    for x in xs:
        __seq1 = None  # noqa: F841 - shares a name the for-loop lowering once used
        __returned = x  # noqa: F841
        out.append(x)
    return out


class AttrDict(dict):
    __getattr__ = dict.__getitem__


CONFIG = AttrDict(depth=2)


def with_config_default(n, cfg=CONFIG):
    if n == 0:
        return cfg.depth
    return with_config_default(n - 1) + 1


def with_huge_default(n, m=7 ** 6000):
    if n == 0:
        return m % 1000
    return with_huge_default(n - 1)


@pytest.mark.parametrize("fn,args", [
    (negative_literals, (3,)), (users_dunder_names, ([1, 2, 3],)),
    (with_config_default, (3,)), (with_huge_default, (2,)),
])
def test_second_review_programs(fn, args):
    check(fn, *args)


def test_weirdly_named_function_compiles():
    def g(x):
        return x + 1

    g.__name__ = "class"
    g.__qualname__ = "<lambda>"
    assert recompile.function(g)(1) == 2


def take(it):
    return next(it)


def reads_iterator_between(it):
    a = take(it)
    b = 2 in it
    c = take(it)
    return a, b, c


def test_iterator_state_between_calls():
    global take
    plain = reads_iterator_between(iter([1, 2, 3, 4]))
    saved, take = take, recompile.function(take)
    try:
        assert recompile.function(reads_iterator_between)(iter([1, 2, 3, 4])) == plain == (1, True, 3)
    finally:
        take = saved


def runaway(n):
    return runaway(n + 1) + 1  # no base case


def test_runaway_recursion_ends_with_recursion_error(monkeypatch):
    monkeypatch.setattr(config, "MAX_DEPTH", 5000)
    with pytest.raises(RecursionError) as info:
        recompile.function(runaway)(0)
    assert "more compiled calls" in "".join(getattr(info.value, "__notes__", []))


def batches(n, alive):
    import weakref

    for i in range(n):
        t = [i] * 10
        alive.append(weakref.ref(Box()))  # noqa: B023
        yield t


def streamed_sum(stream):
    total = 0
    for b in stream:
        total += sum(b)
    return total


def test_for_over_a_stream_and_tensor_rows():
    assert recompile.function(streamed_sum)(batches(50, [])) == streamed_sum(batches(50, []))
    check(stack_rows, torch.arange(6).reshape(3, 2))


def stack_rows(t):
    rows = []
    for r in t:
        rows.append(r * 2)
    return torch.stack(rows)


class Vault:
    def __init__(self):
        self.__secret = 42

    def reader(self):
        def peek(obj):
            return obj.__secret

        return recompile.function(peek)(self)


def test_mangling_in_a_function_nested_in_a_method():
    assert Vault().reader() == 42
