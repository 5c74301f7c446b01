"""Reverse-mode rules for Calls, looked up by the callable (the table ``passes.grad`` relies on).

A rule is ``vjp(fn, g, out, *args, **kwargs)``: the callable, the cotangent of
its result, the result itself and the arguments of the forward call. It returns
an iterable of ``(input, cotangent)`` pairs; an input that is not a tensor (a
Python number, a list of tensors given to ``torch.cat``) is taken apart by the
caller, and pairs whose input needs no gradient are simply dropped. Parameters
a module uses are inputs like any other: ``(module.weight, g_w)``.

``g`` has the structure of ``out``: a tensor, or for a tuple result (``chunk``,
``unbind``) a tuple with None where an item got no cotangent.

Three tables: by callable (``torch.tanh``, ``operator.mul``, ``F.linear``,
``torch.Tensor.tanh``), by Tensor method name (``x.tanh()``: the bound tensor
is passed first, as ``self``) and by nn.Module type (``self.linear(x)``: the
module is ``fn``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from . import semantics as sem

FUNCTION_RULES = {}
METHOD_RULES = {}
MODULE_RULES = {}

_BOUND_BUILTIN = type([].append)  # a bound method of a builtin type: x.tanh for a tensor x


class Rule:
    """A registered vjp; ``method`` rules take the bound tensor as their first argument."""

    __slots__ = ("name", "vjp", "method")

    def __init__(self, name, vjp, method=False):
        self.name = name
        self.vjp = vjp
        self.method = method

    def __call__(self, fn, g, out, args, kwargs):
        if self.method:
            return self.vjp(fn, g, out, fn.__self__, *args, **kwargs)
        return self.vjp(fn, g, out, *args, **kwargs)

    def __repr__(self):
        return f"<grad rule {self.name}>"


def rule(*targets):
    """Register a vjp for callables, Tensor method names (strings) and nn.Module types."""

    def register(vjp):
        for t in targets:
            if isinstance(t, str):
                METHOD_RULES[t] = Rule(t, vjp, method=True)
            elif isinstance(t, type) and issubclass(t, nn.Module):
                MODULE_RULES[t] = Rule(t.__name__, vjp)
            else:
                FUNCTION_RULES[t] = Rule(getattr(t, "__name__", repr(t)), vjp)
        return vjp

    return register


def lookup(fn):
    """The Rule for callable ``fn``, or None."""
    try:
        found = FUNCTION_RULES.get(fn)
    except TypeError:  # unhashable callable
        found = None
    if found is not None:
        return found
    kind = type(fn)
    if kind is _BOUND_BUILTIN:
        if isinstance(fn.__self__, torch.Tensor):
            return METHOD_RULES.get(fn.__name__)
        return None
    if isinstance(fn, nn.Module):
        return MODULE_RULES.get(kind)
    return None


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


def dim_of(dim, ndim):
    return dim + ndim if dim < 0 else dim


# ----------------------------------------------------------------------------
# arithmetic


@rule(operator.add, operator.iadd, torch.add, "add", "__add__", "__radd__")
def _add(fn, g, out, a, b, alpha=1):
    yield a, unbroadcast(g, a)
    yield b, unbroadcast(g if alpha == 1 else g * alpha, b)


@rule(operator.sub, operator.isub, torch.sub, "sub", "__sub__")
def _sub(fn, g, out, a, b, alpha=1):
    yield a, unbroadcast(g, a)
    yield b, unbroadcast(-g if alpha == 1 else -g * alpha, b)


@rule(operator.mul, operator.imul, torch.mul, "mul", "__mul__", "__rmul__")
def _mul(fn, g, out, a, b):
    if is_tensor(a):
        yield a, unbroadcast(g * b, a)
    if is_tensor(b):
        yield b, unbroadcast(g * a, b)


@rule(torch.tanh, torch.Tensor.tanh, "tanh")
def _tanh(fn, g, out, x):
    yield x, g * (1 - out * out)


@rule(torch.sigmoid, torch.Tensor.sigmoid, "sigmoid")
def _sigmoid(fn, g, out, x):
    yield x, g * out * (1 - out)


@rule(F.linear)
def _linear(fn, g, out, x, weight, bias=None):
    yield x, g @ weight
    yield weight, _weight_grad(g, x)
    if bias is not None:
        yield bias, unbroadcast(g, bias)


def _weight_grad(g, x):
    """Gradient of ``x @ w.T`` for w: summed over all leading (batch) dimensions."""
    if x.dim() == 1:
        return torch.outer(g, x)
    return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])


@rule(nn.Linear)
def _linear_module(module, g, out, x):
    return _linear(None, g, out, x, module.weight, module.bias)


# ----------------------------------------------------------------------------
# structure: what the frontend's own helpers do to tensors


@rule(operator.getitem)
def _getitem(fn, g, out, obj, index):
    if not is_tensor(obj):
        return ()  # a list or tuple item is the object itself: its cotangent is already its own
    grad = obj.new_zeros(obj.shape) if g.dtype == obj.dtype else torch.zeros(obj.shape, dtype=g.dtype,
                                                                              device=obj.device)
    grad.index_put_(_as_indices(index, obj), g, accumulate=True) if _advanced(index) else grad.__setitem__(index, g)
    return ((obj, grad),)


def _advanced(index):
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (torch.Tensor, list)) for p in parts)


def _as_indices(index, obj):
    if isinstance(index, tuple):
        raise NotImplementedError
    return (torch.as_tensor(index, device=obj.device),)


@rule(sem.unpack, sem.as_sequence)
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
