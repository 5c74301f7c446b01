"""What recompile knows about a callable, in one place, below the pipeline.

``table`` files rules (gradient, batch, trace) under a callable, a Tensor method's name or an nn.Module
type; ``facts`` names the sets of callables the stages reason about (pure, mutating, no-gradient,
elementwise, ...); ``syntax`` pairs Python's operators with the syntax that writes them. This package
imports torch and ``recompile.intrinsics`` only.
"""
