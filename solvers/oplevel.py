"""Which values of one layer to save and which to recompute: the exact trade-off of
saved bytes against recompute cost, by integer programming (HiGHS, through
``scipy.optimize.milp``).

The layer (``LayerGraph``, plain data from ``remat_pass.plan.op_planner``) is its forward
ops, grouped in *units* (an op with the values it returns; a multi-output op's values
are recomputed together), the values backward reads, and the storages the values live
in (views share their base's storage). A *decision* recomputes a set of units:

- every value the layer's own backward reads is saved or recomputed;
- a recomputed unit's inputs are saved or recomputed; an input from outside the layer
  is saved (a checkpoint) unless it is kept anyway (``External.kept``);
- values the policy must save (read by another layer's backward) are saved;
- a recomputed random unit also saves its RNG state (``rng_state_bytes``).

Its *saved bytes* are the bytes of the storages holding a saved value, plus the RNG
states and the checkpoints; its *recompute cost* is the sum of the recomputed units'
costs (the caller's integer unit: FLOPs for compute ops, bytes moved for memory-bound
ops, or timed nanoseconds). ``layer_front`` gives every Pareto-optimal (saved bytes,
recompute cost) decision, by the epsilon-constraint method: least cost under a bytes
cap, then the cap one byte below the answer (Haimes et al. 1971).
The integer program follows Checkmate (Jain et al. 2020, "Checkmate: Breaking the
Memory Wall with Optimal Tensor Rematerialization") restricted to one recompute per
value, with the saved set as the decision, as PyTorch's knapsack partitioner
(``torch/_functorch/partitioners.py``, ``activation_memory_budget``) chooses what to
save. ``brute_force_front`` enumerates every decision (tests), ``evaluate`` gives one
decision's figures by the same rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from typing import NamedTuple, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .errors import RematError
from .highs_output import quiet_stdout  # noqa: F401 - re-exported (imported from here)


@dataclasses.dataclass(frozen=True)
class Value:
    """One tensor a unit returns.

    Attributes:
        storage: index into ``LayerGraph.storage_bytes`` (views share their base's).
        read_by_backward: the layer's own backward reads it.
        must_save: saved whatever the decision (read by another layer's backward).
        savable: it can be saved (False for values that are not tensors).
    """

    storage: int
    read_by_backward: bool = False
    must_save: bool = False
    savable: bool = True


@dataclasses.dataclass(frozen=True)
class Unit:
    """One forward op and the values it returns.

    Attributes:
        values: indices into ``LayerGraph.values``.
        inputs: indices of the values it reads (inside the layer).
        externals: indices into ``LayerGraph.externals`` it reads.
        cost: its recompute cost (integer, the caller's unit).
        random: it draws random numbers (recomputing it saves an RNG state).
        recomputable: the decision may recompute it.
    """

    values: tuple[int, ...]
    inputs: tuple[int, ...] = ()
    externals: tuple[int, ...] = ()
    cost: int = 0
    random: bool = False
    recomputable: bool = True


@dataclasses.dataclass(frozen=True)
class External:
    """A value from outside the layer that its ops read.

    Attributes:
        nbytes: its storage's bytes.
        kept: it is saved or static anyway (a primal, or read by some backward), so a
            recompute may read it for free.
    """

    nbytes: int
    kept: bool


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """One layer as the integer program sees it (see the module docstring)."""

    units: tuple[Unit, ...]
    values: tuple[Value, ...]
    storage_bytes: tuple[int, ...]
    externals: tuple[External, ...] = ()
    rng_state_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class LayerDecision:
    """One point of the trade-off.

    Attributes:
        recomputed: indices of the recomputed units (sorted).
        saved_bytes: the decision's saved bytes.
        recompute_cost: the decision's recompute cost.
    """

    recomputed: tuple[int, ...]
    saved_bytes: int
    recompute_cost: int


def evaluate(g: LayerGraph, recompute: Sequence[int]) -> LayerDecision | None:
    """The figures of recomputing the units ``recompute`` (None when it is not a valid
    decision: a unit that may not be recomputed, or an input neither saved nor
    recomputed cannot happen, since any value not recomputed is saved if savable).

    Values not recomputed that backward or a recompute reads are saved; a non-savable
    value that must be available and is not recomputed makes the decision invalid.
    """
    rec = set(recompute)
    if any(not g.units[u].recomputable for u in rec):
        return None
    unit_of = {v: u for u, unit in enumerate(g.units) for v in unit.values}
    saved: set[int] = {v for v, val in enumerate(g.values) if val.must_save}
    for v, val in enumerate(g.values):
        if val.read_by_backward and unit_of[v] not in rec:
            saved.add(v)
    externals: set[int] = set()
    for u in rec:
        for v in g.units[u].inputs:
            if unit_of[v] not in rec:
                saved.add(v)
        externals.update(e for e in g.units[u].externals if not g.externals[e].kept)
    if any(not g.values[v].savable for v in saved):
        return None
    nbytes = sum(g.storage_bytes[s] for s in {g.values[v].storage for v in saved})
    nbytes += sum(g.externals[e].nbytes for e in externals) + g.rng_state_bytes * sum(g.units[u].random for u in rec)
    # recomputing a unit nothing needs is never useful: count only what is needed
    return LayerDecision(tuple(sorted(rec)), nbytes, sum(g.units[u].cost for u in rec))


def brute_force_front(g: LayerGraph) -> list[LayerDecision]:
    """The Pareto front of (saved bytes, recompute cost) by trying every set of
    recomputable units (2^units: small graphs only), least cost first."""
    candidates = [u for u, unit in enumerate(g.units) if unit.recomputable]
    every = []
    for k in range(len(candidates) + 1):
        for rec in itertools.combinations(candidates, k):
            d = evaluate(g, rec)
            if d is not None:
                every.append(d)
    return _front(every)


def _front(decisions: list[LayerDecision]) -> list[LayerDecision]:
    out: list[LayerDecision] = []
    for d in sorted(decisions, key=lambda d: (d.recompute_cost, d.saved_bytes, d.recomputed)):
        if not out or d.saved_bytes < out[-1].saved_bytes:
            out.append(d)
    return out


@dataclasses.dataclass(frozen=True)
class SolveLimits:
    """Bounds on the time the integer programs of a layer take.

    Attributes:
        program_time_s: HiGHS ``time_limit`` of one program (seconds); an answer found by
            then is kept with its proven gap.
        mip_rel_gap: HiGHS ``mip_rel_gap`` (0: solved to proven optimality).
        front_time_s: seconds for the whole front of one layer kind; when spent, the
            front stops and its least-bytes end is solved once.
        fronts_time_s: seconds for the fronts of every layer kind of one plan together
            (``front_pool.solve_layer_fronts``, one deadline shared by the kinds, on
            however many threads): a front still running then stops as at
            ``front_time_s``, and one that starts after it keeps its two ends only (a
            model of many kinds, such as EfficientNet's 14, is bounded as one of a few).
        max_points: the most points a front keeps (the least-bytes end is kept).
        calibrate_time_s: seconds the caller may spend calibrating the points (the op
            planner's liveness profiles, ``remat_pass.plan.op_planner``): past it, the
            points not yet calibrated are left out (both ends and an even spread first).

    Raises:
        RematError: a limit is negative or not a number.
    """

    program_time_s: float = 5.0
    mip_rel_gap: float = 0.0
    front_time_s: float = 15.0
    fronts_time_s: float = 30.0
    max_points: int = 64
    calibrate_time_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("program_time_s", "mip_rel_gap", "front_time_s", "fronts_time_s", "calibrate_time_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise RematError(f"SolveLimits.{name} must be a number >= 0, got {v!r}")
        if not isinstance(self.max_points, int) or self.max_points < 2:
            raise RematError(f"SolveLimits.max_points must be an integer >= 2, got {self.max_points!r}")


@dataclasses.dataclass(frozen=True)
class LayerFront:
    """A layer's trade-off as ``solve_layer_front`` found it.

    Attributes:
        points: the Pareto-optimal decisions found, least cost first.
        gap_cost: the largest proven gap of a point (recompute cost units): how much
            cheaper a decision within its bytes could be; 0 when every program was
            solved to optimality.
        complete: the whole front was enumerated (not cut by ``front_time_s``).
        programs: integer programs solved.
        solve_time_s: seconds it took.
    """

    points: tuple[LayerDecision, ...]
    gap_cost: int
    complete: bool
    programs: int
    solve_time_s: float

    @property
    def exact(self) -> bool:
        """Every point proven optimal and the whole front enumerated."""
        return self.complete and self.gap_cost == 0


def spread_order(n: int) -> list[int]:
    """0..n-1 with both ends first, then midpoints by bisection (an even spread at any
    prefix): the order in which a bounded caller takes a front's points.

    >>> spread_order(6)
    [0, 5, 2, 1, 3, 4]
    """
    if n <= 2:
        return list(range(n))
    out, intervals = [0, n - 1], [(0, n - 1)]
    while intervals:
        nxt = []
        for a, b in intervals:
            if b - a > 1:
                m = (a + b) // 2
                out.append(m)
                nxt += [(a, m), (m, b)]
        intervals = nxt
    return out


MIP_FEASIBILITY_TOLERANCE = 1e-8
"""HiGHS ``mip_feasibility_tolerance``, applied to the byte row scaled to a largest
coefficient of 1 (``_Program.bytes_at_most``). With HiGHS's default 1e-6 on the row in
bytes, a layer of 13 GB saved came back 942 bytes over its cap, the same point for
every cap within 1 KB below it, and HiGHS failed with a solve error at one of them.
On 320 random layers (80 seeds, each scaled by 2**20, 2**26, 2**30 and 2**33 bytes;
16,337 programs, 62 s: the slow test of ``tests/solvers/test_front_cap_tolerance.py``)
this tolerance with the scaled row gave every front equal to brute force; the default
1e-6, 1e-8 unscaled, or coefficients scaled to 1e3 or 1e6 each gave wrong or failed
fronts on some of them (a point missed while the gap was 0). 1e-10 is the least HiGHS
accepts."""


class _Answer(NamedTuple):
    """One program's answer: the variables, its proven gap (objective units), and
    whether the time limit stopped it."""

    x: np.ndarray | None
    gap: int
    timed_out: bool


class _Program:
    """The integer program of one layer: variables ``[save value v | recompute unit u |
    hold storage s | hold external e]``, all binary."""

    def __init__(self, g: LayerGraph):
        self.g = g
        nv, nu, ns, ne = len(g.values), len(g.units), len(g.storage_bytes), len(g.externals)
        self.save, self.rec = 0, nv
        self.hold, self.ext = nv + nu, nv + nu + ns
        self.n = nv + nu + ns + ne
        unit_of = {v: u for u, unit in enumerate(g.units) for v in unit.values}
        rows: list[tuple[dict[int, float], float, float]] = []  # (coefficients, low, high)
        for v, val in enumerate(g.values):
            if val.read_by_backward:  # saved or recomputed
                rows.append(({self.save + v: 1, self.rec + unit_of[v]: 1}, 1, np.inf))
            rows.append(({self.hold + val.storage: 1, self.save + v: -1}, 0, np.inf))
        for u, unit in enumerate(g.units):
            for v in unit.inputs:  # a recomputed unit's inputs are available
                rows.append(({self.save + v: 1, self.rec + unit_of[v]: 1, self.rec + u: -1}, 0, np.inf))
            for e in unit.externals:
                if not g.externals[e].kept:
                    rows.append(({self.ext + e: 1, self.rec + u: -1}, 0, np.inf))
        self.rows = rows
        low, high = np.zeros(self.n), np.ones(self.n)
        for v, val in enumerate(g.values):
            if val.must_save:
                low[self.save + v] = 1
            if not val.savable:
                high[self.save + v] = 0
        for u, unit in enumerate(g.units):
            if not unit.recomputable:
                high[self.rec + u] = 0
        self.bounds = Bounds(low, high)
        self.bytes = np.zeros(self.n)
        self.bytes[self.hold:self.hold + ns] = g.storage_bytes
        self.bytes[self.ext:self.ext + ne] = [e.nbytes for e in g.externals]
        self.bytes[self.rec:self.rec + nu] = [g.rng_state_bytes * unit.random for unit in g.units]
        # the byte row in its greatest common divisor: exact, and smaller numbers for HiGHS
        self.byte_unit = int(np.gcd.reduce(self.bytes.astype(np.int64))) or 1
        self.byte_units = self.bytes / self.byte_unit
        # and scaled by a power of two (exact in floating point) to a largest coefficient
        # of at most 1, so that HiGHS's tolerances apply to it as to the 0/1 structure rows
        self.row_scale = 2.0 ** -max(0, int(np.ceil(np.log2(max(1.0, self.byte_units.max())))))
        self.cost = np.zeros(self.n)
        self.cost[self.rec:self.rec + nu] = [unit.cost for unit in g.units]

    def bytes_at_most(self, cap: float) -> tuple[np.ndarray, float]:
        """The row ``saved bytes <= cap`` (bytes) in units of ``byte_unit`` (every total
        of the program is a multiple of it, so the rounded-down cap is the same
        constraint), both sides times ``row_scale`` (a power of two: exact)."""
        return self.byte_units * self.row_scale, float(np.floor(cap / self.byte_unit)) * self.row_scale

    def solve(self, objective: np.ndarray, extra: list[tuple[np.ndarray, float]],
              limits: SolveLimits | None = None, time_left_s: float = np.inf,
              presolve: bool = True) -> _Answer | None:
        """Minimise ``objective`` under the structure and ``extra`` rows ``a @ x <= b``,
        within ``limits`` (HiGHS ``time_limit``: the smaller of the program's limit and
        ``time_left_s``; ``mip_rel_gap``). None: proven infeasible; an answer with no
        ``x``: stopped by the time limit before any solution was found."""
        limits = limits or SolveLimits()
        data, row_idx, col_idx, low, high = [], [], [], [], []
        for r, (coef, lo, hi) in enumerate(self.rows):
            for c, a in coef.items():
                row_idx.append(r), col_idx.append(c), data.append(a)
            low.append(lo), high.append(hi)
        for a, b in extra:
            r = len(low)
            for c in np.flatnonzero(a):
                row_idx.append(r), col_idx.append(int(c)), data.append(float(a[c]))
            low.append(-np.inf), high.append(b)
        matrix = coo_array((data, (row_idx, col_idx)), shape=(len(low), self.n)).tocsr()
        options = {"mip_rel_gap": limits.mip_rel_gap, "presolve": presolve, "disp": False,
                   "time_limit": max(1e-3, min(limits.program_time_s, time_left_s)),
                   "mip_feasibility_tolerance": MIP_FEASIBILITY_TOLERANCE}
        with quiet_stdout(), warnings.catch_warnings():
            # scipy passes options it does not list to HiGHS verbatim, warning that it does
            warnings.filterwarnings("ignore", "Unrecognized options detected", RuntimeWarning)
            res = milp(objective, constraints=LinearConstraint(matrix, low, high), bounds=self.bounds,
                       integrality=np.ones(self.n), options=options)
        if res.status == 2:  # infeasible
            return None
        if res.status == 1 and res.x is None:  # no solution found in time
            return _Answer(None, 0, True)
        if res.status not in (0, 1) or res.x is None:
            raise RematError(f"HiGHS did not solve the layer's integer program: {res.message}")
        bound = getattr(res, "mip_dual_bound", None)
        # objective values are integers: the optimum is at least the dual bound rounded up
        gap = 0 if bound is None or not np.isfinite(bound) else max(0, int(round(res.fun)) - int(np.ceil(bound - 1e-6)))
        return _Answer(np.round(res.x).astype(int), gap, res.status == 1)

    def decision(self, x: np.ndarray) -> LayerDecision:
        rec = tuple(int(u) for u in np.flatnonzero(x[self.rec:self.rec + len(self.g.units)]))
        d = evaluate(self.g, rec)
        if d is None:
            raise RematError("the integer program returned a decision that is not valid")
        return d


def layer_front(g: LayerGraph, max_points: int = 64, limits: SolveLimits | None = None) -> list[LayerDecision]:
    """The points of ``solve_layer_front(g, limits)`` (at most ``max_points``), least
    cost first. Same errors."""
    limits = dataclasses.replace(limits or SolveLimits(), max_points=max_points)
    return list(solve_layer_front(g, limits).points)


def solve_layer_front(g: LayerGraph, limits: SolveLimits | None = None,
                      deadline: float | None = None) -> LayerFront:
    """Every Pareto-optimal (saved bytes, recompute cost) decision of the layer, least
    cost first, within ``limits`` (at most ``limits.max_points``; the least-bytes end is
    kept when cut) and before ``deadline`` (a ``time.perf_counter()`` value: the plan's
    shared bound, ``limits.fronts_time_s``; None: none).

    Each point is the least recompute cost among decisions saving at most a cap (an
    integer program; HiGHS ``time_limit`` and ``mip_rel_gap`` from ``limits``, an
    answer stopped by them carrying its proven gap); the next cap is one byte below its
    saved bytes, and an answer of the same cost with fewer bytes replaces the previous
    point, so every point ends at the least bytes of its cost (the epsilon-constraint
    method, Haimes et al. 1971). The byte row is divided by its greatest common divisor
    and scaled by a power of two to coefficients of at most 1 (exact), solved with
    ``MIP_FEASIBILITY_TOLERANCE``. HiGHS still honours a cap only within that tolerance:
    an answer over the cap by its exact bytes is solved again at a cap lowered by twice
    the excess, doubling, so each program that is kept lowers the cap (decisions within
    that margin of a cap can be missed). A cap HiGHS calls infeasible is asked again
    without presolve (its presolve called feasible caps of such layers infeasible,
    ending the front early). When ``limits.front_time_s`` is spent the enumeration
    stops and the least-bytes decision is solved once, so the front still reaches the
    layer's least saved bytes (``LayerFront.complete`` False). The figures of each point
    are recomputed with ``evaluate`` from the recomputed units (exact integers), and each
    point's recompute set is the least needed (units nothing reads are not recomputed).

    Raises:
        RematError: HiGHS fails (not for an infeasible cap, which ends the front).
    """
    limits = limits or SolveLimits()
    t0 = time.perf_counter()
    prog = _Program(g)
    found: list[LayerDecision] = []
    gap, programs, complete = 0, 0, True
    cap, shave = float(prog.bytes.sum()) + 1, 0.0
    while cap - shave >= 0:
        now = time.perf_counter()
        left = min(limits.front_time_s - (now - t0), np.inf if deadline is None else deadline - now)
        if left <= 0 and found:
            complete = False
            break
        answer = prog.solve(prog.cost, [prog.bytes_at_most(cap - shave)], limits, left if found else np.inf)
        programs += 1
        if answer is None:  # HiGHS's presolve can call a feasible cap infeasible: asked again without
            answer = prog.solve(prog.cost, [prog.bytes_at_most(cap - shave)], limits, left if found else np.inf,
                                presolve=False)
            programs += 1
        if answer is None:  # proven infeasible: no decision saves fewer bytes
            break
        if answer.x is None:  # stopped by the time limit before any decision was found
            complete = False
            break
        d = _least_needed(g, prog.decision(answer.x))
        if d.saved_bytes > cap:  # within HiGHS's relative feasibility tolerance, not the cap
            shave = max(2 * shave, 2.0 * (d.saved_bytes - cap))
            continue
        gap, shave = max(gap, answer.gap), 0.0
        if found and d.recompute_cost == found[-1].recompute_cost:
            found[-1] = d  # the same cost with fewer bytes: the earlier point was not minimal
        else:
            found.append(d)
        cap = d.saved_bytes - 1
    if not complete:  # the least-bytes end, solved once
        answer = prog.solve(prog.byte_units, [], limits)
        programs += 1
        if answer is not None and answer.x is not None:
            found.append(_least_needed(g, prog.decision(answer.x)))
    front = _front(found)
    if len(front) > limits.max_points:
        step = (len(front) - 1) / (limits.max_points - 1)
        front = [front[round(k * step)] for k in range(limits.max_points)]
    return LayerFront(tuple(front), gap, complete, programs, time.perf_counter() - t0)


def _least_needed(g: LayerGraph, d: LayerDecision) -> LayerDecision:
    """Drop recomputed units that neither backward nor another recompute reads (the
    program may recompute a unit of zero cost and zero saving either way)."""
    rec = set(d.recomputed)
    unit_of = {v: u for u, unit in enumerate(g.units) for v in unit.values}
    needed: set[int] = set()
    todo = [unit_of[v] for v, val in enumerate(g.values) if val.read_by_backward and unit_of[v] in rec]
    while todo:
        u = todo.pop()
        if u in needed:
            continue
        needed.add(u)
        todo.extend(unit_of[v] for v in g.units[u].inputs if unit_of[v] in rec)
    better = evaluate(g, sorted(needed))
    return better if better is not None and better.saved_bytes <= d.saved_bytes and \
        better.recompute_cost <= d.recompute_cost else d
