"""How the facts snapshot (``fixtures/facts_before_move.json``) names callables, types and values.

A callable of recompile's own is named by its qualified name alone (``recompile:build_tuple``): the move
changed the modules they live in, not what they are. Anything else is named by its module and qualified
name (``torch.tanh``, ``_operator.add``), or by its repr where it has no name (``'append'``, ``(0, 1)``).
"""

import torch


def describe(x):
    if isinstance(x, (str, int, float, bool, type(None))):
        return repr(x)
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, tuple):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    module = getattr(x, "__module__", None)
    name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"recompile:{name}" if module.startswith("recompile") else f"{module}.{name}"
    text = repr(x)
    if " at 0x" in text:
        raise ValueError(f"no stable name for {text}")
    return text


def listing(fact):
    """A fact set or table as a sorted list of names (``key -> value`` for a table)."""
    if isinstance(fact, dict):
        return sorted(f"{describe(k)} -> {describe(v)}" for k, v in fact.items())
    return sorted(describe(v) for v in fact)
