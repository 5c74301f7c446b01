"""Where a rule is filed: under a callable, a Tensor method's name or an nn.Module type.

A program holds callables of three kinds, and a rule for each is filed under one key (``key``):
``torch.tanh`` (or ``operator.mul``, ``F.linear``, ``Tensor.tanh``) under itself; a bound Tensor method
(``x.tanh``, ``x.split``) under its name, ``"tanh"``, whatever tensor it is bound to; a module
(``self.linear``) under its type, ``nn.Linear``. A ``RuleTable`` holds one kind of rule by those keys
(the gradient rules of ``autodiff.rules``, the batch rules of ``runtime.batch_rules``, the trace forms of
``codegen.segments``): ``register(*targets)`` files one rule under several keys where it is written, as a
decorator, and ``lookup(fn)`` finds the rule of a callable the program holds when it runs. JAX files one
rule per primitive per transformation the same way.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

BOUND_BUILTIN = type([].append)  # a bound method of a builtin type: x.tanh for a tensor x
BOUND_SLOT = type((0).__add__)  # a bound slot wrapper: x.__getitem__


def by_names(args, kwargs, names):
    """A rule's ``args`` and ``kwargs`` by parameter ``names`` (the values of the ones given), or None for an
    unknown keyword, too many arguments, or one given both ways."""
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    found = dict(zip(names, args))
    if any(k in found for k in kwargs):
        return None
    found.update(kwargs)
    return found


def tensor_method(fn):
    """The name of the torch Tensor method ``fn`` is bound to (``x.tanh`` -> ``"tanh"``), else None. A
    method a Tensor subclass defines itself is not torch's, and gets none."""
    kind = type(fn)
    if kind is BOUND_BUILTIN or kind is BOUND_SLOT:
        return fn.__name__ if isinstance(fn.__self__, torch.Tensor) else None
    if kind is types.MethodType:  # Tensor methods written in Python (x.split, x.norm, x.__rsub__)
        if isinstance(fn.__self__, torch.Tensor) and getattr(fn.__func__, "__module__", "") == "torch._tensor":
            return fn.__name__
    return None


def torch_callable(fn):
    """Whether ``fn`` is torch's: a module, or a callable of one of torch's modules (not torch.utils)."""
    if isinstance(fn, nn.Module):
        return True
    module = getattr(fn, "__module__", None) or ""
    return isinstance(module, str) and (module.startswith("torch") and not module.startswith("torch.utils"))


def has_hooks(module):
    """Whether a hook (the module's own or a global one) may change what ``module`` computes or its gradient:
    forward hooks, and backward hooks, which a rule computing the module's call another way would bypass."""
    m = _nn_module
    return bool(module._forward_hooks or module._forward_pre_hooks or m._global_forward_hooks or
                m._global_forward_pre_hooks) or has_backward_hooks(module)


def has_backward_hooks(module):
    """Whether a backward hook (the module's own or a global one) may change ``module``'s gradient: only a call
    of the module itself (not under torch.func.vmap) runs it."""
    m = _nn_module
    return bool(module._backward_hooks or module._backward_pre_hooks or m._global_backward_hooks or
                m._global_backward_pre_hooks)


def key(fn):
    """What a rule for ``fn`` is filed under: a Tensor method's name, a module's type, else ``fn``."""
    name = tensor_method(fn)
    if name is not None:
        return name
    return type(fn) if isinstance(fn, nn.Module) else fn


class RuleTable:
    """Rules of one kind (``name``) by key: ``by_callable``, ``by_method`` (Tensor method names) and
    ``by_module`` (nn.Module types). ``make(rule, target)`` is what gets filed for a registered function
    (itself, unless given). A module with hooks has no rule (``has_hooks``: the rule would bypass them)."""

    def __init__(self, name, make=None):
        self.name = name
        self.make = make
        self.by_callable = {}
        self.by_method = {}
        self.by_module = {}

    def __repr__(self):
        return f"<RuleTable {self.name}: {len(self)} rules>"

    def __len__(self):
        return len(self.by_callable) + len(self.by_method) + len(self.by_module)

    def register(self, *targets):
        """Decorator filing a rule under each of ``targets``: callables, Tensor method names (str), Module
        types."""

        def register(rule):
            for t in targets:
                filed = rule if self.make is None else self.make(rule, t)
                if isinstance(t, str):
                    self.by_method[t] = filed
                elif isinstance(t, type) and issubclass(t, nn.Module):
                    self.by_module[t] = filed
                else:
                    self.by_callable[t] = filed
            return rule

        return register

    def lookup(self, fn):
        """The rule of callable ``fn`` filed under ``key(fn)``, or None (also for a module whose hooks may
        change what it computes). (``key``'s tests written out: this runs for every call a gradient
        program's forward makes.)"""
        try:
            found = self.by_callable.get(fn)
        except TypeError:  # unhashable callable
            found = None
        if found is not None:
            return found
        kind = type(fn)
        if kind is BOUND_BUILTIN or kind is BOUND_SLOT:
            return self.by_method.get(fn.__name__) if isinstance(fn.__self__, torch.Tensor) else None
        if kind is types.MethodType:
            if isinstance(fn.__self__, torch.Tensor) and getattr(fn.__func__, "__module__", "") == "torch._tensor":
                return self.by_method.get(fn.__name__)
            return None
        if isinstance(fn, nn.Module):
            return None if has_hooks(fn) else self.by_module.get(kind)
        return None
