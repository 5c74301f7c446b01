r"""Reader for Penn-Treebank bracketed trees in the SST format.

One tree per line, every node labelled with an integer::

    (3 (2 It) (4 (4 (2 's) (4 (3 (2 a) (4 lovely)) (2 film))) (2 .)))

A node is ``(LABEL word)`` (a leaf) or ``(LABEL child child)``; our models
are binary, so an internal node with any other number of children is an
error.  A word is any run of characters other than whitespace and
parentheses (``-LRB-``, ``'s``, ``...``).  Only ASCII whitespace separates
tokens: SST has words with a no-break space inside (``8\u00a01\/2``).

The parser is a tokenizer plus a loop over an explicit stack of open nodes,
so tree depth is not limited by Python's recursion limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable, NoReturn

from .tree import Tree, TreeBuilder
from .vocab import Vocab

# A token is a parenthesis or a maximal run of anything else but whitespace;
# whatever the pattern skips is whitespace.  re.ASCII makes \s ASCII-only.
_WHITESPACE = " \t\n\r\f\v"
_TOKEN = re.compile(r"[()]|[^\s()]+", re.ASCII)


class PTBFormatError(ValueError):
    """Malformed PTB input, with where it was found.

    ``filename`` (None for a string not read from a file), ``lineno``
    (1-based line in the file), ``column`` (1-based) and ``reason`` (what
    was wrong); ``text`` is the offending line.  ``str(err)`` reads
    ``train.txt:12:37: expected ')' ...`` followed by the line and a caret.
    """

    def __init__(self, reason: str, filename: str | None, lineno: int, column: int, text: str | None = None):
        self.reason = reason
        self.filename = filename
        self.lineno = lineno
        self.column = column
        self.text = text
        super().__init__(self._format())

    def __reduce__(self):  # keep picklable (e.g. raised in a DataLoader worker)
        return type(self), (self.reason, self.filename, self.lineno, self.column, self.text)

    def _format(self) -> str:
        message = f"{self.filename or '<string>'}:{self.lineno}:{self.column}: {self.reason}"
        if self.text is None:
            return message
        snippet, caret = _snippet(self.text, self.column)
        return f"{message}\n    {snippet}\n    {caret}"


def _snippet(line: str, column: int, width: int = 72) -> tuple[str, str]:
    """A window of at most about ``width`` characters of ``line`` around
    ``column``, and a caret line pointing at it (SST lines run to 700)."""
    start = max(0, min(column - 1 - width // 2, len(line) - width))
    end = start + width
    prefix = "..." if start > 0 else ""
    suffix = "..." if end < len(line) else ""
    text = prefix + line[start:end].replace("\t", " ") + suffix  # tabs would shift the caret
    return text, " " * (len(prefix) + column - 1 - start) + "^"


@dataclass(slots=True)
class _OpenNode:
    """An internal node whose ')' has not been seen yet."""

    label: int
    start: int  # token index of its '('
    children: list[int] = field(default_factory=list)


# Padding after the last token, so looking a few tokens ahead needs no bounds
# checks; the empty string stands for "end of input".
_END = ""
_LOOKAHEAD = 3


class _Parser:
    """Parses one tree; raises PTBFormatError located in the source file.

    Tokens are kept as bare strings for speed; their offsets in the text are
    only recomputed when reporting an error.
    """

    def __init__(self, text: str, filename: str | None, lineno: int, num_labels: int | None):
        self.text = text
        self.filename = filename
        self.lineno = lineno
        self.num_labels = num_labels
        self.tokens = _TOKEN.findall(text) + [_END] * _LOOKAHEAD

    def parse(self, vocab: Vocab, grow: bool) -> Tree:
        tokens = self.tokens
        builder = TreeBuilder()
        stack: list[_OpenNode] = []
        if tokens[0] != "(":
            self._fail(0, f"expected '(' to start a tree, found {self._describe(0)}")
        i = 0
        while True:
            token = tokens[i]
            if token == "(":
                if stack and len(stack[-1].children) == 2:
                    self._fail(i, f"internal node opened at column {self._column(stack[-1].start)} "
                                  "has more than 2 children; trees must be binary")
                label = self._label(i + 1)
                content = tokens[i + 2]
                if content == "(":  # internal node: children follow
                    stack.append(_OpenNode(label, i))
                    i += 2
                    continue
                if content in (")", _END):
                    what = "empty node: " if content else ""
                    self._fail(i + 2, f"{what}expected a word or a child after label {label}, "
                                      f"found {self._describe(i + 2)}")
                if tokens[i + 3] != ")":
                    self._fail(i + 3, f"expected ')' to close leaf '({label} {content}', "
                                      f"found {self._describe(i + 3)}")
                done = builder.leaf(label, content, vocab.lookup(content, grow))
                i += 4
            elif token == ")":
                node = stack.pop()
                if len(node.children) != 2:
                    count = len(node.children)
                    self._fail(i, f"internal node opened at column {self._column(node.start)} has "
                                  f"{count} child{'' if count == 1 else 'ren'}; trees must be binary "
                                  "(exactly 2 children)")
                done = builder.node(node.label, *node.children)
                i += 1
            elif token == _END:
                self._fail(i, f"unbalanced parentheses: expected ')', found end of line with {len(stack)} "
                              f"node(s) still open (innermost opened at column {self._column(stack[-1].start)})")
            else:
                self._fail(i, f"expected '(' or ')', found word {token!r}: inside an internal node "
                              "every child must be a bracketed node like '(2 word)'")
            if stack:
                stack[-1].children.append(done)
                continue
            if tokens[i] == ")":
                self._fail(i, "unbalanced ')': the tree is already complete")
            if tokens[i] != _END:
                rest = self.text[self._offset(i):].rstrip()
                rest = rest if len(rest) <= 30 else rest[:27] + "..."
                self._fail(i, f"trailing text after the end of the tree: {rest!r}")
            return builder.build()

    def _label(self, i: int) -> int:
        """The label at token ``i`` (just after a '(')."""
        token = self.tokens[i]
        if token in ("(", ")", _END):
            what = "empty node" if token == ")" else "missing label"
            self._fail(i, f"{what}: expected an integer label after '(', found {self._describe(i)}")
        if not (token.isascii() and token.isdigit()):
            self._fail(i, f"label must be a non-negative integer, found {token!r}")
        label = int(token)
        if self.num_labels is not None and label >= self.num_labels:
            self._fail(i, f"label {label} out of range: expected 0..{self.num_labels - 1}")
        return label

    def _describe(self, i: int) -> str:
        token = self.tokens[i]
        return repr(token) if token else "end of line"

    # -- error locations (only computed on failure) --------------------------

    def _offset(self, i: int) -> int:
        """0-based offset in the text of token ``i``; end of input is just
        after the last token."""
        starts = [m.start() for m in _TOKEN.finditer(self.text)]
        if i < len(starts):
            return starts[i]
        return starts[-1] + len(self.tokens[len(starts) - 1]) if starts else 0

    def _column(self, i: int) -> int:
        """1-based column of token ``i`` on its line."""
        offset = self._offset(i)
        return offset - self.text.rfind("\n", 0, offset)

    def _fail(self, i: int, reason: str) -> NoReturn:
        offset = self._offset(i)
        line_start = self.text.rfind("\n", 0, offset) + 1
        line_end = self.text.find("\n", offset)
        line = self.text[line_start:] if line_end < 0 else self.text[line_start:line_end]
        raise PTBFormatError(
            reason,
            filename=self.filename,
            lineno=self.lineno + self.text.count("\n", 0, offset),
            column=offset - line_start + 1,
            text=line.rstrip("\r\n"),
        )


def parse_tree(
    line: str,
    vocab: Vocab,
    *,
    grow: bool = True,
    num_labels: int | None = None,
    lineno: int | None = None,
    filename: str | None = None,
) -> Tree:
    """Parse one bracketed tree.

    Words get ids from ``vocab``: new words are added if ``grow`` (and the
    vocabulary is not frozen), otherwise they map to ``<unk>`` (id 0).
    ``num_labels``, if given, bounds the labels to ``0 .. num_labels - 1``.
    ``lineno`` (default 1) and ``filename`` only locate errors: a malformed
    tree raises :class:`PTBFormatError` naming ``filename:lineno:column``.
    The text may span several lines; newlines count as whitespace.
    """
    parser = _Parser(line, filename, 1 if lineno is None else lineno, num_labels)
    return parser.parse(vocab, grow)


def read_trees(
    source: str | os.PathLike | Iterable[str],
    vocab: Vocab,
    *,
    grow: bool = True,
    num_labels: int | None = None,
) -> list[Tree]:
    """Read one tree per non-blank line from a file path or an iterable of lines.

    ``vocab`` is updated in place (see :func:`parse_tree` for ``grow`` and
    ``num_labels``).  Errors carry the 1-based line number in the source
    and, for a path or an open file, its name.
    """
    if isinstance(source, str) and (source.lstrip().startswith("(") or "\n" in source):
        raise TypeError("read_trees takes a path or an iterable of lines, not PTB text; "
                        "use parse_tree, or pass text.splitlines()")
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8-sig") as f:  # -sig: tolerate a BOM
            return _read_lines(f, os.fspath(source), vocab, grow, num_labels)
    name = getattr(source, "name", None)  # an open file knows its name
    return _read_lines(source, name if isinstance(name, str) else None, vocab, grow, num_labels)


def _read_lines(lines: Iterable[str], filename, vocab, grow, num_labels) -> list[Tree]:
    return [
        parse_tree(line, vocab, grow=grow, num_labels=num_labels, lineno=lineno, filename=filename)
        for lineno, line in enumerate(lines, start=1)
        if line.strip(_WHITESPACE)
    ]
