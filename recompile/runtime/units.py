"""The program points of a batched run, and the cell of a deferred call: what the agenda and level runs share.

A *unit* is where the frames of a batched run merge (``passes.batching`` finds them): a function's entry
SubGraph, or a branch of a Cond in a SubGraph that invokes. Codegen makes one ``Unit`` per unit, holding its
generated function; an Invoke's target (a compiled function's handle, ``ir.Target``) names its entry unit as
``batched_unit``. A request answered by a lazy value gets a ``Deferred`` cell, which runs the request's
whole group when the value is first read.
"""

from __future__ import annotations

from . import batch as bt


class Unit:
    """A program point where frames are merged: a function entry or a Cond branch."""

    def __init__(self, name, filename, arity):
        self.name = self.qualname = name
        self.filename = filename
        self.arity = arity  # its outputs
        self.fn = None  # the generated function, and ``code`` its GeneratedCode: set by codegen
        self.code = None
        self.is_generator = False
        self.successors = ()  # Units and Invoke targets (resolved to their entry unit when needed: ``unit_of``)
        self.reach = None  # every unit it may lead to (runtime.agenda)
        self.levels = None  # a function entry's level program, where it has one (codegen.levels)

    def __repr__(self):
        return f"<unit {self.name}>"


def unit_of(target):
    """The unit a request for ``target`` goes to: the unit itself, or a compiled function's entry unit."""
    return target if type(target) is Unit else target.batched_unit


class Deferred:
    """The result of a deferred request: the thunk of the lazy value its frame got instead. ``run`` (the
    agenda's run, or a level run) runs the request's group when the value is read."""

    __slots__ = ("run", "unit", "value", "done", "versions")

    def __init__(self, run, unit, args):
        self.run, self.unit = run, unit
        self.value, self.done = None, False
        # in-place changes to the arguments before the call runs would change what it computes
        self.versions = bt.tensor_versions(args)

    def depends_on(self):
        return ()

    def compute(self):
        if not self.done:
            self.run.run_deferred(self)
        return self.value

    def check_arguments(self, site):
        if bt.changed(self.versions):
            raise RuntimeError(
                f"recompile: an argument of the call at {site.filename}:{site.lineno} was changed in place "
                "after the call was issued and before it ran (batched mode defers calls whose results "
                "are only returned); change a copy instead, or compile with mode='sequential'")
