"""Running one piece of test work on several Python threads at once."""

import threading
import time


def run_threads(n_threads, work, timeout=60):
    """``work(t)`` for t in range(n_threads), each on its own thread, started together (a barrier);
    their results in order. Fails if a thread raised or did not end within ``timeout`` seconds in all."""
    barrier = threading.Barrier(n_threads)
    results = [None] * n_threads
    errors = []

    def run(t):
        try:
            barrier.wait()
            results[t] = work(t)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(n_threads)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "threads did not finish"
    assert not errors, errors
    return results
