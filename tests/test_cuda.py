"""The batched paths on a CUDA device give what eager PyTorch gives on the CPU (float64: values and parameter
gradients): every Tree-LSTM, RNTN and module-cell spelling of the idiom benchmark, every sentence model of the
sequence benchmark (the packed-RNN path among them) and the top-down model, each with no per-instance op, and
the Tree-RNN example trained in each mode. Skipped without a CUDA device (CI has none); the threaded runtime's
own CUDA tests are in test_threaded.py."""

import os
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import bench_idioms  # noqa: E402
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
