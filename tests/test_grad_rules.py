"""recompile.autodiff.rules: every rule, in each of its forms, against torch.autograd.

A case is a callable (or a Tensor method name, called on the first argument, or a module) and its
arguments. ``check`` runs it twice: on ``requires_grad_()`` copies under autograd, and on plain copies under
``torch.no_grad()`` followed by the rule; the gradients must agree to 1e-9 in float64.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recompile.autodiff import rules as grad_rules
from recompile import intrinsics
from recompile.autodiff.factors import DEFERRED, form
from recompile.autodiff.rules import lookup

D = torch.float64
_gen = torch.Generator().manual_seed(0)


def r(*shape, dtype=D):
    return torch.randn(shape, generator=_gen, dtype=dtype)


def pos(*shape):
    return torch.rand(shape, generator=_gen, dtype=D) + 0.5


def ints(high, *shape):
    return torch.randint(high, shape, generator=_gen)


class Const:
    """An argument that is not differentiated (class weights, which torch refuses to differentiate)."""

    def __init__(self, value):
        self.value = value


# ---------------------------------------------------------------------------
# the harness


def _inplace(fn, kwargs):
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", "")
    return (name.endswith("_") and not name.endswith("__") or name in ("__iadd__", "__isub__", "__itruediv__")
            or fn in (operator.iadd, operator.isub, operator.itruediv) or bool(kwargs.get("inplace"))
            or bool(getattr(fn, "inplace", False)))


def _map(x, table):
    """``x`` with its differentiable tensors replaced through ``table`` (by id) and Consts unwrapped."""
    if isinstance(x, Const):
        return x.value
    if isinstance(x, torch.Tensor):
        return table.get(id(x), x)
    if type(x) in (list, tuple):
        return type(x)(_map(v, table) for v in x)
    return x


def _leaves(x, found):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        found.setdefault(id(x), x)
    elif type(x) in (list, tuple):
        for v in x:
            _leaves(v, found)


def _items(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _cotangent(out):
    """A random cotangent shaped like ``out``; a tuple of three or more gets None in the middle."""
    if isinstance(out, torch.Tensor):
        return torch.randn(out.shape, generator=_gen, dtype=D).to(out.dtype) if out.is_floating_point() else None
    items = [_cotangent(o) for o in out]
    if len(items) > 2:
        items[1] = None
    return tuple(items)


def _call(fn, args, kwargs):
    if isinstance(fn, str):
        bound = getattr(args[0], fn)
        return bound, bound(*args[1:], **kwargs), args[1:]
    return fn, fn(*args, **kwargs), args


def check(fn, args, kwargs):
    found = {}
    for a in (*args, *kwargs.values()):
        _leaves(a, found)
    leaves = list(found.values())
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    tol = 1e-9 if all(t.dtype == D for t in leaves + params) else 1e-5
    inplace = _inplace(fn, kwargs)

    # torch.autograd
    grad_copies = {i: t.detach().requires_grad_() for i, t in found.items()}
    a_args = [_map(a, grad_copies) for a in args]
    if inplace:  # a leaf cannot be changed in place: change a copy, which passes the gradient on
        a_args[0] = a_args[0].clone()
    a_kwargs = {k: _map(v, grad_copies) for k, v in kwargs.items()}
    with torch.enable_grad():
        _, a_out, _ = _call(fn, a_args, a_kwargs)
    g = _cotangent(a_out)
    outs, gs = [], []
    for o, go in zip(_items(a_out), _items(g)):
        if go is not None and isinstance(o, torch.Tensor) and o.requires_grad:
            outs.append(o)
            gs.append(go)
    inputs = list(grad_copies.values()) + params
    expected = torch.autograd.grad(outs, inputs, gs, allow_unused=True) if outs else [None] * len(inputs)
    expected = [torch.zeros_like(t) if e is None else e.to_dense() for t, e in zip(leaves + params, expected)]

    # the rule, on plain copies, after a forward without autograd
    plain = {i: t.detach().clone() for i, t in found.items()}
    index = {id(c): n for n, c in enumerate(plain.values())}
    index.update({id(p): len(leaves) + n for n, p in enumerate(params)})
    r_args = [_map(a, plain) for a in args]
    r_kwargs = {k: _map(v, plain) for k, v in kwargs.items()}
    with torch.no_grad():
        r_fn, out, rest = _call(fn, r_args, r_kwargs)
    found_rule = lookup(r_fn)
    assert found_rule is not None, f"no rule for {fn!r}"
    got = [torch.zeros_like(t) for t in leaves + params]
    for x, gx in found_rule(r_fn, g, out, tuple(rest), r_kwargs):
        pairs = zip(x, gx) if isinstance(x, (list, tuple)) and isinstance(gx, (list, tuple)) else [(x, gx)]
        for t, gt in pairs:
            if gt is None or not isinstance(t, torch.Tensor):
                continue
            if isinstance(gt, DEFERRED):  # a parameter gradient kept as factors: formed as the backward will
                gt = form([gt])
            n = index.get(id(t))
            if n is None:
                assert not t.is_floating_point(), "a cotangent for a tensor that is no input"
                continue
            assert gt.shape == t.shape and gt.dtype == t.dtype, (gt.shape, gt.dtype, t.shape, t.dtype)
            got[n] = got[n] + gt

    for n, (e, gt) in enumerate(zip(expected, got)):
        assert torch.equal(e.isnan(), gt.isnan()), f"input {n}: NaNs differ"
        finite = e.isfinite() & gt.isfinite()
        assert torch.equal(e[~finite & ~e.isnan()], gt[~finite & ~gt.isnan()]), f"input {n}: infinities differ"
        diff = (e[finite] - gt[finite]).abs().max().item() if finite.any() else 0.0
        assert diff <= tol, f"input {n}: max abs diff {diff}"


# ---------------------------------------------------------------------------
# the cases

CASES = []
_counts = {}


def _label(fn):
    if isinstance(fn, str):
        return "." + fn
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    owner = {torch: "torch", torch.Tensor: "Tensor", F: "F", operator: "operator"}
    for o, name in owner.items():
        if getattr(o, getattr(fn, "__name__", ""), None) is fn:
            return f"{name}.{fn.__name__}"
    return getattr(fn, "__qualname__", repr(fn))


def case(fn, *args, **kwargs):
    label = _label(fn)
    _counts[label] = _counts.get(label, 0) + 1
    CASES.append(pytest.param(fn, args, kwargs, id=f"{label}-{_counts[label]}"))


def forms(name, *args, **kwargs):
    """The same call as torch.name, Tensor.name and x.name(...), for those torch has."""
    for owner in (torch, torch.Tensor):
        f = getattr(owner, name, None)
        if f is not None:
            case(f, *args, **kwargs)
    if hasattr(torch.Tensor, name):
        case(name, *args, **kwargs)


x, y, p, s = r(3, 4), r(3, 4), pos(3, 4), r()
row, col, b3 = r(4), r(3, 1), r(2, 3, 4)
x32, y32 = r(3, 4, dtype=torch.float32), r(3, 4, dtype=torch.float32)
ties = torch.tensor([[1.0, 3.0, 3.0, -1.0], [3.0, 0.0, 2.0, 2.0], [-2.0, -2.0, 0.5, 0.5]], dtype=D)
with_nan = x.clone()
with_nan[1, 2] = math.nan

# arithmetic
case(operator.add, x, y)
case(operator.add, x, row)
case(operator.add, 2.0, x)
case(operator.add, x32, y)
case(operator.iadd, x, col)
case(intrinsics.iadd_fresh, x, col)  # (``x += col`` of an x the frame made: written out of place)
case(intrinsics.iadd_fresh, 2.0, x)
case(intrinsics.iadd_fresh, x32, y)  # (in place, x keeps its dtype)
case(intrinsics.isub_fresh, x, row)
case(intrinsics.imul_fresh, x, y)
case(intrinsics.itruediv_fresh, x, p)
for _fresh in intrinsics.OUT_OF_PLACE:  # (``x.relu_()``, ``torch.relu_(x)`` of an x the frame made, so written)
    case(_fresh, p if _fresh.method == "sqrt" else x, *((-0.5, 0.5) if _fresh.method == "clamp" else ()))
case(intrinsics.fill_fresh, x, s)  # (``x.fill_(v)`` of an x the frame made: each element v, none of x's)
case(intrinsics.fill_fresh, x, 0.5)
case(intrinsics.zero_fresh, x)
case(intrinsics.setitem_fresh, x, 1, r(4))  # (``x[i] = v`` of an x the frame made: a copy so written)
case(intrinsics.setitem_fresh, x, (slice(None), 2), s)  # (v broadcast: its cotangent summed)
case(intrinsics.setitem_fresh, x, torch.tensor([0, 2]), r(4))
case(intrinsics.setitem_fresh, x32, 0, r(4))  # (v cast to x's dtype: its cotangent back to v's)
case(intrinsics.setitem_fresh, x, 0, r(1, 4))  # (v's leading 1-dim, which the write drops: given back)
forms("add", x, row, alpha=0.5)
case(torch.add, input=x, other=y, alpha=2)
forms("add_", x, row, alpha=2.0)
for name in ("__add__", "__radd__"):
    case(name, x, row)
case("__iadd__", x, y)
case(operator.sub, x, row)
case(operator.sub, 1.5, x)
case(operator.isub, x, y)
forms("sub", x, y, alpha=3)
forms("subtract", col, row)
forms("sub_", x, row, alpha=0.5)
forms("subtract_", x, y)
case("__sub__", x, 2.0)
case("__isub__", x, row)
case(torch.rsub, x, row, alpha=2)
case(torch.rsub, x, 3.0)
case("__rsub__", x, 3.0)
case("__rsub__", x, col)
case(operator.mul, x, row)
case(operator.mul, 3.0, x)
case(operator.mul, x32, y)
forms("mul", x, col)
forms("multiply", s, x)
case("__mul__", x, y)
case("__rmul__", x, 2.5)
case(operator.truediv, x, p)
case(operator.truediv, 2.0, p)
case(operator.truediv, x, pos(4))
case(operator.itruediv, x, p)
forms("div", x, p)
forms("div", x, p, rounding_mode="floor")
forms("divide", x, pos(3, 1))
forms("true_divide", x, p)
case(torch.true_divide, input=x, other=pos(4))
forms("div_", x, p)
forms("divide_", x, pos(4))
forms("true_divide_", x, 2.0)
case("__truediv__", x, p)
case("__div__", x, p)
case("__rtruediv__", p, 2.0)
case("__itruediv__", x, p)
case(operator.neg, x)
for name in ("neg", "negative", "neg_", "negative_"):
    forms(name, x)
case("__neg__", x)
case(operator.pos, x)
forms("positive", x)
case("__pos__", x)
case(operator.pow, p, 3)
case(operator.pow, p, 0.5)
case(operator.pow, p, 0)
case(operator.pow, 2.0, x)
case(operator.pow, 0.0, p)
case(operator.pow, p, y)
case(operator.pow, p, row)
case(operator.pow, torch.tensor([0.0, 2.0, 0.0], dtype=D), torch.tensor([2.0, 0.0, 0.0], dtype=D))
case(pow, p, 3)  # (Python's builtin: ``pow(x, 3)`` is ``x ** 3``)
case(pow, 2.0, x)
forms("pow", p, 2.5)
forms("pow", p, y)
case(torch.pow, self=2.0, exponent=x)
case(torch.pow, input=p, exponent=col)
case("__pow__", p, y)
case("__rpow__", x, 3.0)

# products
A, B, v, w = r(3, 4), r(4, 5), r(4), r(5)
case(operator.matmul, A, B)
case(operator.matmul, v, r(4))
case(operator.matmul, A, v)
case(operator.matmul, v, B)
case(operator.matmul, r(2, 3, 4), B)
case(operator.matmul, r(2, 1, 3, 4), r(5, 4, 2))
case(operator.matmul, v, r(2, 4, 5))
case(operator.matmul, r(2, 3, 4), v)
case(operator.matmul, A, r(2, 4, 5))
case(operator.imatmul, A, B)
forms("matmul", A, B)
forms("matmul", r(2, 3, 4), r(2, 4, 5))
case(torch.matmul, input=A, other=v)
case("__matmul__", A, B)
case("__rmatmul__", B, A)
forms("mm", A, B)
case(torch.mm, input=A, mat2=B)
forms("bmm", r(2, 3, 4), r(2, 4, 5))
forms("mv", A, v)
forms("dot", v, r(4))
case(torch.dot, v, tensor=r(4))
forms("outer", v, w)
forms("ger", v, w)
W, bias = r(5, 4), r(5)
case(F.linear, x, W, bias)
case(F.linear, b3, W, bias)
case(F.linear, row, W)
case(F.linear, b3, r(4), r())
case(F.linear, input=x, weight=W, bias=bias)
case(nn.Linear(4, 5).double(), b3)
case(nn.Linear(4, 2, bias=False).double(), row)

# elementwise
UNARY_INPUTS = {
    "exp": x, "exp2": x, "expm1": x, "log": p, "log2": p, "log10": p, "log1p": p - 0.4, "sqrt": p, "rsqrt": p,
    "reciprocal": p, "square": x, "abs": x, "sin": x, "cos": x, "tan": x / 2, "sinh": x, "cosh": x, "atan": x,
    "erf": x, "tanh": x, "sigmoid": x, "relu": x,
}
# the in-place forms of those whose gradient reads only the result (the others have no rule)
IN_PLACE = {"exp", "exp2", "expm1", "sqrt", "rsqrt", "reciprocal", "tan", "tanh", "sigmoid", "relu"}
for name, value in UNARY_INPUTS.items():
    forms(name, value)
    if name in IN_PLACE:
        forms(name + "_", value)
forms("absolute", x)
case(abs, x)
case("__abs__", x)
for f, value in ((torch.special.exp2, x), (torch.special.expm1, x), (torch.special.log1p, p), (torch.special.erf, x),
                 (torch.special.expit, x), (F.sigmoid, x), (F.tanh, x), (F.relu, x), (F.relu_, x)):
    case(f, value)
case(F.relu, x, inplace=True)
case(F.relu, input=x)
case(F.leaky_relu, x)
case(F.leaky_relu, x, 0.2)
case(F.leaky_relu, x, negative_slope=0.3, inplace=True)
case(F.leaky_relu_, x, 0.1)
case(F.elu, x)
case(F.elu, x, alpha=0.5)
case(F.elu, x, 1.5, inplace=True)
case(F.elu_, x, 0.7)
case(F.gelu, x * 2)
case(F.gelu, x * 2, approximate="tanh")
case(F.softplus, x)
case(F.softplus, x * 10, beta=2, threshold=5)
case(F.silu, x)
case(F.hardtanh, x * 2)
case(F.hardtanh, x, -0.5, 0.5)
case(F.hardtanh, x * 2, inplace=True)
case(F.hardtanh_, x * 2)
case(F.relu6, x * 5)
case(F.relu6, x * 5, inplace=True)
lo, hi = r(4) - 0.5, r(3, 1) + 0.5
for name in ("clamp", "clip"):
    forms(name, x, -0.5, 0.5)
    forms(name, x, min=-0.3)
    forms(name, x, max=0.2)
    forms(name, x, lo, hi)
    forms(name, x, min=lo)
    forms(name, x, max=hi)
forms("clamp_min", x, 0.1)
forms("clamp_min", x, lo)
forms("clamp_max", x, 0.1)
forms("clamp_max", x, hi)
cond = x > 0
case(torch.where, cond, x, y)
case(torch.where, cond, x, 2.0)
case(torch.where, cond, 1.5, y)
case(torch.where, cond[:, :1], row, col)
case(torch.where, condition=cond, input=x32, other=y)
case(torch.Tensor.where, x, cond, y)
case("where", x, cond, row)
a_t = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=D)
b_t = torch.tensor([[1.0, 0.0, 5.0, 4.0], [2.0, 2.0, 3.0, 0.0]], dtype=D)
forms("maximum", a_t, b_t)
forms("minimum", a_t, b_t)
forms("max", a_t, b_t)
forms("min", b_t, a_t)
case(torch.max, x, other=y)
case(torch.min, x, other=y)
mask = x > 0.3
forms("masked_fill", x, mask, 0.5)
forms("masked_fill", x, mask[:1], r())
forms("masked_fill_", x, mask, -1.0)

# reductions
forms("sum", x)
forms("sum", x, 1)
forms("sum", x, -1, True)
forms("sum", b3, (0, 2))
forms("sum", b3, dim=[0, -1], keepdim=True)
forms("sum", x32, dtype=D)
forms("sum", x, axis=0)
forms("sum", x, 1, keepdims=True)
forms("sum", x, dim=())
forms("sum", s)
forms("sum", s, 0)
forms("nansum", with_nan)
forms("nansum", with_nan, 1)
forms("mean", x)
forms("mean", x, 1)
forms("mean", b3, (0, -1), True)
forms("mean", x, dim=-1, keepdim=True)
forms("mean", x32, dtype=D)
forms("mean", x, axis=1)
forms("mean", s)
for name in ("max", "min"):
    forms(name, x)
    forms(name, ties)
    forms(name, with_nan)
    forms(name, x, 1)
    forms(name, ties, 1)
    forms(name, ties, dim=0, keepdim=True)
    forms(name, b3, -1)
    forms(name, x, axis=0)
    forms(name, s, 0)
for name in ("amax", "amin"):
    forms(name, x)
    forms(name, ties)
    forms(name, ties, 1)
    forms(name, ties, dim=0, keepdim=True)
    forms(name, b3, (0, 2))
    forms(name, b3, (-1, 0), True)
forms("logsumexp", x, 1)
forms("logsumexp", b3, (0, 2))
forms("logsumexp", x, -1, True)
forms("logsumexp", x, dim=0)
case(torch.special.logsumexp, x, 1)
zero_row = x.clone()
zero_row[1] = 0
forms("norm", x)
forms("norm", x, 2, 1)
forms("norm", x, dim=-1, keepdim=True)
forms("norm", x, p="fro")
forms("norm", zero_row, dim=1)
forms("norm", b3, 2, (0, 2))
forms("norm", x, p=1, dim=1)
forms("norm", x, float("inf"))
forms("norm", x, "nuc")
forms("norm", x32, 2, 1, dtype=D)
case(torch.linalg.vector_norm, x)
case(torch.linalg.vector_norm, x, 2, dim=1)
case(torch.linalg.vector_norm, zero_row, dim=(0, 1), keepdim=True)
case(torch.linalg.vector_norm, x, ord=1)
case(torch.linalg.vector_norm, x, ord=3, dim=-1)
case(torch.linalg.norm, x)
case(torch.linalg.norm, x, dim=1)
case(torch.linalg.norm, b3, dim=(1, 2), keepdim=True)
case(torch.linalg.norm, x, ord="fro")
case(torch.linalg.norm, x, ord=2)
for name in ("var", "std"):
    forms(name, x)
    forms(name, x, 1)
    forms(name, x, dim=1, correction=0)
    forms(name, x, 1, keepdim=True)
for name in ("var_mean", "std_mean"):
    forms(name, x, 1)
    forms(name, x, dim=0, correction=0)
case("var", x, 1, True)

# shape
case(torch.cat, [x, y])
case(torch.cat, [x, row.unsqueeze(0)], dim=-2)
case(torch.cat, (x, col), 1)
case(torch.cat, [x, torch.empty(0, dtype=D), y])
case(torch.cat, [x, x], axis=1)
case(torch.cat, [x32, y])
case(torch.concat, [x, col], dim=1)
case(torch.concatenate, [x, col], axis=1)
case(torch.concatenate, [x, y], 0)
case(torch.stack, [x, y])
case(torch.stack, (x, y, x), 1)
case(torch.stack, [x, y], dim=-1)
case(torch.stack, [x32, y])
forms("split", x, 2)
forms("split", x, [1, 3], 1)
forms("split", x, 1, dim=-1)
case(torch.split, x, split_size_or_sections=[2, 1])
case("split", x, split_size=2, dim=1)
forms("chunk", x, 2)
forms("chunk", x, 3, 1)
forms("chunk", x, chunks=4, dim=-1)
forms("tensor_split", x, 3, 1)
forms("tensor_split", x, [1, 3], dim=1)
forms("unbind", x)
forms("unbind", b3, 1)
forms("unbind", x, dim=-1)
forms("reshape", x, (4, 3))
forms("reshape", x, (-1,))
case("view", x, 2, 6)
case(torch.Tensor.view, x, (12,))
case("view", x, torch.int64)
forms("view_as", x, y.reshape(4, 3))
forms("reshape_as", x, r(2, 6))
forms("squeeze", col)
forms("squeeze", col, 1)
forms("squeeze", col, dim=-1)
forms("squeeze", b3.unsqueeze(1), (1,))
forms("unsqueeze", x, 1)
forms("unsqueeze", x, -1)
forms("flatten", b3)
forms("flatten", b3, 1)
forms("flatten", b3, start_dim=0, end_dim=1)
forms("unflatten", x, 1, (2, 2))
forms("ravel", x)
forms("contiguous", x.T)
forms("clone", x)
case(nn.Flatten(), b3)
case(nn.Unflatten(1, (2, 2)), x)
case(nn.Identity(), x)
forms("transpose", b3, 0, 2)
forms("transpose", b3, -1, 0)
forms("transpose", x, dim0=0, dim1=1)
forms("swapdims", b3, 0, 1)
forms("swapaxes", b3, 0, -1)
case(torch.swapaxes, x, axis0=1, axis1=0)
forms("movedim", b3, 0, -1)
forms("movedim", b3, (0, 1), (2, 0))
forms("moveaxis", b3, -1, 0)
forms("t", x)
forms("t", row)
forms("permute", b3, (2, 0, 1))
forms("permute", b3, (-1, 0, 1))
case("permute", b3, 2, 0, 1)
case("permute", b3, dims=(1, 2, 0))
forms("flip", x, (0,))
forms("flip", b3, [0, 2])
case("flip", x, 0, 1)
case("flip", x, 1)
case(torch.flip, x, dims=[1])
forms("fliplr", x)
forms("flipud", x)
forms("roll", x, 1)
forms("roll", x, 2, 1)
forms("roll", x, (1, -2), (0, 1))
forms("roll", x, shifts=1, dims=-1)
case("expand", col, 3, 4)
case(torch.Tensor.expand, col, (2, 3, 4))
case("expand", col, -1, 5)
forms("expand_as", col, x)
forms("broadcast_to", row, (3, 4))
case(torch.broadcast_tensors, x, row, col.unsqueeze(0))
case("repeat", x, 2, 3)
case(torch.Tensor.repeat, x, (1, 2))
case("repeat", x, 2, 1, 3)
case("repeat", row, repeats=(2, 2))
forms("tile", x, (2,))
forms("tile", x, (2, 1, 2))
forms("narrow", x, 1, 1, 2)
forms("narrow", x, -1, 0, 3)
forms("narrow", x, 0, torch.tensor(1), 2)
forms("select", x, 1, 2)
forms("select", b3, -1, -1)
idx = torch.tensor([2, 0, 2, 3])
forms("index_select", x, 1, idx)
forms("index_select", x, 0, idx[:3] % 3)
forms("gather", x, 1, ints(4, 3, 5))
forms("gather", x, dim=0, index=ints(3, 2, 4))
for name in ("float", "double", "half", "bfloat16", "cpu"):
    case(name, x)
    case(getattr(torch.Tensor, name), x)
case("double", x32)
case("to", x, torch.float32)
case("to", x32, D)
case("to", x, "cpu")
case("to", x, y32)
case(torch.Tensor.to, x, dtype=torch.float32)
case("type_as", x, y32)
case(torch.Tensor.type_as, x32, y)
forms("detach", x)

# indexing and the frontend's structure helpers
rows3 = torch.tensor([0, 2, 0])
for index in (1, -1, slice(1, 3), (slice(None), 2), (Ellipsis, None, 1), (0, slice(None, None, 2)), True,
              rows3, [0, 0, 2], x > 0, torch.tensor([True, False, True]), [True, False, True],
              (rows3, torch.tensor([1, 1, 3])), (torch.tensor([[0], [2]]), [1, 1, 3]), torch.tensor(1),
              (slice(None), idx), (idx[:2], slice(1, 3)), (Ellipsis, rows3), torch.tensor(True), [[0, 1], [2, 2]],
              [rows3, slice(None)], torch.tensor([-1, 0, -3]), torch.tensor(-2), rows3.int()):
    case(operator.getitem, x, index)
case(operator.getitem, b3, (0, slice(None), idx))
case(operator.getitem, b3, (idx[:2] % 2, 1, idx[:2]))
case(torch.Tensor.__getitem__, x, (rows3, 0))
case("__getitem__", x, (slice(None), [3, 3]))
case(intrinsics.unpack, x, 3)
case(intrinsics.as_sequence, x)
case(getattr, x, "T")
case(getattr, b3, "mT")

# softmax, losses, embeddings
for name in ("softmax", "log_softmax"):
    forms(name, x, 1)
    forms(name, x, -1)
    forms(name, b3, dim=0)
    forms(name, x32, 1, D)
    forms(name, x32, 0, dtype=D)
    functional = getattr(F, name)
    case(functional, x, dim=1)
    case(functional, x)
    case(functional, b3)
    case(functional, x, 1, 3)
    case(functional, x32, -1, dtype=D)
    case(getattr(torch.special, name), b3, 1)
case(nn.Softmax(dim=-1), b3)
case(nn.Softmax(), x)
case(nn.LogSoftmax(1), b3)

logits, target = r(5, 4), ints(4, 5)
ignored = target.clone()
ignored[[1, 3]] = -100
cw = Const(pos(4))
for reduction in ("mean", "sum", "none"):
    case(F.cross_entropy, logits, target, reduction=reduction)
    case(F.cross_entropy, r(4), torch.tensor(2), reduction=reduction)
    case(F.cross_entropy, r(2, 4, 3), ints(4, 2, 3), reduction=reduction)
    case(F.cross_entropy, logits, ignored, reduction=reduction)
    case(F.cross_entropy, logits, target, cw, reduction=reduction)
    case(F.cross_entropy, logits, ignored, weight=cw, reduction=reduction)
    case(F.cross_entropy, logits, target, label_smoothing=0.1, reduction=reduction)
    case(F.cross_entropy, logits, torch.softmax(r(5, 4), 1), reduction=reduction)
    case(F.nll_loss, logits, target, reduction=reduction)
    case(F.nll_loss, r(4), torch.tensor(1), reduction=reduction)
    case(F.nll_loss, r(2, 4, 3), ints(4, 2, 3), reduction=reduction)
    case(F.nll_loss, logits, ignored, cw, reduction=reduction)
    case(F.mse_loss, x, y, reduction=reduction)
    case(F.binary_cross_entropy_with_logits, x, torch.rand(3, 4, generator=_gen, dtype=D), reduction=reduction)
    case(F.binary_cross_entropy, torch.sigmoid(x), torch.rand(3, 4, generator=_gen, dtype=D), reduction=reduction)
case(F.cross_entropy, logits, target, ignore_index=1)
case(F.cross_entropy, logits, target, size_average=False)
case(F.cross_entropy, logits, target, cw, label_smoothing=0.2)
case(F.nll_loss, logits, target, ignore_index=0, reduction="sum")
case(F.nll_loss, logits, target, reduce=False)
case(F.mse_loss, x, row)
case(F.mse_loss, col, x, reduction="sum")
case(F.mse_loss, x, y, weight=pos(3, 4))
case(F.binary_cross_entropy_with_logits, x, torch.rand(3, 4, generator=_gen, dtype=D), pos_weight=Const(pos(4)))
case(F.binary_cross_entropy_with_logits, x, torch.rand(3, 4, generator=_gen, dtype=D), Const(pos(3, 4)))
case(F.binary_cross_entropy, torch.sigmoid(x), torch.rand(3, 4, generator=_gen, dtype=D), Const(pos(3, 4)))
case(nn.CrossEntropyLoss(), logits, target)
case(nn.CrossEntropyLoss(weight=pos(4), reduction="sum", ignore_index=2), logits, target)
case(nn.CrossEntropyLoss(label_smoothing=0.1), logits, target)
case(nn.NLLLoss(reduction="none"), logits, ignored)
case(nn.MSELoss(reduction="sum"), x, y)
case(nn.BCEWithLogitsLoss(), x, torch.rand(3, 4, generator=_gen, dtype=D))
case(nn.BCEWithLogitsLoss(pos_weight=pos(4)), x, torch.rand(3, 4, generator=_gen, dtype=D))

table = r(6, 4)
tokens = torch.tensor([[1, 2, 1], [5, 2, 2]])
case(F.embedding, tokens, table)
case(F.embedding, tokens, table, padding_idx=2)
case(F.embedding, tokens, table, -1)
case(F.embedding, tokens, table, scale_grad_by_freq=True)
case(F.embedding, tokens, table, max_norm=1.0)
case(F.embedding, torch.tensor(3), table)
case(F.embedding, input=tokens[0], weight=table, sparse=True)
case(nn.Embedding(6, 4, padding_idx=1).double(), tokens)
case(nn.Embedding(6, 4, scale_grad_by_freq=True).double(), tokens)

# module activations
for module in (nn.Tanh(), nn.Sigmoid(), nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.2), nn.ELU(0.7),
               nn.ELU(inplace=True), nn.GELU("tanh"), nn.GELU(), nn.SiLU(), nn.Softplus(2, 3), nn.Hardtanh(-0.5, 0.5),
               nn.ReLU6()):
    case(module, x * 4 if isinstance(module, (nn.Softplus, nn.ReLU6)) else x)


# ---------------------------------------------------------------------------
# tests


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fn,args,kwargs", CASES)
def test_rule_matches_autograd(fn, args, kwargs):
    check(fn, args, kwargs)


def _tested():
    """The table keys the cases reach: callables, the names of bound methods, module types."""
    functions, methods, modules = set(), set(), set()
    for param in CASES:
        fn, args, _ = param.values
        if isinstance(fn, str):
            methods.add(getattr(args[0], fn).__name__)
        elif isinstance(fn, nn.Module):
            modules.add(type(fn))
        else:
            functions.add(fn)
    return functions, methods, modules


def test_every_rule_has_cases():
    functions, methods, modules = _tested()
    assert [k for k in grad_rules.GRAD.by_callable if k not in functions] == []
    assert sorted(set(grad_rules.GRAD.by_method) - methods) == []
    assert [m.__name__ for m in grad_rules.GRAD.by_module if m not in modules] == []


def test_lookup_without_rule():
    t = r(3)
    assert lookup(torch.erfinv) is None
    assert lookup(t.erfinv) is None
    assert lookup(torch.Tensor.erfinv) is None
    assert lookup(nn.Bilinear(2, 2, 2)) is None
    assert lookup([].append) is None
    assert lookup(print) is None


def test_lookup_ignores_subclass_methods():
    class Mine(torch.Tensor):
        def split(self, *args):  # not torch's split: no rule of torch's may apply
            return super().split(*args)

    t = r(4).as_subclass(Mine)
    assert lookup(t.split) is None
    assert lookup(r(4).split) is not None
    assert lookup(nn.Parameter(r(4)).split) is not None


def test_detach_passes_no_gradient():
    t = r(3, 4)
    for fn in (torch.detach, torch.Tensor.detach):
        assert list(lookup(fn)(fn, torch.ones(3, 4), t.detach(), (t,), {})) == []
    bound = t.detach
    assert list(lookup(bound)(bound, torch.ones(3, 4), bound(), (), {})) == []


def test_getitem_of_a_list_is_the_item_itself():
    items = [r(2), r(3)]
    assert list(lookup(operator.getitem)(operator.getitem, torch.ones(3), items[1], (items, 1), {})) == []


@pytest.mark.parametrize("index", [2, -1, torch.tensor(1), torch.tensor([0, 2, 0])], ids=str)
def test_rows_read_give_rows_not_a_table_sized_cotangent(index):
    """``x[t]`` read at every step of a loop: each read's cotangent is its rows, and the gradient of ``x`` is
    formed once (a dense cotangent per read made a backward's memory grow with the length squared)."""
    t = r(4, 3)
    out = t[index]
    (part,) = lookup(operator.getitem)(operator.getitem, torch.ones_like(out), out, (t, index), {})
    assert part[0] is t and isinstance(part[1], DEFERRED)
    want = torch.zeros_like(t).index_put_((torch.as_tensor(index),), torch.ones_like(out), accumulate=True)
    torch.testing.assert_close(form([part[1]]), want)


def test_silu_in_place_is_refused():
    t = r(3)
    out = F.silu(t.clone(), inplace=True)
    with pytest.raises(NotImplementedError, match="inplace"):
        list(lookup(F.silu)(F.silu, torch.ones(3), out, (out,), {"inplace": True}))


def test_keyword_and_positional_forms_bind_alike():
    t = r(3, 4)
    g = r(3, 1)
    out = t.sum(1, keepdim=True)
    for args, kwargs in (((t, 1, True), {}), ((t,), {"dim": 1, "keepdim": True}), ((t, -1), {"keepdims": True})):
        (_, grad), = lookup(torch.sum)(torch.sum, g, out, args, kwargs)
        assert torch.equal(grad, g.expand(3, 4))
