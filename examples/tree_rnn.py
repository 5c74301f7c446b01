"""Recursive neural network (Socher et al. 2011) on SST, written as a plain recursive method.

    python examples/tree_rnn.py [--data DIR] [--epochs N] [--checkpoint PATH [--resume]] [--curve PNG] [--dump]
"""

import torch
from torch import nn

import recompile
from sst_runner import SentimentModel, main


class TreeRNN(SentimentModel):
    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.leaf = nn.Linear(embed, hidden)
        self.compose = nn.Linear(2 * hidden, hidden)  # h = tanh(W [h_left; h_right] + b)
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
            h = torch.tanh(self.compose(torch.cat([hl, hr], dim=-1)))
            loss = loss_l + loss_r
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, loss


if __name__ == "__main__":
    main(TreeRNN, __doc__)
