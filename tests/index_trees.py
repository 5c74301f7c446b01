"""Random binary trees as parallel index lists, shared by the scheduler and threaded-runtime tests."""


def random_index_tree(rnd, n_leaves, values=False):
    """A random binary tree with ``n_leaves`` leaves: lists ``left``, ``right`` (-1 at a leaf), node 0 the
    root, built depth first with ``rnd`` (a random.Random). With ``values``, also ``vals``: a number in
    [-50, 50] per node, drawn as each node is made."""
    left, right, vals = [], [], []

    def build(k):
        idx = len(left)
        left.append(-1)
        right.append(-1)
        if values:
            vals.append(rnd.randint(-50, 50))
        if k > 1:
            a = rnd.randint(1, k - 1)
            lo = build(a)
            hi = build(k - a)
            left[idx], right[idx] = lo, hi
        return idx

    build(n_leaves)
    return (left, right, vals) if values else (left, right)
