"""Tree-LSTM on SST minibatches: eager, hand-batched PyTorch and recompile's batched runtime, in one process.

    python benchmarks/bench_batching.py [--data DIR] [--trees N] [--batch 25 256]
                                        [--eager-trees M] [--repeats R] [--threads T]

Three ways to run the binary Tree-LSTM of examples/tree_lstm.py (embed 300,
hidden 150, 5 classes; a tree's loss is the summed cross-entropy of every
node) over a minibatch of trees:

- eager: the model's eager twin (its compiled methods replaced by the
  undecorated functions, so the recursion is plain PyTorch), one tree at a
  time; the minibatch loss is the sum of the trees' losses. It is slow, so it
  is timed on the first --eager-trees trees only, cut into minibatches of the
  same size (fewer trees than the size make one smaller minibatch).
- hand-batched: the same model and parameters written by hand in the style of
  TensorFlow Fold: all nodes of one height, across the minibatch, run as one
  batch (leaves first, then heights 1, 2, ...), then one classifier and one
  cross-entropy over all nodes. Its schedule is computed with torch ops from
  the Forest inside the timed call, as recompile gets only the Forest too.
- recompile: ``recompile.vmap(model.encode, in_dims=(None, 0))(forest,
  forest.roots)``, the unchanged recursive method run over the whole forest;
  it returns (h, c, loss) stacked over the trees and the minibatch loss is
  ``loss.sum()``. If ``recompile.vmap`` is missing or fails, that column says
  so and the others still run.
- schedule: the schedule recompile derives from ``encode`` (see
  runtime/agenda.py), written out by hand as plain tensor code with no
  runtime: the descent depth by depth through ``is_leaf``/``left``/``right``,
  the leaf branch once for every leaf, the internal-node branch once per
  depth with the ``if``'s join, the node losses once and each tree's loss
  summed into its root's row at once (a tree sum, runtime/levels.py). It
  issues about the fewest tensor ops an executor of the program as written
  can, so "sched/hand" is about the most recompile's runtime could reach with
  no overhead of its own, and "rec/sched" what that overhead costs.

Before timing, hand-batched, schedule and recompile are checked against eager in
float64 on a few trees (loss and every parameter gradient). Then, for each
minibatch size, trees/s for inference (forward under torch.no_grad()) and for
training (forward, zero_grad, backward, SGD step; one step per minibatch),
best of --repeats, the four taking turns in each repeat. Forests are built
once, outside the timing.
"""

import argparse
import copy
import os
import sys
import time
from collections import namedtuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from tree_lstm import TreeLSTM  # noqa: E402

import recompile  # noqa: E402
from recompile.data import Forest, load_sst, sample_dir  # noqa: E402

CHECK_TREES = 8  # trees of the float64 correctness checks


# -- eager -------------------------------------------------------------------------------------


def eager_twin(model_cls):
    """``model_cls`` with every compiled method (``encode``, ``node_loss``) replaced by its
    undecorated function, so that a call runs as plain PyTorch."""
    plain = {}
    for klass in reversed(model_cls.__mro__):  # a subclass's method overrides its base's
        plain.update({name: attr.python for name, attr in vars(klass).items()
                      if isinstance(attr, recompile.CompiledFunction)})
    return type("Eager" + model_cls.__name__, (model_cls,), plain)


def eager_loss(model, trees):
    """Minibatch loss of the eager twin: one recursion per tree, losses summed."""
    return sum(model.encode(tree, tree.root)[-1] for tree in trees)


# -- hand-batched ------------------------------------------------------------------------------

# The schedule of a forest, computed once per call (see level_plan):
#   leaf_words  LongTensor [leaves]: word ids of the height-0 nodes, in row order
#   sizes       list: sizes[l] = number of nodes of height l
#   uses        list of lists: uses[k][p] = number of height-k nodes whose parent has height p
#               (p = max height + 1 for the roots, whose state no parent reads)
#   children    list: children[l - 1] = LongTensor [2 * sizes[l]]: for each height-l node in row
#               order, the rows of its left and right child among the inputs of level l
#   labels      LongTensor [N]: node labels, in row order (level 0 rows, then level 1, ...)
LevelPlan = namedtuple("LevelPlan", "leaf_words sizes uses children labels")


def level_plan(forest):
    """Schedule ``forest`` level by level, with torch ops (no Python loop over nodes).

    Each node's state is read exactly once, by its parent. Rows of a level are
    ordered by the height of their parent, so the states that level p reads
    from a lower level k are one contiguous block of k's output: level p's
    inputs are ``torch.cat`` of one ``torch.split`` piece per lower level.
    Autograd differentiates split and cat in time proportional to the rows
    moved; gathering from one buffer of all states would instead cost
    O(all nodes) per level in the backward pass (index_select's and
    copy-into-slice's backward allocate the whole buffer), which measured
    about 20% slower training at minibatch 256 on SST.
    """
    heights, left, right = forest.heights, forest.left, forest.right
    top = int(heights.max())
    internal = left >= 0
    parent_height = torch.full_like(heights, top + 1)  # roots: read by nobody
    parent_height[left[internal]] = heights[internal]
    parent_height[right[internal]] = heights[internal]
    key = heights * (top + 2) + parent_height
    order = torch.argsort(key, stable=True)  # row order: by height, then by parent's height
    uses = torch.bincount(key, minlength=(top + 1) * (top + 2)).view(top + 1, top + 2)
    # Row of each node among the inputs of its parent's level: the inputs of level p are
    # the nodes with parent height p, in row order.
    by_parent = order[torch.argsort(parent_height[order], stable=True)]
    readers = uses.sum(0)
    first_input = torch.cumsum(readers, 0) - readers
    input_row = torch.empty_like(order)
    input_row[by_parent] = torch.arange(order.numel()) - first_input[parent_height[by_parent]]
    sizes = uses.sum(1).tolist()
    levels = torch.split(order, sizes)
    children = [torch.stack([input_row[left[nodes]], input_row[right[nodes]]], 1).flatten()
                for nodes in levels[1:]]
    return LevelPlan(forest.words[levels[0]], sizes, uses.tolist(), children, forest.labels[order])


def by_reader(plan, x, k):
    """Level k's output ``x``, cut into {parent height: block of rows} (views)."""
    counts = plan.uses[k]
    readers = [p for p, n in enumerate(counts) if n]
    return dict(zip(readers, torch.split(x, [counts[p] for p in readers])))


def inputs(blocks, p):
    """Level p's inputs: the blocks of every lower level read by p, in level order."""
    parts = [b[p] for b in blocks if p in b]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def hand_batched(model, forest):
    """Summed loss over every node of ``forest`` under TreeLSTM ``model``, one batch per height."""
    plan = level_plan(forest)
    hidden = model.out.in_features

    # Height 0: every leaf of the minibatch at once.
    ig, og, u = torch.chunk(model.leaf(model.embed(plan.leaf_words)), 3, dim=-1)
    c = torch.sigmoid(ig) * torch.tanh(u)
    h = torch.sigmoid(og) * torch.tanh(c)
    hs = [h]
    h_blocks, c_blocks = [by_reader(plan, h, 0)], [by_reader(plan, c, 0)]
    for level, children in enumerate(plan.children, 1):
        n = plan.sizes[level]
        # children holds (left, right) pairs, so n x [hl | hr] is a view of the gathered rows
        hlr = inputs(h_blocks, level).index_select(0, children).view(n, 2 * hidden)
        clr = inputs(c_blocks, level).index_select(0, children).view(n, 2, hidden)
        gates = model.node(hlr)  # input, output, update, forget-left, forget-right
        s = torch.sigmoid(gates)  # (the update slot's sigmoid is not used: one op instead of four)
        ig, og, forget = s[:, :hidden], s[:, hidden:2 * hidden], s[:, 3 * hidden:].view(n, 2, hidden)
        c = ig * torch.tanh(gates[:, 2 * hidden:3 * hidden]) + (forget * clr).sum(1)
        h = og * torch.tanh(c)
        hs.append(h)
        h_blocks.append(by_reader(plan, h, level))
        c_blocks.append(by_reader(plan, c, level))
    return F.cross_entropy(model.out(torch.cat(hs)), plan.labels, reduction="sum")


# -- recompile's schedule, with no runtime ------------------------------------------------------


def program_schedule(model, forest):
    """(h, c, loss) per tree of ``forest``, computed as recompile's batched runtime schedules
    ``TreeLSTM.encode`` (one batch per depth; leaves and node losses once), with every value a plain
    tensor and no bookkeeping but what the schedule needs."""
    # Descent: the roots, then each depth's internal nodes' left children followed by their right ones;
    # ``root``: the tree (its root's row) of each node of the depth.
    i, root, depths, leaf_rows = forest.roots, torch.arange(forest.roots.numel()), [], []
    while i.numel():
        leaf = forest.is_leaf[i]
        inner = ~leaf
        at_leaf, at_inner = i[leaf], i[inner]
        # join order: this depth's leaves, then its internal nodes; ``back`` restores the depth's order
        back = torch.argsort(torch.cat([leaf.nonzero().squeeze(1), inner.nonzero().squeeze(1)]))
        depths.append((i, at_leaf.numel(), at_inner.numel(), back, root))
        leaf_rows.append(at_leaf)
        i = torch.cat([forest.left[at_inner], forest.right[at_inner]])
        root = root[inner].repeat(2)
    # The leaf branch, once for the leaves of every depth.
    ig, og_leaf, u = torch.chunk(model.leaf(model.embed(forest.words[torch.cat(leaf_rows)])), 3, dim=-1)
    c_leaf = torch.sigmoid(ig) * torch.tanh(u)
    leaf_counts = [d[1] for d in depths]
    og_leaf, c_leaf = torch.split(og_leaf, leaf_counts), torch.split(c_leaf, leaf_counts)
    # Ascent, deepest first: the depth below holds the left children's rows, then the right ones'.
    hs, labels, below = [], [], None
    for d in range(len(depths) - 1, -1, -1):
        i, leaves, inner, back, _ = depths[d]
        og, c = og_leaf[d], c_leaf[d]
        if inner:
            h_below, c_below = below
            ig, og_in, u, fl, fr = torch.chunk(model.node(torch.cat([h_below[:inner], h_below[inner:]], -1)), 5, -1)
            c_in = (torch.sigmoid(ig) * torch.tanh(u) + torch.sigmoid(fl) * c_below[:inner]
                    + torch.sigmoid(fr) * c_below[inner:])
            og, c = ((torch.cat([og, og_in]).index_select(0, back), torch.cat([c, c_in]).index_select(0, back))
                     if leaves else (og_in, c_in))
        h = torch.sigmoid(og) * torch.tanh(c)
        hs.append(h)
        labels.append(forest.labels[i])
        below = (h, c)
    # The node losses, once; each tree's loss (a tree sum: 0.0 at a leaf, loss_l + loss_r, + node_loss) is
    # their sum over its nodes, added into its root's row at once.
    node_loss = F.cross_entropy(model.out(torch.cat(hs)), torch.cat(labels), reduction="none")
    roots = torch.cat([depths[d][4] for d in range(len(depths) - 1, -1, -1)])
    loss = node_loss.new_zeros(forest.roots.numel()).index_add(0, roots, node_loss)
    return hs[-1], below[1], loss


def schedule_loss(model):
    return lambda forest: program_schedule(model, forest)[-1].sum()


# -- recompile ---------------------------------------------------------------------------------


def recompile_batched(model):
    """forest -> minibatch loss through recompile's batched runtime (raises if it is missing)."""
    encode = recompile.vmap(model.encode, in_dims=(None, 0))

    def loss(forest):
        h, c, per_tree = encode(forest, forest.roots)  # h: [B, hidden], per_tree: [B]
        return per_tree.sum()

    return loss


# -- checks ------------------------------------------------------------------------------------


def gradients(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def on_cpu(grads):
    return {name: g.cpu() for name, g in grads.items()}


def check_hand_batched(model, trees, hand=None):
    """Raise unless ``hand`` (by default hand_batched) gives the eager twin's loss and parameter gradients
    (float64)."""
    eager = eager_twin(type(model))(model.embed.num_embeddings).double()
    eager.load_state_dict(model.state_dict())
    want = eager_loss(eager, trees)
    want_grads = gradients(eager, want)
    got = (hand or hand_batched)(eager, Forest.from_trees(trees))
    got_grads = gradients(eager, got)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-9, atol=1e-9)


def check_per_tree(model, trees, encode_forest, eager_cls=None):
    """Raise unless ``encode_forest(model copy, forest)`` gives, per tree, eager's root h, c and loss,
    and the minibatch loss eager's parameter gradients (float64); ``eager_cls``: the eager model (by
    default, the eager twin of TreeLSTM)."""
    eager = (eager_cls or eager_twin(TreeLSTM))(model.embed.num_embeddings).double()
    eager.load_state_dict(model.state_dict())
    twin = copy.deepcopy(model).double()
    want = [eager.encode(tree, tree.root) for tree in trees]
    want_grads = gradients(eager, sum(w[-1] for w in want))
    got = encode_forest(twin, Forest.from_trees(trees))
    for k, (value, wanted) in enumerate(zip(got, zip(*want))):
        torch.testing.assert_close(value, torch.stack(wanted).detach(), rtol=1e-7, atol=1e-9,
                                   msg=lambda m, k=k: f"{'hcl'[k]}: {m}")
    torch.testing.assert_close(gradients(twin, got[-1].sum()), want_grads, rtol=1e-7, atol=1e-9)


def check_recompile(model, trees):
    """Raise unless recompile's batched encode matches eager (``check_per_tree``)."""
    check_per_tree(model, trees,
                   lambda twin, forest: recompile.vmap(twin.encode, in_dims=(None, 0))(forest, forest.roots))


# -- timing ------------------------------------------------------------------------------------


def throughputs(runs, train, repeats):
    """{name: best trees/s} of runs {name: (loss_fn, model, batches)}: ``repeats`` passes of ``loss_fn`` over
    ``batches`` each, after one untimed call on the first batch (warm-up, and recompile's one build). The runs
    take turns within each repeat, so that a change in the machine's speed (it is shared) reaches them
    alike. A run that raises gives its exception instead, and is not run again."""
    passes = {name: (_pass(loss_fn, model, train), batches) for name, (loss_fn, model, batches) in runs.items()}
    best = dict.fromkeys(runs, 0.0)
    for turn in range(repeats + 1):
        for name, (run, batches) in passes.items():
            if isinstance(best[name], Exception):
                continue
            try:
                if turn == 0:
                    run(batches[:1])
                    continue
                start = time.perf_counter()
                run(batches)
                best[name] = max(best[name], sum(len(b) for b in batches) / (time.perf_counter() - start))
            except Exception as e:
                best[name] = e
    return best


def throughput(loss_fn, model, batches, train, repeats):
    """Best trees/s of one run (see ``throughputs``)."""
    best = throughputs({"run": (loss_fn, model, batches)}, train, repeats)["run"]
    if isinstance(best, Exception):
        raise best
    return best


def _pass(loss_fn, model, train):
    """A function running ``loss_fn`` once over a list of batches (with a training step each when
    ``train``)."""
    # A small step: the loss sums thousands of nodes' cross-entropies (speed does not depend on it).
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(batches):
        for batch in batches:
            if train:
                loss = loss_fn(batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                with torch.no_grad():
                    loss_fn(batch)

    return run


def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def arguments(description):
    """The options every SST benchmark takes: --data, --trees, --batch, --threads, --repeats."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="SST directory (default: the shipped sample)")
    p.add_argument("--trees", type=int, default=512, help="trees timed")
    p.add_argument("--batch", type=int, nargs="+", default=[25, 256], help="minibatch sizes")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--repeats", type=int, default=3, help="timed passes; the best counts")
    return p


def sst_trees(args):
    """(the data directory, SST, its first --trees train trees), with --threads torch threads set."""
    torch.set_num_threads(args.threads)
    data = args.data or sample_dir()
    sst = load_sst(data, splits=("train",))
    return data, sst, sst.train[: args.trees]


def main(argv=None):
    p = arguments(__doc__)
    p.add_argument("--eager-trees", type=int, default=100, help="of those, the first M are timed eagerly")
    args = p.parse_args(argv)
    data, sst, trees = sst_trees(args)
    eager_trees = trees[: args.eager_trees]

    torch.manual_seed(0)
    base = TreeLSTM(len(sst.vocab))
    print(f"Tree-LSTM (embed 300, hidden 150), {len(trees)} SST trees from {data} "
          f"(eager: the first {len(eager_trees)}), {args.threads} torch thread(s)")

    check_hand_batched(base, trees[:CHECK_TREES])  # raises on a mismatch: no numbers for a wrong model
    print(f"hand-batched matches eager (float64, {min(CHECK_TREES, len(trees))} trees: loss and gradients)")
    check_per_tree(base, trees[:CHECK_TREES], program_schedule)
    print("schedule matches eager (float64: per-tree h, c and loss, gradients)")
    unavailable = None  # the recompile column's text when recompile.vmap is missing or fails
    try:
        check_recompile(base, trees[:CHECK_TREES])
        print("recompile matches eager (float64: per-tree h and loss, gradients)")
    except AssertionError as e:  # wrong numbers: say so, but still time it
        print(f"recompile does NOT match eager: {e}")
    except Exception as e:  # missing or failing: not timed, the column shows the exception's type
        unavailable = type(e).__name__
        print(f"recompile unavailable: {type(e).__name__}: {e}")
    errors = []  # exceptions raised by recompile while timing, printed after the table

    models = {name: copy.deepcopy(base) for name in ("hand", "recompile", "schedule")}
    models["eager"] = eager_twin(TreeLSTM)(len(sst.vocab))
    models["eager"].load_state_dict(base.state_dict())
    loss_fns = {"eager": lambda batch: eager_loss(models["eager"], batch),
                "hand": lambda forest: hand_batched(models["hand"], forest),
                "schedule": schedule_loss(models["schedule"])}
    forests = {size: [Forest.from_trees(chunk) for chunk in chunks(trees, size)] for size in args.batch}

    print(f"{'':10} {'batch':>5} {'eager trees/s':>14} {'hand trees/s':>13} {'recompile trees/s':>18} "
          f"{'rec/hand':>9} {'rec/eager':>10} {'schedule trees/s':>17} {'sched/hand':>11} {'rec/sched':>10}")
    for mode, train in (("inference", False), ("training", True)):
        for size in args.batch:
            runs = {"eager": (loss_fns["eager"], models["eager"], chunks(eager_trees, size)),
                    **{name: (loss_fns[name], models[name], forests[size]) for name in ("hand", "schedule")}}
            if unavailable is None:
                if "recompile" not in loss_fns:
                    loss_fns["recompile"] = recompile_batched(models["recompile"])
                runs["recompile"] = (loss_fns["recompile"], models["recompile"], forests[size])
            best = throughputs(runs, train, args.repeats)
            for name in ("eager", "hand", "schedule"):
                if isinstance(best[name], Exception):
                    raise best[name]
            eager, hand, schedule = best["eager"], best["hand"], best["schedule"]
            rec, column = best.get("recompile"), unavailable
            if isinstance(rec, Exception):
                column = type(rec).__name__
                errors.append(f"{mode} {size}: {type(rec).__name__}: {rec}")
                rec = None
            if rec is None:
                ratios, to_schedule = f"{'-':>9} {'-':>10}", "-"
            else:
                column = f"{rec:.1f}"
                ratios, to_schedule = f"{rec / hand:8.2f}x {rec / eager:9.2f}x", f"{rec / schedule:.2f}x"
            print(f"{mode:10} {size:5d} {eager:14.1f} {hand:13.1f} {column:>18} {ratios} "
                  f"{schedule:17.1f} {schedule / hand:10.2f}x {to_schedule:>10}")
    for text in errors:
        print(f"recompile failed at {text}")


if __name__ == "__main__":
    main()
