"""Builds and handles: what a compiled function is to the programs that call it.

A ``Function`` holds what recompile made of a Python function once (its parsed source, IR name and
signature) and, per owner class, its ``FunctionBuild`` (the program after each pass, its generated code,
its gradient programs) and its ``Callee``, the handle an Invoke names (the ``ir.Target`` protocol). The
frontend binds a call of a compiled function to the callee's handle when it converts the caller, so
mutually recursive functions refer to each other before either is built; the api's ``CompiledFunction``
is a Function that can also be called and inspected.
"""

from __future__ import annotations

import functools
import inspect
import threading

from . import intrinsics, ir
from .codegen import generate
from .codegen.batched import generate_batched
from .frontend import convert, lifting, parse_function, validate
from .naming import Namer
from .passes.effects import (callables_named, first_change, invoke_may_mutate, program_may_mutate,
                             program_runs_again_unseen, recursions_kept_in_order,
                             recursions_waiting_in_turn)
from .passes.fission import split_blocks
from .passes.grad import backward_name, derive, forward_name
from .passes.holding import caller_visible_change
from .passes.pipeline import FINAL, run_passes
from .runtime import fallbacks, helpers

_ir_names = Namer(suffix=lambda k: f"#{k}")
_ir_names_lock = threading.Lock()


def unique_ir_name(qualname):
    """SubGraph names are unique across programs: a second function of the same qualname gets #2."""
    with _ir_names_lock:
        return _ir_names.fresh(qualname)


class Function:
    """A Python function as recompile compiles it: ``python`` (the function itself), its parsed source,
    ``signature``, ``ir_name`` and ``fusion`` (the fused ops' backend, or None); its builds and handles,
    one per owner class (None for a plain function). Refused syntax raises CompileError here."""

    def __init__(self, python, fusion, parsed=None):
        if not inspect.isfunction(python):
            raise TypeError(f"recompile.function expects a Python function, got {type(python).__name__}")
        self.python = python
        self.fusion = fusion
        if parsed is None:  # (else a nested def lifted out of another compiled function: ``frontend.lifting``)
            parsed = parse_function(python)
            validate(parsed)
            seen = lifting.visible(parsed)
            parsed.lifted = lifting.find(parsed, seen)
            for name, lift in parsed.lifted.items():
                lift.make = functools.partial(self._lifted, name, seen)
        self.parsed = parsed
        self.signature = self.parsed.signature
        self.ir_name = unique_ir_name(python.__qualname__)
        self._builds = {}
        self._callees = {}
        self._lock = threading.RLock()

    def on_build(self):
        """Called once for each build made (the api counts them)."""

    def _lifted(self, name, seen, lift):
        """The compiled function of nested def ``name``, lifted out of this one (``frontend.lifting``)."""
        with self._lock:
            if lift.function is None:
                python, parsed = lifting.function_of(self.parsed, name, lift, seen)
                validate(parsed)
                lift.function = self._like(python, parsed, lift.takes_receiver)
        return lift.function

    def _like(self, python, parsed, receiver):
        """A function compiled as this one is, of ``python`` parsed as ``parsed`` (``receiver``: its first
        parameter is this method's ``self``)."""
        return Function(python, self.fusion, parsed)

    def callee(self, owner):
        """The handle of this function built for ``owner`` (an ``ir.Target``)."""
        handle = self._callees.get(owner)
        if handle is None:  # no lock: a build holding one may ask for a handle (mutual recursion)
            handle = self._callees.setdefault(owner, Callee(self, owner))
        return handle

    def build_for(self, owner):
        """The FunctionBuild for ``owner``, made on first use (once, whichever thread asks first)."""
        build = self._builds.get(owner)
        if build is None:
            with self._lock:
                build = self._builds.get(owner)
                if build is None:
                    build = self._builds[owner] = FunctionBuild(self, owner)
        return build


def callee_of(obj, owner):
    """The handle of compiled function ``obj`` for ``owner``, or None if ``obj`` is not one."""
    return obj.callee(owner) if isinstance(obj, Function) else None


class FunctionBuild:
    """The program of one compiled function, for one owner class (None for plain functions)."""

    def __init__(self, function, owner):
        self.function = function
        self.owner = owner

        def callee_for(obj, owner_of_call):
            # the plain function referring to itself by name is recursion too: calling the
            # compiled version gives the same results, and runs off the Python stack
            if obj is function.python:
                return function.callee(owner_of_call)
            return callee_of(obj, owner_of_call)

        frontend_sg = convert(function.parsed, function.ir_name, owner, callee_for)
        self.stages = run_passes(frontend_sg, function.parsed, function.fusion)
        self._code = None
        self._code_lock = threading.Lock()
        self._grad = None
        self._grad_code = None
        self._batched_code = None
        function.on_build()

    def _once(self, attr, make):
        """``self.<attr>``, made by ``make()`` on first use (once, whichever thread asks first)."""
        value = getattr(self, attr)
        if value is None:
            with self._code_lock:
                value = getattr(self, attr)
                if value is None:
                    value = make()
                    setattr(self, attr, value)
        return value

    @property
    def code(self):
        # generated on first use: grouping calls needs the callees' programs, which for mutual
        # recursion can only be converted once this build exists
        return self._once("_code", lambda: generate(self.stages[FINAL], self._may_mutate))

    @property
    def batched_code(self):
        """The batched program (codegen.batched): its ``unit`` is where frames of this function merge."""
        return self._once("_batched_code", self._generate_batched)

    def _generate_batched(self):
        sg = self.stages[FINAL]
        for invoke in recursions_kept_in_order(sg, FINAL, self._may_mutate):  # (never slower without a word)
            change = first_change(invoke.target, FINAL)
            fallbacks.calls_in_order(invoke.loc, invoke.target.qualname, change.loc if change is not None else None,
                                     change is not None and ir.is_call(change, intrinsics.set_cell))
        asked_at_once = {c.invoke: block for block in split_blocks(sg, self._may_mutate).values()
                         for c in block.ask.calls}
        for invoke, before in recursions_waiting_in_turn(sg, FINAL, asked_at_once):
            fallbacks.calls_in_turn(invoke.loc, invoke.target.qualname, before.loc)
        return generate_batched(sg, self._may_mutate)

    @property
    def grad(self):
        """(forward-with-saves SubGraph, gradient SubGraph) of this function (passes.grad)."""
        return self._once("_grad", lambda: derive(self.stages[FINAL], self._may_mutate))

    @property
    def grad_code(self):
        """(forward-with-saves code, gradient code)."""
        fwd, bwd = self.grad  # (outside the lock: deriving takes it)
        # the gradient changes no user state: its calls need no ordering analysis
        return self._once("_grad_code", lambda: (generate(fwd, self._may_mutate), generate(bwd, release=True)))

    @staticmethod
    def _may_mutate(invoke):
        return invoke_may_mutate(invoke, FINAL)


_UNREAD = object()  # (a property not yet read: None is one of its values)


class Callee:
    """The handle of a compiled function bound to an owner class: what an Invoke names (``ir.Target``).

    The program it runs is built on first use, so mutually recursive functions refer to each other before
    either is built.
    """

    def __init__(self, function, owner):
        self.function = function
        self.owner = owner
        self.ir_name = function.ir_name
        self.signature = function.signature
        self.qualname = function.python.__qualname__
        self.filename = function.parsed.filename
        self._code = None
        self._unit = None
        self._may_mutate = None
        self._shares = None
        self._runs_again_unseen = None
        self._makes_functions = None
        self._changes_callers = _UNREAD
        self.ready = False  # this function and every function it may invoke are built
        self.forward = GradHandle(self, 0)
        self.backward = GradHandle(self, 1)

    def prepare(self):
        """Build everything this function may invoke, so that a CompileError comes before anything runs."""
        for _ in ir.reachable(self, FINAL):
            pass
        self.ready = True

    @property
    def build(self):
        return self.function.build_for(self.owner)

    def subgraph(self, stage):
        return self.build.stages[stage]

    @property
    def code(self):
        code = self._code
        if code is None:
            code = self._code = self.build.code
        return code

    @property
    def runs_again_unseen(self):
        """Whether this function, run again, changes and shows nothing twice (``passes.effects``)."""
        if self._runs_again_unseen is None:
            self._runs_again_unseen = program_runs_again_unseen(self, FINAL)
        return self._runs_again_unseen

    @property
    def may_mutate(self):
        """Whether this function, or any it may invoke, may change state in place (``passes.effects``)."""
        if self._may_mutate is None:
            self._may_mutate = program_may_mutate(self, FINAL)
        return self._may_mutate

    @property
    def shares_computed_once(self):
        """Whether the instances of a batched run of this function may share what is computed once for them all
        (``runtime.sharing``): neither it nor what it may invoke changes anything in place, nor does a helper of
        the user's that they call (``passes.effects.callables_named``; ``bump(v)`` changing ``v`` must change
        each instance's own ``v``)."""
        if self._shares is None:
            self._shares = not self.may_mutate and not any(
                helpers.changes_something(fn, owner) for fn, owner in callables_named(self, FINAL))
        return self._shares

    @property
    def makes_functions(self):
        """Whether this function, or any it may invoke, makes a nested function, lambda or generator
        expression (``intrinsics.make_function``): a closure the derived gradient programs do not see into."""
        if self._makes_functions is None:
            self._makes_functions = any(
                isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value is intrinsics.make_function
                for handle in ir.reachable(self, FINAL) for sg in handle.subgraph(FINAL).walk() for op in sg.ops)
        return self._makes_functions

    @property
    def changes_callers(self):
        """The first op, in this function or any it may invoke, that may put a value into an object its caller
        holds (``node.state = h``, ``out.append(h)``, ``buf.add_(h)``: ``passes.holding``), or None."""
        if self._changes_callers is _UNREAD:
            self._changes_callers = caller_visible_change(self, FINAL)
        return self._changes_callers

    @property
    def batched_unit(self):
        unit = self._unit
        if unit is None:
            unit = self._unit = self.build.batched_code.unit
        return unit


class GradHandle:
    """The handle of a function's forward-with-saves (0) or gradient (1) program (``ir.Target``). Its
    ``subgraph(stage)`` is its function's, which is what the gradient programs' analyses read."""

    def __init__(self, callee, which):
        self.callee = callee
        self.which = which
        self.ir_name = (forward_name, backward_name)[which](callee.ir_name)
        self.signature = None  # (gradient programs are invoked by the grad pass, never bound by the frontend)
        self.qualname = callee.qualname
        self.filename = callee.filename
        self._code = None

    @property
    def build(self):
        return self.callee.build

    def subgraph(self, stage):
        return self.callee.subgraph(stage)

    @property
    def forward(self):
        raise TypeError("a gradient program has no gradient program of its own (no higher-order gradients)")

    backward = forward

    @property
    def code(self):
        code = self._code
        if code is None:
            code = self._code = self.callee.build.grad_code[self.which]
        return code
