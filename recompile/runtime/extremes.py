"""Each row's max, min or median over all its elements, its gradient shared among the row's ties as torch's.

``x.max()`` (no dim) gives every element equal to the result an even share of the cotangent (a NaN result is
every NaN element's). ``amax`` over the same dims shares it too, but as ``mask * (g / count)``: a cotangent of
inf gives the other elements ``0 * inf``, NaN, where torch's ``max()`` on the CPU puts the shares into zeros
and leaves the others 0 (on CUDA it multiplies, as amax does). So a batched ``x.max()`` is this Function, not an
amax over each instance's dims.
"""

import torch

from ..autodiff.rules import shared_by_ties
from ..dynamo import opaque


class RowExtreme(torch.autograd.Function):
    """Each row's ``kind`` ("max", "min" or "median") of a 2-d ``flat``. It keeps its input and result for the
    backward, as torch's does: a change of either in place refuses the backward, as eager's refuses it."""

    @staticmethod
    def forward(ctx, flat, kind):
        m = flat.median(dim=1).values if kind == "median" else flat.amax(1) if kind == "max" else flat.amin(1)
        ctx.save_for_backward(flat, m)
        return m

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(ctx, grad):
        flat, m = ctx.saved_tensors
        m = m.unsqueeze(1)
        tied = (flat == m) | (flat.isnan() & m.isnan())  # (a NaN result is the NaN elements', as torch's)
        return shared_by_ties(grad.unsqueeze(1).to(flat.dtype), tied), None
