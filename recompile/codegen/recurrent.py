"""A loop that steps an RNN cell over a sequence, run in batched mode as torch's own RNN over the packed steps.

Users write a recurrent model as a loop over each sequence::

    while t < n:                      # or: for t in range(n)
        h, c = self.cell(self.embed(words[t]), (h, c))
        t = t + 1

Run as written, every step multiplies a few rows (the instances still in the loop) by the cell's input
weights, one step after another, and pays the loop's bookkeeping in Python at every step. A hand-batched
model runs ``nn.LSTM`` over a packed minibatch instead: one product for every word's input, and the steps
in C++. ``RecurrentLoop`` finds the loops that are exactly this, and runs them so:

- the *inputs* of every step (here ``self.embed(words[t])``: ops that read only the counter and values the
  loop does not change) are computed once, before the loop, for every (instance, step) the loop will
  run, as one batch (``chain``), laid out step by step with the longest sequences first: a
  ``PackedSequence``'s data;
- the cell's steps run over that data from each instance's state when the loop starts, and each instance's
  final state is the loop's result: without grad as ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``;
  with grad written out over the packed rows (``lazy_weights.packed_steps``), whose backward torch's packed
  RNN makes far more costly.

A loop is taken when, after the step inputs, its body is the cell call alone on its carried state (or several
cells, each stepping over the state the one below just made; a state may start as None, the cell's zeros, and
inputs and states may be matrices of one row each, ``x.unsqueeze(0)``), with sums of a cell's new state
(``total = total + h``: its start plus the instance's packed states, ``index_add``ed, in step order on the CPU)
or of values computed from the new states (``loss = loss + F.cross_entropy(self.out(h), tags[t])``: computed for
every step at once after the cells, ``added_sg``, and added alike),
its counter moves by 1 and its test is ``counter < end`` (``counter > end`` or ``>= end`` counting down) or a
``for`` over a range, each instance's rows, or each instance's stretch of them (``words[:n]``). At run time
each cell must be an ``nn.LSTMCell``, ``nn.GRUCell`` or ``nn.RNNCell`` of its own (no hooks, no forward of its
own), every callable of the step inputs one that changes nothing and draws no random numbers (as a traced
segment's generic ops: ``segments.rerunnable``), and every value of the shapes the cell takes.
Anything else runs the loop as it is written (``control.Loop``): the step inputs are pure, so computing them
and dropping them changes nothing, and an error they raise is raised by the written loop, at its step, from
the user's line.

A loop whose body after the step inputs is an update of its own instead of cells (``h = torch.tanh(x +
self.hh(h))``, a CRF's ``alpha = torch.logsumexp(alpha.unsqueeze(1) + self.trans, 0) + emits[t]``, an LSTM's
gates written out; ``_update``) runs its step inputs alike, then the update, a batched function of its own, step
by step over the first rows of the instances still in the loop, longest first (``RecurrentLoop._steps``). Sums
of several values a step adds one after another (``gold = gold + a + b``: ``fusion.running_sums``) are one
``index_add`` of each step's values in that order.
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from .. import config, intrinsics, ir
from ..ops import facts
from ..ops.table import has_hooks
from ..passes import effects, fusion
from ..passes.effects import op_mutates
from ..runtime import batch as bt
from ..runtime import batch_rules, lazy_weights, ranges, rows, sharing
from ..runtime.batch import Batch
from . import segments

# (``t = t + 1`` and ``t += 1`` of an int counter; ``intrinsics.iadd_fresh`` where ``passes.fresh`` wrote it so)
_STEP_UP = (operator.add, operator.iadd, intrinsics.iadd_fresh)
_STEP_DOWN = (operator.sub, operator.isub, intrinsics.isub_fresh)
_COMPARISONS = {operator.lt: "lt", operator.gt: "gt", operator.ge: "ge"}
_READS = (getattr, operator.getitem)
_CELLS = (nn.LSTMCell, nn.GRUCell, nn.RNNCell)


class RecurrentLoop:
    """One While of a batched function, found to step a cell over a sequence (``plan``); called with the
    loop's initial values, it returns the loop's final ones, or NotImplemented where the run does not fit."""

    def __init__(self, op, counter, end, layers, chain_sg, reads_sg, var_sources, indexed, appended=(),
                 stacked_only=(), added_sg=None, added_layers=()):
        self.loc = op.loc
        self.counter = counter  # the counter's position among the loop variables
        self.end = end  # (kind, invariant position | Const): see ``ranges.trip_counts``
        # per cell, bottom first (each steps over the one below's states), its state: ("pair", h position,
        # c position) or ("one", state position)
        self.layers = layers
        self.chain_sg = chain_sg  # (counter, *invariants) -> (step input, *loop variables' chain values)
        self.reads_sg = reads_sg  # (*invariants) -> (*cells, *the step inputs' callables)
        # per loop variable: "counter", "index" (the counter's value at the step), ("state", layer, part),
        # ("sum", layer), "same" or ("chain", k)
        self.var_sources = var_sources
        # which invariants the step inputs read (the others are not taken for each row)
        # per ``x[t]`` read for the chain (its last inputs): the invariant, and what t is: "counter", "range" (the
        # item of the range the loop runs over), or "item" (the item itself: x is that range)
        self.indexed = indexed
        # per ``xs.append(h)`` of a layer's new state: (the list's invariant position, the layer), and whether
        # the program reads that list only by ``torch.stack(xs)`` (its rows then go in only if needed)
        self.appended = list(appended)
        self.stacked_only = list(stacked_only) or [False] * len(self.appended)
        # (counter, *invariants, *the items read, *the states of ``added_layers``) -> what each step adds to a sum
        # that is not a state's h (``loss = loss + F.cross_entropy(self.out(h), tags[t])``), or None
        self.added_sg, self.added_layers = added_sg, list(added_layers)
        used = {x for sg in (chain_sg, added_sg) if sg is not None for o in sg.ops for x in o.operands()} | {
            v for sg in (chain_sg, added_sg) if sg is not None for v in sg.outputs}  # (``total + s``: s itself)
        chain_used = [v in used for v in chain_sg.inputs[1:len(chain_sg.inputs) - len(indexed)]]
        added_used = [v in used for v in added_sg.inputs[1:len(chain_sg.inputs) - len(indexed)]] \
            if added_sg is not None else chain_used
        self.used = [a or b for a, b in zip(chain_used, added_used)]
        self.reads = self.chain = self.added = None  # their batched functions (``compile``)
        # a loop whose steps are an update of its own (no cell): see ``stepping``
        self.update_sg = self.update = None
        self.updated, self.reads_state, self.callees, self.fixed_calls = [], [], 0, []
        self.runs = 0  # loops run as one RNN
        self.declined = 0  # loops run as written

    def __repr__(self):
        return f"<recurrent loop {self.chain_sg.name}>"

    def stepping(self, update_sg, updated, reads_state, callees, fixed_calls):
        """Make it a loop whose steps run ``update_sg`` (no cell): (*the variables it changes whose values
        before the step it reads, *the values read before the loop, *the step values) -> the variables' new
        values; ``updated`` their positions, each a layer of the states, ``reads_state`` whether it reads each;
        ``callees`` how many of the reads' callables the step inputs call (the update's read values follow
        them), ``fixed_calls`` the positions of those values the update calls."""
        self.update_sg, self.updated, self.reads_state = update_sg, updated, reads_state
        self.callees, self.fixed_calls = callees, fixed_calls

    def compile(self, generate):
        """Its functions, batched code made by ``generate`` (``codegen.batched.generate_batched``)."""
        self.reads = generate(self.reads_sg).functions[self.reads_sg.name]
        self.chain = generate(self.chain_sg).functions[self.chain_sg.name]
        if self.added_sg is not None:
            self.added = generate(self.added_sg).functions[self.added_sg.name]
        if self.update_sg is not None:
            self.update = generate(self.update_sg).functions[self.update_sg.name]

    def __call__(self, n, loop_vars, invariants):
        out = self._run(n, list(loop_vars), list(invariants)) if config.RECURRENT_LOOPS else NotImplemented
        if out is NotImplemented:
            self.declined += 1
        else:
            self.runs += 1
        return out

    def _run(self, n, loop_vars, invariants):
        callees = _tuple(self.reads(n, *invariants), len(self.reads_sg.outputs))
        cells = callees[:len(self.layers)]
        calls = callees[len(cells):len(cells) + self.callees] if self.update else callees[len(cells):]
        fixed = callees[len(cells) + self.callees:] if self.update else ()
        if not all(type(c) in _CELLS and not has_hooks(c) and "forward" not in c.__dict__ for c in cells):
            return NotImplemented
        if not all(type(c) is not Batch and (segments.rerunnable(c) or _tensor_method(c)) for c in
                   (*calls, *(fixed[p] for p in self.fixed_calls))):
            return NotImplemented
        if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            return NotImplemented
        starts = ranges.counter_values(n, loop_vars[self.counter])
        steps = self.trip_counts(n, starts, invariants)
        if steps is None or sum(steps) == 0:
            return NotImplemented
        if not _stack_fits(cells, self.layers):
            return NotImplemented
        lists = [_lists(n, invariants[p]) for p, _ in self.appended]
        if any(each is None for each in lists) or any(
                type(cells[layer]) is nn.LSTMCell and self.layers[layer][0] != "pair" for _, layer in self.appended
                if cells):
            return NotImplemented  # (an LSTM's state appended whole is its (h, c): the packed states hold h)
        # (an update's variables as (n, ...) rows: each instance's state, of one shape)
        # (a variable the update only writes, ``i, f, g, o = gates.chunk(4)``, may start as anything: undefined)
        begun = [_instance_rows(n, loop_vars[j]) for j in self.updated]
        if any(b is None and (read or min(steps) == 0) for b, read in zip(begun, self.reads_state)):
            return NotImplemented
        summed = {j: source[1] for j, source in enumerate(self.var_sources) if source[0] == "sum"}
        starts_of = {j: _sum_start(n, loop_vars[j], cells[i], self.layers[i]) if cells else
                     _instance_rows(n, loop_vars[j], begun[i]) if begun[i] is not None else None
                     for j, i in summed.items()}
        if any(v is None for v in starts_of.values()):
            return NotImplemented
        added_to = {j: source[1] for j, source in enumerate(self.var_sources) if source[0] == "added"}
        layout = _Layout(steps)
        way = ranges.direction(self.end[0])
        counters = [starts[k] + way * j for k, j in zip(layout.instance, layout.step)]
        args = [ranges.counter_like(loop_vars[self.counter], counters)]
        args += [layout.take(v) if used else None for v, used in zip(invariants, self.used)]
        try:
            items = self.range_items(invariants, layout, counters) if any(
                b == "range" or b == "item" and not _rows_or_lists(invariants[p]) for p, b in self.indexed) \
                else None
            item = (bt.from_items(items) if len(items) > 1 else items[0]) if items is not None else None
            args += [item if by == "item" and not _rows_or_lists(invariants[p]) else
                     _items_at(invariants[p], layout, item, items) if by == "range" else
                     _items_at(invariants[p], layout, args[0], counters) for p, by in self.indexed]
            outs = _tuple(self.chain(layout.rows, *args), len(self.chain_sg.outputs))
        except Exception:  # (the written loop raises it at its step, from the user's line)
            return NotImplemented
        # (the layers whose states of every step the loop's sums and lists read)
        needed = {*summed.values(), *(layer for _, layer in self.appended), *self.added_layers}
        if self.update is not None:
            stepped = len(self.update_sg.inputs) - sum(self.reads_state) - len(fixed)
            ran = self._steps(layout, begun, fixed, outs[:stepped], needed)
            if ran is None:
                return NotImplemented
            (finals, every), one_row, chained = ran, False, outs[stepped:]
        else:
            ran = self._cells(n, loop_vars, cells, layout, outs[0], steps, needed, starts_of)
            if ran is None:
                return NotImplemented
            (finals, every, one_row), chained = ran, outs[1:]
        added = self._added(n, layout, args, every, one_row, {j: loop_vars[j] for j in added_to}, added_to) \
            if added_to else {}
        if added is None:
            return NotImplemented
        for each, (p, layer), stacked in zip(lists, self.appended, self.stacked_only):
            packed = every[layer].unsqueeze(1) if one_row else every[layer]
            if not any(each) and type(invariants[p]) is Batch:  # (their stack: one index of the packed states)
                # (with ``stacked``, the program reads the lists only by their stack: the rows go in where needed)
                rows.hand_rows(invariants[p], each, packed, layout.index, layout.steps(), steps, fill=not stacked)
                continue
            states = packed.unbind(0)
            for r, k in enumerate(layout.instance):
                each[k].append(states[r])
        sums = {j: start.index_add(0, layout.index.to(start.device), every[i])  # (in step order on the CPU)
                for (j, i), start in zip(summed.items(), starts_of.values())}
        sums.update(added)
        return self._results(n, loop_vars, starts, steps, layout, finals, chained, sums)

    def _cells(self, n, loop_vars, cells, layout, x, steps, needed, starts_of):
        """(each layer's final states, its packed states of every step where ``needed``, whether states are
        matrices of one row) of the cells stepped over the packed step inputs ``x``; None where they do not
        take them."""
        data = bt.tensor_of(x) if type(x) is Batch else x.unsqueeze(0) if type(x) is torch.Tensor else None
        # (each step's input a matrix of one row, ``x.unsqueeze(0)``, and the states too: rows of the one batch)
        one_row = data is not None and data.dim() == 3 and data.shape[1] == 1
        if one_row:
            data = data.squeeze(1)
        states = [_state(n, form, loop_vars, cell, min(steps), one_row) for form, cell in zip(self.layers, cells)]
        if any(s is None for s in states):
            return None
        weight = cells[0].weight_ih
        if data is None or data.dim() != 2 or data.shape != (layout.rows, cells[0].input_size) \
                or data.dtype != weight.dtype or data.device != weight.device:
            return None
        if any(c.weight_ih.dtype != data.dtype or c.weight_ih.device != data.device for c in cells) or \
                any(s.dtype != data.dtype or s.device != data.device for state in states for s in state) or \
                any(s.dtype != data.dtype or s.device != data.device for s in starts_of.values()):
            return None
        finals, every = [], []
        for i, (cell, state) in enumerate(zip(cells, states)):
            ends, data = _run_cell(cell, data, layout, state, i + 1 < len(cells) or i in needed, one_row)
            finals.append(ends)
            every.append(data)
        return finals, every, one_row

    def _steps(self, layout, begun, fixed, stepped, needed):
        """(each variable's final state, its packed states of every step where ``needed``) of the update run
        step by step over the instances still in the loop, longest first: the first rows of the states, of the
        values read before the loop (taken in that order once) and of each step's packed values; None where a
        step raises or gives a variable a value that is not its rows of the shape, dtype and device it began
        with (the written loop then runs it, and raises its error from the user's line)."""
        if not begun:  # (a loop of sums of its step inputs alone)
            return [], []
        taking = layout.order[:layout.instances]
        parts = [b.index_select(0, bt.index_on(taking, b)) if b is not None else None for b in begun]
        fixed = [bt.take(v, taking, layout.taking()) for v in fixed]
        cuts = [_cut(v, layout.sizes) for v in stepped]
        finished, made, going = [], {i: [] for i in needed}, layout.instances
        try:
            for j, count in enumerate(layout.sizes):
                if count < going:
                    finished.append([p[count:] for p in parts])
                    parts = [p[:count] for p in parts]
                going = count
                out = _tuple(self.update(count, *(bt.from_tensor(p) for p, read in zip(parts, self.reads_state)
                                                  if read),
                                         *(bt.part(v, 0, count) for v in fixed), *(c[j] for c in cuts)),
                             len(parts))
                parts = [_instance_rows(count, v, p) for v, p in zip(out, parts)]
                if any(p is None for p in parts):
                    return None
                for i in needed:
                    made[i].append(parts[i])
        except Exception:
            return None
        finished.append(parts)
        ends = [torch.cat([f[i] for f in reversed(finished)]) if len(finished) > 1 else parts[i]
                for i in range(len(parts))]
        finals = [[bt.from_tensor(f)] for f in _unsorted(begun, ends, layout)]
        return finals, [torch.cat(made[i]) if i in made else None for i in range(len(parts))]

    def _added(self, n, layout, args, every, one_row, starts, added_to):
        """{loop variable: its sum} of each sum whose steps add values computed from the new state (``loss +
        F.cross_entropy(self.out(h), tags[t])``) or step inputs (``gold + self.trans[tags[t - 1], tags[t]] +
        emits[t, tags[t]]``): those values for every row at once (``added_sg``), each instance's added to its
        start in step order, a step's values in the order the step adds them (one ``index_add``: on the CPU, in
        the rows' order, as the loop adds them); None where a start or a value is not a tensor of one dtype and
        shape."""
        totals, like = [], next((e for e in every if e is not None), None)
        for start in starts.values():  # (checked first: a loop given up runs its callables again, as written)
            total = _instance_rows(n, start)
            if total is None or like is not None and (total.dtype != like.dtype or total.device != like.device):
                return None
            totals.append(total)
        states = [bt.from_tensor(every[i].unsqueeze(1) if one_row else every[i]) for i in self.added_layers]
        try:
            values = _tuple(self.added(layout.rows, *args, *states), len(self.added_sg.outputs))
        except Exception:  # (the written loop raises it at its step, from the user's line)
            return None
        found = {}
        for j, total in zip(starts, totals):
            each = [_instance_rows(layout.rows, values[i], total) for i in added_to[j]]
            if any(rows is None for rows in each):
                return None
            index = layout.index.to(total.device)
            if len(each) > 1:  # (a step's values one after another, as ``(gold + a) + b`` adds them)
                index = index.repeat_interleave(len(each))
                each = [torch.stack(each, 1).flatten(0, 1)]
            found[j] = total.index_add(0, index, each[0])
        return found

    def range_items(self, invariants, layout, counters):
        """Each row's item ``t = seq[i]`` of a ``for t in range(...)``: its instance's range at its position."""
        seq = invariants[self.end[1]]
        each = ranges.of(seq) if type(seq) is Batch else None
        return [each[k][i] for k, i in zip(layout.instance, counters)] if each is not None else \
            [seq[i] for i in counters]

    def trip_counts(self, n, starts, invariants):
        kind, where = self.end
        end = where.value if isinstance(where, ir.Const) else tuple(invariants[p] for p in where) \
            if kind == "zip" else invariants[where]
        return ranges.trip_counts(n, starts, kind, end)

    def _results(self, n, loop_vars, starts, steps, layout, finals, chained, sums):
        out = []
        for j, source in enumerate(self.var_sources):
            if j in sums:
                out.append(bt.from_tensor(sums[j]))
            elif source == "counter":
                way = ranges.direction(self.end[0])
                ends = [s + way * k for s, k in zip(starts, steps)]
                start = loop_vars[j]
                out.append(_per_instance(n, ends) if ranges.counter_dtype(start) is None else
                           ranges.counter_like(start, ends))
            elif source[0] == "state":
                ends = finals[source[1]]
                if source[2] is not None:
                    out.append(ends[source[2]])
                elif len(ends) == 2:  # (an LSTM's (h, c) as one variable)
                    out.append(bt.from_struct(tuple, ends, n) if n > 1 else tuple(ends))
                else:
                    out.append(ends[0])
            elif source == "same":
                out.append(loop_vars[j])
            elif source == "index":  # (the counter at each instance's last step; its start value if it took none)
                way = ranges.direction(self.end[0])
                last = ranges.counter_like(loop_vars[self.counter], [s + way * (k - 1) for s, k in zip(starts, steps)])
                out.append(last if all(steps) else _per_instance(n, [
                    bt.instance(last, i) if k else bt.instance(loop_vars[j], i) for i, k in enumerate(steps)]))
            else:  # ("chain", k): its value at the instance's last step, or the initial one if it took none
                value = chained[source[1]]
                if n > 1 and layout.rows > 1 and all(steps):  # (every instance's last row, at once)
                    rows = layout.last_rows()
                    out.append(bt.take(value, bt.long_tensor(rows), rows))
                    continue
                initial = loop_vars[j]
                out.append(_per_instance(n, [
                    bt.instance(value, layout.last_row(k)) if layout.rows > 1 and steps[k] else
                    value if steps[k] else bt.instance(initial, k) for k in range(n)]))
        return tuple(out)


class _Layout:
    """The (instance, step) rows of a loop's steps as a PackedSequence lays them out: step by step, and within
    a step the instances by their number of steps, longest first (ties in instance order)."""

    def __init__(self, steps):
        order = sorted(range(len(steps)), key=steps.__getitem__, reverse=True)  # (stable: ties keep their order)
        self.order = bt.long_tensor(order)
        taking = [k for k in order if steps[k]]
        self.instances = len(taking)  # the instances that take a step
        sizes, instance, step = [], [], []
        for j in range(steps[order[0]]):
            while steps[taking[-1]] <= j:
                taking.pop()
            sizes.append(len(taking))
            instance.extend(taking)
            step.extend([j] * len(taking))
        self.batch_sizes = bt.long_tensor(sizes)
        self.sizes, self.instance, self.step = sizes, instance, step
        self.index = bt.long_tensor(instance)
        self.rows = len(instance)
        self._steps, self._order = steps, order
        self._last = None

    def taking(self):
        """The instances that take a step, longest first."""
        return self._order[:self.instances]

    def steps(self):
        """Each row's step, a LongTensor."""
        return bt.long_tensor(self.step)

    def take(self, value):
        """An invariant's value for each row: an instance's own value on each of its rows."""
        if type(value) is not Batch:
            return value
        taken = bt.take(value, self.index, self.instance)
        bt.note_taken(value, self.index, taken)  # (the loop's steps may save it; the caller may change value after)
        return taken

    def last_row(self, k):
        """The row of instance k's last step (it takes one)."""
        return self.last_rows()[k]

    def last_rows(self):
        """Each instance's last row (where it takes a step)."""
        if self._last is None:
            starts = [0]
            for size in self.sizes:
                starts.append(starts[-1] + size)
            rank = {k: r for r, k in enumerate(self._order)}
            self._last = [starts[s - 1] + rank[k] if s else None for k, s in enumerate(self._steps)]
        return self._last


def _rows(seq):
    """Whether a ``for`` runs over ``seq``'s rows (a tensor's, each instance's, each instance's stretch of
    them: ``words[:n]``), not over a range."""
    return type(seq) is torch.Tensor or type(seq) is Batch and (seq.owner == "tensor" or rows.of(seq) is not None)


def _rows_or_lists(seq):
    """Whether a ``for`` runs over ``seq``'s rows (``_rows``) or over each instance's own list or tuple
    (``for h in hs``, ``for child in node.children``), not over a range."""
    return _rows(seq) or ranges.own_sequences(seq)


def _items_at(value, layout, counter, counters):
    """``value[t]`` for each row's instance and counter t: one advanced index of a tensor's rows, without
    taking the whole sequence for each row."""
    stretches = rows.of(value)
    if stretches is not None:
        return rows.items_at(stretches, layout.index, counters)
    if type(value) is Batch and value.owner == "items" and value.thunk is None:
        lists = value.items
        if type(lists) is rows.Appended and sharing.state.fresh and lists.holds_its_rows_alone():
            # (lists a loop appended its rows to: the rows read where they lie, leaves' empty lists beside them)
            found = lists.rows_at(layout.instance, counters)
            if found is not None:
                return bt.from_tensor(found)
        # (``hs[t]`` of each instance's own list of states, ``for t in range(len(hs))``: their stack, read once)
        stack = rows.stacked(len(value.items), value, (), {})
        if stack is not NotImplemented:
            return _items_at(stack, layout, counter, counters)
        if ranges.own_sequences(value):
            # (a list empty or of values of their own shapes: each row's item)
            return _stacked_or_items([value.items[k][t] for k, t in zip(layout.instance, counters)])
    if type(value) in (list, tuple):  # (``hs[t]`` of a list every row reads: one frame's node's own)
        return _stacked_or_items([value[t] for t in counters])  # (the written loop raises an IndexError at its step)
    t = bt.tensor_of(value) if type(value) is Batch else value if type(value) is torch.Tensor else None
    if t is None or t.dim() < (2 if type(value) is Batch else 1):
        return batch_rules.item(layout.rows, layout.take(value), counter)
    steps = bt.long_tensor(counters, t.device)
    if type(value) is not Batch:
        return bt.from_tensor(t[steps])
    places = rows.counted(steps, t.shape[1])
    if places is None:  # (the written loop raises it at its step)
        raise IndexError(f"index out of range for dimension 0 with size {t.shape[1]}")
    return bt.from_tensor(rows.gather_rows(t, layout.index.to(t.device), places))


def _stacked_or_items(found):
    """Each row's item ``found``: one stack where they are tensors alike, else the rows' items."""
    if all(type(x) in bt.PLAIN_TENSORS for x in found) and bt.same_kind(found, 0):
        return bt.from_tensor(torch.stack(found))
    return bt.from_items(found) if len(found) > 1 else found[0]


def _run_cell(cell, data, layout, state, outputs=False, one_row=False):
    """The cell stepped over the packed ``data`` from the instances' states ``state`` ((n, hidden) each): the
    final states, each an (n, hidden) batch (with ``one_row`` (n, 1, hidden): each instance's a matrix of one
    row), and with ``outputs`` the packed states of every step (the input of a cell stepped above it), else
    None."""
    order = layout.order.to(state[0].device)  # (the layout's on the CPU: torch's packed RNN reads its sizes there)
    taking = order[:layout.instances]
    hx = [s.index_select(0, taking) for s in state]
    weights = [cell.weight_ih, cell.weight_hh] + ([cell.bias_ih, cell.bias_hh] if cell.bias else [])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (data, *hx, *weights)):
        # (torch's packed RNN records a step's input rows as a narrow of every step's: its backward is a full-size
        # gradient per step, which this one does not make: 30% faster a training step of a sentence LSTM)
        out, steps = lazy_weights.packed_steps(cell, data, layout.sizes, tuple(hx) if len(hx) == 2 else hx[0],
                                               outputs)
        ends = list(out) if len(hx) == 2 else [out]
    elif torch.is_inference_mode_enabled():
        ends, steps = _torch_rnn(cell, data, layout.batch_sizes, [s.unsqueeze(0) for s in hx], weights)
    else:
        # (without grad, in inference mode: 2-4% faster; what leaves it is copied to ordinary tensors, which the
        # caller may change in place or use where autograd records, as the plain level runs' results are)
        with torch.inference_mode():
            ends, steps = _torch_rnn(cell, data, layout.batch_sizes, [s.unsqueeze(0) for s in hx], weights)
        ends = [e.clone() for e in ends]
        steps = steps.clone() if outputs else None
    finals = _unsorted(state, ends, layout)
    return [bt.from_tensor(f.unsqueeze(1) if one_row else f) for f in finals], steps


def _unsorted(state, ends, layout):
    """Each instance's final rows, in instance order, of ``ends`` (the instances that take a step, longest
    first): those that take none keep theirs of ``state``."""
    order = layout.order.to(ends[0].device)
    if layout.instances == len(layout.order):
        back = torch.argsort(order)
        return [e.index_select(0, back) for e in ends]
    return [s.index_copy(0, order[:layout.instances], e) for s, e in zip(state, ends)]


def _instance_rows(n, value, like=None):
    """``value`` as (n, ...) rows, each instance's tensor (or the one they share: a plain tensor, also the one
    instance's own where n is 1), or None where it is not a tensor (of ``like``'s shape, dtype and device past
    its rows, where given)."""
    if type(value) is Batch:
        t = bt.tensor_of(value)
    elif type(value) in bt.PLAIN_TENSORS:
        t = value.unsqueeze(0).expand(n, *value.shape)
    else:
        return None
    if t is None or t.shape[0] != n or like is not None and (
            t.shape[1:] != like.shape[1:] or t.dtype != like.dtype or t.device != like.device):
        return None
    return t


def _cut(value, sizes):
    """Each step's values of ``value``, a step input of every row (the layout's packed rows): the rows of
    each step, cut by one split; a value every row shares at each step."""
    if type(value) is not Batch:
        return [value] * len(sizes)
    t = bt.rows_tensor(value)
    if t is not None:
        return [bt.from_tensor(c) for c in t.split(sizes)]
    items, out, at = bt.items_of(value), [], 0
    for size in sizes:
        out.append(items[at] if size == 1 else bt.from_items(items[at:at + size]))
        at += size
    return out


def _torch_rnn(cell, data, batch_sizes, hx, weights):
    """torch's own packed RNN of ``cell``'s kind: the final states, a row per sequence, and every step's."""
    flags = (cell.bias, 1, 0.0, cell.training, False)
    if type(cell) is nn.LSTMCell:
        steps, h, c = torch.lstm(data, batch_sizes, hx, weights, *flags)
        return [h[0], c[0]], steps
    run = torch.gru if type(cell) is nn.GRUCell else torch.rnn_tanh if cell.nonlinearity == "tanh" else torch.rnn_relu
    steps, h = run(data, batch_sizes, hx[0], weights, *flags)
    return [h[0]], steps


def _stack_fits(cells, layers):
    """Whether each cell above the first takes the one below's state as its input (an LSTM's h alone)."""
    for below, above, form in zip(cells, cells[1:], layers):
        if above.input_size != below.hidden_size or (type(below) is nn.LSTMCell and form[0] != "pair"):
            return False
    return True


def _state(n, form, loop_vars, cell, fewest, one_row):
    """The cell's state when the loop starts, as (n, hidden) tensors (h, c for an LSTM), or None. A state of
    None (``state = None``, then ``state = cell(x, state)``) is the zeros the cell starts from, where every
    instance takes a step (one that takes none ends with None). With ``one_row`` each instance's state is a
    matrix of one row, (1, hidden)."""
    if form[0] == "pair":
        parts = [loop_vars[form[1]], loop_vars[form[2]]]
    else:
        value = loop_vars[form[1]]
        parts = [value]
        if value is None:
            weight = cell.weight_ih
            zeros = torch.zeros(n, cell.hidden_size, dtype=weight.dtype, device=weight.device)
            return None if fewest == 0 else [zeros, zeros] if type(cell) is nn.LSTMCell else [zeros]
        if type(cell) is nn.LSTMCell:
            if type(value) is Batch and value.struct is not None and value.owner is None:
                parts = list(bt.struct_items(value))  # (a dict's keys: no state, as the cell refuses them)
            elif type(value) is tuple:
                parts = list(value)
            else:
                return None
    if len(parts) != (2 if type(cell) is nn.LSTMCell else 1):
        return None
    shape = (1, cell.hidden_size) if one_row else (cell.hidden_size,)
    out = []
    for p in parts:
        t = _instance_rows(n, p)
        if t is None or t.shape[1:] != shape:
            return None
        out.append(t.squeeze(1) if one_row else t)
    return out


def _sum_start(n, value, cell, form):
    """A sum's start as (n, hidden) rows: each instance's tensor, or one they share; None where the sum is not
    of a state's h and a tensor of its shape (an LSTM's whole state, a number)."""
    if type(cell) is nn.LSTMCell and form[0] != "pair":
        return None
    t = _instance_rows(n, value)
    return t if t is not None and t.shape[1:] == (cell.hidden_size,) else None


def _lists(n, value):
    """Each instance's list of ``value`` (a list, or a batch of them), or None where one is not a list."""
    each = bt.items_of(value) if type(value) is Batch else [value] if n == 1 else None
    return each if each is not None and all(type(x) is list for x in each) else None


def _tuple(out, count):
    return (out,) if count == 1 else () if count == 0 else out


def _per_instance(n, values):
    """One value every instance shares where they are the same int, else a batch of them."""
    if n == 1:
        return values[0]
    first = values[0]
    if type(first) is int and all(type(v) is int and v == first for v in values):
        return first
    return bt.from_items(values)


# -- finding the loops


def plan(op, holder=None):
    """The RecurrentLoop of While ``op`` (in SubGraph ``holder``), or None when its body is not a cell stepped
    over step inputs."""
    found = counting(op)
    if found is None:
        return None
    counter, end = found
    body = op.body_sg
    k = len(op.loop_vars)
    params = body.inputs
    counter_param, invariant_params = params[counter], params[k:]
    chain = _chain(body, {counter_param, *invariant_params})
    step_up = body.outputs[counter].op
    rest = [o for o in body.ops if o not in chain and o is not step_up]
    sums = _sums(rest, body, counter)
    rest = [o for o in rest if not any(o in ops for ops, _ in sums.values())]
    appends = _appends(rest, body, invariant_params)
    rest = [o for o in rest if o not in appends]
    added = _added_ops(rest, body, sums, chain, {counter_param, *invariant_params}, k)
    if added is None:
        return None
    rest = [o for o in rest if o not in added]
    layers = _cell_calls(rest, body, params[:k], counter)
    update = _update(rest, body, params, k, counter, chain) if layers is None else None
    if layers is None and update is None:
        return None
    states = {}  # loop variable -> ("state", layer, h 0 | c 1 | None: the whole state)
    if layers is not None:
        stepped = [layers[0][0].args[0]]  # (the cell's input)
        if not (isinstance(stepped[0], ir.Value) and (stepped[0].op in chain or stepped[0] is counter_param
                                                      or stepped[0] in invariant_params)):
            return None
        for i, (_, form) in enumerate(layers):
            for part, j in enumerate(form[1:]):
                states[j] = ("state", i, part if form[0] == "pair" else None)
        tops = {body.outputs[form[1]]: i for i, (_, form) in enumerate(layers)}  # (each layer's h, or its state)
        fixed, update_ops = [], set()
    else:  # (each variable the update changes a "layer" of its own: its state, its packed states)
        updated, update_ops, fixed, stepped = update
        states = {j: ("state", i, None) for i, j in enumerate(updated)}
        tops = {body.outputs[j]: i for i, j in enumerate(updated)}
        layers = []
    var_sources, chained = [], []
    if any(call.args[0] not in tops for call in appends):
        return None
    appended = [(p, tops[call.args[0]]) for call, p in appends.items()]
    if len({p for p, _ in appended}) != len(appended):
        return None  # (two appends a step to one list interleave their states, which the packed states do not)
    lists = {invariant_params[p] for p, _ in appended}  # (read by nothing but their appends: the step inputs,
    if any(v in lists for o in body.ops if not _is_append_of(o, lists) for v in o.operands()):  # run ahead,
        return None  # would read them before the loop grows them)
    for j, (param, out) in enumerate(zip(params[:k], body.outputs)):
        if j == counter:
            var_sources.append("counter")
        elif j in sums:
            addends = sums[j][1]
            if len(addends) == 1 and addends[0] in tops:
                var_sources.append(("sum", tops[addends[0]]))
            elif all(isinstance(v, ir.Value) and (v.op in added or v.op in chain or v is counter_param
                                                  or v in invariant_params) for v in addends):
                var_sources.append(("added", addends))  # (values computed from the new states, or step inputs)
            else:
                return None
        elif j in states:
            var_sources.append(states[j])
        elif out is param:
            var_sources.append("same")
        elif out is counter_param:  # (``t`` of ``for t, w in enumerate(words)``: the counter at its step)
            var_sources.append("index")
        elif isinstance(out, ir.Value) and out.op in chain:
            var_sources.append(("chain", len(chained)))
            chained.append(out)
        else:
            return None
    callees = [o.fn for o in chain if isinstance(o, ir.Call) and isinstance(o.fn, ir.Value)]
    added_callees = [o.fn for o in added if isinstance(o, ir.Call) and isinstance(o.fn, ir.Value)]
    if any(c.op not in chain and not _pure_method(c) for c in added_callees):
        return None  # (a callable the step computes: a method of its value, ``self.out(h).sum``, that changes nothing)
    callees += [c for c in added_callees if c.op in chain]  # (read before the loop, and checked, as the steps')
    # a method of a step's value (``x.unsqueeze``) is read with it, step by step: by its name, one that changes
    # nothing; every other callable is read once, before the loop, from what the loop does not change
    methods = [c for c in callees if _pure_method(c) and counter_param in _params(_needed([c], chain) or ())]
    callees = [c for c in callees if c not in methods]
    cell_values = [call.fn for call, _ in layers]
    reads = _needed([*cell_values, *callees, *fixed], chain)
    if reads is None or any(not _is_read(o) for o in reads) or counter_param in _params(reads):
        return None
    added_values = [v for source in var_sources if source[0] == "added" for v in source[1]]
    # (the new states the added values read: each a layer's top)
    state_values = sorted({v for o in added for v in o.operands() if isinstance(v, ir.Value) and v.op not in added
                           and v.op not in chain and v not in params}, key=body.outputs.index)
    if any(v not in tops for v in state_values):
        return None
    added_chain = _needed([*(v for o in added for v in o.operands() if isinstance(v, ir.Value) and v.op in chain),
                           *(v for v in added_values if v.op in chain)], chain)
    steps = _needed([*stepped, *chained], chain)
    if steps is None or added_chain is None:
        return None
    # (an op whose result no step needs runs with the steps' inputs all the same: it may fail, as the written
    # loop's would at its step (``a, b = x[t]`` of an item of another length, a missing attribute); a call among
    # them is checked to change and draw nothing, as every call of the chain is)
    leftover = chain - steps - reads - added_chain - update_ops - {step_up}
    steps |= _needed([v for o in leftover for v in o.outputs], chain)
    name = body.name + ".steps"
    # ``x[t]`` of a sequence the loop does not change: each row's item read at once, as the chain's input
    # (and ``x[t]`` of the range's item ``t = seq[i]`` in a ``for t in range(...)``: each row's t is known too)
    seq = invariant_params[end[1]] if end[0] == "range" else None
    range_items = {o.output for o in steps if _const_fn(o) is operator.getitem and not o.kwargs
                   and o.args == [seq, counter_param]}
    range_items |= {o.output for o in added_chain if _const_fn(o) is operator.getitem and not o.kwargs
                    and o.args == [seq, counter_param]}
    items = [o for o in body.ops if (o in steps or o in added_chain) and _const_fn(o) is operator.getitem
             and not o.kwargs and o.args[0] in invariant_params and (
                 o.args[1] is counter_param or o.args[1] in range_items and o.args[0] is not seq)]
    given = [counter_param, *invariant_params, *(o.output for o in items)]
    chain_sg = _subgraph(name, given, [o for o in body.ops if o in steps and o not in items], [*stepped, *chained],
                         body.loc)
    added_sg = _subgraph(name + ".added", [*given, *state_values], [
        o for o in body.ops if (o in added_chain and o not in items) or o in added], added_values, body.loc) \
        if added_values else None
    at = iter(range(len(added_values)))  # (each sum's values, in order: their places among the added values)
    var_sources = [("added", tuple(next(at) for _ in source[1])) if source[0] == "added" else source
                   for source in var_sources]
    reads_sg = _subgraph(name + ".callables", invariant_params, [o for o in body.ops if o in reads],
                         [*cell_values, *callees, *fixed], body.loc)
    indexed = [(invariant_params.index(o.args[0]), "item" if o.output in range_items else
                "counter" if o.args[1] is counter_param else "range") for o in items]
    stacked_only = [_only_stacked(op.invariants[p], op, holder) for p, _ in appended]
    found = RecurrentLoop(op, counter, end, [form for _, form in layers], chain_sg, reads_sg, var_sources, indexed,
                          appended, stacked_only, added_sg, [tops[v] for v in state_values])
    if update is not None:
        read = {v for o in update_ops for v in o.operands()}
        found.stepping(_subgraph(name + ".update", [*(params[j] for j in updated if params[j] in read), *fixed,
                                                    *stepped],
                                 [o for o in body.ops if o in update_ops], [body.outputs[j] for j in updated],
                                 body.loc), updated, [params[j] in read for j in updated], len(callees), [
            p for p, v in enumerate(fixed) if any(isinstance(o, ir.Call) and o.fn is v for o in update_ops)])
    return found


def _only_stacked(value, loop, holder):
    """Whether list ``value``, built in ``holder`` (``xs = []``), is read there by nothing but ``loop`` and
    ``torch.stack(xs)`` (nor returned): every other use of it reaches it through an op of ``holder``."""
    if holder is None or _const_fn(value.op) is not intrinsics.build_list or value.op not in holder.ops \
            or value in holder.outputs:
        return False
    for o in holder.ops:
        if o is loop or value not in o.operands():
            continue
        if not (isinstance(o, ir.Call) and not o.kwargs and not o.star and o.args == [value]
                and effects.resolve(o.fn) is torch.stack):
            return False
    return True


def counting(op):
    """(the counter's loop-variable position, the end) of a While whose test is ``counter < end``, a ``for``'s
    ``has_index(seq, counter)`` or a ``for`` over a ``zip``'s (``_zipped``) with a body adding 1 to the counter,
    or ``counter > end`` / ``counter >= end`` with a body taking 1 from it; else None."""
    cond, body, k = op.cond_sg, op.body_sg, len(op.loop_vars)
    zipped = _zipped(cond, k)
    if zipped is not None:
        return _counted(body, *zipped)
    if len(cond.ops) != 1 or len(cond.outputs) != 1 or cond.outputs[0] is not cond.ops[0].output:
        return None
    test = cond.ops[0]
    if not (isinstance(test, ir.Call) and isinstance(test.fn, ir.Const) and len(test.args) == 2
            and not test.kwargs and not test.star):
        return None
    params = cond.inputs
    a, b = test.args
    kind = _COMPARISONS.get(test.fn.value)
    if kind is not None and a in params[:k]:
        counter = params.index(a)
        if b in params[k:]:
            end = (kind, params.index(b) - k)
        elif isinstance(b, ir.Const) and type(b.value) in (int, float):
            end = (kind, b)
        else:
            return None
    elif test.fn.value is intrinsics.has_index and b in params[:k] and a in params[k:]:
        counter, end = params.index(b), ("range", params.index(a) - k)
    else:
        return None
    return _counted(body, counter, end)


def _zipped(cond, k):
    """(the counter's position, ("zip", the sequences' invariant positions)) of a ``for`` over ``zip(a, b,
    ...)``, whose test is ``has_index(a, i) and has_index(b, i) and ...``; else None."""
    params = cond.inputs
    found = _has_index_chain(cond, {p: p for p in params})
    if found is None or len(found) < 2:
        return None
    counters = {i for _, i in found}
    if len(counters) != 1 or not all(a in params[k:] for a, _ in found):
        return None
    (i,) = counters
    if i not in params[:k]:
        return None
    return params.index(i), ("zip", tuple(params.index(a) - k for a, _ in found))


def _has_index_chain(sg, names):
    """[(sequence, counter)] of a test ``has_index(a, i) and has_index(b, i) and ...`` (each of sg's values
    named by the outermost test's parameter it is: ``names``), or None for another test."""
    ops = sg.ops
    first = ops[0] if ops and len(sg.outputs) == 1 else None
    if not (isinstance(first, ir.Call) and isinstance(first.fn, ir.Const) and first.fn.value is intrinsics.has_index
            and len(first.args) == 2 and not first.kwargs and not first.star):
        return None
    found = [(names.get(first.args[0]), names.get(first.args[1]))]
    if len(ops) == 1:
        return found if sg.outputs[0] is first.output else None
    test = ops[1]
    if len(ops) != 2 or not isinstance(test, ir.Cond) or test.pred is not first.output or \
            sg.outputs[0] is not test.output or test.else_sg.ops or len(test.else_sg.outputs) != 1 or \
            not (isinstance(test.else_sg.outputs[0], ir.Const) and test.else_sg.outputs[0].value is False):
        return None
    rest = _has_index_chain(test.then_sg, {p: names.get(a) for p, a in zip(test.then_sg.inputs, test.args)})
    return None if rest is None else found + rest


def _counted(body, counter, end):
    """(counter, end) where the body moves the counter by 1 the way ``end`` counts, else None."""
    step = body.outputs[counter]
    up = step.op if isinstance(step, ir.Value) else None
    if not (isinstance(up, ir.Call) and isinstance(up.fn, ir.Const) and len(up.args) == 2 and not up.kwargs
            and up.args[0] is body.inputs[counter] and isinstance(up.args[1], ir.Const)
            and type(up.args[1].value) is int):
        return None
    moves = up.args[1].value * (1 if up.fn.value in _STEP_UP else -1 if up.fn.value in _STEP_DOWN else 0)
    if moves != ranges.direction(end[0]):
        return None
    return counter, end


def _chain(body, given):
    """The body's ops that read only ``given`` (the counter, the invariants) and what such ops computed, and
    that may be run ahead of their step: calls without unpacking, captures, fused ops."""
    known, chain = set(given), set()
    for o in body.ops:
        if _runs_ahead(o) and all(not isinstance(v, ir.Value) or v in known for v in o.operands()):
            chain.add(o)
            known.update(o.outputs)
    return chain


def _sums(rest, body, counter):
    """{loop variable: (the ops of ``rest`` adding to it, what each adds)} for each variable the body only adds
    values to (``fusion.running_sums``): its final value is its start plus the values of every step, in order."""
    return {j: found for j, found in fusion.running_sums(body).items()
            if j != counter and all(o in rest for o in found[0])}


def _added_ops(rest, body, sums, chain, given, k):
    """The ops of ``rest`` that compute what a sum adds at each step where that is not a new state itself but
    computed from the new states (``F.cross_entropy(self.out(h), tags[t])``: the body's new values of its
    variables), the step's inputs (the chain) and what the loop does not change; read by nothing else, and each
    one that may run ahead of its step (as the chain's ops). An empty set where there is none; None where a sum
    adds a value that reads something else (a variable's value before the step)."""
    states = {v for v in body.outputs[:k] if isinstance(v, ir.Value)}
    found = set()
    for _, addends in sums.values():
        pending = [v for v in addends if isinstance(v, ir.Value) and v not in states]
        while pending:
            v = pending.pop()
            if v in given or v.op in chain or v in states or v.op in found:
                continue
            producer = v.op
            if producer not in rest or not _runs_ahead(producer):
                return None
            found.add(producer)
            pending.extend(x for x in producer.operands() if isinstance(x, ir.Value))
    made = {v for o in found for v in o.outputs}
    readers = [o for o in body.ops if o not in found and not any(o in ops for ops, _ in sums.values())]
    if any(v in made for o in readers for v in o.operands()) or any(v in made for v in body.outputs):
        return None
    return found


def _runs_ahead(o):
    """Whether op ``o`` may be run for every step at once, ahead of or after its step: a call without unpacking
    that changes nothing (of a callable the program reads, or one that runs again alike), a capture, a fused op."""
    if isinstance(o, ir.Call):
        return not o.star and all(key is not None for key, _ in o.kwargs) and not op_mutates(o) and (
            isinstance(o.fn, ir.Value) or segments.rerunnable(o.fn.value))
    return isinstance(o, (ir.Capture, ir.Fused)) and not (isinstance(o, ir.Capture) and o.source_kind == "free")


def _appends(rest, body, invariant_params):
    """{op of ``rest``: invariant position} of each ``xs.append(v)`` of a list the loop does not rebind, its result
    unread: after the loop, each instance's list holds each step's v (a cell's new state: ``plan`` checks)."""
    read = {v for o in body.ops for v in o.operands()} | {v for v in body.outputs if isinstance(v, ir.Value)}
    found = {}
    for o in rest:
        method = effects.growing(o.fn.op) if isinstance(o, ir.Call) and isinstance(o.fn, ir.Value) else None
        if (method is not None and method[1] == "append" and method[0] in invariant_params and len(o.args) == 1
                and not o.kwargs and not o.star and o.output not in read):
            found[o] = invariant_params.index(method[0])
    return found


def _update(rest, body, params, k, counter, chain):
    """(the loop variables it changes, its ops, the values it reads that the loop does not change, the step
    values it reads) of the ops of ``rest`` when they are a state update of their own (``h = torch.tanh(x +
    self.hh(h))``, ``alpha = torch.logsumexp(alpha.unsqueeze(1) + self.trans, 0) + emits[t]``): ops that change
    nothing and draw nothing, reading the variables they change (each its value before the step), values
    computed from the counter by the step inputs (the chain: run for every step at once), and what the loop
    does not change (read once, before the loop: attribute and item reads; other ops of those are run with the
    update). None where they read anything else (another variable's value before the step) or call what is not
    read before the loop or a tensor's own method."""
    if not all(_runs_ahead(o) for o in rest):
        return None
    ops = set(rest)
    made = {v for o in rest for v in o.outputs}
    updated = [j for j in range(k) if j != counter and body.outputs[j] in made]
    if rest and not updated:
        return None
    state_params = {params[j] for j in updated}
    counter_param, invariants = params[counter], set(params[k:])
    stepping = {counter_param}  # (the chain's values computed from the counter: a step's own)
    for o in body.ops:
        if o in chain and any(v in stepping for v in o.operands()):
            stepping.update(o.outputs)
    fixed, stepped, seen = [], [], set()
    pending = [v for o in body.ops if o in ops for v in o.operands() if isinstance(v, ir.Value)]
    while pending:
        v = pending.pop(0)
        if v in seen or v in made or v in state_params:
            continue
        seen.add(v)
        if v in stepping:
            stepped.append(v)
        elif v in invariants or v.op in chain and all(_is_read(o) for o in _needed([v], chain)):
            fixed.append(v)
        elif v.op in chain:  # (computed from what the loop does not change: run with the update, at each step)
            ops.add(v.op)
            made.update(v.op.outputs)
            pending.extend(x for x in v.op.operands() if isinstance(x, ir.Value))
        else:
            return None
    for o in ops:
        if isinstance(o, ir.Call) and isinstance(o.fn, ir.Value) and o.fn not in fixed and not _pure_method(o.fn):
            return None
    return updated, ops, fixed, stepped


def _is_append_of(o, lists):
    """Whether op ``o`` is ``xs.append`` (the attribute) of one of ``lists``."""
    method = effects.growing(o)
    return method is not None and method[1] == "append" and method[0] in lists


def _cell_calls(rest, body, state_params, counter):
    """The cell calls among the body's other ops, bottom first, each with its state's form, or None unless those
    ops are the calls alone (``h = cell(x, h)``), or with a built state and its unpacking (``h, c = cell(x,
    (h, c))``), and each call above the first steps over the state the one below made (``h2 = cell2(h1, h2)``)."""
    outputs = body.outputs
    calls = [o for o in rest if isinstance(o, ir.Call) and isinstance(o.fn, ir.Value)]
    layers, accounted, below = [], set(), None
    for call in calls:
        if len(call.args) != 2 or call.kwargs or call.star or len(call.outputs) != 1:
            return None
        if below is not None and call.args[0] is not below:
            return None
        state = call.args[1]
        if state in state_params:
            j = state_params.index(state)
            if j == counter or outputs[j] is not call.output:
                return None
            layers.append((call, ("one", j)))
            accounted.add(call)
            below = call.output
            continue
        build = state.op if isinstance(state, ir.Value) else None
        unpack = next((o for o in rest if _const_fn(o) is intrinsics.unpack and o.args[0] is call.output), None)
        if not (isinstance(build, ir.Call) and _const_fn(build) is intrinsics.build_tuple and len(build.args) == 2
                and all(a in state_params for a in build.args) and unpack is not None and len(unpack.outputs) == 2):
            return None
        h, c = (state_params.index(a) for a in build.args)
        if len({h, c, counter}) != 3 or outputs[h] is not unpack.outputs[0] or outputs[c] is not unpack.outputs[1]:
            return None
        layers.append((call, ("pair", h, c)))
        accounted.update((call, build, unpack))
        below = unpack.outputs[0]
    if not layers or accounted != set(rest):
        return None
    positions = [j for _, form in layers for j in form[1:]]
    if len(set(positions)) != len(positions):
        return None
    # (what a call makes goes to its own state variables and to the cell above, nowhere else)
    made = {v for o in accounted for v in o.outputs}
    for o in accounted:
        for v in o.operands():
            if v in made and not (o is v.op or _feeds(o, v, layers)):
                return None
    return layers


def _feeds(o, v, layers):
    """Whether op ``o`` reads ``v`` as the layers' plumbing: a call's own built state, its result unpacked, or
    the state of the cell below as a cell's input."""
    if _const_fn(o) is intrinsics.unpack:
        return o.args[0] is v and isinstance(v.op, ir.Call) and any(v is call.output for call, _ in layers)
    for k, (call, form) in enumerate(layers):
        if o is call:
            return v is call.args[1] or (k > 0 and v is call.args[0])
    return False


def _const_fn(o):
    return o.fn.value if isinstance(o, ir.Call) and isinstance(o.fn, ir.Const) else None


def _needed(values, chain):
    """The chain ops that ``values`` are computed from, or None if one is not computed by the chain (a
    loop variable) where it is not an invariant given."""
    found, pending = set(), [v for v in values if isinstance(v, ir.Value)]
    while pending:
        v = pending.pop()
        if v.op is None:
            continue  # (a parameter: an invariant, the chain's own inputs)
        if v.op not in chain:
            return None
        if v.op not in found:
            found.add(v.op)
            pending.extend(x for x in v.op.operands() if isinstance(x, ir.Value))
    return found


def _params(ops):
    """The parameters ``ops`` read."""
    return {x for o in ops for x in o.operands() if isinstance(x, ir.Value) and x.op is None}


def _pure_method(value):
    """``x.name`` of a tensor method that changes nothing and draws nothing (``x.unsqueeze``, not ``x.add_``)."""
    o = value.op
    if not (isinstance(o, ir.Call) and _const_fn(o) is getattr and isinstance(o.args[1], ir.Const)):
        return False
    return _pure_name(o.args[1].value)


def _pure_name(name):
    """Whether ``name`` is a tensor method's that changes nothing and draws nothing."""
    return (type(name) is str and hasattr(torch.Tensor, name) and not facts.mutating_method(name)
            and name not in facts.DRAWING_METHODS)


def _tensor_method(fn):
    """Whether ``fn`` is a tensor's own method that changes nothing and draws nothing (``self.trans.sum``)."""
    return isinstance(getattr(fn, "__self__", None), torch.Tensor) and _pure_name(getattr(fn, "__name__", None))


def _is_read(o):
    """A capture or an attribute or item read: run once for the loop, before it, as the callables it calls."""
    return isinstance(o, ir.Capture) or (isinstance(o, ir.Call) and _const_fn(o) in _READS)


def _subgraph(name, inputs, ops, outputs, loc):
    """A function SubGraph of copies of ``ops`` (program order), reading ``inputs`` (fresh parameters) and
    returning ``outputs``."""
    sg = ir.SubGraph(name, [], loc)
    fresh = {}
    for v in inputs:
        fresh[v] = ir.Value(v.hint)
        sg.inputs.append(fresh[v])
    for o in ops:
        c = _copy(o)
        c.map_operands(lambda x: fresh.get(x, x) if isinstance(x, ir.Value) else x)
        for old, new in zip(o.outputs, c.outputs):
            fresh[old] = new
        sg.ops.append(c)
    sg.outputs = [fresh.get(v, v) if isinstance(v, ir.Value) else v for v in outputs]
    return sg


def _copy(o):
    """A copy of op ``o`` with outputs of its own (its operands still the original's, to map)."""
    c = object.__new__(type(o))
    c.__dict__.update(o.__dict__)
    for attr in ("args", "kwargs", "loop_vars", "invariants"):
        if attr in c.__dict__:
            c.__dict__[attr] = list(c.__dict__[attr])
    c.outputs = [ir.Value(v.hint, c) for v in o.outputs]
    return c
