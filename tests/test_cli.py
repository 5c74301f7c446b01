"""recompile.cli: ``recompile dump TARGET``, run in this process through ``cli.main`` as ``python -m recompile``
would run it from a temporary directory; and, end to end, ``python -m recompile`` and the ``recompile`` console
script as subprocesses.

The target modules are written into that directory: a package with a plain function and a decorated recursive
function and, beside them, an nn.Module class with a decorated recursive method; and scripts whose top level
prints, parses arguments or exits.
"""

from __future__ import annotations

import ast
import copy
import os
import re
import shutil
import subprocess
import sys

import pytest

from recompile import cli, program

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


def cli_with_yield(x):
    y = x + 1
    yield y  # L:bad
'''

BAD_DECORATED = '''\
import recompile


@recompile.function
def cli_decorated_yield(x):
    yield x  # L:bad
'''


def line_of(text, mark):
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if line.rstrip().endswith(f"# L:{mark}")]
    assert len(hits) == 1, mark
    return hits[0]


SCRIPT = '''\
import argparse
import sys

import recompile

print("script top level")
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
ARGS = parser.parse_args()  # at import: dump's own arguments would be refused here


@recompile.function
def script_rec(n):
    if n <= 0:
        return ARGS.epochs
    return script_rec(n - 1) + n


if __name__ == "__main__":
    print("script main block")
    parser.parse_args(["--no-such-flag"])
    sys.exit(3)
'''

EXITS = '''\
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("data")
ARGS = parser.parse_args()


def exits_plain(x):
    return x
'''

MODELS_FILE = "clipkg/cli_models.py"
NN_FILE = "clipkg/cli_nn.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "clipkg").mkdir()
    (root / "clipkg" / "__init__.py").write_text("")
    (root / MODELS_FILE).write_text(MODELS)
    (root / NN_FILE).write_text(NN_MODELS)
    (root / "cli_bad.py").write_text(BAD)
    (root / "cli_bad_decorated.py").write_text(BAD_DECORATED)
    (root / "cli_script.py").write_text(SCRIPT)
    (root / "cli_exits.py").write_text(EXITS)
    return root


@pytest.fixture
def dump(root, monkeypatch, capsysbinary):
    """``dump(*args)``: the CompletedProcess of ``python -m recompile dump ARGS`` run from ``root``, run here.

    Each run imports its target anew and names SubGraphs as a fresh process would (IR names are unique per
    process: a second import of a file would give ``cli_rec#2``); the modules it imported are dropped after.
    """
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))  # `python -m` puts the working directory first; sys.path is restored
    names = copy.deepcopy(program._ir_names)
    before = set(sys.modules)

    def run(*args):
        monkeypatch.setattr(program, "_ir_names", copy.deepcopy(names))
        try:
            code = cli.main(["dump", *args])
            message = ""
        except SystemExit as exc:  # as the interpreter reports it: a message goes to stderr, with status 1
            code, message = (1, f"{exc.code}\n") if isinstance(exc.code, str) else (exc.code, "")
        out, err = capsysbinary.readouterr()
        return subprocess.CompletedProcess(args, code, out.decode(errors="replace"),
                                           err.decode(errors="replace") + message)

    yield run
    for name in set(sys.modules) - before:
        if name.startswith(("clipkg", "_recompile_dump_")):
            del sys.modules[name]


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


def test_plain_function_is_compiled_on_the_spot(dump):
    out = ok(dump(f"{MODELS_FILE}:cli_plain"))
    assert out.startswith("# program, entry @cli_plain\n")
    assert f"subgraph @cli_plain(%x, %y):  # cli_models.py:{line_of(MODELS, 'plain')}" in out
    assert "capture global 'CLI_BONUS'" in out
    if_line = line_of(MODELS, "plain_if")
    assert f"subgraph @cli_plain.if{if_line}.then(" in out and f"subgraph @cli_plain.if{if_line}.else(" in out


def test_stage_frontend_and_capture_differ(dump):
    front = ok(dump(f"{MODELS_FILE}:cli_rec", "--stage", "frontend"))
    cap = ok(dump(f"{MODELS_FILE}:cli_rec", "--stage", "capture"))
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


def test_method_stages(dump):
    front = ok(dump(f"{NN_FILE}:CliTree.walk", "--stage", "frontend"))
    cap = ok(dump(f"{NN_FILE}:CliTree.walk"))
    walk = line_of(NN_MODELS, "walk")
    for out in (front, cap):
        assert out.startswith("# program, entry @CliTree.walk\n")
        assert f"subgraph @CliTree.walk(%self, %n):  # cli_nn.py:{walk}" in out
        assert "invoke @CliTree.walk(" in out  # self.walk(...) is the recursion
    assert "call getattr(%self" in front and "capture free 'CLI_BONUS'" in front
    assert "capture attr 'self.k' of %self" in cap and "capture global 'CLI_BONUS'" in cap
    assert "capture attr" not in front and "capture free" not in cap


def test_format_dot(dump):
    out = ok(dump(f"{MODELS_FILE}:cli_rec", "--format", "dot"))
    assert out.startswith("digraph")
    assert out.rstrip().endswith("}")
    assert out.count('subgraph "cluster_') == 3  # the function and its two branches
    assert 'lhead="cluster_cli_rec"' in out  # the recursive call points at the function's cluster


def test_source(dump):
    out = ok(dump(f"{MODELS_FILE}:cli_rec", "--source"))
    assert out.startswith("def ")
    tree = ast.parse(out)
    assert all(isinstance(node, ast.FunctionDef) for node in tree.body) and len(tree.body) == 3
    assert "yield" in out
    assert re.search(rf"yield .*  # cli_models\.py:{line_of(MODELS, 'rec_call')}$", out, re.M)


def test_method_source(dump):
    out = ok(dump(f"{NN_FILE}:CliTree.walk", "--source"))
    assert out.startswith("def CliTree_walk(self, n):")
    assert "yield" in out  # self.walk(...) is a compiled call of the method's own program
    assert "self.k" in out  # the attribute capture
    assert re.search(rf"yield .*  # cli_nn\.py:{line_of(NN_MODELS, 'walk_call')}$", out, re.M)


# ---------------------------------------------------------------------------
# package.module:QUALNAME


def test_package_module_form(dump):
    out = ok(dump("clipkg.cli_models:cli_rec"))
    assert out.startswith("# program, entry @cli_rec\n")
    assert out == ok(dump(f"{MODELS_FILE}:cli_rec", "--stage", "capture"))


# ---------------------------------------------------------------------------
# errors


def test_missing_file(dump):
    err = failed(dump("no_such_file.py:f"))
    assert "no such file" in err and "no_such_file.py" in err


def test_missing_colon(dump):
    err = failed(dump(MODELS_FILE))
    assert "QUALNAME" in err and MODELS_FILE in err


def test_missing_module(dump):
    err = failed(dump("no_such_package_xyz.mod:f"))
    assert "cannot import" in err and "no_such_package_xyz" in err


def test_missing_attribute(dump):
    err = failed(dump(f"{MODELS_FILE}:cli_nope"))
    assert "has no" in err and "cli_nope" in err


def test_not_a_function(dump):
    err = failed(dump("cli_bad.py:NOT_A_FUNCTION"))
    assert "NOT_A_FUNCTION" in err and "not a function" in err


def test_bad_stage_is_a_usage_error(dump):
    err = failed(dump(f"{MODELS_FILE}:cli_rec", "--stage", "bogus"), code=2)
    assert "--stage" in err and "bogus" in err


@pytest.mark.parametrize("target, text", [("cli_bad.py:cli_with_yield", BAD),
                                          ("cli_bad_decorated.py:cli_decorated_yield", BAD_DECORATED)])
def test_compile_error_shows_the_line(dump, target, text):
    proc = dump(target)
    err = failed(proc)
    assert proc.stdout == ""
    lineno = line_of(text, "bad")
    first = err.splitlines()[0]
    assert re.fullmatch(rf"recompile dump: \S*cli_bad\w*\.py:{lineno}:5: yield \(a generator function\) is not "
                        r"supported.*", first), first
    assert "    yield " in err and "# L:bad" in err  # the source line
    assert err.splitlines()[2] == "    ^"  # and a caret under it


# ---------------------------------------------------------------------------
# a script as the target: imported, not run


def test_script_main_block_does_not_run(dump):
    proc = dump("cli_script.py:script_rec", "--stage", "frontend")  # options its own parser would refuse
    out = ok(proc)
    assert out.startswith("# program, entry @script_rec\n")
    assert "script main block" not in out + proc.stderr
    assert "script top level" not in out  # what the top level prints stays out of the dump
    assert "script top level" in proc.stderr
    assert sys.argv[0] != "cli_script.py"  # given back


def test_help_says_the_target_is_imported(dump):
    proc = dump("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "is imported, not run as a script" in text and "the rest of its top level runs" in text


def test_script_that_exits_on_import_is_a_clear_error(dump):
    err = failed(dump("cli_exits.py:exits_plain"))
    assert "importing cli_exits.py ended the program (exit status 2)" in err
    assert 'if __name__ == "__main__":' in err


# ---------------------------------------------------------------------------
# -o, and drawings through Graphviz's dot


def test_output_file(dump, root):
    path = root / "cli_rec.txt"
    assert ok(dump(f"{MODELS_FILE}:cli_rec", "-o", str(path))) == ""
    assert path.read_text() == ok(dump(f"{MODELS_FILE}:cli_rec"))


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_drawing_without_graphviz_says_how_to_install_it(dump, root, monkeypatch, tmp_path, fmt):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` there
    path = root / f"cli_rec.{fmt}"
    proc = dump(f"{MODELS_FILE}:cli_rec", "--format", fmt, "-o", str(path))
    err = failed(proc)
    assert proc.stdout == "" and not path.exists()
    assert f"drawing {fmt} needs Graphviz's `dot`" in err and "apt-get install graphviz" in err
    assert "https://graphviz.org/download/" in err


def fake_dot(directory, body):
    """A `dot` program in ``directory``, a Python script; ``body`` reads ``sys`` (and PATH is set to it alone)."""
    path = directory / "dot"
    path.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    path.chmod(0o755)
    return path


def test_drawing_pipes_the_dot_text_through_dot(dump, root, monkeypatch, tmp_path):
    # a `dot` that writes back its arguments and its input: the drawing is what `dot -Tsvg` made of the DOT text
    fake_dot(tmp_path, 'sys.stdout.write(f"args: {sys.argv[1:]}\\n" + sys.stdin.read())')
    monkeypatch.setenv("PATH", str(tmp_path))
    path = root / "cli_rec_fake.svg"
    assert ok(dump(f"{MODELS_FILE}:cli_rec", "--format", "svg", "-o", str(path))) == ""
    assert path.read_text() == "args: ['-Tsvg']\n" + ok(dump(f"{MODELS_FILE}:cli_rec", "--format", "dot"))


def test_drawing_that_dot_refuses_is_a_clear_error(dump, monkeypatch, tmp_path):
    fake_dot(tmp_path, 'sys.stderr.write("Error: syntax error in line 1\\n"); sys.exit(1)')
    monkeypatch.setenv("PATH", str(tmp_path))
    err = failed(dump(f"{MODELS_FILE}:cli_rec", "--format", "svg", "-o", str(tmp_path / "x.svg")))
    assert "`dot -Tsvg` failed (1): Error: syntax error in line 1" in err


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
@pytest.mark.parametrize("fmt, magic", [("png", b"\x89PNG"), ("svg", b"<?xml")])
def test_drawing_with_graphviz(dump, root, fmt, magic):
    path = root / f"cli_nn.{fmt}"
    ok(dump(f"{NN_FILE}:CliTree.walk", "--format", fmt, "-o", str(path)))
    assert path.read_bytes().startswith(magic)


# ---------------------------------------------------------------------------
# end to end: `python -m recompile` and the console script, as subprocesses (each starts torch: a second or two)


def run_command(argv, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_python_dash_m(dump, root):
    target = f"{MODELS_FILE}:cli_rec"
    assert ok(run_command([sys.executable, "-m", "recompile", "dump", target], root)) == ok(dump(target))


@pytest.mark.slow
def test_console_script(dump, root):
    script = shutil.which("recompile")
    if not script:
        pytest.skip("the `recompile` console script is not on PATH")
    target = f"{MODELS_FILE}:cli_rec"
    assert ok(run_command([script, "dump", target], root)) == ok(dump(target))
