"""Which compiled functions may change state their caller can see (an analysis, not a rewrite).

Codegen groups independent Invokes and computes the arguments of a whole group
before its first call runs. That is only the same as Python when the earlier
calls do not mutate what those arguments read, so a call whose program may
mutate (``obj.attr = v``, ``xs[i] = v``, ``x += y``, ``xs.append(v)``,
``t.add_(v)``, ... anywhere in it or in what it invokes) keeps its place.
Calls of undecorated helpers are taken as not mutating what the caller reads; whether a run may share values
computed once for every instance also asks the helpers the program names (``callables_named``).
"""

from __future__ import annotations

import builtins
import inspect
import operator

from .. import ir
from ..ops import facts


_COUNTING = (operator.iadd, operator.isub)


def op_mutates(op):
    """True when ``op`` itself may change an object in place."""
    if not isinstance(op, ir.Call):
        return False
    if out_target(op) is not None:  # torch.mul(a, b, out=c) writes c
        return True
    if any(name == "inplace" and not (isinstance(v, ir.Const) and not v.value) for name, v in op.kwargs):
        return True  # F.relu(x, inplace=True) writes x
    fn = op.fn
    if isinstance(fn, ir.Const):
        return facts.among(fn.value, facts.MUTATING)
    producer = fn.op
    if (isinstance(producer, ir.Call) and isinstance(producer.fn, ir.Const) and producer.fn.value is getattr
            and isinstance(producer.args[1], ir.Const)):
        return facts.mutating_method(producer.args[1].value)  # obj.append(...)
    if isinstance(producer, ir.Capture):
        if producer.source_kind == "attr":
            return facts.mutating_method(producer.source)  # self.append(...) in a list subclass
        value = build_time_value(producer)  # setattr(...) read as a builtin, heappush imported by name
        return facts.among(value, facts.MUTATING) or facts.mutating_method(ir.safe_getattr(value, "__name__"))
    return False


def out_target(op):
    """The operand Call ``op`` names as ``out=`` (the tensor a torch function writes its result into), or
    None. (``out=None`` is torch's default: no target.)"""
    for name, value in op.kwargs:
        if name == "out" and not (isinstance(value, ir.Const) and value.value is None):
            return value
    return None


def subgraph_may_mutate(sg, may_mutate):
    """Whether running SubGraph ``sg`` (the branches and loops it holds too) may mutate state: an op of its
    own, or an Invoke whose program may (``may_mutate(invoke)``)."""
    counting = int_counting(sg)
    return any((op_mutates(o) and o not in counting) or (isinstance(o, ir.Invoke) and may_mutate(o))
               for s in sg.walk() for o in s.ops)


def int_counting(sg):
    """The ``+=`` / ``-=`` ops (in ``sg`` and what it holds) of a loop's counter that starts as an int and
    only moves by int constants (``t = 0; while ...: t += 1``): an int's augmented assignment makes a new
    int, and changes nothing in place."""
    found = set()
    for s in sg.walk():
        for o in s.ops:
            if not isinstance(o, ir.While):
                continue
            for j, start in enumerate(o.loop_vars):
                step = o.body_sg.outputs[j]
                up = step.op if isinstance(step, ir.Value) else None
                if (isinstance(start, ir.Const) and type(start.value) is int and isinstance(up, ir.Call)
                        and isinstance(up.fn, ir.Const) and up.fn.value in _COUNTING and len(up.args) == 2
                        and not up.kwargs and up.args[0] is o.body_sg.inputs[j]
                        and isinstance(up.args[1], ir.Const) and type(up.args[1].value) is int):
                    found.add(up)
    return found


def build_time_value(capture):
    """What a global or closure Capture reads now (at build time); None when unbound."""
    if capture.source_kind == "closure":
        try:
            return capture.source.cell_contents
        except ValueError:
            return None
    if capture.source_kind == "global":
        if capture.name in capture.source:
            return capture.source[capture.name]
        return getattr(builtins, capture.name, None)
    return None


def subgraph_mutates(sg):
    counting = int_counting(sg)
    return any(op_mutates(op) and op not in counting for s in sg.walk() for op in s.ops)


def invoke_may_mutate(invoke, stage):
    """Whether the program an Invoke runs — its callee and all it may invoke — may mutate state."""
    return program_may_mutate(invoke.target, stage)


def program_may_mutate(target, stage):
    """Whether the compiled function ``target`` names (an ``ir.Target``), or anything it may invoke, may
    mutate state."""
    return any(subgraph_mutates(t.subgraph(stage)) for t in ir.reachable(target, stage))


# Builtins whose call is an effect of its own, seen by the user (output, input, files)
_VISIBLE = frozenset({print, input, open, breakpoint, exec, eval})


def program_runs_again_unseen(target, stage):
    """Whether the compiled function ``target`` names, run again, changes and shows nothing twice: neither it
    nor what it may invoke changes state in place, calls a builtin with an effect of its own (``print``,
    ``open``) or a random draw by name. (A callable it reads at run time, ``self.drop``, is not seen here.)"""
    if program_may_mutate(target, stage):
        return False
    for t in ir.reachable(target, stage):
        for sg in t.subgraph(stage).walk():
            for op in sg.ops:
                if isinstance(op, ir.Call):
                    fn = resolve(op.fn)
                    if facts.among(fn, _VISIBLE) or facts.among(fn, facts.DRAWS):
                        return False
    return True


def callables_named(target, stage):
    """(callable, class or None) for each object that a Call of the program of ``target`` (and of all it may
    invoke) names, where it is known when the program is built: a global, a closure variable or an attribute of
    one (``resolve``: ``helper(v)``), or in a method, ``self.<name>`` where the owner class defines ``name``
    (``self.bump(v)``: the plain function and that class)."""
    for t in ir.reachable(target, stage):
        owner = getattr(t, "owner", None)
        for sg in t.subgraph(stage).walk():
            for op in sg.ops:
                if isinstance(op, ir.Call):
                    fn = resolve(op.fn)
                    if fn is not None:
                        yield fn, None
                    elif owner is not None:
                        found = _class_attribute(op.fn, owner)
                        if found is not None:
                            yield found


def _class_attribute(operand, owner):
    """(what ``owner`` defines as ``name``, ``owner`` where that is a method bound to the instance, else None)
    where the operand reads ``self.<name>``: a method's plain function, or a static or class method's, examined
    as a plain one; else None."""
    producer = operand.op if isinstance(operand, ir.Value) else None
    if not (isinstance(producer, ir.Capture) and producer.source_kind == "attr" and isinstance(producer.source, str)
            and isinstance(producer.base, ir.Value) and producer.base.is_self):
        return None
    try:
        found = inspect.getattr_static(owner, producer.source)
    except AttributeError:
        return None
    if isinstance(found, (staticmethod, classmethod)):
        return found.__func__, None
    return found, owner


def resolve(operand):
    """The object an operand holds when the program is built, if that is known (a constant, a global or closure
    variable, an attribute of one: ``torch.randn``); else None."""
    if isinstance(operand, ir.Const):
        return operand.value
    producer = operand.op
    if isinstance(producer, ir.Capture) and producer.source_kind in ("global", "closure"):
        return build_time_value(producer)
    if (isinstance(producer, ir.Call) and isinstance(producer.fn, ir.Const) and producer.fn.value is getattr
            and len(producer.args) == 2 and not producer.kwargs and isinstance(producer.args[1], ir.Const)
            and isinstance(producer.args[1].value, str)):
        base = resolve(producer.args[0])
        return None if base is None else ir.safe_getattr(base, producer.args[1].value)
    return None
