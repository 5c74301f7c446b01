"""recompile.passes.capture: outer references become Capture ops, nested SubGraphs get no free values."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import recompile
from recompile import ir
from recompile.passes.capture import free_values

THIS = sys.modules[__name__]
CAP_OFFSET = 10
CAP_TABLE = {"a": 1, "b": 2}


# ---------------------------------------------------------------------------
# functions under test (plain; compiled inside the tests)


def cap_tree(left, right, vals, i):
    if left[i] < 0:
        return vals[i] + CAP_OFFSET
    return cap_tree(left, right, vals, left[i]) + cap_tree(left, right, vals, right[i])


def cap_nested(xs, k):
    total = 0
    best = -1
    for x in xs:
        if x > k:
            j = 0
            while j < x:
                if j % 2 == 0 and x != k + 1:
                    total = total + j * CAP_OFFSET
                else:
                    total = total - 1
                j = j + 1
            best = x if x > best else best
        elif x < 0:
            total = total + len(xs)
    return total, best


def cap_comprehension(xs, k):
    ys = [x * k + CAP_OFFSET for x in xs if x > k]
    return ys, sum(ys) if ys else -1


def cap_builtin(xs):
    return len(xs) + max(xs)


def cap_reads_global(x):
    return x + CAP_OFFSET


def make_closure(scale):
    @recompile.function
    def scaled(x):
        if x > 0:
            return x * scale
        return x - scale

    return scaled


class CapModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3, bias=False)
        self.depth_bonus = 2

    @recompile.function
    def forward(self, x, n):
        if n <= 0:
            return self.lin(x) + self.depth_bonus
        return self.forward(x, n - 1) * 0.5


def cap_module_plain(m, x, n):
    if n <= 0:
        return m.lin(x) + m.depth_bonus
    return cap_module_plain(m, x, n - 1) * 0.5


LEFT = [1, 3, -1, 5, -1, -1, -1]
RIGHT = [2, 4, -1, 6, -1, -1, -1]
VALS = [0, 1, 2, 3, 4, 5, 6]


def cap_tree_ref(left, right, vals, i):
    if left[i] < 0:
        return vals[i] + CAP_OFFSET
    return cap_tree_ref(left, right, vals, left[i]) + cap_tree_ref(left, right, vals, right[i])


@pytest.fixture
def tree(monkeypatch):
    """cap_tree compiled, its global name bound to the compiled function (as a module-level @ would)."""
    f = recompile.function(cap_tree)
    monkeypatch.setattr(THIS, "cap_tree", f)
    f.program()  # built while the global names the compiled function: the recursion is an Invoke
    return f


# ---------------------------------------------------------------------------
# no free values after capture


def _check_no_free_values(program):
    sgs = list(program.all_subgraphs())
    assert len(sgs) >= 1
    for sg in sgs:
        assert free_values(sg) == [], (sg.name, free_values(sg))


def _check_arity(program):
    for sg in program.all_subgraphs():
        for op in sg.ops:
            if isinstance(op, ir.Cond):
                assert len(op.then_sg.inputs) == len(op.else_sg.inputs) == len(op.args)
                assert len(op.then_sg.outputs) == len(op.else_sg.outputs) == len(op.outputs)
            elif isinstance(op, ir.While):
                n = len(op.loop_vars) + len(op.invariants)
                assert len(op.cond_sg.inputs) == len(op.body_sg.inputs) == n
                assert len(op.body_sg.outputs) == len(op.loop_vars) == len(op.outputs)
                assert len(op.cond_sg.outputs) == 1


def test_recursive_tree_has_no_free_values_after_capture(tree):
    program = tree.program("capture")
    assert any(isinstance(op, ir.Invoke) for sg in program.all_subgraphs() for op in sg.ops)
    _check_no_free_values(program)
    _check_arity(program)
    assert tree(LEFT, RIGHT, VALS, 0) == cap_tree_ref(LEFT, RIGHT, VALS, 0)


CASES = [
    (cap_nested, [([3, -1, 5, 0, 2], 1), ([], 0), ([7, 8], 6)]),
    (cap_comprehension, [([3, -1, 5, 0, 2], 1), ([], 0)]),
    (cap_builtin, [([3, 1, 2],)]),
    (cap_reads_global, [(5,)]),
]


@pytest.mark.parametrize("fn, calls", CASES, ids=[fn.__name__ for fn, _ in CASES])
def test_no_free_values_after_capture(fn, calls):
    f = recompile.function(fn)
    program = f.program("capture")
    _check_no_free_values(program)
    _check_arity(program)
    for args in calls:
        assert f(*args) == fn(*args)


def test_closure_and_method_have_no_free_values_after_capture():
    _check_no_free_values(make_closure(3).program("capture"))
    _check_no_free_values(CapModule.forward.program("capture"))
    _check_arity(CapModule.forward.program("capture"))


def test_frontend_branches_read_outer_values(tree):
    program = tree.program("frontend")
    func = program.subgraphs[tree.ir_name]
    assert free_values(func) == []  # the function itself reads only its inputs
    nested = [sg for sg in program.all_subgraphs() if sg is not func]
    assert nested and all(sg.inputs == [] for sg in nested)  # branches have no inputs yet
    with_free = {sg.name: free_values(sg) for sg in nested if free_values(sg)}
    assert with_free
    # every free value of a frontend branch is an input of the function
    for values in with_free.values():
        assert set(values) <= set(func.inputs)
    # the else branch (two recursive calls) reads all four parameters
    else_sg = next(sg for sg in nested if sg.kind == "else")
    assert set(free_values(else_sg)) == set(func.inputs)


def test_frontend_loops_read_outer_values():
    f = recompile.function(cap_nested)
    frontend = [sg for sg in f.program("frontend").all_subgraphs() if free_values(sg)]
    kinds = {sg.kind for sg in frontend}
    assert {"cond", "body"} <= kinds  # while predicate and body read values they do not define
    assert "; invariant " not in f.dump(stage="frontend")
    assert "; invariant " in f.dump(stage="capture")


def test_capture_threads_values_through_cond_args(tree):
    program = tree.program("capture")
    func = program.subgraphs[tree.ir_name]
    cond = next(op for op in func.ops if isinstance(op, ir.Cond))
    assert set(cond.args) == set(func.inputs)  # the branches get what they read, from the parent
    assert set(cond.else_sg.inputs).isdisjoint(func.inputs)  # as their own new inputs


def test_frontend_stage_is_not_modified_by_capture(tree):
    tree.program("capture")
    text = tree.dump(stage="frontend")
    assert "capture free 'CAP_OFFSET'" in text
    assert "capture global" not in text
    for sg in tree.program("frontend").all_subgraphs():
        if sg.kind != "function":
            assert sg.inputs == []


# ---------------------------------------------------------------------------
# kinds of Capture


def _captures(program):
    return [op for sg in program.all_subgraphs() for op in sg.ops if isinstance(op, ir.Capture)]


def test_global_becomes_capture_global(tree):
    frontend = [c for c in _captures(tree.program("frontend")) if c.name == "CAP_OFFSET"]
    captured = [c for c in _captures(tree.program("capture")) if c.name == "CAP_OFFSET"]
    assert [c.source_kind for c in frontend] == ["free"]
    assert [c.source_kind for c in captured] == ["global"]
    assert captured[0].source is THIS.__dict__  # the module's globals, read at run time
    assert "capture global 'CAP_OFFSET'" in tree.dump(stage="capture")


def test_builtin_name_becomes_capture_global_and_falls_back_to_builtins():
    f = recompile.function(cap_builtin)
    names = {c.name: c.source_kind for c in _captures(f.program("capture"))}
    assert names == {"len": "global", "max": "global"}
    assert f([4, 9, 1]) == cap_builtin([4, 9, 1]) == 12


def test_closure_variable_becomes_capture_closure():
    f = make_closure(3)
    text = f.dump(stage="capture")
    assert "capture closure 'scale'" in text
    assert "capture free 'scale'" in f.dump(stage="frontend")
    caps = [c for c in _captures(f.program("capture")) if c.name == "scale"]
    assert len(caps) == 2  # read in both branches
    cells = dict(zip(f.python.__code__.co_freevars, f.python.__closure__))
    assert all(c.source_kind == "closure" and c.source is cells["scale"] for c in caps)
    assert f(2) == 6 and f(-2) == -5


def test_self_attribute_becomes_capture_attr():
    m = CapModule()
    x = torch.randn(2, 3)
    assert torch.equal(m(x, 2), cap_module_plain(m, x, 2))
    program = CapModule.forward.program("capture")
    attrs = [c for c in _captures(program) if c.source_kind == "attr"]
    assert sorted(c.name for c in attrs) == ["self.depth_bonus", "self.lin"]
    for c in attrs:
        assert isinstance(c.base, ir.Value) and c.base.is_self
    text = CapModule.forward.dump(stage="capture")
    assert "capture attr 'self.lin' of %self" in text
    assert "capture attr 'self.depth_bonus' of %self" in text
    frontend = CapModule.forward.dump(stage="frontend")
    assert "call getattr(%self, 'lin')" in frontend
    assert "capture attr" not in frontend
    # the recursive self.forward(...) is an Invoke, not an attribute read
    assert f"invoke @{CapModule.forward.ir_name}(" in text


def test_self_attr_read_each_call():
    m = CapModule()
    x = torch.randn(2, 3)
    first = m(x, 1)
    m.depth_bonus = 100
    with torch.no_grad():
        m.lin.weight.mul_(2)
    second = m(x, 1)
    assert torch.equal(second, cap_module_plain(m, x, 1))
    assert not torch.equal(first, second)
    assert CapModule.forward.stats["builds"] == 1


# ---------------------------------------------------------------------------
# read at run time: rebinding between calls is seen


def test_global_rebound_between_calls_is_seen(monkeypatch):
    f = recompile.function(cap_reads_global)
    assert f(1) == 1 + CAP_OFFSET
    monkeypatch.setattr(THIS, "CAP_OFFSET", 1000)
    assert f(1) == 1001
    monkeypatch.setattr(THIS, "CAP_OFFSET", -5)
    assert f(1) == -4
    assert f.stats["builds"] == 1


def test_global_rebound_seen_inside_recursion(tree, monkeypatch):
    before = tree(LEFT, RIGHT, VALS, 0)
    monkeypatch.setattr(THIS, "CAP_OFFSET", 0)
    assert tree(LEFT, RIGHT, VALS, 0) == cap_tree_ref(LEFT, RIGHT, VALS, 0) == sum(VALS[i] for i in (2, 4, 5, 6))
    assert before != tree(LEFT, RIGHT, VALS, 0)
    assert tree.stats["builds"] == 1


def test_global_deleted_raises_name_error(monkeypatch):
    f = recompile.function(cap_reads_global)
    monkeypatch.delattr(THIS, "CAP_OFFSET")
    with pytest.raises(NameError, match="CAP_OFFSET"):
        f(1)
    with pytest.raises(NameError, match="CAP_OFFSET"):
        cap_reads_global(1)


def test_closure_rebound_between_calls_is_seen():
    offset = 1

    @recompile.function
    def add_offset(x):
        return x + offset

    assert add_offset(1) == 2
    offset = 41
    assert add_offset(1) == 42
    assert add_offset.stats["builds"] == 1
