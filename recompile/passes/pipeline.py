"""The pass pipeline: a list anyone can read. Each entry is (stage name, pass)."""

from __future__ import annotations

from .. import ir
from .capture import capture

# Each pass takes (function SubGraph, ParsedFunction) and returns the SubGraph.
PASSES = [
    ("capture", capture),
]

FINAL = PASSES[-1][0]  # the program that runs
# "grad" is the forward-with-saves and gradient program (passes.grad), derived when first needed
GRAD = "grad"
STAGES = ["frontend"] + [name for name, _ in PASSES] + [GRAD]


def run_passes(frontend_sg, parsed):
    """{stage: SubGraph} for every stage; each stage works on its own copy."""
    stages = {"frontend": frontend_sg}
    current = frontend_sg
    for name, pass_ in PASSES:
        current = pass_(ir.clone(current), parsed)
        stages[name] = current
    return stages
