"""A variable-length LSTM and a top-down tree generator as users write them, each against hand-batched PyTorch.

    python benchmarks/bench_sequences.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R]

The idiom suite's models that are not bottom-up trees (``bench_idioms.py`` has those):

- A sentence classifier: an ``nn.LSTMCell`` run over each SST sentence's words, the last state classified
  (embedding 300, hidden 150, 5 classes, one cross-entropy per sentence). Written five ways, ``for t in
  range(n)``, ``while t < n``, ``for w in words[:n]`` and ``for x in self.embed(words[:n])``, and as an
  ``nn.LSTM`` over each sentence (``self.lstm(self.embed(words[:n]))``), over padded word rows and per-sentence
  lengths through ``recompile.vmap``; against the same parameters in one ``nn.LSTM``
  over the packed minibatch (``pack_padded_sequence``), the way a PyTorch user batches sentences of different
  lengths by hand. And the states averaged over the sentence, two ways (``total = total + h``, ``total / n``;
  ``hs.append(h)``, ``torch.stack(hs).mean(0)``), against the packed ``nn.LSTM``'s states padded with zeros
  and summed; two layers of cells, against a 2-layer ``nn.LSTM``; attention over the states (a softmax of
  ``self.att(states)`` along the sentence), against the padded states with the softmax masked; and both
  directions (a second cell over ``reversed(range(n))``), against a bidirectional ``nn.LSTM``.
- Recurrences written out, no cell module: an Elman RNN (``h = torch.tanh(self.ih(x) + self.hh(h))``) and an
  LSTM's gates (``(self.ih(x) + self.hh(h)).chunk(4)``), against the same steps over the padded minibatch, every
  word's input product at once and the sentences that ended kept by ``torch.where``, as a user batches a cell of
  their own by hand.
- A text CNN (Kim 2014): convolutions of widths 3, 4 and 5 over each sentence's embedded words, each filter's
  largest output over the sentence; written ``conv(self.embed(words[:n]).t().unsqueeze(0))``, ``.max(dim=2)``
  and ``xs[None].transpose(1, 2)``, ``F.max_pool1d(y, y.size(2))``; against the convolutions over the padded
  minibatch, the padding's words zeroed and the outputs past each end masked out of the max.
- A tagger: a tag per word (each SST leaf's sentiment), the loss summed over the words. Written as PyTorch's
  LSTM tagger tutorial writes it (``self.lstm(embeds.view(n, 1, -1))``, ``lstm_out.view(n, -1)``, ``log_softmax``
  and ``nll_loss`` of ``tags[:n]``) and as a cell's loop adding each step's loss; against the packed ``nn.LSTM``
  whose packed outputs are scored as they lie.
- A linear-chain CRF over an ``nn.LSTM``'s scores of each sentence (the SST leaves' labels its tags): the gold
  path read tag by tag, the forward algorithm a ``logsumexp`` per step, each a loop over the sentence; against
  the same forward algorithm over the padded minibatch, the sentences that ended kept by ``torch.where``.
- A top-down model that grows a tree from a start state while ``depth < MAX_DEPTH and p > 0.5`` (its gate
  ``p`` computed from the state): per-instance trees of different shapes decided at run time. Against the
  same model batched by hand depth by depth (the instances that expand gathered, their children's states
  computed at once, the results scattered back on the way up).

Each is checked against its eager twin (float64: per-instance values and the parameter gradients) and its
per-instance ops counted (``stats["per_instance"]``, which should be empty) before it is timed. Throughput
is sentences (or start states) per second, best of --repeats, the runs taking turns; training is
forward, backward and an SGD step per minibatch.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from bench_batching import arguments, chunks, gradients, on_cpu, sst_trees, throughputs  # noqa: E402

import recompile  # noqa: E402

# -- the sentence LSTM


class SentenceLSTM(nn.Module):
    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.cell = nn.LSTMCell(embed, hidden)
        self.out = nn.Linear(hidden, classes)

    def classify(self, words, n, label):
        """Cross-entropy of the sentence ``words[:n]`` (``for t in range(n)``)."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for t in range(n):
            h, c = self.cell(self.embed(words[t]), (h, c))
        return F.cross_entropy(self.out(h), label)


class SentenceLSTMWhile(SentenceLSTM):
    def classify(self, words, n, label):
        """The same loop as ``while t < n``."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        t = 0
        while t < n:
            h, c = self.cell(self.embed(words[t]), (h, c))
            t = t + 1
        return F.cross_entropy(self.out(h), label)


class SentenceLSTMPrefix(SentenceLSTM):
    def classify(self, words, n, label):
        """The same loop as ``for w in words[:n]``."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for w in words[:n]:
            h, c = self.cell(self.embed(w), (h, c))
        return F.cross_entropy(self.out(h), label)


class SentenceLSTMEmbedded(SentenceLSTM):
    def classify(self, words, n, label):
        """The sentence embedded first, ``for x in self.embed(words[:n])``."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for x in self.embed(words[:n]):
            h, c = self.cell(x, (h, c))
        return F.cross_entropy(self.out(h), label)


class SentenceLSTMModule(SentenceLSTM):
    """The cell's parameters also held as one ``nn.LSTM`` (not a submodule: the state dict stays the cell's)."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        lstm = nn.LSTM(embed, hidden)
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            setattr(lstm, f"{name}_l0", getattr(self.cell, name))
        object.__setattr__(self, "lstm", lstm)

    def classify(self, words, n, label):
        """An ``nn.LSTM`` over each sentence, ``_, (h, c) = self.lstm(self.embed(words[:n]))``."""
        _, (h, c) = self.lstm(self.embed(words[:n]))
        return F.cross_entropy(self.out(h[-1]), label)


class TwoLayerLSTM(SentenceLSTM):
    """Two cells a step, the second over the first's state (a 2-layer LSTM written with cells)."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        self.cell2 = nn.LSTMCell(hidden, hidden)

    def classify(self, words, n, label):
        """Two LSTMCell layers, ``while t < n``."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        h2 = torch.zeros(self.cell2.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c2 = torch.zeros(self.cell2.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        t = 0
        while t < n:
            h, c = self.cell(self.embed(words[t]), (h, c))
            h2, c2 = self.cell2(h, (h2, c2))
            t = t + 1
        return F.cross_entropy(self.out(h2), label)


class PooledLSTM(SentenceLSTM):
    def classify(self, words, n, label):
        """The states averaged over the sentence (``total = total + h``, then ``total / n``)."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        total = torch.zeros_like(h)
        for t in range(n):
            h, c = self.cell(self.embed(words[t]), (h, c))
            total = total + h
        return F.cross_entropy(self.out(total / n), label)


class CollectedLSTM(SentenceLSTM):
    def classify(self, words, n, label):
        """The states collected in a list and averaged (``hs.append(h)``, then ``torch.stack(hs).mean(0)``)."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        hs = []
        for t in range(n):
            h, c = self.cell(self.embed(words[t]), (h, c))
            hs.append(h)
        return F.cross_entropy(self.out(torch.stack(hs).mean(0)), label)


class AttendedLSTM(SentenceLSTM):
    """Attention over the sentence's states, a weight per word from ``self.att``."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        self.att = nn.Linear(hidden, 1)

    def classify(self, words, n, label):
        """Attention: ``hs.append(h)``, a softmax of ``self.att(states)`` along the sentence.

        The weights scale the states (``weights[:, None] * states``), summed."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        hs = []
        for t in range(n):
            h, c = self.cell(self.embed(words[t]), (h, c))
            hs.append(h)
        states = torch.stack(hs)
        weights = torch.softmax(self.att(states).squeeze(-1), 0)
        return F.cross_entropy(self.out((weights[:, None] * states).sum(0)), label)


class BiLSTM(SentenceLSTM):
    """A second cell over the sentence backwards, the two last states classified together."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        self.back = nn.LSTMCell(embed, hidden)
        self.out = nn.Linear(2 * hidden, classes)

    def classify(self, words, n, label):
        """Both directions: ``for t in range(n)``, then ``for t in reversed(range(n))``.

        One cell each, over ``xs = self.embed(words[:n])``."""
        xs = self.embed(words[:n])
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for t in range(n):
            h, c = self.cell(xs[t], (h, c))
        hb = torch.zeros(self.back.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        cb = torch.zeros(self.back.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for t in reversed(range(n)):
            hb, cb = self.back(xs[t], (hb, cb))
        return F.cross_entropy(self.out(torch.cat([h, hb])), label)


class TaggerLSTM(SentenceLSTMModule):
    def classify(self, words, n, tags):
        """A tag per word as PyTorch's tutorial writes it: ``self.lstm(embeds.view(n, 1, -1))``.

        The scores ``self.out(lstm_out.view(n, -1))``, ``F.nll_loss`` of their ``log_softmax`` and ``tags[:n]``,
        summed over the words."""
        embeds = self.embed(words[:n])
        lstm_out, _ = self.lstm(embeds.view(n, 1, -1))
        tag_space = self.out(lstm_out.view(n, -1))
        tag_scores = F.log_softmax(tag_space, dim=1)
        return F.nll_loss(tag_scores, tags[:n], reduction="sum")


class TaggerCell(SentenceLSTM):
    def classify(self, words, n, tags):
        """A tag per word, a cell's loop adding each step's cross-entropy (``loss = loss + ...``)."""
        h = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.cell.hidden_size, dtype=self.out.weight.dtype, device=self.out.weight.device)
        loss = torch.zeros((), dtype=self.out.weight.dtype, device=self.out.weight.device)
        for t in range(n):
            h, c = self.cell(self.embed(words[t]), (h, c))
            loss = loss + F.cross_entropy(self.out(h), tags[t])
        return loss


class CRFTagger(SentenceLSTMModule):
    """A tag per word scored by an ``nn.LSTM`` over the sentence, the tags a linear-chain CRF's."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        self.trans = nn.Parameter(0.1 * torch.randn(classes, classes))
        self.start = nn.Parameter(0.1 * torch.randn(classes))

    def classify(self, words, n, tags):
        """A CRF's negative log-likelihood of ``tags[:n]``: the gold path's score read tag by tag
        (``self.trans[tags[t - 1], tags[t]] + emits[t, tags[t]]``), the forward algorithm's ``logsumexp`` a step."""
        out, _ = self.lstm(self.embed(words[:n]))
        emits = self.out(out)
        tags = tags[:n]
        gold = self.start[tags[0]] + emits[0, tags[0]]
        for t in range(1, n):
            gold = gold + self.trans[tags[t - 1], tags[t]] + emits[t, tags[t]]
        alpha = self.start + emits[0]
        for t in range(1, n):
            alpha = torch.logsumexp(alpha.unsqueeze(1) + self.trans, 0) + emits[t]
        return torch.logsumexp(alpha, 0) - gold


class ElmanRNN(nn.Module):
    """A sentence classifier whose recurrence is written out, no cell module: an Elman RNN."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.ih = nn.Linear(embed, hidden)
        self.hh = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, classes)

    def classify(self, words, n, label):
        """An Elman RNN written out, ``h = torch.tanh(self.ih(x) + self.hh(h))``, its last state classified."""
        h = torch.zeros(self.hh.in_features, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for t in range(n):
            h = torch.tanh(self.ih(self.embed(words[t])) + self.hh(h))
        return F.cross_entropy(self.out(h), label)


class WrittenLSTM(ElmanRNN):
    """An LSTM whose gates are written out (two Linear layers, their sum chunked in four)."""

    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__(vocab_size, embed, hidden, classes)
        self.ih = nn.Linear(embed, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden, bias=False)

    def classify(self, words, n, label):
        """An LSTM's gates written out, ``(self.ih(x) + self.hh(h)).chunk(4)``, its last state classified."""
        h = torch.zeros(self.hh.in_features, dtype=self.out.weight.dtype, device=self.out.weight.device)
        c = torch.zeros(self.hh.in_features, dtype=self.out.weight.dtype, device=self.out.weight.device)
        for t in range(n):
            i, f, g, o = (self.ih(self.embed(words[t])) + self.hh(h)).chunk(4)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return F.cross_entropy(self.out(h), label)


class TextCNN(nn.Module):
    """Kim's (2014) sentence CNN: convolutions of widths 3, 4 and 5 over the sentence's embedded words, each
    filter's largest output over the sentence, classified."""

    def __init__(self, vocab_size, embed=300, filters=100, widths=(3, 4, 5), classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.convs = nn.ModuleList([nn.Conv1d(embed, filters, k, padding=k // 2) for k in widths])
        self.out = nn.Linear(filters * len(widths), classes)

    def classify(self, words, n, label):
        """Cross-entropy of the sentence ``words[:n]`` (``Conv1d`` over ``xs.t().unsqueeze(0)``)."""
        x = self.embed(words[:n]).t().unsqueeze(0)  # (1, embed, n)
        features = [F.relu(conv(x)).max(dim=2).values for conv in self.convs]
        return F.cross_entropy(self.out(torch.cat(features, 1)), label.unsqueeze(0))


class TextCNN2d(TextCNN):
    def classify(self, words, n, label):
        """Cross-entropy of the sentence ``words[:n]`` (``xs[None].transpose(1, 2)``, ``max_pool1d``)."""
        x = self.embed(words[:n])[None].transpose(1, 2)  # (1, embed, n)
        features = []
        for conv in self.convs:
            y = F.relu(conv(x))
            features.append(F.max_pool1d(y, y.size(2)).squeeze(2))
        return F.cross_entropy(self.out(torch.cat(features, 1)), label.view(1))


def compiled(cls):
    return type(cls.__name__ + "Compiled", (cls,), {"classify": recompile.function(cls.classify)})


class Sentences:
    """A minibatch of sentences: word ids padded to the longest (rows), lengths, labels (one per sentence, or a
    tag per word: padded as the words are)."""

    def __init__(self, sentences, labels):
        self.lengths = torch.tensor([len(s) for s in sentences])
        self.words = _padded(sentences, int(self.lengths.max()))
        self.labels = _padded(labels, int(self.lengths.max())) if type(labels[0]) is list else torch.tensor(labels)

    def __len__(self):
        return len(self.labels)


def _padded(rows, width):
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for k, row in enumerate(rows):
        out[k, :len(row)] = torch.tensor(row)
    return out


def sentence_of(tree):
    """A tree's words in sentence order (its leaves, post-order), and its root's label."""
    leaves = tree.is_leaf.nonzero().view(-1)
    return tree.words[leaves].tolist(), int(tree.labels[tree.root])


def tagged_sentence_of(tree):
    """A tree's words in sentence order, and each word's tag (its leaf's label)."""
    leaves = tree.is_leaf.nonzero().view(-1)
    return tree.words[leaves].tolist(), tree.labels[leaves].tolist()


def packed_lstm(model):
    """An ``nn.LSTM`` holding the very parameters of ``model.cell`` (and ``model.cell2``, as its second layer;
    ``model.back``, as its reverse direction); None for a model without cells (a CNN)."""
    if not hasattr(model, "cell"):
        return None
    cells = [model.cell] + ([model.cell2] if hasattr(model, "cell2") else [])
    back = getattr(model, "back", None)
    lstm = nn.LSTM(model.cell.input_size, model.cell.hidden_size, num_layers=len(cells), batch_first=True,
                   bidirectional=back is not None)
    for layer, cell in enumerate(cells):
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            setattr(lstm, f"{name}_l{layer}", getattr(cell, name))
            if back is not None:
                setattr(lstm, f"{name}_l{layer}_reverse", getattr(back, name))
    return lstm.to(model.out.weight.dtype)


def hand_batched_sentences(model, lstm, batch):
    """The minibatch's summed loss by hand: one ``nn.LSTM`` over the packed sentences."""
    packed = nn.utils.rnn.pack_padded_sequence(model.embed(batch.words), batch.lengths, batch_first=True,
                                               enforce_sorted=False)
    _, (h, _) = lstm(packed)
    return F.cross_entropy(model.out(h[-1]), batch.labels, reduction="sum")


def hand_batched_pooled(model, lstm, batch):
    """``PooledLSTM``'s minibatch loss by hand: one ``nn.LSTM`` over the packed sentences, every step's state
    padded with zeros, summed over the steps and divided by the lengths."""
    packed = nn.utils.rnn.pack_padded_sequence(model.embed(batch.words), batch.lengths, batch_first=True,
                                               enforce_sorted=False)
    out, _ = lstm(packed)
    states, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    mean = states.sum(1) / batch.lengths.unsqueeze(1)
    return F.cross_entropy(model.out(mean), batch.labels, reduction="sum")


def hand_batched_attended(model, lstm, batch):
    """``AttendedLSTM``'s minibatch loss by hand: one ``nn.LSTM`` over the packed sentences, the states padded,
    the attention's softmax over each sentence's words (the padding masked with -inf)."""
    packed = nn.utils.rnn.pack_padded_sequence(model.embed(batch.words), batch.lengths, batch_first=True,
                                               enforce_sorted=False)
    out, _ = lstm(packed)
    states, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    scores = model.att(states).squeeze(-1)
    words = torch.arange(states.shape[1], device=states.device) < batch.lengths.to(states.device).unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(~words, float("-inf")), 1)
    pooled = (weights.unsqueeze(-1) * states).sum(1)
    return F.cross_entropy(model.out(pooled), batch.labels, reduction="sum")


def hand_batched_bidirectional(model, lstm, batch):
    """``BiLSTM``'s minibatch loss by hand: one bidirectional ``nn.LSTM`` over the packed sentences, the two
    directions' last states classified together."""
    packed = nn.utils.rnn.pack_padded_sequence(model.embed(batch.words), batch.lengths, batch_first=True,
                                               enforce_sorted=False)
    _, (h, _) = lstm(packed)
    return F.cross_entropy(model.out(torch.cat([h[0], h[1]], -1)), batch.labels, reduction="sum")


def hand_batched_tagger(model, lstm, batch):
    """A tagger's minibatch loss by hand: one ``nn.LSTM`` over the packed sentences, its packed outputs scored as
    they lie against the tags packed alike."""
    packed = nn.utils.rnn.pack_padded_sequence(model.embed(batch.words), batch.lengths, batch_first=True,
                                               enforce_sorted=False)
    out, _ = lstm(packed)
    tags = nn.utils.rnn.pack_padded_sequence(batch.labels, batch.lengths, batch_first=True, enforce_sorted=False)
    return F.cross_entropy(model.out(out.data), tags.data, reduction="sum")


def hand_batched_crf(model, lstm, batch):
    """``CRFTagger``'s minibatch loss by hand: one ``nn.LSTM`` over the packed sentences, its states padded and
    scored; the gold paths' scores gathered at once, the forward algorithm a step over the padded minibatch, the
    sentences that ended kept as they were (``torch.where``)."""
    lengths = batch.lengths.to(batch.words.device)
    packed = nn.utils.rnn.pack_padded_sequence(model.embed(batch.words), batch.lengths, batch_first=True,
                                               enforce_sorted=False)
    states, _ = nn.utils.rnn.pad_packed_sequence(lstm(packed)[0], batch_first=True)
    emits = model.out(states)  # (B, longest, tags)
    longest = emits.shape[1]
    tags = batch.labels[:, :longest]
    words = torch.arange(longest, device=lengths.device) < lengths.unsqueeze(1)
    scores = emits.gather(2, tags.unsqueeze(2)).squeeze(2) + torch.cat(
        [model.start[tags[:, :1]], model.trans[tags[:, :-1], tags[:, 1:]]], 1)
    gold = torch.where(words, scores, scores.new_zeros(())).sum(1)
    alpha = model.start + emits[:, 0]
    for t in range(1, longest):
        step = torch.logsumexp(alpha.unsqueeze(2) + model.trans, 1) + emits[:, t]
        alpha = torch.where(words[:, t:t + 1], step, alpha)
    return (torch.logsumexp(alpha, 1) - gold).sum()


def hand_batched_written(model, lstm, batch):
    """``ElmanRNN``'s or ``WrittenLSTM``'s minibatch loss by hand: every word's input product at once, then the
    recurrence a step over the padded minibatch, the sentences that ended kept as they were (``torch.where``)."""
    lengths = batch.lengths.to(batch.words.device)
    x = model.ih(model.embed(batch.words))  # (B, longest, the gates' width)
    h = x.new_zeros(len(batch), model.hh.in_features)
    c = h
    for t in range(x.shape[1]):
        going = (t < lengths).unsqueeze(1)
        if type(model) is ElmanRNN:
            h = torch.where(going, torch.tanh(x[:, t] + model.hh(h)), h)
            continue
        i, f, g, o = (x[:, t] + model.hh(h)).chunk(4, 1)
        new_c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.where(going, torch.sigmoid(o) * torch.tanh(new_c), h)
        c = torch.where(going, new_c, c)
    return F.cross_entropy(model.out(h), batch.labels, reduction="sum")


def hand_batched_cnn(model, lstm, batch):
    """``TextCNN``'s minibatch loss by hand: each convolution over the padded sentences (the padding's words
    zeroed, as a convolution's own padding), its outputs past each sentence's end masked out of the max."""
    lengths = batch.lengths.to(batch.words.device)
    words = torch.arange(batch.words.shape[1], device=lengths.device) < lengths.unsqueeze(1)
    x = (model.embed(batch.words) * words.unsqueeze(-1)).transpose(1, 2)  # (B, embed, longest)
    features = []
    for conv in model.convs:
        y = F.relu(conv(x))
        k, pad = conv.kernel_size[0], conv.padding[0]
        kept = torch.arange(y.shape[2], device=y.device) < (lengths + 2 * pad - k + 1).unsqueeze(1)
        features.append(y.masked_fill(~kept.unsqueeze(1), float("-inf")).max(2).values)
    return F.cross_entropy(model.out(torch.cat(features, 1)), batch.labels, reduction="sum")


def recompile_sentences(model):
    classify = recompile.vmap(model.classify, in_dims=(0, 0, 0))
    return lambda batch: classify(batch.words, batch.lengths, batch.labels).sum()


def check_sentences(cls, base, batch, hand_batched=hand_batched_sentences, device="cpu"):
    """Raise unless ``cls`` through recompile.vmap (on ``device``) and the packed nn.LSTM (``hand_batched``)
    give eager's per-sentence losses and parameter gradients (float64, on the CPU); returns the per-instance op
    counts."""
    eager = cls(base.embed.num_embeddings).double()
    eager.load_state_dict(base.state_dict())
    model = compiled(cls)(base.embed.num_embeddings).double().to(device)
    model.load_state_dict(base.state_dict())
    want = torch.stack([eager.classify(batch.words[k], int(batch.lengths[k]), batch.labels[k])
                        for k in range(len(batch))])
    want_grads = gradients(eager, want.sum())
    got = recompile.vmap(model.classify, in_dims=(0, 0, 0))(*(t.to(device) for t in (batch.words, batch.lengths,
                                                                                       batch.labels)))
    assert got.device.type == torch.device(device).type
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(on_cpu(gradients(model, got.sum())), want_grads, rtol=1e-7, atol=1e-9)
    hand = hand_batched(eager, packed_lstm(eager), batch)
    torch.testing.assert_close(hand, want.sum().detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(eager, hand), want_grads, rtol=1e-7, atol=1e-9)
    return dict(type(model).classify.stats.get("per_instance", {}))


# (title, spellings, the packed nn.LSTM's version of the same model)
SENTENCE_FAMILIES = (
    ("Variable-length LSTM (embed 300, hidden 150) against one packed nn.LSTM",
     {"LSTMCell, for range(n)": SentenceLSTM, "LSTMCell, while t < n": SentenceLSTMWhile,
      "LSTMCell, for words[:n]": SentenceLSTMPrefix, "LSTMCell, embed(words[:n])": SentenceLSTMEmbedded,
      "nn.LSTM per sentence": SentenceLSTMModule},
     hand_batched_sentences),
    ("States averaged over the sentence against one packed nn.LSTM's padded states",
     {"LSTMCell, states summed": PooledLSTM, "LSTMCell, stack(hs).mean(0)": CollectedLSTM},
     hand_batched_pooled),
    ("Two layers against one packed 2-layer nn.LSTM", {"two LSTMCell layers": TwoLayerLSTM},
     hand_batched_sentences),
    ("Attention over the states against one packed nn.LSTM's padded states, masked",
     {"attention, softmax(.., 0)": AttendedLSTM}, hand_batched_attended),
    ("Both directions against one packed bidirectional nn.LSTM", {"reversed(range(n))": BiLSTM},
     hand_batched_bidirectional),
    ("An Elman RNN written out (no cell module) against the same steps over the padded minibatch, masked",
     {"Elman RNN written out": ElmanRNN}, hand_batched_written),
    ("An LSTM's gates written out against the same steps over the padded minibatch, masked",
     {"LSTM gates written out": WrittenLSTM}, hand_batched_written),
    ("A text CNN (Kim 2014: widths 3, 4, 5, 100 filters each) against its convolutions over the padded sentences",
     {"Conv1d, xs.t(), max(2)": TextCNN, "xs[None], max_pool1d": TextCNN2d}, hand_batched_cnn))
# (taggers: a tag per word, the sentences read by ``tagged_sentence_of``)
TAGGER_FAMILY = ("A tag per word against one packed nn.LSTM's packed outputs",
                 {"tutorial, view(n, 1, -1)": TaggerLSTM, "LSTMCell, loss per step": TaggerCell}, hand_batched_tagger)
CRF_FAMILY = ("A linear-chain CRF over an nn.LSTM's scores against its forward algorithm over the padded minibatch",
              {"CRF, loops over tags": CRFTagger}, hand_batched_crf)


# -- the top-down model

MAX_DEPTH = 5


class TopDown(nn.Module):
    def __init__(self, hidden=150):
        super().__init__()
        self.gate = nn.Linear(hidden, 1)
        self.l = nn.Linear(hidden, hidden)
        self.r = nn.Linear(hidden, hidden)
        self.merge = nn.Linear(2 * hidden, hidden)
        self.leaf = nn.Linear(hidden, hidden)

    def expand(self, h, depth):
        """Grows a node while its gate is open: the tree's shape follows the computed states."""
        p = torch.sigmoid(self.gate(h)).squeeze(-1)
        if depth < MAX_DEPTH and p > 0.5:
            left = self.expand(torch.tanh(self.l(h)), depth + 1)
            right = self.expand(torch.tanh(self.r(h)), depth + 1)
            return torch.tanh(self.merge(torch.cat([left, right], -1))) * p
        return torch.tanh(self.leaf(h)) * (1 - p)


class TopDownCompiled(TopDown):
    expand = recompile.function(TopDown.expand)


def hand_batched_top_down(model, h, depth=0):
    """``expand`` of every row of ``h`` by hand: the rows that expand, gathered, go down one depth at once."""
    p = torch.sigmoid(model.gate(h)).squeeze(-1)
    out = torch.tanh(model.leaf(h)) * (1 - p).unsqueeze(-1)
    if depth >= MAX_DEPTH:
        return out
    grow = (p > 0.5).nonzero().view(-1)
    if not len(grow):
        return out
    x = h.index_select(0, grow)
    children = hand_batched_top_down(model, torch.tanh(torch.cat([model.l(x), model.r(x)])), depth + 1)
    k = len(grow)
    merged = torch.tanh(model.merge(torch.cat([children[:k], children[k:]], -1))) * p[grow].unsqueeze(-1)
    return out.index_copy(0, grow, merged)


def check_top_down(base, starts, device="cpu"):
    """Raise unless the compiled top-down model through recompile.vmap (on ``device``) and the hand-batched one
    give eager's values and parameter gradients (float64, on the CPU); returns the per-instance op counts."""
    eager = TopDown(base.leaf.in_features).double()
    eager.load_state_dict(base.state_dict())
    model = TopDownCompiled(base.leaf.in_features).double().to(device)
    model.load_state_dict(base.state_dict())
    starts = starts.double()
    want = torch.stack([eager.expand(h, 0) for h in starts])
    want_grads = gradients(eager, want.sum())
    got = recompile.vmap(model.expand, in_dims=(0, None))(starts.to(device), 0)
    assert got.device.type == torch.device(device).type
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(on_cpu(gradients(model, got.sum())), want_grads, rtol=1e-7, atol=1e-9)
    hand = hand_batched_top_down(eager, starts)
    torch.testing.assert_close(hand, want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(eager, hand.sum()), want_grads, rtol=1e-7, atol=1e-9)
    return dict(TopDownCompiled.expand.stats.get("per_instance", {}))


def top_down_model(hidden):
    """A TopDown whose gate opens for about two thirds of the states (trees of every size up to the limit)."""
    torch.manual_seed(0)
    model = TopDown(hidden)
    with torch.no_grad():
        model.gate.bias.fill_(0.6)
    return model


# -- the table


def table(rows, unit):
    print(f"{'':24} {'mode':>9} {'batch':>5} {'hand ' + unit:>15} {'recompile ' + unit:>20} {'rec/hand':>9}")
    for name, mode, size, hand, rec in rows:
        ratio = f"{rec / hand:8.2f}x" if not isinstance(rec, Exception) else f"{'-':>9}"
        rec_text = f"{rec:20.1f}" if not isinstance(rec, Exception) else f"{type(rec).__name__:>20}"
        print(f"{name:24} {mode:>9} {size:5d} {hand:15.1f} {rec_text} {ratio}")


def time_family(spellings, hand_run, batches_by_size, repeats):
    """[(name, mode, size, hand/s, recompile/s)] of {name: model} against ``hand_run``."""
    rows = []
    for mode, train in (("inference", False), ("training", True)):
        for size, batches in batches_by_size.items():
            runs = {"hand": hand_run(batches)}
            runs.update({name: (loss, model, batches) for name, (loss, model) in spellings.items()})
            best = throughputs(runs, train, repeats)
            rows += [(name, mode, size, best["hand"], best[name]) for name in spellings]
    return rows


def time_against_packed(vocab, spellings, hand_batched, check_batch, batches, repeats, title):
    """The rows of ``time_family`` for sentence models {name: class} (their parameters one model's), each
    checked first, against ``hand_batched`` over a packed ``nn.LSTM`` of those parameters."""
    torch.manual_seed(0)
    base = next(iter(spellings.values()))(vocab)
    for cls in spellings.values():
        counts = check_sentences(cls, base, check_batch, hand_batched)
        print(f"  {cls.classify.__doc__.split(chr(10))[0]:60} matches eager; per-instance ops: {counts or 'none'}")
    hand = type(base)(vocab)
    hand.load_state_dict(base.state_dict())
    lstm = packed_lstm(hand)
    models = {}
    for name, cls in spellings.items():
        model = compiled(cls)(vocab)
        model.load_state_dict(base.state_dict())
        models[name] = (recompile_sentences(model), model)
    print(title)
    return time_family(models, lambda b: (lambda batch: hand_batched(hand, lstm, batch), hand, b), batches, repeats)


def main(argv=None):
    args = arguments(__doc__).parse_args(argv)
    data, sst, trees = sst_trees(args)
    vocab = len(sst.vocab)
    print(f"{len(trees)} SST sentences from {data}, {args.threads} torch thread(s); each model checked "
          "against eager (float64: per-instance values and parameter gradients) before it is timed")

    for reading, families in ((sentence_of, SENTENCE_FAMILIES), (tagged_sentence_of, (TAGGER_FAMILY, CRF_FAMILY))):
        sentences = [reading(t) for t in trees]
        check_batch = Sentences(*zip(*sentences[:8]))
        batches = {size: [Sentences(*zip(*chunk)) for chunk in chunks(sentences, size)] for size in args.batch}
        for title, spellings, hand_batched in families:
            table(time_against_packed(vocab, spellings, hand_batched, check_batch, batches, args.repeats, title),
                  "sent/s")

    hidden = 150
    base = top_down_model(hidden)
    starts = 2 * torch.randn(len(trees), hidden, generator=torch.Generator().manual_seed(1))
    counts = check_top_down(base, starts[:32])
    print(f"Top-down model (hidden {hidden}, depth < {MAX_DEPTH} and p > 0.5) matches eager; "
          f"per-instance ops: {counts or 'none'}")
    model = TopDownCompiled(hidden)
    model.load_state_dict(base.state_dict())
    expand = recompile.vmap(model.expand, in_dims=(0, None))
    hand = copy_of(base)
    batches = {size: chunks(starts, size) for size in args.batch}
    table(time_family({"top-down, and": (lambda h: expand(h, 0).sum(), model)},
                      lambda b: (lambda h: hand_batched_top_down(hand, h).sum(), hand, b), batches, args.repeats),
          "starts/s")


def copy_of(model):
    twin = type(model)(model.leaf.in_features)
    twin.load_state_dict(model.state_dict())
    return twin


if __name__ == "__main__":
    main()
