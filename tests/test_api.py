"""recompile.api: the decorator, CompiledFunction (calling, binding, inspecting) and recompile.dump."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

import recompile
from recompile import ir
import types

from recompile.api import CompiledFunction

# ---------------------------------------------------------------------------
# functions under test


def api_sig(a, b=2, *args, c, d=4, **kw):
    """Returns what it was given."""
    return (a, b, args, c, d, sorted(kw.items()))


def api_posonly(a, b, /, c=3):
    return a * 100 + b * 10 + c


def api_kwonly(x, *, scale=2, shift):
    if x > 0:
        return x * scale + shift
    return x - shift


def api_tree(left, right, vals, i):
    """Sum of the values at the leaves."""
    if left[i] < 0:
        return vals[i]
    return api_tree(left, right, vals, left[i]) + api_tree(left, right, vals, right[i])


def api_recursive():
    @recompile.function
    def tree(left, right, vals, i):
        if left[i] < 0:
            return vals[i]
        return tree(left, right, vals, left[i]) + tree(left, right, vals, right[i])

    return tree


def _depth(self, x, n):
    if n <= 0:
        return self.lin(x) * self.scale
    return self.depth(x, n - 1) + 1


class ApiPlain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.scale = 2.0

    depth = _depth


class ApiCompiled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.scale = 2.0

    depth = recompile.function(_depth)


class ApiDecorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 5

    @recompile.function
    def count(self, n):
        """Counts down."""
        if n <= 0:
            return self.k
        return self.count(n - 1) + 1


LEFT = [1, 3, -1, 5, -1, -1, -1]
RIGHT = [2, 4, -1, 6, -1, -1, -1]
VALS = [0, 1, 2, 3, 4, 5, 6]


def _error(fn, *args, **kwargs):
    with pytest.raises(TypeError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------------------
# the decorator and its options


def test_bare_decorator():
    f = recompile.function(api_kwonly)
    assert isinstance(f, CompiledFunction)
    assert f.mode == "batched"  # the default
    assert f(3, shift=1) == api_kwonly(3, shift=1)


def test_decorator_with_mode_sequential():
    deco = recompile.function(mode="sequential")
    f = deco(api_kwonly)
    assert isinstance(f, CompiledFunction) and f.mode == "sequential"
    g = recompile.function(api_kwonly, mode="sequential")
    for x in (-2, 0, 3):
        assert f(x, shift=1) == g(x, shift=1) == api_kwonly(x, shift=1)
    assert "mode=sequential" in repr(f)


def test_decorator_syntax_in_a_function_body():
    @recompile.function
    def bare(x):
        return x + 1

    @recompile.function(mode="sequential")
    def with_mode(x):
        return x + 2

    assert bare(1) == 2 and with_mode(1) == 3
    assert isinstance(bare, CompiledFunction) and isinstance(with_mode, CompiledFunction)


@pytest.mark.parametrize("options", [{"batch": True}, {"mode": "sequential", "workers": 4}, {"Mode": "x"}])
def test_unknown_option_raises_type_error(options):
    bad = sorted(set(options) - {"mode"})
    with pytest.raises(TypeError) as info:
        recompile.function(**options)
    assert all(name in str(info.value) for name in bad)
    with pytest.raises(TypeError):
        recompile.function(api_kwonly, **options)


@pytest.mark.parametrize("mode", ["threads", "", "Sequential", "Batched", None])
def test_unknown_mode_raises_value_error(mode):
    with pytest.raises(ValueError) as info:
        @recompile.function(mode=mode)
        def f(x):
            return x
    assert repr(mode) in str(info.value)
    with pytest.raises(ValueError):
        recompile.function(api_kwonly, mode=mode)


@pytest.mark.parametrize("obj", [len, 42, "f", ApiPlain, functools.partial(api_kwonly, 1)],
                         ids=["builtin", "int", "str", "class", "partial"])
def test_not_a_function_raises_type_error(obj):
    with pytest.raises(TypeError):
        recompile.function(obj)


# ---------------------------------------------------------------------------
# calling: arguments bound exactly as Python does


SIG_CALLS = [
    ((1,), {"c": 3}),
    ((1, 5, 6, 7), {"c": 3, "d": 0, "z": 9}),
    ((), {"a": 1, "c": 2}),
    ((1,), {"c": 2, "b": 7, "extra": 1}),
]

SIG_WRONG = [
    ((), {}),  # missing a and c
    ((1,), {}),  # missing keyword-only c
    ((1,), {"c": 2, "a": 3}),  # a twice
    ((1, 2), {"b": 3, "c": 1}),  # b twice
]

POSONLY_WRONG = [
    ((1,), {}),
    ((1, 2, 3, 4), {}),
    ((), {"a": 1, "b": 2}),  # positional-only passed by keyword
    ((1, 2), {"d": 4}),
    ((1, 2), {"c": 1, "x": 0}),
]


@pytest.mark.parametrize("args, kwargs", SIG_CALLS)
def test_defaults_varargs_and_keyword_only(args, kwargs):
    f = recompile.function(api_sig)
    assert f(*args, **kwargs) == api_sig(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs", [((1, 2), {}), ((1, 2, 9), {}), ((1, 2), {"c": 0})])
def test_positional_only(args, kwargs):
    f = recompile.function(api_posonly)
    assert f(*args, **kwargs) == api_posonly(*args, **kwargs)


@pytest.mark.parametrize("fn, args, kwargs", [(api_sig, a, k) for a, k in SIG_WRONG]
                         + [(api_posonly, a, k) for a, k in POSONLY_WRONG]
                         + [(api_kwonly, (1,), {}), (api_kwonly, (1, 2), {"shift": 0}),
                            (api_kwonly, (), {"shift": 0}), (api_kwonly, (1,), {"shift": 0, "bogus": 1})])
def test_wrong_call_raises_pythons_type_error(fn, args, kwargs):
    f = recompile.function(fn)
    assert _error(f, *args, **kwargs) == _error(fn, *args, **kwargs)


def test_keyword_only_defaults():
    f = recompile.function(api_kwonly)
    for x in (-3, 0, 4):
        for kw in ({"shift": 1}, {"shift": 1, "scale": 10}, {"scale": -1, "shift": 0}):
            assert f(x, **kw) == api_kwonly(x, **kw)


def test_signature_is_the_original():
    f = recompile.function(api_sig)
    assert inspect.signature(f) == inspect.signature(api_sig)


# ---------------------------------------------------------------------------
# methods


def test_method_bound_through_the_descriptor():
    m = ApiCompiled()
    bound = m.depth
    assert isinstance(bound, types.MethodType)  # a method like any other: signature, ==, pickling
    assert bound.__self__ is m
    assert bound.__func__ is ApiCompiled.__dict__["depth"]
    assert ApiCompiled.depth is ApiCompiled.__dict__["depth"]  # from the class: the function itself
    assert bound == m.depth
    assert list(inspect.signature(bound).parameters) == list(inspect.signature(ApiPlain().depth).parameters)
    x = torch.randn(4, 3)
    p = ApiPlain()
    for n in (0, 1, 3):
        assert torch.equal(m.depth(x, n), p.depth(x, n))
    assert ApiCompiled.depth.stats["builds"] == 1


@recompile.function
def api_plain_fn_compiled(x):
    return x + 1


def test_copies_share_and_pickle_finds_the_compiled_function():
    import copy
    import pickle

    assert copy.copy(api_plain_fn_compiled) is api_plain_fn_compiled
    assert copy.deepcopy({"f": api_plain_fn_compiled})["f"] is api_plain_fn_compiled
    assert pickle.loads(pickle.dumps(api_plain_fn_compiled)) is api_plain_fn_compiled


def test_method_decorated_in_class_body():
    m = ApiDecorated()
    assert m.count(3) == 8
    m.k = 0
    assert m.count(2) == 2
    program = ApiDecorated.count.program()
    assert any(isinstance(op, ir.Invoke) for sg in program.all_subgraphs() for op in sg.ops)
    assert ApiDecorated.count.__doc__ == "Counts down."


def test_unbound_call_through_the_class():
    m, p = ApiCompiled(), ApiPlain()
    x = torch.randn(2, 3)
    for n in (0, 2):
        assert torch.equal(ApiCompiled.depth(m, x, n), ApiPlain.depth(p, x, n))
    d = ApiDecorated()
    assert ApiDecorated.count(d, 4) == d.count(4) == 9


def test_unbound_call_runs_the_bound_program():
    class ApiUnbound(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 1

        @recompile.function
        def down(self, n):
            if n <= 0:
                return self.k
            return self.down(n - 1) + 1

    m = ApiUnbound()
    assert m.down(3) == 4
    assert ApiUnbound.down(m, 3) == 4
    assert ApiUnbound.down.stats["builds"] == 1
    assert ApiUnbound.down.stats["calls"] == 2


def test_method_wrong_call_has_pythons_message():
    m, p = ApiCompiled(), ApiPlain()
    x = torch.randn(1, 3)
    for args, kwargs in [((), {}), ((x,), {}), ((x, 1, 2), {}), ((x,), {"m": 1}), ((x, 1), {"n": 1})]:
        assert _error(m.depth, *args, **kwargs) == _error(p.depth, *args, **kwargs)


# ---------------------------------------------------------------------------
# built once


def test_built_once_across_calls_with_different_inputs():
    f = api_recursive()
    assert f.stats["builds"] == 0  # nothing is built before the first call
    for n in range(20):
        size = n % 7
        left = [1, -1, -1] if size else [-1]
        right = [2, -1, -1] if size else [-1]
        vals = torch.randn(3 if size else 1, size + 1, dtype=torch.float64) if n % 2 else list(range(3))
        got = f(left, right, vals, 0)
        want = api_tree(left, right, vals, 0)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want
    assert f.stats["builds"] == 1
    assert f.stats["calls"] == 20


def test_built_once_for_keyword_and_default_variations():
    f = recompile.function(api_kwonly)
    f(1, shift=0)
    f(-1, shift=3, scale=5)
    f(x=2, shift=1)
    assert f.stats["builds"] == 1 and f.stats["calls"] == 3


# ---------------------------------------------------------------------------
# the wrapper looks like the original


def test_python_attribute_is_the_original():
    f = recompile.function(api_tree)
    assert f.python is api_tree
    assert f.python(LEFT, RIGHT, VALS, 0) == 4 + 5 + 6 + 2


def test_functools_metadata():
    f = recompile.function(api_tree)
    assert f.__name__ == "api_tree"
    assert f.__qualname__ == "api_tree"
    assert f.__doc__ == "Sum of the values at the leaves."
    assert f.__module__ == __name__
    assert f.__wrapped__ is api_tree
    assert inspect.unwrap(f) is api_tree
    m = recompile.function(_depth)
    assert m.__name__ == "_depth" and m.__doc__ is None


# ---------------------------------------------------------------------------
# inspecting: program, dump, source


def test_stages():
    assert recompile.STAGES == ["frontend", "capture", "prune", "accumulate", "fresh", "unpack", "fusion", "grad"]


@pytest.mark.parametrize("stage", recompile.STAGES)
@pytest.mark.parametrize("format", ["text", "dot"])
def test_module_dump_equals_method_dump(stage, format):
    f = api_recursive()
    assert recompile.dump(f, stage=stage, format=format) == f.dump(stage=stage, format=format)
    assert recompile.dump(f, stage, format) == f.dump(stage, format)


def test_dump_defaults():
    f = api_recursive()
    assert recompile.dump(f) == f.dump() == f.dump(stage="capture", format="text")
    assert f.dump().startswith(f"# program, entry @{f.ir_name}")
    assert f.dump(format="dot").startswith("digraph")
    program = f.program()
    assert isinstance(program, ir.Program) and program.entry == f.ir_name
    assert program.to_text() == f.dump()


def test_dump_of_a_method():
    text = ApiDecorated.count.dump()
    assert f"subgraph @{ApiDecorated.count.ir_name}(%self, %n)" in text
    assert "capture attr 'self.k'" in text
    assert ApiDecorated().count.dump() == text  # through a bound method too


@pytest.mark.parametrize("stage", ["", "Capture", "codegen", "Grad", None])
def test_invalid_stage_raises_value_error(stage):
    f = api_recursive()
    with pytest.raises(ValueError, match="stage"):
        f.dump(stage=stage)
    with pytest.raises(ValueError, match="stage"):
        f.program(stage)
    with pytest.raises(ValueError, match="stage"):
        recompile.dump(f, stage=stage)


@pytest.mark.parametrize("format", ["svg", "TEXT", "", None, "json"])
def test_invalid_format_raises_value_error(format):
    f = api_recursive()
    with pytest.raises(ValueError, match="format"):
        f.dump(format=format)
    with pytest.raises(ValueError, match="format"):
        recompile.dump(f, format=format)


def test_source_is_the_generated_python():
    f = api_recursive()
    source = f.source()
    assert source.startswith("def ")
    assert "yield" in source
    compile(source, "<generated>", "exec")
    assert f.stats["builds"] == 1  # inspecting builds (once) ...
    f(LEFT, RIGHT, VALS, 0)
    assert f.stats["builds"] == 1  # ... and calling does not build again


# ---------------------------------------------------------------------------
# lambdas: compiled as the def they stand for, found in their file wherever they sit

LAMBDAS = {"twice": lambda x: x * 2,
           "sign": lambda x: (x if x.sum() > 0
                              else -x)}
SIDE_BY_SIDE = (lambda x: x - 1), (lambda x: x + 5)
CURRIED = lambda a: lambda x: x * a  # noqa: E731


@pytest.mark.parametrize("fn", [LAMBDAS["twice"], LAMBDAS["sign"], SIDE_BY_SIDE[0], SIDE_BY_SIDE[1],
                                CURRIED, CURRIED(3.0)], ids=["dict-entry", "two-lines", "first", "second",
                                                            "outer", "inner"])
@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_a_lambda_compiles_as_the_def_it_stands_for(fn, mode):
    x = torch.tensor([-1.0, 0.5])
    want = fn(x)
    got = recompile.function(fn, mode=mode)(x)
    if callable(want):  # (the outer lambda returns a function: compare what each makes)
        want, got = want(x), got(x)
    assert torch.equal(got, want)


def test_a_lambda_whose_source_is_gone_is_a_compile_error(tmp_path):
    scope = {}
    exec(compile("f = lambda x: x + 1\n", str(tmp_path / "gone.py"), "exec"), scope)
    with pytest.raises(recompile.CompileError, match="cannot read the source of <lambda>"):
        recompile.function(scope["f"])
