"""How a Fused op (``passes.fusion``) runs: its members as one plain Python function, or compiled.

``FusedKernel`` holds the members' code generated like any SubGraph's (a
traceback points at the member's own line) and runs it through the op's
backend:

- ``python``: the plain function, one call for the whole chain;
- ``compile``: ``torch.compile`` of that function with every dim dynamic, so
  one compiled kernel serves any batch size; it is compiled on first use and
  kept. The resolved callables are arguments, so torch's guards check them and
  a rebound ``torch.sigmoid`` is honoured. A call runs the plain function
  instead when its data is not all tensors and numbers, or when its largest
  tensor has fewer than ``COMPILE_MIN_ELEMENTS`` elements: below that a
  compiled call costs more than it saves (measured on CPU: 9 ops on 25 x 150
  floats take 28 us plain and 38 us compiled, on 1000 x 150 718 us and 486 us),
  and single instances (one row, a rank less) would each need a recompile.
  Should compiling fail (no C++ compiler), the kernel warns once and runs the
  plain function from then on.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch

from .. import ir
from ..ops.facts import NUMBERS

COMPILE_MIN_ELEMENTS = 16384


class FusedKernel:
    """A fused op's code: ``python`` (the members as one plain function), ``batched`` (the members one by
    one, each by its batch rule, in batched code; else None), ``callables`` (body input position -> the
    callable it held at build time), ``deps`` (per output, the input positions it is computed from)
    and ``entry``, what a call runs (by the backend)."""

    def __init__(self, op, python, batched=None):
        self.name = op.body.name
        self.backend = op.backend
        self.callables = dict(op.callables)
        self.python = python
        self.batched = batched
        self.deps = _dependencies(op.body)
        # (for batch_rules.fused, which checks its arguments on every batched call)
        self.data_positions = tuple(i for i in range(len(op.body.inputs)) if i not in self.callables)
        self.dep_masks = tuple(sum(1 << i for i in d) for d in self.deps)
        self.compile_s = None  # seconds the first compiled call took
        self._compiled = None
        self._compile_failed = False
        self._lock = threading.Lock()
        self.entry = self.python if self.backend == "python" else self._run_compiled

    def __repr__(self):
        return f"<fused {self.name} ({self.backend})>"

    def same_callables(self, args):
        """Whether the callables among ``args`` are the ones the program was built with."""
        for i, fn in self.callables.items():
            if args[i] is not fn:
                return False
        return True

    def _run_compiled(self, *args):
        largest = 0
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                largest = max(largest, a.numel())
            elif type(a) not in NUMBERS and i not in self.callables:
                return self.python(*args)
        if largest < COMPILE_MIN_ELEMENTS or self._compile_failed:
            return self.python(*args)
        with self._lock:
            if self._compiled is None:
                self._compiled = torch.compile(self.python, dynamic=True)
        start = time.perf_counter() if self.compile_s is None else None
        try:
            out = self._compiled(*args)
        except Exception as exc:
            failure = exc
        else:
            if start is not None:
                self.compile_s = time.perf_counter() - start
            return out
        out = self.python(*args)  # outside the except: the user's own error is raised clean, from their line
        self._compile_failed = True
        warnings.warn(f"recompile: torch.compile failed on fused op {self.name} ({type(failure).__name__}: "
                      f"{failure}); it runs as plain Python", RuntimeWarning, stacklevel=2)
        return out


def _dependencies(body):
    """For each output of ``body``, the set of input positions it is computed from."""
    deps = {v: {i} for i, v in enumerate(body.inputs)}
    for op in body.ops:
        found = set()
        for x in op.operands():
            if isinstance(x, ir.Value):
                found |= deps[x]
        for v in op.outputs:
            deps[v] = found
    return [frozenset(deps[v]) for v in body.outputs]
