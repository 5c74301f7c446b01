"""The pass pipeline: a list anyone can read. Each entry is (stage name, pass)."""

from __future__ import annotations

import functools

from .. import ir
from .accumulate import accumulate
from .capture import capture
from .fresh import fresh
from .fusion import DEFAULT_BACKEND, fuse
from .prune import prune
from .unpack import unpack


def passes(fusion=DEFAULT_BACKEND):
    """The passes in order; ``fusion`` is the fused ops' backend, or None to fuse nothing."""
    return [
        ("capture", capture),
        ("prune", prune),
        ("accumulate", accumulate),
        ("fresh", fresh),
        ("unpack", unpack),
        ("fusion", functools.partial(fuse, backend=fusion) if fusion else None),  # None: the stage is unchanged
    ]


FINAL = "fusion"  # the program that runs
UNFUSED = "unpack"  # the program before fusion (each elementwise op its own: what a trace may inline)
# "grad" is the forward-with-saves and gradient program (passes.grad), derived when first needed
GRAD = "grad"
STAGES = ["frontend"] + [name for name, _ in passes()] + [GRAD]


def run_passes(frontend_sg, parsed, fusion=DEFAULT_BACKEND):
    """{stage: SubGraph} for every stage; each stage works on its own copy."""
    stages = {"frontend": frontend_sg}
    current = frontend_sg
    for name, pass_ in passes(fusion):
        if pass_ is not None:
            current = pass_(ir.clone(current), parsed)
        stages[name] = current
    return stages
