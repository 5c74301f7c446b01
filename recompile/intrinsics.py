"""Python's semantics as the callables the IR holds.

Each is what a piece of syntax does in plain Python (building a tuple,
unpacking, raising, reading a global), written as a callable so that the IR
can hold it as a ``Call``. Every stage knows them: the frontend emits them,
passes and emitters recognise them, generated code calls them. They import
nothing of recompile's.
"""

from __future__ import annotations

import builtins
import operator
import sys
import types
import weakref
from itertools import chain

import torch
from torch import nn


class Marker:
    """A constant of the IR's own, printed by its name."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class _Undefined(Marker):
    """The value of a variable that is not bound on this path (e.g. a loop target after zero iterations)."""

    __slots__ = ()

    def __bool__(self):
        raise UnboundLocalError("an unbound variable was used")


UNDEFINED = _Undefined("UNDEFINED")


def check_bound(value, name, free=False):
    """``value`` of variable ``name`` where it is bound; Python's error where not (``free``: a variable of the
    enclosing function, which a nested def lifted out reads as a parameter: ``frontend.lifting``)."""
    if value is UNDEFINED:
        if free:
            raise NameError(f"cannot access free variable '{name}' where it is not associated with a value in "
                            "enclosing scope")
        raise UnboundLocalError(f"cannot access local variable '{name}' where it is not associated with a value")
    return value


def as_sequence(obj):
    """What a ``for`` loop iterates, made indexable: sequences and tensors as they are, other iterables
    wrapped so that items are drawn from the iterator only as the loop reaches them."""
    kind = type(obj)
    if kind in _INDEXABLE or kind is ReversedSequence:
        return obj
    if isinstance(obj, torch.Tensor) and kind.__iter__ is torch.Tensor.__iter__:
        if obj.dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        return obj.unbind(0)  # what Tensor.__iter__ iterates: views of the rows
    return DrawnSequence(iter(obj))


# exactly these types iterate as their indexing says; subclasses may define __iter__ otherwise
_INDEXABLE = (list, tuple, range, str, nn.ModuleList, nn.Sequential)  # (a ModuleList indexes as the list it holds)


class DrawnSequence:
    """The items of an iterator, drawn as a lowered ``for`` reaches them: ``has(i)`` draws item i
    (i = 0, 1, 2, ... in turn) and ``[i]`` reads it. Only the current item is kept, so a loop
    over a stream holds one item at a time, as Python's does."""

    __slots__ = ("_it", "_index", "_item")

    def __init__(self, iterator):
        self._it = iterator
        self._index = -1
        self._item = None

    def has(self, i):
        while self._index < i:
            try:
                self._item = next(self._it)
            except StopIteration:
                self._item = None
                return False
            self._index += 1
        return True

    def __getitem__(self, i):
        return self._item


class ReversedSequence:
    """The items of a list, tuple, str, range or module list from its end, as ``reversed`` gives them to a lowered
    ``for``: item i is ``seq[start - i]``, ``start`` the sequence's last index when the loop began, there while that
    index lies in the sequence (as a list's reverse iterator reads it). A view of the sequence: every instance of a
    batch that shares the sequence shares it, and reads each item once for all."""

    __slots__ = ("seq", "start")

    def __init__(self, seq):
        self.seq = seq
        self.start = len(seq) - 1

    def has(self, i):
        j = self.start - i
        return 0 <= j < len(self.seq)

    def __getitem__(self, i):
        return self.seq[self.start - i]


def reversed_sequence(seq):
    """What ``for x in reversed(seq)`` iterates: a ``ReversedSequence`` of a list, tuple, str, range or module list;
    of anything else what ``reversed`` gives (a tensor's rows flipped, a dict's keys from the last)."""
    out = reversed(seq)  # (Python's own errors: a set or an iterator is no sequence)
    return ReversedSequence(seq) if type(seq) in _INDEXABLE else out


def builtin_read(value, ident):
    """``value``, the name ``ident`` read where the frontend wrote a loop over Python's builtin of that name as an
    index loop (``for i, x in enumerate(xs)``), or gave it a list for a generator (``sum(h for h in hs)``): an
    error if the name now stands for something else (the module's own, bound after the function was compiled),
    which the compiled code does not call as written."""
    if value is not getattr(builtins, ident):
        raise RuntimeError(
            f"recompile: {ident}(...) was compiled as Python's builtin {ident} (a for over it as an index loop, "
            f"a generator given to it as a list), but {ident} now names {value!r} (bound after the function was "
            f"compiled); compile the function again (recompile.function) once {ident} is bound, or give that "
            f"{ident} another name")
    return value


def has_index(seq, i):
    """The test of a lowered ``for``: is there an item at position i? (A list's length is read each
    time, so items appended during the loop are visited, as in Python.)"""
    kind = type(seq)
    if kind is DrawnSequence or kind is ReversedSequence:
        return seq.has(i)
    if kind is range:  # len() of a range beyond sys.maxsize overflows; indexing does not
        try:
            seq[i]
        except IndexError:
            return False
        return True
    return i < len(seq)


def unpack_starred(value, before, after):
    """``a, *rest, z = value``: value's items as a tuple whose element ``before`` is the list of the items
    between the first ``before`` and the last ``after``, ready to unpack."""
    try:
        items = list(value)
    except TypeError:
        if getattr(type(value), "__iter__", None) is None and getattr(type(value), "__getitem__", None) is None:
            raise TypeError(f"cannot unpack non-iterable {type(value).__name__} object") from None
        raise
    if len(items) < before + after:
        raise ValueError(f"not enough values to unpack (expected at least {before + after}, got {len(items)})")
    end = len(items) - after
    return (*items[:before], items[before:end], *items[end:])


def build_tuple(*items):
    return items


def build_list(*items):
    return list(items)


def build_set(*items):
    return set(items)


# A list made for one recursive call to fill (``passes.accumulate``) starts with FILLED: ``hand_back`` then puts
# the call's own list into it as one item, which its caller appends to its own as one item, so that each call
# costs its own items, not its subtree's; the list a call not so made is handed gets the items themselves.
FILLED = type("Filled", (), {"__repr__": lambda self: "FILLED", "__slots__": ()})()


def hand_back(target, own):
    """The end of a call of a function rewritten by ``passes.accumulate``: the items of ``own`` (the lists of
    the calls it made, held in it as they are, read in their place) added to the list ``target`` it was
    handed; or ``own`` itself, where ``target`` was made for this call (``FILLED``)."""
    if type(target) is list and target and target[0] is FILLED:
        target.append(own)
        return
    items, pending = [], [iter(own)]
    while pending:  # (depth first, by a stack of iterators: a deep recursion's lists nest deep)
        for item in pending[-1]:
            if type(item) is list and item and item[0] is FILLED:
                pending.append(chain.from_iterable(item[1:]))  # (the own list its call handed back)
                break
            items.append(item)
        else:
            pending.pop()
    if type(target) is list:
        target.extend(items)
    else:  # (a list of the user's class, or another collector: its own append, item by item, in Python's order)
        for item in items:
            target.append(item)


def _as_in_place(result, x):
    """Whether ``result``, an op's out-of-place result for tensor ``x``, is what its in-place form would leave in
    ``x``: a tensor of ``x``'s dtype and shape (else the in-place op casts, or raises)."""
    return isinstance(result, torch.Tensor) and result.dtype == x.dtype and result.shape == x.shape


def _augmented_fresh(in_place, out_of_place, name):
    """``x op= y`` where only this frame holds ``x``'s object (``passes.fresh``): for a tensor, ``x op y``, a new
    tensor where it has ``x``'s dtype and shape (what the in-place op would give), else the in-place op on a
    copy (it casts, or raises, as eager's); a list copied, then changed; anything else Python's in-place op
    (an immutable number makes a new one). ``x`` itself is never changed, so a value computed once for every
    instance may be read by each."""

    def augmented(x, y):
        if isinstance(x, torch.Tensor):
            result = out_of_place(x, y)
            return result if _as_in_place(result, x) else in_place(x.clone(), y)
        if type(x) is list:
            return in_place(list(x), y)
        return in_place(x, y)

    augmented.__name__ = augmented.__qualname__ = name
    augmented.in_place, augmented.out_of_place = in_place, out_of_place
    return augmented


iadd_fresh = _augmented_fresh(operator.iadd, operator.add, "iadd_fresh")
isub_fresh = _augmented_fresh(operator.isub, operator.sub, "isub_fresh")
imul_fresh = _augmented_fresh(operator.imul, operator.mul, "imul_fresh")
itruediv_fresh = _augmented_fresh(operator.itruediv, operator.truediv, "itruediv_fresh")
AUGMENTED_FRESH = {f.in_place: f for f in (iadd_fresh, isub_fresh, imul_fresh, itruediv_fresh)}


def _method_fresh(name, function=False):
    """``x.name_(...)`` (with ``function``: ``torch.name_(x, ...)``) where only this frame holds ``x``'s object
    (``passes.fresh``): for a tensor, ``x.name(...)``, a new tensor where it has ``x``'s dtype and shape (what the
    in-place op gives: an int tensor's ``sigmoid`` is a float one), else the in-place op on a copy (it casts, or
    raises, as eager's); anything else the in-place op (a number has no such method, and torch's function takes
    none: each raises as eager's). ``x`` itself is never changed."""
    in_place = name + "_"

    def fresh(x, *args, **kwargs):
        if isinstance(x, torch.Tensor):
            result = getattr(x, name)(*args, **kwargs)
            if _as_in_place(result, x):
                return result
            x = x.clone()
        return getattr(torch, in_place)(x, *args, **kwargs) if function else getattr(x, in_place)(*args, **kwargs)

    fresh.__name__ = fresh.__qualname__ = ("torch_" if function else "") + f"{name}_fresh"
    fresh.in_place, fresh.method = in_place, name
    return fresh


_FRESH_NAMES = ("relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "clamp")
# Tensor methods changing their tensor elementwise (by in-place name), and torch's functions doing so (by the
# function), as ``passes.fresh`` writes them out of place
METHODS_FRESH = {name + "_": _method_fresh(name) for name in _FRESH_NAMES}
FUNCTIONS_FRESH = {getattr(torch, name + "_"): _method_fresh(name, function=True) for name in _FRESH_NAMES}
OUT_OF_PLACE = (*METHODS_FRESH.values(), *FUNCTIONS_FRESH.values())


def fill_fresh(x, value):
    """``x.fill_(value)`` where only this frame holds ``x`` (``passes.fresh``): for a tensor, ``torch.fill``, a new
    tensor of ``x``'s dtype and shape (a gradient reaches a tensor ``value``, none ``x``); anything else the
    in-place op, which raises as eager's."""
    if not isinstance(x, torch.Tensor):
        return x.fill_(value)
    if isinstance(value, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
        value = value.detach()  # (an integer tensor takes no gradient: torch.fill would refuse one that needs it)
    return torch.fill(x, value)


def zero_fresh(x):
    """``x.zero_()`` where only this frame holds ``x`` (``passes.fresh``): ``torch.fill`` of a tensor with 0, whose
    gradient (none) reaches ``x`` as the in-place op's does."""
    return torch.fill(x, 0) if isinstance(x, torch.Tensor) else x.zero_()


def requires_grad_fresh(x):
    """``x.requires_grad_()`` where only this frame holds ``x`` (``passes.fresh``): the flag set on the very object,
    as eager's (its errors eager's); no value changes, and no one else sees it."""
    return x.requires_grad_()


fill_fresh.in_place, zero_fresh.in_place, requires_grad_fresh.in_place = "fill_", "zero_", "requires_grad_"
# In-place Tensor methods that set what a tensor only its frame holds is (by in-place name): fill and zero make a
# new tensor (``SETS_FRESH``), requires_grad_ hands on the tensor itself
SETTERS_FRESH = {f.in_place: f for f in (fill_fresh, zero_fresh, requires_grad_fresh)}
SETS_FRESH = (fill_fresh, zero_fresh)


def setitem_fresh(x, index, value):
    """``x[index] = value`` where only this frame holds ``x`` and nothing but the write reads it (``passes.fresh``):
    for a tensor, a copy of ``x`` so written (cast and refused as eager's write is), which the ops after it read
    for ``x``: a value computed once for every instance may be read by each. A copy this made before (``out[t]
    = h`` step after step, ``owned``) is written in place and handed on, as eager's buffer is: no copy of the
    whole buffer per write (a derived gradient takes the result's cotangent before it gives the buffer's).
    Anything else is written itself (its errors eager's)."""
    if not isinstance(x, torch.Tensor):
        x[index] = value
        return x
    if not owned(x):
        x = x.clone()
        x[index] = value
        own(x)
        return x
    x[index] = value
    return x


# The results ``setitem_fresh`` and its batch rule made, by the memory they view (weak references: one gone
# frees its entry): each read by nothing but the next write of its buffer (``passes.fresh``), which may change
# it in place, through that very memory (a loop's steps run ahead hand one instance's value on as a view of
# it). A batch's rows of such a value may be each instance's own copy of a value computed once, expanded:
# ``batch_rules.per_instance`` copies them before this sees them
_OWNED = {}


def _footprint(t):
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def owned(t):
    """Whether tensor ``t`` views just the memory of a result ``setitem_fresh`` (or its batch rule: ``own``)
    made (not an empty one: every empty tensor's memory is at 0)."""
    if not t.numel():
        return False
    ref = _OWNED.get(_footprint(t))
    return ref is not None and ref() is not None


def own(t):
    """Note tensor ``t`` as a result only a buffer's next write reads (``setitem_fresh``)."""
    key = _footprint(t)
    _OWNED[key] = weakref.ref(t, lambda ref: _OWNED.get(key) is ref and _OWNED.pop(key, None))


MERGE = Marker("MERGE")  # marks ``**mapping`` among the keys given to build_dict


def build_dict(*items):
    """``{k: v, **m}`` from alternating keys and values; the key MERGE merges the mapping after it."""
    out = {}
    for i in range(0, len(items), 2):
        k, v = items[i], items[i + 1]
        if k is MERGE:
            out.update(v)
        else:
            out[k] = v
    return out


def frame_locals(*items):
    """``locals()`` from alternating names and values: the names bound at that point (UNDEFINED: not bound on
    the path taken), in the order Python lists them."""
    return {items[i]: items[i + 1] for i in range(0, len(items), 2) if items[i + 1] is not UNDEFINED}


def unpack(value, n):
    """``a, b = value``: generated code unpacks the result; this keeps the op explicit in the IR."""
    return value


def raise_exception(exc=None, cause=None, has_cause=False):
    if exc is None:
        raise  # re-raise the exception being handled, as a bare raise does (RuntimeError if none)
    if has_cause:
        raise exc from cause
    raise exc


def format_value(value, conversion, spec):
    if conversion == 115:  # !s
        value = str(value)
    elif conversion == 114:  # !r
        value = repr(value)
    elif conversion == 97:  # !a
        value = ascii(value)
    return format(value, spec)


def join_str(*parts):
    return "".join(parts)


def read_global(namespace, name):
    """A global read: the module's globals, then builtins, else NameError, as in Python."""
    if name in namespace:
        return namespace[name]
    try:
        return getattr(builtins, name)
    except AttributeError:
        raise NameError(f"name '{name}' is not defined") from None


def import_module(namespace, name, level, fromlist):
    """An ``import`` statement's module: Python's ``__import__`` from the function's own module (its package
    for a relative import), the top package of ``import a.b``, the module itself for ``from a.b import x``."""
    return builtins.__import__(name, namespace, None, fromlist, level)


def import_from(module, name):
    """``from module import name`` (and ``import a.b as c``'s step to b): the attribute, else the submodule of
    that name, else Python's ImportError."""
    try:
        return getattr(module, name)
    except AttributeError:
        pass
    package = getattr(module, "__name__", "<unknown module name>")
    if f"{package}.{name}" in sys.modules:
        return sys.modules[f"{package}.{name}"]
    path = getattr(module, "__file__", None)
    raise ImportError(f"cannot import name {name!r} from {package!r} ({path or 'unknown location'})", name=package,
                      path=path)


def read_cell(cell, name):
    try:
        return cell.cell_contents
    except ValueError:
        raise NameError(f"cannot access free variable '{name}' where it is not associated with a value "
                        "in enclosing scope") from None


def new_cell():
    """The cell of a variable that a nested function, lambda or generator expression uses (empty: unbound)."""
    return types.CellType()


def fixed_cell(value):
    """The cell of a parameter that a nested scope uses and nothing rebinds."""
    return types.CellType(value)


def set_cell(cell, value):
    cell.cell_contents = value


def read_local_cell(cell, name):
    try:
        return cell.cell_contents
    except ValueError:
        raise UnboundLocalError(f"cannot access local variable '{name}' where it is not associated with a value") \
            from None


def cell_or_undefined(cell):
    """A cell's value, or UNDEFINED where it holds none (``locals()`` leaves such a variable out)."""
    try:
        return cell.cell_contents
    except ValueError:
        return UNDEFINED


def delete_cell(cell, name, free):
    """``del name`` of a variable kept in a cell (``free``: the enclosing function's, by ``nonlocal``)."""
    if free:
        read_cell(cell, name)
    else:
        read_local_cell(cell, name)
    del cell.cell_contents


def write_global(namespace, name, value):
    namespace[name] = value


def delete_global(namespace, name):
    try:
        del namespace[name]
    except KeyError:
        raise NameError(f"name '{name}' is not defined") from None


def make_function(code, namespace, defaults, kwdefaults, annotations, *cells):
    """A nested function, lambda or generator expression's function, as Python makes it where it is defined:
    its code, the module's globals, its defaults and the cells of the variables it shares."""
    fn = types.FunctionType(code, namespace, code.co_name, defaults, cells)
    if kwdefaults is not None:
        fn.__kwdefaults__ = kwdefaults
    if annotations is not None:
        fn.__annotations__ = annotations
    return fn


def finds_in_class(obj, cls, name):
    """Whether ``obj.name`` is the attribute ``name`` of class ``cls`` itself: obj is exactly a cls
    and has no instance attribute of that name."""
    return type(obj) is cls and name not in getattr(obj, "__dict__", ())


def not_in(a, b):
    return a not in b


class CompiledCall:
    """A call of a compiled function that a level program runs as a helper (``passes.levels``): ``target``, the
    compiled function's handle (its owner class with it). Called for one instance, it is the function's call;
    for a batch, ``runtime.helpers`` runs the function's own program (traced into the level's pieces, or one
    batched run)."""

    __slots__ = ("target",)

    def __init__(self, target):
        self.target = target

    def __call__(self, *args, **kwargs):
        return self.target.function(*args, **kwargs)

    def __repr__(self):
        return f"<compiled call of {self.target.qualname}>"
