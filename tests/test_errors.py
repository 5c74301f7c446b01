"""Errors: constructs outside the subset -> recompile.CompileError pointing at
the user's line; runtime errors deep inside compiled recursion keep their type
and name the compiled call chain.

The faulty functions live, undecorated, in tests/programs_errors.py; each has
one line marked ``# ERR`` (the line the error must point at) and recursive
ones mark their call site with ``# CALLSITE``.  Expected line numbers are read
from those markers, never hard-coded.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys

import pytest
import torch

import recompile  # attributes looked up inside tests only

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
import programs_errors as pe  # noqa: E402

MODES = [None, "sequential"]
MODE_IDS = ["default", "sequential"]
F64 = torch.float64
X = torch.tensor([1.0, -2.0, 0.5], dtype=F64)


def compile_fn(fn, mode=None):
    if mode is None:
        return recompile.function(fn)
    return recompile.function(mode=mode)(fn)


def identity(fn):
    return fn


def marker_line(fn, marker):
    """Line number (in fn's file) of the single line of fn carrying ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, line in enumerate(lines) if marker in line]
    assert len(hits) == 1, f"{fn.__name__}: expected one {marker!r} line, found {hits}"
    return hits[0]


# ---------------------------------------------------------------------------
# CompileError: location, source excerpt with caret, construct named
# ---------------------------------------------------------------------------

class Bad:
    def __init__(self, name, get_fn, args, words):
        self.name = name
        self.get_fn = get_fn          # called at test time (after setup)
        self.args = args
        self.words = words            # the message must name one of these (outside the source excerpt)

    def __repr__(self):
        return self.name


BAD = [
    Bad("yield", lambda: pe.uses_yield, (X,), ["yield", "generator"]),
    Bad("async_def", lambda: pe.uses_async, (X,), ["async"]),
]


def _mentions(text, word):
    if word.isidentifier():
        return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None
    return word.lower() in text.lower()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_compile_error_points_at_construct(bad, mode):
    fn = bad.get_fn()
    expected_line = marker_line(fn, "# ERR")

    with pytest.raises(recompile.CompileError) as ei:
        g = compile_fn(fn, mode)
        g(*bad.args)

    err = ei.value
    assert isinstance(err, Exception)
    assert err.filename is not None and str(err.filename).endswith("programs_errors.py"), err.filename
    assert err.lineno == expected_line, f"lineno {err.lineno}, expected {expected_line}\n{err}"

    source_line = linecache.getline(inspect.getsourcefile(fn), expected_line).rstrip("\n")
    assert isinstance(err.offset, int) and not isinstance(err.offset, bool)
    assert 1 <= err.offset <= len(source_line) + 1, err.offset

    msg = str(err)
    code = source_line.split("#")[0].strip()
    assert code and code in msg, f"source line {code!r} not in message:\n{msg}"
    assert re.search(r"^\s*\^[\^~]*\s*$", msg, re.MULTILINE), f"no caret line in message:\n{msg}"

    # the construct must be named by the message itself, not merely by the quoted source line / path
    rest = msg.replace(source_line.strip(), " ").replace(code, " ")
    rest = rest.replace(str(err.filename), " ").replace(os.path.basename(str(err.filename)), " ")
    assert any(_mentions(rest, w) for w in bad.words), f"none of {bad.words} named in:\n{msg}"


def test_compile_error_is_exported():
    assert issubclass(recompile.CompileError, Exception)


def test_plain_python_versions_actually_run():
    """Sanity: the 'bad' functions are valid Python (so only the compiler can object)."""
    assert [torch.equal(y, X + i) for i, y in enumerate(pe.uses_yield(X))] == [True] * 3


# ---------------------------------------------------------------------------
# runtime errors deep inside compiled recursion
# ---------------------------------------------------------------------------

def _error_text(exc):
    return str(exc) + "\n" + "\n".join(str(n) for n in getattr(exc, "__notes__", []))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_raise_deep_in_recursion_keeps_type_and_names_call_site(mode, monkeypatch):
    plain = pe.rec_boom
    callsite = marker_line(plain, "# CALLSITE")
    assert plain(8, -1) == 8
    with pytest.raises(ValueError):
        plain(8, 3)                      # depth 5: 8 -> 3

    f = compile_fn(plain, mode)
    monkeypatch.setattr(pe, "rec_boom", f)   # as with a module-level @recompile.function
    with pytest.raises(ValueError) as ei:
        f(8, 3)
    exc = ei.value
    assert type(exc) is ValueError
    text = _error_text(exc)
    assert "boom" in str(exc)
    assert "rec_boom" in text, text
    assert f"programs_errors.py:{callsite}" in text, text

    # the same compiled function works again
    assert f(8, -1) == 8
    assert f(0, -1) == 0
    with pytest.raises(ValueError):
        f(4, 0)
    assert f(5, 9) == 5
    assert f.stats["builds"] == 1


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_index_error_at_leaf_keeps_type_and_names_call_site(mode, monkeypatch):
    left = [1, 3, 5, -1, -1, -1, -1]
    right = [2, 4, 6, -1, -1, -1, -1]
    good = [0, 0, 0, 1, 2, 3, 4]
    short = [0, 0, 0, 1, 2]            # leaves 5 and 6 index past the end
    plain = pe.tree_leaf_sum
    callsite = marker_line(plain, "# CALLSITE")
    expected = plain(left, right, good, 0)
    with pytest.raises(IndexError):
        plain(left, right, short, 0)

    f = compile_fn(plain, mode)
    monkeypatch.setattr(pe, "tree_leaf_sum", f)
    with pytest.raises(IndexError) as ei:
        f(left, right, short, 0)
    exc = ei.value
    assert type(exc) is IndexError
    text = _error_text(exc)
    assert "tree_leaf_sum" in text, text
    assert f"programs_errors.py:{callsite}" in text, text

    assert f(left, right, good, 0) == expected
    assert f([-1], [-1], [7], 0) == 7
    assert f.stats["builds"] == 1


def make_local_rec(deco):
    @deco
    def local_rec(n, k):
        if n == 0:
            return 10 // k
        return local_rec(n - 1, k) + 1  # CALLSITE

    return local_rec


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_error_in_recursion_defined_in_test_file(mode):
    plain = make_local_rec(identity)
    callsite = marker_line(plain, "# CALLSITE")
    with pytest.raises(ZeroDivisionError):
        plain(6, 0)

    f = make_local_rec(lambda fn: compile_fn(fn, mode))
    with pytest.raises(ZeroDivisionError) as ei:
        f(6, 0)
    exc = ei.value
    assert type(exc) is ZeroDivisionError
    text = _error_text(exc)
    assert "local_rec" in text, text
    assert f"test_errors.py:{callsite}" in text, text

    assert f(6, 2) == plain(6, 2) == 11
    assert f(0, 5) == plain(0, 5) == 2
    assert f.stats["builds"] == 1
