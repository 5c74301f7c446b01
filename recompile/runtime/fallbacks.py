"""An op of a batched run that runs once per instance is never silent.

``batch_rules`` runs an op once per instance where no rule and no vmap batches it; ``fell_back`` then warns
once per program point (``recompile.PerInstanceWarning``), with the user's file and line (generated code runs
under them), the op, why it ran so, and what to write instead; with ``config.PER_INSTANCE`` "error" it raises
``recompile.PerInstanceError``, with "allow" it stays silent (the run's stats count it either way).
"""

from __future__ import annotations

import os
import types

import torch

from .. import config, intrinsics
from ..diagnostics import user_line, warn_once
from ..errors import PerInstanceError, PerInstanceWarning
from ..ops import facts, syntax
from ..ops.table import has_backward_hooks, torch_callable
from . import helpers
from .batch import Batch, instance

# Why an op ran once per instance, and what to write instead: (why, instead).
FRESH = ("no instance differs in its arguments, but each gets a result of its own (a fresh object, a random "
         "draw or a side effect)", "if it has none of these, compute it once outside the compiled function")
FRESH_CHANGED = ("no instance differs in its arguments, but the program changes values in place, so each "
                 "instance gets a fresh result of its own", "change a copy (y = x + 1, not x += 1) so that the "
                 "program changes nothing in place")
UNPACKED = ("its arguments are unpacked (*args, **kwargs) and may differ per instance",
            "pass the arguments one by one")
CHOSEN = ("each instance calls its own callable (one chosen by the data)",
          "pick modules from an nn.ModuleList (or plain, undecorated module-level functions from a list, or "
          "call methods of your objects' classes) in a function that changes nothing in place, or choose with "
          "if/elif, so that each branch batches")
PYTHON_VALUE = ("it makes a Python value of each instance's tensor", "keep it a tensor: torch.where(c, a, b) for "
                "an if on it, a tensor index for an int")
NESTED = ("it is a nested function, lambda or generator expression, or a with, try, match, class or import "
          "statement, which runs as Python",
          "move what it computes into a function of its own compiled with @recompile.function, or write it "
          "with torch ops")
HOOKED = ("it has backward hooks, which run for each call of it, as eager's do (torch.func.vmap would skip them)",
          "remove the backward hooks (register_full_backward_hook) where the model runs batched")
CHANGES = ("it changes something in place (an attribute of what it is given, a list, a tensor), so each instance "
           "runs it in turn, its changes before the next one's reads, as in plain Python (a compiled one as the "
           "plain Python it is made of)",
           "return what it computes instead of storing it (return c, h, not node.state = c, h), or change a copy")
PYTHON = ("it is Python code of per-instance values", "compile it with @recompile.function, or write it "
          "with torch ops")
UNVMAPPABLE = ("torch.func.vmap cannot batch it here (a shape that depends on the values, a call into Python, "
               "or an op torch has no batching rule for)", "write it with ops whose result's shape does not depend "
               "on the values, or with ops torch.func.vmap batches")
WRITES = ("it changes each instance's tensor in place", "write it out of place (y = x.add(1), not x.add_(1))")
OWN_DICT = ("each instance holds a dict of its own here (the program changes dicts, and keys(), values() or items() "
            "of one it changed, copied or sent down one side of a branch read each instance's)",
            "read it by key (d['h'] + d['c']), or build the dict after its last change")
LOOPED = ("a for over each instance's own iterable that no rule reads at once (an iterator, a dict, a list the "
          "program changes in place)", "loop over a range or a tensor's rows, or over a list the program does not "
          "change in place (build a new one: xs = xs[:-1], not xs.pop())")
COUNTED = ("its gradient scales each index by its count among the call's own indices (scale_grad_by_freq), which "
           "one call of every instance's would count together", "leave scale_grad_by_freq off")
PYTHON_VALUES = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", int, float, bool}
# Python's builtins of tensors, which read each instance's values as Python numbers or bools: the torch op to
# write instead
BUILTINS_OF_TENSORS = {max: "torch.maximum(a, b) or x.max()", min: "torch.minimum(a, b) or x.min()",
                       any: "(x > 1).any() of a tensor", all: "(x > 1).all() of a tensor",
                       round: "torch.round(x)", sorted: "torch.sort(x)"}


def reason(fn):
    """Why ``fn`` (a callable, or a Batch of them or of a tensor's method) ran once per instance."""
    if type(fn) is Batch:
        if fn.method is None:
            first = instance(fn, 0)
            if isinstance(getattr(first, "__self__", None), torch.Tensor):  # (each instance's tensor's method)
                return _of_method(first.__name__)
            if type(getattr(first, "__self__", None)) is dict:  # (``d.values()`` of each instance's own dict)
                return OWN_DICT
            return NESTED if _nested(first) else CHOSEN
        return _of_method(fn.method[1])
    if facts.among(fn, PYTHON_VALUES) or getattr(fn, "__name__", None) in PYTHON_VALUES:
        return PYTHON_VALUE
    if facts.among(fn, syntax.AUGMENTED) or facts.among(fn, intrinsics.SETTERS_FRESH.values()):
        return WRITES  # (``y += x`` on each instance's own tensor; ``v.fill_(k)``)
    if fn is slice:  # (``x[:k]`` with a per-instance k: a shape of each instance's own)
        return UNVMAPPABLE
    if facts.among(fn, facts.FOR_LOOP):
        return LOOPED
    instead = BUILTINS_OF_TENSORS.get(fn) if isinstance(fn, types.BuiltinFunctionType) else None
    if instead is not None:
        return (f"Python's {fn.__name__} reads each instance's tensors as Python values", f"write {instead}")
    if _nested(fn):
        return NESTED
    if helpers.changes_in_place(fn):
        return CHANGES
    if isinstance(fn, torch.nn.Module) and has_backward_hooks(fn):
        return HOOKED
    refused = helpers.refusal(fn)
    if refused is not None:
        return (f"it is Python code of per-instance values that recompile does not compile ({refused})",
                "write it with what recompile compiles, or with torch ops")
    return UNVMAPPABLE if torch_callable(fn) else PYTHON


def _of_method(name):
    """Why a Tensor method ``name`` of each instance's tensor ran once per instance."""
    return PYTHON_VALUE if name in PYTHON_VALUES else WRITES if name.endswith("_") else UNVMAPPABLE


def _nested(fn):
    """Whether ``fn`` is a function defined inside another (a closure, a lambda, a generator expression's, the
    one a with, try or match statement runs in)."""
    return isinstance(fn, types.FunctionType) and "<locals>" in fn.__qualname__



def calls_in_order(call, callee, change, shared_variable=False):
    """Warn (unless ``config.PER_INSTANCE == "allow"``) that the recursive calls of ``callee`` at ``call`` (an
    ``errors.Location``) keep their order, since its program may change a value in place (at ``change``, a
    Location, or None; ``shared_variable``: there it sets a variable a nested scope shares): an instance's calls
    then run one after another, not one batch per depth."""
    if config.PER_INSTANCE == "allow":
        return
    at = f" ({os.path.basename(change.filename)}:{change.lineno})" if change is not None else ""
    if shared_variable:  # (a variable a with, try or match block, a nested def or a lambda reads or sets)
        at = f" (a variable it sets at {at[2:-1]} is shared with a with, try or match block, a nested def or a lambda)"
    message = (f"recompile: the calls of {callee} at {os.path.basename(call.filename)}:{call.lineno} run one after "
               f"another within each instance, in their order, since {callee} may change a value in place{at}: "
               f"each batches only with other instances' calls of the same step, not as one batch per depth; return "
               f"what the calls make instead of changing what they are given (return h, loss, and add the losses "
               f"up), or change a copy (y = x + 1, not x += 1)")
    warn_once((call.filename, call.lineno), callee, message, PerInstanceWarning)


def calls_in_turn(call, callee, before):
    """Warn (unless ``config.PER_INSTANCE == "allow"``) that the recursive calls of ``callee`` at ``call`` (an
    ``errors.Location``, in an ``if`` or loop) wait for its calls at ``before``: an instance's calls then run one
    after another, not one batch per depth."""
    if config.PER_INSTANCE == "allow":
        return
    name = callee.split(".")[-1]
    message = (f"recompile: the calls of {callee} at {os.path.basename(call.filename)}:{call.lineno} wait within "
               f"each instance for its calls at {os.path.basename(before.filename)}:{before.lineno}: an if or loop "
               f"that calls it runs those calls to their end before what follows starts, so an instance's calls run "
               f"one after another, each batching only with other instances' calls of the same step, not as one "
               f"batch per depth; give each call an if of its own (if l >= 0: h = h + {name}(l)), make the calls "
               f"side by side in one block after a leaf test (hl = {name}(...); hr = {name}(...)), or loop over a "
               f"list of the children (for j in [j for j in (l, r) if j >= 0])")
    warn_once((call.filename, call.lineno), callee + " in turn", message, PerInstanceWarning)


def fell_back(name, n, why):
    """Warn of (or, with ``config.PER_INSTANCE == "error"``, refuse) an op run once per instance, at the
    user's line."""
    filename, line = where = user_line(3)
    reason, instead = why
    message = (f"recompile: {name} runs once per instance at {os.path.basename(filename)}:{line} ({n} "
               f"instances): {reason}; {instead}")
    if config.PER_INSTANCE == "error":
        raise PerInstanceError(message + ' (config.PER_INSTANCE is "error")')
    warn_once(where, name, message, PerInstanceWarning)
