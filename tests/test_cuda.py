"""The batched paths on a CUDA device give what eager PyTorch gives on the CPU (float64: values and parameter
gradients): every Tree-LSTM, RNTN and module-cell spelling of the idiom benchmark, every sentence model of the
sequence benchmark (the packed-RNN path among them) and the top-down model, each with no per-instance op, and
the Tree-RNN example trained in each mode, the programs that change values in place, a few ops with rules of
their own (in-place index ops under vmap, a write at each instance's own index, attention over each instance's
sequence), and a backward that reads saved values some instances changed in place (runtime/saved_versions.py).
Skipped without a CUDA device (CI has none); the threaded runtime's own CUDA tests are in test_threaded.py."""

import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import bench_idioms  # noqa: E402
import bench_in_place  # noqa: E402
import test_saved_versions as saved  # noqa: E402
import bench_sequences  # noqa: E402
from bench_batching import eager_twin, gradients, on_cpu  # noqa: E402
from tree_rnn import TreeRNN  # noqa: E402

import recompile  # noqa: E402
from recompile.data import load_sst, sample_dir  # noqa: E402


@pytest.fixture(scope="module")
def trees():
    sst = load_sst(sample_dir(), splits=("train",))
    return len(sst.vocab), sst.train[:12]


TREE_SPELLINGS = {**bench_idioms.SPELLINGS, **bench_idioms.RNTN_SPELLINGS, **bench_idioms.CELL_SPELLINGS}


@pytest.mark.parametrize("name", list(TREE_SPELLINGS))
def test_tree_spellings_on_cuda_equal_eager_on_cpu(name, trees):
    vocab, sample = trees
    torch.manual_seed(0)
    cls = TREE_SPELLINGS[name]
    assert bench_idioms.check(cls, cls(vocab), sample, device="cuda") == {}  # (no per-instance op)


# (name -> class, its hand-batched twin, how a tree becomes a sentence: the taggers read a tag per word)
SENTENCE_SPELLINGS = {name: (cls, hand, reading) for reading, families in (
    (bench_sequences.sentence_of, bench_sequences.SENTENCE_FAMILIES),
    (bench_sequences.tagged_sentence_of, (bench_sequences.TAGGER_FAMILY,)))
    for _, spellings, hand in families for name, cls in spellings.items()}


@pytest.mark.parametrize("name", list(SENTENCE_SPELLINGS))
def test_sentence_models_on_cuda_equal_eager_on_cpu(name, trees):
    vocab, sample = trees
    torch.manual_seed(0)
    cls, hand, reading = SENTENCE_SPELLINGS[name]
    batch = bench_sequences.Sentences(*zip(*(reading(t) for t in sample)))
    assert bench_sequences.check_sentences(cls, cls(vocab), batch, hand, device="cuda") == {}


def test_top_down_model_on_cuda_equals_eager_on_cpu():
    starts = 2 * torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    assert bench_sequences.check_top_down(bench_sequences.top_down_model(16), starts, device="cuda") == {}


@pytest.mark.parametrize("mode", ["batched", "sequential", "threaded"])
def test_tree_rnn_example_trains_on_cuda_as_eager_on_cpu(mode, trees):
    vocab, sample = trees
    torch.manual_seed(0)
    base = TreeRNN(vocab)
    eager = eager_twin(TreeRNN)(vocab).double()
    eager.load_state_dict(base.state_dict())
    compiled = type("TreeRNN" + mode.title(), (TreeRNN,), {"encode": recompile.function(TreeRNN.encode.python,
                                                                                         mode=mode)})
    model = compiled(vocab).double().to("cuda")
    model.load_state_dict(base.state_dict())
    want = sum(eager.encode(tree, tree.root)[-1] for tree in sample)
    want_grads = gradients(eager, want)
    got = sum(model.encode(tree.to("cuda"), tree.root)[-1] for tree in sample)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(on_cpu(gradients(model, got)), want_grads, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", list(bench_in_place.PROGRAMS))
def test_in_place_programs_on_cuda_equal_eager_on_cpu(name):
    bench_in_place.check(bench_in_place.PROGRAMS[name], steps=9, device="cuda")


def added_at_indices(x, j):
    z = torch.zeros_like(x)
    z.index_add_(0, j, x * 2.0)
    return z.sigmoid().sum(-1)


def written_at_own_index(x, j):
    used = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    used[int(j[0])] = 1.0
    return (x.sum(-1) * used).sum() + x.square().sum()


ATTEND = torch.nn.MultiheadAttention(4, 2, batch_first=True).double()


def attended(x, j):
    keep = torch.arange(x.shape[0], device=x.device) <= j[0]
    out, _ = ATTEND(x[None], x[None], x[None], key_padding_mask=~keep[None], need_weights=False)
    return out[0].sum(-1)


@pytest.mark.parametrize("fn", [added_at_indices, written_at_own_index, attended])
def test_ops_with_rules_of_their_own_on_cuda_equal_eager_on_cpu(fn, monkeypatch):
    monkeypatch.setattr(recompile.config, "PER_INSTANCE", "error")
    ATTEND.eval()
    x = torch.randn(5, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    j = torch.tensor([[0, 2, 2, 5, 1, 3], [5, 4, 3, 2, 1, 0], [1, 1, 1, 1, 1, 1], [3, 0, 0, 0, 0, 0],
                      [2, 2, 4, 4, 0, 0]])
    xe = x.clone().requires_grad_()
    want = torch.stack([fn(xe[k], j[k]) for k in range(5)])
    want_grad = torch.autograd.grad(want.square().sum(), xe)[0]
    ATTEND.cuda()
    try:
        xb = x.cuda().requires_grad_()
        got = recompile.vmap(recompile.function(fn))(xb, j.cuda())
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), want.detach())
        torch.testing.assert_close(torch.autograd.grad(got.square().sum(), xb)[0].cpu(), want_grad)
    finally:
        ATTEND.cpu()


@pytest.mark.parametrize("fn", [saved.tanh_changed_where_unread, saved.exp_changed_in_a_loop_where_unread])
def test_a_change_by_some_instances_of_what_an_op_saved_keeps_eagers_gradient_on_cuda(fn):
    x = saved.X.clone().requires_grad_()
    want = torch.autograd.grad(saved.eager_loop(fn, x, saved.S).square().sum(), x)[0]
    xc = saved.X.cuda().requires_grad_()
    got = recompile.vmap(recompile.function(fn))(xc, saved.S.cuda())
    torch.testing.assert_close(torch.autograd.grad(got.square().sum(), xc)[0].cpu(), want)


def test_a_change_of_what_an_instance_needs_is_refused_on_cuda():
    xc = saved.X.cuda().requires_grad_()
    got = recompile.vmap(recompile.function(saved.tanh_changed_then_read))(xc, saved.S.cuda())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        got.sum().backward()
