"""Tests for recompile.data: trees as index tensors, the PTB reader, Forest, Vocab, SST."""

from __future__ import annotations

import pickle
import runpy
from pathlib import Path

import pytest
import torch

from recompile.data import (
    SST,
    Forest,
    PTBFormatError,
    Tree,
    TreeBuilder,
    Vocab,
    load_sst,
    parse_tree,
    read_trees,
    sample_dir,
)

FIXTURES = Path(__file__).parent / "fixtures"
FULL_SST = Path("/work/shared/data/sst")
REPO = Path(__file__).resolve().parent.parent

EXAMPLE = "(3 (2 It) (4 (4 (2 's) (4 (3 (2 a) (4 lovely)) (2 film))) (2 .)))"


def ids(t: torch.Tensor) -> list:
    return t.tolist()


# -- recursive reference functions, written against one tree ----------------
# They only use x.is_leaf / x.left / x.right / x.labels / x.words, so they
# must give the same answers on a Forest given forest.roots[k].


def label_sum(x, i):
    if x.is_leaf[i]:
        return int(x.labels[i])
    return int(x.labels[i]) + label_sum(x, x.left[i]) + label_sum(x, x.right[i])


def leaf_words(x, i):
    if x.is_leaf[i]:
        return [int(x.words[i])]
    return leaf_words(x, x.left[i]) + leaf_words(x, x.right[i])


def left_deep(depth: int) -> str:
    """(0 (0 ... (0 (1 w0) (1 w1)) ...) (1 wN)): every left child internal."""
    return "(0 " * depth + "(1 w0)" + "".join(f" (1 w{k}))" for k in range(1, depth + 1))


def right_deep(depth: int) -> str:
    return "".join(f"(0 (1 w{k}) " for k in range(depth)) + f"(1 w{depth})" + ")" * depth


# ============================================================================
# Tree
# ============================================================================


class TestTreeArrays:
    def test_example_exact_arrays(self):
        vocab = Vocab()
        tree = parse_tree(EXAMPLE, vocab)
        # Post-order: 0 It, 1 's, 2 a, 3 lovely, 4 (a lovely), 5 film,
        # 6 ((a lovely) film), 7 ('s ...), 8 ., 9 (... .), 10 root.
        assert vocab.itos == ["<unk>", "It", "'s", "a", "lovely", "film", "."]
        assert ids(tree.words) == [1, 2, 3, 4, -1, 5, -1, -1, 6, -1, -1]
        assert ids(tree.left) == [-1, -1, -1, -1, 2, -1, 4, 1, -1, 7, 0]
        assert ids(tree.right) == [-1, -1, -1, -1, 3, -1, 5, 6, -1, 8, 9]
        assert ids(tree.labels) == [2, 2, 2, 4, 3, 2, 4, 4, 2, 4, 3]
        assert ids(tree.is_leaf) == [True, True, True, True, False, True, False, False, True, False, False]
        assert ids(tree.heights) == [0, 0, 0, 0, 1, 0, 2, 3, 0, 4, 5]
        assert tree.root == 10 == tree.num_nodes - 1
        assert tree.height == 5
        assert tree.num_leaves == 6
        assert tree.tokens == ["It", "'s", "a", "lovely", "film", "."]

    def test_dtypes(self):
        tree = parse_tree(EXAMPLE, Vocab())
        for name in ("words", "left", "right", "labels", "heights"):
            assert getattr(tree, name).dtype == torch.long, name
        assert tree.is_leaf.dtype == torch.bool
        assert isinstance(tree.root, int)

    def test_single_leaf_tree(self):
        tree = parse_tree("(4 great)", Vocab())
        assert tree.num_nodes == 1 and tree.root == 0 and tree.height == 0
        assert ids(tree.left) == [-1] and ids(tree.is_leaf) == [True]
        assert tree.to_ptb() == "(4 great)"

    def test_leaves_in_index_order_are_the_sentence(self):
        vocab = Vocab()
        tree = parse_tree(EXAMPLE, vocab)
        assert [vocab.itos[w] for w in tree.words[tree.is_leaf].tolist()] == tree.tokens

    def test_repr(self):
        tree = parse_tree(EXAMPLE, Vocab())
        assert repr(tree) == "Tree(num_nodes=11, height=5, tokens=\"It 's a lovely film .\")"


class TestTreeRoundTrip:
    def test_to_ptb_round_trip(self):
        assert parse_tree(EXAMPLE, Vocab()).to_ptb() == EXAMPLE

    def test_to_ptb_normalises_whitespace(self):
        messy = "  (2\t(1   a)\n  (3 b) ) "
        assert parse_tree(messy, Vocab()).to_ptb() == "(2 (1 a) (3 b))"

    def test_to_ptb_with_vocab_shows_what_the_model_sees(self):
        vocab = Vocab(["a"]).freeze()
        tree = parse_tree("(2 (1 a) (3 zebra))", vocab)
        assert tree.to_ptb() == "(2 (1 a) (3 zebra))"
        assert tree.to_ptb(vocab) == "(2 (1 a) (3 <unk>))"

    def test_to_ptb_without_tokens_needs_vocab(self):
        tree = Tree(words=[1, 2, -1], left=[-1, -1, 0], right=[-1, -1, 1], labels=[1, 3, 2])
        assert tree.tokens is None
        with pytest.raises(ValueError, match="no tokens"):
            tree.to_ptb()
        assert tree.to_ptb(Vocab(["a", "b"])) == "(2 (1 a) (3 b))"

    def test_from_nested(self):
        vocab = Vocab()
        tree = Tree.from_nested((2, (1, "a"), (3, "b")), vocab)
        assert ids(tree.words) == [1, 2, -1]
        assert ids(tree.left) == [-1, -1, 0]
        assert ids(tree.right) == [-1, -1, 1]
        assert ids(tree.labels) == [1, 3, 2]
        assert tree.tokens == ["a", "b"]
        assert tree.to_ptb() == "(2 (1 a) (3 b))"

    def test_from_nested_matches_parser_and_to_nested_inverts(self):
        nested = (3, (2, "It"), (4, (4, (2, "'s"), (4, (3, (2, "a"), (4, "lovely")), (2, "film"))), (2, ".")))
        v1, v2 = Vocab(), Vocab()
        built, parsed = Tree.from_nested(nested, v1), parse_tree(EXAMPLE, v2)
        for name in ("words", "left", "right", "labels", "is_leaf", "heights"):
            assert torch.equal(getattr(built, name), getattr(parsed, name)), name
        assert v1.itos == v2.itos
        assert parsed.to_nested() == nested

    def test_from_nested_grow_false(self):
        vocab = Vocab(["a"])
        tree = Tree.from_nested((2, (1, "a"), (3, "b")), vocab, grow=False)
        assert ids(tree.words) == [1, 0, -1] and len(vocab) == 2

    @pytest.mark.parametrize("bad", [(2, "a", "b"), (2, (1, "a")), ("2", "a"), (2,), (), (2, (1, "a"), 3)])
    def test_from_nested_rejects_malformed(self, bad):
        with pytest.raises(ValueError, match="expected \\(label, word\\) or \\(label, left, right\\)"):
            Tree.from_nested(bad, Vocab())

    def test_builder(self):
        vocab = Vocab()
        b = TreeBuilder()
        a = b.leaf(1, "a", vocab.add("a"))
        c = b.leaf(3, "b", vocab.add("b"))
        b.node(2, a, c)
        assert b.build().to_ptb() == "(2 (1 a) (3 b))"


class TestTreeValidation:
    def test_accepts_valid_arrays(self):
        tree = Tree(words=[5, 6, -1], left=[-1, -1, 0], right=[-1, -1, 1], labels=[0, 1, 2], tokens=["x", "y"])
        assert ids(tree.heights) == [0, 0, 1] and tree.root == 2

    @pytest.mark.parametrize(
        "arrays, message",
        [
            # root first (pre-order), not post-order
            (dict(words=[-1, 1, 2], left=[1, -1, -1], right=[2, -1, -1], labels=[0, 0, 0]), "not post-order"),
            # children swapped
            (dict(words=[1, 2, -1], left=[-1, -1, 1], right=[-1, -1, 0], labels=[0, 0, 0]), "not post-order"),
            # two separate trees
            (dict(words=[1, 2], left=[-1, -1], right=[-1, -1], labels=[0, 0]), "more than one tree"),
            # one child missing
            (dict(words=[1, -1], left=[-1, -1], right=[-1, 0], labels=[0, 0]), "not post-order"),
            (dict(words=[-1], left=[-1], right=[-1], labels=[0]), "leaf 0 has word id -1"),
            (dict(words=[1, 2, 7], left=[-1, -1, 0], right=[-1, -1, 1], labels=[0, 0, 0]), "internal node 2"),
            (dict(words=[1, 2, -1], left=[-1, -1, 0], right=[-1, -1, 1], labels=[0, 0]), "equal length"),
            (dict(words=[], left=[], right=[], labels=[]), "at least one node"),
        ],
    )
    def test_rejects_bad_arrays(self, arrays, message):
        with pytest.raises(ValueError, match=message):
            Tree(**arrays)

    def test_rejects_wrong_token_count(self):
        with pytest.raises(ValueError, match="2 leaves but 1 tokens"):
            Tree(words=[1, 2, -1], left=[-1, -1, 0], right=[-1, -1, 1], labels=[0, 0, 0], tokens=["a"])


class TestTreeDevice:
    def test_to_returns_moved_copy(self):
        tree = parse_tree(EXAMPLE, Vocab())
        moved = tree.to("meta")
        assert moved is not tree
        assert moved.device.type == "meta" and tree.device.type == "cpu"
        for name in ("words", "left", "right", "is_leaf", "labels", "heights"):
            assert getattr(moved, name).device.type == "meta", name
            assert getattr(moved, name).shape == getattr(tree, name).shape
        assert moved.root == tree.root and moved.tokens == tree.tokens

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_cuda_round_trip(self):
        trees = read_trees(FIXTURES / "ptb_small.txt", Vocab())
        tree = trees[0].to("cuda")
        assert tree.words.is_cuda and tree.height == 5
        forest = Forest.from_trees([t.to("cuda") for t in trees])
        assert forest.roots.is_cuda and forest.tree(1).to_ptb() == trees[1].to_ptb()
        assert all(level.is_cuda for level in forest.levels())


# ============================================================================
# PTB reader
# ============================================================================


class TestParseTokens:
    def test_odd_characters_in_words(self):
        text = "(2 (2 -LRB-) (2 (2 ``) (2 (2 's) (2 (2 ...) (2 (2 \\/) (2 (2 n't) (2 caf\u00e9--$5,000&!)))))))"
        tree = parse_tree(text, Vocab())
        assert tree.tokens == ["-LRB-", "``", "'s", "...", "\\/", "n't", "caf\u00e9--$5,000&!"]
        assert tree.to_ptb() == text

    def test_no_break_space_is_part_of_a_word(self):
        # SST train has (2 8\u00a01\/2): only ASCII whitespace separates tokens.
        tree = parse_tree("(2 (2 Contempt) (2 8\u00a01\\/2))", Vocab())
        assert tree.tokens == ["Contempt", "8\u00a01\\/2"]

    def test_tabs_and_newlines_separate(self):
        tree = parse_tree("(2\t(1 a)\r\n(3\tb))", Vocab())
        assert tree.tokens == ["a", "b"] and ids(tree.labels) == [1, 3, 2]

    def test_grow_false_maps_unknown_to_unk(self):
        vocab = Vocab(["a"])
        tree = parse_tree("(2 (1 a) (3 b))", vocab, grow=False)
        assert ids(tree.words) == [1, 0, -1] and len(vocab) == 2
        assert tree.tokens == ["a", "b"]  # the text is kept even if the id is <unk>

    def test_frozen_vocab_does_not_grow(self):
        vocab = Vocab(["a"]).freeze()
        tree = parse_tree("(2 (1 a) (3 b))", vocab, grow=True)
        assert ids(tree.words) == [1, 0, -1] and len(vocab) == 2

    def test_multi_digit_labels(self):
        assert ids(parse_tree("(12 (0 a) (007 b))", Vocab()).labels) == [0, 7, 12]


def bad_tree_cases():
    # (text, column, reason fragment).  Columns are 1-based.
    return [
        ("(2 (1 a))", 9, "internal node opened at column 1 has 1 child; trees must be binary"),
        ("(2 (1 a) (2 b) (3 c))", 16, "internal node opened at column 1 has more than 2 children"),
        ("(2 (1 a) (2 (0 b)))", 18, "internal node opened at column 10 has 1 child"),
        ("(2 (1 a) (2 b)", 15, "unbalanced parentheses: expected ')', found end of line with 1 node(s) still open"),
        ("(2 (1 (0 a) (0 b)) (2 (1 c) (2 d)", 34, "2 node(s) still open (innermost opened at column 20)"),
        ("(2 a))", 6, "unbalanced ')': the tree is already complete"),
        ("(2 (1 a) (3 b)))", 16, "unbalanced ')'"),
        (")", 1, "expected '(' to start a tree, found ')'"),
        ("(2 a) (3 b)", 7, "trailing text after the end of the tree: '(3 b)'"),
        ("(2 a) junk", 7, "trailing text after the end of the tree: 'junk'"),
        ("((1 a) (2 b))", 2, "missing label: expected an integer label after '(', found '('"),
        ("(", 2, "missing label: expected an integer label after '(', found end of line"),
        ("()", 2, "empty node: expected an integer label after '(', found ')'"),
        ("(2 (1 a) ())", 11, "empty node: expected an integer label"),
        ("(2)", 3, "empty node: expected a word or a child after label 2, found ')'"),
        ("(2", 3, "expected a word or a child after label 2, found end of line"),
        ("(x a)", 2, "label must be a non-negative integer, found 'x'"),
        ("(2.5 a)", 2, "label must be a non-negative integer, found '2.5'"),
        ("(-1 a)", 2, "label must be a non-negative integer, found '-1'"),
        ("(2 (1 a) (positive b))", 11, "label must be a non-negative integer, found 'positive'"),
        ("(2 a b)", 6, "expected ')' to close leaf '(2 a', found 'b'"),
        ("(2 a (1 b))", 6, "expected ')' to close leaf '(2 a', found '('"),
        ("(2 a", 5, "expected ')' to close leaf '(2 a', found end of line"),
        ("(2 (1 a) b)", 10, "expected '(' or ')', found word 'b'"),
        ("hello", 1, "expected '(' to start a tree, found 'hello'"),
        ("", 1, "expected '(' to start a tree, found end of line"),
    ]


class TestParseErrors:
    @pytest.mark.parametrize("text, column, reason", bad_tree_cases())
    def test_error_location_and_reason(self, text, column, reason):
        with pytest.raises(PTBFormatError) as info:
            parse_tree(text, Vocab(), filename="train.txt", lineno=12)
        err = info.value
        assert (err.filename, err.lineno, err.column) == ("train.txt", 12, column)
        assert reason in err.reason
        assert str(err).startswith(f"train.txt:12:{column}: {err.reason}\n")

    def test_is_a_value_error(self):
        with pytest.raises(ValueError):
            parse_tree("(2 a", Vocab())

    def test_defaults_without_file(self):
        with pytest.raises(PTBFormatError) as info:
            parse_tree("(2 a b)", Vocab())
        assert info.value.filename is None and info.value.lineno == 1
        assert str(info.value).startswith("<string>:1:6: expected ')'")

    def test_message_shows_line_and_caret(self):
        with pytest.raises(PTBFormatError) as info:
            parse_tree("(2 a b)", Vocab(), filename="f.txt")
        assert str(info.value).splitlines()[1:] == ["    (2 a b)", "         ^"]

    def test_long_line_snippet_is_windowed(self):
        text = "(2 (1 a) " + " ".join(["(2 (1 x)"] * 100) + " (2 b c" + ")" * 101
        with pytest.raises(PTBFormatError) as info:
            parse_tree(text, Vocab())
        _, snippet, caret = str(info.value).splitlines()
        assert len(snippet) < 90 and snippet.lstrip().startswith("...")
        assert snippet[caret.index("^")] == "c"

    def test_label_range(self):
        assert parse_tree("(4 a)", Vocab(), num_labels=5).labels.tolist() == [4]
        with pytest.raises(PTBFormatError, match=r"<string>:1:11: label 5 out of range: expected 0..4"):
            parse_tree("(2 (1 a) (5 b))", Vocab(), num_labels=5)

    def test_multi_line_text_reports_the_right_line(self):
        with pytest.raises(PTBFormatError) as info:
            parse_tree("(2 (1 a)\n   (3 b c))", Vocab(), lineno=7)
        assert (info.value.lineno, info.value.column) == (8, 9)
        assert info.value.text == "   (3 b c))"

    def test_picklable(self):
        with pytest.raises(PTBFormatError) as info:
            parse_tree("(2 a b)", Vocab(), filename="f.txt", lineno=3)
        copy = pickle.loads(pickle.dumps(info.value))
        assert (copy.filename, copy.lineno, copy.column, str(copy)) == ("f.txt", 3, 6, str(info.value))


class TestDeepTrees:
    @pytest.mark.parametrize("make", [left_deep, right_deep])
    def test_5000_deep_parses_and_round_trips(self, make):
        text = make(5000)
        tree = parse_tree(text, Vocab())
        assert tree.num_nodes == 10001 and tree.height == 5000
        assert tree.to_ptb() == text
        # Rebuilding from the arrays re-runs the post-order check.
        again = Tree(tree.words, tree.left, tree.right, tree.labels, tree.tokens)
        assert torch.equal(again.heights, tree.heights)
        forest = Forest.from_trees([tree, tree])
        assert len(forest.levels()) == 5001
        assert forest.tree(1).to_ptb() == text

    def test_deep_error_is_still_located(self):
        text = left_deep(5000)[:-1]
        with pytest.raises(PTBFormatError) as info:
            parse_tree(text, Vocab())
        assert info.value.column == len(text) + 1 and "unbalanced parentheses" in info.value.reason


class TestReadTrees:
    def test_reads_file_skipping_blank_lines(self):
        vocab = Vocab()
        trees = read_trees(FIXTURES / "ptb_small.txt", vocab)
        assert [t.num_nodes for t in trees] == [11, 7, 1]
        assert trees[1].tokens == ["-LRB-", "``", "awful...", "-RRB-"]
        lines = [line for line in (FIXTURES / "ptb_small.txt").read_text().splitlines() if line]
        assert [t.to_ptb() for t in trees] == lines

    def test_reads_iterable_of_lines(self):
        trees = read_trees(["(1 a)\n", "   \t\n", "(2 (1 b) (3 c))\n"], Vocab())
        assert [t.to_ptb() for t in trees] == ["(1 a)", "(2 (1 b) (3 c))"]

    def test_error_has_file_line_column(self, tmp_path):
        path = tmp_path / "train.txt"
        path.write_text("(2 (1 a) (3 b))\n\n(2 (1 a) (3 b))\n(3 (2 ok) (1 (2 x) (2 y) (2 z)))\n")
        with pytest.raises(PTBFormatError) as info:
            read_trees(path, Vocab())
        err = info.value
        assert (err.filename, err.lineno, err.column) == (str(path), 4, 26)
        assert str(err).startswith(f"{path}:4:26: internal node opened at column 11 has more than 2 children")

    def test_error_from_open_file_uses_its_name(self, tmp_path):
        path = tmp_path / "dev.txt"
        path.write_text("(1 a)\n(2 a b)\n")
        with open(path) as f, pytest.raises(PTBFormatError) as info:
            read_trees(f, Vocab())
        assert (info.value.filename, info.value.lineno, info.value.column) == (str(path), 2, 6)

    def test_error_from_list_has_line_number(self):
        with pytest.raises(PTBFormatError) as info:
            read_trees(["(1 a)", "", "(2 (1 a)"], Vocab())
        assert (info.value.filename, info.value.lineno, info.value.column) == (None, 3, 9)

    def test_bom_is_ignored(self, tmp_path):
        path = tmp_path / "bom.txt"
        path.write_bytes("\ufeff(1 a)\n".encode("utf-8"))
        assert read_trees(path, Vocab())[0].tokens == ["a"]

    def test_text_instead_of_path_is_refused(self):
        with pytest.raises(TypeError, match="use parse_tree"):
            read_trees("(1 a)", Vocab())

    def test_missing_file(self, tmp_path):
        with pytest.raises(FileNotFoundError):
            read_trees(tmp_path / "nope.txt", Vocab())


# ============================================================================
# Forest
# ============================================================================


@pytest.fixture(scope="module")
def small_trees():
    vocab = Vocab()
    trees = read_trees(FIXTURES / "ptb_small.txt", vocab)
    trees += read_trees(sample_dir() / "dev.txt", vocab)[:20]
    return trees


class TestForest:
    def test_offsets_roots_sizes(self, small_trees):
        trees = small_trees[:3]  # 11, 7 and 1 nodes
        forest = Forest.from_trees(trees)
        assert ids(forest.sizes) == [11, 7, 1]
        assert ids(forest.offsets) == [0, 11, 18]
        assert ids(forest.roots) == [10, 17, 18]
        assert ids(forest.tree_of) == [0] * 11 + [1] * 7 + [2]
        assert forest.num_trees == len(forest) == 3 and forest.num_nodes == 19
        # tree 1's child indices are shifted by its offset, leaves keep -1
        assert ids(forest.left[11:18]) == [t + 11 if t >= 0 else -1 for t in ids(trees[1].left)]
        assert ids(forest.right[11:18]) == [t + 11 if t >= 0 else -1 for t in ids(trees[1].right)]
        assert ids(forest.words) == ids(torch.cat([t.words for t in trees]))
        assert ids(forest.labels) == ids(torch.cat([t.labels for t in trees]))
        assert ids(forest.heights) == ids(torch.cat([t.heights for t in trees]))
        assert forest.height == 5

    def test_recursive_function_agrees_on_forest_and_trees(self, small_trees):
        forest = Forest.from_trees(small_trees)
        for k, tree in enumerate(small_trees):
            root = forest.roots[k]
            assert label_sum(forest, root) == label_sum(tree, tree.root) == int(tree.labels.sum())
            assert leaf_words(forest, root) == leaf_words(tree, tree.root) == ids(tree.words[tree.is_leaf])

    def test_children_precede_parents(self, small_trees):
        forest = Forest.from_trees(small_trees)
        internal = ~forest.is_leaf
        index = torch.arange(forest.num_nodes)
        assert bool((forest.left[internal] < index[internal]).all())
        assert bool((forest.right[internal] < index[internal]).all())
        assert bool((forest.tree_of[forest.left[internal]] == forest.tree_of[internal]).all())

    def test_tree_round_trip(self, small_trees):
        forest = Forest.from_trees(small_trees)
        for k, tree in enumerate(small_trees):
            back = forest.tree(k)
            for name in ("words", "left", "right", "is_leaf", "labels", "heights"):
                assert torch.equal(getattr(back, name), getattr(tree, name)), (k, name)
            assert back.root == tree.root and back.tokens == tree.tokens
            assert back.to_ptb() == tree.to_ptb()
        assert forest.tree(-1).to_ptb() == small_trees[-1].to_ptb()
        assert [t.to_ptb() for t in forest.trees()] == [t.to_ptb() for t in small_trees]

    def test_tree_index_out_of_range(self, small_trees):
        forest = Forest.from_trees(small_trees[:2])
        with pytest.raises(IndexError, match="tree index 2 out of range for a forest of 2 trees"):
            forest.tree(2)

    def test_levels(self, small_trees):
        forest = Forest.from_trees(small_trees)
        levels = forest.levels()
        assert len(levels) == forest.height + 1
        assert sorted(torch.cat(levels).tolist()) == list(range(forest.num_nodes))
        done = torch.zeros(forest.num_nodes, dtype=torch.bool)
        for h, level in enumerate(levels):
            assert level.dtype == torch.long
            assert bool((forest.heights[level] == h).all())
            assert ids(level) == sorted(ids(level))
            internal = level[~forest.is_leaf[level]]
            # a valid bottom-up schedule: children were computed at lower levels
            assert bool(done[forest.left[internal]].all()) and bool(done[forest.right[internal]].all())
            done[level] = True
        assert ids(levels[0]) == ids(forest.is_leaf.nonzero().flatten())

    def test_levels_of_example_tree(self):
        tree = parse_tree(EXAMPLE, Vocab())
        assert [ids(level) for level in tree.levels()] == [[0, 1, 2, 3, 5, 8], [4], [6], [7], [9], [10]]

    def test_empty_forest(self):
        forest = Forest.from_trees([])
        assert forest.num_trees == 0 and forest.num_nodes == 0 and forest.levels() == []
        assert forest.is_leaf.dtype == torch.bool and forest.roots.dtype == torch.long

    def test_to_device(self, small_trees):
        forest = Forest.from_trees(small_trees[:3])
        moved = forest.to("meta")
        for name in ("words", "left", "right", "is_leaf", "labels", "heights", "roots", "offsets", "sizes", "tree_of"):
            assert getattr(moved, name).device.type == "meta", name
        assert forest.roots.device.type == "cpu" and moved.tokens == forest.tokens

    def test_mixed_devices_refused(self, small_trees):
        with pytest.raises(ValueError, match="one device"):
            Forest.from_trees([small_trees[0], small_trees[1].to("meta")])

    def test_repr(self, small_trees):
        assert repr(Forest.from_trees(small_trees[:3])) == "Forest(num_trees=3, num_nodes=19, height=5)"


# ============================================================================
# Vocab
# ============================================================================


class TestVocab:
    def test_starts_with_unk(self):
        vocab = Vocab()
        assert vocab.itos == ["<unk>"] and len(vocab) == 1
        assert vocab["<unk>"] == Vocab.UNK_ID == 0 and "<unk>" in vocab

    def test_add_and_lookup(self):
        vocab = Vocab()
        assert [vocab.add(t) for t in ["a", "b", "a"]] == [1, 2, 1]
        assert vocab["b"] == 2 and vocab["zzz"] == 0
        assert "a" in vocab and "zzz" not in vocab
        assert vocab.lookup("zzz") == 0 and len(vocab) == 3  # default: no growth
        assert vocab.lookup("zzz", grow=True) == 3 and len(vocab) == 4
        assert list(vocab) == ["<unk>", "a", "b", "zzz"]

    def test_freeze(self):
        vocab = Vocab(["a"])
        assert vocab.freeze() is vocab and vocab.frozen
        assert vocab.add("b") == 0 and vocab.lookup("b", grow=True) == 0
        assert vocab.add("a") == 1 and len(vocab) == 2 and "b" not in vocab
        assert repr(vocab) == "Vocab(size=2, frozen)"

    def test_add_requires_str(self):
        with pytest.raises(TypeError, match="must be str"):
            Vocab().add(3)

    def test_save_load_round_trip(self, tmp_path):
        vocab = Vocab(["a", "-LRB-", "caf\u00e9", "two words", "8\u00a01\\/2"])
        vocab.save(tmp_path / "vocab.txt")
        assert (tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines()[:2] == ["<unk>", "a"]
        loaded = Vocab.load(tmp_path / "vocab.txt")
        assert loaded.itos == vocab.itos and not loaded.frozen

    def test_save_refuses_line_breaks(self, tmp_path):
        with pytest.raises(ValueError, match="line break"):
            Vocab(["bad\ntoken"]).save(tmp_path / "v.txt")

    def test_load_checks_header_and_duplicates(self, tmp_path):
        path = tmp_path / "v.txt"
        path.write_text("a\nb\n")
        with pytest.raises(ValueError, match=r"v.txt:1: .* must start with '<unk>', found 'a'"):
            Vocab.load(path)
        path.write_text("<unk>\na\nb\na\n")
        with pytest.raises(ValueError, match=r"v.txt:4: duplicate token 'a'"):
            Vocab.load(path)


# ============================================================================
# SST
# ============================================================================


class TestSST:
    def test_sample_is_shipped(self):
        names = sorted(p.name for p in sample_dir().iterdir())
        assert names == ["README.md", "dev.txt", "test.txt", "train.txt"]
        assert sum(p.stat().st_size for p in sample_dir().iterdir()) < 300_000

    def test_load_sample(self):
        sst = load_sst(sample_dir())
        assert isinstance(sst, SST)
        assert (len(sst.train), len(sst.dev), len(sst.test)) == (400, 100, 100)
        assert sst["dev"] is sst.dev
        for trees in (sst.train, sst.dev, sst.test):
            for tree in trees:
                assert 0 <= int(tree.labels.min()) and int(tree.labels.max()) <= 4
                assert bool((tree.words < len(sst.vocab)).all())

    def test_sample_round_trips_line_by_line(self):
        sst = load_sst(sample_dir())
        for split in ("train", "dev", "test"):
            lines = (sample_dir() / f"{split}.txt").read_text(encoding="utf-8").splitlines()
            assert [t.to_ptb() for t in sst[split]] == lines, split

    def test_vocab_comes_from_train_only(self):
        sst = load_sst(sample_dir())
        train_words = {w for t in sst.train for w in t.tokens}
        assert len(sst.vocab) == len(train_words) + 1
        unseen = [(t, i) for t in sst.dev for i, w in enumerate(t.tokens) if w not in train_words]
        assert unseen, "the dev sample should contain words not in the train sample"
        for tree, i in unseen:
            assert int(tree.words[tree.is_leaf][i]) == 0

    def test_given_vocab_and_subset_of_splits(self):
        vocab = load_sst(sample_dir(), splits=("train",)).vocab
        size = len(vocab)
        sst = load_sst(sample_dir(), splits=("test", "dev"), vocab=vocab)
        assert sst.train is None and len(sst.dev) == 100 and len(vocab) == size
        with pytest.raises(KeyError, match="'train' was not loaded"):
            sst["train"]

    def test_needs_train_or_vocab(self):
        with pytest.raises(ValueError, match="include 'train' in splits or pass a vocab"):
            load_sst(sample_dir(), splits=("dev",))

    def test_unknown_split(self):
        with pytest.raises(ValueError, match="unknown SST split"):
            load_sst(sample_dir(), splits=("train", "validation"))

    def test_missing_file_named_before_reading(self, tmp_path):
        (tmp_path / "train.txt").write_text("(1 a)\n")
        (tmp_path / "dev.txt").write_text("(1 b)\n")
        vocab = Vocab()
        with pytest.raises(FileNotFoundError) as info:
            load_sst(tmp_path, vocab=vocab)
        assert str(tmp_path / "test.txt") in str(info.value)
        assert "SST test split not found" in str(info.value)
        assert len(vocab) == 1  # nothing was read

    def test_labels_out_of_range_are_errors(self, tmp_path):
        for split in ("train", "dev", "test"):
            (tmp_path / f"{split}.txt").write_text("(1 a)\n")
        (tmp_path / "dev.txt").write_text("(1 a)\n(2 (5 a) (1 b))\n")
        with pytest.raises(PTBFormatError, match=r"dev.txt:2:5: label 5 out of range: expected 0..4"):
            load_sst(tmp_path)

    @pytest.mark.skipif(not FULL_SST.is_dir(), reason="full SST not available")
    def test_full_treebank(self):
        sst = load_sst(FULL_SST)
        assert (len(sst.train), len(sst.dev), len(sst.test)) == (8544, 1101, 2210)
        # Published SST-5 root-label distribution (see the data set's README).
        assert torch.bincount(torch.stack([t.labels[t.root] for t in sst.train])).tolist() == [
            1092, 2218, 1624, 2322, 1288]
        assert torch.bincount(torch.stack([t.labels[t.root] for t in sst.test])).tolist() == [
            279, 633, 389, 510, 399]
        assert len(sst.vocab) == 18280 + 1  # word types in train, plus <unk>
        assert max(t.height for t in sst.test) == 28 and max(t.num_nodes for t in sst.test) == 111


def test_example_script_runs(capsys):
    runpy.run_path(str(REPO / "examples" / "data" / "sst_forest.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "400 train trees" in out
