"""How batched code runs each op for a group of instances, read from the program (``recompile dump --instances``).

A value differs between instances where it derives from a parameter that does (every parameter but those
named shared: ``self``, the tree of a forest that ``vmap`` passes with ``in_dims=None``), through a call,
a branch or loop that joins instances' values, or a recursive call. Each op is then one of

- ``once``: nothing it reads differs between instances; it runs once for all of them (``runtime.sharing``
  gives each instance its own copy only where the program needs one; a torch op runs so where the program
  changes nothing in place, else per instance, and warns);
- ``batched``: one op for the group, by the callable's batch rule, or ``torch.func.vmap`` for a torch op
  with none; a call, branch or loop of the group is one too;
- ``per instance``: a callable known to have neither (Python code of per-instance values, a Python value
  made of each instance's tensor), with why and what to write instead, as the run's warning says;
- ``by type``: a callable read from a value the program is given (``self.cell``, ``x.squeeze``), which the
  run batches by its type: a module or tensor method with a rule or vmap is batched, anything else runs
  per instance (and warns).

The reading is static: a run may do better (a tensor computed once, ops of a traced piece), and worse only
where ``by type`` finds no rule or a program that changes values in place runs a torch op of shared values
once per instance (each run's warnings and ``stats["per_instance"]`` say so).
"""

from __future__ import annotations

import builtins

from .. import intrinsics, ir
from ..ops import facts
from ..ops.table import torch_callable
from ..runtime import fallbacks, helpers
from ..runtime.batch_rules import BATCH

ONCE, BATCHED, BY_TYPE, PER_INSTANCE = "once", "batched", "by type", "per instance"
_UNKNOWN = object()


class _Reading:
    """Which values differ between instances (``varies``), and the values known when the program is read
    (constants, globals, their attributes)."""

    def __init__(self, program):
        self.program = program
        self.varies = set()  # ids of ir.Values
        self.known = {}  # id of an ir.Value -> its value
        self.changed = True

    def vary(self, values):
        for v in values:
            if isinstance(v, ir.Value) and id(v) not in self.varies:
                self.varies.add(id(v))
                self.changed = True

    def differs(self, operand):
        return isinstance(operand, ir.Value) and id(operand) in self.varies

    def value(self, operand):
        if isinstance(operand, ir.Const):
            return operand.value
        return self.known.get(id(operand), _UNKNOWN)

    def subgraph(self, sg):
        for op in sg.ops:
            self.op(op)

    def op(self, op):
        if isinstance(op, ir.Capture):
            self.capture(op)
        elif isinstance(op, ir.Cond):
            self.cond(op)
        elif isinstance(op, ir.While):
            self.loop(op)
        elif isinstance(op, ir.Invoke):
            callee = self.program.subgraphs.get(op.callee)
            if callee is not None:
                self.pass_to(callee.inputs, op.args)
                if any(self.differs(v) for v in callee.outputs):
                    self.vary(op.outputs)
            if any(self.differs(a) for a in op.args):
                self.vary(op.outputs)
        else:
            if isinstance(op, ir.Call):
                self.call(op)
            if any(self.differs(a) for a in op.operands()) or _own_per_instance(self.value(op.fn)):
                self.vary(op.outputs)
            receiver = _changed_receiver(op)
            if receiver is not None and any(self.differs(a) for a in op.args):
                self.vary([receiver])  # (``hs.append(h)`` of a per-instance h: the list holds it now)

    def capture(self, op):
        if op.source_kind == "global" and isinstance(op.source, dict):
            found = op.source.get(op.name, getattr(builtins, op.name, _UNKNOWN))
            if found is not _UNKNOWN:
                self.known[id(op.outputs[0])] = found
        elif op.source_kind == "attr":
            if self.differs(op.base):
                self.vary(op.outputs)

    def call(self, op):
        if self.value(op.fn) is getattr:
            base, name = (self.value(a) for a in op.args[:2])
            if base is not _UNKNOWN and type(name) is str and not self.differs(op.args[0]):
                found = getattr(base, name, _UNKNOWN)
                if found is not _UNKNOWN:
                    self.known[id(op.outputs[0])] = found

    def pass_to(self, params, args):
        self.vary(p for p, a in zip(params, args) if self.differs(a))

    def cond(self, op):
        for branch in (op.then_sg, op.else_sg):
            self.pass_to(branch.inputs, op.args)
            self.subgraph(branch)
            self.vary(a for a, p in zip(op.args, branch.inputs) if self.differs(p))  # (what it changed: see op)
        if self.differs(op.pred):
            self.vary(op.outputs)
        for branch in (op.then_sg, op.else_sg):
            self.vary(o for o, r in zip(op.outputs, branch.outputs) if self.differs(r))

    def loop(self, op):
        start = [*op.loop_vars, *op.invariants]
        for sg in (op.cond_sg, op.body_sg):
            self.pass_to(sg.inputs, start)
            self.pass_to(sg.inputs, op.body_sg.outputs)  # (what a step gives the next)
            self.subgraph(sg)
        self.vary(o for o, r in zip(op.outputs, op.body_sg.outputs) if self.differs(r))
        inner = op.body_sg.inputs[len(op.loop_vars):]
        self.vary(a for a, p in zip(op.invariants, inner) if self.differs(p))  # (what a step changed: see op)
        self.pass_to(op.outputs, op.loop_vars)
        if op.cond_sg.outputs and self.differs(op.cond_sg.outputs[0]):
            self.vary(op.outputs)  # (instances leave at different steps: each its own final values)


def read(program, shared=("self",)):
    """{op: (how, why or None)} for every op of ``program``, its entry's parameters named in ``shared`` given
    alike to every instance and the others per instance."""
    reading = _Reading(program)
    entry = program.subgraphs[program.entry]
    reading.vary(v for v in entry.inputs if (v.hint or "").split(".")[0] not in shared)
    while reading.changed:  # (a fixpoint: recursion and loops hand values back to where they came from)
        reading.changed = False
        for sg in program.subgraphs.values():
            reading.subgraph(sg)
    return {op: _how(reading, op) for sg in program.all_subgraphs() for op in sg.ops}


def _how(reading, op):
    varies = any(reading.differs(a) for a in op.operands())
    if not isinstance(op, ir.Call):
        return (BATCHED if varies else ONCE), None
    fn = reading.value(op.fn)
    if fn is _UNKNOWN:
        if _made_here(op.fn):  # a nested function, lambda, or the function a with or try statement runs in
            why, instead = fallbacks.NESTED
            return PER_INSTANCE, f"{why}; {instead}"
        return BY_TYPE, None
    if _own_per_instance(fn):
        return BATCHED, None
    if helpers.kind(fn) is not None and (not varies or not _batches(fn)):
        return BATCHED, ("an undecorated helper or a compiled function (a module's forward), run once for the group "
                         "(it changes nothing in place)")
    if not varies:
        return _once(fn)
    if _batches(fn):
        return BATCHED, None
    why, instead = fallbacks.reason(fn)
    return PER_INSTANCE, f"{why}; {instead}"


def _changed_receiver(op):
    """The object a method call may change in place (``hs`` of ``hs.append(h)``), or None."""
    method = op.fn.op if isinstance(op, ir.Call) and isinstance(op.fn, ir.Value) else None
    if (isinstance(method, ir.Call) and isinstance(method.fn, ir.Const) and method.fn.value is getattr
            and isinstance(method.args[1], ir.Const) and facts.mutating_method(method.args[1].value)):
        return method.args[0]
    return None


def _made_here(operand):
    producer = operand.op if isinstance(operand, ir.Value) else None
    return (isinstance(producer, ir.Call) and isinstance(producer.fn, ir.Const)
            and producer.fn.value is intrinsics.make_function)


def _own_per_instance(fn):
    """Whether ``fn`` gives each instance an object of its own, read from shared values too: a cell of a
    variable that a nested function uses (``batch_rules._unbatched``)."""
    return fn is intrinsics.new_cell


def _once(fn):
    """An op of shared values: once, unless each instance must get its own result (a random draw, a Python
    call with effects or a fresh object: ``batch_rules._unbatched``)."""
    known = facts.among(fn, facts.PURE) or facts.among(fn, facts.SHAREABLE) or torch_callable(fn)
    if known and not facts.among(fn, facts.DRAWS):
        return ONCE, None
    why, instead = fallbacks.FRESH
    return PER_INSTANCE, f"{why}; {instead}"


def _batches(fn):
    if fn is intrinsics.unpack:  # (``a, b = pair``: the batched code takes a batch of tuples apart itself)
        return True
    try:
        if BATCH.lookup(fn) is not None or isinstance(fn, type) and BATCH.by_module.get(fn) is not None:
            return True
    except TypeError:
        return False
    return torch_callable(fn) and fallbacks.reason(fn) is not fallbacks.PYTHON_VALUE


def note_text(how, why):
    return how if why is None else f"{how}: {why}"
