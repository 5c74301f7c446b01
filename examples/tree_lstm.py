"""Binary Tree-LSTM (Tai et al. 2015, constituency variant) on SST, written as a plain recursive method.

    python examples/tree_lstm.py            # the small SST sample shipped with recompile
    python examples/tree_lstm.py --data DIR --epochs 3   # DIR: the full treebank's train/dev/test.txt
    python examples/tree_lstm.py --epochs 5 --checkpoint run.pt --resume --curve curve.png
        # saved after each epoch; run again, it goes on where it stopped; the curve needs matplotlib
"""

import torch
from torch import nn

import recompile
from sst_runner import SentimentModel, main


class TreeLSTM(SentimentModel):
    def __init__(self, vocab_size, embed=300, hidden=150, classes=5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed)
        self.leaf = nn.Linear(embed, 3 * hidden)  # input, output, update gates of a leaf
        self.node = nn.Linear(2 * hidden, 5 * hidden)  # input, output, update, forget-left, forget-right
        self.out = nn.Linear(hidden, classes)

    @recompile.function
    def encode(self, tree, i):
        """(h, c, summed cross-entropy over the subtree rooted at node i)."""
        if tree.is_leaf[i]:
            x = self.embed(tree.words[i])
            ig, og, u = torch.chunk(self.leaf(x), 3, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u)
            loss = 0.0
        else:
            hl, cl, loss_l = self.encode(tree, tree.left[i])
            hr, cr, loss_r = self.encode(tree, tree.right[i])
            ig, og, u, fl, fr = torch.chunk(self.node(torch.cat([hl, hr], dim=-1)), 5, dim=-1)
            c = torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
            loss = loss_l + loss_r
        h = torch.sigmoid(og) * torch.tanh(c)
        loss = loss + self.node_loss(h, tree.labels[i])
        return h, c, loss


if __name__ == "__main__":
    main(TreeLSTM, __doc__)
