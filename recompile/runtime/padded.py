"""Each instance's value of its own length along a dim that is not its first, batched (``Padded``): the
(1, D, L) of ``self.embed(words[:n]).t().unsqueeze(0)`` that a ``Conv1d`` reads, the conv's output, its pooling.

``Rows`` keeps each instance's stretch along its first dim. An op that moves that dim (``t``, ``transpose``,
``permute``, ``unsqueeze(0)``, ``x[None]``) gives a ``Padded``: instance k's value is ``tensor[k]`` cut to
``lengths[k]`` along ``dim``, the rest of the row past its end whatever the ops made of it. Ops that move dims,
ops finite at every finite input with finite gradients (``relu``, ``tanh``, adding a shared bias), convolutions
along the dim (reading zeros past each end, as their own zero padding), pooling, and reductions along the dim
run once on the padded tensor; a reduction along the dim leaves out what lies past each end (``torch.where``),
so nothing there reaches a value, nor a gradient but times a zero. An op whose result has the lengths along
its first dim again gives ``Rows``. Everything else runs per instance (and says so).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import facts
from ..ops.table import has_hooks
from . import batch as bt
from . import extremes, rows
from .batch import Batch


class Padded(list):
    """Instance k's value is ``tensor[k].narrow(dim, 0, lengths[k])`` (the list holds those views, once
    ``fill`` made them); ``dim`` ≥ 1 (an instance's)."""

    __slots__ = ("tensor", "dim", "lengths", "zeroed", "own", "_mask", "_zeros")

    def __init__(self, tensor, dim, lengths, zeroed=False, views=True, own=False):
        self.tensor, self.dim, self.lengths = tensor, dim, list(lengths)
        self.zeroed = zeroed  # whether what lies past each end is zeros
        # whether each instance's value is, in eager code, a tensor of its own (a conv's output, and an op's of it
        # elementwise), contiguous: not a view of another's (``xs.t()``)
        self.own = own
        self._mask = self._zeros = None
        if views:
            self.fill()

    def fill(self):
        """Make each instance's value: a view of one unbind (in a run that changes nothing in place, no view of
        them is changed), contiguous where eager's is (``own``: ``y.view(-1)`` of a conv's output reads it)."""
        if len(self) or not self.lengths:
            return self
        longest, dim, own = self.tensor.shape[self.dim + 1], self.dim, self.own
        views = (row if m == longest else row.narrow(dim, 0, m) for row, m in zip(self.tensor.unbind(0), self.lengths))
        self.extend(v.contiguous() for v in views) if own else self.extend(views)
        return self

    def taken(self, positions):
        """The Padded of instances ``positions``."""
        positions = list(positions)
        index = torch.tensor(positions, device=self.tensor.device)
        return Padded(self.tensor.index_select(0, index), self.dim, [self.lengths[k] for k in positions],
                      self.zeroed)

    def mask(self):
        if self._mask is None:
            self._mask = _mask(self.tensor, self.dim, self.lengths)
        return self._mask

    def zeros_past_ends(self):
        """``tensor`` with zeros past each instance's end (what a convolution's zero padding reads)."""
        if self.zeroed:
            return self.tensor
        if self._zeros is None:  # (once for every convolution of it)
            self._zeros = torch.where(self.mask(), self.tensor, self.tensor.new_zeros(()))
        return self._zeros


def _mask(t, dim, lengths):
    """Bools shaped to broadcast against ``t``: which places along (an instance's) ``dim`` lie in each
    instance's value."""
    longest = t.shape[dim + 1]
    inside = torch.arange(longest, device=t.device) < torch.tensor(lengths, device=t.device)[:, None]
    return inside.view(len(lengths), *[1] * dim, longest, *[1] * (t.dim() - dim - 2))


def of(value):
    """The Padded a Batch holds as its instances' values (their views made or not), in a run that changes
    nothing in place, else None."""
    return bt.held(value, Padded)


def holds(args):
    """Whether an argument is a batch of Padded values."""
    return any(bt.holds(a, Padded) for a in args)


def result(n, tensor, dim, lengths, zeroed=False, own=False):
    """The Batch of values of ``lengths`` along ``dim`` of ``tensor``'s rows: Rows where dim is an instance's
    first; a Padded's views made when first read."""
    if dim == 0:
        return rows.batch(n, rows.padded_rows(n, tensor, lengths))
    longest = tensor.shape[dim + 1]
    return Batch(n, thunk=bt.Views(Padded(tensor, dim, lengths, zeroed, views=False, own=own),
                                   any(m != longest for m in lengths)))


def from_rows(seq):
    """Rows ``seq`` as (tensor, dim, lengths, zeroed) of one tensor (n, longest, ...) with zeros past each end:
    what lies there in the rows (another instance's data, a NaN, a softmax's -inf) must not reach a gradient
    through the ops that run on it here."""
    t = rows.as_padded(seq)
    return torch.where(_mask(t, 0, seq.lengths), t, t.new_zeros(())), 0, seq.lengths, True


def padded_out(n, seq, pads, value):
    """``F.pad(x, pad, value=value)`` of each instance's stretch (Rows ``seq``) with ``pads`` its own (a tuple of
    ints each), where only the right pad of the stretch's own dim differs and every instance comes out as long
    there (``F.pad(x, (0, L - n))``): one tensor of the stretches, ``value`` past each end, cut or extended to that
    length, the pads of the other dims shared; None for any other pads."""
    rank = seq.source.dim() - 1  # (an instance's value's: its stretch's dim first)
    width = len(pads[0])
    if rank < 1 or width != 2 * rank or any(len(p) != width or not all(type(v) is int for v in p) for p in pads):
        return None  # (a pad that does not reach the stretch's dim, or reaches past its rank: each instance's own)
    right = 2 * rank - 1  # (the stretch's right pad: pairs count from the last dim, the stretch's is the rank-th)
    if any(p[:right] != pads[0][:right] or p[right + 1:] != pads[0][right + 1:] for p in pads):
        return None
    ends = {m + p[right] for m, p in zip(seq.lengths, pads)}
    if len(ends) != 1 or min(ends) < 0:
        return None
    t, _, lengths, _ = from_rows(seq)  # (zeros past each end)
    if value:
        t = torch.where(_mask(t, 0, lengths), t, t.new_full((), value))
    shared = list(pads[0])
    shared[right] = ends.pop() - t.shape[1]  # (the rows past every end dropped or added: all of them pad)
    return bt.from_tensor(F.pad(t, shared, value=value))


# ---- ops that move dims ------------------------------------------------------------------------------------

WHOLE = frozenset({"sum", "mean", "max", "min", "amax", "amin"})  # (reductions over an instance's whole value)
_PLACES = frozenset({"argmax", "argmin"})  # (and the place of its extreme in it laid flat)
MOVES = frozenset({"t", "transpose", "swapaxes", "swapdims", "permute", "movedim", "unsqueeze", "squeeze",
                   "contiguous"})


def _order_of(name, rank, args, kwargs):
    """The instance's dims in the order ``name`` leaves them (a permutation), or None for other forms."""
    if kwargs:
        return None
    order = list(range(rank))
    if name == "t":
        return order[::-1] if rank == 2 and not args else None
    if name == "contiguous":
        return order if not args else None
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = [_dim(d, rank) for d in args] if len(args) == 2 else [None]
        if None in dims:
            return None
        a, b = dims
        order[a], order[b] = order[b], order[a]
        return order
    if name == "permute":
        dims = list(args[0]) if len(args) == 1 and type(args[0]) in (tuple, list, torch.Size) else list(args)
        dims = [_dim(d, rank) for d in dims]
        return dims if len(dims) == rank and None not in dims and sorted(dims) == order else None
    if name == "movedim":
        if len(args) != 2:
            return None
        a, b = (_dim(d, rank) for d in args)
        if a is None or b is None:
            return None
        order.remove(a)
        order.insert(b, a)
        return order
    return None


def _dim(d, rank):
    """``d`` made non-negative against ``rank``, or None where it is no int dim of it."""
    return d + rank if type(d) is int and -rank <= d < 0 else d if type(d) is int and 0 <= d < rank else None


def moved(n, name, tensor, dim, lengths, args, kwargs, zeroed=False):
    """``x.name(*args)`` that moves, adds or drops dims, of values of ``lengths`` along ``dim``: once on their
    tensor (views); NotImplemented for other forms, and for a squeeze of the lengths' dim."""
    rank = tensor.dim() - 1
    if name in ("unsqueeze", "squeeze"):
        if kwargs or len(args) > 1:
            return NotImplemented
        if name == "unsqueeze":
            at = _dim(args[0], rank + 1) if args else None
            if at is None:
                return NotImplemented
            return result(n, tensor.unsqueeze(at + 1), dim + (at <= dim), lengths, zeroed)
        drop = [_dim(args[0], rank)] if args else [d for d in range(rank) if d != dim and tensor.shape[d + 1] == 1]
        if None in drop or dim in drop or (not args and min(lengths) == 1):
            return NotImplemented  # (the lengths' dim: squeezed in an instance of length 1 only)
        drop = [d for d in drop if tensor.shape[d + 1] == 1]
        return result(n, tensor.squeeze([d + 1 for d in drop]) if drop else tensor,
                       dim - sum(d < dim for d in drop), lengths, zeroed)
    order = _order_of(name, rank, args, kwargs)
    if order is None:
        return NotImplemented
    out = tensor.contiguous() if name == "contiguous" else tensor.permute(0, *[d + 1 for d in order])
    return result(n, out, order.index(dim), lengths, zeroed)


def rows_method(n, name, seq, args, kwargs):
    """``xs.t()``, ``xs.transpose(0, 1)``, ``xs.unsqueeze(0)`` ... of each instance's stretch (Rows) that move
    its rows' dim: Padded (or Rows again); ``xs.sum()``, ``xs.max()`` over all of it; NotImplemented for other
    ops."""
    if name == "size" and len(args) <= 1 and not kwargs:  # (``out.size(0)``: each instance's length)
        return size(n, seq.source.shape[1:], 0, seq.lengths, *args)
    if name == "dim" and not args and not kwargs:
        return seq.source.dim() - 1
    if name in ("numel", "nelement") and not args and not kwargs:  # (each instance's length times a row's size)
        return bt.from_items([m * math.prod(seq.source.shape[2:]) for m in seq.lengths])
    if (name in WHOLE or name in _PLACES) and not args and not kwargs:  # (an empty stretch's sum is 0; ``whole``
        t = rows.as_padded(seq)                                          # refuses the rest)
        return whole(n, name, t, 0, seq.lengths, _mask(t, 0, seq.lengths))
    if seq.shortest == 0:
        return NotImplemented
    if name in WHOLE and type(kwargs.get("dim", args[0] if args else None)) in (tuple, list):  # (``xs.sum((0, 1))``)
        return reduced(n, name, Padded(*from_rows(seq)), args, kwargs)
    if name not in MOVES:
        return NotImplemented
    tensor, dim, lengths, zeroed = from_rows(seq)
    return moved(n, name, tensor, dim, lengths, args, kwargs, zeroed)


def indexed(n, tensor, dim, lengths, index, zeroed=False):
    """``x[None]``, ``x[0]``, ``x[:, None]``, ``x[..., :k]``: an index of ``None``, ints, slices and an ellipsis
    that keeps the lengths' dim whole; NotImplemented for others."""
    index = index if type(index) is tuple else (index,)
    if not all(i is None or i is Ellipsis or type(i) in (int, slice) for i in index) or index.count(Ellipsis) > 1:
        return NotImplemented
    rank = tensor.dim() - 1
    taken = sum(1 for i in index if i is not None and i is not Ellipsis)
    if taken > rank:
        return NotImplemented
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (rank - taken) + index[at + 1:]
    else:
        index = index + (slice(None),) * (rank - taken)
    source_dim, new_dim = 0, 0  # (walking the instance's dims and the result's)
    for place, i in enumerate(index):
        if i is None:
            new_dim += 1
            continue
        if source_dim == dim:
            if type(i) is int:  # (``out[0, -1]``: each instance's item along the dim, after the rest)
                kept = indexed(n, tensor, dim, lengths, index[:place] + (slice(None),) + index[place + 1:])
                return NotImplemented if kept is NotImplemented else _item(n, kept, new_dim, lengths, i)
            if i != slice(None):  # (``out[:, 1:]``: a slice each instance starts at the same place)
                try:
                    bounds = [i.indices(m) for m in lengths]
                except TypeError:  # (a bound that is not an index: each instance raises its own)
                    return NotImplemented
                start = bounds[0][0]
                if any(step != 1 or a != start for a, _, step in bounds):
                    return NotImplemented
                index = index[:place] + (slice(start, None),) + index[place + 1:]
                lengths = [max(0, b - a) for a, b, _ in bounds]
            found = new_dim
        if type(i) is slice:
            new_dim += 1
        source_dim += 1
    return result(n, tensor[(slice(None), *index)], found, lengths, zeroed)


def _item(n, kept, dim, lengths, i):
    """Item i (from the end where negative) of each instance's value along its lengths' ``dim`` (of Batch
    ``kept``), where each has one; NotImplemented otherwise (each instance raises its own IndexError)."""
    at = [i if i >= 0 else m + i for m in lengths]
    if not all(0 <= a < m for a, m in zip(at, lengths)):
        return NotImplemented
    found = of(kept)
    t = found.tensor.movedim(dim + 1, 1) if found is not None else rows.of(kept).source
    device = t.device
    return bt.from_tensor(t[torch.arange(n, device=device), torch.tensor(at, device=device)])


# ---- ops finite everywhere ------------------------------------------------------------------------------

_DIVISIONS = frozenset({operator.truediv, torch.div, "div", "__truediv__"})
_MODULES = tuple(m for m in facts.ELEMENTWISE_MODULES if m is not nn.Dropout)


def _finite_op(n, fn, x, args, kwargs):
    """``fn(*args, **kwargs)``, finite at finite inputs with finite gradients (a name: ``x``'s method), once
    on the padded tensor; its other operands numbers, shared tensors that do not reach the lengths' dim (or
    are 1 there), or values of the same lengths and shape (not as a divisor); NotImplemented otherwise."""
    if any(isinstance(v, torch.Tensor) or type(v) is Batch for v in kwargs.values()) or kwargs.get("inplace"):
        return NotImplemented
    if type(fn) is not str and getattr(fn, "__module__", None) == F.__name__ and any(a is True for a in args[1:]):
        return NotImplemented  # (``F.relu(x, True)``: in place, by position)
    rank = x.tensor.dim() - 1
    values = []
    for position, a in enumerate(args):
        if a is x.tensor:  # (a method's own tensor)
            values.append(a)
        elif type(a) is Batch:
            other = of(a)
            if fn in _DIVISIONS and position == 1 or other is not x and (
                    other is None or other.dim != x.dim or other.lengths != x.lengths or
                    other.tensor.shape != x.tensor.shape):
                return NotImplemented  # (a divisor: past an end, a zero there)
            values.append(other.tensor)
        elif isinstance(a, torch.Tensor):
            reach = a.dim() - (rank - x.dim)  # (≥ 0: right-aligned, its dim ``reach`` meets the lengths' dim)
            if a.dim() > rank or (reach >= 0 and a.shape[reach] != 1):
                return NotImplemented
            values.append(a)
        elif type(a) in (int, float, bool) or a is None:
            values.append(a)
        else:
            return NotImplemented
    out = getattr(values[0], fn)(*values[1:], **kwargs) if type(fn) is str else fn(*values, **kwargs)
    if type(out) is not torch.Tensor or out.shape != x.tensor.shape:
        return NotImplemented
    return result(n, out, x.dim, x.lengths, own=x.own)


# ---- convolution and pooling along the lengths' dim --------------------------------------------------------

_CONVS = {nn.Conv1d: 1, nn.Conv2d: 2}
_CONV_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2}


def _pair(value, count):
    return tuple(value) if type(value) in (tuple, list) else (value,) * count


def convolved(n, x, conv, weight, bias, stride, padding, dilation, groups, spatial):
    """A convolution over each instance's value whose lengths' dim is one of its ``spatial`` dims (unbatched
    (C, *S), or a batch of its own (B, C, *S)): one convolution of the padded tensor, zeros past each end (what
    its zero padding reads), each instance's output as long as its own convolution's. NotImplemented where an
    output would be empty (its instance's conv raises)."""
    t = x.tensor
    rank = t.dim() - 1
    if rank not in (spatial + 1, spatial + 2) or x.dim < rank - spatial:
        return NotImplemented
    along = x.dim - (rank - spatial)  # (which spatial dim)
    step, spread = _pair(stride, spatial)[along], _pair(dilation, spatial)[along]  # (along that dim)
    kernel = weight.shape[2 + along]
    reach = spread * (kernel - 1)  # (a window's width less one)
    if padding == "same":
        lengths, left = list(x.lengths), reach // 2
    else:
        left = 0 if padding == "valid" else _pair(padding, spatial)[along]
        lengths = [(m + 2 * left - reach - 1) // step + 1 for m in x.lengths]
    if min(lengths) < 1:
        return NotImplemented
    right = reach - left if padding == "same" else left
    if math.prod(t.shape[1:-spatial - 1]) == 1 and step == 1 and (spatial == 1 or type(padding) is not str) and \
            sum(x.lengths) + n * (left + right) <= _PACKED_SHARE * n * (t.shape[x.dim + 1] + left + right):
        flat = t.reshape(n, *t.shape[-spatial - 1:])  # (one sequence each)
        out = _end_to_end(flat, x.lengths, conv, weight, bias, stride, padding, dilation, groups, spatial, along,
                          left, right, lengths)
    else:
        source = x.zeros_past_ends()
        flat = source.reshape(-1, *source.shape[-spatial - 1:])  # (instances times their batches)
        out = conv(flat, weight, bias, stride, padding, dilation, groups)
    out = out.view(*t.shape[:-spatial - 1], *out.shape[1:])
    return result(n, out, x.dim, lengths, own=True)


_PACKED_SHARE = 0.8  # (sequences laid end to end where that is this share of their padded length, or less)


def _end_to_end(flat, lengths, conv, weight, bias, stride, padding, dilation, groups, spatial, along, left, right,
                out_lengths):
    """A convolution (stride 1 along the dim) of each instance's sequence along spatial dim ``along`` of ``flat``
    (n, C, *S), what lies past each end never read: the sequences laid end to end, each between its own
    padding's zeros, as one sequence of one convolution that pads nothing along that dim; each instance's
    outputs (the windows within its stretch) gathered back into rows padded to the longest. No padding's worth
    of compute past the shorter sequences' ends; the windows that straddle two sequences are computed and never
    read."""
    ax = 2 + along
    counts = torch.tensor(lengths)
    spans = counts + (left + right)
    starts = spans.cumsum(0) - spans
    k, i = rows.spread(counts)  # (each instance's places, and where they go among the sequences end to end)
    device = flat.device
    places = flat.movedim(ax, 1)[k.to(device), i.to(device)]  # (its places: (sum of lengths, C, *rest))
    joined = places.new_zeros(int(spans.sum()), *places.shape[1:]).index_put_(((starts[k] + left + i).to(device),),
                                                                           places)
    joined = joined.movedim(0, ax - 1).unsqueeze(0)  # (1, C, *S): one sequence
    pads = [0 if a == along else p for a, p in enumerate(_pair(0 if type(padding) is str else padding, spatial))]
    out = conv(joined, weight, bias, stride, pads, dilation, groups)[0].movedim(ax - 1, 0)  # (T, C', *rest)
    longest = max(out_lengths)
    at = (starts[:, None] + torch.arange(longest)).clamp(max=out.shape[0] - 1)  # (n, longest): past an end, a copy
    return out[at.to(out.device)].movedim(1, ax)


def pooled(n, x, fn, kind, kernel, stride, padding, ceil_mode, spatial=1):
    """``F.max_pool1d``/``avg_pool1d`` along the lengths' dim (the last): a kernel as long as each instance's
    value is its max or mean there (``kernel_size=n``, ``x.size(2)``); a shared kernel without padding pools
    the padded tensor, each output as long as its instance's own. NotImplemented for other forms."""
    t = x.tensor
    rank = t.dim() - 1
    if x.dim != rank - 1 or rank not in (spatial + 1, spatial + 2) or padding != 0 or ceil_mode or \
            not t.is_floating_point():  # (an integer pooling: each instance raises torch's error)
        return NotImplemented
    kernels = bt.instance_ints(n, kernel)
    if kernels == x.lengths and stride in (None, kernel, ()):
        return _pooled_whole(n, x, kind == "max")
    if type(kernel) is not int or type(stride) not in (int, type(None)) or kernel < 1 or \
            (stride is not None and stride < 1):
        return NotImplemented
    step = kernel if stride is None else stride
    lengths = [(m - kernel) // step + 1 for m in x.lengths]
    if min(lengths) < 1:
        return NotImplemented
    return result(n, fn(t.reshape(-1, *t.shape[-2:]), kernel, step).view(*t.shape[:-1], -1), x.dim, lengths,
                   own=True)


# ---- reductions ------------------------------------------------------------------------------------------

_REDUCTIONS = rows.REDUCTIONS | {"softmax", "log_softmax"}


def _along(n, x, name, keepdim, correction=1):
    """``name`` along the lengths' dim of each instance's value, what lies past each end left out (``rows``'
    reductions and softmaxes within a mask)."""
    t = x.tensor
    if name in ("softmax", "log_softmax"):
        if min(x.lengths) == 0 or not t.is_floating_point():
            return NotImplemented
        out = rows.softmax_within(name, t, x.dim + 1, x.mask())
        if name == "log_softmax":  # (-inf past each end: finite there, zeros)
            out = torch.where(x.mask(), out, out.new_zeros(()))
        return result(n, out, x.dim, x.lengths, zeroed=True)
    if name not in rows.EMPTY_SAFE and min(x.lengths) == 0:
        return NotImplemented  # (an empty one: its instance's own op says what it gives or raises)
    return rows.reduced_within(n, name, t, x.dim + 1, x.mask(), torch.tensor(x.lengths), keepdim, correction)


def reduced(n, name, x, args, kwargs):
    """``x.sum(d)``, ``x.max(dim=d)``, ``torch.softmax(x, d)``, ``x.sum()`` ... of each instance's value: along
    the lengths' dim through ``_along``; along another, once on the padded tensor; over everything, what lies
    past each end left out. NotImplemented for other forms."""
    rank = x.tensor.dim() - 1
    found = rows.reduction_args(name, args, kwargs)
    if found is None or (name in ("softmax", "log_softmax") and (found[0] is None or "keepdim" in kwargs
                                                                 or len(args) > 1)):
        return NotImplemented
    dim, keepdim, correction = found
    if dim is None:
        if name in ("std", "var") or keepdim or args:
            return NotImplemented
        return whole(n, name, x.tensor, x.dim, x.lengths, x.mask())
    if type(dim) in (tuple, list) and name in ("sum", "mean", "amax", "amin"):  # (``x.sum((0, 1))``)
        dims = [_dim(d, rank) for d in dim]
        if None in dims or len(set(dims)) < len(dims) or not dims:
            return NotImplemented
        if x.dim in dims:
            return whole(n, name, x.tensor, x.dim, x.lengths, x.mask(), dims, keepdim)
        out = getattr(x.tensor, name)([d + 1 for d in dims], keepdim)
        return result(n, out, x.dim - (0 if keepdim else sum(d < x.dim for d in dims)), x.lengths)
    dim = _dim(dim, rank)
    if dim is None:
        return NotImplemented
    if dim == x.dim:
        return _along(n, x, name, keepdim, correction)
    spread = {"correction": correction} if name in ("std", "var") else {}
    out = getattr(x.tensor, name)(dim + 1, keepdim=keepdim, **spread) if name not in ("softmax", "log_softmax") \
        else getattr(x.tensor, name)(dim + 1)
    at = x.dim - (dim < x.dim and not keepdim and name not in ("softmax", "log_softmax"))
    if type(out) is torch.Tensor:
        return result(n, out, at, x.lengths)
    return bt.from_struct(type(out), [result(n, out.values, at, x.lengths),
                                      result(n, out.indices, at, x.lengths)], n)


def whole(n, name, t, dim, lengths, mask, over=None, keepdim=False):
    """``x.sum()``, ``x.max()``, ``x.sum((0, 1))`` ... over each instance's whole value (of ``lengths`` along
    ``dim`` of ``t``), or over its dims ``over`` (the lengths' dim among them), in one reduction of the padded
    tensor, what lies past each end left out (a full max's gradient is shared by every tie, as eager's; an inf
    tying with the fill, which would take a share, runs per instance). NotImplemented for other reductions."""
    dims = tuple(range(1, t.dim())) if over is None else tuple(d + 1 for d in over)
    if name in _PLACES and dim == 0 and over is None and min(lengths) > 0 and math.prod(t.shape[2:]) > 0 and \
            t.dtype is not torch.bool and not t.is_complex():  # (eager's own error for those)
        # (``s.argmax()``: each instance's place in its value laid flat, which is its place in its padded rows laid
        # flat, what lies past its end filled so as to lose, and coming after it where it ties)
        filled = torch.where(mask, t, t.new_full((), rows.extreme_fill(t, name == "argmax")))
        return bt.from_tensor(getattr(filled.reshape(n, -1), name)(1))
    if name in ("max", "min") and (over is not None or not t.is_floating_point()):
        name = "a" + name  # (the values alone: over several dims, or integers, with no gradient to share)
    if name not in WHOLE or name != "sum" and min(lengths) == 0:
        return NotImplemented
    if name in ("max", "min"):  # (``x.max()``: torch's shares of ties)
        fill = rows.extreme_fill(t, name == "max")
        if t.requires_grad and torch.is_grad_enabled() and bool((torch.where(mask, t, 0) == fill).any()):
            return NotImplemented
        filled = torch.where(mask, t, t.new_full((), fill))
        return bt.from_tensor(extremes.RowExtreme.apply(filled.reshape(n, -1), name))
    rest = math.prod(t.shape[d] for d in dims if d != dim + 1)  # (the other dims' sizes, shared)
    return rows.reduced_within(n, name, t, dims, mask, torch.tensor(lengths) * rest, keepdim)


# ---- the entry points batch_rules calls ----------------------------------------------------------------

METHODS = MOVES | facts.FINITE_METHODS | _REDUCTIONS | {"size", "dim", "chunk", "split"}
ROWS_METHODS = MOVES | WHOLE | {"size", "dim", "numel", "nelement"}  # (a stretch's methods ``rows_method`` runs)


def method(n, name, x, args, kwargs):
    """``xs.name(*args, **kwargs)`` of each instance's Padded value, or NotImplemented."""
    if name in MOVES:
        return moved(n, name, x.tensor, x.dim, x.lengths, args, kwargs, x.zeroed)
    if name in _REDUCTIONS:
        return reduced(n, name, x, args, kwargs)
    if name == "size":
        return size(n, x.tensor.shape[1:], x.dim, x.lengths, *args) if len(args) <= 1 and not kwargs else \
            NotImplemented
    if name == "dim":
        return x.tensor.dim() - 1 if not args and not kwargs else NotImplemented
    if name in ("chunk", "split"):
        return _pieces(n, name, x, args, kwargs)
    if name in facts.FINITE_METHODS:
        return _finite_op(n, name, x, (x.tensor, *args), kwargs)
    return NotImplemented


def size(n, shape, along, lengths, dim=None):
    """``x.size()``, ``x.size(d)`` of values of ``shape`` (an instance's, padded) and ``lengths`` along dim
    ``along``: each instance's length there, the rest shared."""
    if dim is None:
        return bt.from_struct(torch.Size, [bt.from_items(list(lengths)) if d == along else s
                                           for d, s in enumerate(shape)], n)
    d = _dim(dim, len(shape))
    if d is None:
        return NotImplemented
    return bt.from_items(list(lengths)) if d == along else shape[d]


def attribute(n, name, x):
    """``x.shape``, ``x.ndim``, ``x.T`` of each instance's Padded value, or NotImplemented."""
    if name == "shape":
        return size(n, x.tensor.shape[1:], x.dim, x.lengths)
    if name == "ndim":
        return x.tensor.dim() - 1
    if name == "T" and x.tensor.dim() == 3:
        return moved(n, "t", x.tensor, x.dim, x.lengths, (), {}, x.zeroed)
    return NotImplemented


def call(n, fn, args, kwargs):
    """``fn(*args, **kwargs)`` where an argument holds Padded values, or NotImplemented."""
    if fn in (operator.matmul, torch.matmul, F.linear, torch.bmm):
        if fn is not F.linear and len(args) == 2 and not kwargs and type(args[0]) is Batch and of(args[0]) is None:
            return _by_each(n, fn, args[0], of(args[1]))  # (``q @ xs.t()``: each instance's own q)
        return _weighted(n, fn, args, kwargs) if fn is not torch.bmm else NotImplemented
    x = of(args[0]) if args and type(args[0]) is Batch else None
    if x is None:
        if fn in (operator.add, operator.mul, torch.add, torch.mul) and len(args) == 2 and of(args[1]) is not None \
                and not kwargs:
            return call(n, fn, (args[1], args[0]), kwargs)  # (``b + x``: the same for these)
        if fn in (operator.sub, torch.sub) and len(args) == 2 and of(args[1]) is not None and not kwargs:
            negated = call(n, operator.neg, (args[1],), {})
            return NotImplemented if negated is NotImplemented else call(n, operator.add, (negated, args[0]), {})
        return NotImplemented
    try:
        hash(fn)
    except TypeError:
        return NotImplemented
    if isinstance(fn, nn.Module):
        kind = type(fn)
        if kind in _ENCODERS:
            return encoded(n, fn, args, kwargs)
        if has_hooks(fn) or "forward" in fn.__dict__ or len(args) != 1 or kwargs or getattr(fn, "inplace", False):
            return NotImplemented
        if kind in _CONVS:
            if fn.padding_mode != "zeros" or any(type(a) is Batch for a in (fn.weight, fn.bias)):
                return NotImplemented
            conv = F.conv1d if kind is nn.Conv1d else F.conv2d
            return convolved(n, x, conv, fn.weight, fn.bias, fn.stride, fn.padding, fn.dilation, fn.groups,
                             _CONVS[kind])
        if kind in (nn.MaxPool1d, nn.AvgPool1d):
            if kind is nn.MaxPool1d and (fn.dilation != 1 or fn.return_indices):
                return NotImplemented
            if kind is nn.AvgPool1d and (fn.count_include_pad is not True and fn.padding != 0):
                return NotImplemented
            pool = F.max_pool1d if kind is nn.MaxPool1d else F.avg_pool1d
            return pooled(n, x, pool, "max" if kind is nn.MaxPool1d else "avg", _one(fn.kernel_size),
                          _one(fn.stride), _one(fn.padding), fn.ceil_mode)
        if kind in (nn.AdaptiveMaxPool1d, nn.AdaptiveAvgPool1d):
            return _adaptive(n, x, kind is nn.AdaptiveMaxPool1d, fn.output_size,
                             getattr(fn, "return_indices", False))
        if kind in _MODULES or (kind is nn.Dropout and (not fn.training or fn.p == 0)):
            return _finite_op(n, fn, x, (x.tensor,), {})
        if kind is nn.GLU:
            return _halved(n, x, fn.dim)
        if kind is nn.BatchNorm1d and not fn.training and fn.track_running_stats and x.tensor.dim() == 4 and \
                x.tensor.shape[1] == 1 and x.dim == 2:  # (a batch of one (1, C, L), by the running statistics)
            return result(n, fn(x.tensor.squeeze(1)).unsqueeze(1), x.dim, x.lengths)
        return NotImplemented
    if fn in _CONV_FUNCTIONS:
        return _conv_call(n, fn, x, args, kwargs)
    if fn is F.glu:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
        return _halved(n, x, dim) if len(args) <= 2 and set(kwargs) <= {"dim"} else NotImplemented
    if fn in (torch.chunk, torch.split):
        return _pieces(n, fn.__name__, x, args[1:], kwargs)
    if fn in (F.max_pool1d, F.avg_pool1d):
        return _pool_call(n, fn, x, args, kwargs)
    if fn in (F.adaptive_max_pool1d, F.adaptive_avg_pool1d):
        if len(args) != 2 or set(kwargs) - {"return_indices"}:
            return NotImplemented
        return _adaptive(n, x, fn is F.adaptive_max_pool1d, args[1], kwargs.get("return_indices", False))
    name = rows.REDUCING.get(fn)
    if name is not None and name in _REDUCTIONS:
        return reduced(n, name, x, args[1:], kwargs)
    if fn in _MOVING_FUNCTIONS:
        return moved(n, _MOVING_FUNCTIONS[fn], x.tensor, x.dim, x.lengths, args[1:], kwargs, x.zeroed)
    if fn in facts.FINITE_EVERYWHERE:
        return _finite_op(n, fn, x, args, kwargs)
    return NotImplemented


def _weighted(n, fn, args, kwargs):
    """``x @ W``, ``F.linear(x, W, b)`` of each instance's value whose lengths' dim is not its last, ``W @ x``
    of one whose lengths' dim is its last (not the one ``@`` sums over), by shared weights of 1 or 2 dims: once
    on the padded tensor. NotImplemented for other forms."""
    if kwargs or len(args) not in (2, 3) or (len(args) == 3 and fn is not F.linear):
        return NotImplemented
    first = of(args[0]) if type(args[0]) is Batch else None
    x, weight = (first, args[1]) if first is not None else (of(args[1]) if type(args[1]) is Batch else None, args[0])
    if x is None or type(weight) not in (torch.Tensor, nn.Parameter) or weight.dim() not in (1, 2) or \
            (len(args) == 3 and args[2] is not None and type(args[2]) not in (torch.Tensor, nn.Parameter)):
        return NotImplemented
    rank = x.tensor.dim() - 1
    if first is not None:
        if x.dim == rank - 1:
            return NotImplemented
        return result(n, fn(x.tensor, *args[1:]), x.dim, x.lengths)
    if fn is F.linear or x.dim != rank - 1 or rank < 2:
        return NotImplemented
    out = fn(weight, x.tensor)
    return result(n, out, out.dim() - 2, x.lengths)


def _by_each(n, fn, a, x):
    """``q @ x``, ``torch.bmm(q, x)`` of each instance's own tensor q and its value x whose lengths' dim is its
    last (not the one ``@`` sums over): one batched matmul; what lies past each end of x (finite) gives what
    lies past each end of the result. NotImplemented for other operands."""
    q = bt.tensor_of(a) if rows.of(a) is None else None
    if x is None or q is None or q.dim() < 2:
        return NotImplemented
    rank = x.tensor.dim() - 1
    if rank < 2 or x.dim != rank - 1 or q.shape[-1] != x.tensor.shape[-2] or q.dtype is not x.tensor.dtype or \
            (fn is torch.bmm and (q.dim() != 4 or rank != 3 or q.shape[1] != x.tensor.shape[1])):
        return NotImplemented  # (a bmm's shapes that do not meet: each instance raises its own)
    vector = q.dim() == 2  # (each q a vector: a row, then taken away, as matmul does)
    q = q.unsqueeze(1) if vector else q
    gap = (rank - 2) - (q.dim() - 3)  # (the batch dims of the two, right-aligned after the instances')
    q = q.view(q.shape[0], *[1] * gap, *q.shape[1:]) if gap > 0 else q
    t = x.tensor.view(x.tensor.shape[0], *[1] * -gap, *x.tensor.shape[1:]) if gap < 0 else x.tensor
    out = torch.matmul(q, t)
    if vector:
        out = out.squeeze(-2)
    return result(n, out, out.dim() - 2, x.lengths)


def _halved(n, x, dim):
    """``F.glu(x, dim)`` along a dim not the lengths': once on the padded tensor."""
    d = _dim(dim, x.tensor.dim() - 1)
    if d is None or d == x.dim or x.tensor.shape[d + 1] % 2:
        return NotImplemented  # (an odd size: each instance raises torch's error)
    return result(n, F.glu(x.tensor, d + 1), x.dim, x.lengths)


def _pieces(n, name, x, args, kwargs):
    """``x.chunk(2, dim=1)``, ``x.split(h, 1)``, ``x.split([a, b], 1)`` along a dim not the lengths': the
    padded tensor's pieces, each instance's of each."""
    if len(args) not in (1, 2) or set(kwargs) - {"dim"} or (len(args) == 2 and kwargs):
        return NotImplemented
    size = args[0]
    if type(size) is Batch and size.struct is not None and size.owner is None and size.struct[0] is list and \
            not any(type(p) is Batch for p in size.struct[1]):
        size = list(size.struct[1])  # (``[1, h - 1]``: a list the program built of what every instance shares)
    d = _dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), x.tensor.dim() - 1)
    if d is None or d == x.dim or not (type(size) is int or type(size) in (list, tuple) and name == "split" and all(
            type(s) is int for s in size)):
        return NotImplemented
    try:
        parts = getattr(x.tensor, name)(list(size) if type(size) is not int else size, d + 1)
    except RuntimeError:  # (sizes that do not add up: each instance raises torch's error)
        return NotImplemented
    return bt.from_struct(tuple, [result(n, part, x.dim, x.lengths) for part in parts], n)


def _one(value):
    return value[0] if type(value) in (tuple, list) and len(value) == 1 else value


def _adaptive(n, x, maximum, output_size, return_indices):
    """``F.adaptive_max_pool1d(x, 1)``: the max (or mean) along the lengths' dim, kept."""
    if _one(output_size) != 1 or return_indices or x.dim != x.tensor.dim() - 2 or not x.tensor.is_floating_point():
        return NotImplemented
    return _pooled_whole(n, x, maximum)


def _pooled_whole(n, x, maximum):
    """A pooling window as long as each instance's value: its max along the lengths' dim (the gradient to the
    first of tied maxima, as a max pool's), or its mean; the dim kept."""
    if not maximum:
        return _along(n, x, "mean", True)
    out = _along(n, x, "max", True)
    return out if out is NotImplemented else out.struct[1][0]


def _bound(fn, args, kwargs, names, defaults):
    """``fn``'s arguments after the input by ``names`` (positional, then by keyword), or None for others."""
    if len(args) > len(names) + 1 or set(kwargs) - set(names):
        return None
    found = dict(zip(names, defaults))
    found.update(zip(names, args[1:]))
    for key, value in kwargs.items():
        if names.index(key) < len(args) - 1:
            return None
        found[key] = value
    return found


def _conv_call(n, fn, x, args, kwargs):
    bound = _bound(fn, args, kwargs, ("weight", "bias", "stride", "padding", "dilation", "groups"),
                   (None, None, 1, 0, 1, 1))
    if bound is None or not isinstance(bound["weight"], torch.Tensor) or type(bound["bias"]) is Batch or \
            any(type(v) is Batch for v in bound.values()):
        return NotImplemented
    return convolved(n, x, fn, *bound.values(), _CONV_FUNCTIONS[fn])


def _pool_call(n, fn, x, args, kwargs):
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad") if fn is F.avg_pool1d else \
        ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
    bound = _bound(fn, args, kwargs, names, (None, None, 0, False, True) if fn is F.avg_pool1d else
                   (None, None, 0, 1, False, False))
    if bound is None or bound.get("dilation", 1) != 1 or bound.get("return_indices") or \
            bound.get("count_include_pad", True) is not True or type(bound["stride"]) is Batch:
        return NotImplemented
    return pooled(n, x, fn, "max" if fn is F.max_pool1d else "avg", _one(bound["kernel_size"]),
                  _one(bound["stride"]), _one(bound["padding"]), bound["ceil_mode"])


_MOVING_FUNCTIONS = {torch.t: "t", torch.transpose: "transpose", torch.permute: "permute", torch.movedim: "movedim",
                     torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze", torch.swapaxes: "swapaxes",
                     torch.swapdims: "swapdims"}


def rows_call(n, fn, args, kwargs):
    """``torch.transpose(xs, 0, 1)``, ``torch.unsqueeze(xs, 0)``, ``torch.sum(xs)`` of each instance's stretch
    (Rows) moving its rows' dim or reducing all of it, a transformer encoder over it; or NotImplemented."""
    if type(fn) in _ENCODERS:
        return encoded(n, fn, args, kwargs)
    try:
        name = _MOVING_FUNCTIONS.get(fn) or rows.REDUCING.get(fn)
    except TypeError:
        return NotImplemented
    seq = rows.of(args[0]) if name is not None and type(args[0]) is Batch else None
    return NotImplemented if seq is None else rows_method(n, name, seq, args[1:], kwargs)


_ENCODERS = (nn.TransformerEncoderLayer, nn.TransformerEncoder, nn.MultiheadAttention)


def _sequences(value, first):
    """Each instance's sequence of its own length in ``value``, unbatched (L, D) or a batch of one ((L, 1, D);
    (1, L, D) where ``first``, batch first), as (padded (n, longest, D) with zeros past each end, its form,
    lengths), or None for other values."""
    seq, x = rows.of(value), of(value)
    if seq is not None and seq.shortest and seq.source.dim() in (3, 4):
        t = from_rows(seq)[0]  # (zeros past each end: a NaN there would reach the weights' gradients)
        if t.dim() == 4 and (first or t.shape[2] != 1):
            return None
        return (t, "rows", seq.lengths) if t.dim() == 3 else (t.squeeze(2), "rows of one", seq.lengths)
    if x is not None and first and x.dim == 1 and x.tensor.dim() == 4 and x.tensor.shape[1] == 1 \
            and min(x.lengths) > 0:
        return x.zeros_past_ends().squeeze(1), "batch first", x.lengths
    return None


def _laid_out(n, out, form, lengths):
    """A module's output (n, longest, D) over ``_sequences`` of ``form``, laid out as they were."""
    if form == "batch first":
        return result(n, out.unsqueeze(1), 1, lengths)
    return rows.batch(n, rows.padded_rows(n, out.unsqueeze(2) if form == "rows of one" else out, lengths))


def encoded(n, module, args, kwargs):
    """An ``nn.TransformerEncoderLayer``, ``TransformerEncoder`` or ``MultiheadAttention`` over each instance's
    sequence of its own length (``_sequences``): once over the sequences padded, the places past each end masked
    out of attention (``src_key_padding_mask``, ``key_padding_mask``), each instance's output laid out as its
    input (an attention's weights each instance's own view of them). Not with masks of the user's, nor with
    dropout while training (each instance draws its own); NotImplemented then, and for other forms."""
    if has_hooks(module) or "forward" in module.__dict__ or (module.training and any(
            type(m) is nn.Dropout and m.p > 0 or type(m) is nn.MultiheadAttention and m.dropout > 0
            for m in module.modules())):
        return NotImplemented
    if type(module) is nn.MultiheadAttention:
        return _attended(n, module, args, kwargs)
    layer = module if type(module) is nn.TransformerEncoderLayer else module.layers[0]
    first = layer.self_attn.batch_first
    found = _sequences(args[0], first) if len(args) == 1 and not kwargs and type(args[0]) is Batch else None
    if found is None:
        return NotImplemented
    source, form, lengths = found
    ignored = ~_mask(source, 0, lengths).view(n, -1)
    out = module(source if first else source.transpose(0, 1), src_key_padding_mask=ignored)
    return _laid_out(n, out if first else out.transpose(0, 1), form, lengths)


_ATTENTION_OPTIONS = {"need_weights": True, "average_attn_weights": True, "key_padding_mask": None,
                      "attn_mask": None, "is_causal": False}


def _attended(n, module, args, kwargs):
    """``attention(q, k, v)`` of an ``nn.MultiheadAttention`` over each instance's sequences (``encoded``)."""
    names = ("query", "key", "value", *_ATTENTION_OPTIONS)
    if len(args) > len(names) or set(kwargs) - set(names) or any(name in kwargs for name in names[:len(args)]):
        return NotImplemented
    given = {**_ATTENTION_OPTIONS, **dict(zip(names, args)), **kwargs}
    if any(given[key] is not None for key in ("key_padding_mask", "attn_mask")) or given["is_causal"] is not False \
            or type(given["need_weights"]) is not bool or type(given["average_attn_weights"]) is not bool:
        return NotImplemented
    first = module.batch_first
    found = [_sequences(given[key], first) if type(given.get(key)) is Batch else None
             for key in ("query", "key", "value")]
    if None in found or len({form for _, form, _ in found}) != 1 or any(m[2] != found[0][2] for m in found):
        return NotImplemented
    (q, form, lengths), (k, _, _), (v, _, _) = found
    ignored = ~_mask(q, 0, lengths).view(n, -1)
    if not first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, weights = module(q, k, v, key_padding_mask=ignored, need_weights=given["need_weights"],
                          average_attn_weights=given["average_attn_weights"])
    out = _laid_out(n, out if first else out.transpose(0, 1), form, lengths)
    if weights is not None:  # (each instance's (L, L): its own view)
        weights = bt.from_items([weights[j, ..., :m, :m] if form == "rows" else weights[j:j + 1, ..., :m, :m]
                                 for j, m in enumerate(lengths)])
    return bt.from_struct(tuple, [out, weights], n)
