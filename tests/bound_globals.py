"""Temporarily rebinding a test module's globals (a compiled function reads globals when it runs)."""

import contextlib


@contextlib.contextmanager
def bound_globals(namespace, objs):
    """Bind ``name -> obj`` in ``namespace`` (a module's globals) and restore the old values afterwards."""
    saved = {name: namespace[name] for name in objs}
    namespace.update(objs)
    try:
        yield
    finally:
        namespace.update(saved)
