"""Unit tests of runtime/batch_rules.call and runtime/batch.py.

For each op, ``batch_rules.call(n, fn, args, kwargs)`` on Batch-wrapped
inputs is compared with the op run on each instance's values. Every batched
input is tried in three forms: one stacked tensor (``Batch(n, tensor=...)``),
a list of per-instance values (``batch.from_items``) and the pieces of a join
(what a Cond leaves: ``batch.join`` of two sub-batches). For the tensor form,
ops that have a batch rule (or that torch.func.vmap batches) must not run per
instance (``batch_rules.counters.per_instance`` stays empty). The readers of
a result (``instance``, ``items_of``, ``tensor_of``, ``stack_output``) must
agree with each other. Then the batch plumbing: ``concat``, ``part``,
``take``, ``join`` round trips.
"""

from __future__ import annotations

import copy
import operator
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recompile
from recompile.runtime import batch as bt
from recompile.runtime import batch_rules as br
from recompile.runtime.sharing import state as sharing_state
from recompile import config, intrinsics
from recompile.runtime.batch import Batch
from test_segments import switched

F64 = torch.float64
N = 4
TOL = 1e-12


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def assert_same(got, want, path="result"):
    """Equal values of equal Python types; tensors of equal shape and dtype (values within TOL)."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor, f"{path}: {type(got).__name__} instead of a tensor"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        if want.dtype.is_floating_point:
            assert torch.allclose(got, want, rtol=0, atol=TOL, equal_nan=True), f"{path}: {got} != {want}"
        else:
            assert torch.equal(got, want), f"{path}: {got} != {want}"
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{k}]")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def rand(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def randint(high, *shape, seed=0):
    return torch.randint(high, shape, generator=torch.Generator().manual_seed(seed))


def as_tensor_form(stacked):
    return Batch(stacked.shape[0], tensor=stacked.clone())


def as_items_form(stacked):
    return bt.from_items([t.clone() for t in stacked.unbind(0)])


def as_pieces_form(stacked):
    """The batch as a Cond's join leaves it: even instances from one side, odd ones from the other."""
    n = stacked.shape[0]
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    whole = Batch(n, tensor=stacked.clone())
    sides = [(bt.take(whole, torch.tensor(p), p), p) for p in (evens, odds)]
    return bt.join(n, sides)


FORMS = {"tensor": as_tensor_form, "items": as_items_form, "pieces": as_pieces_form}


def instances(value, n):
    return [bt.instance(value, k) for k in range(n)]


def reset_counters():
    br.counters.per_instance = {}


def check_readers(out, want, n):
    """``out`` (the result of call) against the per-instance results ``want``, through every reader."""
    if type(out) is not Batch:
        # shared by every instance: each instance's result must equal it
        for k in range(n):
            assert_same(out, want[k], f"shared result vs instance {k}")
        return
    assert out.n == n
    for k in range(n):
        assert_same(bt.instance(out, k), want[k], f"instance {k}")
    for k, item in enumerate(bt.items_of(out)):
        assert_same(item, want[k], f"items_of[{k}]")
    if all(type(w) is torch.Tensor for w in want) and len({(w.shape, w.dtype) for w in want}) == 1:
        stacked = torch.stack(want)
        assert_same(bt.tensor_of(out), stacked, "tensor_of")
        assert_same(bt.stack_output(out, n), stacked, "stack_output")
    elif all(type(w) in (tuple, list) for w in want) and all(type(x) is torch.Tensor for w in want for x in w):
        stacked = type(want[0])(torch.stack([w[j] for w in want]) for j in range(len(want[0])))
        assert_same(tuple(bt.stack_output(out, n)), tuple(stacked), "stack_output")


# ---------------------------------------------------------------------------
# the op table: name -> (make(wrap) -> (fn, args, kwargs), batched without per-instance runs?)
# ``wrap`` turns a stacked tensor (dim 0 the instance) into a Batch of the form under test.
# ---------------------------------------------------------------------------

LINEAR = nn.Linear(5, 3).double()
EMBED = nn.Embedding(10, 4).double()
TABLE = rand(10, 3, seed=99)


def method(wrap_value, name):
    """``x.name`` of a batched x, read as generated code reads it."""
    return br.call(N, getattr, (wrap_value, name))


def lst(*parts):
    return bt.from_struct(list, list(parts), N)


def tup(*parts):
    return bt.from_struct(tuple, list(parts), N)


BILINEAR = nn.Bilinear(3, 2, 4).double()
BAG, BAG_SUM = (nn.EmbeddingBag(10, 3, mode=mode).double() for mode in ("mean", "sum"))
LSTM_CELL, GRU_CELL, RNN_CELL = (cell(3, 5).double() for cell in (nn.LSTMCell, nn.GRUCell, nn.RNNCell))
torch.manual_seed(0)
SEQUENTIAL = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4),
                           nn.Sequential(nn.Linear(4, 2), nn.ReLU())).double()


OPS = {
    # elementwise, with broadcasting between per-instance ranks and shared operands
    "add_same_rank": lambda w: (operator.add, (w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))), {}),
    "add_rank2_rank1": lambda w: (operator.add, (w(rand(N, 2, 3, seed=1)), w(rand(N, 3, seed=2))), {}),
    "mul_rank1_rank0": lambda w: (operator.mul, (w(rand(N, 3, seed=1)), w(rand(N, seed=2))), {}),
    "mul_rank0_rank2": lambda w: (operator.mul, (w(rand(N, seed=2)), w(rand(N, 2, 3, seed=1))), {}),
    "sub_shared_rank2_first": lambda w: (operator.sub, (rand(2, 3, seed=3), w(rand(N, 3, seed=1))), {}),
    "truediv_shared_scalar": lambda w: (operator.truediv, (w(rand(N, 3, seed=1)), 3.0), {}),
    "pow_int": lambda w: (operator.pow, (w(rand(N, 3, seed=1)), 2), {}),
    "gt_number": lambda w: (operator.gt, (w(rand(N, seed=1)), 0.0), {}),
    "torch_where": lambda w: (torch.where, (w(rand(N, 3, seed=1) > 0), w(rand(N, 3, seed=2)), 0.0), {}),
    "tanh": lambda w: (torch.tanh, (w(rand(N, 3, seed=1)),), {}),
    "sigmoid_module": lambda w: (nn.Sigmoid(), (w(rand(N, 3, seed=1)),), {}),
    "torch_add_alpha": lambda w: (torch.add, (w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))), {"alpha": 2}),
    "maximum": lambda w: (torch.maximum, (w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))), {}),
    # joining and splitting along feature dims
    "cat_last": lambda w: (torch.cat, (lst(w(rand(N, 3, seed=1)), w(rand(N, 2, seed=2))),), {"dim": -1}),
    "cat_dim0_positional": lambda w: (torch.cat, (lst(w(rand(N, 3, seed=1)), w(rand(N, 2, seed=2))), 0), {}),
    "cat_rank2_dim1": lambda w: (torch.cat, (lst(w(rand(N, 2, 3, seed=1)), w(rand(N, 2, 4, seed=2))), 1), {}),
    "cat_with_shared_part": lambda w: (torch.cat, (lst(w(rand(N, 3, seed=1)), rand(2, seed=2)),), {"dim": 0}),
    "stack_default": lambda w: (torch.stack, (lst(w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))),), {}),
    "stack_dim_last": lambda w: (torch.stack, (lst(w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))),), {"dim": -1}),
    "cat_tensors_keyword": lambda w: (torch.cat, (), {"tensors": lst(w(rand(N, 3, seed=1)), w(rand(N, 2, seed=2))),
                                                      "dim": -1}),
    "stack_tensors_keyword": lambda w: (torch.stack, (), {"tensors": lst(w(rand(N, 3, seed=1)),
                                                                         w(rand(N, 3, seed=2)))}),
    "chunk_last": lambda w: (torch.chunk, (w(rand(N, 6, seed=1)), 3), {"dim": -1}),
    "chunk_default_dim": lambda w: (torch.chunk, (w(rand(N, 6, seed=1)), 2), {}),
    "chunk_rank2_dim1": lambda w: (torch.chunk, (w(rand(N, 2, 6, seed=1)), 2, 1), {}),
    "split_size": lambda w: (torch.split, (w(rand(N, 6, seed=1)), 4), {}),
    "split_sizes_last": lambda w: (torch.split, (w(rand(N, 2, 6, seed=1)), [1, 5]), {"dim": -1}),
    # linear layers, embeddings
    "nn_linear": lambda w: (LINEAR, (w(rand(N, 5, seed=1)),), {}),
    "nn_linear_rank2": lambda w: (LINEAR, (w(rand(N, 2, 5, seed=1)),), {}),
    "F_linear": lambda w: (F.linear, (w(rand(N, 5, seed=1)), LINEAR.weight, LINEAR.bias), {}),
    "F_linear_no_bias": lambda w: (F.linear, (w(rand(N, 5, seed=1)), LINEAR.weight), {}),
    "nn_linear_input_keyword": lambda w: (LINEAR, (), {"input": w(rand(N, 5, seed=1))}),
    "F_linear_keywords": lambda w: (F.linear, (), {"input": w(rand(N, 5, seed=1)), "weight": LINEAR.weight,
                                                   "bias": LINEAR.bias}),
    "nn_embedding_scalar_ids": lambda w: (EMBED, (w(randint(10, N, seed=1)),), {}),
    "nn_embedding_vector_ids": lambda w: (EMBED, (w(randint(10, N, 3, seed=1)),), {}),
    "F_embedding": lambda w: (F.embedding, (w(randint(10, N, seed=1)), EMBED.weight), {}),
    "F_embedding_keywords": lambda w: (F.embedding, (), {"input": w(randint(10, N, seed=1)), "weight": EMBED.weight}),
    # indexing
    "gather_shared_table": lambda w: (operator.getitem, (TABLE, w(randint(10, N, seed=2))), {}),
    "gather_shared_vector": lambda w: (operator.getitem, (torch.arange(10) * 3, w(randint(10, N, seed=2))), {}),
    "batched_index_int": lambda w: (operator.getitem, (w(rand(N, 2, 3, seed=1)), 1), {}),
    "batched_index_negative": lambda w: (operator.getitem, (w(rand(N, 3, seed=1)), -1), {}),
    "batched_index_slice": lambda w: (operator.getitem, (w(rand(N, 4, 3, seed=1)), slice(1, 3)), {}),
    "batched_index_tuple": lambda w: (operator.getitem, (w(rand(N, 2, 3, seed=1)), (slice(None), 2)), {}),
    "batched_index_none_ellipsis": lambda w: (operator.getitem, (w(rand(N, 2, 3, seed=1)), (None, Ellipsis, 0)),
                                              {}),
    # reductions
    "torch_sum": lambda w: (torch.sum, (w(rand(N, 2, 3, seed=1)),), {}),
    "torch_sum_rank1": lambda w: (torch.sum, (w(rand(N, 3, seed=1)),), {}),
    "torch_sum_dim": lambda w: (torch.sum, (w(rand(N, 2, 3, seed=1)), 1), {}),
    "torch_sum_dim_keepdim": lambda w: (torch.sum, (w(rand(N, 2, 3, seed=1)),), {"dim": 0, "keepdim": True}),
    "torch_mean": lambda w: (torch.mean, (w(rand(N, 2, 3, seed=1)),), {}),
    "torch_mean_dim_neg": lambda w: (torch.mean, (w(rand(N, 2, 3, seed=1)),), {"dim": -1}),
    "torch_mean_dims": lambda w: (torch.mean, (w(rand(N, 2, 3, seed=1)), (0, 1)), {}),
    "method_sum": lambda w: (method(w(rand(N, 2, 3, seed=1)), "sum"), (), {}),
    "method_sum_dim": lambda w: (method(w(rand(N, 2, 3, seed=1)), "sum"), (1,), {}),
    "method_mean_dim_kw": lambda w: (method(w(rand(N, 2, 3, seed=1)), "mean"), (), {"dim": 0}),
    # softmax
    "softmax": lambda w: (torch.softmax, (w(rand(N, 3, seed=1)), -1), {}),
    "softmax_dim0": lambda w: (torch.softmax, (w(rand(N, 2, 3, seed=1)), 0), {}),
    "F_softmax_kw": lambda w: (F.softmax, (w(rand(N, 2, 3, seed=1)),), {"dim": 1}),
    "F_log_softmax": lambda w: (F.log_softmax, (w(rand(N, 2, 3, seed=1)),), {"dim": -1}),
    "method_log_softmax": lambda w: (method(w(rand(N, 2, 3, seed=1)), "log_softmax"), (-1,), {}),
    # shape methods and attributes
    "unsqueeze_method": lambda w: (method(w(rand(N, 3, seed=1)), "unsqueeze"), (0,), {}),
    "unsqueeze_method_neg": lambda w: (method(w(rand(N, 3, seed=1)), "unsqueeze"), (-1,), {}),
    "torch_unsqueeze": lambda w: (torch.unsqueeze, (w(rand(N, 3, seed=1)), 0), {}),
    "view": lambda w: (method(w(rand(N, 2, 3, seed=1)), "view"), (6,), {}),
    "view_minus_one": lambda w: (method(w(rand(N, 2, 3, seed=1)), "view"), (-1, 2), {}),
    "reshape_tuple": lambda w: (method(w(rand(N, 2, 3, seed=1)), "reshape"), ((3, 2),), {}),
    "size": lambda w: (method(w(rand(N, 2, 3, seed=1)), "size"), (), {}),
    "size_dim": lambda w: (method(w(rand(N, 2, 3, seed=1)), "size"), (-1,), {}),
    "dim": lambda w: (method(w(rand(N, 2, 3, seed=1)), "dim"), (), {}),
    "getattr_shape": lambda w: (getattr, (w(rand(N, 2, 3, seed=1)), "shape"), {}),
    "getattr_ndim": lambda w: (getattr, (w(rand(N, 2, 3, seed=1)), "ndim"), {}),
    "getattr_dtype": lambda w: (getattr, (w(rand(N, 2, 3, seed=1)), "dtype"), {}),
    "getattr_device": lambda w: (getattr, (w(rand(N, 2, 3, seed=1)), "device"), {}),
    "tanh_method": lambda w: (method(w(rand(N, 3, seed=1)), "tanh"), (), {}),
    "F_sigmoid": lambda w: (F.sigmoid, (w(rand(N, 3, seed=1)),), {}),
    "F_tanh": lambda w: (F.tanh, (w(rand(N, 2, 3, seed=1)),), {}),
    # each Tensor method taking a dim, and each torch function filed with a dim rule (where its dim is)
    **{f"method_{name}": (lambda name, args: lambda w: (method(w(rand(N, 2, 4, seed=1)), name), args, {}))(name, args)
       for name, args in (("chunk", (2, -1)), ("split", (2, 1)), ("unbind", (1,)), ("max", (0,)),
                          ("argmax", (-1,)), ("softmax", (0,)), ("squeeze", (0,)), ("mean", ()))},
    "torch_split_dim": lambda w: (torch.split, (w(rand(N, 2, 4, seed=1)), 2, -1), {}),
    "torch_unbind_dim": lambda w: (torch.unbind, (w(rand(N, 2, 4, seed=1)), 1), {}),
    "torch_max_dim": lambda w: (torch.max, (w(rand(N, 2, 4, seed=1)), 0), {}),
    "torch_argmax_dim": lambda w: (torch.argmax, (w(rand(N, 2, 4, seed=1)), -1), {}),
    "torch_logsumexp_dim": lambda w: (torch.logsumexp, (w(rand(N, 2, 4, seed=1)), 1), {}),
    "torch_norm_dim": lambda w: (torch.norm, (w(rand(N, 2, 4, seed=1)), 2, 0), {}),
    "torch_log_softmax_dim": lambda w: (torch.log_softmax, (w(rand(N, 2, 4, seed=1)), 0), {}),
    # recurrent cells: an instance's input a vector or a matrix of rows; its state batched, shared or none
    "lstm_cell": lambda w: (LSTM_CELL, (w(rand(N, 3, seed=1)), tup(w(rand(N, 5, seed=2)), w(rand(N, 5, seed=3)))),
                            {}),
    "lstm_cell_rows_shared_state": lambda w: (LSTM_CELL, (w(rand(N, 2, 3, seed=1)),
                                                          (rand(2, 5, seed=2), rand(2, 5, seed=3))), {}),
    "gru_cell_no_state": lambda w: (GRU_CELL, (w(rand(N, 3, seed=1)),), {}),
    # (a shared input, each instance's own state: ``self.gru(zeros, hl + hr)``)
    "gru_cell_shared_input": lambda w: (GRU_CELL, (rand(3, seed=1), w(rand(N, 5, seed=2))), {}),
    "lstm_cell_shared_rows_input": lambda w: (LSTM_CELL, (rand(2, 3, seed=1), tup(w(rand(N, 2, 5, seed=2)),
                                                                                   w(rand(N, 2, 5, seed=3)))), {}),
    # an nn.Sequential: each module by its rule (rows of an instance too)
    "sequential": lambda w: (SEQUENTIAL, (w(rand(N, 2, 3, seed=1)),), {}),
    "rnn_cell_hx_keyword": lambda w: (RNN_CELL, (w(rand(N, 3, seed=1)),), {"hx": w(rand(N, 5, seed=2))}),
    # einsum: batched operands get a subscript of their own, shared ones stay as they are
    "einsum_bilinear_shared_tensor": lambda w: (torch.einsum, ("i,kij,j->k", w(rand(N, 3, seed=1)),
                                                              rand(2, 3, 3, seed=2), w(rand(N, 3, seed=3))), {}),
    "einsum_implicit_output": lambda w: (torch.einsum, ("ij,jk", w(rand(N, 2, 3, seed=1)), rand(3, 4, seed=2)), {}),
    "einsum_ellipsis_list": lambda w: (torch.einsum, ("...j,j->...", lst(w(rand(N, 2, 3, seed=1)), rand(3, seed=2))),
                                       {}),
    "einsum_scalar_result": lambda w: (torch.einsum, ("i,i->", w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))), {}),
}

# losses: (C,) and (B, C) per-instance inputs, every reduction
for _red in ("sum", "mean", "none"):
    OPS[f"cross_entropy_C_{_red}"] = (lambda red: lambda w: (
        F.cross_entropy, (w(rand(N, 5, seed=1)), w(randint(5, N, seed=2))), {"reduction": red}))(_red)
    OPS[f"cross_entropy_BC_{_red}"] = (lambda red: lambda w: (
        F.cross_entropy, (w(rand(N, 3, 5, seed=1)), w(randint(5, N, 3, seed=2))), {"reduction": red}))(_red)
    OPS[f"nll_loss_BC_{_red}"] = (lambda red: lambda w: (
        F.nll_loss, (w(F.log_softmax(rand(N, 3, 5, seed=1), -1)), w(randint(5, N, 3, seed=2))),
        {"reduction": red}))(_red)
# len() of a batched tensor: the instances' first dim, one int
OPS["len"] = lambda w: (len, (w(rand(N, 2, 3, seed=1)),), {})
# x[i] with an integer tensor i of one element per instance: one index of x's rows (a loop's steps run ahead)
OPS["batched_tensor_batched_index"] = lambda w: (operator.getitem, (w(rand(N, 3, seed=1)), w(randint(3, N, seed=2))),
                                                 {})
# a shared tensor's rows by each instance's vector of indices; a shared tensor's method given batched arguments
OPS["shared_tensor_index_vectors"] = lambda w: (operator.getitem, (rand(6, 3, seed=1), w(randint(6, N, 4, seed=2))),
                                                {})
OPS["shared_tensor_method"] = lambda w: (torch.zeros(5, dtype=F64).scatter_add,
                                         (0, w(randint(5, N, 3, seed=1)), w(rand(N, 3, seed=2))), {})
OPS["cross_entropy_default_reduction"] = lambda w: (
    F.cross_entropy, (w(rand(N, 3, 5, seed=1)), w(randint(5, N, 3, seed=2))), {})

# vector norms over each instance's elements or dims (torch.norm, Tensor.norm): one linalg.vector_norm
OPS["torch_norm"] = lambda w: (torch.norm, (w(rand(N, 2, 4, seed=1)),), {})
OPS["torch_norm_fro_keywords"] = lambda w: (torch.norm, (), {"input": w(rand(N, 2, 4, seed=1)), "p": "fro",
                                                             "dim": (0, 1), "keepdim": True})
OPS["method_norm"] = lambda w: (method(w(rand(N, 2, 4, seed=1)), "norm"), (), {})
OPS["method_norm_p1_dim"] = lambda w: (method(w(rand(N, 2, 4, seed=1)), "norm"), (1, -1), {})
OPS["method_norm_inf"] = lambda w: (method(w(rand(N, 3, seed=1)), "norm"), (), {"p": float("inf")})
OPS["torch_index_select"] = lambda w: (torch.index_select, (w(rand(N, 2, 4, seed=1)), -1, torch.tensor([3, 0, 3])), {})
OPS["method_index_select"] = lambda w: (method(w(rand(N, 2, 4, seed=1)), "index_select"), (0, torch.tensor([1, 1])),
                                        {})
# ops taking a dim of 0-d instances, whose dim 0 or -1 is the instance itself, not the batch's instance dim
for _name, _args in (("softmax", (-1,)), ("log_softmax", (0,)), ("squeeze", (0,)), ("sum", (-1,)),
                     ("max", (-1,)), ("argmax", (0,)), ("unsqueeze", (-1,))):
    OPS[f"method_{_name}_of_0d"] = (lambda name, args: lambda w: (method(w(rand(N, seed=1)), name), args, {}))(
        _name, _args)
for _fn in (torch.softmax, torch.logsumexp, torch.unsqueeze):
    OPS[f"torch_{_fn.__name__}_of_0d"] = (lambda fn: lambda w: (fn, (w(rand(N, seed=1)), -1), {}))(_fn)

# ops given rules of their own (each once a torch.func.vmap of the group, about 0.1 ms a call): dim ops,
# products, elementwise functions, methods and modules, pointwise losses, shapes
_ROWS = lambda w: w(rand(N, 2, 4, seed=1))  # noqa: E731 - an instance's (2, 4) tensor
RULED = {
    "torch_max_binary": lambda w: (torch.max, (w(rand(N, 3, seed=1)), w(rand(N, 3, seed=2))), {}),
    "torch_min_binary_shared": lambda w: (torch.min, (w(rand(N, 3, seed=1)), rand(3, seed=2)), {}),
    "torch_amax_all": lambda w: (torch.amax, (_ROWS(w),), {}),
    "torch_amin_dims": lambda w: (torch.amin, (_ROWS(w), (0, 1)), {}),
    "method_amax_all": lambda w: (method(_ROWS(w), "amax"), (), {}),
    "torch_flatten": lambda w: (torch.flatten, (_ROWS(w),), {}),
    "method_flatten_0d": lambda w: (method(w(rand(N, seed=1)), "flatten"), (), {}),
    "torch_mm_shared_right": lambda w: (torch.mm, (_ROWS(w), rand(4, 3, seed=2)), {}),
    "torch_mm_shared_left": lambda w: (torch.mm, (rand(3, 2, seed=2), _ROWS(w)), {}),
    "torch_bmm": lambda w: (torch.bmm, (w(rand(N, 2, 2, 3, seed=1)), w(rand(N, 2, 3, 2, seed=2))), {}),
    "torch_mv_shared_matrix": lambda w: (torch.mv, (rand(3, 4, seed=2), w(rand(N, 4, seed=1))), {}),
    "torch_mv_batched": lambda w: (torch.mv, (_ROWS(w), w(rand(N, 4, seed=2))), {}),
    "torch_dot": lambda w: (torch.dot, (w(rand(N, 4, seed=1)), w(rand(N, 4, seed=2))), {}),
    "torch_dot_shared": lambda w: (torch.dot, (rand(4, seed=2), w(rand(N, 4, seed=1))), {}),
    "matmul_shared_matrix_vector": lambda w: (torch.matmul, (rand(3, 4, seed=2), w(rand(N, 4, seed=1))), {}),
    "matmul_shared_vector_matrix": lambda w: (torch.matmul, (rand(2, seed=2), _ROWS(w)), {}),
    "method_mv": lambda w: (method(_ROWS(w), "mv"), (rand(4, seed=2),), {}),
    "method_dot": lambda w: (method(w(rand(N, 4, seed=1)), "dot"), (w(rand(N, 4, seed=2)),), {}),
    "torch_outer": lambda w: (torch.outer, (w(rand(N, 3, seed=1)), rand(2, seed=2)), {}),
    "torch_addmm": lambda w: (torch.addmm, (rand(3, seed=3), _ROWS(w), rand(4, 3, seed=2)), {}),
    "F_normalize": lambda w: (F.normalize, (_ROWS(w),), {"dim": -1}),
    "F_normalize_default_dim": lambda w: (F.normalize, (_ROWS(w),), {}),
    "nn_softmax": lambda w: (nn.Softmax(dim=-1), (_ROWS(w),), {}),
    "nn_log_softmax_dim0": lambda w: (nn.LogSoftmax(dim=0), (_ROWS(w),), {}),
    "F_one_hot": lambda w: (F.one_hot, (w(randint(5, N, 3, seed=1)), 5), {}),
    "F_mse_loss": lambda w: (F.mse_loss, (_ROWS(w), w(rand(N, 2, 4, seed=2))), {}),
    "F_kl_div_batchmean": lambda w: (F.kl_div, (w(rand(N, 2, 4, seed=1).log_softmax(-1)),
                                                w(rand(N, 2, 4, seed=2).softmax(-1))), {"reduction": "batchmean"}),
    "F_kl_div_log_target_sum": lambda w: (F.kl_div, (w(rand(N, 4, seed=1).log_softmax(-1)),
                                                     rand(4, seed=2).log_softmax(-1)),
                                          {"reduction": "sum", "log_target": True}),
    "F_l1_loss_sum_shared_target": lambda w: (F.l1_loss, (_ROWS(w), rand(2, 4, seed=2)), {"reduction": "sum"}),
    "F_smooth_l1_none": lambda w: (F.smooth_l1_loss, (_ROWS(w), w(rand(N, 2, 4, seed=2))),
                                   {"reduction": "none", "beta": 0.5}),
    "F_bce_with_logits": lambda w: (F.binary_cross_entropy_with_logits,
                                    (_ROWS(w), w(rand(N, 2, 4, seed=2).sigmoid())), {}),
    "F_bce_0d": lambda w: (F.binary_cross_entropy, (w(rand(N, seed=1).sigmoid()), w(rand(N, seed=2).sigmoid())),
                           {}),
    # (the margin losses, which torch's vmap has no rule for; any operand shared)
    "F_margin_ranking": lambda w: (F.margin_ranking_loss,
                                   (_ROWS(w), rand(2, 4, seed=2), w(rand(N, 2, 4, seed=3).sign())), {"margin": 0.1}),
    "F_margin_ranking_none": lambda w: (F.margin_ranking_loss, (_ROWS(w), w(rand(N, 2, 4, seed=2)), rand(2, 4, seed=3)),
                                        {"reduction": "none"}),
    "F_triplet_swap": lambda w: (F.triplet_margin_loss, (_ROWS(w), w(rand(N, 2, 4, seed=2)), rand(2, 4, seed=3)),
                                 {"swap": True, "p": 1}),
    "F_triplet_1d_sum": lambda w: (F.triplet_margin_loss,
                                   (w(rand(N, 4, seed=1)), rand(4, seed=2), w(rand(N, 4, seed=3))),
                                   {"reduction": "sum", "margin": 2.0}),
    "F_rrelu_eval": lambda w: (F.rrelu, (_ROWS(w), 0.1, 0.3), {"training": False}),
    # (``torch.take``: each instance's elements read flat, by a shared index or each instance's own, negative too)
    "F_triplet_keywords_out_of_order": lambda w: (F.triplet_margin_loss, (), {
        "negative": rand(2, 4, seed=3), "anchor": _ROWS(w), "positive": w(rand(N, 2, 4, seed=2))}),
    "torch_take_shared": lambda w: (torch.take, (_ROWS(w), torch.tensor([[7, -1], [0, 3]])), {}),
    # (a Gaussian's and a multi-class margin's losses, torch's vmap has no rule for them; any operand shared)
    "F_gaussian_nll": lambda w: (F.gaussian_nll_loss, (_ROWS(w), w(rand(N, 2, 4, seed=2)),
                                                       w(rand(N, 2, 4, seed=3).abs() + 0.1)), {}),
    "F_gaussian_nll_var_a_rank_less_sum_full": lambda w: (F.gaussian_nll_loss, (
        _ROWS(w), rand(2, 4, seed=2), w(rand(N, 2, seed=3).abs())), {"reduction": "sum", "full": True}),
    "F_gaussian_nll_shared_var_of_one_none": lambda w: (F.gaussian_nll_loss, (
        w(rand(N, 4, seed=1)), w(rand(N, 4, seed=2)), torch.tensor([0.5], dtype=F64)), {"reduction": "none"}),
    "F_multi_margin": lambda w: (F.multi_margin_loss, (_ROWS(w), w(randint(4, N, 2, seed=2))), {}),
    "F_multi_margin_vector_shared_class": lambda w: (F.multi_margin_loss, (w(rand(N, 4, seed=1)), torch.tensor(2)), {
        "p": 2, "margin": 0.5, "weight": rand(4, seed=5).abs(), "reduction": "none"}),
    "F_multi_margin_sum": lambda w: (F.multi_margin_loss, (), {
        "target": w(randint(4, N, 2, seed=2)), "input": _ROWS(w), "reduction": "sum"}),
    # (``torch.column_stack``: each instance's vectors and numbers as columns, any shared)
    "torch_column_stack": lambda w: (torch.column_stack, (lst(w(rand(N, 2, seed=1)), rand(2, seed=2),
                                                              w(rand(N, 2, 3, seed=3))),), {}),
    "torch_column_stack_numbers": lambda w: (torch.column_stack, (tup(w(rand(N, seed=1)), w(rand(N, seed=2))),), {}),
    "nn_embedding_bag_rows": lambda w: (BAG, (w(randint(10, N, 2, 3, seed=1)),), {}),
    "nn_embedding_bag_offsets_weighted": lambda w: (BAG_SUM, (w(randint(10, N, 5, seed=1)), torch.tensor([0, 2, 2])),
                                                    {"per_sample_weights": w(rand(N, 5, seed=2))}),
    "F_embedding_bag_offsets_max": lambda w: (F.embedding_bag, (w(randint(10, N, 5, seed=1)), TABLE,
                                                                torch.tensor([0, 3])), {"mode": "max"}),
    "F_embedding_bag_rows_padding": lambda w: (F.embedding_bag, (w(randint(10, N, 3, 2, seed=1)), TABLE), {
        "mode": "sum", "padding_idx": 0}),
    "torch_take_own": lambda w: (torch.take, (_ROWS(w), w(randint(8, N, 3, seed=4) - 4)), {}),
    "F_relu6": lambda w: (F.relu6, (_ROWS(w),), {}),
    "F_hardtanh_bounds": lambda w: (F.hardtanh, (_ROWS(w), -0.5, 0.5), {}),
    "F_mish": lambda w: (F.mish, (_ROWS(w),), {}),
    "nn_identity": lambda w: (nn.Identity(), (_ROWS(w),), {}),
    "nn_hardtanh": lambda w: (nn.Hardtanh(-0.2, 0.3), (_ROWS(w),), {}),
    "torch_where_number": lambda w: (torch.where, (w(rand(N, 2, 4, seed=2) > 0), _ROWS(w), 0.0), {}),
    **{f"torch_{name}": (lambda name, args: lambda w: (getattr(torch, name), (_ROWS(w), *args), {}))(name, args)
       for name, args in (("flip", ((0, -1),)), ("roll", (1, 1)), ("narrow", (1, 1, 2)), ("select", (0, 1)),
                          ("transpose", (0, 1)), ("permute", ((1, 0),)), ("movedim", (0, -1)), ("cumsum", (1,)),
                          ("cummax", (0,)), ("sort", ()), ("argsort", (0,)), ("topk", (2,)), ("kthvalue", (2, 0)),
                          ("diff", ()), ("tensor_split", (2,)), ("prod", (1,)), ("var", ()), ("std", (1,)),
                          ("logcumsumexp", (1,)))},
    **{f"method_{name}": (lambda name, args: lambda w: (method(_ROWS(w), name), args, {}))(name, args)
       for name, args in (("flip", (0,)), ("permute", (1, 0)), ("transpose", (-1, -2)), ("t", ()),
                          ("cumsum", (-1,)), ("sort", (0, True)), ("expand", (3, 2, 4)), ("repeat", (2, 1, 1)),
                          ("new_zeros", ((2, 3),)), ("new_full", ((3,), 2.0)), ("clamp", (-0.5, 0.5)),
                          ("pow", (2,)), ("to", (torch.float32,)), ("type_as", (rand(1, seed=3).float(),)),
                          ("lerp", (rand(4, seed=3), 0.3)), ("prod", ()), ("var", (False,)), ("std", ()),
                          ("amin", (-1,)), ("narrow", (-1, 1, 2)), ("roll", (1, -1)))},
    "method_masked_fill": lambda w: (method(_ROWS(w), "masked_fill"), (w(rand(N, 2, 4, seed=2) > 0), 0.0), {}),
    "method_where": lambda w: (method(_ROWS(w), "where"), (w(rand(N, 2, 4, seed=2) > 0), 0.0), {}),
    "torch_zeros_like": lambda w: (torch.zeros_like, (_ROWS(w),), {}),
    "torch_full_like": lambda w: (torch.full_like, (_ROWS(w), 2.0), {}),
    "torch_reshape": lambda w: (torch.reshape, (_ROWS(w), (4, 2)), {}),
    "F_pad": lambda w: (F.pad, (_ROWS(w), (1, 2)), {"value": 0.5}),
    "torch_gather_shared_index": lambda w: (torch.gather, (_ROWS(w), 1, torch.tensor([[3, 0], [1, 1]])), {}),
    "method_gather_batched_index": lambda w: (method(_ROWS(w), "gather"), (-1, w(randint(4, N, 2, 3, seed=2))), {}),
    "F_cosine_similarity": lambda w: (F.cosine_similarity, (_ROWS(w), w(rand(N, 2, 4, seed=2))), {"dim": -1}),
    "F_pairwise_distance": lambda w: (F.pairwise_distance, (_ROWS(w), rand(2, 4, seed=2)), {}),
    "nn_cross_entropy_loss": lambda w: (nn.CrossEntropyLoss(), (w(rand(N, 3, 5, seed=1)), w(randint(5, N, 3, seed=2))),
                                        {}),
    "nn_nll_loss_sum": lambda w: (nn.NLLLoss(reduction="sum"), (w(rand(N, 3, 5, seed=1)), w(randint(5, N, 3, seed=2))),
                                  {}),
    "torch_vander": lambda w: (torch.vander, (w(rand(N, 3, seed=1)),), {"N": 4}),
    "torch_vander_increasing_ints": lambda w: (torch.vander, (w(randint(5, N, 3, seed=1)),), {"increasing": True}),
    "torch_renorm": lambda w: (torch.renorm, (_ROWS(w), 2, 0, 1.0), {}),
    "method_renorm_last_dim": lambda w: (method(_ROWS(w), "renorm"), (1, -1, 0.5), {}),
    "method_tolist": lambda w: (method(w(rand(N, 3, seed=1)), "tolist"), (), {}),
    "torch_isin": lambda w: (torch.isin, (w(randint(5, N, 2, 3, seed=1)), torch.tensor([1, 3])), {}),
    "torch_isin_invert_number": lambda w: (torch.isin, (w(randint(5, N, 3, seed=1)), 2), {"invert": True}),
    "torch_bincount_weights": lambda w: (torch.bincount, (w(randint(5, N, 6, seed=1)),),
                                         {"weights": w(rand(N, 6, seed=2)), "minlength": 7}),
    "torch_bincount_own_lengths": lambda w: (torch.bincount, (w(torch.tensor([[0, 1, 1], [4, 0, 2], [1, 1, 1],
                                                                              [7, 7, 0]])),), {}),
    "real_of_rows": lambda w: (getattr, (_ROWS(w), "real"), {}),
    "nn_bilinear": lambda w: (BILINEAR, (w(rand(N, 3, seed=1)), w(rand(N, 2, seed=2))), {}),
    "nn_bilinear_shared_second": lambda w: (BILINEAR, (w(rand(N, 3, seed=1)), rand(2, seed=2)), {}),
    "F_bilinear_rows": lambda w: (F.bilinear, (w(rand(N, 2, 3, seed=1)), w(rand(N, 2, 2, seed=2)),
                                               BILINEAR.weight, BILINEAR.bias), {}),
    "F_bilinear_keywords_shared_first": lambda w: (F.bilinear, (), {
        "input1": rand(3, seed=1), "input2": w(rand(N, 2, seed=2)), "weight": BILINEAR.weight}),
}
OPS.update(RULED)

# what the rules must leave to vmap or run per instance: ``dim=()`` (every dim, which on the batch's tensor would
# take the instances' dim too), var's positional unbiased, diff's prepend, an instance's 0-d operand of another
# dtype (it promotes as a dimensioned one does not), masked_fill's per-instance value, new_zeros' separate ints,
# pairwise_distance of 0-d instances, torch.max by each instance's own dim, hardtanh's per-instance bounds
OPS.update({
    "method_amax_no_dims": lambda w: (method(_ROWS(w), "amax"), (), {"dim": (), "keepdim": True}),
    "method_var_no_dims": lambda w: (method(_ROWS(w), "var"), (), {"dim": ()}),
    "torch_norm_no_dims": lambda w: (torch.norm, (_ROWS(w),), {"dim": ()}),
    "method_sum_no_dims": lambda w: (method(_ROWS(w), "sum"), (), {"dim": ()}),
    "method_var_positional_unbiased": lambda w: (method(_ROWS(w), "var"), (1, False, True), {}),
    "torch_diff_shared_prepend": lambda w: (torch.diff, (_ROWS(w),), {"prepend": rand(2, 1, seed=3)}),
    "method_mul_0d_other_dtype": lambda w: (method(w(rand(N, 4, seed=1).float()), "mul"), (w(rand(N, seed=2)),), {}),
    "method_masked_fill_own_value": lambda w: (method(_ROWS(w), "masked_fill"), (w(rand(N, 2, 4, seed=2) > 0),
                                                                                 w(rand(N, seed=3))), {}),
    "method_new_zeros_ints": lambda w: (method(_ROWS(w), "new_zeros"), (2, 3), {}),
    "F_pairwise_distance_0d": lambda w: (F.pairwise_distance, (w(rand(N, seed=1)), w(rand(N, seed=2))),
                                         {"keepdim": True}),
})

# cross_entropy's mean over the targets it does not ignore (-100): per instance, and one row per instance
_IGNORING = randint(5, N, 3, seed=2)
_IGNORING[0, 1] = -100
_IGNORING[2] = -100
OPS["cross_entropy_mean_ignoring"] = lambda w: (F.cross_entropy, (w(rand(N, 3, 5, seed=1)), w(_IGNORING.clone())), {})
OPS["nll_loss_mean_ignoring"] = lambda w: (F.nll_loss, (w(rand(N, 3, 5, seed=1)), w(_IGNORING.clone())), {})
OPS["cross_entropy_row_ignored"] = lambda w: (F.cross_entropy,
                                              (w(rand(N, 5, seed=1)), w(torch.tensor([1, -100, 2, 0])[:N])), {})

# ops with no rule of their own, batched by torch.func.vmap: still no per-instance runs
VMAPPED = {
    "linalg_det": lambda w: (torch.linalg.det, (w(rand(N, 3, 3, seed=1)),), {}),
    "matmul": lambda w: (torch.matmul, (w(rand(N, 2, 3, seed=1)), w(rand(N, 3, 2, seed=2))), {}),
    "transpose_method": lambda w: (method(w(rand(N, 2, 3, seed=1)), "transpose"), (0, 1), {}),
    "cross_entropy_label_smoothing": lambda w: (F.cross_entropy, (w(rand(N, 5, seed=1)), w(randint(5, N, seed=2))),
                                                {"label_smoothing": 0.1}),
}

# ops that run per instance (no rule, not vmappable, or a Python builtin): correct, and counted
# (a Python number of each instance's one element: one ``tolist`` of the rows, ``python_numbers``)
OPS.update({
    "item": lambda w: (method(w(rand(N, seed=1)), "item"), (), {}),
    "float_builtin": lambda w: (float, (w(rand(N, seed=1)),), {}),
})


def _truths():
    """Rows whose Python truth decides: zeros, NaN (true), and one row all true."""
    t = (rand(N, 4, seed=1) > 0).double()
    t[0, 1], t[1] = float("nan"), 1.0
    return t


# (Python's any / all of each instance's elements: one reduction of the rows, ``python_any_all``)
OPS.update({
    "any_builtin": lambda w: (any, (w(_truths()),), {}),
    "all_builtin": lambda w: (all, (w(_truths()),), {}),
    "any_of_one_column": lambda w: (any, (w(_truths()[:, :1].contiguous().unsqueeze(2)),), {}),
    "all_of_ints": lambda w: (all, (w(randint(2, N, 3, seed=4)),), {}),
    "any_of_empty_rows": lambda w: (any, (w(rand(N, 0, seed=1)),), {}),
    "all_of_empty_rows": lambda w: (all, (w(rand(N, 0, seed=1)),), {}),
})
PER_INSTANCE = {
    "python_helper": lambda w: (lambda t: t * t.sum(), (w(rand(N, 3, seed=1)),), {}),
}
# (each instance's own dim, or bound: a Python number per instance)
PER_INSTANCE.update({
    "torch_max_own_dim": lambda w: (torch.max, (_ROWS(w), bt.from_items([1, 0, 1, 0][:N])), {}),
    "F_hardtanh_own_bounds": lambda w: (F.hardtanh, (_ROWS(w), bt.from_items([-0.5, -0.2, -1.0, 0.0][:N]), 0.5),
                                        {}),
})


def run_case(make, form):
    """(result of call, per-instance results, per-instance counts). The inputs are made twice (the same
    values): reading a batch's instances may change its form, so the reference reads its own copy."""
    wrap = FORMS[form]
    fn, args, kwargs = make(wrap)
    want = []
    for k in range(N):
        f = bt.instance(fn, k)
        want.append(f(*[bt.instance(a, k) for a in args], **{key: bt.instance(v, k) for key, v in kwargs.items()}))
    fn, args, kwargs = make(wrap)
    reset_counters()
    out = br.call(N, fn, args, kwargs)
    counted = dict(br.counters.per_instance)
    reset_counters()
    return out, want, counted


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(OPS) + list(VMAPPED))
def test_op_matches_per_instance(name, form):
    out, want, counted = run_case({**OPS, **VMAPPED}[name], form)
    check_readers(out, want, N)
    if form == "tensor":
        assert counted == {}, f"{name} ran per instance: {counted}"


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(PER_INSTANCE))
def test_op_without_rule_runs_per_instance(name, form):
    out, want, counted = run_case(PER_INSTANCE[name], form)
    check_readers(out, want, N)
    assert sum(counted.values()) >= N, counted


@pytest.mark.parametrize("shape", [(N,), (N, 3, 2)], ids=["0-d", "rows of two"])
def test_any_of_what_python_cannot_iterate_or_judge_is_left_to_each_instance(shape):
    """Each instance's ``any(t)`` raises Python's own error there (iterating a 0-d tensor; the truth of a row
    of two elements): the rule leaves it to them."""
    x = Batch(N, tensor=rand(*shape, seed=1))
    assert br.python_any_all(N, any, (x,), {}) is NotImplemented
    with pytest.raises((TypeError, RuntimeError)):
        any(bt.instance(x, 0))


def test_shared_operands_run_once():
    reset_counters()
    x = rand(3, seed=1)
    # an immutable result is shared; a fresh tensor computed once, each instance its own row of one copy, as
    # n separate runs would each make their own (a run that may change values in place)
    assert br.call(N, operator.add, (2, 3)) == 5
    assert br.call(N, getattr, (x, "shape")) == x.shape
    out = br.call(N, torch.tanh, (x,))
    assert type(out) is Batch and out.n == N
    assert all(torch.equal(t, torch.tanh(x)) for t in bt.items_of(out))
    bt.instance(out, 0).add_(1.0)  # (a change of one instance's stays its own)
    assert torch.equal(bt.instance(out, 1), torch.tanh(x)) and torch.equal(bt.instance(out, 0), torch.tanh(x) + 1)
    assert br.counters.per_instance == {}
    # a random draw: each instance its own, as n runs would make
    out = br.call(N, torch.rand, (3,))
    assert len({tuple(t.tolist()) for t in bt.items_of(out)}) == N
    assert br.counters.per_instance  # counted
    reset_counters()


def test_n_equal_one_is_a_plain_call():
    x = rand(3, seed=1)
    assert_same(br.call(1, torch.tanh, (x,)), torch.tanh(x))
    assert_same(br.call(1, F.softmax, (x,), {"dim": 0}), F.softmax(x, dim=0))


@pytest.mark.parametrize("form", ["tensor", "items", "pieces"])
def test_iadd_on_batched_tensor(form):
    stacked = rand(N, 3, seed=1)
    target = FORMS[form](stacked)
    other = rand(N, 3, seed=2)
    reset_counters()
    out = br.call(N, operator.iadd, (target, Batch(N, tensor=other.clone())))
    want = [stacked[k] + other[k] for k in range(N)]
    check_readers(out, want, N)
    if form == "tensor":
        assert out is target  # x += y changes x: the result is x itself
        assert br.counters.per_instance == {}
        assert_same(target.tensor, stacked + other)
    # x itself sees the change, whatever its form
    for k in range(N):
        assert_same(bt.instance(target, k), want[k], f"target instance {k}")
    assert_same(bt.tensor_of(target), stacked + other)
    reset_counters()


@pytest.mark.parametrize("exponent", ["shared", "batched"])
def test_ipow_on_batched_tensor_is_in_place(exponent):
    stacked = rand(N, 3, seed=1).abs() + 0.5
    target = Batch(N, tensor=stacked.clone())
    power = 2.0 if exponent == "shared" else Batch(N, tensor=rand(N, 3, seed=2).abs())
    reset_counters()
    out = br.call(N, operator.ipow, (target, power))
    assert out is target and br.counters.per_instance == {}  # x **= y changes x's tensor, as x += y does
    want = stacked ** (2.0 if exponent == "shared" else power.tensor)
    assert_same(target.tensor, want)


def test_iadd_shared_operand_broadcast():
    stacked = rand(N, 2, 3, seed=1)
    target = Batch(N, tensor=stacked.clone())
    row = rand(3, seed=2)
    out = br.call(N, operator.iadd, (target, row))
    assert out is target
    assert_same(bt.tensor_of(target), stacked + row)


# ---------------------------------------------------------------------------
# dtype promotion: a per-instance 0-d tensor combined with a shared tensor
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("batched_dtype, shared", [
    (torch.float32, torch.tensor(0.5, dtype=F64)),        # 0-d with 0-d: the wider float wins
    (F64, torch.tensor([0.5, 1.5, 2.5], dtype=torch.float32)),  # 0-d with 1-d: the dimensioned one wins
    (torch.float32, torch.tensor([0.5, 1.5], dtype=F64)),
], ids=["f32_0d+f64_0d", "f64_0d+f32_1d", "f32_0d+f64_1d"])
def test_elementwise_type_promotion_of_scalar_instances(batched_dtype, shared):
    """Each instance's value is a 0-d tensor: torch's promotion between 0-d and dimensioned tensors must
    follow the instance's own ranks, not those of the stacked (n,) tensor."""
    stacked = torch.tensor([1.25, -2.5, 3.0, 0.125], dtype=batched_dtype)
    out = br.call(N, operator.add, (Batch(N, tensor=stacked), shared))
    check_readers(out, [stacked[k] + shared for k in range(N)], N)


# ---------------------------------------------------------------------------
# lists held by a batch (struct form) and mutated per instance
# ---------------------------------------------------------------------------

def test_append_to_struct_list_then_stack():
    """``xs = [x]; xs.append(y); torch.stack(xs)`` where x, y are batched: the append must be seen."""
    x, y = rand(N, 3, seed=1), rand(N, 3, seed=2)
    xs = br.call(N, intrinsics.build_list, (Batch(N, tensor=x.clone()),))
    append = br.call(N, getattr, (xs, "append"))
    br.call(N, append, (Batch(N, tensor=y.clone()),))
    assert [len(v) for v in instances(xs, N)] == [2] * N
    out = br.call(N, torch.stack, (xs,))
    check_readers(out, [torch.stack([x[k], y[k]]) for k in range(N)], N)


def test_extend_a_struct_list_and_each_instances_own_lists_then_sum():
    """``xs.extend([...])`` of a list the program built, and of each instance's own lists (of their own lengths),
    then ``sum(xs)``: one op for every instance's list, added from zero in order as Python's sum adds."""
    x, y = rand(N, 3, seed=1), rand(N, 3, seed=2)
    reset_counters()
    xs = br.call(N, intrinsics.build_list, (Batch(N, tensor=x.clone()),))
    br.call(N, br.call(N, getattr, (xs, "extend")), (br.call(N, intrinsics.build_tuple, (Batch(N, tensor=y), 2.0)),))
    assert [len(v) for v in instances(xs, N)] == [3] * N and br.counters.per_instance == {}
    own = Batch(N, items=[[x[k]] * (k + 1) for k in range(N)])  # (each instance's list, of its own length)
    br.call(N, br.call(N, getattr, (own, "extend")), (br.call(N, intrinsics.build_list, (Batch(N, tensor=y),)),))
    assert [len(v) for v in bt.items_of(own)] == [k + 2 for k in range(N)] and br.counters.per_instance == {}
    out = br.call(N, sum, (own,))
    check_readers(out, [sum([x[k]] * (k + 1) + [y[k]]) for k in range(N)], N)
    assert br.counters.per_instance == {}
    g = torch.Generator().manual_seed(5)
    halves = [[(torch.randn(3, generator=g) * 100).half() for _ in range(3 * k + 1)] for k in range(N)]
    got = bt.items_of(br.call(N, sum, (Batch(N, items=[list(h) for h in halves]),)))
    assert all(torch.equal(a, sum(h)) for a, h in zip(got, halves))  # (rounded after each +, as Python's sum)
    mixed = Batch(N, items=[[x[k], 1.0] for k in range(N)])  # (a Python number among them: each its own sum)
    check_readers(br.call(N, sum, (mixed,)), [x[k] + 1.0 for k in range(N)], N)


def test_setitem_in_struct_list_then_cat():
    x, y = rand(N, 3, seed=1), rand(N, 3, seed=2)
    xs = br.call(N, intrinsics.build_list, (Batch(N, tensor=x.clone()), Batch(N, tensor=x.clone())))
    br.call(N, operator.setitem, (xs, 0, Batch(N, tensor=y.clone())))
    out = br.call(N, torch.cat, (xs,), {"dim": -1})
    check_readers(out, [torch.cat([y[k], x[k]], -1) for k in range(N)], N)


# ---------------------------------------------------------------------------
# batch.py: forms, concat / part / take / join round trips
# ---------------------------------------------------------------------------

def test_from_tensor_size_one_is_plain():
    t = rand(1, 3, seed=1)
    assert type(bt.from_tensor(t)) is torch.Tensor
    assert_same(bt.from_tensor(t), t[0])
    assert type(bt.from_tensor(rand(2, 3))) is Batch


@pytest.mark.parametrize("form", list(FORMS))
def test_readers_agree(form):
    stacked = rand(5, 2, 3, seed=4)
    b = FORMS[form](stacked)
    assert_same(bt.tensor_of(b), stacked)
    assert_same(bt.stack_output(b, 5), stacked)
    for k, item in enumerate(bt.items_of(b)):
        assert_same(item, stacked[k])
        assert_same(bt.instance(b, k), stacked[k])


def test_struct_readers():
    h, c = rand(N, 3, seed=1), rand(N, 2, seed=2)
    s = bt.from_struct(tuple, [Batch(N, tensor=h), Batch(N, tensor=c)], N)
    for k in range(N):
        assert_same(bt.instance(s, k), (h[k], c[k]))
    out = bt.stack_output(s, N)
    assert_same(out, (h, c))
    mixed = bt.from_struct(list, [Batch(N, tensor=h), 7], N)
    assert_same(bt.items_of(mixed), [[h[k], 7] for k in range(N)])


def test_stack_output_of_shared_and_mixed_values():
    t = rand(3, seed=1)
    assert_same(bt.stack_output(t, 4), t.expand(4, 3))
    assert_same(bt.stack_output((t, t * 2), 2), (t.expand(2, 3), (t * 2).expand(2, 3)))
    with pytest.raises(ValueError, match="must return tensors"):
        bt.stack_output(bt.from_items([t, 1.0, t]), 3)
    with pytest.raises(ValueError, match="must return tensors"):
        bt.stack_output(bt.from_items([t, rand(2)]), 2)
    with pytest.raises(ValueError, match="must return tensors"):
        bt.stack_output(3, 2)


@pytest.mark.parametrize("form", list(FORMS))
def test_take_and_part(form):
    stacked = rand(6, 3, seed=2)
    b = FORMS[form](stacked)
    positions = [4, 0, 3]
    sub = bt.take(b, torch.tensor(positions), positions)
    assert sub.n == 3
    assert_same(bt.tensor_of(sub), stacked[positions])
    one = bt.take(b, torch.tensor([5]), [5])
    assert type(one) is torch.Tensor
    assert_same(one, stacked[5])
    assert bt.take("shared", torch.tensor([1, 2]), [1, 2]) == "shared"
    assert bt.part(b, 0, 6) is b
    middle = bt.part(b, 2, 3)
    assert middle.n == 3
    assert_same(bt.tensor_of(middle), stacked[2:5])
    assert_same(bt.part(b, 5, 1), stacked[5])


@pytest.mark.parametrize("form", list(FORMS))
def test_cut_gives_each_request_its_rows(form):
    stacked = rand(7, 3, seed=4)
    counts = [3, 1, 2, 1]
    pieces = bt.cut(FORMS[form](stacked), counts)
    start = 0
    for piece, count in zip(pieces, counts):
        if count == 1:
            assert_same(piece, stacked[start])
        else:
            assert piece.n == count
            assert_same(bt.tensor_of(piece), stacked[start:start + count])
        start += count
    assert bt.cut("shared", [2, 3]) == ["shared", "shared"]


def test_cut_of_a_tuple_and_its_gradient_is_one_cat():
    h = rand(5, 2, seed=1).requires_grad_(True)
    c = rand(5, 2, seed=2)
    value = bt.from_struct(tuple, [Batch(5, tensor=h * 1), Batch(5, tensor=c), "label"], 5)
    first, second = bt.cut(value, [4, 1])
    assert first.struct[0] is tuple and first.n == 4
    assert_same(bt.tensor_of(first.struct[1][1]), c[:4])
    assert first.struct[1][2] == "label"
    assert type(second) is tuple and second[2] == "label"
    assert_same(second[1], c[4])
    rows = bt.tensor_of(first.struct[1][0])
    assert type(rows.grad_fn).__name__.startswith("SplitWithSizes"), rows.grad_fn
    (rows.sum() + second[0].sum() * 2).backward()
    assert_same(h.grad, torch.tensor([[1.0, 1.0]] * 4 + [[2.0, 2.0]], dtype=F64))


class Counted:
    """A thunk that computes a fixed batch, counting how often it is asked to."""

    def __init__(self, value):
        self.value, self.calls = value, 0

    def depends_on(self):
        return ()

    def compute(self):
        self.calls += 1
        return self.value


def test_lazy_values_pass_through_arithmetic_cuts_joins_and_tuples():
    x = rand(6, 3, seed=5)
    source = Counted(Batch(6, tensor=x))
    lazy = Batch(6, thunk=source)
    doubled = br.call(6, operator.mul, (lazy, 2.0))
    total = br.call(6, operator.add, (doubled, Batch(6, tensor=x)))
    assert doubled.thunk is not None and total.thunk is not None
    head, tail = bt.cut(total, [4, 2])
    joined = bt.join(6, [(head, [0, 2, 4, 5]), (tail, [1, 3])])
    pair = br.call(6, intrinsics.build_tuple, (joined, "tag"))
    assert bt.is_lazy(joined) and source.calls == 0  # nothing read yet
    first = bt.tensor_of(pair.struct[1][0])
    assert source.calls == 1
    want = 3 * x
    order = [0, 4, 1, 5, 2, 3]  # instance k of the join is row order[k] of the cut rows
    assert_same(first, want[order])
    assert pair.struct[1][1] == "tag"
    assert_same(bt.tensor_of(doubled), 2 * x)  # computed in place, once
    assert source.calls == 1


def test_an_op_without_a_lazy_rule_computes_its_lazy_argument():
    x = rand(4, 2, seed=6)
    source = Counted(Batch(4, tensor=x))
    out = br.call(4, torch.tanh, (Batch(4, thunk=source),))
    assert source.calls == 1 and out.thunk is None
    assert_same(bt.tensor_of(out), torch.tanh(x))


def test_a_long_chain_of_lazy_values_is_computed_without_recursion():
    x = torch.arange(6, dtype=F64).view(3, 2)  # (whole numbers: the sums are exact)
    value = Batch(3, thunk=Counted(Batch(3, tensor=x)))
    for _ in range(20000):
        value = br.call(3, operator.add, (value, 1.0))
    assert_same(bt.tensor_of(value), x + 20000)


def test_concat_then_part_round_trip():
    a = rand(3, 4, seed=1)
    shared = rand(4, seed=2)
    c = rand(2, 4, seed=3)
    parts = [(Batch(3, tensor=a), 3), (shared, 1), (bt.from_items(list(c.unbind(0))), 2), (shared, 2)]
    joined = bt.concat(parts)
    assert joined.n == 8
    want = [*a.unbind(0), shared, *c.unbind(0), shared, shared]
    for k in range(8):
        assert_same(bt.instance(joined, k), want[k])
    start = 0
    for value, count in parts:
        back = bt.part(joined, start, count)
        if count == 1:
            assert_same(back, value)
        else:
            got = bt.tensor_of(back)
            expect = bt.tensor_of(value) if type(value) is Batch else value.expand(count, 4)
            assert_same(got, expect)
        start += count


def test_concat_same_object_stays_shared():
    obj = object()
    assert bt.concat([(obj, 1), (obj, 3)]) is obj
    t = rand(3)
    assert bt.concat([(t, 2), (t, 1)]) is t


def test_concat_tuples_is_a_struct():
    h1, h2 = rand(3, seed=1), rand(3, seed=2)
    b = bt.concat([((h1, 1), 1), ((h2, 2), 1)])
    assert b.n == 2
    assert_same(bt.instance(b, 0), (h1, 1))
    assert_same(bt.instance(b, 1), (h2, 2))


def test_concat_keeps_each_requests_list_object():
    """Lists passed by two requests are their callers' objects: appending in the merged frame must append to
    them (they are not values to rebuild, whatever their lengths)."""
    first, second = [], []
    merged = bt.concat([(first, 1), (second, 1)])
    assert bt.instance(merged, 0) is first
    assert bt.instance(merged, 1) is second
    x = rand(2, 3, seed=1)
    append = br.call(2, getattr, (merged, "append"))
    br.call(2, append, (Batch(2, tensor=x),))
    assert len(first) == 1 and len(second) == 1


def test_concat_different_length_lists_keep_identity():
    first, second = [1], [2, 3]
    merged = bt.concat([(first, 1), (second, 1)])
    assert bt.instance(merged, 0) is first and bt.instance(merged, 1) is second


@pytest.mark.parametrize("form", list(FORMS))
def test_join_round_trip(form):
    stacked = rand(7, 2, seed=5)
    b = FORMS[form](stacked)
    yes, no = [0, 2, 3, 6], [1, 4, 5]
    sides = [(bt.take(b, torch.tensor(p), p), p) for p in (yes, no)]
    joined = bt.join(7, sides)
    assert_same(bt.tensor_of(joined), stacked)
    assert_same(bt.items_of(joined), list(stacked.unbind(0)))
    for k in range(7):
        assert_same(bt.instance(joined, k), stacked[k])
    sub = bt.take(joined, torch.tensor([6, 1]), [6, 1])
    assert_same(bt.tensor_of(sub), stacked[[6, 1]])
    assert_same(bt.tensor_of(bt.part(joined, 1, 4)), stacked[1:5])


def test_join_single_side_and_shared_sides():
    t = rand(3)
    assert bt.join(3, [(t, [0, 1, 2])]) is t
    assert bt.join(3, [(t, [0, 2]), (t, [1])]) is t


def test_join_with_python_numbers_and_tensors():
    """loss = 0.0 at a leaf, a tensor elsewhere: the join's items are each instance's own value, and
    tensor_like makes the numbers tensors of the given dtype."""
    losses = rand(2, seed=1)
    joined = bt.join(4, [(0.0, [1, 3]), (Batch(2, tensor=losses), [0, 2])])
    items = bt.items_of(joined)
    assert items[1] == 0.0 and type(items[1]) is float and items[3] == 0.0
    assert_same(items[0], losses[0])
    assert_same(items[2], losses[1])
    assert bt.tensor_of(joined) is None
    assert_same(bt.tensor_like(joined, F64), torch.stack([losses[0], torch.tensor(0.0, dtype=F64),
                                                          losses[1], torch.tensor(0.0, dtype=F64)]))
    out = br.call(4, operator.add, (joined, Batch(4, tensor=rand(4, seed=2))))
    check_readers(out, [items[k] + rand(4, seed=2)[k] for k in range(4)], 4)


def test_join_then_inplace_per_instance_keeps_aliases():
    """A joined batch whose tensor was formed (a read), changed in place per instance: every later read
    of the same batch sees the change."""
    stacked = rand(4, 3, seed=1)
    joined = as_pieces_form(stacked)
    assert_same(bt.tensor_of(joined), stacked)  # forms and caches the tensor
    br.per_instance(4, operator.iadd, (joined, 1.0))
    assert_same(bt.tensor_of(joined), stacked + 1)
    for k in range(4):
        assert_same(bt.instance(joined, k), stacked[k] + 1)


# ---------------------------------------------------------------------------
# Python numbers per instance, and tensor operators
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("numbers", [[1, 2, 3, 4], [0.5, -1.0, 2.0, 0.0], [True, False, True, True]],
                         ids=["int", "float", "bool"])
@pytest.mark.parametrize("fn", [operator.add, operator.mul, operator.sub], ids=lambda f: f.__name__)
def test_python_number_instances_with_batched_tensor(numbers, fn):
    if fn is operator.sub and type(numbers[0]) is bool:
        pytest.skip("torch refuses - with a bool operand")
    x = rand(N, 3, seed=1)
    nums = bt.from_items(list(numbers))
    reset_counters()
    out = br.call(N, fn, (nums, Batch(N, tensor=x.clone())))
    check_readers(out, [fn(numbers[k], x[k]) for k in range(N)], N)
    assert br.counters.per_instance == {}
    out = br.call(N, fn, (Batch(N, tensor=x.clone()), nums))
    check_readers(out, [fn(x[k], numbers[k]) for k in range(N)], N)
    reset_counters()


def test_python_number_instances_stay_python_numbers():
    out = br.call(N, operator.add, (bt.from_items([1, 2, 3, 4]), 1))
    assert [bt.instance(out, k) for k in range(N)] == [2, 3, 4, 5]
    assert all(type(bt.instance(out, k)) is int for k in range(N))
    reset_counters()


def test_matmul_operator_is_batched():
    """``x @ W`` (operator.matmul) on a batched x is one batched op, as torch.matmul is, not a per-instance
    loop."""
    x = rand(N, 3, seed=1)
    W = rand(3, 2, seed=2)
    reset_counters()
    out = br.call(N, operator.matmul, (Batch(N, tensor=x.clone()), W))
    check_readers(out, [x[k] @ W for k in range(N)], N)
    assert br.counters.per_instance == {}, br.counters.per_instance


@pytest.mark.parametrize("classes", [3, 5, 15, 16, 2])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_cross_entropy_of_many_rows_of_few_classes_is_torchs(classes, reduction, monkeypatch):
    """Without grad, many rows of 3 to 15 classes take ``logsumexp - gather`` (``batch_rules._row_losses``):
    the same losses as torch's, an ignored class index (-100) included, and torch's own path with grad."""
    taken = []
    logsumexp = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda *a: taken.append(1) or logsumexp(*a))
    n, b = 400, 3  # (1200 rows)
    x, target = rand(n, b, classes, seed=1), randint(classes, n, b, seed=2)
    target[::7, 1] = -100
    want = F.cross_entropy(x.reshape(n * b, classes), target.reshape(n * b), reduction="none").reshape(n, b)
    want = want.sum(1) if reduction == "sum" else want
    for t in (target.clamp(min=0), target):  # (all indices classes, then some ignored)
        with torch.no_grad():
            got = bt.tensor_of(br.call(n, F.cross_entropy, (bt.from_tensor(x), bt.from_tensor(t)),
                                       {"reduction": reduction}))
        assert taken == ([1] if 2 < classes < 16 and t is not target else [])  # (-100: gather refuses)
        taken.clear()
        if t is target:
            torch.testing.assert_close(got, want)
        else:
            full = F.cross_entropy(x.reshape(n * b, classes), t.reshape(n * b), reduction="none").reshape(n, b)
            torch.testing.assert_close(got, full.sum(1) if reduction == "sum" else full)
    x.requires_grad_()
    got = bt.tensor_of(br.call(n, F.cross_entropy, (bt.from_tensor(x), bt.from_tensor(target)),
                               {"reduction": reduction}))
    assert not taken and got.requires_grad  # (torch's own, which autograd records)
    torch.testing.assert_close(got.detach(), want)


@pytest.mark.parametrize("fn, kwargs", [(F.margin_ranking_loss, {"margin": 0.2}),
                                        (F.triplet_margin_loss, {"swap": True}),
                                        (F.triplet_margin_loss, {"p": 1, "reduction": "none"})],
                         ids=["margin_ranking", "triplet_swap", "triplet_p1_none"])
def test_a_margin_loss_has_eagers_gradient_ties_at_the_margin_included(fn, kwargs):
    """Each instance's gradient as eager's call gives it, where an element's loss is exactly at zero too."""
    a, b = rand(N, 3, 4, seed=1).requires_grad_(), rand(N, 3, 4, seed=2).requires_grad_()
    if fn is F.margin_ranking_loss:
        c = torch.ones(N, 3, 4, dtype=F64)
        with torch.no_grad():
            b[:, 0] = a[:, 0] + kwargs["margin"]  # (-(a - b) + margin is 0 there: torch's clamp_min decides)
    else:
        c = rand(N, 3, 4, seed=3)
    got = bt.tensor_of(br.call(N, fn, (bt.from_tensor(a), bt.from_tensor(b), bt.from_tensor(c)), kwargs))
    want = torch.stack([fn(a[k], b[k], c[k], **kwargs) for k in range(N)])
    torch.testing.assert_close(got, want)
    for x in (a, b):
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x, retain_graph=True)[0],
                                   torch.autograd.grad(want.sum(), x, retain_graph=True)[0])



# ---------------------------------------------------------------------------
# values no instance differs in: computed once where every instance may share them
# ---------------------------------------------------------------------------

@pytest.fixture
def sharing():
    """``runtime.sharing.state.fresh`` as a run that changes nothing in place sets it; restored after."""
    saved = sharing_state.fresh
    sharing_state.fresh = True
    yield sharing_state
    sharing_state.fresh = saved


@pytest.mark.parametrize("make", [lambda: (slice, (None, 3)), lambda: (range, (2, 5)),
                                  lambda: (intrinsics.build_tuple, (Ellipsis, slice(1, 2))),
                                  lambda: (tuple, ((1, slice(2, 3)),))])
def test_immutable_values_of_shared_arguments_are_made_once(make):
    fn, args = make()
    reset_counters()
    out = br.call(N, fn, args)
    assert type(out) is not Batch and out == fn(*args) and br.counters.per_instance == {}


def test_a_list_of_shared_items_is_one_list_per_instance_that_torch_ops_read_as_one():
    reset_counters()
    sizes = br.call(N, intrinsics.build_list, (2, 4))
    assert type(sizes) is Batch and br.counters.per_instance == {}
    lists = bt.items_of(br.call(N, intrinsics.build_list, (2, 4)))
    assert lists == [[2, 4]] * N and len({id(x) for x in lists}) == N  # (each instance its own list)
    x = rand(N, 6, seed=1)
    parts = br.call(N, method(Batch(N, tensor=x.clone()), "split"), (sizes, -1))
    assert br.counters.per_instance == {}
    check_readers(parts, [tuple(row.split([2, 4], -1)) for row in x], N)
    appended = br.call(N, getattr, (sizes, "append"))
    br.call(N, appended, (7,))  # (a list's own method: per instance, each instance's list)
    assert bt.items_of(sizes) == [[2, 4, 7]] * N and len({id(v) for v in bt.items_of(sizes)}) == N


def test_a_nested_list_of_shared_items_is_one_list_to_a_torch_op_and_each_instances_own_to_a_builtin(sharing):
    reset_counters()
    rows = [br.call(N, intrinsics.build_list, (1.0, 0.0)), br.call(N, intrinsics.build_list, (2.0, 3.0))]
    table = br.call(N, intrinsics.build_list, tuple(rows))
    out = br.call(N, torch.tensor, (table,), {"dtype": F64})  # (``torch.tensor([[1.0, 0.0], [2.0, 3.0]])``)
    assert type(out) is torch.Tensor and br.counters.per_instance == {}
    assert torch.equal(out, torch.tensor([[1.0, 0.0], [2.0, 3.0]], dtype=F64))
    largest = bt.items_of(br.call(N, max, (table,)))  # (Python hands each instance its own inner list)
    assert largest == [[2.0, 3.0]] * N and len({id(v) for v in largest}) == N


def test_a_list_the_program_built_is_no_tensor_and_stays_one_list_of_its_items():
    """``tensor_of`` of a list display (``[0.5] * 6`` read by a trace as an operand) is None, and leaves it the
    list of shared items it was: a later ``* 6`` repeats them, with no op per instance."""
    reset_counters()
    xs = br.call(N, intrinsics.build_list, (0.5,))
    assert bt.tensor_of(xs) is None and xs.struct is not None and xs.owner is None
    out = br.call(N, operator.mul, (xs, 6))
    assert out.struct[1] == [0.5] * 6 and br.counters.per_instance == {}


def test_an_item_of_a_list_the_program_built_is_set_by_a_shared_int_as_python_sets_it():
    reset_counters()
    hs = br.call(N, operator.mul, (br.call(N, intrinsics.build_list, (None,)), 3))  # (``[None] * 3``)
    x = Batch(N, tensor=rand(N, 2, seed=1))
    br.call(N, operator.setitem, (hs, 1, x))
    br.call(N, operator.setitem, (hs, -1, 2.0))
    assert br.counters.per_instance == {}
    check_readers(hs, [[None, row, 2.0] for row in x.tensor], N)
    with pytest.raises(IndexError, match="list assignment index out of range"):
        br.call(N, operator.setitem, (hs, 3, x))


def test_tolist_of_each_instances_tensor_is_one_tolist_giving_each_its_own_lists():
    reset_counters()
    x = Batch(N, tensor=rand(N, 2, 3, seed=1))
    out = br.call(N, method(x, "tolist"), ())
    assert br.counters.per_instance == {}
    check_readers(out, [row.tolist() for row in x.tensor], N)
    assert len({id(v) for v in bt.items_of(out)}) == N
    numbers = br.call(N, method(Batch(N, tensor=torch.tensor([1, -2, 3, 4])), "tolist"), ())
    assert bt.items_of(numbers) == [1, -2, 3, 4]


@pytest.mark.parametrize("each, dtype", [
    ([[1.0, 2.5], [0.0, -1.0], [3.0, 4.0], [2.0, 2.0]], None),
    ([[1, 2.5], [0, -1.5], [3, 4.0], [2, 2.5]], None),  # (an int and a float in each: float32 in each)
    ([[[True], [False]], [[False], [False]], [[True], [True]], [[False], [True]]], None),
    ([1, 2, 3, 4], F64), ([[1, 2.5], [0, -1], [3, 4], [2, 2]], F64)])
def test_torch_tensor_of_each_instances_python_numbers_is_one_tensor(each, dtype):
    reset_counters()
    kwargs = {} if dtype is None else {"dtype": dtype}
    for fn in (torch.tensor, torch.as_tensor):
        out = br.call(N, fn, (bt.from_items(copy.deepcopy(each)),), kwargs)
        assert br.counters.per_instance == {}
        check_readers(out, [fn(v, **kwargs) for v in each], N)


@pytest.mark.parametrize("each", [[[1, 2], [0, 1], [3, 4], [2.0, 2]],  # (instance 3's floats: float32, others int64)
                                  [[1.0, 2.0], [0.0], [3.0, 4.0], [2.0, 2.0]]])  # (lengths that differ)
def test_torch_tensor_of_numbers_an_instances_own_call_reads_otherwise_runs_per_instance(each, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    reset_counters()
    out = br.call(N, torch.tensor, (bt.from_items(copy.deepcopy(each)),))
    assert br.counters.per_instance
    check_readers(out, [torch.tensor(v) for v in each], N)


def test_torch_ops_of_shared_values_are_computed_once_in_a_run_that_changes_nothing(sharing):
    w = rand(3, 2, seed=1)
    reset_counters()
    zeros = br.call(N, torch.zeros, (3,))
    view = br.call(N, w.t, ())
    linear = br.call(N, nn.Linear(2, 2).double(), (rand(2, seed=2),))
    assert all(type(v) is torch.Tensor for v in (zeros, view, linear)) and br.counters.per_instance == {}
    assert torch.equal(view, w.t())
    sharing.fresh = False  # (a run that may change a value in place: computed once, each instance its own row)
    zeros = br.call(N, torch.zeros, (3,))
    assert type(zeros) is Batch and zeros.owner == "tensor" and br.counters.per_instance == {}
    views = br.call(N, w.t, ())  # (a view: each instance's call views w itself, so a change reaches w)
    assert all(v._base is w for v in bt.items_of(views))


@pytest.mark.parametrize("rows", [torch.tensor([3, -1, 0, 7]), torch.tensor([[2.75], [-2.5], [0.0], [-0.0]]),
                                  torch.tensor([True, False, False, True]),
                                  torch.tensor([1.5, 2.0, -3.25, 0.5], dtype=torch.bfloat16)])
@pytest.mark.parametrize("convert", [int, float, bool, "item"])
def test_python_numbers_of_each_instances_one_element_are_one_tolist(rows, convert):
    """``int(t)``, ``float(t)``, ``bool(t)``, ``t.item()`` of each instance's one element: the very numbers, of the
    very types, that each instance's call gives, with no op once per instance."""
    reset_counters()
    x = Batch(N, tensor=rows.clone())
    if convert == "item":
        got, want = br.call(N, method(x, "item"), ()), [r.item() for r in rows]
    else:
        got, want = br.call(N, convert, (x,)), [convert(r) for r in rows]
    got = bt.items_of(got)
    assert got == want and [type(v) for v in got] == [type(v) for v in want]
    assert [str(v) for v in got] == [str(v) for v in want]  # (-0.0 stays -0.0)
    assert br.counters.per_instance == {}


def test_python_numbers_that_are_not_one_element_each_or_fail_run_as_each_instance_runs_them():
    """More than one element per instance: per instance, raising eager's error; NaN to int: eager's error."""
    with pytest.raises(ValueError, match="only one element tensors can be converted"):
        br.call(N, int, (Batch(N, tensor=rand(N, 2, seed=1)),))
    with pytest.raises(ValueError, match="cannot convert float NaN to integer"):
        br.call(N, int, (Batch(N, tensor=torch.tensor([1.0, float("nan"), 2.0, 3.0])),))
    big = torch.tensor([2 ** 63 + 5, 1, 2, 3], dtype=torch.uint64)  # (past int64: torch refuses each instance's)
    with pytest.raises(RuntimeError, match="without overflow"):
        br.call(N, int, (Batch(N, tensor=big),))
    reset_counters()


def exp_of_a_copy(x, w):
    v = w.t().clone()  # (each instance's own tensor, held apart: the function changes a shared value's copy)
    torch.exp_(v)
    return v.max(1)[0] + x


def sin_of_a_copy(x, w):
    v = w.t().clone()
    torch.sin_(v)
    return v.max(1)[0] + x


def changes_each_instances_copy_as_eager(fn):
    """``fn(x, w)`` under vmap over x, w shared, against the eager loop."""
    x = torch.tensor([[1.0, 2.0, 0.5], [-1.0, -2.0, 0.5], [0.3, 0.1, 0.2]], dtype=F64)
    w = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5], [0.2, 0.3, 0.4]], dtype=F64)
    want = torch.stack([fn(x[k], w) for k in range(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.vmap(recompile.function(fn), in_dims=(0, None))(x, w)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fn", [exp_of_a_copy, sin_of_a_copy])
def test_torch_function_form_of_an_in_place_method_changes_each_instances_own_tensor(fn):
    """``torch.exp_(v)`` of tensors the batch holds apart ran under vmap on their stack, a copy: the instances'
    tensors were left as they were (a wrong value). It is ``v.exp_()``."""
    changes_each_instances_copy_as_eager(fn)


double_in_place = lambda v: v.mul_(2.0)  # noqa: E731  (a helper written as a lambda, changing its argument)


def doubled_by_a_lambda(x, w):
    v = w.t().clone()
    double_in_place(v)
    return v.max(1)[0] + x


def test_a_lambda_changing_its_argument_in_place_changes_each_instances_tensor():
    """(Was a wrong value: a lambda's program is not examined, so the run took the function to change nothing,
    shared the clone of w computed once, and gave each instance's call a copy of it, whose change was lost. A
    lambda or closure of the user's now counts as one that may change what it is given.)"""
    changes_each_instances_copy_as_eager(doubled_by_a_lambda)


def extremes_of_scores(x, y):
    a, b = x.sum(), y.sum()
    return max(a, b) * 2.0 + min(a, b, torch.tensor(0.5, dtype=x.dtype)) + max([x[0], y[0], x[1]]) * 3.0


def test_python_max_and_min_of_one_element_tensors_are_one_where_for_the_batch(monkeypatch):
    """Python keeps the first and takes each later one that compares greater (less): ties and the gradient go to
    the first, as eager's; a list the program built (``max([a, b, c])``) too."""
    monkeypatch.setattr(config, "PER_INSTANCE", "error")
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0], [2.0, 1.0]], dtype=F64)
    y = torch.tensor([[3.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 2.0]], dtype=F64)
    xe, ye = x.clone().requires_grad_(), y.clone().requires_grad_()
    want = torch.stack([extremes_of_scores(xe[k], ye[k]) for k in range(N)])
    xb, yb = x.clone().requires_grad_(), y.clone().requires_grad_()
    got = recompile.vmap(recompile.function(extremes_of_scores))(xb, yb)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.sum(), (xb, yb)), torch.autograd.grad(want.sum(), (xe, ye))):
        torch.testing.assert_close(g, w)


def test_python_max_of_tensors_of_more_than_one_element_raises_as_eager():
    with pytest.raises(RuntimeError, match="ambiguous"):
        br.call(N, max, (Batch(N, tensor=rand(N, 2, seed=1)), Batch(N, tensor=rand(N, 2, seed=2))))
    reset_counters()


@pytest.mark.parametrize("index", [torch.tensor([2, 0]), [2, 0], (slice(None), torch.tensor([1])), np.array([2, 0]),
                                   range(2), ((0, 2),)], ids=["tensor", "list", "tuple", "array", "range", "nested"])
def test_rows_picked_by_an_index_are_a_new_tensor_each_instance_owns_in_a_run_that_changes_values(index, sharing):
    """``w[idx]`` with an index that copies (what eager's ``w[idx]`` is no view of): in a run that changes values in
    place, each instance's own rows of one copy, as each instance's call makes its own tensor; in one that changes
    nothing, computed once and shared. A view (``w[1:]``, ``w[torch.tensor(1)]``) is the same memory, as eager's."""
    w = rand(3, 3, seed=1)
    reset_counters()
    shared = br.item(N, w, index)
    assert type(shared) is torch.Tensor and torch.equal(shared, w[index]) and br.counters.per_instance == {}
    sharing.fresh = False
    own = br.item(N, w, index)
    assert type(own) is Batch and own.owner == "tensor" and br.counters.per_instance == {}
    assert all(torch.equal(r, w[index]) for r in bt.items_of(own)) and own.tensor.stride(0) == w[index].numel()
    for view in (slice(1, None), torch.tensor(1)):
        got = br.item(N, w, view)
        assert type(got) is torch.Tensor and got._base is w


@pytest.mark.parametrize("make", [
    lambda: (torch.randn, (3,), {}),  # draws
    lambda: (torch.ones(3).add_, (1.0,), {}),  # writes in place
    lambda: (torch.add, (torch.ones(3), 1.0), {"out": torch.empty(3)}),
    lambda: (F.relu, (torch.ones(3),), {"inplace": True}),
    lambda: (torch.ones(3).bernoulli, (), {}),
    lambda: (lambda t: t * 2, (torch.ones(3),), {}),  # a helper: its effects are its own
])
def test_ops_that_draw_write_or_are_not_torchs_still_run_per_instance(make, sharing):
    fn, args, kwargs = make()
    assert not br.computes_alike(fn, kwargs)
    reset_counters()
    br.call(N, fn, args, kwargs)
    assert sum(br.counters.per_instance.values()) == N  # (its result: one per instance, or the tensor it wrote)


@pytest.mark.parametrize("fn", [nn.Dropout(0.5), F.dropout], ids=["module", "function"])
def test_dropout_of_a_shared_tensor_draws_each_instances_mask_in_one_op(fn, sharing):
    """In training each instance its own mask, drawn at once over the tensor repeated for every instance; out of
    training the tensor itself, once."""
    x = torch.ones(64, dtype=torch.float64)
    reset_counters()
    out = br.call(N, fn, (x, 0.5) if fn is F.dropout else (x,))
    assert type(out) is Batch and out.owner == "tensor" and br.counters.per_instance == {}
    rows = out.tensor
    assert rows.shape == (N, 64) and set(rows.unique().tolist()) <= {0.0, 2.0}
    assert len({tuple(r.tolist()) for r in rows}) == N  # (each instance's own draws)
    off = br.call(N, fn, (x, 0.5, False) if fn is F.dropout else (x,)) if fn is F.dropout else \
        br.call(N, fn.eval(), (x,))
    assert off is x


@pytest.mark.parametrize("right", ["matrix", "vector"])
def test_a_batch_times_a_shared_matrix_is_one_product(right):
    x = rand(N, 2, 3, seed=1)
    w = rand(3, 4, seed=2) if right == "matrix" else rand(3, seed=2)
    for fn in (operator.matmul, torch.matmul):
        reset_counters()
        out = br.call(N, fn, (Batch(N, tensor=x.clone()), w))
        assert br.counters.per_instance == {}
        check_readers(out, [row @ w for row in x], N)
    out = br.call(N, operator.matmul, (rand(4, 2, seed=3), Batch(N, tensor=x.clone())))  # (shared @ batch: vmap)
    check_readers(out, [rand(4, 2, seed=3) @ row for row in x], N)


@pytest.mark.parametrize("ranks", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_batched_vectors_and_matrices_times_each_other_are_one_product(ranks):
    shapes = {(1, 1): ((3,), (3,)), (2, 1): ((2, 3), (3,)), (1, 2): ((3,), (3, 4)), (2, 2): ((2, 3), (3, 4))}[ranks]
    x, y = rand(N, *shapes[0], seed=1), rand(N, *shapes[1], seed=2)
    reset_counters()
    out = br.call(N, operator.matmul, (Batch(N, tensor=x.clone()), Batch(N, tensor=y.clone())))
    assert br.counters.per_instance == {}
    check_readers(out, [x[k] @ y[k] for k in range(N)], N)


def test_addcmul_addcdiv_and_lerp_batch_elementwise():
    a, b, c = rand(N, 3, seed=1), rand(N, 3, seed=2), rand(N, 3, seed=3).abs() + 1
    for fn, kwargs in ((torch.addcmul, {"value": 0.5}), (torch.addcdiv, {"value": 2.0}), (torch.lerp, {})):
        args = (Batch(N, tensor=a), Batch(N, tensor=b), Batch(N, tensor=c) if fn is not torch.lerp else 0.25)
        reset_counters()
        out = br.call(N, fn, args, kwargs)
        assert br.counters.per_instance == {} and br.BATCH.by_callable[fn] is br.elementwise
        check_readers(out, [fn(a[k], b[k], c[k] if fn is not torch.lerp else 0.25, **kwargs) for k in range(N)], N)


def test_isinstance_of_a_batch_is_one_answer_where_every_instance_agrees():
    reset_counters()
    assert br.call(N, isinstance, (Batch(N, tensor=rand(N, 3)), torch.Tensor)) is True
    assert br.call(N, isinstance, (tup(Batch(N, tensor=rand(N, 3)), 1.0), tuple)) is True
    assert br.call(N, isinstance, (lst(Batch(N, tensor=rand(N, 3))), (tuple, int))) is False
    mixed = br.call(N, isinstance, (bt.from_items([1, 2.0, 3, "4"]), int))
    assert bt.items_of(mixed) == [True, False, True, False] and br.counters.per_instance == {}


def test_is_none_of_a_batch_is_one_answer_where_every_instance_agrees():
    reset_counters()
    assert br.call(N, operator.is_, (Batch(N, tensor=rand(N, 3)), None)) is False
    assert br.call(N, operator.is_not, (tup(Batch(N, tensor=rand(N, 3)), 1.0), None)) is True
    mixed = br.call(N, operator.is_, (bt.from_items([None, (1, 2), None, 0]), None))
    assert bt.items_of(mixed) == [True, False, True, False] and br.counters.per_instance == {}
    assert bt.items_of(br.call(N, operator.is_not, (bt.from_items([None, 1, None, 0]), None))) == \
        [False, True, False, True]



def full_extremes(x):
    return x.max() + x.min() * 2 + torch.max(x) * 3 + torch.min(x) * 4 + x.amax()


@pytest.mark.parametrize("rows", [
    [[1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [0.0, 5.0, 1.0]],  # (instances of vectors: ties in two of them)
    [[[1.0, 3.0], [3.0, 0.0]], [[2.0, 2.0], [2.0, 2.0]]],  # (of matrices)
    [1.0, 2.0, 2.0],  # (of 0-d tensors)
])
def test_a_full_max_or_min_splits_its_gradient_among_ties_as_torch_does(rows):
    """``x.max()`` over every dim sends each tied maximum an equal share (``max(dim)`` all to the first)."""
    xs = torch.tensor(rows, dtype=torch.float64, requires_grad=True)
    want = torch.stack([full_extremes(x) for x in xs])
    want_grad, = torch.autograd.grad(want.sum(), xs)
    got = recompile.vmap(recompile.function(full_extremes))(xs)
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(torch.autograd.grad(got.sum(), xs)[0], want_grad)


def bool_minus(x, k):
    return (x > 0) - k


def masked_sum(x, i):
    return x[i].sum()  # (a uint8 index is a mask to torch: i = 0 selects nothing)


def test_what_torch_refuses_for_one_instance_each_instance_refuses():
    xs, ks = torch.randn(3, 4), torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError) as eager:
        bool_minus(xs[0], ks[0])
    with pytest.raises(RuntimeError, match=str(eager.value).split(".")[0]):
        recompile.vmap(recompile.function(bool_minus), in_dims=(0, 0))(xs, ks)


def test_a_uint8_index_is_a_mask_as_torch_reads_it():
    x = torch.randn(3, 4, dtype=torch.float64)
    i = torch.tensor([1, 0, 2], dtype=torch.uint8)
    got = recompile.vmap(recompile.function(masked_sum), in_dims=(None, 0))(x, i)
    torch.testing.assert_close(got, torch.stack([masked_sum(x, k) for k in i]))


def median_index(x, lens):
    return x[lens.median()] * 1.0


def test_whole_median_keeps_an_integer_dtype_and_gives_a_nan_its_gradient():
    x = torch.tensor([[1.0, float("nan"), 2.0], [3.0, 1.0, 2.0]], requires_grad=True)
    lens = torch.tensor([[0, 2, 1], [1, 1, 2]])
    want = torch.stack([median_index(x[k], lens[k]) for k in range(2)])
    got = recompile.vmap(recompile.function(median_index))(x, lens)
    torch.testing.assert_close(got, want, equal_nan=True)
    m = recompile.vmap(recompile.function(torch_median_of))(x)
    (g,) = torch.autograd.grad(m, x, torch.ones_like(m))
    e = torch.stack([r.median() for r in x])
    (w,) = torch.autograd.grad(e, x, torch.ones_like(e))
    torch.testing.assert_close(g, w)
    assert g[0].tolist() == [0.0, 1.0, 0.0]  # (the NaN median is the NaN element's)


def torch_median_of(x):
    return x.median() * 1.0


def test_a_sequential_is_as_rerunnable_and_alike_as_its_modules():
    """An nn.Sequential of pure modules may be run again and computed once for shared inputs; one holding a
    Dropout draws (each instance its own mask), and one with a hook is not the rule's."""
    from recompile.codegen.segments import rerunnable

    assert rerunnable(SEQUENTIAL) and br.computes_alike(SEQUENTIAL, {})
    drawing = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    assert not rerunnable(drawing) and not br.computes_alike(drawing, {})
    hooked = nn.Sequential(nn.Linear(3, 3)).double()
    hooked[0].register_forward_hook(lambda m, i, o: o * 2)
    assert not rerunnable(hooked) and not br.computes_alike(hooked, {})
    x = rand(N, 3, seed=4)
    got = br.call(N, hooked, (Batch(N, tensor=x),))
    assert torch.allclose(bt.tensor_of(got), hooked(x))


def test_a_parameter_indexed_by_batched_indices_is_one_gather():
    """``self.embed.weight[word]`` (an nn.Parameter, not a plain tensor by type) with one index per instance:
    one gather of rows, its gradient the rows', not one index per instance."""
    weight = nn.Parameter(rand(6, 3, seed=1))
    index = torch.tensor([4, 0, 4, 2])
    reset_counters()
    out = br.call(N, operator.getitem, (weight, Batch(N, tensor=index)))
    assert br.counters.per_instance == {}
    assert torch.equal(bt.tensor_of(out), weight[index])
    bt.tensor_of(out).sum().backward()
    assert torch.equal(weight.grad, torch.zeros(6, 3, dtype=F64).index_add_(0, index, torch.ones(N, 3, dtype=F64)))


def _changed_in_place(change, *extra, apart=False):
    """(the batched run's result and gradients, per instance's): ``change(y, *extra)`` changes ``y = x * 1``
    in place, under one batch rule call of the program's op, then ``y * y`` is summed. With ``apart`` the batch
    holds each instance's tensor apart (items: views of y's rows, as a branch's join may hold them)."""
    x = rand(N, 2, 3, seed=1).requires_grad_()
    out = []
    for batched in (True, False):
        if batched:
            y = x * 1.0
            br.counters.per_instance.clear()
            target = Batch(N, items=[y[k] for k in range(N)]) if apart else Batch(N, tensor=y)
            change(target, *[Batch(N, tensor=e) if isinstance(e, torch.Tensor) and e.shape[0] == N
                             else e for e in extra])
            assert br.counters.per_instance == {}, dict(br.counters.per_instance)
        else:  # (each instance its own tensor, as eager code has it)
            ys = [x[k] * 1.0 for k in range(N)]
            for k, y in enumerate(ys):
                change(y, *[e[k] if isinstance(e, torch.Tensor) and e.shape[0] == N else e for e in extra])
            y = torch.stack(ys)
        (grad,) = torch.autograd.grad((y * y).sum(), x)
        out.append((y.detach(), grad))
    return out


# (index, value) of ``y[index] = value``: "value" and "mask" stand for a batched value and a batched mask, "row"
# for each instance's own int (a 0-d tensor)
SETITEMS = {"int": (0, 2.0), "slices": ((slice(None), slice(1, None)), -1.0), "ellipsis": ((Ellipsis, 0), 0.5),
            "shared_value": (1, rand(3, seed=3)), "batched_value": (1, "value"),
            "lower_rank_value": (slice(None), "value"), "mask": ("mask", 0.0), "each_int": ("row", 2.0),
            "each_int_batched_value": ("row", "value")}


@pytest.mark.parametrize("apart", [False, True], ids=["rows", "apart"])
@pytest.mark.parametrize("case", list(SETITEMS))
def test_setitem_of_each_instances_own_tensor_is_one_write(case, apart):
    extra = {"value": rand(N, 3, seed=2), "mask": rand(N, 2, 3, seed=4) > 0, "row": torch.tensor([1, 0, 1, 1])}
    index, value = (extra.get(a, a) if isinstance(a, str) else a for a in SETITEMS[case])
    (got, got_grad), (want, want_grad) = _changed_in_place(
        lambda y, i, v: br.call(N, operator.setitem, (y, i, v)) if type(y) is Batch else operator.setitem(y, i, v),
        index, value, apart=apart)
    assert torch.equal(got, want) and torch.allclose(got_grad, want_grad)


IN_PLACE_METHODS = [("clamp_", (-0.5, 0.5)), ("zero_", ()), ("relu_", ()), ("sigmoid_", ()), ("tanh_", ()),
                    ("masked_fill_", ("mask", 1.0)), ("add_", ("value",)), ("mul_", (2.0,))]


@pytest.mark.parametrize("apart", [False, True], ids=["rows", "apart"])
@pytest.mark.parametrize("name, args", IN_PLACE_METHODS)
def test_an_in_place_method_of_each_instances_own_tensor_is_one_call(name, args, apart):
    """Of rows of the batch's tensor, one call; of tensors held apart (``sigmoid_`` of views of one tensor's
    rows, each saving its result, whose version a second instance's op would move), one call on their stack,
    then each given its row."""
    extra = {"mask": rand(N, 2, 3, seed=4) > 0, "value": rand(N, 3, seed=2)}
    batched = [extra.get(a, a) if isinstance(a, str) else a for a in args]
    (got, got_grad), (want, want_grad) = _changed_in_place(
        lambda y, *e: br.call(N, Batch(N, method=(y, name)), tuple(e)) if type(y) is Batch else getattr(y, name)(*e),
        *batched, apart=apart)
    torch.testing.assert_close(got, want)  # (a vectorized sigmoid may differ from a row's in the last bit)
    torch.testing.assert_close(got_grad, want_grad)


# in-place methods no rule lines up, which torch.func.vmap runs by a batching rule: (name, args); "src" stands for
# a batched value of each instance's shape
UNDER_VMAP = [("index_add_", (0, torch.tensor([1, 0]), "src")), ("index_fill_", (1, torch.tensor([2]), 0.5)),
              ("scatter_add_", (1, torch.tensor([[0, 0, 2], [1, 1, 1]]), "src")), ("sin_", ()), ("round_", ()),
              ("index_put_", ((torch.tensor([1, 1]),), "src", True))]


@pytest.mark.parametrize("apart", [False, True], ids=["rows", "apart"])
@pytest.mark.parametrize("name, args", UNDER_VMAP, ids=[name for name, _ in UNDER_VMAP])
def test_an_in_place_method_no_rule_lines_up_runs_under_vmap_once(name, args, apart):
    """``z.index_add_(0, idx, h)`` ... of each instance's own tensor: one call under torch.func.vmap on the
    batch's rows (or, held apart, on their stack, each tensor then given its row), with eager's gradient."""
    src = rand(N, 2, 3, seed=5)
    batched = [src[:, 0] if a == "src" and name == "index_put_" else src if a == "src" else a for a in args]
    (got, got_grad), (want, want_grad) = _changed_in_place(
        lambda y, *e: br.call(N, Batch(N, method=(y, name)), tuple(e)) if type(y) is Batch else getattr(y, name)(*e),
        *batched, apart=apart)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("op", [operator.iadd, operator.imul])
def test_an_augmented_op_of_tensors_held_apart_is_one_call(op):
    (got, got_grad), (want, want_grad) = _changed_in_place(
        lambda y, v: br.call(N, op, (y, v)) if type(y) is Batch else op(y, v), rand(N, 3, seed=2), apart=True)
    assert torch.equal(got, want) and torch.allclose(got_grad, want_grad)


def test_an_in_place_change_of_tensors_held_apart_that_share_memory_runs_per_instance():
    """Two instances holding one tensor (eager code changes it twice) or an argument overlapping one: each
    instance's op, as eager runs it."""
    t = rand(3, seed=1)
    y = Batch(N, items=[t] * N)
    reset_counters()
    br.call(N, Batch(N, method=(y, "add_")), (1.0,))
    assert br.counters.per_instance and torch.equal(t, rand(3, seed=1) + N)
    rows = rand(N, 3, seed=2)
    y = Batch(N, items=[rows[k] for k in range(N)])
    reset_counters()
    br.call(N, operator.iadd, (y, Batch(N, items=[rows[(k + 1) % N] for k in range(N)])))
    assert br.counters.per_instance
    reset_counters()


@pytest.mark.parametrize("changed_after", [False, True])
def test_an_activation_of_one_instances_row_changes_a_copy_whose_version_its_later_changes_move(changed_after):
    """One instance's ``relu_`` of its row of a batch's tensor saves a copy of the row, so that another row's
    change leaves its backward be; a later change of the row itself moves the copy's version, and the backward
    raises as eager's does."""
    x = rand(N, 3, seed=1).requires_grad_()
    rows = x * 1.0
    reset_counters()
    row = rows[1]
    assert br.call(1, row.relu_, ()) is row
    br.call(1, rows[2].sigmoid_, ())  # (another instance's row: eager's is another tensor)
    if changed_after:
        br.call(1, row.add_, (1.0,))
    loss = (row * x[1]).sum() + rows[2].sum()
    want_row = (x[1] * 1.0).relu() + (1.0 if changed_after else 0.0)
    torch.testing.assert_close(row, want_row)
    if changed_after:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        return
    loss.backward()
    xe = rand(N, 3, seed=1).requires_grad_()
    ((xe[1] * 1.0).relu() * xe[1]).sum().add((xe[2] * 1.0).sigmoid().sum()).backward()
    torch.testing.assert_close(x.grad, xe.grad)


def test_an_op_torch_func_vmap_has_no_batching_rule_for_runs_per_instance_where_it_is_counted():
    """vmap loops over the rows of an op it has no batching rule for (``histc``), unseen but for a warning of
    torch's: the loop is refused there, and the op runs per instance, counted and warned of as every such op."""
    x = Batch(N, tensor=rand(N, 6, seed=1))
    reset_counters()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch's "performance drop" warning is not raised)
        with pytest.warns(recompile.PerInstanceWarning, match="histc"):
            out = br.call(N, torch.histc, (x,), {"bins": 4, "min": -2, "max": 2})
    assert br.counters.per_instance
    assert torch.equal(bt.tensor_of(out), torch.stack([torch.histc(r, bins=4, min=-2, max=2) for r in x.tensor]))
    assert torch._C._functorch._is_vmap_fallback_enabled()  # (vmap's own loop is back on for other callers)
    reset_counters()


def test_an_in_place_change_of_rows_that_are_one_shared_value_runs_per_instance():
    """A batch whose rows are one value expanded (no row its own memory) is changed one instance at a time."""
    shared = rand(3, seed=1)
    y = Batch(N, tensor=shared.unsqueeze(0).expand(N, 3))
    reset_counters()
    br.call(N, operator.setitem, (y, 0, 5.0))
    assert br.counters.per_instance
    reset_counters()


def test_a_write_reading_its_own_target_runs_per_instance_as_eager_refuses_or_allows_it():
    """``y[1:] = y[:2]`` overlaps within each instance (torch refuses it), which the batch's tensor hides from
    torch's check; ``y[0] = y[2]`` does not overlap (torch allows it): both run per instance, as eager."""
    y = Batch(N, tensor=rand(N, 3, seed=1))
    with pytest.raises(RuntimeError, match="single memory location"):
        br.call(N, operator.setitem, (y, slice(1, None), br.call(N, operator.getitem, (y, slice(None, 2)))))
    t = rand(N, 3, seed=1)
    y = Batch(N, tensor=t.clone())
    br.call(N, operator.setitem, (y, 0, br.call(N, operator.getitem, (y, 2))))
    assert torch.equal(y.tensor, torch.stack([t[:, 2], t[:, 1], t[:, 2]], 1))
    reset_counters()


def test_in_place_changes_whose_value_is_not_the_batchs_run_as_each_instance_runs_them():
    """``y.fill_(v)`` with each instance's own 0-d v, ``y[mask] = values`` with a shared vector (as many values
    as each instance's mask picks), ``y.copy_(t)`` with a shared t of a higher rank (eager refuses it): each
    as eager runs it, instance by instance."""
    x = rand(N, 4, seed=1)
    y = Batch(N, tensor=x.clone())
    br.call(N, Batch(N, method=(y, "fill_")), (Batch(N, tensor=rand(N, seed=2)),))
    assert torch.equal(y.tensor, rand(N, seed=2)[:, None].expand(N, 4))
    mask = torch.tensor([[True, False, True, False]] * N)
    values = torch.tensor([10.0, 20.0], dtype=F64)
    y = Batch(N, tensor=x.clone())
    br.call(N, operator.setitem, (y, Batch(N, tensor=mask), values))
    want = x.clone()
    for k in range(N):
        want[k][mask[k]] = values
    assert torch.equal(bt.tensor_of(y), want)
    y = Batch(N, tensor=x.clone())
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        br.call(N, Batch(N, method=(y, "copy_")), (rand(N, 4, seed=3),))
    reset_counters()


TIE = torch.tensor([1.0, 3.0, 3.0], dtype=F64)


def added_to_its_own_item(y):
    v = y * 1.0
    v.add_(v[torch.argmax(TIE)])  # (a view of v: torch refuses the overlap)
    return v


def test_an_in_place_change_reading_its_own_target_through_items_or_a_0d_index_is_refused_as_eager():
    y = rand(N, 3, seed=1)
    with pytest.raises(RuntimeError, match="single memory location"):
        added_to_its_own_item(y[0])
    with pytest.raises(RuntimeError, match="single memory location"):
        recompile.vmap(recompile.function(added_to_its_own_item))(y)
    t = Batch(N, tensor=rand(N, 3, seed=2))
    with pytest.raises(RuntimeError, match="single memory location"):
        br.call(N, Batch(N, method=(t, "add_")), (br.call(N, operator.getitem, (t, torch.tensor(1))),))
    reset_counters()


def median_scaled(x):
    return x.median() * x.sum()


def median_changed(x):
    m = x.median()
    m.sigmoid_()  # (median's backward reads its result: eager refuses the backward)
    return m


def test_whole_median_shares_the_gradient_among_ties_and_keeps_its_result_as_eager():
    x = torch.tensor([[1.0, 2.0, 2.0, 0.5], [3.0, -1.0, 0.0, 2.0], [2.0, 2.0, 2.0, 1.0]], dtype=F64,
                     requires_grad=True)
    f = recompile.vmap(recompile.function(median_scaled))
    (got,) = torch.autograd.grad(f(x).sum(), x)
    (want,) = torch.autograd.grad(torch.stack([median_scaled(r) for r in x]).sum(), x)
    torch.testing.assert_close(got, want)
    distinct = torch.tensor([[1.0, 2.5, 2.0, 0.5], [3.0, -1.0, 0.0, 2.0]], dtype=F64, requires_grad=True)
    assert torch.autograd.gradgradcheck(f, (distinct,))  # (finite differences part ties: none here)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.stack([median_changed(r) for r in x]).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        recompile.vmap(recompile.function(median_changed))(x).sum().backward()


def test_index_select_then_a_write_of_its_input_keeps_eagers_backward():
    """``torch.index_select`` of a batched tensor by a shared index is one index_select of the batch's rows, which
    keeps (as eager's) only the input's sizes for its backward: writing that input in place afterwards leaves the
    backward as eager computes it (torch.func.vmap's form keeps the input, and refused)."""
    index = torch.tensor([2, 0, 2])

    def f(x):
        v = torch.index_select(x * 1, 0, index)
        v[1:] = torch.index_select(v, 0, index)[:2]
        return torch.tanh(v.amax() * v.sum())

    x = rand(N, 3, seed=1).requires_grad_()
    want = torch.stack([f(row) for row in x])
    want_grad, = torch.autograd.grad(want.sum(), x)
    got = recompile.vmap(recompile.function(f))(x)
    got_grad, = torch.autograd.grad(got.sum(), x)
    assert torch.allclose(got, want) and torch.allclose(got_grad, want_grad)


def _softmax_of_sum(x):
    return x.sum().softmax(-1)


def _logsumexp_of_sum(x):
    return torch.logsumexp(x.sum(), 0)


def _max_of_sum(x):
    return x.sum().max(-1).values


def _unsqueezed_sum(x):
    return x.sum().unsqueeze(-1) + x


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "op_by_op"])
@pytest.mark.parametrize("f", [_softmax_of_sum, _logsumexp_of_sum, _max_of_sum, _unsqueezed_sum],
                         ids=lambda f: f.__name__)
def test_a_dim_of_a_0d_instance_is_its_own_in_a_compiled_program(f, segments):
    """A dim op of each instance's 0-d tensor, in a compiled program (raw segments, or op by op): the dim is the
    instance's, never the batch's instance dim (a softmax over the instances was 0.78 off)."""
    x = rand(N, 3, seed=2)
    want = torch.stack([f(row) for row in x])
    saved = config.SEGMENTS
    config.SEGMENTS = segments
    try:
        got = recompile.vmap(recompile.function(f))(x)
    finally:
        config.SEGMENTS = saved
    assert torch.allclose(got, want)



@pytest.mark.parametrize("name", list(RULED))
def test_op_with_a_rule_of_its_own_does_not_go_through_vmap(name, monkeypatch):
    """Each of these is one call on the batch's tensor, not a torch.func.vmap of the group."""
    vmapped = []
    real = br._vmapped
    monkeypatch.setattr(br, "_vmapped", lambda *args: vmapped.append(args[1]) or real(*args))
    out, want, counted = run_case(RULED[name], "tensor")
    check_readers(out, want, N)
    assert not vmapped and counted == {}, (vmapped, counted)


def _float_parts(value):
    """The floating tensors among ``value`` (a tensor, or tuples and lists of them) that carry a gradient."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _float_parts(v)]
    return []


# rules whose result carries no gradient (indices, new tensors of a value, a conversion to another dtype; vander,
# whose backward torch refuses: with a gradient it runs per instance)
_NO_GRADIENT_RESULT = {"F_one_hot", "method_tolist", "torch_vander_increasing_ints", "torch_vander", "torch_isin",
                       "torch_isin_invert_number", "torch_bincount_weights", "torch_bincount_own_lengths",
                       "nn_embedding_bag_rows", "F_embedding_bag_offsets_max", "F_embedding_bag_rows_padding",
                       "torch_argsort", "method_new_zeros", "method_new_full", "torch_zeros_like", "torch_full_like",
                       "method_to", "method_type_as"}


@pytest.mark.parametrize("name", [k for k in RULED if k not in _NO_GRADIENT_RESULT])
def test_op_with_a_rule_of_its_own_gives_per_instance_gradients(name):
    """The gradient of each rule's result, summed, with respect to its batched inputs: as the per-instance
    calls give it."""
    leaves = []

    def fresh(t):
        t = t.detach().clone().requires_grad_() if t.is_floating_point() else t
        leaves.append(t)
        return as_tensor_form(t)

    fn, args, kwargs = RULED[name](fresh)
    got = sum(t.sum() for t in _float_parts(bt.stack_output(br.call(N, fn, args, kwargs), N)))
    assert torch.is_tensor(got), "the rule's result carries no gradient"
    floats = [t for t in leaves if t.requires_grad]
    got_grads = torch.autograd.grad(got, floats, allow_unused=True)
    reused = iter(leaves)
    fn, args, kwargs = RULED[name](lambda t: as_tensor_form(next(reused)))
    want = sum(t.sum() for k in range(N) for t in _float_parts(bt.instance(fn, k)(
        *[bt.instance(a, k) for a in args], **{key: bt.instance(v, k) for key, v in kwargs.items()})))
    want_grads = torch.autograd.grad(want, floats, allow_unused=True)
    for g, w in zip(got_grads, want_grads):
        if w is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode, by_freq", [("mean", False), ("max", False), ("sum", True)])
def test_an_embedding_bag_of_each_instances_bags_gives_its_table_each_instances_gradient(mode, by_freq, monkeypatch):
    """(``scale_grad_by_freq``: a word's gradient scaled by its count in the instance's own bags, each
    instance's own call)"""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    bag = nn.EmbeddingBag(10, 3, mode=mode, scale_grad_by_freq=by_freq).double()
    words = randint(10, N, 6, seed=3)
    out = br.call(N, bag, (Batch(N, tensor=words.clone()), torch.tensor([0, 4])))
    got = torch.autograd.grad((bt.tensor_of(out) * rand(N, 2, 3, seed=4)).sum(), bag.weight)[0]
    want = torch.autograd.grad(sum((bag(w, torch.tensor([0, 4])) * r).sum() for w, r in zip(words, rand(
        N, 2, 3, seed=4))), bag.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_vander_of_rows_that_need_a_gradient_is_each_instances_own_whose_backward_torch_refuses(monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    x = rand(N, 3, seed=1).requires_grad_()
    reset_counters()
    out = br.call(N, torch.vander, (Batch(N, tensor=x),), {"N": 4})
    assert br.counters.per_instance
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        bt.stack_output(out, N).sum().backward()


@pytest.mark.parametrize("how", ["module", "function"])
def test_an_embedding_scaling_gradients_by_frequency_looks_up_each_instances_words_on_its_own(how, monkeypatch):
    """``scale_grad_by_freq`` scales a word's gradient by its count among one call's indices: one call of every
    instance's would count them together (a wrong gradient), so each instance's call is its own."""
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    table = nn.Embedding(5, 3, scale_grad_by_freq=True).double()
    fn, extra = (table, ()) if how == "module" else (F.embedding, (table.weight,))
    kwargs = {} if how == "module" else {"scale_grad_by_freq": True}
    words = torch.tensor([[1, 1, 2], [1, 3, 3], [2, 2, 2], [4, 0, 4]])
    reset_counters()
    out = br.call(N, fn, (Batch(N, tensor=words.clone()), *extra), kwargs)
    assert sum(br.counters.per_instance.values()) == N
    got = torch.autograd.grad((bt.stack_output(out, N) * rand(N, 3, 3, seed=2)).sum(), table.weight)[0]
    want = torch.autograd.grad(sum((fn(w, *extra, **kwargs) * r).sum() for w, r in zip(words, rand(
        N, 3, 3, seed=2))), table.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn, args, kwargs, error", [
    (torch.renorm, (2, 0, 1.0), {}, RuntimeError),  # (an instance's vector: renorm needs two dims)
    (torch.vander, (3, 1), {}, TypeError)])  # (increasing an int, not a bool)
def test_what_each_instances_call_refuses_is_refused(fn, args, kwargs, error, monkeypatch):
    monkeypatch.setattr(config, "PER_INSTANCE", "allow")
    with pytest.raises(error):
        fn(rand(2, seed=1), *args, **kwargs)
    with pytest.raises(error):
        br.call(N, fn, (Batch(N, tensor=rand(N, 2, seed=1)), *args), kwargs)


def test_bincount_of_a_negative_minlength_raises_torchs_error():
    with pytest.raises(RuntimeError, match="minlength should be >= 0"):
        br.call(N, torch.bincount, (Batch(N, tensor=randint(3, N, 4, seed=1)),), {"minlength": -1})


def products_three_ways(x):
    return x.prod(0) + torch.prod(x, 1).sum() + x.prod()


def test_a_prod_with_zeros_in_some_instances_differentiates_as_each_instances_own(monkeypatch):
    """torch's prod gradient takes its zero-safe way where its whole input holds a zero (an inf's gradient is
    then finite, else NaN): batched, a zero of one instance would change another's gradient."""
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "ignore")
    for rows in ([[float("inf"), 2.0], [3.0, 1.0]], [[0.0, 2.0], [3.0, 1.0]]):
        x = torch.tensor([[[float("inf"), 2.0], [1.0, 5.0]], rows], dtype=torch.float64, requires_grad=True)
        f = recompile.function(products_three_ways)
        got = recompile.vmap(f)(x)
        want = torch.stack([products_three_ways(x[k]) for k in range(2)])
        torch.testing.assert_close(got, want, equal_nan=True)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0],
                                   equal_nan=True)
        assert bool(f.stats.get("per_instance")) == (rows[0][0] == 0.0)  # (batched where zeros are alike)


def _numerator_joined(x, t, d):
    """A numerator joined from a branch giving a Python number and one giving a tensor, over ``t``, and over each
    instance's own number."""
    if x.sum() > 0:
        v = 3.0
    else:
        v = x * 1.0
    w = 2.0 if d > 1 else 4.0
    return v / t, (v / w) * t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_number_over_a_tensor_divides_as_eager_beside_tensors(dtype):
    """``v / t`` of a Python number v is ``t.reciprocal() * v`` in eager, which rounds apart from one division:
    instances whose numerator is a number beside instances whose numerator is a tensor give eager's bits (and a
    number over a number stays Python's float), with eager's gradients, and no op runs per instance."""
    compiled = recompile.function(_numerator_joined)
    torch.manual_seed(0)
    xs = torch.randn(300, 1, dtype=dtype)
    ts = (torch.rand(300, 1, dtype=dtype) * 7 + 0.1).requires_grad_()
    ds = torch.randint(0, 3, (300,))
    with switched(config, "error", "PER_INSTANCE"):
        got = recompile.vmap(compiled)(xs, ts, ds)
    want = [_numerator_joined(x, t, d) for x, t, d in zip(xs, ts, ds)]
    for j in range(2):
        assert torch.equal(got[j], torch.stack([each[j] for each in want]))
    (grad,) = torch.autograd.grad(got[0].sum() + got[1].sum(), ts)
    (eager,) = torch.autograd.grad(sum(v.sum() + u.sum() for v, u in want), ts)
    assert torch.equal(grad, eager)


class _LeafZeroLoss(nn.Module):
    """A tree RNN whose leaves return a Python ``0.0`` as their loss: a node whose children are both leaves adds two
    numbers (a Python float), one with a leaf and an inner node a number and a tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def encode(self, left, right, leaf, i):
        if left[i] < 0:
            return leaf[i], 0.0
        hl, loss_l = self.encode(left, right, leaf, left[i])
        hr, loss_r = self.encode(left, right, leaf, right[i])
        h = torch.tanh(self.lin(hl + hr))
        return h, loss_l + loss_r + self.out(h).sum()


def test_numbers_met_by_numbers_beside_tensors_batch_as_python_adds_them():
    eager = _LeafZeroLoss().double()
    model = copy.deepcopy(eager)
    type(model).encode_c = recompile.function(_LeafZeroLoss.encode)
    left = torch.tensor([-1, -1, 0, -1, 2, -1, -1, 5, -1, -1, 8, 7, 10])
    right = torch.tensor([-1, -1, 1, -1, 3, -1, -1, 6, -1, -1, 9, 4, 11])
    roots = torch.tensor([2, 12, 7, 4])
    leaf = torch.randn(13, 4, dtype=torch.float64)
    with switched(config, "error", "PER_INSTANCE"):
        h, loss = recompile.vmap(model.encode_c, in_dims=(None, None, None, 0))(left, right, leaf, roots)
    want = [eager.encode(left, right, leaf, r) for r in roots]
    torch.testing.assert_close(h, torch.stack([w[0] for w in want]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, torch.stack([w[1] for w in want]), rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(loss.sum() + h.sum(), list(model.parameters()))
    expected = torch.autograd.grad(sum(w[1] + w[0].sum() for w in want), list(eager.parameters()))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def _powers_and_products(x, y):
    return x ** 2, -x, x < 1, x * y


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_an_instances_python_numbers_beside_anothers_tensors_stay_as_python_computes_them(dtype):
    """Ops of a value that is a Python number for one instance and a tensor for another: the number's instance gets
    Python's own numbers; a product of half floats and numbers is each instance's own (a number rounded to a half
    float before the op would give what eager's does not)."""
    compiled = recompile.function(_powers_and_products)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    xs, ys = [x, 0.1, x], [0.1, 0.2, 0.3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        got = recompile.map(compiled, xs, ys)
    for g, w in zip(got, (_powers_and_products(a, b) for a, b in zip(xs, ys))):
        for a, b in zip(g, w):
            assert type(a) is type(b)
            assert torch.equal(a, b) if type(b) is torch.Tensor else a == b
