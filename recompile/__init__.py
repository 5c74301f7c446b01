"""recompile: compile recursive Python model code into one static program and run it.

    @recompile.function
    def encode(tree, i): ...
"""

from .api import CompiledFunction, function  # noqa: F401
from .debugging import disable  # noqa: F401
from .errors import (CompileError, GradFallbackWarning, PerInstanceError, PerInstanceWarning,  # noqa: F401
                     RecompileError, SharedChangeWarning)
from .passes.pipeline import FINAL, STAGES  # noqa: F401
from .vmap import map, vmap  # noqa: F401

__all__ = ["function", "vmap", "disable", "CompiledFunction", "CompileError", "RecompileError",
           "PerInstanceError", "PerInstanceWarning", "GradFallbackWarning", "SharedChangeWarning", "STAGES", "dump"]
# (``recompile.map`` is public too, but not star-imported: ``from recompile import *`` would hide the builtin)
__version__ = "0.1.0"


def dump(fn, stage=FINAL, format="text"):
    """The IR of compiled function ``fn`` after ``stage``, as text or DOT."""
    return fn.dump(stage=stage, format=format)
