"""solvers.front_pool: the fronts of several layer kinds solved on threads are the
fronts solved one by one, and HiGHS's output never reaches stdout while the solves
overlap (the first thread redirects fd 1, the last one restores it)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading

from solvers.front_pool import solve_layer_fronts
from solvers.highs_output import quiet_stdout
from solvers.oplevel import SolveLimits, evaluate, solve_layer_front
from tests.solvers.test_solvers import random_layer

UNBOUNDED = SolveLimits(program_time_s=60, front_time_s=600, fronts_time_s=600)  # no time bound can cut a front here


def test_threaded_fronts_equal_the_fronts_one_by_one():
    graphs = [random_layer(seed, n) for seed, n in [(1, 12), (2, 8), (5, 14), (7, 6)]]
    alone = [solve_layer_front(g, UNBOUNDED) for g in graphs]
    together = solve_layer_fronts(graphs, UNBOUNDED, workers=2)
    assert [f.points for f in together] == [f.points for f in alone]
    assert all(f.complete for f in together)


def test_one_deadline_bounds_the_fronts_of_every_kind_together():
    """``fronts_time_s`` is one deadline for all kinds (a model of many kinds is
    bounded as one of a few): at 0 every front, on one thread or two, is cut to its
    two ends (recompute nothing; the least saved bytes, as the unbounded front's last
    point), each point a valid decision; a per-kind bound alone left them whole."""
    graphs = [random_layer(seed, n) for seed, n in [(1, 12), (2, 8), (5, 14), (7, 6)]]
    whole = solve_layer_fronts(graphs, UNBOUNDED, workers=1)
    assert all(f.complete for f in whole) and max(len(f.points) for f in whole) > 2
    for workers in (1, 2):
        cut = solve_layer_fronts(graphs, dataclasses.replace(UNBOUNDED, fronts_time_s=0), workers=workers)
        for f, w, g in zip(cut, whole, graphs):
            assert not f.complete and len(f.points) == min(2, len(w.points))
            assert f.points[0].recompute_cost == 0 and f.points[-1].saved_bytes == w.points[-1].saved_bytes
            assert all(evaluate(g, d.recomputed) == d for d in f.points)


def test_overlapping_quiet_blocks_keep_fd1_quiet_and_restore_it(capfd):
    """Two threads inside quiet_stdout at once, one leaving while the other still
    prints: nothing reaches fd 1, and fd 1 works again after both have left."""
    inside, leave_first = threading.Barrier(2), threading.Event()

    def first():
        with quiet_stdout():
            inside.wait()
        leave_first.set()

    def second():
        with quiet_stdout():
            inside.wait()
            leave_first.wait()
            ctypes.CDLL(None).printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution\n")
            os.write(1, b"raw from the second thread\n")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert capfd.readouterr().out == ""
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "after\n"
