"""The chain model of a layer stack under full recompute, and an exact solver over it.

A schedule splits the L layers of the stack into *recomputed groups* of consecutive
layers (any sizes) and *stored* layers (anywhere). The model predicts its peak bytes
from per-layer costs, all plain integers (bytes, FLOPs) calibrated from the graph's
liveness (``remat_pass.symbolic.chain_costs``):

- ``M(<p)``: bytes saved in forward by the layers before ``p`` and still held in
  backward: ``stored_saved_bytes[i]`` for a stored layer, ``last_saved_bytes[i]`` for
  the last layer of a group (its output, the next checkpoint), ``member_saved_bytes[i]``
  for the other members (RNG states).
- Forward of layer j: ``M(<j) + stored_forward_bytes[j]`` (stored) or, in a group
  starting at p, ``M(<p) + sum(member_saved_bytes[p:j]) + recomputed_forward_bytes[j]``.
- Backward of layer j: ``M(<j) + stored_backward_bytes[j]`` (stored) or, in a group
  starting at p, ``M(<p) + sum(carry_bytes[p:j]) + recomputed_backward_bytes[j]``: the
  layers of the group below j were rebuilt together with j and are still live.
- The head (final norm, logits, loss and their backward): ``M(<L) + head_bytes``; the
  rest of the outer region: ``outer_bytes``.
- A schedule with at least one group also saves ``shared_checkpoint_bytes``: outer
  values every group reads (an attention mask), saved once. They are live in every
  forward region, the head, and the backward of every layer above the lowest group
  (they die at the lowest group's recompute, before its backward).

The peak is the largest of these. Recompute FLOPs add up per layer
(``last_recompute_flops`` / ``member_recompute_flops``). Every quantity of the future
of a prefix depends on the prefix only through ``M`` and the peak so far, so a dynamic
program over the chain that keeps, at each layer boundary, the Pareto-optimal
``(M, recompute FLOPs, peak)`` states is exact: it yields the Pareto front of (recompute
FLOPs, peak) over all 2^(L-1)·... schedules. This is the dynamic program over the chain
of Rotor (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous chains") and
Revolve (Griewank & Walther 2000), specialised to Megatron-LM's full recompute: a group
is rebuilt once, from its saved input, right before its backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from remat_pass.errors import InfeasibleBudget, InvalidSchedule


@dataclasses.dataclass(frozen=True)
class ChainCosts:
    """Per-layer costs of a layer stack (bytes and FLOPs, plain ints; length L each).

    See the module docstring for how each enters the peak.
    """

    stored_saved_bytes: tuple[int, ...]
    last_saved_bytes: tuple[int, ...]
    member_saved_bytes: tuple[int, ...]
    stored_forward_bytes: tuple[int, ...]
    recomputed_forward_bytes: tuple[int, ...]
    stored_backward_bytes: tuple[int, ...]
    recomputed_backward_bytes: tuple[int, ...]
    carry_bytes: tuple[int, ...]
    last_recompute_flops: tuple[int, ...]
    member_recompute_flops: tuple[int, ...]
    head_bytes: int
    outer_bytes: int
    forward_flops: int = 0
    shared_checkpoint_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.stored_saved_bytes)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple) and len(v) != n:
                raise ValueError(f"ChainCosts.{f.name} has {len(v)} entries for L={n} layers")

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.stored_saved_bytes)


@dataclasses.dataclass(frozen=True)
class Solution:
    """One schedule of the chain model.

    Attributes:
        groups: the recomputed groups (tuples of consecutive layers); others stored.
        peak_bytes: the model's peak.
        recompute_flops: the model's recompute FLOPs.
    """

    groups: tuple[tuple[int, ...], ...]
    peak_bytes: int
    recompute_flops: int


def _group_terms(c: ChainCosts, p: int, q: int) -> tuple[int, int, int, int]:
    """(peak above M(<p), saved bytes, recompute FLOPs, forward peak above M(<p)) of group p..q."""
    member_saved = 0
    carry = 0
    bw = 0
    fw = 0
    for j in range(p, q + 1):
        fw = max(fw, member_saved + c.recomputed_forward_bytes[j])
        bw = max(bw, carry + c.recomputed_backward_bytes[j])
        if j < q:
            member_saved += c.member_saved_bytes[j]
            carry += c.carry_bytes[j]
    saved = member_saved + c.last_saved_bytes[q]
    flops = sum(c.member_recompute_flops[p:q]) + c.last_recompute_flops[q]
    return max(fw, bw), saved, flops, fw


def model_peak(c: ChainCosts, groups: Sequence[Sequence[int]]) -> Solution:
    """The chain model's peak and recompute FLOPs of one schedule.

    Raises:
        InvalidSchedule: a group is not a run of consecutive layers in 0..L-1, or
            groups overlap.
    """
    start_of: dict[int, int] = {}
    covered: set[int] = set()
    for g in groups:
        g = list(g)
        if not g or g != list(range(g[0], g[0] + len(g))) or g[0] < 0 or g[-1] >= c.num_layers:
            raise InvalidSchedule(f"group {g} is not a run of consecutive layers in 0..{c.num_layers - 1}")
        if covered & set(g):
            raise InvalidSchedule(f"group {g} overlaps another group")
        covered |= set(g)
        start_of[g[0]] = g[-1]
    x = c.shared_checkpoint_bytes if start_of else 0
    m = peak = flops = 0
    seen_group = False
    i = 0
    while i < c.num_layers:
        if i in start_of:
            q = start_of[i]
            above, saved, f, _ = _group_terms(c, i, q)
            peak = max(peak, m + above + (x if seen_group else 0))
            m += saved
            flops += f
            seen_group = True
            i = q + 1
        else:
            peak = max(peak, m + x + c.stored_forward_bytes[i],
                       m + (x if seen_group else 0) + c.stored_backward_bytes[i])
            m += c.stored_saved_bytes[i]
            i += 1
    peak = max(peak, m + x + c.head_bytes, c.outer_bytes)
    return Solution(tuple(tuple(g) for g in groups), peak, flops)


def _prune(states: list[tuple], budget: int | None, dims: tuple[int, ...],
           flops_budget: int | None = None) -> list[tuple]:
    """Keep the states not dominated on ``dims`` (indices of M, flops, peak) among those
    with the same has-group flag; drop those over ``budget`` or ``flops_budget``."""
    if budget is not None:
        states = [s for s in states if s[2] <= budget]
    if flops_budget is not None:
        states = [s for s in states if s[1] <= flops_budget]
    states.sort(key=lambda s: (s[5], *(s[d] for d in dims), s[0], s[1], s[2], s[3]))
    kept: list[tuple] = []
    staircase: dict[bool, list[tuple]] = {False: [], True: []}
    if len(dims) == 2:  # sorted on dims[0]: dominated iff not below the best dims[1] so far
        best: dict[bool, Any] = {False: None, True: None}
        for s in states:
            b = best[s[5]]
            if b is not None and b <= s[dims[1]]:
                continue
            best[s[5]] = s[dims[1]]
            kept.append(s)
        return kept
    for s in states:
        others = staircase[s[5]]
        if any(all(k[d] <= s[d] for d in dims[1:]) for k in others):
            continue
        others.append(s)
        kept.append(s)
    return kept


def _groups_of(choices: tuple) -> tuple[tuple[int, ...], ...]:
    out = []
    while choices:
        (p, q), choices = choices
        if q is not None:
            out.append(tuple(range(p, q + 1)))
    return tuple(sorted(out))


def _solve(c: ChainCosts, budget_bytes: int | None, flops_budget: int | None,
           dims: tuple[int, ...]) -> list[tuple]:
    """The dynamic program: final ``(flops, peak, tiebreak key, choices)`` of the
    schedules kept when states are compared on ``dims`` (0: M, 1: FLOPs, 2: peak)."""
    L = c.num_layers
    x = c.shared_checkpoint_bytes
    group_cache: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    finals = []
    # mode 0: no group at all (store everything); mode 1: at least one group, so the
    # shared checkpoint is live in every forward region and the head.
    for mode in (0, 1):
        xf = x if mode else 0
        # a state: (M, flops, peak, tiebreak key, choices as a linked list, has_group)
        frontier: list[list[tuple]] = [[] for _ in range(L + 1)]
        frontier[0] = [(0, 0, 0, (), (), False)]
        for i in range(L):
            states = _prune(frontier[i], budget_bytes, dims, flops_budget)
            frontier[i] = []
            for m, f, pk, key, ch, has in states:
                xb = x if has else 0
                p2 = max(pk, m + xf + c.stored_forward_bytes[i], m + xb + c.stored_backward_bytes[i])
                frontier[i + 1].append(
                    (m + c.stored_saved_bytes[i], f, p2, key + ((i, -1),), ((i, None), ch), has)
                )
                if not mode:
                    continue
                for q in range(i, L):
                    if (i, q) not in group_cache:
                        group_cache[(i, q)] = _group_terms(c, i, q)
                    above, saved, gf, _ = group_cache[(i, q)]
                    p3 = max(pk, m + above + (x if has else 0))
                    if budget_bytes is not None and p3 > budget_bytes:
                        continue
                    frontier[q + 1].append(
                        (m + saved, f + gf, p3, key + ((i, q),), ((i, q), ch), True)
                    )
        for m, f, pk, key, ch, has in frontier[L]:
            if has != bool(mode):
                continue
            peak = max(pk, m + xf + c.head_bytes, c.outer_bytes)
            if budget_bytes is not None and peak > budget_bytes:
                continue
            if flops_budget is not None and f > flops_budget:
                continue
            finals.append((f, peak, key, ch))
    return finals


def pareto_front(c: ChainCosts, budget_bytes: int | None = None) -> list[Solution]:
    """Every schedule on the Pareto front of (recompute FLOPs, peak bytes), exactly.

    Args:
        c: the chain costs.
        budget_bytes: if given, only schedules whose model peak is <= it.

    Returns:
        Solutions sorted by recompute FLOPs ascending (peak descending); ties broken
        by the groups, so the answer is deterministic. Empty when nothing fits.

    Complexity: O(L^2 · F) with F the number of Pareto states (M, FLOPs, peak) at a
    layer boundary; F grows quickly on heterogeneous chains (use ``least_recompute``,
    which compares states on (M, FLOPs) only, for long stacks).
    """
    finals = _solve(c, budget_bytes, None, (0, 1, 2))
    finals.sort(key=lambda s: (s[0], s[1], s[2]))
    front: list[Solution] = []
    for f, peak, key, ch in finals:
        if front and front[-1].peak_bytes <= peak:
            continue
        front.append(Solution(_groups_of(ch), peak, f))
    return front


def least_feasible_peak(c: ChainCosts) -> Solution:
    """The schedule of least model peak (among those, the least recompute)."""
    finals = _solve(c, None, None, (0, 2))
    f, peak, key, ch = min(finals, key=lambda s: (s[1], s[0], s[2]))
    return Solution(_groups_of(ch), peak, f)


def least_recompute(c: ChainCosts, budget_bytes: int) -> Solution:
    """The schedule with the least recompute FLOPs whose model peak is <= ``budget_bytes``
    (among those, the least peak).

    Raises:
        InfeasibleBudget: ``budget_bytes`` is below the least peak any schedule reaches;
            the error carries that least peak (``least_feasible_peak_bytes``).

    Example:
        >>> c = ChainCosts((10, 10), (2, 2), (0, 0), (10, 10), (10, 10), (20, 20),
        ...                (20, 20), (12, 12), (5, 5), (5, 5), 0, 0)
        >>> least_recompute(c, 30).groups
        ((0,),)
    """
    finals = _solve(c, budget_bytes, None, (0, 1))
    if not finals:
        least = least_feasible_peak(c).peak_bytes
        raise InfeasibleBudget(
            f"no schedule fits a peak budget of {budget_bytes} bytes: the least feasible "
            f"peak is {least} bytes ({least / 2**20:.2f} MiB); raise the budget to at "
            "least that",
            least_feasible_peak_bytes=least,
            budget_bytes=budget_bytes,
        )
    f, peak, key, ch = min(finals, key=lambda s: (s[0], s[1], s[2]))
    return Solution(_groups_of(ch), peak, f)


def least_peak(c: ChainCosts, recompute_budget_flops: int) -> Solution:
    """The dual: the schedule with the least model peak whose recompute FLOPs are <=
    ``recompute_budget_flops`` (among those, the least recompute).

    Raises:
        ValueError: ``recompute_budget_flops`` is negative.
    """
    if recompute_budget_flops < 0:
        raise ValueError(f"recompute budget {recompute_budget_flops} FLOPs is negative; it must be >= 0")
    # storing everything costs 0 FLOPs, so some schedule always qualifies
    finals = _solve(c, None, recompute_budget_flops, (0, 1, 2))
    f, peak, key, ch = min(finals, key=lambda s: (s[1], s[0], s[2]))
    return Solution(_groups_of(ch), peak, f)
