"""A weight's gradient formed once per backward for all the rows a run multiplied it by (or looked up in it).

A level run's piece (``codegen.segments.Plain``) multiplies a few rows by the
same weight at every depth, and a loop's body at every step. Recorded op by op,
torch's backward forms that weight's gradient at every depth (``g_d^T x_d``, a
full out x in matrix from a few rows) and adds them up one by one. Here each
product is recorded as a ``_DeferredLinear`` whose backward gives the rows' and
the bias' gradients at once but only keeps ``(g_d, x_d)``; one ``_WeightGate``
per weight and run (``of_run``), which every product reads, runs after all of
them (autograd runs a node once every node reading its output has run) and
forms the weight's gradient as one matrix product over all the kept rows (Cavs'
lazy batching). An embedding lookup's own gradient is a whole table, mostly
zeros: a ``_DeferredEmbedding`` keeps its indices and output gradient, and its
table's gate adds them into one table once. Both backwards are themselves
differentiable, so ``create_graph=True`` still works.

Such a product of a few rows also runs faster with the weight laid out
transposed (in x out, contiguous) than as ``nn.Linear`` keeps it (out x in,
which ``F.linear`` reads through a transposed view): on CPU, 1.1 to 2 times as
fast for 4 to 64 rows (see ``SMALL_ROWS``). A run copies each weight it
multiplies so once, into a buffer its thread keeps for that weight (a fresh
allocation each run would cost more than the copy), and uses the copy for its
products without grad and for the forward of its deferred ones. The copy lives
for one run: a weight changed between runs, in place or through ``.data``
(which torch's version counter does not see), is copied again.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..dynamo import opaque
from ..ops.table import has_hooks


class LazyWeight:
    """One weight's products of one run: the gate they all read, and the rows kept for it."""

    __slots__ = ("weight", "gate", "kept", "flipped")

    def __init__(self):
        self.weight = None
        self.gate = None
        self.kept = {}  # per backward pass (autograd's graph task): ([g_d], [x_d])
        self.flipped = None  # (weight, its version, its transposed copy) for this run's products

    def product(self, x, weight, bias):
        """``F.linear(x, weight, bias)`` for a 2-d ``x``, recording nothing for autograd: by the weight's
        transposed copy where the rows are few, on CPU (where it was measured)."""
        if x.shape[0] > SMALL_ROWS or not (x.is_cpu and weight.is_cpu):
            return F.linear(x, weight, bias)
        flipped = self.flipped
        if flipped is None or flipped[0] is not weight or flipped[1] != weight._version:
            flipped = self.flipped = (weight, weight._version, _transposed(weight))
        if bias is None:
            return x.mm(flipped[2])
        if bias.dtype is not x.dtype or x.dtype not in _WIDE:  # (addmm refuses the one as ``F.linear`` does,
            return torch.addmm(bias, x, flipped[2])        # and adds the bias before rounding to half floats)
        return x.mm(flipped[2]).add_(bias)  # (2-4% faster than ``addmm``, which first copies the bias into every row)

    def keep(self, g, x):
        """Keep a product's output gradient and input rows (a lookup's indices) for the backward pass running."""
        grads, inputs = self.kept.setdefault(torch._C._current_graph_task_id(), ([], []))
        grads.append(g)
        inputs.append(x)

    def linear(self, x, weight, bias):
        """``F.linear(x, weight, bias)`` for a 2-d ``x``, its weight gradient deferred to the gate."""
        return _DeferredLinear.apply(x, self.gate_of(weight), bias, self)

    def gate_of(self, weight):
        if self.gate is None or self.weight is not weight:
            self.weight = weight
            self.gate = _WeightGate.apply(weight, self)
        return self.gate

    def weight_grad(self, grads, inputs):
        """The weight's gradient from the kept rows: output gradients and inputs, row for row."""
        g = grads[0] if len(grads) == 1 else torch.cat(grads)
        x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        return g.t().mm(x)


class LazyEmbedding(LazyWeight):
    """One embedding table's lookups of one run: each lookup keeps its indices and output gradient, and the
    gate adds them into one table-sized gradient (a lookup's own gradient is a full table, mostly zeros)."""

    __slots__ = ()

    def lookup(self, indices, weight):
        return _DeferredEmbedding.apply(indices, self.gate_of(weight), self)

    def weight_grad(self, grads, inputs):
        width = self.weight.shape[1]
        g = torch.cat([x.reshape(-1, width) for x in grads])
        i = torch.cat([i.reshape(-1) for i in inputs])
        return self.weight.new_zeros(self.weight.shape, dtype=g.dtype).index_add_(0, i, g)


class _WeightGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, lazy):
        ctx.lazy = lazy
        return weight.new_zeros(())

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(ctx, _):
        # (a pass that did not reach the gate, autograd.grad of other inputs, leaves its rows behind: each
        # pass keeps its own)
        grads, inputs = ctx.lazy.kept.pop(torch._C._current_graph_task_id(), ((), ()))
        if not grads:
            return None, None
        return ctx.lazy.weight_grad(grads, inputs), None


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, bias, lazy):
        # (the weight saved too: changed in place before the backward, it is refused as torch refuses it)
        ctx.save_for_backward(x, lazy.weight)
        ctx.lazy = lazy
        ctx.has_bias = bias is not None
        return lazy.product(x, lazy.weight, bias)

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        ctx.lazy.keep(g, x)
        grad_x = g.mm(weight) if ctx.needs_input_grad[0] else None
        grad_bias = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class _DeferredEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, gate, lazy):
        ctx.save_for_backward(indices, lazy.weight)  # (the weight: changed in place before the backward, refused)
        ctx.lazy = lazy
        return F.embedding(indices, lazy.weight)

    @staticmethod
    @opaque  # under torch.compile: run as without it, not traced
    def backward(ctx, g):
        indices, _ = ctx.saved_tensors
        ctx.lazy.keep(g, indices)
        return None, None, None


# Up to this many rows a product's own weight gradient (a full out x in matrix, added to the others) costs
# more than keeping its rows for the gate; with more, forming it at once is as fast (measured on the
# examples' Tree-LSTM: 5% faster training at minibatch 25, 1% slower at 256 with every product deferred).
FEW_ROWS = 64

# Up to this many rows a product by the weight's transposed copy is faster than ``F.linear`` (measured on a
# 2-core CPU, one thread, for weights of 300x750, 150x600, 64x256 and 512x2048: 1.1-2.4x for 4-64 rows,
# 1.0-1.1x at 96-128, even at 256; its copy, once a run, costs about one product of 25 rows).
SMALL_ROWS = 128


def linear(x, weight, bias, lazy):
    """A plain piece's Linear: deferred weight gradient where autograd records a product of a few rows by a
    weight that requires grad; by the weight's transposed copy where autograd records nothing and the rows
    are few; ``F.linear`` otherwise."""
    if x.dim() == 2:
        if not torch.is_grad_enabled():
            return lazy.product(x, weight, bias)
        if x.shape[0] <= FEW_ROWS and weight.requires_grad and not torch.is_autocast_enabled(x.device.type):
            return lazy.linear(x, weight, bias)  # (not under autocast: its backward would mix the dtypes)
    return F.linear(x, weight, bias)


def embedding(indices, weight, lazy):
    """An embedding lookup with no options: its table's gradient deferred to the run's gate where autograd
    records it, ``F.embedding`` otherwise."""
    if torch.is_grad_enabled() and weight.requires_grad and not (
            weight.is_cuda and torch.are_deterministic_algorithms_enabled()):  # (index_add_ on CUDA: atomics)
        return lazy.lookup(indices, weight)
    return F.embedding(indices, weight)


def lookup(module, indices):
    """``module(indices)`` of an ``nn.Embedding``: with no options, hooks or forward of its own, its table's
    gradient deferred to the gate of the run going on."""
    if module.padding_idx is None and module.max_norm is None and not module.scale_grad_by_freq and \
            not module.sparse and _own_call(module):
        return embedding(indices, module.weight, of_run(module.weight, LazyEmbedding))
    return module(indices)


def cell(module, x, state=None):
    """``module(x, state)`` of an ``nn.RNNCell``, ``LSTMCell`` or ``GRUCell`` on a matrix of rows: where autograd
    records its two products and they are of few rows, written out as torch's cells compute them, the products'
    weight gradients deferred to the run's gates (a loop's steps form each once); the module's own call otherwise
    (without grad the written-out cell measured no faster)."""
    kind = type(module)
    if not _writes_out(module, kind, x, state):
        return module(x) if state is None else module(x, state)
    if state is None:
        zeros = x.new_zeros(x.shape[0], module.hidden_size)
        state = (zeros, zeros) if kind is nn.LSTMCell else zeros
    gx = linear(x, module.weight_ih, module.bias_ih, of_run(module.weight_ih))
    return step(module, gx, state, of_run(module.weight_hh))


def step(module, gx, state, lazy):
    """One step of cell ``module`` from the input's product ``gx`` (with its bias) and the state, as torch's
    cells compute it; the state's product's weight gradient deferred to ``lazy``'s gate where its rows are few."""
    kind = type(module)
    h = state[0] if kind is nn.LSTMCell else state
    gh = linear(h, module.weight_hh, module.bias_hh, lazy)
    if kind is nn.LSTMCell:
        i, f, g, o = (gx + gh).chunk(4, 1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if kind is nn.GRUCell:
        xr, xz, xn = gx.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + torch.sigmoid(xr + hr) * hn)
        return n + z * (h - n)  # ((1 - z) n + z h, as torch writes it)
    return torch.tanh(gx + gh) if module.nonlinearity == "tanh" else torch.relu(gx + gh)


def packed_steps(module, data, batch_sizes, state, outputs=False):
    """Cell ``module`` stepped over packed rows ``data`` (step j's rows are the first ``batch_sizes[j]``
    sequences', longest first) from ``state`` (a row per sequence, in that order): each sequence's final state,
    and with ``outputs`` every step's (h), packed as ``data`` is (else None).
    Every step's input product is one product, cut into the steps' rows by one split (whose backward is one
    concatenation, where torch's own packed RNN narrows it step by step and adds up a full-size gradient per
    step), and the state's products share one weight gradient (``step``)."""
    chunks = F.linear(data, module.weight_ih, module.bias_ih).split(batch_sizes)
    lazy = of_run(module.weight_hh)
    pair = type(module) is nn.LSTMCell
    parts = list(state) if pair else [state]
    finished = []  # (the rows of the sequences that ended, the last first)
    made = [] if outputs else None
    for gx, rows in zip(chunks, batch_sizes):
        if rows < parts[0].shape[0]:
            finished.append([p[rows:] for p in parts])
            parts = [p[:rows] for p in parts]
        out = step(module, gx, tuple(parts) if pair else parts[0], lazy)
        parts = list(out) if pair else [out]
        if outputs:
            made.append(parts[0])
    finished.append(parts)
    ends = [torch.cat([f[k] for f in reversed(finished)]) if len(finished) > 1 else parts[k]
            for k in range(len(parts))]
    return (tuple(ends) if pair else ends[0]), (torch.cat(made) if outputs else None)


_CELL_OF = {nn.LSTM: nn.LSTMCell, nn.GRU: nn.GRUCell, nn.RNN: nn.RNNCell}
_cells = weakref.WeakKeyDictionary()  # an RNN module -> the cell of its parameters (``_cell_of``)


def module_steps(module, packed, states):
    """(the outputs, a PackedSequence, and the final states as the module returns them) of a one-layer,
    one-direction ``nn.LSTM``/``GRU``/``RNN`` with biases over ``packed``, with grad: its steps written out over
    the packed rows as a cell of its parameters (``packed_steps``, faster to train than torch's packed RNN); None
    for any other module or run (the module then runs itself)."""
    kind = _CELL_OF.get(type(module))
    data = packed.data
    if kind is None or module.num_layers != 1 or module.bidirectional or not module.bias or \
            getattr(module, "proj_size", 0) or not torch.is_grad_enabled() or \
            torch.is_autocast_enabled(data.device.type) or data.dim() != 2 or \
            data.dtype != module.weight_ih_l0.dtype or data.device != module.weight_ih_l0.device:
        return None
    cell = _cell_of(module, kind)
    if cell is None:
        return None
    order, back = packed.sorted_indices, packed.unsorted_indices
    n, hidden = int(packed.batch_sizes[0]), module.hidden_size  # (every sequence takes the first step)
    if states is None:
        zeros = data.new_zeros(n, hidden)
        hx = (zeros, zeros) if kind is nn.LSTMCell else zeros
    else:
        given = states if kind is nn.LSTMCell else (states,)
        if any(p.shape != (1, n, hidden) or p.dtype != data.dtype or p.device != data.device for p in given):
            return None  # (the module raises as torch does)
        parts = [p[0] if order is None else p[0].index_select(0, order) for p in given]
        hx = tuple(parts) if kind is nn.LSTMCell else parts[0]
    ends, steps = packed_steps(cell, data, packed.batch_sizes.tolist(), hx, True)
    ends = [e if back is None else e.index_select(0, back) for e in (ends if kind is nn.LSTMCell else (ends,))]
    finals = tuple(e.unsqueeze(0) for e in ends)
    out = nn.utils.rnn.PackedSequence(steps, packed.batch_sizes, order, back)
    return out, (finals if kind is nn.LSTMCell else finals[0])


def _cell_of(module, kind):
    """A cell of ``kind`` holding ``module``'s layer-0 parameters (the very Parameters: their gradients are
    the module's), kept while they are the module's; None where one is not a Parameter (a parametrization's
    tensor, computed at each read)."""
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    if not all(type(getattr(module, k + "_l0")) is nn.Parameter for k in names):
        return None
    cell = _cells.get(module)
    if cell is None or any(getattr(cell, k) is not getattr(module, k + "_l0") for k in names):
        cell = kind(module.input_size, module.hidden_size, bias=True, device="meta",
                    **({"nonlinearity": module.nonlinearity} if kind is nn.RNNCell else {}))
        for k in names:
            setattr(cell, k, getattr(module, k + "_l0"))
        _cells[module] = cell
    return cell


def _own_call(module):
    """Whether calling ``module`` runs its class's forward and nothing else (no hooks, no forward of its own)."""
    return not has_hooks(module) and "forward" not in module.__dict__


def _writes_out(module, kind, x, state):
    """Whether ``cell`` writes the cell out: with grad, few rows, a bias, no autocast, and inputs the module
    would take as they are (anything else goes to it, to run or refuse as torch does)."""
    if not (torch.is_grad_enabled() and module.weight_ih.requires_grad and x.dim() == 2 and x.shape[0] <= FEW_ROWS
            and module.bias and not torch.is_autocast_enabled(x.device.type) and _own_call(module)
            and x.shape[1] == module.input_size and x.dtype == module.weight_ih.dtype):
        return False
    if kind is nn.RNNCell and module.nonlinearity not in ("tanh", "relu"):
        return False
    if state is None:
        return True
    parts = state if kind is nn.LSTMCell else (state,)
    if kind is nn.LSTMCell and (type(state) is not tuple or len(state) != 2):
        return False
    return all(isinstance(p, torch.Tensor) and p.shape == (x.shape[0], module.hidden_size) and p.dtype == x.dtype
               for p in parts)


class _Runs(threading.local):
    """Per thread: the lazy weights of the batched run going on (``weights``: (id of the weight, kind) ->
    LazyWeight), or None outside one (set by ``runtime.agenda``)."""

    def __init__(self):
        self.weights = None


runs = _Runs()


def of_run(weight, kind=LazyWeight):
    """The ``kind`` of lazy weight the run going on keeps for ``weight`` (one gate for all its products in
    the run: a loop's steps, a level run's depths), or a new one outside a run."""
    weights = runs.weights
    if weights is None:
        return kind()
    key = (id(weight), kind)
    found = weights.get(key)
    if found is None or (found.weight is not None and found.weight is not weight):  # (an id used again)
        found = weights[key] = kind()
    return found


_buffers = threading.local()  # .pool: id(weight) -> the buffer its transposed copies are made in
MAX_BUFFERS = 64  # (a thread's buffers past this many are dropped; weights that die drop theirs at once)


def _transposed(weight):
    """``weight.t()`` copied into the buffer this thread keeps for ``weight`` (a normal tensor, also inside
    inference mode, so that a run with grad may use it next)."""
    pool = getattr(_buffers, "pool", None)
    if pool is None:
        pool = _buffers.pool = {}
    key = id(weight)
    buffer = pool.get(key)
    shape = (weight.shape[1], weight.shape[0])
    if buffer is None or buffer.shape != shape or buffer.dtype != weight.dtype or buffer.device != weight.device:
        if len(pool) >= MAX_BUFFERS:
            pool.clear()
        with torch.inference_mode(False):
            buffer = torch.empty(shape, dtype=weight.dtype, device=weight.device)
        pool[key] = buffer
        weakref.finalize(weight, pool.pop, key, None)
    # (not numpy's copy through ``weight.numpy()``, no faster a training step: that marks the weight's storage
    # not resizable for good, and FSDP frees an unsharded parameter by resizing its storage to 0)
    with torch.no_grad():
        buffer.copy_(weight.t())
    return buffer


_WIDE = (torch.float32, torch.float64)
