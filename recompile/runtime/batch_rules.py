"""Batch rules: how one op runs for n instances at once.

``call(n, fn, args, kwargs)`` is what generated batched code runs for every
``Call``. Where no argument is batched, the op runs once (if its result may be
shared) or once per instance. Otherwise a rule picked by ``fn`` runs it as one
tensor op with dim 0 the instance — the hand-written rules below for the ops
models are made of (elementwise, linear and embedding, cat/stack/chunk,
indexing with batched indices as a gather, reductions, softmax, losses), then
torch.func.vmap for any other torch function, Tensor method or module — and
where neither applies the op runs per instance, is counted and warned of
(``runtime.fallbacks``). What every instance may share, and each instance's own
copies, is ``runtime.sharing``'s to say.
"""

from __future__ import annotations

import operator
import string
import threading
import types
from itertools import repeat

import torch
import torch.nn.functional as F
from torch import nn

from .. import config, debugging, intrinsics
from ..ops import facts, syntax
from ..ops.table import BOUND_BUILTIN, RuleTable, by_names, has_backward_hooks, has_hooks, tensor_method, torch_callable
from . import batch as bt
from . import saved_versions
from . import cells, chosen, dicts, distributions, extremes, fallbacks, helpers, lazy_weights, padded, ranges
from . import ragged_products, row_wise, rows
from . import sharing, spreads
from .batch import Batch

# Batch rules, filed as the gradient rules are (``ops.table``): ``rule(n, fn, args, kwargs)`` for a callable
# or a module (``fn``), ``rule(n, x, args, kwargs)`` for a method of a batched tensor ``x``; each returns the
# batched result, or NotImplemented where it does not apply (the op then goes to vmap, or per instance).
BATCH = RuleTable("batch")
# (the facts the hot paths test on every op, as names of this module: one global lookup each)
_IN_PLACE = frozenset(facts.IN_PLACE)
# (``n += 1`` of an immutable n changes nothing: it is ``n + 1``; so is ``passes.fresh``'s form of it)
_AUGMENTED = frozenset(syntax.AUGMENTED) | frozenset(intrinsics.AUGMENTED_FRESH.values())
_NUMBERS, _LAZY = facts.NUMBERS, facts.LAZY
_SHAREABLE, _PURE, _IMMUTABLE = facts.SHAREABLE, facts.PURE, facts.IMMUTABLE
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


class Counters(threading.local):
    """Per-thread tally of how ops ran, read by the scheduler after each frame step."""

    def __init__(self):
        self.per_instance = {}  # name -> instances run one by one


counters = Counters()


# (the lowered ``for``'s own calls, named as the user wrote the loop)
_LOOP_NAMES = {intrinsics.as_sequence: "for ... in", intrinsics.has_index: "for ... in",
               intrinsics.reversed_sequence: "for ... in reversed(...)"}


def _name(fn):
    if facts.among(fn, _LOOP_NAMES):
        return _LOOP_NAMES[fn]
    if facts.among(fn, intrinsics.SETTERS_FRESH.values()):  # (``v.fill_(k)`` written anew: named as written)
        return "Tensor." + fn.in_place
    if type(fn) is Batch:
        if fn.method is not None:
            return "Tensor." + fn.method[1]
        fn = bt.instance(fn, 0)  # (a callable per instance: named by the first)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return f"{module}.{name}" if module and module not in ("builtins", "_operator", "operator") else name


def call(n, fn, args, kwargs=None):
    """``fn(*args, **kwargs)`` for n instances."""
    noted = _noted_change(n, fn, args, kwargs) if saved_versions.watched() else None
    if noted is None:
        out = _call(n, fn, args, kwargs)
    else:
        with noted:
            out = _call(n, fn, args, kwargs)
    if (bt.CACHES or bt.MADE_FROM) and (_changes_in_place(fn) or _asks_in_place(fn, args, kwargs)):
        # (a change through a view of a value joined from pieces, or of a value copies were made from where eager
        # makes views: see bt.CACHES, bt.MADE_FROM)
        bt.after_in_place(_in_place_target(fn, args))
    return out


def _noted_change(n, fn, args, kwargs):
    """The note of in-place op ``fn``'s change of its target's tensor in the run's ledger (saved_versions), or
    None for an op that changes nothing in place or no tensor of its own."""
    if not (_changes_in_place(fn) or _asks_in_place(fn, args, kwargs)):
        return None
    target = _in_place_target(fn, args)
    rows = n > 1 and type(target) is Batch
    target = target.tensor if type(target) is Batch and target.owner == "tensor" else target
    if type(target) not in PLAIN_TENSORS:
        return None
    return saved_versions.writing(target, instances=rows, program=True, group=n)


def _in_place_target(fn, args):
    """What in-place op ``fn`` changed: a method's receiver (``v.add_(w)``), else its first argument."""
    if type(fn) is Batch:
        return fn.method[0]
    receiver = getattr(fn, "__self__", None)
    if isinstance(receiver, torch.Tensor):
        return receiver
    return args[0] if args else None


def _asks_in_place(fn, args, kwargs):
    """``facts.asks_in_place``; a tensor method's batch (``x.relu``) takes no ``inplace`` flag."""
    return type(fn) is not Batch and facts.asks_in_place(fn, args, kwargs)


def _in_place_function_of_items(fn, args, kwargs):
    """Whether ``fn`` is a function (not a tensor's method, not an operator) that changes its first argument in
    place (``F.relu(x, inplace=True)``, ``nn.init.constant_(x, c)``, ``torch.relu_(x)``), and that argument is
    each instance's own tensor (a Batch's items): a rule would change a tensor stacked from them, not theirs,
    so each instance's runs on its own."""
    target = args[0] if args else None
    if type(target) is not Batch or target.owner != "items" or type(fn) is Batch or fn is operator.setitem \
            or fn in _IN_PLACE or isinstance(getattr(fn, "__self__", None), torch.Tensor):
        return False
    return _asks_in_place(fn, args, kwargs) or getattr(fn, "__name__", "").endswith("_") and \
        (getattr(fn, "__module__", None) or "").startswith("torch")  # (not ``operator.not_``, ``and_``)


def _changes_in_place(fn):
    """Whether callable ``fn`` is an in-place op: ``x += y``, ``x[i] = y``, ``x.mul_(y)``."""
    if type(fn) is Batch:
        return fn.method is not None and fn.method[1].endswith("_")
    return fn in _IN_PLACE or fn is operator.setitem or getattr(fn, "__name__", "").endswith("_")


def _call(n, fn, args, kwargs):
    if n == 1:
        if type(fn) is nn.Embedding and not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
            # (one instance left in a loop: its lookups share the run's gate)
            return lazy_weights.lookup(fn, args[0])
        out = _row_changed_on_a_copy(fn, args, kwargs)
        if out is not NotImplemented:
            return out
        return fn(*args, **kwargs) if kwargs else fn(*args)
    if _in_place_function_of_items(fn, args, kwargs):
        return per_instance(n, fn, args, kwargs)
    kind = type(fn)
    if kind is Batch:
        bt.ready(fn)
        if fn.method is not None:
            base, name = fn.method
            rule = BATCH.by_method.get(name)
            if rule is not None:
                out = rule(n, base, args, kwargs or {})
                if out is not NotImplemented:
                    return out
            found = padded.of(base)
            if found is not None:  # (``x.t().unsqueeze(0)`` of each instance's rows: a Conv1d's input)
                out = padded.method(n, name, found, args, kwargs or {})
                if out is NotImplemented and name in ragged_products.METHODS:  # (``a.t().mm(enc)``)
                    out = ragged_products.product(n, ragged_products.METHODS[name], (base, *args), kwargs)
                return per_instance(n, fn, args, kwargs) if out is NotImplemented else out
            found = rows.of(base)
            if found is not None:  # (``torch.stack(hs).mean(0)`` of lists of their own lengths)
                out = rows.along_rows(n, name, found, args, kwargs or {}, method=True)
                if out is NotImplemented:  # (``xs.tanh()``, ``xs.squeeze(-1)``: each row alone)
                    out = row_wise.method(n, name, found, args, kwargs or {})
                if out is NotImplemented:  # (``xs.t()``, ``xs.unsqueeze(0)``: the rows' dim moved)
                    out = padded.rows_method(n, name, found, args, kwargs or {})
                if out is NotImplemented and name in ragged_products.METHODS:  # (``enc.mm(h.t())``)
                    out = ragged_products.product(n, ragged_products.METHODS[name], (base, *args), kwargs)
                # (else each instance's own call: its views differ in shape, which vmap would pad)
                return per_instance(n, fn, args, kwargs) if out is NotImplemented else out
            return _vmapped_or_per_instance(n, fn, (base, *args), kwargs, method=name)
        if _methods_of_python_values(fn, args, kwargs):  # (``word.upper()`` of each instance's str: Python's work)
            return _each_instance(n, fn, args, kwargs)
        out = chosen.grouped(n, fn, args, kwargs, call)  # (``self.ops[op[i]](x)``: one call per module)
        return per_instance(n, fn, args, kwargs) if out is NotImplemented else out
    for a in args:
        if type(a) is Batch:
            break
    else:
        if not kwargs or not any(type(v) is Batch for v in kwargs.values()):
            return _unbatched(n, fn, args, kwargs)
    if any(type(a) is Batch and a.struct is not None and a.owner is None for a in args) and \
            facts.value_call(fn, (), None):  # (``min([3, self.k])``: a list display of shared items is one list)
        out = _of_shared_lists(n, fn, args, kwargs)
        if out is not NotImplemented:
            return out
    try:
        rule = BATCH.by_callable.get(fn)
    except TypeError:  # unhashable callable
        rule = None
    if _lazy_among(args) or (kwargs and _lazy_among(kwargs.values())):
        if rule is elementwise and fn in _LAZY and not kwargs:
            return Batch(n, thunk=LazyOp(n, fn, args))
        if rule is not _build_rule:  # (a tuple or list holds its lazy elements as they are)
            for a in (*args, *(kwargs.values() if kwargs else ())):
                bt.resolved(a)
    if rule is None and isinstance(fn, nn.Module) and not has_hooks(fn):
        rule = BATCH.by_module.get(type(fn))
    if rule is None and bt.plain_namedtuple(fn) and not kwargs and len(args) == len(fn._fields):
        return bt.from_struct(fn, list(args), n)  # (a namedtuple of batched fields: its instances' are its fields')
    if rule is None and bt.plain_dataclass(fn):  # (``State(h, c)``: likewise, each instance's made where needed)
        fields = bt.dataclass_fields(fn, args, kwargs or {})
        if fields is not None:
            return bt.from_struct(fn, fields, n)
    if rule is not None:
        out = rule(n, fn, args, kwargs or {})
        if out is not NotImplemented:
            return out
    if args and type(args[0]) is Batch and (args[0].owner == "items" or type(args[0].thunk) is bt.Views or
                                            rows.joined(args[0])):
        found = rows.of(args[0])
        try:
            name = rows.REDUCING.get(fn) if found is not None else None
        except TypeError:  # (an unhashable callable)
            name = None
        if name is not None:  # (``torch.max(torch.stack(hs), 0)``)
            out = rows.along_rows(n, name, found, args[1:], kwargs or {})
            if out is not NotImplemented:
                return out
    if padded.holds(args):  # (``F.relu(self.conv(xs.t()))``: lengths along another dim)
        out = padded.call(n, fn, args, kwargs or {})
        if out is NotImplemented and fn in ragged_products.PRODUCTS:  # (``a.t() @ enc``)
            out = ragged_products.product(n, fn, args, kwargs)
        return _helper_or_per_instance(n, fn, args, kwargs) if out is NotImplemented else out
    if row_wise.holds_rows(args):  # (``mlp(self.embed(words[:n]))``: each row alone)
        out = row_wise.call(n, fn, args, kwargs or {})
        if out is NotImplemented:  # (``torch.transpose(xs, 0, 1)``: the rows' dim moved)
            out = padded.rows_call(n, fn, args, kwargs or {})
        if out is NotImplemented and fn in ragged_products.PRODUCTS:  # (``enc @ h.t()``: h each instance's own)
            out = ragged_products.product(n, fn, args, kwargs)
        return _helper_or_per_instance(n, fn, args, kwargs) if out is NotImplemented else out
    return _vmapped_or_per_instance(n, fn, args, kwargs)


def _helper_or_per_instance(n, fn, args, kwargs):
    """A call no rule batches (of stretches, each instance's own length; of a compiled function): where ``fn`` is
    a helper of the user's or a compiled function (``self.node_forward(x, child_c, child_h)``), its program run
    once for the group, each op in it seeing the stretches; else each instance's own call (one that changes
    something in place: each instance's changes before the next one's reads)."""
    out = _run_helper(n, fn, args, kwargs) if helpers.kind(fn) is not None else NotImplemented
    return per_instance(n, fn, args, kwargs) if out is NotImplemented else out


def _row_changed_on_a_copy(fn, args, kwargs):
    """An in-place op whose backward reads what it changes (``x.relu_()``, ``x.sigmoid_()``, ``F.relu(x, True)``, a
    module built in place) of one instance's tensor ``x`` that is a whole row of one tensor of the batch, with
    gradients on: the op changes a copy of the row, which is then written into it. In eager code ``x`` is a tensor
    of its own; here its version counter is the whole tensor's, so what the op saved for its backward would count
    as changed once another instance's row of that tensor changes, and the backward would raise where eager's
    computes. NotImplemented (nothing done) where it is no such op."""
    # (every op of one instance comes here: a run that changes nothing in place, or an op that saves nothing of
    # what it changes, is told apart first)
    if sharing.state.fresh or not torch.is_grad_enabled() or not _saves_its_target(fn, args, kwargs):
        return NotImplemented
    x = _in_place_target(fn, args)
    if type(x) not in PLAIN_TENSORS or x._base is None or not _a_whole_row(x):
        return NotImplemented
    kwargs = kwargs or {}
    values = [v for v in (*args, *kwargs.values()) if v is not x]
    if not (x.requires_grad or any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)) \
            or _in_storages({x.untyped_storage().data_ptr()}, values):
        return NotImplemented  # (nothing to save; or an argument overlapping x, whose overlap torch checks)
    copy = x.clone()
    if getattr(fn, "__self__", None) is x:  # (``x.relu_()``: the copy's method)
        out = getattr(copy, fn.__name__)(*args, **kwargs)
    else:
        out = fn(copy, *args[1:], **kwargs)
    x.grad_fn  # (read: a view of a base changed since regenerates it)
    with saved_versions.writing(x):
        x.copy_(copy)
    bt.note_made_from([x], copy, written=True)  # (what the op saved is the copy: a later change of x moves it)
    return x if out is copy else out


def _a_whole_row(x):
    """Whether view ``x`` is one whole row of its base (one instance's value in a batch's tensor)."""
    base = x._base
    return base.dim() == x.dim() + 1 and base.shape[0] > 1 and base.shape[1:] == x.shape and \
        base.stride()[1:] == x.stride()


# In-place Tensor methods whose backward reads their result or their input (not ``add_``, ``zero_``, ``x[i] = v``)
_SAVING_IN_PLACE = frozenset({
    "relu_", "sigmoid_", "tanh_", "exp_", "log_", "sqrt_", "abs_", "clamp_", "clamp_min_", "clamp_max_", "pow_",
    "sin_", "cos_", "tan_", "asin_", "acos_", "atan_", "sinh_", "cosh_", "reciprocal_", "rsqrt_", "log1p_",
    "expm1_", "log2_", "log10_", "exp2_", "erf_", "logit_", "atan2_", "lerp_", "addcmul_", "addcdiv_"})


def _saves_its_target(fn, args, kwargs):
    """Whether in-place op ``fn`` writes its target's elements, keeping its shape, and its backward reads what it
    changes (``_SAVING_IN_PLACE``, ``torch.relu_``, an elementwise function or module with an ``inplace`` flag)."""
    if isinstance(getattr(fn, "__self__", None), torch.Tensor):
        return getattr(fn, "__name__", None) in _SAVING_IN_PLACE
    if facts.among(fn, intrinsics.FUNCTIONS_FRESH):
        return True
    return facts.asks_in_place(fn, args, kwargs) and (
        isinstance(fn, facts.ELEMENTWISE_MODULES) or facts.among(fn, facts.ELEMENTWISE))


class LazyOp:
    """``fn(*args)`` on n instances where an argument is lazy (arithmetic of ``facts.LAZY``): run by ``call``
    when read."""

    __slots__ = ("n", "fn", "args", "versions")

    def __init__(self, n, fn, args):
        self.n, self.fn, self.args = n, fn, args
        self.versions = bt.tensor_versions(args)

    def depends_on(self):
        return [d for a in self.args for d in bt.lazies_in(a)]

    def compute(self):
        if bt.changed(self.versions):
            raise RuntimeError(
                "recompile: a tensor that arithmetic on a deferred call's result reads was changed in place "
                "before that arithmetic ran (batched mode defers calls whose results are only returned); "
                "change a copy instead, or compile with mode='sequential'")
        return call(self.n, self.fn, self.args)


def _lazy_among(values):
    """Whether a value is lazy (a deferred call's result) where an op's rule would read it; Rows or a Padded whose
    views are not made yet (``bt.Views``) are read by their rules as they are."""
    for a in values:
        if type(a) is Batch and (a.thunk is not None and type(a.thunk) is not bt.Views
                                 or (a.pieces is not None and bt.is_lazy(a))):
            return True
    return False


def attr(n, x, name):
    """``x.name`` (the common case of ``getattr``: a constant name)."""
    if type(x) is not Batch:
        return getattr(x, name)
    return call(n, getattr, (x, name))


def item(n, x, index):
    """``x[index]``."""
    if type(x) is not Batch and type(index) is not Batch:
        out = x[index]
        return out if n == 1 or not _copied(x, out) else _made_once(n, out)
    if type(x) is Batch and x.struct is not None:
        return call(n, operator.getitem, (x, index))  # (a tuple's or dict's item: its rule picks the part)
    # (call's path for getitem, without its dispatch: the gather rule, else vmap or one by one)
    if type(x) is Batch and x.thunk is not None and type(x.thunk) is not bt.Views:
        bt.force(x)  # (an RNN module's outputs, laid out when first read; views are read where they lie)
    out = gather(n, operator.getitem, (x, index), None)
    if out is NotImplemented:
        out = _vmapped_or_per_instance(n, operator.getitem, (x, index), None)
    return out


def fused(n, kernel, args):
    """A fused op (``codegen.fused``) for n instances: one call of the kernel on the batched tensors when
    that means the same for each instance, else its members one by one, each by its own rule.

    It means the same when every batched argument is a tensor of one per-instance rank r, no shared
    tensor has a larger rank (broadcasting lines it up within each instance), all tensors but bool
    ones have one dtype (a batch turns an instance's 0-d tensor into a dimensioned one, which
    promotes otherwise), every result depends on a batched argument (else it would be one object
    shared by all) and the callables are still the ones the program was built with."""
    if n == 1:
        return kernel.entry(*args)
    if not kernel.same_callables(args):  # one rebound since the build: it may not be elementwise
        return kernel.batched(n, *args)
    values, rank, dtype, shared_rank, batched = list(args), None, None, 0, 0
    for i in kernel.data_positions:  # (the callables were checked above)
        a = args[i]
        kind = type(a)
        if kind is Batch:
            t = a.tensor if a.owner == "tensor" else bt.tensor_of(a)
            if t is None or (rank is not None and t.dim() - 1 != rank):
                return kernel.batched(n, *args)
            rank = t.dim() - 1
            values[i] = t
            batched |= 1 << i
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):  # (a Parameter too)
            t = a
            shared_rank = max(shared_rank, a.dim())
        else:
            if kind not in _NUMBERS:
                return kernel.batched(n, *args)
            continue
        if t.dtype is not torch.bool:  # (bool is the lowest category: it never decides a promotion)
            if dtype is not None and t.dtype != dtype:
                return kernel.batched(n, *args)
            dtype = t.dtype
    if rank is None or shared_rank > rank or not all(mask & batched for mask in kernel.dep_masks):
        return kernel.batched(n, *args)
    out = kernel.entry(*values)
    if not kernel.deps:  # a chain whose results nothing reads: run for its errors, it returns nothing
        return None
    if len(kernel.deps) == 1:
        return bt.from_tensor(out)
    return tuple(bt.from_tensor(o) for o in out)


def _unbatched(n, fn, args, kwargs):
    """No argument differs between instances: run once if every instance may share the result (a read, an
    immutable value, or in a run that changes nothing in place a torch op that draws nothing). A list (or a
    dict display) of shared items is kept as them (a struct): each instance gets its own list only where it
    needs one, and a torch op reads them as one shared list (``_vmapped_or_per_instance``)."""
    if fn is intrinsics.build_list and not kwargs:
        return bt.from_struct(list, list(args), n)
    if fn is intrinsics.build_dict:  # (a dict of shared values: held as them too, each instance's made where needed)
        out = dict_display(n, fn, args, kwargs)
        if out is not NotImplemented:
            return out
    if fn is intrinsics.new_cell:  # (a variable of each instance's own, which a nested function uses)
        return cells.new_cells(n)
    try:
        reads = fn in _SHAREABLE
        known = reads or fn in _PURE or (fn in _AUGMENTED and facts.immutable(args[0])) or \
            (sharing.state.fresh and computes_alike(fn, kwargs))
    except TypeError:  # unhashable callable
        reads = known = False
    # (Python's builtins of plain data; not of a tensor computed once, which Python code gets a copy of: below)
    valued = facts.value_call(fn, args, kwargs) and not sharing.any_fresh((*args, *(kwargs or {}).values()))
    known = known or valued
    if not known and helpers.kind(fn) is not None:
        # an undecorated helper of shared values (``init_state(self)``): its compiled program run once for the
        # group, where each op inside is computed once or per instance as that op needs
        out = _run_helper(n, fn, args, kwargs)
        if out is not NotImplemented:
            return out
    if not known and _draws_per_element(fn, args, kwargs):
        # (``self.dropout(embedded)`` of a value every instance shares: each instance's own mask, drawn at once)
        return _dropped_for_each(n, fn, args, kwargs or {})
    if not known and sharing.any_fresh((*args, *(kwargs.values() if kwargs else ()))):
        # Python code of a tensor computed once for every instance: each instance its own copy (``own``)
        _count(fn, n, fallbacks.FRESH if sharing.state.fresh else fallbacks.FRESH_CHANGED)
        results = [sharing.call_owning(fn, args, kwargs) for _ in range(n)]
        return results[0] if all(r is results[0] for r in results) else bt.from_items(results)
    first = fn(*args, **kwargs) if kwargs else fn(*args)
    if fn is operator.getitem and _copied(args[0], first):
        return _made_once(n, first)
    if valued and type(first) is list and _made_anew(fn) and all(facts.immutable(v) for v in first):
        # (``sorted(self.names)``: a new list of shared values, each instance's own made where it needs one)
        return bt.from_struct(list, first, n)
    if valued and type(first) in _DICT_VIEWS:  # (``self.config.items()``: a view of a dict every instance shares)
        return first
    # (a pure call giving back an argument, ``as_sequence`` of a shared list, makes nothing new: shared as it is;
    # nor does a builtin's read of what a shared container holds, ``max(self.lists)``, ``self.config.get(k)``)
    reads = reads or (valued and _held_by(first, args, fn))
    shared = known and (facts.immutable(first) or any(first is a for a in args)
                        or (sharing.state.fresh and sharing.shareable_result(first)))
    if reads or shared:
        if reads and isinstance(first, torch.Tensor) and sharing.any_fresh(args):
            sharing.mark_fresh(first)  # (a view of a tensor computed once: the same memory)
        elif not reads and not facts.immutable(first) and not sharing.handed_back(first, fn, args):
            sharing.mark_fresh(first)  # (not what the caller holds, nor a view of it: that is what it was)
        return first
    if not sharing.state.fresh and _new_tensor(first, fn, args, kwargs) and (known or computes_alike(fn, kwargs)):
        # a run that changes values in place: each instance its own row. Where the result has a gradient, the op
        # runs over every instance's rows, so that an in-place change of a result its backward reads is refused
        # as eager refuses it (a copy of one result would hide the change)
        receiver, name = getattr(fn, "__self__", None), tensor_method(fn)
        spread_kwargs = {k: _rows_of_each(n, v) for k, v in kwargs.items()} if kwargs else None
        if first.grad_fn is not None and isinstance(receiver, torch.Tensor) and name is not None:
            return call(n, Batch(n, method=(_rows_of_each(n, receiver), name)),
                        [_rows_of_each(n, a) for a in args], spread_kwargs)
        if first.grad_fn is not None and _tensors_in((*args, *(kwargs.values() if kwargs else ()))):
            return call(n, fn, [_rows_of_each(n, a) for a in args], spread_kwargs)
        return _made_once(n, first)
    # a side effect, a random draw or a fresh object (a tensor, a list) per instance, as n runs would make
    _count(fn, n, fallbacks.FRESH if sharing.state.fresh else fallbacks.FRESH_CHANGED)
    results = [first] + [fn(*args, **kwargs) if kwargs else fn(*args) for _ in range(n - 1)]
    if all(r is first for r in results):  # (None from a helper run for its effect)
        return first
    return bt.from_items(results)


def _held_by(value, args, fn):
    """Whether ``value`` is one of ``args`` or ``fn``'s receiver, or what one of them that is a list, tuple, set or
    dict holds (an item, a dict's value)."""
    for a in (*args, getattr(fn, "__self__", None)):
        if value is a or (type(a) in facts.PLAIN_CONTAINERS and any(
                value is v for v in (a.values() if type(a) is dict else a))):
            return True
    return False


def _made_anew(fn):
    """Whether ``fn``, a ``facts.value_call``, makes the list it returns (``sorted``, ``list``, ``"a b".split()``),
    where ``max(lists)`` or ``d.get(k)`` hands back one that exists."""
    return fn is sorted or fn is list or (type(fn) is BOUND_BUILTIN and facts.immutable(fn.__self__))


def _copied(x, out):
    """Whether ``out = x[index]`` of a tensor x is a new tensor (an index of a tensor, a list, an array, a range),
    not a view of x (ints, slices, ``...``, ``None``, a 0-d integer tensor)."""
    return isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and not out._is_view()


def _rows_of_each(n, value):
    """A shared tensor as n instances' rows of their own, in a list or tuple too (other values as they are)."""
    if type(value) in (list, tuple) and _tensors_in(value):
        return bt.from_struct(type(value), [_rows_of_each(n, v) for v in value], n)  # (``torch.cat([w, w])``)
    return _copies(n, value) if isinstance(value, torch.Tensor) else value


def _copies(n, t):
    """Tensor ``t`` as n instances' rows, each a copy of its own."""
    return bt.from_tensor(t.unsqueeze(0).expand(n, *t.shape).clone())


def _tensors_in(values):
    """The tensors among ``values`` and in the lists, tuples and dicts among them (one level)."""
    found = []
    for v in values:
        inner = v.values() if type(v) is dict else v if type(v) in (list, tuple) else (v,)
        found.extend(t for t in inner if isinstance(t, torch.Tensor))
    return found


def _new_tensor(out, fn, args, kwargs):
    """Whether ``out`` = ``fn(*args, **kwargs)`` is a tensor in memory of its own: no view, none of the tensors
    the call was given (its receiver, those in its arguments' lists too); not a 0-d integer tensor (an index that
    views what it indexes, which an instance's rows of one batch cannot) nor a leaf that requires grad (which eager
    code may not change in place; an instance's rows of one batch are no leaf)."""
    if type(out) is not torch.Tensor or out._is_view() or (out.dim() == 0 and not out.is_floating_point()) \
            or (out.requires_grad and out.grad_fn is None):
        return False
    place = out.untyped_storage().data_ptr()
    given = _tensors_in((*args, *(kwargs.values() if kwargs else ()), getattr(fn, "__self__", None)))
    return not any(t.untyped_storage().data_ptr() == place for t in given)


def _made_once(n, t):
    """A new tensor ``t`` computed once for n instances: shared where the run changes nothing in place (noted,
    so that Python code run for one instance copies it), else each instance's own rows of one copy, as each
    instance's own call would make its own tensor."""
    if sharing.state.fresh:
        return sharing.mark_fresh(t)
    return _copies(n, t)


def per_instance(n, fn, args, kwargs=None, why=None):
    """The op run once per instance; the results batched."""
    _count(fn, n, why or fallbacks.reason(fn))
    kwargs = kwargs or {}
    given = (*args, *kwargs.values(), fn.method[0] if type(fn) is Batch and fn.method else None)
    # (a value held as each instance's own tensor, which an op before may have read through a tensor stacked
    # from them: see below)
    owned = [(t, t._version) for x in given if type(x) is Batch and x.owner == "items"
             for t in x.items if isinstance(t, torch.Tensor) and not t.is_inference()] if bt.MADE_FROM else ()
    # (an in-place op with gradients on: each instance's row of one tensor that needs no gradient (a value made
    # once, as each instance's own copy) becomes one that needs it once an instance's op reads one that does;
    # the other instances' rows, viewed before, count as leaves, which autograd lets no one change, until what
    # autograd records of them is read again)
    target = _in_place_target(fn, args) if torch.is_grad_enabled() and (
        _changes_in_place(fn) or _asks_in_place(fn, args, kwargs)) else None
    items = bt.items_of(target) if type(target) is Batch else None
    # (a compiled function that changes something, its instances in turn: what plain Python does, at eager's
    # speed, not a batched run of one instance, whose calls wait on each other's changes)
    plain = type(fn) is not Batch and _runs_plain(fn)
    results = []
    for k in range(n):
        if items is not None and isinstance(items[k], torch.Tensor) and items[k]._base is not None:
            items[k].grad_fn  # (read: a view of a base changed since regenerates it)
        one, values, named = bt.instance(fn, k), [bt.instance(x, k) for x in args], \
            {key: bt.instance(v, k) for key, v in kwargs.items()}
        if plain or type(fn) is Batch and _runs_plain(one):
            with debugging.plain_here():
                results.append(sharing.call_owning(one, values, named))
            continue
        if one is intrinsics.setitem_fresh and isinstance(values[0], torch.Tensor):
            values[0] = values[0].clone()  # (a row may view a value every instance shares: see intrinsics.owned)
        out = _row_changed_on_a_copy(one, values, named)
        results.append(sharing.call_owning(one, values, named) if out is NotImplemented else out)
    if bt.CACHES:  # (a value joined from branches, changed through the tensor of its rows: see bt.CACHES)
        bt.caches_changed()
    for t, version in owned:
        if t._version != version:
            bt.changed_in_place(t)
    for x in given:
        if type(x) is Batch and x.owner == "items":
            x.tensor = None  # the op may have changed the items: a tensor made from them is stale
            rows.forget_stale_copy(x)  # (and so is a padded copy of them)
    return bt.from_items(results)


def _runs_plain(fn):
    """Whether ``fn`` is a compiled function that changes something in place: run per instance as plain Python."""
    return helpers.compiled_function(fn) and helpers.changes_in_place(fn)


# builtins that only regroup the items they are given, and read no tensor's values: unpacked arguments
# (``hs, cs = zip(*pairs)``, each instance's list of its own length) are each instance's Python work, as in
# Python, and the tensors they regroup stay the rows they were
_REGROUPING = frozenset({zip})


def per_instance_or_once(n, thunk, values, callee):
    """A call of ``callee`` whose arguments are unpacked (``f(*xs, **kw)``), run per instance on ``values``."""
    if n == 1:
        return thunk(*values)
    if type(callee) is not Batch and facts.among(callee, _REGROUPING):  # (a callee may be unhashable)
        return bt.from_items([thunk(*[bt.instance(v, k) for v in values]) for k in range(n)])
    _count(thunk, n, fallbacks.UNPACKED)
    return bt.from_items([sharing.call_owning(thunk, [bt.instance(v, k) for v in values]) for k in range(n)])


def add_counts(into, counts):
    """Per-instance ``counts`` ({name: count}) added to ``into``'s."""
    for name, k in counts.items():
        into[name] = into.get(name, 0) + k


def _count(fn, n, why):
    name = _name(fn)
    counters.per_instance[name] = counters.per_instance.get(name, 0) + n
    if config.PER_INSTANCE != "allow":
        fallbacks.fell_back(name, n, why)


# -- torch.func.vmap for torch ops without a rule here

def _draws_per_element(fn, args, kwargs):
    """Whether ``fn`` draws one number per element of the tensor it is given first (dropout: a module with no
    hooks, or the function), not in place."""
    if not args or type(args[0]) not in PLAIN_TENSORS:
        return False
    if type(fn) in facts.ELEMENT_DRAW_MODULES:
        return not has_hooks(fn) and not fn.inplace and "forward" not in vars(fn)
    return facts.among(fn, facts.ELEMENT_DRAWS) and not (kwargs or {}).get("inplace") and not (
        len(args) > 3 and args[3])


def _dropped_for_each(n, fn, args, kwargs):
    """Dropout of a tensor every instance shares: in training, each instance's own mask, drawn at once over the
    tensor's rows for every instance (as a batch's are), its gradient summed back; out of training the tensor
    itself, once, as eager's gives it."""
    if isinstance(fn, nn.Module):
        training = fn.training and fn.p > 0
    else:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
    if not training:
        return fn(*args, **kwargs)
    x = args[0]
    return bt.from_tensor(fn(x.expand(n, *x.shape), *args[1:], **kwargs))


def computes_alike(fn, kwargs):
    """Whether ``fn`` run again on the same values gives an equal, fresh result and changes nothing: a torch
    function, a method of a tensor or a module of a kind batch rules know (not one that draws random numbers
    or writes in place). What changes it in place afterwards is for the caller to rule out (``runtime.sharing``)."""
    if kwargs and ("out" in kwargs or kwargs.get("inplace") or kwargs.get("training")):
        return False
    kind = type(fn)
    if kind is BOUND_BUILTIN or kind is types.MethodType:
        name = tensor_method(fn)
        if name is not None:
            return not name.endswith("_") and name not in facts.DRAWING_METHODS
        owner = getattr(fn, "__self__", None)
        if not (owner is None or isinstance(owner, (type, types.ModuleType))):
            return False  # (a method of an object: a module's parameters(), a distribution's sample())
    if kind is nn.Sequential:  # (as alike as each of its modules)
        return not has_hooks(fn) and all(computes_alike(m, None) for m in fn)
    if isinstance(fn, nn.Module):
        return kind in BATCH.by_module and kind not in facts.DRAWS and not has_hooks(fn) and \
            not getattr(fn, "inplace", False)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    return (isinstance(module, str) and (module == "torch" or module.startswith("torch."))
            and not module.startswith(("torch.utils", "torch.distributions")) and isinstance(name, str)
            and not name.endswith("_") and not any(word in name for word in _STATEFUL_NAMES)
            and not facts.among(fn, facts.DRAWS))


# (torch functions whose names say they draw or keep state: not computed once for all instances)
_STATEFUL_NAMES = ("rand", "dropout", "bernoulli", "multinomial", "normal", "poisson", "binomial", "rrelu",
                   "batch_norm", "instance_norm", "sample", "seed", "manual", "set_", "empty")


def _shared_structs(values, nested=False):
    """``values`` with each list or tuple of shared items, held as a struct (``_unbatched``), made the one
    list or tuple every instance has; None if there is none. ``nested``: of such structs too, for a torch op
    (``torch.tensor([[1.0, 0.0]])``), which keeps none of them; a builtin may hand back an inner list
    (``max([[1], [2]])``), each instance's own."""
    out, found = list(values), False
    for i, v in enumerate(out):
        plain = _shared_struct(v, nested)
        if plain is not _DIFFERS:
            out[i], found = plain, True
    return out if found else None


_DIFFERS = object()


def _shared_struct(v, nested):
    """The one list or tuple every instance has, where ``v`` is a struct of shared items (or, ``nested``, of such
    structs); else ``_DIFFERS``."""
    if type(v) is not Batch or v.struct is None or v.owner is not None:
        return _DIFFERS
    items = []
    for p in v.struct[1]:
        if type(p) is Batch:
            p = _shared_struct(p, nested) if nested else _DIFFERS
            if p is _DIFFERS:
                return _DIFFERS
        items.append(p)
    return bt.build(v.struct[0], items)


def _run_helper(n, fn, args, kwargs):
    """Undecorated helper ``fn`` compiled and run once for the group (``runtime.helpers``), or NotImplemented.
    The helper changes nothing in place, but where this run does, the helper's run shares nothing either: what it
    hands back (a tensor, in a list or a view of one) this run may change, each instance its own."""
    with sharing.unshared(not sharing.state.fresh):
        out = helpers.run(n, fn, args, kwargs or {})
    if out is NotImplemented:
        return out
    add_counts(counters.per_instance, out[1])  # (the helper's run's, counted as this run's)
    return out[0]


def _of_shared_lists(n, fn, args, kwargs):
    """``fn`` of arguments every instance shares, lists and dicts the program built of shared items among them:
    run once, as ``_unbatched`` runs it (NotImplemented where an argument differs between instances)."""
    plain = _shared_structs(args) or list(args)
    plain_kwargs = dict(zip(kwargs, _shared_structs(kwargs.values()) or kwargs.values())) if kwargs else kwargs
    if any(type(a) is Batch for a in (*plain, *(plain_kwargs or {}).values())):
        return NotImplemented
    return _unbatched(n, fn, tuple(plain), plain_kwargs)


def _vmapped_or_per_instance(n, fn, args, kwargs, method=None):
    if method is None and _python_work(fn, args, kwargs):  # (Python's work on each instance's str or list)
        return _each_instance(n, fn, args, kwargs)
    if method is None and helpers.compiled_function(fn):
        # (``self.encoder(tree)``, a module whose forward is compiled: its program run once for the group)
        return _helper_or_per_instance(n, fn, args, kwargs)
    if method is None and isinstance(fn, nn.Module) and has_backward_hooks(fn):
        return per_instance(n, fn, args, kwargs)  # (its backward hooks run for each call, as eager's: not under vmap)
    if method is None and args and type(args[0]) is Batch and _in_place_function(fn):
        # (``torch.exp_(v)`` is ``v.exp_()``: vmap would change a stack of the instances' tensors, not theirs)
        return call(n, Batch(n, method=(args[0], fn.__name__)), args[1:], kwargs)
    bound = tensor_method(fn) if method is None else None  # (``base.scatter_add``: a shared tensor's method)
    torch_op = method is not None or bound is not None or torch_callable(fn)
    if torch_op:  # (a torch op neither keeps nor changes a list it is given: one may do)
        plain = _shared_structs(args, nested=True)
        plain_kwargs = _shared_structs(kwargs.values(), nested=True) if kwargs else None
        if plain is not None or plain_kwargs is not None:
            args = tuple(plain) if plain is not None else args
            if plain_kwargs is not None:
                kwargs = dict(zip(kwargs, plain_kwargs))
            if method is not None:
                return call(n, Batch(n, method=(args[0], method)), args[1:], kwargs)
            return call(n, fn, args, kwargs)
    if torch_op and not (method or bound or "").endswith("_"):
        out = _vmapped(n, fn, args, kwargs or {}, method)
        if out is not NotImplemented:
            return out
    if method in _IN_PLACE_UNDER_VMAP:
        out = _in_place_under_vmap(n, method, args[0], args[1:], kwargs or {})
        if out is not NotImplemented:
            return out
    if method is not None:
        return per_instance(n, fn, args[1:], kwargs)
    if bound is None:  # (an undecorated helper of the user's, a method of a module too: compiled, one run)
        out = _run_helper(n, fn, args, kwargs)
        if out is not NotImplemented:
            return out
    return per_instance(n, fn, args, kwargs)


def _on_python_sequences(fn, args, kwargs):
    """Whether ``fn`` is an operator that changes nothing (``word[-1:] + word[:1]``, ``ch == "a"``, ``ll + lr`` of
    two lists) on each instance's own str, list or tuple, with shared str, int, slice, list or tuple operands:
    Python's work on Python values, as eager code does it, one instance at a time (the items of a list are
    not touched; a tensor among them is only handed on)."""
    if kwargs or getattr(fn, "__module__", None) not in ("_operator", "operator") or \
            not facts.among(fn, facts.PURE):
        return False
    batched = [a for a in args if type(a) is Batch]
    return bool(batched) and all(_python_sequences(a) for a in batched) and \
        all(type(a) in _PYTHON_OPERANDS for a in args if type(a) is not Batch)


def _each_instance(n, fn, args, kwargs):
    """``fn`` (or each instance's callable of Batch ``fn``) called on each instance's arguments, with no warning:
    for Python's work on Python values, which no batch does at once."""
    if not kwargs and type(fn) is not Batch:
        return bt.from_items(list(map(fn, *[bt.items_of(a) if type(a) is Batch else repeat(a, n) for a in args])))
    return bt.from_items([bt.instance(fn, k)(*[bt.instance(a, k) for a in args],
                                             **{key: bt.instance(v, k) for key, v in (kwargs or {}).items()})
                          for k in range(n)])


def _python_work(fn, args, kwargs):
    """Whether ``fn`` on ``args`` is Python's work on Python values, which eager code does one instance at a time
    too: an operator on sequences, ``in``, or a method of a shared str (``"-".join(words)``)."""
    return _on_python_sequences(fn, args, kwargs) or _membership_of_python_values(fn, args, kwargs) or \
        _shared_value_read(fn, args, kwargs)


def _shared_value_read(fn, args, kwargs):
    """Whether ``fn`` is a method of a shared str (``"-".join``, ``"{}:{}".format``), or one that reads a shared
    dict, list or tuple (``vocab.get(word, 0)``, ``words.index(w)``), given each instance's str, number, list or
    tuple."""
    if type(fn) is not BOUND_BUILTIN:
        return False
    kind = type(fn.__self__)
    if not (kind is str or kind is dict and fn.__name__ in ("get", "__getitem__", "__contains__")
            or kind in (list, tuple) and fn.__name__ in ("index", "count", "__contains__")):
        return False
    return any(type(a) is Batch for a in (*args, *(kwargs or {}).values())) and _python_arguments(args, kwargs)


def _python_arguments(args, kwargs):
    """Whether every argument is a Python value, no tensor: each instance's str, number, list or tuple (a Batch), or
    a shared value."""
    for a in (*args, *(kwargs or {}).values()):
        if type(a) is Batch:
            if not (_python_sequences(a) or _python_scalars(a)):
                return False
        elif isinstance(a, torch.Tensor):
            return False
    return True


def _python_scalars(b):
    """Whether Batch ``b`` holds each instance's own str, number, None or tuple, as its items."""
    return b.thunk is None and b.method is None and b.owner == "items" and set(map(type, b.items)) <= _PYTHON_SCALARS


def _python_containers(b):
    """Whether Batch ``b`` holds each instance's own str, list or tuple, a dict or set display the program built
    (``{"a": 1}``), or each instance's own container of a kind ``in`` reads without consuming it."""
    if _python_sequences(b):
        return True
    if b.thunk is not None or b.method is not None:
        return False
    if b.owner is None and b.struct is not None:
        return issubclass(b.struct[0], (dict, set))
    return b.owner == "items" and set(map(type, b.items)) <= _CONTAINERS


def _membership_of_python_values(fn, args, kwargs):
    """Whether ``fn`` is ``in`` or ``not in`` of Python values (``ch in VOWELS``, ``word not in vocab``): each
    instance's str, number or tuple, or a shared one, in a shared str, list, tuple, dict, set or range, or in each
    instance's own str, list or tuple. Python's work on Python values, one instance at a time as eager code does
    it (``in`` on an iterator, which it consumes, is not among them)."""
    place = 0 if fn is operator.contains else 1 if fn is intrinsics.not_in else None
    if place is None or kwargs or len(args) != 2:
        return False
    container, item = args[place], args[1 - place]
    if type(container) is not Batch and type(item) is not Batch:
        return False
    if not (_python_containers(container) if type(container) is Batch else type(container) in _CONTAINERS):
        return False
    return _python_scalars(item) if type(item) is Batch else type(item) in _PYTHON_SCALARS


def _methods_of_python_values(fn, args, kwargs):
    """Whether Batch ``fn`` holds each instance's method of its own immutable Python value (``word.upper``,
    ``word.startswith``, ``key.count``), given Python values: such a method changes nothing, and runs as Python
    runs it."""
    if fn.method is not None or fn.thunk is not None:
        return False
    # (the callables first: a module chosen by the data, the usual Batch of callables, fails at its first item)
    return all(type(m) is BOUND_BUILTIN and type(m.__self__) in _UNCHANGING_SELVES for m in bt.items_of(fn)) and \
        _python_arguments(args, kwargs)


_CONTAINERS = frozenset({str, list, tuple, dict, set, frozenset, range})
_PYTHON_SCALARS = frozenset({str, int, float, bool, type(None), tuple})
_UNCHANGING_SELVES = frozenset((*facts.IMMUTABLE, tuple))  # (whose methods change nothing)
_PYTHON_SEQUENCES = frozenset({str, list, tuple})
_PYTHON_OPERANDS = frozenset({str, int, slice, list, tuple})


def _python_sequences(b):
    """Whether every instance's value of Batch ``b`` is its own str, list or tuple (the items made, or a list or
    tuple the program built)."""
    if b.thunk is not None or b.method is not None:
        return False
    if b.owner == "items":
        return all(type(x) in _PYTHON_SEQUENCES for x in b.items)
    if b.pieces is not None:  # (joined from branches: ``[]`` at a leaf, ``ll + lr`` at a node)
        return all(_python_sequences(v) if type(v) is Batch else type(v) in _PYTHON_SEQUENCES
                   for v, _ in b.pieces[0])
    return b.struct is not None and b.struct[0] in (list, tuple)


def _in_place_function(fn):
    """Whether ``fn`` is torch's function form of an in-place Tensor method (``torch.exp_``, ``torch.sin_``)."""
    name = getattr(fn, "__name__", None)
    return type(name) is str and name.endswith("_") and getattr(torch, name, None) is fn \
        and hasattr(torch.Tensor, name)


def _vmapped(n, fn, args, kwargs, method):
    """fn under torch.func.vmap, where every batched argument is a tensor (a list of tensors counts)."""
    flat, dims = [], []
    spec = []
    for a in (*args, *kwargs.values()):
        if type(a) is Batch:
            if a.struct is not None and a.owner is None:
                parts = []
                for p in a.struct[1]:
                    t = bt.tensor_of(p) if type(p) is Batch else p
                    if type(p) is Batch and t is None:
                        return NotImplemented
                    parts.append((t, 0 if type(p) is Batch else None))
                spec.append(("struct", a.struct[0], len(parts)))
                for t, d in parts:
                    flat.append(t)
                    dims.append(d)
                continue
            t = bt.tensor_of(a)
            if t is None:
                return NotImplemented
            flat.append(t)
            dims.append(0)
        else:
            flat.append(a)
            dims.append(None)
        spec.append(("one",))
    keys = list(kwargs)
    positional = len(args)

    def one(*values):
        it = iter(values)
        rebuilt = []
        for s in spec:
            rebuilt.append(next(it) if s[0] == "one" else s[1](next(it) for _ in range(s[2])))
        pos, kw = rebuilt[:positional], dict(zip(keys, rebuilt[positional:]))
        if method is not None:
            return getattr(pos[0], method)(*pos[1:], **kw)
        return fn(*pos, **kw)

    # (an op vmap has no batching rule for it would run once per row, silently: refused here, it runs per
    # instance with the warning and the count every such op gets)
    looping = _VMAP_LOOPS is not None and _VMAP_LOOPS._is_vmap_fallback_enabled()
    if looping:
        _VMAP_LOOPS._set_vmap_fallback_enabled(False)
    try:
        out = torch.func.vmap(one, in_dims=tuple(dims), randomness="different")(*flat)
    except Exception:  # an op vmap cannot batch (a data-dependent shape, .item()): run it per instance
        return NotImplemented
    finally:
        if looping:
            _VMAP_LOOPS._set_vmap_fallback_enabled(True)
    return _wrap(out, n)


# torch's switch of vmap's loop over the rows for an op it has no batching rule for (a private module of
# torch's: where a version has none, vmap loops, unseen, as before)
_VMAP_LOOPS = getattr(torch._C, "_functorch", None)
if _VMAP_LOOPS is not None and not hasattr(_VMAP_LOOPS, "_set_vmap_fallback_enabled"):
    _VMAP_LOOPS = None


def _wrap(out, n):
    if type(out) is torch.Tensor:
        return bt.from_tensor(out)
    if isinstance(out, (tuple, list)):  # (a torch.return_types structseq too)
        return bt.from_struct(type(out), [_wrap(o, n) for o in out], n)
    raise TypeError(f"a batched op returned {type(out).__name__}")


# -- hand-written rules

def _tensor_args(n, args, like=None):
    """The batched tensor of each batched argument (Python numbers among them converted to ``like``'s
    dtype), or None if one is not a tensor."""
    out = []
    for a in args:
        if type(a) is Batch:
            if a.struct is not None and a.owner is None:
                return None  # (a list's items: no tensor, and reading it as one would give each instance its list)
            t = bt.tensor_of(a) if like is None else bt.tensor_like(a, like)
            if t is None:
                return None
            out.append(t)
        else:
            out.append(a)
    return out


def _numbers_as_rows(a, b):
    """The tensors of ``a`` and ``b`` where one is joined from tensors and Python numbers (``x + sum(hs)``, some
    lists empty) and the other a tensor of each instance's or a shared one: the numbers as full rows
    (``bt.rows_beside``), else None."""
    for joined, other in ((a, b), (b, a)):
        if type(joined) is not Batch or joined.pieces is None:
            continue
        t = other.tensor if type(other) is Batch and other.owner == "tensor" else \
            other if type(other) is torch.Tensor else None
        if t is None:
            continue
        rows = bt.rows_beside(joined, t.shape[1:] if type(other) is Batch else t.shape, t.dtype)
        if rows is not None:
            return [rows, t] if joined is a else [t, rows]
    return None


# ``v / t`` (``v /= t`` of a frame's own v): of a Python number v, eager computes ``t.reciprocal() * v``
# (``Tensor.__rtruediv__``), which rounds apart from one division of v's value as a tensor
_TRUE_DIVISIONS = frozenset({operator.truediv, intrinsics.itruediv_fresh})
_WIDE_FLOATS = (torch.float32, torch.float64)  # (a Python float meets them as a tensor of theirs would)
# Python's arithmetic where one instance's operands may be two numbers, another's a number and a tensor
_APART = frozenset({operator.add, operator.sub, operator.mul, *_TRUE_DIVISIONS, *intrinsics.AUGMENTED_FRESH.values()})


def _holds_numbers(value):
    """Whether Batch ``value`` holds a Python number for some instance beside others' tensors (joined from a
    branch that gives ``0.0`` and one that gives a tensor)."""
    if type(value) is not Batch or value.owner == "tensor" or value.struct is not None:
        return False
    if value.pieces is not None and value.items is None:
        return any(type(v) in _NUMBERS or _holds_numbers(v) for v, _ in value.pieces[0])
    return value.items is not None and any(type(v) in _NUMBERS for v in value.items)


def _numbers_meet(fn, a, b):
    """Whether some instance's operands of ``fn`` may both be Python numbers, or a number be divided by a tensor
    (``_numbers_apart``); not where one operand is every instance's tensor and the op no division of a number."""
    if _holds_numbers(a):
        return fn in _TRUE_DIVISIONS or type(b) in _NUMBERS or _holds_numbers(b)
    return type(a) in _NUMBERS and _holds_numbers(b)


def _numbers_apart(n, fn, a, b):
    """``fn(a, b)`` where an instance's operands may both be Python numbers (a leaf's ``loss = 0.0`` met by its
    sibling's) while others' hold tensors: those instances as Python computes them; a number over a tensor as
    eager does, ``t.reciprocal() * v``; the others by the rule; joined. NotImplemented where only the others are
    here (the rule then takes them all)."""
    a_items = bt.items_of(a) if type(a) is Batch else [a] * n
    b_items = bt.items_of(b) if type(b) is Batch else [b] * n
    tensors = [x for x in (*a_items, *b_items) if type(x) not in _NUMBERS]
    like = tensors[0].dtype if tensors and type(tensors[0]) in PLAIN_TENSORS else None
    if like is None or like.is_floating_point and like not in _WIDE_FLOATS or any(
            type(x) not in PLAIN_TENSORS or x.dtype is not like for x in tensors):
        return NotImplemented  # (a number as a half float rounds before the op, which eager's does not)
    division = fn in _TRUE_DIVISIONS
    kinds = [0 if type(x) not in _NUMBERS else 2 if type(y) in _NUMBERS else 1 if division else 0
             for x, y in zip(a_items, b_items)]
    if not any(kinds):
        return NotImplemented
    sides = []
    for kind in (0, 1, 2):
        positions = [k for k, c in enumerate(kinds) if c == kind]
        if not positions:
            continue
        m, index = len(positions), bt.long_tensor(positions)
        a_side, b_side = bt.take(a, index, positions), bt.take(b, index, positions)
        if kind == 0:
            out = fn(a_side, b_side) if m == 1 else _as_tensors(m, fn, (a_side, b_side), {}, like)
            if out is NotImplemented:
                return out
        elif kind == 1:
            out = call(m, operator.mul, (call(m, torch.reciprocal, (b_side,)), a_side))
        else:
            out = bt.from_items([fn(a_items[k], b_items[k]) for k in positions]) if m > 1 else \
                fn(a_items[positions[0]], b_items[positions[0]])
        sides.append((out, positions))
    return bt.join(n, sides)


def _dtype_hint(args):
    for a in args:
        if type(a) is Batch and a.tensor is not None:
            return a.tensor.dtype
        if type(a) is torch.Tensor:
            return a.dtype
    for a in args:
        if type(a) is Batch and bt.tensor_of(a) is not None:
            return a.tensor.dtype
    return None


@BATCH.register(*facts.ELEMENTWISE, *facts.ELEMENTWISE_MODULES)
def elementwise(n, fn, args, kwargs):
    """An op applied elementwise with broadcasting: instance values of lower rank are lined up with the
    others by inserting dims after the batch dim."""
    if kwargs and any(type(v) is Batch for v in kwargs.values()) or (fn is torch.where and len(args) == 1):
        return NotImplemented
    if fn in _NUMBER_PARAMETERS and any(type(a) is Batch for a in args[1:]):
        return NotImplemented  # (``F.hardtanh(x, lo, hi)`` of each instance's own bounds: Python numbers)
    if len(args) == 2:  # fast path: two tensors of equal rank, or a tensor and a number
        a, b = args
        ta = a.tensor if type(a) is Batch and a.owner == "tensor" else a if type(a) in _NUMBERS else None
        tb = b.tensor if type(b) is Batch and b.owner == "tensor" else b if type(b) in _NUMBERS else None
        if ta is not None and tb is not None and fn not in _IN_PLACE and (
                type(ta) in _NUMBERS or type(tb) in _NUMBERS or (ta.dim() == tb.dim() and ta.dtype is tb.dtype)):
            return bt.from_tensor(fn(ta, tb, **kwargs))
    elif len(args) == 1 and type(args[0]) is Batch and args[0].owner == "tensor":
        return bt.from_tensor(fn(args[0].tensor, **kwargs))
    # (off the fast path: Python ints per instance, and tuples or lists the program built)
    numbers = _number_rows(args) if fn in _NUMBER_OPERATORS and not kwargs else None
    if numbers is not None:
        return bt.from_items([fn(*row) for row in numbers])
    if fn in (operator.add, operator.mul) and not kwargs and len(args) == 2:
        joined = _joined_structs(n, fn, *args)
        if joined is not NotImplemented:
            return joined
    if fn in _APART and len(args) == 2 and not kwargs and _numbers_meet(fn, *args):
        apart = _numbers_apart(n, fn, *args)
        if apart is not NotImplemented:
            return apart
    return _as_tensors(n, fn, args, kwargs, _dtype_hint(args))


def _as_tensors(n, fn, args, kwargs, like):
    """``elementwise`` of arguments read as tensors, Python numbers among a batch's values as tensors of dtype
    ``like``."""
    values = _tensor_args(n, args, like)
    if values is None and len(args) == 2 and fn in _NUMBER_OPERATORS and fn not in _IN_PLACE:
        values = _numbers_as_rows(*args)  # (Python's operators only: ``torch.maximum(x, 0)`` refuses the int)
    if values is None:
        return NotImplemented
    if fn is torch.where and len(values) == 3 and values[0].dtype is torch.bool:  # (the condition apart)
        mixed = len({v.dtype for v in values[1:] if type(v) is torch.Tensor}) > 1
    else:
        mixed = len({v.dtype for v in values if type(v) is torch.Tensor}) > 1
    if mixed:
        # mixed dtypes promote by each instance's rank (a 0-d tensor gives way): two operands meet in the dtype
        # one instance's would (torch computes a binary op so), anything else is left to vmap
        if len(values) != 2:
            return NotImplemented
        one = [v[0] if type(a) is Batch else v for a, v in zip(args, values)]
        try:
            fn(*one, **kwargs)  # (what one instance's op refuses, ``bool_tensor - k``, each instance raises)
        except Exception:
            return NotImplemented
        common = torch.result_type(*one)
        values = [v.to(common) if type(v) is torch.Tensor else v for v in values]
    ranks = [v.dim() - 1 if type(a) is Batch else (v.dim() if type(v) is torch.Tensor else 0)
             for a, v in zip(args, values)]
    top = max(ranks)
    for i, (a, v) in enumerate(zip(args, values)):
        if type(a) is Batch and ranks[i] < top:
            values[i] = v.reshape(v.shape[:1] + (1,) * (top - ranks[i]) + v.shape[1:])
    out = fn(*values, **kwargs)
    if fn in _IN_PLACE:  # x += y changed x's tensor: the result is x itself
        target = args[0]
        if type(target) is not Batch or target.owner != "tensor":
            return NotImplemented
        return target
    return bt.from_tensor(out)


# Python's operators on Python numbers: a batch of per-instance numbers (a loop's steps run ahead,
# ``codegen.recurrent``; each instance's ``t.item()``) stays Python numbers, each instance's computed as Python
# computes it (Python code of Python values, not a torch op run per instance)
_NUMBER_OPERATORS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.pos, operator.invert, operator.lt, operator.le, operator.gt, operator.ge, operator.eq,
    operator.ne,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, *intrinsics.AUGMENTED_FRESH.values()})
_PYTHON_NUMBERS = (int, float, bool)


def _number_rows(args):
    """Each instance's arguments where every argument is a Python number (int, float, bool) or a batch of them,
    else None."""
    columns = []
    for a in args:
        if type(a) in _PYTHON_NUMBERS:
            columns.append(None)
        elif type(a) is Batch and a.owner == "items" and a.thunk is None and all(
                type(v) in _PYTHON_NUMBERS for v in a.items):
            columns.append(a.items)
        else:
            return None
    n = next((len(c) for c in columns if c is not None), None)
    if n is None:
        return None
    return zip(*[c if c is not None else [a] * n for a, c in zip(args, columns)])


def _joined_structs(n, fn, a, b):
    """``xs + ys`` and ``xs * k`` of tuples or lists the program built (``[1.0] * H``, ``[h] + hs``): the
    elements, batched or shared, concatenated or repeated, as Python does."""
    def parts(v):
        if type(v) is Batch and v.struct is not None and v.owner is None and v.thunk is None \
                and v.struct[0] in (list, tuple):
            return v.struct[0], list(v.struct[1])
        if type(v) in (list, tuple):
            return type(v), list(v)
        return None, None

    kind_a, parts_a = parts(a)
    kind_b, parts_b = parts(b)
    if fn is operator.add and kind_a is not None and kind_a is kind_b:
        return bt.from_struct(kind_a, parts_a + parts_b, n)
    own_a, own_b = bt.own_lists(a), bt.own_lists(b)
    if fn is operator.add and (own_a or own_b) and (own_a or kind_a is list) and (own_b or kind_b is list):
        # (``stack + [(h, c)]`` of each instance's own list: each instance's new list, as Python makes it)
        each_a, each_b = (own or (bt.items_of(v) if type(v) is Batch else [v] * n) for own, v in
                          ((own_a, a), (own_b, b)))
        return bt.from_items([x + y for x, y in zip(each_a, each_b)])
    if fn is operator.mul and kind_a is not None and type(b) is int:
        return bt.from_struct(kind_a, parts_a * b, n)
    if fn is operator.mul and kind_b is not None and type(a) is int:
        return bt.from_struct(kind_b, a * parts_b, n)
    return NotImplemented


_LIST_METHODS = frozenset(("append", "extend", "pop", "insert"))  # (of lists the program built: their rules)


@BATCH.register(intrinsics.build_dict)
def dict_display(n, fn, args, kwargs):
    """``{k: v, ...}`` with keys every instance shares: held as its values (``batch.Keyed``), each instance's
    own dict made only where it needs one (a change to it, a method)."""
    if kwargs or len(args) % 2:
        return NotImplemented
    found = {}
    for k, v in zip(args[::2], args[1::2]):
        if type(k) is Batch or k is intrinsics.MERGE or not facts.immutable(k):
            return NotImplemented
        found[k] = v
    return bt.from_struct(bt.dict_kind(tuple(found)), list(found.values()), n)


@BATCH.register(list, tuple)
def container(n, fn, args, kwargs):
    """``list(xs)`` / ``tuple(xs)`` of a tuple or list the program built (its elements, in a new container of
    each instance's own), of a batched tensor (its rows: each row every instance's at once), or of each
    instance's own list or tuple."""
    if kwargs or len(args) != 1 or type(args[0]) is not Batch:
        return NotImplemented
    xs = bt.ready(args[0])
    if xs.struct is not None and xs.owner is None and xs.struct[0] in (list, tuple):
        return bt.from_struct(fn, list(xs.struct[1]), n)
    if xs.owner == "tensor" and xs.tensor.dim() >= 2:
        return bt.from_struct(fn, [bt.from_tensor(row) for row in xs.tensor.unbind(1)], n)
    if xs.owner == "items" and xs.thunk is None and all(type(x) in (list, tuple) for x in xs.items):
        return bt.from_items([fn(x) for x in xs.items])  # (each instance's own list: a new one of its items)
    return NotImplemented


def _own_rows(target):
    """The tensor of a batch whose rows are its instances' own tensors (no row the view of another's), which an
    in-place change may write whole; else None (items, or a shared value expanded into rows)."""
    if type(target) is not Batch or target.owner != "tensor":
        return None
    t = target.tensor
    return t if _unexpanded(t) else None


def _unexpanded(t):
    """Whether no two elements of tensor ``t`` are one element of memory (``expand``'s stride 0)."""
    return all(stride or size <= 1 for stride, size in zip(t.stride(), t.shape))


def _reads_its_target(t, values):
    """Whether a tensor among ``values`` (or a Batch's items) shares ``t``'s memory (``y[1:] = y[:2]``): torch
    refuses an overlap of one instance's tensor that it cannot see in the batch's, so each instance then runs
    its own. (Under torch.func's transforms a tensor's memory cannot be read: each instance runs its own.)"""
    address = _storage_of(t)
    return address is None or _in_storages({address}, values)


def _in_storages(storages, values):
    """Whether a tensor among ``values`` (or a Batch's items) lies in one of ``storages`` (their data_ptrs), or
    may (a tensor of torch.func's, whose memory cannot be read)."""
    for v in values:
        parts = (v.tensor,) + tuple(v.items or ()) if type(v) is Batch else (v,)
        for p in parts:
            if type(p) is torch.Tensor:
                address = _storage_of(p)
                if address is None or address in storages:
                    return True
    return False


def _storage_of(t):
    """The address of tensor ``t``'s storage; None for a tensor torch.func wraps, which has none to read."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return None


def _aligned(value, rank):
    """A batched ``value``'s tensor with dims inserted after the instance dim up to instance rank ``rank`` (an
    instance's lower-rank value broadcasts from the right), a shared one as it is; None where it has none, or
    where a shared tensor's rank is above ``rank`` (its leading dims would fall on the instances)."""
    if type(value) is not Batch:
        return None if isinstance(value, torch.Tensor) and value.dim() > rank else value
    v = bt.tensor_of(value)
    if v is None or v.dim() - 1 > rank:
        return None
    return v.reshape(v.shape[:1] + (1,) * (rank - v.dim() + 1) + v.shape[1:])


@BATCH.register(operator.setitem)
def set_item(n, fn, args, kwargs):
    """``y[index] = v`` of each instance's own tensor ``y``: one write of the batch's rows, by an index every
    instance shares (ints, slices, None, ``...``) or by each instance's mask of its whole shape (``y[m] = 0.0``);
    of a list the program built, by a shared int: its element."""
    if kwargs or len(args) != 3:
        return NotImplemented
    target, index, value = args
    if dicts.held(target):
        return dicts.set_field(target, index, value)
    if type(target) is Batch and target.struct is not None and target.owner is None and target.struct[0] is list \
            and type(index) is int:  # (``hs = [None] * 3; hs[1] = h``: the element of the list every name sees)
        target.struct[1][index] = value  # (out of range: Python's IndexError, as each instance's list raises)
        return None
    t = _own_rows(target)
    if t is None:  # (each instance's own tensor held apart: written in their stack, each then given its row)
        out = _stacked_in_place(target, (index, value), {}, lambda stacked: _write_rows(stacked, index, value),
                                written=index)
        return NotImplemented if out is NotImplemented else None
    return _write_rows(t, index, value)


def _write_rows(t, index, value):
    """``y[index] = value`` of each instance's row of ``t``: None, or NotImplemented (nothing written) where
    there is no such write."""
    at = bt.instance_index(index) if type(index) is Batch and t.dim() >= 2 else None
    parts = ([at] if at.dim() == 1 else None) if at is not None else \
        _instance_parts(index) if t.dim() >= 2 else None
    if parts is not None and (type(value) is not Batch or value.owner == "tensor"):
        # (``v[j] = 1.0``, ``h[j] += x``, ``out[t, 0] = v``: each instance's own ints, beside shared ints and
        # slices, one write of every instance's row)
        dropped = sum(not (type(p) is slice or p is None or p is Ellipsis) for p in parts)
        value = _aligned(value, t.dim() - 1 - dropped + sum(p is None for p in parts))
        if value is None or _reads_its_target(t, (value,)):
            return NotImplemented
        if isinstance(value, torch.Tensor) and value.dtype != t.dtype:
            value = value.to(t.dtype)  # (an index's write refuses another dtype: eager's copy casts)
        t[(torch.arange(t.shape[0], device=t.device),
           *(p.to(t.device) if isinstance(p, torch.Tensor) else p for p in parts))] = value
        return None
    if type(index) is Batch:
        where = bt.tensor_of(index)
        if where is None or where.dtype is not torch.bool or where.shape != t.shape or type(value) is Batch or (
                isinstance(value, torch.Tensor) and value.dim()):  # (a mask's elements take one value each)
            return NotImplemented
    elif plain_index(index):
        where = (slice(None),) + (index if type(index) is tuple else (index,))
    else:
        return NotImplemented
    if _reads_its_target(t, (value,)) and not (type(value) is Batch and value.owner == "tensor" and _same_memory(
            value.tensor, t[where])):  # (``y[0] += 1``: the row it changed written onto itself, as eager's)
        return NotImplemented
    value = _aligned(value, t[where].dim() - 1)
    if value is None:
        return NotImplemented
    t[where] = value
    return None


def _overlaps_what_it_writes(joined, index, values):
    """Whether a tensor among ``values`` (or a Batch's) shares some elements of batch tensor ``joined`` (a value
    joined from a branch's sides: its cache) with the elements a change writes, all of them, or those at shared
    ``index`` of ``y[index] = v``, but is not those very elements (``y.add_(y)``, ``y[0] += 1``): torch refuses
    such a change of each instance's tensor, as eager's does (``v.add_(v[0])``, ``y[1:] = y[:2]``)."""
    written = joined[(slice(None),) + (index if type(index) is tuple else (index,))] \
        if index is not None and plain_index(index) else joined
    storage = joined.untyped_storage().data_ptr()
    for v in values:
        for p in ((v.tensor,) + tuple(v.items or ()) if type(v) is Batch else (v,)):
            if type(p) not in PLAIN_TENSORS or p.untyped_storage().data_ptr() != storage or _same_memory(p, written):
                continue
            if p.dtype != written.dtype or torch.isin(_addresses(p), _addresses(written)).any():
                return True
    return False


def _addresses(t):
    """The storage positions of tensor ``t``'s elements, flat."""
    at = torch.tensor(t.storage_offset())
    for size, stride in zip(t.shape, t.stride()):
        at = at.unsqueeze(-1) + torch.arange(size) * stride
    return at.flatten()


_PLAIN_PARTS = (int, slice, type(None), type(Ellipsis))


def _instance_parts(index):
    """A tuple index of each instance's own ints (``(t, 0)``) beside shared ints, slices, None and ``...`` (or
    each instance's own tuple of these), its parts with each instance's ints as one LongTensor; else None."""
    if type(index) is not Batch or index.thunk is not None:
        return None
    if index.owner == "items" and index.items and all(type(i) is tuple for i in index.items):
        columns = list(zip(*index.items)) if len({len(i) for i in index.items}) == 1 else None
        if not columns:
            return None  # (each instance's own tuple: its column of ints, or one shared part)
        given = [c[0] if type(c[0]) in _PLAIN_PARTS and all(type(v) is type(c[0]) and v == c[0] for v in c)
                 else bt.from_items(list(c)) for c in columns]
    elif index.struct is not None and index.owner is None and index.struct[0] is tuple:
        given = index.struct[1]
    else:
        return None
    parts = []
    for p in given:
        if type(p) is Batch:
            p = bt.instance_index(p)
            if p is None:
                return None
        elif not plain_index(p):
            return None
        parts.append(p)
    return parts


def _same_memory(a, b):
    """Whether tensors ``a`` and ``b`` are views of the very same elements, in the same order."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape and \
        a.stride() == b.stride() and a.storage_offset() == b.storage_offset() and a.dtype == b.dtype


def _lined_up(t, name, args, kwargs):
    """The arguments of Tensor method ``name`` on the batch's tensor ``t``, batched ones lined up as elementwise
    ops line them up; None where there is no such call (a keyword, or an argument that takes one value for
    every element, given per instance: ``y.fill_(v)``)."""
    if any(type(v) is Batch for v in kwargs.values()) or any(
            type(a) is Batch for a in args[_ONE_VALUE.get(name, len(args)):]):
        return None
    values = [_aligned(a, t.dim() - 1) for a in args]
    return None if any(v is None for v in values) else values


def _in_place_method(name):
    """``y.clamp_(...)``, ``y.masked_fill_(m, v)``, ``y.zero_()`` ... of each instance's own tensor: the method
    on the batch's tensor, its batched arguments lined up as elementwise ops line them up."""

    method = getattr(torch.Tensor, name)

    def rule(n, base, args, kwargs):
        t = _own_rows(base)
        if t is None:
            return _stacked_in_place(base, args, kwargs, lambda stacked: _lined_up_change(
                stacked, method, name, args, kwargs))
        if _reads_its_target(t, (*args, *kwargs.values())):
            return NotImplemented
        return NotImplemented if _lined_up_change(t, method, name, args, kwargs) is NotImplemented else base

    return rule


def _lined_up_change(t, change, name, args, kwargs):
    """``change(t, *args, **kwargs)``, an elementwise in-place op (Tensor method ``name``, or an augmented operator
    with no name) of the instances' rows of ``t``, its batched arguments lined up as elementwise ops line them
    up; NotImplemented, changing nothing, where there is no such call (``_lined_up``)."""
    values = _lined_up(t, name, args, kwargs)
    if values is None:
        return NotImplemented
    change(t, *values, **kwargs)
    return None


# In-place Tensor methods that keep their tensor's shape, which torch.func.vmap runs on each instance's rows of
# one tensor by a batching rule of its own (those it has none for it runs per row, with a warning of its own):
# writes by index, elementwise ones the rules above do not line up (not a draw: each instance's draws are its
# own, in its own order; not ``unsqueeze_`` or ``t_``, which change the shape the batch's tensor holds)
_IN_PLACE_UNDER_VMAP = frozenset({
    "index_add_", "index_fill_", "index_put_", "scatter_add_", "scatter_reduce_", "nan_to_num_", "logit_",
    "atan2_", "sin_", "cos_", "tan_", "asin_", "acos_", "atan_", "sinh_", "cosh_", "floor_", "ceil_", "round_",
    "trunc_", "frac_", "sign_", "reciprocal_", "rsqrt_", "log1p_", "expm1_", "log2_", "log10_", "exp2_", "erf_",
})


def _in_place_under_vmap(n, name, base, args, kwargs):
    """``base.name(*args)``, a Tensor method changing each instance's own tensor in place that no rule knows
    (``index_add_``, ``scatter_``, ``index_put_``), under torch.func.vmap, which changes the rows of the batch's
    tensor (or, where the batch holds them apart, of their stack: ``_stacked_in_place``); NotImplemented where
    there is no such call, or vmap refuses it."""
    t = _own_rows(base)
    if t is None:
        return _stacked_in_place(base, args, kwargs, lambda stacked: _vmapped(
            n, None, (Batch(n, tensor=stacked), *args), kwargs, name))
    if _reads_its_target(t, (*args, *kwargs.values())):
        return NotImplemented
    return NotImplemented if _vmapped(n, None, (base, *args), kwargs, name) is NotImplemented else base


def _stacked_in_place(target, args, kwargs, change, written=None):
    """An in-place change of each instance's own tensor where the batch holds them apart (items; a value joined
    from pieces, rows of several tensors): the tensors stacked, changed by one op, then each given its row
    (``copy_``), so that every instance's tensor changes as eager's does. Run once per instance instead, each op
    would move the version of a tensor whose other rows another instance's op saved for its gradient (a row's
    ``sigmoid_``), and the backward would raise where eager's computes. NotImplemented where the values are not
    tensors of one shape and dtype, where two share memory (each instance's op would then see another's
    change) or an argument shares theirs, or where autograd refuses the change (a leaf that needs a gradient,
    an inference tensor): each instance's op then runs, or raises, as eager's. ``written``: the index of a
    write ``y[index] = v``, whose ``v`` may be the very elements it writes (``y[0] += 1``), as eager's may."""
    if type(target) is not Batch or target.owner == "tensor" or target.thunk is not None \
            or target.struct is not None or target.method is not None:
        return NotImplemented
    held = bt.pieces_items(target) if target.pieces is not None else target.items
    if held is None or not all(type(x) in PLAIN_TENSORS and _unexpanded(x) for x in held) \
            or not bt.same_kind(held, 0) or not _apart(held):
        return NotImplemented
    # (an argument read from the tensor joined of them, ``v[0]`` of a value joined from a branch's sides, is
    # read from each instance's own tensor in eager code, which torch refuses to change by it)
    read = (*args, *kwargs.values())
    if _in_storages({x.untyped_storage().data_ptr() for x in held}, read):
        return NotImplemented
    if target.tensor is not None and _overlaps_what_it_writes(target.tensor, written, read):
        return NotImplemented
    for x in held:
        base = x if x._base is None else x._base
        if x.is_inference() or base.is_leaf and base.requires_grad:
            return NotImplemented
    stacked = torch.stack(held)
    if change(stacked) is NotImplemented:
        return NotImplemented
    _given_their_rows(held, stacked)
    if bt.MADE_FROM:
        for x in held:
            bt.changed_in_place(x)
    # (what the op saved is the stack, where eager's saved each instance's tensor: a later change of one moves it)
    bt.note_made_from(held, stacked, written=True)
    if target.owner == "items":
        target.tensor = None  # (a tensor stacked from the items is stale; a joined value's cache checks itself)
    return target


def _given_their_rows(held, stacked):
    """Each tensor of ``held`` given its row of ``stacked``: those that are whole rows of one tensor (a joined
    value's rows of a batch's tensor) by one ``index_copy_`` into it, the others each by ``copy_``."""
    groups = {}
    for k, x in enumerate(held):
        row = _row_of_its_base(x)
        if row is None:
            _written(bt.view_again(x), stacked[k])
        else:
            _, ks, positions = groups.setdefault(id(x._base), (x._base, [], []))
            ks.append(k)
            positions.append(row)
    for base, ks, positions in groups.values():
        if len(ks) == 1:
            _written(bt.view_again(held[ks[0]]), stacked[ks[0]])
        else:
            at = bt.long_tensor(positions, base.device)
            with saved_versions.writing(base, at, instances=True):
                base.index_copy_(0, at, stacked[bt.long_tensor(ks, stacked.device)])


def _written(view, rows):
    with saved_versions.writing(view):
        view.copy_(rows)


def _row_of_its_base(x):
    """The row of its base that view ``x`` is, whole, or None."""
    base = x._base
    if base is None or base.dim() != x.dim() + 1 or base.shape[1:] != x.shape or base.stride()[1:] != x.stride() \
            or base.stride(0) <= 0:
        return None
    row, rest = divmod(x.storage_offset() - base.storage_offset(), base.stride(0))
    return row if rest == 0 and 0 <= row < base.shape[0] else None


def _apart(tensors):
    """Whether no two of ``tensors`` share an element of memory."""
    spans = sorted((t.untyped_storage().data_ptr(), t.storage_offset(), t.storage_offset() + bt.span(t))
                   for t in tensors)
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


# In-place methods (and masked_fill) whose arguments from this position on are one value for every element (a
# 0-d tensor)
_ONE_VALUE = {"fill_": 0, "masked_fill_": 1, "masked_fill": 1}
# Tensor methods converting to another dtype (or device): an argument of another dtype is what they are for
_CONVERSIONS = frozenset({"to", "type_as", "type", "half", "bfloat16", "bool", "int"})
# In-place tensor methods acting on each element alone (their arguments broadcast within an instance)
_ELEMENTWISE_IN_PLACE = ("add_", "sub_", "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_", "masked_fill_", "fill_",
                         "zero_", "copy_", "relu_", "sigmoid_", "tanh_", "exp_", "log_", "neg_", "abs_", "sqrt_",
                         "pow_", "addcmul_", "addcdiv_", "lerp_")
for _changing in _ELEMENTWISE_IN_PLACE:
    BATCH.register(_changing)(_in_place_method(_changing))


_ELEMENTWISE_AUGMENTED = frozenset(syntax.AUGMENTED) - {operator.imatmul}  # (``x @= w`` is no elementwise op)


@BATCH.register(*facts.IN_PLACE)
def elementwise_inplace(n, fn, args, kwargs):
    target = args[0]
    if (type(target) is not Batch or target.owner != "tensor") and (kwargs or _number_rows(args) is None):
        if type(target) is Batch and not kwargs and len(args) == 2 and fn in _ELEMENTWISE_AUGMENTED:
            return _stacked_in_place(target, args[1:], {}, lambda stacked: _lined_up_change(
                stacked, fn, None, args[1:], {}))
        return NotImplemented  # a shared target: per instance (ints: a new int each)
    return elementwise(n, fn, args, kwargs)


@BATCH.register(*intrinsics.AUGMENTED_FRESH.values())
def augmented_fresh(n, fn, args, kwargs):
    """``x op= y`` of an object only its frame holds (``passes.fresh``): the out-of-place op's rule, where every
    instance's tensor ``x`` has the result's dtype and shape; else each instance as Python runs it (the
    in-place op casts or raises)."""
    if kwargs or len(args) != 2:
        return NotImplemented
    out = elementwise(n, fn.out_of_place, args, {})
    return NotImplemented if out is NotImplemented else _as_in_place(args[0], out)


@BATCH.register(*intrinsics.OUT_OF_PLACE)
def method_fresh(n, fn, args, kwargs):
    """``x.relu_()`` (``clamp_(min=0)``, ...) of a tensor only its frame holds (``passes.fresh``): the out-of-place
    method's rule, where every instance's tensor ``x`` has the result's dtype and shape; else each instance as
    Python runs it."""
    x, rule = args[0], BATCH.by_method.get(fn.method)
    if type(x) is not Batch or rule is None:
        return NotImplemented
    out = rule(n, x, args[1:], kwargs)
    return NotImplemented if out is NotImplemented else _as_in_place(x, out)


@BATCH.register(intrinsics.setitem_fresh)
def setitem_fresh(n, fn, args, kwargs):
    """``x[i] = v`` of a tensor only its frame holds, written out of place (``passes.fresh``: a buffer filled by a
    loop): a copy of the batch's rows (or of the one tensor every instance shares), written by one op, by an
    index every instance shares or each instance's own int (``_write_rows``); a copy this made before, which
    nothing but this write reads, in place (``intrinsics.owned``)."""
    x = args[0]
    if kwargs or len(args) != 3:
        return NotImplemented
    t = bt.tensor_of(x) if type(x) is Batch else x.expand(n, *x.shape) if type(x) in PLAIN_TENSORS else None
    if t is None:
        return NotImplemented
    value = args[2]
    if type(value) is Batch and value.owner == "items":  # (``out[t] = k``, each instance's own Python number)
        numbers = _python_numbers(value, t.dtype)
        value = value if numbers is None else bt.from_tensor(numbers.to(t.device))
    if type(x) is not Batch or not _own_copy(t):  # (a value every instance shares: each instance's copy)
        t = t.clone()
    if _write_rows(t, args[1], value) is NotImplemented:
        return NotImplemented
    intrinsics.own(t)
    return bt.from_tensor(t)


def _own_copy(t):
    """Whether batch tensor ``t`` is a copy ``setitem_fresh``'s rule made, or rows of one (the instances still in
    a loop), no row another's (``_unexpanded``): written in place, each instance's row its own buffer."""
    base = t if t._base is None or not intrinsics.owned(t._base) else t._base
    return intrinsics.owned(base) and _unexpanded(t) and (base is t or (
        t.shape[1:] == base.shape[1:] and t.stride() == base.stride()))


@BATCH.register(*intrinsics.SETS_FRESH)
def sets_fresh(n, fn, args, kwargs):
    """``x.fill_(v)``, ``x.zero_()`` of a tensor only its frame holds (``passes.fresh``): the new tensor made of the
    batch's tensor, where every instance has the one ``v``."""
    x = args[0]
    if kwargs or type(x) is not Batch and not (args[1:] and type(args[1]) is Batch):
        return NotImplemented
    t = bt.tensor_of(x) if type(x) is Batch else x.expand(n, *x.shape) if type(x) in PLAIN_TENSORS else None
    if t is None:
        return NotImplemented
    if not args[1:] or type(args[1]) is not Batch:
        return bt.from_tensor(fn(t, *args[1:]))
    value = bt.tensor_of(args[1]) if args[1].owner == "tensor" else _python_numbers(args[1], t.dtype)
    if value is None or value.shape != (n,):  # (``v.fill_(k)``, each instance's own number: its rows)
        return NotImplemented
    if not (t.is_floating_point() or t.is_complex()):
        value = value.detach()
    return bt.from_tensor(value.to(t.dtype).view(n, *[1] * (t.dim() - 1)).expand_as(t).clone())


def _python_numbers(value, dtype=None):
    """Batch ``value`` of each instance's Python number (int, float or bool) as one tensor (of ``dtype``, where
    given: each number converted as a write into such a tensor converts it), else None."""
    items = bt.items_of(value) if value.owner == "items" else None
    if not items or not all(type(v) in (int, float, bool) for v in items):
        return None
    return torch.tensor(items, dtype=dtype)


@BATCH.register(intrinsics.requires_grad_fresh)
def requires_grad_fresh(n, fn, args, kwargs):
    """``x.requires_grad_()`` of a tensor only its frame holds (``passes.fresh``): set on the batch's tensor (a leaf,
    or one that requires grad already), or on each instance's own, and the batch handed on as it is."""
    x = args[0]
    if kwargs or len(args) != 1 or type(x) is not Batch:
        return NotImplemented
    if x.owner == "tensor" and (x.tensor.is_leaf or x.tensor.requires_grad):
        x.tensor.requires_grad_()
        return x
    items = bt.items_of(x) if x.owner == "items" else None
    if not items or not all(type(t) in PLAIN_TENSORS and (t.is_leaf or t.requires_grad) for t in items):
        return NotImplemented
    for t in items:
        t.requires_grad_()
    return x


def _as_in_place(x, out):
    """``out``, the batch of ``x op y`` (or ``x.name()``) computed for an in-place op of ``x`` written out of place,
    where every instance's tensor ``x`` has its dtype and shape (what the in-place op gives); else NotImplemented:
    each instance runs as Python runs it (the in-place op casts, or raises)."""
    t = out.tensor if type(out) is Batch and out.owner == "tensor" else None
    if type(x) is Batch and x.owner == "tensor":
        tensors = [x.tensor[0]]
    else:
        tensors = [v for v in (bt.items_of(x) if type(x) is Batch else [x]) if isinstance(v, torch.Tensor)]
    if tensors and (t is None or any(v.dtype is not t.dtype or v.shape != t.shape[1:] for v in tensors)):
        return NotImplemented
    return out


def _dim_rule(position, default=None):
    """An op mapping over every dim but one (``dim``, given at ``position`` or by keyword): the instance
    dim goes first, so a non-negative dim moves up by one."""

    def rule(n, fn, args, kwargs):
        values = _tensor_args(n, args)
        if values is None or any(type(v) is Batch for v in kwargs.values()) or type(args[0]) is not Batch:
            return NotImplemented
        if any(type(a) is Batch for a in args[1:]) or not dims_shift(values[0], fn) or _no_dims(
                kwargs.get("dim")) or len(values) > position and _no_dims(values[position]):
            return NotImplemented
        kwargs = dict(kwargs)
        if "dim" in kwargs:
            kwargs["dim"] = shift_dim(kwargs["dim"])
        elif len(values) > position:
            values[position] = shift_dim(values[position])
        elif default is not None:
            kwargs["dim"] = shift_dim(default)
        else:
            return NotImplemented
        return _wrap(fn(*values, **kwargs), n)

    return rule


# Elementwise functions whose arguments after the input are Python numbers, not tensors
_NUMBER_PARAMETERS = frozenset({F.relu6, F.hardtanh, F.softshrink, F.hardshrink, F.threshold, F.celu, F.elu,
                                F.leaky_relu, F.selu, F.softplus, F.gelu})


def _no_dims(dim):
    """``dim=()`` (or ``[]``): torch reads it as every dim, which on the batch's tensor would take the instances'
    dim too."""
    return type(dim) in (tuple, list) and not dim


def dims_shift(t, op):
    """Whether an instance's dim is the batch tensor ``t``'s next one: not where each instance is 0-d, whose
    dim 0 or -1 is the instance itself (``x.sum().softmax(-1)`` is 1.0; on the batch's tensor it would mix the
    instances), except for unsqueeze, which adds the dim."""
    return t.dim() > 1 or op in (torch.unsqueeze, "unsqueeze")


def shift_dim(dim):
    """A dim of an instance's tensor as the same dim of the batch's (dim 0 the instance)."""
    if type(dim) is int:
        return dim + 1 if dim >= 0 else dim
    if type(dim) in (tuple, list):
        return type(dim)(d + 1 if d >= 0 else d for d in dim)
    raise TypeError  # caught by nobody: a dim we do not understand should not pass silently


def _by_position(kwargs, name):
    """A call with no positional argument: its first parameter ``name``, given by keyword, moved to its
    position (``torch.cat(tensors=[a, b])`` read as ``torch.cat([a, b])``), for the rules that read it there."""
    if name not in kwargs:
        return (), kwargs
    rest = dict(kwargs)
    return (rest.pop(name),), rest


@BATCH.register(torch.cat, torch.stack, torch.concat)
def join_along(n, fn, args, kwargs):
    """torch.cat / torch.stack of a list of batched tensors along a feature dim."""
    if not args:  # (the positional form, the usual one, pays only this test)
        args, kwargs = _by_position(kwargs, "tensors")
        if not args:
            return NotImplemented
    seq = args[0]
    if type(seq) is Batch and (seq.owner == "items" or bt.own_lists(seq, (list, tuple)) is not None):
        # (each instance's list of its own length; or the lists a loop or branch joined)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if type(dim) is int and dim != 0 and len(args) <= 2 and set(kwargs) <= {"dim"}:
            if fn is torch.stack:
                return _stacked_along(n, seq, dim)
            out = _cat_along(n, seq, dim)  # (``torch.cat(hs, dim=-1)`` of a node's children's states)
            if out is not NotImplemented:
                return out
        return rows.stacked(n, seq, args, kwargs) if fn is torch.stack else rows.concatenated(n, seq, args, kwargs)
    if type(seq) is not Batch or seq.struct is None or seq.owner is not None or len(args) > 2 or \
            issubclass(seq.struct[0], bt.Keyed):  # (a dict: torch's TypeError, each instance's)
        return NotImplemented
    if row_wise.holds_rows(seq.struct[1]) and set(kwargs) <= {"dim"}:  # (``torch.cat([fwd, bwd], 1)``)
        out = row_wise.joined(n, fn, seq.struct[1], kwargs.get("dim", args[1] if len(args) > 1 else 0))
        if out is not NotImplemented:
            return out
    if fn is not torch.stack and any(type(p) is Batch and rows.of(p) is not None for p in seq.struct[1]):
        # (``torch.cat([nt[None], torch.stack(hs), nt[None]])``: each instance's pieces, of its own lengths, laid
        # end to end in one cat, as each instance's list of them; else each instance's cat, and its error)
        return rows.concatenated(n, seq, args, kwargs)
    parts = []
    for p in seq.struct[1]:
        if type(p) is not Batch:
            return NotImplemented  # a shared part would need expanding: leave it to vmap
        t = bt.tensor_of(p)
        if t is None:
            return NotImplemented
        parts.append(t)
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if type(dim) is not int or set(kwargs) - {"dim"}:
        return NotImplemented
    return bt.from_tensor(fn(parts, dim=shift_dim(dim)))


@BATCH.register(F.linear, F.embedding, F.layer_norm)
def over_last_dims(n, fn, args, kwargs):
    """Ops acting on the last dim(s) of their first argument with shared weights (linear, embedding,
    layer norm, a Linear module): the batch dim is one more leading dim."""
    if not args:
        args, kwargs = _by_position(kwargs, "input")
    if not args or type(args[0]) is not Batch or any(type(a) is Batch for a in args[1:]) or \
            any(type(v) is Batch for v in kwargs.values()):
        return NotImplemented
    x = bt.tensor_of(args[0])
    if x is None or (x.dim() < 2 and fn not in _ANY_RANK):  # (an instance's 0-d input: rank matters)
        return NotImplemented
    if _counts_its_indices(fn, args, kwargs):
        return per_instance(n, fn, args, kwargs, why=fallbacks.COUNTED)
    return bt.from_tensor(fn(x, *args[1:], **kwargs))


def _counts_its_indices(fn, args, kwargs):
    """Whether ``fn`` is an embedding lookup (or bag) whose gradient scales each index by its count among the
    call's own indices (``scale_grad_by_freq``): one call of every instance's would count them together."""
    if isinstance(fn, (nn.Embedding, nn.EmbeddingBag)):
        return bool(fn.scale_grad_by_freq)
    if fn is F.embedding or fn is F.embedding_bag:  # (both take it as their sixth parameter)
        return bool(kwargs.get("scale_grad_by_freq") or len(args) > 5 and args[5])
    return False


PLAIN_TENSORS = bt.PLAIN_TENSORS  # (tensors as torch's ops take them: no subclass's own overrides)


@BATCH.register(operator.getitem)
def gather(n, fn, args, kwargs):
    """``x[i]`` with a batched i (a gather), or a batched x with a shared index."""
    out = _gather(n, fn, args, kwargs)
    x = args[0]
    if type(out) is Batch and out.owner == "tensor" and type(x) is Batch and x.owner == "tensor" and \
            not sharing.state.fresh and not _same_base(out.tensor, x.tensor) and _basic_index(args[1]):
        # (each instance's ``x[i]`` is a view of its x in eager code, a gathered copy here: a later change of x
        # in place must move the copy's version too, so that a backward that saved it raises as eager's does)
        bt.note_made_from([x.tensor], out.tensor)
    return out


def _of_each_list(x, fn, index):
    """``fn(xs, index)`` (``xs[-1]``, ``xs[-2:]``, ``del xs[-2:]``) of each instance's own list, tuple or str, with a
    shared int or slice: each instance's, as its own call would give (a batch of the results; None where ``fn``
    gives none); NotImplemented where one raises (an index past an end: each instance raises its own, or not)."""
    lists = bt.own_lists(x, (list, tuple, str))
    if lists is None or type(index) is int and not all(-len(each) <= index < len(each) for each in lists):
        return NotImplemented
    out = [fn(each, index) for each in lists]
    return None if fn is operator.delitem else bt.from_items(out)


def _looked_up(table, keys):
    """``table[k]`` of a shared dict with each instance's own key, a Python str or int (a vocabulary's lookup):
    each instance's value, as its own read gives it; NotImplemented where a key is missing (each instance
    raises its own KeyError) or is another kind (a tensor hashes by identity)."""
    keys = bt.items_of(keys) if keys.thunk is None else None
    if keys is None or not set(map(type, keys)) <= {str, int}:
        return NotImplemented
    try:
        return bt.from_items([table[k] for k in keys])
    except KeyError:
        return NotImplemented


def _item_of_each_list(n, x, index):
    """``xs[i]`` of each instance's own list or tuple at its own int i: each instance's item, the very object its
    own read gives; NotImplemented where an index is no int or lies past an end (each instance raises its own)."""
    lists = bt.own_lists(x, (list, tuple))
    ints = bt.instance_ints(n, index) if lists is not None else None
    if ints is None or not all(type(i) is int and -len(each) <= i < len(each) for each, i in zip(lists, ints)):
        return NotImplemented
    return bt.from_items([each[i] for each, i in zip(lists, ints)])


def _value_of_each_key(n, d, key):
    """``d[key]`` of a dict held as its values (keys every instance shares) with each instance's own key: the one
    value where every instance's key is the same, else each instance's from their stack (``_element_each``), or
    where the program changes values in place each instance's own value;
    NotImplemented where a key is missing (each instance raises its own KeyError) or no shared key can be one
    (a tensor, a list: each instance's own lookup says)."""
    keys, values = d.struct[0].keys_, d.struct[1]
    places = [dicts.place(keys, k) for k in bt.items_of(key)]
    if any(p is None or p is NotImplemented for p in places):
        return NotImplemented
    if all(p == places[0] for p in places):
        return values[places[0]]
    out = _element_each(n, values, bt.from_items(places)) if sharing.state.fresh else NotImplemented
    # (where the program changes values in place: each instance's very value, its row, as its own read gives it)
    return bt.from_items([bt.instance(values[p], k) for k, p in enumerate(places)]) if out is NotImplemented else out


@BATCH.register(intrinsics.reversed_sequence)
def reversed_sequences(n, fn, args, kwargs):
    """What ``for x in reversed(xs)`` iterates: of each instance's rows, their flip (``reversed``'s rule); of each
    instance's own list, in a run that changes nothing in place (where such a list only grows, and a reverse
    iterator never reaches what is appended), a copy of it reversed, which the ``for`` reads as one stack."""
    out = rows.reversed_rows(n, fn, args, kwargs)
    if out is not NotImplemented or len(args) != 1 or kwargs or not sharing.state.fresh:
        return out
    xs = args[0]
    if type(xs) is Batch and xs.struct is not None and xs.owner is None and xs.struct[0] in (list, tuple):
        return bt.from_struct(list, xs.struct[1][::-1], n)  # (``reversed([a, b, c])``: its items, from the last)
    lists = bt.own_lists(xs, (list, tuple))
    return NotImplemented if lists is None else bt.from_items([list(reversed(each)) for each in lists])


@BATCH.register(operator.delitem)
def deleted(n, fn, args, kwargs):
    """``del xs[i]`` / ``del xs[a:b]`` (shared i, a, b) of each instance's own list."""
    if kwargs or len(args) != 2 or type(args[1]) not in (int, slice) or bt.own_lists(args[0]) is None:
        return NotImplemented
    return _of_each_list(args[0], fn, args[1])


def _same_base(a, b):
    return (a if a._base is None else a._base) is (b if b._base is None else b._base)


def _basic_index(index):
    """Whether each instance's ``index`` is one eager indexing makes a view by: ints, 0-d integer tensors,
    slices, None, ``...``, tuples of these."""
    if type(index) is Batch:
        if index.struct is not None and index.owner is None and index.struct[0] is tuple:
            return all(_basic_index(p) for p in index.struct[1])
        if index.owner == "tensor":
            return index.tensor.dim() == 1 and index.tensor.dtype in facts.INTEGER_INDEX
        return index.owner == "items" and all(_basic_index(k) for k in index.items)
    if type(index) is tuple:
        return all(_basic_index(p) for p in index)
    if isinstance(index, torch.Tensor):
        return index.dim() == 0 and index.dtype in facts.INTEGER_INDEX
    return index is None or index is Ellipsis or type(index) in (int, slice)


def _gather(n, fn, args, kwargs):
    x, index = args
    shared = _built_shared(index)
    if shared is not None:
        index = shared  # (``x[[0, 2]]``, ``x[[0, 2], 1]``: lists the program built of values every instance shares)
        if type(x) is not Batch:
            return _unbatched(n, operator.getitem, (x, index), None)
    if type(index) is Batch and index.owner == "items" and index.items and type(index.items[0]) is slice:
        return rows.stretch(n, x, index)  # (``words[:n]``, n per instance)
    if type(index) is Batch and index.struct is not None and index.owner is None and index.struct[0] is tuple:
        out = _points(n, x, index.struct[1])  # (``trans[tags[t - 1], tags[t]]``, ``emits[t, tags[t]]``)
        if out is NotImplemented:
            out = _row_then_rest(n, x, index.struct[1])  # (``kids[i, :n_kids[i]]``)
        if out is not NotImplemented:
            return out
    if type(x) is Batch and type(index) is Batch and x.struct is not None and x.owner is None and \
            x.struct[0] in (list, tuple) and sharing.state.fresh:
        out = _element_each(n, x.struct[1], index)  # (``[a, b, c][k]``, k per instance)
        if out is not NotImplemented:
            return out
    if type(x) is Batch and type(index) is Batch and rows.of(x) is not None and index.struct is None:
        out = rows.item_each(rows.of(x), index)  # (``xs[len(xs) - 1]``: an int per instance)
        if out is not NotImplemented:
            return out
    if type(x) is Batch and type(index) is Batch and index.struct is None and x.owner != "tensor":
        out = _item_of_each_list(n, x, index)  # (``hs[t - 1]`` of each instance's own list, t its own)
        if out is not NotImplemented:
            return out
    if type(x) is Batch and type(index) is Batch and x.struct is not None and x.owner is None and \
            issubclass(x.struct[0], bt.Keyed):
        out = _value_of_each_key(n, x, index)  # (``chart[0, n]`` of a dict with shared keys, n each instance's)
        if out is not NotImplemented:
            return out
    if type(x) is not Batch and type(index) is Batch and type(x) not in PLAIN_TENSORS:
        out = chosen.picked(x, index)  # (``self.ops[op[i]]``: each instance's module)
        if out is not NotImplemented:
            return out
        if type(x) is dict:
            out = _looked_up(x, index)  # (``VOCAB[ch]``, each instance's own character)
            if out is not NotImplemented:
                return out
    if type(x) is not Batch and type(index) is Batch and type(x) in PLAIN_TENSORS:  # (``self.embed.weight[i]``)
        i = bt.tensor_of(index)
        if i is None:
            items = bt.items_of(index)
            if not all(type(k) is int or type(k) is torch.Tensor and k.dim() == 0 and k.dtype in facts.INTEGER_INDEX
                       for k in items):
                return NotImplemented
            # (Python ints, 0-d integer tensors among them where requests of other depths joined: each reads x's row)
            i = torch.tensor([k if type(k) is int else int(k) for k in items], device=x.device)
        elif i.dtype is torch.bool and 2 <= i.dim() <= x.dim() + 1 and i.shape[1:] == x.shape[:i.dim() - 1]:
            return _masked(n, _rows_each(n, x), i)  # (``w[m]``, each instance's mask of the shared w)
        elif i.dtype not in facts.INTEGER_INDEX or i.dim() < 1:
            return NotImplemented  # a mask per instance
        i = _held_index(i, x)
        if i.dim() > 1:  # (each instance's tensor of indices: ``x[i]`` of all of them is each instance's rows)
            return bt.from_tensor(x[i])
        return bt.from_tensor(index_rows(x, i))
    if type(x) is Batch and type(index) is not Batch:
        if type(index) is torch.Tensor and index.dim() == 0 and index.dtype in facts.INTEGER_INDEX and \
                index.is_cpu and not dicts.held(x):  # (a dict's key is the tensor: no int finds it)
            index = int(index)  # (``x[k]`` of a 0-d integer tensor reads as ``x[int]``: a view, as eager's)
        if (x.items is not None or rows.holds(x)) and type(index) is slice:
            found = rows.of(x)
            out = rows.sliced(n, found, index) if found is not None else _of_each_list(x, operator.getitem, index)
            if out is not NotImplemented:
                return out
        if padded.of(x) is not None:  # (``x[0]`` of a Conv1d's (1, C, L) output)
            found = padded.of(x)
            return padded.indexed(n, found.tensor, found.dim, found.lengths, index, found.zeroed)
        if (x.items is not None or rows.holds(x)) and (index is None or type(index) is tuple and index[:1] == (None,)):
            found = rows.of(x)  # (``xs[None]``: the rows' dim moved)
            if found is not None and found.shortest:
                return padded.indexed(n, *padded.from_rows(found)[:3], index, True)
        if (x.items is not None or rows.holds(x)) and type(index) is tuple:
            found = rows.of(x)  # (``xs[:, None]``, ``xs[..., :h]``: each row alone)
            out = row_wise.indexed(n, found, index) if found is not None else NotImplemented
            if out is not NotImplemented:
                return out
            if found is not None and len(index) > 1 and type(index[0]) is int:  # (``out[-1, 0]``: a row, then in it)
                row = gather(n, operator.getitem, (x, index[0]), {})
                if row is not NotImplemented:
                    return call(n, operator.getitem, (row, index[1:] if len(index) > 2 else index[1]))
        if (x.items is not None or rows.holds(x)) and type(index) is int:
            found = rows.of(x)
            out = rows.listed_item(n, x.items, index) if type(x.items) is rows.Listed else \
                ranges.item(x, index) if found is None else \
                rows.item(found, index) if index >= 0 else rows.last_items(found, index)
            if out is not NotImplemented:
                return out
            out = _of_each_list(x, operator.getitem, index) if found is None else NotImplemented
            if out is not NotImplemented:
                return out  # (``hs[-1]``: each instance's item)
        if x.owner == "items" and x.thunk is None and type(index) in (str, int) and \
                all(type(v) is dict for v in x.items):
            return _read_of_each(x.items, lambda d: d[index])  # (``node["children"]`` of each instance's own dict)
        if x.struct is not None and x.owner is None and issubclass(x.struct[0], bt.Keyed):
            at = dicts.place(x.struct[0].keys_, index)
            return NotImplemented if at is None or at is NotImplemented else x.struct[1][at]
        if x.struct is not None and x.owner is None and type(index) is int:
            return x.struct[1][index]
        if x.struct is not None and x.owner is None and type(index) is slice and x.struct[0] in (tuple, list):
            return bt.from_struct(x.struct[0], x.struct[1][index], n)  # (``pieces[::-1]``)
        t = x.tensor if x.owner == "tensor" else bt.tensor_of(x) if x.items is None or _stackable(x) else None
        if t is not None and t.dim() >= 2 and (_one_advanced(index) or _adjacent_advanced(index)):
            # (``x[[0, 2]]``, ``x[idx]``, ``m[rows, cols]``: every instance's the same places)
            return bt.from_tensor(t[(slice(None),) + (index if type(index) is tuple else (index,))])
        if t is not None and type(index) is torch.Tensor and index.dtype is torch.bool and 1 <= index.dim() < t.dim():
            return bt.from_tensor(t[:, index])  # (a mask every instance shares, of its leading dims)
        if t is None or not plain_index(index):
            return NotImplemented
        return bt.from_tensor(t[(slice(None),) + (index if type(index) is tuple else (index,))])
    if type(x) is Batch and type(index) is Batch or type(x) in (range, tuple) and type(index) is Batch:
        return _gather_each(n, x, index)
    return NotImplemented


def _stacked_along(n, seqs, dim):
    """``torch.stack(hs, dim=1)`` of each instance's own list (``rows.stacked``, the new dim first) with the
    new dim moved to ``dim``: each instance's value then of its own length along that dim (``padded``)."""
    out = rows.stacked(n, seqs, (seqs,), {})
    if out is NotImplemented:
        return out
    found = rows.of(out) if out.owner != "tensor" else None
    if found is None:  # (every list as long: one tensor)
        t = out.tensor
        return bt.from_tensor(t.movedim(1, dim + 1 if dim >= 0 else dim + t.dim()))
    return padded.rows_method(n, "movedim", found, (0, dim), {})


def _cat_along(n, seqs, dim):
    """``torch.cat(hs, dim=-1)`` of each instance's own list, every list as long and its tensors of one shape: one
    stack of all their tensors, the lists' dim merged into ``dim``, as each instance's cat lays them;
    NotImplemented for lists of their own lengths (each instance's cat) or a dim out of range (torch's error)."""
    lists = bt.items_of(seqs)
    if type(lists) is rows.Appended:
        lists.fill()
    if not all(type(each) in (list, tuple) for each in lists) or len({len(each) for each in lists}) != 1 \
            or not lists[0]:
        return NotImplemented
    flat = [x for each in lists for x in each]
    if not all(type(x) is torch.Tensor for x in flat) or not bt.same_kind(flat, 0):
        return NotImplemented
    t = torch.stack(flat).view(n, len(lists[0]), *flat[0].shape)  # (n, the lists' length, each tensor's dims)
    rank = t.dim() - 2
    d = dim if dim >= 0 else dim + rank
    if not 0 <= d < rank:
        return NotImplemented
    return bt.from_tensor(t.movedim(1, d + 1).flatten(d + 1, d + 2))


def _rows_each(n, value):
    """Each instance's tensor of ``value`` as the rows of one tensor: a batch's, or a shared tensor's expanded
    (no copy); None for anything else."""
    return bt.tensor_of(value) if type(value) is Batch else value.expand(n, *value.shape) \
        if type(value) in PLAIN_TENSORS else None


def _masked(n, t, mask):
    """``x[m]`` of each instance's bool mask ``m`` of x's leading dims (``t`` the rows of the instances' x, one
    per instance): every instance's chosen elements laid end to end, each instance's value its own stretch of
    them, as long as its mask's count (read once: the stretches' lengths)."""
    lengths = mask.reshape(n, -1).sum(1).tolist()
    return rows.batch(n, rows.packed_rows(n, t[mask], lengths))


def _built_shared(index):
    """A list the program built of values every instance shares (in a tuple of such, or of shared values), as
    the plain list or tuple it is for every instance; None for anything else."""
    if type(index) is not Batch or index.struct is None or index.owner is not None or index.struct[0] not in (
            list, tuple):
        return None
    kind, parts = index.struct
    if not any(p.struct[0] is list for p in parts if type(p) is Batch and p.struct is not None) and kind is tuple:
        return None  # (a tuple with no list in it: ``_points`` reads each instance's own parts)
    plain = []
    for p in parts:
        if type(p) is Batch:  # (in a tuple, a list built of shared values; else it differs per instance)
            p = _built_shared(p) if kind is tuple and p.struct is not None and p.struct[0] is list else None
            if p is None:
                return None
        plain.append(p)
    return kind(plain)


def _element_each(n, parts, index):
    """``xs[k]`` of a list or tuple the program built of tensors of one shape (each instance's rows, or shared),
    with each instance's own int k: one gather of each instance's element from their stack. Only in a run that
    changes nothing in place (eager's result is the element itself, this one a copy of it); NotImplemented where
    a k lies outside the list (each instance raises its own IndexError) or the elements differ in kind."""
    k = bt.instance_index(index)
    if not parts or k is None:
        return NotImplemented
    rows_of = [_rows_each(n, p) for p in parts]
    if any(r is None for r in rows_of) or not bt.same_kind(rows_of, 0) or rows_of[0].dim() < 1 or \
            rows_of[0].shape[0] != n:
        return NotImplemented
    if bool(((k < -len(parts)) | (k >= len(parts))).any()):
        return NotImplemented
    stacked = torch.stack(rows_of, 1)
    at = (k % len(parts)).to(stacked.device)
    return bt.from_tensor(stacked[torch.arange(n, device=stacked.device), at])


@BATCH.register(torch.masked_select)
def masked_select(n, fn, args, kwargs):
    """``torch.masked_select(x, m)`` (and ``x.masked_select(m)``): ``x[m]`` of x and the mask broadcast against
    each other, either or both each instance's own: each instance's stretch of the chosen elements."""
    if kwargs or len(args) != 2:
        return NotImplemented
    x, m = (_rows_each(n, a) for a in args)
    if x is None or m is None or m.dtype is not torch.bool or x.dim() != m.dim():
        return NotImplemented  # (instances of other ranks: where a broadcast puts their dims, each instance's call)
    try:
        x, m = torch.broadcast_tensors(x, m)
    except RuntimeError:  # (shapes that do not broadcast: each instance's call raises torch's error)
        return NotImplemented
    return _masked(n, x, m)


@BATCH.register("masked_select")
def masked_select_method(n, x, args, kwargs):
    return masked_select(n, torch.masked_select, (x, *args), kwargs)


def _gather_each(n, x, index):
    """``x[i]`` where both differ per instance and each i is a Python int (the steps of a loop run ahead,
    ``codegen.recurrent``): one advanced index of x's rows, or each range's item; each instance's own mask
    (``x[x > 0]``): each instance's stretch of the chosen elements."""
    m = index.tensor if index.owner == "tensor" else None
    if m is not None and m.dtype is torch.bool and x.owner == "tensor" and 2 <= m.dim() <= x.tensor.dim() and \
            m.shape == x.tensor.shape[:m.dim()]:
        return _masked(n, x.tensor, m)
    if index.owner == "tensor" and x.owner == "tensor" and index.tensor.dim() >= 1 \
            and index.tensor.dtype in facts.INTEGER_INDEX and x.tensor.dim() >= 2:
        # (each instance's integer tensor, ``x[k]`` of ``v, k = x.sort()`` too: its instance's row number
        # broadcast against it)
        i = _held_index(index.tensor.to(x.tensor.device), x.tensor)
        rows = torch.arange(n, device=i.device).view(n, *([1] * (i.dim() - 1)))
        return bt.from_tensor(x.tensor[rows, i])
    if index.owner != "items" or not all(type(i) is int for i in index.items):
        return NotImplemented
    if type(x) is not Batch:  # (a range or tuple every instance shares)
        return bt.from_items([x[i] for i in index.items])
    if x.items is not None and x.owner == "items" and sharing.state.fresh and type(x.items[0]) in PLAIN_TENSORS:
        return _row_of_each_tensor(n, x, index)
    if x.items is not None and x.owner == "items":
        return ranges.items(x, index.items)
    t = x.tensor if x.owner == "tensor" else None
    if t is None or t.dim() < 2:
        return NotImplemented
    return bt.from_tensor(t[torch.arange(n, device=t.device), torch.tensor(index.items, device=t.device)])


def _stackable(x):
    """Whether Batch ``x`` holds each instance's own tensor, all of one shape (a leaf's sentence among leaves of
    sentences as long), in a run that changes nothing in place: read as their stack (eager's reads are views)."""
    return x.owner == "items" and x.thunk is None and sharing.state.fresh and \
        type(x.items[0]) in PLAIN_TENSORS and bt.instance_shape(x) is not None


def _row_of_each_tensor(n, x, index):
    """``inputs[tree.idx]``: each instance's own tensor (``recompile.map`` over sentences) at each instance's own
    int, one index of their rows (stacked, or padded where their lengths differ: ``rows.item_each``), in a run
    that changes nothing in place (eager's are views); NotImplemented where an int lies outside its tensor (each
    instance raises its own IndexError)."""
    found = rows.of(x)
    if found is not None:
        return rows.item_each(found, index)
    t = bt.tensor_of(x)
    if t is None or t.dim() < 2 or not all(-t.shape[1] <= i < t.shape[1] for i in index.items):
        return NotImplemented
    return bt.from_tensor(t[torch.arange(n, device=t.device), torch.tensor(index.items, device=t.device)])


def _points(n, x, parts):
    """``x[i, j]`` with ints, each shared or each instance's own (a Python int or a 0-d integer tensor): one
    advanced index of every instance's point, x shared or a batched tensor; of each instance's stretch of rows,
    its row (``rows.item_each``, or the shared place's), then the rest in that row. Only in a run that changes
    nothing in place (eager's are views of x, the index a copy). NotImplemented for other parts (slices, tensors
    of indices, masks), and where a place lies outside a stretch (each instance raises)."""
    if not sharing.state.fresh:
        return NotImplemented
    at = []
    for p in parts:
        k = p if type(p) is int else bt.instance_index(p) if type(p) is Batch else None
        if k is None:
            return NotImplemented
        at.append(k)
    if not any(type(k) is torch.Tensor for k in at):
        return NotImplemented
    if type(x) in PLAIN_TENSORS:
        return bt.from_tensor(x[tuple(at)]) if len(at) <= x.dim() else NotImplemented
    if type(x) is not Batch:
        return NotImplemented
    found = rows.of(x)
    if found is None:
        t = x.tensor if x.owner == "tensor" else None
        if t is None or len(at) >= t.dim():
            return NotImplemented
        return bt.from_tensor(t[(torch.arange(n, device=t.device), *at)])
    if len(at) > found.source.dim() - 1:  # (more ints than an instance has dims)
        return NotImplemented
    row = gather(n, operator.getitem, (x, at[0]), {}) if type(at[0]) is int else rows.item_each(found, parts[0])
    return _in_row(n, row, parts[1:])


def _in_row(n, row, rest):
    """``row[rest]`` (the places after a row's, each shared or each instance's), or ``row`` where none is left."""
    if row is NotImplemented or not rest:
        return row
    index = rest[0] if len(rest) == 1 else \
        bt.from_struct(tuple, list(rest), n) if any(type(p) is Batch for p in rest) else tuple(rest)
    return gather(n, operator.getitem, (row, index), {})


def _row_then_rest(n, x, parts):
    """``x[i, ...]`` of a shared tensor x, i each instance's int, the rest holding what ``_points`` does not read
    (``kids[i, :n_kids[i]]``, each instance's own stretch): each instance's row of x, one gather, then the rest
    in it, as ``x[i][...]`` reads the same. Only in a run that changes nothing in place (eager's is a view of x,
    the row here a copy)."""
    if not sharing.state.fresh or type(x) not in PLAIN_TENSORS or len(parts) < 2 or x.dim() < len(parts) or \
            type(parts[0]) is not Batch or bt.instance_index(parts[0]) is None:
        return NotImplemented
    return _in_row(n, gather(n, operator.getitem, (x, parts[0]), {}), parts[1:])


def _held_index(i, x):
    """Index rows ``i`` as the gather of ``x`` keeps them for its gradient: a copy where autograd records one,
    since the batch's index may be changed in place later (``t -= 1`` after ``xs[t]``), where each instance's
    0-d index was read as an int, which nothing keeps."""
    return i.clone() if x.requires_grad and torch.is_grad_enabled() and i.dim() else i


def index_rows(x, i):
    """``x[i]`` for a 1-d integer index: on CPU by index_select, a third the cost of advanced indexing on
    small tensors. It refuses negative or out-of-range indices, which ``x[i]`` then wraps or reports
    (on CUDA it would assert on the device instead, so there it is always ``x[i]``)."""
    if x.is_cpu and x.dim() and (i.dtype is torch.long or i.dtype is torch.int):
        try:
            return x.index_select(0, i)
        except (IndexError, RuntimeError):
            pass
    return x[i]


def _one_advanced(index):
    """A shared index that picks the same rows in every instance's dim 0: a list of ints, or an integer tensor
    (alone: with other indices, where numpy's rules put the picked dims may differ once batched)."""
    if type(index) is list:
        return bool(index) and all(type(i) is int for i in index)
    return type(index) is torch.Tensor and index.dim() >= 1 and index.dtype in facts.INTEGER_INDEX


def _adjacent_advanced(index):
    """A shared tuple index with integer tensors or lists of ints (ints count with them) side by side, the rest
    ints, slices and None: numpy's rules put the picked dims where they stand, after the instance's dim too."""
    if type(index) is not tuple or not any(_one_advanced(i) for i in index):
        return False
    at = [k for k, i in enumerate(index) if _one_advanced(i) or type(i) is int]
    return all(_one_advanced(i) or plain_index(i) and i is not Ellipsis for i in index) and \
        at == list(range(at[0], at[-1] + 1))


@BATCH.register(len)
def length(n, fn, args, kwargs):
    """``len(x)`` of a batch: the instances' first dim for a batched tensor (one int they share), a tuple's
    length for a tuple built in the program, else each instance's own."""
    if kwargs or len(args) != 1 or type(args[0]) is not Batch:
        return NotImplemented
    x = bt.ready(args[0])
    if x.owner == "tensor":
        return x.tensor.shape[1] if x.tensor.dim() >= 2 else NotImplemented  # (a 0-d tensor has no len)
    if x.struct is not None and x.owner is None and issubclass(x.struct[0], tuple):
        return len(x.struct[1])
    items = bt.items_of(x)
    try:
        found = [len(v) for v in items]
    except TypeError:
        return NotImplemented  # (each instance raises its own)
    return found[0] if all(f == found[0] for f in found) else bt.from_items(found)


def plain_index(index):
    """An index that selects the same way in every instance: ints, slices, None, Ellipsis (not tensors)."""
    if type(index) is tuple:
        return all(plain_index(i) for i in index)
    return type(index) in (int, slice, type(None)) or index is Ellipsis


BATCH.register(operator.contains, intrinsics.not_in)(dicts.contains)
for _dict_method in dicts.METHODS:
    BATCH.register(_dict_method)(dicts.method_rule(_dict_method))
BATCH.register(*distributions.CLASSES)(distributions.build)
BATCH.register(*distributions.EVENT_PARAMETERS)(distributions.build_with_events)
BATCH.register(torch.distributions.Independent)(distributions.independent)
BATCH.register(torch.distributions.kl_divergence)(distributions.kl)
for _method in distributions.METHODS:
    BATCH.register(_method)(distributions.method_rule(_method))
BATCH.register(range)(ranges.build)
BATCH.register(slice)(rows.slices)
BATCH.register(reversed)(rows.reversed_rows)
BATCH.register(intrinsics.as_sequence)(ranges.as_sequence)
BATCH.register(intrinsics.has_index)(ranges.has_index)
BATCH.register(intrinsics.fixed_cell)(cells.fixed_cells)
BATCH.register(intrinsics.set_cell)(cells.set_cells)
BATCH.register(intrinsics.read_local_cell)(cells.read_cells)
BATCH.register(intrinsics.cell_or_undefined)(cells.cells_or_undefined)
BATCH.register(intrinsics.delete_cell)(cells.delete_cells)
BATCH.register(intrinsics.make_function)(cells.make_functions)


@BATCH.register(intrinsics.check_bound)
def bound_check(n, fn, args, kwargs):
    """A read of a variable that some paths may leave unbound: UnboundLocalError if any instance's value is
    UNDEFINED, else the batch as it is (no instance is read by itself)."""
    if kwargs or len(args) not in (2, 3) or type(args[1]) is not str:
        return NotImplemented
    if _holds_undefined(args[0]):
        intrinsics.check_bound(intrinsics.UNDEFINED, *args[1:])
    return args[0]


def _holds_undefined(value):
    if value is intrinsics.UNDEFINED:
        return True
    if type(value) is not Batch or value.thunk is not None:  # (a lazy value is a call's result: bound)
        return False
    if value.pieces is not None:
        return any(_holds_undefined(v) for v, _ in value.pieces[0])
    return value.owner == "items" and any(x is intrinsics.UNDEFINED for x in value.items)


@BATCH.register(intrinsics.unpack_starred)
def starred_unpack(n, fn, args, kwargs):
    """``a, *rest = xs`` of a batched tuple of known length, or of a batched tensor's rows: taken apart
    as it is, the middle a batch of lists."""
    if kwargs or len(args) != 3 or type(args[0]) is not Batch:
        return NotImplemented
    value, before, after = args
    bt.ready(value)
    if value.struct is not None and value.owner is None:
        parts = list(bt.struct_items(value))
    elif value.owner == "tensor" and value.tensor.dim() > 1:
        parts = [bt.from_tensor(t) for t in value.tensor.unbind(1)]
    else:
        return NotImplemented
    if len(parts) < before + after:
        intrinsics.unpack_starred(parts, before, after)  # (its ValueError)
    end = len(parts) - after
    return bt.from_struct(tuple, [*parts[:before], bt.from_struct(list, parts[before:end], n), *parts[end:]], n)


@BATCH.register(intrinsics.build_tuple, intrinsics.build_list)
def _build_rule(n, fn, args, kwargs):
    return bt.from_struct(tuple if fn is intrinsics.build_tuple else list, list(args), n)


@BATCH.register(getattr)
def attribute(n, fn, args, kwargs):
    """``getattr(x, name)`` of a batched x."""
    x, name = args[0], args[1]
    if type(name) is not str or len(args) != 2:
        return NotImplemented
    if x.owner == "tensor" or (x.items is None and x.struct is None and bt.tensor_of(x) is not None):
        t = x.tensor
        if name in SHARED_ATTRS:
            return getattr(t, name)
        if name == "shape":
            return t.shape[1:]
        if name == "ndim":
            return t.dim() - 1
        if name == "data":  # (each instance's tensor's values, detached: rows of the batch's)
            return bt.from_tensor(t.data)
        if name in ("real", "imag"):  # (views of each element: the rows' own; a real dtype's imag raises)
            return bt.from_tensor(getattr(t, name))
        if name in ("T", "H") and t.dim() <= 3:  # (all of an instance's dims reversed: at most two, as torch allows)
            flipped = t.permute(0, *reversed(range(1, t.dim())))
            return bt.from_tensor(flipped.conj() if name == "H" else flipped)
        if name in ("mT", "mH") and t.dim() >= 3:  # (an instance's last two dims swapped)
            swapped = t.transpose(-2, -1)
            return bt.from_tensor(swapped.conj() if name == "mH" else swapped)
        if callable(getattr(torch.Tensor, name, None)):
            return Batch(x.n, method=(x, name))
    drawn = distributions.of(x)
    if drawn is not None:  # (``d.log_prob``, ``d.mean`` of each instance's distribution: the batch's)
        return Batch(x.n, method=(x, name)) if name in distributions.METHODS else \
            distributions.attribute(x.n, drawn, name)
    if dicts.has_method(x, name):  # (``d.get("h")``, ``d.values()``: see ``dicts``)
        return Batch(x.n, method=(x, name))
    if name in _LIST_METHODS and (x.struct is not None and x.owner is None and x.struct[0] is list or
                                  bt.own_lists(x) is not None):
        return Batch(x.n, method=(x, name))  # (``hs.append(h)`` of lists the program built: see ``appended``)
    if x.struct is not None and x.owner is None:  # (a field of what an op returned: ``x.max(-1).values``)
        kind, parts = x.struct
        fields = getattr(kind, "_fields", None) or getattr(kind, "__match_args__", ())
        if name in fields:
            return parts[fields.index(name)]
    if name in SHARED_ATTRS and name != "requires_grad" and rows.of(x) is not None:  # (``seq.dtype``)
        return getattr(rows.of(x).source, name)
    if name in ("shape", "ndim") and rows.of(x) is not None:  # (``xs.shape[0]``: each instance's length)
        seq = rows.of(x)
        rest = list(seq.source.shape[2:])
        return seq.source.dim() - 1 if name == "ndim" else \
            bt.from_struct(torch.Size, [bt.from_items(list(seq.lengths)), *rest], x.n)
    if padded.of(x) is not None:  # (``x.t().unsqueeze(0)`` of each instance's rows, and what follows)
        if name in SHARED_ATTRS:
            return getattr(padded.of(x).tensor, name)
        found = padded.attribute(x.n, name, padded.of(x))
        if found is not NotImplemented:
            return found
        return Batch(x.n, method=(x, name)) if name in padded.METHODS or name in ragged_products.METHODS \
            else NotImplemented
    if name == "T" and rows.of(x) is not None and rows.of(x).source.dim() == 3:
        return padded.rows_method(x.n, "t", rows.of(x), (), {})
    if (name in rows.ALONG_ROWS or name in row_wise.METHODS or name in padded.ROWS_METHODS or
            name in ragged_products.METHODS or name in ("new_zeros", "new_ones", "size")) and rows.of(x) is not None:
        return Batch(x.n, method=(x, name))  # (``torch.stack(hs).mean(0)``, ``xs.tanh()``: see ``rows``, ``row_wise``)
    if x.owner == "items" and sharing.state.fresh and not name.endswith("_") and x.thunk is None \
            and callable(getattr(torch.Tensor, name, None)) and all(type(v) in PLAIN_TENSORS for v in x.items) \
            and bt.same_kind(x.items, 0):
        # (a method of each instance's own tensor, all of one shape, where nothing changes one in place: called
        # on their stack, as a batch's tensor's is)
        return Batch(x.n, method=(x, name))
    if x.owner == "items" and name == "size" and x.thunk is None and all(type(v) in PLAIN_TENSORS for v in x.items):
        return Batch(x.n, method=(x, name))  # (``input_tensor.size(0)`` of each instance's own: ``_sizes_of_each``)
    if x.owner == "items" and name.endswith("_") and not name.endswith("__") \
            and callable(getattr(torch.Tensor, name, None)) and all(type(v) is torch.Tensor for v in x.items):
        # (``v.add_(...)`` of each instance's own tensor: run per instance on the Batch, which then forgets a
        # tensor stacked from its items before the change)
        return Batch(x.n, method=(x, name))
    if x.owner == "items" and x.thunk is None and not any(issubclass(t, torch.Tensor) for t in set(map(type, x.items))):
        # (``node.children``, ``node.word`` of each instance's own object: a tree of the user's nodes)
        # (``attrgetter`` follows dots, where ``getattr(v, "a.b")`` reads the one attribute of that name)
        return _read_of_each(x.items, operator.attrgetter(name) if "." not in name else lambda v: getattr(v, name))
    if name in _KIND_ATTRS and x.owner == "items" and x.thunk is None and all(
            isinstance(v, torch.Tensor) for v in x.items):
        # (``xs.dtype``, ``xs.shape`` of each instance's own tensor: one value where all have it, a Python read
        # each, no op)
        found = [getattr(v, name) for v in x.items]
        return found[0] if all(v == found[0] for v in found) else bt.from_items(found)
    return NotImplemented


def _read_of_each(objects, read):
    """``read(obj)`` of each instance's own Python object (``node.children``; ``node["word"]`` of a dict):
    each one's, as Python reads it, in one pass, in instance order (an instance's error raised there, as a loop
    of its reads raises it, each read made once); the one object where every instance's is that object."""
    found = list(map(read, objects))  # (the first instance's error, raised as its own read raises it)
    first = found[0]
    for v in found:  # (a loop, not all(genexpr): it runs at every node)
        if v is not first:
            return bt.from_items(found)
    return first


@BATCH.register(sum)
def python_sum(n, fn, args, kwargs):
    """``sum(xs)`` (or ``sum(xs, start)``) of a list or tuple the program built: its items added in order, a
    batched ``+`` each, as Python adds them."""
    if (kwargs and set(kwargs) != {"start"}) or not 1 <= len(args) + len(kwargs) <= 2:
        return NotImplemented
    xs = args[0]
    total = args[1] if len(args) > 1 else kwargs.get("start", 0)
    if type(xs) is Batch and xs.owner == "items":
        if type(total) is int and total == 0:
            out = _summed_rows(n, xs.items)
            return _summed_lists(n, xs.items) if out is NotImplemented else out
        if sharing.state.fresh and (type(total) in PLAIN_TENSORS or type(total) is Batch):
            # (``sum((f(c) for c in kids), h0)``: a tensor start; where nothing changes in place, the total of
            # an empty list may be a copy of it)
            return _summed_lists(n, xs.items, total)
    if type(xs) is not Batch or xs.struct is None or xs.owner is not None:
        return NotImplemented
    for item in bt.struct_items(xs):  # (a dict's keys: Python's TypeError, as ``sum(d)`` raises it)
        total = call(n, operator.add, (total, item))
    return total


def _summed_rows(n, lists):
    """``sum(xs)`` of each instance's list that a loop appended rows of one packed tensor to (``rows.Appended``: a
    node's children's states), while the lists hold those alone, in a run that changes nothing in place: one
    ``index_add`` of the rows by instance, in row order, so each list's rows add in its order from zero, as
    Python adds them (on the CPU, whose ``index_add`` adds in that order); an empty list's 0 (a leaf's) joined with
    the others' totals. NotImplemented for anything else."""
    if type(lists) is not rows.Appended or not sharing.state.fresh or not lists.holds_its_rows_alone():
        return NotImplemented
    packed = lists.packed
    if packed.device.type != "cpu" or not packed.is_floating_point() or len(lists) != n:
        return NotImplemented
    total = packed.new_zeros(n, *packed.shape[1:]).index_add(0, lists.instance, packed)
    full = [k for k, m in enumerate(lists.lengths) if m]
    if len(full) == n:
        return bt.from_tensor(total)
    if not full:
        return NotImplemented
    empty = [k for k, m in enumerate(lists.lengths) if not m]
    return bt.join(n, [(0, empty), (bt.from_tensor(total[bt.long_tensor(full)]), full)])


def _summed_lists(n, lists, start=None):
    """``sum(xs)`` (``sum(xs, start)``, a tensor start of the items' shape and dtype) of each instance's own list
    of tensors of one shape and dtype (lists of their own lengths): position by position, every instance's j-th
    tensor added to its total at once, from zero (from each instance's start), so that each total rounds as
    ``0 + a + b ...`` does (and the same way every run, on any device); an empty list's sum is Python's 0 (a
    leaf's children), joined with the others' totals, or its start. NotImplemented for anything else."""
    if not all(type(each) is list for each in lists):
        return NotImplemented
    if start is not None:
        if not any(lists):
            return start  # (``sum([], s) is s``)
        begun = start if type(start) is not Batch else bt.tensor_of(start)
        first = next(t for each in lists for t in each)
        if type(begun) not in PLAIN_TENSORS or type(first) is not torch.Tensor or begun.dtype is not first.dtype \
                or begun.device != first.device \
                or begun.shape[type(start) is Batch:] != first.shape:
            return NotImplemented
        return _summed_from(n, lists, begun if type(start) is Batch else begun.expand(n, *begun.shape))
    empty = [k for k, each in enumerate(lists) if not each]
    if empty:
        if len(empty) == n:
            return NotImplemented
        full = [k for k, each in enumerate(lists) if each]
        total = _summed_lists(len(full), [lists[k] for k in full])
        return total if total is NotImplemented else bt.join(n, [(0, empty), (total, full)])
    first = lists[0][0]
    return _summed_from(n, lists, first.new_zeros(n, *first.shape)) if type(first) is torch.Tensor \
        else NotImplemented


def _summed_from(n, lists, total):
    """``_summed_lists``' totals, each instance's from its row of ``total`` (n rows), once their items are known to
    be tensors of one shape and dtype."""
    flat = [t for each in lists for t in each]
    first = flat[0]
    if not (first.is_floating_point() or first.is_complex()) or any(
            type(t) is not torch.Tensor or t.shape != first.shape or t.dtype is not first.dtype
            or t.device != first.device for t in flat):
        return NotImplemented
    for j in range(max(len(each) for each in lists)):
        taking = [k for k, each in enumerate(lists) if len(each) > j]
        step = torch.stack([lists[k][j] for k in taking])
        if len(taking) == n:
            total = total + step
        else:
            at = torch.tensor(taking, device=first.device)
            total = total.index_put((at,), total[at] + step)
    return bt.from_tensor(total)


# attributes of a batched tensor that are every instance's too
SHARED_ATTRS = {"dtype", "device", "is_cuda", "requires_grad", "layout", "is_floating_point"}
_KIND_ATTRS = ("dtype", "device", "is_cuda", "layout", "shape", "ndim")  # (not its values, nor its gradient's)


@BATCH.register("size")
def size(n, x, args, kwargs):
    if kwargs or len(args) > 1 or args and type(args[0]) is not int:
        return NotImplemented
    shape = bt.instance_shape(x)
    if shape is None:  # (each instance's tensor of its own length: ``input_tensor.size(0)``, each one's)
        return _sizes_of_each(x, args)
    return shape[args[0]] if args else shape


def _sizes_of_each(x, args):
    """``x.size(d)`` (``x.size()``) of each instance's own tensor, as each one's gives it: a Batch of them, or the
    one every instance has; NotImplemented where a value is no tensor or ``d`` no dim of one (its own raises)."""
    found = rows.of(x)
    tensors = list(found) if found is not None and found.made else None if found is not None else \
        bt.items_of(x) if x.owner == "items" and x.thunk is None else None
    if found is not None and tensors is None:  # (views not made: the lengths, the shared rest)
        rank = found.source.dim() - 1
        d = args[0] if args else None
        if d is not None and not -rank <= d < rank:
            return NotImplemented
        if d is not None and d % rank != 0:
            return found.source.shape[1 + d % rank]
        sizes = [torch.Size([k, *found.source.shape[2:]]) for k in found.lengths]
        return bt.from_items(list(found.lengths)) if d is not None else bt.from_items(sizes)
    if tensors is None or not all(type(t) in PLAIN_TENSORS and (not args or -t.dim() <= args[0] < t.dim())
                                  for t in tensors):
        return NotImplemented
    sizes = [t.size(*args) for t in tensors]
    return sizes[0] if all(v == sizes[0] for v in sizes) else bt.from_items(sizes)


@BATCH.register("dim")
def dim(n, x, args, kwargs):
    shape = bt.instance_shape(x)
    return NotImplemented if shape is None or args or kwargs else len(shape)


@BATCH.register("append")
def appended(n, xs, args, kwargs):
    """``xs.append(v)`` of a list the program built, held as its elements (every instance's list as long as
    the others'): v, batched or shared, becomes its next element, in the list every name of it sees. Of each
    instance's own list (lists of their own lengths: some instances appended in a loop they left), each
    instance's v is appended to its list, as its own call would."""
    if kwargs or len(args) != 1:
        return NotImplemented
    lists = bt.own_lists(xs)
    if lists is not None:
        values = bt.items_of(args[0]) if type(args[0]) is Batch else [args[0]] * n
        for each, v in zip(lists, values):
            each.append(v)
        return None
    if xs.struct is None or xs.owner is not None or xs.struct[0] is not list:
        return NotImplemented
    xs.struct[1].append(args[0])
    return None


@BATCH.register("extend")
def extended(n, xs, args, kwargs):
    """``xs.extend(ys)`` of a list the program built (held as its elements) by a list or tuple the program built
    or a shared one: their elements its next ones; of each instance's own list, each instance's ys (``append``)."""
    if kwargs or len(args) != 1 or type(xs) is not Batch:
        return NotImplemented
    ys = args[0]
    built = xs.struct is not None and xs.owner is None and xs.struct[0] is list
    if built and type(ys) is Batch and ys.struct is not None and ys.owner is None and ys.struct[0] in (list, tuple):
        xs.struct[1].extend(list(ys.struct[1]))
        return None
    if built and type(ys) in (list, tuple):
        xs.struct[1].extend(ys)
        return None
    # (each instance's ys, of its own length maybe: each instance's own list from here)
    lists = bt.own_lists_made(xs) if built and type(ys) is Batch else bt.own_lists(xs)
    if lists is not None:
        each_ys = bt.items_of(ys) if type(ys) is Batch else [ys] * n
        for each, more in zip(lists, each_ys):
            each.extend(more)
        return None
    return NotImplemented


@BATCH.register(intrinsics.hand_back)
def handed_back(n, fn, args, kwargs):
    """``intrinsics.hand_back(target, own)`` of each instance's list ``target`` and own list (``passes.accumulate``):
    each instance's, as its own call would (Python's work on its lists)."""
    target, own = args
    if kwargs or type(target) is not Batch:
        return NotImplemented
    lists = bt.own_lists_made(target)
    if lists is None:
        return NotImplemented
    for each, mine in zip(lists, bt.items_of(own) if type(own) is Batch else [own] * n):
        fn(each, mine)
    return None


@BATCH.register("insert")
def inserted(n, xs, args, kwargs):
    """``xs.insert(i, v)`` (a shared int i) of a list the program built, held as its elements (v, batched or
    shared, its element i), or of each instance's own list (each instance's v at i of its list)."""
    if kwargs or len(args) != 2 or type(args[0]) is not int:
        return NotImplemented
    if xs.struct is not None and xs.owner is None and xs.struct[0] is list:
        xs.struct[1].insert(args[0], args[1])
        return None
    lists = bt.own_lists(xs)
    if lists is None:
        return NotImplemented
    values = bt.items_of(args[1]) if type(args[1]) is Batch else [args[1]] * n
    for each, v in zip(lists, values):
        each.insert(args[0], v)
    return None


@BATCH.register("pop")
def popped(n, xs, args, kwargs):
    """``xs.pop()`` (``xs.pop(i)``, a shared int i) of a list the program built, held as its elements: the element
    taken from the list every name of it sees; of each instance's own list, each instance's, where every list has
    it (else each instance's own call: Python's IndexError where one has not)."""
    if kwargs or len(args) > 1 or args and type(args[0]) is not int:
        return NotImplemented
    at = args[0] if args else -1
    lists = bt.own_lists(xs)
    if lists is not None and all(-len(v) <= at < len(v) for v in lists):
        return bt.from_items([each.pop(at) for each in lists])
    if xs.struct is None or xs.owner is not None or xs.struct[0] is not list or not \
            -len(xs.struct[1]) <= at < len(xs.struct[1]):
        return NotImplemented
    return xs.struct[1].pop(at)


@BATCH.register(int, float, bool)
def python_numbers(n, fn, args, kwargs):
    """``int(t)``, ``float(t)``, ``bool(t)`` of each instance's one-element tensor: every instance's Python number
    from one ``tolist`` of the rows (what ``t.item()`` gives each, converted as the builtin converts it)."""
    numbers = _numbers_of(n, args[0]) if len(args) == 1 and not kwargs else None
    if numbers is None:
        return python_arithmetic(n, fn, args, kwargs)  # (``float(t.item())``: of Python numbers)
    return bt.from_items([fn(v) for v in numbers])


@BATCH.register(any, all)
def python_any_all(n, fn, args, kwargs):
    """``any(t)``, ``all(t)`` of each instance's tensor of one dim (Python's truth of each element in turn; of a
    (k, 1) tensor, of each row's one element): every instance's bool from one reduction of the rows and one host
    read, as ``bool(t)`` gives each (NaN is true, an empty tensor has none: any False, all True)."""
    x = args[0] if len(args) == 1 and not kwargs else None
    t = (x.tensor if x.owner == "tensor" else bt.tensor_of(x)) if type(x) is Batch else None
    if t is None or t.layout is not torch.strided or t.dim() not in (2, 3) or t.dim() == 3 and t.shape[2] != 1:
        return NotImplemented  # (a 0-d tensor, rows of several elements: each instance's call raises Python's error)
    truth = (t != 0).reshape(t.shape[0], -1)
    return bt.from_items((truth.any(1) if fn is any else truth.all(1)).tolist())


@BATCH.register(round, abs, min, max, divmod, pow, *facts.MATH)
def python_arithmetic(n, fn, args, kwargs):
    """Python's builtins and ``math`` of each instance's Python numbers (``round(t.item(), 2)``,
    ``math.exp(float(t))``): each instance's computed as Python computes it (Python code of Python values, not
    a torch op run per instance); ``abs(t)`` of each instance's tensor: ``torch.abs`` of the batch."""
    rows = None if kwargs and any(type(v) is Batch for v in kwargs.values()) else _number_rows(args)
    if rows is not None:
        return bt.from_items([fn(*row, **kwargs) for row in rows])
    if fn is abs and len(args) == 1 and not kwargs and type(args[0]) is Batch:
        return elementwise(n, torch.abs, args, {})
    if (fn is max or fn is min) and not kwargs:
        return _extreme_of_tensors(n, fn, args)
    if fn is pow and len(args) == 2 and not kwargs:  # (``pow(x, 2)`` is ``x ** 2``)
        return call(n, operator.pow, args)
    return NotImplemented


def _extreme_of_tensors(n, fn, args):
    """``max(a, b)``, ``min(a, b, c)`` or ``max(xs)`` (a list or tuple the program built) of one-element tensors of
    one shape and dtype, each instance's or shared: Python keeps the first and takes each later one that
    compares greater (less), which is ``torch.where(b > a, b, a)`` over the batch, the chosen tensor's gradient
    its own as in eager code; NotImplemented for anything else."""
    items = args
    if len(args) == 1 and type(args[0]) is Batch and args[0].struct is not None and args[0].owner is None \
            and issubclass(args[0].struct[0], (list, tuple)):
        items = args[0].struct[1]
    if len(items) < 2:
        return NotImplemented
    rows = []
    for item in items:
        t = bt.tensor_of(item) if type(item) is Batch else item.unsqueeze(0) if type(item) in PLAIN_TENSORS \
            else None
        if t is None or t[0].numel() != 1:
            return NotImplemented
        rows.append(t)
    first = rows[0]
    if any(t.shape[1:] != first.shape[1:] or t.dtype is not first.dtype or t.device != first.device for t in rows):
        return NotImplemented
    beats = operator.gt if fn is max else operator.lt
    out = first
    for t in rows[1:]:
        out = torch.where(beats(t, out), t, out)
    if out.shape[0] != n:
        out = out.expand(n, *out.shape[1:])  # (every one shared: the same for each instance)
    return bt.from_tensor(out)


@BATCH.register(operator.index)
def index_numbers(n, fn, args, kwargs):
    """``operator.index(t)`` of each instance's 0-d integer tensor (the bound of a ``reversed(range(t))`` loop):
    every instance's int from one ``tolist`` of the rows; other values each instance's own call."""
    x = args[0] if len(args) == 1 and not kwargs else None
    if type(x) is Batch and x.owner == "items" and all(type(i) is int for i in x.items):
        return x  # (each instance's int: its own index, as it is)
    t = x.tensor if type(x) is Batch and x.owner == "tensor" else None
    if t is None or t.dim() != 1 or t.dtype not in facts.INTEGER_INDEX:
        return NotImplemented
    return bt.from_items(t.tolist())


@BATCH.register("item")
def item_numbers(n, x, args, kwargs):
    """``t.item()`` of each instance's one-element tensor: one ``tolist`` of the rows."""
    numbers = None if args or kwargs else _numbers_of(n, x)
    return NotImplemented if numbers is None else bt.from_items(numbers)


@BATCH.register("tolist")
def listed(n, x, args, kwargs):
    """``t.tolist()`` of each instance's tensor: one ``tolist`` of the rows, each instance's own nested list (or
    number, of a 0-d tensor)."""
    t = None if args or kwargs else bt.tensor_of(x)
    if t is None or t.layout is not torch.strided:
        return NotImplemented
    return bt.from_items(t.tolist())


def _numbers_of(n, x):
    """The Python numbers of Batch ``x``, a tensor of one element per instance (not complex), or None."""
    t = x.tensor if type(x) is Batch and x.owner == "tensor" else None
    if t is None or t.numel() != n or t.is_complex() or t.layout is not torch.strided or t.dtype is torch.uint64:
        return None  # (a uint64 past int64's range: each instance's call raises)
    return t.reshape(n).tolist()


@BATCH.register("numel", "nelement")
def numel(n, x, args, kwargs):
    shape = bt.instance_shape(x)
    return NotImplemented if shape is None or args or kwargs else shape.numel()


@BATCH.register("view", "reshape")
def reshaping(n, x, args, kwargs):
    """view / reshape: the instance dim stays first."""
    t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
    if t is None or kwargs or any(type(a) is Batch for a in args):
        return NotImplemented
    shape = args[0] if len(args) == 1 and type(args[0]) in (tuple, list, torch.Size) else args
    if not all(type(s) is int for s in shape):
        return NotImplemented
    return bt.from_tensor(t.reshape((t.shape[0], *shape)))


def unary_method(name):
    def rule(n, x, args, kwargs):
        if args or kwargs:
            return NotImplemented
        t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
        return NotImplemented if t is None else bt.from_tensor(getattr(t, name)())
    return rule


def method_dim(name, position, default_all=False):
    """Tensor method ``name`` taking a dim (sum, mean, softmax, unsqueeze, chunk ...)."""

    def rule(n, x, args, kwargs):
        t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
        if t is None or any(type(a) is Batch for a in (*args, *kwargs.values())) or not dims_shift(t, name):
            return NotImplemented
        args, kwargs = list(args), dict(kwargs)
        if _no_dims(kwargs.get("dim")) or len(args) > position and _no_dims(args[position]):
            return NotImplemented
        if "dim" in kwargs:
            kwargs["dim"] = shift_dim(kwargs["dim"])
        elif len(args) > position:
            args[position] = shift_dim(args[position])
        elif default_all and t.dim() > 1:  # x.sum(): over every dim of the instance
            kwargs["dim"] = tuple(range(1, t.dim()))
        else:
            return NotImplemented
        return _wrap(getattr(t, name)(*args, **kwargs), n)

    return rule


@BATCH.register(torch.sum, torch.mean)
def full_reduction(n, fn, args, kwargs):
    """torch.sum(x) / torch.mean(x) with no dim: a reduction over all of an instance."""
    if len(args) != 1 or kwargs or type(args[0]) is not Batch:
        return _dim_rule(1)(n, fn, args, kwargs)
    t = bt.tensor_of(args[0])
    if t is None or t.dim() == 1:  # (an instance's 0-d tensor: leave it to vmap)
        return NotImplemented
    return bt.from_tensor(fn(t, dim=tuple(range(1, t.dim()))))


@BATCH.register(F.cross_entropy, F.nll_loss)
def cross_entropy(n, fn, args, kwargs):
    """cross_entropy / nll_loss: an instance's (C) or (B, C) input becomes rows of one (n·B, C) input."""
    if len(args) != 2 or not {"reduction"}.issuperset(kwargs) or type(args[0]) is not Batch:
        return NotImplemented
    if rows.of(args[0]) is not None:  # (a loss per word of each sentence: ``F.nll_loss(scores, tags[:n])``)
        return _stretch_losses(n, fn, rows.of(args[0]), args[1], kwargs.get("reduction", "mean"))
    values = _tensor_args(n, args)
    if values is None or type(args[1]) is not Batch:
        return NotImplemented
    x, target = values
    reduction = kwargs.get("reduction", "mean")
    if x.dim() == 2 and target.dim() == 1:  # one row per instance
        losses = _row_losses(fn, x, target)
        if reduction == "mean":  # (an ignored target's mean is 0 / 0, as torch's)
            losses = losses / (target != -100).to(losses.dtype)
        return bt.from_tensor(losses)
    if x.dim() != 3 or target.dim() != 2 or target.dtype not in (torch.long, torch.int):
        return NotImplemented  # class probabilities, or extra dims: leave it to vmap
    b = x.shape[1]
    losses = _row_losses(fn, x.reshape(n * b, x.shape[2]), target.reshape(n * b)).reshape(n, b)
    if reduction == "none":
        return bt.from_tensor(losses)
    if reduction == "sum":
        return bt.from_tensor(losses.sum(1))
    if reduction == "mean":  # (over each instance's targets that are not ignored, as torch's mean)
        return bt.from_tensor(losses.sum(1) / (target != -100).sum(1).to(losses.dtype))
    return NotImplemented


def _stretch_losses(n, fn, scores, targets, reduction):
    """cross_entropy / nll_loss of each instance's stretch of rows (L, C) and its stretch of class indices (L):
    one loss over every instance's rows packed, each row's loss then summed (or averaged over the targets that are
    not ignored, or kept: Rows) per instance."""
    labels = rows.of(targets) if type(targets) is Batch else None
    if labels is None or labels.lengths != scores.lengths or scores.source.dim() != 3 or \
            labels.source.dim() != 2 or labels.source.dtype not in (torch.long, torch.int) or scores.shortest == 0 \
            or reduction not in ("none", "sum", "mean"):
        return NotImplemented
    target = row_wise.packed(labels)
    losses = row_wise.from_packed(n, _row_losses(fn, row_wise.packed(scores), target), scores)
    if reduction == "none":
        return losses
    total = rows.reduced(n, "sum", rows.of(losses), (0,), {})
    if reduction == "sum" or total is NotImplemented:
        return total
    counted = rows.reduced(n, "sum", rows.of(row_wise.from_packed(n, (target != -100).to(total.tensor.dtype),
                                                                  scores)), (0,), {})
    return bt.from_tensor(total.tensor / counted.tensor)  # (over each instance's targets not ignored, as torch's)


def _row_losses(fn, x, target):
    """``fn(x, target, reduction="none")`` for rows ``x`` (R, C) of class indices ``target`` (R). Without
    grad, a cross-entropy of a few classes over many rows is ``logsumexp(x) - x[target]``: torch's
    ``log_softmax`` is slow for 3 to 15 classes on CPU (measured: 1.2-5x slower from about 1000 elements,
    e.g. 60 against 25 us for 941 rows of 5 classes; faster below, and for 2 or 16 and more classes). An
    index outside the classes (``ignore_index``) makes ``gather`` refuse: torch's own then answers it."""
    rows, classes = x.shape
    if fn is F.cross_entropy and 2 < classes < 16 and rows * classes >= 1024 and x.is_cpu and \
            target.dtype is torch.long and not (torch.is_grad_enabled() and x.requires_grad):
        try:
            picked = x.gather(1, target.unsqueeze(1)).squeeze(1)
        except (IndexError, RuntimeError):
            pass
        else:
            return torch.logsumexp(x, 1) - picked
    return fn(x, target, reduction="none")


@BATCH.register(operator.matmul, torch.matmul)
def matmul(n, fn, args, kwargs):
    """``x @ w`` of a batched x (instance rank 1 or more) and a shared vector or matrix w: one product, the
    instance dim one more leading dim of x; of a shared matrix and a batched x, one product too; of two
    batched vectors or matrices, one batched product (``batched_product``); anything else through vmap."""
    out = _product(args, kwargs)
    return _vmapped(n, fn, args, kwargs, None) if out is None else bt.from_tensor(out)


def _product(args, kwargs, ranks=None):
    """The batch's tensor of each instance's ``a @ b`` (``args``), one product, or None; ``ranks``: the instance
    ranks the op takes (``torch.mm``: 2 and 2), or None for any of matmul's."""
    if len(args) != 2 or kwargs or not any(type(a) is Batch for a in args):
        return None
    a, b = (bt.tensor_of(v) if type(v) is Batch else v if type(v) in PLAIN_TENSORS else None for v in args)
    if a is None or b is None or a.dtype != b.dtype:
        return None
    ra, rb = (t.dim() - (type(v) is Batch) for t, v in zip((a, b), args))
    if ranks is not None and (ra, rb) != ranks or ra not in (1, 2, 3) or rb not in (1, 2, 3):
        return None
    if type(args[1]) is not Batch:  # (x @ w: the instance dim one more leading dim of x)
        return a @ b if rb in (1, 2) else None
    if type(args[0]) is not Batch:  # (w @ x: w's leading dims must not meet the instance dim)
        if ra == 1 and rb == 1:
            return b @ a
        if ra == 2 and rb == 1:
            return b @ a.t()
        return a @ b if ra in (1, 2) or ra == rb == 3 else None
    return batched_product(a, b) if ra in (1, 2) and rb in (1, 2) or ra == rb == 3 else None


@BATCH.register(torch.mm, torch.bmm, torch.mv, torch.dot, torch.inner)
def products(n, fn, args, kwargs):
    """``torch.mm`` / ``bmm`` / ``mv`` / ``dot`` of batched and shared operands, as ``@`` of the instance ranks
    each takes: one product for every instance."""
    out = _product(args, kwargs, _PRODUCT_RANKS[fn])
    return _vmapped(n, fn, args, kwargs, None) if out is None else bt.from_tensor(out)


_PRODUCT_RANKS = {torch.mm: (2, 2), torch.bmm: (3, 3), torch.mv: (2, 1), torch.dot: (1, 1), torch.inner: (1, 1)}


@BATCH.register(torch.outer, torch.ger)
def outer(n, fn, args, kwargs):
    """``torch.outer(a, b)`` of instance vectors (one side may be shared): one broadcast product."""
    if len(args) != 2 or kwargs:
        return NotImplemented
    a, b = (bt.tensor_of(v) if type(v) is Batch else v if type(v) in PLAIN_TENSORS else None for v in args)
    if a is None or b is None or a.dtype != b.dtype or any(
            t.dim() - (type(v) is Batch) != 1 for t, v in zip((a, b), args)):
        return NotImplemented
    return bt.from_tensor(a.unsqueeze(-1) * b.unsqueeze(-2))


def batched_product(x, y):
    """Instance k's ``x[k] @ y[k]`` for every k, of instance vectors or matrices (dim 0 the instance)."""
    if x.dim() == 2 and y.dim() == 2:
        return (x * y).sum(-1)
    if y.dim() == 2:
        return (x @ y.unsqueeze(-1)).squeeze(-1)
    if x.dim() == 2:
        return (x.unsqueeze(1) @ y).squeeze(1)
    return x @ y


_ANY_RANK = {F.embedding}


@BATCH.register(nn.Linear, nn.Embedding, nn.LayerNorm)
def _module_over_last_dims(n, module, args, kwargs):
    kind = type(module)
    if _counts_its_indices(module, args, kwargs):
        return per_instance(n, module, args, kwargs, why=fallbacks.COUNTED)
    if kind is nn.Embedding and len(args) == 1 and not kwargs and type(args[0]) is Batch:
        found = rows.of(args[0])
        if found is not None:  # (each instance's stretch of indices, ``self.embed(words[:n])``)
            out = rows.embedded(module, found, lazy_weights.lookup)
            return NotImplemented if out is None else out
        i = bt.tensor_of(args[0])
        if i is None:
            return NotImplemented
        # (what Embedding.forward runs, its gradient deferred to the run's gate where ``lookup`` may)
        return bt.from_tensor(lazy_weights.lookup(module, i))
    if kind is nn.Linear and len(args) == 1 and not kwargs and "forward" not in module.__dict__:
        # (what Linear.forward runs, without Module.__call__'s dispatch: call() checked for hooks)
        return over_last_dims(n, F.linear, (args[0], module.weight, module.bias), kwargs)
    return over_last_dims(n, module, args, kwargs)


@BATCH.register(nn.Sequential)
def in_sequence(n, seq, args, kwargs):
    """An ``nn.Sequential`` (with its own forward and no hooks): each of its modules by its rule, on what the
    one before gave, as its forward runs them."""
    if kwargs or len(args) != 1 or type(seq) is not nn.Sequential or "forward" in seq.__dict__:
        return NotImplemented
    x = args[0]
    for module in seq:
        x = call(n, module, (x,))
    return x


@BATCH.register(nn.RNNCell, nn.LSTMCell, nn.GRUCell)
def recurrent_cell(n, cell, args, kwargs):
    """An RNN, LSTM or GRU cell on batched inputs: the instances' rows (an instance's input a vector, or a
    matrix of rows) are one batch of rows for the cell; a shared state, or a shared input (``cell(zeros, h)``
    of each instance's own state), is every instance's."""
    if len(args) > 2 or (kwargs and set(kwargs) != {"hx"}) or not args:
        return NotImplemented
    x = args[0]
    if type(x) is Batch:
        x = bt.tensor_of(x)
    elif type(x) in PLAIN_TENSORS and x.dim() in (1, 2):
        x = x.expand(n, *x.shape)
    else:
        return NotImplemented
    if x is None or x.dim() not in (2, 3):
        return NotImplemented
    rows = x.shape[:-1]  # (n,) or (n, B)
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    states = None
    if hx is not None:
        parts = list(bt.struct_items(hx)) if type(hx) is Batch and hx.struct is not None and hx.owner is None else \
            list(hx) if type(hx) is tuple else [hx]
        if (type(cell) is nn.LSTMCell) != (len(parts) == 2):
            return NotImplemented
        states = []
        for part in parts:
            t = bt.tensor_of(part) if type(part) is Batch else part
            if not isinstance(t, torch.Tensor):
                return NotImplemented
            if type(part) is not Batch:
                t = t.expand(*rows, *t.shape[-1:]) if t.dim() == x.dim() - 1 else None
            if t is None or t.shape[:-1] != rows:
                return NotImplemented
            states.append(t.reshape(-1, t.shape[-1]))
    flat = x.reshape(-1, x.shape[-1])
    out = lazy_weights.cell(cell, flat, None if states is None else tuple(states) if len(states) == 2 else states[0])
    if type(out) is tuple:
        return bt.from_struct(tuple, [bt.from_tensor(o.reshape(*rows, o.shape[-1])) for o in out], n)
    return bt.from_tensor(out.reshape(*rows, out.shape[-1]))


_ATTENTION_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                   "average_attn_weights", "is_causal")


@BATCH.register(nn.MultiheadAttention)
def multihead_attention(n, module, args, kwargs):
    """``mha(q, k, v, ...)`` of each instance's sequences (one, ``(L, E)``, or a batch of its own): one call of
    the module with every instance's sequences as its batch, a key padding mask of each instance's stacked with
    them, an ``attn_mask`` every instance shares; the results (and weights) cut back into each instance's.
    (``need_weights=False`` takes torch's fused attention, which ``torch.func.vmap`` cannot batch.)"""
    if len(args) > len(_ATTENTION_ARGS) or set(kwargs) - set(_ATTENTION_ARGS[len(args):]):
        return NotImplemented
    bound = {**dict(zip(_ATTENTION_ARGS, args)), **kwargs}
    if any(type(bound.get(name)) is Batch for name in ("need_weights", "attn_mask", "average_attn_weights",
                                                       "is_causal")) or module.training and module.dropout > 0:
        return NotImplemented  # (a dropout's draws are each instance's own, in its own order)
    attn_mask = bound.get("attn_mask")
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() != 2:
        return NotImplemented  # (a mask per batch row and head: the batch here is another)
    inputs = [bound.get(name) for name in ("query", "key", "value")]
    tensors = [bt.tensor_of(x) if type(x) is Batch else None for x in inputs]
    if any(t is None for t in tensors) or len({t.dim() for t in tensors}) != 1 or tensors[0].dim() not in (3, 4):
        return NotImplemented
    mask = bound.get("key_padding_mask")
    rank = tensors[0].dim() - 1  # (an instance's: 2 for one sequence, 3 for a batch of its own)
    if type(mask) is Batch:
        mask = bt.tensor_of(mask)
        if mask is None or mask.dim() != rank:
            return NotImplemented
    elif mask is not None:
        return NotImplemented  # (one mask every instance shares: each instance's own call)
    first = module.batch_first
    batched = [_sequences_batched(t, rank, first) for t in tensors]
    mask = mask.flatten(0, 1) if mask is not None and rank == 3 else mask
    call = {**{k: v for k, v in bound.items() if k not in ("query", "key", "value", "key_padding_mask")},
            "key_padding_mask": mask}
    out, weights = module(*batched, **call)
    if rank == 3:
        weights = None if weights is None else weights.unflatten(0, (n, -1))
    out = _sequences_unbatched(out, n, rank, first)
    return bt.from_struct(tuple, [bt.from_tensor(out), None if weights is None else bt.from_tensor(weights)], n)


def _sequences_batched(t, rank, first):
    """The batch's rows ``t`` of each instance's sequence (``rank`` 2: ``(L, E)``) or own batch of them (3), as
    one batch of sequences for a module (``batch_first`` or not): the instances are the batch, or their batches
    laid end to end."""
    if rank == 2:
        return t if first else t.transpose(0, 1)
    return t.flatten(0, 1) if first else t.transpose(0, 1).flatten(1, 2)


def _sequences_unbatched(out, n, rank, first):
    """The module's output of ``_sequences_batched`` inputs back as the batch's rows, each instance's."""
    if rank == 2:
        return out if first else out.transpose(0, 1)
    return out.unflatten(0, (n, -1)) if first else out.unflatten(1, (n, -1)).transpose(0, 1)


@BATCH.register(nn.TransformerEncoderLayer, nn.TransformerEncoder)
def transformer_encoder(n, module, args, kwargs):
    """A Transformer encoder layer (or stack of them) over each instance's sequence (``(L, E)``, or a batch of its
    own): one call with every instance's sequences as its batch, a key padding mask of each instance's with them,
    a ``src_mask`` every instance shares. Not with dropout while training (each instance draws its own), nor
    where the encoder would read a padding mask as nested tensors (its outputs past each end: zeros)."""
    names = ("src", "mask" if type(module) is nn.TransformerEncoder else "src_mask", "src_key_padding_mask",
             "is_causal")
    bound = by_names(args, kwargs, names)
    if bound is None or "forward" in module.__dict__ or module.training and any(
            isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        return NotImplemented
    src, padding = bound.get("src"), bound.get("src_key_padding_mask")
    if any(type(bound.get(name)) is Batch for name in names[1:] if name != "src_key_padding_mask") or \
            type(src) is not Batch or padding is not None and type(padding) is not Batch:
        return NotImplemented
    if isinstance(bound.get(names[1]), torch.Tensor) and bound[names[1]].dim() != 2:
        return NotImplemented  # (a mask per batch row and head: the batch here is another)
    x = bt.tensor_of(src)
    layer = module.layers[0] if type(module) is nn.TransformerEncoder else module
    if x is None or x.dim() not in (3, 4):
        return NotImplemented
    rank, first = x.dim() - 1, layer.self_attn.batch_first
    call = {k: v for k, v in bound.items() if k not in ("src", "src_key_padding_mask")}
    if padding is not None:
        padding = bt.tensor_of(padding)
        if padding is None or padding.dim() != rank or type(module) is nn.TransformerEncoder:
            return NotImplemented
        call["src_key_padding_mask"] = padding if rank == 2 else padding.flatten(0, 1)
    return bt.from_tensor(_sequences_unbatched(module(_sequences_batched(x, rank, first), **call), n, rank, first))


@BATCH.register(nn.RNN, nn.LSTM, nn.GRU)
def recurrent_layer(n, module, args, kwargs):
    """An ``nn.RNN``, ``LSTM`` or ``GRU`` over each instance's sequences: the instances' sequences are one batch
    of sequences for the module (each is run on its own by it), its results cut back per instance. Not with
    dropout between layers while training (each instance draws its own), nor with packed sequences."""
    if len(args) > 2 or (kwargs and set(kwargs) != {"hx"}) or not args or type(args[0]) is not Batch \
            or "forward" in module.__dict__ or (module.dropout and module.training):
        return NotImplemented
    stretches = rows.of(args[0])  # (``self.lstm(self.embed(words[:n]))``: sequences of their own lengths)
    seq, one = args[0], padded.of(args[0])
    first = module.batch_first
    if one is not None and first and one.dim == 1 and one.tensor.dim() == 4 and one.tensor.shape[1] == 1:
        seq = padded.moved(n, "transpose", one.tensor, 1, one.lengths, (0, 1), {})  # ((1, L, D) as (L, 1, D))
        stretches = rows.of(seq)
    if args[0].owner != "tensor" and stretches is None:
        return NotImplemented
    x = args[0].tensor if stretches is None else stretches.source
    rank = x.dim() - 1  # (an instance's: 2, one unbatched sequence; 3, a batch of them)
    if rank not in (2, 3) or x.shape[-1] != module.input_size:
        return NotImplemented
    if rank == 2:  # (n, L, D): the instances are the module's batch
        flat = x if first else x.transpose(0, 1)
    else:  # (n, B, L, D) or (n, L, B, D): instances times their batches
        flat = x.reshape(-1, *x.shape[2:]) if first else x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])
    sequences = n if stretches is not None else flat.shape[0] if first else flat.shape[1]  # (a stretch each)
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    lstm = type(module) is nn.LSTM
    states = None
    if hx is not None:
        parts = list(bt.struct_items(hx)) if type(hx) is Batch and hx.struct is not None and hx.owner is None else \
            list(hx) if type(hx) is tuple else [hx]
        if len(parts) != (2 if lstm else 1):
            return NotImplemented
        states = []
        for part in parts:  # (an instance's: (layers, H) or (layers, B, H))
            t = bt.tensor_of(part) if type(part) is Batch else part.unsqueeze(0).expand(n, *part.shape) \
                if type(part) is torch.Tensor else None
            if t is None or t.dim() != rank + 1:
                return NotImplemented
            states.append(t.transpose(0, 1).reshape(t.shape[1], sequences, t.shape[-1]))
    states = None if states is None else tuple(states) if lstm else states[0]
    if stretches is not None:
        if rank == 3 and (not first or seq is not args[0]) and x.shape[2] == 1:
            # (``self.lstm(xs.view(n, 1, -1))``, ``self.gru(xs[None])`` batch first: a batch of one)
            return _one_sequence_each(n, module, seq, states, 0 if first else 1)
        return rows.through_rnn(n, module, stretches, states) if rank == 2 else NotImplemented
    out, ends = module(flat, states)

    def per_instance_state(h):  # (layers, rows, H) -> (n, layers, H) or (n, layers, B, H)
        return bt.from_tensor(h.reshape(h.shape[0], n, *([] if rank == 2 else [-1]), h.shape[-1]).transpose(0, 1))

    if rank == 2:
        out = out if first else out.transpose(0, 1)
    else:
        out = out.reshape(n, -1, *out.shape[1:]) if first else \
            out.reshape(out.shape[0], n, -1, out.shape[-1]).transpose(0, 1)
    ends = bt.from_struct(tuple, [per_instance_state(e) for e in ends], n) if lstm else per_instance_state(ends)
    return bt.from_struct(tuple, [bt.from_tensor(out), ends], n)


def _one_sequence_each(n, module, seq, states, at):
    """An RNN module over each instance's stretch of rows (L, 1, D), a batch of one sequence: as over (L, D),
    its outputs (L, 1, H), or (1, L, H) where ``at`` is 0 (batch first), and final states (layers, 1, H)."""
    squeezed = row_wise.method(n, "squeeze", rows.of(seq), (1,), {})
    if squeezed is NotImplemented:
        return NotImplemented
    out = rows.through_rnn(n, module, rows.of(squeezed), states)
    if out is NotImplemented:
        return out
    outputs, ends = out.struct[1]
    outputs = Batch(n, thunk=_BatchOfOne(n, outputs, at))  # (laid out only when read, as ``through_rnn``'s)
    parts = list(ends.struct[1]) if type(module) is nn.LSTM else [ends]
    parts = [bt.from_tensor(bt.tensor_of(e).unsqueeze(2)) for e in parts]
    return bt.from_struct(tuple, [outputs, bt.from_struct(tuple, parts, n) if len(parts) == 2 else parts[0]], n)


class _BatchOfOne:
    """Each instance's RNN outputs (L, H), a lazy batch of Rows, as the (L, 1, H) of a batch of one sequence (or
    (1, L, H) where ``at`` is 0)."""

    __slots__ = ("n", "outputs", "at")

    def __init__(self, n, outputs, at):
        self.n, self.outputs, self.at = n, outputs, at

    def depends_on(self):
        return []  # (the outputs are laid out by ``compute``, their views left unmade: ``bt.resolved``)

    def compute(self):
        seq = rows.of(bt.resolved(self.outputs))
        out = row_wise.method(self.n, "unsqueeze", seq, (1,), {}) if self.at else \
            padded.rows_method(self.n, "unsqueeze", seq, (0,), {})
        return out if out is not NotImplemented else \
            bt.from_items([v.unsqueeze(self.at) for v in bt.items_of(self.outputs)])


@BATCH.register(isinstance)
def instance_of(n, fn, args, kwargs):
    """``isinstance(x, cls)`` of a batched x: the rows of a tensor are tensors, the instances of a tuple or
    list built in the program are tuples or lists; other forms instance by instance (one bool where all
    agree)."""
    if kwargs or len(args) != 2 or type(args[1]) is Batch or type(args[0]) is not Batch:
        return NotImplemented
    x, cls = args
    if x.owner == "tensor":
        return issubclass(torch.Tensor, cls)
    if x.struct is not None and x.owner is None:
        return issubclass(x.struct[0], cls)
    found = [isinstance(v, cls) for v in bt.items_of(x)]
    return found[0] if all(f is found[0] for f in found) else bt.from_items(found)


@BATCH.register(operator.is_, operator.is_not)
def none_test(n, fn, args, kwargs):
    """``x is None`` (``is not``) of a batched x (``if state is None``): the rows of a tensor and the instances
    of a tuple or list built in the program are not None; other forms instance by instance (one bool where all
    agree)."""
    if kwargs or len(args) != 2 or args[1] is not None or type(args[0]) is not Batch:
        return NotImplemented
    x = bt.ready(args[0])
    if x.owner == "tensor" or x.struct is not None and x.owner is None:
        found = [False]
    else:
        found = [v is None for v in bt.items_of(x)]
    if fn is operator.is_not:
        found = [not f for f in found]
    return found[0] if all(f is found[0] for f in found) else bt.from_items(found)


@BATCH.register(operator.not_)
def negation(n, fn, args, kwargs):
    """``not x`` of a batch (a loop's break flag, joined from the instances that broke and those that did not;
    ``not node.children`` of each instance's own list): each instance's bool, from one host read where x holds
    one number per instance."""
    (x,) = args
    t = bt.tensor_of(x) if x.items is None else None
    if t is not None and t.numel() == n:
        return bt.from_items((t.reshape(n) == 0).tolist())
    items = bt.items_of(x)
    if not all(type(v) in _PLAIN_TRUTH for v in items):
        return NotImplemented
    return bt.from_items([not v for v in items])


# Python values whose truth Python's own types define (a tensor's raises for many elements; a user's class may
# define its own): ``not`` of each instance's, in one pass
_PLAIN_TRUTH = (bool, int, float, str, list, tuple, dict, type(None))


@BATCH.register(torch.einsum)
def einsum(n, fn, args, kwargs):
    """``torch.einsum(equation, *operands)`` with batched and shared operands: the batched ones get a
    subscript of their own, first, and so does the result; shared ones are used as they are (vmap would
    copy a shared tensor for every instance)."""
    if kwargs or len(args) < 2 or type(args[0]) is not str:
        return NotImplemented
    operands = args[1:]
    if len(operands) == 1 and type(operands[0]) in (list, tuple):
        operands = operands[0]
    if len(operands) == 1 and type(operands[0]) is Batch and operands[0].struct is not None:
        operands = bt.struct_items(operands[0])
    if ragged_products.holds_lengths(operands):
        out = NotImplemented
        if row_wise.holds_rows(operands):  # (``torch.einsum("nd,de->ne", xs, W)``: each row alone)
            out = row_wise.einsummed(n, args[0], operands)
        # (``torch.einsum("ld,kd->lk", enc, h)``, h each instance's own: padded)
        return ragged_products.einsum(n, args[0], operands) if out is NotImplemented else out
    equation = batched_equation(args[0], [type(o) is Batch for o in operands])
    tensors = _tensor_args(n, operands)
    if equation is None or tensors is None or not all(isinstance(t, torch.Tensor) for t in tensors):
        return NotImplemented
    return bt.from_tensor(fn(equation, *tensors))


def batched_equation(equation, batched):
    """The einsum ``equation`` of operands each batched or not (``batched``): a subscript of its own, first,
    for the batched operands and the result; None where none is batched or the equation is not of this form."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(batched) or not any(batched):
        return None
    if not arrow:  # (implicit output: the subscripts seen once, in order, after any ellipsis)
        letters = [ch for ch in lhs if ch.isalpha()]
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    free = [ch for ch in string.ascii_letters if ch not in equation]
    if not free:
        return None
    b = free[0]
    return ",".join(b + t if is_batched else t for t, is_batched in zip(terms, batched)) + f"->{b}{rhs}"


BATCH.register(torch.chunk, torch.split)(_dim_rule(2, default=0))
BATCH.register(torch.unbind)(_dim_rule(1, default=0))
BATCH.register(torch.softmax, F.softmax, F.log_softmax, torch.log_softmax, torch.unsqueeze, torch.squeeze,
               torch.argmax, torch.logsumexp, torch.index_select)(_dim_rule(1))
_BY_DIM = _dim_rule(1)
# (its noise drawn for every instance's elements at once: each instance's independent of the others', as eager's)
BATCH.register(F.gumbel_softmax)(_dim_rule(4, default=-1))


_WHOLE = {torch.max: "max", torch.min: "min", torch.median: "median"}


@BATCH.register(torch.max, torch.min, torch.median)
def extreme(n, fn, args, kwargs):
    """``torch.max(x)`` / ``torch.min(x)`` / ``torch.median(x)`` of a batched x: over every element of each
    instance, with torch's gradient for the full reduction (split evenly among ties, where ``max(dim)`` gives all
    to the first); with a dim by the dim rule; ``torch.max(a, b)`` of two tensors elementwise, as maximum."""
    if len(args) == 1 and not kwargs and type(args[0]) is Batch:
        t = bt.tensor_of(args[0])
        if t is not None:
            return bt.from_tensor(_whole_of(t, _WHOLE[fn]))
    if len(args) == 2 and not kwargs and fn is not torch.median and all(
            type(a) in PLAIN_TENSORS or type(a) is Batch and bt.tensor_of(a) is not None for a in args):
        return elementwise(n, torch.maximum if fn is torch.max else torch.minimum, args, kwargs)
    return _BY_DIM(n, fn, args, kwargs)


@BATCH.register(torch.flatten)
def flatten(n, fn, args, kwargs):
    """``torch.flatten(x, start_dim, end_dim)`` of a batched x: the same dims of the batch's tensor."""
    return _flattened(args[0] if args else kwargs.get("input"), args[1:], kwargs, ("start_dim", "end_dim"))


@BATCH.register("flatten")
def flatten_method(n, x, args, kwargs):
    return _flattened(x, args, kwargs, ("start_dim", "end_dim"))


def _flattened(x, args, kwargs, names):
    found = by_names(args, {k: v for k, v in kwargs.items() if k != "input"}, names)
    if type(x) is not Batch or found is None or any(type(v) is not int for v in found.values()):
        return NotImplemented
    t = bt.tensor_of(x)
    if t is None:
        return NotImplemented
    if t.dim() == 1:  # (each instance 0-d: flattened to one element)
        return bt.from_tensor(t.reshape(-1, 1)) if found.get("start_dim", 0) in (0, -1) and \
            found.get("end_dim", -1) in (0, -1) else NotImplemented
    return bt.from_tensor(t.flatten(shift_dim(found.get("start_dim", 0)), shift_dim(found.get("end_dim", -1))))


def _whole_of(t, kind):
    """Each instance's (row's) max, min or median over all its elements, its gradient shared among ties."""
    if t.dim() == 1:  # (each instance's 0-d tensor is its own maximum)
        return t.clone()
    flat = t.reshape(t.shape[0], -1)
    if not (flat.is_floating_point() or flat.is_complex()):  # (no gradient to share: integers stay integers)
        return flat.median(dim=1).values if kind == "median" else flat.amax(1) if kind == "max" else flat.amin(1)
    return extremes.RowExtreme.apply(flat, kind)


def _extreme_method(kind):
    """``x.max()`` / ``x.min()`` / ``x.median()`` of a batched tensor (see ``extreme``); with a dim,
    ``method_dim``'s rule."""
    by_dim = method_dim(kind, 0)

    def rule(n, x, args, kwargs):
        if not args and not kwargs:
            t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
            if t is not None:
                return bt.from_tensor(_whole_of(t, kind))
        return by_dim(n, x, args, kwargs)

    return rule


def _norm(x, p, dim, keepdim, dtype, n):
    """A vector norm of each instance's batched tensor ``x`` (a Batch), over ``dim`` or all its elements:
    ``torch.linalg.vector_norm`` over the dims past the instance dim, as torch.norm computes it; None where
    it is no vector norm (a matrix norm by name) or each instance is 0-d."""
    t = bt.tensor_of(x) if type(x) is Batch else None
    if t is None or t.dim() < 2 or type(p) is str and p != "fro" or type(p) is bool or type(keepdim) is not bool:
        return None
    if p is None or p == "fro":
        p = 2
    if type(p) not in (int, float) or _no_dims(dim):
        return None
    dims = tuple(range(1, t.dim())) if dim is None else shift_dim(dim)
    return _wrap(torch.linalg.vector_norm(t, p, dims, keepdim, dtype=dtype), n)


@BATCH.register(F.normalize)
def normalize(n, fn, args, kwargs):
    """``F.normalize(x, p, dim, eps)`` of a batched x: the same dim of the batch's tensor."""
    found = by_names(args, kwargs, ("input", "p", "dim", "eps", "out"))
    x = None if found is None else found.get("input")
    if type(x) is not Batch or found.get("out") is not None or any(
            type(v) is Batch for k, v in found.items() if k != "input") or type(found.get("dim", 1)) is not int:
        return NotImplemented
    t = bt.tensor_of(x)
    if t is None or not dims_shift(t, fn):
        return NotImplemented
    return bt.from_tensor(fn(t, found.get("p", 2.0), shift_dim(found.get("dim", 1)), found.get("eps", 1e-12)))


@BATCH.register(nn.Softmax, nn.LogSoftmax, nn.Softmin)
def softmax_module(n, module, args, kwargs):
    """``nn.Softmax(dim)`` and its kin on a batched x: the functional form over the same dim (not with
    ``dim=None``, whose dim depends on the rank)."""
    if len(args) != 1 or kwargs or type(args[0]) is not Batch or module.dim is None or type(module.dim) is not int:
        return NotImplemented
    t = bt.tensor_of(args[0])
    if t is None or not dims_shift(t, module):
        return NotImplemented
    return bt.from_tensor(_SOFTMAX_OF[type(module)](t, shift_dim(module.dim)))


_SOFTMAX_OF = {nn.Softmax: torch.softmax, nn.LogSoftmax: torch.log_softmax,
               nn.Softmin: lambda t, d: torch.softmax(-t, d)}


@BATCH.register(F.one_hot)
def one_hot(n, fn, args, kwargs):
    """``F.one_hot(i, num_classes)`` of batched indices, the classes given: one call (each instance's shape
    gets the classes' dim last, as the batch's does)."""
    found = by_names(args, kwargs, ("tensor", "num_classes"))
    classes = None if found is None else found.get("num_classes", -1)
    if type(classes) is not int or classes < 0 or type(found.get("tensor")) is not Batch:
        return NotImplemented  # (classes read from each instance's largest index: its own)
    t = bt.tensor_of(found["tensor"])
    return NotImplemented if t is None else bt.from_tensor(fn(t, classes))


_LOSS_OPTIONS = frozenset(("reduction", "beta", "delta", "weight", "pos_weight", "log_target"))


@BATCH.register(F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                F.binary_cross_entropy_with_logits, F.soft_margin_loss, F.kl_div)
def pointwise_loss(n, fn, args, kwargs):
    """A loss of each element of an instance's input against the same element of its target (either may be
    shared, of the instance's shape): the elements' losses in one call, then each instance's sum or mean
    (``kl_div``'s ``batchmean``: the sum over the instance's first dim's size)."""
    if len(args) != 2 or not set(kwargs) <= _LOSS_OPTIONS or any(type(v) is Batch for v in kwargs.values()) or \
            not any(type(a) is Batch for a in args):
        return NotImplemented
    x, y = (bt.tensor_of(a) if type(a) is Batch else a if type(a) in PLAIN_TENSORS else None for a in args)
    if x is None or y is None:
        return NotImplemented
    shape = (x.shape[1:] if type(args[0]) is Batch else x.shape)
    if (y.shape[1:] if type(args[1]) is Batch else y.shape) != shape:
        return NotImplemented  # (shapes that broadcast: torch warns, once per instance)
    reduction = kwargs.get("reduction", "mean")
    if reduction == "batchmean" and fn is F.kl_div and shape:
        reduction, per = "sum", shape[0]  # (an instance's own first dim: torch's batch)
    else:
        per = 1
    if reduction not in ("none", "sum", "mean") or any(
            isinstance(v, torch.Tensor) and v.dim() > len(shape) for v in kwargs.values()):
        return NotImplemented  # (a weight of more dims than an instance's: broadcast onto the instances)
    rows = max(x.shape[:1] if type(args[0]) is Batch else (), y.shape[:1] if type(args[1]) is Batch else ())
    x, y = (t if type(a) is Batch else t.expand(*rows, *t.shape) for t, a in zip((x, y), args))
    out = fn(x, y, **{**kwargs, "reduction": "none"})
    if reduction == "none" or out.dim() == 1:
        return bt.from_tensor(out)
    dims = tuple(range(1, out.dim()))
    return bt.from_tensor((out.sum(dims) if per == 1 else out.sum(dims) / per) if reduction == "sum" else
                          out.mean(dims))


@BATCH.register(torch.norm)
def norm(n, fn, args, kwargs):
    """``torch.norm(x, p, dim, keepdim)`` of a batched x (no dim: over each instance's every element)."""
    found = by_names(args, kwargs, ("input", "p", "dim", "keepdim", "out", "dtype"))
    if found is None or found.get("out") is not None or any(type(v) is Batch for v in found.values()
                                                             if v is not found.get("input")):
        return NotImplemented
    out = _norm(found.get("input"), found.get("p", "fro"), found.get("dim"), found.get("keepdim", False),
                found.get("dtype"), n)
    return NotImplemented if out is None else out


@BATCH.register("norm")
def norm_method(n, x, args, kwargs):
    """``x.norm(p, dim, keepdim)`` of a batched x (see ``norm``)."""
    found = by_names(args, kwargs, ("p", "dim", "keepdim", "dtype"))
    if found is None or any(type(v) is Batch for v in found.values()):
        return NotImplemented
    out = _norm(x, found.get("p", "fro"), found.get("dim"), found.get("keepdim", False), found.get("dtype"), n)
    return NotImplemented if out is None else out


# -- ops along dims, and elementwise Tensor methods: one call on the batch's tensor

# Ops taking dims: name -> their dim parameters, each (position after the input, keyword, kind, default):
# kind "dim" (an int), "dims" (an int or a sequence of them), "perm" (a whole order of the instance's dims,
# or the method's ``*dims``) or "refused" (a parameter with no batched form unless it is None); default: what
# an absent one means (None: nothing to shift, it counts from the end or is all of them alike; ``REQUIRED``:
# no batched form without it).
REQUIRED = object()
DIM_OPS = {
    "flip": ((0, "dims", "dims", REQUIRED),), "roll": ((1, "dims", "dims", REQUIRED),),
    "narrow": ((0, "dim", "dim", REQUIRED),), "select": ((0, "dim", "dim", REQUIRED),),
    "transpose": ((0, "dim0", "dim", REQUIRED), (1, "dim1", "dim", REQUIRED)),
    "swapaxes": ((0, "axis0", "dim", REQUIRED), (1, "axis1", "dim", REQUIRED)),
    "movedim": ((0, "source", "dims", REQUIRED), (1, "destination", "dims", REQUIRED)),
    "permute": ((0, "dims", "perm", REQUIRED),),
    "cumsum": ((0, "dim", "dim", REQUIRED),), "cumprod": ((0, "dim", "dim", REQUIRED),),
    "logcumsumexp": ((0, "dim", "dim", REQUIRED),), "cummax": ((0, "dim", "dim", REQUIRED),),
    "cummin": ((0, "dim", "dim", REQUIRED),),
    "sort": ((0, "dim", "dim", None),), "argsort": ((0, "dim", "dim", None),), "topk": ((1, "dim", "dim", None),),
    "kthvalue": ((1, "dim", "dim", None),), "diff": ((1, "dim", "dim", None), (2, "prepend", "refused", None),
                                                      (3, "append", "refused", None)),
    "prod": ((0, "dim", "dim", REQUIRED),), "amax": ((0, "dim", "dims", REQUIRED),),
    "amin": ((0, "dim", "dims", REQUIRED),), "logsumexp": ((0, "dim", "dims", REQUIRED),),
    "tensor_split": ((1, "dim", "dim", 0),),
}


def _shifted_dims(t, name, args, kwargs, method=False):
    """``args`` and ``kwargs`` of op ``name`` on each instance's tensor (of the Tensor ``method``), their dims moved
    past the instance dim of the batch's tensor ``t``; None where there is no such form."""
    if not dims_shift(t, name) or any(type(v) is Batch for v in (*args, *kwargs.values())):
        return None
    args, kwargs = list(args), dict(kwargs)
    if name == "permute" and args and all(type(a) is int for a in args) or \
            method and name == "flip" and len(args) > 1 and all(type(a) is int for a in args):
        args = [tuple(args)]  # (``x.permute(1, 0)``, ``x.flip(0, 1)``: the method's ``*dims``)
    for position, keyword, kind, default in DIM_OPS[name]:
        here = "kw" if keyword in kwargs else "arg" if len(args) > position else None
        if here is None:
            if default is REQUIRED:
                return None
            if default is not None:
                kwargs[keyword] = shift_dim(default)
            continue
        value = kwargs[keyword] if here == "kw" else args[position]
        if kind == "refused":  # (``diff(prepend=t)``: a tensor of each instance's rank, to be lined up)
            if value is None:
                continue
            return None
        if kind == "dim" and type(value) is not int or kind != "dim" and not (
                type(value) is int or type(value) in (tuple, list) and all(type(d) is int for d in value)) or \
                _no_dims(value):
            return None
        value = shift_dim(value)
        if kind == "perm":
            value = (0, *value)
        if here == "kw":
            kwargs[keyword] = value
        else:
            args[position] = value
    return args, kwargs


def _dim_function(n, fn, args, kwargs):
    """``torch.flip(x, dims)``, ``torch.cumsum(x, dim)``, ``torch.sort(x)`` ... of a batched x."""
    if not args or type(args[0]) is not Batch:
        return NotImplemented
    t = bt.tensor_of(args[0])
    found = None if t is None else _shifted_dims(t, fn.__name__, args[1:], kwargs)
    return NotImplemented if found is None else _wrap(fn(t, *found[0], **found[1]), n)


def _dim_method(name):
    def rule(n, x, args, kwargs):
        t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
        found = None if t is None else _shifted_dims(t, name, args, kwargs, method=True)
        return NotImplemented if found is None else _wrap(getattr(t, name)(*found[0], **found[1]), n)
    return rule


for _op in DIM_OPS:
    if _op not in ("amax", "amin", "logsumexp", "prod"):  # (theirs: _whole_or_dims below; logsumexp: _dim_rule)
        BATCH.register(getattr(torch, _op))(_dim_function)
    if _op not in ("amax", "amin", "prod"):
        BATCH.register(_op)(_dim_method(_op))


_ZEROS_UNALIKE = ("some instances' values hold a zero and others not, and torch's prod gradient takes its "
                  "zero-safe way for a whole input with a zero (an inf's gradient is finite there, else NaN)",
                  "nothing to change: a prod runs batched where every instance's values hold a zero or none do")


def _whole_or_dims(name):
    """``x.amax()``, ``x.prod()``, ``x.var()`` ... of each instance: with no dim over all its elements, else
    over its dims (``DIM_OPS``; var and std: ``dim``, ``correction`` or ``unbiased``, ``keepdim``)."""
    by_dims = _dim_method(name) if name in DIM_OPS else None

    def rule(n, x, args, kwargs):
        t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
        if t is None or t.dim() < 2 or any(type(v) is Batch for v in (*args, *kwargs.values())):
            return NotImplemented
        if name == "prod" and not spreads.zeros_alike(t):  # (nor vmap's: it differentiates the batch's prod)
            return per_instance(n, Batch(n, method=(x, name)), args, kwargs, _ZEROS_UNALIKE)
        if name in ("var", "std"):
            if args and type(args[0]) is bool:  # (``x.var(False)``: unbiased, by position)
                args, kwargs = args[1:], {**kwargs, "unbiased": args[0]}
            found = by_names(args, kwargs, ("dim", "unbiased", "keepdim", "correction"))
            if found is None or _no_dims(found.get("dim")):
                return NotImplemented
            dims = found.pop("dim", None)
            dims = tuple(range(1, t.dim())) if dims is None else shift_dim(dims)
            return bt.from_tensor(getattr(t, name)(dim=dims, **found))
        if args or "dim" in kwargs:
            return by_dims(n, x, args, kwargs)  # (``dim=()`` among them: refused there)
        if name == "prod":
            return bt.from_tensor(t.flatten(1).prod(1, **kwargs))
        return bt.from_tensor(getattr(t, name)(dim=tuple(range(1, t.dim())), **kwargs))

    return rule


def _as_function(method_rule):
    """The rule of ``torch.name(x, ...)`` from that of ``x.name(...)``."""

    def rule(n, fn, args, kwargs):
        return method_rule(n, args[0], args[1:], kwargs) if args and type(args[0]) is Batch else NotImplemented

    return rule


for _op in ("amax", "amin", "prod", "var", "std"):
    BATCH.register(_op)(_whole_or_dims(_op))
    BATCH.register(getattr(torch, _op))(_as_function(_whole_or_dims(_op)))


def _product_method(ranks):
    def rule(n, x, args, kwargs):
        out = _product((x, *args), kwargs, ranks)
        return NotImplemented if out is None else bt.from_tensor(out)
    return rule


for _op, _ranks in (("matmul", None), ("mm", (2, 2)), ("bmm", (3, 3)), ("mv", (2, 1)), ("dot", (1, 1)),
                      ("inner", (1, 1))):
    BATCH.register(_op)(_product_method(_ranks))


def _gathered(n, t, dim, index):
    """Each instance's ``gather(dim, index)`` (index batched, or shared: the same for every instance)."""
    idx = bt.tensor_of(index) if type(index) is Batch else index.expand(t.shape[0], *index.shape) \
        if type(index) in PLAIN_TENSORS else None
    if idx is None or type(dim) is not int or idx.dim() != t.dim() or not dims_shift(t, "gather"):
        return NotImplemented
    return bt.from_tensor(t.gather(shift_dim(dim), idx))


@BATCH.register(torch.gather)
def gather_along(n, fn, args, kwargs):
    """``torch.gather(x, dim, index)`` of a batched x, by a batched or shared index."""
    if len(args) != 3 or kwargs or type(args[0]) is not Batch:
        return NotImplemented
    t = bt.tensor_of(args[0])
    return NotImplemented if t is None else _gathered(n, t, args[1], args[2])


@BATCH.register("gather")
def gather_method(n, x, args, kwargs):
    t = bt.tensor_of(x)
    return NotImplemented if len(args) != 2 or kwargs or t is None else _gathered(n, t, *args)


@BATCH.register("t")
def transposed(n, x, args, kwargs):
    """``x.t()`` of each instance's matrix (a vector or a 0-d tensor is its own)."""
    t = bt.tensor_of(x)
    if args or kwargs or t is None or t.dim() > 3:
        return NotImplemented
    return bt.from_tensor(t.transpose(1, 2) if t.dim() == 3 else t)


BATCH.register(torch.t)(_as_function(transposed))


@BATCH.register(torch.addmm)
def addmm(n, fn, args, kwargs):
    """``torch.addmm(m, a, b)`` (no beta or alpha) with a batched operand: one product, then ``m`` added."""
    if len(args) != 3 or kwargs or type(args[0]) is Batch and bt.tensor_of(args[0]) is None:
        return NotImplemented
    out = _product(args[1:], {}, (2, 2))
    m = _aligned(args[0], 2)
    return NotImplemented if out is None or m is None else bt.from_tensor(torch.add(m, out))


def _instance_reduced(out, reduction):
    """Each instance's loss elements (rows of ``out``) reduced as an instance's call reduces its own: ``none``,
    ``sum`` or ``mean`` of all of them; None for another reduction."""
    if reduction == "none" or reduction in ("sum", "mean") and out.dim() == 1:
        return bt.from_tensor(out)  # (as it is: each instance's one element, or no reduction)
    if reduction not in ("sum", "mean"):
        return None
    flat = out.reshape(out.shape[0], -1)
    return bt.from_tensor(flat.sum(1) if reduction == "sum" else flat.mean(1))


_MARGIN_RANKING = ("input1", "input2", "target", "margin", "size_average", "reduce", "reduction")
_TRIPLET = ("anchor", "positive", "negative", "margin", "p", "eps", "swap", "size_average", "reduce", "reduction")


@BATCH.register(F.margin_ranking_loss, F.triplet_margin_loss)
def margin_loss(n, fn, args, kwargs):
    """``F.margin_ranking_loss(x1, x2, y)`` (``max(0, -y (x1 - x2) + margin)``) and ``F.triplet_margin_loss(a, p,
    n)`` (``max(0, margin + d(a, p) - d(a, n))``, d the pairwise distance over the last dim) of instance tensors of
    one rank, any of them shared: their loss elements at once, then each instance's reduction (torch has no vmap
    rule for either)."""
    names = _MARGIN_RANKING if fn is F.margin_ranking_loss else _TRIPLET
    found = by_names(args, kwargs, names)
    tensors = [found.get(k) for k in names[:3]] if found is not None else [None]
    if None in tensors or found.get("size_average") is not None or found.get("reduce") is not None or any(
            type(found.get(k)) is Batch for k in names[3:]):
        return NotImplemented
    rows_of = [_rows_each(n, t) for t in tensors]
    if any(r is None for r in rows_of) or len({r.dim() for r in rows_of}) != 1:
        return NotImplemented  # (ranks that differ: each instance's call raises torch's error)
    reduction = found.get("reduction", "mean")
    if fn is F.margin_ranking_loss:
        x1, x2, y = rows_of
        out = (-y * (x1 - x2) + found.get("margin", 0.0)).clamp_min(0)
    else:
        a, pos, neg = rows_of
        if not 2 <= a.dim() <= 3:
            return NotImplemented  # (an instance's anchor of another rank: its call raises torch's error)
        p, eps = found.get("p", 2), found.get("eps", 1e-6)
        near, far = F.pairwise_distance(a, pos, p, eps), F.pairwise_distance(a, neg, p, eps)
        if found.get("swap", False):
            far = torch.min(far, F.pairwise_distance(pos, neg, p, eps))
        out = (found.get("margin", 1.0) + near - far).clamp_min(0)
    reduced = _instance_reduced(out, reduction)
    return NotImplemented if reduced is None else reduced


_GAUSSIAN_NLL = ("input", "target", "var", "full", "eps", "reduction")


@BATCH.register(F.gaussian_nll_loss)
def gaussian_nll(n, fn, args, kwargs):
    """``F.gaussian_nll_loss(x, target, var)`` of instance tensors, any of them shared (``var`` of x's rank, or one
    less: torch's forms): torch's loss elements of every instance at once (its checks of var's shape and sign
    too), then each instance's reduction."""
    found = by_names(args, kwargs, _GAUSSIAN_NLL)
    tensors = [found.get(k) for k in _GAUSSIAN_NLL[:3]] if found is not None else [None]
    if None in tensors or any(type(found.get(k)) is Batch for k in _GAUSSIAN_NLL[3:]):
        return NotImplemented
    x, target, var = (_rows_each(n, t) for t in tensors)
    if x is None or target is None or var is None or target.dim() != x.dim() or var.dim() not in (
            x.dim(), x.dim() - 1):
        return NotImplemented  # (ranks that differ: each instance's call broadcasts them, or raises)
    out = fn(x, target, var, full=found.get("full", False), eps=found.get("eps", 1e-6), reduction="none")
    reduced = _instance_reduced(out, found.get("reduction", "mean"))
    return NotImplemented if reduced is None else reduced


_MULTI_MARGIN = ("input", "target", "p", "margin", "weight", "size_average", "reduce", "reduction")


@BATCH.register(F.multi_margin_loss)
def multi_margin(n, fn, args, kwargs):
    """``F.multi_margin_loss(x, y)`` of each instance's scores (a vector and its class, or a matrix and a class a
    row), either shared: every instance's rows one matrix for one call, then each instance's reduction."""
    found = by_names(args, kwargs, _MULTI_MARGIN)
    if found is None or found.get("size_average") is not None or found.get("reduce") is not None or any(
            type(found.get(k)) is Batch for k in _MULTI_MARGIN[2:]):
        return NotImplemented
    x, y = _rows_each(n, found.get("input")), _rows_each(n, found.get("target"))
    if x is None or y is None or x.dim() not in (2, 3) or y.dim() != x.dim() - 1 or x.shape[:-1] != y.shape:
        return NotImplemented  # (shapes torch refuses: each instance's call raises its error)
    out = fn(x.reshape(-1, x.shape[-1]), y.reshape(-1), p=found.get("p", 1), margin=found.get("margin", 1.0),
             weight=found.get("weight"), reduction="none").view(y.shape)
    reduced = _instance_reduced(out, found.get("reduction", "mean"))
    return NotImplemented if reduced is None else reduced


@BATCH.register(F.rrelu)
def rrelu_eval(n, fn, args, kwargs):
    """``F.rrelu(x, lower, upper, training=False)``: the leaky ReLU of slope ``(lower + upper) / 2`` it is, on the
    batch's tensor (in training it draws a slope per element: each instance's own draws, its own call)."""
    found = by_names(args, kwargs, ("input", "lower", "upper", "training", "inplace"))
    if found is None or found.get("training", False) or found.get("inplace", False) or \
            type(found.get("input")) is not Batch or any(type(v) is Batch for k, v in found.items() if k != "input"):
        return NotImplemented
    x = bt.tensor_of(found["input"])
    if x is None:
        return NotImplemented
    return bt.from_tensor(F.rrelu(x, found.get("lower", 1.0 / 8), found.get("upper", 1.0 / 3), False))


@BATCH.register(F.cosine_similarity, F.pairwise_distance)
def similarity(n, fn, args, kwargs):
    """``F.cosine_similarity(a, b, dim)`` / ``F.pairwise_distance(a, b)`` of instance tensors of one rank (one
    may be shared): one call, the dim moved past the instance dim."""
    if len(args) < 2 or any(type(v) is Batch for v in (*args[2:], *kwargs.values())):
        return NotImplemented
    a, b = (bt.tensor_of(v) if type(v) is Batch else v if type(v) in PLAIN_TENSORS else None for v in args[:2])
    if a is None or b is None or len({t.dim() - (type(v) is Batch) for t, v in zip((a, b), args[:2])}) != 1:
        return NotImplemented
    rest, kwargs = list(args[2:]), dict(kwargs)
    if not dims_shift(a if type(args[0]) is Batch else b, fn):  # (an instance's 0-d tensor: its own dim)
        return NotImplemented
    if fn is F.cosine_similarity:
        dim = kwargs.get("dim", rest[0] if rest else 1)
        if type(dim) is not int or not dims_shift(a if type(args[0]) is Batch else b, fn):
            return NotImplemented
        if "dim" in kwargs or not rest:
            kwargs["dim"] = shift_dim(dim)
        else:
            rest[0] = shift_dim(dim)
    return bt.from_tensor(fn(a, b, *rest, **kwargs))


@BATCH.register(nn.CrossEntropyLoss, nn.NLLLoss)
def loss_module(n, module, args, kwargs):
    """``nn.CrossEntropyLoss()`` / ``nn.NLLLoss()`` with no class weights, default ignore index and no label
    smoothing: the functional rule with the module's reduction."""
    if kwargs or len(args) != 2 or module.weight is not None or module.ignore_index != -100 or getattr(
            module, "label_smoothing", 0.0) or "forward" in module.__dict__:
        return NotImplemented
    fn = F.cross_entropy if type(module) is nn.CrossEntropyLoss else F.nll_loss
    return cross_entropy(n, fn, args, {"reduction": module.reduction})


@BATCH.register(nn.Bilinear, F.bilinear)
def bilinear(n, fn, args, kwargs):
    """``F.bilinear(x1, x2, weight, bias)`` or ``nn.Bilinear`` with shared weights, of inputs of one shape but
    the last dim (one of them may be shared, of the instance's shape): one call on the batch's rows."""
    if isinstance(fn, nn.Module):
        if kwargs or len(args) != 2 or "forward" in fn.__dict__:
            return NotImplemented
        inputs, weights = args, (fn.weight, fn.bias)
    else:
        found = by_names(args, kwargs, ("input1", "input2", "weight", "bias"))
        if found is None or "weight" not in found:
            return NotImplemented
        inputs, weights = (found.get("input1"), found.get("input2")), (found["weight"], found.get("bias"))
    if any(type(w) is Batch for w in weights) or not any(type(v) is Batch for v in inputs):
        return NotImplemented
    a, b = (bt.tensor_of(v) if type(v) is Batch else v if type(v) in PLAIN_TENSORS else None for v in inputs)
    if a is None or b is None:
        return NotImplemented
    if type(inputs[0]) is not Batch:
        a = a.expand(b.shape[0], *a.shape)
    if type(inputs[1]) is not Batch:
        b = b.expand(a.shape[0], *b.shape)
    if a.shape[:-1] != b.shape[:-1]:
        return NotImplemented  # (inputs that broadcast: each instance's own call)
    return bt.from_tensor(F.bilinear(a, b, *weights))


def _sized(name):
    """``x.expand(*sizes)`` / ``x.repeat(*sizes)`` of each instance's tensor: its new leading dims go after the
    instance dim."""

    def rule(n, x, args, kwargs):
        sizes = tuple(args[0]) if len(args) == 1 and type(args[0]) in (tuple, list, torch.Size) else args
        t = bt.tensor_of(x)
        if name == "repeat" and not kwargs and t is not None and sizes and type(sizes[0]) is Batch:
            return _repeated_rows(n, t, sizes)
        if kwargs or t is None or not sizes or any(type(k) is not int for k in sizes) or len(sizes) < t.dim() - 1:
            return NotImplemented
        t = t.reshape(t.shape[:1] + (1,) * (len(sizes) - t.dim() + 1) + t.shape[1:])
        return bt.from_tensor(t.expand(-1, *sizes) if name == "expand" else t.repeat(1, *sizes))

    return rule


def _repeated_rows(n, t, sizes):
    """``x.repeat(len(child_h), 1)`` of each instance's one row (x of shape (1, ...)), the count each instance's own:
    the stretches of the rows repeated (treelstm.pytorch's forget gates); NotImplemented for other repeats."""
    if t.dim() < 2 or t.shape[1] != 1 or len(sizes) != t.dim() - 1 or any(k != 1 or type(k) is not int
                                                                          for k in sizes[1:]):
        return NotImplemented
    return _stretches_of(n, lambda shape: t.expand(shape).contiguous(), [sizes[0], *t.shape[2:]])


BATCH.register("expand")(_sized("expand"))
BATCH.register("repeat")(_sized("repeat"))


# Tensor methods acting on each element alone, their tensor arguments broadcast within an instance (as the
# in-place ones, ``_ELEMENTWISE_IN_PLACE``); and conversions of the whole tensor (dtype, device)
_ELEMENTWISE_METHODS = ("clamp", "clamp_min", "clamp_max", "clip", "pow", "masked_fill", "where", "lerp", "fmod",
                        "remainder", "maximum", "minimum", "add", "sub", "mul", "div", "atan2", "hypot",
                        "logaddexp", "square", "sin", "cos", "log1p", "expm1", "erf", "reciprocal",
                        "rsqrt", "sign", "floor", "ceil", "round", "trunc", "frac", "nan_to_num", "to", "type_as",
                        "type", "half", "bfloat16", "bool", "int")


def _elementwise_method(name):
    def rule(n, x, args, kwargs):
        t = x.tensor if x.owner == "tensor" else bt.tensor_of(x)
        if t is not None and name == "masked_fill" and len(args) == 2 and not kwargs and type(args[1]) is Batch:
            return _masked_fill_each(n, t, *args)
        if t is None or name not in _CONVERSIONS and any(
                v.dtype is not t.dtype and v.dtype is not torch.bool for v in (
                    bt.tensor_of(a) if type(a) is Batch else a for a in args) if isinstance(v, torch.Tensor)):
            return NotImplemented  # (an instance's 0-d tensor promotes as a batch's dimensioned one does not)
        values = _lined_up(t, name, args, kwargs)
        if values is None:
            return NotImplemented
        out = getattr(t, name)(*values, **kwargs)
        return bt.from_tensor(out) if type(out) is torch.Tensor and out.shape[:1] == t.shape[:1] else NotImplemented
    return rule


for _op in _ELEMENTWISE_METHODS:
    BATCH.register(_op)(_elementwise_method(_op))


def _masked_fill_each(n, t, mask, value):
    """``x.masked_fill(mask, v)`` with each instance's own 0-d ``v``: ``torch.where`` of the mask, ``v`` cast to
    ``x``'s dtype first as masked_fill casts it (its gradient, the cotangents of the filled elements summed, is
    masked_fill's)."""
    v = bt.tensor_of(value)
    where = _aligned(mask, t.dim() - 1)
    if v is None or v.dim() != 1 or v.is_complex() or where is None or not isinstance(where, torch.Tensor) \
            or where.dtype is not torch.bool:
        return NotImplemented
    return bt.from_tensor(torch.where(where, v.to(t.dtype).reshape(n, *[1] * (t.dim() - 1)), t))


@BATCH.register(torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like)
def like(n, fn, args, kwargs):
    """``torch.zeros_like(x)`` ... of a batched x: the batch's rows, each instance's own."""
    if not args or type(args[0]) is not Batch or any(type(v) is Batch for v in (*args[1:], *kwargs.values())):
        return NotImplemented
    t = bt.tensor_of(args[0])
    return NotImplemented if t is None else bt.from_tensor(fn(t, *args[1:], **kwargs))


def _new_like(name):
    """``x.new_zeros(size)`` ... of a batched x: a row for each instance (each its own tensor, as each
    instance's call makes one)."""

    def rule(n, x, args, kwargs):
        # (what it makes reads x's dtype and device alone: a stretch's source has them too)
        seq = rows.of(x) if x.owner != "tensor" else None
        t = bt.tensor_of(x) if seq is None else seq.source
        if name in ("new_zeros", "new_ones") and t is not None and (len(args) != 1 or type(args[0]) is Batch) \
                and not set(kwargs) - {"dtype", "device"}:  # (``x.new_zeros(L - n, H)``: each its own length)
            out = _stretches_of(n, lambda shape: getattr(t, name)(shape, **kwargs), _size_parts(args))
            if out is not NotImplemented:
                return out
        if name != "new_full" and len(args) > 1 and all(type(a) is int for a in args):
            args = (args,)  # (``x.new_zeros(2, 3)``: the size as separate ints)
        size = args[0] if args else kwargs.get("size")
        if t is None or type(size) not in (tuple, list, torch.Size, int) or any(
                type(v) is Batch for v in (*args, *kwargs.values())) or (
                type(size) is not int and any(type(k) is not int for k in size)):
            return NotImplemented
        size = (size,) if type(size) is int else tuple(size)
        rest = {k: v for k, v in kwargs.items() if k != "size"}
        return bt.from_tensor(getattr(t, name)((n, *size), *args[1:], **rest))

    return rule


for _op in ("new_zeros", "new_ones", "new_full", "new_empty"):
    BATCH.register(_op)(_new_like(_op))


@BATCH.register("new")
def _new_sized(n, x, args, kwargs):
    """``x.new(1, H)`` of a batched x, sizes given: ``x.new_empty``'s rule (given data, a tensor or a storage, it
    copies or views it: each instance's own call)."""
    if not args or not all(type(a) is int for a in args) or set(kwargs) - {"dtype", "device"}:
        return NotImplemented
    return _NEW_EMPTY(n, x, (args,), kwargs)


_NEW_EMPTY = _new_like("new_empty")


def _size_parts(args):
    """The elements of a size given as separate values (``zeros(a, b)``) or as one tuple or list, a built one
    included (``zeros((L - n, H))``)."""
    if len(args) == 1 and type(args[0]) is Batch and args[0].struct is not None and args[0].owner is None and \
            args[0].struct[0] in (tuple, list):
        return list(args[0].struct[1])
    if len(args) == 1 and type(args[0]) in (tuple, list):
        return list(args[0])
    return list(args)


def _stretches_of(n, make, parts):
    """A new tensor of each instance's own first size and the shared rest (``torch.zeros(L - n, H)``), as the
    stretches of one ``make((n, longest, *rest))``: what ``torch.cat`` with each instance's stretch reads at once;
    NotImplemented for any other size (each instance's own call says what it makes of it), and in a run that
    changes values in place (where each instance's tensor is its own, with a version of its own)."""
    if not sharing.state.fresh or not parts or type(parts[0]) is not Batch or any(
            type(k) is not int for k in parts[1:]):
        return NotImplemented
    lengths = [operator.index(v) if _integer_scalar(v) else v for v in bt.instance_ints(n, parts[0])]
    if any(type(m) is not int or m < 0 for m in lengths):
        return NotImplemented
    return rows.batch(n, rows.padded_rows(n, make((n, max(lengths), *parts[1:])), lengths))


@BATCH.register(torch.zeros, torch.ones)
def made_of_own_length(n, fn, args, kwargs):
    """``torch.zeros(L - n, H)`` (``ones``) of each instance's own first size: the stretches of one tensor."""
    if set(kwargs) - {"dtype", "device"} or any(type(v) is Batch for v in kwargs.values()):
        return NotImplemented
    return _stretches_of(n, lambda shape: fn(shape, **kwargs), _size_parts(args))


@BATCH.register(torch.take)
def taken(n, fn, args, kwargs):
    """``torch.take(x, index)``: ``x.reshape(-1)[index]`` of each instance (torch's vmap has no rule for it), the
    index shared or each instance's own; NotImplemented where an index lies outside an instance's elements (its
    own call raises torch's error)."""
    found = by_names(args, kwargs, ("input", "index"))
    if found is None or len(found) != 2:
        return NotImplemented
    x, index = (_rows_each(n, v) for v in (found["input"], found["index"]))
    if x is None or index is None or index.dtype not in facts.INTEGER_INDEX:
        return NotImplemented
    flat = x.reshape(n, -1)
    size = flat.shape[1]
    if index.numel() and bool(((index < -size) | (index >= size)).any()):
        return NotImplemented
    at = torch.where(index < 0, index + size, index).reshape(n, -1)
    return bt.from_tensor(flat.gather(1, at).view(index.shape))


@BATCH.register(torch.column_stack)
def column_stack(n, fn, args, kwargs):
    """``torch.column_stack([a, b, ...])`` of a list the program built (instance tensors, any shared): each
    instance's vector or number a column, the columns side by side, one ``cat`` of the rows."""
    found = by_names(args, kwargs, ("tensors", "out"))
    seq = found.get("tensors") if found is not None and found.get("out") is None else None
    if type(seq) is not Batch or seq.struct is None or seq.owner is not None or seq.struct[0] not in (list, tuple):
        return NotImplemented
    parts = [_rows_each(n, p) for p in seq.struct[1]]
    if not parts or None in parts:
        return NotImplemented
    columns = [p.reshape(n, -1, 1) if p.dim() <= 2 else p for p in parts]
    first = columns[0]
    if any(c.dim() != first.dim() or c.shape[:2] != first.shape[:2] or c.shape[3:] != first.shape[3:]
           for c in columns):
        return NotImplemented  # (sizes that differ: each instance's call raises torch's error)
    return bt.from_tensor(torch.cat(columns, 2))


@BATCH.register(torch.isin)
def isin(n, fn, args, kwargs):
    """``torch.isin(x, test)`` of batched elements against shared test elements: elementwise, one call."""
    found = by_names(args, kwargs, ("elements", "test_elements", "assume_unique", "invert"))
    if found is None or type(found.get("elements")) is not Batch or any(
            type(v) is Batch for k, v in found.items() if k != "elements") or "test_elements" not in found:
        return NotImplemented
    x = bt.tensor_of(found["elements"])
    if x is None:
        return NotImplemented
    return bt.from_tensor(fn(x, found["test_elements"], assume_unique=found.get("assume_unique", False),
                             invert=found.get("invert", False)))


@BATCH.register(torch.bincount)
def bincount(n, fn, args, kwargs):
    """``torch.bincount(x, weights, minlength)`` of each instance's vector of counts: each instance's values moved
    past the others' bins, one call; each instance's length its own (``max(x) + 1``, at least minlength: one host
    read). NotImplemented where an instance's values are empty or negative (its call gives or raises its own)."""
    found = by_names(args, kwargs, ("input", "weights", "minlength"))
    if found is None or type(found.get("minlength")) is Batch or "input" not in found:
        return NotImplemented
    x = _rows_each(n, found["input"])
    weights = found.get("weights")
    weights = _rows_each(n, weights) if weights is not None else None
    minlength = found.get("minlength", 0)
    if x is None or x.dim() != 2 or x.shape[1] == 0 or x.dtype not in facts.INTEGER_INDEX or \
            type(minlength) is not int or minlength < 0 or found.get("weights") is not None and (
                weights is None or weights.shape != x.shape):
        return NotImplemented
    low, high = x.aminmax(dim=1)
    if bool((low < 0).any()):
        return NotImplemented
    lengths = [max(minlength, h + 1) for h in high.tolist()]
    size = max(lengths)
    at = x + torch.arange(n, device=x.device).unsqueeze(1) * size
    out = fn(at.reshape(-1), None if weights is None else weights.reshape(-1), minlength=n * size).view(n, size)
    if all(length == size for length in lengths):
        return bt.from_tensor(out)
    return bt.from_items([row[:length] for row, length in zip(out.unbind(0), lengths)])


@BATCH.register(torch.vander)
def vander(n, fn, args, kwargs):
    """``torch.vander(x, N, increasing)`` of each instance's vector: the powers of every row at once, as torch
    makes them (a column of ones, then the running product of x; a ``cumprod``, which takes an integer x to
    int64 as ``vander`` does), their order flipped unless increasing. Not where x needs a gradient: torch's
    ``vander`` changes its own result in place and refuses its backward, and so must each instance's."""
    found = by_names(args, kwargs, ("x", "N", "increasing"))
    if found is None or type(found.get("x")) is not Batch or any(type(v) is Batch for k, v in found.items()
                                                                   if k != "x"):
        return NotImplemented
    x = bt.tensor_of(found["x"])
    size = found.get("N")
    if x is None or x.dim() != 2 or x.requires_grad and torch.is_grad_enabled():
        return NotImplemented  # (no vector: its own call raises; torch's vander has no working gradient: as it is)
    size = x.shape[1] if size is None else size
    if type(size) is not int or size < 1 or type(found.get("increasing", False)) is not bool:
        return NotImplemented
    columns = torch.cat([torch.ones(*x.shape, 1, dtype=x.dtype, device=x.device),
                         x.unsqueeze(-1).expand(*x.shape, size - 1)], -1)
    powers = torch.cumprod(columns, -1)
    return bt.from_tensor(powers if found.get("increasing", False) else powers.flip(-1))


@BATCH.register(torch.renorm)
def renorm(n, fn, args, kwargs):
    """``torch.renorm(x, p, dim, maxnorm)`` of a batched x (see ``_renormed``)."""
    found = by_names(args, kwargs, ("input", "p", "dim", "maxnorm"))
    return NotImplemented if found is None or len(found) != 4 else _renormed(n, found["input"], found)


@BATCH.register("renorm")
def renorm_method(n, x, args, kwargs):
    """``x.renorm(p, dim, maxnorm)`` of a batched x (see ``_renormed``)."""
    found = by_names(args, kwargs, ("p", "dim", "maxnorm"))
    return NotImplemented if found is None or len(found) != 3 else _renormed(n, x, found)


def _renormed(n, x, found):
    """Each instance's sub-tensors along its ``dim`` scaled to a p-norm of at most maxnorm: every instance's
    sub-tensors the rows of one matrix, renormed along its first dim."""
    t = bt.tensor_of(x) if type(x) is Batch else None
    dim = found["dim"]
    if t is None or t.dim() < 3 or t.numel() == 0 or type(dim) is not int or not -(t.dim() - 1) <= dim < t.dim() - 1 \
            or any(type(found[k]) is Batch for k in ("p", "maxnorm")):
        return NotImplemented
    moved = t.movedim(dim % (t.dim() - 1) + 1, 1)
    out = torch.renorm(moved.reshape(n * moved.shape[1], -1), found["p"], 0, found["maxnorm"])
    return bt.from_tensor(out.reshape(moved.shape).movedim(1, dim % (t.dim() - 1) + 1))


@BATCH.register(torch.tensor, torch.as_tensor)
def tensor_of_numbers(n, fn, args, kwargs):
    """``torch.tensor(xs)`` of each instance's Python numbers (a number, or lists of them: ``[float(v) for v in
    x]``, ``x.tolist()``), nested alike in every instance: one tensor of them all. The dtype an instance's own call
    infers from the types of its numbers is every instance's where each holds the same types (or the dtype is
    given); NotImplemented otherwise, or where the instances' lists differ in length (each its own call)."""
    x = args[0] if len(args) == 1 else None
    if type(x) is not Batch or not (x.owner == "items" or x.struct is not None and x.owner is None) or any(
            type(v) is Batch for v in kwargs.values()):
        return NotImplemented  # (a batch's tensors: vmap's, as before)
    if _shared_struct(x, True) is not _DIFFERS:
        return NotImplemented  # (lists of shared numbers: the one list, made once: ``_vmapped_or_per_instance``)
    values = bt.items_of(x)
    kinds = [set() for _ in values]
    if not all(_number_leaves(v, each) for v, each in zip(values, kinds)) or kwargs.get("dtype") is None and any(
            each != kinds[0] for each in kinds):
        return NotImplemented
    try:
        return bt.from_tensor(fn(values, **kwargs))
    except (ValueError, TypeError, RuntimeError):  # (lists of lengths that differ: each instance's own call)
        return NotImplemented


def _number_leaves(value, kinds):
    """Whether ``value`` is a Python number (bool, int or float), or lists and tuples of them; their types noted
    in ``kinds``."""
    kind = type(value)
    if kind in (bool, int, float):
        kinds.add(kind)
        return True
    return kind in (list, tuple) and all(_number_leaves(v, kinds) for v in value)


_BAG = ("input", "offsets", "per_sample_weights")
_BAG_FUNCTION = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode", "sparse",
                 "per_sample_weights", "include_last_offset", "padding_idx")


@BATCH.register(nn.EmbeddingBag, F.embedding_bag)
def embedding_bag(n, fn, args, kwargs):
    """An ``nn.EmbeddingBag`` (or ``F.embedding_bag``) of each instance's bags: a matrix of bags of one length, or
    a vector cut by shared offsets (``bag(words, torch.tensor([0]))``). Every instance's bags one call: the
    matrices' rows laid end to end, or the vectors with each instance's offsets moved past the others'. Not with
    ``max_norm`` (the lookup renormalizes the table in place, each instance's call in turn) or
    ``scale_grad_by_freq`` (a word's gradient scaled by its count in the instance's own bags)."""
    module = isinstance(fn, nn.Module)
    found = by_names(args, kwargs, _BAG if module else _BAG_FUNCTION)
    if found is None or (module and (type(fn) is not nn.EmbeddingBag or "forward" in fn.__dict__)):
        return NotImplemented
    last = fn.include_last_offset if module else found.get("include_last_offset", False)
    max_norm = fn.max_norm if module else found.get("max_norm")
    if _counts_its_indices(fn, args, kwargs):
        return per_instance(n, fn, args, kwargs, why=fallbacks.COUNTED)
    offsets, weights = found.get("offsets"), found.get("per_sample_weights")
    if max_norm is not None or last or type(found.get("input")) is not Batch or any(
            type(v) is Batch for k, v in found.items() if k not in ("input", "per_sample_weights")):
        return NotImplemented
    x = bt.tensor_of(found["input"])
    w = _rows_each(n, weights) if weights is not None else None
    if x is None or weights is not None and (w is None or w.shape != x.shape):
        return NotImplemented
    if offsets is None and x.dim() == 3:  # (each instance's bags the rows of a matrix)
        bags, flat, flat_offsets = x.shape[1], x.reshape(-1, x.shape[2]), None
    elif offsets is not None and x.dim() == 2 and type(offsets) in PLAIN_TENSORS and offsets.dim() == 1:
        starts, size = offsets.tolist(), x.shape[1]
        if not starts or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > size:
            return NotImplemented  # (offsets torch refuses, or none: each instance's call raises, or gives its own)
        bags, flat = len(starts), x.reshape(-1)
        flat_offsets = (offsets.unsqueeze(0) + size * torch.arange(n, device=offsets.device).unsqueeze(1)).reshape(-1)
    else:
        return NotImplemented
    flat_weights = None if w is None else w.reshape(flat.shape)
    if module:
        out = fn(flat, flat_offsets, flat_weights)
    else:
        out = fn(**{**found, "input": flat, "offsets": flat_offsets, "per_sample_weights": flat_weights})
    return bt.from_tensor(out.view(n, bags, *out.shape[1:]))


@BATCH.register(torch.reshape)
def reshaped(n, fn, args, kwargs):
    """``torch.reshape(x, shape)`` of a batched x: the batch's tensor to (instances, *shape)."""
    shape = args[1] if len(args) == 2 and not kwargs else None
    if type(args[0]) is not Batch or type(shape) not in (tuple, list, torch.Size) or any(
            type(k) is not int for k in shape):
        return NotImplemented
    t = bt.tensor_of(args[0])
    return NotImplemented if t is None else bt.from_tensor(t.reshape(t.shape[0], *shape))


def _integer_scalar(v):
    return type(v) is torch.Tensor and v.dim() == 0 and v.dtype in facts.INTEGER_INDEX


@BATCH.register(F.pad)
def constant_padded(n, fn, args, kwargs):
    """``F.pad(x, pad)`` of a batched x, constant mode: the pad reaches only the instance's last dims; of each
    instance's stretch ``x[:n]`` padded to one length (``F.pad(x, (0, L - n))``), one tensor of them."""
    pad = args[1] if len(args) > 1 else kwargs.get("pad")
    found = by_names(args, kwargs, ("input", "pad", "mode", "value"))
    seq = rows.of(found["input"]) if found is not None and "pad" in found else None
    if seq is not None and found.get("mode", "constant") == "constant" and type(found.get("value")) is not Batch:
        pads = [tuple(operator.index(v) if _integer_scalar(v) else v for v in bt.instance(found["pad"], k))
                for k in range(n)]  # (``6 - n`` of each instance's 0-d n: an int, as the pad reads it)
        out = padded.padded_out(n, seq, pads, found.get("value") or 0.0)
        if out is not None:
            return out
    if type(args[0]) is not Batch or type(pad) not in (tuple, list) or kwargs.get("mode", "constant") != "constant" \
            or len(args) > 2 and args[2] != "constant" or any(type(v) is Batch for v in (*args[1:], *kwargs.values())):
        return NotImplemented
    t = bt.tensor_of(args[0])
    if t is None or len(pad) // 2 > t.dim() - 1:
        return NotImplemented
    return bt.from_tensor(fn(t, *args[1:], **kwargs))


for _method in facts.UNARY_METHODS:
    BATCH.register(_method)(unary_method(_method))
for _method, (_position, _every) in facts.DIM_METHODS.items():
    BATCH.register(_method)(method_dim(_method, _position, _every))
for _kind in ("max", "min", "median"):
    BATCH.register(_kind)(_extreme_method(_kind))
