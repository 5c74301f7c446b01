"""Canonicalisation: a function body with one return at its end, and loops without jumps.

AST -> AST, before conversion to the IR:
- ``return v`` becomes ``__retval = v`` plus a return flag; the function ends
  with ``return __retval``.
- ``break`` / ``continue`` become flags that the loop condition and guards read.
- statements after one that may jump are guarded by ``if not <flags>:`` —
  or, when one branch of an ``if`` always jumps, moved into the other branch.
- ``for target in xs`` becomes an index loop over ``as_sequence(xs)`` while ``has_index(seq, i)``; ``for i, x in
  enumerate(xs)`` the same loop over xs, i its index, ``for x, y in zip(xs, ys)`` one over xs and ys, and
  ``for t in reversed(range(a, b))`` a counter from b - 1 down to a. A ``for`` over a tuple or list display of a
  few items (``for child in (left, right)``, a comprehension over one, ``enumerate`` of one; a name holding one
  that nothing else reads there: ``held_displays``), or over ``range(2)``, is its body once per item.
- ``assert`` becomes ``if not test: raise AssertionError(msg)``.
- ``import`` becomes assignments of what Python's import gives (``intrinsics.import_module``, ``import_from``).
- ``with``, ``try``, ``match`` and ``class`` become a call of a nested function holding the statement
  (``python_blocks``), then a return, break or continue where it says so.

Flag assignments that stand for a jump carry ``_jump = True`` so the converter
knows that a block ends there. Flags nobody reads are dropped afterwards.
"""

from __future__ import annotations

import copy

import gast

from . import held_displays, python_blocks

# Names this pass makes up start with "." so that no Python identifier can clash with them
# (the gast tree is converted, never compiled, so any string is a valid name here).
RETVAL = ".retval"
RETFLAG = ".returned"
# internal names the converter binds to runtime helpers, whatever the user calls len etc.
AS_SEQUENCE = ".as_sequence"
REVERSED_SEQUENCE = ".reversed_sequence"
HAS_INDEX = ".has_index"
BUILTIN_READ = ".builtin_read"
INDEX = ".index"
ASSERTION_ERROR = ".AssertionError"
IMPORT = ".import"
IMPORT_FROM = ".import_from"
GLOBALS = ".globals"  # (the function's own module's globals: a relative import's package)


def located(new, old):
    """``new`` at ``old``'s position in the source (line and column span)."""
    for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
        setattr(new, attr, getattr(old, attr, None))
    return new


def is_guard(node):
    """Whether ``node`` is an ``if`` canonicalize put after a jump, whose empty else runs only after it."""
    return getattr(node, "_guard", False)


def name(ident, store=False, at=None):
    node = gast.Name(id=ident, ctx=gast.Store() if store else gast.Load(), annotation=None, type_comment=None)
    return located(node, at) if at is not None else node


def const(value, at=None):
    node = gast.Constant(value=value, kind=None)
    return located(node, at) if at is not None else node


def assign(ident, value, at):
    return located(gast.Assign(targets=[name(ident, True, at)], value=value, type_comment=None), at)


def _call(ident, args, at):
    return located(gast.Call(func=name(ident, at=at), args=args, keywords=[]), at)


def not_(expr, at):
    return located(gast.UnaryOp(op=gast.Not(), operand=expr), at)


def and_(exprs, at):
    return exprs[0] if len(exprs) == 1 else located(gast.BoolOp(op=gast.And(), values=exprs), at)


def jump(ident, at):
    """``ident = True`` standing for a return/break/continue."""
    node = assign(ident, const(True, at), at)
    node._jump = True
    return node


def is_jump(stmt):
    return getattr(stmt, "_jump", False) or isinstance(stmt, gast.Raise)


def always_jumps(stmts):
    """True when every path through ``stmts`` ends in a jump (or raise)."""
    for s in stmts:
        if is_jump(s):
            return True
        if isinstance(s, gast.If) and always_jumps(s.body) and always_jumps(s.orelse):
            return True
    return False


class _Loop:
    def __init__(self, n, flag):
        self.brk = flag(f".break{n}")
        self.cont = flag(f".continue{n}")
        self.uses_brk = False
        self.uses_cont = False


class Canonicalizer:
    def __init__(self, declared=None, builtins=frozenset()):
        self.declared = declared or {}  # the function's global and nonlocal names
        self.builtins = builtins  # builtin names (``enumerate``) that no scope of the function binds
        self.first_param = None
        self.loops = []
        self.counter = 0
        self.returns_in_loop = False
        self.flags = {RETFLAG}  # the names this pass made up for jumps: only these may be dropped

    def _flag(self, ident):
        self.flags.add(ident)
        return ident

    # -- entry
    def function(self, fdef):
        first = (fdef.args.posonlyargs + fdef.args.args)[:1]
        self.first_param = first[0].id if first else None
        body = [s for i, s in enumerate(fdef.body) if not (i == 0 and _is_docstring(s))]
        consumed = _GeneratorsConsumed(self.builtins)
        body = held_displays.walked_displays([consumed.visit(s) for s in body], self.declared,
                                              _UNROLLED_ITEMS)
        new_body = self.block(body)
        at = fdef
        prelude = _builtin_reads(sorted(consumed.lowered), at)
        prelude += [assign(RETVAL, const(None, at), at), assign(RETFLAG, const(False, at), at)]
        end = located(gast.Return(value=name(RETVAL, at=at)), body[-1] if body else at)
        fdef.body = _drop_unread_flags(prelude + new_body + [end], self.flags)
        return fdef

    # -- blocks
    def block(self, stmts):
        out = []
        for i, s in enumerate(stmts):
            new = self.stmt(s)
            rest = stmts[i + 1:]
            if rest and (always_jumps(new) or self._may_set(new)):
                out.extend(self._attach(new, rest))
                return out
            out.extend(new)
        return out

    def _attach(self, stmts, rest):
        """``stmts`` (canonical, may jump) followed by ``rest`` (not yet canonical), run only if no jump."""
        if always_jumps(stmts):
            return stmts  # what follows is dead code
        flags = self._may_set(stmts)
        if not flags:
            return stmts + self.block(rest)
        last = stmts[-1]
        # when only the last statement, an if, may jump, what follows can go into its branch that
        # does not jump (no flag test needed); flags set earlier need the guard
        alone = isinstance(last, gast.If) and not self._may_set(stmts[:-1])
        if alone and always_jumps(last.body):
            last.orelse = self._attach(last.orelse, rest)
            return stmts
        if alone and always_jumps(last.orelse):
            last.body = self._attach(last.body, rest)
            return stmts
        test = and_([not_(name(f, at=rest[0]), rest[0]) for f in sorted(flags)], rest[0])
        guard = located(gast.If(test=test, body=self.block(rest), orelse=[]), rest[0])
        guard._guard = True  # its (empty) else runs only after a jump (``is_guard``)
        return stmts + [guard]

    def _active_flags(self):
        flags = {RETFLAG}
        if self.loops:
            flags |= {self.loops[-1].brk, self.loops[-1].cont}
        return flags

    def _may_set(self, stmts):
        active = self._active_flags()
        found = set()
        for s in stmts:
            for node in gast.walk(s):
                if getattr(node, "_jump", False):
                    ident = node.targets[0].id
                    if ident in active:
                        found.add(ident)
        return found

    # -- statements
    def stmt(self, s):
        method = getattr(self, "stmt_" + type(s).__name__, None)
        return method(s) if method else [s]

    def stmt_Return(self, s):
        value = s.value if s.value is not None else const(None, s)
        out = [assign(RETVAL, value, s), jump(RETFLAG, s)]
        if self.loops:
            self.returns_in_loop = True
        return out

    def stmt_Break(self, s):
        loop = self.loops[-1]
        loop.uses_brk = True
        return [jump(loop.brk, s)]

    def stmt_Continue(self, s):
        loop = self.loops[-1]
        loop.uses_cont = True
        return [jump(loop.cont, s)]

    def stmt_If(self, s):
        s.body = self.block(s.body)
        s.orelse = self.block(s.orelse)
        return [s]

    def stmt_Assert(self, s):
        if not __debug__:  # python -O drops asserts
            return []
        args = [s.msg] if s.msg is not None else []
        exc = located(gast.Call(func=name(ASSERTION_ERROR, at=s), args=args, keywords=[]), s)
        raise_ = located(gast.Raise(exc=exc, cause=None), s)
        return [located(gast.If(test=not_(s.test, s), body=[raise_], orelse=[]), s)]

    def stmt_With(self, s):
        self.counter += 1
        helper, calls = python_blocks.lower(s, self.counter, self.declared, self.first_param, located)
        return [helper] + self.block(calls)

    stmt_Try = stmt_TryStar = stmt_Match = stmt_ClassDef = stmt_With

    def stmt_Import(self, s):
        """``import a.b`` binds ``a``, ``import a.b as c`` the module ``a.b``: assignments of what Python's
        import gives, so that a batch computes them once (they read nothing of an instance's)."""
        out = []
        for alias in s.names:
            value = _call(IMPORT, [name(GLOBALS, at=s), const(alias.name, s), const(0, s), const((), s)], s)
            if alias.asname is None:
                out.append(assign(alias.name.partition(".")[0], value, s))
                continue
            for part in alias.name.split(".")[1:]:  # (``import a.b as c``: a's attribute b, as Python reads it)
                value = _call(IMPORT_FROM, [value, const(part, s)], s)
            out.append(assign(alias.asname, value, s))
        return out

    def stmt_ImportFrom(self, s):
        """``from m import x as y``: ``y`` the name ``x`` of the module Python's import gives (relative to the
        function's own package for ``from . import x``)."""
        self.counter += 1
        module = f".module{self.counter}"
        fromlist = tuple(a.name for a in s.names)
        out = [assign(module, _call(IMPORT, [name(GLOBALS, at=s), const(s.module or "", s), const(s.level or 0, s),
                                             const(fromlist, s)], s), s)]
        out += [assign(a.asname or a.name, _call(IMPORT_FROM, [name(module, at=s), const(a.name, s)], s), s)
                for a in s.names]
        return out

    def stmt_While(self, s):
        if any(isinstance(n, gast.NamedExpr) for n in gast.walk(s.test)):
            # `while (v := f()) ...:` binds v for the body: test at the top of the body instead, and
            # remember that the test (not a break) ended the loop, for the else clause
            self.counter += 1
            done = self._flag(f".exhausted{self.counter}")
            stop = located(gast.If(test=not_(s.test, s.test), body=[assign(done, const(True, s), s),
                                                                  located(gast.Break(), s.test)], orelse=[]), s.test)
            breaks = _breaks_out(s.body)  # (before the body is canonical: its breaks become flags)
            loop = self._loop(s, const(True, s), [stop] + s.body, [], prelude=[], header=[])
            if not s.orelse:
                return loop
            if not breaks:  # without a break of its own, the loop only ends by its test
                return loop + self.block(s.orelse)
            orelse = located(gast.If(test=name(done, at=s), body=self.block(s.orelse), orelse=[]), s)
            return [assign(done, const(False, s), s)] + loop + [orelse]
        return self._loop(s, s.test, s.body, s.orelse, prelude=[], header=[])

    def stmt_For(self, s):
        self.counter += 1
        n = self.counter
        found = self._unrolled_items(s)
        if found is not None:
            return self._unrolled(s, n, found)
        idx = f".idx{n}"
        bounds = self._reversed_range(s.iter)
        if bounds is not None:
            return self._counted_down(s, n, bounds)
        sources, item_of, lowered = self._iterated(s.iter)
        # (the iterables evaluated first, in order, then each made indexable, as zip and enumerate take them)
        held = [f".iter{n}_{k}" for k in range(len(sources))] if len(sources) > 1 else []
        seqs = [f".seq{n}" if len(sources) == 1 else f".seq{n}_{k}" for k in range(len(sources))]
        prelude = _builtin_reads(sorted(lowered), s)
        prelude += [assign(h, x, s) for h, x in zip(held, sources)]
        for k, (seq, x) in enumerate(zip(seqs, sources)):
            over = name(held[k], at=x) if held else x
            prelude.append(assign(seq, located(gast.Call(func=name(AS_SEQUENCE, at=x), args=[over], keywords=[]), x),
                                  s))
        prelude.append(assign(idx, const(0, s), s))
        tests = [located(gast.Call(func=name(HAS_INDEX, at=s), args=[name(seq, at=s), name(idx, at=s)], keywords=[]),
                         s) for seq in seqs]
        test = tests[0] if len(tests) == 1 else and_(tests, s)  # (zip draws each in turn, and stops at the first end)
        item = item_of(iter(seqs), lambda: name(idx, at=s), s.target)
        bind = located(gast.Assign(targets=[s.target], value=item, type_comment=None), s.target)
        step = assign(idx, located(gast.BinOp(left=name(idx, at=s), op=gast.Add(), right=const(1, s)), s), s)
        return self._loop(s, test, s.body, s.orelse, prelude, [bind, step])

    def _unrolled_items(self, s):
        """(the items, the builtins read) of ``for`` statement ``s`` where it runs over a tuple or list display of
        at most ``_UNROLLED_ITEMS`` items (no starred one), ``enumerate`` of one, or ``range`` of int constants
        that many whose body hands no value to the next iteration (``_carries``: such a loop may step as an RNN),
        ``enumerate`` and ``range`` the builtins, with no ``else`` and nothing in its body that keeps a loop a
        loop (``_KEPT_LOOP``); else None."""
        it = s.iter
        call = it.func.id if isinstance(it, gast.Call) and isinstance(it.func, gast.Name) and not it.keywords \
            and it.func.id in self.builtins and not any(isinstance(a, gast.Starred) for a in it.args) else None
        if _display(it):
            items, read = list(it.elts), ()
        elif call == "enumerate" and 1 <= len(it.args) <= 2 and _display(it.args[0]) and (
                len(it.args) == 1 or _int_constant(it.args[1]) is not None):
            start = _int_constant(it.args[1]) if len(it.args) == 2 else 0
            items = [located(gast.Tuple(elts=[const(start + k, x), x], ctx=gast.Load()), x)
                     for k, x in enumerate(it.args[0].elts)]
            read = ("enumerate",)
        elif call == "range" and 1 <= len(it.args) <= 3 and all(_int_constant(a) is not None for a in it.args):
            try:
                numbers = range(*(_int_constant(a) for a in it.args))
                if len(numbers) > _UNROLLED_ITEMS:
                    return None
            except (ValueError, OverflowError):  # (a step of 0, a huge range: the loop raises or runs as written)
                return None
            if _carries(s.body):
                return None  # (``h = cell(x[t], h)``: one step after another either way, and a loop may step as an RNN)
            items, read = [const(k, it) for k in numbers], ("range",)
        else:
            return None
        if not 0 < len(items) <= _UNROLLED_ITEMS or s.orelse or any(
                isinstance(node, _KEPT_LOOP) for stmt in s.body for node in gast.walk(stmt)):
            return None
        return items, read

    def _unrolled(self, s, n, found):
        """``for x in (a, b): body`` over a few items, as the statements it runs: the items evaluated first, in
        order, then ``x = a``, the body, ``x = b``, the body (``for k in range(2)``: ``k = 0``, the body, ``k = 1``,
        the body, ``range`` read as the builtin). A node's calls on its children (``for child in (tree.left[i],
        tree.right[i])``, a comprehension over them) are then calls of one block, which the batched and threaded
        runtimes issue together, where a loop issues one an iteration."""
        elements, read = found
        items = [f".item{n}_{k}" for k in range(len(elements))]
        stmts = _builtin_reads(read, s)
        stmts += [assign(item, x, x) for item, x in zip(items, elements)]
        for item in items:
            stmts.append(located(gast.Assign(targets=[copy.deepcopy(s.target)], value=name(item, at=s.target),
                                             type_comment=None), s.target))
            stmts += copy.deepcopy(s.body)
        return self.block(stmts)

    def _reversed_range(self, it):
        """The bounds (start or None, stop) of ``reversed(range(stop))`` or ``reversed(range(start, stop))``, where
        both are the builtins (names no scope of the function binds); None for anything else."""
        def builtin_call(x, ident, counts):
            return isinstance(x, gast.Call) and isinstance(x.func, gast.Name) and x.func.id == ident \
                and ident in self.builtins and not x.keywords and len(x.args) in counts \
                and not any(isinstance(a, gast.Starred) for a in x.args)
        if not builtin_call(it, "reversed", (1,)) or not builtin_call(it.args[0], "range", (1, 2)):
            return None
        args = it.args[0].args
        return (None, args[0]) if len(args) == 1 else (args[0], args[1])

    def _counted_down(self, s, n, bounds):
        """``for t in reversed(range(a, b))`` as the loop counting down that it is: ``i = b - 1``, then while
        ``i >= a``: ``t = i``, ``i = i - 1``, the body (the bounds read once, as Python ints, ``range`` taking them
        by ``__index__``): the form a batched run steps as one RNN where the body steps a cell."""
        start, stop = bounds
        idx, low, high = f".idx{n}", f".low{n}", f".high{n}"
        prelude = _builtin_reads(("reversed", "range"), s)

        def as_index(x):
            return located(gast.Call(func=name(INDEX, at=x), args=[x], keywords=[]), x)
        if start is not None:
            prelude.append(assign(low, as_index(start), s))
        prelude.append(assign(high, as_index(stop), s))
        prelude.append(assign(idx, located(gast.BinOp(left=name(high, at=s), op=gast.Sub(), right=const(1, s)), s),
                              s))
        test = located(gast.Compare(left=name(idx, at=s), ops=[gast.GtE()],
                                    comparators=[name(low, at=s) if start is not None else const(0, s)]), s)
        bind = located(gast.Assign(targets=[s.target], value=name(idx, at=s.target), type_comment=None), s.target)
        step = assign(idx, located(gast.BinOp(left=name(idx, at=s), op=gast.Sub(), right=const(1, s)), s), s)
        return self._loop(s, test, s.body, s.orelse, prelude, [bind, step])

    def _iterated(self, it):
        """What a ``for`` over ``it`` indexes: (the iterables, item(seq names, index, at) -> the item's expression,
        the builtins whose call it lowers).
        ``enumerate(xs)`` (or ``enumerate(xs, k)``, k an int constant) and ``zip(xs, ys, ...)``, where they are the
        builtins (``builtins``: names no scope of the function binds), are loops over xs (and ys) themselves: item
        i is ``(i + k, xs[i])`` or ``(xs[i], ys[i])``, an index loop a batched run reads at once, as over a range
        or a tensor's rows. Anything else is one iterable whose item i is ``seq[i]``."""
        call = it if isinstance(it, gast.Call) and isinstance(it.func, gast.Name) and it.func.id in self.builtins \
            and not it.keywords and it.args and not any(isinstance(a, gast.Starred) for a in it.args) else None
        if call is not None and call.func.id == "enumerate" and (len(call.args) == 1 or len(call.args) == 2 and (
                isinstance(call.args[1], gast.Constant) and type(call.args[1].value) is int)):
            sources, inner, names = self._iterated(call.args[0])
            start = call.args[1].value if len(call.args) == 2 else 0

            def counted(seqs, index, at):
                number = index() if not start else located(gast.BinOp(left=index(), op=gast.Add(),
                                                                      right=const(start, at)), at)
                return located(gast.Tuple(elts=[number, inner(seqs, index, at)], ctx=gast.Load()), at)
            return sources, counted, names | {"enumerate"}
        if call is not None and call.func.id == "reversed" and len(call.args) == 1:
            # (``for layer in reversed(self.layers)``: an index loop over the list read from its end, which the
            # instances sharing the list read at once, where the list's reverse iterator is each one's own)
            view = located(gast.Call(func=name(REVERSED_SEQUENCE, at=it), args=call.args, keywords=[]), it)
            return [view], lambda seqs, index, at: located(gast.Subscript(
                value=name(next(seqs), at=at), slice=index(), ctx=gast.Load()), at), {"reversed"}
        if call is not None and call.func.id == "zip":
            parts = [self._iterated(a) for a in call.args]

            def zipped(seqs, index, at):
                elts = [item(seqs, index, at) for _, item, _ in parts]
                return located(gast.Tuple(elts=elts, ctx=gast.Load()), at)
            sources = [x for part, _, _ in parts for x in part]
            return sources, zipped, {"zip"}.union(*(names for _, _, names in parts))

        def indexed(seqs, index, at):
            return located(gast.Subscript(value=name(next(seqs), at=at), slice=index(), ctx=gast.Load()), at)
        return [it], indexed, set()

    def _loop(self, s, test, body, orelse, prelude, header):
        self.counter += 1
        loop = _Loop(self.counter, self._flag)
        self.loops.append(loop)
        outer_returns = self.returns_in_loop
        self.returns_in_loop = False
        new_body = self.block(body)
        returns = self.returns_in_loop
        self.returns_in_loop = outer_returns or returns
        self.loops.pop()
        conds = []
        if loop.uses_brk:
            conds.append(not_(name(loop.brk, at=s), s))
        if returns:
            conds.append(not_(name(RETFLAG, at=s), s))
        conds.append(test)
        if loop.uses_cont:
            header = header + [assign(loop.cont, const(False, s), s)]
        node = located(gast.While(test=and_(conds, s), body=header + new_body, orelse=[]), s)
        out = list(prelude)
        if loop.uses_brk:
            out.append(assign(loop.brk, const(False, s), s))
        out.append(node)
        if orelse:
            new_else = self.block(orelse)
            guard = [not_(name(loop.brk, at=s), s)] if loop.uses_brk else []
            if returns:
                guard.append(not_(name(RETFLAG, at=s), s))
            out.extend([located(gast.If(test=and_(guard, s), body=new_else, orelse=[]), s)] if guard else new_else)
        return out


# builtins that consume the whole of the one iterable they are given (and how many positional arguments each
# takes with it): ``sum(h for h in hs)`` gives what ``sum([h for h in hs])`` gives
CONSUMERS = {"sum": (1, 2), "min": (1,), "max": (1,), "sorted": (1,), "tuple": (1,), "list": (1,), "set": (1,),
             "frozenset": (1,)}


# builtins that stop at the first item that decides (what the rest of the items are then is not computed)
DECIDERS = {"any", "all"}


class _GeneratorsConsumed(gast.NodeTransformer):
    """A generator expression that a builtin consumes whole (``CONSUMERS``; the names no scope of the function
    binds) becomes a list comprehension: converted in place as a loop, which a batched run steps for every
    instance at once, where a generator runs as Python once per instance. ``any(g)`` and ``all(g)`` of one
    ``for`` become a comprehension marked ``decides`` (the builtin's name) standing for the whole call: the
    converter makes it a loop that stops at the first item that decides, as the builtins do. (Not inside a
    nested function, nor any/all inside a with, try, match or class statement: those run as Python; nor a generator
    that calls ``next``, whose StopIteration Python makes a RuntimeError.)
    ``lowered``: the builtins so called, read at the function's start by ``builtin_read``."""

    def __init__(self, builtins):
        self.builtins = builtins
        self.lowered = set()
        self.in_python = 0  # (how many statements run as Python enclose the node)

    def visit_Call(self, node):
        f = node.func
        plain = (isinstance(f, gast.Name) and f.id in self.builtins and node.args
                 and not any(isinstance(a, gast.Starred) for a in node.args)
                 and all(k.arg is not None for k in node.keywords))
        plain = plain and not (isinstance(node.args[0], gast.GeneratorExp) and _draws_by_next(node.args[0]))
        if (plain and f.id in DECIDERS and not self.in_python and len(node.args) == 1 and not node.keywords
                and isinstance(node.args[0], gast.GeneratorExp) and len(node.args[0].generators) == 1):
            gen = node.args[0]
            comp = gast.copy_location(gast.ListComp(elt=gen.elt, generators=gen.generators), node)
            comp.decides = f.id
            self.lowered.add(f.id)
            self.generic_visit(comp)
            return comp
        if plain and f.id in CONSUMERS and isinstance(node.args[0], gast.GeneratorExp) \
                and len(node.args) in CONSUMERS[f.id]:
            gen = node.args[0]
            node.args[0] = gast.copy_location(gast.ListComp(elt=gen.elt, generators=gen.generators), gen)
            self.lowered.add(f.id)
        self.generic_visit(node)
        return node

    def _nested(self, node):
        return node  # (a scope of its own, compiled as Python)

    def _python_block(self, node):
        self.in_python += 1
        self.generic_visit(node)
        self.in_python -= 1
        return node

    visit_Lambda = visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_GeneratorExp = _nested
    visit_With = visit_AsyncWith = visit_Try = visit_TryStar = visit_Match = _python_block


def _draws_by_next(gen):
    """Whether generator expression ``gen``'s items or tests call ``next`` (``__next__``): a StopIteration there
    is a RuntimeError of the generator's (PEP 479), which a loop would let out as it is; it stays a generator."""
    parts = [gen.elt, *(c for g in gen.generators for c in g.ifs), *(g.iter for g in gen.generators[1:])]
    return any(isinstance(n, gast.Call) and (isinstance(n.func, gast.Name) and n.func.id == "next" or
                                            isinstance(n.func, gast.Attribute) and n.func.attr == "__next__")
               for part in parts for n in gast.walk(part))


def _builtin_reads(names, at):
    """``builtin_read(enumerate, "enumerate")`` ... for each builtin a loop was lowered for: an error if the name
    now stands for another."""
    return [located(gast.Expr(value=located(gast.Call(
        func=name(BUILTIN_READ, at=at), args=[name(b, at=at), const(b, at)], keywords=[]), at)), at) for b in names]


_UNROLLED_ITEMS = 8  # (a display of more items stays a loop: its body is not copied more often)
# (what keeps a loop a loop: a jump out of the body; a nested scope or a with / try / match statement, which the
# converter finds again by the very node, so its body may not be copied)
_KEPT_LOOP = (gast.Break, gast.Continue, gast.Return, gast.Yield, gast.YieldFrom, gast.Await, gast.FunctionDef,
              gast.AsyncFunctionDef, gast.Lambda, gast.GeneratorExp, gast.ListComp, gast.SetComp, gast.DictComp,
              gast.AsyncWith, *python_blocks.KINDS)


def _display(x):
    return isinstance(x, (gast.Tuple, gast.List)) and not any(isinstance(e, gast.Starred) for e in x.elts)


def _int_constant(x):
    """The int an int literal is (``2``, ``-2``), else None."""
    if isinstance(x, gast.UnaryOp) and isinstance(x.op, (gast.USub, gast.UAdd)):
        inner = _int_constant(x.operand)
        return None if inner is None else -inner if isinstance(x.op, gast.USub) else inner
    return x.value if isinstance(x, gast.Constant) and type(x.value) is int else None


def _carries(body):
    """Whether a name ``body`` binds is read in it before the body binds it (``h = cell(x[t], h)``, ``total += v``):
    a value one iteration hands the next."""
    bound = {n.id for stmt in body for n in gast.walk(stmt) if isinstance(n, gast.Name)
             and isinstance(n.ctx, gast.Store)}
    seen = set()
    for stmt in body:
        nodes = list(gast.walk(stmt))
        read = {n.id for n in nodes if isinstance(n, gast.Name) and isinstance(n.ctx, gast.Load)}
        read |= {n.target.id for n in nodes if isinstance(n, gast.AugAssign) and isinstance(n.target, gast.Name)}
        if (read & bound) - seen:
            return True
        seen |= {n.id for n in nodes if isinstance(n, gast.Name) and isinstance(n.ctx, gast.Store)}
    return False


def _breaks_out(stmts):
    """Whether a break in ``stmts`` (not in a loop nested in them) leaves their loop."""
    for s in stmts:
        if isinstance(s, gast.Break):
            return True
        if isinstance(s, gast.If) and (_breaks_out(s.body) or _breaks_out(s.orelse)):
            return True
    return False


def _is_docstring(stmt):
    return isinstance(stmt, gast.Expr) and isinstance(stmt.value, gast.Constant) and isinstance(stmt.value.value, str)


def _drop_unread_flags(body, flags):
    """Remove stores of ``flags`` that nothing reads (a jump flag stays as a marker Pass)."""
    module = gast.Module(body=body, type_ignores=[])
    read = {n.id for n in gast.walk(module) if isinstance(n, gast.Name) and isinstance(n.ctx, gast.Load)}

    class Dropper(gast.NodeTransformer):
        def visit_Assign(self, node):
            t = node.targets[0] if len(node.targets) == 1 else None
            if isinstance(t, gast.Name) and t.id in flags and t.id not in read:
                if getattr(node, "_jump", False):
                    marker = located(gast.Pass(), node)
                    marker._jump = True
                    return marker
                return None
            return node

    Dropper().visit(module)
    return module.body


def canonicalize(fdef, declared=None, builtins=frozenset()):
    return Canonicalizer(declared, builtins).function(fdef)
