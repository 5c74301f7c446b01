"""Token <-> id mapping shared by every split of a data set.

Id 0 is always ``<unk>``, so unknown words need no special casing downstream:
an embedding table of ``len(vocab)`` rows covers every id a lookup can return.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator


class Vocab:
    """Maps tokens (strings) to consecutive integer ids; id 0 is ``<unk>``.

    The vocabulary grows through :meth:`add` (or ``lookup(token, grow=True)``)
    until :meth:`freeze` is called.  A frozen vocabulary never changes size:
    adding a token it does not know returns ``UNK_ID`` instead of a new id.
    That makes "read training data growing the vocabulary, then freeze and
    read evaluation data with the same code" safe — the embedding table sized
    from ``len(vocab)`` stays valid.

    ``itos`` is the list of tokens by id (``itos[0] == "<unk>"``).
    """

    UNK = "<unk>"
    UNK_ID = 0

    def __init__(self, tokens: Iterable[str] = ()):
        self.itos: list[str] = [self.UNK]
        self._stoi: dict[str, int] = {self.UNK: self.UNK_ID}
        self._frozen = False
        for token in tokens:
            self.add(token)

    # -- growing -----------------------------------------------------------

    def add(self, token: str) -> int:
        """Return the id of ``token``, giving it a new id if it is new.

        On a frozen vocabulary a new token is not added and ``UNK_ID`` is
        returned.
        """
        index = self._stoi.get(token)
        if index is not None:
            return index
        if not isinstance(token, str):
            raise TypeError(f"vocabulary tokens must be str, got {type(token).__name__}: {token!r}")
        if self._frozen:
            return self.UNK_ID
        index = len(self.itos)
        self.itos.append(token)
        self._stoi[token] = index
        return index

    def lookup(self, token: str, grow: bool = False) -> int:
        """Id of ``token``; a new token is added if ``grow`` (see :meth:`add`),
        otherwise it maps to ``UNK_ID``."""
        if grow:
            return self.add(token)
        return self._stoi.get(token, self.UNK_ID)

    def freeze(self) -> "Vocab":
        """Stop growing (see the class docstring).  Returns ``self``."""
        self._frozen = True
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen

    # -- reading -----------------------------------------------------------

    def __getitem__(self, token: str) -> int:
        """Id of ``token``, ``UNK_ID`` if unknown (never grows)."""
        return self._stoi.get(token, self.UNK_ID)

    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __len__(self) -> int:
        return len(self.itos)

    def __iter__(self) -> Iterator[str]:
        """Tokens in id order, ``<unk>`` first."""
        return iter(self.itos)

    def __repr__(self) -> str:
        state = ", frozen" if self._frozen else ""
        return f"Vocab(size={len(self)}{state})"

    # -- files -------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write one token per line, in id order (line 1 is ``<unk>``)."""
        for index, token in enumerate(self.itos):
            if "\n" in token or "\r" in token:
                raise ValueError(f"cannot save token {index} ({token!r}): it contains a line break")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(token + "\n" for token in self.itos)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Vocab":
        """Read a file written by :meth:`save`; token ids are line numbers - 1.

        The result is not frozen; call :meth:`freeze` if it must not grow.
        """
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the last line
        if not lines or lines[0] != cls.UNK:
            found = repr(lines[0]) if lines else "an empty file"
            raise ValueError(f"{os.fspath(path)}:1: a vocabulary file must start with {cls.UNK!r}, found {found}")
        vocab = cls()
        for lineno, token in enumerate(lines[1:], start=2):
            if token in vocab:
                raise ValueError(f"{os.fspath(path)}:{lineno}: duplicate token {token!r}")
            vocab.add(token)
        return vocab
