"""Python's operators and the syntax that writes them, one row each.

The frontend reads syntax into calls of these callables (``a + b`` is ``operator.add``), the emitters
write the calls back as syntax, and traced segments write some of them infix: all derive their maps
from the rows here. ``node`` names the AST class, which ``ast`` and ``gast`` both define.
"""

from __future__ import annotations

import operator
from typing import Callable, NamedTuple, Optional

from .. import intrinsics


class Operator(NamedTuple):
    fn: Callable  # the callable the IR holds
    node: str  # the AST node class writing it (ast.Add, gast.Add)
    symbol: str  # how Python writes it
    in_place: Optional[Callable] = None  # its augmented assignment (``a += b``), for a binary operator


BINARY = (
    Operator(operator.add, "Add", "+", operator.iadd),
    Operator(operator.sub, "Sub", "-", operator.isub),
    Operator(operator.mul, "Mult", "*", operator.imul),
    Operator(operator.truediv, "Div", "/", operator.itruediv),
    Operator(operator.floordiv, "FloorDiv", "//", operator.ifloordiv),
    Operator(operator.mod, "Mod", "%", operator.imod),
    Operator(operator.pow, "Pow", "**", operator.ipow),
    Operator(operator.matmul, "MatMult", "@", operator.imatmul),
    Operator(operator.and_, "BitAnd", "&", operator.iand),
    Operator(operator.or_, "BitOr", "|", operator.ior),
    Operator(operator.xor, "BitXor", "^", operator.ixor),
    Operator(operator.lshift, "LShift", "<<", operator.ilshift),
    Operator(operator.rshift, "RShift", ">>", operator.irshift),
)
UNARY = (
    Operator(operator.neg, "USub", "-"),
    Operator(operator.pos, "UAdd", "+"),
    Operator(operator.invert, "Invert", "~"),
    Operator(operator.not_, "Not", "not "),
)
# (``a in b`` is ``operator.contains(b, a)``, its operands swapped: the frontend and the emitters write it
# themselves)
COMPARE = (
    Operator(operator.lt, "Lt", "<"),
    Operator(operator.le, "LtE", "<="),
    Operator(operator.gt, "Gt", ">"),
    Operator(operator.ge, "GtE", ">="),
    Operator(operator.eq, "Eq", "=="),
    Operator(operator.ne, "NotEq", "!="),
    Operator(operator.is_, "Is", "is"),
    Operator(operator.is_not, "IsNot", "is not"),
    Operator(intrinsics.not_in, "NotIn", "not in"),
)

SYMBOL = {row.fn: row.symbol for row in (*BINARY, *UNARY, *COMPARE)}
AUGMENTED = tuple(row.in_place for row in BINARY)  # ``a op= b``: each changes ``a`` in place where it can


def by_node(rows, module, in_place=False):
    """{``module``'s node class: callable} for ``rows`` (``module`` is ``ast`` or ``gast``); with
    ``in_place``, the augmented assignment's callable."""
    return {getattr(module, row.node): row.in_place if in_place else row.fn for row in rows}


def by_fn(rows, module):
    """{callable: ``module``'s node class} for ``rows``."""
    return {row.fn: getattr(module, row.node) for row in rows}
