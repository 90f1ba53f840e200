"""The trade-off fronts of several layer kinds solved at once, one kind per thread.

``oplevel.solve_layer_front`` is a sequence of integer programs (each cap depends on the
previous answer), so one front runs on one core; the fronts of different layer kinds
(a T5 has four: the first encoder layer, the other encoder layers, the first decoder
layer, the other decoder layers) are independent. HiGHS releases the GIL while it
solves (scipy's ``_highspy`` wrapper), so threads run them in parallel, the largest
kind first, and the fronts come back in the caller's order. Each front is the one
``solve_layer_front`` gives alone (HiGHS is deterministic for a given program and
options); only a time limit that stops a program can make two runs differ, alone or
together. HiGHS's C output is kept off stdout across the overlapping solves
(``highs_output.quiet_stdout`` counts them).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .oplevel import LayerFront, LayerGraph, SolveLimits, solve_layer_front


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where
    the platform has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def solve_layer_fronts(graphs: Sequence[LayerGraph], limits: SolveLimits | None = None,
                       workers: int | None = None) -> list[LayerFront]:
    """``[solve_layer_front(g, limits, deadline) for g in graphs]`` on up to ``workers``
    threads (default: ``usable_cpus()``; at most one per graph; one runs them in turn
    here), every front stopping at one deadline ``limits.fronts_time_s`` after the call.

    Raises:
        RematError: as ``solve_layer_front`` (HiGHS fails).
    """
    limits = limits or SolveLimits()
    deadline = time.perf_counter() + limits.fronts_time_s  # shared by every kind
    workers = min(len(graphs), usable_cpus() if workers is None else max(1, workers))
    if workers <= 1:
        return [solve_layer_front(g, limits, deadline) for g in graphs]
    order = sorted(range(len(graphs)), key=lambda i: -len(graphs[i].values))  # largest first
    with ThreadPoolExecutor(workers, thread_name_prefix="layer-front") as pool:
        futures = {i: pool.submit(solve_layer_front, graphs[i], limits, deadline) for i in order}
        return [futures[i].result() for i in range(len(graphs))]
