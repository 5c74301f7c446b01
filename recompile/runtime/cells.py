"""Closure cells and nested functions for n instances (``intrinsics.new_cell`` ... ``make_function``).

Each instance has a cell of its own for a variable that a nested function, lambda or generator expression
uses, as n runs would have. A nested function made of per-instance cells is one function per instance;
calling it then runs once per instance, with the warning ``fallbacks`` gives.
"""

from __future__ import annotations

from .. import intrinsics
from . import batch as bt
from . import sharing
from .batch import Batch


def new_cells(n):
    return bt.from_items([intrinsics.new_cell() for _ in range(n)])


def fixed_cells(n, fn, args, kwargs):
    if kwargs or len(args) != 1:
        return NotImplemented
    return bt.from_items([intrinsics.fixed_cell(sharing.own(bt.instance(args[0], k))) for k in range(n)])


def set_cells(n, fn, args, kwargs):
    if kwargs or len(args) != 2 or type(args[0]) is not Batch:
        return NotImplemented
    cells, value = args
    for k, cell in enumerate(bt.items_of(cells)):
        intrinsics.set_cell(cell, sharing.own(bt.instance(value, k)))
    return None


def read_cells(n, fn, args, kwargs):
    if kwargs or len(args) != 2 or type(args[0]) is not Batch:
        return NotImplemented
    return bt.from_items([intrinsics.read_local_cell(cell, args[1]) for cell in bt.items_of(args[0])])


def cells_or_undefined(n, fn, args, kwargs):
    if kwargs or len(args) != 1 or type(args[0]) is not Batch:
        return NotImplemented
    return bt.from_items([intrinsics.cell_or_undefined(cell) for cell in bt.items_of(args[0])])


def delete_cells(n, fn, args, kwargs):
    if kwargs or len(args) != 3 or type(args[0]) is not Batch:
        return NotImplemented
    cells, name, free = args
    cells = bt.items_of(cells)
    for cell in cells:  # (every instance's is checked first: an unbound one raises before any is deleted)
        intrinsics.read_cell(cell, name) if free else intrinsics.read_local_cell(cell, name)
    for cell in cells:
        intrinsics.delete_cell(cell, name, free)
    return None


def make_functions(n, fn, args, kwargs):
    if kwargs:
        return NotImplemented
    return bt.from_items([intrinsics.make_function(*[bt.instance(a, k) for a in args]) for k in range(n)])
