"""recompile.cli: ``python -m recompile dump TARGET`` (and the ``recompile`` console script), run as subprocesses.

The target modules are written into a temporary directory: a package with a
plain function and a decorated recursive function (no torch, so that most runs
are quick) and, beside them, an nn.Module class with a decorated recursive
method. Every command is started once, when the module's fixture first runs;
the tests then check the output of the command they name.
"""

from __future__ import annotations

import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

import pytest

MODELS = '''\
import recompile

CLI_BONUS = 7


def cli_plain(x, y):  # L:plain
    if x > y:  # L:plain_if
        z = x - y
    else:
        z = y - x
    return z + CLI_BONUS


@recompile.function
def cli_rec(n):  # L:rec
    if n <= 0:  # L:rec_if
        return 0
    return cli_rec(n - 1) + n  # L:rec_call
'''

NN_MODELS = '''\
import recompile
from torch import nn

from clipkg.cli_models import CLI_BONUS


class CliTree(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = 3

    @recompile.function
    def walk(self, n):  # L:walk
        if n <= 0:  # L:walk_if
            return self.k + CLI_BONUS
        return self.walk(n - 1) + 1  # L:walk_call
'''

BAD = '''\
NOT_A_FUNCTION = 3


def cli_with_try(x):
    y = x + 1
    try:  # L:try
        y = y * 2
    except ValueError:
        y = 0
    return y
'''

BAD_DECORATED = '''\
import recompile


@recompile.function
def cli_decorated_try(x):
    try:  # L:try
        return x
    finally:
        pass
'''


def line_of(text, mark):
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if line.rstrip().endswith(f"# L:{mark}")]
    assert len(hits) == 1, mark
    return hits[0]


class Runs:
    """Commands run concurrently; ``runs[name]`` waits for that one."""

    def __init__(self, root):
        self.root = root
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self.futures = {}

    def start(self, name, argv, pythonpath=None):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.futures[name] = self.pool.submit(
            subprocess.run, argv, cwd=self.root, env=env, capture_output=True, text=True, timeout=120)

    def __getitem__(self, name):
        return self.futures[name].result()


MODELS_FILE = "clipkg/cli_models.py"
NN_FILE = "clipkg/cli_nn.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "clipkg").mkdir()
    (root / "clipkg" / "__init__.py").write_text("")
    (root / MODELS_FILE).write_text(MODELS)
    (root / NN_FILE).write_text(NN_MODELS)
    (root / "cli_bad.py").write_text(BAD)
    (root / "cli_bad_decorated.py").write_text(BAD_DECORATED)
    r = Runs(root)
    py = [sys.executable, "-m", "recompile", "dump"]
    # fast ones first: they do not import torch
    r.start("missing_file", py + ["no_such_file.py:f"])
    r.start("missing_colon", py + [MODELS_FILE])
    r.start("missing_module", py + ["no_such_package_xyz.mod:f"])
    r.start("try", py + ["cli_bad.py:cli_with_try"])
    r.start("try_decorated", py + ["cli_bad_decorated.py:cli_decorated_try"])
    r.start("not_a_function", py + ["cli_bad.py:NOT_A_FUNCTION"])
    r.start("bad_stage", py + [f"{MODELS_FILE}:cli_rec", "--stage", "bogus"])
    r.start("plain", py + [f"{MODELS_FILE}:cli_plain"])
    r.start("rec_frontend", py + [f"{MODELS_FILE}:cli_rec", "--stage", "frontend"])
    r.start("rec_capture", py + [f"{MODELS_FILE}:cli_rec", "--stage", "capture"])
    r.start("dot", py + [f"{MODELS_FILE}:cli_rec", "--format", "dot"])
    r.start("source", py + [f"{MODELS_FILE}:cli_rec", "--source"])
    r.start("package", py + ["clipkg.cli_models:cli_rec"], pythonpath=str(root))
    r.start("missing_attribute", py + [f"{MODELS_FILE}:cli_nope"])
    r.start("method_frontend", py + [f"{NN_FILE}:CliTree.walk", "--stage", "frontend"])  # these two load torch
    r.start("method_capture", py + [f"{NN_FILE}:CliTree.walk"])
    r.start("method_source", py + [f"{NN_FILE}:CliTree.walk", "--source"])
    script = shutil.which("recompile")
    if script:
        r.start("script", [script, "dump", f"{MODELS_FILE}:cli_rec"])
    r.script = script
    yield r
    r.pool.shutdown(wait=True)


def ok(proc):
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "recompile dump:" not in proc.stderr, proc.stderr
    return proc.stdout


def failed(proc, code=1):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


# ---------------------------------------------------------------------------
# FILE.py:QUALNAME


def test_plain_function_is_compiled_on_the_spot(runs):
    out = ok(runs["plain"])
    assert out.startswith("# program, entry @cli_plain\n")
    assert f"subgraph @cli_plain(%x, %y):  # cli_models.py:{line_of(MODELS, 'plain')}" in out
    assert "capture global 'CLI_BONUS'" in out
    if_line = line_of(MODELS, "plain_if")
    assert f"subgraph @cli_plain.if{if_line}.then(" in out and f"subgraph @cli_plain.if{if_line}.else(" in out


def test_stage_frontend_and_capture_differ(runs):
    front, cap = ok(runs["rec_frontend"]), ok(runs["rec_capture"])
    assert front != cap
    if_line = line_of(MODELS, "rec_if")
    # frontend: branches take no inputs and read the parent's %n directly; capture: %n is passed in
    assert f"subgraph @cli_rec.if{if_line}.else():" in front
    assert re.search(rf"subgraph @cli_rec\.if{if_line}\.else\(%n\.\d+\):", cap)
    assert re.search(r"cond %\S+ then @\S+ else @\S+\(\)", front)
    assert re.search(r"cond %\S+ then @\S+ else @\S+\(%n\)", cap)
    call = line_of(MODELS, "rec_call")
    assert re.search(rf"= invoke @cli_rec\(%\S+\)  # cli_models\.py:{call}", front)
    assert re.search(rf"= invoke @cli_rec\(%\S+\)  # cli_models\.py:{call}", cap)
    # the same ops: only the branch inputs and the cond arguments differ
    def ops(text):  # op lines with value names blanked, without headers and the cond
        return [re.sub(r"%[\w.]+", "%", line) for line in text.splitlines()
                if not line.startswith("subgraph") and " = cond " not in line]

    assert ops(front) == ops(cap)


def test_method_stages(runs):
    front, cap = ok(runs["method_frontend"]), ok(runs["method_capture"])
    walk = line_of(NN_MODELS, "walk")
    for out in (front, cap):
        assert out.startswith("# program, entry @CliTree.walk\n")
        assert f"subgraph @CliTree.walk(%self, %n):  # cli_nn.py:{walk}" in out
        assert f"invoke @CliTree.walk(" in out  # self.walk(...) is the recursion
    assert "call getattr(%self" in front and "capture free 'CLI_BONUS'" in front
    assert "capture attr 'self.k' of %self" in cap and "capture global 'CLI_BONUS'" in cap
    assert "capture attr" not in front and "capture free" not in cap


def test_format_dot(runs):
    out = ok(runs["dot"])
    assert out.startswith("digraph")
    assert out.rstrip().endswith("}")
    assert out.count('subgraph "cluster_') == 3  # the function and its two branches
    assert 'lhead="cluster_cli_rec"' in out  # the recursive call points at the function's cluster


def test_source(runs):
    out = ok(runs["source"])
    assert out.startswith("def ")
    tree = ast.parse(out)
    assert all(isinstance(node, ast.FunctionDef) for node in tree.body) and len(tree.body) == 3
    assert "yield" in out
    assert re.search(rf"yield .*  # cli_models\.py:{line_of(MODELS, 'rec_call')}$", out, re.M)


def test_method_source(runs):
    out = ok(runs["method_source"])
    assert out.startswith("def CliTree_walk(self, n):")
    assert "yield" in out  # self.walk(...) is a compiled call of the method's own program
    assert "self.k" in out  # the attribute capture
    assert re.search(rf"yield .*  # cli_nn\.py:{line_of(NN_MODELS, 'walk_call')}$", out, re.M)


# ---------------------------------------------------------------------------
# package.module:QUALNAME


def test_package_module_form(runs):
    out = ok(runs["package"])
    assert out.startswith("# program, entry @cli_rec\n")
    assert out == ok(runs["rec_capture"])


# ---------------------------------------------------------------------------
# errors


def test_missing_file(runs):
    err = failed(runs["missing_file"])
    assert "no such file" in err and "no_such_file.py" in err


def test_missing_colon(runs):
    err = failed(runs["missing_colon"])
    assert "QUALNAME" in err and MODELS_FILE in err


def test_missing_module(runs):
    err = failed(runs["missing_module"])
    assert "cannot import" in err and "no_such_package_xyz" in err


def test_missing_attribute(runs):
    err = failed(runs["missing_attribute"])
    assert "has no" in err and "cli_nope" in err


def test_not_a_function(runs):
    err = failed(runs["not_a_function"])
    assert "NOT_A_FUNCTION" in err and "not a function" in err


def test_bad_stage_is_a_usage_error(runs):
    err = failed(runs["bad_stage"], code=2)
    assert "--stage" in err and "bogus" in err


@pytest.mark.parametrize("name, text", [("try", BAD), ("try_decorated", BAD_DECORATED)])
def test_compile_error_shows_the_line(runs, name, text):
    proc = runs[name]
    err = failed(proc)
    assert proc.stdout == ""
    lineno = line_of(text, "try")
    first = err.splitlines()[0]
    assert re.fullmatch(rf"recompile dump: \S*cli_bad\w*\.py:{lineno}:5: try/except/finally is not supported.*",
                        first), first
    assert "    try:  # L:try" in err  # the source line
    assert err.splitlines()[2] == "    ^"  # and a caret under it


# ---------------------------------------------------------------------------
# the console script


def test_console_script(runs):
    if not runs.script:
        pytest.skip("the `recompile` console script is not on PATH")
    assert ok(runs["script"]) == ok(runs["rec_capture"])
