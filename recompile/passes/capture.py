"""Outer-reference capture (Jeong et al. §5).

1. A free name becomes a global or closure Capture (read each time it runs,
   so a rebound global is seen); ``self.<attr>`` reads become attribute Captures.
2. Every nested SubGraph (Cond branch, While predicate and body) gets the
   outer values it reads as explicit inputs, passed by its Cond / While op.
   Afterwards a SubGraph uses only its own inputs and the values its ops define.
"""

from __future__ import annotations

from .. import ir


def capture(sg, parsed):
    """Apply the pass to a function SubGraph (in place) and return it."""
    for s in sg.walk():
        _resolve(s, parsed)
    _thread(sg)
    return sg


def _resolve(sg, parsed):
    for i, op in enumerate(sg.ops):
        if isinstance(op, ir.Capture) and op.source_kind == "free":
            if op.name in parsed.freevars:
                op.source_kind, op.source = "closure", parsed.freevars[op.name]
            else:
                op.source_kind, op.source = "global", parsed.globals
        elif (isinstance(op, ir.Call) and isinstance(op.fn, ir.Const) and op.fn.value is getattr
              and len(op.args) == 2 and not op.kwargs and isinstance(op.args[0], ir.Value)
              and op.args[0].is_self and isinstance(op.args[1], ir.Const)):
            attr = op.args[1].value
            new = ir.Capture(op.loc, f"self.{attr}", "attr", attr, op.args[0])
            new.outputs = op.outputs
            for v in new.outputs:
                v.op = new
            sg.ops[i] = new


def free_values(sg):
    """Values ``sg`` reads but does not define, in order of first use."""
    defined = set(sg.inputs)
    free = []
    seen = set()

    def use(x):
        if isinstance(x, ir.Value) and x not in defined and x not in seen:
            seen.add(x)
            free.append(x)

    for op in sg.ops:
        for x in op.operands():
            use(x)
        defined.update(op.outputs)
    for x in sg.outputs:
        use(x)
    return free


def _add_inputs(sg, outer_values):
    """Make ``outer_values`` inputs of ``sg`` (appended), rewriting its reads."""
    mapping = {}
    for v in outer_values:
        nv = ir.Value(v.hint)
        nv.is_self = v.is_self
        mapping[v] = nv
        sg.inputs.append(nv)

    def m(x):
        return mapping.get(x, x) if isinstance(x, ir.Value) else x

    for op in sg.ops:
        op.map_operands(m)
    sg.outputs = [m(x) for x in sg.outputs]


def _thread(sg):
    for op in sg.ops:
        for inner in op.subgraphs():
            _thread(inner)
        if isinstance(op, ir.Cond):
            outer = _union(free_values(op.then_sg), free_values(op.else_sg))
            _add_inputs(op.then_sg, outer)
            _add_inputs(op.else_sg, outer)
            op.args = op.args + outer
        elif isinstance(op, ir.While):
            outer = _union(free_values(op.cond_sg), free_values(op.body_sg))
            _add_inputs(op.cond_sg, outer)
            _add_inputs(op.body_sg, outer)
            op.invariants = op.invariants + outer


def _union(a, b):
    seen = set(a)
    return a + [v for v in b if v not in seen]
