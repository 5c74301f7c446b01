"""Reductions of each instance whose torch gradient is not the one their batched composition would give.

``var``/``std`` along a dim of a padded tensor, within a mask, with torch's own gradient; and ``zeros_alike``,
whether a batched ``prod`` differentiates as each instance's own.

Eager ``var`` differentiates as ``var_backward`` writes it: ``2 / (N - correction) * g * (x - mean)``, N not
clamped (where ``N - correction`` is 0 the cotangent is ±inf; below 0 it is finite), and ``std`` passes
``g / (2 * std)``, 0 where the std is 0. Composed of where/sum/divide ops, the gradient would differ: the mean's
own path adds ``inf - inf`` (NaN) where nothing is left, and a root's gradient at 0 is NaN. So a batched
``var`` is this Function, whose backward is torch's formula over each instance's places (differentiable again:
a double backward sees the mean as torch's does).
"""

import torch

from ..dynamo import opaque


class RowSpread(torch.autograd.Function):
    """``var`` along int ``dim`` of ``padded`` where ``mask`` (broadcast) marks each instance's places and
    ``counts`` (its shape, 1 along ``dim``: broadcast too) how many it has there."""

    @staticmethod
    def forward(ctx, padded, mask, counts, dim, keepdim, correction):
        zero = padded.new_zeros(())
        mean = torch.where(mask, padded, zero).sum(dim, keepdim=True) / counts
        apart = torch.where(mask, padded - mean, zero)
        left = (counts - correction).clamp(min=0)  # (eager's value: nothing left is a division by 0)
        out = (apart * apart).sum(dim, keepdim=True) / left
        ctx.save_for_backward(padded, mask, counts)
        ctx.dim, ctx.correction = dim, correction
        return out if keepdim else out.squeeze(dim)

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(ctx, grad):
        padded, mask, counts = ctx.saved_tensors
        g = grad if grad.dim() == padded.dim() else grad.unsqueeze(ctx.dim)
        zero = padded.new_zeros(())
        mean = torch.where(mask, padded, zero).sum(ctx.dim, keepdim=True) / counts
        each = (2.0 / (counts - ctx.correction)) * g * (padded - mean)
        return torch.where(mask, each, zero), None, None, None, None, None


class SpreadRoot(torch.autograd.Function):
    """``std`` from ``var``: its root, whose gradient is torch's ``std_backward``'s, ``g / (2 * std)``, 0 where
    the std is 0."""

    @staticmethod
    def forward(ctx, var):
        out = var.sqrt()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(ctx, grad):
        out, = ctx.saved_tensors
        return (grad / (out * 2)).masked_fill(out == 0, 0)


def zeros_alike(t):
    """Whether a batched ``prod`` of ``t`` (instances along dim 0) differentiates as each instance's own: torch's
    prod backward takes its zero-safe way where its whole input has a zero (an inf's gradient is then finite,
    else NaN), so the instances must all have a zero or none, where a gradient is taken."""
    if not (t.requires_grad and torch.is_grad_enabled()):
        return True
    zeros = (t == 0).flatten(1).any(1)
    return bool(zeros.all()) or not bool(zeros.any())
