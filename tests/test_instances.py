"""``recompile dump --instances`` (codegen/instances.py): each op marked once, batched, per instance or by type,
read from the program and the parameters every instance shares."""

import re

import torch

import recompile
from recompile import cli


def marks(text):
    """{source line's first op text: its mark} of a dump's ops."""
    return [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^  (.*?)  # \[([^\]]+)\]", text, re.M)]


def scale(self, x, n):
    k = torch.ones(3) * 2.0  # (shared arguments: once)
    y = torch.tanh(x) * k  # (x per instance: batched)
    z = self.proj(y)  # (a module read from self: by its type)
    for t in range(n):
        z = z + t
    return z * int(n)  # (an int of each instance's tensor: one ``tolist`` of the group's)


def test_each_op_is_marked_with_how_a_batch_runs_it():
    text = recompile.function(scale).dump(instances=("self",))
    found = marks(text)
    how = {}
    for op, mark in found:
        how.setdefault(op.split(" = ")[-1], mark)
    assert how["call %ones(3)"] == "once"
    assert how["call getattr(%self, 'proj')"] == "once"
    assert how["fused[python] @scale.fused1(%ones.1, %tanh, %x)"] == "batched"
    assert how["call %proj(%y)"] == "by type"
    assert how["call %int(%n)"] == "batched"
    assert [mark for op, mark in found if " = while " in op] == ["batched"]
    assert how["call add(%idx1.2, 1)"] == "once"  # (the loop's counter: every instance at the same step)


def test_a_parameter_named_shared_makes_what_derives_from_it_once():
    compiled = recompile.function(scale)
    assert "call %int(%n)  # [once]" in compiled.dump(instances=("self", "n"))
    assert "[" not in compiled.dump().split("\n", 1)[1].replace("[python]", "")  # (no marks unless asked)


def test_the_cli_marks_the_example(capsys):
    assert cli.main(["dump", "examples/tree_lstm.py:TreeLSTM.encode", "--instances", "--shared", "self",
                     "tree"]) in (0, None)
    found = marks(capsys.readouterr().out)
    assert found and not [op for op, mark in found if mark.startswith("per instance")]
    assert ("%v = call getitem(%is_leaf, %i)", "batched") in found


def noisy(x):
    noise = torch.randn(3)  # (a draw: each instance its own)
    print("step")  # (an effect: each instance's)
    return x + noise


def test_a_draw_or_an_effect_of_shared_values_is_marked_per_instance():
    how = dict((op.split(" = ")[-1], mark) for op, mark in marks(recompile.function(noisy).dump(instances=())))
    assert how["call %randn(3)"].startswith("per instance: no instance differs in its arguments")
    assert how["call %print('step')"].startswith("per instance")


def collected(x, flag):
    hs = [h * 2 for h in (x, x + 1)]  # (appends of per-instance values to a list built empty)
    kept = []
    if flag > 0:
        kept.append(x)  # (in a branch)
    return hs[0] + kept[0] if kept else hs[0]


def test_a_list_a_method_changes_with_per_instance_values_is_batched_after():
    how = {op.split(" = ")[-1]: mark for op, mark in marks(recompile.function(collected).dump(instances=()))}
    assert how["call getitem(%listcomp1.1, 0)"] == "batched"
    assert how["call getitem(%kept.3, 0)"] == "batched"
