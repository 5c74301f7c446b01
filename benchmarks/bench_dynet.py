"""recompile against DyNet's automatic batching on the same models, parameters and minibatches.

    pip install dyNET38      # DyNet 2.1 for Python 3 (optional: without it this says so and stops)
    python benchmarks/bench_dynet.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R]

DyNet (Neubig et al. 2017) builds a graph per minibatch the way a user writes the model, one instance after
another, and its autobatching (``autobatch=1``) groups the graph's nodes of one signature into batched ops
before running it: the peer closest to recompile. Each model is written for DyNet as a DyNet user would (the
tree walked bottom-up, the sentence step by step, the top-down model reading its gate with ``.value()``),
given the very parameters of the PyTorch model (copied), and checked against eager PyTorch (float32: the
minibatch loss) before it is timed:

- the Tree-LSTM of ``examples/tree_lstm.py``, the Tree-RNN of ``examples/tree_rnn.py`` and the RNTN of
  ``examples/rntn.py`` (every node's cross-entropy summed) over SST trees, recompile running
  ``recompile.vmap(model.encode, in_dims=(None, 0))``;
- the variable-length LSTM and the top-down model of ``bench_sequences.py`` (its ``for t in range(n)`` form);
- ``bench_objects.py``'s child-sum Tree-LSTM over the user's own node objects and its greedy
  sequence-to-sequence model (the decoder reading each step's argmax, with ``.npvalue()`` in DyNet), recompile
  running ``recompile.map(model, examples)``.

Throughput is trees (sentences, start states) per second, best of --repeats; training is forward, backward
and an SGD step per minibatch (DyNet's SimpleSGDTrainer, torch.optim.SGD), inference the forward alone.
DyNet runs on one thread; torch is set to --threads (1 by default).

DyNet updates only the rows of a lookup table that the minibatch read; torch's default ``nn.Embedding`` has a
dense gradient, so each step zeroes, fills and updates the whole table (18k x 300 on the full SST). With
``--sparse`` the PyTorch models' tables are ``nn.Embedding(..., sparse=True)``, torch's way to the same update.
"""

import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import bench_objects as objects  # noqa: E402
import bench_sequences as seq  # noqa: E402
from bench_batching import arguments, chunks, eager_twin, sst_trees, throughputs  # noqa: E402
from bench_idioms import recompile_loss  # noqa: E402
from rntn import RNTN  # noqa: E402
from tree_lstm import TreeLSTM  # noqa: E402
from tree_rnn import TreeRNN  # noqa: E402

import recompile  # noqa: E402
from recompile.data import Forest  # noqa: E402

dy = None  # the dynet module, once main() has set it up (``load_dynet``)


def load_dynet(mem):
    """Import DyNet with autobatching and ``mem`` MB of memory (autobatching needs it up front); False where it
    is not installed."""
    global dy
    if dy is None:
        try:
            import dynet_config

            dynet_config.set(autobatch=1, mem=mem, random_seed=1)
            import dynet
        except ImportError:
            return False
        dy = dynet
    return True

LR = 1e-4  # (a small step, as bench_batching's: speed does not depend on it)


class Params:
    """A PyTorch module's parameters, copied into a DyNet ParameterCollection by name."""

    def __init__(self, module, lookups=("embed.weight",), skip=()):
        self.pc = dy.ParameterCollection()
        self.p = {}
        for name, t in module.state_dict().items():
            if name in skip:
                continue
            array = t.detach().float().numpy()
            if name in lookups:
                self.p[name] = self.pc.lookup_parameters_from_numpy(array)
            else:
                self.p[name] = self.pc.parameters_from_numpy(array)

    def __getitem__(self, name):
        return self.p[name]

    def affine(self, prefix, *xs):
        """``prefix``'s Linear of x (several: of their concatenation)."""
        x = xs[0] if len(xs) == 1 else dy.concatenate(list(xs))
        return dy.affine_transform([self.p[prefix + ".bias"], self.p[prefix + ".weight"], x])


def tree_lists(tree):
    return (tree.words.tolist(), tree.left.tolist(), tree.right.tolist(), tree.labels.tolist())


def dynet_tree_loss(params, tree, node):
    """A tree's summed node losses, walked bottom-up (post-order: children first)."""
    words, left, right, labels = tree
    states, losses = [], []
    for i in range(len(words)):
        state = node(params, words[i], None if left[i] < 0 else (states[left[i]], states[right[i]]))
        states.append(state)
        h = state[0] if type(state) is tuple else state
        losses.append(dy.pickneglogsoftmax(params.affine("out", h), labels[i]))
    return dy.esum(losses)


def lstm_node(params, word, children):
    hidden = params["out.weight"].shape()[1]
    if children is None:
        y = params.affine("leaf", dy.lookup(params["embed.weight"], word))
        ig, og, u = (dy.pick_range(y, k * hidden, (k + 1) * hidden) for k in range(3))
        c = dy.cmult(dy.logistic(ig), dy.tanh(u))
    else:
        (hl, cl), (hr, cr) = children
        y = params.affine("node", hl, hr)
        ig, og, u, fl, fr = (dy.pick_range(y, k * hidden, (k + 1) * hidden) for k in range(5))
        c = dy.cmult(dy.logistic(ig), dy.tanh(u)) + dy.cmult(dy.logistic(fl), cl) + dy.cmult(dy.logistic(fr), cr)
    return dy.cmult(dy.logistic(og), dy.tanh(c)), c


def rnn_node(params, word, children):
    if children is None:
        return dy.tanh(params.affine("leaf", dy.lookup(params["embed.weight"], word)))
    return dy.tanh(params.affine("compose", *children))


class RNTNParams(Params):
    """The RNTN's V (hidden x 2h x 2h) as a (hidden * 2h) x 2h matrix: V x, read as 2h x hidden (DyNet reshapes
    column-major), is each k's ``V[k] x`` as a column."""

    def __init__(self, module):
        super().__init__(module, skip=("V",))
        v = module.V.detach().float().numpy()
        self.p["V"] = self.pc.parameters_from_numpy(v.reshape(v.shape[0] * v.shape[1], v.shape[2]))


def rntn_node(params, word, children):
    if children is None:
        return dy.tanh(params.affine("leaf", dy.lookup(params["embed.weight"], word)))
    x = dy.concatenate(list(children))
    hidden = params["W.weight"].shape()[0]
    per_k = dy.reshape(params["V"] * x, (2 * hidden, hidden))
    return dy.tanh(dy.transpose(per_k) * x + params.affine("W", x))


def lstm_step(params, cell, x, h, c):
    """One step of the ``nn.LSTMCell`` named ``cell`` (torch's gate order: input, forget, cell, output)."""
    hidden = params[cell + ".weight_hh"].shape()[1]
    g = dy.affine_transform([params[cell + ".bias_ih"], params[cell + ".weight_ih"], x, params[cell + ".weight_hh"],
                             h])
    g = g + params[cell + ".bias_hh"]
    i, f, u, o = (dy.pick_range(g, k * hidden, (k + 1) * hidden) for k in range(4))
    c = dy.cmult(dy.logistic(f), c) + dy.cmult(dy.logistic(i), dy.tanh(u))
    return dy.cmult(dy.logistic(o), dy.tanh(c)), c


def dynet_sentence_loss(params, words, label):
    """The sentence LSTM step by step."""
    h = c = dy.zeros(params["out.weight"].shape()[1])
    for w in words:
        h, c = lstm_step(params, "cell", dy.lookup(params["embed.weight"], w), h, c)
    return dy.pickneglogsoftmax(params.affine("out", h), label)


def held_nodes(node):
    """``bench_objects``' Node as a DyNet user holds one: (word, label, children), ints."""
    return int(node.word), int(node.label), [held_nodes(child) for child in node.children]


def dynet_child_sum(params, node):
    """(h, c, the subtree's summed loss) of ``bench_objects``' child-sum Tree-LSTM, children first."""
    word, label, children = node
    hidden = params["out.weight"].shape()[1]
    x = dy.lookup(params["embed.weight"], word)
    kids = [dynet_child_sum(params, child) for child in children]
    h_sum = dy.esum([h for h, _, _ in kids]) if kids else dy.zeros(hidden)
    iou = params.affine("ioux", x) + params["iouh.weight"] * h_sum
    i, o, u = (dy.pick_range(iou, k * hidden, (k + 1) * hidden) for k in range(3))
    c = dy.cmult(dy.logistic(i), dy.tanh(u))
    fx = params.affine("fx", x)
    for h_k, c_k, _ in kids:
        c = c + dy.cmult(dy.logistic(fx + params["fh.weight"] * h_k), c_k)
    h = dy.cmult(dy.logistic(o), dy.tanh(c))
    loss = dy.pickneglogsoftmax(params.affine("out", h), label)
    return h, c, dy.esum([loss, *(each for _, _, each in kids)])


def dynet_greedy_loss(params, pair):
    """``bench_objects``' sequence-to-sequence loss: the encoder over the words, then the decoder fed its own
    argmax (read with ``.npvalue()``, which runs the graph so far) until END or the target's length."""
    words, target = pair
    h = c = dy.zeros(params["out.weight"].shape()[1])
    for w in words:
        h, c = lstm_step(params, "encoder", dy.lookup(params["embed.weight"], w), h, c)
    token, losses = objects.START, []
    for t in range(len(target)):
        h, c = lstm_step(params, "decoder", dy.lookup(params["embed.weight"], token), h, c)
        logits = params.affine("out", h)
        losses.append(dy.pickneglogsoftmax(logits, target[t]))
        token = int(logits.npvalue().argmax())
        if token == objects.END:
            break
    return dy.esum(losses)


def dynet_expand(params, h, depth):
    """The top-down model: its gate read as a number (``.value()`` runs the graph so far) decides the shape."""
    p = dy.pick(dy.logistic(params.affine("gate", h)), 0)
    if depth < seq.MAX_DEPTH and p.value() > 0.5:
        left = dynet_expand(params, dy.tanh(params.affine("l", h)), depth + 1)
        right = dynet_expand(params, dy.tanh(params.affine("r", h)), depth + 1)
        return dy.tanh(params.affine("merge", left, right)) * p
    return dy.tanh(params.affine("leaf", h)) * (-p + 1.0)  # (DyNet has no number minus an expression)


def dynet_run(loss_of, params, batches, train, repeats):
    """Best items/s of building, running (and with ``train`` back-propagating and stepping) each minibatch."""
    trainer = dy.SimpleSGDTrainer(params.pc, LR)
    best = 0.0
    for turn in range(repeats + 1):
        start = time.perf_counter()
        for batch in batches if turn else batches[:1]:
            dy.renew_cg()
            loss = dy.esum([loss_of(params, item) for item in batch])
            loss.value()
            if train:
                loss.backward()
                trainer.update()
        if turn:
            best = max(best, sum(len(b) for b in batches) / (time.perf_counter() - start))
    return best


def checked(name, torch_loss, params, loss_of, items):
    """Raise unless DyNet's minibatch loss on ``items`` is eager PyTorch's (float32)."""
    dy.renew_cg()
    got = dy.esum([loss_of(params, item) for item in items]).value()
    want = float(torch_loss)
    if abs(got - want) > 1e-4 * max(1.0, abs(want)):
        raise AssertionError(f"{name}: DyNet's loss {got} is not eager PyTorch's {want}")
    print(f"  {name:26} DyNet matches eager PyTorch (the minibatch loss {want:.4f})")


def sparse_table(model):
    """``model`` with its embedding table's gradient sparse (the same weights)."""
    old = model.embed
    model.embed = nn.Embedding(old.num_embeddings, old.embedding_dim, sparse=True)
    model.embed.weight = old.weight
    return model


def tree_families(sst, trees, sparse):
    """(name, model, DyNet params, node function) of the three tree models."""
    torch.manual_seed(0)
    out = []
    for name, cls, make, node in (("Tree-LSTM", TreeLSTM, Params, lstm_node), ("Tree-RNN", TreeRNN, Params, rnn_node),
                                  ("RNTN", RNTN, RNTNParams, rntn_node)):
        model = cls(len(sst.vocab))
        if sparse:
            sparse_table(model)
        params = make(model)
        eager = eager_twin(cls)(len(sst.vocab))
        eager.load_state_dict(model.state_dict())
        with torch.no_grad():
            want = sum(eager.encode(t, t.root)[-1] for t in trees[:8])
        checked(name, want, params, lambda p, t, node=node: dynet_tree_loss(p, tree_lists(t), node), trees[:8])
        out.append((name, model, params, node))
    return out


def main(argv=None):
    parser = arguments(__doc__)
    parser.add_argument("--sparse", action="store_true", help="the PyTorch models' embeddings sparse=True")
    parser.add_argument("--dynet-mem", type=int, default=4096, help="MB DyNet allocates up front")
    args = parser.parse_args(argv)
    if not load_dynet(args.dynet_mem):
        print("DyNet is not installed (pip install dyNET38): nothing to compare with")
        return
    data, sst, trees = sst_trees(args)
    print(f"{len(trees)} SST trees from {data}, torch on {args.threads} thread(s), DyNet autobatch=1, "
          f"PyTorch embeddings {'sparse' if args.sparse else 'dense'}")
    rows = []
    for name, model, params, node in tree_families(sst, trees, args.sparse):
        forests = {size: [Forest.from_trees(c) for c in chunks(trees, size)] for size in args.batch}
        lists = {size: [[tree_lists(t) for t in c] for c in chunks(trees, size)] for size in args.batch}
        rows += timed(name, model, recompile_loss(model), forests, params,
                      lambda p, t, node=node: dynet_tree_loss(p, t, node), lists, args.repeats)

    sentences = [seq.sentence_of(t) for t in trees]
    model = seq.compiled(seq.SentenceLSTM)(len(sst.vocab))
    if args.sparse:
        sparse_table(model)
    params = Params(model)
    check = seq.Sentences(*zip(*sentences[:8]))
    with torch.no_grad():
        checked("variable-length LSTM", seq.recompile_sentences(model)(check), params,
                lambda p, s: dynet_sentence_loss(p, *s), sentences[:8])
    rows += timed("variable-length LSTM", model, seq.recompile_sentences(model),
                  {size: [seq.Sentences(*zip(*c)) for c in chunks(sentences, size)] for size in args.batch}, params,
                  lambda p, s: dynet_sentence_loss(p, *s), {size: chunks(sentences, size) for size in args.batch},
                  args.repeats)

    hidden = 150
    model = seq.TopDownCompiled(hidden)
    model.load_state_dict(seq.top_down_model(hidden).state_dict())
    params = Params(model, lookups=())
    starts = 2 * torch.randn(len(trees), hidden, generator=torch.Generator().manual_seed(1))
    expand = seq.recompile.vmap(model.expand, in_dims=(0, None))
    as_inputs = list(starts.numpy())
    with torch.no_grad():
        checked("top-down", expand(starts[:8], 0).sum(), params,
                lambda p, h: dy.sum_elems(dynet_expand(p, dy.inputTensor(h), 0)), as_inputs[:8])
    rows += timed("top-down", model, lambda h: expand(h, 0).sum(), {s: chunks(starts, s) for s in args.batch},
                  params, lambda p, h: dy.sum_elems(dynet_expand(p, dy.inputTensor(h), 0)),
                  {s: chunks(as_inputs, s) for s in args.batch}, args.repeats)

    rows += held_families(sst, trees, args)

    print(f"{'':22} {'mode':>9} {'batch':>5} {'DyNet /s':>10} {'recompile /s':>13} {'rec/DyNet':>10}")
    for name, mode, size, dynet_rate, rec in rows:
        ratio = f"{rec / dynet_rate:9.2f}x" if not isinstance(rec, Exception) else f"{type(rec).__name__:>10}"
        rate = f"{rec:13.1f}" if not isinstance(rec, Exception) else f"{'-':>13}"
        print(f"{name:22} {mode:>9} {size:5d} {dynet_rate:10.1f} {rate} {ratio}")


def held_families(sst, trees, args):
    """The rows of ``bench_objects``' models over what users hold, through ``recompile.map``: the child-sum
    Tree-LSTM over node objects, and the greedy sequence-to-sequence model."""
    torch.manual_seed(0)
    model = objects.ChildSumTreeLSTM(len(sst.vocab))
    if args.sparse:
        sparse_table(model)
    params = Params(model)
    roots = [objects.nodes_of(t) for t in trees]
    held = [held_nodes(root) for root in roots]
    with torch.no_grad():
        want = sum(model.forward.python(model, root)[2] for root in roots[:8])
    checked("child-sum over nodes", want, params, lambda p, n: dynet_child_sum(p, n)[2], held[:8])
    rows = timed("child-sum over nodes", model, lambda batch: sum(r[2] for r in recompile.map(model, batch)),
                 {size: chunks(roots, size) for size in args.batch}, params, lambda p, n: dynet_child_sum(p, n)[2],
                 {size: chunks(held, size) for size in args.batch}, args.repeats)
    model = objects.Seq2Seq()
    if args.sparse:
        sparse_table(model)
    params = Params(model)
    pairs = [objects.sentence_pair(t) for t in trees]
    held = [(w.tolist(), t.tolist()) for w, t in pairs]
    with torch.no_grad():
        want = sum(model.forward.python(model, *pair)[1] for pair in pairs[:8])
    checked("seq2seq, greedy", want, params, dynet_greedy_loss, held[:8])
    rows += timed("seq2seq, greedy", model, lambda batch: sum(r[1] for r in recompile.map(model, *zip(*batch))),
                  {size: chunks(pairs, size) for size in args.batch}, params, dynet_greedy_loss,
                  {size: chunks(held, size) for size in args.batch}, args.repeats)
    return rows


def timed(name, model, loss_fn, batches, params, dynet_loss, dynet_batches, repeats):
    """[(name, mode, size, DyNet items/s, recompile items/s)] for each minibatch size and mode."""
    rows = []
    for mode, train in (("inference", False), ("training", True)):
        for size in batches:
            rec = throughputs({name: (loss_fn, model, batches[size])}, train, repeats)[name]
            rows.append((name, mode, size, dynet_run(dynet_loss, params, dynet_batches[size], train, repeats), rec))
    return rows


if __name__ == "__main__":
    main()
