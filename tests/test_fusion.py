"""The fusion pass (passes/fusion.py) and how fused ops run (codegen/fused.py, batch_rules.fused).

Layout
  1. which ops the pass groups, and which it must leave apart
  2. the fused program printed (``dump --stage fusion``), the option, the gradient program
  3. differential: fused vs unfused vs eager, values and gradients, sequential and batched
  4. the batch rule: one call when broadcasting means the same per instance, members otherwise
  5. a rebound callable, errors at the member's line, the compile backend
"""

from __future__ import annotations

import operator
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

import recompile
from recompile import ir
from recompile.codegen import fused as fused_kernels
from recompile.ops.facts import FUSIBLE
from recompile.passes.fusion import unfuse
from source_lines import marker

F64 = torch.float64
MODES = ("sequential", "batched")
FUSIONS = (False, "python")


def fused_ops(fn, stage="fusion"):
    program = fn.program(stage)
    return [op for sg in program.all_subgraphs() for op in sg.ops if isinstance(op, ir.Fused)]


def members(op):
    return [m.fn.value.__name__ if isinstance(m.fn, ir.Const) else op.callables[op.body.inputs.index(m.fn)].__name__
            for m in op.body.ops]


# ---------------------------------------------------------------------------
# 1. grouping
# ---------------------------------------------------------------------------

def lstm_cell(i, u, f, o, c0):
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f) * c0
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def test_lstm_cell_is_one_fused_op_with_both_results_as_outputs():
    f = recompile.function(lstm_cell)
    (op,) = fused_ops(f)
    assert members(op) == ["sigmoid", "tanh", "mul", "sigmoid", "mul", "add", "sigmoid", "tanh", "mul"]
    # c is needed outside (it is returned), so it is an output, computed once, not recomputed
    assert [v.hint for v in op.outputs] == ["c", "h"]
    assert len(op.body.outputs) == 2
    assert set(op.callables.values()) == {torch.sigmoid, torch.tanh}


def two_chains(x, y):
    a = torch.exp(x) + 1
    n = a.sum()  # not elementwise, and it reads a member's result: the chain stops at a
    b = torch.relu(y) * n
    return a, b


def test_a_use_between_members_splits_the_group():
    f = recompile.function(two_chains)
    ops = fused_ops(f)
    assert [members(op) for op in ops] == [["exp", "add"], ["relu", "mul"]]


def scale_in_place(t):
    t.mul_(3)


def mutation_between(x, y):
    a = torch.sigmoid(x)
    x.add_(1)  # a member moved past this would read the changed x
    return a * y


def helper_mutation_between(x, y):
    a = torch.exp(x)
    scale_in_place(x)  # the same, out of sight in a helper
    return a + y


def inplace_kwarg_between(x, y):
    a = torch.exp(x)
    F.relu(x, inplace=True)
    return a + y


def effect_between(x, y, z):
    a = x * y  # raises on bad shapes: before the print, as in Python
    print("after a")
    return a + z


def raise_between(x, y, s):
    a = torch.exp(x) * y
    n = int(s)  # raises its own error first
    return a + n


@pytest.mark.parametrize("fn", [mutation_between, helper_mutation_between, inplace_kwarg_between])
@pytest.mark.parametrize("mode", MODES)
def test_no_member_moves_past_a_state_change(fn, mode):
    f = recompile.function(fn, mode=mode)
    assert fused_ops(f) == []
    x, y = torch.randn(3), torch.randn(3)
    want = fn(x.clone(), y)
    with torch.no_grad():
        torch.testing.assert_close(f(x.clone(), y), want)


@pytest.mark.parametrize("mode", MODES)
def test_effects_and_errors_keep_their_order(mode, capsys):
    f = recompile.function(effect_between, mode=mode)
    assert fused_ops(f) == []
    with pytest.raises(RuntimeError), torch.no_grad():
        f(torch.randn(3), torch.randn(4), torch.randn(3))
    assert capsys.readouterr().out == ""
    g = recompile.function(raise_between, mode=mode)
    assert [members(op) for op in fused_ops(g)] == [["exp", "mul"]]  # not across int(s)
    with pytest.raises(ValueError), torch.no_grad():
        g(torch.randn(3), torch.randn(3), "x")


def helper(t):
    return t * 2


def call_between(x, y):
    a = torch.tanh(x)
    z = helper(y)  # a call between members: it might change x, so tanh may not move past it
    return a * z


def kw_and_unknown(x, y, act):
    a = torch.add(x, y, alpha=2)  # keyword arguments: not fused
    b = act(a) * 2  # a callable known only at run time: not fused
    return x.sigmoid() * b  # a Tensor method: not fused, and the two * may not move past it


def single(x):
    return torch.tanh(x)


def test_what_stays_unfused():
    assert fused_ops(recompile.function(kw_and_unknown)) == []
    assert fused_ops(recompile.function(single)) == []
    assert fused_ops(recompile.function(call_between)) == []


def nested(xs, k):
    total = torch.zeros(())
    for x in xs:
        if k > 0:
            total = total + torch.sigmoid(x) * 2
        else:
            total = total - torch.tanh(x) * torch.exp(x)
    return total


def test_fuses_inside_loops_and_branches():
    f = recompile.function(nested)
    assert sorted(map(tuple, map(members, fused_ops(f)))) == [("sigmoid", "mul", "add"),
                                                             ("tanh", "exp", "mul", "sub")]


def test_fusible_ops_are_elementwise():
    x, y = torch.randn(4, 3), torch.randn(3)
    for fn in FUSIBLE:
        if fn is torch.where:
            out = fn(x > 0, x, y)
        else:
            try:
                out = fn(x)
            except TypeError:  # a binary op
                out = fn(x, y)
        assert out.shape == (4, 3), fn


# ---------------------------------------------------------------------------
# 2. printing, the option, the gradient program
# ---------------------------------------------------------------------------

def printed(x, y):
    a = torch.sigmoid(x)  # L:a
    b = a * y  # L:b
    return b


def test_dump_shows_the_fused_op_and_its_members_with_their_lines():
    f = recompile.function(printed)
    text = f.dump(stage="fusion")
    name = f"{f.ir_name}.fused1"
    here = "test_fusion.py"
    assert f"%b = fused[python] @{name}(%sigmoid, %x, %y)  # {here}:{marker(printed, 'b')}" in text
    assert f"subgraph @{name}(" in text
    assert f"call %sigmoid.1(%x.1)  # {here}:{marker(printed, 'a')}" in text
    assert f"= call mul(%sigmoid.2, %y.1)  # {here}:{marker(printed, 'b')}" in text
    assert "fused" not in f.dump(stage="capture")
    dot = f.dump(stage="fusion", format="dot")
    assert "fused[python]" in dot and "\\l  %sigmoid" in dot
    assert "fused[compile]" in recompile.function(printed, fusion="compile").dump()


def test_cli_dump_stage_fusion(capsys):
    from recompile import cli
    target = f"{__file__}:printed"
    assert cli.main(["dump", target, "--stage", "fusion"]) in (0, None)
    assert "fused[python]" in capsys.readouterr().out


def test_fusion_option():
    assert fused_ops(recompile.function(printed, fusion=False)) == []
    assert fused_ops(recompile.function(printed, fusion=True))[0].backend == "python"
    assert fused_ops(recompile.function(printed, fusion="compile"))[0].backend == "compile"
    assert recompile.function(printed).fusion == "python"
    with pytest.raises(ValueError, match="unknown fusion 'gpu'"):
        recompile.function(printed, fusion="gpu")


def test_gradient_program_is_derived_from_the_members():
    f = recompile.function(lstm_cell, mode="sequential")
    assert fused_ops(f) and not fused_ops(f, stage="grad")
    sg = f.program("fusion").subgraphs[f.ir_name]
    plain = unfuse(sg)
    assert not any(isinstance(op, ir.Fused) for op in plain.ops)
    muls = [op for op in plain.ops if isinstance(op, ir.Call) and isinstance(op.fn, ir.Const)
            and op.fn.value is operator.mul]
    assert len(muls) == 3 and muls[-1].output in plain.outputs[0].op.args  # h = ... * ..., returned
    assert any(isinstance(op, ir.Fused) for op in sg.ops)  # unfuse works on a copy


# ---------------------------------------------------------------------------
# 3. differential
# ---------------------------------------------------------------------------

def tree_cell(tree, i, w):
    """A Tree-LSTM-like recursion: leaves and internal nodes each end in an elementwise chain."""
    if tree[i] is None:
        x = w[i % w.shape[0]]
        c = torch.sigmoid(x) * torch.tanh(x + 1)
        return torch.tanh(c) * torch.sigmoid(-x), c
    hl, cl = tree_cell(tree, tree[i][0], w)
    hr, cr = tree_cell(tree, tree[i][1], w)
    g = hl @ w[:4].T
    c = torch.sigmoid(g[:3]) * cl + torch.sigmoid(hr) * cr - torch.relu(g[:3]) / 3
    return torch.tanh(c) * torch.sigmoid(hl + hr), c


TREE = {0: (1, 2), 1: (3, 4), 2: None, 3: None, 4: (5, 6), 5: None, 6: None}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_tree_recursion_matches_eager(mode, fusion):
    f = recompile.function(tree_cell, mode=mode, fusion=fusion)  # the global tree_cell is recursion
    # the leaf's chain is one op; the node's is two: the second g[:3] may not be passed
    assert len(fused_ops(f)) == (3 if fusion else 0)
    w = torch.randn(5, 3, dtype=F64, requires_grad=True)
    h, c = f(TREE, 0, w)
    (gw,) = torch.autograd.grad(h.sum() + c.sum() * 2, w)
    h0, c0 = tree_cell(TREE, 0, w)
    (gw0,) = torch.autograd.grad(h0.sum() + c0.sum() * 2, w)
    torch.testing.assert_close((h, c, gw), (h0, c0, gw0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fusion", FUSIONS)
def test_lstm_cell_values_and_gradients(mode, fusion):
    f = recompile.function(lstm_cell, mode=mode, fusion=fusion)
    args = [torch.randn(4, 6, dtype=F64, requires_grad=True) for _ in range(5)]
    h, c = f(*args)
    grads = torch.autograd.grad(h.sum() + (c * c).sum(), args)
    h0, c0 = lstm_cell(*args)
    grads0 = torch.autograd.grad(h0.sum() + (c0 * c0).sum(), args)
    torch.testing.assert_close((h, c), (h0, c0))
    torch.testing.assert_close(grads, grads0)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_vmap_of_lstm_cell(fusion):
    f = recompile.function(lstm_cell, fusion=fusion)
    f.stats.reset()
    args = [torch.randn(7, 6, dtype=F64, requires_grad=True) for _ in range(5)]
    h, c = recompile.vmap(f)(*args)
    h0, c0 = lstm_cell(*args)
    torch.testing.assert_close((h, c), (h0, c0))
    torch.testing.assert_close(torch.autograd.grad(h.sum(), args), torch.autograd.grad(h0.sum(), args))
    assert f.stats["per_instance"] == {}


@pytest.mark.parametrize("fusion", FUSIONS)
def test_nested_control_flow_matches_eager(fusion):
    xs = [torch.randn(3, dtype=F64) for _ in range(4)]
    for mode in MODES:
        f = recompile.function(nested, mode=mode, fusion=fusion)
        for k in (1, -1):
            torch.testing.assert_close(f(xs, k), nested(xs, k))


def dead_chain(x, y):
    unused = torch.sigmoid(x) * y + 0.1  # a fused op whose result nothing reads
    return x * 2


def dead_chain_in_branch(x, y):
    if x.sum() > 0:
        scaled = torch.sigmoid(x) * 2.0  # not read after the if: the prune pass drops it, fusion keeps the op
        out = x + y
    else:
        out = x - y
    return out


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("fn", [dead_chain, dead_chain_in_branch])
def test_a_fused_chain_nothing_reads_still_runs_and_returns_nothing(fn, fusion):
    f = recompile.function(fn, fusion=fusion)
    if fusion:
        assert any(not op.outputs for op in fused_ops(f))
    xs = torch.randn(6, 3, dtype=F64)
    xs[::2] = -xs[::2].abs()
    ys = torch.randn(6, 3, dtype=F64)
    torch.testing.assert_close(recompile.vmap(f)(xs, ys), torch.stack([fn(x, y) for x, y in zip(xs, ys)]))
    if fn is dead_chain:  # its members still run: their shape error is still raised
        with pytest.raises(RuntimeError):
            recompile.vmap(f)(xs, torch.randn(6, 4, dtype=F64))


# ---------------------------------------------------------------------------
# 4. the batch rule
# ---------------------------------------------------------------------------

def scaled(x, w):
    return torch.sigmoid(x) * w + torch.tanh(x)


@pytest.mark.parametrize("case", ["same_rank", "shared_higher_rank", "mixed_dtype", "numbers", "lower_rank"])
def test_batch_rule_against_per_instance(case):
    n = 5
    x = torch.randn(n, 3, dtype=F64)
    w = {"same_rank": torch.randn(3, dtype=F64),
         "shared_higher_rank": torch.randn(2, 3, dtype=F64),  # per instance it broadcasts x up to rank 2
         "mixed_dtype": torch.tensor(0.5, dtype=torch.float32),  # a 0-d tensor gives way to x's dtype
         "numbers": 3,
         "lower_rank": torch.randn(3, dtype=F64)}[case]
    in_dims = (0, None)
    if case == "lower_rank":  # batched instances of rank 0 against a shared rank-1 tensor
        x = torch.randn(n, dtype=F64)
    f = recompile.function(scaled)
    f.stats.reset()
    got = recompile.vmap(f, in_dims=in_dims)(x, w)
    want = torch.stack([scaled(x[k], w) for k in range(n)])
    torch.testing.assert_close(got, want)
    assert got.dtype == want.dtype


def kernels(f):
    """The fused kernels of ``f``'s batched code, each counting how often its members ran one by one."""
    code = f.build_for(None).batched_code
    found = [v for v in code.entry.__globals__.values() if isinstance(v, fused_kernels.FusedKernel)]
    for kernel in found:
        kernel.member_runs = 0

        def counted(*args, _members=kernel.batched, _kernel=kernel):
            _kernel.member_runs += 1
            return _members(*args)

        kernel.batched = counted
    return found


def sums(a, b):
    return a * 2 + b


def sums_item(a, b):
    s = (a.sum() * b).item()  # a Python number per instance: no tensor to call the kernel on
    return a * 2 + s * a


@pytest.mark.parametrize("b, one_call", [(1, True), (torch.ones(3, dtype=F64), True),
                                         (torch.nn.Parameter(torch.ones(3, dtype=F64)), True),
                                         (torch.ones(2, 3, dtype=F64), False), ("item", False),
                                         (torch.ones(3, dtype=torch.float32), False)])
def test_which_path_the_batch_rule_takes(b, one_call):
    f = recompile.function(sums_item if isinstance(b, str) else sums)
    b = 1 if isinstance(b, str) else b
    (kernel,) = kernels(f)
    a = torch.randn(4, 3, dtype=F64)
    got = recompile.vmap(f, in_dims=(0, None))(a, b)
    want = torch.stack([f.python(a[k], b) for k in range(4)])
    torch.testing.assert_close(got, want)
    assert kernel.member_runs == (0 if one_call else 1)


def masked(x, m):
    return torch.where(m, torch.tanh(x), x * 2) * m


def test_bool_tensors_take_the_one_call_path():
    f = recompile.function(masked)
    (kernel,) = kernels(f)
    x, m = torch.randn(5, 3, dtype=F64), torch.rand(5, 3) > 0.5
    torch.testing.assert_close(recompile.vmap(f)(x, m), masked(x, m))
    assert kernel.member_runs == 0


# ---------------------------------------------------------------------------
# 5. rebinding, errors, compile backend
# ---------------------------------------------------------------------------

act = torch.sigmoid


def uses_global_act(x):
    return act(x) * 2 + 1


@pytest.mark.parametrize("fusion", ["python", "compile"])
def test_a_rebound_callable_takes_effect(fusion, monkeypatch):
    f = recompile.function(uses_global_act, fusion=fusion)
    x = torch.randn(3, 2)
    (op,) = fused_ops(f)
    assert op.callables == {0: torch.sigmoid}
    torch.testing.assert_close(f(x), torch.sigmoid(x) * 2 + 1)
    monkeypatch.setitem(globals(), "act", torch.tanh)
    torch.testing.assert_close(f(x), torch.tanh(x) * 2 + 1)
    torch.testing.assert_close(recompile.vmap(f)(x), torch.tanh(x) * 2 + 1)
    monkeypatch.setitem(globals(), "act", lambda t: t - t.mean())  # not elementwise: per instance
    torch.testing.assert_close(recompile.vmap(f)(x), torch.stack([(t - t.mean()) * 2 + 1 for t in x]))


def bad_shapes(x, y):
    a = torch.sigmoid(x)
    b = a * y  # L:bad
    return b


@pytest.mark.parametrize("mode", MODES)
def test_error_in_a_fused_op_names_the_members_line(mode):
    f = recompile.function(bad_shapes, mode=mode)
    assert fused_ops(f)
    with pytest.raises(RuntimeError) as info:
        f(torch.randn(3), torch.randn(4))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"test_fusion.py:{marker(bad_shapes, 'bad')}" in notes
    tb = info.traceback
    assert any(entry.lineno + 1 == marker(bad_shapes, "bad") and entry.path.name == "test_fusion.py"
               for entry in tb)


def big_cell(i, u, f, c0):
    return torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f) * c0


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="torch.compile needs a C++ compiler")
def test_compile_backend_compiles_large_calls_once_and_matches():
    f = recompile.function(big_cell, fusion="compile")
    code = f.build_for(None).batched_code
    (kernel,) = [v for v in code.entry.__globals__.values() if isinstance(v, fused_kernels.FusedKernel)]
    small = [torch.randn(4, 8) for _ in range(4)]
    torch.testing.assert_close(f(*small), big_cell(*small))
    assert kernel._compiled is None  # below COMPILE_MIN_ELEMENTS: the plain function
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="recompile: torch.compile failed")  # fail, not fall back
        for rows in (200, 300):  # the batch dim is dynamic: one compile serves both
            big = [torch.randn(rows, 100) for _ in range(4)]
            torch.testing.assert_close(f(*big), big_cell(*big))
    assert kernel.compile_s is not None and kernel.backend == "compile"
    args = [torch.randn(200, 100, requires_grad=True) for _ in range(4)]
    grads = torch.autograd.grad(f(*args).sum(), args)
    torch.testing.assert_close(grads, torch.autograd.grad(big_cell(*args).sum(), args))
