"""solvers.oplevel.solve_layer_front on layers of hundreds of megabytes to terabytes
saved: HiGHS honours the byte cap only within its feasibility tolerance, and its
presolve can call a feasible cap infeasible. The front of such a layer must still be
exactly the brute-force Pareto front, complete, with no answer over its cap.

The layers are the random layers of ``test_solvers`` with every size scaled and a few
odd bytes added (so the byte row's greatest common divisor is small and cannot
shrink the numbers HiGHS sees). Before the fixes these seeds stalled (the same point
returned for a cap one byte below it until the time bound: incomplete), raised
"HiGHS Status 4: Solve error", or ended the front early at a cap HiGHS's presolve
called infeasible (a front of 1 point where brute force finds 3).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from solvers.oplevel import LayerGraph, SolveLimits, brute_force_front, evaluate, solve_layer_front
from tests.solvers.test_solvers import random_layer

UNBOUNDED = SolveLimits(program_time_s=60, front_time_s=600, fronts_time_s=600)


def scaled_layer(seed: int, n_units: int, scale: int) -> LayerGraph:
    """``random_layer(seed, n_units)`` with every storage and outside input ``scale``
    times larger, plus 0-3 bytes per storage."""
    g = random_layer(seed, n_units)
    r = random.Random(seed)
    storages = tuple(b * scale + r.randint(0, 3) for b in g.storage_bytes)
    externals = tuple(dataclasses.replace(e, nbytes=e.nbytes * scale) for e in g.externals)
    return dataclasses.replace(g, storage_bytes=storages, externals=externals)


CASES = [  # (seed, units, scale): each failed one of the three ways before
    (2, 12, 2**20), (5, 12, 2**20), (15, 10, 2**20),  # front ended at a wrongly infeasible cap
    (0, 10, 2**26), (4, 10, 2**26), (6, 10, 2**26),  # the same point again: stalled, incomplete
    (11, 10, 2**26),  # HiGHS solve error while the cap was lowered
    (17, 12, 2**30), (22, 11, 2**30), (5, 12, 2**33),
]


@pytest.mark.parametrize("seed,units,scale", CASES)
def test_front_of_a_huge_layer_is_the_brute_force_front(seed, units, scale):
    g = scaled_layer(seed, units, scale)
    front = solve_layer_front(g, UNBOUNDED)
    assert front.exact
    assert [(d.saved_bytes, d.recompute_cost) for d in front.points] == [
        (d.saved_bytes, d.recompute_cost) for d in brute_force_front(g)]
    assert all(evaluate(g, d.recomputed) == d for d in front.points)


def test_sizes_with_a_common_divisor_are_solved_in_it():
    """Sizes that are all multiples of 2**20 bytes give the front of the same layer in
    mebibytes, scaled (the byte row is divided by its greatest common divisor)."""
    small = random_layer(3, 11)
    big = dataclasses.replace(small, storage_bytes=tuple(b * 2**20 for b in small.storage_bytes),
                              externals=tuple(dataclasses.replace(e, nbytes=e.nbytes * 2**20) for e in small.externals),
                              rng_state_bytes=small.rng_state_bytes * 2**20)
    a, b = solve_layer_front(small, UNBOUNDED), solve_layer_front(big, UNBOUNDED)
    assert [(d.saved_bytes * 2**20, d.recompute_cost, d.recomputed) for d in a.points] == [
        (d.saved_bytes, d.recompute_cost, d.recomputed) for d in b.points]


@pytest.mark.slow
def test_fronts_of_320_huge_layers_are_the_brute_force_fronts():
    """80 random layers of 10-12 units, each scaled by 2**20, 2**26, 2**30 and 2**33
    bytes: every front exact and equal to brute force (the sweep that chose
    ``MIP_FEASIBILITY_TOLERANCE`` and the row scaling; about a minute)."""
    wrong = []
    for seed in range(80):
        for scale in (2**20, 2**26, 2**30, 2**33):
            g = scaled_layer(seed, 10 + seed % 3, scale)
            front = solve_layer_front(g, UNBOUNDED)
            if not front.exact or [(d.saved_bytes, d.recompute_cost) for d in front.points] != [
                    (d.saved_bytes, d.recompute_cost) for d in brute_force_front(g)]:
                wrong.append((seed, scale))
    assert wrong == []
