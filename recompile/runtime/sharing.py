"""What the instances of a batched run may share: values computed once, and each instance's own copies.

In a run that changes nothing in place (``passes.effects``: the called function and all it invokes), the
result of a torch op none of whose inputs differ between instances is computed once and shared by them all
(``batch_rules.computes_alike``), as ``torch.func.vmap`` computes an unmapped value once. Such tensors are
noted (``mark_fresh``), and Python code run for one instance alone (an undecorated helper, which may change
what it is given) gets a copy of its own (``own``), so that a change it makes stays that instance's.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import warnings
import weakref

import torch

from ..errors import SharedChangeWarning
from ..ops import facts


class State(threading.local):
    """Per thread: ``fresh``, whether the run going on changes nothing in place (set by ``runtime.agenda``);
    ``never``, whether runs started now share nothing whatever they change (``unshared``)."""

    def __init__(self):
        self.fresh = False
        self.never = False


state = State()


@contextlib.contextmanager
def unshared(when=True):
    """Runs started inside (a helper's, called from a run that changes values in place) share nothing computed
    once: their results may be changed in place by the run that called them."""
    saved = state.never
    state.never = state.never or when
    try:
        yield
    finally:
        state.never = saved


def shareable_result(value):
    """A result every instance may hold as one object: a tensor, a value no call changes, a tuple of them."""
    if type(value) is tuple:
        return all(shareable_result(v) for v in value)
    return isinstance(value, torch.Tensor) or facts.immutable(value)


_fresh = {}  # id -> (weak reference, mark) of each tensor computed once (tensors compare elementwise: no WeakSet)
_marks = itertools.count(1)  # (each mark's number: a run's own marks are those after its start, ``marks_now``)


def _is_fresh(value, since=0):
    entry = _fresh.get(id(value))
    return entry is not None and entry[0]() is value and entry[1] > since


def mark_fresh(value):
    """Note a shared result of a torch op computed once: a tensor, or the tensors of a tuple."""
    if isinstance(value, torch.Tensor):
        key = id(value)
        entry = _fresh.get(key)
        ref = entry[0] if entry is not None and entry[0]() is value else \
            weakref.ref(value, lambda ref, key=key: (_fresh.get(key) or (None,))[0] is ref and _fresh.pop(key))
        _fresh[key] = (ref, next(_marks))
    elif type(value) is tuple:
        for v in value:
            mark_fresh(v)
    return value


def marks_now():
    """A number below every mark made from now on: ``own_results(..., since=marks_now())`` taken at a run's start
    reads that run's marks alone (a tensor an earlier run computed once may be one the caller holds by now)."""
    return next(_marks)


def handed_back(result, fn, args):
    """Whether ``fn(*args)`` gave back what it was given, or a view of memory it was given that was not computed
    once (``W.contiguous()``, ``W.view(-1)``, ``W.detach()``, ``max(a, b)``): no new value, but what the caller
    holds, which each instance's call hands back as it is."""
    receiver = getattr(fn, "__self__", None)
    if result is receiver or any(result is a for a in args):
        return True
    if type(result) not in (torch.Tensor, torch.nn.Parameter) or result.layout is not torch.strided:
        return False
    place = result.untyped_storage().data_ptr()
    return any(isinstance(t, torch.Tensor) and t.layout is torch.strided and not _is_fresh(t)
               and t.untyped_storage().data_ptr() == place for t in (receiver, *args))


def any_fresh(values):
    """Whether one of ``values`` is a tensor computed once for every instance."""
    if not _fresh:
        return False
    for a in values:
        if isinstance(a, torch.Tensor) and _is_fresh(a):
            return True
    return False


def own(value):
    """``value`` as one instance gets it for Python code run for it alone: a copy of a tensor computed once
    for every instance (``mark_fresh``), so that a change in place stays that instance's."""
    if _fresh and isinstance(value, torch.Tensor) and _is_fresh(value):
        return value.clone()
    return value


def own_results(results, since):
    """Each instance's result as its own call returns it: a tensor the run computed once for every instance
    (``mark_fresh``, after mark ``since``) is the first holder's, and each later one's a copy of its own, as each
    Python call makes its own ``torch.zeros(3)``; a tuple, list or dict holding one is rebuilt around the copies.
    An instance's own aliasing stays: ``return z, [z]`` hands back one copy twice."""
    if not _fresh:
        return results
    held = set()  # (ids of the tensors computed once that an earlier instance holds)
    return [_own_result(r, since, held, {}) for r in results]


def _own_result(value, since, held, copies):
    key = id(value)
    found = copies.get(key)
    if found is not None:
        return found[1]
    if isinstance(value, torch.Tensor):
        mine = value
        if _is_fresh(value, since) and key in held:
            mine = value.clone()
        elif _is_fresh(value, since):
            held.add(key)
    elif isinstance(value, (tuple, list, dict)):
        pairs = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        items = [(k, _own_result(v, since, held, copies)) for k, v in pairs]
        mine = value if all(a is b for (_, a), (_, b) in zip(items, pairs)) else _rebuilt(value, items)
    else:
        return value
    copies[key] = (value, mine)  # (the value too: its id stays its own while this instance's walk goes on)
    return mine


def _rebuilt(value, items):
    """``value``, a tuple, list or dict, of its type again, holding ``items`` ((key, item) pairs); ``value`` itself
    where its type cannot be made so."""
    try:
        if isinstance(value, tuple):
            return type(value)(*[v for _, v in items]) if hasattr(value, "_fields") else \
                type(value)([v for _, v in items])
        mine = copy.copy(value)  # (a subclass's own type and state: a defaultdict's factory)
        if isinstance(value, list):
            mine[:] = [v for _, v in items]
        else:
            mine.update(items)
        return mine
    except TypeError:
        return value


def call_owning(fn, args, kwargs=None):
    """``fn(*args, **kwargs)`` for one instance, each tensor computed once for every instance given as a copy of
    its own (``own``). A copy the call changes in place and does not hand back is warned of (once per helper):
    the code after the call reads the value every instance shares, which eager code would see changed."""
    copies = []

    def owned(value):
        mine = own(value)
        if mine is not value and not mine.is_inference():  # (an inference tensor keeps no version to compare)
            copies.append((mine, mine._version))
        return mine

    out = fn(*[owned(a) for a in args], **{k: owned(v) for k, v in (kwargs or {}).items()})
    for mine, at in copies:
        if mine._version != at and not _hands_back(out, mine):
            warnings.warn(
                f"recompile: {getattr(fn, '__qualname__', fn)!s} changed in place a tensor of shape "
                f"{tuple(mine.shape)} computed once for every instance of the batch; each instance's call changed "
                "its own copy, and code after the call that reads the tensor reads the unchanged one, where eager "
                "code reads the changed one. The run could not tell when it started that the function changes "
                "what it is given: call it by the name of a global function or of a method of self's class (not "
                "a value read at run time), one that @recompile.function compiles; or change a copy "
                "(z = z + 1)", SharedChangeWarning, stacklevel=2)
            break
    return out


def _hands_back(out, t, depth=0):
    """Whether result ``out`` is ``t``, a view of it, or a tuple, list or dict holding one."""
    if isinstance(out, torch.Tensor):
        return out is t or out._base is t or (t._base is not None and out._base is t._base)
    if depth < 4 and isinstance(out, (tuple, list)):
        return any(_hands_back(o, t, depth + 1) for o in out)
    if depth < 4 and isinstance(out, dict):
        return any(_hands_back(o, t, depth + 1) for o in out.values())
    return False
