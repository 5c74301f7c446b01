"""The Stanford Sentiment Treebank (SST-5) in its PTB-format split files.

A data directory holds ``train.txt``, ``dev.txt`` and ``test.txt``, one
binarised tree per line with a sentiment label 0..4 on every node.  A small
sample of each split ships with the package (see :func:`sample_dir`).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .ptb import read_trees
from .tree import Tree
from .vocab import Vocab

SPLITS = ("train", "dev", "test")
NUM_LABELS = 5  # 0 = very negative ... 4 = very positive


@dataclass
class SST:
    """The loaded splits (None where not requested) and their shared vocabulary."""

    vocab: Vocab
    train: list[Tree] | None = None
    dev: list[Tree] | None = None
    test: list[Tree] | None = None

    def __getitem__(self, split: str) -> list[Tree]:
        """``sst["dev"]``; KeyError if the split is unknown or was not loaded."""
        trees = getattr(self, split, None) if split in SPLITS else None
        if trees is None:
            raise KeyError(f"split {split!r} was not loaded")
        return trees


def sample_dir() -> Path:
    """Directory of the small SST sample shipped with the package: the first
    400 / 100 / 100 trees of train / dev / test."""
    # Package data sits next to this module in a normal (unzipped) install.
    return Path(__file__).resolve().parent / "sst_sample"


def load_sst(
    data_dir: str | os.PathLike,
    splits: Sequence[str] = SPLITS,
    vocab: Vocab | None = None,
) -> SST:
    """Read ``{split}.txt`` from ``data_dir`` for each split in ``splits``.

    Vocabulary: with ``vocab=None`` a new one is built from the train split
    (which must then be among ``splits``).  A given ``vocab`` grows on the
    train split unless it is frozen.  Dev and test never grow it: their
    unseen words map to ``<unk>``.  Labels outside 0..4 are format errors.

    Raises FileNotFoundError naming the first missing split file (before
    reading anything) and :class:`~recompile.data.PTBFormatError` for bad input.
    """
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise ValueError(f"unknown SST split(s) {unknown}; expected some of {list(SPLITS)}")
    if vocab is None:
        if "train" not in splits:
            raise ValueError("load_sst builds its vocabulary from the train split; "
                             "include 'train' in splits or pass a vocab")
        vocab = Vocab()
    paths = {split: Path(data_dir) / f"{split}.txt" for split in splits}
    for split, path in paths.items():
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, f"SST {split} split not found (expected PTB trees, one per line)",
                                    str(path))
    result = SST(vocab=vocab)
    # Train first, so the vocabulary is complete before dev/test are looked up.
    for split in sorted(splits, key=SPLITS.index):
        trees = read_trees(paths[split], vocab, grow=(split == "train"), num_labels=NUM_LABELS)
        setattr(result, split, trees)
    return result
