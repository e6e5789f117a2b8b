"""Independent jobs of one stage spread over the machine's cores, with results that do not depend on it.

`alongside(here, fn, jobs, workers)` returns `(here(), [fn(*job) for job in jobs])`, in that order. With
`workers` > 1, `here` runs in this process while the jobs run in `workers - 1` spawned processes (spawn, not
fork: torch's thread pools do not survive a fork); `here` may use what cannot be pickled (a loaded model). Each
process gets its share of the cores' threads, so two workers on two cores do not fight over them. `fn` must be a
module-level function and the jobs picklable.

Ctrl-C stops the workers at once (they ignore SIGINT; this process terminates them) and reaches the caller as
KeyboardInterrupt; an error in a worker reaches the caller as the same exception.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def cores() -> int:
    """The cores this process may run on (the affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_each(workers: int) -> int:
    """Torch threads per process when `workers` processes share the cores."""
    return max(1, cores() // max(1, workers))


def split(items: list, parts: int) -> list[list]:
    """`items` cut into `parts` (at most len(items)) contiguous runs of about equal length, in order."""
    k = max(1, min(int(parts), len(items)))
    return [items[round(i * len(items) / k): round((i + 1) * len(items) / k)] for i in range(k)] if items else []


def _init_worker(threads: int) -> None:
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    torch.set_num_threads(threads)


def alongside(here: Callable[[], Any], fn: Callable[..., Any], jobs: list[tuple], workers: int) -> tuple[Any, list]:
    """(here(), [fn(*job) for job in jobs]): `here` runs in this process while the jobs run in `workers - 1`
    spawned processes at most (with `workers` <= 1, or no jobs, everything runs here, in order)."""
    helpers = max(0, min(int(workers) - 1, len(jobs)))
    if helpers == 0:
        return here(), [fn(*job) for job in jobs]
    import multiprocessing as mp
    import signal

    import torch

    threads, before = threads_each(helpers + 1), torch.get_num_threads()
    # the workers start with SIGINT ignored (kept across exec), so a Ctrl-C while they import prints nothing there
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = mp.get_context("spawn").Pool(helpers, initializer=_init_worker, initargs=(threads,))
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        pending = [pool.apply_async(fn, job) for job in jobs]
        torch.set_num_threads(threads)
        try:
            mine = here()
        finally:
            torch.set_num_threads(before)
        out = [p.get() for p in pending]
        pool.close()
        return mine, out
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
