"""A dict the program built with keys every instance shares (``{"h": h, "c": c}``), batched.

``batch_rules.dict_display`` holds such a dict as its values (a struct of ``batch.Keyed`` kind: the keys the
kind's, the values each a batch or a value every instance shares), and each instance's own dict is made only
where something needs one. The rules here read and change it as that struct:

- ``d[key] = v`` changes the struct itself (``set_field``), so every name of the dict sees the change: another
  variable, a list holding it, a compiled callee's parameter (taking some instances of it, in a run that may
  change a dict, makes each instance's own dict first: ``batch.settle``);
- ``d.get(key)``, ``key in d`` read its keys and values as they are;
- ``d.keys()``, ``d.values()``, ``d.items()`` and a ``for`` over ``d`` give the keys, values or pairs as a
  tuple, in a run that changes nothing in place (Python's views follow later changes of the dict; a tuple
  does not, and no change can come there).
"""

from __future__ import annotations

import operator

from ..ops import facts
from . import batch as bt
from . import sharing
from .batch import Batch


def held(value):
    """Whether ``value`` is a batch of such dicts, held as its values (no instance's own dict made)."""
    return type(value) is Batch and value.struct is not None and value.owner is None and \
        issubclass(value.struct[0], bt.Keyed)


def place(keys, key):
    """``key``'s position among ``keys``, None where it is not one of them, NotImplemented where no instance
    can hold it as a shared key (a batch, an unhashable or mutable value: each instance's own call says)."""
    if type(key) is Batch or not facts.immutable(key):
        return NotImplemented
    try:
        return keys.index(key) if key in keys else None
    except TypeError:  # (an unhashable key: each instance raises)
        return NotImplemented


def set_field(target, key, value):
    """``d[key] = v``: the struct's value replaced, or the key added at its end, as a dict orders its keys."""
    kind, parts = target.struct
    at = place(kind.keys_, key)
    if at is NotImplemented:
        return NotImplemented
    if at is None:
        target.struct = (bt.dict_kind(kind.keys_ + (key,)), parts + [value])
    else:
        target.struct = (kind, parts[:at] + [value] + parts[at + 1:])
    return None


def contains(n, fn, args, kwargs):
    """``key in d`` (``operator.contains(d, key)``) and ``key not in d`` (``intrinsics.not_in(key, d)``): one bool
    every instance shares."""
    if len(args) != 2 or kwargs:
        return NotImplemented
    d, key = args if fn is operator.contains else args[::-1]
    if not held(d):
        return NotImplemented
    at = place(d.struct[0].keys_, key)
    return NotImplemented if at is NotImplemented else (at is not None) is (fn is operator.contains)


def method(n, d, name, args, kwargs):
    """``d.get(key[, default])``, ``d.keys()``, ``d.values()``, ``d.items()``; NotImplemented for other dicts and
    calls."""
    if not held(d) or kwargs:
        return NotImplemented
    kind, parts = d.struct
    if name == "get" and 1 <= len(args) <= 2:
        at = place(kind.keys_, args[0])
        if at is NotImplemented:
            return NotImplemented
        return parts[at] if at is not None else args[1] if len(args) == 2 else None
    if args or not sharing.state.fresh:
        return NotImplemented
    if name == "keys":
        return kind.keys_
    if name == "values":
        return bt.from_struct(tuple, list(parts), n)
    if name == "items":
        return bt.from_struct(tuple, [bt.from_struct(tuple, [k, v], n) for k, v in zip(kind.keys_, parts)], n)
    return NotImplemented


METHODS = frozenset({"get", "keys", "values", "items"})


def has_method(d, name):
    """Whether ``d.name`` is a method ``method`` may batch: ``get`` of such a dict, its views in a run that
    changes nothing in place."""
    return held(d) and name in METHODS and (name == "get" or sharing.state.fresh)


def method_rule(name):
    """The batch rule of method ``name`` of such a dict (``batch_rules.BATCH``'s by method name)."""

    def rule(n, d, args, kwargs):
        return method(n, d, name, args, kwargs)

    return rule


def iterated(seq):
    """What a ``for`` over such a dict iterates, in a run that changes nothing in place: its keys; else None."""
    return seq.struct[0].keys_ if held(seq) and sharing.state.fresh else None
