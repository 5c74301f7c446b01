"""The package's layers, read from its source (an ast walk over ``recompile/``).

Each stage imports only from earlier stages or from the shared layers beneath all of them, no two modules
import each other (directly or around a cycle, lazy imports inside functions included), and no module
reads another's private names. The floors, highest first (a module may import its own package and any
lower floor):

    cli, vmap  ->  api  ->  program  ->  codegen  ->  passes, runtime  ->  frontend, autodiff
    ->  ir, ops, graphviz, debugging  ->  intrinsics, naming, errors, config, data, dynamo, pickling,
    diagnostics

``recompile/__init__.py`` (the public names) and ``__main__.py`` stand above them all.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "recompile"
FLOORS = [
    {"intrinsics", "naming", "errors", "config", "data", "dynamo", "pickling", "diagnostics"},
    {"ir", "ops", "graphviz", "debugging"},
    {"frontend", "autodiff"},
    {"passes", "runtime"},
    {"codegen"},
    {"program"},
    {"api"},
    {"cli", "vmap"},
]
FLOOR = {part: k for k, parts in enumerate(FLOORS) for part in parts}
TOP = {"recompile", "recompile.__main__"}  # the package's face: above every floor
# private attributes of torch's (and Python's: a namedtuple's _fields and _make, sys._getframe) read on purpose
FOREIGN_PRIVATE = {"_fields", "_make", "_getframe", "_C", "_autograd", "_get_current_graph_task_keep_graph", "_base",
                   "_is_view", "_version", "_current_graph_task_id", "_forward_hooks", "_forward_pre_hooks",
                   "_backward_hooks", "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                   "_backward_pre_hooks", "_global_backward_pre_hooks", "_parameters",
                   # torch's switch of vmap's silent loop over an op it has no batching rule for (batch_rules)
                   "_functorch", "_is_vmap_fallback_enabled", "_set_vmap_fallback_enabled",
                   # torch's saved-tensor hooks: whether they may be set, the caller's own, the node a backward
                   # runs and the order nodes were made in (runtime.saved_versions)
                   "_saved_tensors_hooks_is_enabled", "_top_saved_tensors_default_hooks", "_current_autograd_node",
                   "_get_sequence_nr", "_sequence_nr"}


def _modules():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text(), str(path)), parts[-1] == "__init__")
    return found


MODULES = _modules()


def _package(name, is_package):
    return name if is_package else name.rpartition(".")[0]


def _imports(name):
    """(line, imported module, names imported from it) of each import in module ``name``, anywhere in it."""
    path, tree, is_package = MODULES[name]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "recompile")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name, is_package).split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "recompile":
                continue
            names = [a.name for a in node.names]
            others = [n for n in names if f"{target}.{n}" not in MODULES]  # (not submodules: names in target)
            if others:
                out.append((node.lineno, target, others))
            out.extend((node.lineno, f"{target}.{n}", ()) for n in names if f"{target}.{n}" in MODULES)
    return out


def _none(found):
    """Fail with every finding listed, one a line."""
    if found:
        raise AssertionError("\n".join(found))


def _part(name):
    """The floor part a module belongs to: ``recompile.runtime.agenda`` -> ``runtime``."""
    return name.split(".")[1] if name.count(".") else name


def test_every_module_has_a_floor():
    assert sorted({_part(m) for m in MODULES if m not in TOP} - set(FLOOR)) == []


def test_no_import_against_the_floors():
    wrong = []
    for name in MODULES:
        if name in TOP:
            continue
        mine = _part(name)
        for line, target, _ in _imports(name):
            theirs = _part(target)
            if target in TOP or (theirs != mine and FLOOR[theirs] >= FLOOR[mine]):
                wrong.append(f"{name}:{line} imports {target}")
    _none(wrong)


def test_no_cycle_between_modules():
    edges = {name: {t for _, t, _ in _imports(name) if t in MODULES and t != name} for name in MODULES}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    _none(cycles)


def _defined_names(tree):
    """Every name a module defines or binds: its functions and classes, the names and attributes it assigns,
    the parameters, the ``__slots__`` of its classes, the attributes it sets by name (``setattr``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Assign) and any(getattr(x, "id", None) == "__slots__" for x in node.targets):
            names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
        elif _call_of(node, "setattr") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            names.add(node.args[1].value)
    return names


def _call_of(node, fn):
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == fn


def _attribute_reads(tree):
    """(line, base, name) of each attribute a module reads: ``x.name``, and ``getattr(x, "name")`` /
    ``hasattr(x, "name")`` (base None)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            yield node.lineno, node.value, node.attr
        elif (_call_of(node, "getattr") or _call_of(node, "hasattr")) and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            yield node.lineno, None, node.args[1].value


def _module_names(name, tree):
    """The names module ``name`` binds to modules of recompile's (``from ..runtime import batch as bt``)."""
    imported = {target for _, target, _ in _imports(name)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(a.asname or a.name for a in node.names
                         if any(t.endswith("." + a.name) for t in imported))
        elif isinstance(node, ast.Import):
            found.update((a.asname or a.name) for a in node.names if a.name.split(".")[0] == "recompile")
    return found


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reads_another_modules_private_names():
    wrong = []
    for name, (path, tree, _) in MODULES.items():
        for line, target, names in _imports(name):
            wrong.extend(f"{name}:{line} imports {target}.{n}" for n in names if _private(n) and target != name)
        modules_here = _module_names(name, tree)
        own = _defined_names(tree)
        for line, base, attr in _attribute_reads(tree):
            if not _private(attr) or attr in own:
                continue
            if isinstance(base, ast.Name) and base.id in modules_here:
                wrong.append(f"{name}:{line} reads {base.id}.{attr}")
            elif attr not in FOREIGN_PRIVATE:
                wrong.append(f"{name}:{line} reads .{attr}, which it does not define")
    _none(sorted(set(wrong)))


@pytest.mark.parametrize("source, bad", [
    ("from ..runtime import batch_rules\n", "recompile.passes.fusion:1 imports recompile.runtime.batch_rules"),
    ("from ..api import CompiledFunction\n", "recompile.passes.fusion:1 imports recompile.api"),
])
def test_an_import_against_the_floors_is_seen(source, bad, monkeypatch):
    path, _, is_package = MODULES["recompile.passes.fusion"]
    monkeypatch.setitem(MODULES, "recompile.passes.fusion", (path, ast.parse(source), is_package))
    with pytest.raises(AssertionError) as info:
        test_no_import_against_the_floors()
    assert bad in str(info.value)


def test_a_cycle_and_a_private_read_are_seen(monkeypatch):
    path, _, is_package = MODULES["recompile.ir"]
    monkeypatch.setitem(MODULES, "recompile.ir", (path, ast.parse("from . import naming\n"), is_package))
    path, _, is_package = MODULES["recompile.naming"]
    monkeypatch.setitem(MODULES, "recompile.naming", (path, ast.parse(
        "from . import ir\nfrom .ir import _Printed\nx = ir._Printed\ny = getattr(x, '_names', None)\n"), is_package))
    with pytest.raises(AssertionError, match="recompile.ir -> recompile.naming -> recompile.ir"):
        test_no_cycle_between_modules()
    with pytest.raises(AssertionError) as info:
        test_no_module_reads_another_modules_private_names()
    assert "imports recompile.ir._Printed" in str(info.value) and "reads ir._Printed" in str(info.value)
    assert "reads ._names, which it does not define" in str(info.value)
