"""The values of a batched frame: one object standing for a value of each of n instances.

A frame in batched mode runs one SubGraph for n instances at once. Each of its
variables is either

- a plain object: the same value for every instance (a module, the tree they
  share, a constant). With n == 1 every value is plain, so one instance runs
  exactly as in sequential mode; or
- a ``Batch``: a value per instance, held as one tensor whose dim 0 is the
  instance (``tensor``), as a list (``items``), as a tuple or list whose
  elements are batched (``struct``: ``h, c, loss`` returned together), or as
  the pieces a Cond or a loop put back together (``pieces``), formed into one
  of the others only when an op needs it.

A Batch never hides inside a plain object, and one of size 1 is never made:
it is the plain value of its one instance.

A Batch may also be *lazy* (``thunk``): a value not computed yet — the result
of a call the scheduler deferred, or arithmetic on such a result. It is
computed, in place, the first time anything reads it (``force``); a few
operations pass it on unread (``part``, a Cond's join, tuple building, the
arithmetic of ``facts.LAZY``, ``batch_rules.LazyOp``).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy
import torch

from ..ops.facts import INTEGER_INDEX, NUMBERS
from . import saved_versions, sharing


class Batch:
    __slots__ = ("n", "tensor", "items", "struct", "pieces", "method", "owner", "thunk", "made", "ints", "__weakref__")

    def __init__(self, n, tensor=None, items=None, struct=None, pieces=None, method=None, thunk=None):
        self.n = n
        self.thunk = thunk  # a lazy batch: ``thunk.compute()`` gives its value (see ``force``)
        self.method = method  # (batched tensor, name): ``x.name`` waiting to be called
        self.tensor = tensor
        self.items = items
        self.struct = struct  # (tuple | list, [element: plain or Batch])
        self.pieces = pieces  # ([(value, count)], Order: where each piece's instances go)
        # which form is the truth; the other is a cache. A tensor's items are views of it, so they
        # stay true after an in-place change; a tensor stacked from items does not.
        self.owner = "tensor" if tensor is not None else "items" if items is not None else None
        # where the program may change values in place: the versions of the tensors a cache (``tensor`` made
        # from pieces or items) was made from, which tell that it went stale (``_check_cache``)
        self.made = None
        self.ints = None  # its items, Python ints, as one LongTensor (``instance_index``)

    def __repr__(self):
        form = ("lazy" if self.thunk is not None else "tensor " + "x".join(map(str, self.tensor.shape))
                if self.tensor is not None
                else "items" if self.items is not None else "struct" if self.struct is not None else "pieces")
        return f"<Batch of {self.n}: {form}>"


class Views:
    """A lazy batch's thunk: a value that knows where each instance's value lies in one tensor (``rows.Rows``,
    ``padded.Padded``), whose instances' views are made when something first reads them (``held.fill``). The
    rules for such values read where they lie, not the views: a chain of ops on them makes none."""

    __slots__ = ("held", "ragged")

    def __init__(self, held, ragged):
        self.held = held
        self.ragged = ragged  # whether the values differ in length (no one tensor: ``tensor_of`` says None)

    def depends_on(self):
        return []

    def compute(self):
        return Batch(len(self.held.lengths), items=self.held.fill())


def held(value, kind):
    """The value of type ``kind`` (``rows.Rows``, ``padded.Padded``) that Batch ``value`` holds as its instances'
    values, their views made or not (``Views``), in a run that changes nothing in place (elsewhere a view's shape
    or values may have changed since: ``ys.unsqueeze_(0)``), else None."""
    if type(value) is not Batch:
        return None
    thunk = value.thunk
    found = thunk.held if type(thunk) is Views else value.items if thunk is None and value.owner == "items" \
        else None
    return found if type(found) is kind and sharing.state.fresh else None


def holds(value, kind):
    """Whether ``value`` is a batch of values of type ``kind`` (``held``), in any run."""
    return type(value) is Batch and (type(value.items) is kind or type(value.thunk) is Views and
                                     type(value.thunk.held) is kind)


# Tensors as torch's ops take them, no subclass's own overrides: a module's parameter too (``a = self.start``)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def long_tensor(ints, device=None):
    """Python ints (a list, a range) as a LongTensor (on ``device``): through numpy where there are more than a
    few, which reads a long list several times faster than ``torch.tensor`` (a loop's rows, a layout's index)."""
    t = torch.from_numpy(numpy.array(ints, dtype=numpy.int64)) if len(ints) > 16 else \
        torch.tensor(ints, dtype=torch.long)
    return t if device is None or t.device == torch.device(device) else t.to(device)


def from_tensor(t):
    return t[0] if t.shape[0] == 1 else Batch(t.shape[0], tensor=t)


def rows_view(t, rows):
    """Rows ``rows`` (a list of positions) of tensor ``t`` as a batch whose values are views of them, so that
    an in-place change of one changes ``t``: a slice where the rows run in order, else each row's view."""
    if len(rows) == 1:
        return t[rows[0]]
    start = rows[0]
    if rows == list(range(start, start + len(rows))):
        return Batch(len(rows), tensor=t[start:start + len(rows)])
    return from_items([t[k] for k in rows])


def from_items(items):
    """The batch of per-instance values ``items`` (len ≥ 2)."""
    return Batch(len(items), items=items)


def from_struct(kind, parts, n):
    return Batch(n, struct=(kind, parts))


class Keyed(dict):
    """The kind of a dict built in the program with keys every instance shares (``{"h": h, "c": c}``), held as a
    struct of its values: ``_make`` gives each instance's plain dict (``dict_kind``)."""

    keys_ = ()

    @classmethod
    def _make(cls, values):
        return dict(zip(cls.keys_, values))


_DICT_KINDS = {}


def struct_items(value):
    """What a ``for`` over struct Batch ``value`` draws, in order: a dict's keys (every instance's the same),
    else its parts."""
    kind, parts = value.struct
    return list(kind.keys_) if issubclass(kind, Keyed) else parts


def dict_kind(keys):
    """The Keyed kind of dicts with ``keys``, in order (one class per key tuple, kept)."""
    kind = _DICT_KINDS.get(keys)
    if kind is None:
        kind = _DICT_KINDS[keys] = type("dict", (Keyed,), {"keys_": keys})
    return kind


def plain_namedtuple(cls):
    """Whether ``cls`` is a namedtuple class as ``collections.namedtuple`` or ``typing.NamedTuple`` makes it (its
    fields read as its items): not a subclass of one, whose own ``__new__`` or properties a field's read or a
    rebuilt instance would bypass."""
    return type(cls) is type and cls.__bases__ == (tuple,) and isinstance(getattr(cls, "_fields", None), tuple) \
        and hasattr(cls, "_make")


_PLAIN_DATACLASSES = {}


def plain_dataclass(cls):
    """Whether ``cls`` is a dataclass whose instances are their fields: the ``__init__`` dataclasses wrote, taking
    each field by name and storing it, with no ``__post_init__`` (nor ``InitVar``), its fields read by name
    (``__match_args__``). (Kept per class.)"""
    try:
        found = _PLAIN_DATACLASSES.get(cls)
    except TypeError:  # (an unhashable callable)
        return False
    if found is None:
        found = _PLAIN_DATACLASSES[cls] = _is_plain_dataclass(cls)
    return found


def _is_plain_dataclass(cls):
    if type(cls) is not type or not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__"):
        return False
    code = getattr(cls.__init__, "__code__", None)
    names = tuple(f.name for f in dataclasses.fields(cls))
    return code is not None and code.co_filename == "<string>" and all(f.init for f in dataclasses.fields(cls)) \
        and code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount] == names \
        and getattr(cls, "__match_args__", None) == names


def dataclass_fields(cls, args, kwargs):
    """The values of the fields of plain dataclass ``cls`` that ``cls(*args, **kwargs)`` stores, in order (a
    field not given: its default); None where the call is not so simple (a default made by a factory, a field
    given twice or missing: the call itself raises)."""
    fields = dataclasses.fields(cls)
    if len(args) > len(fields):
        return None
    values = list(args)
    for f in fields[len(args):]:
        if f.name in kwargs:
            values.append(kwargs[f.name])
        elif f.default is not dataclasses.MISSING:
            values.append(f.default)
        else:
            return None
    if set(kwargs) - {f.name for f in fields[len(args):]}:
        return None
    return values


def _values_alone(kind):
    """Whether objects of struct ``kind`` are their values alone where nothing changes an object in place (a dict
    display's ``Keyed`` kind, a plain dataclass): no one can tell one made anew from another."""
    return issubclass(kind, Keyed) or plain_dataclass(kind)


def build(kind, items):
    """A struct's value of ``kind`` (tuple, list, a namedtuple, torch's return types, a plain dataclass) from its
    ``items``."""
    if kind is list or kind is tuple:  # (first: every instance's own ``hs = []`` of every node is made here)
        return kind(items)
    return kind._make(items) if hasattr(kind, "_make") else kind(*items) if plain_dataclass(kind) else kind(items)


# -- lazy batches


def is_lazy(value):
    """Whether ``value`` is, or is joined from, a lazy batch not computed yet."""
    if type(value) is not Batch:
        return False
    if value.thunk is not None:
        return True
    return value.pieces is not None and any(is_lazy(v) for v, _ in value.pieces[0])


def lazies_in(value):
    """The uncomputed lazy batches ``value`` is made of (itself, its joined pieces, its elements)."""
    if type(value) is not Batch:
        return []
    if value.thunk is not None:
        return [value]
    found = []
    if value.pieces is not None:
        for v, _ in value.pieces[0]:
            found.extend(lazies_in(v))
    if value.struct is not None:
        for v in value.struct[1]:
            found.extend(lazies_in(v))
    return found


def force(b, views=True):
    """Compute lazy batch ``b`` in place. What it depends on is computed first, deepest first, with an
    explicit stack: a chain of lazy values as long as a deep recursion's needs no Python stack. Without
    ``views``, b's instances' views (``Views``) are left to be made when read."""
    stack = [b]
    while stack:
        top = stack[-1]
        if top.thunk is None or (not views and top is b and type(top.thunk) is Views):
            stack.pop()
            continue
        waiting = [d for d in top.thunk.depends_on() if d.thunk is not None]
        if waiting:
            stack.extend(waiting)
            continue
        _adopt(top, top.thunk.compute())


def _adopt(b, value):
    """Lazy batch ``b`` becomes ``value`` (a Batch of b.n, or one value every instance shares); a value whose
    views are not made yet stays so (``Views``)."""
    if type(value) is Batch:
        if value.thunk is not None and type(value.thunk) is not Views:
            force(value, views=False)
        b.tensor, b.items, b.struct, b.pieces = value.tensor, value.items, value.struct, value.pieces
        b.method, b.owner = value.method, value.owner
        b.thunk = value.thunk
        return
    b.tensor, b.items, b.struct, b.pieces, b.method = None, [value] * b.n, None, None, None
    b.owner = "items"
    b.thunk = None


def ready(value):
    """``value``, computed if it is a lazy batch."""
    if type(value) is Batch and value.thunk is not None:
        force(value)
    return value


def resolved(value):
    """``value``, computed if it is a lazy batch, its instances' views (``Views``) left to be made when read (as
    the rules for Rows and Padded values read them)."""
    if type(value) is Batch and value.thunk is not None and type(value.thunk) is not Views:
        force(value, views=False)
    return value


def ready_all(value):
    """Compute every lazy batch ``value`` is made of (its joined pieces and elements too). A plain value
    holds no batch (see above), so it is not searched."""
    if type(value) is Batch:
        for lazy in lazies_in(value):
            force(lazy)


def tensor_versions(values):
    """(tensor, version) of the tensors among ``values``, to tell later whether one was changed in place."""
    found = []
    for v in values:
        t = v if type(v) is torch.Tensor else v.tensor if type(v) is Batch and v.owner == "tensor" else None
        if t is not None:
            found.append((t, t._version))
    return found


def changed(versions):
    return any(t._version != version for t, version in versions)


class _LazyPart:
    """Instances start .. start+count-1 of a lazy value, for the request that asked for them."""

    __slots__ = ("value", "start", "count")

    def __init__(self, value, start, count):
        self.value, self.start, self.count = value, start, count

    def depends_on(self):
        return lazies_in(self.value)

    def compute(self):
        return part(self.value, self.start, self.count)


# -- reading a batch in the form an op needs


def settle(value):
    """A batch of lists built in the program (``[hl, hr]``) is kept as its elements until each instance's
    list is needed by itself: then every instance gets its own list, and those lists are the truth."""
    if type(value) is Batch and value.thunk is not None:
        force(value)
    if type(value) is Batch and value.struct is not None and not issubclass(value.struct[0], tuple) and not (
            sharing.state.fresh and value.items is None and _values_alone(value.struct[0])):
        items_of(value)  # (a dict display, a dataclass, stays its values where nothing changes one: in a loop)
    return value


def instance(value, k):
    """Instance k's value."""
    if type(value) is not Batch:
        return value
    settle(value)
    if value.tensor is not None and value.owner == "tensor":
        return value.tensor[k]
    return items_of(value)[k]


def items_of(b):
    """The per-instance values of Batch ``b`` as a list."""
    if b.thunk is not None:
        force(b)
    if b.made is not None:
        _check_cache(b)
    if b.items is None:
        if b.tensor is not None:
            t = b.tensor
            # (unbind's views, whose gradients are one stack: select's each make a zero tensor of the whole batch.
            # Where autograd records in a run that may change values in place, select's: torch lets those be
            # changed in place)
            recorded = t.requires_grad or torch.is_grad_enabled()
            b.items = [t[k] for k in range(b.n)] if recorded and not sharing.state.fresh else list(t.unbind(0))
        elif b.struct is not None:
            kind, parts = b.struct
            columns = [items_of(p) if type(p) is Batch else [p] * b.n for p in parts]
            b.items = [build(kind, list(row)) for row in zip(*columns)] if columns else \
                [build(kind, []) for _ in range(b.n)]
            if not issubclass(kind, tuple):
                # each instance now has its own list, which the program may change: from here on the
                # items are the truth
                b.struct, b.owner = None, "items"
        elif b.method is not None:
            base, name = b.method
            b.items = [getattr(x, name) for x in items_of(base)]
        else:
            b.items = _gather_pieces(b, [items_of(v) if type(v) is Batch else [v] * c for v, c in b.pieces[0]])
    return b.items


def own_lists(v, kinds=(list,)):
    """Each instance's own list (of ``kinds``) that Batch ``v`` holds, whether as its items or as the pieces a
    branch or a loop joined (each list the object its side holds), else None."""
    if type(v) is not Batch or v.thunk is not None:
        return None
    if v.owner is None and v.pieces is not None and v.struct is None:
        if not all(type(p) in kinds or own_lists(p, kinds) is not None for p, _ in v.pieces[0]):
            return None
        return items_of(v)
    # (the set of their types, not all(genexpr): it runs at every append of a loop over each node's children)
    return v.items if v.owner == "items" and set(map(type, v.items)).issubset(kinds) else None


def own_lists_made(v):
    """``own_lists(v)``, each instance's value first made its own object (``items_of``): a list display the
    program built, held once as its elements for every instance, becomes one list per instance, the same objects a
    caller holding ``v`` holds, so a change made to them from here is each instance's own."""
    if type(v) is Batch:
        items_of(v)
    return own_lists(v)


def instance_shape(b):
    """The shape every instance's tensor of Batch ``b`` has, read without joining or stacking them (a Batch's
    tensor, its items, its pieces); None where its values are not all tensors of one shape, or not computed yet."""
    if b.thunk is not None or b.method is not None or b.owner is None and b.struct is not None:
        return None
    if b.owner == "tensor":
        return b.tensor.shape[1:]
    values = b.items if b.owner == "items" else [v for v, _ in b.pieces[0]]
    shape = None
    for v in values:
        found = instance_shape(v) if type(v) is Batch else v.shape if type(v) in PLAIN_TENSORS else None
        if found is None or shape is not None and found != shape:
            return None
        shape = found
    return shape


def instance_index(value):
    """Each instance's int of Batch ``value`` (Python ints, or 0-d integer tensors) as one LongTensor, else
    None (a bool or uint8 tensor is a mask, as eager reads it)."""
    if value.ints is not None:
        return value.ints  # (a loop's steps, ``t - 1`` of them: read as an index several times)
    if value.owner == "items" and value.items and all(type(k) is int for k in value.items):
        value.ints = long_tensor(value.items)
        return value.ints
    t = tensor_of(value) if value.owner is not None else None
    return t if t is not None and t.dim() == 1 and t.dtype in INTEGER_INDEX else None


def instance_ints(n, value):
    """Each instance's value of ``value`` (a range's or a slice's bound): Python ints for a batch of integer
    tensors of one element (one host read), else the values themselves (a shared one n times)."""
    if type(value) is not Batch:
        return [value] * n
    t = tensor_of(value)
    if t is not None and t.dim() == 1 and not (t.is_floating_point() or t.is_complex()):
        return t.tolist()
    return items_of(value)


def tensor_of(b):
    """Batch ``b`` as one tensor of n rows, or None if its values are not tensors of one shape and dtype."""
    if b.thunk is not None:
        if type(b.thunk) is Views and b.thunk.ragged:  # (values of their own lengths, not made yet: they need not be)
            return None
        force(b)
    if b.made is not None:
        _check_cache(b)
    if b.tensor is None:
        if b.struct is not None and b.owner is None:
            return None  # (a list, tuple or dict is no tensor: asking must not make each instance's own)
        if b.pieces is not None:
            t = _joined_tensor(b.pieces, None)
            if t is None:
                return None
            b.tensor = t
        elif b.items is not None or b.struct is not None or b.method is not None:
            items = items_of(b)
            if not all(type(x) in PLAIN_TENSORS for x in items) or not same_kind(items, 0):
                return None
            b.tensor = torch.stack(items)
            note_made_from(items, b.tensor)
        else:
            return None
        if not sharing.state.fresh and (b.pieces is not None or b.owner == "items"):
            # (made from inference tensors, which keep no version: a cache made anew whenever read)
            b.made = _made_from(b) or ()
            if b.owner is None and not b.tensor.is_inference():
                _watch(b)
    return b.tensor


def _made_from(b):
    """The versions of the tensors that batch ``b``'s cache is made from: its pieces' (their tensors', their
    items', nested pieces'), or its items'; None where one is an inference tensor (which keeps no version)."""
    if b.owner == "items":
        versions = [_version_of(x) for x in b.items]
    else:
        versions = [_version_of(v) for v, _ in b.pieces[0]]
    return None if any(v is None for v in versions) else tuple(versions)


def _version_of(value):
    if type(value) is Batch:
        if value.owner == "tensor":
            value = value.tensor
        elif value.owner == "items" or value.pieces is not None:
            return _made_from(value)
        else:
            return 0  # (a struct: no tensor of it is changed in place as a whole)
    if not isinstance(value, torch.Tensor):
        return 0
    return None if value.is_inference() else value._version


# The tensors joined from pieces (``tensor_of``) in a run that may change values in place, by id: (weak refs of
# the tensor and of its batch, the tensor's version). An op may change one in place through a view of it
# (``w[0] *= 3``), where eager code changes each instance's own tensor, which other names may hold
# (``w = v if c else v * 2``): ``caches_changed`` brings such changes into the pieces.
CACHES = {}


def _watch(b):
    if len(CACHES) > _limits["caches"]:
        for key, (t, held, _) in list(CACHES.items()):
            if t() is None or held() is None:
                del CACHES[key]
        _limits["caches"] = max(256, 2 * len(CACHES))
    CACHES[id(b.tensor)] = (weakref.ref(b.tensor), weakref.ref(b), b.tensor._version)


def caches_changed():
    """Bring into their pieces (``written_through``) the rows that changed in place in a tensor joined from
    them since it was made or last looked at; then drop such a tensor whose pieces changed since
    (``_check_cache``: what an op saved of it moves its version)."""
    for key, (ref, held, version) in list(CACHES.items()):
        t, b = ref(), held()
        if t is None or b is None or b.tensor is not t:
            del CACHES[key]
            continue
        if t._version != version:
            CACHES[key] = (ref, held, t._version)
            joined = _joined_tensor(b.pieces, None)
            if joined is not None and joined.shape == t.shape:
                changed = {k for k, d in enumerate(rows_differ(joined, t)) if d}
                if changed:
                    written_through(b, changed)
                    b.made = _made_from(b) or ()
        if b.made is not None and _made_from(b) != b.made:
            _check_cache(b)
            if b.tensor is not t:
                del CACHES[key]


def _check_cache(b):
    """Drop batch ``b``'s cache (its tensor; a joined value's items, views of it) where a tensor it was made
    from changed in place since: through another name of it (``u = w if c else w * 3; u *= 2``). An op that
    read the value saved the cache where eager's saved those very tensors: the cache's version moves too, so
    that its backward raises as eager's does."""
    now = _made_from(b)
    if now == b.made:
        return
    changed = _rows_changed(b) if b.owner is None and now is not None else None
    if changed == []:
        b.made = now  # (a version moved, not these rows: another row of a piece's base changed)
        return
    if b.owner is None and not b.tensor.is_inference():
        saved_versions.moved(b.tensor, changed)
    b.tensor, b.made = None, None
    if b.owner is None:
        b.items = None


def _rows_changed(b):
    """The rows of batch ``b``'s cache that no longer hold what its pieces hold (None: it cannot tell)."""
    joined = _joined_tensor(b.pieces, None)
    if joined is None or joined.shape != b.tensor.shape or joined.dtype != b.tensor.dtype:
        return None
    return [k for k, differ in enumerate(rows_differ(joined, b.tensor)) if differ]


def rows_differ(a, b):
    """Per row (dim 0) of tensors ``a`` and ``b`` of one shape, whether their values differ (NaN where both hold
    NaN is no difference): a list of bools, one host read."""
    a, b = a.detach(), b.detach()
    differ = a != b
    if a.is_floating_point() or a.is_complex():
        differ &= ~(a.isnan() & b.isnan())
    return differ.reshape(a.shape[0], -1).any(1).tolist()


# Tensors made as copies of instances' own tensors (stacked; rows gathered where eager makes views), by the
# tensor each of those views (its base, or itself), with the stretch of the base it spans: an op that read the
# copy saved it where eager's saved the instances' tensors, so a later change in place of what overlaps one of
# them moves the copy's version too (``changed_in_place``), and a backward that saved it raises as eager's
# does. (By id, with weak references that tell a reused id apart; pruned as it grows.)
MADE_FROM = {}
# (the sizes past which MADE_FROM and CACHES are pruned; the copies kept, ``_Kept``, since MADE_FROM last was)
_limits = {"made_from": 4096, "caches": 256, "kept": 0}


def note_made_from(items, stacked, written=False):
    """Note that tensor ``stacked`` holds copies of tensors ``items``, where eager code would hold them or views
    of them (a stack of instances' tensors; rows gathered where each instance's index makes a view). With
    ``written``, ``stacked`` was just written into them (an in-place op run on a copy of each: ``batch_rules``):
    only a change after this one moves its version."""
    if not _noting(stacked):
        return
    # (a copy just written is held by no one but the backward that saved it, whose Python object dies: what is
    # kept is a detached view of it, one version counter with it)
    ref = _Kept(stacked.detach()) if written else weakref.ref(stacked)
    if written:
        _limits["kept"] += 1
        if _limits["kept"] > 128:  # (the entries of tensors gone, and the copies they kept, go)
            _prune()
            _limits["kept"] = 0
    for k, t in enumerate(items):
        start = t.storage_offset()
        entry = _copies_of(t)
        entry[1].append((ref, start, start + span(t), k, entry[0]()._version if written else None))


class _Kept:
    """A strong reference standing where ``MADE_FROM`` keeps weak ones."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


def note_rows_copied(source, index, rows):
    """Note that tensor ``rows`` holds copies of tensor ``source``'s rows at ``index`` (a LongTensor), where
    eager code would hold each instance's row itself (a branch's side reading its copy of an argument)."""
    if not _noting(rows) or source.dim() == 0:
        return
    start, step = source.storage_offset(), source.stride(0)
    row = 1 + sum((size - 1) * stride for size, stride in zip(source.shape[1:], source.stride()[1:])) \
        if source.numel() else 0
    _copies_of(source)[1].append((weakref.ref(rows), start, start + span(source), (start, step, row, index), None))


def note_taken(value, index, taken):
    """``note_rows_copied`` of batch ``taken``, taken from batch ``value``'s rows at ``index``, where it is a
    gathered copy of them (not a view, which shares their version)."""
    if type(value) is not Batch or type(taken) is not Batch or taken.owner != "tensor" or sharing.state.fresh:
        return
    source = rows_tensor(value)
    if source is not None and source.untyped_storage().data_ptr() != taken.tensor.untyped_storage().data_ptr():
        note_rows_copied(source, index, taken.tensor)


def _noting(stacked):
    """Whether copies made now are noted (a run that may change values in place, with a backward to raise in);
    prunes ``MADE_FROM`` as it grows."""
    if sharing.state.fresh or not torch.is_grad_enabled() or stacked.is_inference():
        return False
    if len(MADE_FROM) > _limits["made_from"]:
        _prune()
        _limits["made_from"] = max(4096, 2 * len(MADE_FROM))  # (what stays alive is pruned again once it doubles)
    return True


def _prune():
    """Drop the ``MADE_FROM`` entries of tensors gone, or whose copies are all gone."""
    for key, (base, stacks) in list(MADE_FROM.items()):
        if base() is None or all(s[0]() is None for s in stacks):
            del MADE_FROM[key]


def _copies_of(t):
    """The ``MADE_FROM`` entry of the tensor ``t`` views (its base, or itself), made where there is none."""
    base = t if t._base is None else t._base
    entry = MADE_FROM.get(id(base))
    if entry is None or entry[0]() is not base:
        entry = MADE_FROM[id(base)] = (weakref.ref(base), [])
    return entry


def after_in_place(target):
    """Batch or tensor ``target`` was changed in place by an op: the tensors joined from pieces and those made
    from its rows (``CACHES``, ``MADE_FROM``) follow."""
    if CACHES:
        caches_changed()
    t = target.tensor if type(target) is Batch and target.owner == "tensor" else target
    if MADE_FROM and isinstance(t, torch.Tensor):
        changed_in_place(t)


def changed_in_place(t):
    """Tensor ``t`` (an instance's own) was changed in place: move the version of every copy made of a tensor
    that overlaps it (``MADE_FROM``)."""
    base = t if t._base is None else t._base
    entry = MADE_FROM.get(id(base))
    if entry is None or entry[0]() is not base:
        return
    # (only what was made of the part of the base that t spans: another instance's row of one batch's tensor
    # is another tensor in eager code, with a version of its own)
    start = t.storage_offset()
    end = start + span(t)
    for ref, lo, hi, rows, version in entry[1]:
        stacked = ref()
        if stacked is None or not (lo < end and start < hi) or version == base._version:
            continue
        positions = [rows] if type(rows) is int else _rows_copied_over(rows, start, end)
        if positions != []:
            saved_versions.moved(stacked, positions)


def _rows_copied_over(rows, start, end):
    """The rows of a note's copy that copy storage ``start`` .. ``end`` of its source (None: all may): ``rows`` is
    (the source's offset, its rows' stride, what a row spans, the rows copied: a LongTensor)."""
    offset, step, row, index = rows
    if step <= 0:
        return None
    first = max(0, (start - offset - row) // step + 1)
    last = (end - 1 - offset) // step
    # (read here, where a change is, not where each copy is made)
    return [j for j, r in enumerate(index.tolist()) if first <= r <= last]


def span(t):
    """How many elements of storage tensor ``t`` spans from its first (1 past its last)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def _repeat(value, count):
    if type(value) is not torch.Tensor:
        return None
    return value.unsqueeze(0).expand(count, *value.shape)


def same_kind(tensors, skip):
    first = tensors[0]
    shape, dtype, device = first.shape[skip:], first.dtype, first.device
    for t in tensors:  # (a loop, not all(genexpr): it runs for every join and gathered input)
        # (each instance's own tensor, ``skip`` 0: its whole shape, read without slicing it)
        if t.dtype is not dtype or (t.shape[skip:] if skip else t.shape) != shape or t.device != device:
            return False
    return True


def tensor_like(b, dtype):
    """Batch ``b`` as a tensor, where Python numbers among its values become tensors of ``dtype`` (for an
    elementwise op with a tensor of that dtype, whose result then equals the per-instance one)."""
    t = tensor_of(b)
    if t is not None:
        return t
    if b.pieces is not None and b.items is None:
        t = _pieces_like(b, dtype)
        if t is not None:
            return t
    items = items_of(b)
    tensors = [x for x in items if type(x) is torch.Tensor]
    if not tensors:
        if not all(type(x) in NUMBERS for x in items) or not _number_fits(items, dtype):
            return None
        return torch.tensor(items, dtype=dtype)
    if not same_kind(tensors, 0) or tensors[0].dtype is not dtype:
        return None
    numbers = [x for x in items if type(x) is not torch.Tensor]
    if not all(type(x) in NUMBERS for x in numbers) or not _number_fits(numbers, dtype):
        return None
    shape, device = tensors[0].shape, tensors[0].device
    if shape:  # (a number beside vectors: as a row of their shape it would not broadcast as the number does)
        return None
    rows = [x if type(x) is torch.Tensor else torch.full(shape, x, dtype=dtype, device=device) for x in items]
    return torch.stack(rows)


def rows_beside(b, shape, dtype):
    """Batch ``b``, joined from pieces of tensors and Python numbers (``sum(hs)`` of an empty list is 0), as one
    tensor whose number pieces are full rows, for an elementwise op with an operand of per-instance ``shape``
    and ``dtype``: where the tensors' rows broadcast to that shape, a number's row gives each element what the
    number does. None otherwise."""
    if b.pieces is None or b.tensor is not None:
        return None
    like = _first_rows(b)
    if like is None or like.dtype is not dtype or torch.broadcast_shapes(tuple(shape), like.shape[1:]) != shape:
        return None
    return _joined_tensor(b.pieces, like, rows=True)


def _pieces_like(b, dtype):
    """tensor_like of a joined batch, piece by piece: a piece of one shared number becomes one full tensor."""
    like = _first_rows(b)
    if like is None or like.dtype is not dtype:
        return None
    return _joined_tensor(b.pieces, like)


def _first_rows(b):
    """The rows of the first piece of joined batch ``b`` that is a tensor (a shared one as one row), or None."""
    for v, _ in b.pieces[0]:
        t = tensor_of(v) if type(v) is Batch else v.unsqueeze(0) if type(v) is torch.Tensor else None
        if t is not None:
            return t
    return None


def _joined_tensor(pieces, like, rows=False):
    """The rows of joined ``pieces`` as one tensor in instance order; with a tensor ``like``, a piece of
    one shared Python number becomes rows of its dtype (``rows``: of its shape too, see ``rows_beside``)."""
    parts = []
    for v, count in pieces[0]:
        if like is not None and type(v) in NUMBERS:
            if not _number_fits([v], like.dtype) or like.dim() > 1 and not rows:  # (else beside 0-d tensors only)
                return None
            parts.append(torch.full((count, *like.shape[1:]), v, dtype=like.dtype, device=like.device))
            continue
        if like is not None and _numbers(v):  # (each instance's own Python number: ``v / w`` of numbers)
            # (not as half floats: a number rounded to one before the op gives what eager's, unrounded, does not)
            if not _number_fits(v.items, like.dtype) or like.dtype in (torch.float16, torch.bfloat16) or \
                    like.dim() > 1 and not rows:
                return None
            column = torch.tensor(v.items, dtype=like.dtype, device=like.device)
            parts.append(column.view(count, *(1,) * (like.dim() - 1)).expand(count, *like.shape[1:]))
            continue
        t = tensor_of(v) if type(v) is Batch else _repeat(v, count)
        if t is None:
            return None
        parts.append(t)
    if not same_kind(parts, 1):
        return None
    joined = torch.cat(parts)
    return joined.index_select(0, pieces[1].inverse(joined.device))


def written_through(value, changed):
    """Bring the rows of instances ``changed`` (a set of positions) of batch ``value``, joined from pieces (a
    branch's outputs) and then changed in place through one tensor of its rows (``value.tensor``: a write-back,
    an op run per instance), into the values the pieces hold for them: eager code changed those very tensors,
    which other names may hold too (``w = v if c else v * 1``), and a backward that saved one (``amin``'s
    result, ``exp``'s) raises, as eager's does."""
    rows = value.tensor
    for k, item in enumerate(pieces_items(value)):
        # (an inference tensor, made before the run, cannot be changed out of inference mode)
        if k in changed and isinstance(item, torch.Tensor) and item is not rows and \
                (torch.is_inference_mode_enabled() or not item.is_inference()):
            view = view_again(item)
            with saved_versions.writing(view):
                view.copy_(rows[k])


def view_again(t):
    """View ``t`` of a tensor made anew: a view made before an earlier copy into its base made the base need a
    gradient counts as a leaf, which autograd lets no one change in place."""
    base = t._base
    return t if base is None else base.as_strided(t.size(), t.stride(), t.storage_offset())


def pieces_items(b):
    """Each instance's own value of batch ``b`` joined from pieces: what its piece holds (nested joins too),
    not a view of one tensor joined from them (a cache)."""
    lists = [pieces_items(v) if type(v) is Batch and v.pieces is not None and v.owner != "tensor" else
             items_of(v) if type(v) is Batch else [v] * c for v, c in b.pieces[0]]
    return _gather_pieces(b, lists)


def _number_fits(numbers, dtype):
    """Whether Python numbers combine with a ``dtype`` tensor as tensors of that dtype would."""
    if dtype.is_floating_point or dtype.is_complex:
        return True
    if dtype is torch.bool:
        return all(type(x) is bool for x in numbers)
    return all(type(x) in (bool, int) for x in numbers)


# -- splitting and joining batches


def take(value, index, positions):
    """The sub-batch of instances ``positions`` (list; ``index`` the same as a LongTensor)."""
    if type(value) is not Batch:
        return value
    settle(value)
    if len(positions) == 1:
        return instance(value, positions[0])
    if _held_as_parts(value):
        kind, parts = value.struct
        return from_struct(kind, [take(p, index, positions) for p in parts], len(positions))
    if value.pieces is not None and sharing.state.fresh:
        for (piece, _), joined in zip(value.pieces[0], value.pieces[1].positions):
            if joined == positions:  # (the instances of one side it was joined from: ``if l >= 0`` then ``if r >= 0``)
                return piece
    t = rows_tensor(value)
    if t is not None:
        return Batch(len(positions), tensor=t.index_select(0, index_on(index, t)))
    items = items_of(value)
    if type(items) is not list and hasattr(items, "taken"):  # (``rows.Rows``: where they lie kept too)
        return from_items(items.taken(positions))
    return from_items([items[k] for k in positions])


def _held_as_parts(value):
    """Whether a struct's parts are its truth: always for a tuple's (its items, once made, a cache of them);
    a list's or dict's until each instance's object was made."""
    return value.struct is not None and (value.items is None or issubclass(value.struct[0], tuple))


def rows_tensor(value):
    """The one tensor of Batch ``value``'s rows that taking instances indexes: its tensor where that is its
    truth or an untouched cache, or its joined pieces as one tensor; None for items and structs."""
    settle(value)
    if value.owner == "tensor" or (value.tensor is not None and value.items is None and value.struct is None):
        return value.tensor
    if value.pieces is not None and value.items is None:
        return tensor_of(value)
    return None


def index_on(index, t):
    """LongTensor ``index`` on ``t``'s device."""
    return index if index.device == t.device else index.to(t.device)


def part(value, start, count):
    """Instances start .. start+count-1, for the request that asked for them."""
    if type(value) is not Batch:
        return value
    if count == value.n:
        return value
    if value.owner == "tensor":  # (the common case first: rows of one tensor)
        t = value.tensor
        return t[start] if count == 1 else Batch(count, tensor=t[start:start + count])
    if count > 1 and is_lazy(value):  # (one instance's value is plain: it must be computed)
        return Batch(count, thunk=_LazyPart(value, start, count))
    settle(value)
    t = value.tensor if value.owner == "tensor" else None
    if t is None and value.items is None:
        if value.struct is not None:
            kind, parts = value.struct
            if count == 1:
                return build(kind, [part(p, start, 1) for p in parts])
            return from_struct(kind, [part(p, start, count) for p in parts], count)
        t = tensor_of(value)
    if t is not None:
        return t[start] if count == 1 else Batch(count, tensor=t[start:start + count])
    items = items_of(value)
    if count > 1 and type(items) is not list and hasattr(items, "taken"):
        return from_items(items.taken(range(start, start + count)))
    return items[start] if count == 1 else from_items(items[start:start + count])


def cut(value, counts, split=True):
    """``value``'s instances cut into consecutive runs of ``counts``, one per request a frame served.
    A tensor is cut by one ``split``, whose gradient is one ``cat``: a slice per request would each
    make a gradient the size of the whole tensor in the backward pass. ``split=False`` cuts by slices,
    which autograd lets a program change in place (a split's pieces it does not)."""
    if type(value) is not Batch:
        return [value] * len(counts)
    if split and not is_lazy(value):
        # (where the run changes nothing in place, a list or dict built in the program stays a struct too: no
        # instance's object is made until one is needed, and each is then made once, by the part that holds it)
        t = value.tensor if value.owner == "tensor" else None
        if t is None and value.items is None and value.struct is None:
            t = tensor_of(value)
        if t is not None:
            return [p[0] if c == 1 else Batch(c, tensor=p) for p, c in zip(t.split_with_sizes(counts), counts)]
        if _held_as_parts(value):
            kind, parts = value.struct
            rows = zip(*[cut(p, counts, split) for p in parts]) if parts else [()] * len(counts)
            return [build(kind, row) if c == 1 else from_struct(kind, list(row), c) for row, c in zip(rows, counts)]
    out, start = [], 0
    for c in counts:
        out.append(part(value, start, c))
        start += c
    return out


def cut_result(value, counts, several, split=True):
    """A frame's result cut for the requests it served: ``cut`` of the value, or with ``several`` outputs
    one tuple of their parts per request."""
    if not several:
        return cut(value, counts, split)
    return list(zip(*[cut(v, counts, split) for v in value]))


def concat_args(requests):
    """The arguments of a frame serving ``requests`` [(args, count)]: each position's values concatenated."""
    return tuple(concat([(a[j], c) for a, c in requests]) for j in range(len(requests[0][0])))


def concat(parts):
    """One batch of the instances of ``parts`` [(value, count)], in order: a frame's inputs gathered from
    the requests it serves, copied into one tensor once, at entry."""
    first = parts[0][0]
    if len(parts) == 1:
        return ready(first)
    if type(first) is not Batch and all(v is first for v, _ in parts):
        return first  # one value every instance shares (a batch passed twice is two runs of rows)
    for v, _ in parts:
        settle(v)
    n = sum(c for _, c in parts)
    tensors = []
    for v, c in parts:
        if type(v) is Batch:
            t = v.tensor if v.owner == "tensor" else None
            if t is None:
                break
        elif type(v) is torch.Tensor:
            t = v.unsqueeze(0) if c == 1 else _repeat(v, c)
        else:
            break
        tensors.append(t)
    else:
        if same_kind(tensors, 1):
            return Batch(n, tensor=torch.cat(tensors))
    kinds = {_struct_kind(v) for v, _ in parts}
    if len(kinds) == 1 and None not in kinds:
        kind, size = kinds.pop()
        columns = [[(_element(v, j), c) for v, c in parts] for j in range(size)]
        return from_struct(kind, [concat(col) for col in columns], n)
    items = []
    for v, c in parts:
        items.extend(items_of(v) if type(v) is Batch else [v] * c)
    return from_items(items)


def _struct_kind(value):
    if type(value) is Batch:
        return (value.struct[0], len(value.struct[1])) if value.struct is not None else None
    if type(value) is tuple or isinstance(value, tuple) and plain_namedtuple(type(value)):
        return (type(value), len(value))  # (a tuple or a namedtuple; not a list: each instance's must stay its own)
    return None


def _element(value, j):
    return value.struct[1][j] if type(value) is Batch else value[j]


class Order:
    """Where the instances of joined sides go: side after side, the positions of its instances. Indexing
    the sides' rows, concatenated, by ``inverse`` puts them in instance order. Made once per Cond (or
    loop), for all the values it joins; with each side's positions also as a LongTensor (a Cond on a
    tensor predicate has them), the inverse is computed on the device instead of built from a list."""

    __slots__ = ("n", "positions", "indexes", "_order", "_inverse")

    def __init__(self, n, sides_positions, indexes=None):
        self.n = n
        self.positions = sides_positions
        self.indexes = indexes
        self._order = None
        self._inverse = {}

    @property
    def order(self):
        """The positions of the joined rows, side after side, as one list."""
        if self._order is None:
            self._order = [k for positions in self.positions for k in positions]
        return self._order

    def inverse(self, device):
        t = self._inverse.get(device)
        if t is None:
            if self.indexes is not None:
                t = torch.argsort(torch.cat(self.indexes).to(device))
            else:
                inverse = [0] * self.n
                for at, k in enumerate(self.order):
                    inverse[k] = at
                t = torch.tensor(inverse, device=device)
            self._inverse[device] = t
        return t


def join(n, sides, order=None):
    """The batch of n instances whose values come from ``sides`` [(value, positions)]: the branches of a
    Cond, or the instances that left a loop at different iterations."""
    first = sides[0][0]
    if len(sides) == 1 or all(v is first for v, _ in sides):
        return first
    if order is None:
        order = Order(n, [p for _, p in sides])
    kinds = {_joined_kind(v) for v, _ in sides}
    if len(kinds) == 1 and None not in kinds:  # (tuples; dicts and lists where nothing changes them)
        kind, size = kinds.pop()
        items = [(_joined_items(v), p) for v, p in sides]
        return from_struct(kind, [join(n, [(each[j], p) for each, p in items], order) for j in range(size)], n)
    joined = Batch(n, pieces=([(v, len(p)) for v, p in sides], order))
    if all(type(v) in NUMBERS or _numbers(v) for v, _ in sides):
        # (``i += 1`` on one side: Python numbers, which nothing changes in place, are each instance's at once,
        # so that the ops of ints and indices read them as such: ``xs[i]``, ``i + 1``)
        return Batch(n, items=items_of(joined))
    return joined


def _numbers(value):
    return type(value) is Batch and value.owner == "items" and value.thunk is None and all(
        type(v) in NUMBERS for v in value.items)


def _joined_kind(value):
    """``_struct_kind`` for ``join``: in a run that changes nothing in place (``sharing.state.fresh``) a dict or
    list the program built too (one instance's plain dict by its keys), whose objects no change can tell
    apart; elsewhere each instance's object must stay the one its side made."""
    kind = _struct_kind(value)
    if kind is not None and issubclass(kind[0], tuple):
        return kind
    if not sharing.state.fresh:
        return None
    if type(value) is dict and all(type(k) is str for k in value):
        return dict_kind(tuple(value)), len(value)
    if _values_alone(type(value)):  # (one instance's plain dataclass: its fields)
        return type(value), len(type(value).__match_args__)
    return kind


def _joined_items(value):
    """A joined struct's items: a Batch's parts, a tuple's items, a dict's values, a dataclass's fields."""
    if type(value) is Batch:
        return value.struct[1]
    if type(value) is dict:
        return list(value.values())
    return [getattr(value, name) for name in type(value).__match_args__] if plain_dataclass(type(value)) else value


def _gather_pieces(b, lists):
    flat = [x for part in lists for x in part]
    out = [None] * b.n
    for at, k in enumerate(b.pieces[1].order):
        out[k] = flat[at]
    return out


def _kinds(items):
    """What per-instance results were, for an error: tensors by shape and dtype, other values by type."""
    kinds = {f"Tensor{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}" if isinstance(x, torch.Tensor)
             else type(x).__name__ for x in items}
    shown = sorted(kinds)
    return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")


def stack_output(value, n):
    """A batched result as torch.func.vmap returns it: tensors stacked along dim 0, a tuple or list of
    them as a tuple or list of stacked tensors, a dict of them as a dict."""
    if type(value) is Batch:
        ready(value)
        if value.struct is not None and value.owner is None:
            kind, parts = value.struct
            return build(kind, [stack_output(p, n) for p in parts])
        t = tensor_of(value)
        if t is not None:
            return t
        items = items_of(value)
        if all(isinstance(x, (tuple, list)) for x in items) and len({(type(x), len(x)) for x in items}) == 1:
            kind = type(items[0])
            return build(kind, [stack_output(from_items([x[j] for x in items]), n) for j in range(len(items[0]))])
        raise ValueError("recompile.vmap: the function must return tensors (or tuples, lists or dicts of tensors) "
                         f"of one shape and dtype for every instance; got {_kinds(items)}")
    if type(value) in PLAIN_TENSORS:
        return value.unsqueeze(0).expand(n, *value.shape)
    if isinstance(value, (tuple, list)):
        return build(type(value), [stack_output(v, n) for v in value])
    raise ValueError(f"recompile.vmap: the function must return tensors, got {type(value).__name__}")
