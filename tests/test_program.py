"""recompile.program: a compiled function's builds and handles (the ``ir.Target`` protocol), one per owner."""

import pytest
import torch

import recompile
from recompile import ir, program
from recompile.passes.pipeline import FINAL


@recompile.function
def is_even(n):
    if n == 0:
        return True
    return is_odd(n - 1)


@recompile.function
def is_odd(n):
    if n == 0:
        return False
    return is_even(n - 1)


def plain(n):
    return n


class Base:
    @recompile.function
    def depth(self, n):
        if n == 0:
            return 0
        return self.depth(n - 1) + self.step()

    def step(self):
        return 1


class Sub(Base):
    def step(self):
        return 2


def test_a_handle_is_a_target():
    callee = is_even.callee(None)
    assert callee.ir_name == is_even.ir_name and callee.qualname == "is_even"
    assert callee.filename == __file__ and callee.signature is is_even.signature
    assert isinstance(callee.subgraph(FINAL), ir.SubGraph) and callee.subgraph(FINAL).name == is_even.ir_name
    assert callee.forward.ir_name == is_even.ir_name + ":fwd" and callee.backward.ir_name == is_even.ir_name + ":bwd"
    assert callee.forward.subgraph(FINAL) is callee.subgraph(FINAL)  # (a gradient program's analyses read its function)
    with pytest.raises(TypeError, match="higher-order"):
        callee.forward.forward


def test_reachable_walks_each_function_once_from_the_target():
    found = list(ir.reachable(is_even.callee(None), FINAL))
    assert found == [is_even.callee(None), is_odd.callee(None)]
    assert [t.ir_name for t in ir.reachable(is_odd.callee(None), FINAL)] == [is_odd.ir_name, is_even.ir_name]


def test_one_build_and_one_handle_per_owner_class():
    before = Base.depth.stats["builds"]
    assert Base().depth(3) == 3 and Sub().depth(3) == 6
    assert Base.depth.callee(Base) is Base.depth.callee(Base) and Base.depth.callee(Sub) is not Base.depth.callee(Base)
    assert Base.depth.build_for(Sub) is Base.depth.build_for(Sub) and Base.depth.build_for(Sub).owner is Sub
    assert Base.depth.stats["builds"] == before + 2


def test_callee_of_knows_compiled_functions_only():
    assert program.callee_of(is_even, None) is is_even.callee(None)
    assert program.callee_of(plain, None) is None and program.callee_of(torch.tanh, None) is None


def test_ir_names_are_unique_across_functions_of_one_qualname():
    first = program.unique_ir_name("test_program.same")
    assert first == "test_program.same"
    assert program.unique_ir_name("test_program.same") == "test_program.same#2"


def test_a_function_is_what_recompile_compiles():
    with pytest.raises(TypeError, match="expects a Python function"):
        program.Function(len, None)
    f = program.Function(plain, None)
    assert f.python is plain and f.ir_name.startswith("plain") and list(f.signature.parameters) == ["n"]
    assert f.build_for(None).stages[FINAL].name == f.ir_name


def helper(obj, n):
    if n == 0:
        return 0
    return obj.extra(n - 1)


class TwoOwners:
    m = helper  # (compiled below: helper is built for this class, and for no class when called by name)

    @recompile.function
    def root(self, n):
        return self.m(n) + helper(self, n)

    @recompile.function
    def extra(self, n):
        return n


helper = recompile.function(helper)
TwoOwners.m = helper


def test_a_function_built_for_two_owners_is_shown_once_and_walked_once():
    assert TwoOwners().root(2) == 2
    before = helper.stats["builds"]
    program = TwoOwners.root.program()
    assert list(program.subgraphs) == [TwoOwners.root.ir_name, helper.ir_name]
    assert helper.stats["builds"] == before  # (the second owner's build was not walked into)


def test_a_gradient_handle_runs_its_gradient_programs_code():
    callee = is_even.callee(None)
    fwd, bwd = callee.forward, callee.backward
    assert fwd.code is callee.build.grad_code[0] and bwd.code is callee.build.grad_code[1]
    assert fwd.code.entry.__name__.endswith("fwd") and bwd.code.entry.__name__.endswith("bwd")
