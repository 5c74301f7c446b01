"""The decorator: ``recompile.function`` and the CompiledFunction it returns."""

from __future__ import annotations

import functools
import inspect
import threading
import types

import torch

from . import config, ir
from .codegen import generate
from .codegen.batched import generate_batched
from .naming import Namer
from .frontend import convert, parse_function, validate
from .passes.effects import invoke_may_mutate, program_may_mutate
from .passes.fusion import BACKENDS, DEFAULT_BACKEND
from .passes.grad import derive
from .passes.pipeline import FINAL, GRAD, STAGES, run_passes
from .runtime import agenda, autograd, pool, scheduler, threaded

MODES = ("batched", "sequential", "threaded")
_ir_names = Namer(suffix=lambda k: f"#{k}")
_ir_names_lock = threading.Lock()


def _unique_ir_name(qualname):
    """SubGraph names are unique across programs: a second function of the same qualname gets #2."""
    with _ir_names_lock:
        return _ir_names.fresh(qualname)


def _make_binder(fn):
    """A function with ``fn``'s signature returning its parameters as a tuple.

    Calling it binds arguments exactly as Python does (defaults, keywords) and
    raises Python's own TypeError for a wrong call.
    """
    sig = inspect.signature(fn, follow_wrapped=False)
    parts, names, star_done = [], [], False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append("*" + p.name)
            star_done = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append("**" + p.name)
        elif p.kind is p.KEYWORD_ONLY:
            if not star_done:
                parts.append("*")
                star_done = True
            parts.append(p.name)
        else:
            parts.append(p.name)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
        names.append(p.name)
    ret = "(" + "".join(n + ", " for n in names) + ")"
    namespace = {}
    exec(f"def binder({', '.join(parts)}):\n    return {ret}\n", namespace)
    binder = namespace["binder"]
    binder.__defaults__ = fn.__defaults__
    binder.__kwdefaults__ = fn.__kwdefaults__
    binder.__name__, binder.__qualname__ = fn.__name__, fn.__qualname__  # for Python's own messages
    binder.__code__ = binder.__code__.replace(co_name=fn.__name__, co_qualname=fn.__qualname__)
    return binder


class Stats(dict):
    """Counters of a compiled function.

    ``builds``, ``calls``, ``frames``, ``max_depth``; with gradients, ``backwards``
    (gradient programs run) and ``grad_fallbacks`` ({callable: calls} that had no
    gradient rule and were recorded by torch.autograd instead).
    """

    def __init__(self):
        super().__init__(builds=0, calls=0, frames=0, max_depth=0, backwards=0, grad_fallbacks={})
        self._lock = threading.Lock()

    def record_backward(self):
        with self._lock:
            self["backwards"] += 1

    def record_fallbacks(self, fallbacks):
        if fallbacks:
            with self._lock:
                counts = self["grad_fallbacks"]
                for name, n in fallbacks.items():
                    counts[name] = counts.get(name, 0) + n

    def record_build(self):
        with self._lock:
            self["builds"] += 1

    def record_start(self):
        with self._lock:
            self["calls"] += 1  # failed calls count too

    def record_run(self, run_stats):
        with self._lock:
            self["frames"] += run_stats.frames
            self["max_depth"] = max(self["max_depth"], run_stats.max_depth)

    def record_batched(self, run_stats):
        """Add a batched run: executions and instances per program point, ops run per instance, time."""
        self.record_run(run_stats)
        with self._lock:
            batches = self.setdefault("batches", {})
            for name, (runs, instances) in run_stats.batches.items():
                entry = batches.setdefault(name, {"runs": 0, "instances": 0, "mean_batch": 0.0})
                entry["runs"] += runs
                entry["instances"] += instances
                entry["mean_batch"] = entry["instances"] / entry["runs"]
            per_instance = self.setdefault("per_instance", {})
            for name, count in run_stats.per_instance.items():
                per_instance[name] = per_instance.get(name, 0) + count
            self["compute_s"] = self.get("compute_s", 0.0) + run_stats.compute_s
            self["scheduling_s"] = self.get("scheduling_s", 0.0) + run_stats.total_s - run_stats.compute_s

    def reset(self):
        """Zero the run counters (builds stay)."""
        with self._lock:
            builds = self["builds"]
            self.clear()
            self.update(Stats())
            self["builds"] = builds


class FunctionBuild:
    """The program of one compiled function, for one owner class (None for plain functions)."""

    def __init__(self, cf, owner):
        self.cf = cf
        self.owner = owner
        def callee_of(obj, owner_of_call):
            # the plain function referring to itself by name is recursion too: calling the
            # compiled version gives the same results, and runs off the Python stack
            if obj is cf.python:
                return cf.callee(owner_of_call)
            return _callee_of(obj, owner_of_call)

        frontend_sg = convert(cf._parsed, cf.ir_name, owner, callee_of)
        self.stages = run_passes(frontend_sg, cf._parsed, cf.fusion)
        self._code = None
        self._code_lock = threading.Lock()
        self._grad = None
        self._grad_code = None
        self._batched_code = None
        cf.stats.record_build()

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
        return self._once("_batched_code", lambda: generate_batched(self.stages[FINAL], self._may_mutate))

    @property
    def grad(self):
        """(forward-with-saves SubGraph, gradient SubGraph) of this function (passes.grad)."""
        return self._once("_grad", lambda: derive(self.stages[FINAL],
                                                  lambda target: (target.forward, target.backward),
                                                  self._may_mutate))

    @property
    def grad_code(self):
        """(forward-with-saves code, gradient code)."""
        fwd, bwd = self.grad  # (outside the lock: deriving takes it)
        # the gradient changes no user state: its calls need no ordering analysis
        return self._once("_grad_code", lambda: (generate(fwd, self._may_mutate), generate(bwd, release=True)))

    @staticmethod
    def _may_mutate(invoke):
        return invoke_may_mutate(invoke, FINAL)


class Callee:
    """The runtime handle of a compiled function bound to an owner class.

    It is what an Invoke names; the program it runs is built on first use, so
    mutually recursive functions refer to each other before either is built.
    """

    def __init__(self, cf, owner):
        self.cf = cf
        self.owner = owner
        self.ir_name = cf.ir_name
        self.signature = cf.signature
        self.qualname = cf.__qualname__
        self.filename = cf._parsed.filename
        self._code = None
        self._unit = None
        self._may_mutate = None
        self.ready = False  # this function and every function it may invoke are built
        self.forward = GradHandle(self, 0)
        self.backward = GradHandle(self, 1)

    def prepare(self):
        """Build everything this function may invoke, so that a CompileError comes before anything runs."""
        seen = set()
        pending = [self]
        while pending:
            handle = pending.pop()
            if handle in seen:
                continue
            seen.add(handle)
            build = handle.build
            for sg in build.stages[FINAL].walk():
                pending.extend(op.target for op in sg.ops if isinstance(op, ir.Invoke))
        self.ready = True

    @property
    def build(self):
        return self.cf._build_for(self.owner)

    @property
    def code(self):
        code = self._code
        if code is None:
            code = self._code = self.build.code
        return code

    @property
    def may_mutate(self):
        """Whether this function, or any it may invoke, may change state in place (``passes.effects``)."""
        if self._may_mutate is None:
            self._may_mutate = program_may_mutate(self, FINAL)
        return self._may_mutate

    @property
    def batched_unit(self):
        unit = self._unit
        if unit is None:
            unit = self._unit = self.build.batched_code.unit
        return unit


class GradHandle:
    """The runtime handle of a function's forward-with-saves (0) or gradient (1) program."""

    def __init__(self, callee, which):
        self.callee = callee
        self.which = which
        self.qualname = callee.qualname
        self.filename = callee.filename
        self._code = None

    @property
    def build(self):
        return self.callee.build

    @property
    def code(self):
        code = self._code
        if code is None:
            code = self._code = self.callee.build.grad_code[self.which]
        return code


def _callee_of(obj, owner):
    return obj.callee(owner) if isinstance(obj, CompiledFunction) else None


class CompiledFunction:
    """A function compiled to a recompile program. Call it like the original."""

    def __init__(self, fn, mode="batched", fusion=True, threads=None, max_live_frames=config.MAX_LIVE_FRAMES):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        if threads is not None and mode == "sequential":
            raise ValueError("threads applies to mode='threaded' and mode='batched', not mode='sequential'")
        if max_live_frames is not None and (not isinstance(max_live_frames, int) or isinstance(max_live_frames, bool)
                                            or max_live_frames < 1):
            raise ValueError(f"max_live_frames must be a positive int or None, got {max_live_frames!r}")
        if fusion is True:
            fusion = DEFAULT_BACKEND
        elif fusion is False or fusion is None:
            fusion = None
        elif fusion not in BACKENDS:
            raise ValueError(f"unknown fusion {fusion!r}; use True, False or one of: {', '.join(BACKENDS)}")
        if not inspect.isfunction(fn):
            raise TypeError(f"recompile.function expects a Python function, got {type(fn).__name__}")
        self.python = fn
        self.mode = mode
        self.fusion = fusion  # the fused ops' backend, or None
        # worker threads: threaded mode uses what the machine offers unless told; batched mode runs its
        # groups on the calling thread unless told (see README, "Threads")
        self.threads = threads if threads is not None else (pool.default_threads() if mode == "threaded" else 1)
        self.max_live_frames = max_live_frames
        functools.update_wrapper(self, fn)
        self._parsed = parse_function(fn)
        validate(self._parsed)
        self.signature = self._parsed.signature
        self.ir_name = _unique_ir_name(fn.__qualname__)
        self._binder = _make_binder(fn)
        self._builds = {}
        self._callees = {}
        self._lock = threading.RLock()
        self._owner = None
        self.stats = Stats()

    # -- building

    def __set_name__(self, owner, name):
        self._owner = owner

    def callee(self, owner):
        handle = self._callees.get(owner)
        if handle is None:  # no lock: a build holding one may ask for a handle (mutual recursion)
            handle = self._callees.setdefault(owner, Callee(self, owner))
        return handle

    def _build_for(self, owner):
        build = self._builds.get(owner)
        if build is None:
            with self._lock:
                build = self._builds.get(owner)
                if build is None:
                    build = self._builds[owner] = FunctionBuild(self, owner)
        return build

    # -- calling

    def __call__(self, *args, **kwargs):
        # a method called through its class (Class.method(obj, ...)) runs the program of obj's class
        owner = type(args[0]) if self._owner is not None and args and isinstance(args[0], self._owner) else None
        return self._run(owner, args, kwargs)

    def _run(self, owner, args, kwargs):
        bound = self._binder(*args, **kwargs)
        callee = self.callee(owner)
        if not callee.ready:
            callee.prepare()
        self.stats.record_start()
        workers = self._pool()
        if self.mode == "batched":
            # torch.autograd records each batched op once for all its instances: the backward is batched too
            result, run_stats = agenda.run(callee, bound, pool=workers)
            self.stats.record_batched(run_stats)
            return result
        if self.mode == "threaded" and workers is not None:
            runner = functools.partial(threaded.run, pool=workers, max_live=self.max_live_frames)
        else:
            runner = scheduler.run
        if torch.is_grad_enabled():
            result, run_stats = autograd.run(callee, bound, self.stats, runner)
        else:
            result, run_stats = runner(callee, bound)
        self.stats.record_run(run_stats)
        return result

    def _pool(self):
        """The worker pool a call runs on, or None to run on the calling thread: sequential mode, batched
        mode with one thread, and a call made by a worker's own code (not an Invoke the compiler saw), since
        waiting for the pool from inside it could take every worker."""
        if (self.mode == "sequential" or (self.mode == "batched" and self.threads == 1)
                or pool.current_worker() is not None):
            return None
        return pool.get(self.threads)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        if self._owner is None:  # assigned to a class after it was created: no __set_name__ call
            self._owner = type(instance)
        return types.MethodType(self, instance)

    # like a function, a compiled function is shared by copies and pickled by reference
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return self.__qualname__

    # -- inspecting

    def program(self, stage=FINAL, owner=None):
        """The Program reachable from this function after ``stage`` (see STAGES).

        ``stage="grad"`` gives each function's forward-with-saves (``F:fwd``) and
        gradient (``F:bwd``) SubGraphs.
        """
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; available: {', '.join(STAGES)}")
        owner = owner if owner is not None else self._owner
        subgraphs = {}
        seen = set()
        pending = [self.callee(owner)]
        while pending:
            handle = pending.pop()
            if handle.ir_name in seen:
                continue
            seen.add(handle.ir_name)
            build = handle.build
            if stage == GRAD:
                for sg in build.grad:
                    subgraphs[sg.name] = sg
            else:
                subgraphs[handle.ir_name] = build.stages[stage]
            for s in build.stages[FINAL if stage == GRAD else stage].walk():
                pending.extend(op.target for op in s.ops if isinstance(op, ir.Invoke))
        return ir.Program(self.ir_name + (":fwd" if stage == GRAD else ""), subgraphs)

    def dump(self, stage=FINAL, format="text", owner=None):
        """The IR after ``stage`` as text (``format="text"``) or Graphviz DOT (``format="dot"``)."""
        program = self.program(stage, owner)
        if format == "text":
            return program.to_text()
        if format == "dot":
            return program.to_dot()
        raise ValueError(f"unknown format {format!r}; use 'text' or 'dot'")

    def source(self, owner=None):
        """The generated Python source of this function (and its nested SubGraphs)."""
        owner = owner if owner is not None else self._owner
        return self._build_for(owner).code.source

    def __repr__(self):
        threads = f" threads={self.threads}" if self.mode != "sequential" else ""
        return f"<recompile.function {self.__qualname__} mode={self.mode}{threads}>"


def function(fn=None, **options):
    """Compile ``fn``: ``@recompile.function`` or ``@recompile.function(mode="sequential", fusion=False)``.

    ``mode``: ``"batched"`` (the default), ``"sequential"`` or ``"threaded"`` (independent frames
    run on a pool of worker threads). ``fusion``: True (the default: chains of elementwise ops run
    as one op, ``passes.fusion``), False (or None), or a backend for the fused ops: ``"python"``
    (one plain Python function) or ``"compile"`` (torch.compile, compiled once per fused op).
    ``threads``: worker threads; threaded mode defaults to the CPUs this process may use, batched
    mode to 1 (its groups run on the calling thread; more overlap independent groups).
    ``max_live_frames``: in threaded mode, how many frames of one call may be started and not yet
    returned (None: no bound); it bounds memory, not correctness.
    """
    unknown = set(options) - {"mode", "fusion", "threads", "max_live_frames"}
    if unknown:
        raise TypeError(f"recompile.function() got unexpected option(s): {', '.join(sorted(unknown))}")
    if fn is None:
        return lambda f: CompiledFunction(f, **options)
    return CompiledFunction(fn, **options)
