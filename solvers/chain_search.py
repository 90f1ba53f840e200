"""The exact solvers over the chain model (``solvers.chain``): the least recompute under a
peak budget, the least feasible peak, the Pareto front of (recompute, peak), and the least
peak under a recompute budget.

Every quantity of the future of a prefix depends on the prefix only through ``M``
(``solvers.chain``), whether a group exists below, and the peak so far, so a dynamic
program over the chain that keeps, at each layer boundary, the Pareto-optimal
``(M, recompute)`` states whose peak fits the budget is exact. This is the dynamic
program over the chain of Rotor (Beaumont et al. 2019, "Optimal checkpointing for
heterogeneous chains") and Revolve (Griewank & Walther 2000), specialised to Megatron-LM's
full recompute: a group is rebuilt once, from its saved input, right before its backward.

Speed (``least_recompute``): the states of a boundary are kept sorted by ``M`` (recompute
falling), so every transition (store layer i, or group i..q) is valid for a *prefix* of
them: its peak and the budget bound ``M`` from above. A backward pass first computes,
for every boundary, the least budget any completion needs above ``M`` (``_needs``); a
state that cannot be completed within the budget is never created. Transitions are
numpy slices, and the group lengths tried from a boundary stop once even the smallest
``M`` cannot fit the group's peak. Both prunings drop only states that no schedule
within the budget passes through, so the answer is the same as without them.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from .chain import ChainCosts, Solution, model_peak, saved_at_boundaries
from .errors import infeasible

_INF = float("inf")

# state families: 0 no group anywhere in the schedule; 1 groups allowed, none yet
# below this boundary; 2 a group below this boundary
_NO_GROUPS, _BEFORE_GROUP, _AFTER_GROUP = 0, 1, 2


class _Groups(NamedTuple):
    """Every group's terms as arrays: ``peak[p][q - p]`` (its peak above M(<p)),
    ``saved[p][q - p]`` and ``cost[p][q - p]`` for the group p..q."""

    peak: list[np.ndarray]
    saved: list[np.ndarray]
    cost: list[np.ndarray]


def _groups(c: ChainCosts, dtype) -> _Groups:  # noqa: ANN001
    """``chain._group_terms`` of every group inside one stack (p..q for q < ``stack_end(p)``),
    with prefix sums and running maxima (numpy)."""
    def prefix(values: tuple[int, ...]) -> np.ndarray:
        return np.concatenate((np.zeros(1, dtype=dtype), np.cumsum(np.array(values, dtype=dtype))))

    member, carry, flops = prefix(c.member_saved_bytes), prefix(c.carry_bytes), prefix(c.member_recompute_flops)
    fw_at = member[:-1] + np.array(c.recomputed_forward_bytes, dtype=dtype)
    bw_at = carry[:-1] + np.array(c.recomputed_backward_bytes, dtype=dtype)
    last_saved = np.array(c.last_saved_bytes, dtype=dtype)
    last_flops = np.array(c.last_recompute_flops, dtype=dtype)
    out = _Groups([], [], [])
    for p in range(c.num_layers):
        end = c.stack_end(p)
        fw = np.maximum.accumulate(fw_at[p:end]) - member[p]
        bw = np.maximum.accumulate(bw_at[p:end]) - carry[p]
        out.peak.append(np.maximum(fw, bw))
        out.saved.append(member[p:end] - member[p] + last_saved[p:end])
        out.cost.append(flops[p:end] - flops[p] + last_flops[p:end])
    return out


def _needs(c: ChainCosts, groups: _Groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per family, per boundary i: the least budget above ``M(<i)`` (bytes) that some
    completion of layers i..L-1 needs (inf: none completes). A backward pass: a min over
    the choice at i of the max of its own regions and what it saves plus the rest's
    need; exact, since every region's peak is ``M`` plus a constant."""
    L, x = c.num_layers, c.shared_checkpoint_bytes
    kind = np.float64 if _peak_bound(c) < 2**53 else object  # floats hold such byte counts exactly
    need = tuple(np.full(L + 1, _INF, dtype=kind) for _ in range(3))
    need[_NO_GROUPS][L] = c.head_bytes
    need[_AFTER_GROUP][L] = x + c.head_bytes
    for i in range(L - 1, -1, -1):
        opts = c.options(i)
        gp = groups.peak[i].astype(kind)
        gs = groups.saved[i].astype(kind)
        for fam in (_NO_GROUPS, _BEFORE_GROUP, _AFTER_GROUP):
            xf = 0 if fam == _NO_GROUPS else x
            xb = x if fam == _AFTER_GROUP else 0
            best = min(max(xf + o.forward_bytes, xb + o.backward_bytes, o.saved_bytes + need[fam][i + 1])
                       for o in opts)
            if fam != _NO_GROUPS:
                best = min(best, np.maximum(gp + xb, gs + need[_AFTER_GROUP][i + 1:i + 1 + len(gp)]).min())
            need[fam][i] = max(best, _gap_above(c.gap_at(i), fam))
    return need


def _gap_above(gap, fam: int) -> int:  # noqa: ANN001
    """The bytes above M the outer steps at a stack boundary need for a family (0: no
    gap there). The family says whether groups exist (forward) and below (backward)."""
    if gap is None:
        return 0
    return max(gap.forward(fam != _NO_GROUPS), gap.backward(fam == _AFTER_GROUP))


class _States(NamedTuple):
    """States of one (boundary, family). State k came from state ``parent_index[k]`` of
    the frontier named by ``sources[source[k]] = (boundary, family, choice)``: choice
    ``q >= 0`` for the group i..q, ``-1 - o`` for layer i stored with option o. A
    frontier (the result of ``_pareto``) is sorted by M ascending, recompute strictly
    falling. A block of candidates may carry one source for all (an int)."""

    saved: np.ndarray
    recompute: np.ndarray
    peak: np.ndarray
    parent_index: np.ndarray
    source: np.ndarray | int


def _dtype(c: ChainCosts) -> type | np.dtype:
    """int64 when every sum fits with room to spare, else exact Python ints."""
    return np.int64 if _peak_bound(c) + sum(c.last_recompute_flops) + sum(c.member_recompute_flops) + sum(
        o.recompute_flops for opts in c.stored_options for o in opts) < 2**60 else object


def _pareto(blocks: list[_States], dtype) -> _States:  # noqa: ANN001
    """Merge candidate states and keep those that no other state beats on both M and
    recompute (among equal (M, recompute): the least peak, then the first).

    Every block is sorted by M already (a shifted subset of a frontier), so a stable
    sort on M merges runs; within a run of equal M only the least recompute can be kept.
    """
    saved, recompute, peak, index = (np.concatenate(parts) for parts in zip(*(b[:4] for b in blocks)))
    source = np.concatenate([np.full(len(b.saved), b.source, dtype=np.int64) if isinstance(b.source, int)
                             else b.source for b in blocks])
    order = np.argsort(saved, kind="stable")
    m, f, p = saved[order], recompute[order], peak[order]
    starts = np.flatnonzero(np.concatenate(([True], m[1:] != m[:-1])))
    lengths = np.diff(np.append(starts, len(m)))
    run_best = np.minimum.reduceat(f, starts)
    best_below = np.minimum.accumulate(run_best)
    useful = np.ones(len(starts), dtype=bool)  # the run's best beats every smaller M
    useful[1:] = run_best[1:] < best_below[:-1]
    candidate = (f == np.repeat(run_best, lengths)) & np.repeat(useful, lengths)
    kept = np.flatnonzero(candidate)
    if len(kept) != int(useful.sum()):  # ties on (M, recompute): least peak, then first
        pc = np.where(candidate, p, _INF)
        candidate &= p == np.repeat(np.minimum.reduceat(pc, starts), lengths)
        kept = np.flatnonzero(candidate)
        run_of = np.repeat(np.arange(len(starts)), lengths)[kept]
        kept = kept[np.concatenate(([True], run_of[1:] != run_of[:-1]))]
    kept = order[kept]
    return _States(saved[kept].astype(dtype), recompute[kept].astype(dtype), peak[kept].astype(dtype),
                   index[kept], source[kept])


class _LowerBound:
    """A lower bound on the recompute of any completion of layers i..L-1 from a state
    with saved bytes M, by Lagrangian relaxation (Held & Karp 1970; Fisher 1981).

    Every completion within the budget ends with ``M + S <= B_end`` (``S``: the bytes
    the completion saves; ``B_end = B - head - x``: the head region's bound), so for
    every ``lambda >= 0`` its recompute ``C`` satisfies ``C >= C + lambda * (M + S -
    B_end) >= D_i(lambda) - lambda * (B_end - M)``, where ``D_i(lambda)`` is the least
    ``C + lambda * S`` over all completions, budget ignored (one backward pass over the
    chain per lambda, all lambdas at once). The bound is the max over a grid of lambdas.
    """

    def __init__(self, c: ChainCosts, budget: int, saved: list[np.ndarray], cost: list[np.ndarray]):
        L, x = c.num_layers, c.shared_checkpoint_bytes
        ratios = [float(c.last_recompute_flops[i]) / max(1.0, float(c.stored_saved_bytes[i] - c.last_saved_bytes[i]))
                  for i in range(L)]
        ratios += [float(o.recompute_flops) / max(1.0, float(c.stored_saved_bytes[i] - o.saved_bytes))
                   for i in range(L) for o in c.options(i)[1:]]
        positive = [r for r in ratios if r > 0] or [1.0]
        self.lam = np.concatenate(([0.0], np.geomspace(min(positive) / 4, max(positive) * 4, 23)))
        self.end = (budget - c.head_bytes, budget - c.head_bytes - x, budget - c.head_bytes - x)
        tables = tuple(np.full((L + 1, len(self.lam)), _INF) for _ in range(3))
        tables[_NO_GROUPS][L] = 0.0
        tables[_AFTER_GROUP][L] = 0.0
        for i in range(L - 1, -1, -1):
            opts = c.options(i)
            stored = np.min([o.recompute_flops + self.lam * o.saved_bytes for o in opts], axis=0)
            grouped = (cost[i].astype(np.float64)[:, None] + saved[i].astype(np.float64)[:, None] * self.lam[None, :]
                       + tables[_AFTER_GROUP][i + 1:i + 1 + len(cost[i])]).min(axis=0)
            tables[_NO_GROUPS][i] = stored + tables[_NO_GROUPS][i + 1]
            for fam in (_BEFORE_GROUP, _AFTER_GROUP):
                tables[fam][i] = np.minimum(stored + tables[fam][i + 1], grouped)
        self.tables = tables
        self.focused: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, boundaries: int | np.ndarray, fam: int, saved: np.ndarray) -> np.ndarray:
        """The bound for states with these saved bytes (float64; inf: none completes),
        all at one boundary or each at its own (``boundaries`` an array like ``saved``).
        After ``focus``, one lambda per boundary (a weaker bound, much cheaper)."""
        room = self.end[fam] - saved.astype(np.float64)
        if self.focused is not None:
            lam, d = self.focused[0][fam][boundaries], self.focused[1][fam][boundaries]
            return d - room * lam
        return (self.tables[fam][boundaries] - room[:, None] * self.lam).max(axis=1)

    def focus(self, saved_at: Sequence[int]) -> None:
        """Keep, per boundary and family, the lambda whose bound is highest for a state
        with ``saved_at[boundary]`` bytes (the path of a good schedule: the bound matters
        most near it)."""
        room = np.array([[e - m for m in saved_at] for e in self.end], dtype=np.float64)  # (family, boundary)
        values = np.stack(self.tables) - room[:, :, None] * self.lam  # (family, boundary, lambda)
        best = np.argmax(np.nan_to_num(values, nan=-_INF, posinf=_INF), axis=2)
        lam = self.lam[best]
        d = np.take_along_axis(np.stack(self.tables), best[:, :, None], axis=2)[:, :, 0]
        self.focused = (lam, d)


class _Search:
    """The forward dynamic program of ``_least_recompute`` for one budget.

    ``run(beam, upper)``: with ``beam``, only that many states per frontier are kept
    (those with the least recompute plus lower bound): a fast schedule within the
    budget, not always the cheapest, whose recompute is an upper bound. With ``upper``,
    a state whose recompute plus lower bound (``_LowerBound``) exceeds it is dropped:
    no completion of it is cheaper than the schedule that gave ``upper``, so the answer
    stays exact.
    """

    def __init__(self, c: ChainCosts, budget: int):
        self.c, self.budget, self.x = c, budget, c.shared_checkpoint_bytes
        self.dtype = _dtype(c)
        groups = _groups(c, self.dtype)
        self.group_peak, self.group_saved, self.group_cost = groups
        # least group peak over q' >= q, to stop trying longer groups
        self.least_ahead = [np.minimum.accumulate(a[::-1])[::-1] for a in self.group_peak]
        self.need = _needs(c, groups)
        self.need_after = self.need[_AFTER_GROUP]
        self.lower = _LowerBound(c, budget, self.group_saved, self.group_cost)
        self.beam: int | None = None
        self.upper = _INF

    def within_upper(self, boundaries: int | np.ndarray, fam: int, saved: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """Which candidates may still beat ``upper`` (recompute plus lower bound)."""
        if self.upper == _INF:
            return np.ones(saved.shape, dtype=bool)
        bound = cost.astype(np.float64) + self.lower(boundaries, fam, saved)
        return bound <= self.upper + (1e-9 * abs(self.upper) + 1)  # float rounding of the bound

    def push(self, key: tuple[int, int], saved: np.ndarray, cost: np.ndarray, peak: np.ndarray,
             index: np.ndarray, source: tuple[int, int, int]) -> None:
        """Candidates from the states ``index`` of the frontier ``source`` names."""
        self.sources.append(source)
        self.pending.setdefault(key, []).append(_States(saved, cost, peak, index, len(self.sources) - 1))

    def frontier(self, key: tuple[int, int]) -> _States | None:
        """The Pareto set of the candidates of ``key`` (the beam's best with ``beam``)."""
        blocks = self.pending.pop(key, None)
        front = _pareto(blocks, self.dtype) if blocks else None
        if front is not None and self.beam is not None and len(front.saved) > self.beam:
            score = front.recompute.astype(np.float64) + self.lower(key[0], key[1], front.saved)
            keep = np.sort(np.argsort(score, kind="stable")[:self.beam])
            front = _States(*(a[keep] for a in front))
        gap = self.c.gap_at(key[0])
        if front is not None and gap is not None:  # the outer steps between two stacks
            front = front._replace(peak=np.maximum(front.peak, front.saved + _gap_above(gap, key[1])))
        if front is not None:
            self.fronts[key] = front
        return front

    def expand(self, i: int, fam: int) -> None:
        """Every transition out of the frontier (i, fam): each valid for a prefix of it."""
        c, budget, x = self.c, self.budget, self.x
        front = self.frontier((i, fam))
        if front is None:
            return
        m, f, p = front.saved, front.recompute, front.peak
        xf = 0 if fam == _NO_GROUPS else x
        xb = x if fam == _AFTER_GROUP else 0
        for k, o in enumerate(c.options(i)):
            limit = min(budget - xf - o.forward_bytes, budget - xb - o.backward_bytes,
                        budget - o.saved_bytes - self.need[fam][i + 1])
            n = int(np.searchsorted(m, limit, side="right"))
            if n:
                ms, fs = m[:n] + o.saved_bytes, f[:n] + o.recompute_flops
                idx = np.flatnonzero(self.within_upper(i + 1, fam, ms, fs))
                if len(idx):
                    pk = np.maximum(p[idx], m[idx] + max(xf + o.forward_bytes, xb + o.backward_bytes))
                    self.push((i + 1, fam), ms[idx], fs[idx], pk, idx, (i, fam, -1 - k))
        if fam == _NO_GROUPS:
            return
        # all group lengths at once: rows q - i, each valid for a prefix of the frontier
        nq = int(np.searchsorted(self.least_ahead[i], budget - xb - m[0], side="right"))
        if not nq:
            return
        gp, gs, gc = self.group_peak[i][:nq], self.group_saved[i][:nq], self.group_cost[i][:nq]
        limits = np.minimum(budget - gp - xb, budget - gs - self.need_after[i + 1:i + 1 + nq])
        counts = np.searchsorted(m, limits, side="right")
        width = int(counts.max())
        if not width:
            return
        rows, cols = np.nonzero(np.arange(width)[None, :] < counts[:, None])
        saved, cost = m[cols] + gs[rows], f[cols] + gc[rows]
        keep = self.within_upper(i + 1 + rows, _AFTER_GROUP, saved, cost)
        if not keep.all():
            rows, cols, saved, cost = rows[keep], cols[keep], saved[keep], cost[keep]
        peak = np.maximum(p[cols], m[cols] + (gp[rows] + xb))
        cuts = np.searchsorted(rows, np.arange(nq + 1))
        for r in range(nq):
            a, b = cuts[r], cuts[r + 1]
            if a < b:
                self.push((i + r + 1, _AFTER_GROUP), saved[a:b], cost[a:b], peak[a:b], cols[a:b], (i, fam, i + r))

    def run(self, beam: int | None = None, upper: float = _INF) -> Solution | None:
        """The search (see the class docstring); None when no schedule fits."""
        c, L = self.c, self.c.num_layers
        self.beam, self.upper = beam, upper
        self.pending: dict[tuple[int, int], list[_States]] = {}
        self.fronts: dict[tuple[int, int], _States] = {}
        self.sources: list[tuple[int, int, int]] = []
        zero = np.zeros(1, dtype=self.dtype)
        for fam in (_NO_GROUPS, _BEFORE_GROUP):
            if self.need[fam][0] <= self.budget:
                self.push((0, fam), zero, zero, zero, np.zeros(1, dtype=np.int64), (-1, -1, 0))
        for i in range(L):
            for fam in (_NO_GROUPS, _BEFORE_GROUP, _AFTER_GROUP):
                self.expand(i, fam)
        best: tuple | None = None
        for fam in (_NO_GROUPS, _AFTER_GROUP):
            front = self.frontier((L, fam))
            if front is None:
                continue
            xf = 0 if fam == _NO_GROUPS else self.x
            for k in range(len(front.saved)):
                peak = max(int(front.peak[k]), int(front.saved[k]) + xf + c.head_bytes, c.outer_bytes)
                key = (int(front.recompute[k]), peak, fam, k)
                if peak <= self.budget and (best is None or key < best):
                    best = key
        if best is None:
            return None
        flops, peak, fam, k = best
        return self.trace(L, fam, k, peak, flops)

    def trace(self, boundary: int, fam: int, k: int, peak: int, flops: int) -> Solution:
        """Follow the parent pointers from a final state back to boundary 0."""
        groups: list[tuple[int, ...]] = []
        options = [0] * self.c.num_layers
        while boundary > 0:
            front = self.fronts[(boundary, fam)]
            i, parent_fam, choice = self.sources[int(front.source[k])]
            k = int(front.parent_index[k])
            if choice >= 0:
                groups.append(tuple(range(i, choice + 1)))
            else:
                options[i] = -1 - choice
            boundary, fam = i, parent_fam
        return Solution(tuple(sorted(groups)), peak, flops, tuple(options) if any(options) else ())


def _least_recompute(c: ChainCosts, budget: int, beam: int = 8) -> Solution | None:
    """The exact least-recompute schedule whose model peak is <= ``budget`` (None when
    none is): a beam search gives an upper bound, the exact search prunes with it. See
    the module docstring for the method."""
    if c.outer_bytes > budget or budget < 0:
        return None
    search = _Search(c, budget)
    quick = search.run(beam=beam)
    if quick is None:
        return None
    search.lower.focus(saved_at_boundaries(c, quick))
    return search.run(upper=quick.recompute_flops)


def least_feasible_peak(c: ChainCosts) -> Solution:
    """The schedule of least model peak (among those, the least recompute).

    The least peak comes from the feasibility bound of ``least_recompute`` at M = 0
    (exact: it is a min over every schedule of the max of its regions).
    """
    need = _needs(c, _groups(c, _dtype(c)))
    least = max(c.outer_bytes, int(min(need[_NO_GROUPS][0], need[_BEFORE_GROUP][0])))
    sol = _least_recompute(c, least)
    assert sol is not None and sol.peak_bytes == least
    return sol


def least_recompute(c: ChainCosts, budget_bytes: int) -> Solution:
    """The schedule with the least recompute FLOPs whose model peak is <= ``budget_bytes``
    (among those, the least peak of the states kept).

    Raises:
        InfeasibleBudget: ``budget_bytes`` is below the least peak any schedule reaches;
            the error carries that least peak (``least_feasible_peak_bytes``).

    Example:
        Two layers; storing both peaks at 30 bytes, recomputing layer 0 alone at 22
        for 5 FLOPs:

        >>> c = ChainCosts((10, 10), (2, 2), (0, 0), (10, 10), (10, 10), (20, 20),
        ...                (20, 20), (12, 12), (5, 5), (5, 5), 0, 0)
        >>> least_recompute(c, 30)
        Solution(groups=(), peak_bytes=30, recompute_flops=0, options=())
        >>> least_recompute(c, 25)
        Solution(groups=((0,),), peak_bytes=22, recompute_flops=5, options=())
    """
    sol = _least_recompute(c, budget_bytes)
    if sol is None:
        raise infeasible(budget_bytes, least_feasible_peak(c).peak_bytes)
    return sol


def pareto_front(c: ChainCosts, budget_bytes: int | None = None) -> list[Solution]:
    """Every schedule on the Pareto front of (recompute FLOPs, peak bytes), exactly.

    Found by ``least_recompute`` at the budget (none: a bound above every peak), then
    again at one byte below the peak of each answer: each answer is the cheapest
    schedule that fits, so no front point between two answers is missed (an answer
    whose recompute equals the previous one's replaces it: same cost, lower peak).

    Args:
        c: the chain costs.
        budget_bytes: if given, only schedules whose model peak is <= it.

    Returns:
        Solutions sorted by recompute FLOPs ascending (peak descending). Empty when
        nothing fits.
    """
    front: list[Solution] = []
    budget = _peak_bound(c) if budget_bytes is None else budget_bytes
    while True:
        sol = _least_recompute(c, budget)
        if sol is None:
            return front
        if front and sol.recompute_flops == front[-1].recompute_flops:
            front[-1] = sol
        else:
            front.append(sol)
        budget = sol.peak_bytes - 1


def _peak_bound(c: ChainCosts) -> int:
    """A number of bytes no schedule's model peak exceeds (every byte term added up)."""
    total = c.head_bytes + c.outer_bytes + c.shared_checkpoint_bytes
    for f in ("stored_saved_bytes", "last_saved_bytes", "member_saved_bytes", "stored_forward_bytes",
              "recomputed_forward_bytes", "stored_backward_bytes", "recomputed_backward_bytes", "carry_bytes"):
        total += sum(abs(v) for v in getattr(c, f))
    total += sum(abs(v) for opts in c.stored_options for o in opts for v in o[:3])
    total += sum(abs(v) for gap in c.stack_gaps for v in gap)
    return total


def least_peak(c: ChainCosts, recompute_budget_flops: int) -> Solution:
    """The dual: the schedule with the least model peak whose recompute FLOPs are <=
    ``recompute_budget_flops`` (among those, the least recompute).

    Found by bisection on the peak budget with ``least_recompute`` (the least
    recompute never rises as the budget grows).

    Raises:
        ValueError: ``recompute_budget_flops`` is negative.
    """
    if recompute_budget_flops < 0:
        raise ValueError(f"recompute budget {recompute_budget_flops} FLOPs is negative; it must be >= 0")
    low = least_feasible_peak(c)
    if low.recompute_flops <= recompute_budget_flops:
        return low
    # lo fails; hi fits (every layer stored with option 0 recomputes nothing)
    lo, hi = low.peak_bytes, model_peak(c, ()).peak_bytes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        sol = _least_recompute(c, mid)
        if sol is not None and sol.recompute_flops <= recompute_budget_flops:
            hi = mid
        else:
            lo = mid
    sol = _least_recompute(c, hi)
    assert sol is not None
    return sol
