"""Models as users copy them from public code, through ``recompile.map``, against the same code run eagerly.

    python benchmarks/bench_copied.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R]

Three models, each the code of a well-known public implementation as its users copy it, unchanged but for the
decorator on the method that recurses or loops, over examples made from SST's train trees:

- treelstm.pytorch's child-sum Tree-LSTM (Tai et al. 2015): ``node_forward`` with ``torch.split``,
  ``repeat(len(child_h), 1)`` and sums with ``keepdim``, a leaf's states
  ``inputs[0].detach().new(1, H).fill_(0.).requires_grad_()``, a node's its children's ``torch.cat``; its
  states returned by each call, a classifier at the root;
- the same as that repository writes it, each node's states stored on the node (``tree.state = ...``) and read
  back by its parent (``map(lambda x: x.state, tree.children)``);
- PyTorch's sequence-to-sequence tutorial: its ``EncoderRNN`` (an ``nn.GRU`` stepped one word at a time) filling
  ``encoder_outputs[ei]``, its ``AttnDecoderRNN`` (dropout, attention over ``MAX_LENGTH`` slots, ``torch.bmm``)
  fed the target (teacher forcing), the loss added up with ``loss +=``.

There is no hand-batched version of these: each is timed against the same code run eagerly, one example at a
time, examples/s and recompile / eager, the runs taking turns; the per-instance ops recompile ran are listed
(what it could not batch, and warned of). Each is checked against eager first (float64: every example's loss
and the parameter gradients).
"""

import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from bench_batching import arguments, chunks, gradients, sst_trees, throughputs  # noqa: E402

import recompile  # noqa: E402

EMBED, HIDDEN, CLASSES, WORDS = 300, 150, 5, 1000
SOS, EOS = 0, 1


class Tree:
    """treelstm.pytorch's tree: ``idx`` the node's word in the sentence, ``children``, ``num_children``."""

    def __init__(self):
        self.parent, self.num_children, self.children, self.idx = None, 0, [], 0

    def add_child(self, child):
        child.parent = self
        self.num_children += 1
        self.children.append(child)


def tai_example(tree):
    """(the Tree, the sentence's word ids and one more for the nodes with children, the root's label)."""
    left, right, words = tree.left.tolist(), tree.right.tolist(), tree.words.tolist()
    leaves = [i for i in range(len(left)) if left[i] < 0]
    position = {i: k for k, i in enumerate(leaves)}

    def build(i):
        node = Tree()
        node.idx = position.get(i, len(leaves))  # (a node with children reads the extra word: an unknown one)
        if left[i] >= 0:
            node.add_child(build(left[i]))
            node.add_child(build(right[i]))
        return node

    sentence = torch.tensor([words[i] for i in leaves] + [0])
    return build(int(tree.root)), sentence, tree.labels[int(tree.root)]


class ChildSumTreeLSTM(nn.Module):
    """treelstm.pytorch's model/ChildSumTreeLSTM, its states returned."""

    def __init__(self, in_dim, mem_dim):
        super().__init__()
        self.in_dim = in_dim
        self.mem_dim = mem_dim
        self.ioux = nn.Linear(self.in_dim, 3 * self.mem_dim)
        self.iouh = nn.Linear(self.mem_dim, 3 * self.mem_dim)
        self.fx = nn.Linear(self.in_dim, self.mem_dim)
        self.fh = nn.Linear(self.mem_dim, self.mem_dim)

    def node_forward(self, inputs, child_c, child_h):
        child_h_sum = torch.sum(child_h, dim=0, keepdim=True)
        iou = self.ioux(inputs) + self.iouh(child_h_sum)
        i, o, u = torch.split(iou, iou.size(1) // 3, dim=1)
        i, o, u = torch.sigmoid(i), torch.sigmoid(o), torch.tanh(u)
        f = torch.sigmoid(self.fh(child_h) + self.fx(inputs).repeat(len(child_h), 1))
        fc = torch.mul(f, child_c)
        c = torch.mul(i, u) + torch.sum(fc, dim=0, keepdim=True)
        h = torch.mul(o, torch.tanh(c))
        return c, h

    @recompile.function
    def forward(self, tree, inputs):
        states = [self.forward(tree.children[idx], inputs) for idx in range(tree.num_children)]
        if tree.num_children == 0:
            child_c = inputs[0].detach().new(1, self.mem_dim).fill_(0.).requires_grad_()
            child_h = inputs[0].detach().new(1, self.mem_dim).fill_(0.).requires_grad_()
        else:
            child_c, child_h = zip(*states)
            child_c, child_h = torch.cat(child_c, dim=0), torch.cat(child_h, dim=0)
        return self.node_forward(inputs[tree.idx].unsqueeze(0), child_c, child_h)


class StoringTreeLSTM(ChildSumTreeLSTM):
    """The same as treelstm.pytorch writes it: each node's states stored on the node."""

    @recompile.function
    def forward(self, tree, inputs):
        for idx in range(tree.num_children):
            self.forward(tree.children[idx], inputs)
        if tree.num_children == 0:
            child_c = inputs[0].detach().new(1, self.mem_dim).fill_(0.).requires_grad_()
            child_h = inputs[0].detach().new(1, self.mem_dim).fill_(0.).requires_grad_()
        else:
            child_c, child_h = zip(*map(lambda x: x.state, tree.children))
            child_c, child_h = torch.cat(child_c, dim=0), torch.cat(child_h, dim=0)
        tree.state = self.node_forward(inputs[tree.idx].unsqueeze(0), child_c, child_h)
        return tree.state


class SentimentTree(nn.Module):
    """An embedding, one of the Tree-LSTMs above, and a classifier of the root's state."""

    def __init__(self, vocab_size, encoder=ChildSumTreeLSTM):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, EMBED)
        self.childsumtreelstm = encoder(EMBED, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    @recompile.function
    def forward(self, tree, sentence, label):
        c, h = self.childsumtreelstm(tree, self.emb(sentence))
        return F.cross_entropy(self.out(h), label.view(1))


class EncoderRNN(nn.Module):
    """PyTorch's tutorial "NLP From Scratch: Translation with a Sequence to Sequence Network and Attention"."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output = embedded
        output, hidden = self.gru(output, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size)


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, max_length, dropout_p=0.1):
        super().__init__()
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.dropout_p = dropout_p
        self.max_length = max_length
        self.embedding = nn.Embedding(self.output_size, self.hidden_size)
        self.attn = nn.Linear(self.hidden_size * 2, self.max_length)
        self.attn_combine = nn.Linear(self.hidden_size * 2, self.hidden_size)
        self.dropout = nn.Dropout(self.dropout_p)
        self.gru = nn.GRU(self.hidden_size, self.hidden_size)
        self.out = nn.Linear(self.hidden_size, self.output_size)

    def forward(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)
        attn_weights = F.softmax(self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0), encoder_outputs.unsqueeze(0))
        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)
        output = F.relu(output)
        output, hidden = self.gru(output, hidden)
        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights


class Translator(nn.Module):
    """The tutorial's ``train`` step for one pair, teacher forcing always on, as a module."""

    def __init__(self, max_length):
        super().__init__()
        self.max_length = max_length
        self.encoder = EncoderRNN(WORDS, HIDDEN)
        self.decoder = AttnDecoderRNN(HIDDEN, WORDS, max_length)

    @recompile.function
    def forward(self, input_tensor, target_tensor):
        encoder_hidden = self.encoder.initHidden().to(self.decoder.out.weight.dtype)
        input_length = input_tensor.size(0)
        target_length = target_tensor.size(0)
        encoder_outputs = torch.zeros(self.max_length, self.encoder.hidden_size,
                                      dtype=self.decoder.out.weight.dtype)
        loss = 0
        for ei in range(input_length):
            encoder_output, encoder_hidden = self.encoder(input_tensor[ei], encoder_hidden)
            encoder_outputs[ei] = encoder_output[0, 0]
        decoder_input = torch.tensor([[SOS]])
        decoder_hidden = encoder_hidden
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = self.decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            loss += F.nll_loss(decoder_output, target_tensor[di])
            decoder_input = target_tensor[di]  # Teacher forcing
        return loss / target_length


def translation_pair(tree):
    """(a sentence's words folded into WORDS, as the tutorial's (n, 1) tensor with EOS; the same reversed)."""
    words = [2 + w % (WORDS - 2) for w in tree.words[tree.left < 0].tolist()] + [EOS]
    return torch.tensor(words).view(-1, 1), torch.tensor(words[-2::-1] + [EOS]).view(-1, 1)


def check(model, examples):
    """Raise unless ``recompile.map`` gives eager's losses and parameter gradients (float64)."""
    model = model.double()
    with recompile.disable():
        want = torch.stack([model(*example) for example in examples])
    want_grads = gradients(model, want.sum())
    got = torch.stack(recompile.map(model, *zip(*examples)))
    torch.testing.assert_close(got, want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, got.sum()), want_grads, rtol=1e-7, atol=1e-9)
    model.float()


def per_instance_ops(model, examples):
    """The ops a run over ``examples`` ran once per instance, as ``stats`` counts them."""
    compiled = type(model).forward
    compiled.stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recompile.PerInstanceWarning)
        recompile.map(model, *zip(*examples))
    return compiled.stats["per_instance"]


def main(argv=None):
    args = arguments(__doc__).parse_args(argv)
    data, sst, trees = sst_trees(args)
    print(f"{len(trees)} SST trees from {data}, {args.threads} torch thread(s); each model checked against eager "
          "(float64: every example's loss, and the parameter gradients) before it is timed")
    torch.manual_seed(0)
    tai = [tai_example(tree) for tree in trees]
    pairs = [translation_pair(tree) for tree in trees]
    longest = max(len(source) for source, _ in pairs)
    models = (("treelstm.pytorch's child-sum Tree-LSTM, states returned", SentimentTree(len(sst.vocab)), tai),
              ("the same, states stored on the nodes", SentimentTree(len(sst.vocab), StoringTreeLSTM), tai),
              ("PyTorch's seq2seq tutorial (GRU encoder, attention decoder)", Translator(longest), pairs))
    for name, model, examples in models:
        model.eval()  # (the tutorial's dropout: eval, so that eager and recompile draw nothing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", recompile.PerInstanceWarning)
            check(model, examples[:6])
        ops = per_instance_ops(model, examples[:32])
        print(f"{name}: recompile.map matches eager; per-instance ops: "
              f"{', '.join(f'{k} ({v})' for k, v in sorted(ops.items())) or 'none'}")
        print(f"  {'mode':>9} {'batch':>5} {'eager ex/s':>11} {'recompile ex/s':>15} {'rec/eager':>10}")
        for mode, train in (("inference", False), ("training", True)):
            for size in args.batch:
                groups = chunks(examples, size)

                def eager(batch, m=model):
                    with recompile.disable():
                        return sum(m(*example) for example in batch)

                def batched(batch, m=model):
                    return sum(recompile.map(m, *zip(*batch)))

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", recompile.PerInstanceWarning)
                    best = throughputs({"eager": (eager, model, groups), "recompile": (batched, model, groups)},
                                       train, args.repeats)
                for run in best.values():
                    if isinstance(run, Exception):
                        raise run
                print(f"  {mode:>9} {size:5d} {best['eager']:11.1f} {best['recompile']:15.1f} "
                      f"{best['recompile'] / best['eager']:9.2f}x")


if __name__ == "__main__":
    main()
