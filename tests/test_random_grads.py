"""Randomized differential gradient tests: generated programs, compiled in every mode, against eager PyTorch.

A seeded generator writes small random programs as Python source: an entry ``f(x, y, w, d)`` that may call
itself with a smaller ``d``, a second compiled function ``g(a, w, k)`` that may call itself with a smaller
``k``, and an undecorated helper ``h(a, b)``. Their bodies mix

- branches on tensor predicates (``if v.sum() > 0:``, ``elif``, ternaries) and on Python ints
  (``if d % 2 == 0:``), ``while`` loops with a counter (some also with a tensor condition), ``for`` over
  ``range(k)`` (some with a data-dependent ``break``), over a matrix's rows and over a list, lists appended
  in a loop and stacked or summed, list comprehensions, tuple unpacking (``vals, idx = torch.max(m, 0)``,
  ``torch.chunk``), a ``raise`` some inputs reach;
- recursion (also in a ``for`` whose trips' calls batched mode asks for at once), calls of the other compiled
  function and of the plain helper;
- in-place updates of tensors the function made itself (``t += u``, ``t.mul_(2.0)``, ``t[0] = s``,
  ``t.tanh_()``), also after an op saved them for its gradient (eager then refuses the backward);
- reductions with ties (``max``, ``amax``, ``torch.max(m, dim=0).values``, ``min``, ``median``, ``sum``,
  ``mean``, ``logsumexp``, ``norm``, ``argmax``): the inputs are drawn from a few small dyadic values, so that
  they repeat;
- elementwise ops, ``where``, ``clamp``, ``maximum``, matmul with a weight, indexing by ints, integer tensors
  (repeated indices among them) and masks, ``cat``, ``stack``; a global parameter ``C`` that requires grad,
  and constant globals ``TIE`` = [1., 3., 3.] and ``IDX`` = [2, 0, 2].

The program is written to a module file four times over, once plain (the eager reference) and once per
mode with ``f`` and ``g`` decorated (``sequential``, ``threaded``, ``batched``), and imported. Each case
runs the eager program and every compiled one on fresh float64 leaves, takes ``torch.autograd.grad`` of a
fixed weighted sum of the results with respect to ``x``, ``y``, ``w`` and ``C``, and compares values and
gradients (within 1e-9, relative to the size of the value; a None gradient equals zeros);
``recompile.vmap`` of the batched ``f`` over stacked instances (``x`` batched; ``y`` and ``w`` batched or
shared) is compared with a loop of eager calls. Where eager raises, at the call or in the backward, the
compiled run must raise the same exception type, at either point.

Floating-point ties: a batched run computes a transcendental function (tanh, exp, ...) on a stacked
tensor, whose elements may take another code path (vectorized or not) than one instance's, and so differ
by an ulp; a max, a comparison or a relu that meets two such values that eager finds equal may then
choose differently. The generator knows which values are exact (sums and products of small dyadic inputs,
relu, clamp, max, indexing) and calls a program *fragile* where a tie-sensitive op reads an inexact value;
a fragile program's batched runs (batched mode and vmap) take inputs drawn from a normal distribution,
where no two values coincide, while sequential and threaded runs, which compute what eager computes op
for op, still take the tied inputs. Where a run still disagrees, and eager's own outcome moves beyond the
tolerance when the inputs move by an ulp or so (a threshold met, then magnified by recursion; a tie the generator
took for exact, of values a norm made; ``sin`` of a value near 1e15), the case is chaotic and not compared
(``chaotic``).

Known bugs: a program with a construct that meets one (``KNOWN_BUGS``) is not compared in the modes it
affects, and where sequential mode refuses what eager computes (``KNOWN_REFUSALS``) that refusal is
accepted; ``RECOMPILE_RANDOM_KNOWN=1`` compares everything. Each known bug is also kept below as a
minimized program marked ``xfail(strict=True)``, which passes once the bug is fixed (then drop its entry).

The default run covers ``SEEDS``; ``RECOMPILE_RANDOM_PROGRAMS=N`` runs N more seeds (from
``RECOMPILE_RANDOM_START``, 1000 by default) in ``test_many_random_programs``. A failure prints the seed,
the mode, the inputs and the generated source; ``ProgramGenerator(seed).source()`` gives the source again.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import re
import sys
import warnings

import pytest
import torch

import recompile

F64 = torch.float64
RTOL = 1e-9
VALUES = (-1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0)  # small dyadic values: sums and products stay exact, ties are common
MODES = ("sequential", "threaded", "batched")
DECORATORS = {
    "eager": "",
    "sequential": "@recompile.function(mode='sequential')",
    "threaded": "@recompile.function(mode='threaded', threads=2)",
    "batched": "@recompile.function(mode='batched')",
}
BATCH = 3  # instances under recompile.vmap


# ---------------------------------------------------------------------------
# 1. the generator
# ---------------------------------------------------------------------------

class Var:
    __slots__ = ("type", "exact", "fresh", "clean", "mclean", "saved")

    def __init__(self, type, exact, fresh, clean=True, mclean=True, saved=False):
        self.type = type    # "V": a (3,) vector, "S": a 0-d tensor, "M": a (3, 3) matrix
        self.exact = exact  # exact in float64 where the inputs are small dyadic values
        self.fresh = fresh  # a tensor this frame made and no other name refers to: safe to change in place
        # not read since it was assigned, nor made by an op whose gradient recompile takes to read its result:
        # changing it in place is no hazard (KNOWN_BUGS, KNOWN_REFUSALS)
        self.clean = clean
        self.mclean = mclean  # not read by a method call (v.max()) since it was assigned
        self.saved = saved  # made by an op whose gradient reads its result (tanh, softmax, v.relu_())

    def copy(self):
        return Var(self.type, self.exact, self.fresh, self.clean, self.mclean, self.saved)

    def meet(self, other):
        """What holds of both (a branch's join, a loop's next trip)."""
        return Var(self.type, self.exact and other.exact, self.fresh and other.fresh, self.clean and other.clean,
                   self.mclean and other.mclean, self.saved or other.saved)

    def same(self, other):
        return (self.exact, self.fresh, self.clean, self.mclean, self.saved) == (
            other.exact, other.fresh, other.clean, other.mclean, other.saved)


NAME = re.compile(r"\b[A-Za-z_]\w*\b")
# ops whose gradient needs only their input, which recompile's sequential mode takes to read their result
# (KNOWN_REFUSALS["in_place_after_read"]): a tensor one of them made is not clean
READS_INPUT_ONLY = ("torch.square(", "torch.sin(", "torch.erf(", "torch.dot(", "torch.mv(")
# ops whose gradient reads their result
SAVES_RESULT = ("torch.tanh(", "torch.sigmoid(", "torch.exp(", "torch.softmax(", "torch.relu(")


class Emitted:
    """The line an in-place statement writes, and whether it reads the tensor it changes (``t.add_(t * 2)``)."""

    def __init__(self, lines, target):
        self.lines, self.target, self.line = lines, target, None

    def append(self, line):
        self.line = line

    def pop(self):
        return self.line

    @property
    def reads_target(self):
        return NAME.findall(self.line).count(self.target) > 1


class Expr:
    __slots__ = ("text", "type", "exact", "aliases", "view")

    def __init__(self, text, type, exact, aliases=frozenset(), view=False):
        self.text, self.type, self.exact, self.aliases = text, type, exact, frozenset(aliases)
        self.view = view  # a view (of a named tensor or of a temporary): never changed in place


class Scope:
    """The names a block may read: tensors by kind, and Python ints with their ranges."""

    def __init__(self, tensors, ints, params):
        self.tensors = tensors  # name -> Var
        self.ints = ints        # name -> (lo, hi), inclusive
        self.params = params    # names that are the function's parameters or globals (never changed in place)

    def copy(self):
        return Scope({k: v.copy() for k, v in self.tensors.items()}, dict(self.ints), set(self.params))

    def of(self, type):
        return [n for n, v in self.tensors.items() if v.type == type]


class ProgramGenerator:
    """One random program per seed (deterministic): ``source(decorator)`` and a description of its inputs."""

    def __init__(self, seed):
        self.seed = seed
        self.rng = random.Random(seed)
        # (choices added since seeds were first run draw from their own stream: a seed's program stays the one
        # its earlier runs, and FOUND, name)
        self.aside = random.Random(seed * 7919 + 1)
        # (and so do the loops of recursive calls: a program without one is the one earlier runs found)
        self.looped = random.Random(seed * 104729 + 2)
        self.loops_calls = self.looped.random() < 0.3
        # (and so do recursive calls each in an if of its own)
        self.apart = random.Random(seed * 15485863 + 3)
        self.splits_calls = self.apart.random() < 0.4
        self.counter = itertools.count()
        self.fragile = False
        self.features = set()
        self.fn = None        # the function whose body is being generated
        self.calls_left = 0   # recursive call sites left in f's body (each counts its loop's trips)
        self.g_calls_left = 0
        self.helper = self._gen_helper()
        self.g_body = self._gen_g()
        self.f_body = self._gen_f()

    # -- small choices

    def chance(self, p):
        return self.rng.random() < p

    def pick(self, options):
        return self.rng.choice(options)

    def weighted(self, table):
        total = sum(w for w, _ in table)
        r = self.rng.random() * total
        for w, item in table:
            r -= w
            if r < 0:
                return item
        return table[-1][1]

    def name(self, prefix="v"):
        return f"{prefix}{next(self.counter)}"

    def const(self):
        return self.pick(("0.5", "2.0", "1.5", "0.25", "-1.0"))

    def operand(self, make):
        """``make()``, the operand of a tie-sensitive op: exact where a few tries give one (fewer fragile
        programs)."""
        saved = self.fragile, set(self.features)
        for _ in range(3):
            e = make()
            if e.exact:
                return e
            self.fragile, self.features = saved[0], set(saved[1])
        return make()

    def tie_sensitive(self, *exprs):
        if not all(e.exact for e in exprs):
            self.fragile = True

    # -- expressions

    def index(self, scope):
        """An index of a dim of size 3: an int, an int variable, or a 0-d integer tensor; now and then ``d``,
        which is out of range when it is 3 (an IndexError, which every mode must raise as eager does)."""
        ints = [n for n, (lo, hi) in scope.ints.items() if lo >= -3 and hi <= 2]
        if "d" in scope.ints and self.chance(0.02):
            self.features.add("index_out_of_range")
            return "d"
        if ints and self.chance(0.5):
            return self.pick(ints)
        if self.chance(0.15):
            self.features.add("index_tensor")
            return f"IDX[{self.pick(('0', '1', '2'))}]"
        return self.pick(("0", "1", "2", "-1"))

    def leaf(self, scope, type):
        names = scope.of(type)
        if names and self.chance(0.8):
            mine = [n for n in names if n not in scope.params]
            if mine and self.chance(0.6):
                n = self.pick(mine[-3:])  # what was computed last, mostly: fewer dead statements
            else:
                n = self.pick([n for n in names if n not in ("C", "TIE")] or names) if self.chance(0.8) \
                    else self.pick(names)
            v = scope.tensors[n]
            return Expr(n, type, v.exact, {n})
        if type == "V":
            if self.chance(0.3):
                return Expr("TIE", "V", True, {"TIE"})
            return self.reduce_m(scope, lambda: self.leaf(scope, "M"))
        if type == "S":
            return self.reduce_v(scope, lambda: self.leaf(scope, "V"))
        vs = [self.leaf(scope, "V") for _ in range(3)]
        return Expr(f"torch.stack([{vs[0].text}, {vs[1].text}, {vs[2].text}])", "M", all(v.exact for v in vs))

    def reduce_v(self, scope, make):
        """A 0-d tensor from a vector ``make()`` gives."""
        kind = self.weighted([(1, k) for k in ("sum", "mean", "max", "min", "amax", "maxdim", "norm", "lse", "index",
                                                "dot")] + [(0.15, "median")])
        self.features.add(f"reduce:{kind}")
        v = self.operand(make) if kind in ("max", "min", "amax", "maxdim", "median") else make()
        t = v.text
        if kind == "sum":
            return Expr(f"{t}.sum()", "S", v.exact)
        if kind == "mean":
            return Expr(f"{t}.mean()", "S", False)
        if kind in ("max", "min"):
            self.tie_sensitive(v)
            return Expr(f"{t}.{kind}()", "S", v.exact)
        if kind == "amax":
            self.tie_sensitive(v)
            return Expr(f"{t}.amax()", "S", v.exact)
        if kind == "maxdim":
            self.tie_sensitive(v)
            fn = self.pick(("max", "min"))
            return Expr(f"torch.{fn}({t}, dim=0).values", "S", v.exact)
        if kind == "norm":
            return Expr(f"{t}.norm()", "S", False)
        if kind == "lse":
            return Expr(f"torch.logsumexp({t}, 0)", "S", False)
        if kind == "index":
            return Expr(f"{t}[{self.index(scope)}]", "S", v.exact, v.aliases, view=True)
        if kind == "dot":
            u = self.expr(scope, "V", 0)
            return Expr(f"torch.dot({t}, {u.text})", "S", v.exact and u.exact)
        self.tie_sensitive(v)
        return Expr(f"{t}.median()", "S", v.exact)

    def reduce_m(self, scope, make):
        """A vector from a matrix ``make()`` gives."""
        kind = self.pick(("sum", "mean", "amax", "amin", "maxdim", "mindim", "lse", "norm", "row", "col",
                          "mv", "vm"))
        self.features.add(f"reduce_m:{kind}")
        m = self.operand(make) if kind in ("amax", "amin", "maxdim", "mindim") else make()
        t, dim = m.text, self.pick(("0", "1"))
        if kind == "sum":
            return Expr(f"{t}.sum({dim})", "V", m.exact)
        if kind == "mean":
            return Expr(f"{t}.mean({dim})", "V", False)
        if kind in ("amax", "amin"):
            self.tie_sensitive(m)
            return Expr(f"{t}.{kind}({dim})", "V", m.exact)
        if kind in ("maxdim", "mindim"):
            self.tie_sensitive(m)
            fn = kind[:3]
            if self.chance(0.5):
                return Expr(f"torch.{fn}({t}, dim={dim}).values", "V", m.exact)
            return Expr(f"{t}.{fn}({dim})[0]", "V", m.exact)
        if kind == "lse":
            return Expr(f"torch.logsumexp({t}, dim={dim})", "V", False)
        if kind == "norm":
            return Expr(f"{t}.norm(dim={dim})", "V", False)
        if kind == "row":
            return Expr(f"{t}[{self.index(scope)}]", "V", m.exact, m.aliases, view=True)
        if kind == "col":
            return Expr(f"{t}[:, {self.index(scope)}]", "V", m.exact, m.aliases, view=True)
        v = self.expr(scope, "V", 0)
        if kind == "mv":
            return Expr(f"({t} @ {v.text})", "V", m.exact and v.exact)
        return Expr(f"({v.text} @ {t})", "V", m.exact and v.exact)

    def expr(self, scope, type, depth):
        if depth <= 0 or self.chance(0.25):
            return self.leaf(scope, type)
        if type == "V":
            return self.expr_v(scope, depth)
        if type == "S":
            return self.expr_s(scope, depth)
        return self.expr_m(scope, depth)

    def expr_v(self, scope, depth):
        kind = self.weighted([
            (3, "unary"), (4, "binary"), (1, "scale"), (1, "div"), (1, "where"), (1, "clamp"), (1, "maxmin"),
            (2, "matmul"), (2, "reduce_m"), (1, "cat"), (1, "stack"), (1, "softmax"), (1, "neg"), (1, "rare"),
            (1, "relu"), (0.5, "gather"), (0.5, "ternary"), (0.5, "comprehension"),
        ])
        self.features.add(f"v:{kind}")
        sub = lambda t="V": self.expr(scope, t, depth - 1)  # noqa: E731
        if kind == "unary":
            a = sub()
            fn = self.pick(("torch.tanh({})", "torch.sigmoid({})", "{}.tanh()", "torch.exp(torch.tanh({}))",
                            "torch.sin({})"))
            return Expr(fn.format(a.text), "V", False)
        if kind == "relu":
            a = self.operand(sub)
            self.tie_sensitive(a)
            return Expr(self.pick(("torch.relu({})", "{}.relu()")).format(a.text), "V", a.exact)
        if kind == "binary":
            a, b = sub(), sub(self.pick(("V", "V", "S")))
            op = self.pick(("+", "-", "*"))
            if b.type == "S" and self.chance(0.5):
                a, b = b, a
            return Expr(f"({a.text} {op} {b.text})", "V", a.exact and b.exact)
        if kind == "scale":
            a = sub()
            return Expr(f"({a.text} * {self.const()} + {self.const()})", "V", a.exact)
        if kind == "div":
            a, b = sub(), sub(self.pick(("V", "S")))
            return Expr(f"({a.text} / ({b.text} * {b.text} + 1.0))", "V", False)
        if kind == "where":
            ct = self.pick(("V", "S"))
            c1, c2, a, b = self.operand(sub), self.operand(lambda: sub(ct)), sub(), sub()
            self.tie_sensitive(c1, c2)
            op = self.pick((">", "<", ">=", "=="))
            return Expr(f"torch.where({c1.text} {op} {c2.text}, {a.text}, {b.text})", "V", a.exact and b.exact)
        if kind == "clamp":
            a = self.operand(sub)
            self.tie_sensitive(a)
            form = self.pick(("{}.clamp(-0.5, 1.0)", "torch.clamp({}, min=0.0)", "{}.clamp(max=1.0)",
                              "torch.clamp({}, -1.0, 0.5)"))
            return Expr(form.format(a.text), "V", a.exact)
        if kind == "maxmin":
            a, b = self.operand(sub), self.operand(sub)
            self.tie_sensitive(a, b)
            fn = self.pick(("maximum", "minimum"))
            return Expr(f"torch.{fn}({a.text}, {b.text})", "V", a.exact and b.exact)
        if kind == "matmul":
            a, m = sub(), sub("M")
            form = self.pick(("({v} @ {m})", "({m} @ {v})", "torch.matmul({m}, {v})", "torch.mv({m}, {v})"))
            return Expr(form.format(v=a.text, m=m.text), "V", a.exact and m.exact)
        if kind == "reduce_m":
            return self.reduce_m(scope, lambda: sub("M"))
        if kind == "cat":
            a, b = sub(), sub()
            if self.chance(0.5):
                return Expr(f"torch.cat([{a.text}[:1], {b.text}[1:]])", "V", a.exact and b.exact)
            s = sub("S")
            return Expr(f"torch.cat([{a.text}[:2], {s.text}.reshape(1)])", "V", a.exact and s.exact)
        if kind == "stack":
            ss = [sub("S") for _ in range(3)]
            return Expr(f"torch.stack([{ss[0].text}, {ss[1].text}, {ss[2].text}])", "V", all(s.exact for s in ss))
        if kind == "softmax":
            a = sub()
            return Expr(f"torch.softmax({a.text}, 0)", "V", False)
        if kind == "ternary":
            a, b = sub(), sub()
            return Expr(f"({a.text} if {self.predicate(scope)} else {b.text})", "V", a.exact and b.exact,
                        a.aliases | b.aliases, a.view or b.view)
        if kind == "comprehension":
            m, v, j = sub("M"), sub(), self.name("j")
            return Expr(f"torch.stack([{m.text}[{j}] * {v.text}[{j}] for {j} in range(3)]).sum(0)", "V",
                        m.exact and v.exact)
        if kind == "gather":  # repeated indices: their cotangents add up
            a = sub()
            if self.chance(0.5):
                return Expr(f"{a.text}[IDX]", "V", a.exact)
            return Expr(f"torch.index_select({a.text}, 0, IDX)", "V", a.exact)
        if kind == "neg":
            a = sub()
            return Expr(f"(-{a.text})", "V", a.exact)
        # ops met less often (several without a gradient rule of their own)
        form = self.pick(("{}.flip(0)", "torch.cumsum({}, 0)", "torch.sort({}).values", "{}.abs()",
                          "torch.erf({})", "{}.roll(1, 0)", "torch.square({})"))
        if form in ("torch.sort({}).values", "{}.abs()"):
            a = self.operand(sub)
            self.tie_sensitive(a)
        else:
            a = sub()
        return Expr(form.format(a.text), "V", a.exact and form != "torch.erf({})")

    def expr_s(self, scope, depth):
        kind = self.weighted([(4, "reduce"), (2, "binary"), (1, "unary"), (1, "scale"), (1, "reduce_mm"),
                              (0.3, "argmax"), (0.3, "masked")])
        self.features.add(f"s:{kind}")
        sub = lambda t="S": self.expr(scope, t, depth - 1)  # noqa: E731
        if kind == "argmax":  # an index tensor chosen by the data (the first of tied maxima)
            v, u = sub("V"), self.operand(lambda: sub("V"))
            self.tie_sensitive(u)
            return Expr(f"{v.text}[torch.{self.pick(('argmax', 'argmin'))}({u.text})]", "S", v.exact, v.aliases,
                        view=True)
        if kind == "masked":  # a boolean mask: as many elements as the data says
            v, u = sub("V"), self.operand(lambda: sub("V"))
            self.tie_sensitive(u)
            return Expr(f"{v.text}[{u.text} > 0].sum()", "S", v.exact)
        if kind == "reduce":
            return self.reduce_v(scope, lambda: sub("V"))
        if kind == "reduce_mm":
            fn = self.pick(("sum", "max", "amax", "min"))
            m = sub("M") if fn == "sum" else self.operand(lambda: sub("M"))
            if fn != "sum":
                self.tie_sensitive(m)
            return Expr(f"{m.text}.{fn}()", "S", m.exact)
        if kind == "binary":
            a, b = sub(), sub()
            op = self.pick(("+", "-", "*"))
            return Expr(f"({a.text} {op} {b.text})", "S", a.exact and b.exact)
        if kind == "unary":
            a = sub()
            return Expr(f"torch.tanh({a.text})", "S", False)
        a = sub()
        return Expr(f"({a.text} * {self.const()})", "S", a.exact)

    def expr_m(self, scope, depth):
        kind = self.weighted([(2, "unary"), (2, "binary"), (1, "matmul"), (1, "t"), (1, "stack"), (1, "outer"),
                              (1, "bcast")])
        self.features.add(f"m:{kind}")
        sub = lambda t="M": self.expr(scope, t, depth - 1)  # noqa: E731
        if kind == "unary":
            if self.chance(0.5):
                a = self.operand(sub)
                self.tie_sensitive(a)
                return Expr(f"torch.relu({a.text})", "M", a.exact)
            a = sub()
            return Expr(f"torch.tanh({a.text})", "M", False)
        if kind == "binary":
            a, b = sub(), sub()
            op = self.pick(("+", "-", "*"))
            return Expr(f"({a.text} {op} {b.text})", "M", a.exact and b.exact)
        if kind == "matmul":
            a, b = sub(), sub()
            return Expr(f"({a.text} @ {b.text})", "M", a.exact and b.exact)
        if kind == "t":
            a = sub()
            return Expr(f"{a.text}.t()", "M", a.exact, a.aliases, view=True)
        if kind == "stack":
            vs = [self.expr(scope, "V", depth - 1) for _ in range(3)]
            dim = self.pick(("0", "1"))
            return Expr(f"torch.stack([{vs[0].text}, {vs[1].text}, {vs[2].text}], {dim})", "M",
                        all(v.exact for v in vs))
        if kind == "outer":
            a, b = self.expr(scope, "V", depth - 1), self.expr(scope, "V", depth - 1)
            if self.chance(0.5):
                return Expr(f"torch.outer({a.text}, {b.text})", "M", a.exact and b.exact)
            return Expr(f"({a.text}.unsqueeze(1) * {b.text}.unsqueeze(0))", "M", a.exact and b.exact)
        a, v = sub(), self.expr(scope, "V", depth - 1)
        return Expr(f"({a.text} * {v.text})", "M", a.exact and v.exact)

    def predicate(self, scope):
        """A tensor predicate (a one-element bool tensor)."""
        kind = self.pick(("cmp0", "cmp", "elem", "any"))
        self.features.add(f"pred:{kind}")
        if kind == "cmp0":
            s = self.operand(lambda: self.expr(scope, "S", 1))
            self.tie_sensitive(s)
            return f"{s.text} {self.pick(('>', '<', '>='))} {self.pick(('0', '0.5', '1.0', '-0.5'))}"
        if kind == "cmp":
            a = self.operand(lambda: self.expr(scope, "S", 1))
            b = self.operand(lambda: self.expr(scope, "S", 1))
            self.tie_sensitive(a, b)
            return f"{a.text} {self.pick(('>', '<', '<='))} {b.text}"
        if kind == "elem":
            v = self.operand(lambda: self.expr(scope, "V", 1))
            self.tie_sensitive(v)
            return f"{v.text}[{self.index(scope)}] > {self.pick(('0', '0.5'))}"
        v = self.operand(lambda: self.expr(scope, "V", 1))
        self.tie_sensitive(v)
        return f"({v.text} > {self.pick(('0', '1.0'))}).{self.pick(('any', 'all'))}()"

    # -- statements

    def emit(self, scope, lines, line):
        """Append ``line``; every tensor name it reads has been read (see Var.clean)."""
        lines.append(line)
        for n in NAME.findall(line):
            v = scope.tensors.get(n)
            if v is not None:
                v.clean = False
                if re.search(rf"\b{n}\.\w+\(", line):
                    v.mclean = False

    def assign(self, scope, target, e, lines, indent):
        self.emit(scope, lines, f"{indent}{target} = {e.text}")
        for n in e.aliases:
            if n in scope.tensors:
                scope.tensors[n].fresh = False
        clean = not (e.text.startswith(READS_INPUT_ONLY) or e.text.endswith(".abs()"))
        fresh = not e.aliases and not e.view and target not in scope.params
        saved = e.text.startswith(SAVES_RESULT) or e.text.endswith((".tanh()", ".relu()"))
        scope.tensors[target] = Var(e.type, e.exact, fresh, clean, saved=saved)

    def block(self, scope, n, indent, nest, carried=()):
        """``n`` statements; names made inside a nested block are not read after it."""
        lines = []
        for _ in range(n):
            self.statement(scope, lines, indent, nest, carried)
        return lines

    def statement(self, scope, lines, indent, nest, carried):
        table = [(4, "assign"), (2, "reassign"), (3, "inplace"), (0.3, "raise")]
        if nest > 0:
            table += [(2, "if_tensor"), (1, "if_int"), (1, "for_range"), (1, "for_rows"), (1, "for_list"),
                      (1, "while"), (1, "append"), (0.5, "for_break"), (0.3, "unpack_max"), (0.3, "chunk")]
        if self.fn == "f" and self.calls_left > 0:
            table.append((3, "recurse"))
        if self.fn == "g" and self.g_calls_left > 0:
            table.append((2, "recurse_g"))
        if self.fn == "f":
            table += [(1, "call_g"), (1, "call_h")]
        if self.fn == "g":
            table.append((1, "call_h"))
        if self.fn == "f" and self.loops_calls and self.calls_left >= 2 and self.looped.random() < 0.3:
            kind = "recurse_loop"
        elif self.fn == "f" and not self.loops_calls and self.splits_calls and self.calls_left >= 2 \
                and self.apart.random() < 0.4:
            kind = "recurse_apart"
        else:
            kind = self.weighted(table)
        getattr(self, "st_" + kind)(scope, lines, indent, nest, carried)

    def st_raise(self, scope, lines, indent, nest, carried):
        """An error some inputs raise: every mode must raise it too (vmap: where any instance does)."""
        self.features.add("raise")
        s = self.expr(scope, "S", 1)
        self.emit(scope, lines, f"{indent}if {s.text} > {self.pick(('3.0', '6.0', '12.0'))}:")
        lines.append(f"{indent}    raise ValueError('too large')")

    def unfresh(self, scope, *exprs):
        """Tensors another name (a loop variable, a callee's parameter) may now refer to."""
        for e in exprs:
            for n in e.aliases:
                if n in scope.tensors:
                    scope.tensors[n].fresh = False

    def locals_of(self, scope, type=None):
        return [n for n, v in scope.tensors.items() if n not in scope.params and (type is None or v.type == type)]

    def st_assign(self, scope, lines, indent, nest, carried):
        type = self.weighted([(5, "V"), (3, "S"), (1, "M")])
        e = self.expr(scope, type, self.pick((1, 2, 2, 3)))
        if (e.aliases or e.view) and self.chance(0.5) or self.chance(0.1):
            e = Expr(f"{e.text}.clone()", e.type, e.exact)
        self.assign(scope, self.name(), e, lines, indent)

    def st_reassign(self, scope, lines, indent, nest, carried):
        names = self.locals_of(scope)
        if not names:
            return self.st_assign(scope, lines, indent, nest, carried)
        n = self.pick(names)
        e = self.expr(scope, scope.tensors[n].type, self.pick((1, 2)))
        self.assign(scope, n, e, lines, indent)

    def st_inplace(self, scope, lines, indent, nest, carried):
        names = [n for n in self.locals_of(scope) if scope.tensors[n].fresh]
        if not names:
            return self.st_assign(scope, lines, indent, nest, carried)
        clean = [n for n in names if scope.tensors[n].clean]
        n = self.pick(clean if clean and self.chance(0.8) else names)
        v = scope.tensors[n]
        hazard = not v.clean
        lines = Emitted(lines, n)
        kind = self.pick(("iadd", "isub", "imul", "idiv", "mul_", "add_", "setitem", "unary_"))
        self.features.add(f"inplace:{kind}")
        if kind == "setitem" and v.type == "S":
            kind = "iadd"
        operand_type = {"V": self.pick(("V", "S")), "S": "S", "M": self.pick(("M", "V", "S"))}[v.type]
        if kind in ("iadd", "isub", "imul"):
            e = self.expr(scope, operand_type, 1)
            if kind == "imul" and e.text == n:  # (v *= v: refused as eager refuses it, test_square_in_place_...)
                e = Expr(f"({n} * 1.0)", e.type, e.exact)
            elif e.text.startswith(f"{n}["):
                # (v *= v[i]: eager refuses to write a tensor from a view of itself; a batched run computes it,
                # its v[i] being a copy of the batch's rows: docs/batching.md, Limits)
                e = Expr(f"({e.text} * 1.0)", e.type, e.exact)
            op = {"iadd": "+=", "isub": "-=", "imul": "*="}[kind]
            lines.append(f"{indent}{n} {op} {e.text}")
            v.exact = v.exact and e.exact
        elif kind == "idiv":
            e = self.expr(scope, operand_type, 1)
            lines.append(f"{indent}{n} /= ({e.text} * {e.text} + 1.0)")
            v.exact = False
        elif kind == "mul_":
            lines.append(f"{indent}{n}.mul_({self.const()})")
        elif kind == "add_":
            e = self.expr(scope, operand_type, 1)
            if self.chance(0.5):
                lines.append(f"{indent}{n}.add_({e.text})")
            else:
                lines.append(f"{indent}{n}.add_({e.text}, alpha={self.const()})")
            v.exact = v.exact and e.exact
        elif kind == "setitem":
            e = self.expr(scope, "S" if v.type == "V" else "V", 1)
            if v.type == "V" and self.chance(0.3):
                e2 = self.expr(scope, "V", 1)
                lines.append(f"{indent}{n}[1:] = {e2.text}[:2]")
                v.exact = v.exact and e2.exact
            else:
                lines.append(f"{indent}{n}[{self.index(scope)}] = {e.text}")
                v.exact = v.exact and e.exact
        else:
            fn = self.pick(("tanh_", "sigmoid_", "relu_"))
            if fn == "relu_":
                self.tie_sensitive(Expr(n, v.type, v.exact))
            else:
                v.exact = False
            # (not ``clamp_``: its gradient needs its input, which sequential mode refuses to keep where it cannot
            # write the op out of place: docs/gradients.md)
            if self.aside.random() < 0.3:  # (torch's function form: ``torch.relu_(v)``)
                lines.append(f"{indent}torch.{fn}({n})")
            else:
                lines.append(f"{indent}{n}.{fn}()")
            self.features.add("inplace_unary")
        if hazard or lines.reads_target:
            self.features.add("inplace_hazard")
        own = 1 if kind in ("mul_", "add_", "unary_") else 0  # (the in-place method call itself)
        if not v.mclean or len(re.findall(rf"\b{n}\.\w+\(", lines.line)) > own or \
                (kind == "unary_" and (v.saved or hazard)):
            self.features.add("inplace_hazard_method")
        if kind == "unary_" and v.saved:
            self.features.add("inplace_hazard")
        self.emit(scope, lines.lines, lines.pop())
        v.clean = False  # (an in-place op may save the value it made: *=, /=, tanh_)
        v.mclean = v.mclean and not own
        v.saved = kind == "unary_"

    def merge_into(self, scope, branches, names):
        """After an if: each name is what every branch left it (inexact, aliased or read in any: so)."""
        for n in list(names) + [n for n in scope.tensors if n not in names]:
            v = branches[0].tensors[n]
            for b in branches[1:]:
                v = v.meet(b.tensors[n])
            scope.tensors[n] = v

    def targets(self, scope):
        """(name, type) a branch assigns: one or two locals, or a new name."""
        names = self.locals_of(scope)
        out = []
        if names:
            out.append(self.pick(names))
            if len(names) > 1 and self.chance(0.3):
                out.append(self.pick([n for n in names if n != out[0]]))
        types = [scope.tensors[n].type for n in out]
        if not out or self.chance(0.3):
            out.append(self.name())
            types.append(self.pick(("V", "S")))
        return out, types

    def branch_body(self, scope, targets, types, indent, nest):
        inner = scope.copy()
        lines = self.block(inner, self.pick((0, 1, 2)), indent, nest - 1)
        for t, type in zip(targets, types):
            e = self.expr(inner, type, self.pick((1, 2)))
            self.assign(inner, t, e, lines, indent)
        return inner, lines

    def st_if_tensor(self, scope, lines, indent, nest, carried, pred=None):
        targets, types = self.targets(scope)
        conds = [pred or self.predicate(scope)]
        if pred is None and self.chance(0.25):
            conds.append(self.predicate(scope))
        branches = []
        for i, c in enumerate(conds):
            inner, body = self.branch_body(scope, targets, types, indent + "    ", nest)
            lines.append(f"{indent}{'if' if i == 0 else 'elif'} {c}:")
            lines.extend(body)
            branches.append(inner)
        inner, body = self.branch_body(scope, targets, types, indent + "    ", nest)
        lines.append(f"{indent}else:")
        lines.extend(body)
        branches.append(inner)
        self.merge_into(scope, branches, targets)

    def int_predicate(self, scope):
        n = self.pick([k for k in scope.ints if k in ("d", "k")] or list(scope.ints))
        return self.pick((f"{n} > 0", f"{n} % 2 == 0", f"{n} == 1", f"{n} >= 2"))

    def st_if_int(self, scope, lines, indent, nest, carried):
        if not scope.ints:
            return self.st_if_tensor(scope, lines, indent, nest, carried)
        self.features.add("if_int")
        self.st_if_tensor(scope, lines, indent, nest, carried, pred=self.int_predicate(scope))

    def loop(self, scope, lines, indent, nest, header, bind, trips, after_body=()):
        """A loop whose body reassigns one or two names that exist before it (the loop's state)."""
        names = self.locals_of(scope)
        if not names:
            self.st_assign(scope, lines, indent, nest, ())
            names = self.locals_of(scope)
        carried = [self.pick(names)]
        if len(names) > 1 and self.chance(0.3):
            carried.append(self.pick([n for n in names if n != carried[0]]))
        budget = self.calls_left, self.g_calls_left
        entry = {n: v.copy() for n, v in scope.tensors.items()}
        for attempt in range(5):  # until what the body leaves is what it assumed at its start
            if attempt == 4:  # (give up: assume nothing)
                for v in entry.values():
                    v.exact = v.fresh = v.clean = v.mclean = False
            # a call site in the body runs once per trip: it gets a share of the call sites left
            self.calls_left, self.g_calls_left = budget[0] // trips, budget[1] // trips
            inner = Scope({n: v.copy() for n, v in entry.items()}, dict(scope.ints), set(scope.params))
            bind(inner)
            body = self.block(inner, self.pick((0, 1, 2)), indent + "    ", nest - 1)
            for t in carried:
                e = self.expr(inner, inner.tensors[t].type, self.pick((1, 2)))
                self.assign(inner, t, e, body, indent + "    ")
            stable = True
            for n, v in entry.items():
                w = v.meet(inner.tensors[n])
                if not w.same(v):
                    entry[n], stable = w, False
            if stable:
                break
        used = budget[0] // trips - self.calls_left, budget[1] // trips - self.g_calls_left
        self.calls_left, self.g_calls_left = budget[0] - used[0] * trips, budget[1] - used[1] * trips
        lines.extend(header)
        lines.extend(body)
        lines.extend(indent + "    " + a for a in after_body)
        for n in scope.tensors:
            scope.tensors[n] = entry[n].meet(inner.tensors[n])
        for line in header:  # (the header's reads: a loop may run no trip)
            self.emit(scope, [], line)

    def st_for_range(self, scope, lines, indent, nest, carried):
        i = self.name("i")
        if "d" in scope.ints and self.chance(0.3):
            bound, hi, trips = "d", 2, 3
        else:
            k = self.pick((1, 2, 3))
            bound, hi, trips = str(k), k - 1, k
        self.features.add("for_range")
        self.loop(scope, lines, indent, nest, [f"{indent}for {i} in range({bound}):"],
                  lambda inner: inner.ints.__setitem__(i, (0, hi)), trips)

    def st_for_rows(self, scope, lines, indent, nest, carried):
        m = self.expr(scope, "M", 1)
        row = self.name("row")
        self.features.add("for_rows")
        self.unfresh(scope, m)
        self.loop(scope, lines, indent, nest, [f"{indent}for {row} in {m.text}:"],
                  lambda inner: inner.tensors.__setitem__(row, Var("V", m.exact, False)), 3)

    def st_for_list(self, scope, lines, indent, nest, carried):
        a, b = self.expr(scope, "V", 1), self.expr(scope, "V", 1)
        item = self.name("item")
        self.features.add("for_list")
        self.unfresh(scope, a, b)
        self.loop(scope, lines, indent, nest, [f"{indent}for {item} in [{a.text}, {b.text}]:"],
                  lambda inner: inner.tensors.__setitem__(item, Var("V", a.exact and b.exact, False)), 2)

    def st_while(self, scope, lines, indent, nest, carried):
        n = self.name("n")
        k = self.pick((1, 2, 3))
        lines.append(f"{indent}{n} = 0")
        cond = f"{n} < {k}"
        if self.chance(0.4):
            names = self.locals_of(scope)
            if names:
                cond += f" and {self.predicate(scope)}"
                self.features.add("while_tensor")
        self.features.add("while")
        self.loop(scope, lines, indent, nest, [f"{indent}while {cond}:"],
                  lambda inner: inner.ints.__setitem__(n, (0, k - 1)), k, after_body=[f"{n} += 1"])

    def st_for_break(self, scope, lines, indent, nest, carried):
        i = self.name("i")
        k = self.pick((2, 3))
        pred = self.predicate(scope)
        self.features.add("for_break")
        self.loop(scope, lines, indent, nest, [f"{indent}for {i} in range({k}):"],
                  lambda inner: inner.ints.__setitem__(i, (0, k - 1)), k, after_body=[f"if {pred}:", "    break"])

    def st_unpack_max(self, scope, lines, indent, nest, carried):
        """``values, indices = torch.max(m, dim)``; the indices pick elements (repeated ones among them)."""
        self.features.add("unpack_max")
        m, v = self.operand(lambda: self.expr(scope, "M", 1)), self.expr(scope, "V", 1)
        self.tie_sensitive(m)
        vals, idx = self.name("vals"), self.name("idx")
        self.emit(scope, lines, f"{indent}{vals}, {idx} = torch.{self.pick(('max', 'min'))}({m.text}, "
                                f"{self.pick(('0', '1'))})")
        self.unfresh(scope, m)
        scope.tensors[vals] = Var("V", m.exact, False, False, False)
        self.assign(scope, self.name(), Expr(f"({vals} * {self.const()} + {v.text}[{idx}])", "V",
                                             m.exact and v.exact), lines, indent)

    def st_chunk(self, scope, lines, indent, nest, carried):
        self.features.add("chunk")
        v = self.expr(scope, "V", 2)
        a, b, c = self.name("p"), self.name("p"), self.name("p")
        self.emit(scope, lines, f"{indent}{a}, {b}, {c} = torch.chunk({v.text}, 3)")
        self.unfresh(scope, v)
        self.assign(scope, self.name(), Expr(f"torch.cat([{c}, {a}, {b}])", "V", v.exact), lines, indent)

    def st_append(self, scope, lines, indent, nest, carried):
        acc, i = self.name("acc"), self.name("i")
        k = self.pick((2, 3))
        inner = scope.copy()
        inner.ints[i] = (0, k - 1)
        type = self.pick(("S", "V"))
        e = self.expr(inner, type, 2)
        self.features.add("append")
        lines.append(f"{indent}{acc} = []")
        lines.append(f"{indent}for {i} in range({k}):")
        self.emit(scope, lines, f"{indent}    {acc}.append({e.text})")
        for n in e.aliases:
            if n in scope.tensors:
                scope.tensors[n].fresh = False
        if type == "S" and k == 3:
            out = Expr(f"torch.stack({acc})", "V", e.exact)
        elif type == "S":
            out = Expr(f"torch.stack({acc}).sum()", "S", e.exact)
        elif self.chance(0.5):
            out = Expr(f"torch.stack({acc}).sum(0)", "V", e.exact)
        else:
            out = Expr(f"sum({acc})", "V", e.exact)
        self.assign(scope, self.name(), out, lines, indent)

    def st_recurse(self, scope, lines, indent, nest, carried):
        self.features.add("recurse")
        self.calls_left -= 1
        r, s = self.name("r"), self.name("s")
        a, b = self.expr(scope, "V", 2), self.expr(scope, "V", 1)
        m = self.expr(scope, "M", 1) if self.chance(0.3) else Expr("w", "M", True)
        step = self.pick(("1", "1", "2"))
        guard = f"d > {int(step) - 1}"
        if self.chance(0.3):
            guard += f" and {self.predicate(scope)}"
            self.features.add("recurse_tensor_guard")
        self.emit(scope, lines, f"{indent}if {guard}:")
        self.emit(scope, lines, f"{indent}    {r}, {s} = f({a.text}, {b.text}, {m.text}, d - {step})")
        if self.calls_left > 0 and self.chance(0.3):  # a second call: a node's two children
            self.calls_left -= 1
            self.features.add("recurse_twice")
            r2, s2 = self.name("r"), self.name("s")
            c = self.expr(scope, "V", 1)
            self.emit(scope, lines, f"{indent}    {r2}, {s2} = f({c.text}, {a.text}, w, d - {step})")
            self.emit(scope, lines, f"{indent}    {r} = {r} {self.pick(('+', '-', '*'))} {r2}")
            self.emit(scope, lines, f"{indent}    {s} = {s} + {s2} * 0.5")
        self.base_case(scope, lines, indent, r, s, a, b, m)

    def st_recurse_apart(self, scope, lines, indent, nest, carried):
        """Two recursive calls, each in an ``if`` of its own, the second's test and arguments made before the
        first call: batched mode asks for both at once (``passes.fission.split_block``)."""
        self.features.add("recurse_apart")
        self.calls_left -= 2
        step = self.pick(("1", "2"))
        guards = [f"d > {int(step) - 1}", f"d > {int(step) - 1}"]
        if self.chance(0.4):
            guards[1] += f" and {self.predicate(scope)}"
        calls = [(self.name("r"), self.name("s"), self.expr(scope, "V", 2), self.expr(scope, "V", 1))
                 for _ in guards]
        held = []
        for _, _, a, b in calls:  # (the arguments computed before the ifs, as tree.left[i] is read)
            names = self.name("p"), self.name("p")
            for n, e in zip(names, (a, b)):
                self.emit(scope, lines, f"{indent}{n} = {e.text}")
            held.append(names)
        for guard, (r, s, a, b), (pa, pb) in zip(guards, calls, held):
            self.emit(scope, lines, f"{indent}if {guard}:")
            if self.chance(0.5):  # (an argument the side computes)
                z = self.name("z")
                self.emit(scope, lines, f"{indent}    {z} = {pa} * 0.5")
                self.emit(scope, lines, f"{indent}    {r}, {s} = f({z}, {pb}, w, d - {step})")
            else:
                self.emit(scope, lines, f"{indent}    {r}, {s} = f({pa}, {pb}, w, d - {step})")
            if self.chance(0.5):  # (the side's ops after the call)
                self.emit(scope, lines, f"{indent}    {r} = torch.tanh({r}) {self.pick(('+', '*'))} {pb}")
            self.base_case(scope, lines, indent, r, s, a, b)
        (r, s, _, _), (r2, s2, _, _) = calls
        self.emit(scope, lines, f"{indent}{r} = {r} {self.pick(('+', '-', '*'))} {r2}")
        self.emit(scope, lines, f"{indent}{s} = {s} + {s2} * 0.5")

    def base_case(self, scope, lines, indent, r, s, *read):
        """The ``else`` of a recursion's guard, ``r`` and ``s`` given plain values there; after it they hold a
        call's values, and what the calls read (``read``) may be another name's."""
        lines.append(f"{indent}else:")
        base_v, base_s = self.expr(scope, "V", 1), self.expr(scope, "S", 1)
        self.emit(scope, lines, f"{indent}    {r} = {base_v.text}")
        self.emit(scope, lines, f"{indent}    {s} = {base_s.text}")
        # (the call's values are the callee's: exact if its inputs are, which the program's exactness flags
        # do not follow; a call's result is never changed in place)
        scope.tensors[r] = Var("V", False, False)
        scope.tensors[s] = Var("S", False, False)
        self.unfresh(scope, *read, base_v, base_s)

    def st_recurse_loop(self, scope, lines, indent, nest, carried):
        """Recursion in a loop whose trips' calls read only the counter and values made before it: batched mode
        asks for every trip's call at once (``passes.fission``), then gathers their results, in a list and in a
        carried sum."""
        self.features.add("recurse_loop")
        k = self.pick((2, 3)) if self.calls_left >= 3 else 2
        self.calls_left -= k
        r, s, i, acc, tot = self.name("r"), self.name("s"), self.name("i"), self.name("acc"), self.name("tot")
        a, b = self.expr(scope, "V", 2), self.expr(scope, "V", 1)
        step = self.pick(("1", "2"))
        self.emit(scope, lines, f"{indent}if d > {int(step) - 1}:")
        lines.append(f"{indent}    {acc} = []")
        self.emit(scope, lines, f"{indent}    {tot} = {self.expr(scope, 'S', 1).text}")
        lines.append(f"{indent}    for {i} in range({k}):")
        if self.looped.random() < 0.5:  # (the call under an ``if``: the instances taking it ask for it)
            za, zb = self.name("z"), self.name("z")
            self.emit(scope, lines, f"{indent}        {za} = {a.text} + {i}")
            self.emit(scope, lines, f"{indent}        {zb} = {b.text}")
            guard = f"{i} != {self.pick((0, 1))}" if self.chance(0.5) else self.predicate(scope)
            self.emit(scope, lines, f"{indent}        if {guard}:")
            self.emit(scope, lines, f"{indent}            {r}, {s} = f({za}, {zb}, w, d - {step})")
            lines.append(f"{indent}            {acc}.append({r} * {self.const()})")
            lines.append(f"{indent}            {tot} = {tot} {self.pick(('+', '-', '*'))} {s}")
            lines.append(f"{indent}        else:")
            lines.append(f"{indent}            {acc}.append({zb} * 0.5)")
        else:
            self.emit(scope, lines, f"{indent}        {r}, {s} = f({a.text} + {i}, {b.text}, w, d - {step})")
            lines.append(f"{indent}        {acc}.append({r} * {self.const()})")
            lines.append(f"{indent}        {tot} = {tot} {self.pick(('+', '-', '*'))} {s}")
        lines.append(f"{indent}    {r} = torch.stack({acc}).{self.pick(('sum', 'mean'))}(0)")
        lines.append(f"{indent}    {s} = {tot}")
        self.base_case(scope, lines, indent, r, s, a, b)

    def st_recurse_g(self, scope, lines, indent, nest, carried):
        self.features.add("recurse_g")
        self.g_calls_left -= 1
        r = self.name("r")
        a = self.expr(scope, "V", 2)
        base = self.expr(scope, "V", 1)
        lines.append(f"{indent}if k > 0:")
        self.emit(scope, lines, f"{indent}    {r} = g({a.text}, w, k - 1)")
        lines.append(f"{indent}else:")
        self.emit(scope, lines, f"{indent}    {r} = {base.text}")
        scope.tensors[r] = Var("V", False, False)
        for e in (a, base):
            for n in e.aliases:
                if n in scope.tensors:
                    scope.tensors[n].fresh = False

    def st_call_g(self, scope, lines, indent, nest, carried):
        self.features.add("call_g")
        a = self.expr(scope, "V", 2)
        m = self.expr(scope, "M", 1) if self.chance(0.3) else Expr("w", "M", True)
        r = self.name("r")
        self.emit(scope, lines, f"{indent}{r} = g({a.text}, {m.text}, {self.pick(('0', '1', '2'))})")
        scope.tensors[r] = Var("V", False, False)
        for e in (a, m):
            for n in e.aliases:
                if n in scope.tensors:
                    scope.tensors[n].fresh = False

    def st_call_h(self, scope, lines, indent, nest, carried):
        self.features.add("call_h")
        a, b = self.expr(scope, "V", 1), self.expr(scope, "V", 1)
        r = self.name("r")
        self.emit(scope, lines, f"{indent}{r} = h({a.text}, {b.text})")
        scope.tensors[r] = Var("V", False, False)
        for e in (a, b):
            for n in e.aliases:
                if n in scope.tensors:
                    scope.tensors[n].fresh = False

    # -- functions

    def params(self, names_types):
        tensors = {n: Var(t, True, False) for n, t in names_types}
        tensors["C"] = Var("V", True, False)
        return tensors

    def _gen_helper(self):
        self.fn = "h"
        scope = Scope(self.params([("a", "V"), ("b", "V")]), {}, {"a", "b", "C"})
        body = []
        for _ in range(self.pick((0, 1))):
            self.st_assign(scope, body, "    ", 0, ())
        e = self.expr(scope, "V", 2)
        body.append(f"    return {e.text}")
        # (whatever the helper computes, its result is treated as inexact by its callers)
        return body

    def _gen_g(self):
        self.fn = "g"
        self.g_calls_left = self.pick((0, 1, 1, 2))
        scope = Scope(self.params([("a", "V"), ("w", "M")]), {"k": (0, 2)}, {"a", "w", "C"})
        body = self.block(scope, self.pick((1, 2, 3)), "    ", 1)
        e = self.expr(scope, "V", 2)
        body.append(f"    return {e.text}")
        return body

    def _gen_f(self):
        self.fn = "f"
        self.calls_left = self.pick((0, 1, 2, 2, 3))
        scope = Scope(self.params([("x", "V"), ("y", "V"), ("w", "M")]), {"d": (0, 3)}, {"x", "y", "w", "C"})
        body = self.block(scope, self.pick((2, 3, 4, 5)), "    ", 2)
        v, s = self.expr(scope, "V", 2), self.expr(scope, "S", 2)
        body.append(f"    return {v.text}, {s.text}")
        return body

    def source(self, mode="eager"):
        deco = DECORATORS[mode]
        parts = [
            f"# generated by tests/test_random_grads.py, seed {self.seed}",
            "import torch",
            "import recompile",
            "",
            "TIE = torch.tensor([1.0, 3.0, 3.0], dtype=torch.float64)",
            "IDX = torch.tensor([2, 0, 2])",
            "C = torch.tensor([0.5, -1.0, 0.5], dtype=torch.float64, requires_grad=True)",
            "",
            "",
            "def h(a, b):",
            *self.helper,
            "",
            "",
            *([deco] if deco else []),
            "def g(a, w, k):",
            *self.g_body,
            "",
            "",
            *([deco] if deco else []),
            "def f(x, y, w, d):",
            *self.f_body,
            "",
        ]
        return "\n".join(parts)


# Known bugs the generator meets: {name: (the generator's feature, modes not compared, what goes wrong)}.
# A program with the feature is not compared in those modes (RECOMPILE_RANDOM_KNOWN=1: it is); each bug has
# a minimized program among the xfail tests below, which will pass once it is fixed.
KNOWN_BUGS = {}  # (none known now; each entry {name: (the generator's feature, modes, what goes wrong)})

# Known bugs that only values every instance of a vmap shares meet: a program with the feature is compared
# under vmap with every argument batched (in_dims 0), none shared.
KNOWN_SHARED_BUGS = {}  # (none known now; each entry {name: (the generator's feature, what goes wrong)})

# Known refusals where eager computes: {name: (feature, modes, what)}. In those modes a program with the feature
# may raise RuntimeError ("modified by an inplace operation") in the backward where eager gives gradients; where
# eager raises, the compiled program must still raise, and where neither raises, values and gradients must agree.
KNOWN_REFUSALS = {}  # (none known now: the last, an in-place change after torch.max(v, dim=0), dot or mv, mended)


# ---------------------------------------------------------------------------
# 2. running a program: eager and compiled, values, gradients, exceptions
# ---------------------------------------------------------------------------

def load(path, name, source):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_LOADED = itertools.count()


def modules(gen, folder):
    """{mode: module} for the eager program and each compiled mode, written under ``folder``."""
    out = {}
    for mode in ("eager",) + MODES:
        name = f"rp_{gen.seed}_{mode}_{next(_LOADED)}"
        out[mode] = load(folder / f"{name}.py", name, gen.source(mode))
    return out


def tied_inputs(rng):
    def vec(n):
        vals = [rng.choice(VALUES) for _ in range(n)]
        if rng.random() < 0.4:  # a forced tie
            i, j = rng.sample(range(n), 2)
            vals[j] = vals[i]
        return vals

    x = vec(3)
    y = vec(3)
    w = [vec(3) for _ in range(3)]
    if rng.random() < 0.3:
        w[rng.randrange(3)] = list(w[rng.randrange(3)])  # a repeated row
    return torch.tensor(x, dtype=F64), torch.tensor(y, dtype=F64), torch.tensor(w, dtype=F64)


def normal_inputs(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    return tuple(torch.randn(shape, generator=gen, dtype=F64) for shape in ((3,), (3,), (3, 3)))


def output_weights(out, k0=0):
    tensors = out if isinstance(out, tuple) else (out,)
    return [torch.cos(torch.arange(t.numel(), dtype=F64) * 0.37 + 0.3 * (k + k0) + 0.1).reshape(t.shape)
            for k, t in enumerate(tensors)]


class Outcome:
    """What a run gave: values and gradients, or the exception raised (and whether at the call or backward)."""

    def __init__(self, values=None, grads=None, error=None, phase=None):
        self.values, self.grads, self.error, self.phase = values, grads, error, phase

    def __repr__(self):
        if self.error is not None:
            return f"<raised {type(self.error).__name__} at {self.phase}: {self.error}>"
        return f"<values {self.values} grads {self.grads}>"


def differentiate(call, leaves, weights_for):
    """Run ``call()``, then autograd.grad of the weighted sum of its float results w.r.t. ``leaves``."""
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - compared with eager's
        return Outcome(error=exc, phase="call")
    tensors = out if isinstance(out, tuple) else (out,)
    weights = weights_for(tensors)
    loss = None
    for t, wt in zip(tensors, weights):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            term = (t * wt).sum()
            loss = term if loss is None else loss + term
    values = tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in tensors)
    if loss is None:
        return Outcome(values, [None] * len(leaves))
    try:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as exc:  # noqa: BLE001
        return Outcome(values, error=exc, phase="backward")
    return Outcome(values, [g.detach().clone() if g is not None else None for g in grads])


def single(mod, inputs, d):
    x, y, w = (t.detach().clone().requires_grad_() for t in inputs)
    leaves = [x, y, w, mod.C]
    return differentiate(lambda: mod.f(x, y, w, d), leaves, output_weights)


def batched_eager(mod, inputs, shared, d):
    """The eager reference of vmap: one call per instance, results stacked, one backward over all."""
    x, y, w = (t.detach().clone().requires_grad_() for t in inputs)
    leaves = [x, y, w, mod.C]

    def call():
        outs = []
        for i in range(BATCH):
            yi = y if shared["y"] else y[i]
            wi = w if shared["w"] else w[i]
            outs.append(mod.f(x[i], yi, wi, d))
        return tuple(torch.stack([o[k] for o in outs]) for k in range(len(outs[0])))

    return differentiate(call, leaves, output_weights)


def raised_by_an_instance(got, mod, inputs, shared, d):
    """Whether the vmap's call raised what one of its instances, called alone, raises at its call: the
    instances run together, not one after another, so where two instances raise different errors either may
    come first (docs/language.md, Order of calls and effects)."""
    if got.error is None or got.phase != "call":
        return False
    x, y, w = inputs
    for i in range(BATCH):
        alone = single(mod, (x[i], y if shared["y"] else y[i], w if shared["w"] else w[i]), d)
        if alone.phase == "call" and type(alone.error) is type(got.error) and str(alone.error) == str(got.error):
            return True
    return False


def batched_compiled(mod, inputs, shared, d):
    x, y, w = (t.detach().clone().requires_grad_() for t in inputs)
    leaves = [x, y, w, mod.C]
    dims = (0, None if shared["y"] else 0, None if shared["w"] else 0, None)
    return differentiate(lambda: recompile.vmap(mod.f, in_dims=dims)(x, y, w, d), leaves, output_weights)


def compare(got, want, refusal_allowed=False):
    """None where ``got`` agrees with ``want``, else what differs (a line)."""
    if refusal_allowed and want.error is None and isinstance(got.error, RuntimeError) and \
            "modified by an inplace operation" in str(got.error):
        return None
    if want.error is not None:
        if got.error is None:
            return f"eager raised {type(want.error).__name__} at {want.phase} ({want.error}); compiled did not"
        if type(got.error) is not type(want.error):
            return (f"eager raised {type(want.error).__name__} at {want.phase} ({want.error}); compiled raised "
                    f"{type(got.error).__name__} at {got.phase} ({got.error})")
        return None
    if got.error is not None:
        return f"compiled raised {type(got.error).__name__} at {got.phase}: {got.error}"
    if len(got.values) != len(want.values):
        return f"{len(got.values)} results, eager gave {len(want.values)}"
    for k, (g, w) in enumerate(zip(got.values, want.values)):
        if type(g) is not type(w):
            return f"result {k}: {type(g).__name__}, eager gave {type(w).__name__}"
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"result {k}: {tuple(g.shape)} {g.dtype}, eager gave {tuple(w.shape)} {w.dtype}"
        bad = close(g, w)
        if bad:
            return f"result {k}: {bad}\n  compiled {g}\n  eager    {w}"
    for label, g, w in zip(("x", "y", "w", "C"), got.grads, want.grads):
        if w is None and g is None:
            continue
        g = torch.zeros_like(w) if g is None else g  # (a zero gradient is a gradient: None and zeros agree)
        w = torch.zeros_like(g) if w is None else w
        bad = close(g, w)
        if bad:
            return f"grad of {label}: {bad}\n  compiled {g}\n  eager    {w}"
    return None


def close(g, w):
    if g.shape != w.shape:
        return f"shape {tuple(g.shape)} != {tuple(w.shape)}"
    if not g.numel():
        return None
    if torch.isnan(g).ne(torch.isnan(w)).any():
        return "NaN in one and not the other"
    g, w = g.nan_to_num(0.0), w.nan_to_num(0.0)
    diff = ((g - w).abs() / (1.0 + w.abs())).max().item()
    return None if diff <= RTOL else f"max relative difference {diff:.3g}"


def chaotic(reference, inputs, want):
    """Whether eager's outcome on ``inputs`` changes beyond the tolerance when they move by a few ulps: a fragile
    program with normal inputs may still meet a threshold (a comparison, a break) that an ulp of a batched
    transcendental decides, and recursion then magnifies the difference; no run can match eager there."""
    for k in range(24):  # (run only where a compiled run disagreed; a tie may flip once in eight moves: 61324)
        gen = torch.Generator().manual_seed(k)
        moved = tuple(t * (1.0 + 4e-16 * torch.randn(t.shape, generator=gen, dtype=F64)) for t in inputs)
        if compare(reference(moved), want):
            return True
    return False


def _modes_of(table, gen):
    """{mode: entry name} for the modes where ``table``'s entries (name -> (feature, modes, why)) apply to the
    program ``gen`` made; none with RECOMPILE_RANDOM_KNOWN set."""
    if os.environ.get("RECOMPILE_RANDOM_KNOWN"):
        return {}
    out = {}
    for name, (feature, modes, _) in table.items():
        if feature in gen.features:
            for mode in modes:
                out.setdefault(mode, name)
    return out


def tolerated_refusals(gen):
    """{mode: known refusal} for the modes where a program may refuse what eager computes."""
    return _modes_of(KNOWN_REFUSALS, gen)


def skipped_modes(gen):
    """{mode: known bug} for the modes a program is not compared in, by the constructs it has."""
    return _modes_of(KNOWN_BUGS, gen)


def unshared(gen):
    """The known bug that makes a program's vmap run take no shared argument, or None."""
    if os.environ.get("RECOMPILE_RANDOM_KNOWN"):
        return None
    return next((name for name, (feature, _) in KNOWN_SHARED_BUGS.items() if feature in gen.features), None)


def check_seed(seed, folder, modes=MODES + ("vmap",), cases=2):
    """Every mode against eager on ``cases`` inputs; a list of (mode, case, message) disagreements."""
    gen = ProgramGenerator(seed)
    skip = skipped_modes(gen)
    modes = tuple(m for m in modes if m not in skip)
    gen.skipped = skip
    tolerated = tolerated_refusals(gen)
    mods = modules(gen, folder)
    rng = random.Random(seed * 7919 + 1)
    failures = []
    gen.counts = {}  # {mode: [cases compared, cases where eager raised]}

    def count(mode, want):
        c = gen.counts.setdefault(mode, [0, 0])
        c[0] += 1
        c[1] += want.error is not None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        for case in range(cases):
            tied = tied_inputs(rng)
            normal = normal_inputs(rng)
            d = rng.choice((0, 1, 2, 3))
            for mode in modes:
                if mode == "vmap":
                    continue
                inputs = normal if (gen.fragile and mode == "batched") else tied
                want = single(mods["eager"], inputs, d)
                got = single(mods[mode], inputs, d)
                count(mode, want)
                bad = compare(got, want, mode in tolerated)
                if bad and chaotic(lambda xs: single(mods["eager"], xs, d), inputs, want):
                    continue  # (an inexact value the generator took for exact can meet a tie too: 46853)
                if bad:
                    failures.append((mode, case, d, inputs, bad))
            if "vmap" in modes:
                shared = {"y": rng.random() < 0.4, "w": rng.random() < 0.6}
                if unshared(gen):
                    shared = {"y": False, "w": False}
                pool = [normal_inputs(rng) if gen.fragile else tied_inputs(rng) for _ in range(BATCH)]
                stacked = tuple(torch.stack([p[j] for p in pool]) for j in range(3))
                inputs = (stacked[0], pool[0][1] if shared["y"] else stacked[1],
                          pool[0][2] if shared["w"] else stacked[2])
                want = batched_eager(mods["eager"], inputs, shared, d)
                got = batched_compiled(mods["batched"], inputs, shared, d)
                count("vmap", want)
                bad = compare(got, want)
                if bad and chaotic(lambda xs: batched_eager(mods["eager"], xs, shared, d), inputs, want):
                    continue  # (31689: a tie of ``torch.max(.., 1)`` on values a norm made)
                if bad and raised_by_an_instance(got, mods["eager"], inputs, shared, d):
                    continue  # (14739: the instances run together, so another instance's error may come first)
                if bad:
                    failures.append((f"vmap shared={shared}", case, d, inputs, bad))
    return gen, failures


def report(gen, failures):
    lines = [f"seed {gen.seed} (fragile={gen.fragile}, not compared: {gen.skipped or 'none'}, "
             f"vmap with nothing shared: {unshared(gen) or 'no'}): "
             f"{len(failures)} disagreement(s)"]
    for mode, case, d, inputs, bad in failures:
        lines.append(f"- mode {mode}, case {case}, d={d}, x={inputs[0].tolist()}, y={inputs[1].tolist()}, "
                     f"w={inputs[2].tolist()}\n  {bad}")
    lines.append("source:\n" + gen.source("eager"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# 3. the tests
# ---------------------------------------------------------------------------

SEEDS = list(range(24))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_program_matches_eager_in_every_mode(seed, tmp_path):
    gen, failures = check_seed(seed, tmp_path)
    assert not failures, report(gen, failures)


# Seeds past the default run whose programs once disagreed with eager (each a missed or a false raise of
# "modified by an inplace operation", or a refusal to change a leaf in place), kept as they were mended; the
# last four, false raises where the batch's plumbing reached a node that saved what a side or a loop's rest
# changed, with a gradient of zeros
FOUND = [39508, 42242, 44059, 45434, 46075, 46501, 57069, 63722, 80298, 92148]


@pytest.mark.parametrize("seed", FOUND)
def test_a_random_program_that_once_disagreed_matches_eager(seed, tmp_path):
    gen, failures = check_seed(seed, tmp_path)
    assert not failures, report(gen, failures)


def test_generator_is_deterministic_and_the_default_seeds_cover_the_constructs():
    assert ProgramGenerator(5).source() == ProgramGenerator(5).source()
    seen = set()
    compared = dict.fromkeys(MODES + ("vmap",), 0)
    for seed in SEEDS:
        gen = ProgramGenerator(seed)
        seen |= gen.features
        for mode in compared:
            compared[mode] += mode not in skipped_modes(gen)
    for feature in ("recurse", "recurse_twice", "recurse_tensor_guard", "recurse_loop", "recurse_apart", "call_g",
                    "recurse_g",
                    "call_h", "if_int", "for_range", "for_rows", "for_list", "for_break", "while", "while_tensor",
                    "append", "raise",
                    "inplace:setitem", "inplace:mul_", "inplace:add_", "inplace:idiv", "inplace_hazard",
                    "reduce:max", "reduce:amax", "reduce:maxdim", "reduce:norm", "reduce:lse", "reduce_m:maxdim",
                    "v:where", "v:clamp", "v:matmul", "v:cat", "v:stack", "v:gather", "index_tensor", "s:argmax"):
        assert feature in seen, feature
    # the known bugs leave most programs compared in every mode
    assert all(n >= 0.6 * len(SEEDS) for n in compared.values()), compared


@pytest.mark.skipif(not os.environ.get("RECOMPILE_RANDOM_PROGRAMS"),
                    reason="set RECOMPILE_RANDOM_PROGRAMS=N to run N more random programs")
def test_many_random_programs(tmp_path):
    n = int(os.environ["RECOMPILE_RANDOM_PROGRAMS"])
    start = int(os.environ.get("RECOMPILE_RANDOM_START", "1000"))
    reports = []
    for seed in range(start, start + n):
        gen, failures = check_seed(seed, tmp_path)
        if failures:
            reports.append(report(gen, failures))
    assert not reports, f"{len(reports)} of {n} programs disagree with eager:\n\n" + "\n\n".join(reports)


# ---------------------------------------------------------------------------
# 4. known bugs the generator found, minimized (KNOWN_BUGS): each passes once its bug is fixed
# ---------------------------------------------------------------------------

def _grads(fn, *args):
    """(values, gradients w.r.t. every argument that requires grad) of ``fn(*args)``'s weighted sum."""
    out = fn(*args)
    wanted = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    weights = torch.cos(torch.arange(out.numel(), dtype=F64) + 0.5).reshape(out.shape)
    return out.detach(), torch.autograd.grad((out * weights).sum(), wanted, allow_unused=True)


def _leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


def kb_median(x):
    return x.median()


def test_median_of_tied_elements_under_vmap_shares_the_gradient_like_eager():
    """A batch of ``x.median()`` shares each instance's cotangent among its tied elements, as eager's does (it
    gave it all to one)."""
    x = _leaf([[2.0, 2.0, 0.0], [1.0, 1.0, 1.0]])
    want = _grads(lambda x: torch.stack([kb_median(r) for r in x]), x)
    got = _grads(recompile.vmap(recompile.function(kb_median)), x)
    assert torch.allclose(got[0], want[0]) and torch.allclose(got[1][0], want[1][0]), (got, want)


def kb_tanh_in_place(y):
    v = y * 1.0
    v.tanh_()
    return v


def kb_sigmoid_in_place_after_a_loop(y, w):
    v = y * 1.0
    for _ in range(2):
        v = -v
        if w.amax() > 1.0:
            break
    v.sigmoid_()
    return torch.maximum(v, y).mean()


def test_in_place_sigmoid_after_a_loop_under_vmap_backpropagates_like_eager():
    """(Was a known bug: after a loop some instances left early, v is held as each instance's row of one of two
    tensors, and v.sigmoid_() ran once per instance on rows whose version counter they share; the instances'
    tensors are now stacked, changed by one op and given their rows.)"""
    y = _leaf([[0.5, -1.0], [-3.0, 2.0], [1.0, 2.0]])
    w = torch.tensor([[0.5, 2.0], [0.1, 0.2], [3.0, 0.0]], dtype=F64)
    want = _grads(lambda y: torch.stack([kb_sigmoid_in_place_after_a_loop(r, s) for r, s in zip(y, w)]), y)
    got = _grads(lambda y: recompile.vmap(recompile.function(kb_sigmoid_in_place_after_a_loop))(y, w), y)
    assert torch.allclose(got[1][0], want[1][0]), (got, want)


def test_in_place_tanh_of_a_batched_value_under_vmap_backpropagates_like_eager():
    """(Was a known bug: v.tanh_() ran once per instance on rows of one batched tensor, whose version counter
    they share, and the backward found tanh's saved result changed; it is now one tanh_ of the batch.)"""
    y = _leaf([[0.5, -1.0], [1.0, 2.0]])
    want = _grads(lambda y: torch.stack([kb_tanh_in_place(r) for r in y]), y)
    got = _grads(recompile.vmap(recompile.function(kb_tanh_in_place)), y)
    assert torch.allclose(got[1][0], want[1][0]), (got, want)


def kb_max_then_changed(x):
    v = x * 1.0
    m = v.max()
    v -= 1.0
    return m * 1.0


def kb_sin_then_changed(x):
    v = x * 1.0
    m = v.sin()
    v -= 1.0
    return m


def kb_mul_then_changed(x, w):
    v = x * 1.0
    m = v.mul(w)
    v -= 1.0
    return m


def kb_shifted_by_its_max(x):
    v = x * 1.0
    v -= v.max()
    return v


def kb_relu_of_a_saved_result(x):
    v = torch.tanh(x * 1.0)
    v.relu_()
    return v * 1.0


def kb_tanh_of_a_saved_result(x):
    v = torch.softmax(x * 1.0, 0)
    v.tanh_()
    return v * 1.0


def kb_sigmoid_after_a_product_read_it(x):
    v = x * 1.0
    m = v * x
    v.sigmoid_()
    return m


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
@pytest.mark.parametrize("fn", [kb_max_then_changed, kb_sin_then_changed, kb_mul_then_changed, kb_shifted_by_its_max,
                                kb_relu_of_a_saved_result, kb_tanh_of_a_saved_result,
                                kb_sigmoid_after_a_product_read_it])
def test_a_change_after_a_method_call_read_the_tensor_is_refused_like_eager(fn, mode):
    """A tensor read by a method call (``v.max()``, ``v.sin()``, ``v.mul(w)``) and then changed in place, and a
    saved tensor changed by an in-place method without arguments (``v.relu_()``): the backward raises, as
    eager's does (it used to read the changed value: a NaN or a wrong gradient)."""
    args = [_leaf([1.0, 3.0, 2.0])] + ([_leaf([0.5, 2.0, -1.0])] if fn is kb_mul_then_changed else [])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(fn, *args)  # eager
    compiled = recompile.function(fn, mode=mode)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(compiled, *args)


def kb_max_along_dim_then_changed(x):
    v = x * 1.0
    m = torch.max(v, dim=0).values
    v += 1.0
    return m


def kb_square_then_changed(x):
    v = torch.square(x * 1.0)
    v -= 1.0
    return v


def kb_abs_then_changed(x):
    v = (x * 1.0).abs()
    v -= 1.0
    return v


def kb_erf_then_changed(x):
    v = torch.erf(x * 1.0)
    v -= 1.0
    return v


def kb_dot_then_changed(x):
    v = torch.dot(x * 1.0, x + 1.0)
    v.mul_(0.5)
    return v


def kb_mv_then_changed(x):
    v = torch.mv(torch.outer(x, x), x * 1.0)
    v.mul_(0.5)
    return v


def kb_dot_with_a_constant_then_its_input_changed(x):
    v = x * 1.0
    s = torch.dot(v, TIE_) + torch.mv(torch.outer(TIE_, TIE_), v).sum()  # (v read for the constant's gradient)
    v += 1.0
    return s * v


TIE_ = torch.tensor([1.0, 3.0, 3.0], dtype=torch.float64)


def kb_min_along_dim_of_a_method_then_changed(x):
    v = torch.stack([x, x * 2.0])
    m = v.min(1).values
    v.mul_(3.0)
    return m


@pytest.mark.parametrize("fn", [kb_square_then_changed, kb_abs_then_changed, kb_erf_then_changed,
                                kb_dot_then_changed, kb_mv_then_changed, kb_max_along_dim_then_changed,
                                kb_min_along_dim_of_a_method_then_changed,
                                kb_dot_with_a_constant_then_its_input_changed])
@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_a_change_of_a_result_its_gradient_does_not_read_is_allowed_as_eager_allows_it(fn, mode):
    """(Was known: square, abs, erf need their inputs for their gradients, not their results, but their
    rules counted as reading their results, and the backward refused a later change of the result; dot and mv
    hand their work to matmul's rule, which reads no result, and counted as reading it; ``torch.max(v, 0)``
    reads the indices it found, not v, and counted as reading v; a product reads each factor for the other's
    gradient alone, and a constant needs none.)"""
    x = _leaf([0.3, -0.7, 1.5])
    want = _grads(fn, x)
    got = _grads(recompile.function(fn, mode=mode), x)
    assert torch.allclose(got[0], want[0]) and torch.allclose(got[1][0], want[1][0]), (got, want)




def kb_square_in_place(x):
    v = x * 1.0
    v *= v
    return v


@pytest.mark.parametrize("mode", ["sequential", "threaded", "batched"])
def test_square_in_place_is_refused_like_eager(mode):
    """v *= v: eager's mul_ saves v as its other operand, then changes it; every mode refuses the backward too
    (the generator still writes v *= v * 1.0, whose backward eager computes)."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(kb_square_in_place, _leaf([1.0, 2.0, -3.0]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(recompile.function(kb_square_in_place, mode=mode), _leaf([1.0, 2.0, -3.0]))


def kb_add_reading_itself(x, y):
    v = y * 1.0
    v.add_(v * 2.0)
    return x + v


def test_in_place_add_that_reads_its_target_on_a_shared_value_under_vmap():
    """v.add_(v * 2.0) of each instance's own tensor made from a shared argument: each changes its own, and
    the result is 3 * y (the change was lost: a tensor stacked from the items before it was read after)."""
    x, y = torch.zeros(3, 2, dtype=F64), torch.tensor([2.0, 2.0], dtype=F64)
    want = torch.stack([kb_add_reading_itself(r, y) for r in x])
    got = recompile.vmap(recompile.function(kb_add_reading_itself), in_dims=(0, None))(x, y)
    assert torch.equal(got, want), (got, want)


def kb_shared_saved_then_changed(x, w):
    v = w * 1.0
    s = torch.dot(v, v)
    v += 1.0
    return x + v * s


def test_a_change_of_a_saved_shared_value_under_vmap_is_refused_like_eager():
    """A tensor computed once from a shared argument in a run that changes values in place is each instance's
    own rows of one batch, whose backward sees the change eager sees."""
    x, w = torch.zeros(3, 2, dtype=F64, requires_grad=True), _leaf([1.0, 2.0])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(lambda x, w: torch.stack([kb_shared_saved_then_changed(r, w) for r in x]), x, w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(recompile.vmap(recompile.function(kb_shared_saved_then_changed), in_dims=(0, None)), x, w)
