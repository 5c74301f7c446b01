"""The Tree-LSTM written as a shift-reduce parser over a stack (SPINN), as users write it, against SPINN batched
by hand.

    python benchmarks/bench_parsers.py [--data DIR] [--trees N] [--batch 25 256] [--repeats R]

SPINN (Bowman et al. 2016) reads a sentence's binary parse as a sequence of transitions: a shift pushes the next
word's state on a stack, a reduce pops two states and pushes their parent's. With the nodes of a tree in post-order
(``recompile.data``'s order) a leaf is a shift and an inner node a reduce, so the parser over a tree's nodes
computes the very Tree-LSTM of ``examples/tree_lstm.py`` (its parameters, every node's cross-entropy summed), one
node per step, the stack a Python list of ``(h, c)`` pairs. Written three ways:

- ``stack.pop()`` twice, then ``stack.append((h, c))``;
- ``(hl, cl), (hr, cr) = stack[-2:]``, ``stack = stack[:-2]``, ``stack = stack + [(h, c)]``;
- two lists of states, read ``hs[-2], hs[-1]`` and cut by ``del hs[-2:]``.

Each runs through ``recompile.vmap`` over a minibatch of trees padded to one length (its words, leaf flags and
labels by node, and each tree's number of nodes, the loop's ``range(n)``). Before it is timed, each is checked
against its eager twin (float64: every tree's loss, and the parameter gradients; and the loss against the
Tree-LSTM's own ``encode``) and its per-instance ops counted (``stats["per_instance"]``, which should be empty).
The reference is SPINN batched by hand as its PyTorch implementations batch it: at each step, the trees that
shift and the trees that reduce each one batched op, each tree's stack a Python list of rows. The last column is
recompile against the same Tree-LSTM batched by height (``bench_batching.hand_batched``): the cost of the spelling
(a stack's steps are a tree's nodes, a height's levels are fewer), not of recompile.
"""

import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from bench_batching import arguments, chunks, gradients, hand_batched, sst_trees, throughputs  # noqa: E402
from tree_lstm import TreeLSTM  # noqa: E402

import recompile  # noqa: E402
from recompile.data import Forest  # noqa: E402


class StackPopped(TreeLSTM):
    def parse(self, words, is_leaf, labels, n):
        """stack.pop() twice, stack.append((h, c))"""
        stack = []
        loss = 0.0
        for t in range(n):
            if is_leaf[t]:
                ig, og, u = torch.chunk(self.leaf(self.embed(words[t])), 3, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u)
            else:
                hr, cr = stack.pop()
                hl, cl = stack.pop()
                ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            h = torch.sigmoid(og) * torch.tanh(c)
            loss = loss + self.node_loss(h, labels[t])
            stack.append((h, c))
        return loss


class StackSliced(TreeLSTM):
    def parse(self, words, is_leaf, labels, n):
        """stack[-2:], stack = stack[:-2], stack + [(h, c)]"""
        stack = []
        loss = 0.0
        for t in range(n):
            if is_leaf[t]:
                ig, og, u = torch.chunk(self.leaf(self.embed(words[t])), 3, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u)
            else:
                (hl, cl), (hr, cr) = stack[-2:]
                stack = stack[:-2]
                ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            h = torch.sigmoid(og) * torch.tanh(c)
            loss = loss + self.node_loss(h, labels[t])
            stack = stack + [(h, c)]
        return loss


class StacksCut(TreeLSTM):
    def parse(self, words, is_leaf, labels, n):
        """two stacks, hs[-2], hs[-1], del hs[-2:]"""
        hs, cs = [], []
        loss = 0.0
        for t in range(n):
            if is_leaf[t]:
                ig, og, u = torch.chunk(self.leaf(self.embed(words[t])), 3, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u)
            else:
                hl, hr, cl, cr = hs[-2], hs[-1], cs[-2], cs[-1]
                del hs[-2:]
                del cs[-2:]
                ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
                c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            h = torch.sigmoid(og) * torch.tanh(c)
            loss = loss + self.node_loss(h, labels[t])
            hs.append(h)
            cs.append(c)
        return loss


SPELLINGS = {"stack.pop()": StackPopped, "stack[-2:], stack + [..]": StackSliced, "del hs[-2:]": StacksCut}


def compiled(cls):
    """``cls`` with ``parse`` compiled (the eager class stays as it is: the check's twin)."""
    return type(cls.__name__ + "Compiled", (cls,), {"parse": recompile.function(cls.parse)})


def transitions(trees):
    """(words, is_leaf, labels, n) of a minibatch of trees: each tree's nodes in post-order, padded to the longest
    (a leaf's word, an inner node's -1; padding a leaf of word 0 that no step reaches)."""
    longest = max(len(t.words) for t in trees)

    def padded(name, fill):
        return torch.stack([F.pad(getattr(t, name).long(), (0, longest - len(t.words)), value=fill) for t in trees])

    return padded("words", 0), padded("is_leaf", 1).bool(), padded("labels", 0), \
        torch.tensor([len(t.words) for t in trees])


class Minibatch:
    """A minibatch's transitions and its forest (for the Tree-LSTM by height); its length its number of trees
    (what ``throughputs`` counts)."""

    def __init__(self, trees):
        self.transitions, self.forest, self.size = transitions(trees), Forest.from_trees(trees), len(trees)

    def __len__(self):
        return self.size


def hand_batched_spinn(model, words, is_leaf, labels, n):
    """The summed loss of every node of every tree, SPINN batched by hand: at step t, every tree that shifts (its
    leaf's gates computed for all words at once, read by index), then every tree that reduces (its two top states
    popped from its own stack and stacked into one composition), then every node's loss at once."""
    stacks = [[] for _ in range(words.shape[0])]
    leaves = model.leaf(model.embed(words.clamp(min=0)))
    total = 0.0
    for t in range(int(n.max())):
        live = (n > t).nonzero().view(-1)
        shifting = is_leaf[live, t]
        hs, cs, who = [], [], []
        shift, reduce = live[shifting], live[~shifting]
        if len(shift):
            ig, og, u = leaves[shift, t].chunk(3, -1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            hs.append(torch.sigmoid(og) * torch.tanh(c))
            cs.append(c)
            who += shift.tolist()
        if len(reduce):
            ks = reduce.tolist()
            right = [stacks[k].pop() for k in ks]
            left = [stacks[k].pop() for k in ks]
            hl, cl = (torch.stack(side) for side in zip(*left))
            hr, cr = (torch.stack(side) for side in zip(*right))
            ig, og, u, fl, fr = model.node(torch.cat([hl, hr], -1)).chunk(5, -1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            hs.append(torch.sigmoid(og) * torch.tanh(c))
            cs.append(c)
            who += ks
        h, c = torch.cat(hs), torch.cat(cs)
        total = total + F.cross_entropy(model.out(h), labels[torch.tensor(who), t], reduction="sum")
        for row, k in enumerate(who):
            stacks[k].append((h[row], c[row]))
    return total


def check(cls, base, trees):
    """Raise unless ``cls`` through recompile.vmap gives its eager twin's per-tree losses and parameter gradients
    (float64), the losses the Tree-LSTM's ``encode`` gives too; returns its per-instance op counts."""
    eager = cls(base.embed.num_embeddings).double()
    eager.load_state_dict(base.state_dict())
    model = compiled(cls)(base.embed.num_embeddings).double()
    model.load_state_dict(base.state_dict())
    model.parse.stats.reset()
    want = torch.stack([eager.parse(*(part[0] for part in transitions([tree]))) for tree in trees])
    want_grads = gradients(eager, want.sum())
    with torch.no_grad():
        encoded = torch.stack([eager.encode(tree, tree.root)[-1] for tree in trees])
    torch.testing.assert_close(want.detach(), encoded, rtol=1e-7, atol=1e-9)
    got = recompile.vmap(model.parse)(*transitions(trees))
    torch.testing.assert_close(got, want.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(model, got.sum()), want_grads, rtol=1e-7, atol=1e-9)
    hand = hand_batched_spinn(eager, *transitions(trees))
    torch.testing.assert_close(hand, want.sum().detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gradients(eager, hand), want_grads, rtol=1e-7, atol=1e-9)
    return dict(model.parse.stats.get("per_instance", {}))


def main(argv=None):
    args = arguments(__doc__).parse_args(argv)
    data, sst, trees = sst_trees(args)
    vocab = len(sst.vocab)
    print(f"{len(trees)} SST trees from {data}, {args.threads} torch thread(s); each spelling checked against "
          "eager (float64: every tree's loss, and the parameter gradients) before it is timed")
    torch.manual_seed(0)
    base = TreeLSTM(vocab)
    for name, cls in SPELLINGS.items():
        counts = check(cls, base, trees[:8])
        print(f"  {name:26} matches eager and the Tree-LSTM; per-instance ops: {counts or 'none'}")
    print(f"  {'SPINN batched by hand':26} matches eager (float64: the loss and its gradients)")
    models = {name: compiled(cls)(vocab) for name, cls in SPELLINGS.items()}
    for model in models.values():
        model.load_state_dict(base.state_dict())
    hand, by_height = copy.deepcopy(base), copy.deepcopy(base)
    print(f"{'':26} {'mode':>9} {'batch':>5} {'hand SPINN/s':>13} {'recompile/s':>12} {'rec/hand':>9} "
          f"{'by height/s':>12} {'rec/height':>11}")
    for mode, train in (("inference", False), ("training", True)):
        for size in args.batch:
            minibatches = [Minibatch(c) for c in chunks(trees, size)]
            runs = {"hand": (lambda b: hand_batched_spinn(hand, *b.transitions), hand, minibatches),
                    "height": (lambda b: hand_batched(by_height, b.forest), by_height, minibatches)}
            runs.update({name: ((lambda b, f=recompile.vmap(m.parse): f(*b.transitions).sum()), m, minibatches)
                         for name, m in models.items()})
            best = throughputs(runs, train, args.repeats)
            for name in SPELLINGS:
                rec = best[name]
                if isinstance(rec, Exception):
                    print(f"{name:26} {mode:>9} {size:5d} {best['hand']:13.1f} {type(rec).__name__:>12}")
                    continue
                print(f"{name:26} {mode:>9} {size:5d} {best['hand']:13.1f} {rec:12.1f} {rec / best['hand']:8.2f}x "
                      f"{best['height']:12.1f} {rec / best['height']:10.2f}x")


if __name__ == "__main__":
    main()
