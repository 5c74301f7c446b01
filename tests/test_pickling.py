"""recompile.pickling: a compiled function pickles by reference where pickle can find it, else it is rebuilt;
a model keeping one in its state round-trips through pickle, deepcopy and torch.save / torch.load.

``Sub.encode = recompile.function(Base.encode)`` is named ``Base.encode`` (the Python function's qualname),
which names Base's plain function: pickle refused it as "not the same object".
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import recompile


class PickleBase(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def encode(self, x, n):
        if n <= 0:
            return x
        return self.encode(torch.tanh(self.lin(x)), n - 1) + x

    def forward(self, x):
        return self.encode(x, 3)


class PickleSub(PickleBase):
    encode = recompile.function(PickleBase.encode)


class PickleLater(PickleBase):
    pass


PickleLater.encode = recompile.function(PickleBase.encode)  # no __set_name__: its owner is known once bound


class PickleSubSub(PickleSub):
    pass


class PickleUnbound(PickleBase):  # bound by one test only
    pass


PickleUnbound.encode = recompile.function(PickleBase.encode)


@recompile.function
def pickle_count(n):
    if n <= 0:
        return 0
    return pickle_count(n - 1) + 1


def test_function_defined_where_compiled_pickles_by_name():
    assert pickle.loads(pickle.dumps(pickle_count)) is pickle_count


def test_method_assigned_in_a_subclass_pickles_by_the_class_that_holds_it():
    fn = PickleSub.__dict__["encode"]
    assert fn.__qualname__ == "PickleBase.encode"  # the name pickle first looks it up by: PickleBase's plain one
    assert pickle.loads(pickle.dumps(fn)) is fn
    sub = PickleSubSub()  # bound through a subclass: still found in the class that holds it
    assert pickle.loads(pickle.dumps(sub.encode)).__func__ is fn


def test_assigned_after_the_class_was_made():
    fn = PickleUnbound.__dict__["encode"]
    assert fn._owner is None  # no __set_name__, not bound yet: rebuilt from the Python function
    again = pickle.loads(pickle.dumps(fn))
    assert again is not fn and again.python is PickleBase.encode and again.mode == fn.mode
    PickleUnbound()(torch.ones(4))
    assert pickle.loads(pickle.dumps(fn)) is fn  # bound once: found through its owner


def test_kept_in_a_container_only_is_rebuilt_with_its_options():
    fn = recompile.function(PickleBase.encode, mode="threaded", threads=2, fusion=False, max_live_frames=9)
    again = pickle.loads(pickle.dumps({"encode": fn}))["encode"]
    assert again is not fn and again.python is PickleBase.encode
    assert (again.mode, again.threads, again.fusion, again.max_live_frames) == ("threaded", 2, None, 9)
    default = pickle.loads(pickle.dumps([recompile.function(PickleBase.encode)]))[0]
    assert default._max_live_frames is recompile.function(PickleBase.encode)._max_live_frames  # still config's
    m = PickleBase()
    x = torch.randn(2, 4)
    torch.testing.assert_close(again(m, x, 3), m(x))


def round_trips():
    return {
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "deepcopy": copy.deepcopy,
        "torch.save": lambda m: torch.load(_saved(m), weights_only=False),
    }


def _saved(m):
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("how", list(round_trips()))
@pytest.mark.parametrize("cls", [PickleSub, PickleLater, PickleSubSub])
def test_model_round_trips_and_computes_the_same(cls, how):
    torch.manual_seed(0)
    m = cls()
    m.encoders = {"tree": type(m).encode}  # state that holds the compiled function itself
    m(torch.randn(2, 4))  # built and run before it is copied
    again = round_trips()[how](m)
    assert again is not m and type(again) is cls
    assert again.encoders["tree"] is cls.encode  # the class's own compiled function, not a copy
    eager = PickleBase()  # the plain Python method, with the same weights
    eager.load_state_dict(m.state_dict())
    x = torch.randn(3, 4)
    for model in (m, again, eager):
        model.zero_grad()
        model(x).sum().backward()
    torch.testing.assert_close(again(x), eager(x))
    torch.testing.assert_close(again(x), m(x), rtol=0, atol=0)
    for (name, p), q, r in zip(again.named_parameters(), m.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(p.grad, r.grad, msg=name)
