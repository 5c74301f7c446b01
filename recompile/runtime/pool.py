"""Worker threads that run the ready work of compiled calls (threaded mode, and batched mode with threads).

One pool per thread count, shared by every compiled function and every
Python thread that calls one: a task is a callable taking the worker that
runs it. Workers are daemon threads that wait on one ready queue; a pool is
started on first use and lives as long as the process.

A worker keeps one CUDA stream per device, made on first use, so that work
issued by different workers can overlap on the GPU (see ``streams``).
"""

from __future__ import annotations

import os
import queue
import threading

_pools = {}
_pools_lock = threading.Lock()
_local = threading.local()


def _forget_pools():
    # a forked child has none of the parent's threads: its calls start pools of their own
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def default_threads():
    """What the machine offers: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not on every platform)
        return max(1, os.cpu_count() or 1)


def current_worker():
    """The worker running on this thread, or None on any other thread."""
    return getattr(_local, "worker", None)


def get(threads):
    """The pool of ``threads`` workers."""
    pool = _pools.get(threads)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(threads)
            if pool is None:
                pool = _pools[threads] = Pool(threads)
    return pool


class Worker:
    __slots__ = ("index", "streams")

    def __init__(self, index):
        self.index = index
        self.streams = {}  # CUDA device index -> this worker's stream on it

    def stream(self, device):
        s = self.streams.get(device)
        if s is None:
            import torch
            s = self.streams[device] = torch.cuda.Stream(device)
        return s


class Pool:
    def __init__(self, threads):
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._queue = queue.SimpleQueue()
        self.workers = [Worker(i) for i in range(threads)]
        for w in self.workers:
            threading.Thread(target=self._serve, args=(w,), name=f"recompile-worker-{threads}.{w.index}",
                             daemon=True).start()

    def submit(self, task):
        """Put ``task`` behind the work already queued; a free worker calls ``task(worker)``."""
        self._queue.put(task)

    def _serve(self, worker):
        _local.worker = worker
        take = self._queue.get
        while True:
            task = take()
            try:
                task(worker)
            except BaseException:  # a task reports its own errors to its call; this one is a bug in it
                import traceback
                traceback.print_exc()
            del task  # an idle worker keeps nothing of the call it last served alive
