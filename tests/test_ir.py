"""recompile.ir: the text printer, the DOT printer and ``ir.clone``.

The functions compiled here live in this file; every expected line number is
read from a ``# L:<name>`` marker on the line, never hard-coded.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import recompile
from recompile import ir
from source_lines import marker, source_range  # tests/ is on sys.path under pytest

HERE = os.path.basename(__file__)
IR_SCALE = 3




# ---------------------------------------------------------------------------
# functions under test


def ir_plain(x, y):  # L:def
    z = x + y  # L:z
    w = z * 2  # L:w
    return w


@recompile.function
def ir_tree_count(left, right, i):  # L:def
    if left[i] < 0:  # L:if
        return 1
    a = ir_tree_count(left, right, left[i])  # L:a
    b = ir_tree_count(left, right, right[i])  # L:b
    return a + b + IR_SCALE  # L:ret


def ir_tree_count_plain(left, right, i):
    if left[i] < 0:
        return 1
    return ir_tree_count_plain(left, right, left[i]) + ir_tree_count_plain(left, right, right[i]) + IR_SCALE


def ir_loop(xs, k):  # L:def
    total = 0
    for x in xs:  # L:for
        if x > k:  # L:if
            total = total + x  # L:add
    return total


@recompile.function
def ir_even(n):  # L:def
    if n == 0:
        return True
    return ir_odd(n - 1)  # L:call


@recompile.function
def ir_odd(n):  # L:def
    if n == 0:
        return False
    return ir_even(n - 1)  # L:call


def ir_quotes(x):
    s = x + 'say "hi" \\ back'
    return s


LEFT = [1, 3, -1, -1, -1]
RIGHT = [2, 4, -1, -1, -1]


# ---------------------------------------------------------------------------
# text printer


def test_text_exact_for_straight_line_function():
    f = recompile.function(ir_plain)
    d = marker(ir_plain, "def")
    expected = (
        f"# program, entry @{f.ir_name}\n"
        "\n"
        f"subgraph @{f.ir_name}(%x, %y):  # {HERE}:{d}\n"
        f"  %z = call add(%x, %y)  # {HERE}:{marker(ir_plain, 'z')}\n"
        f"  %w = call mul(%z, 2)  # {HERE}:{marker(ir_plain, 'w')}\n"
        "  return %w\n"
    )
    assert f.dump(stage="capture") == expected
    assert f.dump(stage="frontend") == expected  # nothing to capture
    assert f(2, 5) == ir_plain(2, 5)


def _op_lines(text):
    return [line for line in text.splitlines() if line.startswith("  ") and not line.startswith("  return")]


@pytest.mark.parametrize("stage", recompile.STAGES)
def test_text_one_op_per_line_with_location(stage):
    f = ir_tree_count
    program = f.program(stage)
    text = f.dump(stage=stage)
    fused = [op.body for sg in program.all_subgraphs() for op in sg.ops if isinstance(op, ir.Fused)]
    n_ops = sum(len(sg.ops) for sg in [*program.all_subgraphs(), *fused])
    ops = _op_lines(text)
    assert len(ops) == n_ops
    lines = source_range(f)
    for line in ops:
        m = re.fullmatch(r"  (?:(%[\w.]+(?:, %[\w.]+)*) = )?(call|invoke|cond|while|capture|fused\[python\]) .*  # (\S+):(\d+)", line)
        assert m, line
        assert m.group(3) == HERE
        assert int(m.group(4)) in lines, line
    # one `return` per SubGraph, one header per SubGraph
    n_sgs = len(list(program.all_subgraphs())) + len(fused)
    assert sum(line.startswith("  return") for line in text.splitlines()) == n_sgs
    assert sum(line.startswith("subgraph @") for line in text.splitlines()) == n_sgs


def test_text_subgraph_headers():
    f = ir_tree_count
    program = f.program("capture")
    text = f.dump(stage="capture")
    headers = [line for line in text.splitlines() if line.startswith("subgraph @")]
    assert [h.split("(")[0] for h in headers] == [f"subgraph @{sg.name}" for sg in program.all_subgraphs()]
    assert headers[0] == f"subgraph @{f.ir_name}(%left, %right, %i):  # {HERE}:{marker(f, 'def')}"
    if_line = marker(f, "if")
    branch_headers = headers[1:]
    assert len(branch_headers) == 2
    assert branch_headers[0].startswith(f"subgraph @{f.ir_name}.if{if_line}.then(")
    assert branch_headers[1].startswith(f"subgraph @{f.ir_name}.if{if_line}.else(")
    for h in branch_headers:
        assert h.endswith(f"):  # {HERE}:{if_line}")
    assert text.startswith(f"# program, entry @{f.ir_name}\n\nsubgraph @")


def test_text_invoke_lines_name_callee_and_call_site():
    f = ir_tree_count
    text = f.dump()
    invokes = [line for line in text.splitlines() if " = invoke @" in line]
    assert len(invokes) == 2
    for line, mark in zip(invokes, ("a", "b")):
        assert f"invoke @{f.ir_name}(" in line
        assert line.endswith(f"  # {HERE}:{marker(f, mark)}")
    # the recursion reads the compiled function: Invoke ops, no Call of it
    assert "call ir_tree_count" not in text
    assert f(LEFT, RIGHT, 0) == ir_tree_count_plain(LEFT, RIGHT, 0)


def test_text_names_values_uniquely():
    text = ir_tree_count.dump()
    defined = []
    for line in text.splitlines():
        m = re.match(r"  (%[\w.]+(?:, %[\w.]+)*) = ", line)
        if m:
            defined += m.group(1).split(", ")
        m = re.match(r"subgraph @\S+\((.*)\):", line)
        if m and m.group(1):
            defined += m.group(1).split(", ")
    assert len(defined) == len(set(defined))
    for name in defined:
        assert re.fullmatch(r"%[A-Za-z_]\w*(\.\d+)?", name), name
    # every %name used (after capture) is defined somewhere in the program text
    used = set(re.findall(r"%[A-Za-z_]\w*(?:\.\d+)?", text))
    assert used <= set(defined)
    # readable names: the parameters and the captured global keep their names
    assert "%left" in defined and "%i" in defined and "%IR_SCALE" in defined


def test_text_capture_global_line():
    f = ir_tree_count
    ret = marker(f, "ret")
    assert f"%IR_SCALE = capture global 'IR_SCALE'  # {HERE}:{ret}" in f.dump(stage="capture")
    assert f"%IR_SCALE = capture free 'IR_SCALE'  # {HERE}:{ret}" in f.dump(stage="frontend")


def test_text_while_line():
    f = recompile.function(ir_loop)
    text = f.dump()
    loops = [line for line in text.splitlines() if re.match(r"  .* = while @", line)]
    assert len(loops) == 1
    for_line = marker(ir_loop, "for")
    assert re.fullmatch(
        rf"  %\S+(, %\S+)* = while @{re.escape(f.ir_name)}\.while{for_line}\.cond "
        rf"do @{re.escape(f.ir_name)}\.while{for_line}\.body\(.*\)  # {re.escape(HERE)}:{for_line}", loops[0])
    assert "; invariant " in loops[0]  # after capture the loop gets the values it reads as invariants
    assert "; invariant " not in f.dump(stage="frontend")
    add = [line for line in text.splitlines() if "call add(%total" in line]
    assert len(add) == 1 and add[0].endswith(f"# {HERE}:{marker(ir_loop, 'add')}")
    assert f([1, 5, 7], 4) == ir_loop([1, 5, 7], 4)


def test_program_to_text_matches_dump():
    program = ir_tree_count.program("capture")
    assert program.to_text() == ir_tree_count.dump(stage="capture")
    assert ir.format_program(program) == program.to_text()
    assert program.to_dot() == ir_tree_count.dump(stage="capture", format="dot")


# ---------------------------------------------------------------------------
# DOT printer

_QUOTED = r'"(?:[^"\\]|\\.)*"'
_DOT_LINE = [
    ("open", re.compile(r"digraph recompile \{")),
    ("attr", re.compile(r"  rankdir=TB;")),
    ("attr", re.compile(r"  compound=true;")),
    ("attr", re.compile(r"  node \[shape=box, fontname=monospace, fontsize=10\];")),
    ("cluster", re.compile(rf"  subgraph ({_QUOTED}) \{{")),
    ("label", re.compile(rf"    label={_QUOTED};")),
    ("node", re.compile(rf"    (n\d+) \[label={_QUOTED}, shape=(box|ellipse)\];")),
    ("edge", re.compile(r"  (n\d+) -> (n\d+);")),
    ("across", re.compile(r"  (n\d+) -> (n\d+) \[constraint=false\];")),
    ("dashed", re.compile(rf"  (n\d+) -> (n\d+) \[style=dashed, constraint=false, lhead=({_QUOTED})\];")),
    ("order", re.compile(r"  (n\d+) -> (n\d+) \[style=invis(, weight=10)?\];")),
    ("close", re.compile(r"(  )?\}")),
]


def parse_dot_layout(text):
    """Check every line against the grammar the printer uses; return clusters, nodes, edges.

    Data edges are ``edges`` (within a cluster) and ``across`` (a branch reading its parent's value: they move
    nothing); ``order`` holds the invisible edges of the layout, (from, to, within one cluster)."""
    lines = text.splitlines()
    assert lines[0] == "digraph recompile {"
    assert lines[-1] == "}" and text.endswith("}\n")
    clusters = {}  # name -> [node ids]
    labels = {}
    edges, dashed, across, order = [], [], [], []
    current = None
    depth = 0
    for line in lines:
        for kind, rx in _DOT_LINE:
            m = rx.fullmatch(line)
            if m:
                break
        else:
            raise AssertionError(f"unexpected DOT line: {line!r}")
        if kind in ("open", "cluster"):
            depth += 1
        if kind == "close":
            depth -= 1
            current = None
            assert depth >= 0
        if kind == "cluster":
            name = m.group(1)[1:-1]
            assert name.startswith("cluster_")
            assert name not in clusters
            clusters[name] = []
            current = name
        elif kind == "node":
            assert current is not None, "node outside a cluster"
            clusters[current].append(m.group(1))
            labels[m.group(1)] = line.split('label="', 1)[1].rsplit('", shape=', 1)[0]
        elif kind == "edge":
            edges.append((m.group(1), m.group(2)))
        elif kind == "across":
            across.append((m.group(1), m.group(2)))
        elif kind == "dashed":
            dashed.append((m.group(1), m.group(2), m.group(3)[1:-1]))
        elif kind == "order":
            order.append((m.group(1), m.group(2), m.group(3) is not None))
    assert depth == 0
    for a, b in edges + across + [(a, b) for a, b, _ in dashed] + [(a, b) for a, b, _ in order]:
        assert a in labels and b in labels, (a, b)
    return clusters, labels, edges, dashed, across, order


def parse_dot(text):
    """(clusters, labels, edges, dashed): what the drawing says, the layout's edges left out."""
    return parse_dot_layout(text)[:4]


@pytest.mark.parametrize("stage", recompile.STAGES)
def test_dot_one_cluster_per_subgraph(stage):
    f = ir_tree_count
    program = f.program(stage)
    text = f.dump(stage=stage, format="dot")
    assert text.startswith("digraph")
    clusters, labels, edges, dashed = parse_dot(text)
    names = [sg.name for sg in program.all_subgraphs()]
    assert text.count('subgraph "cluster_') == len(names)
    assert list(clusters) == [f"cluster_{n}" for n in names]
    # one node per op plus inputs and return per cluster
    for sg in program.all_subgraphs():
        ids = clusters[f"cluster_{sg.name}"]
        assert len(ids) == len(sg.ops) + 2
        assert labels[ids[0]].startswith("inputs(")
        assert labels[ids[-1]].startswith("return")
    assert edges  # data edges exist


def test_dot_invoke_has_dashed_edge_to_callee_cluster():
    f = ir_tree_count
    clusters, labels, edges, dashed = parse_dot(f.dump(format="dot"))
    invoke_nodes = [n for n, label in labels.items() if f"invoke @{f.ir_name}(" in label]
    assert len(invoke_nodes) == 2
    entry = clusters[f"cluster_{f.ir_name}"][0]
    for n in invoke_nodes:
        assert (n, entry, f"cluster_{f.ir_name}") in dashed
    # the Cond points at both of its branch clusters
    cond = [n for n, label in labels.items() if " = cond " in label]
    assert len(cond) == 1
    targets = {lhead for src, _, lhead in dashed if src == cond[0]}
    assert targets == {c for c in clusters if ".if" in c}


def test_dot_mutual_recursion_crosses_functions():
    program = ir_even.program()
    assert set(program.subgraphs) == {ir_even.ir_name, ir_odd.ir_name}
    clusters, labels, edges, dashed = parse_dot(ir_even.dump(format="dot"))
    assert f"cluster_{ir_even.ir_name}" in clusters and f"cluster_{ir_odd.ir_name}" in clusters
    to_odd = [d for d in dashed if d[2] == f"cluster_{ir_odd.ir_name}"]
    to_even = [d for d in dashed if d[2] == f"cluster_{ir_even.ir_name}"]
    assert len(to_odd) == 1 and len(to_even) == 1
    assert "invoke @" + ir_odd.ir_name in labels[to_odd[0][0]]
    assert to_odd[0][1] == clusters[f"cluster_{ir_odd.ir_name}"][0]
    assert ir_even(7) is False and ir_even(10) is True


def test_dot_escapes_quotes_and_backslashes():
    f = recompile.function(ir_quotes)
    text = f.dump(format="dot")
    parse_dot(text)  # every label is one well-formed quoted string
    assert '\\"hi\\"' in text
    assert f("x") == ir_quotes("x")


@pytest.mark.parametrize("stage", recompile.STAGES)
def test_dot_layout_is_one_column_per_cluster_stacked_top_to_bottom(stage):
    text = ir_tree_count.dump(stage=stage, format="dot")
    assert "  rankdir=TB;" in text.splitlines()
    clusters, labels, edges, dashed, across, order = parse_dot_layout(text)
    cluster_of = {n: c for c, ids in clusters.items() for n in ids}
    columns = list(clusters.values())
    # within a cluster, each node is held under the one before it, in program order
    within = {(a, b) for a, b, weighted in order if weighted}
    assert within == {(a, b) for ids in columns for a, b in zip(ids, ids[1:])}
    # each cluster's return is held above the next cluster's inputs: the stack follows the text dump
    between = [(a, b) for a, b, weighted in order if not weighted]
    assert between == [(ids[-1], nxt[0]) for ids, nxt in zip(columns, columns[1:])]
    # call edges and a branch's reads of its parent's values are drawn, but move nothing (recursion points up)
    assert dashed and all("[style=dashed, constraint=false, lhead=" in line
                          for line in text.splitlines() if "style=dashed" in line)
    assert all(cluster_of[a] == cluster_of[b] for a, b in edges)
    assert all(cluster_of[a] != cluster_of[b] for a, b in across)
    if stage == "frontend":  # branches read the function's %left, %right, %i directly before capture
        assert across


def test_dot_long_label_is_wrapped_left_aligned():
    # the grad stage's record of saved values is one long tuple: unwrapped, it set the width of the drawing
    text = ir_tree_count.dump(stage="grad", format="dot")
    dumped = [line.strip() for line in ir_tree_count.dump(stage="grad").splitlines()]
    labels = parse_dot(text)[1]
    wrapped = [label for label in labels.values() if "\\l" in label and " fused[" not in label]
    assert any(label.count("\\l") > 2 for label in wrapped)
    for label in wrapped:
        lines = label.split("\\l")
        assert lines[-1] == ""  # ends with \l: the last line is left-aligned as well
        assert all(len(line) <= 110 for line in lines)
        assert all(line.startswith("    ") for line in lines[1:-1])
        assert "".join(line.strip() + (" " if line.endswith(",") else "") for line in lines) in dumped


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
@pytest.mark.parametrize("fn", ["ir_tree_count", "ir_even", "ir_loop", "ir_quotes"])
def test_dot_renders_with_graphviz(fn, tmp_path):
    f = globals()[fn]
    f = f if isinstance(f, recompile.CompiledFunction) else recompile.function(f)
    for stage in recompile.STAGES:
        path = tmp_path / f"{fn}_{stage}.dot"
        path.write_text(f.dump(stage=stage, format="dot"))
        proc = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "<svg" in proc.stdout


# ---------------------------------------------------------------------------
# clone


def _values(sg):
    out = []
    for s in sg.walk():
        out += s.inputs
        for op in s.ops:
            out += op.outputs
    return out


def _repr_dump(sg):
    """A dump that shows every Value with its id (Value.__repr__)."""
    lines = []
    for s in sg.walk():
        lines.append(f"{s.name} {s.kind} {s.inputs!r} -> {s.outputs!r}")
        for op in s.ops:
            lines.append(f"  {type(op).__name__} {op.outputs!r} <- {op.operands()!r}")
    return "\n".join(lines)


@pytest.mark.parametrize("stage", recompile.STAGES)
def test_clone_same_text_new_values(stage):
    program = ir_tree_count.program(stage)
    sg = program.subgraphs[program.entry]
    before = ir.format_subgraph(sg)
    c = ir.clone(sg)
    assert ir.format_subgraph(c) == before
    assert ir.format_subgraph(sg) == before  # the original is untouched
    # same structure ...
    assert [s.name for s in c.walk()] == [s.name for s in sg.walk()]
    assert [s.kind for s in c.walk()] == [s.kind for s in sg.walk()]
    for a, b in zip(c.walk(), sg.walk()):
        assert a is not b
        assert [type(op) for op in a.ops] == [type(op) for op in b.ops]
        assert [o is p for o, p in zip(a.ops, b.ops)] == [False] * len(b.ops)
        assert len(a.inputs) == len(b.inputs) and len(a.outputs) == len(b.outputs)
        assert [op.loc for op in a.ops] == [op.loc for op in b.ops]
        for op in a.ops:
            for v in op.outputs:
                assert v.op is op
    # ... with new Values only
    old, new = _values(sg), _values(c)
    assert len(old) == len(new)
    assert not set(map(id, old)) & set(map(id, new))
    # the same printed text modulo value ids
    r_old, r_new = _repr_dump(sg), _repr_dump(c)
    assert r_old != r_new
    strip = lambda s: re.sub(r"(%\w*)\.\d+", r"\1.ID", s)  # noqa: E731
    assert strip(r_old) == strip(r_new)


def test_clone_is_independent_of_the_original():
    sg = ir_tree_count.program("frontend").subgraphs[ir_tree_count.ir_name]
    before = ir.format_subgraph(sg)
    c = ir.clone(sg)
    c.ops.append(ir.Call(None, ir.Const(len), [c.inputs[0]]))
    c.ops[-1].outputs[0].hint = "extra"
    branch = next(op for op in c.ops if isinstance(op, ir.Cond)).then_sg
    branch.inputs.append(ir.Value("extra_in"))
    assert ir.format_subgraph(sg) == before
    assert "%extra" in ir.format_subgraph(c)


def test_clone_keeps_free_values_unless_mapped():
    sg = ir_tree_count.program("frontend").subgraphs[ir_tree_count.ir_name]
    cond = next(op for op in sg.ops if isinstance(op, ir.Cond))
    branch = cond.else_sg
    from recompile.passes.capture import free_values

    free = free_values(branch)
    assert free  # a frontend branch reads its parent's values
    kept = ir.clone(branch)
    assert free_values(kept) == free  # the very same outer Values
    fresh = {v: ir.Value(v.hint) for v in free}
    mapped = ir.clone(branch, dict(fresh))
    assert free_values(mapped) == [fresh[v] for v in free]


def test_clone_keeps_is_self_of_method_inputs():
    import torch.nn as nn

    class IrNode(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 2

        @recompile.function
        def depth(self, n):
            if n <= 0:
                return self.k
            return self.depth(n - 1) + 1

    m = IrNode()
    assert m.depth(3) == 5
    sg = IrNode.depth.program("frontend").subgraphs[IrNode.depth.ir_name]
    assert sg.inputs[0].is_self and not sg.inputs[1].is_self
    c = ir.clone(sg)
    assert c.inputs[0].is_self and not c.inputs[1].is_self
    assert c.inputs[0] is not sg.inputs[0]
