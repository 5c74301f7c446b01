"""The decorator: ``recompile.function`` and the CompiledFunction it returns (options, calling, inspecting)."""

from __future__ import annotations

import functools
import inspect
import os
import threading
import types

import torch

from . import config, debugging, dynamo, ir, pickling
from .codegen.instances import note_text, read as instance_notes
from .diagnostics import warn_once
from .errors import GradFallbackWarning
from .passes.fusion import BACKENDS, DEFAULT_BACKEND
from .passes.pipeline import FINAL, GRAD, STAGES, UNFUSED
from .program import Function
from .runtime import agenda, autograd, helpers, pool, scheduler, threaded

MODES = ("batched", "sequential", "threaded")


class _Configured:
    """A default read from ``recompile.config`` when it is used, not when the function was compiled."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"config.{self.name}"

    def value(self):
        return getattr(config, self.name)


_MAX_LIVE_FRAMES = _Configured("MAX_LIVE_FRAMES")


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


def _warn_stored(compiled, op):
    """Warn once, at the user's line of ``op``, that a call of ``compiled`` stores values where its caller
    reads them, and so runs with gradients as batched mode runs one instance."""
    where = (op.loc.filename, op.loc.lineno)
    warn_once(where, "stores into the caller's objects",
              f"recompile: {compiled.__qualname__} (mode={compiled.mode!r}) may put a value into an object its "
              f"caller holds, at {os.path.basename(where[0])}:{where[1]} (an attribute of an argument, a list "
              "passed in, an argument tensor changed in place, a global): the derived gradient program carries "
              "gradients only to what a call returns, so with gradients on this call runs as batched mode runs "
              "one instance, where torch.autograd records each op. Return the values instead to keep the derived "
              "program", GradFallbackWarning)


class CompiledFunction(Function):
    """A function compiled to a recompile program. Call it like the original.

    As a ``program.Function`` it holds the builds and handles; this class adds the options, the calling
    (bound like the Python function, run by the mode's scheduler) and the inspecting.
    """

    def __init__(self, fn, mode="batched", fusion=True, threads=None, max_live_frames=_MAX_LIVE_FRAMES, *,
                 parsed=None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        if threads is not None and mode == "sequential":
            raise ValueError("threads applies to mode='threaded' and mode='batched', not mode='sequential'")
        if max_live_frames is not None and max_live_frames is not _MAX_LIVE_FRAMES and (
                not isinstance(max_live_frames, int) or isinstance(max_live_frames, bool) or max_live_frames < 1):
            raise ValueError(f"max_live_frames must be a positive int or None, got {max_live_frames!r}")
        if fusion is True:
            fusion = DEFAULT_BACKEND
        elif fusion is False or fusion is None:
            fusion = None
        elif fusion not in BACKENDS:
            raise ValueError(f"unknown fusion {fusion!r}; use True, False or one of: {', '.join(BACKENDS)}")
        self.mode = mode
        self._options = {"mode": mode, "fusion": fusion, "threads": threads}  # as given: what a rebuild is given
        if max_live_frames is not _MAX_LIVE_FRAMES:
            self._options["max_live_frames"] = max_live_frames
        # worker threads: threaded mode uses what the machine offers unless told; batched mode runs its
        # groups on the calling thread unless told (see docs/threads.md, "Batched mode with threads")
        self.threads = threads if threads is not None else (pool.default_threads() if mode == "threaded" else 1)
        self._max_live_frames = max_live_frames
        functools.update_wrapper(self, fn)
        self.stats = Stats()
        # (the fused ops' backend, or None; a TypeError for what is no function; ``parsed``: see ``_like``)
        super().__init__(fn, fusion, parsed)
        # bind(*args, **kwargs): the parameters' values in order, bound as Python binds them (or its TypeError)
        self.bind = _make_binder(fn)
        self._owner = None

    # -- building

    def __set_name__(self, owner, name):
        self._owner = owner

    def on_build(self):
        self.stats.record_build()

    def _like(self, python, parsed, receiver):
        """A nested def lifted out of this function (``frontend.lifting``), compiled with this one's options (a
        method of this one's class where ``receiver``: called for one instance, it runs its program for the class)."""
        lifted = CompiledFunction(python, **self._options, parsed=parsed)
        lifted._owner = self._owner if receiver else None
        return lifted

    # -- calling

    @dynamo.opaque  # under torch.compile: a graph break, not a trace of the runtime
    def __call__(self, *args, **kwargs):
        if config.DISABLED:  # (recompile.disable(): the plain function, whose recursion comes back here)
            return self.python(*args, **kwargs)
        # a method called through its class (Class.method(obj, ...)) runs the program of obj's class
        owner = type(args[0]) if self._owner is not None and args and isinstance(args[0], self._owner) else None
        if debugging.plain():  # (a per-instance call of one that changes something: see debugging.plain_here)
            return debugging.plain_call(self.python, args, kwargs, lambda: self._run(owner, args, kwargs))
        return self._run(owner, args, kwargs)

    def _run(self, owner, args, kwargs):
        bound = self.bind(*args, **kwargs)
        if self.mode == "batched":
            return self.run_batched(bound, 1, owner)
        callee = self._ready_callee(owner)
        if torch.is_grad_enabled() and (callee.makes_functions or callee.changes_callers is not None):
            # a tensor that reaches a nested function through its closure, or that the call stores where its
            # caller reads it, is out of the derived gradient's sight: one instance on the batched runtime,
            # whose ops torch.autograd records, has its gradient
            if callee.changes_callers is not None:
                _warn_stored(self, callee.changes_callers)
            return self.run_batched(bound, 1, owner)
        self.stats.record_start()
        workers = self._pool()
        if self.mode == "threaded" and workers is not None:
            runner = functools.partial(threaded.run, pool=workers, max_live=self.max_live_frames)
        else:
            runner = scheduler.run
        if torch.is_grad_enabled():
            replay = functools.partial(_replayed, callee, bound)
            result, run_stats = autograd.run(callee, bound, self.stats, runner, replay)
        else:
            result, run_stats = runner(callee, bound)
        self.stats.record_run(run_stats)
        return result

    def run_batched(self, args, n, owner=None):
        """Run ``n`` instances at once on ``args``, the value of each parameter in order (the self of a method
        first), each a value every instance shares or a ``runtime.batch.Batch`` of one value per instance
        (what ``recompile.vmap`` makes). Returns the result, a Batch where it differs between instances.
        torch.autograd records each batched op once for all its instances: the backward is batched too."""
        return self._run_batched(args, n, owner)[0]

    def _run_batched(self, args, n, owner):
        """``run_batched``'s result, and the ops its run ran once per instance (``{name: count}``)."""
        callee = self._ready_callee(owner)
        self.stats.record_start()
        result, run_stats = agenda.run(callee, args, n, pool=self._pool())
        self.stats.record_batched(run_stats)
        return result, run_stats.per_instance

    def _ready_callee(self, owner):
        callee = self.callee(owner)
        if not callee.ready:
            callee.prepare()
        return callee

    @property
    def max_live_frames(self):
        """In threaded mode, how many frames of one call may be started and not returned (None: no bound);
        by default ``config.MAX_LIVE_FRAMES``, read when a call starts."""
        bound = self._max_live_frames
        return bound.value() if bound is _MAX_LIVE_FRAMES else bound

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
        return pickling.reduce(self, self._owner, self._options)

    # -- inspecting

    def program(self, stage=FINAL, owner=None):
        """The Program reachable from this function after ``stage`` (see STAGES).

        ``stage="grad"`` gives each function's forward-with-saves (``F:fwd``) and
        gradient (``F:bwd``) SubGraphs.
        """
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; available: {', '.join(STAGES)}")
        entry = self.callee(owner if owner is not None else self._owner)
        subgraphs = {}
        # (a function built for two owner classes is shown once, as the first build met)
        for handle in ir.reachable(entry, FINAL if stage == GRAD else stage, key=_ir_name):
            if stage == GRAD:
                for sg in handle.build.grad:
                    subgraphs[sg.name] = sg
            else:
                subgraphs[handle.ir_name] = handle.subgraph(stage)
        return ir.Program(entry.forward.ir_name if stage == GRAD else entry.ir_name, subgraphs)

    def dump(self, stage=FINAL, format="text", owner=None, instances=None):
        """The IR after ``stage`` as text (``format="text"``) or Graphviz DOT (``format="dot"``).

        ``instances`` (text only): the names of the parameters every instance of a batch shares (``("self",)``,
        or ``("self", "tree")`` for a forest given with ``in_dims=None``); each op is then marked with how
        batched code runs it for a group: once, batched, per instance (with why), or by type (a callable read
        from a value the function is given: batched where its type has a rule or vmap takes it)."""
        program = self.program(stage, owner)
        if format == "text":
            if instances is None:
                return program.to_text()
            notes = instance_notes(program, tuple(instances))
            return program.to_text({op: note_text(*how) for op, how in notes.items()})
        if instances is not None:
            raise ValueError("instances= marks the text dump's ops; DOT has no place for it")
        if format == "dot":
            return program.to_dot()
        raise ValueError(f"unknown format {format!r}; use 'text' or 'dot'")

    def source(self, owner=None):
        """The generated Python source of this function (and its nested SubGraphs)."""
        owner = owner if owner is not None else self._owner
        return self.build_for(owner).code.source

    def __repr__(self):
        threads = f" threads={self.threads}" if self.mode != "sequential" else ""
        return f"<recompile.function {self.__qualname__} mode={self.mode}{threads}>"


def _ir_name(target):
    return target.ir_name


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


def _replayed(callee, args):
    """A call run again on the batched runtime, which torch.autograd records (``runtime.autograd``)."""
    return agenda.run(callee, args, 1)[0]


def _helper_forms(cf):
    """What ``runtime.helpers`` runs a compiled function ``cf`` by, as a helper: its signature, ``kind(owner)``
    (built for ``owner``, or its CompileError raised: "pure" where run again it changes and shows nothing
    twice, "unchanging" where it only changes nothing in place, else None), ``run(args, n, owner)`` giving its
    result and the ops it ran once per instance, and ``ops(owner)``, its program before fusion (the SubGraph a
    plain piece may trace in its own place: ``codegen.segments``)."""

    def kind(owner):
        callee = cf._ready_callee(owner)
        if not callee.shares_computed_once:  # (it changes something in place, or a helper it calls by name does)
            return None
        return "pure" if callee.runs_again_unseen else "unchanging"

    return cf.signature, kind, cf._run_batched, lambda owner: cf._ready_callee(owner).subgraph(UNFUSED)


# an undecorated helper, compiled for batched runs (a compiled function called as a value, a module's compiled
# forward: its own program); a compiled function a level program runs as a helper
helpers.compiler = lambda fn: _helper_forms(fn if isinstance(fn, CompiledFunction) else
                                            CompiledFunction(fn, mode="batched"))
helpers.COMPILED = (CompiledFunction,)
helpers.calling = lambda target: _helper_forms(target.function)
