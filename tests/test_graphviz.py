"""recompile.graphviz: DOT text drawn by Graphviz's `dot` where it is installed, a clear error where it is not.

The command line's drawings (``recompile dump --format png|svg``) are tested in test_cli.py.
"""

import shutil

import pytest

import recompile
from recompile import graphviz


@recompile.function
def gv_count(n):
    if n <= 0:
        return 0
    return gv_count(n - 1) + 1


def test_missing_dot_says_how_to_install_graphviz(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` there
    with pytest.raises(graphviz.GraphvizError, match="apt-get install graphviz") as info:
        graphviz.render(gv_count.dump(format="dot"), "svg")
    assert isinstance(info.value, recompile.RecompileError)
    assert "drawing svg needs Graphviz's `dot` program, which is not on PATH" in str(info.value)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="'jpeg'.*png, svg"):
        graphviz.render("digraph {}", "jpeg")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` is not installed")
def test_render_with_graphviz():
    svg = graphviz.render(gv_count.dump(format="dot"), "svg").decode()
    assert "<svg" in svg and "gv_count" in svg
    assert graphviz.render(gv_count.dump(format="dot"), "png").startswith(b"\x89PNG")
    with pytest.raises(graphviz.GraphvizError, match="failed"):
        graphviz.render("digraph { not dot", "svg")
