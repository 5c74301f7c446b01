"""recompile.ops.table: rules filed under a callable, a Tensor method's name or an nn.Module type, and found
again from the callable a program holds when it runs."""

import operator

import pytest
import torch
from torch import nn

from recompile.ops.table import RuleTable, has_backward_hooks, has_hooks, key, tensor_method


def rule_a(*args):
    return "a"


def rule_b(*args):
    return "b"


def test_a_rule_is_filed_under_each_target_and_found_by_the_callable():
    table = RuleTable("t")
    table.register(torch.tanh, "tanh", nn.Tanh)(rule_a)
    x = torch.zeros(2)
    assert table.lookup(torch.tanh) is rule_a
    assert table.lookup(x.tanh) is rule_a  # a bound method of any tensor: by its name
    assert table.lookup(nn.Tanh()) is rule_a  # a module: by its type
    assert table.lookup(torch.sigmoid) is None and table.lookup(x.sigmoid) is None
    assert len(table) == 3 and "3 rules" in repr(table)


def test_make_files_what_the_table_holds_for_each_target():
    table = RuleTable("t", make=lambda rule, target: (rule, target))
    table.register(operator.add, "add")(rule_b)
    assert table.lookup(operator.add) == (rule_b, operator.add)
    assert table.lookup(torch.zeros(1).add) == (rule_b, "add")


def test_python_tensor_methods_are_torchs_but_a_subclass_method_is_not():
    table = RuleTable("t")
    table.register("split")(rule_a)
    x = torch.arange(4.0)
    assert tensor_method(x.split) == "split" and table.lookup(x.split) is rule_a

    class Mine(torch.Tensor):
        def split(self, *args):
            return "mine"

    mine = x.as_subclass(Mine)
    assert tensor_method(mine.split) is None and table.lookup(mine.split) is None
    assert tensor_method([].append) is None  # a bound method of another builtin type


@pytest.mark.parametrize("hook", ["forward", "forward pre", "full backward", "full backward pre"])
def test_a_module_whose_hooks_may_change_it_or_its_gradient_has_no_rule(hook):
    """A rule computing the module's call another way would bypass its hooks: a backward hook's too."""
    table = RuleTable("t")
    table.register(nn.Linear)(rule_a)
    m = nn.Linear(2, 2)
    assert table.lookup(m) is rule_a and not has_hooks(m)
    handle = getattr(m, f"register_{hook.replace(' ', '_')}_hook")(lambda *a: None)
    assert has_hooks(m) and table.lookup(m) is None
    assert has_backward_hooks(m) == ("backward" in hook)
    handle.remove()
    assert table.lookup(m) is rule_a


def test_an_exact_module_type_only():
    table = RuleTable("t")
    table.register(nn.Linear)(rule_a)

    class MyLinear(nn.Linear):
        pass

    assert table.lookup(MyLinear(2, 2)) is None


def test_unhashable_callables_find_no_rule():
    class Unhashable:
        __hash__ = None

        def __call__(self):
            return 0

    table = RuleTable("t")
    table.register(operator.add)(rule_a)
    assert table.lookup(Unhashable()) is None


def test_key_names_where_a_rule_is_filed():
    x = torch.ones(1)
    assert key(torch.tanh) is torch.tanh and key(x.tanh) == "tanh" and key(x.split) == "split"
    assert key(nn.ReLU()) is nn.ReLU and key(len) is len


def test_lookup_finds_what_is_filed_under_the_key_of_a_callable():
    x, m = torch.ones(2), nn.Linear(2, 2)

    class Mine(torch.Tensor):
        def split(self, *args):
            return "mine"

    callables = [torch.tanh, operator.mul, x.tanh, x.split, x.__getitem__, x.__rsub__, m, nn.ReLU(), len,
                 [].append, x.as_subclass(Mine).split, torch.Tensor.tanh]
    table = RuleTable("t")
    for fn in callables:
        k = key(fn)
        table.register(k if isinstance(k, (str, type)) else fn)(("rule", k))
    for fn in callables:
        assert table.lookup(fn) == ("rule", key(fn)), fn
