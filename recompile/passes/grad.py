"""Gradient derivation: from a function SubGraph, its forward-with-saves and its gradient SubGraph.

For a function ``F`` the pass makes two function SubGraphs:

- ``F:fwd(ctx, *inputs)`` runs F and returns ``(result, record)``. The record
  is a tuple of the forward values the gradient needs (the value cache entry
  of this activation). It holds the records of the calls F made, so the
  records form a tree that mirrors the call tree: a record is found by its
  path (parent record, call site, loop iteration; Jeong et al. §5), never in a
  stack shared between frames, and it is dropped as soon as its gradient has
  run.
- ``F:bwd(ctx, record)`` runs the reverse-mode rules of F's ops in reverse
  order. Cotangents are kept by tensor in ``ctx`` (``autodiff.backprop``):
  a rule reads the cotangent of its result and adds to those of its inputs,
  so tensors that travel through lists, tuples, dicts and objects need no rule
  of their own.

Control flow keeps its shape:

- an ``Invoke`` of G becomes an Invoke of ``G:fwd`` (its record is saved) and,
  at the same position in the gradient, an Invoke of ``G:bwd``: recursion
  stays recursion (Jeong et al. Fig. 5b), mutual recursion likewise;
- a ``Cond`` saves which branch ran; its gradient is a Cond on that flag;
- a ``While`` pushes each iteration's record on a linked list ``(record, rest)``
  (the trip count is its length); its gradient loops over that list, last
  iteration first (Yu et al. §5.1). Early return, break and continue reach
  here already lowered to these.

Each forward ``Call`` keeps its place. A Call of a callable known when the
program is built runs as written and its rule is a constant; any other call
goes through ``backprop.call_forward``, which looks the rule up by the
callable at run time or records the call for torch.autograd (the fallback).
A value that a later op of the same SubGraph changes in place (``y += 1``)
gets its version saved, and the gradient of an op that read it checks it, as
torch does. A view read or handed on after something may have changed its
tensor in place (an in-place op, or a call, branch or loop that may change a
value: ``passes.effects``) is checked when it is read (``bp.check_unchanged``):
the gradient cannot follow the change as torch's does.
"""

from __future__ import annotations

import operator
import os

import torch

from .. import intrinsics, ir
from ..ops import facts
from ..autodiff import backprop as bp
from ..autodiff import rules as grad_rules
from . import effects
from .fusion import unfuse

BACKWARD_CALLS = {bp.call_backward, bp.read_backward, bp.backward_of}


def forward_name(name):
    """The name of the forward-with-saves SubGraph of SubGraph ``name`` (``F:fwd``)."""
    return f"{name}:fwd"


def backward_name(name):
    """The name of the gradient SubGraph of SubGraph ``name`` (``F:bwd``)."""
    return f"{name}:bwd"


def derive(sg, may_mutate=lambda invoke: True):
    """(``F:fwd``, ``F:bwd``) for function SubGraph ``sg`` (not changed).

    An Invoke's target (``ir.Target``) gives the handles of its forward-with-saves
    and gradient programs; ``may_mutate(invoke)`` whether the program it runs may change
    a value in place (``passes.effects``). A Fused op is derived from its members
    (``fusion.unfuse``).
    """
    sg = unfuse(sg)
    deriver = _Deriver(may_mutate)
    ctx_f, ctx_b = ir.Value("ctx"), ir.Value("ctx")
    fwd = ir.SubGraph(forward_name(sg.name), [ctx_f, *sg.inputs], sg.loc, "function")
    bwd = ir.SubGraph(backward_name(sg.name), [ctx_b], sg.loc, "function")
    rec_f = deriver.body(sg, fwd, bwd, ctx_f, ctx_b)
    pair = ir.Call(sg.loc, ir.Const(intrinsics.build_tuple), [sg.outputs[0], rec_f], hints=("result",))
    fwd.ops.append(pair)
    fwd.outputs = [pair.output]
    bwd.outputs = [ir.Const(None)]
    return fwd, bwd


def _const_fn(op):
    if isinstance(op.fn, ir.Const):
        try:
            hash(op.fn.value)
            return op.fn.value
        except TypeError:
            return None
    return None


def _swap_outputs(op, n=None):
    """Give ``op`` fresh outputs; return its old ones (to be produced by a following op)."""
    old = op.outputs
    op.outputs = [ir.Value(v.hint, op) for v in old] if n is None else [ir.Value("", op) for _ in range(n)]
    return old


def _produce(op, values):
    """Make ``op`` the producer of ``values`` (its outputs)."""
    op.outputs = list(values)
    for v in values:
        v.op = op


class _Deriver:
    def __init__(self, may_mutate):
        self.may_mutate = may_mutate

    def body(self, sg, fwd, bwd, ctx_f, ctx_b, prologue=()):
        """Move ``sg``'s ops (already rewired to ``fwd``'s inputs) into ``fwd`` with saving, fill ``bwd``.

        Returns the forward Value of this activation's record. ``bwd`` gets the
        record as its input after ``ctx_b`` unless ``prologue`` ops produce it.
        """
        chunks = []  # per forward op, its gradient ops (in order); run last chunk first
        guarded = _changed_later(sg.ops, sg.outputs, sg.inputs)
        stale = _read_after_a_change(sg.ops, sg.outputs, sg.inputs, self.may_mutate)
        watched = {v for values in stale.values() for v in values}
        made = {}  # watched Value -> its version when it was made (an input's: when the SubGraph began)
        for v in sg.inputs:
            if v in watched:
                made[v] = _version_now(fwd, sg, v)
        # (what each op changes in place, read before any op is rewired: the callable of ``v.sigmoid_()`` is
        # noted when its getattr is, after which it no longer names its receiver)
        changes = {op: _in_place_target(op) for op in sg.ops}
        unread = {op: _values_not_read(op) for op in sg.ops}
        indexed = {op: list(op.args) for op in sg.ops if _calls_getitem(op)}  # (their checks are given them)
        for j, op in enumerate(sg.ops):
            for v in stale.get(j, ()):
                fwd.ops.append(ir.Call(op.loc, ir.Const(bp.check_unchanged), [v, made[v], _where(op)], n_outputs=0))
            outputs = list(op.outputs)
            chunk = self.op(op, fwd.ops, ctx_f, ctx_b)
            for v in outputs:
                if v in watched:
                    made[v] = _version_now(fwd, op, v)
            backward = [o for o in chunk if isinstance(o, ir.Call) and _const_fn(o) in BACKWARD_CALLS]
            for v in guarded.get(op, ()) if len(backward) == 1 else ():
                if v in unread[op]:
                    continue  # (``x[i]`` with x changed afterwards: its gradient reads i, and only x's shape)
                # its gradient may read v: check that v is still as the op saw it
                seen = _version_now(fwd, op, v)
                back = backward[0]
                ctx, how = back.args[0], back.args[1]
                out = ir.Const(None) if _const_fn(back) is bp.backward_of else back.args[2]
                # (a rule's call also gives the check the op's arguments: see Rule.read_for_others)
                by_rule = _const_fn(back) is bp.call_backward and not back.kwargs
                check = ir.Call(op.loc, ir.Const(bp.check_version),
                                [ctx, out, v, seen, _where(op), how,
                                 ir.Const(v in op.outputs or v is changes[op]),
                                 *(back.args[4:] if by_rule else indexed.get(op, ()))], n_outputs=0)
                chunk.insert(chunk.index(back), check)  # (after what the chunk makes for the call)
            chunks.append(chunk)
        for v in stale.get(len(sg.ops), ()):  # what the SubGraph hands on is read too
            fwd.ops.append(ir.Call(sg.loc, ir.Const(bp.check_unchanged), [v, made[v], _where_end(sg)],
                                   n_outputs=0))
        grad_ops = [o for chunk in reversed(chunks) for o in chunk]
        saved = _read_from(grad_ops, _defined(fwd))
        rec = ir.Call(sg.loc, ir.Const(intrinsics.build_tuple), saved, hints=("record",))
        fwd.ops.append(rec)
        rec_b = ir.Value("record")
        restore = []
        if saved:
            unpack = ir.Call(sg.loc, ir.Const(intrinsics.unpack), [rec_b, ir.Const(len(saved))], n_outputs=len(saved),
                             hints=[v.hint for v in saved])
            mapping = dict(zip(saved, unpack.outputs))
            for o in grad_ops:
                o.map_operands(lambda x: mapping.get(x, x) if isinstance(x, ir.Value) else x)
            restore = [unpack]
        if prologue:
            prologue[-1].outputs[0:1] = [rec_b]
            rec_b.op = prologue[-1]
        else:
            bwd.inputs.append(rec_b)
        bwd.ops.extend([*prologue, *restore, *grad_ops])
        return rec.output

    # -- one forward op: append its forward form to ``out``, return its gradient ops

    def op(self, op, out, ctx_f, ctx_b):
        if isinstance(op, ir.Capture):
            out.append(op)
            old = _swap_outputs(op)
            note = ir.Call(op.loc, ir.Const(bp.note), [ctx_f, op.output])
            _produce(note, old)
            out.append(note)
            return []
        if isinstance(op, ir.Call):
            return self.call(op, out, ctx_f, ctx_b)
        if isinstance(op, ir.Invoke):
            return self.invoke(op, out, ctx_f, ctx_b)
        if isinstance(op, ir.Cond):
            return self.cond(op, out, ctx_f, ctx_b)
        if isinstance(op, ir.While):
            return self.while_(op, out, ctx_f, ctx_b)
        raise TypeError(f"no gradient for {op!r}")

    def call(self, op, out, ctx_f, ctx_b):
        fn = _const_fn(op)
        if fn is not None and fn in facts.NO_GRADIENT and fn not in facts.READS:
            out.append(op)
            return []
        if fn is operator.setitem:
            op.fn = ir.Const(bp.set_item)
            out.append(op)
            # (the index's version at the write: one changed in place afterwards would send the cotangent elsewhere)
            seen = ir.Call(op.loc, ir.Const(bp.version), op.args[1:2], n_outputs=1, hints=("version",))
            out.append(seen)
            return [ir.Call(op.loc, ir.Const(bp.setitem_backward), [ctx_b, *op.args, seen.output], n_outputs=0)]
        if fn in facts.IN_PLACE and len(op.args) == 2 and not op.star and not op.kwargs and len(op.outputs) == 1:
            update = ir.Call(op.loc, ir.Const(bp.in_place), [ctx_f, op.fn, *op.args], n_outputs=2)
            _produce(update, [op.output, ir.Value("aux", update)])
            out.append(update)
            return [self._backward_call(op, ctx_b, update.outputs[1], op.output)]
        rule = grad_rules.lookup(fn) if fn is not None else None
        if fn is not None and (rule is not None or fn in facts.READS):
            out.append(op)
            if fn in facts.READS:
                old = _swap_outputs(op)
                note = ir.Call(op.loc, ir.Const(bp.note_all if len(old) > 1 else bp.note), [ctx_f, *op.outputs],
                               n_outputs=len(old))
                _produce(note, old)
                out.append(note)
                op = _with_outputs(op, old)
            name = op.args[1] if fn is getattr else None
            if name is not None and not (isinstance(name, ir.Value) or name.value in facts.DIFFERENTIABLE_ATTRS):
                return []
            aux = ir.Const(rule)
            result, grads = self._result(op, ctx_b)
            backward = bp.read_backward if fn in facts.READS or fn is intrinsics.as_sequence else bp.call_backward
            return grads + [self._backward_call(op, ctx_b, aux, result, backward)]
        # a callable known only when it runs: look its rule up then, or record it for torch.autograd
        wrapped = ir.Call(op.loc, ir.Const(bp.call_forward), [ctx_f, op.fn, *op.args], op.kwargs,
                          star={i + 2 for i in op.star}, n_outputs=2, hints=(_hint(op), "aux"))
        out.append(wrapped)
        result, aux = wrapped.outputs
        if len(op.outputs) == 1:
            _produce(wrapped, [op.outputs[0], aux])
            result = op.outputs[0]
        elif op.outputs:
            unpack = ir.Call(op.loc, ir.Const(intrinsics.unpack), [result, ir.Const(len(op.outputs))],
                             n_outputs=len(op.outputs))
            _produce(unpack, op.outputs)
            out.append(unpack)
        return [ir.Call(op.loc, ir.Const(bp.backward_of), [ctx_b, aux], n_outputs=0)]

    def _result(self, op, ctx_b):
        """The operand naming a Call's result in the gradient: its output, or a tuple of its outputs."""
        if len(op.outputs) == 1:
            return op.outputs[0], []
        if not op.outputs:
            return ir.Const(None), []
        pack = ir.Call(op.loc, ir.Const(intrinsics.build_tuple), list(op.outputs), hints=("results",))
        return pack.output, [pack]

    def _backward_call(self, op, ctx_b, aux, result, backward=bp.call_backward):
        return ir.Call(op.loc, ir.Const(backward), [ctx_b, aux, result, op.fn, *op.args], op.kwargs,
                       star={i + 4 for i in op.star}, n_outputs=0)

    def invoke(self, op, out, ctx_f, ctx_b):
        fwd_handle, bwd_handle = op.target.forward, op.target.backward
        call = ir.Invoke(op.loc, fwd_handle.ir_name, fwd_handle, [ctx_f, *op.args], hints=(_hint(op),))
        out.append(call)
        split = ir.Call(op.loc, ir.Const(intrinsics.unpack), [call.output, ir.Const(2)], n_outputs=2)
        rec = ir.Value("record", split)
        _produce(split, [op.output, rec])
        out.append(split)
        back = ir.Invoke(op.loc, bwd_handle.ir_name, bwd_handle, [ctx_b, rec])
        return [back]

    def cond(self, op, out, ctx_f, ctx_b):
        branches_f, branches_b = [], []
        for sg, flag in ((op.then_sg, True), (op.else_sg, False)):
            c_f, c_b = ir.Value("ctx"), ir.Value("ctx")
            f = ir.SubGraph(forward_name(sg.name), [c_f, *sg.inputs], sg.loc, sg.kind)
            b = ir.SubGraph(backward_name(sg.name), [c_b], sg.loc, sg.kind)
            rec = self.body(sg, f, b, c_f, c_b)
            f.outputs = [*sg.outputs, ir.Const(flag), rec]
            branches_f.append(f)
            branches_b.append(b)
        fwd = ir.Cond(op.loc, op.pred, branches_f[0], branches_f[1], [ctx_f, *op.args], len(op.outputs) + 2)
        took_then, rec = ir.Value("took_then", fwd), ir.Value("record", fwd)
        _produce(fwd, [*op.outputs, took_then, rec])
        out.append(fwd)
        return [ir.Cond(op.loc, took_then, branches_b[0], branches_b[1], [ctx_b, rec], 0)]

    def while_(self, op, out, ctx_f, ctx_b):
        n = len(op.loop_vars)
        # forward: the loop also carries the list of iteration records
        cond = op.cond_sg
        tape_c, ctx_c = ir.Value("tape"), ir.Value("ctx")
        cond.inputs[n:n] = [tape_c]
        cond.inputs.append(ctx_c)
        cond.name = forward_name(cond.name)
        body = op.body_sg
        tape_in, ctx_in = ir.Value("tape"), ir.Value("ctx")
        c_b = ir.Value("ctx")
        body_f = ir.SubGraph(forward_name(body.name), [*body.inputs[:n], tape_in, *body.inputs[n:], ctx_in], body.loc,
                             body.kind)
        body_b = ir.SubGraph(backward_name(body.name), [], body.loc, body.kind)
        tape_b = ir.Value("tape")
        split = ir.Call(body.loc, ir.Const(intrinsics.unpack), [tape_b, ir.Const(2)], n_outputs=2,
                        hints=("record", "tape"))
        rest = split.outputs[1]
        rec = self.body(body, body_f, body_b, ctx_in, c_b, prologue=[split])
        push = ir.Call(body.loc, ir.Const(intrinsics.build_tuple), [rec, tape_in], hints=("tape",))
        body_f.ops.append(push)
        body_f.outputs = [*body.outputs, push.output]
        body_b.inputs = [tape_b, c_b]
        body_b.outputs = [rest]
        fwd = ir.While(op.loc, cond, body_f, [*op.loop_vars, ir.Const(None)], [*op.invariants, ctx_f])
        tape = ir.Value("tape", fwd)
        _produce(fwd, [*op.outputs, tape])
        out.append(fwd)
        # gradient: pop the records, last iteration first
        t_c, c_c = ir.Value("tape"), ir.Value("ctx")
        more = ir.SubGraph(f"{body.name}:more", [t_c, c_c], body.loc, "cond")
        test = ir.Call(op.loc, ir.Const(operator.is_not), [t_c, ir.Const(None)])
        more.ops.append(test)
        more.outputs = [test.output]
        return [ir.While(op.loc, more, body_b, [tape], [ctx_b])]


def _calls_getitem(op):
    """Whether ``op`` is ``x[i]`` (its gradient reads ``i`` where ``x`` is a tensor, nothing of a list's)."""
    return isinstance(op, ir.Call) and _const_fn(op) is operator.getitem and len(op.args) == 2 and not op.kwargs


def _values_not_read(op):
    """The arguments of Call ``op`` whose values its rule does not read (``Rule.reads_only``: ``x`` of ``x[i]``),
    where no other argument is the same Value."""
    fn = _const_fn(op) if isinstance(op, ir.Call) else None
    rule = grad_rules.lookup(fn) if fn is not None and not op.kwargs and not op.star else None
    if rule is None or rule.reads_only is None or rule.method:
        return frozenset()
    read = {a for k, a in enumerate(op.args) if k in rule.reads_only}
    return frozenset(a for a in op.args if isinstance(a, ir.Value) and a not in read)


def _where(op):
    """``file:line`` of ``op``, as the checks name it."""
    return ir.Const(f"{os.path.basename(op.loc.filename)}:{op.loc.lineno}")


_HANDS_ON = {"function": "what the function returns", "then": "what the branch hands on",
             "else": "what the branch hands on", "body": "what the loop body hands on"}


def _where_end(sg):
    """Where a check of what ``sg`` hands on (returns, or gives the next iteration) names: its last op."""
    loc = sg.ops[-1].loc if sg.ops else sg.loc
    what = _HANDS_ON.get(sg.kind, "what it hands on")
    return ir.Const(f"{os.path.basename(loc.filename)}:{loc.lineno} ({what})")


def _version_now(fwd, op, v):
    """Append to ``fwd`` the reading of ``v``'s version (after ``op``); return the Value read."""
    seen = ir.Call(op.loc, ir.Const(bp.version), [v], hints=("version",))
    fwd.ops.append(seen)
    return seen.output


def _changed_later(ops, outputs=(), inputs=()):
    """{op: [values]}: values an op reads or makes that may be changed in place after it ran: by a later
    op of the SubGraph (``y = torch.tanh(x); y += 1``); by the caller or the enclosing SubGraph, when the
    SubGraph returns them (``t = callee(x); t += 1``, also inside a returned tuple, list, set or dict)
    or received them as inputs (``q = x / y`` in a branch, then ``x += 1`` after the ``if``). The
    gradient of the op then checks they were not, where its rule reads them."""
    guarded = {}
    for k, op in enumerate(ops):
        target = _in_place_target(op)
        if target is not None:
            targets = [target]
        elif isinstance(op, (ir.Cond, ir.While)) and _changes_inside(op):
            # (``if d: y *= 2`` after ``y = torch.sigmoid(x)``: what a branch or a loop body may change is
            # any value it is given)
            targets = [v for v in op.operands() if isinstance(v, ir.Value)]
        else:
            continue
        for target in (a for t in targets for a in _may_be(t, ops[:k])):
            # (a view of it, ``v[1]``, ``v.t()``, ``v.narrow(0, 1, 2)``, shares its version: an op that read the
            # view checks the view)
            items = [target]
            for earlier in ops[:k]:
                base = _viewed(earlier)
                if base is not None and base in items:
                    items.extend(earlier.outputs)
                elif isinstance(earlier, _HANDING_ON) and any(v in items for v in earlier.operands()):
                    items.extend(earlier.outputs)  # (``a = x if c else v``: a may be v)
            for earlier in ops[:k]:  # (x.div_(y) makes x too: its receiver is its result)
                if target in _reads(earlier) or target in earlier.outputs or target is _in_place_target(earlier):
                    guarded.setdefault(earlier, []).append(target)
                    continue
                read = [v for v in _reads(earlier) if v in items[1:]]
                if read:
                    guarded.setdefault(earlier, []).extend(read)
    outside = _returned_values(outputs) | set(inputs)
    for op in ops if inputs else ():  # (a view of an input, ``x[j]`` in a loop body, shares its version too)
        base = _viewed(op)
        if base is not None and base in outside:
            outside.update(op.outputs)
    for op in ops if outside else ():
        for v in (*_reads(op), *op.outputs):
            if v in outside and v not in guarded.get(op, ()):
                guarded.setdefault(op, []).append(v)
    return guarded


_HANDING_ON = (ir.Cond, ir.While, ir.Invoke)  # (ops whose outputs may be values they were given)


def _may_be(target, ops):
    """``target`` and the values of ``ops`` it may be, or be a view of, when it is changed in place: what a
    branch or a loop hands on may be a value it was given (``w = v if c else v * 2``), as may what a call
    returns; a view's change changes its base. (The checks read versions at run time: where the value is
    another, they find nothing changed.)"""
    found = [target]
    for op in reversed(ops):
        if not any(v in found for v in op.outputs):
            continue
        if isinstance(op, _HANDING_ON):
            found.extend(v for v in op.operands() if isinstance(v, ir.Value) and v not in found)
        else:
            base = _viewed(op)
            if base is not None and base not in found:
                found.append(base)
    return found


# (a copy that ``reshape``, ``flatten`` or ``contiguous`` made has a version of its own: the check at run time
# then finds nothing changed, as eager's does)
_VIEW_METHODS = facts.VIEW_METHODS
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_VIEW_FUNCTIONS = frozenset(getattr(torch, name) for name in _VIEW_METHODS if callable(getattr(torch, name, None)))


def _viewed(op):
    """The tensor whose view ``op`` makes (``v[1]``, ``v.t()``, ``v.T``, ``torch.narrow(v, ...)``), or None."""
    if not isinstance(op, ir.Call):
        return None
    fn = _const_fn(op)
    if fn is operator.getitem or fn in _VIEW_FUNCTIONS:
        return op.args[0] if op.args else None
    if fn is getattr and isinstance(op.args[1], ir.Const) and op.args[1].value in _VIEW_ATTRIBUTES:
        return op.args[0]
    method = op.fn.op if isinstance(op.fn, ir.Value) else None
    if (isinstance(method, ir.Call) and _const_fn(method) is getattr and isinstance(method.args[1], ir.Const)
            and method.args[1].value in _VIEW_METHODS):
        owner = method.args[0]
        if isinstance(owner, ir.Value) and isinstance(owner.op, ir.Capture) and \
                effects.build_time_value(owner.op) is torch:  # (``torch.transpose(v, 0, 1)``: a function of v)
            return op.args[0] if op.args else None
        return owner
    return None


def _reads(op):
    """The values ``op`` reads: its operands and, for a method call (``v.sin()``, ``v.mul(w)``), the tensor it is
    bound to, which its gradient may read as it reads an argument; for ``x[i, j]``, the index tuple's values."""
    receiver = _receiver(op)
    read = op.operands() if receiver is None else [*op.operands(), receiver]
    if _calls_getitem(op):  # (``x[i, j]``: the tuple's tensors are the index its gradient reads)
        index = op.args[1]
        made = index.op if isinstance(index, ir.Value) else None
        if isinstance(made, ir.Call) and _const_fn(made) is intrinsics.build_tuple and not made.star:
            read.extend(v for v in made.args if isinstance(v, ir.Value))
    return read


def _receiver(op):
    """The Value a method call is bound to (``%m = call %sin()`` after ``%sin = getattr(%v, 'sin')``), or None."""
    if isinstance(op, ir.Call) and isinstance(op.fn, ir.Value) and isinstance(op.fn.op, ir.Call) \
            and _const_fn(op.fn.op) is getattr and isinstance(op.fn.op.args[0], ir.Value):
        return op.fn.op.args[0]
    return None


def _changes_inside(op):
    """Whether a Cond's branches or a While's condition or body hold an op that changes a value in place."""
    return any(_in_place_target(inner) is not None for sg in op.subgraphs() for s in sg.walk() for inner in s.ops)


def _read_after_a_change(ops, outputs=(), inputs=(), may_mutate=lambda invoke: True):
    """{index of op: [values]}: values the op reads after an op that may have changed a value in place since
    they were made in the SubGraph or came in as its inputs (an in-place op, or a call, branch or loop that may
    hold one). Index ``len(ops)`` lists the SubGraph's outputs that are so read (what a function returns, a
    branch or a loop body hands on). If the change reached them (a view of the changed tensor, also one made,
    handed in or handed back by a call), the derived gradient would send their cotangent to what they were
    when made: the op checks, when it runs, that they are unchanged (``bp.check_unchanged``). A call that
    may change nothing (``passes.effects``) is not a change, so recursion that changes nothing in place gets
    no check. (The version reads and checks move like pure ops in ``codegen.plan``: a check of a call's
    arguments, or a version read of its result, keeps independent calls issued together.)"""
    made_at, last_change, found = dict.fromkeys(inputs, -1), -1, {}

    def note_stale(j, values):
        stale = (x for x in values if isinstance(x, ir.Value) and made_at.get(x, last_change) < last_change)
        for v in dict.fromkeys(stale):
            found.setdefault(j, []).append(v)

    for j, op in enumerate(ops):
        if last_change >= 0 and _moves_data(op):
            note_stale(j, op.operands())
        if _may_change(op, may_mutate):
            last_change = j
        for v in op.outputs:
            made_at[v] = j
    if last_change >= 0:
        note_stale(len(ops), outputs)
    return found


def _may_change(op, may_mutate):
    """Whether ``op`` may change a value in place: an in-place op, a call whose program may, or a branch or
    loop holding either."""
    if _in_place_target(op) is not None:
        return True
    if isinstance(op, ir.Invoke):
        return may_mutate(op)
    return any(_may_change(o, may_mutate) for sub in op.subgraphs() for o in sub.ops)


def _moves_data(op):
    """Whether an op may pass the values it reads on to a gradient (not ``x.shape``, ``len(x)``, ``x > 0``)."""
    if not isinstance(op, ir.Call):
        return True
    fn = _const_fn(op)
    if fn is getattr:
        name = op.args[1] if len(op.args) > 1 else None
        return not (isinstance(name, ir.Const) and name.value in facts.DATA_ATTRS)
    return fn is None or fn in facts.BUILDERS or fn in facts.MOVES or fn not in facts.NO_GRADIENT


def _returned_values(outputs):
    """The Values a SubGraph returns, and those packed into a returned tuple, list, set or dict
    (``return h, loss``; ``return [y]``)."""
    found, pending = set(), [v for v in outputs if isinstance(v, ir.Value)]
    while pending:
        v = pending.pop()
        if v in found:
            continue
        found.add(v)
        if isinstance(v.op, ir.Call) and _const_fn(v.op) in facts.BUILDERS:
            pending.extend(a for a in v.op.args if isinstance(a, ir.Value))
    return found


def _in_place_target(op):
    """The Value a Call changes in place (``x += y``, ``x[i] = v``, ``x.add_(y)``, ``x.relu_()``), or None."""
    if not isinstance(op, ir.Call):
        return None
    out = effects.out_target(op) if op.args else None
    if out is not None:  # torch.mul(a, b, out=c)
        return out if isinstance(out, ir.Value) else None
    fn = _const_fn(op)
    if op.args and (fn in facts.IN_PLACE or fn is operator.setitem or any(
            k == "inplace" and isinstance(v, ir.Const) and v.value is True for k, v in op.kwargs)):
        target = op.args[0]  # (F.relu(x, inplace=True) too)
    elif isinstance(op.fn, ir.Value) and isinstance(op.fn.op, ir.Call) and _const_fn(op.fn.op) is getattr:
        name = op.fn.op.args[1]
        is_method = isinstance(name, ir.Const) and isinstance(name.value, str)
        if not (is_method and name.value.endswith("_") and not name.value.endswith("__")):
            return None
        target = op.fn.op.args[0]
    else:
        return None
    return target if isinstance(target, ir.Value) else None


def _with_outputs(op, outputs):
    """A view of Call ``op`` whose outputs are ``outputs`` (for building its gradient call)."""
    import copy

    view = copy.copy(op)
    view.outputs = list(outputs)
    return view


def _hint(op):
    return op.outputs[0].hint if op.outputs else ""


def _defined(sg):
    values = set(sg.inputs)
    for op in sg.ops:
        values.update(op.outputs)
    return values


def _read_from(ops, values):
    """The Values of ``values`` that ``ops`` read, in order of first use."""
    seen, order = set(), []
    for op in ops:
        for x in op.operands():
            if isinstance(x, ir.Value) and x in values and x not in seen:
                seen.add(x)
                order.append(x)
    return order

