"""The SST examples: compiled encoders equal the same code run eagerly (values and gradients), and train."""

import os
import sys

import pytest
import torch

from recompile.data import load_sst, sample_dir

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from rntn import RNTN  # noqa: E402
from sst_runner import main  # noqa: E402
from tree_lstm import TreeLSTM  # noqa: E402
from tree_rnn import TreeRNN  # noqa: E402

MODELS = [TreeRNN, RNTN, TreeLSTM]


@pytest.fixture(scope="module")
def sst():
    return load_sst(sample_dir())


def eager_twin(model_cls):
    """The same model with the undecorated method, so that recursion runs in plain PyTorch."""
    return type("Eager" + model_cls.__name__, (model_cls,), {"encode": model_cls.encode.python})


@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_compiled_equals_eager(model_cls, sst):
    torch.manual_seed(0)
    compiled = model_cls(len(sst.vocab), embed=16, hidden=12).double()
    eager = eager_twin(model_cls)(len(sst.vocab), embed=16, hidden=12).double()
    eager.load_state_dict(compiled.state_dict())
    for tree in sst.train[:6]:
        got_loss, got_logits = compiled(tree)
        want_loss, want_logits = eager(tree)
        torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-12)
        compiled.zero_grad()
        eager.zero_grad()
        got_loss.backward()
        want_loss.backward()
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)
    assert type(compiled).encode.stats["builds"] == 1


# the composition weight of each model: what every internal node of a tree reads
COMPOSITION = {TreeRNN: "compose.weight", RNTN: "V", TreeLSTM: "node.weight"}


@pytest.mark.filterwarnings("ignore:recompile. a differentiable backward")
@pytest.mark.parametrize("mode", ["batched", "sequential", "threaded"])
@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_gradcheck_and_gradgradcheck_pass_in_every_mode(model_cls, mode, sst):
    """torch.autograd's own checks of first and second derivatives, through the recursion of a tree, for the
    weight every internal node reads (float64, a tiny model)."""
    cls = type(f"{mode}{model_cls.__name__}", (model_cls,),
               {"encode": __import__("recompile").function(model_cls.encode.python, mode=mode)})
    torch.manual_seed(0)
    model = cls(len(sst.vocab), embed=3, hidden=2).double()
    tree = next(t for t in sst.train if 3 <= len(t.words) <= 4)
    name = COMPOSITION[model_cls]

    def loss(weight):
        return torch.func.functional_call(model, {name: weight}, (tree,))[0]

    weight = dict(model.named_parameters())[name].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(loss, (weight,), fast_mode=True)
    assert torch.autograd.gradgradcheck(loss, (weight,), fast_mode=True)


@pytest.mark.parametrize("model_cls", MODELS, ids=lambda c: c.__name__)
def test_training_lowers_the_loss(model_cls, capsys):
    history = main(model_cls, "test", ["--limit", "40", "--epochs", "3", "--embed", "32", "--hidden", "24",
                                       "--lr", "0.1"])
    losses = [loss for loss, _ in history]
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert "dev root accuracy" in out


def test_dump_flag_prints_the_ir(capsys):
    main(TreeLSTM, "test", ["--limit", "2", "--epochs", "1", "--embed", "8", "--hidden", "8", "--dump"])
    out = capsys.readouterr().out
    name = TreeLSTM.encode.ir_name  # "TreeLSTM.encode" (#2 when another class of that name compiled first)
    assert f"subgraph @{name}(" in out
    assert f"invoke @{name}(" in out
