"""Connecting a compiled call to torch.autograd: one autograd node per call.

With grad mode on, a call runs the forward-with-saves program (``passes.grad``)
under ``torch.no_grad()``: torch records nothing per op. If the forward met a
tensor that requires grad (an argument, a parameter, a captured tensor), the
call's floating-point result tensors come out of one ``CompiledCall`` node
whose inputs are those tensors. Its backward runs the derived gradient
program on the sequential scheduler and hands torch the gradients of the inputs,
so ``loss.backward()`` fills ``.grad``, gradients accumulate as usual and
``torch.autograd.grad`` works too.

A backward that must itself be differentiable (``create_graph=True``: double
backward, ``torch.func.grad``) cannot use the derived program, whose saved
values torch did not record. It runs the call again on the batched runtime,
which torch.autograd records, from the random state the forward started
with, and differentiates that (as ``torch.utils.checkpoint`` recomputes).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from . import scheduler
from ..dynamo import opaque
from ..autodiff.backprop import GradContext, external, plain_object, tensors_in

# contexts still alive (their saved values with them): what the memory test watches
live_contexts = weakref.WeakSet()


class _State:
    __slots__ = ("handle", "ctx", "record", "results", "stats", "replay", "rng", "positions", "versions")

    def __init__(self, handle, ctx, record, results, stats, replay=None, rng=None, positions=None):
        self.handle = handle
        self.ctx = ctx
        self.record = record
        self.results = results
        self.stats = stats
        self.replay = replay  # () -> the call's result, run again where torch.autograd records it
        self.rng = rng  # the random state the forward started with
        self.positions = positions  # where ``results`` are among the result's tensors (``tensors_in``)
        self.versions = [t._version for t in ctx.sources.values()]  # (as the forward left them)


class CompiledCall(torch.autograd.Function):
    @staticmethod
    def forward(state, *sources):
        return tuple(t.detach() for t in state.results)

    @staticmethod
    def setup_context(fctx, inputs, output):  # (apart from forward: what torch.func's transforms ask)
        fctx.state = inputs[0]
        fctx.set_materialize_grads(False)

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(fctx, *grads):
        state = fctx.state
        if torch.is_grad_enabled() and state is not None:  # create_graph=True
            return (None, *_recorded_grads(state, grads))
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
        ctx.refusals.clear()
        ctx.grads.clear()
        return (None, *out)


def run(callee, args, stats, runner=scheduler.run, replay=None):
    """Run compiled function ``callee`` on bound ``args`` with gradients: (result, RunStats).

    ``runner(handle, args)`` runs the forward: the sequential scheduler, or the threaded one. ``replay()``
    runs the call again where torch.autograd records it (the batched runtime), for a backward with
    ``create_graph=True``.
    """
    ctx = GradContext()
    live_contexts.add(ctx)
    for a in args:
        ctx.note_tree(a)
    rng = _random_state() if replay is not None else None
    with torch.no_grad():
        pair, run_stats = runner(callee.forward, (ctx, *args))
    result, record = pair
    stats.record_fallbacks(ctx.fallbacks)
    if not ctx.sources:
        return result, run_stats
    # the program's own floating-point tensors; one from outside (an argument returned) stays itself
    found, positions = list(tensors_in(result)), {}
    for k, t in enumerate(found):
        if (t.is_floating_point() or t.is_complex()) and not external(t):
            positions.setdefault(id(t), k)
    if not positions:
        return result, run_stats
    results = [found[k] for k in positions.values()]
    state = _State(callee, ctx, record, results, stats, replay, rng, list(positions.values()))
    outs = CompiledCall.apply(state, *ctx.sources.values())
    if not isinstance(outs, tuple):
        outs = (outs,)
    return _replace(result, dict(zip(map(id, results), outs))), run_stats


_warned_replay = set()


def _recorded_grads(state, grads):
    """The gradients of the call's sources as a differentiable function of them and of ``grads``: the call run
    again from its forward's random state, recorded by torch.autograd, and differentiated with
    ``create_graph``."""
    name = state.handle.qualname
    if state.replay is None or getattr(state.handle, "may_mutate", True):
        raise RuntimeError(
            f"recompile: a differentiable backward (create_graph=True, torch.func.grad) through {name}, which "
            "changes values in place, is not supported in sequential and threaded mode (running it again would "
            "not start from the same values); compile it with mode=\"batched\"")
    _check_unchanged(state)
    if name not in _warned_replay:
        _warned_replay.add(name)
        code = state.handle.function.python.__code__  # (at the function's def: the backward has no user line)
        warnings.warn_explicit(
            f"recompile: a differentiable backward (create_graph=True, torch.func.grad) through {name} runs the "
            "call again on the batched runtime, which torch.autograd records; Python effects in it run twice. "
            "Compile it with mode=\"batched\" to record it once", UserWarning, code.co_filename, code.co_firstlineno)
    with torch.random.fork_rng(devices=state.rng[1].keys()), _parameters_as_used(state.ctx):
        _set_random_state(state.rng)
        with torch.enable_grad():
            result = state.replay()
    found = list(tensors_in(result))
    outs = [found[k] for k in state.positions]
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    sources = list(state.ctx.sources.values())
    if not pairs:
        return [None] * len(sources)
    return torch.autograd.grad([o for o, _ in pairs], sources, [g for _, g in pairs], create_graph=True,
                               allow_unused=True)


def _check_unchanged(state):
    """Refuse to replay a call whose sources were changed in place since its forward (torch's own refusal): the
    replay would read what is there now, not what the forward read."""
    for t, version in zip(state.ctx.sources.values(), state.versions):
        if t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a tensor of shape {tuple(t.shape)} that {state.handle.qualname} read was changed in place after "
                "the call (its differentiable backward runs the call again)")


@contextlib.contextmanager
def _parameters_as_used(ctx):
    """The modules' parameters as the forward used them, for the replay (``torch.func.functional_call`` gave
    them back when it returned), then as they are now."""
    swapped = []
    for _, params in ctx.modules.values():
        for m, name, p in params:
            now = m._parameters.get(name)
            if now is not p:
                m._parameters[name] = p
                swapped.append((m, name, now))
    try:
        yield
    finally:
        for m, name, now in reversed(swapped):
            m._parameters[name] = now


def _random_state():
    """The CPU generator's state and, per CUDA device already in use, its own."""
    cuda = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = {d: torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())}
    return torch.get_rng_state(), cuda


def _set_random_state(rng):
    torch.set_rng_state(rng[0])
    for d, s in rng[1].items():
        torch.cuda.set_rng_state(s, d)


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
