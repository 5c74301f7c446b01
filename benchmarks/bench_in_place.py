"""Programs that change values in place, batched by ``recompile.vmap``, against a loop of eager calls.

    python benchmarks/bench_in_place.py [--instances 64 256] [--steps 30] [--repeats R]

Users write loops that fill a buffer (``out[t] = v``), scale a state in place (``acc.mul_(0.5)``, ``h.mul_(0.9)``
after a branch), add into one (``acc += v``) or activate one in place (``h.sigmoid_()``; ``w.relu_()`` where ``w``
may be another name of ``v``: a change of values each instance holds apart, one op on their stack). A batched
``if`` in such a program works on copies of its instances' rows, and hands on views of the argument's rows only
where a later change in place may reach what it hands on (``passes/aliasing.py``); ``x.mul_(y)`` and
``x.sigmoid_()`` of a tensor only the frame holds are written out of place (``passes/fresh.py``). Each program
is checked against the eager loop in float64 (values, and the gradient of the input), then timed in turns with
it, inference (``torch.no_grad``) and training (forward and backward), one torch thread: instances/s and
recompile / eager.
"""

import argparse
import time

import torch

import recompile

DIM = 4


def written_into_a_buffer(x, n):
    out = torch.zeros(x.shape[0], DIM, dtype=x.dtype, device=x.device)
    for t in range(n):
        v = x[t] if x[t].sum() > 0 else x[t] * 2.0
        out[t] = v
    return out.sum(0)


def scaled_in_place(x, n):
    acc = torch.zeros(DIM, dtype=x.dtype, device=x.device)
    for t in range(n):
        v = x[t] if x[t].sum() > 0 else x[t] * 2.0
        acc = acc + v
        acc.mul_(0.5)
    return acc


def joined_then_scaled(x, n):
    h = torch.zeros(DIM, dtype=x.dtype, device=x.device)
    for t in range(n):
        h = h + x[t] if x[t].sum() > 0 else h * 0.5
        h.mul_(0.9)
    return h


def added_in_place(x, n):
    acc = torch.zeros(DIM, dtype=x.dtype, device=x.device)
    for t in range(n):
        v = x[t] if x[t].sum() > 0 else x[t] * 2.0
        acc += v
    return acc


def joined_then_activated(x, n):
    h = torch.zeros(DIM, dtype=x.dtype, device=x.device)
    for t in range(n):
        h = h + x[t] if x[t].sum() > 0 else h * 0.5
        h.sigmoid_()
    return h


def aliased_then_activated(x, n):
    acc = torch.zeros(DIM, dtype=x.dtype, device=x.device)
    for t in range(n):
        v = x[t] * 1.0
        w = v if x[t].sum() > 0 else v * 2.0
        w.relu_()  # (where the sum is positive, v itself)
        acc = acc + v + w
    return acc


PROGRAMS = {"out[t] = v": written_into_a_buffer, "acc.mul_(0.5)": scaled_in_place,
            "h.mul_(0.9) after an if": joined_then_scaled, "acc += v": added_in_place,
            "h.sigmoid_() after an if": joined_then_activated, "w.relu_(), w may be v": aliased_then_activated}


def inputs(count, steps, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(count, steps, DIM, generator=g, dtype=dtype),
            torch.randint(steps // 3, steps + 1, (count,), generator=g))


def eager_loop(fn):
    return lambda x, n: torch.stack([fn(x[k], int(n[k])) for k in range(len(n))])


def check(fn, steps, device="cpu"):
    """The compiled program on ``device`` against the eager loop on the CPU in float64: values, and the gradient
    of the input."""
    x, n = inputs(5, steps, torch.float64, seed=1)
    runs = {}
    for name, run, where in (("eager", eager_loop(fn), "cpu"),
                             ("recompile", recompile.vmap(recompile.function(fn)), device)):
        leaf = x.to(where).requires_grad_()
        out = run(leaf, n)
        assert out.device.type == torch.device(where).type
        runs[name] = (out.detach().cpu(), torch.autograd.grad(out.square().sum(), leaf)[0].cpu())
    for want, got in zip(runs["eager"], runs["recompile"]):
        torch.testing.assert_close(got, want)


def timed(run, x, n, train, repeats):
    best = float("inf")
    for _ in range(repeats):
        leaf = x.clone().requires_grad_(train)
        start = time.perf_counter()
        if train:
            run(leaf, n).square().sum().backward()
        else:
            with torch.no_grad():
                run(leaf, n)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{DIM}-wide rows, up to {args.steps} steps, 1 torch thread; each program checked against the eager "
          "loop (float64: values and the input's gradient) before it is timed")
    print(f"{'program':26s}{'mode':>10s}{'instances':>10s}{'eager inst/s':>14s}{'recompile inst/s':>18s}"
          f"{'rec/eager':>10s}")
    for name, fn in PROGRAMS.items():
        check(fn, args.steps)
        compiled = recompile.vmap(recompile.function(fn))
        for train in (False, True):
            for count in args.instances:
                x, n = inputs(count, args.steps, torch.float32)
                runs = {"eager": eager_loop(fn), "recompile": compiled}
                for run in runs.values():  # (a first call builds and traces)
                    timed(run, x, n, train, 1)
                best = {k: float("inf") for k in runs}
                for _ in range(args.repeats):  # (in turns, so that both see the machine alike)
                    for k, run in runs.items():
                        best[k] = min(best[k], timed(run, x, n, train, 1))
                rates = {k: count / v for k, v in best.items()}
                print(f"{name:26s}{'training' if train else 'inference':>10s}{count:>10d}{rates['eager']:>14.0f}"
                      f"{rates['recompile']:>18.0f}{rates['recompile'] / rates['eager']:>9.2f}x")


if __name__ == "__main__":
    main()
