"""Switches and limits, in one place, read where they are used (``config.NAME`` when it is needed, never
copied at import), so that a test or a benchmark may change one for a while and every reader sees it.

The switches are on by default; turned off, they measure one way of running against another. The
thresholds a kernel choice rests on (``runtime.lazy_weights.SMALL_ROWS``, ``codegen.fused``'s
``COMPILE_MIN_ELEMENTS``) stay beside the measurements that chose them.
"""

import os

# -- debugging

# Every compiled function called as the plain Python function it was made from, recursion included, and
# ``recompile.vmap`` as a loop over instances (``recompile.disable()``; set to 1 by ``RECOMPILE_DISABLE=1``).
DISABLED = os.environ.get("RECOMPILE_DISABLE", "").strip().lower() not in ("", "0", "false", "no")

# -- limits

# Compiled recursion is not bounded by the interpreter's limit, but a runaway one (a cycle in a tree's child
# indices) should end with RecursionError, as in Python, in seconds rather than take all memory: at this
# depth a cycle ends in about 6 s (sequential and batched) on a 2-core CPU, under 1.5 GB.
MAX_DEPTH = 200_000
CHAIN_SHOWN = 12  # calls shown at each end of a long call chain in an error's note
MAX_LIVE_FRAMES = 4096  # threaded mode's default bound on the frames of one call started and not returned

# -- batched execution

# Level programs (``runtime.levels``): a recursion whose call tree its arguments decide runs depth by depth,
# without frames. Off: every call goes through the agenda.
LEVELS = True
TREE_SUMS = True  # (read when a level program is built; off: late elements always take the second way up)
PLAIN_LEVELS = True  # level runs on plain tensors where they can; off: always on Batch values
PLAIN_FAILURES = 8  # failed plain runs (a guard, an error) after which a program runs on Batch values only

# An op run once per instance in a batched run (``runtime.batch_rules``): "warn" once per program point (the
# user's file and line, the op, why, what to write instead), "error" (raise ``recompile.PerInstanceError``:
# for tests that a model batches whole), or "allow" (count it in ``stats["per_instance"]`` only).
PER_INSTANCE = "warn"
# An undecorated function of the user's own code called with per-instance values is compiled and run once for
# the group (``runtime.helpers``); off: it runs once per instance, as Python.
COMPILE_HELPERS = True

# A loop stepping an RNN cell over a sequence runs as torch's own RNN over the packed steps
# (``codegen.recurrent``); off: step by step, as written.
RECURRENT_LOOPS = True

# Segments (``codegen.segments``): straight runs of batched ops traced into plain tensor code. Read when
# batched code is generated; off: every op goes through its batch rule.
SEGMENTS = True
SEGMENT_TRACES = 3  # traces a segment makes, each a raw function for the kinds of that call (a leaf's 0.0 and
# a node's batched loss may reach the same segment)
SEGMENT_MISSES = 8  # calls no raw function served, once SEGMENT_TRACES were traced, after which it stops trying
