"""Generated functions -> code objects under the user's file and lines, for both emitters.

The emitters (``emit``, ``batched``) build an AST whose statements carry the user's Location. ``load``
prints it with astor, parses the text back, gives each statement the user's line, compiles it under the
user's file name and runs it in the namespace of its ``Module``: a traceback then points at the user's
source, and ``GeneratedCode.source`` shows each generated statement with the user line it came from.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import re

import astor

from ..naming import Namer


class GeneratedCode:
    """The compiled functions of one function build and the source they came from."""

    def __init__(self, source, functions, entry_name, generators, codes):
        self.source = source
        self.functions = functions
        self.entry = functions[entry_name]
        self.entry_is_generator = entry_name in generators
        self.codes = codes


class Module:
    """Module-level names of the generated code: constants, helpers, SubGraph functions."""

    def __init__(self):
        self.namespace = {"__builtins__": builtins, "__name__": "recompile.generated"}
        self.names = Namer(reserved=self.namespace)
        self.codes = set()  # code generated for this module elsewhere (fused ops' members), and its source
        self.sources = []

    def attach(self, code):
        self.codes |= code.codes
        self.sources.append(code.source)

    def ref(self, value, hint=""):
        """The module-level name holding ``value`` (the same name each time it is asked for)."""
        key = id(value)
        name = self.names.given_to(key)
        if name is None:
            name = self.names.name_of(key, "_rc_" + re.sub(r"\W", "_", hint or type(value).__name__)[:30])
            self.namespace[name] = value
        return name


def locate(node, loc):
    """Mark generated statement ``node`` as made from the user's Location ``loc``; returns ``node``."""
    node._rc_loc = loc
    return node


def location(node):
    """The user's Location a generated statement was marked with (``locate``), or None."""
    return getattr(node, "_rc_loc", None)


def load(defs, sg, module):
    """Print ``defs`` (FunctionDefs whose statements are marked with the user's Location, ``locate``), parse
    the text back with each statement at the user's line, compile it under the file of function SubGraph ``sg``
    (under a name of its own where the lines cannot be placed) and run it in ``module``'s namespace.
    Returns (the source, each statement marked with its user file:line; the code objects of the functions
    and of the code ``module`` holds besides)."""
    tree = ast.Module(body=defs, type_ignores=[])
    ast.fix_missing_locations(tree)
    text = astor.to_source(tree)
    parsed = ast.parse(text)
    line_map = _place(parsed, tree)
    filename = sg.loc.filename if line_map is not None else f"<recompile {sg.name}>"
    if line_map is None:
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    code = compile(parsed, filename, "exec")
    exec(code, module.namespace)
    codes = {module.namespace[d.name].__code__ for d in defs} | module.codes
    source = "\n\n".join([_annotate(text, line_map or {}), *module.sources])
    return source, codes


def _statements(node):
    """Statements in a fixed depth-first order (parents before their bodies)."""
    for field in ("body", "orelse"):
        for stmt in getattr(node, field, None) or []:
            yield stmt
            yield from _statements(stmt)


def _place(tree, original):
    """Give the parsed-back statements the user's positions; return {generated line: loc}."""
    line_map = {}
    new_stmts, old_stmts = list(_statements(tree)), list(_statements(original))
    if len(new_stmts) != len(old_stmts):
        return None
    pairs = [(new, location(old)) for new, old in zip(new_stmts, old_stmts)]
    for new, loc in pairs:
        if loc is not None:
            line_map[new.lineno] = loc
    for new, loc in pairs:  # parents first: a nested statement then overrides its own nodes
        if loc is None:
            continue
        text = linecache.getline(loc.filename, loc.lineno)
        indent = len(text) - len(text.lstrip())
        for n in ast.walk(new):
            if hasattr(n, "lineno"):
                n.lineno = n.end_lineno = loc.lineno
                n.col_offset = indent
                n.end_col_offset = max(len(text.rstrip()), indent)
    return line_map


def _annotate(text, line_map):
    """The printed source with each statement's user file:line at its end."""
    lines = text.splitlines()
    for lineno, loc in line_map.items():
        i = lineno - 1
        if 0 <= i < len(lines):
            lines[i] = f"{lines[i]}  # {os.path.basename(loc.filename)}:{loc.lineno}"
    return "\n".join(lines) + "\n"
