"""The SST examples: compiled encoders equal the same code run eagerly (values and gradients), and train."""

import io
import os
import sys

import pytest
import torch

from recompile.data import load_sst, sample_dir

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import sst_runner  # noqa: E402
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


TINY = ["--limit", "12", "--embed", "8", "--hidden", "8", "--batch", "4"]


def test_resumed_run_goes_on_as_the_uninterrupted_one(tmp_path, capsys):
    straight = main(TreeLSTM, "test", TINY + ["--epochs", "3"])
    checkpoint = str(tmp_path / "tree_lstm.pt")
    first = main(TreeLSTM, "test", TINY + ["--epochs", "1", "--checkpoint", checkpoint])
    assert first == straight[:1] and os.path.exists(checkpoint)
    resumed = main(TreeLSTM, "test", TINY + ["--epochs", "3", "--checkpoint", checkpoint, "--resume"])
    assert resumed == straight  # the same losses and accuracies, bit for bit: weights, optimizer, shuffles
    out = capsys.readouterr().out
    assert f"resumed from {checkpoint} after epoch 1" in out
    assert out.count("epoch 3  train loss/node") == 2 and "epoch 2  train loss/node" in out
    again = main(TreeLSTM, "test", TINY + ["--epochs", "3", "--checkpoint", checkpoint, "--resume"])
    assert again == straight  # nothing left to train: the checkpoint's history


def test_resume_without_a_checkpoint_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(TreeLSTM, "test", TINY + ["--resume"])
    assert info.value.code == 2
    assert "--resume needs --checkpoint PATH" in capsys.readouterr().err


def test_training_curve(tmp_path):
    pytest.importorskip("matplotlib")
    curve = tmp_path / "curve.png"
    main(TreeRNN, "test", TINY + ["--epochs", "2", "--curve", str(curve)])
    assert curve.read_bytes().startswith(b"\x89PNG")


def test_curve_without_matplotlib_is_refused_before_training(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    with pytest.raises(SystemExit):
        main(TreeRNN, "test", TINY + ["--curve", "never.png"])
    err = capsys.readouterr()
    assert "--curve needs matplotlib: pip install matplotlib" in err.err and "epoch" not in err.out


def test_without_tqdm_each_epoch_has_its_log_line(monkeypatch, capsys):
    monkeypatch.setattr(sst_runner, "tqdm", None)  # as where the examples extra is not installed
    main(TreeRNN, "test", TINY + ["--epochs", "2"])
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if "train loss/node" in line]
    assert [line.split()[:2] for line in lines] == [["epoch", "1"], ["epoch", "2"]]
    assert all("dev root accuracy" in line and "trees/s" in line for line in lines)
    assert captured.err == ""


def test_progress_bar_shows_trees_per_second_and_loss(monkeypatch, capsys):
    tqdm = pytest.importorskip("tqdm")
    drawn = io.StringIO()

    def on_a_terminal(**kw):  # under pytest stderr is no terminal, where the bar is off; and draw every step
        return tqdm.tqdm(**{**kw, "disable": False, "file": drawn, "mininterval": 0})

    monkeypatch.setattr(sst_runner, "tqdm", on_a_terminal)
    main(TreeRNN, "test", TINY + ["--epochs", "1"])
    assert "tree/s" in drawn.getvalue() and "loss/node=" in drawn.getvalue() and "epoch 1" in drawn.getvalue()
    assert "\r" not in capsys.readouterr().out  # the log lines stay apart from the bar
