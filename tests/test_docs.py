"""The documentation runs, and names every public thing.

Every ```python block of README.md and docs/*.md runs, and what it prints is what the page says; every
relative link goes to a file (and heading) that exists; every ``recompile dump`` command a page shows runs
and prints what the page shows; docs/design.md lists every module of the package; docs/api.md has an entry
for every public name.

How a page's code runs (the convention to follow when writing docs):

- The ```python blocks of one page run in order, in one namespace, like the cells of a notebook: a block may
  use what an earlier block of the same page defined. Each page runs in a process of its own, as a user's
  script would (forked from one that imported torch and recompile once), with ``torch.manual_seed(0)`` and
  an empty temporary directory as the working directory. (A process of its own: the names in generated code
  and in ``f.stats["batches"]`` depend on what the process compiled before.)
- Each block is written to a file of its own in that directory (named after the page and the block's first
  line, such as ``README.md-57.py``), after blank lines, so that its lines keep their numbers in the page: a
  traceback's ``line 60`` is line 60 of the page. recompile reads a function's source from its file, as it
  does for any user's module.
- A line ``print(...)  # expected`` checks what that print writes, without the final newline, against the
  comment: they must be equal, where ``...`` stands for any text, line breaks included (as doctest's
  ELLIPSIS): ``print(loss)  # tensor(0.6..., grad_fn=<...>)``. A print with such a comment that never runs
  fails the page; a print without a comment is not checked.
- Code that cannot run here (it needs a GPU, the full treebank, or a file of the user's) goes in a block of
  another language: ```text, ```sh and ```console blocks are shown and never run.
- A ```text block whose first line is ``$ recompile dump ARGS`` runs ``recompile dump ARGS`` from the
  repository root; every other line it shows, but a line ``...``, must come out, in that order.
- Blocks must be quick: tiny models, a few steps. The whole module runs in seconds.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
import traceback
import types

import pytest
import torch

import recompile
import recompile.data
from recompile import cli, config
from recompile.api import Stats

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


def page_id(path):
    return str(path.relative_to(ROOT))


def blocks(path):
    """[(language, first line number of the code, code)] of the fenced blocks of a page, in order."""
    found, lines = [], path.read_text(encoding="utf-8").split("\n")
    k = 0
    while k < len(lines):
        m = FENCE.match(lines[k])
        if m and m.group(2):
            indent, language, start = m.group(1), m.group(2), k + 1
            k += 1
            while k < len(lines) and lines[k].strip() != "```":
                k += 1
            code = [line[len(indent):] if line.startswith(indent) else line for line in lines[start:k]]
            found.append((language, start + 1, "\n".join(code) + "\n"))
        k += 1
    return found


# -- running a page's code


def expectations(source, filename):
    """{line: expected text} of the prints in ``source`` that carry a ``# expected`` comment; every line of
    such a print maps to its expectation (a frame reports the line the call is on)."""
    comments = {tok.start[0]: tok.string[1:].strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    found = {}
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"):
            expected = comments.get(node.end_lineno)
            if expected:
                for line in range(node.lineno, node.end_lineno + 1):
                    found[line] = expected
    return found


def matches(expected, text):
    pattern = ".*?".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, text.strip(), re.DOTALL) is not None


class CheckedPrint:
    """The page's ``print``: prints as usual, and checks a print that carries an expectation."""

    def __init__(self):
        self.expected = {}  # (filename, line) -> expected text
        self.seen = set()

    def __call__(self, *args, **kwargs):
        if kwargs.get("file") is not None:
            return builtins.print(*args, **kwargs)
        out = io.StringIO()
        builtins.print(*args, **kwargs, file=out)
        text = out.getvalue()
        sys.stdout.write(text)
        frame = sys._getframe(1)
        where = (frame.f_code.co_filename, frame.f_lineno)
        expected = self.expected.get(where)
        if expected is not None:
            self.seen.add(where)
            page, line = os.path.basename(where[0]).rsplit("-", 1)[0], where[1]
            assert matches(expected, text.rstrip("\n")), (
                f"{page}, line {line}: print wrote\n{text.rstrip()}\nwhere the page says\n{expected}")


def run_page(page, workdir):
    """Run the python blocks of ``page`` as the module docstring says, in ``workdir`` (in a process of its own)."""
    name = "docs_" + re.sub(r"\W", "_", page_id(page))
    module = types.ModuleType(name)
    checked = CheckedPrint()
    module.print = checked
    sys.modules[name] = module
    os.chdir(workdir)
    torch.manual_seed(0)
    for language, line, source in blocks(page):
        if language != "python":
            continue
        path = os.path.join(workdir, f"{page.name}-{line}.py")
        padded = "\n" * (line - 1) + source
        with open(path, "w", encoding="utf-8") as f:
            f.write(padded)
        checked.expected.update({(path, k): v for k, v in expectations(padded, path).items()})
        exec(compile(padded, path, "exec"), module.__dict__)
    never = sorted({line for _, line in checked.expected} - {line for _, line in checked.seen})
    assert not never, f"{page_id(page)}: prints with an expected output that never ran, lines {never}"


def run_job(job, workdir):
    """A page's python (``("page", path)``) or a ``recompile dump`` command (``("dump", args)``); raises or
    returns an exit status."""
    kind, what = job
    if kind == "page":
        run_page(pathlib.Path(what), workdir)
        return 0
    os.chdir(ROOT)
    try:
        return cli.main(what)
    except SystemExit as exc:
        return exc.code


def serve(jobs, outdir):
    """Run each job in a process of its own, forked from this one (which imported torch and recompile once),
    its output in ``outdir/K``; print the exit statuses as JSON. A process of its own, as a user's script or
    command has: what a process compiled before changes the names in generated code and in ``stats``."""
    statuses = []
    for k, job in enumerate(jobs):
        workdir = os.path.join(outdir, f"{k}.d")
        os.mkdir(workdir)
        pid = os.fork() if hasattr(os, "fork") else None
        if pid == 0 or pid is None:
            saved = os.dup(1), os.dup(2)
            with open(os.path.join(outdir, str(k)), "w", encoding="utf-8") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                try:
                    code = run_job(job, workdir) or 0
                except BaseException:
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                sys.stderr.flush()
            if pid == 0:
                os._exit(code)
            os.dup2(saved[0], 1)  # (no fork: the caller runs one job per process)
            os.dup2(saved[1], 2)
            statuses.append(code)
            continue
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    print(json.dumps(statuses))


def dump_blocks():
    """(command, the lines shown) of each ```text block that shows ``$ recompile dump ...``."""
    for page in PAGES:
        for language, line, source in blocks(page):
            first = source.split("\n", 1)[0]
            if language == "text" and first.startswith("$ recompile dump "):
                yield pytest.param(first[2:], source.split("\n")[1:], id=f"{page_id(page)}:{line}")


CODE_PAGES = [page for page in PAGES if any(language == "python" for language, _, _ in blocks(page))]
DUMPS = list(dump_blocks())
JOBS = [("page", str(page)) for page in CODE_PAGES] + [("dump", shlex.split(p.values[0])[1:]) for p in DUMPS]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every job run once: {job index: (exit status, output)}."""
    outdir = tmp_path_factory.mktemp("docs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    driver = "import json, sys, test_docs; test_docs.serve(json.loads(sys.argv[1]), sys.argv[2])"
    batches = [JOBS] if hasattr(os, "fork") else [[job] for job in JOBS]
    statuses = []
    for batch in batches:
        done = subprocess.run([sys.executable, "-c", driver, json.dumps(batch), str(outdir)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        statuses += json.loads(done.stdout.strip().split("\n")[-1])
        if len(batches) > 1:  # (each batch wrote its one output as 0)
            os.replace(outdir / "0", outdir / f"out{len(statuses) - 1}")
            shutil.rmtree(outdir / "0.d")
    name = (lambda k: f"out{k}") if len(batches) > 1 else str
    return {k: (status, (outdir / name(k)).read_text(encoding="utf-8")) for k, status in enumerate(statuses)}


@pytest.mark.parametrize("page", CODE_PAGES, ids=page_id)
def test_the_python_of_each_page_runs_and_prints_what_it_says(page, ran):
    status, output = ran[JOBS.index(("page", str(page)))]
    assert status == 0, f"{page_id(page)}:\n{output}"


def test_the_expectation_convention():
    assert matches("tensor(3.)", "tensor(3.)\n")
    assert matches("{'builds': 1, ..., 'per_instance': {}, ...}", "{'builds': 1, 'calls': 2, 'per_instance': {}, 'x': 1}")
    assert matches("tensor([[...]])", "tensor([[1., 2.],\n        [3., 4.]])")
    assert not matches("tensor(3.)", "tensor(4.)")
    assert not matches("{..., 'per_instance': {}, ...}", "{'per_instance': {'getitem': 9}, 'x': 1}")
    source = "x = 1\nprint(x)  # 1\nprint(\n    x)  # 1\nprint(x)\n"
    assert expectations(source, "t.py") == {2: "1", 3: "1", 4: "1"}


@pytest.mark.parametrize("command, shown", DUMPS)
def test_each_dump_shown_is_what_the_command_prints(command, shown, ran):
    status, output = ran[JOBS.index(("dump", shlex.split(command)[1:]))]
    assert status == 0, f"`{command}` failed:\n{output}"
    out = output.split("\n")
    at = 0
    for line in (s for s in shown if s.strip() and s.strip() != "..."):
        while at < len(out) and out[at].rstrip() != line.rstrip():
            at += 1
        assert at < len(out), f"`{command}` does not print, where the page shows it:\n{line}"
        at += 1


# -- links


def slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    inside = False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans: `f[k](x)` is no link
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_reach_a_file_and_heading(page):
    for link in links(page):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        where = (page.parent / target).resolve() if target else page
        assert where.exists(), f"{page_id(page)}: link to {link}: no such file"
        assert ROOT in where.parents, f"{page_id(page)}: link to {link} leaves the project"
        if anchor:
            assert anchor in anchors(where), f"{page_id(page)}: link to {link}: no such heading"


def test_every_docs_page_is_in_the_table_of_contents():
    listed = {pathlib.Path(link.partition("#")[0]).name for link in links(DOCS / "README.md")}
    for page in DOCS.glob("*.md"):
        assert page.name == "README.md" or page.name in listed, f"docs/README.md does not list {page.name}"


# -- the module list


def test_the_layout_in_design_lists_every_module():
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout"):]
    for path in sorted((ROOT / "recompile").rglob("*.py")):
        rel = path.relative_to(ROOT / "recompile").as_posix()
        if path.name in ("__init__.py", "__main__.py") and rel != "__init__.py":
            continue
        if rel.startswith("data/"):
            rel = rel.split("/", 1)[1]  # listed under data/ by file name
        assert re.search(r"(?<![\w/])" + re.escape(rel) + r"\b", layout), f"docs/design.md, Layout: no {rel}"


# -- the API reference


def public_names():
    """Every public name, as docs/api.md's entry must begin: module-level names with their module, members
    with their class."""
    names = [f"recompile.{n}" for n in recompile.__all__]
    names += ["recompile.map"]  # (public, and kept out of __all__: a star import would hide the builtin)
    names += [f"recompile.config.{n}" for n in dir(config) if n.isupper()]
    names += [f"recompile.data.{n}" for n in recompile.data.__all__]

    def sample(x):
        return x

    compiled = recompile.function(sample)
    members = {n for n in vars(recompile.CompiledFunction) if not n.startswith("_")}
    members |= {n for n in vars(compiled) if not n.startswith("_")}
    names += [f"CompiledFunction.{n}" for n in sorted(members)]
    names += [f"Stats.{n}" for n in vars(Stats) if not n.startswith("_") and not n.startswith("record_")]
    for cls_name in recompile.data.__all__:
        cls = getattr(recompile.data, cls_name)
        if isinstance(cls, type):
            own = set(vars(cls)) | set(vars(cls).get("__annotations__", {}))
            names += [f"{cls_name}.{n}" for n in sorted(own) if not n.startswith("_")]
    return names


def cli_options():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["dump", "--help"])
    return sorted(set(re.findall(r"(--[a-z][a-z-]*)", out.getvalue())) - {"--help"})


def entries():
    """The names docs/api.md has an entry for: a heading, or the first cell of a table row, that begins with
    the name in backticks (a signature may follow)."""
    found = set()
    for line in (DOCS / "api.md").read_text(encoding="utf-8").split("\n"):
        m = re.match(r"^(?:#+|\|)\s*`([\w.]+)", line)
        if m:
            found.add(m.group(1))
    return found


def test_every_public_name_has_an_entry_in_the_api_reference():
    have = entries()
    missing = [n for n in public_names() if n not in have]
    assert not missing, f"docs/api.md has no entry (a heading or table row beginning `NAME`) for: {missing}"


def test_every_option_of_the_command_is_in_the_api_reference():
    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [o for o in cli_options() if f"`{o}" not in text]
    assert not missing, f"docs/api.md does not describe recompile dump's {missing}"
    assert cli_options()  # (the help was read)


def test_the_api_reference_names_nothing_that_is_gone():
    public = set(public_names())
    owners = ("recompile.", "CompiledFunction.", "Stats.") + tuple(f"{n}." for n in recompile.data.__all__)
    stale = [n for n in entries() if n.startswith(owners) and n not in public
             and n not in ("recompile.config", "recompile.data")]
    assert not stale, f"docs/api.md has entries for names that are not public (any more): {stale}"
