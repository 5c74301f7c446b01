"""A Linear weight's gradient formed once per backward for all the rows a level run multiplied it by.

A level run's piece (``codegen.segments.Plain``) multiplies a few rows by the
same weight at every depth. Recorded op by op, torch's backward forms that
weight's gradient at every depth (``g_d^T x_d``, a full out x in matrix from a
few rows) and adds them up one by one. Here each product is recorded as a
``_DeferredLinear`` whose backward gives the rows' and the bias' gradients at
once but only keeps ``(g_d, x_d)``; one ``_WeightGate`` per weight and run,
which every product reads, runs after all of them (autograd runs a node once
every node reading its output has run) and forms the weight's gradient as one
matrix product over all the kept rows (Cavs' lazy batching). Both backwards
are themselves differentiable, so ``create_graph=True`` still works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LazyWeight:
    """One weight's products of one level run: the gate they all read, and the rows kept for it."""

    __slots__ = ("weight", "gate", "kept")

    def __init__(self):
        self.weight = None
        self.gate = None
        self.kept = {}  # per backward pass (autograd's graph task): ([g_d], [x_d])

    def rows(self):
        """The kept rows of the backward pass running."""
        return self.kept.setdefault(torch._C._current_graph_task_id(), ([], []))

    def linear(self, x, weight, bias):
        """``F.linear(x, weight, bias)`` for a 2-d ``x``, its weight gradient deferred to the gate."""
        if self.gate is None or self.weight is not weight:
            self.weight = weight
            self.gate = _WeightGate.apply(weight, self)
        return _DeferredLinear.apply(x, self.gate, bias, self)


class _WeightGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, lazy):
        ctx.lazy = lazy
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        # (a pass that did not reach the gate, autograd.grad of other inputs, leaves its rows behind: each
        # pass keeps its own)
        grads, inputs = ctx.lazy.kept.pop(torch._C._current_graph_task_id(), ((), ()))
        if not grads:
            return None, None
        g = grads[0] if len(grads) == 1 else torch.cat(grads)
        x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        return g.t().mm(x), None


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, bias, lazy):
        # (the weight saved too: changed in place before the backward, it is refused as torch refuses it)
        ctx.save_for_backward(x, lazy.weight)
        ctx.lazy = lazy
        ctx.has_bias = bias is not None
        return F.linear(x, lazy.weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grads, inputs = ctx.lazy.rows()
        grads.append(g)
        inputs.append(x)
        grad_x = g.mm(weight) if ctx.needs_input_grad[0] else None
        grad_bias = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


# Up to this many rows a product's own weight gradient (a full out x in matrix, added to the others) costs
# more than keeping its rows for the gate; with more, forming it at once is as fast (measured on the
# examples' Tree-LSTM: 5% faster training at minibatch 25, 1% slower at 256 with every product deferred).
FEW_ROWS = 64


def linear(x, weight, bias, lazy):
    """A plain piece's Linear: deferred weight gradient where autograd records a product of a few rows by a
    weight that requires grad; ``F.linear`` otherwise."""
    if x.dim() == 2 and x.shape[0] <= FEW_ROWS and weight.requires_grad and torch.is_grad_enabled():
        return lazy.linear(x, weight, bias)
    return F.linear(x, weight, bias)
