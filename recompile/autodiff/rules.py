"""Reverse-mode rules for Calls, looked up by the callable (the table ``passes.grad`` relies on).

A rule is ``vjp(fn, g, out, *args, **kwargs)``: the callable, the cotangent of
its result, the result itself and the arguments of the forward call. It returns
an iterable of ``(input, cotangent)`` pairs; an input that is not a tensor (a
Python number, a list of tensors given to ``torch.cat`` with a list of
cotangents) is taken apart by the caller, and pairs whose input needs no
gradient are simply dropped. Parameters a module uses are inputs like any
other: ``(module.weight, g_w)``.

``g`` has the structure of ``out``: a tensor, or for a tuple result (``chunk``,
``unbind``, ``torch.max(x, dim)``) a tuple with None where an item got no
cotangent.

Rules are filed in ``GRAD`` (an ``ops.table.RuleTable``) by callable
(``torch.tanh``, ``operator.mul``, ``F.linear``, ``torch.Tensor.tanh``), by
Tensor method name (``x.tanh()``: the bound tensor is passed first, as
``self``) and by nn.Module type (``self.linear(x)``: the module is ``fn``).
Rules take torch's parameter names, so that keyword calls bind as they do in
torch.

The common case of each rule is a formula (the table exists for speed); options
rare enough not to deserve one are differentiated on the spot with
torch.autograd (``_autograd``), so that no rule is ever approximately right.
"""

from __future__ import annotations

import dis
import functools
import inspect
import math
import operator
import types

import torch
import torch.nn.functional as F
from torch import nn

from .. import intrinsics
from ..ops.table import BOUND_BUILTIN, BOUND_SLOT, RuleTable
from .factors import Outer, Rows


class Rule:
    """A registered vjp; ``method`` rules take the bound tensor as their first argument.

    ``reads_out`` / ``reads_inputs``: whether the vjp needs the values of the
    result / the inputs (not only their shapes), so that changing them in place
    afterwards makes its gradient wrong (see passes.grad's version checks).
    ``read_for_others``: positions of arguments whose value only the other
    arguments' gradients read (``x * y`` reads x for y's gradient), so that
    changing one matters only when another needs a gradient (``x * 0.5``).
    ``attrs``: of a module's rule, the attributes (its parameters, its options)
    it reads of the module, taken as the forward saw them (``seen``).
    """

    __slots__ = ("name", "vjp", "method", "reads_out", "reads_inputs", "read_for_others", "reads_only",
                 "reads_only_names", "attrs")

    def __init__(self, name, vjp, method=False):
        self.name = name
        self.vjp = vjp
        self.method = method
        self.reads_out = _loads(vjp, "out")
        self.reads_inputs = vjp not in SHAPE_ONLY
        self.read_for_others = ()
        self.reads_only = None  # positions of the only arguments whose values the vjp reads (None: any)
        self.reads_only_names = None  # their names, for arguments given by keyword
        self.attrs = getattr(vjp, "attrs", ())  # a module rule's: the attributes it reads of the module

    def __call__(self, fn, g, out, args, kwargs):
        if self.method:
            return self.vjp(fn, g, out, fn.__self__, *args, **kwargs)
        return self.vjp(fn, g, out, *args, **kwargs)

    def __repr__(self):
        return f"<grad rule {self.name}>"


def _loads(fn, name):
    """Whether function ``fn`` (or a function nested in it) reads the local ``name``."""
    code = fn.__code__
    if name in code.co_cellvars:
        return True
    return any(i.argval == name for i in dis.get_instructions(code) if i.opname.startswith("LOAD_")) or any(
        isinstance(c, types.CodeType) and name in c.co_freevars for c in code.co_consts)


# vjps that read no value of their inputs (only their shapes, or where their cotangents go), filled in below
SHAPE_ONLY = set()


def _filed(vjp, target):
    """The Rule filed for ``vjp`` under ``target`` (a callable, a Tensor method name, a Module type)."""
    if isinstance(target, str):
        return Rule(target, vjp, method=True)
    if isinstance(target, type) and issubclass(target, nn.Module):
        return Rule(target.__name__, vjp)
    return Rule(getattr(target, "__name__", repr(target)), vjp)


# (a module with backward hooks gets no rule either: its call is recorded by torch.autograd, which runs them)
GRAD = RuleTable("grad", make=_filed)
rule = GRAD.register  # ``@rule(*targets)``: register a vjp for callables, Tensor method names and Module types
lookup = GRAD.lookup  # the Rule for callable ``fn``, or None


def _forms(*names):
    """``torch.name``, ``Tensor.name`` (where torch has them) and the method name, for each name."""
    found = []
    for name in names:
        found.extend(f for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None)) if f is not None)
        if hasattr(torch.Tensor, name):
            found.append(name)
    return found


# ----------------------------------------------------------------------------
# helpers


def is_tensor(x):
    return isinstance(x, torch.Tensor)


def unbroadcast(g, like):
    """``g`` summed down to the shape of ``like`` (an operand broadcast in the forward); None for non-tensors."""
    if not is_tensor(like):
        return None
    if g.shape != like.shape:
        g = g.sum_to_size(like.shape) if like.dim() else g.sum()
    if g.dtype != like.dtype and like.is_floating_point():
        g = g.to(like.dtype)
    return g


def written_cotangent(part, value):
    """The cotangent of ``value``, written by ``x[i] = value`` into the region whose cotangent is ``part``: summed
    where it was broadcast into the region, given back the leading 1-dims the write dropped (``x[0] = v`` of a v
    of shape (1, H) into a row of H); None for a non-tensor."""
    if is_tensor(value) and value.dim() > part.dim():
        part = part.reshape((1,) * (value.dim() - part.dim()) + tuple(part.shape))
    return unbroadcast(part, value)


def dim_of(dim, ndim):
    return dim + ndim if dim < 0 else dim


def _reduced(dim, ndim):
    """The dims a reduction over ``dim`` took away, ascending; None and () mean all of them, as in torch."""
    if ndim == 0:
        return []
    if dim is None:
        return list(range(ndim))
    if isinstance(dim, int):
        return [dim % ndim]
    return sorted(d % ndim for d in dim) if len(dim) else list(range(ndim))


def _restore(t, x, dim, keepdim):
    """A reduction's result (or cotangent) ``t`` broadcast back over its input ``x``."""
    if not keepdim:
        for d in _reduced(dim, x.dim()):
            t = t.unsqueeze(d)
    return t.expand(x.shape)


def _dim_kw(dim, keepdim, aliases):
    """torch also takes numpy's names ``axis`` and ``keepdims``."""
    return aliases.get("axis", dim), aliases.get("keepdims", keepdim)


def _unbound(fn):
    """``x.f`` as ``Tensor.f``, which takes x first as a method rule's arguments do; others as they are."""
    if type(fn) in (BOUND_BUILTIN, BOUND_SLOT, types.MethodType) and is_tensor(fn.__self__):
        return getattr(torch.Tensor, fn.__name__)
    return fn


def _items(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _autograd(f, g, args, kwargs=None):
    """Differentiate ``f(*args, **kwargs)`` with torch.autograd, on the spot: for options too rare for a formula.

    The floating tensors of ``args`` and ``kwargs`` (also inside lists) are the inputs; bind what must stay
    constant (a loss's class weights, which torch does not differentiate) into ``f`` with functools.partial.
    """
    copies = []

    def track(x):
        if is_tensor(x) and (x.is_floating_point() or x.is_complex()):
            c = x.detach().requires_grad_()
            copies.append((x, c))
            return c
        if type(x) in (tuple, list):
            return type(x)(track(v) for v in x)
        return x

    call_args = [track(a) for a in args]
    call_kwargs = {k: track(v) for k, v in (kwargs or {}).items()}
    with torch.enable_grad():
        result = f(*call_args, **call_kwargs)
    outs, cotangents = [], []
    for o, go in zip(_items(result), _items(g)):
        if go is not None and is_tensor(o) and o.requires_grad:
            outs.append(o)
            cotangents.append(go)
    if not outs or not copies:
        return []
    found = torch.autograd.grad(outs, [c for _, c in copies], cotangents, allow_unused=True)
    return [(x, gx) for (x, _), gx in zip(copies, found) if gx is not None]


@rule(*_forms("var", "std", "var_mean", "std_mean"))
def _by_autograd(fn, g, out, *args, **kwargs):
    """Calls whose argument conventions (var's ``unbiased``/``correction`` overloads) are not worth a formula."""
    return _autograd(_unbound(fn), g, args, kwargs)


# ----------------------------------------------------------------------------
# arithmetic


@rule(intrinsics.iadd_fresh)
def _add_fresh(fn, g, result, input, other):  # (``result``: a list's elements are read, never a tensor's values)
    """``x += y`` of an x the frame made (``passes.fresh``): a list is extended by any iterable, each element
    getting its own cotangent back (a tensor's rows theirs, stacked; a map's or a generator's elements, the
    very values the list holds, theirs); anything else as ``+``."""
    if not isinstance(input, list) or isinstance(other, (tuple, list)):
        yield from _add(fn, g, result, input, other)
        return
    yield input, g[:len(input)]
    rows = g[len(input):]
    if is_tensor(other):
        if rows:
            yield other, torch.stack([r if r is not None else torch.zeros_like(other[k]) for k, r in enumerate(rows)])
        return
    for value, r in zip(result[len(input):], rows):  # (a map's or a generator's elements: each its own cotangent)
        yield value, r


@rule(operator.add, operator.iadd, *_forms("add", "add_"), "__add__", "__radd__", "__iadd__")
def _add(fn, g, out, input, other, alpha=1):
    if isinstance(input, (tuple, list)) and isinstance(other, (tuple, list)):
        # [a] + [b]: the joined sequence holds the very elements, so each gets its own cotangent back
        yield input, g[:len(input)]
        yield other, g[len(input):]
        return
    # in place (add_, +=) needs neither old value, so ``input`` being ``out`` by now does no harm
    yield input, unbroadcast(g, input)
    yield other, unbroadcast(g if alpha == 1 else g * alpha, other)


@rule(operator.sub, operator.isub, intrinsics.isub_fresh, *_forms("sub", "sub_", "subtract", "subtract_"),
      "__sub__", "__isub__")
def _sub(fn, g, out, input, other, alpha=1):
    yield input, unbroadcast(g, input)
    yield other, unbroadcast(-g if alpha == 1 else -g * alpha, other)


@rule(torch.rsub, "__rsub__")
def _rsub(fn, g, out, input, other, alpha=1):
    return _sub(fn, g, None, other, input, alpha)  # other - alpha * input


# not operator.imul: ``x *= y`` on a tensor overwrites the x that y's gradient needs (backprop makes it
# out of place before looking for a rule)
@rule(operator.mul, intrinsics.imul_fresh, *_forms("mul", "multiply"), "__mul__", "__rmul__")
def _mul(fn, g, out, input, other):
    seq = input if isinstance(input, (tuple, list)) else other if isinstance(other, (tuple, list)) else None
    if seq is not None:  # [h] * 3 holds the very elements: each one's whole cotangent is at its first place
        yield seq, g[:len(seq)]
        return
    if is_tensor(input):
        yield input, unbroadcast(g * other, input)
    if is_tensor(other):
        yield other, unbroadcast(g * input, other)


# the divisor's gradient is torch's, (x / y) / y, from the inputs: a caller may change the quotient in place
@rule(operator.truediv, intrinsics.itruediv_fresh, *_forms("div", "divide", "true_divide"), "__truediv__",
      "__div__")
def _div(fn, g, out, input, other, *, rounding_mode=None):
    return _quotient_grads(g, input, other, None, rounding_mode)


# in place (x /= y) the dividend is overwritten by the quotient: the divisor's gradient reads the quotient
@rule(operator.itruediv, *_forms("div_", "divide_", "true_divide_"), "__idiv__")
def _div_in_place(fn, g, out, input, other, *, rounding_mode=None):
    return _quotient_grads(g, input, other, out, rounding_mode)


def _quotient_grads(g, input, other, quotient, rounding_mode):
    if rounding_mode is not None:  # floor/trunc division is piecewise constant: torch gives it a zero gradient
        for x in (input, other):
            if is_tensor(x):
                yield x, torch.zeros_like(x)
        return
    if is_tensor(input):
        yield input, unbroadcast(g / other, input)
    if is_tensor(other):
        q = quotient if quotient is not None else input / other
        yield other, unbroadcast(-g * (q / other), other)


@rule("__rdiv__")  # the name of x.__rtruediv__
def _rdiv(fn, g, out, self, other):
    return _div(fn, g, None, other, self)


@rule(operator.neg, *_forms("neg", "neg_", "negative", "negative_"))
def _neg(fn, g, out, input):
    yield input, -g


@rule(operator.pos, *_forms("positive"))
def _pos(fn, g, out, input):
    yield input, g


@rule(operator.pow, pow, *_forms("pow"))  # x.__pow__ is named pow; pow(x, 2) is x ** 2
def _pow(fn, g, out, input=None, exponent=None, self=None):
    base = self if input is None else input  # torch.pow(self=2, exponent=x) names a number base ``self``
    if is_tensor(base):
        if is_tensor(exponent):
            d = torch.where(exponent == 0, 0.0, exponent * base.pow(exponent - 1))
            yield base, unbroadcast(g * d, base)
        elif exponent != 0:
            yield base, g * (exponent * base.pow(exponent - 1))
    if is_tensor(exponent):
        if is_tensor(base):
            d = torch.where((base == 0) & (exponent >= 0), 0.0, out * base.log())
        elif base == 0:
            d = torch.where(exponent >= 0, 0.0, out * -math.inf)
        else:
            d = out * (math.log(base) if base > 0 else math.nan)
        yield exponent, unbroadcast(g * d, exponent)


@rule("__rpow__")
def _rpow(fn, g, out, self, other):
    return _pow(fn, g, out, other, self)


# ----------------------------------------------------------------------------
# products


def _matmul_grads(g, a, b):
    """Cotangents of ``a @ b`` with torch.matmul's meaning: 1-D operands and broadcast batch dims."""
    if a.dim() == 1 and b.dim() == 1:
        return g * b, g * a
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    g2 = g.unsqueeze(-2) if a.dim() == 1 else g
    g2 = g2.unsqueeze(-1) if b.dim() == 1 else g2
    ga = g2 @ b2.mT
    if b2.dim() == 2 and a2.dim() > 2:  # a batch times one matrix: fold the batch into rows, one product
        gb = a2.reshape(-1, a2.shape[-1]).mT @ g2.reshape(-1, g2.shape[-1])
    else:
        gb = a2.mT @ g2
    ga = ga.sum_to_size(a2.shape) if ga.shape != a2.shape else ga
    gb = gb.sum_to_size(b2.shape) if gb.shape != b2.shape else gb
    return ga.reshape(a.shape), gb.reshape(b.shape)


@rule(operator.matmul, operator.imatmul, *_forms("matmul"), "__matmul__")  # tensors have no in-place @=
def _matmul(fn, g, out, input, other):
    ga, gb = _matmul_grads(g, input, other)
    return ((input, ga), (other, gb))


# (a rule that hands its work to another passes None for the result where that one reads none of it: whether a
# rule reads its result is read off its code, Rule.reads_out, and a later change of the result in place is fine)
@rule("__rmatmul__")
def _rmatmul(fn, g, out, self, other):
    return _matmul(fn, g, None, other, self)


@rule(*_forms("mm", "bmm"))
def _mm(fn, g, out, input, mat2):
    return _matmul(fn, g, None, input, mat2)


@rule(*_forms("mv"))
def _mv(fn, g, out, input, vec):
    return _matmul(fn, g, None, input, vec)


@rule(*_forms("dot"))
def _dot(fn, g, out, input, tensor):
    return _matmul(fn, g, None, input, tensor)


@rule(*_forms("outer", "ger"))
def _outer(fn, g, out, input, vec2):
    yield input, g @ vec2
    yield vec2, g.T @ input


@rule(F.linear)
def _linear(fn, g, out, input, weight, bias=None):
    if weight.dim() == 2:
        yield input, g @ weight
        yield weight, _weight_grad(g, input)
    else:  # a 1-D weight: input @ weight
        yield from zip((input, weight), _matmul_grads(g, input, weight))
    if bias is not None:
        yield bias, unbroadcast(g, bias)


def _weight_grad(g, x):
    """Gradient of ``x @ w.T`` for w, summed over all leading (batch) dimensions: kept as its factors,
    so that a weight used at many nodes gets one matrix product (autodiff.factors)."""
    return Outer(g, x)


# ----------------------------------------------------------------------------
# elementwise


_LN2, _LN10 = math.log(2.0), math.log(10.0)

# name -> (cotangent of the input from (g, x, y = result), whether it reads only y): those also serve the
# in-place forms (x.exp_()), where x is the result by the time the gradient runs
_UNARY = {
    "exp": (lambda g, x, y: g * y, True),
    "exp2": (lambda g, x, y: g * y * _LN2, True),
    "expm1": (lambda g, x, y: g * (y + 1), True),
    "log": (lambda g, x, y: g / x, False),
    "log2": (lambda g, x, y: g / (x * _LN2), False),
    "log10": (lambda g, x, y: g / (x * _LN10), False),
    "log1p": (lambda g, x, y: g / (x + 1), False),
    "sqrt": (lambda g, x, y: g / (2 * y), True),
    "rsqrt": (lambda g, x, y: -0.5 * g * y.pow(3), True),
    "reciprocal": (lambda g, x, y: -g * (y * y), True),
    "square": (lambda g, x, y: g * 2 * x, False),
    "abs": (lambda g, x, y: g * x.sgn(), False),
    "sin": (lambda g, x, y: g * x.cos(), False),
    "cos": (lambda g, x, y: g * -x.sin(), False),
    "tan": (lambda g, x, y: g * (1 + y * y), True),
    "sinh": (lambda g, x, y: g * x.cosh(), False),
    "cosh": (lambda g, x, y: g * x.sinh(), False),
    "atan": (lambda g, x, y: g / (x * x + 1), False),
    "erf": (lambda g, x, y: g * (2 / math.sqrt(math.pi)) * (-x * x).exp(), False),
    "tanh": (lambda g, x, y: g * (1 - y * y), True),
    "sigmoid": (lambda g, x, y: g * (1 - y) * y, True),
    "relu": (lambda g, x, y: g.masked_fill(y <= 0, 0), True),  # torch's threshold_backward, NaN included
}

_UNARY_ALIASES = {
    "abs": (torch.absolute, torch.Tensor.absolute, "absolute", abs),
    "exp2": (torch.special.exp2,),
    "expm1": (torch.special.expm1,),
    "log1p": (torch.special.log1p,),
    "erf": (torch.special.erf,),
    "sigmoid": (torch.special.expit, F.sigmoid),
    "tanh": (F.tanh,),
    "relu": (F.relu, F.relu_),
}


def _unary(name, derivative, reads_result):
    if reads_result:
        def vjp(fn, g, out, input, inplace=False):
            yield input, derivative(g, input, out)
    else:  # (its result is not read: a change of it in place afterwards leaves the gradient as it was)
        def vjp(fn, g, out, input, inplace=False):
            yield input, derivative(g, input, None)

    vjp.__name__ = vjp.__qualname__ = f"_{name}"
    return vjp


for _name, (_derivative, _reads_result) in _UNARY.items():
    _vjp = rule(*_forms(_name), *(_forms(_name + "_") if _reads_result else ()),
                *_UNARY_ALIASES.get(_name, ()))(_unary(_name, _derivative, _reads_result))
    if _reads_result:  # (its input is only where the cotangent goes: changing it in place afterwards is fine)
        SHAPE_ONLY.add(_vjp)
del _name, _derivative, _reads_result, _vjp


def _unary_rule(name):
    return GRAD.by_callable[getattr(torch, name)].vjp


@rule(F.leaky_relu, F.leaky_relu_)
def _leaky_relu(fn, g, out, input, negative_slope=0.01, inplace=False):
    # in place, input is the result: of the same sign for any positive slope, as torch also relies on
    yield input, torch.where(input > 0, g, g * negative_slope)


@rule(F.elu, F.elu_)
def _elu(fn, g, out, input, alpha=1.0, inplace=False):
    if inplace or fn is F.elu_:  # only the result is left: alpha * exp(x) = y + alpha below 0
        yield input, torch.where(out <= 0, g * (out + alpha), g)
    else:
        yield input, torch.where(input <= 0, g * alpha * input.exp(), g)


_SQRT_HALF = math.sqrt(0.5)
_PDF_SCALE = 1 / math.sqrt(2 * math.pi)
_TANH_SCALE = math.sqrt(2 / math.pi)


@rule(F.gelu)
def _gelu(fn, g, out, input, approximate="none"):
    x = input
    if approximate == "tanh":
        t = torch.tanh(_TANH_SCALE * (x + 0.044715 * x * x * x))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _TANH_SCALE * (1 + 3 * 0.044715 * x * x)
    else:
        d = 0.5 * (1 + torch.erf(x * _SQRT_HALF)) + x * _PDF_SCALE * (-0.5 * x * x).exp()
    yield input, g * d


@rule(F.softplus)
def _softplus(fn, g, out, input, beta=1.0, threshold=20.0):
    bx = input * beta
    yield input, torch.where(bx > threshold, g, g * torch.sigmoid(bx))  # linear above the threshold


@rule(F.silu)
def _silu(fn, g, out, input, inplace=False):
    if inplace:
        raise NotImplementedError("recompile cannot differentiate F.silu(inplace=True): its gradient needs the "
                                  "overwritten input; use inplace=False")
    s = torch.sigmoid(input)
    yield input, g * s * (1 + input * (1 - s))


@rule(F.hardtanh, F.hardtanh_)
def _hardtanh(fn, g, out, input, min_val=-1.0, max_val=1.0, inplace=False):
    # in place, input is the clamped result: at a bound exactly where the input was beyond it
    yield input, g.masked_fill((input <= min_val) | (input >= max_val), 0)


@rule(F.relu6)
def _relu6(fn, g, out, input, inplace=False):
    return _hardtanh(fn, g, None, input, 0.0, 6.0)


@rule(*_forms("clamp", "clip"))
def _clamp(fn, g, out, input, min=None, max=None):
    # torch's convention: the input owns the gradient at the bounds themselves; a tensor bound gets it
    # where it took over (when min > max, max wins)
    above = input >= min if min is not None else None
    below = input <= max if max is not None else None
    inside = below if above is None else above if below is None else above & below
    yield input, unbroadcast(torch.where(inside, g, 0.0), input)
    if is_tensor(min):
        took = ~above if max is None else ~above & (min < max)
        yield min, unbroadcast(torch.where(took, g, 0.0), min)
    if is_tensor(max):
        took = ~below if min is None else ~below | (max < min)
        yield max, unbroadcast(torch.where(took, g, 0.0), max)


@rule(*_forms("clamp_min"))
def _clamp_min(fn, g, out, input, min):
    return _clamp(fn, g, None, input, min=min)


@rule(*_forms("clamp_max"))
def _clamp_max(fn, g, out, input, max):
    return _clamp(fn, g, None, input, max=max)


@rule(torch.where)
def _where(fn, g, out, condition, input=None, other=None):
    yield input, unbroadcast(torch.where(condition, g, 0.0), input)
    yield other, unbroadcast(torch.where(condition, 0.0, g), other)


@rule(torch.Tensor.where, "where")
def _where_method(fn, g, out, self, condition, other):
    return _where(fn, g, None, condition, self, other)


def _pick(g, a, b, a_loses, b_loses):
    """maximum/minimum: the winner takes the cotangent, ties share it half and half (torch's convention)."""
    share = torch.where(a == b, g / 2, g)
    yield a, unbroadcast(share.masked_fill(a_loses, 0), a)
    yield b, unbroadcast(share.masked_fill(b_loses, 0), b)


@rule(*_forms("maximum"))
def _maximum(fn, g, out, input, other):
    return _pick(g, input, other, input < other, input > other)


@rule(*_forms("minimum"))
def _minimum(fn, g, out, input, other):
    return _pick(g, input, other, input > other, input < other)


@rule(*_forms("masked_fill", "masked_fill_"))
def _masked_fill(fn, g, out, input, mask, value):
    # in place needs no old value: the filled places simply lose their cotangent
    yield input, g.masked_fill(mask, 0)
    if is_tensor(value):
        yield value, unbroadcast(torch.where(mask, g, 0.0).sum(), value)


# ----------------------------------------------------------------------------
# reductions


@rule(*_forms("sum"))
def _sum(fn, g, out, input, dim=None, keepdim=False, dtype=None, **aliases):
    dim, keepdim = _dim_kw(dim, keepdim, aliases)
    yield input, unbroadcast(_restore(g, input, dim, keepdim), input)  # unbroadcast: back from a dtype= sum


@rule(*_forms("nansum"))
def _nansum(fn, g, out, input, dim=None, keepdim=False, dtype=None, **aliases):
    dim, keepdim = _dim_kw(dim, keepdim, aliases)
    yield input, unbroadcast(_restore(g, input, dim, keepdim).masked_fill(input.isnan(), 0), input)


@rule(*_forms("mean"))
def _mean(fn, g, out, input, dim=None, keepdim=False, dtype=None, **aliases):
    dim, keepdim = _dim_kw(dim, keepdim, aliases)
    count = math.prod(input.shape[d] for d in _reduced(dim, input.dim()))
    yield input, unbroadcast(_restore(g, input, dim, keepdim) / count, input)


def shared_by_ties(grad, tied):
    """``grad`` (broadcast) shared evenly among the places ``tied`` marks (summed over its last dim), as torch's
    full max, min and median share theirs: on the CPU into zeros, so an inf cotangent leaves the others 0; on
    CUDA as ``tied * share``, as there (and as ``amax`` everywhere), where they get ``0 * inf``, NaN."""
    share = grad / tied.sum(-1, keepdim=True)
    if tied.is_cuda:
        return tied * share
    return torch.where(tied, share, torch.zeros((), dtype=share.dtype, device=share.device))


def _extreme(fn, g, out, input, dim, keepdim, other, aliases, pairwise):
    """torch.max/min: of all elements, along a dim (values and indices), or of two tensors."""
    if other is not None or is_tensor(dim):
        return pairwise(fn, g, out, input, dim if other is None else other)
    dim, keepdim = _dim_kw(dim, keepdim, aliases)
    if dim is None:  # ties share the cotangent evenly (a NaN result is every NaN's)
        mask = (input == out) | (input.isnan() & out.isnan())
        return ((input, shared_by_ties(g, mask.reshape(-1)).view(input.shape)),)
    gv, indices = g[0], out[1]
    if gv is None:
        return ()
    if input.dim() == 0:
        return ((input, gv),)
    d = dim_of(dim, input.dim())
    if not keepdim:
        gv, indices = gv.unsqueeze(d), indices.unsqueeze(d)
    return ((input, gv.new_zeros(input.shape).scatter_(d, indices, gv)),)


@rule(*_forms("max"))
def _max(fn, g, out, input, dim=None, keepdim=False, *, other=None, **aliases):
    return _extreme(fn, g, out, input, dim, keepdim, other, aliases, _maximum)


@rule(*_forms("min"))
def _min(fn, g, out, input, dim=None, keepdim=False, *, other=None, **aliases):
    return _extreme(fn, g, out, input, dim, keepdim, other, aliases, _minimum)


@rule(*_forms("amax", "amin"))
def _amax(fn, g, out, input, dim=(), keepdim=False, **aliases):
    dim, keepdim = _dim_kw(dim, keepdim, aliases)
    mask = input == _restore(out, input, dim, keepdim)
    count = mask.sum(_reduced(dim, input.dim()), keepdim=True)
    yield input, _restore(g, input, dim, keepdim) / count * mask  # ties share evenly, as in torch


@rule(*_forms("logsumexp"), torch.special.logsumexp)
def _logsumexp(fn, g, out, input, dim, keepdim=False, **aliases):
    dim, keepdim = _dim_kw(dim, keepdim, aliases)
    yield input, _restore(g, input, dim, keepdim) * (input - _restore(out, input, dim, keepdim)).exp()


def _two_norm(g, out, input, dim, keepdim):
    norm = _restore(out, input, dim, keepdim)
    scale = (_restore(g, input, dim, keepdim) / norm).masked_fill(norm == 0, 0)  # torch's subgradient at 0
    return unbroadcast(input * scale, input)


@rule(*_forms("norm"))
def _norm(fn, g, out, input, p="fro", dim=None, keepdim=False, *rest, dtype=None):
    if p in ("fro", 2) and not rest:
        return ((input, _two_norm(g, out, input, dim, keepdim)),)
    options = {} if dtype is None else {"dtype": dtype}
    return _autograd(_unbound(fn), g, (input, p, dim, keepdim, *rest), options)


@rule(torch.linalg.vector_norm)
def _vector_norm(fn, g, out, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if ord == 2:
        return ((x, _two_norm(g, out, x, dim, keepdim)),)
    return _autograd(functools.partial(torch.linalg.vector_norm, ord=ord, dim=dim, keepdim=keepdim, dtype=dtype),
                     g, (x,))


@rule(torch.linalg.norm)
def _linalg_norm(fn, g, out, A, ord=None, dim=None, keepdim=False, *, dtype=None):
    if ord is None:  # the 2-norm of the vectors, or of the flattened matrices (Frobenius)
        return ((A, _two_norm(g, out, A, dim, keepdim)),)
    return _autograd(functools.partial(torch.linalg.norm, ord=ord, dim=dim, keepdim=keepdim, dtype=dtype), g, (A,))


# ----------------------------------------------------------------------------
# shape


@rule(torch.cat, torch.concat, torch.concatenate)
def _cat(fn, g, out, tensors, dim=0, **aliases):
    d = dim_of(aliases.get("axis", dim), g.dim())  # g, not out: reading out would forbid out += 1 later
    # torch.cat skips legacy empty 1-D tensors whatever the others' shape: they get no cotangent
    joined = [t.dim() == g.dim() for t in tensors]
    pieces = g.split([t.shape[d] if j else 0 for t, j in zip(tensors, joined)], d)
    return ((tensors, [unbroadcast(p, t) if j else None for p, t, j in zip(pieces, tensors, joined)]),)


@rule(torch.stack)
def _stack(fn, g, out, tensors, dim=0, **aliases):
    pieces = g.unbind(dim_of(aliases.get("axis", dim), g.dim()))
    return ((tensors, [unbroadcast(p, t) for p, t in zip(pieces, tensors)]),)


def _filled(g, out):
    """A tuple result's cotangents, zeros where an item got none."""
    return [gi if gi is not None else torch.zeros_like(o) for gi, o in zip(g, out)]


@rule(*_forms("split", "chunk", "tensor_split"))
def _split(fn, g, out, input, sections=None, dim=0, **_):
    # the pieces tile the input along dim, however they were asked for
    yield input, torch.cat(_filled(g, out), dim)


@rule(*_forms("unbind"))
def _unbind(fn, g, out, input, dim=0):
    yield input, torch.stack(_filled(g, out), dim)


@rule(*_forms("reshape", "view", "view_as", "reshape_as", "squeeze", "unsqueeze", "flatten", "unflatten", "ravel",
              "contiguous", "clone"), nn.Flatten, nn.Unflatten, nn.Identity)
def _reshaped(fn, g, out, input, *args, **kwargs):
    """Ops that keep the elements in order: the cotangent takes the input's shape back."""
    if isinstance(kwargs.get("dtype", args[0] if args else None), torch.dtype):
        return  # x.view(dtype) reinterprets the bits: no gradient, as in torch
    yield input, g.reshape(input.shape)


@rule(*_forms("transpose", "swapdims"))
def _transpose(fn, g, out, input, dim0, dim1):
    yield input, g.transpose(dim0, dim1)


@rule(*_forms("swapaxes"))
def _swapaxes(fn, g, out, input, axis0, axis1):
    return _transpose(fn, g, None, input, axis0, axis1)


@rule(*_forms("movedim", "moveaxis"))
def _movedim(fn, g, out, input, source, destination):
    yield input, g.movedim(destination, source)


@rule(*_forms("t"))
def _t(fn, g, out, input):
    yield input, g.t()


def _dims_arg(dims, kwargs, name="dims"):
    """Dims given as ``f(x, dims)``, ``x.f(dims)``, ``x.f(*dims)`` or by keyword."""
    dims = kwargs.get(name, dims)
    if len(dims) == 1 and not isinstance(dims[0], int):
        dims = dims[0]
    return [dims] if isinstance(dims, int) else list(dims)


@rule(*_forms("permute"))
def _permute(fn, g, out, input, *dims, **kwargs):
    order = _dims_arg(dims, kwargs)
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[dim_of(d, len(order))] = i
    yield input, g.permute(inverse)


@rule(*_forms("flip"))
def _flip(fn, g, out, input, *dims, **kwargs):
    yield input, g.flip(_dims_arg(dims, kwargs))


@rule(*_forms("fliplr"))
def _fliplr(fn, g, out, input):
    yield input, g.fliplr()


@rule(*_forms("flipud"))
def _flipud(fn, g, out, input):
    yield input, g.flipud()


@rule(*_forms("roll"))
def _roll(fn, g, out, input, shifts, dims=None):
    back = -shifts if isinstance(shifts, int) else [-s for s in shifts]
    yield input, g.roll(back) if dims is None else g.roll(back, dims)


@rule(*_forms("expand", "expand_as", "broadcast_to"))
def _expand(fn, g, out, input, *args, **kwargs):
    yield input, unbroadcast(g, input)


@rule(torch.broadcast_tensors)
def _broadcast_tensors(fn, g, out, *tensors):
    return ((t, unbroadcast(gt, t)) for t, gt in zip(tensors, g) if gt is not None)


def _untile(g, input, reps):
    """The cotangent of ``input`` repeated ``reps`` times per dim: the copies summed."""
    reps = list(reps)
    shape = [1] * (len(reps) - input.dim()) + list(input.shape)
    if not reps:
        return g
    interleaved = [n for pair in zip(reps, shape) for n in pair]
    return g.reshape(interleaved).sum(list(range(0, len(interleaved), 2))).reshape(input.shape)


@rule(*_forms("repeat"))
def _repeat(fn, g, out, input, *repeats, **kwargs):
    yield input, _untile(g, input, _dims_arg(repeats, kwargs, "repeats"))


@rule(*_forms("tile"))
def _tile(fn, g, out, input, dims):
    dims = [dims] if isinstance(dims, int) else list(dims)
    yield input, _untile(g, input, [1] * (input.dim() - len(dims)) + dims)


@rule(*_forms("narrow"))
def _narrow(fn, g, out, input, dim, start, length):
    grad = g.new_zeros(input.shape)
    grad.narrow(dim, start, length).copy_(g)
    yield input, grad


@rule(*_forms("select"))
def _select(fn, g, out, input, dim, index):
    yield input, torch.select_scatter(g.new_zeros(input.shape), g, dim, index)


@rule(*_forms("index_select"))
def _index_select(fn, g, out, input, dim, index):
    if input.dim() == 0:
        yield input, g.reshape(())
    else:
        yield input, g.new_zeros(input.shape).index_add_(dim, index.reshape(-1), g)


@rule(*_forms("gather"))
def _gather(fn, g, out, input, dim, index, *, sparse_grad=False):
    yield input, g.new_zeros(input.shape).scatter_add_(dim, index, g)


@rule(*(getattr(torch.Tensor, n) for n in ("float", "double", "half", "bfloat16", "to", "type_as", "cpu")),
      "float", "double", "half", "bfloat16", "to", "type_as", "cpu")
def _cast(fn, g, out, input, *args, **kwargs):
    """Conversions of dtype or device: the cotangent goes back to the input's."""
    yield input, g.to(device=input.device, dtype=input.dtype)


@rule(*_forms("detach"))
def _detach(fn, g, out, input):
    return ()  # detach blocks the gradient: that is what it is for


@rule(intrinsics.fill_fresh)
def _fill_fresh(fn, g, out, input, value):
    """``x.fill_(v)`` of a tensor only its frame holds: each element is ``v``, none of ``x``'s old ones."""
    if is_tensor(value):
        yield value, g.sum().reshape(value.shape)


@rule(intrinsics.zero_fresh)
def _zero_fresh(fn, g, out, input):
    return ()


@rule(intrinsics.setitem_fresh)
def _setitem_fresh(fn, g, out, input, index, value):
    """``x[i] = v`` of a tensor only its frame holds, written out of place: ``v`` gets the cotangent of that
    region (summed where it was broadcast), which ``x`` loses."""
    if is_tensor(value):
        yield value, written_cotangent(g[index], value)
    if is_tensor(input):
        rest = g.clone()
        rest[index] = 0
        yield input, rest


# ----------------------------------------------------------------------------
# indexing and the structure the frontend's own helpers give tensors


@rule(operator.getitem, torch.Tensor.__getitem__, "__getitem__")
def _getitem(fn, g, out, obj, index):
    if not is_tensor(obj):
        return ()  # a list or tuple item is the object itself: its cotangent is already its own
    rows = _rows_read(obj, index)
    if rows is not None:  # (x[t] in a loop: kept as rows, one gradient formed at the end, not one per read)
        return ((obj, Rows(rows, g, tuple(obj.shape))),)
    parts = index if type(index) is tuple else (index,)
    advanced = [_advanced(p) for p in parts]
    grad = g.new_zeros(obj.shape)
    if all(a is False for a in advanced):
        grad[index] = g  # basic indexing picks each element at most once
    elif all(a is True for a in advanced):
        # indices (lists, tensors, masks) alone, the embedding-like case: repeated ones accumulate
        grad.index_put_(tuple(torch.as_tensor(p, device=obj.device) for p in parts), g, accumulate=True)
    else:  # advanced indices among slices, ints, None: where the result's dims go is numpy's business
        return _autograd(operator.getitem, g, (obj, index))
    return ((obj, grad),)


def _rows_read(obj, index):
    """The rows of dim 0 that ``obj[index]`` reads, as a LongTensor (negative indices counted from the end),
    where ``index`` is an int or an integer tensor alone; None for any other index."""
    if obj.dim() == 0:
        return None
    if type(index) is int:
        return torch.tensor([index % obj.shape[0]], device=obj.device)
    if is_tensor(index) and not index.dtype.is_floating_point and index.dtype not in (torch.bool, torch.uint8) \
            and not index.is_complex():
        return index.to(device=obj.device, dtype=torch.long) % obj.shape[0]
    return None


def _advanced(part):
    """False for a basic index, True for one index_put_ takes as it is, None for the others."""
    if is_tensor(part):
        return None if part.dim() == 0 and part.dtype == torch.bool else True
    if isinstance(part, list):  # torch reads a list holding sequences, slices or tensors as a tuple
        return True if all(isinstance(v, int) for v in part) else None
    return False


@rule(intrinsics.unpack, intrinsics.as_sequence)
def _rows(fn, g, out, obj, *rest):
    """``a, b = t`` and ``for row in t`` take a tensor's rows (unbind); other sequences are themselves."""
    if not is_tensor(obj):
        return ()
    rows = [r if r is not None else torch.zeros_like(o) for r, o in zip(g, out)]
    return ((obj, torch.stack(rows)),)


@rule(getattr)
def _getattr(fn, g, out, obj, name, *default):
    if not is_tensor(obj):
        return ()
    if name in ("T", "mT", "H", "mH"):
        back = {"T": lambda t: t.permute(*reversed(range(t.dim()))), "mT": lambda t: t.mT,
                "H": lambda t: t.permute(*reversed(range(t.dim()))).conj(), "mH": lambda t: t.mH}[name]
        return ((obj, back(g)),)
    if name == "real":
        return ((obj, g.to(obj.dtype) if obj.is_complex() else g),)
    return ()


# ----------------------------------------------------------------------------
# softmax, losses, embeddings


def _softmax_args(input, dim, rest, dtype):
    """F.softmax's third parameter is _stacklevel, torch.softmax's is dtype; F.softmax's dim may be None."""
    if dtype is None:
        dtype = next((r for r in rest if isinstance(r, torch.dtype)), None)
    if dim is None:  # F.softmax's implicit dim
        dim = 0 if input.dim() in (0, 1, 3) else 1
    return dim, dtype


@rule(*_forms("softmax"), F.softmax, torch.special.softmax)
def _softmax(fn, g, out, input, dim=None, *rest, dtype=None, **_):
    dim, dtype = _softmax_args(input, dim, rest, dtype)
    yield input, unbroadcast(out * (g - (g * out).sum(dim, keepdim=True)), input)


@rule(*_forms("log_softmax"), F.log_softmax, torch.special.log_softmax)
def _log_softmax(fn, g, out, input, dim=None, *rest, dtype=None, **_):
    dim, dtype = _softmax_args(input, dim, rest, dtype)
    yield input, unbroadcast(g - out.exp() * g.sum(dim, keepdim=True), input)


def _class_weights(g, input, target, weight, ignore_index, reduction):
    """For the class-index losses: each target's share of the cotangent, and the targets safe to index with.

    The class dim of ``input`` is 1 (0 for one unbatched sample); ``target`` has the other dims.
    """
    keep = target != ignore_index
    safe = target.masked_fill(~keep, 0)
    w = keep.to(input.dtype) if weight is None else weight[safe] * keep
    if reduction == "mean":
        w = w / w.sum()  # the mean is over the weights of the targets not ignored
    cd = 1 if input.dim() > 1 else 0
    return (g * w).unsqueeze(cd), safe.unsqueeze(cd), cd


def _exact_class_loss(target, size_average, reduce, label_smoothing=0.0):
    return not (target.is_floating_point() or size_average is not None or reduce is not None or label_smoothing)


@rule(F.cross_entropy)
def _cross_entropy(fn, g, out, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    if not _exact_class_loss(target, size_average, reduce, label_smoothing):
        f = functools.partial(F.cross_entropy, weight=weight, size_average=size_average, ignore_index=ignore_index,
                              reduce=reduce, reduction=reduction, label_smoothing=label_smoothing)
        return _autograd(f, g, (input, target))
    coef, index, cd = _class_weights(g, input, target, weight, ignore_index, reduction)
    grad = torch.softmax(input, cd) * coef  # softmax minus the target's one-hot, scaled by its share
    return ((input, grad.scatter_add_(cd, index, -coef)),)


@rule(F.nll_loss)
def _nll_loss(fn, g, out, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
              reduction="mean"):
    if not _exact_class_loss(target, size_average, reduce):
        f = functools.partial(F.nll_loss, weight=weight, size_average=size_average, ignore_index=ignore_index,
                              reduce=reduce, reduction=reduction)
        return _autograd(f, g, (input, target))
    coef, index, cd = _class_weights(g, input, target, weight, ignore_index, reduction)
    return ((input, torch.zeros_like(input).scatter_(cd, index, -coef)),)


@rule(F.mse_loss)
def _mse_loss(fn, g, out, input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if size_average is not None or reduce is not None or weight is not None:
        f = functools.partial(F.mse_loss, size_average=size_average, reduce=reduce, reduction=reduction)
        return _autograd(f, g, (input, target), {} if weight is None else {"weight": weight})
    diff = input - target
    scale = 2 / diff.numel() if reduction == "mean" else 2
    grad = (scale * g) * diff
    return ((input, unbroadcast(grad, input)), (target, unbroadcast(-grad, target)))


@rule(F.binary_cross_entropy_with_logits)
def _bce_with_logits(fn, g, out, input, target, weight=None, size_average=None, reduce=None, reduction="mean",
                     pos_weight=None):
    if weight is not None or pos_weight is not None or size_average is not None or reduce is not None:
        f = functools.partial(F.binary_cross_entropy_with_logits, weight=weight, size_average=size_average,
                              reduce=reduce, reduction=reduction, pos_weight=pos_weight)
        return _autograd(f, g, (input, target))
    coef = g / input.numel() if reduction == "mean" else g
    return ((input, (torch.sigmoid(input) - target) * coef), (target, -input * coef))


@rule(F.binary_cross_entropy)
def _binary_cross_entropy(fn, g, out, input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    f = functools.partial(F.binary_cross_entropy, weight=weight, size_average=size_average, reduce=reduce,
                          reduction=reduction)
    return _autograd(f, g, (input, target))


@rule(F.embedding)
def _embedding(fn, g, out, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
               sparse=False):
    # max_norm renormalises rows in place during the forward, outside the graph: the backward is the same;
    # sparse=True asks torch for a sparse gradient, this one is dense
    rows = input.reshape(-1)
    if not scale_grad_by_freq and padding_idx is None:  # the common case: rows formed once per backward
        yield weight, Rows(rows, g.reshape(-1, weight.shape[-1]), tuple(weight.shape))
        return
    grad = g.new_zeros(weight.shape).index_add_(0, rows, g.reshape(-1, weight.shape[-1]))
    if scale_grad_by_freq:
        grad /= torch.bincount(rows, minlength=weight.shape[0]).clamp_min(1).unsqueeze(1)
    if padding_idx is not None:
        grad[padding_idx] = 0
    yield weight, grad


# ----------------------------------------------------------------------------
# modules: the functional rule, with the options the module's forward passes


def _module(module_type, vjp, functional, *attrs):
    def module_vjp(module, g, out, *args, **kwargs):  # (forward's keywords, input and target, are the functional's)
        return vjp(functional, g, out, *args, **kwargs, **{a: getattr(module, a) for a in attrs})

    module_vjp.__name__ = module_vjp.__qualname__ = f"_{module_type.__name__}"
    module_vjp.attrs = attrs
    rule(module_type)(module_vjp)


def seen(module, rule):
    """What ``rule`` reads of ``module``, as it is now (the forward's call): a weight swapped or reassigned
    before the backward (``torch.func.functional_call``) is not the one the call used."""
    return types.SimpleNamespace(**{a: getattr(module, a) for a in rule.attrs}) if rule.attrs else module


_module(nn.Linear, _linear, F.linear, "weight", "bias")
_module(nn.Embedding, _embedding, F.embedding, "weight", "padding_idx", "max_norm", "norm_type",
        "scale_grad_by_freq", "sparse")
_module(nn.Tanh, _unary_rule("tanh"), torch.tanh)
_module(nn.Sigmoid, _unary_rule("sigmoid"), torch.sigmoid)
_module(nn.ReLU, _unary_rule("relu"), torch.relu)
_module(nn.LeakyReLU, _leaky_relu, F.leaky_relu, "negative_slope")
_module(nn.ELU, _elu, F.elu, "alpha", "inplace")
_module(nn.GELU, _gelu, F.gelu, "approximate")
_module(nn.SiLU, _silu, F.silu, "inplace")
_module(nn.Softplus, _softplus, F.softplus, "beta", "threshold")
_module(nn.Hardtanh, _hardtanh, F.hardtanh, "min_val", "max_val")
_module(nn.ReLU6, _hardtanh, F.hardtanh, "min_val", "max_val")
_module(nn.Softmax, _softmax, F.softmax, "dim")
_module(nn.LogSoftmax, _log_softmax, F.log_softmax, "dim")
_module(nn.CrossEntropyLoss, _cross_entropy, F.cross_entropy, "weight", "ignore_index", "reduction",
        "label_smoothing")
_module(nn.NLLLoss, _nll_loss, F.nll_loss, "weight", "ignore_index", "reduction")
_module(nn.MSELoss, _mse_loss, F.mse_loss, "reduction")
_module(nn.BCEWithLogitsLoss, _bce_with_logits, F.binary_cross_entropy_with_logits, "weight", "pos_weight",
        "reduction")


for _fresh in intrinsics.OUT_OF_PLACE:  # (``x.relu_()`` written out of place: ``x.relu()``'s rule)
    GRAD.register(_fresh)(GRAD.by_callable[getattr(torch, _fresh.method)].vjp)
del _fresh


SHAPE_ONLY.update({_fill_fresh, _zero_fresh, _add, _add_fresh, _sub, _neg, _pos, _sum, _mean, _cat, _stack,
                   _split, _unbind, _reshaped, _transpose, _t, _swapaxes, _movedim, _getattr, _permute, _expand,
                   _narrow, _select,
                   _rows, _softmax, _log_softmax, _detach, _flip, _fliplr, _flipud, _roll, _broadcast_tensors,
                   _repeat, _tile, _cast})
# (the positions of a function's arguments; a method's receiver comes first, as backprop.check_version gives it)
READ_FOR_OTHERS = {_mul: (0, 1), _div: (0,)}  # x / y: x is read for y's gradient only; y for both
# a product's factors, each read for the other's gradient alone (``torch.dot(v, c)`` with a constant c: v may
# change afterwards, as eager's dot saves v only where c needs a gradient)
READ_FOR_OTHERS.update(dict.fromkeys((_matmul, _rmatmul, _mm, _mv, _dot, _outer, _linear), (0, 1)))
# torch.where(c, x, y) reads c, and only the shapes of x and y; x[i] reads i (where the cotangent goes: an index
# tensor changed in place afterwards would send it elsewhere), and only x's shape; so does ``x[i] = v`` written
# out of place (``setitem_fresh``), and only the shapes of x and v
# (``torch.index_select(x, dim, i)`` likewise reads i, and only x's shape; eager's ``gather`` keeps x, and so
# refuses a change of it, as its rule here does)
READS_ONLY = {_where: (0,), _where_method: (1,), _getitem: (1,), _index_select: (2,), _setitem_fresh: (1,)}
# vjps that read nothing where their first argument is no tensor (a list's item is the object itself)
ITEM_READS = frozenset({_getitem})
# vjps that read no value of their input along a dim (``torch.max(v, 0)``: the indices of their result alone)
ALONG_A_DIM = frozenset({_max, _min})
for _table in (GRAD.by_callable, GRAD.by_method, GRAD.by_module):
    for _r in _table.values():
        _r.reads_inputs = _r.vjp not in SHAPE_ONLY
        _r.read_for_others = READ_FOR_OTHERS.get(_r.vjp, ())
        _r.reads_only = READS_ONLY.get(_r.vjp)
        _r.reads_only_names = None if _r.reads_only is None else tuple(
            list(inspect.signature(_r.vjp).parameters)[3 + k] for k in _r.reads_only)
