"""Undecorated helpers of per-instance values, compiled for the whole group instead of run once per instance.

A plain function of the user's own code (``def node_loss(self, h, label)`` left undecorated), called from a
batched run with values that differ between instances, would otherwise run once per instance: Python sees one
instance at a time. On its first such call it is compiled as ``@recompile.function`` compiles it, and each call
then runs it once for every instance of the group (``CompiledFunction.run_batched``), as ``torch.func.vmap``
traces through whatever a function calls. Its values, gradients, effects and errors are the plain call's.

Compiled: functions (and methods, bound to their object) whose code lies outside the standard library, the
installed packages and recompile itself, defined at module or class level (not closures, lambdas or the
functions the compiler makes of a ``with`` or ``try``), neither generators nor coroutines, with no ``*args``,
``**kwargs`` or keyword-only parameters. Run for the group only where it changes nothing in place (neither it
nor what it invokes: ``passes.effects``): a helper appending to a list, setting an attribute or adding into a
tensor keeps running once per instance, so that each instance's changes come before the next one's reads, as
in plain Python. So does a function the compiler refuses (a construct it does not compile); the warning then
says why. ``config.COMPILE_HELPERS = False`` turns this off.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
import threading
import types
import weakref

import torch
from torch import nn

from .. import config, intrinsics
from ..errors import CompileError
from ..ops.table import has_hooks

# Where code is not the user's: the standard library, installed packages, torch and recompile
_LIBRARY_ROOTS = tuple(sorted({os.path.realpath(p) + os.sep for p in (
    *(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__)) if p}))
_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_VARARGS | \
    inspect.CO_VARKEYWORDS
_STARRED = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
_mine = weakref.WeakKeyDictionary()  # function -> whether it is the user's own (``user_function``)
_compiled = weakref.WeakKeyDictionary()  # function -> its compiled form, or the CompileError that refused it
_kinds = weakref.WeakKeyDictionary()  # function -> {owner class: its kind} (``kind``)
_lock = threading.Lock()
# func -> (its signature, kind(owner): built for owner, or its CompileError raised, "pure" where run again it
# changes and shows nothing twice, "unchanging" where it changes nothing in place, else None, run(args, n,
# owner): its result and the ops it ran once per instance, ops(owner): its SubGraph before fusion): set by
# ``recompile.api``, which compiles (the runtime lies beneath it)
compiler = None
# target -> its (signature, kind, run, ops) as ``compiler`` gives them, for a compiled function's own program:
# set by ``recompile.api`` too
calling = None
COMPILED = ()  # (``recompile.CompiledFunction``, set by ``recompile.api``: a compiled function is its own program)
_calls = weakref.WeakKeyDictionary()  # compiled function handle -> what ``_kind`` gives for it


def user_function(fn):
    """The plain function ``fn`` calls (a function, or a method's function) where it is the user's own code
    that a helper's compilation may take, else None."""
    func = fn.__func__ if type(fn) is types.MethodType else fn
    if type(func) is not types.FunctionType or "<" in func.__qualname__:  # (a closure, a lambda)
        return None
    mine = _mine.get(func)
    if mine is None:
        mine = _mine[func] = _is_users(func)
    return func if mine else None


def _is_users(func):
    code = func.__code__
    if code.co_flags & _FLAGS or code.co_kwonlyargcount or hasattr(func, "__wrapped__"):
        return False
    return not (code.co_filename.startswith("<") or os.path.realpath(code.co_filename).startswith(_LIBRARY_ROOTS))


def compiled(func):
    """Helper ``func`` compiled (on first use: what ``compiler`` gives), or the CompileError that refused it."""
    found = _compiled.get(func)
    if found is None:
        with _lock:
            found = _compiled.get(func)
            if found is None:
                found = _compile(func)
                _compiled[func] = found
    return found


def _compile(func):
    try:
        return compiler(func)
    except CompileError as exc:
        return exc


def refusal(fn):
    """Why helper ``fn`` was not compiled (a line), or None where it was, or is none of the user's."""
    func = runs(fn)[0]
    found = _compiled.get(func) if func is not None else None
    return str(found).splitlines()[0] if isinstance(found, CompileError) else None


def _kind(fn):
    """(compiled form, bound self, owner, kind) of helper ``fn`` (see ``compiler``), or None where it is no
    helper this compiles. A ``CompiledCall`` (a compiled function the level program runs as a helper) is its
    own function's program, for its owner class, whatever ``config.COMPILE_HELPERS`` says; so is a compiled
    function, a module whose ``forward`` is one (``self.encoder(tree)``) or a method of one bound to its object
    (``self.encoder.forward(tree)``)."""
    if type(fn) is intrinsics.CompiledCall:
        return _compiled_call(fn.target)
    func, receiver = runs(fn)
    if func is None or compiler is None or not (config.COMPILE_HELPERS or isinstance(func, COMPILED)):
        return None
    found = compiled(func)
    if isinstance(found, CompileError):
        return None
    bound_self = (receiver,) if receiver is not None else ()
    owner = type(receiver) if bound_self else None
    kind = _kind_for(func, found, owner)
    return None if kind is CompileError else (found, bound_self, owner, kind)


def runs(fn):
    """(the function a call of ``fn`` runs, the object it is bound to or None) where that function is a compiled
    function (``recompile.function``) or the user's own (``user_function``); a module called as Python calls it
    (no hooks, no ``__call__`` or ``forward`` of its own object) runs its class's ``forward`` bound to it. Else
    (None, None)."""
    receiver = None
    if isinstance(fn, nn.Module):
        if type(fn).__call__ is not nn.Module.__call__ or "forward" in vars(fn) or has_hooks(fn):
            return None, None
        receiver, fn = fn, getattr(type(fn), "forward", None)
    elif type(fn) is types.MethodType:
        receiver, fn = fn.__self__, fn.__func__
    if isinstance(fn, COMPILED):  # (not one taking ``*args``, ``**kwargs`` or keyword-only ones, as helpers)
        code = getattr(fn.python, "__code__", None)
        plain = code is not None and not code.co_flags & _STARRED and not code.co_kwonlyargcount
        return (fn, receiver) if plain else (None, None)
    func = user_function(fn) if fn is not None else None
    return (func, receiver) if func is not None else (None, None)


def compiled_function(fn):
    """Whether a call of ``fn`` runs a compiled function (``runs``): it has no vmap form, only its program."""
    return isinstance(runs(fn)[0], COMPILED)


def _kind_for(func, found, owner):
    """``func``'s kind for class ``owner`` (what ``found[1]`` gives, kept), or CompileError where converting it
    refused it."""
    kinds = _kinds.get(func)
    if kinds is None or owner not in kinds:
        try:
            kind = found[1](owner)  # (converted on first use: a construct it does not compile is found here)
        except CompileError as exc:
            _compiled[func] = exc
            return CompileError
        _kinds[func] = kinds = {**(kinds or {}), owner: kind}
    return kinds[owner]


def changes_something(fn, owner=None):
    """Whether calling ``fn`` may change something in place, as its program shows (``passes.effects``): a compiled
    function, or one of the user's own functions (``runs``; a method's plain function read from class ``owner``,
    a bound method, a module's ``forward``) that this compiles; True for a lambda or closure of the user's (not
    examined). False where it is none of these (nothing is known of it then: a call it makes with a value
    computed once for every instance gets a copy, ``sharing.call_owning``)."""
    func, receiver = runs(fn)
    if func is None:
        plain = fn.__func__ if type(fn) is types.MethodType else fn
        # (a lambda or closure of the user's, whose program is not examined: it may change what it is given, and
        # a copy of a value computed once would lose the change; each instance then computes its own)
        return type(plain) is types.FunctionType and "<" in plain.__qualname__ and _is_users(plain)
    if compiler is None:
        return False
    if receiver is not None:
        owner = type(receiver)
    examining = _examining.functions
    if (func, owner) in examining:
        return False  # (a helper its own helpers call back: what it changes is found where it is examined)
    found = compiled(func)
    if isinstance(found, CompileError):
        return False
    examining.add((func, owner))
    try:
        return _kind_for(func, found, owner) is None
    finally:
        examining.discard((func, owner))


class _Examining(threading.local):
    """Per thread: the (function, owner) pairs ``changes_something`` is examining."""

    def __init__(self):
        self.functions = set()


_examining = _Examining()


def _compiled_call(target):
    found = _calls.get(target)
    if found is None:
        forms = calling(target)
        found = _calls[target] = (forms, (), target.owner, forms[1](target.owner))
    return found


def kind(fn):
    """"pure" where ``fn`` is a helper this compiles that, run again, changes and shows nothing twice (a plain
    level run given up runs its pieces again: ``codegen.segments``); "unchanging" where it only changes nothing
    in place; None where it is no helper, or one that changes something (run once per instance)."""
    found = _kind(fn)
    return None if found is None else found[3]


def changes_in_place(fn):
    """Whether ``fn`` is a helper this compiles (or a compiled function) whose program changes something in place:
    it runs once per instance."""
    found = _kind(fn)
    return found is not None and found[3] is None


def inlined(fn):
    """(the SubGraph of pure helper ``fn`` before fusion, its signature), for a plain piece to trace in its own
    place; None where ``fn`` is no pure helper."""
    found = _kind(fn)
    if found is None or found[3] != "pure":
        return None
    (signature, _, _, ops), _, owner, _ = found
    return ops(owner), signature


def run(n, fn, args, kwargs):
    """``fn(*args, **kwargs)`` for ``n`` instances (some arguments Batch values) as one batched run of the
    compiled helper: its result, and the ops it ran once per instance (``{name: count}``, for the caller's
    stats); NotImplemented where ``fn`` is no helper this compiles, or one that changes something in place (each
    instance's changes in turn)."""
    found = _kind(fn)
    if found is None or found[3] is None:
        return NotImplemented
    (signature, _, run_batched, _), bound_self, owner, _ = found
    code = getattr(runs(fn)[0], "__code__", None) if type(fn) is not intrinsics.CompiledCall else None
    if not kwargs and code is not None and len(bound_self) + len(args) == code.co_argcount:  # (each, in order)
        return run_batched((*bound_self, *args), n, owner)
    try:
        bound = signature.bind(*bound_self, *args, **kwargs)
    except TypeError:
        return NotImplemented  # (the plain call raises Python's own error, once per instance)
    bound.apply_defaults()
    return run_batched(tuple(bound.arguments.values()), n, owner)
