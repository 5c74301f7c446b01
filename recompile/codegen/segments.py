"""Straight runs of ops in batched code, run on plain tensors once the kinds of their values are known.

In batched code every op goes through ``batch_rules``: it looks at its
arguments, picks a rule, unwraps the batched tensors and wraps the result in a
new ``Batch``. That costs a few microseconds an op, paid again at every tree
level. Most of those choices come out the same on every call: ``self.node(x)``
is a Linear on a batched matrix, ``torch.chunk(y, 5, dim=-1)`` splits one along
a feature dim, ``tree.left[i]`` gathers from a shared tensor.

A ``Segment`` is a maximal run of such ops (calls, captures, fused ops) between
the points where a unit yields, splits or loops. Its first call with more
than one instance *traces* it: each op is run by the rule it would meet, on
plain tensors (dim 0 the instance), and the line that does so is written
down, with a guard for each fact the rule relied on (a value batched or
shared, a tensor's rank and dtype, a callable's identity, a module's type and
its having no hooks). The lines are compiled into one plain function, which
later calls run instead of the op-by-op code. Ops with no such form (a lazy
value's arithmetic, an unpacking of a batch of tuples) stay calls of their
batch rule inside that function.

Only functions that change nothing in place get raw segments (or whose only
changes are appends to lists of their own, ``effects.local_appends``: their
segments leave the appends out), only ops that change nothing are traced, and
a segment ends where a walk draws an iterator's items (``draws_items``). A
guard that fails, or an error of any kind, leaves the raw function for the
op-by-op code, which runs the segment again from its start (what the raw one
computed is dropped) and raises the user's error from the user's line. A
segment whose raw function keeps failing its guards stops trying.
"""

from __future__ import annotations

import math
import operator
import re
import threading
import types

import torch
import torch.nn.functional as F
from torch import nn

from .. import config, intrinsics, ir
from ..diagnostics import tracing_at
from ..ops import facts, syntax
from ..ops.table import RuleTable, has_hooks, tensor_method
from ..runtime import batch as bt
from ..runtime import batch_rules, chosen, control, distributions, helpers, lazy_weights, sharing
from ..runtime.batch import Batch
from ..runtime.frames import annotated_by
from ..runtime.levels import Deopt, NotPlain

# a lowered ``for``'s and a starred unpacking's intrinsics, and ``sum``, ``list``, ``tuple``: they draw the items of
# an iterator (segments end at the intrinsics, ``draws_items``; the builtins end a trace where they meet one)
_DRAWING = {intrinsics.as_sequence, intrinsics.has_index, intrinsics.unpack_starred}
_ITERATION = _DRAWING | {sum, list, tuple}


def draws_items(op):
    """Whether ``op`` calls one of the intrinsics that draw an iterator's items (a lowered ``for``, a starred
    unpacking): no trace runs it (a run cut short would draw them twice), so segments end at it."""
    return isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value in _DRAWING


# ops a trace may run through their batch rule, inside the raw function: they change nothing and draw nothing,
# so a run cut short by a failed guard may run them again (not builtins such as max or tuple, which would
# consume an iterator twice)
_OPERATORS = {f for f in facts.PURE if getattr(f, "__module__", None) in ("_operator", "operator")}
_GENERIC_OK = (_OPERATORS | facts.LAZY
               | {getattr, intrinsics.build_tuple, intrinsics.build_list, intrinsics.unpack, intrinsics.check_bound,
                  intrinsics.read_global, intrinsics.read_cell}
               | set(batch_rules.BATCH.by_callable) - set(facts.IN_PLACE) - facts.DRAWS - _ITERATION
               - {operator.setitem, operator.delitem, intrinsics.hand_back}  # (``y[i] = v``, ``del xs[-1]``, a
               # call's list handed back: run again, twice)
               - {*distributions.CLASSES, *distributions.EVENT_PARAMETERS, torch.distributions.Independent,
                  torch.distributions.kl_divergence})  # (no traced value: a distribution)
_GENERIC_OK_MODULES = tuple(set(batch_rules.BATCH.by_module) - facts.DRAWS)
# (reading a Plain piece's traced lines: the names they define and read, and the instance count)
_DEFINES = re.compile(r"^([\w, ]+?) = ")
_NAMES = re.compile(r"\b[av]\d+\b")
_PLAIN_TENSORS = batch_rules.PLAIN_TENSORS
_BATCH_N = re.compile(r"\b_n\b")


def _arguments(args, kwargs):
    """The argument list of a traced call: slots ``args`` by position, then ``kwargs`` by name."""
    return ", ".join([s.name for s in args] + [f"{k}={s.name}" for k, s in kwargs.items()])


def _raised_again(exc, run, n, args):
    """``exc`` that a traced run raised, raised by ``run`` (the op-by-op code of the same pure ops) from the
    user's line; or, where it does not happen again there (a one-shot fault: a signal's timeout), as it
    was: an error is never lost."""
    run(n, *args)
    raise exc


class Segment:
    """A run of ops of a batched function: ``generic`` runs them op by op (set once the code is compiled);
    ``__call__`` runs the raw function traced from them when it applies."""

    def __init__(self, name, ops, inputs, outputs, kernels):
        self.name = name
        self.ops = ops
        self.inputs = inputs  # ir.Values, in the order of the call's arguments
        self.outputs = outputs  # ir.Values it returns (one: the value; several: a tuple)
        self.kernels = kernels  # Fused op -> FusedKernel (the very kernels of the generic code)
        self.generic = None
        self.raws = []  # raw functions, one per trace (the kinds may differ between calls: a leaf's 0.0)
        self.sources = []
        self.off = False  # no raw function: the trace met an op it cannot run raw, or too many misses
        self.traced = 0
        self.misses = 0  # calls no raw function served once config.SEGMENT_TRACES traces were made
        self.hits = 0  # calls a raw function served
        self._lock = threading.RLock()  # (a trace may read a deferred value whose call reaches it again)

    def __repr__(self):
        return f"<segment {self.name}>"

    def __call__(self, n, *args):
        if n > 1 and not self.off:
            # ops a raw function runs by their batch rule count their per-instance runs; a raw run cut short
            # is run again op by op, so its counts go in only if it finishes
            counters = batch_rules.counters
            saved = counters.per_instance
            try:
                raws = self.raws
                for k, raw in enumerate(raws):
                    counters.per_instance = {}
                    try:
                        out = raw(n, *args)
                    except Deopt:  # (a guard: the facts this trace relied on do not hold for this call)
                        continue
                    except Exception as exc:
                        if annotated_by(exc) is not None:
                            raise  # (a deferred call it read failed: that call ran, and its error names its chain)
                        counters.per_instance = saved
                        return _raised_again(exc, self.generic, n, args)
                    self.hits += 1
                    if k:  # (the trace that served last is tried first: a model checked in float64, then run in
                        # float32, runs no float64 trace up to its guard before each float32 one)
                        self.raws = [raw, *(r for r in raws if r is not raw)]
                    batch_rules.add_counts(saved, counters.per_instance)
                    return out
                counters.per_instance = {}
                traced = self._missed(n, args)
                if traced is not None:  # (the trace ran the call: its result is this call's)
                    batch_rules.add_counts(saved, counters.per_instance)
                    return traced[0]
            finally:
                counters.per_instance = saved
        return self.generic(n, *args)

    def _missed(self, n, args):
        """No raw function applies: trace one for these kinds (its result in a 1-tuple), or after too many
        misses give up (None: the op-by-op code runs the call)."""
        with self._lock:
            if self.traced < config.SEGMENT_TRACES:
                self.traced += 1
                return self._trace(n, args)
            self.misses += 1
            if self.misses >= config.SEGMENT_MISSES:
                self.raws, self.off = [], True
        return None

    def _trace(self, n, args):
        tracer = _Tracer(self, n, args)
        try:
            source, namespace = tracer.run()
        except _Untraceable:  # (raised before the op without a form ran: what ran before it changes nothing)
            self.off = True
            return None
        except Exception as exc:  # the op-by-op run raises it again, from the user's line
            if annotated_by(exc) is not None:
                raise
            return None
        namespace["_LINES"] = tracer.user_lines(source)
        code = compile(source, f"<recompile segment {self.name}>", "exec")
        exec(code, namespace)
        self.sources.append(source)
        self.raws = self.raws + [namespace["raw"]]  # (a new list: another thread may be iterating the old)
        return (tracer.result,)


class Plain:
    """A level piece's ops (``codegen.levels``) run on plain values: a batched one as its tensor (dim 0 the
    instance, one row too), a shared one as itself, with no Batch on either side. ``kinds`` says which
    inputs are batched (``B``) and which shared (``S``); each kinds gets its own trace, which also gives the
    kinds of the outputs. Only ops with a raw form, and ops of nothing batched for one instance: an op the
    batch rules would run (or a value they would hold) makes the piece untraceable for those kinds
    (``NotPlain``), and a guard that fails raises ``Deopt``; either way the caller runs the piece's batched
    code instead."""

    def __init__(self, name, ops, inputs, outputs, kernels, hands_numbers=False):
        self.name = name
        self.ops = ops
        self.inputs = inputs
        self.outputs = outputs  # ir.Values or Consts
        self.kernels = kernels
        # whether its outputs may be rows standing for Python ints or bools (kind N): a piece whose outputs only
        # other pieces read (the predicate and the calls' arguments), never the function's results
        self.hands_numbers = hands_numbers
        # input kinds -> its traces [(prep, body, output kinds, positions of the shared inputs)]: more than one
        # where a Cond of shared predicate took another branch (``_Tracer.cond``)
        self.traces = {}
        self.sources = []
        self.refused = set()  # input kinds it has no plain form for
        self.numbers = frozenset()  # positions where a call gave rows standing for numbers (kind N)
        self.conds = {}  # its Conds of each instance's own predicate -> RowsCond
        read = {id(v) for op in ops for v in op.operands()} | {id(v) for v in outputs}
        # positions of the inputs no op reads (a leaf branch's ``depth``): requests joined for the piece may
        # differ there without being made rows
        self.unread = frozenset(k for k, v in enumerate(inputs) if id(v) not in read)

    def __repr__(self):
        return f"<plain piece {self.name}>"

    def __call__(self, n, kinds, args, prepared=None):
        """(outputs, their kinds) of the piece on ``args``. ``prepared`` (a dict a level run keeps for its
        duration, in which pure code changes no attribute or global) holds what ``prep`` gave for the shared
        inputs of the last call, reused while they are the same objects. A trace whose guard fails gives way
        to the next; where none holds, a new one is traced (the piece is pure: what ran is dropped)."""
        if self.numbers and "B" in kinds:  # (a trace of rows standing for numbers serves tensors' rows too)
            kinds = tuple("N" if k == "B" and j in self.numbers else k for j, k in enumerate(kinds))
        entries = self.traces.get(kinds, ())
        for k, entry in enumerate(entries):
            try:
                out = self._run(entry, n, args, prepared)
            except Deopt:
                if k == len(entries) - 1 and len(entries) >= config.SEGMENT_TRACES:
                    raise  # (no trace held, and no more may be made)
                continue
            if k:  # (the trace that held goes first next time: a run's depths mostly take the same branch)
                self.traces[kinds] = [entry] + [e for e in entries if e is not entry]
            return out, entry[2]
        if kinds in self.refused:
            raise NotPlain(self.name)
        return self._trace(n, kinds, args)

    def _run(self, entry, n, args, prepared):
        prep, body, _, shared = entry
        mine = prepared.get(prep) if prepared is not None else None  # (per trace: a run may use two)
        if mine is not None:
            for i, x in zip(shared, mine[0]):
                if args[i] is not x:
                    break
            else:
                return body(n, mine[1], *args)
        values = [args[i] for i in shared]
        mine = (values, prep(*values))
        if prepared is not None:
            prepared[prep] = mine
        return body(n, mine[1], *args)

    def _trace(self, n, kinds, args):
        if sum(map(len, self.traces.values())) >= config.SEGMENT_TRACES:
            raise NotPlain(self.name)
        if "N" in kinds:
            self.numbers = self.numbers | {j for j, k in enumerate(kinds) if k == "N"}
        tracer = _Tracer(self, n, args, plain=kinds)
        try:
            source, namespace = tracer.run()
        except _Untraceable:
            self.refused.add(kinds)
            raise NotPlain(self.name) from None
        except Exception as exc:  # (the program's error, or the tracer's: the run on Batch values tells)
            if annotated_by(exc) is not None:
                raise
            raise Deopt(self.name) from exc
        namespace["_LINES"] = tracer.user_lines(source)
        exec(compile(source, f"<recompile plain piece {self.name}>", "exec"), namespace)
        self.sources.append(source)
        shared = [i for i, k in enumerate(kinds) if k == "S"]
        entry = (namespace["prep"], namespace["body"], tracer.out_kinds, shared)
        self.traces[kinds] = self.traces.get(kinds, []) + [entry]  # (a new list: a run may be iterating it)
        return tracer.result, tracer.out_kinds


# What a number standing as rows may meet (``_Tracer.numbers``)
_NUMBER_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.truediv,
                                *intrinsics.AUGMENTED_FRESH.values()})


class RowsCond:
    """A Cond of each instance's own predicate in a plain piece: each branch a ``Plain`` of its own, run on the
    rows that take it (all of them, or none, without a gather), the outputs joined back in the rows' order
    (``cat``, then ``index_select``). A joined output is batched where either branch's is; a shared one then
    takes its rows only where it is a tensor of the rows' shape and dtype (a Python number is the instance's
    own value: ``NotPlain``); outputs of other kinds than the trace's, or of another rank or dtype, raise
    ``Deopt``."""

    def __init__(self, name, op, kernels):
        self.branches = tuple(Plain(f"{name}.{side}", sg.ops, sg.inputs, sg.outputs, kernels)
                              for side, sg in (("then", op.then_sg), ("else", op.else_sg)))

    def __call__(self, n, mask, kinds, args, out_kinds):
        """(outputs, their kinds) for ``n`` rows whose truths are ``mask``; ``out_kinds`` the trace's, or None
        while tracing."""
        truth = mask if mask.dtype is torch.bool else mask != 0  # (``bool(t)``: NaN is true)
        taken = truth.nonzero().view(-1)
        count = taken.shape[0]
        if count in (0, n):
            outs, got = self.branches[count == 0](n, kinds, args)
            outs = list(outs)
        else:
            rest = (~truth).nonzero().view(-1)
            sides = [branch(len(rows), kinds, [a.index_select(0, rows) if k == "B" else a
                                               for a, k in zip(args, kinds)])
                     for branch, rows in zip(self.branches, (taken, rest))]
            order = torch.cat([taken, rest])
            back = torch.empty_like(order)
            back[order] = torch.arange(n, device=order.device)
            outs, got = [], []
            for j in range(len(sides[0][0])):
                parts = [(side[0][j], side[1][j]) for side in sides]
                outs.append(_joined(parts, (count, n - count), back))
                got.append("B" if any(k == "B" for _, k in parts) else "S")
        if out_kinds is not None and tuple(got) != out_kinds:
            raise Deopt
        return outs, tuple(got)


def _joined(parts, counts, back):
    """One output of a RowsCond's two branches ``parts`` ((value, kind) of ``counts`` rows each) in the rows'
    order (``back``)."""
    if all(k == "S" for _, k in parts):
        if parts[0][0] is not parts[1][0]:
            raise NotPlain("a value each branch gives its own of")
        return parts[0][0]
    like = next(v for v, k in parts if k == "B")
    rows = []
    for (v, k), c in zip(parts, counts):
        if k == "S":
            if type(v) not in _PLAIN_TENSORS or v.shape != like.shape[1:]:
                raise NotPlain("a shared value joined with rows")
            v = v.expand(c, *v.shape)
        if v.dtype != like.dtype or v.shape[1:] != like.shape[1:]:
            raise Deopt
        rows.append(v)
    return torch.cat(rows).index_select(0, back)


class _Untraceable(Exception):
    """An op of the segment has no raw form: the segment runs op by op."""


class _Slot:
    """A value of the trace: ``kind`` S (shared: a plain value), B (batched: a plain tensor, dim 0 the
    instance), T (a tuple or list built in the segment: ``items`` are slots), O (a Batch, handled by the
    batch rules), M (a method of a batched tensor: ``value`` is (its B slot, the name), for the call that
    follows) or C (each row's pick from a shared list of callables: ``value`` is the callables, ``items`` the B
    slot of the indices, for the call that follows); ``name`` holds it in the raw function; ``value`` is this
    call's."""

    __slots__ = ("kind", "name", "value", "items", "as_b", "fixed", "number")

    def __init__(self, kind, name, value, items=None, fixed=False):
        self.kind, self.name, self.value, self.items = kind, name, value, items
        self.fixed = fixed  # a constant of the program: the same on every call
        self.as_b = None  # (an O slot) its tensor, once a raw op needed it
        self.number = False  # (a B slot of a plain piece's input of kind N) rows standing for Python floats


class _Tracer:
    def __init__(self, segment, n, args, plain=None):
        self.segment = segment
        self.n = n
        self.args = args
        self.plain = plain  # (a Plain piece's trace) the kinds of its inputs
        self.out_kinds = None
        self.lines = []
        self.loc = None  # (the op being traced: the user's line of the lines it emits)
        self.line_locs = {}  # a line's text -> the user's Location of the op that emitted it
        self.namespace = dict(_HELPERS)
        self.env = {}
        self.count = 0
        self.builds = set()  # names of the tuples and lists the trace built (dropped where nothing reads them)

    # -- names and lines

    def fresh(self):
        self.count += 1
        return f"v{self.count}"

    def const(self, value):
        name = f"k{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def emit(self, line):
        self.lines.append(line)
        if self.loc is not None:
            self.line_locs.setdefault(line, self.loc)

    def user_lines(self, source):
        """{line of ``source``: (file, line) of the user's op it runs}: what a warning raised from the traced
        code names (``diagnostics.user_line``), where the frame's own line is the generated source's."""
        out = {}
        for k, line in enumerate(source.splitlines(), 1):
            loc = self.line_locs.get(line.strip())
            if loc is not None:
                out[k] = (loc.filename, loc.lineno)
        return out

    def load(self, operand):
        """The slot of an operand: a Value's, or a constant's (shared)."""
        if isinstance(operand, ir.Value):
            return self.env[operand]
        value = operand.value
        if type(value) in (int, bool, str, type(None)) or (type(value) is float and math.isfinite(value)):
            return _Slot("S", repr(value), value, fixed=True)  # (a literal: repr reads back as the same value)
        return _Slot("S", self.const(value), value, fixed=True)

    def as_b(self, slot):
        """``slot`` as a batched plain tensor (a Batch's tensor, guarded), or None if it has none."""
        if slot.kind == "B":
            return slot
        if slot.kind != "O":
            return None
        if slot.as_b is None:
            value = slot.value
            if type(value) is not Batch:  # (one instance's own, in a plain piece: ``result``)
                t = value.unsqueeze(0) if type(value) is torch.Tensor else None
            elif bt.is_lazy(value):  # (reading it would run a deferred call early: the rule keeps it lazy)
                return None
            else:
                t = bt.tensor_of(value)
            if t is None:
                return None
            name = self.fresh()
            if self.plain is not None:  # (a depth of one instance holds its own values)
                self.emit(f"{name} = _rows_of(_n, {slot.name}, {t.dim()}, {self.const(t.dtype)})")
            else:
                self.emit(f"{name} = _tensor({slot.name}, {t.dim()}, {self.const(t.dtype)})")
            slot.as_b = _Slot("B", name, t)
        return slot.as_b

    def as_batch(self, slot):
        """An expression holding ``slot`` as the batch rules take it (a Batch, or a plain value)."""
        if slot.kind in ("M", "C"):
            raise _Untraceable  # (a method of a batched tensor, or each row's pick, not called at once)
        if slot.kind == "B":
            return f"_wrap({slot.name})"
        if slot.kind == "T":
            items = ", ".join(self.as_batch(s) for s in slot.items)
            return f"_struct({self.const(_struct_class(slot.value))}, [{items}], _n)"
        return slot.name

    def wrapped_value(self, slot):
        """This call's value of ``slot`` as the batch rules take it."""
        if slot.kind in ("M", "C"):
            raise _Untraceable
        if slot.kind == "B":
            return bt.from_tensor(slot.value)
        if slot.kind == "T":
            return _struct(_struct_class(slot.value), [self.wrapped_value(s) for s in slot.items], self.n)
        return slot.value

    def guard_shared(self, slot):
        """A shared value the trace read (a tensor's rank and dtype where it used it as one)."""
        if isinstance(slot.value, torch.Tensor):
            self.emit(f"_shared_tensor({slot.name}, {slot.value.dim()}, {self.const(slot.value.dtype)})")

    # -- the trace

    def run(self):
        seg = self.segment
        params = []
        for k, (v, a) in enumerate(zip(seg.inputs, self.args)):
            name = f"a{k}"
            params.append(name)
            if self.plain is not None:
                if type(self.plain[k]) is tuple:  # (a struct: the tuple of its elements)
                    self.env[v] = self.struct_input(name, a, self.plain[k])
                elif self.plain[k] in ("B", "N"):
                    self.env[v] = _Slot("B", name, a)
                    self.env[v].number = self.plain[k] == "N"
                    self.emit(f"if {name}.dim() != {a.dim()} or {name}.dtype is not {self.const(a.dtype)}: "
                              "raise _Deopt")
                else:
                    self.env[v] = _Slot("S", name, a)
            elif type(a) is Batch:
                self.env[v] = _Slot("O", name, a)
            else:
                self.env[v] = _Slot("S", name, a)
                self.emit(f"if type({name}) is _Batch: raise _Deopt")
        for op in seg.ops:
            self.op(op)
        if self.plain is not None:
            return self.plain_return(params)
        values = [self.wrapped_value(self.env[v]) for v in seg.outputs]
        self.result = values[0] if len(values) == 1 else tuple(values)
        outs = [self.as_batch(self.env[v]) for v in seg.outputs]
        ret = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
        if not outs:
            ret = "None"
        body = "\n".join("    " + line for line in self.unread_dropped(f"return {ret}") + [f"return {ret}"])
        source = f"def raw(_n{''.join(', ' + p for p in params)}):\n{body}\n"
        return source, self.namespace

    def struct_input(self, name, value, kind):
        """The T slot of a plain piece's struct input ``name`` (the tuple of its elements, of ``kind``: ("T", its
        class, its elements' kinds)), its elements guarded as a B input is; its value the struct as the program
        sees it (``obj.h`` of a namedtuple, ``d["h"]`` of a dict)."""
        _, struct, kinds = kind
        self.emit(f"if type({name}) is not tuple or len({name}) != {len(kinds)}: raise _Deopt")
        items = []
        for j, (k, v) in enumerate(zip(kinds, value)):
            item = _Slot("B" if k in ("B", "N") else "S", f"{name}[{j}]", v)
            if k in ("B", "N"):
                item.number = k == "N"
                self.emit(f"if {name}[{j}].dim() != {v.dim()} or {name}[{j}].dtype is not {self.const(v.dtype)}: "
                          "raise _Deopt")
            items.append(item)
        return _Slot("T", name, bt.build(struct, list(value)), items)

    def plain_return(self, params):
        """A Plain piece's code, in two functions: ``prep(*shared inputs)`` runs the lines that read nothing
        batched (globals, attributes of shared values, the guards on them) and returns what the rest reads of
        theirs; ``body(_n, prep's result, *inputs)`` runs the rest and returns the outputs as they are, each
        batched or shared. A level run calls ``prep`` once for the depths whose shared inputs are the same
        objects (``Plain.__call__``)."""
        slots = [self.load(v) for v in self.segment.outputs]
        if any(s.kind not in ("B", "S") and _handed_struct(s) is None
               or s.number and not (self.segment.hands_numbers and _whole(s)) for s in slots):
            raise _Untraceable  # (a number's rows given on: where the function's values are each instance's)
        self.out_kinds = tuple(_handed_struct(s) if s.kind == "T" else "N" if s.number else s.kind for s in slots)
        self.result = tuple(tuple(i.value for i in s.items) if s.kind == "T" else s.value for s in slots)
        ret = "return (" + "".join(_handed_text(s) + ", " for s in slots) + ")"
        batched = {p for p, k in zip(params, self.plain) if k != "S"}
        shared, rest, made = [], [], []
        for line in self.unread_dropped(ret):
            defines = _DEFINES.match(line)
            names = [x.strip() for x in defines.group(1).split(",") if x.strip()] if defines else []
            if _BATCH_N.search(line) or any(x in batched for x in _NAMES.findall(line)):
                batched.update(names)
                rest.append(line)
            else:
                made.extend(names)
                shared.append(line)
        read = set(_NAMES.findall("\n".join(rest + [ret])))
        handed = [x for x in made if x in read]
        hand = "(" + "".join(x + ", " for x in handed) + ")"
        prep = "\n".join("    " + line for line in shared + [f"return {hand}"])
        body = "\n".join("    " + line for line in ([f"{hand} = _prep"] if handed else []) + rest + [ret])
        shared_params = [p for p, k in zip(params, self.plain) if k == "S"]
        return (f"def prep({', '.join(shared_params)}):\n{prep}\n\n"
                f"def body(_n, _prep{''.join(', ' + p for p in params)}):\n{body}\n"), self.namespace

    def unread_dropped(self, ret):
        """The trace's lines less the tuples and lists it built that no other line, nor ``ret``, reads (a
        ``cat`` of a list names its items itself)."""
        if not self.builds:
            return self.lines
        defined = [(m.group(1).strip() if (m := _DEFINES.match(line)) else None) for line in self.lines]
        read = set(_NAMES.findall("\n".join([ret] + [line if name is None else line.split("=", 1)[1]
                                                       for line, name in zip(self.lines, defined)])))
        return [line for line, name in zip(self.lines, defined) if name not in self.builds or name in read]

    def define(self, value, slot):
        self.env[value] = slot

    def op(self, op):
        self.loc = op.loc
        if op.loc is None or isinstance(op, ir.Cond):  # (a branch's ops say their own lines)
            return self.op_here(op)
        with tracing_at(op.loc.filename, op.loc.lineno):
            return self.op_here(op)

    def op_here(self, op):
        if any(isinstance(x, ir.Value) and x in self.env and self.env[x].number for x in op.operands()) and not (
                isinstance(op, ir.Fused) and self.segment.kernels[op].backend == "python"):
            self.numbers(op)  # (a fused op's members are traced one by one, each checked here)
        if isinstance(op, ir.Capture):
            return self.capture(op)
        if isinstance(op, ir.Fused):
            return self.fused(op)
        if isinstance(op, ir.Call):
            return self.call(op)
        if isinstance(op, ir.Cond):
            return self.cond(op)
        raise _Untraceable

    def numbers(self, op):
        """An op reading rows that stand for Python numbers (an input of kind N: a leaf's ``loss = 0.0`` joined
        with the nodes' losses; ``int(t)``, ``bool(t)``): an index of what is no number, ``x[i]`` of an int's rows
        (the row the int reads), and, of floats', only ``+``, ``-``, ``*`` and ``t / v`` with a floating tensor
        of their dtype, whose result is a tensor as eager's is, of the same value and dtype; anything else (a
        type test, ``.item()``, ``torch.add(v, t)``, which eager refuses, ``i + 1`` of an int, which eager keeps
        an int) is untraceable, and the run goes on Batch values. (An int's or a bool's rows may be handed on as
        a piece's output where ``Plain.hands_numbers``: the predicate, the calls' arguments.)"""
        if not (isinstance(op, ir.Call) and len(op.args) == 2 and not op.kwargs and not op.star):
            raise _Untraceable
        fn = op.fn.value if isinstance(op.fn, ir.Const) else self.env[op.fn].value  # (a fused member's: an input)
        slots = [self.load(a) for a in op.args]
        if fn is operator.getitem and not slots[0].number and slots[1].number \
                and slots[1].value.dtype in (torch.long, torch.int):
            return  # (``tree.left[i]`` of each instance's int: the same row as the int's)
        if not facts.among(fn, _NUMBER_ARITHMETIC) or not all(s.value.is_floating_point() for s in slots
                                                               if s.number) or \
                getattr(fn, "out_of_place", fn) is operator.truediv and slots[0].number:
            raise _Untraceable  # (``v / t`` is ``t.reciprocal() * v`` in eager: not one division)
        numbers = [s for s in slots if s.number]
        others = [self.as_b(s) if s.kind == "O" else s for s in slots if not s.number]  # (a rule's Batch result)
        if len(numbers) != 1 or len(others) != 1 or others[0] is None or others[0].kind not in ("B", "S") or \
                not isinstance(others[0].value, torch.Tensor) or others[0].value.dtype is not numbers[0].value.dtype:
            raise _Untraceable

    def cond(self, op):
        """A Cond whose predicate every instance shares (``depth < MAX_DEPTH and p > 0.5``, the ``and`` at one
        depth): the branch this call takes, inline, behind a guard that the predicate's truth is the traced
        one (the other branch is another trace of the piece, made when a call takes it). In a plain piece, a
        predicate of each instance's own runs each branch on its rows (``RowsCond``)."""
        pred = self.load(op.pred)
        if pred.kind != "S":
            if self.plain is None:
                raise _Untraceable
            return self.rows_cond(op, pred)
        try:
            truth = bool(pred.value)
        except Exception:  # (the op-by-op run raises it from the user's line)
            raise _Untraceable from None
        if not pred.fixed:
            self.emit(f"if bool({pred.name}) is not {truth}: raise _Deopt")
        branch = op.then_sg if truth else op.else_sg
        for param, arg in zip(branch.inputs, op.args):
            self.define(param, self.load(arg))
        for inner in branch.ops:
            self.op(inner)
        for out, result in zip(op.outputs, branch.outputs):
            self.define(out, self.load(result))

    def rows_cond(self, op, pred):
        """``if c.norm() > 5.0:`` of each instance's own predicate, in a plain piece: one line calling the
        Cond's ``RowsCond`` on the rows' truths and the branch arguments (batched ones as tensors of rows)."""
        mask = self.as_b(pred)
        if mask is None or mask.value.dim() != 1:
            raise _Untraceable  # (a truth that is no 0-d tensor per instance: the Batch run raises or decides)
        slots = [self.as_b(s) if s.kind == "O" else s for s in map(self.load, op.args)]
        if any(s is None or s.kind not in ("B", "S") for s in slots):
            raise _Untraceable
        kinds = tuple(s.kind for s in slots)
        conds = self.segment.conds
        if op not in conds:
            conds[op] = RowsCond(f"{self.segment.name}.{op.then_sg.name}", op, self.segment.kernels)
        try:
            values, out_kinds = conds[op](self.n, mask.value, kinds, [s.value for s in slots], None)
        except NotPlain:
            raise _Untraceable from None
        names = [self.fresh() for _ in op.outputs]
        call = (f"{self.const(conds[op])}(_n, {mask.name}, {kinds!r}, [{', '.join(s.name for s in slots)}], "
                f"{out_kinds!r})[0]")
        self.emit(f"{''.join(x + ', ' for x in names)}= {call}" if names else call)
        for out, name, value, kind in zip(op.outputs, names, values, out_kinds):
            self.define(out, _Slot(kind, name, value))

    def capture(self, op):
        if op.source_kind == "attr":
            base = self.load(op.base)
            if base.kind != "S":
                raise _Untraceable
            return self.shared_attr(op.outputs[0], base, op.source)
        helper = intrinsics.read_global if op.source_kind == "global" else intrinsics.read_cell
        value = helper(op.source, op.name)
        name = self.fresh()
        self.emit(f"{name} = {self.const(helper)}({self.const(op.source)}, {op.name!r})")
        self.define(op.outputs[0], _Slot("S", name, value))

    def shared_attr(self, out, base, attr):
        value = getattr(base.value, attr)
        name = self.fresh()
        self.emit(f"{name} = {base.name}.{attr}" if attr.isidentifier() else f"{name} = getattr({base.name}, {attr!r})")
        self.define(out, _Slot("S", name, value))

    def callable_slot(self, op):
        """The slot of the op's callable, and its value: a constant, or a shared value the raw function
        checks is still the same (a module: of the same type, with no hooks)."""
        if isinstance(op.fn, ir.Const):
            return op.fn.value, None
        slot = self.env[op.fn]
        if slot.kind != "S":
            raise _Untraceable  # (a method of a batched tensor, a callable per instance)
        return slot.value, slot

    def guard_callable(self, fn, slot):
        # (a module of torch's, or one whose forward the piece traced in its place: of that class, with no hook added
        # later)
        module = type(fn) in _PLAIN_MODULES or type(fn) in _GENERIC_OK_MODULES or helpers.runs(fn)[1] is fn
        if slot is None:
            if module:
                self.emit(f"if not _plain_module({self.const(fn)}, {self.const(type(fn))}): raise _Deopt")
            return
        if module:
            self.emit(f"if not _plain_module({slot.name}, {self.const(type(fn))}): raise _Deopt")
        elif tensor_method(fn) is not None and type(fn.__self__) in _PLAIN_TENSORS:
            # (``w.t``: a bound method is made anew at each read; torch's method of a plain tensor, by name)
            self.emit(f"if type({slot.name}) is not {self.const(type(fn))} or type({slot.name}.__self__) not in "
                      f"_PLAIN_TENSORS or {slot.name}.__name__ != {fn.__name__!r}: raise _Deopt")
        elif type(fn) is types.MethodType:  # (``self.node_loss``: made anew at each read; its function and class)
            self.emit(f"if type({slot.name}) is not _MethodType or {slot.name}.__func__ is not "
                      f"{self.const(fn.__func__)} or type({slot.name}.__self__) is not "
                      f"{self.const(type(fn.__self__))}: raise _Deopt")
        else:
            self.emit(f"if {slot.name} is not {self.const(fn)}: raise _Deopt")

    def call(self, op):
        if op.star or any(k is None for k, _ in op.kwargs) or not op.outputs:
            raise _Untraceable
        if isinstance(op.fn, ir.Value) and self.env[op.fn].kind == "M":
            return self.method_call(op, self.env[op.fn])
        if isinstance(op.fn, ir.Value) and self.env[op.fn].kind == "C":
            return self.chosen_call(op, self.env[op.fn])
        fn, fn_slot = self.callable_slot(op)
        args = [self.load(a) for a in op.args]
        kwargs = {k: self.load(v) for k, v in op.kwargs}
        if any(s.kind != "S" for s in kwargs.values()):
            return self.generic(op, fn, fn_slot, args, kwargs)
        if fn is intrinsics.unpack:
            return self.unpack(op, args[0])
        if len(op.outputs) > 1:  # a call whose result is unpacked at once
            value = self.raw_call(op, fn, fn_slot, args, kwargs)
            return self.unpack(op, value)
        self.define(op.outputs[0], self.raw_call(op, fn, fn_slot, args, kwargs))

    def method_call(self, op, method):
        """``x.name(*args)`` of a batched tensor ``x`` (an M slot): the method on the batched tensor, a dim it
        takes moved past the instance dim (``_METHODS``); its arguments shared, a dim a constant."""
        base, name = method.value
        args = [self.load(a) for a in op.args]
        kwargs = {k: self.load(v) for k, v in op.kwargs}
        if name == "item" and not args and not kwargs and self.plain is not None and len(op.outputs) == 1 \
                and isinstance(base.value, torch.Tensor):
            # (``t.item()`` of each instance's one integer or bool element: as ``int(t)``, ``bool(t)``)
            slot = _python_number_form(self, bool if base.value.dtype is torch.bool else int, None, [base], {})
            if slot is not None:
                return self.define(op.outputs[0], slot)
        if name not in _METHODS:  # (``_by_method_rule``)
            if len(op.outputs) != 1:
                raise _Untraceable
            slot = self.rule_call(f"_method(_n, {base.name}, {name!r})", _method(self.n, base.value, name), args,
                                  kwargs)
            return self.define(op.outputs[0], self.plain_slot(slot) if self.plain is not None else slot)
        if len(op.outputs) != 1 or any(a.kind != "S" for a in (*args, *kwargs.values())):
            raise _Untraceable
        if name in _SPLITTING:
            for a in args[:1]:  # (how many pieces: the pieces' count must be this call's)
                self.guard_equal(a)
        dim_at, every = _METHODS[name]
        texts = [a.name for a in args]
        values = [a.value for a in args]
        kw_texts = {k: a.name for k, a in kwargs.items()}
        kw_values = {k: a.value for k, a in kwargs.items()}
        rank = base.value.dim()
        if dim_at is not None:
            if not batch_rules.dims_shift(base.value, name):
                raise _Untraceable
            if "dim" in kwargs:
                where, dim = "dim", kwargs["dim"]
            elif len(args) > dim_at:
                where, dim = dim_at, args[dim_at]
            elif every and rank > 1:  # (x.sum(): over every dim of the instance)
                where, dim = "dim", _Slot("S", repr(tuple(range(rank - 1))), tuple(range(rank - 1)), fixed=True)
            elif name in _SPLITTING:  # (``z.chunk(3)``: along the instance's first dim, the default)
                where, dim = "dim", _Slot("S", "0", 0, fixed=True)
            else:
                raise _Untraceable
            if not dim.fixed or type(dim.value) not in (int, tuple):
                raise _Untraceable  # (a dim computed at run time: the shift would be this call's)
            shifted = batch_rules.shift_dim(dim.value)
            if where == "dim":
                kw_texts["dim"], kw_values["dim"] = repr(shifted), shifted
            else:
                texts[where], values[where] = repr(shifted), shifted
        elif name in ("view", "reshape"):
            shape = values[0] if len(values) == 1 and type(values[0]) in (tuple, list) else values
            if kwargs or not all(type(d) is int for d in shape):
                raise _Untraceable
            for a in args:  # (a size computed at run time, ``view(3, H)``: this call's, guarded)
                self.guard_equal(a)
            name, texts, values = "reshape", [f"({base.name}.shape[0], {', '.join(map(repr, shape))}, )"], \
                [(base.value.shape[0], *shape)]
        elif args or kwargs:
            raise _Untraceable
        value = getattr(base.value, name)(*values, **kw_values)
        out = self.fresh()
        arg_text = ", ".join(texts + [f"{k}={t}" for k, t in kw_texts.items()])
        if name in _SPLITTING and type(value) is tuple and all(type(v) is torch.Tensor for v in value):
            self.emit(f"{out} = {base.name}.{name}({arg_text})")
            self.emit(f"if len({out}) != {len(value)}: raise _Deopt")
            self.define(op.outputs[0], _Slot("T", out, value, [_Slot("B", f"{out}[{j}]", v)
                                                                for j, v in enumerate(value)]))
            return
        if type(value) is not torch.Tensor:
            raise _Untraceable
        self.emit(f"{out} = {base.name}.{name}({arg_text})")
        self.define(op.outputs[0], _Slot("B", out, value))

    def guard_equal(self, slot):
        """A shared value the trace relied on, the same on every call (its type too, ``1`` is not ``True``)
        unless a constant of the program; a list is compared with a copy of it as traced."""
        if not slot.fixed:
            value = slot.value
            if type(value) is list and all(facts.immutable(v) for v in value):
                value = _Traced(value)
            elif not facts.immutable(value):
                raise _Untraceable
            self.emit(f"if not _same({slot.name}, {self.const(value)}): raise _Deopt")

    def raw_call(self, op, fn, fn_slot, args, kwargs):
        """The slot of ``fn(*args, **kwargs)``: a raw form where one applies, else the batch rule's call."""
        if "inplace" in kwargs or getattr(fn, "inplace", False) is True:
            raise _Untraceable  # (it changes its argument: a run cut short could not be run again)
        if all(s.kind == "S" for s in args) and _shareable(fn):
            return self.shared_call(fn, fn_slot, args, kwargs)
        if all(s.kind == "S" for s in args) and (self.plain is not None or sharing.state.fresh) and (
                facts.among(fn, _OPERATORS) or batch_rules.computes_alike(fn, {k: s.value for k, s in kwargs.items()})):
            # a torch op (or ``a * b``) of shared values, in a run that changes nothing in place: once, shared (a
            # level run changes nothing in place; a segment checks its run's sharing)
            if self.plain is None:
                self.emit("if not _sharing.fresh: raise _Deopt")
            slot = self.shared_call(fn, fn_slot, args, kwargs)
            if not sharing.shareable_result(slot.value):
                raise _Untraceable  # (a result each instance must have its own of: the batch rule's)
            if not facts.immutable(slot.value) and not sharing.handed_back(slot.value, fn, [a.value for a in args]):
                # (so that Python code run per instance, and each instance's result after the first, copies it)
                self.emit(f"_mark_fresh({slot.name})")
                sharing.mark_fresh(slot.value)  # (this run's too)
            return slot
        form = _namedtuple_form if bt.plain_namedtuple(fn) else _form_of(fn)
        if form is not None and all(s.kind == "S" for s in args):
            form = None  # (nothing batched: the batch rule decides whether every instance may share it)
        if form is not None:
            slot = form(self, fn, fn_slot, args, kwargs)
            if slot is not None:
                return slot
        return self.generic_slot(op, fn, fn_slot, args, kwargs)

    def shared_call(self, fn, fn_slot, args, kwargs):
        """A call of nothing batched whose result every instance shares (``facts.SHAREABLE``)."""
        self.guard_callable(fn, fn_slot)
        fn_name = fn_slot.name if fn_slot is not None else self.const(fn)
        value = fn(*[s.value for s in args], **{k: s.value for k, s in kwargs.items()})
        name = self.fresh()
        self.emit(f"{name} = {fn_name}({_arguments(args, kwargs)})")
        return _Slot("S", name, value)

    def chosen_call(self, op, picked):
        """``self.ops[k](x)`` of a C slot: each distinct callable once, by its batch rule, on the rows that picked
        it, the results' rows joined in row order (``chosen.rows_grouped``; its arguments batched rows or
        shared, its keywords shared)."""
        args = [self.load(a) for a in op.args]
        kwargs = {k: self.load(v) for k, v in op.kwargs}
        if len(op.outputs) != 1 or any(s.kind != "S" for s in kwargs.values()):
            raise _Untraceable
        raw = [self.as_b(s) if s.kind == "O" else s for s in args]
        if any(s is None or s.kind not in ("B", "S") or s.number for s in raw):
            raise _Untraceable
        batched = tuple(s.kind == "B" for s in raw)
        if not any(batched):
            raise _Untraceable
        (index,) = picked.items
        value = chosen.rows_grouped(self.n, picked.value, index.value, [s.value for s in raw], batched,
                                    {k: s.value for k, s in kwargs.items()}, batch_rules.call)
        if value is None:
            raise Deopt(self.segment.name)  # (an index out of range: the run on Batch values raises it)
        if value is NotImplemented:
            raise _Untraceable
        name = self.fresh()
        kw_text = ", ".join(f"{k!r}: {s.name}" for k, s in kwargs.items())
        self.emit(f"{name} = _grouped(_n, {picked.name}, {index.name}, ({''.join(s.name + ', ' for s in raw)}), "
                  f"{batched!r}, {{{kw_text}}})")
        self.emit(f"if {name}.dim() != {value.dim()} or {name}.dtype is not {self.const(value.dtype)}: raise _Deopt")
        self.define(op.outputs[0], _Slot("B", name, value))

    def generic(self, op, fn, fn_slot, args, kwargs):
        slot = self.generic_slot(op, fn, fn_slot, args, kwargs)
        if len(op.outputs) > 1:
            return self.unpack(op, slot)
        self.define(op.outputs[0], slot)

    def generic_slot(self, op, fn, fn_slot, args, kwargs):
        """``fn`` run by its batch rule (``batch_rules.call``), inside the raw function (a plain piece has no
        batch rule: a call of shared values only, shared where pure, else for one instance)."""
        if self.plain is not None:
            if any(s.kind != "S" for s in (*args, *kwargs.values())):
                inlined = self.inline_helper(fn, fn_slot, args, kwargs)
                if inlined is not None:
                    return inlined
                # (an op with no raw form: its batch rule on the batched tensors wrapped, as in a segment)
                if not (rerunnable(fn) or draws_per_element(fn, args)):
                    raise _Untraceable
                return self.plain_slot(self.by_rule(fn, fn_slot, args, kwargs))
            if fn is intrinsics.build_list and not kwargs:  # (a list of shared values: torch ops read it)
                return self.shared_call(fn, fn_slot, args, kwargs)
            if _pure(fn) and type(fn(*[a.value for a in args], **{k: a.value for k, a in kwargs.items()})) \
                    in facts.IMMUTABLE:  # (every instance shares it, as batch_rules._unbatched decides)
                slot = self.shared_call(fn, fn_slot, args, kwargs)
                self.emit(f"if type({slot.name}) is not {self.const(type(slot.value))}: raise _Deopt")
                return slot
            if self.n != 1 or not rerunnable(fn):
                raise _Untraceable
            self.emit("if _n != 1: raise _Deopt")  # (for one instance: its own call)
            return self.shared_call(fn, fn_slot, args, kwargs)
        if not (rerunnable(fn) or draws_per_element(fn, args)):
            raise _Untraceable
        return self.by_rule(fn, fn_slot, args, kwargs)

    def inline_helper(self, fn, fn_slot, args, kwargs):
        """An undecorated helper of the user's that changes and shows nothing (``runtime.helpers``), traced in the
        piece's own place: its ops, before fusion, on these slots (no nested run per depth); None where it is
        no such helper, or has an op with no plain form (the lines it traced are dropped)."""
        found = helpers.inlined(fn)
        if found is None:
            return None
        sg, signature = found
        mark, builds, env, loc = len(self.lines), set(self.builds), dict(self.env), self.loc
        slots = list(args)
        held = fn_slot.name if fn_slot is not None else self.const(fn)
        if type(fn) is types.MethodType:  # (its object, read from the bound method the piece holds)
            name = self.fresh()
            self.emit(f"{name} = {held}.__self__")
            slots.insert(0, _Slot("S", name, fn.__self__))
        elif helpers.runs(fn)[1] is fn:  # (a module, its forward's self)
            slots.insert(0, _Slot("S", held, fn))
        try:
            bound = signature.bind(*slots, **kwargs)  # (the slots themselves, bound as Python binds the values)
        except TypeError:
            del self.lines[mark:]
            return None
        bound.apply_defaults()
        slots = [v if type(v) is _Slot else self.load(ir.Const(v)) for v in bound.arguments.values()]
        self.guard_callable(fn, fn_slot)
        try:
            for param, slot in zip(sg.inputs, slots):
                self.define(param, slot)
            for inner in sg.ops:
                self.op(inner)
            out = self.load(sg.outputs[0])
        except _Untraceable:
            del self.lines[mark:]
            self.builds, self.env = builds, env
            return None
        finally:
            self.loc = loc
        return out

    def by_rule(self, fn, fn_slot, args, kwargs):
        """``fn`` run by its batch rule (``batch_rules.call``) on the arguments as Batch values."""
        self.guard_callable(fn, fn_slot)
        fn_name = fn_slot.name if fn_slot is not None else self.const(fn)
        if self.plain is not None:  # (a plain piece runs depths of one row too)
            return self.rule_call(fn_name, fn, args, kwargs)
        arg_text = "".join(self.as_batch(s) + ", " for s in args)
        values = tuple(self.wrapped_value(s) for s in args)
        kw = {k: self.wrapped_value(s) for k, s in kwargs.items()}
        if fn is operator.getitem and not kwargs and len(args) == 2:
            value = batch_rules.item(self.n, *values)
            text = f"_item(_n, {arg_text})"
        elif kwargs:
            value = batch_rules.call(self.n, fn, values, kw)
            kw_text = ", ".join(f"{k!r}: {self.as_batch(s)}" for k, s in kwargs.items())
            text = f"_call(_n, {fn_name}, ({arg_text}), {{{kw_text}}})"
        else:
            value = batch_rules.call(self.n, fn, values)
            text = f"_call(_n, {fn_name}, ({arg_text}))"
        return self.result(text, value)

    def rule_call(self, fn_text, fn, args, kwargs):
        """The slot of ``_by_rule(_n, fn, args, kwargs)`` (``fn_text`` its callable in the raw function): the
        batch rule's call, or at one instance the op on that instance's own values."""
        kw_text = ", ".join(f"{k!r}: {self.as_batch(s)}" for k, s in kwargs.items())
        value = _by_rule(self.n, fn, tuple(self.wrapped_value(s) for s in args),
                         {k: self.wrapped_value(s) for k, s in kwargs.items()})
        return self.result(f"_by_rule(_n, {fn_text}, ({''.join(self.as_batch(s) + ', ' for s in args)}), "
                           f"{{{kw_text}}})", value)

    def plain_slot(self, slot):
        """A batch rule's result in a plain piece: its tensor where it is one (guarded), else the Batch (which
        a later op may read as a tensor, and which the piece may not return)."""
        if slot.kind == "O":
            return self.as_b(slot) or slot
        return slot

    def result(self, text, value):
        """A slot for the batch rule's result ``value`` computed by expression ``text``."""
        name = self.fresh()
        self.emit(f"{name} = {text}")
        if type(value) is Batch or (self.plain is not None and self.n == 1 and not facts.immutable(value)):
            return _Slot("O", name, value)  # (a plain piece's depth of one instance: that instance's own value)
        if type(value) is torch.Tensor or not isinstance(value, (*facts.NUMBERS, str, type(None), torch.dtype)):
            # a plain result that is not an immutable value: whether it is shared or per instance is the
            # rule's decision on each call, which the raw function would not see
            raise _Untraceable
        self.emit(f"if type({name}) is _Batch: raise _Deopt")
        return _Slot("S", name, value)

    def unpack(self, op, slot):
        k = len(op.outputs)
        if slot.kind == "T" and type(slot.value) is dict:
            raise _Untraceable  # (``a, b = d``: a dict's keys, which the op-by-op code unpacks)
        if slot.kind == "T" and len(slot.items) == k:  # (its length is the program's, or a split's, guarded)
            for v, s in zip(op.outputs, slot.items):
                self.define(v, s)
            return
        if slot.kind == "S" and type(slot.value) in (tuple, list, torch.Size) and len(slot.value) == k:
            # a shared tuple (``d, h = V.shape[0], V.shape[1]``): its items, shared (a wrong length raises as
            # Python does, and the op-by-op code raises it again from the user's line)
            names = [self.fresh() for _ in range(k)]
            self.emit(f"{', '.join(names)}{',' if k == 1 else ''} = {slot.name}")
            for v, name, item in zip(op.outputs, names, slot.value):
                self.define(v, _Slot("S", name, item))
            return
        if slot.kind == "B" and isinstance(slot.value, torch.Tensor):
            if slot.value.dim() < 2 or slot.value.shape[1] != k:
                # (this call's error, which the op-by-op code raises as Python's: the trace is not refused)
                raise ValueError(f"cannot unpack rows of shape {tuple(slot.value.shape)} into {k} names")
            # (``l, r = rows[i]``: each instance's tensor iterated along its first dim, as Python unpacks it)
            self.emit(f"if {slot.name}.dim() != {slot.value.dim()} or {slot.name}.shape[1] != {k}: raise _Deopt")
            names = [self.fresh() for _ in range(k)]
            self.emit(f"{', '.join(names)}{',' if k == 1 else ''} = {slot.name}.unbind(1)")
            for v, name, part in zip(op.outputs, names, slot.value.unbind(1)):
                self.define(v, _Slot("B", name, part))
            return
        if slot.kind == "S" or self.plain is not None or control.draws_to_unpack(self.wrapped_value(slot)):
            raise _Untraceable  # (a shared value unpacked, or iterators drawn: leave it to the op-by-op code)
        value = control.unpack(self.n, self.wrapped_value(slot), k)
        if type(value) is Batch:
            raise _Untraceable
        names = [self.fresh() for _ in range(k)]
        self.emit(f"{', '.join(names)}{',' if k == 1 else ''} = _unpack(_n, {self.as_batch(slot)}, {k})")
        for v, name, part in zip(op.outputs, names, value):
            if type(part) is Batch:
                self.define(v, _Slot("O", name, part))
            else:
                raise _Untraceable  # (a part every instance shares: the rule's decision per call)

    def fused(self, op):
        kernel = self.segment.kernels[op]
        args = [self.load(a) for a in op.args]
        if self.plain is not None and kernel.backend == "python":
            return self.fused_members(op, args)
        for i, fn in kernel.callables.items():
            s = args[i]
            if s.kind != "S" or s.value is not fn:
                return self.fused_generic(op, kernel, args)
            if not s.fixed:
                self.emit(f"if {s.name} is not {self.const(fn)}: raise _Deopt")
        raw, rank, dtype, shared_rank, batched = list(args), None, None, 0, 0
        for i in kernel.data_positions:
            s = args[i]
            if s.kind in ("O", "B"):
                b = self.as_b(s)
                if b is None or (rank is not None and b.value.dim() - 1 != rank):
                    return self.fused_generic(op, kernel, args)
                rank = b.value.dim() - 1
                raw[i] = b
                batched |= 1 << i
                t = b.value
            elif s.kind == "S" and isinstance(s.value, torch.Tensor):
                self.guard_shared(s)
                t = s.value
                shared_rank = max(shared_rank, t.dim())
            elif s.kind == "S" and type(s.value) in facts.NUMBERS:
                if not s.fixed:
                    self.emit(f"if type({s.name}) is not {type(s.value).__name__}: raise _Deopt")
                continue
            else:
                return self.fused_generic(op, kernel, args)
            if t.dtype is not torch.bool:
                if dtype is not None and t.dtype != dtype:
                    return self.fused_generic(op, kernel, args)
                dtype = t.dtype
        if rank is None or shared_rank > rank or not all(mask & batched for mask in kernel.dep_masks) \
                or not kernel.deps:
            return self.fused_generic(op, kernel, args)
        out = kernel.entry(*[s.value for s in raw])
        text = f"{self.const(kernel.entry)}({', '.join(s.name for s in raw)})"
        if len(kernel.deps) == 1:
            name = self.fresh()
            self.emit(f"{name} = {text}")
            slots = [_Slot("B", name, out)]
        else:
            names = [self.fresh() for _ in out]
            self.emit(f"{', '.join(names)} = {text}")
            slots = [_Slot("B", nm, o) for nm, o in zip(names, out)]
        for v, s in zip(op.outputs, slots):
            self.define(v, s)

    def fused_members(self, op, args):
        """A fused op of plain Python in a plain piece: its members traced one by one, as the kernel runs
        them, so that the piece's code holds their ops itself (one call less per op on the hot path)."""
        for v, s in zip(op.body.inputs, args):
            self.define(v, s)
        for member in op.body.ops:
            self.op(member)
        for v, out in zip(op.outputs, op.body.outputs):
            self.define(v, self.load(out))

    def fused_generic(self, op, kernel, args):
        if self.plain is not None:
            raise _Untraceable
        values = tuple(self.wrapped_value(s) for s in args)
        value = batch_rules.fused(self.n, kernel, values)
        text = f"_fused(_n, {self.const(kernel)}, ({''.join(self.as_batch(s) + ', ' for s in args)}))"
        if len(op.outputs) == 1:
            self.define(op.outputs[0], self.result(text, value))
            return
        if type(value) is not tuple:
            raise _Untraceable
        name = self.fresh()
        self.emit(f"{name} = {text}")
        for j, (v, part) in enumerate(zip(op.outputs, value)):
            if type(part) is not Batch:
                raise _Untraceable
            self.define(v, _Slot("O", f"{name}[{j}]", part))


# -- raw forms: each returns the slot of the op run on plain tensors, or None (the batch rule runs it); filed
# as the batch rules are, by the callable or module type they run

TRACE = RuleTable("trace")
_PLAIN_MODULES = (nn.Linear, nn.Embedding)


@TRACE.register(operator.getitem)
def _getitem_form(tr, fn, fn_slot, args, kwargs):
    """``x[i]``: a gather from a shared tensor by batched integer indices, one per instance; or a batched
    tensor indexed alike in every instance (ints, slices, None, ``...``: ``z[..., :H]``)."""
    if len(args) != 2 or kwargs:
        return None
    x, i = args
    if x.kind == "T" and i.kind == "S" and i.fixed:  # (a struct's item by a constant: that element's slot)
        item = _struct_item(x, i.value)
        if item is not None:
            tr.guard_callable(fn, fn_slot)
        return item
    if x.kind in ("B", "O") and i.kind == "S" and batch_rules.plain_index(i.value):
        b = tr.as_b(x)
        if b is None:
            return None
        tr.guard_callable(fn, fn_slot)
        tr.guard_equal(i)
        index = (slice(None),) + (i.value if type(i.value) is tuple else (i.value,))
        name = tr.fresh()
        tr.emit(f"{name} = {b.name}[{tr.const(index)}]")
        return _Slot("B", name, b.value[index])
    if x.kind == "S" and tr.plain is not None and type(x.value) not in _PLAIN_TENSORS:
        return _picked_form(tr, fn, fn_slot, x, i)
    if x.kind != "S" or type(x.value) not in _PLAIN_TENSORS:
        return None
    i = tr.as_b(i)
    if i is None or i.value.dtype not in facts.INTEGER_INDEX or i.value.dim() != 1:
        return None
    tr.guard_callable(fn, fn_slot)
    tr.guard_shared(x)
    tr.emit(f"if type({x.name}) not in _PLAIN_TENSORS: raise _Deopt")
    name = tr.fresh()
    value = batch_rules.index_rows(x.value, i.value)
    tr.emit(f"{name} = _rows({x.name}, {i.name})")
    return _Slot("B", name, value)


def _picked_form(tr, fn, fn_slot, x, i):
    """``self.ops[k]`` in a plain piece: a shared list of modules (or functions) that change and draw nothing,
    picked by each row's integer ``k``: a C slot, which only a call takes (``_Tracer.chosen_call``)."""
    fns = _plain_choices(x.value)
    i = tr.as_b(i) if i.kind in ("B", "O") else None
    if fns is None or i is None or i.value.dim() != 1 or i.value.dtype not in facts.INTEGER_INDEX:
        return None
    tr.guard_callable(fn, fn_slot)
    name = tr.fresh()
    tr.emit(f"{name} = _choices({x.name})")
    return _Slot("C", name, fns, items=(i,))


def _plain_choices(container):
    """The callables of ``container`` a plain piece may group by each row's pick (``chosen.choices``), each one
    that a trace may run again by its batch rule; else None."""
    fns = chosen.choices(container)
    return fns if fns is not None and all(rerunnable(f) for f in fns) else None


def _choices(container):
    fns = _plain_choices(container)
    if fns is None:
        raise Deopt
    return fns


def _grouped(n, fns, index, args, batched, kwargs):
    out = chosen.rows_grouped(n, fns, index, args, batched, kwargs, batch_rules.call)
    if out is None or out is NotImplemented:
        raise Deopt
    return out


@TRACE.register(getattr)
def _attr_form(tr, fn, fn_slot, args, kwargs):
    """``x.name`` of a batched tensor, for a method ``_METHODS`` knows: an M slot, for the call that follows;
    for an attribute every instance has alike (``x.dtype``) or one of an instance's shape, a shared value."""
    if len(args) != 2 or kwargs or args[1].kind != "S" or not args[1].fixed:
        return None
    name = args[1].value
    if args[0].kind == "T" and bt.plain_namedtuple(type(args[0].value)) and name in args[0].value._fields:
        tr.guard_callable(fn, fn_slot)  # (a namedtuple's field)
        return args[0].items[args[0].value._fields.index(name)]
    if name not in _METHODS and name not in batch_rules.SHARED_ATTRS and name not in ("shape", "ndim") and \
            not _by_method_rule(name):
        return None
    x = tr.as_b(args[0])
    if x is None:
        return None
    tr.guard_callable(fn, fn_slot)
    if name in _METHODS or _by_method_rule(name):
        return _Slot("M", "", (x, name))
    out = tr.fresh()
    if name == "shape":
        tr.emit(f"{out} = {x.name}.shape[1:]")
        return _Slot("S", out, x.value.shape[1:])
    if name == "ndim":
        tr.emit(f"{out} = {x.name}.dim() - 1")
        return _Slot("S", out, x.value.dim() - 1)
    tr.emit(f"{out} = {x.name}.{name}")
    return _Slot("S", out, getattr(x.value, name))


# Tensor methods a trace runs on the batched tensor: name -> (the position of the dim it takes, or None; whether
# no dim means every dim of the instance), as their batch rules do (``facts.UNARY_METHODS``, ``DIM_METHODS``);
# chunk, split and unbind give a tuple of batched tensors; not max (values and indices).
_SPLITTING = ("chunk", "split", "unbind")  # (a tuple of tensors: a T slot of B slots)


def _by_method_rule(name):
    """Whether a tensor method ``name`` with no raw form runs, in a trace, by its batch rule: one that changes
    nothing and draws nothing (``x.max(0)``, ``x.norm(dim=-1)``)."""
    return (isinstance(name, str) and name not in _METHODS and not name.startswith("_")
            and not facts.mutating_method(name) and name not in facts.DRAWING_METHODS
            and callable(getattr(torch.Tensor, name, None)))
_METHODS = {**{name: (None, False) for name in (*facts.UNARY_METHODS, "view", "reshape")},
            **{name: facts.DIM_METHODS[name] for name in ("sum", "mean", "softmax", "log_softmax", "unsqueeze",
                                                          "squeeze", "argmax", *_SPLITTING)}}


def _tensors(tr, args):
    """(raw slots, rank, dtype) of elementwise arguments: batched ones of one dtype, shared numbers, shared
    tensors of the same dtype; None if they are not all so. Each instance's shapes broadcast from the right,
    so a batched tensor of a lower instance rank than the others gets its ones after the instance dim."""
    out, rank, dtype = [], None, None
    for s in args:
        if s.kind in ("O", "B"):
            b = tr.as_b(s)
            if b is None:
                return None
            r = b.value.dim() - 1
            if dtype is not None and b.value.dtype != dtype:
                return None
            rank, dtype = max(r, -1 if rank is None else rank), b.value.dtype
            out.append(b)
        elif s.kind == "S" and type(s.value) in facts.NUMBERS:
            out.append(s)
        elif s.kind == "S" and type(s.value) in _PLAIN_TENSORS:
            out.append(s)
        else:
            return None
    if rank is None:
        return None
    for s in out:
        if s.kind == "S" and type(s.value) in _PLAIN_TENSORS:
            if s.value.dtype != dtype:
                return None
            rank = max(rank, s.value.dim())
    for j, s in enumerate(out):
        missing = rank + 1 - s.value.dim() if s.kind == "B" else 0
        if missing:
            name = tr.fresh()
            tr.emit(f"{name} = {s.name}[:{', None' * missing}]")
            out[j] = _Slot("B", name, s.value[(slice(None),) + (None,) * missing])
    return out, rank, dtype


def _whole(slot):
    """Whether a number slot's rows stand for Python ints or bools (``int(t)``, ``bool(t)``), not floats."""
    return not slot.value.is_floating_point()


@TRACE.register(int, bool)
def _python_number_form(tr, fn, fn_slot, args, kwargs):
    """``int(t)`` of each instance's one integer element, ``bool(t)`` of its one element: in a plain piece, rows
    standing for the Python numbers (kind N), which only an index, the predicate and the calls' arguments
    take (``_Tracer.numbers``)."""
    if tr.plain is None or kwargs or len(args) != 1 or fn_slot is None and fn not in (int, bool):
        return None
    x = args[0]
    t = x.value if x.kind == "B" and not x.number else None
    if t is None or type(t) not in _PLAIN_TENSORS or t.numel() != t.shape[0] or t.is_complex() or (
            fn is int and t.dtype not in (torch.long, torch.int)):
        return None  # (``int`` of a float truncates, and of NaN raises; of a uint8 the rows would index as a mask)
    tr.guard_callable(fn, fn_slot)
    tr.emit(f"if {x.name}.numel() != {x.name}.shape[0]: raise _Deopt")
    name = tr.fresh()
    rows = t.reshape(t.shape[0])
    if fn is int:
        tr.emit(f"{name} = {x.name}.reshape({x.name}.shape[0])")
    else:
        tr.emit(f"{name} = {x.name}.reshape({x.name}.shape[0]) != 0")
        rows = rows != 0
    slot = _Slot("B", name, rows)
    slot.number = True
    return slot


@TRACE.register(*facts.ELEMENTWISE)
def _elementwise_form(tr, fn, fn_slot, args, kwargs):
    if (fn in facts.DRAWS and not draws_per_element(fn, args)) or fn in facts.IN_PLACE or (
            fn is torch.where and len(args) == 1):
        return None
    found = _tensors(tr, args)
    if found is None:
        return None
    raw, rank, dtype = found
    tr.guard_callable(fn, fn_slot)
    _guard_shared_arguments(tr, raw)
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    kw = {k: s.value for k, s in kwargs.items()}
    value = fn(*[s.value for s in raw], **kw)
    if type(value) is not torch.Tensor or value.dim() == 0 or value.shape[0] != tr.n:
        return None
    name = tr.fresh()
    infix = _INFIX.get(fn) if fn_slot is None and not kwargs and len(raw) == 2 else None
    if infix is not None:  # (``operator.mul(a, b)`` is ``a * b``: written so, it is one call less)
        tr.emit(f"{name} = {raw[0].name} {infix} {raw[1].name}")
        return _Slot("B", name, value)
    tr.emit(f"{name} = {fn_name}({_arguments(raw, kwargs)})")
    return _Slot("B", name, value)


def _guard_shared_arguments(tr, slots):
    """Guards that the shared values among ``slots`` that a trace reads at run time are of the types it saw."""
    for s in slots:
        if s.kind == "S" and not s.fixed:
            if type(s.value) in _PLAIN_TENSORS:
                tr.guard_shared(s)
                tr.emit(f"if type({s.name}) not in _PLAIN_TENSORS: raise _Deopt")
            else:
                tr.emit(f"if type({s.name}) is not {type(s.value).__name__}: raise _Deopt")


_INFIX = {fn: syntax.SYMBOL[fn] for fn in (operator.add, operator.sub, operator.mul, operator.truediv)}


@TRACE.register(*intrinsics.OUT_OF_PLACE)
def _method_fresh_form(tr, fn, fn_slot, args, kwargs):
    """``x.relu_()`` (``clamp_(min=0)``) of a tensor only its frame holds (``passes.fresh``): ``x.relu()`` on the
    batched tensor, its other arguments shared numbers, where the result keeps ``x``'s dtype and shape (the
    in-place method's; the trace's guards hold them)."""
    x = tr.as_b(args[0])
    rest = [*args[1:], *kwargs.values()]
    if x is None or fn_slot is not None or not all(
            s.kind == "S" and (s.value is None and s.fixed or type(s.value) in facts.NUMBERS) for s in rest):
        return None
    value = getattr(x.value, fn.method)(*[s.value for s in args[1:]], **{k: s.value for k, s in kwargs.items()})
    if type(value) is not torch.Tensor or value.dtype is not x.value.dtype or value.shape != x.value.shape:
        return None
    _guard_shared_arguments(tr, rest)
    name = tr.fresh()
    tr.emit(f"{name} = {x.name}.{fn.method}({_arguments(args[1:], kwargs)})")
    return _Slot("B", name, value)


@TRACE.register(*intrinsics.AUGMENTED_FRESH.values())
def _augmented_fresh_form(tr, fn, fn_slot, args, kwargs):
    """``x op= y`` of an object only its frame holds (``passes.fresh``): ``x op y``, behind a guard that the
    result has ``x``'s shape (the in-place op could not grow it; its dtype the trace's guards hold)."""
    x = args[0]
    if kwargs or len(args) != 2 or fn_slot is not None or x.kind not in ("B", "S"):
        return None
    slot = _elementwise_form(tr, fn.out_of_place, None, args, kwargs)
    if slot is None or not isinstance(x.value, torch.Tensor):
        return slot  # (a number's ``+=`` is its ``+``)
    if slot.value.dtype is not x.value.dtype:
        return None
    if x.kind == "B":  # (rows standing for numbers too: the instances that hold a tensor could not grow it)
        if slot.value.shape != x.value.shape:
            return None
        tr.emit(f"if {slot.name}.shape != {x.name}.shape: raise _Deopt")
    else:
        if slot.value.shape[1:] != x.value.shape:
            return None
        tr.emit(f"if {slot.name}.shape[1:] != {x.name}.shape: raise _Deopt")
    return slot


_CELLS = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)


@TRACE.register(*_CELLS)
def _cell_form(tr, fn, fn_slot, args, kwargs):
    """An RNN, LSTM or GRU cell with no hooks on a batched input of vectors, its state batched or none
    (``batch_rules.recurrent_cell``): one batch of rows; an LSTM's (h, c) a tuple of batched tensors."""
    if kwargs or len(args) not in (1, 2) or not _plain_module(fn, type(fn)):
        return None
    x = tr.as_b(args[0])
    if x is None or x.value.dim() != 2:
        return None
    states = []
    if len(args) == 2:
        hx = args[1]
        parts = hx.items if hx.kind == "T" and type(hx.value) is not dict else [hx]
        if (type(fn) is nn.LSTMCell) != (len(parts) == 2):
            return None
        for part in parts:
            s = tr.as_b(part)
            if s is None or s.value.dim() != 2:
                return None
            states.append(s)
    tr.guard_callable(fn, fn_slot)
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    state_text = "" if not states else ", " + (f"({states[0].name}, {states[1].name})" if len(states) == 2
                                               else states[0].name)
    value = lazy_weights.cell(fn, x.value, *(() if not states else ((states[0].value, states[1].value),)
                                             if len(states) == 2 else (states[0].value,)))
    name = tr.fresh()
    tr.emit(f"{name} = _cell({fn_name}, {x.name}{state_text})")
    if type(value) is tuple:
        return _Slot("T", name, value, [_Slot("B", f"{name}[{j}]", v) for j, v in enumerate(value)])
    return _Slot("B", name, value)


@TRACE.register(*_PLAIN_MODULES)
def _module_form(tr, fn, fn_slot, args, kwargs):
    """A Linear or Embedding module with no hooks on a batched input (rank ≥ 1 for Linear)."""
    if len(args) != 1 or kwargs or type(fn) not in _PLAIN_MODULES or not _plain_module(fn, type(fn)):
        return None
    x = tr.as_b(args[0])
    if x is None:
        return None
    # (as its line computes it: a weight's gradient formed once per backward for the run's products)
    if type(fn) is nn.Linear:
        if x.value.dim() < 2:
            return None
        value = lazy_weights.linear(x.value, fn.weight, fn.bias, lazy_weights.of_run(fn.weight))
    else:
        if x.value.dtype not in facts.INTEGER_INDEX or fn.scale_grad_by_freq:
            return None  # (a word's gradient scaled by its count in each call's own indices: each its own)
        value = lazy_weights.lookup(fn, x.value)
    tr.guard_callable(fn, fn_slot)
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    name = tr.fresh()
    if type(fn) is nn.Linear:  # (its parameters read on lines of their own: a plain piece reads them once a run)
        weight, bias, lazy = tr.fresh(), tr.fresh(), tr.fresh()
        tr.emit(f"{weight}, {bias} = {fn_name}.weight, {fn_name}.bias")
        tr.emit(f"{lazy} = _of_run({weight})")
        tr.emit(f"{name} = _lazy_linear({x.name}, {weight}, {bias}, {lazy})")
    else:
        tr.emit(f"{name} = _lookup({fn_name}, {x.name})")
    return _Slot("B", name, value)


def _dim_arg(args, kwargs, position, default):
    """The dim slot of a dim-taking op: by keyword, at ``position``, or ``default``."""
    if "dim" in kwargs:
        return kwargs["dim"]
    if len(args) > position:
        return args[position]
    return default


@TRACE.register(torch.chunk, torch.split)
def _split_form(tr, fn, fn_slot, args, kwargs):
    """torch.chunk / torch.split (by a size or a list of sizes) of a batched tensor along a feature dim: a
    tuple of batched tensors."""
    if not args or set(kwargs) - {"dim"} or len(args) > 3 or any(s.kind != "S" for s in args[1:]):
        return None
    x = tr.as_b(args[0])
    sizes = args[1].value if len(args) > 1 else None
    if x is None or not (type(sizes) is int or (fn is torch.split and type(sizes) is list
                                                and all(type(k) is int for k in sizes))):
        return None
    dim = _dim_arg(args, kwargs, 2, _Slot("S", "0", 0, fixed=True))
    if type(dim.value) is not int:
        return None
    rank = x.value.dim() - 1
    d = dim.value
    if not -rank <= d < rank:
        return None
    shifted = d + 1 if d >= 0 else d
    tr.guard_callable(fn, fn_slot)
    for s in (args[1], dim):
        if not s.fixed:
            tr.emit(f"if type({s.name}) is not {type(s.value).__name__} or {s.name} != {s.value!r}: raise _Deopt")
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    value = fn(x.value, args[1].value, shifted)
    name = tr.fresh()
    tr.emit(f"{name} = {fn_name}({x.name}, {args[1].value!r}, {shifted})")
    tr.emit(f"if len({name}) != {len(value)}: raise _Deopt")  # (how many pieces depends on the size)
    items = []
    for j, part in enumerate(value):
        items.append(_Slot("B", f"{name}[{j}]", part))
    return _Slot("T", name, value, items)


# torch functions of one tensor along the dims they are given, the dim second: the batch's tensor's dims one on
_ALONG_DIMS = (torch.logsumexp, torch.sum, torch.mean, torch.amax, torch.amin, torch.softmax, torch.log_softmax,
               F.softmax, F.log_softmax, torch.cumsum)


@TRACE.register(*_ALONG_DIMS)
def _along_dims_form(tr, fn, fn_slot, args, kwargs):
    """``torch.logsumexp(x, 0)``, ``torch.sum(x, (0, 1), keepdim)``, ``F.softmax(x, dim=-1)`` ... of a batched x
    along the dims given (the same on every call): the same function on the batch's tensor, its dims moved past
    the instance dim."""
    kwargs = dict(kwargs)
    dim = kwargs.pop("dim") if "dim" in kwargs else args[1] if len(args) > 1 else None
    rest = [*args[2:], *kwargs.values()]  # (keepdim)
    if dim is None or len(args) > 3 or set(kwargs) - {"keepdim"} or any(
            a.kind != "S" or type(a.value) is not bool for a in rest):  # (softmax's third is a dtype: the rule's)
        return None
    x = tr.as_b(args[0])
    if dim.kind == "T" and all(d.kind == "S" and d.fixed for d in dim.items):  # (``(0, 1)``: built of constants)
        dim = _Slot("S", repr(tuple(dim.value)), tuple(dim.value), fixed=True)
    dims = dim.value if type(dim.value) is tuple else (dim.value,)
    if x is None or dim.kind != "S" or not batch_rules.dims_shift(x.value, fn) or not dims or \
            not all(type(d) is int for d in dims):
        return None
    rank = x.value.dim() - 1
    if not all(-rank <= d < rank for d in dims):
        return None
    for a in (dim, *rest):
        tr.guard_equal(a)
    shifted = batch_rules.shift_dim(dim.value)
    tr.guard_callable(fn, fn_slot)
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    value = fn(x.value, shifted, *[a.value for a in args[2:]], **{k: a.value for k, a in kwargs.items()})
    name = tr.fresh()
    extra = "".join(f", {a.name}" for a in args[2:]) + "".join(f", {k}={a.name}" for k, a in kwargs.items())
    tr.emit(f"{name} = {fn_name}({x.name}, {shifted!r}{extra})")
    return _Slot("B", name, value)


@TRACE.register(torch.cat, torch.concat, torch.stack)
def _join_form(tr, fn, fn_slot, args, kwargs):
    """torch.cat / torch.stack of a list built in the segment, all batched tensors, along a feature dim."""
    if not args or args[0].kind != "T" or type(args[0].value) is dict or set(kwargs) - {"dim"} or len(args) > 2:
        return None  # (not a dict: torch refuses it, as the batch rule leaves it to each instance)
    parts = [tr.as_b(s) for s in args[0].items]
    if not parts or any(p is None for p in parts):
        return None
    ranks = {p.value.dim() - 1 for p in parts}
    dtypes = {p.value.dtype for p in parts}
    dim = _dim_arg(args, kwargs, 1, _Slot("S", "0", 0, fixed=True))
    if len(ranks) != 1 or len(dtypes) != 1 or dim.kind != "S" or type(dim.value) is not int:
        return None
    rank = ranks.pop() + (1 if fn is torch.stack else 0)
    d = dim.value
    if not -rank <= d < rank or rank == 0:
        return None
    shifted = d + 1 if d >= 0 else d
    tr.guard_callable(fn, fn_slot)
    if not dim.fixed:
        tr.emit(f"if type({dim.name}) is not int or {dim.name} != {d!r}: raise _Deopt")
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    value = fn([p.value for p in parts], dim=shifted)
    name = tr.fresh()
    tr.emit(f"{name} = {fn_name}([{', '.join(p.name for p in parts)}], dim={shifted})")
    return _Slot("B", name, value)


@TRACE.register(operator.matmul, torch.matmul)
def _matmul_form(tr, fn, fn_slot, args, kwargs):
    """``x @ w``: a batched x (instance rank 1 or more) times a shared vector or matrix, or batched vectors
    and matrices times each other (``batch_rules.matmul``)."""
    if len(args) != 2 or kwargs:
        return None
    x = tr.as_b(args[0])
    if x is None or x.value.dim() < 2:
        return None
    if args[1].kind in ("B", "O"):
        y = tr.as_b(args[1])
        if y is None or x.value.dim() not in (2, 3) or y.value.dim() not in (2, 3):
            return None
        tr.guard_callable(fn, fn_slot)
        name = tr.fresh()
        tr.emit(f"{name} = _batched_product({x.name}, {y.name})")
        return _Slot("B", name, batch_rules.batched_product(x.value, y.value))
    w = args[1]
    if w.kind != "S" or type(w.value) not in _PLAIN_TENSORS or w.value.dim() not in (1, 2):
        return None
    tr.guard_callable(fn, fn_slot)
    tr.guard_shared(w)
    tr.emit(f"if type({w.name}) not in _PLAIN_TENSORS: raise _Deopt")
    name = tr.fresh()
    tr.emit(f"{name} = {x.name} @ {w.name}")
    return _Slot("B", name, x.value @ w.value)


@TRACE.register(F.linear)
def _linear_form(tr, fn, fn_slot, args, kwargs):
    """``F.linear(x, w, b)`` of a batched x (instance rank 1 or more) and a shared weight and bias."""
    if kwargs or len(args) not in (2, 3) or any(s.kind != "S" for s in args[1:]):
        return None
    x, w = tr.as_b(args[0]), args[1]
    b = args[2] if len(args) == 3 else None
    if x is None or x.value.dim() < 2 or type(w.value) not in _PLAIN_TENSORS or w.value.dim() != 2 or not (
            b is None or b.value is None or type(b.value) in _PLAIN_TENSORS):
        return None
    tr.guard_callable(fn, fn_slot)
    for s in (w, b):
        if s is not None and s.value is not None:
            tr.guard_shared(s)
            tr.emit(f"if type({s.name}) not in _PLAIN_TENSORS: raise _Deopt")
        elif s is not None and not s.fixed:
            tr.emit(f"if {s.name} is not None: raise _Deopt")
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    name = tr.fresh()
    tr.emit(f"{name} = {fn_name}({', '.join(s.name for s in (x, w, b) if s is not None)})")
    return _Slot("B", name, fn(x.value, w.value, None if b is None else b.value))


@TRACE.register(torch.einsum)
def _einsum_form(tr, fn, fn_slot, args, kwargs):
    """``torch.einsum(equation, *operands)`` of batched and shared tensors (``batch_rules.einsum``)."""
    if kwargs or len(args) < 2 or args[0].kind != "S" or type(args[0].value) is not str:
        return None
    operands = args[1:]
    if len(operands) == 1 and operands[0].kind == "T" and type(operands[0].value) is not dict:
        operands = operands[0].items
    raw = []
    for s in operands:
        b = tr.as_b(s) if s.kind in ("B", "O") else None
        if b is None and not (s.kind == "S" and type(s.value) in _PLAIN_TENSORS):
            return None
        raw.append(b if b is not None else s)
    equation = batch_rules.batched_equation(args[0].value, [s.kind == "B" for s in raw])
    if equation is None:
        return None
    tr.guard_callable(fn, fn_slot)
    tr.guard_equal(args[0])
    for s in raw:
        if s.kind == "S":
            tr.guard_shared(s)
            tr.emit(f"if type({s.name}) not in _PLAIN_TENSORS: raise _Deopt")
    fn_name = fn_slot.name if fn_slot is not None else tr.const(fn)
    name = tr.fresh()
    tr.emit(f"{name} = {fn_name}({equation!r}, {', '.join(s.name for s in raw)})")
    return _Slot("B", name, fn(equation, *[s.value for s in raw]))


@TRACE.register(intrinsics.build_dict)
def _dict_form(tr, fn, fn_slot, args, kwargs):
    """``{"h": h, "c": c}`` with constant string keys: a T slot of its values (``batch.Keyed``)."""
    keys = args[::2]
    if kwargs or len(args) % 2 or not keys or any(k.kind != "S" or not k.fixed or type(k.value) is not str
                                                  for k in keys) or len({k.value for k in keys}) != len(keys):
        return None
    values = args[1::2]
    if all(v.kind == "S" for v in values):
        return None
    name = tr.fresh()
    tr.emit(f"{name} = ({''.join(v.name + ', ' for v in values)})")
    tr.builds.add(name)
    return _Slot("T", name, {k.value: v.value for k, v in zip(keys, values)}, list(values))


def _namedtuple_form(tr, fn, fn_slot, args, kwargs):
    """``State(h, c)`` of a namedtuple class with its fields in order: a T slot of them."""
    fields = fn._fields
    if kwargs or len(args) != len(fields) or all(a.kind == "S" for a in args):
        return None
    tr.guard_callable(fn, fn_slot)
    name = tr.fresh()
    tr.emit(f"{name} = ({''.join(a.name + ', ' for a in args)})")
    tr.builds.add(name)
    return _Slot("T", name, fn(*[a.value for a in args]), list(args))


@TRACE.register(intrinsics.build_tuple, intrinsics.build_list)
def _build_form(tr, fn, fn_slot, args, kwargs):
    if kwargs or all(s.kind == "S" for s in args):
        return None
    kind = tuple if fn is intrinsics.build_tuple else list
    name = tr.fresh()
    value = kind(s.value for s in args)
    if kind is tuple:
        tr.emit(f"{name} = ({''.join(s.name + ', ' for s in args)})")
    else:
        tr.emit(f"{name} = [{', '.join(s.name for s in args)}]")
    tr.builds.add(name)
    return _Slot("T", name, value, list(args))


def _unpack_undrawn(n, value, k):
    """``control.unpack`` in a raw function, which gives way before it draws an iterator's items: the op-by-op
    code, run from the segment's start, would draw them again."""
    if type(value) is Batch and control.draws_to_unpack(value):
        raise Deopt
    return control.unpack(n, value, k)


def rerunnable(fn):
    """Whether ``fn`` changes nothing and draws nothing: a trace may run it by its batch rule."""
    if getattr(fn, "inplace", False) is True:  # (a module changing its input: run again, it would change it twice)
        return False
    if type(fn) is nn.Sequential:  # (as each of its modules)
        return _plain_module(fn, nn.Sequential) and all(rerunnable(m) for m in fn)
    if type(fn) in _GENERIC_OK_MODULES:  # (not an RNN with dropout between its layers, training: it draws)
        return _plain_module(fn, type(fn)) and not (isinstance(fn, nn.RNNBase) and fn.dropout and fn.training)
    return facts.among(fn, _GENERIC_OK) or helpers.kind(fn) == "pure"


def draws_per_element(fn, args):
    """Whether ``fn`` on ``args`` (slots) draws one number per element of a batched input (dropout, no hooks,
    not in place): a batch's tensor draws every instance's at once, each its own, as each instance would. A
    trace may run it: a run given up and run again draws anew what no instance saw."""
    if not args or args[0].kind not in ("B", "O"):
        return False
    if type(fn) in facts.ELEMENT_DRAW_MODULES:
        return _plain_module(fn, type(fn)) and not fn.inplace
    return facts.among(fn, facts.ELEMENT_DRAWS)


def _pure(fn):
    return facts.among(fn, facts.PURE)


def _shareable(fn):
    return facts.among(fn, facts.SHAREABLE)


def _form_of(fn):
    """The raw form of ``fn``: by the callable, or by a module's exact type (``_module_form`` checks its hooks)."""
    try:
        form = TRACE.by_callable.get(fn)
    except TypeError:  # unhashable callable
        return None
    return form if form is not None else TRACE.by_module.get(type(fn))


# -- what the raw functions call


def _tensor(x, rank, dtype):
    """The batched tensor of Batch ``x``, if it has one of this rank and dtype and computing it runs no
    deferred call."""
    if type(x) is not Batch or x.thunk is not None:
        raise Deopt
    t = x.tensor if x.owner == "tensor" else None
    if t is None:
        if bt.is_lazy(x):
            raise Deopt
        t = bt.tensor_of(x)
        if t is None:
            raise Deopt
    if t.dim() != rank or t.dtype != dtype:
        raise Deopt
    return t


def _method(n, x, name):
    """The method ``name`` of the batched tensor ``x``, as the batch rules call it."""
    return Batch(n, method=(bt.from_tensor(x), name))


def _by_rule(n, fn, args, kwargs=None):
    """``batch_rules.call`` in a trace, where a plain piece's depth may hold one instance: its values are then
    its own (``bt.from_tensor`` of one row), and the op runs on them as written."""
    if n == 1:
        if type(fn) is Batch:  # (``_method``: the instance's own tensor's method)
            base, name = fn.method
            fn = getattr(base, name)
        return fn(*args, **kwargs) if kwargs else fn(*args)
    return batch_rules.call(n, fn, args, kwargs)


def _rows_of(n, x, rank, dtype):
    """``_tensor`` in a plain piece: of one instance, its own tensor given back its instance dim."""
    if n == 1 and type(x) is torch.Tensor:
        if x.dim() != rank - 1 or x.dtype != dtype:
            raise Deopt
        return x.unsqueeze(0)
    return _tensor(x, rank, dtype)


def _shared_tensor(x, rank, dtype):
    if not isinstance(x, torch.Tensor) or x.dim() != rank or x.dtype != dtype:
        raise Deopt


def _plain_module(m, kind):
    """A module of exactly ``kind`` whose call is its own forward, with no hooks (``batch_rules``)."""
    return type(m) is kind and not has_hooks(m) and "forward" not in m.__dict__


def _module(m, *args):
    return m(*args)


class _Traced(tuple):
    """A list as a trace saw it: a copy (the list itself may change later), compared as a list."""


def _same(a, b):
    """Whether ``a`` is what the trace saw, ``b``: the same types and values, through tuples, lists and slices."""
    kind = type(b)
    if kind is _Traced:
        return type(a) is list and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is not kind:
        return False
    if kind is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if kind is slice:
        return _same(a.start, b.start) and _same(a.stop, b.stop) and _same(a.step, b.step)
    return a == b


def _struct_item(slot, key):
    """The slot of item ``key`` of T slot ``slot`` (a tuple's by an int, a dict's by a key it has), or None."""
    value = slot.value
    if type(value) is dict:
        keys = list(value)
        return slot.items[keys.index(key)] if len(keys) == len(slot.items) and key in value else None
    if isinstance(value, tuple) and type(key) is int and -len(slot.items) <= key < len(slot.items):
        return slot.items[key]
    return None


def _handed_struct(slot):
    """A plain piece's kind for a T slot it hands on (``runtime.levels._struct_of``): a tuple, a namedtuple or a
    dict with string keys, of batched and shared values, one at least batched; else None."""
    if slot.kind != "T" or not slot.items or any(i.kind not in ("B", "S") or i.number for i in slot.items) or \
            all(i.kind == "S" for i in slot.items):
        return None
    value = slot.value
    if type(value) is dict:
        if not all(type(k) is str for k in value) or len(value) != len(slot.items):
            return None
    elif not (type(value) is tuple or bt.plain_namedtuple(type(value))):
        return None  # (a list: each instance's own object)
    return ("T", _struct_class(value), tuple(i.kind for i in slot.items))


def _struct_class(value):
    """What ``batch.build`` makes a T slot's value of its items with: its type, a dict's Keyed kind."""
    return bt.dict_kind(tuple(value)) if type(value) is dict else type(value)


def _handed_text(slot):
    """The expression a plain piece returns for ``slot``: a struct as the tuple of its elements."""
    if slot.kind != "T":
        return slot.name
    return "(" + "".join(i.name + ", " for i in slot.items) + ")"


def _struct(kind, parts, n):
    if all(type(p) is not Batch for p in parts):
        return bt.build(kind, parts)
    return bt.from_struct(kind, parts, n)


_HELPERS = {"_Batch": Batch, "_MethodType": types.MethodType, "_Tensor": torch.Tensor, "_Deopt": Deopt,
            "_tensor": _tensor, "_shared_tensor": _shared_tensor, "_plain_module": _plain_module,
            "_of_run": lazy_weights.of_run, "_lazy_linear": lazy_weights.linear, "_lookup": lazy_weights.lookup,
            "_cell": lazy_weights.cell,
            "_module": _module,
            "_wrap": bt.from_tensor, "_struct": _struct, "_method": _method, "_rows": batch_rules.index_rows,
            "_call": batch_rules.call, "_by_rule": _by_rule, "_rows_of": _rows_of, "_item": batch_rules.item,
            "_fused": batch_rules.fused,
            "_unpack": _unpack_undrawn, "_sharing": sharing.state, "_batched_product": batch_rules.batched_product,
            "_mark_fresh": sharing.mark_fresh, "_same": _same, "_choices": _choices, "_grouped": _grouped,
            "_PLAIN_TENSORS": _PLAIN_TENSORS, "__builtins__": __builtins__}
