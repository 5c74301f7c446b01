"""Backward peak memory against sequence length, in every mode beside eager PyTorch's.

    python benchmarks/bench_memory.py [--lengths 1000 2000 4000] [--width W] [--modes ...]

The model is a recurrence that reads ``x[t]`` at every step of a ``while``
loop over a (length, width) float64 sequence, ``h = tanh(h + x[t])``, and
sums the last state. Each (mode, length) runs in a process of its own: the
forward, then the process's peak resident memory is reset (Linux
``/proc/self/clear_refs``) and ``backward()`` runs; what the peak grew by is
the backward's memory. Before that, each mode's gradient is checked against
eager autograd's on a short sequence in this process (it raises otherwise).

One row per length: each mode's MB above the memory held before the
backward, its ratio to eager's, and the backward's seconds. A backward's
memory grows linearly with the work, as eager's does, when the ratios stay
flat down the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

import recompile

MODES = ("eager", "sequential", "threaded", "batched")


def recurrence(x):
    h = torch.zeros(x.shape[1], dtype=x.dtype)
    t = 0
    while t < x.shape[0]:
        h = torch.tanh(h + x[t])
        t += 1
    return h.sum()


def model(mode):
    return recurrence if mode == "eager" else recompile.function(recurrence, mode=mode)


def check(modes, width):
    """Each mode's gradient equals eager autograd's on a short sequence (float64)."""
    x = torch.randn(50, width, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    xe = x.clone().requires_grad_()
    want = torch.autograd.grad(recurrence(xe), xe)[0]
    for mode in modes:
        xm = x.clone().requires_grad_()
        got = torch.autograd.grad(model(mode)(xm), xm)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    print(f"every mode's gradient matches eager ({', '.join(modes)})")


def _peak_kb():
    """The process's peak resident memory since the last reset, in kB (VmHWM; ru_maxrss where absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _resident_kb():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return _peak_kb()


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (resets the peak resident set size to the current one)
    except OSError:
        pass


def measure(mode, length, width):
    """In this process: (MB the backward's peak rose above the memory held before it, its seconds)."""
    torch.manual_seed(0)
    x = torch.randn(length, width, dtype=torch.float64, requires_grad=True)
    y = model(mode)(x)
    _reset_peak()
    before = _resident_kb()
    t = time.perf_counter()
    y.backward()
    seconds = time.perf_counter() - t
    return max(0, _peak_kb() - before) / 1024, seconds


def child(mode, length, width):
    """(MB, seconds) measured in a process of its own, so that no other run's peak counts."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(length), "--width", str(width)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        torch.set_num_threads(1)
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.width)))
        return
    modes = ["eager"] + [m for m in args.modes if m != "eager"]
    check(modes[1:], args.width)
    print(f"backward peak memory above what the forward holds, MB (ratio to eager), seconds; width {args.width}")
    print(f"{'length':>7} " + " ".join(f"{m:>24}" for m in modes))
    for length in args.lengths:
        got = {m: child(m, length, args.width) for m in modes}
        eager_mb = max(got["eager"][0], 1e-3)
        cells = []
        for m in modes:
            mb, s = got[m]
            cells.append(f"{mb:8.1f} ({mb / eager_mb:5.1f}x) {s:6.2f}s")
        print(f"{length:>7} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
