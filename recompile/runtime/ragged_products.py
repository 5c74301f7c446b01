"""Products of tensors one of which holds each instance's own length along a dim, batched: attention over
each sequence's own encoder states.

``scores = enc @ h.t()``, ``ctx = a.t() @ enc``, ``torch.mv(enc, q)``, ``torch.bmm(a.unsqueeze(0), ...)``,
``torch.einsum("ld,kd->lk", enc, h)``, where ``enc`` is each instance's stretch of rows (``rows.Rows``) or such a
stretch with its dim moved (``padded.Padded``) and the other operand each instance's own tensor, or a stretch of
the same lengths. ``row_wise`` runs the forms that act on each row alone without padding; these are the rest.
Each operand of instances' own lengths is padded to the longest with zeros past each end, and the product runs
once as one ``torch.einsum`` with a subscript for the instances: a dim of those lengths that the product sums
over adds zeros there (nothing, nor to a gradient); one the result keeps gives a result of those lengths again,
zeros past each end. Operands whose lengths lie along two different subscripts, or differ, are left to each
instance's own call.
"""

from __future__ import annotations

import operator

import torch

from . import batch as bt
from . import padded, rows
from .batch import Batch

# per instance's ranks: the einsum of each product
_MATMUL = {(2, 2): ("ij", "jk", "ik"), (2, 1): ("ij", "j", "i"), (1, 2): ("j", "jk", "k"), (1, 1): ("j", "j", ""),
           (3, 3): ("bij", "bjk", "bik")}
_RANKS = {torch.mm: {(2, 2)}, torch.bmm: {(3, 3)}, torch.mv: {(2, 1)}, torch.matmul: set(_MATMUL),
          operator.matmul: set(_MATMUL)}
PRODUCTS = frozenset(_RANKS)
METHODS = {"mm": torch.mm, "bmm": torch.bmm, "mv": torch.mv, "matmul": torch.matmul, "__matmul__": torch.matmul}


def holds_lengths(args):
    """Whether an argument holds each instance's own length along a dim (``Rows`` or ``Padded``)."""
    return any(type(a) is Batch and (rows.of(a) is not None or padded.of(a) is not None) for a in args)


def product(n, fn, args, kwargs):
    """``fn(a, b)`` (``@``, ``mm``, ``bmm``, ``mv``, ``matmul``) as one einsum over the instances, or
    NotImplemented."""
    if kwargs or len(args) != 2:
        return NotImplemented
    operands = [_operand(a) for a in args]
    if None in operands:
        return NotImplemented
    ranks = tuple(t.dim() - (1 if batched else 0) for t, _, _, batched in operands)
    if ranks not in _RANKS.get(fn, ()):
        return NotImplemented  # (torch's own error, each instance's, where the ranks do not fit)
    first, second, out = _MATMUL[ranks]
    # (a product's sizes meet exactly, where an einsum would broadcast a size of 1: eager's error, each instance's)
    return _run(n, [first, second], out, operands, exact=True)


def einsum(n, equation, args):
    """``torch.einsum(equation, *args)`` as one einsum over the instances, or NotImplemented: an equation of
    letters with ``->``, each operand's subscripts its own, no ``...``."""
    if type(equation) is not str or "->" not in equation or "." in equation:
        return NotImplemented
    inputs, out = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(args) or not all(s.isalpha() and len(set(s)) == len(s) for s in (*subscripts, out)):
        return NotImplemented
    operands = [_operand(a) for a in args]
    if None in operands or any(t.dim() - batched != len(s) for (t, _, _, batched), s in zip(operands, subscripts)):
        return NotImplemented
    return _run(n, subscripts, out, operands, exact=False)


def _operand(a):
    """(tensor, dim of the instance's own lengths or None, the lengths, whether batched: its dim 0 the
    instances'), zeros past each end; None for what is no tensor (nor a batch of tensors of one shape)."""
    if type(a) is Batch:
        found = padded.of(a)
        if found is not None:
            return found.zeros_past_ends(), found.dim, found.lengths, True
        seq = rows.of(a)
        if seq is not None:
            t, dim, lengths, _ = padded.from_rows(seq)
            return t, dim, lengths, True
        t = bt.tensor_of(a)
        return None if t is None else (t, None, None, True)
    if type(a) in bt.PLAIN_TENSORS:
        return a, None, None, False
    return None


def _run(n, subscripts, out, operands, exact):
    letters = {s[dim] for s, (_, dim, _, _) in zip(subscripts, operands) if dim is not None}
    lengths = {tuple(m) for _, dim, m, _ in operands if dim is not None}
    tensors = [t for t, _, _, _ in operands]
    if len(letters) != 1 or len(lengths) != 1 or len({t.dtype for t in tensors}) != 1 or \
            len({t.device for t in tensors}) != 1:
        return NotImplemented  # (lengths along two subscripts; dtypes eager refuses to mix)
    letter, lengths = letters.pop(), list(lengths.pop())
    sizes = {}  # subscript -> the sizes the operands have along it
    for s, (t, dim, _, batched) in zip(subscripts, operands):
        if dim is None and letter in s:
            return NotImplemented  # (an operand of one size along the lengths' subscript: eager's own error)
        for c, size in zip(s, t.shape[1:] if batched else t.shape):
            sizes.setdefault(c, set()).add(size)
    if not all(len(found) == 1 or not exact and len(found - {1}) == 1 for found in sizes.values()):
        return NotImplemented  # (sizes that do not meet: eager's own error, each instance's)
    instances = next(c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA"
                     if c not in "".join(subscripts) + out)
    equation = ",".join(instances + s if batched else s for s, (_, _, _, batched) in zip(subscripts, operands))
    made = torch.einsum(f"{equation}->{instances}{out}", *tensors)
    if letter in out:
        return padded.result(n, made, out.index(letter), lengths, zeroed=True, own=True)
    return bt.from_tensor(made)
