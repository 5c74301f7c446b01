"""recompile.ops.facts: every fact set and rule table its consumers read before op knowledge moved below the
pipeline (``fixtures/facts_before_move.json``, written from the old layout) is the same after the move, but
for the differences listed here, each made on purpose."""

import importlib
import json
import operator
import os

import torch
import torch.nn.functional as F
from torch import nn

from fact_names import describe, listing
from recompile import intrinsics
from recompile.codegen import emit, segments
from recompile.ops import facts, syntax
from recompile.autodiff import backprop, factors as deferred, rules as grad_rules
from recompile.runtime import batch as bt
from recompile.runtime import batch_rules, cells, dicts, distributions, ranges, rows

convert = importlib.import_module("recompile.frontend.convert")

with open(os.path.join(os.path.dirname(__file__), "fixtures", "facts_before_move.json")) as f:
    BEFORE = json.load(f)

_BOOKKEEPING = {backprop.note, backprop.note_all, backprop.version, backprop.check_unchanged}
_ACTIVATIONS = facts.ELEMENTWISE_MODULES


def _rules(table):
    return {k: r.vjp for k, r in table.items()}


def _metadata():
    return {f"{describe(k)} {kind}": (r.reads_out, r.reads_inputs, tuple(r.read_for_others))
            for kind, table in (("function", grad_rules.GRAD.by_callable), ("method", grad_rules.GRAD.by_method),
                                ("module", grad_rules.GRAD.by_module)) for k, r in table.items()}


def _metadata_of(vjps, reads_inputs, skip=(), reads_out=None, others=None):
    """The rule_metadata entries of the rules of ``vjps`` (not of those filed under ``skip``), as they read with
    ``reads_inputs`` (and ``reads_out`` and ``others`` as read_for_others, where given)."""
    return set(listing({f"{describe(k)} {kind}": (r.reads_out if reads_out is None else reads_out, reads_inputs,
                                                  tuple(r.read_for_others) if others is None else others)
                        for kind, table in (("function", grad_rules.GRAD.by_callable),
                                            ("method", grad_rules.GRAD.by_method),
                                            ("module", grad_rules.GRAD.by_module))
                        for k, r in table.items() if r.vjp in vjps and k not in skip}))


def _method_metadata(vjps, others):
    """The rule_metadata entries of the method rules of ``vjps``, with ``others(rule)`` as read_for_others."""
    return set(listing({f"{describe(k)} method": (r.reads_out, r.reads_inputs, others(r))
                        for k, r in grad_rules.GRAD.by_method.items() if r.vjp in vjps}))


_READ_FOR_OTHERS = {grad_rules._mul, grad_rules._div}


def _fresh_metadata():
    """The rule_metadata entries of ``x op= y`` written out of place: those of the out-of-place op."""
    table = grad_rules.GRAD.by_callable
    return set(listing({f"{describe(f)} function": (table[f.out_of_place].reads_out, table[f.out_of_place].reads_inputs,
                                                    tuple(table[f.out_of_place].read_for_others)) for f in _FRESH}))


def _names(*items):
    return {describe(x) for x in items}


def _entries(pairs):
    return {f"{describe(k)} -> {describe(v)}" for k, v in pairs}


# ops given batch rules of their own where torch.func.vmap ran them (once per group, about 0.1 ms a call):
# elementwise functions and modules, ops along dims, products, shapes, pointwise losses
_MORE_ELEMENTWISE = (F.relu6, F.hardtanh, F.hardsigmoid, F.hardswish, F.logsigmoid, F.softsign, F.tanhshrink, F.mish,
                     F.selu, F.celu, F.hardshrink, F.softshrink, F.threshold, torch.fmax, torch.fmin)
_MORE_ACTIVATIONS = (nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink,
                     nn.Mish, nn.SELU, nn.CELU, nn.Hardshrink, nn.Softshrink, nn.Threshold, nn.Identity)
_MORE_RULES = {"_dim_function", "products", "outer", "like", "reshaped", "constant_padded", "normalize", "one_hot",
               "pointwise_loss", "similarity", "flatten", "addmm", "gather_along",
               "_as_function.<locals>.rule", "softmax_module", "loss_module", "bilinear"}
_MORE_METHOD_RULES = {"_dim_method.<locals>.rule", "_whole_or_dims.<locals>.rule", "_product_method.<locals>.rule",
                      "_elementwise_method.<locals>.rule", "_sized.<locals>.rule", "_new_like.<locals>.rule",
                      "flatten_method", "gather_method", "transposed"}


def _ruled(table, rules):
    """The entries of a batch rule table whose rule is one of the functions named ``rules``."""
    return _entries([(k, r) for k, r in table.items() if describe(r).split(":", 1)[1] in rules])


def _ruled_keys(table, rules):
    return {entry.split(" -> ")[0] for entry in _ruled(table, rules)}


# old name -> (what its consumers read now, names added on purpose, names removed on purpose)
AFTER = {
    # the gradient library's bookkeeping is declared pure where it is written: one PURE for every consumer
    "semantics.PURE": (lambda: facts.PURE, _names(*_BOOKKEEPING), set()),
    "plan._MOVABLE": (lambda: facts.PURE, set(), set()),
    "batch_rules._SHAREABLE": (lambda: batch_rules._SHAREABLE, set(), set()),
    "batch_rules._IMMUTABLE": (lambda: batch_rules._IMMUTABLE, set(), set()),
    # one fact of the augmented assignments a tensor takes in place: ``x **= y`` of a batch runs in place too
    "batch_rules._IN_PLACE": (lambda: batch_rules._IN_PLACE, _names(operator.ipow), set()),
    "batch_rules.LAZY_OPS": (lambda: batch_rules._LAZY, set(), set()),
    "batch_rules._ANY_RANK": (lambda: batch_rules._ANY_RANK, set(), set()),
    # FUSIBLE is a subset of ELEMENTWISE: F.sigmoid and F.tanh, fused before, batch elementwise now
    "batch_rules._ELEMENTWISE": (lambda: facts.ELEMENTWISE, _names(F.sigmoid, F.tanh), set()),
    "batch_rules._ACTIVATIONS": (lambda: facts.ELEMENTWISE_MODULES, set(), set()),
    "batch_rules._SCALARS": (lambda: batch_rules._NUMBERS, set(), set()),
    "batch_rules.INTEGER_INDEX": (lambda: facts.INTEGER_INDEX, set(), set()),
    "batch_rules._SHARED_ATTRS": (lambda: batch_rules.SHARED_ATTRS, set(), set()),
    "batch_rules.RULES": (lambda: batch_rules.BATCH.by_callable,
                          _entries([(F.sigmoid, batch_rules.elementwise), (F.tanh, batch_rules.elementwise),
                                    (operator.ipow, batch_rules.elementwise_inplace)]), set()),
    # an elementwise module is filed under the elementwise rule itself (its wrapper only called it)
    "batch_rules.MODULE_RULES": (lambda: batch_rules.BATCH.by_module,
                                 {f"{describe(m)} -> recompile:elementwise" for m in _ACTIVATIONS
                                  if m not in _MORE_ACTIVATIONS},
                                 {f"{describe(m)} -> recompile:_module_elementwise" for m in _ACTIVATIONS
                                  if m not in _MORE_ACTIVATIONS}),
    "batch_rules.METHOD_RULES": (lambda: batch_rules.BATCH.by_method, set(), set()),
    "fusion.FUSIBLE": (lambda: facts.FUSIBLE, set(), set()),
    "batching.LAZY_FLOW": (lambda: facts.LAZY_FLOW, set(), set()),
    # one NO_GRADIENT: the grad pass's and the gradient library's lists were two views of one fact. (The
    # frontend's own dict and setattr, for **kwargs and attribute stores, now need no run-time lookup in the
    # gradient programs: tests/test_grad.py::test_frontend_dict_and_setattr_calls_pass_gradients_through.
    # format, float, round and the like no longer count as handing data on to a gradient (``_moves_data``);
    # builtins reach the grad pass as captured globals, which it never reads as constants.)
    "grad.NO_GRADIENT": (lambda: facts.NO_GRADIENT,
                         set(BEFORE["backprop._NO_GRADIENT"]) - set(BEFORE["grad.NO_GRADIENT"]), set()),
    "backprop._NO_GRADIENT": (lambda: facts.NO_GRADIENT,
                              set(BEFORE["grad.NO_GRADIENT"]) - set(BEFORE["backprop._NO_GRADIENT"]), set()),
    "grad.READS": (lambda: facts.READS, set(), set()),
    "grad.DIFFERENTIABLE_ATTRS": (lambda: facts.DIFFERENTIABLE_ATTRS, set(), set()),
    "grad._BUILDERS": (lambda: facts.BUILDERS, set(), set()),
    "grad._DATA_ATTRS": (lambda: facts.DATA_ATTRS, set(), set()),
    "backprop._NO_GRADIENT_METHODS": (lambda: facts.NO_GRADIENT_METHODS, set(), set()),
    "backprop._ITERATING": (lambda: facts.ITERATING, set(), set()),
    "backprop._CONTAINERS": (lambda: facts.CONTAINERS, set(), set()),
    "backprop.IN_PLACE": (lambda: facts.IN_PLACE, set(), set()),
    "backprop._AUGMENTED": (lambda: facts.AUGMENTED_METHODS, set(), set()),
    "effects.MUTATING_CALLS": (lambda: facts.MUTATING, set(), set()),
    "effects.MUTATING_METHODS": (lambda: facts.MUTATING_METHODS, set(), set()),
    "convert.BINOPS": (lambda: convert.BINOPS, set(), set()),
    "convert.INPLACE": (lambda: convert.INPLACE, set(), set()),
    "convert.UNARY": (lambda: convert.UNARY, set(), set()),
    "convert.COMPARE": (lambda: convert.COMPARE, set(), set()),
    "emit._BINARY": (lambda: emit._BINARY, set(), set()),
    "emit._COMPARE": (lambda: emit._COMPARE, set(), set()),
    "emit._UNARY": (lambda: emit._UNARY, set(), set()),
    "segments._OPERATORS": (lambda: segments._OPERATORS, set(), set()),
    "segments._GENERIC_OK": (lambda: segments._GENERIC_OK, _names(F.sigmoid, F.tanh), set()),
    "segments._GENERIC_OK_MODULES": (lambda: segments._GENERIC_OK_MODULES, set(), set()),
    "segments._METHODS": (lambda: segments._METHODS, set(), set()),
    "segments._INFIX": (lambda: segments._INFIX, set(), set()),
    "segments._FORMS": (lambda: segments.TRACE.by_callable,
                        _entries([(F.sigmoid, segments._elementwise_form), (F.tanh, segments._elementwise_form)]),
                        set()),
    "segments._PLAIN_MODULES": (lambda: segments.TRACE.by_module, set(), set()),
    "grad_rules.FUNCTION_RULES": (lambda: _rules(grad_rules.GRAD.by_callable), set(), set()),
    "grad_rules.METHOD_RULES": (lambda: _rules(grad_rules.GRAD.by_method), set(), set()),
    "grad_rules.MODULE_RULES": (lambda: _rules(grad_rules.GRAD.by_module), set(), set()),
    "grad_rules.rule_metadata": (_metadata, set(), set()),
    "grad_rules.SHAPE_ONLY": (lambda: grad_rules.SHAPE_ONLY, set(), set()),
    "grad_rules.READ_FOR_OTHERS": (lambda: grad_rules.READ_FOR_OTHERS, set(), set()),
    "deferred.DEFERRED": (lambda: deferred.DEFERRED, set(), set()),
}


# vjps that read their result, not their input (tanh, sigmoid, exp, relu, ..., softmax): an input changed in
# place after the op leaves their gradient right, as eager's
_INPUT_READERS = {grad_rules.GRAD.by_callable[getattr(torch, name)].vjp
                  for name, (_, reads_result) in grad_rules._UNARY.items() if not reads_result}
_RESULT_READERS = {grad_rules.GRAD.by_callable[f].vjp for f in (
    torch.exp, torch.exp2, torch.expm1, torch.sqrt, torch.rsqrt, torch.reciprocal, torch.tan, torch.tanh,
    torch.sigmoid, torch.relu, torch.softmax, torch.log_softmax)}

_VIEWS_MOVING_DIMS = {grad_rules._t, grad_rules._swapaxes, grad_rules._movedim, grad_rules._getattr}
# ops that move, repeat or convert their input, their gradient read of its shape, dtype and device alone (as eager
# saves nothing for them: the input may change in place afterwards)
_SHAPE_READERS = {grad_rules._flip, grad_rules._fliplr, grad_rules._flipud, grad_rules._roll,
                  grad_rules._broadcast_tensors, grad_rules._repeat, grad_rules._tile, grad_rules._cast}

# a product's factors, each read for the other's gradient alone
_PRODUCTS = {grad_rules._matmul, grad_rules._outer, grad_rules._linear}
# rules that hand their work to another that reads no result (``dot`` to ``matmul``'s): they read none either
_PASSING = {grad_rules._rmatmul, grad_rules._mm, grad_rules._mv, grad_rules._dot, grad_rules._rsub,
            grad_rules._relu6, grad_rules._clamp_min, grad_rules._clamp_max, grad_rules._where_method,
            grad_rules._rdiv}

# what facts gained after the move, on purpose: old name -> (names added, names removed)
_ADDCMUL = (torch.addcmul, torch.addcdiv, torch.lerp)  # elementwise, with options (value=, weight=)
# elementwise too: ``&``, ``|``, ``^``, ``~``, ``//``, ``%`` and torch's comparisons, bitwise and remainders
_TORCH_BITWISE = (torch.le, torch.ge, torch.ne, torch.logical_or, torch.logical_xor, torch.bitwise_and,
                  torch.bitwise_or, torch.bitwise_xor, torch.bitwise_not, torch.remainder, torch.fmod,
                  torch.floor_divide, torch.trunc, torch.isnan, torch.isinf, torch.isfinite)
def _out_of_place_metadata():
    """The rule_metadata entries of ``x.relu_()`` written out of place, where they are not a result reader's:
    those of the out-of-place op."""
    table = grad_rules.GRAD.by_callable
    return set(listing({f"{describe(f)} function": (r.reads_out, r.reads_inputs, tuple(r.read_for_others))
                        for f in _OUT_OF_PLACE for r in [table[getattr(torch, f.method)]]
                        if r.vjp not in _RESULT_READERS}))


def _builtin_pow_metadata():
    r = grad_rules.GRAD.by_callable[operator.pow]
    return set(listing({f"{describe(pow)} function": (r.reads_out, r.reads_inputs, tuple(r.read_for_others))}))


_BITWISE = (operator.and_, operator.or_, operator.xor, operator.invert, operator.floordiv, operator.mod,
            *_TORCH_BITWISE)
_FRESH = tuple(intrinsics.AUGMENTED_FRESH.values())
_OUT_OF_PLACE = intrinsics.OUT_OF_PLACE  # (``x.relu_()``, ``torch.relu_(x)`` written out of place)
_PYTHON_ARITHMETIC = (round, abs, min, max, divmod, pow, *facts.MATH)
_CELLS = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)  # a batch of rows for the cell (batch_rules.recurrent_cell)
_LAYERS = (nn.RNN, nn.LSTM, nn.GRU)  # every instance's sequences one batch for the module (batch_rules.recurrent_layer)
_CLOSURES = (intrinsics.fixed_cell, intrinsics.set_cell, intrinsics.read_local_cell, intrinsics.delete_cell,
             intrinsics.make_function, intrinsics.cell_or_undefined)
_IMPORTS = (intrinsics.import_module, intrinsics.import_from)  # (an import statement, made assignments)
GROWN = {
    # a deferred call's result may flow into a dict display the function returns (``{"h": h, "loss": ...}``)
    "batching.LAZY_FLOW": (_names(intrinsics.build_dict), set()),
    # a for over ``reversed(xs)`` iterates xs as ``reversed`` does: a tensor's rows taken for their gradients
    "backprop._ITERATING": (_names(intrinsics.reversed_sequence), set()),
    # Python's math functions are pure: ``math.sqrt(H)`` of a constant runs once for every instance
    # (and the read of ``enumerate`` a for over it as an index loop checks: it hands the builtin back)
    # (and ``operator.index`` of a ``reversed(range(n))`` loop's bound, which the frontend counts down)
    # (and ``x += y`` written out of place: a new object, x unchanged, one call for instances that share x and y)
    # (and the sequence a for over ``reversed(xs)`` reads from its end, a view of xs)
    "semantics.PURE": (_names(*facts.MATH, intrinsics.builtin_read, operator.index, *_FRESH, *_OUT_OF_PLACE,
                              intrinsics.reversed_sequence), set()),
    "plan._MOVABLE": (_names(*facts.MATH, intrinsics.builtin_read, operator.index, *_FRESH, *_OUT_OF_PLACE,
                             intrinsics.reversed_sequence), set()),
    # a slice, a range, a frozenset and ``...`` are values no call can change: every instance shares one
    # (and a view of a sequence from its end, as shared as the sequence is)
    "batch_rules._IMMUTABLE": (_names(slice, range, frozenset, type(Ellipsis), intrinsics.ReversedSequence), set()),
    "batch_rules._ELEMENTWISE": (_names(*_ADDCMUL, *_BITWISE, *_MORE_ELEMENTWISE), set()),
    "batch_rules._ACTIVATIONS": (_names(*_MORE_ACTIVATIONS), set()),
    # ``x @ w`` of a batched x and a shared matrix, or of two batches, is one product (batch_rules.matmul), else
    # vmap as before; einsum gives batched operands a subscript of their own (a shared V is not copied)
    "batch_rules.RULES": (_entries([*((f, batch_rules.elementwise) for f in _ADDCMUL + _BITWISE),
                                    (operator.matmul, batch_rules.matmul), (torch.matmul, batch_rules.matmul),
                                    (torch.einsum, batch_rules.einsum), (isinstance, batch_rules.instance_of),
                                    # ``for t in range(n)`` with n per instance: a batch of ranges (runtime.ranges)
                                    (range, ranges.build), (intrinsics.as_sequence, ranges.as_sequence),
                                    (intrinsics.has_index, ranges.has_index), (operator.not_, batch_rules.negation),
                                    # ``words[:n]`` with n per instance: each instance's slice (runtime.rows)
                                    (slice, rows.slices), (reversed, rows.reversed_rows),
                                    # ``for x in reversed(xs)``: each instance's rows flipped, its own list reversed
                                    (intrinsics.reversed_sequence, batch_rules.reversed_sequences),
                                    # the margin losses torch's vmap has no rule for; rrelu out of training
                                    (F.margin_ranking_loss, batch_rules.margin_loss),
                                    (F.triplet_margin_loss, batch_rules.margin_loss), (F.rrelu, batch_rules.rrelu_eval),
                                    # a call's own list handed back (passes.accumulate): each instance's
                                    (intrinsics.hand_back, batch_rules.handed_back),
                                    # zeros of each instance's own length: the stretches of one tensor
                                    (torch.zeros, batch_rules.made_of_own_length),
                                    (torch.ones, batch_rules.made_of_own_length),
                                    # each instance's elements read flat (torch's vmap has no rule for it)
                                    (torch.take, batch_rules.taken),
                                    # more ops torch's vmap has no rule for: two losses, column_stack, isin,
                                    # bincount (each instance's values past the others' bins), embedding bags
                                    (F.gaussian_nll_loss, batch_rules.gaussian_nll),
                                    (F.multi_margin_loss, batch_rules.multi_margin),
                                    (torch.column_stack, batch_rules.column_stack), (torch.isin, batch_rules.isin),
                                    (torch.bincount, batch_rules.bincount),
                                    (F.embedding_bag, batch_rules.embedding_bag),
                                    # ``torch.tensor([float(v) for v in x])``: each instance's numbers, one tensor
                                    (torch.tensor, batch_rules.tensor_of_numbers),
                                    (torch.vander, batch_rules.vander), (torch.renorm, batch_rules.renorm),
                                    (torch.as_tensor, batch_rules.tensor_of_numbers),
                                    (operator.index, batch_rules.index_numbers),
                                    # ``state is None``: the rows of a tensor and a built tuple are not None
                                    (operator.is_, batch_rules.none_test), (operator.is_not, batch_rules.none_test),
                                    (sum, batch_rules.python_sum),
                                    # Python's any / all of each instance's elements: one reduction of the rows
                                    (any, batch_rules.python_any_all), (all, batch_rules.python_any_all),
                                    # each instance's chosen elements: a stretch of them, as ``x[m]``
                                    (torch.masked_select, batch_rules.masked_select),
                                    # ``key in d`` of a dict built with shared keys: one bool they share
                                    (operator.contains, dicts.contains), (intrinsics.not_in, dicts.contains),
                                    # a variable some paths leave unbound: checked on the batch as it is
                                    (intrinsics.check_bound, batch_rules.bound_check),
                                    # ``a, *rest = xs`` of a batched tuple or tensor: taken apart as it is
                                    (intrinsics.unpack_starred, batch_rules.starred_unpack),
                                    # closure cells, each instance's own, and nested functions made of them
                                    (intrinsics.fixed_cell, cells.fixed_cells), (intrinsics.set_cell, cells.set_cells),
                                    (intrinsics.read_local_cell, cells.read_cells),
                                    (intrinsics.cell_or_undefined, cells.cells_or_undefined),
                                    (intrinsics.delete_cell, cells.delete_cells),
                                    (intrinsics.make_function, cells.make_functions),
                                    # a full max, min or median (ties share the gradient, as torch's)
                                    (torch.max, batch_rules.extreme), (torch.min, batch_rules.extreme),
                                    (torch.median, batch_rules.extreme),
                                    # len() of a batched tensor: one int the instances share
                                    (len, batch_rules.length),
                                    # list() / tuple() of a built tuple or list, or of a batched tensor's rows
                                    (list, batch_rules.container), (tuple, batch_rules.container),
                                    # a dict with shared keys, held as its values
                                    (intrinsics.build_dict, batch_rules.dict_display),
                                    # ``y[index] = v`` of each instance's own tensor: one write of the batch's rows
                                    (operator.setitem, batch_rules.set_item),
                                    # ``del xs[-2:]`` of each instance's own list
                                    (operator.delitem, batch_rules.deleted),
                                    # a distribution of each instance's parameters: one over the batch
                                    *((c, distributions.build) for c in distributions.CLASSES),
                                    *((c, distributions.build_with_events) for c in distributions.EVENT_PARAMETERS),
                                    (torch.distributions.Independent, distributions.independent),
                                    (torch.distributions.kl_divergence, distributions.kl),
                                    # its noise drawn for every instance at once
                                    (F.gumbel_softmax, batch_rules.BATCH.by_callable[F.gumbel_softmax]),
                                    # an index_select keeping only its input's sizes, as eager's (vmap's kept it)
                                    (torch.index_select, batch_rules._BY_DIM),
                                    # a norm over all of each instance's elements too (vmap's was per group)
                                    (torch.norm, batch_rules.norm),
                                    *((f, batch_rules.elementwise) for f in _MORE_ELEMENTWISE),
                                    # ``x += y`` of an x the frame made, written out of place (passes.fresh)
                                    *((f, batch_rules.augmented_fresh) for f in _FRESH),
                                    *((f, batch_rules.method_fresh) for f in _OUT_OF_PLACE),
                                    # Python's builtins and math of each instance's Python numbers, as Python
                                    *((f, batch_rules.python_arithmetic) for f in _PYTHON_ARITHMETIC),
                                    # a Python number of each instance's one element: one tolist of the rows
                                    *((f, batch_rules.python_numbers) for f in (int, float, bool))])
                          | _ruled(batch_rules.BATCH.by_callable, _MORE_RULES),
                          {"_operator.matmul -> recompile:via_vmap",
                           "torch.functional.norm -> recompile:_dim_rule.<locals>.rule",
                           "torch._VariableFunctionsClass.max -> recompile:_dim_rule.<locals>.rule",
                           "torch._VariableFunctionsClass.min -> recompile:_dim_rule.<locals>.rule"}),
    "batch_rules.METHOD_RULES": ({"'append' -> recompile:appended", "'extend' -> recompile:extended",
                                  "'pop' -> recompile:popped", "'insert' -> recompile:inserted",
                                  *(f"'{m}' -> recompile:method_rule.<locals>.rule" for m in distributions.METHODS),
                                  "'numel' -> recompile:numel", "'masked_select' -> recompile:masked_select_method",
                                  *(f"'{m}' -> recompile:method_rule.<locals>.rule" for m in dicts.METHODS),
                                  "'nelement' -> recompile:numel",
                                  "'max' -> recompile:_extreme_method.<locals>.rule",
                                  "'min' -> recompile:_extreme_method.<locals>.rule",
                                  "'median' -> recompile:_extreme_method.<locals>.rule",
                                  "'index_select' -> recompile:method_dim.<locals>.rule",
                                  "'norm' -> recompile:norm_method", "'item' -> recompile:item_numbers",
                                  "'tolist' -> recompile:listed", "'renorm' -> recompile:renorm_method",
                                  *_ruled(batch_rules.BATCH.by_method, _MORE_METHOD_RULES),
                                  # in-place elementwise methods of each instance's own tensor: one on the batch's
                                  *(f"'{m}' -> recompile:_in_place_method.<locals>.rule"
                                    for m in batch_rules._ELEMENTWISE_IN_PLACE)},
                                 {"'max' -> recompile:method_dim.<locals>.rule"}),
    # (an nn.Sequential: each of its modules by its rule)
    "batch_rules.MODULE_RULES": (_entries([*((m, batch_rules.recurrent_cell) for m in _CELLS),
                                           *((m, batch_rules.recurrent_layer) for m in _LAYERS),
                                           (torch.nn.Sequential, batch_rules.in_sequence),
                                           # every instance's sequences one batch of the module's
                                           (torch.nn.MultiheadAttention, batch_rules.multihead_attention),
                                           (torch.nn.TransformerEncoderLayer, batch_rules.transformer_encoder),
                                           (torch.nn.TransformerEncoder, batch_rules.transformer_encoder),
                                           # every instance's bags one bag of the module's
                                           (torch.nn.EmbeddingBag, batch_rules.embedding_bag)])
                                 | _ruled(batch_rules.BATCH.by_module, _MORE_RULES)
                                 | _entries((m, batch_rules.elementwise) for m in _MORE_ACTIVATIONS), set()),
    "segments._GENERIC_OK": (_names(*_ADDCMUL, *_TORCH_BITWISE, torch.matmul, torch.einsum, isinstance, range, slice,
                                    reversed, intrinsics.reversed_sequence, len, intrinsics.build_dict,
                                    *_CLOSURES, torch.median, torch.index_select, *_MORE_ELEMENTWISE, *_FRESH,
                                    *_OUT_OF_PLACE, *_PYTHON_ARITHMETIC,
                                    int, float, bool, operator.index, any, all, torch.masked_select,
                                    F.margin_ranking_loss, F.triplet_margin_loss, torch.zeros, torch.ones, torch.take,
                                    operator.contains, intrinsics.not_in, F.gaussian_nll_loss, F.multi_margin_loss,
                                    torch.column_stack, torch.isin, torch.bincount, F.embedding_bag, torch.tensor,
                                    torch.as_tensor, torch.vander, torch.renorm)
                             | _ruled_keys(batch_rules.BATCH.by_callable, _MORE_RULES), set()),
    "segments._OPERATORS": (_names(operator.index), set()),  # (pure: a trace may run its batch rule)
    "segments._PLAIN_MODULES": (_names(*_CELLS), set()),  # (a trace form of the recurrent cells)
    # ``x op= y`` written out of place: the out-of-place op's gradient
    "grad_rules.FUNCTION_RULES": (_entries([(intrinsics.iadd_fresh, grad_rules._add_fresh),
                                            (intrinsics.isub_fresh, grad_rules._sub),
                                            (intrinsics.imul_fresh, grad_rules._mul),
                                            (intrinsics.itruediv_fresh, grad_rules._div),
                                            *((f, grad_rules.GRAD.by_callable[getattr(torch, f.method)].vjp)
                                              for f in _OUT_OF_PLACE),
                                            (pow, grad_rules._pow)]), set()),  # (``pow(x, 2)`` is ``x ** 2``)
    "segments._GENERIC_OK_MODULES": (_names(*_CELLS, *_LAYERS, torch.nn.Sequential, *_MORE_ACTIVATIONS,
                                            torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                                            torch.nn.TransformerEncoder, torch.nn.EmbeddingBag)
                                     | _ruled_keys(batch_rules.BATCH.by_module, _MORE_RULES), set()),
    # (views that move dims read no value of their input either, as ``transpose`` always did)
    "grad_rules.SHAPE_ONLY": (_names(*_RESULT_READERS, *_VIEWS_MOVING_DIMS, *_SHAPE_READERS, grad_rules._detach,
                                     grad_rules._add_fresh),
                              _names(grad_rules._getitem)),  # (``x[i]`` reads i: ``READS_ONLY``)
    "batch_rules.INTEGER_INDEX": (set(), {"torch.uint8"}),  # (torch reads a uint8 index as a mask)
    # (result readers and detach read no input; a method's receiver is read for the others as its function's;
    # ``x[i]`` reads i, where the cotangent goes: an index changed in place afterwards is checked)
    "grad_rules.rule_metadata": (_metadata_of(_RESULT_READERS | _VIEWS_MOVING_DIMS | _SHAPE_READERS
                                              | {grad_rules._detach}, False)
                                 | _method_metadata(_READ_FOR_OTHERS, lambda r: tuple(r.read_for_others))
                                 | _fresh_metadata() | _out_of_place_metadata()
                                 | _metadata_of({grad_rules._getitem}, True)
                                 | _builtin_pow_metadata()  # (``pow(x, 2)``: as ``x ** 2`` reads)
                                 # (the unary ops whose gradient reads their input alone do not read their result)
                                 | _metadata_of(_INPUT_READERS, True, skip=_OUT_OF_PLACE, reads_out=False)
                                 | _metadata_of(_PASSING, True, reads_out=False) | _metadata_of(_PRODUCTS, True),
                                 _metadata_of(_INPUT_READERS, True, skip=_OUT_OF_PLACE, reads_out=True)
                                 | _metadata_of(_RESULT_READERS | _VIEWS_MOVING_DIMS - {grad_rules._swapaxes}
                                                | {grad_rules._detach}, True,
                                                skip=_OUT_OF_PLACE)  # (new: not in the snapshot)
                                 | _metadata_of({grad_rules._swapaxes}, True, reads_out=True)
                                 | _metadata_of(_PASSING, True, reads_out=True, others=())
                                 | _metadata_of(_PRODUCTS, True, others=())
                                 | _method_metadata(_READ_FOR_OTHERS, lambda r: ())
                                 | _metadata_of({grad_rules._getitem}, False)
                                 | _metadata_of(_SHAPE_READERS, True)),
    # ``type(x)`` of a shared x is read once for every instance (the class is the same object)
    # (an import statement's module and names, read once for every instance too)
    "batch_rules._SHAREABLE": (_names(type, intrinsics.fixed_cell, intrinsics.make_function, intrinsics.builtin_read,
                                      operator.index, intrinsics.import_module, intrinsics.import_from), set()),
    # what a nested function, lambda or generator expression needs: cells, writes of globals
    # (and a call's own list handed back to its caller's, passes.accumulate: it moves tensors, as list.extend)
    "effects.MUTATING_CALLS": (_names(intrinsics.set_cell, intrinsics.delete_cell, intrinsics.write_global,
                                      intrinsics.delete_global, intrinsics.hand_back), set()),
    "grad.NO_GRADIENT": (_names(*_CLOSURES, intrinsics.new_cell, intrinsics.write_global, intrinsics.delete_global,
                                intrinsics.builtin_read, operator.index, *_IMPORTS, intrinsics.hand_back), set()),
    "backprop._NO_GRADIENT": (_names(*_CLOSURES, intrinsics.new_cell, intrinsics.write_global,
                                     intrinsics.delete_global, intrinsics.builtin_read, operator.index, *_IMPORTS,
                                     intrinsics.hand_back),
                              set()),
    # chunk, split and unbind of a batched tensor traced into a tuple of batched tensors
    "segments._METHODS": ({"'chunk' -> (1, False)", "'split' -> (1, False)", "'unbind' -> (0, False)"}, set()),
    "segments._FORMS": (_entries([*((f, segments._elementwise_form) for f in _ADDCMUL + _BITWISE),
                                  (operator.matmul, segments._matmul_form), (torch.matmul, segments._matmul_form),
                                  (torch.einsum, segments._einsum_form), (F.linear, segments._linear_form),
                                  *((f, segments._elementwise_form) for f in _MORE_ELEMENTWISE),
                                  *((f, segments._augmented_fresh_form) for f in _FRESH),
                                  *((f, segments._method_fresh_form) for f in _OUT_OF_PLACE),
                                  # int(t), bool(t) of each instance's one element: rows standing for the numbers
                                  (int, segments._python_number_form), (bool, segments._python_number_form),
                                  # a dict display with string keys: a struct of its values, a piece may hand on
                                  (intrinsics.build_dict, segments._dict_form),
                                  # torch.logsumexp(x, 0), torch.sum(x, dims): along dims moved past the instance's
                                  *((f, segments._along_dims_form) for f in segments._ALONG_DIMS)]),
                        set()),
    # a product's factors are each read for the other's gradient alone
    "grad_rules.READ_FOR_OTHERS": (_entries((vjp, (0, 1)) for vjp in (
        grad_rules._matmul, grad_rules._rmatmul, grad_rules._mm, grad_rules._mv, grad_rules._dot, grad_rules._outer,
        grad_rules._linear)), set()),
}
# ``x.fill_(v)``, ``x.zero_()`` and ``x.requires_grad_()`` of a tensor the frame made, written anew (passes.fresh):
# pure, batched by rules of their own, fill and zero differentiated by theirs (requires_grad_'s result is noted as
# a source); ``x.new(1, H)`` given sizes is new_empty's rule
_SETTERS = tuple(intrinsics.SETTERS_FRESH.values())
_SET_VJPS = {grad_rules._fill_fresh, grad_rules._zero_fresh}
for _fact, _more in {
        "semantics.PURE": _names(*_SETTERS), "plan._MOVABLE": _names(*_SETTERS),
        "segments._GENERIC_OK": _names(*_SETTERS),
        "batch_rules.RULES": _entries((f, batch_rules.BATCH.by_callable[f]) for f in _SETTERS),
        "batch_rules.METHOD_RULES": _entries([("new", batch_rules.BATCH.by_method["new"])]),
        "grad_rules.FUNCTION_RULES": _entries((k, r.vjp) for k, r in grad_rules.GRAD.by_callable.items()
                                              if r.vjp in _SET_VJPS),
        "grad_rules.METHOD_RULES": _entries((k, r.vjp) for k, r in grad_rules.GRAD.by_method.items()
                                            if r.vjp in _SET_VJPS),
        "grad_rules.rule_metadata": _metadata_of(_SET_VJPS, False, others=()),
        "grad_rules.SHAPE_ONLY": _names(*_SET_VJPS)}.items():
    GROWN[_fact] = (GROWN.get(_fact, (set(), set()))[0] | _more, GROWN.get(_fact, (set(), set()))[1])
# ``x[i] = v`` of a tensor the frame made, written as a copy so written (passes.fresh): pure, batched and
# differentiated by rules of its own, which read i (``READS_ONLY``: an index changed afterwards is checked) and
# only the shapes of x and v
for _fact, _more in {
        "semantics.PURE": _names(intrinsics.setitem_fresh), "plan._MOVABLE": _names(intrinsics.setitem_fresh),
        "segments._GENERIC_OK": _names(intrinsics.setitem_fresh),
        "batch_rules.RULES": _entries([(intrinsics.setitem_fresh,
                                        batch_rules.BATCH.by_callable[intrinsics.setitem_fresh])]),
        "grad_rules.FUNCTION_RULES": _entries([(intrinsics.setitem_fresh, grad_rules._setitem_fresh)]),
        "grad_rules.rule_metadata": _metadata_of({grad_rules._setitem_fresh}, True, others=())}.items():
    GROWN[_fact] = (GROWN.get(_fact, (set(), set()))[0] | _more, GROWN.get(_fact, (set(), set()))[1])


def test_every_fact_of_the_snapshot_has_its_new_home():
    assert set(AFTER) == set(BEFORE)


def test_each_fact_is_as_before_but_for_the_listed_differences():
    for name, (now, added, removed) in AFTER.items():
        grown, shrunk = GROWN.get(name, (set(), set()))
        added, removed = added | grown, removed | shrunk
        before = set(BEFORE[name])
        current = listing(now())
        if name == "segments._PLAIN_MODULES":  # (a tuple of types then, the trace table's module keys now)
            current = sorted(k.split(" -> ")[0] for k in current)
        assert not (added & before) and removed <= before, name  # (a listed difference is a real one)
        assert sorted(current) == sorted((before | added) - removed), name


def test_the_derived_facts_hold_their_relations():
    assert facts.FUSIBLE <= facts.ELEMENTWISE
    assert facts.LAZY <= facts.PURE and facts.LAZY_FLOW == facts.LAZY | {intrinsics.build_tuple, intrinsics.build_dict}
    assert facts.MOVES <= facts.NO_GRADIENT and facts.READS <= facts.NO_GRADIENT | {operator.getitem,
                                                                                     intrinsics.unpack}
    assert set(syntax.AUGMENTED) <= facts.MUTATING and set(facts.IN_PLACE) <= set(syntax.AUGMENTED)
    assert set(facts.AUGMENTED_METHODS.values()) <= set(facts.IN_PLACE)
    assert intrinsics.not_in not in facts.PURE  # (``in`` consumes an iterator)
    assert not facts.DRAWS & facts.FUSIBLE  # (running a chain twice must be running it once)


def test_mutating_method_names():
    assert facts.mutating_method("append") and facts.mutating_method("add_")
    assert not facts.mutating_method("__add__") and not facts.mutating_method("sum")
    assert not facts.mutating_method(None)


def test_among_survives_unhashable_callables():
    class Unhashable:
        __hash__ = None

        def __call__(self):
            return 1

    assert not facts.among(Unhashable(), facts.PURE)
    assert facts.among(len, facts.PURE)


def test_the_callables_that_fuse_batch_elementwise_with_a_trace_form():
    x = torch.randn(3, 4)
    for fn in (F.sigmoid, F.tanh, nn.Tanh()):
        batch_rules.counters.per_instance = {}
        out = batch_rules.call(3, fn, (bt.Batch(3, tensor=x),))
        assert batch_rules.counters.per_instance == {} and torch.equal(out.tensor, torch.stack([fn(r) for r in x]))
    assert segments.TRACE.by_callable[F.sigmoid] is segments.TRACE.by_callable[torch.tanh]
