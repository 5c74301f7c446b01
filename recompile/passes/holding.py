"""Which changes a call makes to objects its caller holds (an analysis, not a rewrite).

Sequential and threaded mode differentiate a call with its derived gradient program: one autograd node
whose outputs are what the call returns. A tensor the call stores where its caller can read it
(``node.state = h``, ``out.append(h)`` on a list passed in, ``buf[0] = h`` or ``buf.add_(h)`` on a tensor
passed in, a global list) is not among those outputs, and would reach the caller without its gradient.
``caller_visible_change`` finds such a store, so that the call runs where torch.autograd records each op.

A value is *held* where it may be an object the caller holds, or part of one: a parameter, a global, an
attribute or item or view of a held value, a result of a callable that may hand back what it was given.
A value *holds* caller objects where it may contain one: a list the call built and appended a child's node
to. A store into a held value is visible to the caller; a store into the call's own list is not, but the
items read back from it are held. Tensor functions and methods (not views) and elementwise ops make new
values. The reading is conservative: a change it cannot rule out counts.
"""

from __future__ import annotations

import builtins
import operator

import torch

from .. import intrinsics, ir
from ..ops import facts, syntax
from .effects import attribute_read, build_time_value, int_counting, op_mutates, out_target

# Changes that put nothing into their receiver: a caller reading it afterwards finds no new tensor.
_REMOVING = frozenset({"pop", "popleft", "popitem", "remove", "discard", "clear", "sort", "reverse", "rotate",
                       "heappop", "heapify", "shuffle", "next", "zero_grad", "step", "backward", "move_to_end",
                       "delitem", "delattr", "__delitem__"})
# Changes that hand back an item of their receiver.
_TAKES_ITEM = frozenset({"pop", "popleft", "popitem", "setdefault", "heappop", "heappushpop", "heapreplace"})
# Callables whose result may be (part of) an argument: reads, iteration, views.
_READS = frozenset({getattr, operator.getitem, intrinsics.as_sequence, intrinsics.unpack, intrinsics.unpack_starred,
                    iter, next, reversed, intrinsics.reversed_sequence,
                    builtins.min, builtins.max})  # (``max(node.kids, key=...)``: a kid)
# What may hand back its receiver or a part of it: views, and the methods that split, detach or convert
_VIEW_NAMES = facts.VIEW_METHODS | {"swapdims", "detach", "numpy", "data", "split", "chunk", "unbind", "tensor_split",
                                    "hsplit", "vsplit", "dsplit", "split_with_sizes", "indices", "values",
                                    "__getitem__", "type_as", "to", "cpu", "cuda", "float", "double", "half", "type"}
_OPERATORS = frozenset(row.fn for row in (*syntax.BINARY, *syntax.UNARY, *syntax.COMPARE))
# Callables that build a container of their arguments: it holds what they hold.
_BUILDS = frozenset({intrinsics.build_list, intrinsics.build_tuple, intrinsics.build_set, intrinsics.build_dict,
                     list, tuple, set, dict, sorted, zip, enumerate, map, filter, frozenset})


class _Summary:
    """What one function's reading found, as its callers read it: which parameters are held and hold, whether
    its result is held or holds, which parameters it stores caller objects into."""

    def __init__(self):
        self.held, self.holds, self.fills = set(), set(), set()
        self.returns_held = self.returns_holds = False

    def key(self):
        return (frozenset(self.held), frozenset(self.holds), frozenset(self.fills), self.returns_held,
                self.returns_holds)


class _Reading:
    """One function's values read to a fixed point, given the summaries of the functions it invokes."""

    def __init__(self, sg, summary, summaries):
        self.sg, self.summary, self.summaries = sg, summary, summaries
        self.held, self.holds = set(), set()
        self.outer = {}  # id of a branch's or loop's input -> the operands it stands for
        self.read_from = {}  # id of a value read off a container (an item, an attribute) -> that container
        self.tensors = set()  # ids of values surely tensors (or numbers): a torch op's, arithmetic on one
        self.params = {id(v): j for j, v in enumerate(sg.inputs)}
        self.changes = []  # the ops that change a held value with something put into it
        self.counting = int_counting(sg)  # (``t += 1`` of an int counter makes a new int)
        self.grew = True

    def run(self):
        for j, v in enumerate(self.sg.inputs):
            if j in self.summary.held:
                self.mark(self.held, v)
            if j in self.summary.holds:
                self.mark(self.holds, v)
        while self.grew:
            self.grew = False
            self.changes = []
            self.walk(self.sg)
        out = self.sg.outputs
        self.summary.returns_held = any(self.is_held(v) for v in out)
        self.summary.returns_holds = any(isinstance(v, ir.Value) and id(v) in self.holds for v in out)
        return self

    # -- marks

    def mark(self, found, v):
        if isinstance(v, ir.Value) and id(v) not in found:
            found.add(id(v))
            self.grew = True
            if found is self.holds:  # (a branch's or loop's value filled: so is the outer one it stands for)
                for o in list(self.outer.get(id(v), ())) + list(self.read_from.get(id(v), ())):
                    self.mark(self.holds, o)
                if id(v) in self.params:
                    self.summary.fills.add(self.params[id(v)])

    def is_held(self, v):
        if isinstance(v, ir.Const):
            return _mutable_constant(v.value)
        return id(v) in self.held

    def reaches(self, v):
        """Whether ``v`` is or holds a caller's object."""
        return self.is_held(v) or (isinstance(v, ir.Value) and id(v) in self.holds)

    def pass_in(self, inputs, operands):
        """``inputs`` (a branch's or loop's, or an op's outputs) stand for ``operands``."""
        for v, o in zip(inputs, operands):
            if isinstance(o, ir.Value):
                self.outer.setdefault(id(v), set()).add(o)
            if self.is_held(o):
                self.mark(self.held, v)
            if isinstance(o, ir.Value) and id(o) in self.holds:
                self.mark(self.holds, v)

    # -- ops

    def walk(self, sg):
        for op in sg.ops:
            if isinstance(op, ir.Capture):
                self.mark(self.held, op.output)
            elif isinstance(op, ir.Cond):
                for branch in (op.then_sg, op.else_sg):
                    self.pass_in(branch.inputs, op.args)
                    self.walk(branch)
                    self.pass_in(op.outputs, branch.outputs)
            elif isinstance(op, ir.While):
                n = len(op.loop_vars)
                for s in (op.cond_sg, op.body_sg):
                    self.pass_in(s.inputs, [*op.loop_vars, *op.invariants])
                    self.pass_in(s.inputs[:n], op.body_sg.outputs)
                self.walk(op.cond_sg)
                self.walk(op.body_sg)
                self.pass_in(op.outputs, op.loop_vars)
                self.pass_in(op.outputs, op.body_sg.outputs)
            elif isinstance(op, ir.Invoke):
                self.invoke(op)
            elif isinstance(op, ir.Call) and op not in self.counting:
                self.call(op)
                if _makes_tensor(op, _callable(op.fn), self.tensors):
                    self.tensors.update(id(v) for v in op.outputs)
            elif isinstance(op, ir.Fused):
                self.tensors.update(id(v) for v in op.outputs)

    def invoke(self, op):
        callee = self.summaries.setdefault(op.callee, _Summary())
        for j, a in enumerate(op.args):
            if self.is_held(a):
                callee.held.add(j)
            if isinstance(a, ir.Value) and id(a) in self.holds:
                callee.holds.add(j)
        if callee.returns_held:
            self.mark(self.held, op.output)
        if callee.returns_holds:
            self.mark(self.holds, op.output)
        for j in list(callee.fills):  # (a copy: marking may fill this very function's, in a recursion)
            if j < len(op.args):
                self.mark(self.holds, op.args[j])

    def call(self, op):
        if op_mutates(op):
            receiver, stored, name = _store(op)
            if receiver is not None:
                # (``xs.append(node)`` and ``xs += node.kids`` put the objects in; ``h.add_(m)`` only numbers,
                # ``h.add_(hs[0])`` those of an item of a list the call made)
                copies = _copies_numbers(op, name) or id(receiver) in self.tensors
                if any(self.reaches(v) for v in stored if isinstance(v, ir.Value) and not (
                        copies and id(v) not in self.holds)):
                    self.mark(self.holds, receiver)
                if self.is_held(receiver) and name not in _REMOVING:
                    self.changes.append(op)
                # (what it returns is its receiver, ``x += y``'s ``x``, or something new, ``xs.append``'s None)
                if self.is_held(receiver):
                    self.mark_all(self.held, op.outputs)
                if isinstance(receiver, ir.Value) and id(receiver) in self.holds:
                    if name in _TAKES_ITEM:  # (``stack.pop()`` of the call's list: one of its items)
                        self.mark_all(self.held, op.outputs)
                    self.mark_all(self.holds, op.outputs)
                return
        fn = _callable(op.fn)
        if facts.among(fn, _READS) and op.args and isinstance(op.args[0], ir.Value):
            for out in op.outputs:  # (an item of the call's list filled later fills the list: ``groups[0]``)
                self.read_from.setdefault(id(out), set()).add(op.args[0])
        # (a module of ``self``, ``self.lin(x)``, is the program's own: what it returns comes of its arguments)
        callable_read = [] if _of_self(op.fn) else [op.fn]
        if not any(self.reaches(v) for v in [*callable_read, *op.args, *(v for _, v in op.kwargs)]):
            return
        if facts.among(fn, _OPERATORS):
            if self.may_join(fn, op.args):  # (``xs + ys``, ``[node] * 2``: a new list of the same items)
                self.mark_all(self.holds, op.outputs)
        elif facts.among(fn, _BUILDS):
            self.mark_all(self.holds, op.outputs)  # (a new container of the items)
        elif not _makes_new(op, fn):
            self.mark_all(self.held, op.outputs)

    def may_join(self, fn, args):
        """Whether operator ``fn`` on ``args`` may make a new container of caller objects: ``xs + ys`` of
        containers that are or hold them, or ``node.kids * 2``, unless an operand is a float or bool constant or
        surely a tensor (numbers, tensors). Other operators make numbers or tensors."""
        if any((isinstance(a, ir.Const) and isinstance(a.value, (float, bool))) or id(a) in self.tensors
               for a in args):
            return False
        return fn in (operator.add, operator.mul) and any(self.reaches(a) for a in args)

    def mark_all(self, found, values):
        for v in values:
            self.mark(found, v)


def _makes_tensor(op, fn, tensors):
    """Whether Call ``op`` surely makes a tensor or a number (never a container): a torch function or tensor
    method, or an operator one of whose operands is surely one or a float."""
    if facts.among(fn, _OPERATORS) or facts.among(fn, syntax.AUGMENTED):
        return any((isinstance(a, ir.Const) and isinstance(a.value, float)) or id(a) in tensors for a in op.args)
    if fn is operator.getitem:  # (a tensor's item, row or view is a tensor)
        return bool(op.args) and id(op.args[0]) in tensors
    module = getattr(fn, "__module__", None) or ""
    if fn is not None and module.startswith("torch"):
        return True
    owner, name = _method_name(op.fn)  # (a tensor's method, ``h.add_(x)`` too: its result is a tensor)
    return fn is None and isinstance(name, str) and hasattr(torch.Tensor, name) and id(owner) in tensors


def _copies_numbers(op, name):
    """Whether a mutating Call changes its receiver's numbers, not the objects it holds: a tensor's in-place
    method (``h.add_(m)``), ``out=``, ``inplace=True``. (An augmented assignment may be a list's:
    ``out += node.kids`` puts the kids in.)"""
    return name in ("out", "inplace") or (isinstance(name, str) and name.endswith("_") and not name.endswith("__"))


def _mutable_constant(value):
    """Whether a constant operand may be an object the caller (or anyone) holds: not an immutable value
    (``facts.immutable``) nor a callable."""
    return not facts.immutable(value) and not callable(value)


def _callable(fn):
    """What ``fn`` (a Call's callable operand) is when the program is built, or None: a constant, a global,
    an attribute of a module global (``torch.tanh``)."""
    if isinstance(fn, ir.Const):
        return fn.value
    producer = fn.op if isinstance(fn, ir.Value) else None
    if isinstance(producer, ir.Capture) and producer.source_kind in ("global", "closure"):
        return build_time_value(producer)
    read = attribute_read(fn)
    if read is not None:
        owner, name = read
        if isinstance(owner, ir.Value) and isinstance(owner.op, ir.Capture) and owner.op.source_kind == "global":
            module = build_time_value(owner.op)
            if type(module) is type(torch):
                return ir.safe_getattr(module, name)
    return None


def _of_self(fn):
    """Whether a Call's callable operand is an attribute of the method's own instance (``self.cell``)."""
    producer = fn.op if isinstance(fn, ir.Value) else None
    if isinstance(producer, ir.Capture) and producer.source_kind == "attr":
        base = producer.base
    elif attribute_read(fn) is not None:
        base = attribute_read(fn)[0]
    else:
        return False
    return isinstance(base, ir.Value) and base.is_self


def _method_name(fn):
    """The name of the method a Call's callable operand reads (``x.append``), or None."""
    producer = fn.op if isinstance(fn, ir.Value) else None
    if attribute_read(fn) is not None:
        return attribute_read(fn)
    if isinstance(producer, ir.Capture) and producer.source_kind == "attr":
        return producer.base, producer.name.rsplit(".", 1)[-1]
    return None, None


def _makes_new(op, fn):
    """Whether Call ``op`` surely makes a new value, none of its operands or a part of one: a torch function
    that is not a view, a tensor method that is not one, a builtin of numbers."""
    if fn is not None:
        if facts.among(fn, _READS) or facts.among(fn, _BUILDS):
            return False
        name = getattr(fn, "__name__", None)
        module = getattr(fn, "__module__", None) or ""
        if module.startswith("torch") and name not in _VIEW_NAMES and not facts.mutating_method(name):
            return True
        return facts.among(fn, (len, int, float, bool, str, abs, round, isinstance, hash, id, type, sum, any, all,
                           intrinsics.has_index))
    owner, name = _method_name(op.fn)
    return (isinstance(name, str) and hasattr(torch.Tensor, name) and name not in _VIEW_NAMES
            and not facts.mutating_method(name))


def _store(op):
    """(the operand a mutating Call changes, the operands it puts into it, the change's name) of ``op``."""
    target = out_target(op)
    if target is not None:
        return target, [], "out"
    if any(name == "inplace" for name, _ in op.kwargs):
        return (op.args[0] if op.args else None), [], "inplace"
    owner, name = _method_name(op.fn)
    if name is not None and facts.mutating_method(name) and owner is not None:
        return owner, list(op.args), name
    fn = _callable(op.fn)
    name = getattr(fn, "__name__", None)
    if fn is intrinsics.write_global or fn is intrinsics.set_cell:
        return op.args[0], list(op.args[1:]), name
    if not op.args:
        return None, [], name
    return op.args[0], list(op.args[1:]), name


def caller_visible_change(target, stage):
    """The first op, among the functions a call of ``target`` (an ``ir.Target``) may run, that may put a
    value into an object the caller holds (``passes.holding``); None where every change is to the call's own
    objects."""
    targets = {t.ir_name: t for t in ir.reachable(target, stage, key=lambda t: t.ir_name)}
    summaries = {name: _Summary() for name in targets}
    entry = summaries[target.ir_name]
    n = len(target.subgraph(stage).inputs)
    entry.held.update(range(n))
    while True:
        before = {name: s.key() for name, s in summaries.items()}
        readings = {name: _Reading(t.subgraph(stage), summaries[name], summaries).run()
                    for name, t in targets.items()}
        if all(summaries[name].key() == before.get(name) for name in summaries):
            break
    for name in targets:
        if readings[name].changes:
            return readings[name].changes[0]
    return None
