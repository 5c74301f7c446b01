"""Structured inputs for tree-structured models.

Trees are stored as index tensors numbered children-before-parents
(:class:`Tree`), batched by concatenation (:class:`Forest`), read from
Penn-Treebank bracket format (:func:`parse_tree`, :func:`read_trees`), with
the Stanford Sentiment Treebank as the standard data set (:func:`load_sst`).
"""

from .forest import Forest
from .nodes import NodeArrays
from .ptb import PTBFormatError, parse_tree, read_trees
from .sst import SST, load_sst, sample_dir
from .tree import Tree, TreeBuilder
from .vocab import Vocab

__all__ = [
    "Forest",
    "NodeArrays",
    "PTBFormatError",
    "SST",
    "Tree",
    "TreeBuilder",
    "Vocab",
    "load_sst",
    "parse_tree",
    "read_trees",
    "sample_dir",
]
