"""A display a name holds, then walked by ``for``: walked as the display itself where nothing else reads the list
(frontend/held_displays.py), with Python's values in every mode, and the recursion of a node that loops over a
list of its children run as a level program."""

import contextlib
import textwrap
import warnings

import gast
import torch

import recompile
from recompile.data import Forest
from recompile.frontend.held_displays import walked_displays
from test_language_constructs import check, check_grad, check_vmap
from test_levels import program
from test_segments import WORDS, trees


def rewritten(source, declared=()):
    """The loops of function ``source``'s body after the pass: per ``for`` (and comprehension), what it walks, as
    the source of a name or of a tuple of names (sorted)."""
    fdef = gast.parse(textwrap.dedent(source)).body[0]
    body = walked_displays(fdef.body, {d: "global" for d in declared}, 8)
    walked = []
    for node in gast.walk(gast.Module(body=body, type_ignores=[])):
        it = node.iter if isinstance(node, (gast.For, gast.comprehension)) else None
        if isinstance(it, gast.Name):
            walked.append(it.id)
        elif isinstance(it, gast.Tuple):
            walked.append(tuple(e.id for e in it.elts))
    return sorted(walked, key=str)


def test_a_list_walked_once_is_walked_as_its_items():
    assert rewritten("""
        def f(a, b):
            xs = [a, b]
            for x in xs:
                print(x)
            return xs
    """) == [(".held1_0", ".held1_1")]


def test_every_walk_up_to_another_use_and_comprehensions_too():
    assert rewritten("""
        def f(a, b):
            xs = (a, b, a)
            ys = [y * 2 for y in xs]
            if a:
                for x in xs:
                    pass
            xs.append(3)
            for z in xs:
                pass
    """) == [(".held1_0", ".held1_1", ".held1_2"), (".held1_0", ".held1_1", ".held1_2"), "xs"]  # (sorted)


def test_lists_others_may_read_or_change_stay_lists():
    cases = {
        "changed before the walk": """
            def f(a, b):
                xs = [a, b]
                xs.append(a)
                for x in xs:
                    pass""",
        "changed in the walk": """
            def f(a, b):
                xs = [a, b]
                for x in xs:
                    xs.append(x)""",
        "another name for it": """
            def f(a, b):
                xs = [a, b]
                ys = xs
                for x in xs:
                    ys.append(x)""",
        "read by a nested function": """
            def f(a, b):
                xs = [a, b]
                def g():
                    xs.append(a)
                for x in xs:
                    g()""",
        "a global": """
            def f(a, b):
                xs = [a, b]
                for x in xs:
                    pass""",
        "walked by a generator, which a later change reaches": """
            def f(a, b):
                xs = [a, b]
                g = (x for x in xs)
                for x in xs:
                    pass""",
        "rebound by the loop": """
            def f(a, b):
                xs = [a, b]
                for xs in xs:
                    pass""",
        "starred items": """
            def f(a, b):
                xs = [a, *b]
                for x in xs:
                    pass""",
        "in a with statement": """
            def f(a, b):
                xs = [a, b]
                with a:
                    for x in xs:
                        pass""",
        "in a try statement in a branch": """
            def f(a, b):
                xs = [a, b]
                if a:
                    try:
                        for x in xs:
                            pass
                    finally:
                        pass""",
    }
    for what, source in cases.items():
        walked = rewritten(source, declared=("xs",) if what == "a global" else ())
        assert all(w == "xs" for w in walked) and walked, (what, walked)


# programs run in every mode against plain Python

def children_listed(x, log):
    children = [log.append(1) or x, log.append(2) or x * 2]  # (the items first, in order, then the list)
    hs = []
    for child in children:
        log.append(3)
        hs.append(child + 1)
    return hs, children, [c * 3 for c in children], log


def listed_then_changed(x):
    xs = [x, x + 1]
    for v in xs:
        x = x + v  # (rebinding a name an item was read from: the items are the objects the list holds)
    xs.append(x)
    total = 0
    for v in xs:
        total = total + v
    return total, xs


def listed_holding_itself(x):
    xs = [x]
    xs = [xs, x]  # (the old list, read before the name is bound anew)
    out = []
    for v in xs:
        out.append(v)
    return out


def listed_with_a_jump(x):
    xs = (x, x * 2, x * 3)
    for v in xs:
        if v > 3:
            break
    else:
        v = -1
    return v


def walked_in_a_with(x, flag):
    xs = [x, x * 2]
    out = []
    if flag:
        with contextlib.nullcontext():  # (its body runs as Python: it walks the list itself)
            for v in xs:
                out.append(v + 1)
    return out


def test_values_are_pythons_in_every_mode():
    check(children_listed, (torch.tensor(1.5), []), (2, []))
    check(listed_then_changed, (torch.tensor(0.5),), (3,))
    check(listed_holding_itself, (torch.tensor(1.0),))
    check(listed_with_a_jump, (1,), (2,), (torch.tensor(0.5),))
    check(walked_in_a_with, (torch.tensor(1.5), True), (2, False))


def squared_children(x):
    children = [x * 2, x.sin()]
    total = torch.zeros(())
    for child in children:
        total = total + child * child
    return total


def test_gradients_and_vmap():
    check_grad(squared_children, torch.tensor([0.3, -1.2], dtype=torch.float64))
    check_vmap(squared_children, (0,), torch.randn(5, 3, dtype=torch.float64))


class ListedChildren(torch.nn.Module):
    """A Tree-RNN whose node builds the list of its children and loops over it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(len(WORDS) + 1, 4)
        self.node = torch.nn.Linear(8, 4)

    @recompile.function
    def encode(self, tree, i):
        if tree.is_leaf[i]:
            h = torch.tanh(self.embed(tree.words[i]))
        else:
            children = [tree.left[i], tree.right[i]]
            hs = []
            for child in children:
                hs.append(self.encode(tree, child))
            h = torch.tanh(self.node(torch.cat(hs, dim=-1)))
        return h


def test_a_node_looping_over_a_list_of_its_children_runs_as_a_level_program():
    torch.manual_seed(0)
    prog = program(ListedChildren.encode, ListedChildren)
    assert prog is not None
    model = ListedChildren().double()
    forest = Forest.from_trees(trees())
    with warnings.catch_warnings():
        warnings.simplefilter("error", recompile.PerInstanceWarning)
        got = recompile.vmap(model.encode, in_dims=(None, 0))(forest, forest.roots)
    with recompile.disable():
        want = torch.stack([model.encode(t, t.root) for t in trees()])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert prog.runs == 1
