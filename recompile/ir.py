"""The IR: Program, SubGraph, Value and the five op kinds, with text and DOT printers.

SSA values; the ops of a SubGraph are kept in program order (which is also a
topological order); every op carries the user's source Location.
Operands are either a Value or a Const.
"""

from __future__ import annotations

import itertools
import os
import re
from typing import Protocol

from .intrinsics import Marker
from .naming import Namer

_ids = itertools.count(1)


class Value:
    """An SSA value. ``op`` is the producing op (None for SubGraph inputs)."""

    __slots__ = ("id", "hint", "op", "is_self")

    def __init__(self, hint="", op=None):
        self.id = next(_ids)
        self.hint = (hint or "").lstrip(".")  # names the frontend made up start with "."
        self.op = op
        self.is_self = False  # the bound instance of a method (see passes.capture)

    def __repr__(self):
        return f"%{self.hint or 'v'}.{self.id}"


class Const:
    """A constant operand: any Python object known when the program is built."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return const_repr(self.value)


def const_repr(value):
    if type(value) is int and abs(value) > 10 ** 100:
        return "<large int>"  # its digits may exceed the int->str conversion limit
    if isinstance(value, (int, float, str, bool, bytes, type(None), complex)):
        return repr(value)
    if isinstance(value, tuple) and all(isinstance(v, (int, float, str, bool, type(None))) for v in value):
        return "(" + "".join(const_repr(v) + ", " for v in value) + ")"
    if isinstance(value, Marker):
        return value.name
    name = safe_getattr(value, "__qualname__") or safe_getattr(value, "__name__")
    if isinstance(name, str) and name:
        mod = safe_getattr(value, "__module__")
        if mod in ("_operator", "operator"):
            return name
        if mod == "builtins":
            return name
        if isinstance(mod, str) and mod.startswith("torch"):
            return "torch." + name if not name.startswith("torch") else name
        return name
    return f"<{type(value).__name__}>"


def safe_getattr(value, name):
    """getattr that survives objects whose __getattr__ raises anything (a dict with attribute access)."""
    try:
        return getattr(value, name, None)
    except Exception:
        return None


class Op:
    """Base class of ops. Subclasses list their operand slots in ``operands()``."""

    kind = "op"

    def __init__(self, loc, n_outputs=1, hints=()):
        self.loc = loc
        hints = list(hints) + [""] * (n_outputs - len(hints))
        self.outputs = [Value(h, self) for h in hints[:n_outputs]]

    @property
    def output(self):
        return self.outputs[0]

    def operands(self):
        raise NotImplementedError

    def map_operands(self, fn):
        """Replace every operand x by fn(x) (in place)."""
        raise NotImplementedError

    def subgraphs(self):
        return ()


class Call(Op):
    """Everything that is not control flow nor a compiled call.

    ``fn(*args, **kwargs)``; positions in ``star`` are ``*``-expanded, a kwarg
    named None is ``**``-expanded. With several outputs the result is unpacked
    like ``a, b = fn(...)``.
    """

    kind = "call"
    # the position of the parameter whose list an ``intrinsics.hand_back`` fills (``passes.accumulate``), read by
    # ``passes.effects``; None for any other call
    hands_back = None

    def __init__(self, loc, fn, args=(), kwargs=(), star=(), n_outputs=1, hints=()):
        super().__init__(loc, n_outputs, hints)
        self.fn = fn
        self.args = list(args)
        self.kwargs = list(kwargs)  # [(name|None, operand)]
        self.star = frozenset(star)

    def operands(self):
        return [self.fn, *self.args, *(v for _, v in self.kwargs)]

    def map_operands(self, fn):
        self.fn = fn(self.fn)
        self.args = [fn(a) for a in self.args]
        self.kwargs = [(k, fn(v)) for k, v in self.kwargs]


class Target(Protocol):
    """What ``Invoke.target`` holds: the handle of a compiled function built for one owner class
    (``program.Callee``), or of its forward-with-saves or gradient program (``program.GradHandle``).
    The IR and the passes read only this of it; generated code hands it to the runtime, which runs
    its ``code`` (and in batched mode its ``batched_unit``).

    - ``ir_name``: the name of its entry SubGraph (``Invoke.callee``);
    - ``signature``: how a call binds to its parameters (the frontend binds each call's arguments);
    - ``qualname``, ``filename``: how an error's chain of calls names it;
    - ``subgraph(stage)``: its function's SubGraph after pipeline stage ``stage`` (built on first use);
    - ``forward``, ``backward``: the Targets of its forward-with-saves and gradient programs.
    """

    ir_name: str
    signature: object
    qualname: str
    filename: str
    forward: "Target"
    backward: "Target"

    def subgraph(self, stage) -> "SubGraph": ...


def reachable(target, stage, key=None):
    """Each Target reachable from ``target`` through the Invokes of the SubGraphs after ``stage``,
    ``target`` first, each once: the one walk over the functions a call may run (building each). With
    ``key``, a target whose key was met already is neither given nor walked (``key=ir_name``: one
    function built for several owner classes counts once)."""
    seen, pending = set(), [target]
    while pending:
        t = pending.pop()
        k = t if key is None else key(t)
        if k in seen:
            continue
        seen.add(k)
        yield t
        for sg in t.subgraph(stage).walk():
            pending.extend(op.target for op in sg.ops if isinstance(op, Invoke))


class Invoke(Op):
    """A call of a compiled function's SubGraph (recursion included).

    ``callee`` is the entry SubGraph's name; ``target`` is the compiled
    function's handle (a ``Target``, resolved when the program is built).
    """

    kind = "invoke"
    # the positions of the arguments that are lists made for this recursive call, which its function fills and
    # hands back (``passes.accumulate``); a pass that rebuilds the op drops them, and the call keeps its order
    fills = frozenset()

    def __init__(self, loc, callee, target, args, hints=()):
        super().__init__(loc, 1, hints)
        self.callee = callee
        self.target = target
        self.args = list(args)

    def operands(self):
        return list(self.args)

    def map_operands(self, fn):
        self.args = [fn(a) for a in self.args]


class Cond(Op):
    """``then_sg(*args)`` if bool(pred) else ``else_sg(*args)``; same arity and outputs."""

    kind = "cond"

    def __init__(self, loc, pred, then_sg, else_sg, args, n_outputs, hints=()):
        super().__init__(loc, n_outputs, hints)
        self.pred = pred
        self.then_sg = then_sg
        self.else_sg = else_sg
        self.args = list(args)

    def operands(self):
        return [self.pred, *self.args]

    def map_operands(self, fn):
        self.pred = fn(self.pred)
        self.args = [fn(a) for a in self.args]

    def subgraphs(self):
        return (self.then_sg, self.else_sg)


class While(Op):
    """``while cond_sg(*vars, *inv): vars = body_sg(*vars, *inv)``; outputs the final vars.

    ``loop_vars`` are the initial values of the carried variables;
    ``invariants`` are passed unchanged to every iteration.
    """

    kind = "while"

    def __init__(self, loc, cond_sg, body_sg, loop_vars, invariants=(), hints=()):
        super().__init__(loc, len(loop_vars), hints)
        self.cond_sg = cond_sg
        self.body_sg = body_sg
        self.loop_vars = list(loop_vars)
        self.invariants = list(invariants)

    def operands(self):
        return [*self.loop_vars, *self.invariants]

    def map_operands(self, fn):
        self.loop_vars = [fn(a) for a in self.loop_vars]
        self.invariants = [fn(a) for a in self.invariants]

    def subgraphs(self):
        return (self.cond_sg, self.body_sg)


class Capture(Op):
    """An outer reference, read each time the op runs.

    kind ``free``: a name not yet resolved (frontend output);
    ``global``: module global, then builtins (``source`` = the globals dict);
    ``closure``: a closure cell (``source`` = the cell);
    ``attr``: an attribute of ``base`` (``self.<name>``).
    """

    kind = "capture"

    def __init__(self, loc, name, source_kind="free", source=None, base=None):
        super().__init__(loc, 1, (name.replace(".", "_"),))
        self.name = name
        self.source_kind = source_kind
        self.source = source
        self.base = base

    def operands(self):
        return [self.base] if self.base is not None else []

    def map_operands(self, fn):
        if self.base is not None:
            self.base = fn(self.base)


class Fused(Op):
    """A group of elementwise Calls run as one op (``passes.fusion``).

    ``body`` is a SubGraph of kind ``fused`` holding the member Calls with their
    source locations; its inputs are the group's operands (``args``, in order),
    the callables included, and its outputs the op's outputs. ``callables``
    maps body input positions to the callable each was resolved to when the
    program was built: a backend that bakes them in checks them first.
    ``backend`` names how it runs (``python`` or ``compile``). The body is not
    in ``subgraphs()``: it is not control flow, and it runs as one op.
    """

    kind = "fused"

    def __init__(self, loc, body, args, callables, backend):
        super().__init__(loc, len(body.outputs), [v.hint for v in body.outputs])
        self.body = body
        self.args = list(args)
        self.callables = dict(callables)
        self.backend = backend

    def operands(self):
        return list(self.args)

    def map_operands(self, fn):
        self.args = [fn(a) for a in self.args]


class SubGraph:
    """A function body, a Cond branch, or a While predicate / body."""

    def __init__(self, name, inputs, loc, kind="function"):
        self.name = name
        self.inputs = list(inputs)
        self.outputs = []  # operands
        self.ops = []
        self.loc = loc
        self.kind = kind  # function | then | else | cond | body | fused

    def walk(self):
        """This SubGraph and every SubGraph nested in its ops, outermost first."""
        yield self
        for op in self.ops:
            for sg in op.subgraphs():
                yield from sg.walk()

    def __repr__(self):
        return f"<SubGraph {self.name}>"


class Program:
    """The SubGraphs reachable from an entry, by name."""

    def __init__(self, entry, subgraphs):
        self.entry = entry
        self.subgraphs = dict(subgraphs)  # name -> function SubGraph

    def all_subgraphs(self):
        for sg in self.subgraphs.values():
            yield from sg.walk()

    def to_text(self, notes=None):
        return format_program(self, notes)

    def to_dot(self):
        return format_dot(self)


# ----------------------------------------------------------------------------
# Text printer


class _Printed:
    """How the printers name operands: a Value by its hint, ``.1``, ``.2``... where it repeats (a hint holds no
    dot, so these never meet another hint); a constant by its repr."""

    def __init__(self):
        self.names = Namer(suffix=lambda k: f".{k}", start=1)

    def __call__(self, operand):
        if not isinstance(operand, Value):
            return repr(operand)
        name = self.names.given_to(operand)
        if name is None:
            name = self.names.name_of(operand, (operand.hint or "").replace(".", "_").strip("_") or "v")
        return "%" + name


def _loc_suffix(loc, note=None):
    place = "" if loc is None else f"{os.path.basename(loc.filename)}:{loc.lineno}"
    text = " ".join(t for t in (f"[{note}]" if note else "", place) if t)
    return f"  # {text}" if text else ""


def _format_op(op, nm, note=None):
    outs = ", ".join(nm(v) for v in op.outputs)
    lhs = f"{outs} = " if outs else ""
    if isinstance(op, Call):
        args = []
        for i, a in enumerate(op.args):
            args.append(("*" if i in op.star else "") + nm(a))
        for k, v in op.kwargs:
            args.append(f"{k}={nm(v)}" if k is not None else f"**{nm(v)}")
        text = f"call {nm(op.fn)}({', '.join(args)})"
    elif isinstance(op, Invoke):
        text = f"invoke @{op.callee}({', '.join(nm(a) for a in op.args)})"
    elif isinstance(op, Cond):
        text = (f"cond {nm(op.pred)} then @{op.then_sg.name} else @{op.else_sg.name}"
                f"({', '.join(nm(a) for a in op.args)})")
    elif isinstance(op, While):
        inv = f"; invariant {', '.join(nm(a) for a in op.invariants)}" if op.invariants else ""
        text = (f"while @{op.cond_sg.name} do @{op.body_sg.name}"
                f"({', '.join(nm(a) for a in op.loop_vars)}{inv})")
    elif isinstance(op, Fused):
        text = f"fused[{op.backend}] @{op.body.name}({', '.join(nm(a) for a in op.args)})"
    elif isinstance(op, Capture):
        src = {"free": "free", "global": "global", "closure": "closure", "attr": "attr"}[op.source_kind]
        base = f" of {nm(op.base)}" if op.base is not None else ""
        text = f"capture {src} {op.name!r}{base}"
    else:
        text = op.kind
    return lhs + text + _loc_suffix(op.loc, note)


def format_subgraph(sg, nm=None, notes=None):
    """``sg`` as text, and the SubGraphs nested in it; ``notes`` ({op: text}) are shown beside their ops."""
    nm = nm or _Printed()
    notes = notes or {}
    lines = [f"subgraph @{sg.name}({', '.join(nm(v) for v in sg.inputs)}):{_loc_suffix(sg.loc)}"]
    for op in sg.ops:
        lines.append("  " + _format_op(op, nm, notes.get(op)))
    lines.append(f"  return {', '.join(nm(v) for v in sg.outputs)}")
    text = "\n".join(lines)
    nested = [op.body for op in sg.ops if isinstance(op, Fused)]
    nested += [s for op in sg.ops for s in op.subgraphs()]
    for s in nested:
        text += "\n\n" + format_subgraph(s, nm, notes)
    return text


def format_program(program, notes=None):
    nm = _Printed()
    parts = [f"# program, entry @{program.entry}"]
    for sg in program.subgraphs.values():
        parts.append(format_subgraph(sg, nm, notes))
    return "\n\n".join(parts) + "\n"


# ----------------------------------------------------------------------------
# DOT printer


def _dot_escape(text):
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\l")  # \l: a left-aligned line


def _wrapped(line, width=100):
    """``line`` cut after commas into lines of about ``width`` characters, the later ones indented: a long tuple
    of saved values would otherwise set the width of the whole drawing."""
    parts, current = [], ""
    for piece in re.split(r"(?<=, )", line):
        if current and len(current) + len(piece) > width:
            parts.append(current.rstrip())
            current = "    "
        current += piece
    return parts + [current]


def format_dot(program):
    """Graphviz DOT: one cluster per SubGraph, data edges inside, dashed edges to callees.

    Laid out to be read top to bottom: each cluster's nodes are held in program order, one column, and the
    clusters are stacked in the order of the text dump; the dashed call edges do not move anything (a recursive
    call points back up). Side by side, a small model's clusters and their parallel chains ran thousands of
    points wide.
    """
    nm = _Printed()
    lines = ["digraph recompile {", "  rankdir=TB;", "  compound=true;",
             "  node [shape=box, fontname=monospace, fontsize=10];"]
    node_ids = {}
    entry_node = {}
    counter = itertools.count()
    cluster_of = {}  # node id -> its SubGraph's name

    def node(sg, label, shape="box"):
        nid = f"n{next(counter)}"
        cluster_of[nid] = sg.name
        label = "\n".join(part for line in label.split("\n") for part in _wrapped(line))
        text = _dot_escape(label) + ("\\l" if "\n" in label else "")  # every line left-aligned, the last too
        lines.append(f'    {nid} [label="{text}", shape={shape}];')
        return nid

    def data_edge(src, dst):
        # a branch reading its parent's value (before capture) crosses clusters: such an edge moves nothing
        within = cluster_of[src] == cluster_of[dst]
        return f"  {src} -> {dst};" if within else f"  {src} -> {dst} [constraint=false];"

    later_edges = []
    order_edges = []  # invisible: what holds the column and the stack
    last_node = None
    all_sgs = list(program.all_subgraphs())
    for sg in all_sgs:
        lines.append(f'  subgraph "cluster_{_dot_escape(sg.name)}" {{')
        lines.append(f'    label="{_dot_escape(sg.name)}";')
        entry = node(sg, f"inputs({', '.join(nm(v) for v in sg.inputs)})", shape="ellipse")
        entry_node[sg.name] = entry
        if last_node is not None:
            order_edges.append(f"  {last_node} -> {entry} [style=invis];")
        column = [entry]
        for v in sg.inputs:
            node_ids[v] = entry
        for op in sg.ops:
            label = _format_op(op, nm)
            if isinstance(op, Fused):  # one node: the members listed in it
                label += "".join("\n  " + _format_op(m, nm) for m in op.body.ops)
            nid = node(sg, label)
            column.append(nid)
            for v in op.outputs:
                node_ids[v] = nid
            for operand in op.operands():
                if isinstance(operand, Value) and operand in node_ids:
                    later_edges.append(data_edge(node_ids[operand], nid))
            if isinstance(op, Invoke):
                later_edges.append(("call", nid, op.callee))
            for s in op.subgraphs():
                later_edges.append(("call", nid, s.name))
        out = node(sg, f"return {', '.join(nm(v) for v in sg.outputs)}", shape="ellipse")
        column.append(out)
        for v in sg.outputs:
            if isinstance(v, Value) and v in node_ids:
                later_edges.append(data_edge(node_ids[v], out))
        lines.append("  }")
        order_edges += [f"  {a} -> {b} [style=invis, weight=10];" for a, b in zip(column, column[1:])]
        last_node = out
    later_edges = list(dict.fromkeys(later_edges))  # an op reading one value twice draws one edge
    for e in later_edges:
        if isinstance(e, tuple):
            _, src, callee = e
            if callee in entry_node:
                lines.append(f'  {src} -> {entry_node[callee]} [style=dashed, constraint=false, '
                             f'lhead="cluster_{_dot_escape(callee)}"];')
        else:
            lines.append(e)
    lines += order_edges
    lines.append("}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# Copying


def is_call(op, fn):
    """Whether ``op`` calls the constant callable ``fn`` with positional arguments only (no keyword, no ``*``)."""
    return isinstance(op, Call) and isinstance(op.fn, Const) and op.fn.value is fn and not op.kwargs and not op.star


def uses(sg, outputs=False):
    """{Value: the ops reading it} over SubGraph ``sg`` and the SubGraphs it holds; with ``outputs``, a SubGraph's
    output counts as a read by None (handed out where the SubGraph ends)."""
    found = {}
    for s in sg.walk():
        for op in s.ops:
            for v in op.operands():
                if isinstance(v, Value):
                    found.setdefault(v, []).append(op)
        if outputs:
            for v in s.outputs:
                if isinstance(v, Value):
                    found.setdefault(v, []).append(None)
    return found


def clone(sg, mapping=None):
    """A deep copy of a SubGraph's structure: new Values and ops, the same constants.

    Values defined outside ``sg`` (free values) stay as they are unless ``mapping``
    maps them.
    """
    import copy as _copy

    mapping = {} if mapping is None else mapping

    def m(x):
        return mapping.get(x, x) if isinstance(x, Value) else x

    new = SubGraph(sg.name, [], sg.loc, sg.kind)
    for v in sg.inputs:
        nv = Value(v.hint)
        nv.is_self = v.is_self
        mapping[v] = nv
        new.inputs.append(nv)
    for op in sg.ops:
        nop = _copy.copy(op)
        nop.outputs = []
        for v in op.outputs:
            nv = Value(v.hint, nop)
            mapping[v] = nv
            nop.outputs.append(nv)
        nop.map_operands(m)
        if isinstance(op, Cond):
            nop.then_sg = clone(op.then_sg, mapping)
            nop.else_sg = clone(op.else_sg, mapping)
        elif isinstance(op, While):
            nop.cond_sg = clone(op.cond_sg, mapping)
            nop.body_sg = clone(op.body_sg, mapping)
        elif isinstance(op, Fused):
            nop.body = clone(op.body, mapping)
            nop.callables = dict(op.callables)
        new.ops.append(nop)
    new.outputs = [m(v) for v in sg.outputs]
    return new
