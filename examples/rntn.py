"""Recursive neural tensor network (Socher et al. 2013) on SST, written as a plain recursive method.

    h = tanh([hl; hr]^T V [hl; hr] + W [hl; hr] + b)

    python examples/rntn.py [--data DIR] [--epochs N] [--checkpoint PATH [--resume]] [--curve PNG] [--dump]
"""

import torch
from torch import nn

import recompile
from sst_runner import SentimentModel, main


class RNTN(SentimentModel):
    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__()
        hidden = min(hidden, 50)  # the tensor has hidden * (2 hidden)^2 entries; keep it as in the paper's d
        self.embed = nn.Embedding(vocab_size, embed)
        self.leaf = nn.Linear(embed, hidden)
        self.V = nn.Parameter(torch.randn(hidden, 2 * hidden, 2 * hidden) * 0.01)
        self.W = nn.Linear(2 * hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    @recompile.function
    def encode(self, tree, i):
        """(h, summed cross-entropy over the subtree rooted at node i)."""
        if tree.is_leaf[i]:
            h = torch.tanh(self.leaf(self.embed(tree.words[i])))
            loss = 0.0
        else:
            hl, loss_l = self.encode(tree, tree.left[i])
            hr, loss_r = self.encode(tree, tree.right[i])
            x = torch.cat([hl, hr], dim=-1)
            bilinear = torch.einsum("i,kij,j->k", x, self.V, x)
            h = torch.tanh(bilinear + self.W(x))
            loss = loss_l + loss_r
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, loss


if __name__ == "__main__":
    main(RNTN, __doc__)
