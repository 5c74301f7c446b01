"""Line numbers of marked source lines, for tests that assert exact user lines."""

import inspect


def marker(fn, name):
    """The line number (in its file) of the one line of ``fn`` marked ``# L:<name>``."""
    fn = getattr(fn, "python", fn)
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, line in enumerate(lines) if line.rstrip().endswith(f"# L:{name}")]
    assert len(hits) == 1, (name, hits)
    return hits[0]


def source_range(fn):
    """The lines of ``fn``'s source in its file."""
    fn = getattr(fn, "python", fn)
    lines, start = inspect.getsourcelines(fn)
    return range(start, start + len(lines))
