"""How a compiled function is pickled: by reference where pickle can find it again, else rebuilt from the Python
function it compiles.

Its qualname is the Python function's, so ``Sub.encode = recompile.function(Base.encode)`` is named
``Base.encode``, which names Base's plain function: pickle refused it (not the same object). The class it was
assigned to, found through the owner it was bound for, names it instead.
"""

from __future__ import annotations

import sys


def reduce(cf):
    """``cf.__reduce__()``: a name pickle finds ``cf`` by, else how to rebuild an equal one."""
    if _lookup(sys.modules.get(cf.__module__), cf.__qualname__) is cf:
        return cf.__qualname__  # a function or a method defined where it is compiled
    owner = cf._owner
    for cls in owner.__mro__ if owner is not None else ():
        for name, value in vars(cls).items():
            if value is cf:
                return getattr, (cls, name)  # a class attribute: getattr(cls, name) gives cf itself
    # nowhere by name (e.g. assigned to a class and not used yet, or kept in a container): a new compiled
    # function of the same Python function and options, built again where it is first called
    return rebuild, (cf.python, cf._options)


def rebuild(python, options):
    from .api import CompiledFunction  # (api imports this module)
    return CompiledFunction(python, **options)


def _lookup(obj, qualname):
    for part in qualname.split("."):
        if part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj
