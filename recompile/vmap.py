"""``recompile.vmap`` and ``recompile.map``: many instances of a compiled function in one batched run.

``vmap``'s conventions are torch.func.vmap's: ``in_dims`` gives, per positional
argument, the dim its instances lie along (None: shared by every instance);
results come back stacked along ``out_dims``. Unlike torch.func.vmap, each
instance may take its own path through the function: its own branches, its
own number of loop iterations, its own recursion (a tree per instance).

``map``'s are Python's ``map``: an iterable per positional argument, an
instance per item (a tree as the user's own linked objects, a sequence of its
own length, a Python number), and a list of results, each as the function
returned it for that instance (an int, a list of tokens, a namedtuple).
"""

from __future__ import annotations

import types

import torch

from . import config
from .api import CompiledFunction
from .dynamo import opaque
from .ops.table import has_hooks
from .runtime import batch as bt
from .runtime import sharing


def vmap(fn, in_dims=0, out_dims=0):
    """``fn`` run for a batch of instances: a ``recompile.function`` or a plain Python function (a def or a
    lambda, compiled here as ``recompile.function`` would, once per function), either of them bound to an
    object (``model.encode``), or a module without hooks (its ``forward``)."""
    cf, bound_self = _batched_function(fn, "vmap")
    if not (out_dims is None or type(out_dims) is int):
        raise TypeError("recompile.vmap: out_dims must be an int")

    def batched(*args):
        return _run(cf, bound_self, in_dims, out_dims, args)

    return batched


def map(fn, *iterables, strict=False):
    """``[fn(*args) for args in zip(*iterables)]`` in one batched run: ``fn`` as ``vmap`` takes it; an instance
    per item of the iterables (stopping at the shortest, as Python's ``map``; ``strict=True``: a ValueError where
    their lengths differ, as ``zip``'s). An argument whose every item is the one object (``itertools.repeat(emb)``)
    is shared. Returns a list: each instance's result as ``fn`` returns it."""
    cf, bound_self = _batched_function(fn, "map")
    if not iterables:
        raise TypeError("recompile.map needs at least one iterable of arguments")
    return _run_map(cf, bound_self, [list(row) for row in zip(*iterables, strict=strict)])


@opaque
def _run_map(cf, bound_self, rows):
    n = len(rows)
    if n == 0:
        return []
    if config.DISABLED:  # (recompile.disable(): one plain call per instance)
        return [cf.python(*bound_self, *row) for row in rows]
    columns = [_column([row[j] for row in rows]) for j in range(len(rows[0]))]
    args = cf.bind(*bound_self, *columns)  # (Python's own TypeError for a wrong call, before anything runs)
    since = sharing.marks_now()
    out = cf.run_batched(args, n, type(bound_self[0]) if bound_self else None)
    # (a change in place to one instance's result stays its own, as with Python's calls)
    return sharing.own_results([bt.instance(out, k) for k in range(n)], since)


def _column(items):
    """The value of one argument for the instances: the one object where each has that same object, else a
    Batch of each instance's own."""
    first = items[0]
    return first if all(x is first for x in items) else bt.from_items(items)


def _batched_function(fn, name):
    """The CompiledFunction ``fn`` stands for (in batched mode), and the object it is bound to, if any."""
    if isinstance(fn, torch.nn.Module) and not has_hooks(fn):
        fn = fn.forward
    bound_self = ()
    cf = fn
    if isinstance(fn, types.MethodType):
        cf, bound_self = fn.__func__, (fn.__self__,)
    if isinstance(cf, types.FunctionType):
        cf = _compiled(cf)
    if not isinstance(cf, CompiledFunction):
        raise TypeError(f"recompile.{name} expects a function (a recompile.function, a def or a lambda), "
                        f"got {type(fn).__name__}")
    if cf.mode != "batched":
        raise ValueError(f"recompile.{name} needs a function compiled with mode='batched' (this one is {cf.mode!r})")
    return cf, bound_self


def _compiled(fn):
    """Plain function ``fn``'s CompiledFunction, kept on the function (a vmap of the same one again builds nothing;
    the two go when the function goes)."""
    found = fn.__dict__.get(_KEPT)
    if found is None:
        found = fn.__dict__[_KEPT] = CompiledFunction(fn)
    return found


_KEPT = "__recompile_vmapped__"


@opaque  # under torch.compile: a graph break, not a trace of the runtime
def _run(cf, bound_self, in_dims, out_dims, args):
    dims = in_dims if isinstance(in_dims, (tuple, list)) else (in_dims,) * len(args)
    if len(dims) != len(args):
        raise ValueError(f"recompile.vmap: in_dims has {len(dims)} entries for {len(args)} positional arguments")
    sizes = set()
    values = [_instances(a, d, sizes, i) for i, (a, d) in enumerate(zip(args, dims))]
    if not sizes:
        raise ValueError("recompile.vmap: at least one argument must be batched (an in_dims entry not None)")
    if len(sizes) > 1:
        raise ValueError(f"recompile.vmap: batched arguments disagree on the batch size: {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("recompile.vmap: the batch has no instances (batched arguments of size 0)")
    all_args = (*bound_self, *values)
    owner = type(bound_self[0]) if bound_self else None
    bound = cf.bind(*all_args)  # every parameter, defaults included (Python's own TypeError for a wrong call)
    if config.DISABLED:  # (recompile.disable(): one plain call per instance)
        return _move(_stacked([cf.python(*bound_self, *[_instance(a, d, k) for a, d in zip(args, dims)])
                               for k in range(n)]), out_dims)
    out = bt.stack_output(cf.run_batched(bound, n, owner), n)
    return _move(out, out_dims)


def _instances(arg, dim, sizes, position):
    if dim is None:
        return arg
    if type(dim) is not int:
        raise TypeError(f"recompile.vmap: in_dims entries must be int or None, got {type(dim).__name__}")
    if isinstance(arg, torch.Tensor):
        if arg.dim() == 0:
            raise ValueError(f"recompile.vmap: argument {position} is a 0-d tensor; it has no dim {dim} to batch")
        t = arg.movedim(dim, 0)
        sizes.add(t.shape[0])
        return t[0] if t.shape[0] == 1 else bt.Batch(t.shape[0], tensor=t)
    if isinstance(arg, (tuple, list)):
        parts = [_instances(a, dim, sizes, position) for a in arg]
        n = next(iter(sizes)) if sizes else 1
        return type(arg)(parts) if n == 1 else bt.from_struct(type(arg), parts, n)
    raise ValueError(f"recompile.vmap: argument {position} with in_dim {dim} must be a tensor or a tuple or list "
                     f"of tensors, got {type(arg).__name__}")


def _instance(arg, dim, k):
    """Instance ``k`` of argument ``arg`` batched along ``dim`` (None: shared)."""
    if dim is None:
        return arg
    if isinstance(arg, torch.Tensor):
        return arg.select(dim, k)
    return type(arg)(_instance(a, dim, k) for a in arg)


def _stacked(results):
    """Per-instance results stacked along dim 0, structures item by item, as ``vmap`` returns them."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(results)
    if isinstance(first, (tuple, list)):
        items = [_stacked([r[j] for r in results]) for j in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    raise ValueError(f"recompile.vmap: each instance must return tensors (or tuples or lists of them); got "
                     f"{type(first).__name__}")


def _move(out, dim):
    if dim is None or dim == 0:
        return out
    if isinstance(out, torch.Tensor):
        if not -out.dim() <= dim < out.dim():
            raise ValueError(f"recompile.vmap: out_dims={dim} is out of range for a result of {out.dim() - 1} dims "
                             f"per instance (the stacked result has {out.dim()})")
        return out.movedim(0, dim)
    items = [_move(o, dim) for o in out]
    return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
