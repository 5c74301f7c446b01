"""Batched values (runtime/batch.py): taking a joined batch's instances apart."""

from __future__ import annotations

import torch

from recompile.runtime import batch as bt
from recompile.runtime import sharing


def joined():
    """Instances 0, 2, 3 from one side, 1 and 4 from the other (as a Cond joins its branches' outputs)."""
    yes = bt.from_tensor(torch.tensor([[0.0], [2.0], [3.0]], dtype=torch.float64))
    no = bt.from_tensor(torch.tensor([[1.0], [4.0]], dtype=torch.float64))
    return yes, no, bt.join(5, [(yes, [0, 2, 3]), (no, [1, 4])])


def test_taking_one_sides_instances_of_a_join_gives_that_sides_value_in_a_run_that_changes_nothing(monkeypatch):
    """A later ``if`` whose test splits the instances as an earlier one did (``if l >= 0``, then ``if r >= 0``) takes
    back the very value a side gave: no join made, no rows gathered."""
    monkeypatch.setattr(sharing.state, "fresh", True)
    yes, no, value = joined()
    assert bt.take(value, torch.tensor([0, 2, 3]), [0, 2, 3]) is yes
    assert bt.take(value, torch.tensor([1, 4]), [1, 4]) is no
    other = bt.take(value, torch.tensor([0, 1]), [0, 1])  # (instances of both sides: their rows, gathered)
    torch.testing.assert_close(bt.rows_tensor(other), torch.tensor([[0.0], [1.0]], dtype=torch.float64))


def test_where_the_run_may_change_values_in_place_each_take_is_a_batch_of_its_own(monkeypatch):
    monkeypatch.setattr(sharing.state, "fresh", False)
    yes, _, value = joined()
    taken = bt.take(value, torch.tensor([0, 2, 3]), [0, 2, 3])
    assert taken is not yes
    torch.testing.assert_close(bt.rows_tensor(taken), bt.rows_tensor(yes))
