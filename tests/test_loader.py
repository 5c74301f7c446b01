"""recompile.codegen.loader: generated functions compiled under the user's file and lines."""

import ast
import traceback

import pytest

from recompile import ir
from recompile.codegen.loader import Module, load, locate, location
from recompile.errors import Location


def user_code(x):
    y = x + 1  # line A
    return y / 0  # line B


LINE_A = user_code.__code__.co_firstlineno + 1
LINE_B = LINE_A + 1


def _def(name, statements):
    """``def name(x): statements`` with each statement at the user Location given beside it."""
    body = []
    for text, line in statements:
        stmt = ast.parse(text).body[0]
        locate(stmt, Location(__file__, line) if line else None)
        body.append(stmt)
    fdef = ast.FunctionDef(name=name, args=ast.arguments(posonlyargs=[], args=[ast.arg(arg="x")], vararg=None,
                                                         kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
                           body=body, decorator_list=[], returns=None, type_comment=None)
    locate(fdef, Location(__file__, LINE_A - 1))
    return fdef


def test_a_traceback_points_at_the_users_line():
    module = Module()
    sg = ir.SubGraph("f", [], Location(__file__, LINE_A - 1))
    fdef = _def("f", [("y = x + 1", LINE_A), ("return y / 0", LINE_B)])
    assert location(fdef.body[1]).lineno == LINE_B
    source, codes = load([fdef], sg, module)
    f = module.namespace["f"]
    assert f.__code__ in codes
    with pytest.raises(ZeroDivisionError) as info:
        f(1)
    last = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (last.filename, last.lineno) == (__file__, LINE_B) and "return y / 0" in last.line
    assert f"  # test_loader.py:{LINE_A}" in source and f"  # test_loader.py:{LINE_B}" in source


def test_module_names_a_value_once_and_apart_from_its_builtins():
    module = Module()
    value = object()
    name = module.ref(value, "weight")
    assert name == "_rc_weight" and module.ref(value, "other") == name and module.namespace[name] is value
    assert module.ref(object(), "weight") == "_rc_weight_2"
