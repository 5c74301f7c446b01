"""recompile.dynamo: compiled functions under ``torch.compile`` are a graph break, not a trace into the runtime.

A training step wrapped in torch.compile gives the values and gradients it gives without; dynamo never traces
the runtime (a probe inside the compiled function, run by the runtime, sees ``is_compiling()`` false each
time) and, after the first call, compiles no frame again.
"""

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import recompile
from recompile import dynamo

SEEN = []  # what the probe saw: torch.compiler.is_compiling() each time the compiled code ran it


def probe(x):
    SEEN.append(torch.compiler.is_compiling())
    return x


class DynTree(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)

    @recompile.function
    def encode(self, x, n):
        if n <= 0:
            return probe(x)
        return self.encode(torch.tanh(self.lin(x)), n - 1) + x

    def forward(self, words, n):
        return self.encode(self.embed(words), n)

    def forward_many(self, words, n):
        return recompile.vmap(self.encode, in_dims=(0, None))(self.embed(words), n)


class DynTreeSequential(DynTree):
    encode = recompile.function(DynTree.encode.python, mode="sequential")


def eager_twin(cls):
    return type("Eager" + cls.__name__, (cls,), {"encode": DynTree.encode.python})


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """Each test starts as a process that never ran torch.compile; the entry points are given back after."""
    for fn in dynamo._entries:
        owner, name = dynamo._owner_of(fn)
        monkeypatch.setattr(owner, name, vars(owner)[name])
    monkeypatch.setattr(dynamo, "_in_place", False)
    monkeypatch.setattr(dynamo, "_disabled", {})
    torch._dynamo.reset()
    counters.clear()
    SEEN.clear()
    yield
    torch._dynamo.reset()


def step_of(model, how):
    def step(words):
        out = getattr(model, how)(words, 3)
        loss = (out * out).sum()
        loss.backward()
        return loss.detach(), out.detach()
    return step


def run(step, model, words):
    model.zero_grad()
    loss, out = step(words)
    return loss, out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("cls, how, backend", [(DynTree, "forward_many", "eager"), (DynTree, "forward", "eager"),
                                               (DynTreeSequential, "forward", "eager"),
                                               (DynTree, "forward_many", "aot_eager")])
def test_torch_compile_step_equals_plain_and_does_not_trace_the_runtime(fresh_dynamo, cls, how, backend):
    check_compiled_step(cls, how, backend)


@pytest.mark.slow  # (inductor compiles C++: about 10 s)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # (torch's own)
def test_torch_compile_default_backend(fresh_dynamo):
    check_compiled_step(DynTree, "forward_many", "inductor")


def check_compiled_step(cls, how, backend):
    torch.manual_seed(0)
    model = cls()
    eager = eager_twin(cls)()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(step_of(model, how), backend=backend)
    batches = [torch.randint(0, 10, (5,)), torch.randint(0, 10, (3,)), torch.randint(0, 10, (5,))]
    frames = []
    for words in batches:
        want = run(step_of(eager, "forward"), eager, words)  # (row by row: the same as a batch of words)
        SEEN.clear()
        got = run(compiled, model, words)
        assert SEEN and not any(SEEN)  # the runtime ran the probe, and dynamo never traced it
        torch.testing.assert_close(got[:2], want[:2])
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g, w)
        frames.append(counters["frames"]["total"])
    assert frames[2] == frames[1]  # the third call, like the second, compiled no frame again


def test_every_entry_point_is_opaque():
    import recompile.runtime.autograd  # noqa: F401  (the autograd.Functions: their backward is an entry point)
    import recompile.runtime.lazy_weights  # noqa: F401

    assert dynamo.is_opaque(vars(recompile.CompiledFunction)["__call__"])
    functions, todo = [], [torch.autograd.Function]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("recompile.") and "backward" in vars(cls):
            functions.append(cls)
    assert len(functions) >= 4
    for cls in functions:
        assert dynamo.is_opaque(vars(cls)["backward"]), cls  # autograd's engine calls it: a frame of its own


def test_outside_torch_compile_nothing_of_dynamo_is_used(fresh_dynamo, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compiler.disable called outside torch.compile")

    monkeypatch.setattr(torch.compiler, "disable", refuse)  # (where recompile is imported, it would import dynamo)
    torch.manual_seed(0)
    for cls in (DynTree, DynTreeSequential):
        model = cls()
        eager = eager_twin(cls)()
        eager.load_state_dict(model.state_dict())
        words = torch.arange(4)
        want = run(step_of(eager, "forward"), eager, words)
        for how in ("forward", "forward_many") if cls is DynTree else ("forward",):
            got = run(step_of(model, how), model, words)
            torch.testing.assert_close(got[:2], want[:2])
            for g, w in zip(got[2], want[2]):
                torch.testing.assert_close(g, w)
    assert not dynamo._disabled and not dynamo._in_place
