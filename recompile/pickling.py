"""How a compiled function is pickled: by reference where pickle can find it again, else rebuilt from the Python
function it compiles.

Its qualname is the Python function's, so ``Sub.encode = recompile.function(Base.encode)`` is named
``Base.encode``, which names Base's plain function: pickle refused it (not the same object). The class it was
assigned to, found through the owner it was bound for, names it instead.
"""

from __future__ import annotations

import functools
import sys


def reduce(cf, owner, options):
    """``cf.__reduce__()``: a name pickle finds ``cf`` by, else how to rebuild an equal one. ``owner``: the class
    ``cf`` was bound for (None before its first binding); ``options``: its keyword arguments as given."""
    if _lookup(sys.modules.get(cf.__module__), cf.__qualname__) is cf:
        return cf.__qualname__  # a function or a method defined where it is compiled
    for cls in owner.__mro__ if owner is not None else ():
        for name, value in vars(cls).items():
            if value is cf:
                return getattr, (cls, name)  # a class attribute: getattr(cls, name) gives cf itself
    # nowhere by name (e.g. assigned to a class and not bound yet, or kept in a container): a new compiled
    # function of the same Python function and options, built again where it is first called
    return functools.partial(type(cf), **options), (cf.python,)


def _lookup(obj, qualname):
    for part in qualname.split("."):
        if part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj
