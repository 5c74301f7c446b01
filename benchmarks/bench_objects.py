"""Models over what users hold, through ``recompile.map``, against the same models batched by hand, in one process.

    python benchmarks/bench_objects.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R]

Three models, each written as a researcher writes it for one example, and run over a minibatch of examples
with ``recompile.map(model.forward, examples)``, with no conversion of the data:

- a child-sum Tree-LSTM (Tai et al. 2015) over trees of the user's own node objects (``node.word``,
  ``node.label``, ``node.children``, a list of any length), with a loss at every node: SST's binary trees with
  each internal right child of the same label merged into its parent, so that a node has 2 to 12 children;
- a sequence-to-sequence model: an ``nn.LSTMCell`` encoder over a sentence of its own length (a tensor of word
  ids), then a greedy decoder that feeds back its own argmax and stops at the end token or at the target's
  length, returning its tokens as a Python list and its loss against the reversed sentence;
- the same with dot-product attention (Luong et al. 2015): the decoder fed the target, each step scoring the
  sentence's own encoder states (``torch.stack(states) @ h``, a length per sentence), its softmax weighing them.

Each is checked against its eager self first (float64: every example's values and the parameter gradients),
then timed against a version batched by hand (the tree by height, with ``index_add`` for the children's sums;
the sequences padded, the decoder with a mask of the sentences still going, the attention's scores masked past
each sentence's end), which reads tensors prepared from
the same examples before timing. The table gives examples/s and recompile / hand-batched, the runs taking turns.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from bench_batching import arguments, chunks, gradients, sst_trees, throughputs  # noqa: E402

import recompile  # noqa: E402

EMBED, HIDDEN, CLASSES = 300, 150, 5
START, END, WORDS = 0, 1, 1000  # (the sequence model's vocabulary: word ids folded into WORDS)


class Node:
    """A tree node as a user keeps one: its word (0 for a node with children), its label, its children."""

    __slots__ = ("word", "label", "children")

    def __init__(self, word, label, children):
        self.word, self.label, self.children = word, label, children


def nodes_of(tree):
    """SST ``tree`` as Nodes: each internal right child of its parent's label merged into it (n-ary nodes)."""
    left, right, words, labels = tree.left.tolist(), tree.right.tolist(), tree.words.tolist(), tree.labels.tolist()

    def build(i):
        if left[i] < 0:
            return Node(torch.tensor(words[i]), torch.tensor(labels[i]), [])
        children, r = [build(left[i])], right[i]
        while left[r] >= 0 and labels[r] == labels[i]:
            children.append(build(left[r]))
            r = right[r]
        children.append(build(r))
        return Node(torch.tensor(0), torch.tensor(labels[i]), children)

    return build(int(tree.root))


class ChildSumTreeLSTM(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, EMBED)
        self.ioux = nn.Linear(EMBED, 3 * HIDDEN)
        self.iouh = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.fx = nn.Linear(EMBED, HIDDEN)
        self.fh = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, CLASSES)

    @recompile.function
    def forward(self, node):
        """(h, c, the summed loss of the subtree's nodes)."""
        x = self.embed(node.word)
        hs, cs, loss = [], [], 0.0
        for child in node.children:
            h, c, child_loss = self.forward(child)
            hs.append(h)
            cs.append(c)
            loss = loss + child_loss
        h_sum = sum(hs) if hs else torch.zeros(HIDDEN, dtype=x.dtype)
        i, o, u = torch.chunk(self.ioux(x) + self.iouh(h_sum), 3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        fx = self.fx(x)
        for h_k, c_k in zip(hs, cs):
            c = c + torch.sigmoid(fx + self.fh(h_k)) * c_k
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c, loss + F.cross_entropy(self.out(h), node.label)


def tree_plan(roots):
    """The nodes of ``roots`` by height, as tensors: per height the words, and its nodes' children as pieces,
    one per lower height (that height, the children's rows in it, their parents' rows in this height); the
    labels in height order."""
    levels = []  # per height: its nodes
    where = {}

    def visit(node):
        height = 1 + max((visit(c) for c in node.children), default=-1)
        while len(levels) <= height:
            levels.append([])
        where[id(node)] = (height, len(levels[height]))
        levels[height].append(node)
        return height

    for root in roots:
        visit(root)
    plan = []
    for level in levels:
        pieces = {}  # lower height: (children's rows, parents' rows)
        for p, node in enumerate(level):
            for child in node.children:
                height, k = where[id(child)]
                rows, parents = pieces.setdefault(height, ([], []))
                rows.append(k)
                parents.append(p)
        plan.append((torch.stack([n.word for n in level]),
                     [(height, torch.tensor(rows), torch.tensor(parents)) for height, (rows, parents) in
                      sorted(pieces.items())]))
    labels = torch.stack([n.label for level in levels for n in level])
    return plan, labels


def hand_batched_tree(model, plan):
    """The summed loss of every node, one batch per height: each height's children read from the heights below
    by one index each, their sums by ``index_add``."""
    steps, labels = plan
    hs, cs = [], []
    for words, pieces in steps:
        x = model.embed(words)
        n = x.shape[0]
        h_sum = x.new_zeros(n, HIDDEN)
        c = x.new_zeros(n, HIDDEN)
        if pieces:
            parents = torch.cat([p for _, _, p in pieces])
            hk = torch.cat([hs[height].index_select(0, rows) for height, rows, _ in pieces])
            ck = torch.cat([cs[height].index_select(0, rows) for height, rows, _ in pieces])
            h_sum = h_sum.index_add(0, parents, hk)
        fx = model.fx(x)
        i, o, u = torch.chunk(model.ioux(x) + model.iouh(h_sum), 3, dim=-1)
        if pieces:
            c = c.index_add(0, parents, torch.sigmoid(fx.index_select(0, parents) + model.fh(hk)) * ck)
        c = torch.sigmoid(i) * torch.tanh(u) + c
        h = torch.sigmoid(o) * torch.tanh(c)
        hs.append(h)
        cs.append(c)
    return F.cross_entropy(model.out(torch.cat(hs)), labels, reduction="sum")


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(WORDS, EMBED)
        self.encoder = nn.LSTMCell(EMBED, HIDDEN)
        self.decoder = nn.LSTMCell(EMBED, HIDDEN)
        self.out = nn.Linear(HIDDEN, WORDS)

    @recompile.function
    def forward(self, words, target):
        """(the greedy tokens, a Python list; the summed loss against ``target``, which ends with END)."""
        h = torch.zeros(HIDDEN, dtype=self.out.weight.dtype)
        c = torch.zeros(HIDDEN, dtype=self.out.weight.dtype)
        for x in self.embed(words):
            h, c = self.encoder(x, (h, c))
        tokens, loss, token = [], 0.0, START
        for t in range(len(target)):
            h, c = self.decoder(self.embed.weight[token], (h, c))
            logits = self.out(h)
            loss = loss + F.cross_entropy(logits, target[t])
            token = int(logits.argmax())
            if token == END:
                break
            tokens.append(token)
        return tokens, loss


class AttentionSeq2Seq(Seq2Seq):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(2 * HIDDEN, HIDDEN)  # (the state and its context, to the output layer's input)

    @recompile.function
    def forward(self, words, target):
        """The summed loss against ``target``, fed in a word at a time, each step reading the encoder's states of
        the sentence (its own length) by dot-product attention."""
        h = torch.zeros(HIDDEN, dtype=self.out.weight.dtype)
        c = torch.zeros(HIDDEN, dtype=self.out.weight.dtype)
        states = []
        for x in self.embed(words):
            h, c = self.encoder(x, (h, c))
            states.append(h)
        encoded = torch.stack(states)  # (length, HIDDEN)
        loss, token = 0.0, START
        for t in range(len(target)):
            h, c = self.decoder(self.embed.weight[token], (h, c))
            weights = F.softmax(encoded @ h, dim=0)
            context = weights @ encoded
            logits = self.out(torch.tanh(self.mix(torch.cat([h, context]))))
            loss = loss + F.cross_entropy(logits, target[t])
            token = target[t]
        return loss


def sentence_pair(tree):
    """(words, target) of ``tree``'s sentence: its word ids folded into the vocabulary, and the reversed ones
    followed by END."""
    words = tree.words[tree.left < 0] % (WORDS - 2) + 2
    return words, torch.cat([words.flip(0), torch.tensor([END])])


def sequence_plan(pairs):
    """The padded words, targets and lengths of ``pairs``."""
    words, targets = zip(*pairs)
    return (nn.utils.rnn.pad_sequence(list(words), batch_first=True), torch.tensor([len(w) for w in words]),
            nn.utils.rnn.pad_sequence(list(targets), batch_first=True), torch.tensor([len(t) for t in targets]))


def hand_batched_sequences(model, plan):
    """(each pair's greedy tokens, the summed loss): the encoder over the padded words, each sentence's state
    taken at its end; the decoder run while any sentence goes on, a mask of those that do."""
    words, lengths, targets, target_lengths = plan
    n, longest = words.shape
    x = model.embed(words)
    h = x.new_zeros(n, HIDDEN)
    c = x.new_zeros(n, HIDDEN)
    for t in range(longest):
        going = (t < lengths).unsqueeze(1)
        h2, c2 = model.encoder(x[:, t], (h, c))
        h, c = torch.where(going, h2, h), torch.where(going, c2, c)
    token = torch.full((n,), START)
    going = torch.ones(n, dtype=torch.bool)
    loss, steps = 0.0, []
    for t in range(int(target_lengths.max())):
        going = going & (t < target_lengths)
        if not bool(going.any()):
            break
        h, c = model.decoder(model.embed(token), (h, c))
        logits = model.out(h)
        loss = loss + (F.cross_entropy(logits, targets[:, t], reduction="none") * going).sum()
        token = logits.argmax(1)
        going = going & (token != END)
        steps.append(torch.where(going, token, -1))
    tokens = torch.stack(steps, 1).tolist() if steps else [[] for _ in range(n)]
    return [[k for k in row if k >= 0] for row in tokens], loss


def hand_batched_attention(model, plan):
    """The summed loss: the encoder over the padded words, every step's states kept (each sentence's last one
    carried past its end); the decoder fed the padded targets, its attention masked past each sentence's end, its
    loss past each target's end."""
    words, lengths, targets, target_lengths = plan
    n, longest = words.shape
    x = model.embed(words)
    h = x.new_zeros(n, HIDDEN)
    c = x.new_zeros(n, HIDDEN)
    states = []
    for t in range(longest):
        going = (t < lengths).unsqueeze(1)
        h2, c2 = model.encoder(x[:, t], (h, c))
        h, c = torch.where(going, h2, h), torch.where(going, c2, c)
        states.append(h)
    encoded = torch.stack(states, 1)  # (n, longest, HIDDEN)
    outside = torch.arange(longest) >= lengths[:, None]
    token = torch.full((n,), START)
    loss = 0.0
    for t in range(int(target_lengths.max())):
        h, c = model.decoder(model.embed(token), (h, c))
        scores = torch.bmm(encoded, h.unsqueeze(2)).squeeze(2).masked_fill(outside, float("-inf"))
        context = torch.bmm(F.softmax(scores, dim=1).unsqueeze(1), encoded).squeeze(1)
        logits = model.out(torch.tanh(model.mix(torch.cat([h, context], 1))))
        loss = loss + (F.cross_entropy(logits, targets[:, t], reduction="none") * (t < target_lengths)).sum()
        token = targets[:, t]
    return loss


def check_tree(base, roots):
    """Raise unless the Tree-LSTM through ``recompile.map`` and by hand give eager's values and gradients."""
    model = ChildSumTreeLSTM(base.embed.num_embeddings).double()
    model.load_state_dict(base.state_dict())
    want = [model.forward.python(model, root) for root in roots]
    want_grads = gradients(model, sum(w[2] for w in want))
    got = recompile.map(model, roots)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, sum(g[2] for g in got)), want_grads, rtol=1e-7, atol=1e-9)
    by_hand = hand_batched_tree(model, tree_plan(roots))
    torch.testing.assert_close(by_hand, sum(w[2] for w in want).detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, by_hand), want_grads, rtol=1e-7, atol=1e-9)


def check_sequences(base, pairs):
    """Raise unless the sequence model through ``recompile.map`` and by hand give eager's tokens, losses and
    gradients."""
    model = Seq2Seq().double()
    model.load_state_dict(base.state_dict())
    want = [model.forward.python(model, *pair) for pair in pairs]
    want_grads = gradients(model, sum(w[1] for w in want))
    got = recompile.map(model, *zip(*pairs))
    assert [g[0] for g in got] == [w[0] for w in want]
    torch.testing.assert_close(torch.stack([g[1] for g in got]), torch.stack([w[1] for w in want]).detach(),
                               rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, sum(g[1] for g in got)), want_grads, rtol=1e-7, atol=1e-9)
    tokens, loss = hand_batched_sequences(model, sequence_plan(pairs))
    assert tokens == [w[0] for w in want]
    torch.testing.assert_close(loss, sum(w[1] for w in want).detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, loss), want_grads, rtol=1e-7, atol=1e-9)


def check_attention(base, pairs):
    """Raise unless the attention model through ``recompile.map`` and by hand give eager's losses and
    gradients."""
    model = AttentionSeq2Seq().double()
    model.load_state_dict(base.state_dict())
    want = torch.stack([model.forward.python(model, *pair) for pair in pairs])
    want_grads = gradients(model, want.sum())
    got = torch.stack(recompile.map(model, *zip(*pairs)))
    torch.testing.assert_close(got, want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, got.sum()), want_grads, rtol=1e-7, atol=1e-9)
    loss = hand_batched_attention(model, sequence_plan(pairs))
    torch.testing.assert_close(loss, want.sum().detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, loss), want_grads, rtol=1e-7, atol=1e-9)


def main(argv=None):
    args = arguments(__doc__).parse_args(argv)
    data, sst, trees = sst_trees(args)
    print(f"{len(trees)} SST trees from {data}, {args.threads} torch thread(s); each model checked against eager "
          "(float64: every example's values, and the parameter gradients) before it is timed")
    torch.manual_seed(0)
    roots = [nodes_of(tree) for tree in trees]
    pairs = [sentence_pair(tree) for tree in trees]
    models = (("child-sum Tree-LSTM over node objects", ChildSumTreeLSTM(len(sst.vocab)), roots, check_tree,
               tree_plan, lambda m, plan: hand_batched_tree(m, plan),
               lambda m, batch: sum(r[2] for r in recompile.map(m, batch))),
              ("seq2seq, LSTMCell, greedy decoder", Seq2Seq(), pairs, check_sequences, sequence_plan,
               lambda m, plan: hand_batched_sequences(m, plan)[1],
               lambda m, batch: sum(r[1] for r in recompile.map(m, *zip(*batch)))),
              ("seq2seq with attention, target fed in", AttentionSeq2Seq(), pairs, check_attention, sequence_plan,
               hand_batched_attention, lambda m, batch: sum(recompile.map(m, *zip(*batch)))))
    for name, base, examples, check, plan_of, hand_loss, rec_loss in models:
        check(base, examples[:8])
        print(f"{name}: recompile.map and hand-batched match eager")
        hand = type(base)(*([len(sst.vocab)] if isinstance(base, ChildSumTreeLSTM) else []))
        hand.load_state_dict(base.state_dict())
        print(f"  {'mode':>9} {'batch':>5} {'hand ex/s':>10} {'recompile ex/s':>15} {'rec/hand':>9}")
        for mode, train in (("inference", False), ("training", True)):
            for size in args.batch:
                groups = chunks(examples, size)
                plans = [_Planned(plan_of(group), len(group)) for group in groups]
                runs = {"hand": (lambda plan, m=hand: hand_loss(m, plan.plan), hand, plans),
                        "recompile": (lambda batch, m=base: rec_loss(m, batch), base, groups)}
                best = throughputs(runs, train, args.repeats)
                rec = best["recompile"]
                if isinstance(rec, Exception):
                    raise rec
                print(f"  {mode:>9} {size:5d} {best['hand']:10.1f} {rec:15.1f} {rec / best['hand']:8.2f}x")


class _Planned:
    """A minibatch's tensors for the hand-batched run (``len``: its examples)."""

    def __init__(self, plan, count):
        self.plan, self.count = plan, count

    def __len__(self):
        return self.count


if __name__ == "__main__":
    main()
