"""Ops that act on each row of an instance's stretch alone (``Rows``), run once over every instance's rows.

``mlp(self.embed(words[:n]))``, ``torch.tanh(xs)``, ``self.att(hs).squeeze(-1)``, ``a[:, None] * hs``: each row of
the result is the op of the same row of its inputs alone — elementwise ops whose other operands do not reach the
rows' dim, ``nn.Linear``, ``nn.LayerNorm`` of the last dims, a softmax or a sum along another dim, indexing that
keeps the rows. The instances' stretches are laid end to end in one tensor of an instance's rank (``packed``: a
view where they lie so already, else one index), the op runs once on it, and each instance's result is its
stretch of the output. No row past a stretch's end is computed, so nothing there (a log of padding's zeros) can
reach a value or a gradient.
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
from . import rows
from .batch import Batch

# (dropout too: one mask for every instance's rows at once, each row its own draws, as for a batched value)
_MODULES = tuple(facts.ELEMENTWISE_MODULES)
_FUNCTIONS = (facts.ELEMENTWISE - facts.DRAWS) | {F.dropout}
_SOFTMAX = {torch.softmax: "softmax", F.softmax: "softmax", torch.log_softmax: "log_softmax",
            F.log_softmax: "log_softmax"}
_ELEMENTWISE_METHODS = frozenset({"sigmoid", "tanh", "relu", "exp", "log", "sqrt", "abs", "neg", "clone", "float",
                                  "double", "clamp", "clamp_min", "clamp_max", "clip", "pow", "lerp", "maximum",
                                  "minimum", "add", "sub", "mul", "div", "square", "sin", "cos", "log1p", "expm1",
                                  "erf", "reciprocal", "rsqrt", "sign", "floor", "ceil", "round", "trunc",
                                  "nan_to_num", "masked_fill", "where"})
_DIM_METHODS = frozenset({"softmax", "log_softmax", "sum", "mean", "amax", "amin", "logsumexp", "squeeze",
                          "unsqueeze", "argmax", "argmin", "std", "var", "prod", "any", "all"})
_SHAPING_METHODS = frozenset({"view", "reshape"})
# Functions (and Tensor methods) acting along the dim they are given, each row alone where it is not the rows':
# callable -> (the dim's position after the input, its default)
_ALONG_A_DIM = {F.normalize: (2, 1), F.cosine_similarity: (2, 1), torch.norm: (2, None),
                torch.linalg.vector_norm: (2, None), torch.cumsum: (1, None), "norm": (1, None), "cumsum": (0, None)}
METHODS = _ELEMENTWISE_METHODS | _DIM_METHODS | _SHAPING_METHODS | {"norm", "cumsum", "mm", "matmul"}  # (``method``'s)


def holds_rows(args):
    """Whether an argument is a batch of Rows."""
    return any(rows.holds(a) for a in args)


def packed(seq):
    """Every instance's stretch of ``seq`` end to end, one tensor of an instance's rank (rows first)."""
    if seq.packed is None:
        starts = seq.layout().offsets()
        device = seq.source.device
        if seq.rows is not None and seq.source.shape[0] == 1 and seq.starts == starts:
            seq.packed = seq.source[0, :starts[-1] + seq.lengths[-1]]  # (the stretches lie so already: a view)
        else:
            k, i = seq.where(device)
            first = seq.starts[0]
            if seq.rows is None and seq.alike():  # (each from one column of its row)
                seq.packed = rows.gather_rows(seq.source, k, i + first if first else i)
            else:
                seq.packed = rows.gather_rows(seq.source, seq.row_index(device)[k], i + seq.start_index(device)[k])
    return seq.packed


def from_packed(n, flat, seq):
    """The Batch whose instance k's value is its stretch of ``flat``'s rows, of the lengths of Rows ``seq``
    (Rows of ``flat``, laid end to end)."""
    return rows.batch(n, rows.packed_rows(n, flat, seq.lengths, seq))


def call(n, fn, args, kwargs):
    """``fn(*args, **kwargs)`` where an argument holds Rows, once on the rows packed; NotImplemented where
    ``fn`` is not known to act on each row alone with these arguments."""
    seq = next(rows.of(a) for a in args if rows.holds(a))
    if seq is None or not _plain_options(kwargs):
        return NotImplemented
    rank = seq.source.dim() - 1
    try:
        hash(fn)
    except TypeError:  # (an unhashable callable: no rule names it)
        return NotImplemented
    if seq.shortest == 0 and fn not in facts.ELEMENTWISE:
        return NotImplemented  # (an empty stretch: an elementwise op's is empty, the rest its instance's own says)
    if isinstance(fn, nn.Module):
        if has_hooks(fn) or "forward" in fn.__dict__ or len(args) != 1 or kwargs or getattr(fn, "inplace", False):
            return NotImplemented
        if type(fn) is nn.Linear:
            return _weighted(n, seq, F.linear, args[0], (fn.weight, fn.bias), {})
        if type(fn) is nn.LayerNorm and len(fn.normalized_shape) >= rank:
            return NotImplemented
        if type(fn) is not nn.LayerNorm and type(fn) not in _MODULES:
            return NotImplemented  # (exactly these types: a subclass's forward may reach across the rows)
    elif fn in (F.linear, torch.matmul, operator.matmul, torch.mm):
        if fn is not F.linear and len(args) == 2 and not kwargs and any(type(a) is Batch for a in args[1:]):
            return _products(n, seq, args[0], args[1])
        return _weighted(n, seq, fn, args[0], args[1:], kwargs)
    elif fn is F.dropout:
        if len(args) > 3 and args[3] is not False:  # (``F.dropout(xs, p, True)`` trains; a fourth True: in place)
            return NotImplemented
    elif any(a is True for a in args[1:]) and getattr(fn, "__module__", None) == F.__name__:
        return NotImplemented  # (``F.hardtanh(xs, -1, 1, True)``: in place, by position)
    elif fn is torch.where and len(args) != 3:
        return NotImplemented  # (``torch.where(cond)``: the indices, not a value per row)
    elif fn in _ALONG_A_DIM:
        if not _along_another_dim(fn, args[1:], kwargs, rank) or rows.of(args[0]) is not seq:
            return NotImplemented
    elif fn in _SOFTMAX:
        dim = _dim(args[1:], kwargs, rank)
        if dim is None or dim == 0 or rows.of(args[0]) is not seq:
            return NotImplemented
    elif fn is F.layer_norm:
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        if rows.of(args[0]) is not seq or type(shape) not in (tuple, list, torch.Size) or len(shape) >= rank:
            return NotImplemented
    elif fn not in _FUNCTIONS:
        return NotImplemented
    # (an instance's own tensor only where the op broadcasts it along the rows: not a layer norm's weight, nor
    # a bound of F's activations, which take numbers)
    values = _operands(n, seq, rank, args, getattr(fn, "__module__", None) != F.__name__)
    return NotImplemented if values is None else _rows_of(n, seq, fn(*values, **kwargs))


def _plain_options(kwargs):
    """Whether keyword arguments hold no tensor (a shared one could reach the rows' dim, ``clamp(min=W)``), no
    batch and no ``inplace`` (the op would change a copy: the rows packed)."""
    return not any(isinstance(v, torch.Tensor) or type(v) is Batch for v in kwargs.values()) and \
        not kwargs.get("inplace", False)


def _weighted(n, seq, fn, first, rest, kwargs):
    """``F.linear(xs, W, b)``, ``xs @ W`` of each instance's rows by a shared weight (1-d or 2-d, acting on
    each row's last dim)."""
    if type(first) is not Batch or rows.of(first) is not seq or seq.source.dim() < 3 or not rest or \
            any(type(a) is Batch for a in rest) or not isinstance(rest[0], torch.Tensor) or rest[0].dim() not in (1, 2):
        return NotImplemented
    return _rows_of(n, seq, fn(packed(seq), *rest, **kwargs))


def _products(n, seq, first, second):
    """``xs @ q`` of each instance's rows by its own vector (a score per row), and ``a @ xs`` of a weight per
    row and the rows of the same lengths (their weighted sum): once on the rows packed; NotImplemented for
    other operands."""
    other = rows.of(second) if type(second) is Batch else None
    if rows.of(first) is seq and other is None and type(second) is Batch:
        q = bt.tensor_of(second)
        if q is None or q.dim() != 2 or seq.source.dim() != 3 or q.shape[1] != seq.source.shape[2] or \
                q.dtype is not seq.source.dtype:
            return NotImplemented
        flat = packed(seq)
        return _rows_of(n, seq, (flat * q.index_select(0, seq.where(q.device)[0])).sum(-1))
    if rows.of(first) is seq and other is not None and seq.source.dim() == 2 and other.lengths == seq.lengths \
            and other.source.dim() in (2, 3) and other.source.dtype is seq.source.dtype and seq.shortest:
        weights, values = packed(seq), packed(other)
        if not weights.is_cpu:  # (CUDA's index_add adds in no fixed order: the rows padded, past each end none)
            device = weights.device
            each = rows.as_padded(seq).view(n, -1, *[1] * (values.dim() - 1)) * rows.as_padded(other)
            inside = seq.mask(device).view(n, -1, *[1] * (values.dim() - 1))
            return bt.from_tensor(torch.where(inside, each, each.new_zeros(())).sum(1))
        each = weights.view(-1, *[1] * (values.dim() - 1)) * values
        return bt.from_tensor(each.new_zeros(n, *values.shape[1:]).index_add(0, seq.where(each.device)[0], each))
    return NotImplemented


def einsummed(n, equation, operands):
    """``torch.einsum("nd,de->ne", xs, W)`` of one instance's stretch and shared tensors, where the rows'
    subscript is the stretch's first, in no other operand, and the result's first: each row alone, once on the
    rows packed; NotImplemented for other equations and operands."""
    if type(equation) is not str:
        return NotImplemented
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    at = [k for k, o in enumerate(operands) if type(o) is Batch]
    if not arrow or len(terms) != len(operands) or len(at) != 1 or "." in lhs or \
            any(type(o) not in (torch.Tensor, nn.Parameter) for k, o in enumerate(operands) if k != at[0]):
        return NotImplemented
    seq, term = rows.of(operands[at[0]]), terms[at[0]]
    if seq is None or seq.shortest == 0 or not term or not rhs or rhs[0] != term[0] or lhs.count(term[0]) != 1 \
            or rhs.count(term[0]) != 1 or len(term) != seq.source.dim() - 1:
        return NotImplemented
    values = [packed(seq) if k == at[0] else o for k, o in enumerate(operands)]
    return _rows_of(n, seq, torch.einsum(equation, *values))


def joined(n, fn, parts, dim):
    """``torch.cat([fwd, bwd], 1)``, ``torch.stack([a, b], -1)`` of stretches of the same lengths along a dim
    other than their rows' (each row with the same row of the others): once on the rows packed; ``torch.cat(
    [bos[None], xs, eos[None]])`` along the rows' dim (``_end_to_end``). NotImplemented for other parts and
    dims."""
    found = [rows.of(p) if type(p) is Batch else None for p in parts]
    if fn is not torch.stack and type(dim) is int and any(f is not None for f in found):
        rank = next(f for f in found if f is not None).source.dim() - 1
        if dim in (0, -rank):
            return _end_to_end(n, parts, found, rank)
    if not found or None in found or type(dim) is not int:
        return NotImplemented
    seq = found[0]
    rank = seq.source.dim() - 1
    if seq.shortest == 0 or any(f.lengths != seq.lengths or f.source.dim() - 1 != rank for f in found) or \
            not 1 <= (dim if dim >= 0 else dim + rank + (fn is torch.stack)) <= rank - (fn is not torch.stack):
        return NotImplemented
    return _rows_of(n, seq, fn([packed(f) for f in found], dim))


def _end_to_end(n, parts, found, rank):
    """``torch.cat(parts)`` along the rows' dim, each part a stretch of every instance (Rows ``found``) or a
    shared tensor of the same rank: every instance's rows of the parts in turn, one index of them all laid end
    to end, the result's Rows of the summed lengths. NotImplemented where a part is anything else or the rows'
    shapes differ (each instance's cat then says what it does)."""
    pool, blocks = [], []  # (the parts' rows end to end; per part, each instance's (start in pool, length))
    at = 0
    for p, f in zip(parts, found):
        if f is not None:
            if len(f) != n or f.source.dim() - 1 != rank:
                return NotImplemented
            pool.append(packed(f))
            starts = [at + a for a in rows.offsets(f.lengths)]
            blocks.append((starts, f.lengths))
        elif type(p) in (torch.Tensor, nn.Parameter) and p.dim() == rank:
            pool.append(p)
            blocks.append(([at] * n, [p.shape[0]] * n))
        else:
            return NotImplemented
        at += pool[-1].shape[0]
    if not bt.same_kind(pool, 1):
        return NotImplemented
    starts = torch.tensor([b[0][k] for k in range(n) for b in blocks])  # (instance by instance, part by part)
    sizes = torch.tensor([b[1][k] for k in range(n) for b in blocks])
    lengths = sizes.view(n, -1).sum(1).tolist()
    before = sizes.cumsum(0) - sizes  # (where each block begins in the result)
    total = int(sizes.sum())
    index = torch.arange(total) + (starts - before).repeat_interleave(sizes, output_size=total)
    flat = torch.cat(pool)
    return rows.batch(n, rows.packed_rows(n, flat.index_select(0, index.to(flat.device)), lengths))


def method(n, name, seq, args, kwargs):
    """``xs.name(*args, **kwargs)`` of each instance's stretch ``seq``, once on the rows packed, where the method
    acts on each row alone; NotImplemented otherwise (an empty stretch but for an elementwise method)."""
    if seq.shortest == 0 and name not in _ELEMENTWISE_METHODS or not _plain_options(kwargs):
        return NotImplemented
    rank = seq.source.dim() - 1
    if name in _SHAPING_METHODS:
        return _reshaped(n, name, seq, args, kwargs)
    if name in _DIM_METHODS:
        if name == "unsqueeze":
            dim = _dim(args, kwargs, rank + 1)
        else:
            dim = _dim(args, kwargs, rank)
        if dim is None or dim == 0 or any(type(a) is Batch for a in args):
            return NotImplemented
        if name in ("squeeze", "unsqueeze") and not kwargs:  # (each row's shape: the source's rows alike)
            row = list(seq.source.shape[2:])  # (each row's dims: the instance's dim - 1)
            if name == "unsqueeze":
                row.insert(dim - 1, 1)
            elif row[dim - 1] == 1:
                del row[dim - 1]
            out = rows.rows_reshaped(n, seq, row)
            if out is not None:
                return out
        flat = packed(seq)
        return _rows_of(n, seq, getattr(flat, name)(*args, **kwargs))
    if name in ("mm", "matmul"):  # (``xs.mm(W)``: each row by the shared W)
        if len(args) != 1 or kwargs or type(args[0]) not in (torch.Tensor, nn.Parameter) or rank < 2 or \
                args[0].dim() not in (1, 2):
            return NotImplemented
        return _rows_of(n, seq, getattr(packed(seq), name)(args[0]))
    if name in ("norm", "cumsum"):
        if not _along_another_dim(name, args, kwargs, rank) or any(type(a) is Batch for a in args):
            return NotImplemented
        return _rows_of(n, seq, getattr(packed(seq), name)(*args, **kwargs))
    if name not in _ELEMENTWISE_METHODS:
        return NotImplemented
    values = _operands(n, seq, rank, args, name != "masked_fill")  # (its value a number or a 0-d tensor)
    if values is None:
        return NotImplemented
    return _rows_of(n, seq, getattr(packed(seq), name)(*values, **kwargs))


def _reshaped(n, name, seq, args, kwargs):
    """``xs.view(n, 1, -1)``, ``xs.reshape(-1, H)`` of each instance's stretch where the first size is each
    instance's length (its own ``n``, or -1 with the rest a row's size) and the rest reshape each row alone:
    once on the rows packed; NotImplemented for any other shape."""
    sizes = args[0] if len(args) == 1 and type(args[0]) in (tuple, list, torch.Size) else args
    if kwargs or not sizes or any(type(r) is not int for r in sizes[1:]) or list(sizes[1:]).count(-1) > 1:
        return NotImplemented
    first, rest = sizes[0], list(sizes[1:])
    if type(first) is Batch:
        try:
            lengths = [int(k) for k in bt.instance_ints(n, first)]
        except (TypeError, ValueError, RuntimeError):
            return NotImplemented
        if lengths != seq.lengths:
            return NotImplemented
    elif first != -1 and not (type(first) is int and seq.shortest == first == seq.longest):
        return NotImplemented
    if first == -1 and -1 in rest:
        return NotImplemented
    size = math.prod(seq.source.shape[2:])  # (a row's)
    known = math.prod(r for r in rest if r != -1)
    if known <= 0 or size % known:
        return NotImplemented
    rest = [size // known if r == -1 else r for r in rest]
    if math.prod(rest) != size:
        return NotImplemented
    out = rows.rows_reshaped(n, seq, rest, name)
    if out is None:  # (a view the source's memory does not allow: each row of the rows packed)
        flat = packed(seq)
        return _rows_of(n, seq, getattr(flat, name)(flat.shape[0], *rest))
    return out


def indexed(n, seq, index):
    """``xs[:, k]``, ``xs[:, None]``, ``xs[..., :h]`` of each instance's stretch: an index that keeps every row
    (a full slice of them first, or an ellipsis that covers them), once on the rows packed; NotImplemented for
    other indices."""
    rank = seq.source.dim() - 1
    if seq.shortest == 0 or not index or not all(type(i) in (int, slice, type(None)) or i is Ellipsis
                                                 for i in index):
        return NotImplemented
    if index[0] is Ellipsis:
        taken = sum(1 for i in index[1:] if i is not None)
        if taken >= rank or Ellipsis in index[1:]:
            return NotImplemented
    elif index[0] != slice(None):
        return NotImplemented
    return _rows_of(n, seq, packed(seq)[index])


def _rows_of(n, seq, out):
    """Each instance's stretch of ``out``, the op's result on the rows packed; NotImplemented where it did not
    keep them (each instance then runs its own: the op changes nothing, so running it again is safe)."""
    if type(out) is not torch.Tensor or out.dim() < 1 or out.shape[0] != sum(seq.lengths):
        return NotImplemented
    return from_packed(n, out, seq)


def _operands(n, seq, rank, args, broadcasts=True):
    """The arguments as the packed op takes them, or None: Rows of the same lengths and rank packed; a batched
    tensor of lower rank (or a leading 1) as each row's instance's value (where the op ``broadcasts`` its
    operands); shared values as they are, where they do not reach the rows' dim."""
    values = []
    for a in args:
        if type(a) is Batch:
            other = rows.of(a)
            if other is not None:
                if other.lengths != seq.lengths or other.source.dim() != seq.source.dim():
                    return None
                values.append(packed(other))
                continue
            t = bt.tensor_of(a) if broadcasts else None  # (each instance's own tensors of one shape: stacked)
            if t is None:
                return None
            shape = t.shape[1:]
            if not shape and t.dtype is not seq.source.dtype:
                return None  # (an instance's 0-d tensor gives way in type promotion; a row's value would not)
            if len(shape) == rank and shape[:1] == (1,):
                shape = shape[1:]
            elif len(shape) >= rank:
                return None
            each = t.reshape(n, *shape).index_select(0, seq.where(t.device)[0])  # (each row's instance's)
            values.append(each.view(each.shape[0], *[1] * (rank - 1 - len(shape)), *shape))
        elif isinstance(a, torch.Tensor):
            if a.dim() > rank or (a.dim() == rank and a.shape[0] != 1):
                return None
            values.append(a)
        else:
            values.append(a)
    return values


def _along_another_dim(fn, args, kwargs, rank):
    """Whether ``fn`` (``_ALONG_A_DIM``), given ``args`` after its input, acts along one int dim that is not the
    rows' (``F.normalize(xs, dim=-1)``, ``xs.norm(dim=1)``, ``xs.cumsum(1)``)."""
    position, default = _ALONG_A_DIM[fn]
    dim = kwargs["dim"] if "dim" in kwargs else args[position - 1] if len(args) >= position else default
    return type(dim) is int and -rank <= dim < rank and dim % rank != 0


def _dim(args, kwargs, rank):
    """The one int dim of a method's or a softmax's arguments (positional or ``dim=``), made non-negative
    against ``rank``; None where there is none, or others (a dtype, a tuple)."""
    if set(kwargs) - {"dim", "keepdim", "dtype"} or ("dim" in kwargs) == bool(args) or len(args) > 2:
        return None
    dim = kwargs["dim"] if "dim" in kwargs else args[0]
    if type(dim) is not int or not -rank <= dim < rank:
        return None
    return dim + rank if dim < 0 else dim
