"""Connecting a compiled call to torch.autograd: one autograd node per call.

With grad mode on, a call runs the forward-with-saves program (``passes.grad``)
under ``torch.no_grad()``: torch records nothing per op. If the forward met a
tensor that requires grad (an argument, a parameter, a captured tensor), the
call's floating-point result tensors come out of one ``CompiledCall`` node
whose inputs are those tensors. Its backward runs the derived gradient
program on the sequential scheduler and hands torch the gradients of the inputs,
so ``loss.backward()`` fills ``.grad``, gradients accumulate as usual and
``torch.autograd.grad`` works too.
"""

from __future__ import annotations

import weakref

import torch

from . import scheduler
from ..dynamo import opaque
from ..autodiff.backprop import GradContext, external, plain_object, tensors_in

# contexts still alive (their saved values with them): what the memory test watches
live_contexts = weakref.WeakSet()


class _State:
    __slots__ = ("handle", "ctx", "record", "results", "stats")

    def __init__(self, handle, ctx, record, results, stats):
        self.handle = handle
        self.ctx = ctx
        self.record = record
        self.results = results
        self.stats = stats


class CompiledCall(torch.autograd.Function):
    @staticmethod
    def forward(fctx, state, *sources):
        fctx.state = state
        fctx.set_materialize_grads(False)
        return tuple(t.detach() for t in state.results)

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(fctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True
            raise RuntimeError("recompile: higher-order gradients (create_graph=True) through a compiled call "
                               "are not supported; the derived gradient program is not itself differentiated")
        state = fctx.state
        if state is None:
            raise RuntimeError(
                "recompile: trying to backward through a compiled call a second time; its saved values were "
                "freed after the first backward (pass retain_graph=True to the backward before, as for torch)")
        if all(g is not None for g in grads) and not torch._C._autograd._get_current_graph_task_keep_graph():
            fctx.state = None  # the saved values go as soon as the gradient has used them (retain_graph keeps them)
        # (else an output not differentiated yet may be later, as in torch: out[0].backward(), out[1].backward())
        ctx = state.ctx
        for t, g in zip(state.results, grads):
            ctx.add(t, g)
        with torch.no_grad():
            # on this thread, in order, whatever ran the forward: the gradient program's calls pass
            # cotangents through ``ctx``, an order its grouping cannot see, and torch.autograd (fallback
            # steps) must be able to run its own work on the thread that drives the backward
            scheduler.run(state.handle.backward, (ctx, state.record))
        state.stats.record_backward()
        out = ctx.source_grads()
        ctx.cotangents.clear()
        ctx.grads.clear()
        return (None, *out)


def run(callee, args, stats, runner=scheduler.run):
    """Run compiled function ``callee`` on bound ``args`` with gradients: (result, RunStats).

    ``runner(handle, args)`` runs the forward: the sequential scheduler, or the threaded one.
    """
    ctx = GradContext()
    live_contexts.add(ctx)
    for a in args:
        ctx.note_tree(a)
    with torch.no_grad():
        pair, run_stats = runner(callee.forward, (ctx, *args))
    result, record = pair
    stats.record_fallbacks(ctx.fallbacks)
    if not ctx.sources:
        return result, run_stats
    # the program's own floating-point tensors; one from outside (an argument returned) stays itself
    results = list({id(t): t for t in tensors_in(result)
                    if (t.is_floating_point() or t.is_complex()) and not external(t)}.values())
    if not results:
        return result, run_stats
    outs = CompiledCall.apply(_State(callee, ctx, record, results, stats), *ctx.sources.values())
    if not isinstance(outs, tuple):
        outs = (outs,)
    return _replace(result, dict(zip(map(id, results), outs))), run_stats


def _replace(value, new, depth=0):
    """``value`` with each tensor whose id is in ``new`` replaced by its node output."""
    if isinstance(value, torch.Tensor):
        return new.get(id(value), value)
    if depth < 8 and plain_object(value) and not isinstance(value, (tuple, list, dict)):
        # in place: the caller gets the object the program returned, as in eager code (the saved values
        # keep no object a call merely built or read, so this makes no reference cycle through the node)
        for k, v in list(vars(value).items()):
            r = _replace(v, new, depth + 1)
            if r is not v:
                setattr(value, k, r)
        return value
    if depth < 8 and isinstance(value, tuple):
        items = [_replace(v, new, depth + 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if depth < 8 and isinstance(value, list):
        return [_replace(v, new, depth + 1) for v in value]
    if depth < 8 and isinstance(value, dict):
        return {k: _replace(v, new, depth + 1) for k, v in value.items()}
    return value
