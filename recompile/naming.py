"""One Namer for every generated name: readable, unique, the same on every build.

A name is its base where that is free, else the base with a numbered suffix (``h``, ``h_2``, ``h_3``; the
suffix and where its numbering starts are the Namer's). ``refuse`` turns down names besides those already
given (a keyword, a builtin, another table's names). Each base remembers where its numbering stopped, so
many values of one base cost no rescans; since given names are never taken back, the name chosen is the
first free one, as a scan from the start would find.
"""

from __future__ import annotations


def numbered(k):
    return f"_{k}"


class Namer:
    def __init__(self, suffix=numbered, start=2, refuse=None, reserved=()):
        self.suffix = suffix  # k -> the suffix of the k-th candidate after the base
        self.start = start
        self.refuse = refuse
        self.given = set(reserved)
        self._next = {}  # base -> the first suffix number not tried yet
        self._names = {}  # key -> its name (``name_of``)

    def _free(self, name):
        return name not in self.given and not (self.refuse is not None and self.refuse(name))

    def fresh(self, base):
        """A new name: ``base`` if free, else ``base`` + the first free suffix."""
        name = base
        if not self._free(name):
            k = self._next.get(base, self.start)
            name = base + self.suffix(k)
            while not self._free(name):
                k += 1
                name = base + self.suffix(k)
            self._next[base] = k + 1
        self.given.add(name)
        return name

    def name_of(self, key, base):
        """The name of ``key`` (a Value, an object): made from ``base`` the first time it is asked for."""
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = self.fresh(base)
        return name

    def given_to(self, key):
        """The name ``key`` was given (``name_of``), or None: for a caller whose base costs to make."""
        return self._names.get(key)

    def reserve(self, name):
        """Keep ``name`` from being given (it names something already)."""
        self.given.add(name)

    def __contains__(self, name):
        return name in self.given
