"""Callables the data chooses (``self.ops[op[i]](x)``): one batched call per callable, as DyNet groups by signature.

Each instance may call its own module, picked from a shared ``nn.ModuleList`` (or a list, tuple or ``nn.ModuleDict``)
by an index of its own. ``picked`` reads each instance's pick (Python's own indexing: its errors are each
instance's); ``grouped`` then calls each distinct callable once, on the rows of the instances that picked it, by
that callable's own batch rule, and joins the results in instance order. A method bound to each instance's own
object (``node.is_leaf()``) groups by its class's function, called on the group's objects. Only modules, plain
module-level functions and such methods group: a nested function or lambda may be each instance's own closure,
and a method of each instance's tensor is another rule's. Where the run changes values in place, the instances'
rows would be copies their changes must reach: each instance then calls its own, as before. In a level
program's pieces on plain tensors (``codegen.segments``), ``rows_grouped`` does the same for rows that picked by
an integer of their own.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from . import batch as bt
from . import sharing
from .batch import Batch

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, list, tuple)


def picked(x, index):
    """``x[index]`` of a shared container of callables, index each instance's: a Batch of each instance's pick,
    or NotImplemented."""
    if type(x) not in _CONTAINERS or not sharing.state.fresh or not len(x):
        return NotImplemented
    values = x.values() if isinstance(x, nn.ModuleDict) else x
    if not all(groups(v) for v in values):
        return NotImplemented
    at = bt.instance_index(index) if not isinstance(x, nn.ModuleDict) else None
    if at is not None and at.numel() and -len(x) <= int(at.min()) and int(at.max()) < len(x):
        listed = list(x)  # (one read of the list, then Python's own list indexing: a ModuleList's is slow)
        return bt.from_items([listed[k] for k in at.tolist()])
    keys = bt.items_of(index)
    if not all(type(k) is int or type(k) is str or isinstance(k, torch.Tensor) and k.dim() == 0 for k in keys):
        return NotImplemented
    return bt.from_items([x[k] for k in keys])  # (each instance's IndexError or KeyError as its own)


def groups(fn):
    """Whether instances calling ``fn`` may be one call: a module (no hooks looked at here: its rule does), a
    builtin function (not a method bound to an object: each instance's tensor's ``t.sum``), or a plain function
    defined at a module's top level."""
    if isinstance(fn, nn.Module):
        return True
    if isinstance(fn, types.BuiltinFunctionType):
        return fn.__self__ is None or isinstance(fn.__self__, types.ModuleType)
    return inspect.isfunction(fn) and fn.__closure__ is None and "<locals>" not in fn.__qualname__


def grouped(n, fn, args, kwargs, call):
    """``fn(*args, **kwargs)`` where ``fn`` holds each instance's callable: ``call`` (``batch_rules.call``) once
    per distinct callable on its instances' rows, the results joined; NotImplemented where they do not group."""
    if not sharing.state.fresh or fn.method is not None:
        return NotImplemented
    chosen = bt.items_of(fn)
    order = {}
    for k, c in enumerate(chosen):
        if type(c) is types.MethodType and _groups_as_method(c):
            order.setdefault((id(c.__func__), True), (c.__func__, []))[1].append(k)
        elif groups(c):
            order.setdefault((id(c), False), (c, []))[1].append(k)
        else:
            return NotImplemented
    kwargs = kwargs or {}
    sides = []
    for (_, bound), (c, positions) in order.items():
        if len(order) == 1:
            rows, given = args, kwargs
        else:
            index = bt.long_tensor(positions)
            rows = tuple(bt.take(a, index, positions) if type(a) is Batch else a for a in args)
            given = {key: bt.take(v, index, positions) if type(v) is Batch else v for key, v in kwargs.items()}
        if bound:  # (a method: its function, each instance's object first)
            selves = [chosen[k].__self__ for k in positions]
            rows = (selves[0] if len(selves) == 1 else bt.from_items(selves), *rows)
        sides.append((call(len(positions), c, tuple(rows), given), positions))
    return sides[0][0] if len(sides) == 1 else bt.join(n, sides)


def _groups_as_method(method):
    """Whether the instances calling ``method``'s function, each bound to its own object (``node.is_leaf()`` of
    each instance's node), may be one call of the function on their objects: a plain function of a class's,
    bound to an object (not a tensor, whose methods are another rule's; not a class)."""
    return groups(method.__func__) and not isinstance(method.__self__, (torch.Tensor, type))


def choices(container):
    """The callables of a shared list of them (``nn.ModuleList``, ``nn.Sequential``, a list or tuple) that each
    row of a plain piece may pick by an integer of its own (``segments``), as a tuple; None for anything else (a
    ``ModuleDict``, picked by key, or a callable that may not group)."""
    if type(container) not in _CONTAINERS or isinstance(container, nn.ModuleDict) or not len(container):
        return None
    fns = tuple(container)
    return fns if all(groups(fn) for fn in fns) else None


def rows_grouped(n, fns, index, args, batched, kwargs, call):
    """``fns[index[r]](*row r of args, **kwargs)`` for each of n rows (a plain piece's: dim 0 the instance;
    ``batched`` says which of ``args`` are such rows, the others shared): ``call`` (``batch_rules.call``) once
    per distinct callable on its rows, their results' rows joined back in row order. None where an index is out
    of range (the run on Batch values raises its instance's IndexError); NotImplemented where a result is no
    tensor of rows of one shape and dtype."""
    count = len(fns)
    group, numbers, picked = [], {}, []  # each row's group; a callable's group; each group's callable
    for k in index.tolist():
        if not -count <= k < count:
            return None
        fn = fns[k]
        g = numbers.get(id(fn))
        if g is None:
            g = numbers[id(fn)] = len(picked)
            picked.append(fn)
        group.append(g)
    if len(picked) == 1:
        return _rows_call(n, picked[0], args, batched, kwargs, call)
    sizes = [0] * len(picked)
    for g in group:
        sizes[g] += 1
    # (the rows sorted by group, one gather; each group's rows a stretch of it; the results put back by one copy)
    at = torch.tensor(sorted(range(n), key=group.__getitem__), device=next(a.device for a, b in zip(args, batched)
                                                                            if b))
    stretches = [a.index_select(0, at).split(sizes) if b else None for a, b in zip(args, batched)]
    outs = []
    for g, fn in enumerate(picked):
        out = _rows_call(sizes[g], fn, [s[g] if b else a for a, s, b in zip(args, stretches, batched)], batched,
                         kwargs, call)
        if out is NotImplemented:
            return out
        outs.append(out)
    if not bt.same_kind(outs, 1):
        return NotImplemented
    joined = torch.cat(outs)
    return joined.new_empty(joined.shape).index_copy(0, at.to(joined.device), joined)


def _rows_call(count, fn, args, batched, kwargs, call):
    """``fn`` on ``count`` rows by its batch rule (one row: on that instance's own values), its result's rows."""
    if count == 1:
        out = call(1, fn, tuple(a[0] if b else a for a, b in zip(args, batched)), kwargs)
        return out.unsqueeze(0) if type(out) in bt.PLAIN_TENSORS else NotImplemented
    out = call(count, fn, tuple(bt.from_tensor(a) if b else a for a, b in zip(args, batched)), kwargs)
    t = bt.tensor_of(out) if type(out) is Batch and out.thunk is None else None
    return NotImplemented if t is None or t.shape[0] != count else t
