"""The chain model of a layer stack under full recompute, and an exact solver over it.

A schedule splits the L layers of the stack into *recomputed groups* of consecutive
layers (any sizes) and *stored* layers (anywhere). The model predicts its peak bytes
from per-layer costs, all plain integers (bytes, FLOPs) calibrated from the graph's
liveness (``remat_pass.symbolic.SymbolicModel.chain_costs``):

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
- Several layer stacks (an encoder and a decoder) form one chain, stack after stack;
  ``stack_starts`` lists the first layer of every stack after the first, and no group
  spans a stack boundary (a group is rebuilt from one saved input).
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
from typing import Any, NamedTuple, Sequence

from .errors import InvalidSchedule, infeasible


@dataclasses.dataclass(frozen=True)
class ChainCosts:
    """Per-layer costs of a layer stack (bytes and FLOPs, plain ints; length L each).

    See the module docstring for how each enters the peak. ``stack_starts``: the first
    layer of each stack after the first when the chain is several stacks (no group
    spans one of these boundaries); empty for one stack.
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
    stack_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.stored_saved_bytes)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple) and f.name != "stack_starts" and len(v) != n:
                raise ValueError(f"ChainCosts.{f.name} has {len(v)} entries for L={n} layers")
        if list(self.stack_starts) != sorted(set(self.stack_starts)) or any(
                not 0 < s < n for s in self.stack_starts):
            raise ValueError(f"ChainCosts.stack_starts {self.stack_starts} are not increasing layers in 1..{n - 1}")

    def stack_end(self, layer: int) -> int:
        """One past the last layer of the stack holding ``layer`` (L for the last stack)."""
        return min((s for s in self.stack_starts if s > layer), default=self.num_layers)

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


class _GroupTerms(NamedTuple):
    """What a recomputed group p..q adds: its peak above M(<p) (bytes), the bytes it
    saves, its recompute FLOPs, and its forward peak above M(<p) (bytes)."""

    peak_above_bytes: int
    saved_bytes: int
    recompute_flops: int
    forward_peak_above_bytes: int


def _group_terms(c: ChainCosts, p: int, q: int) -> _GroupTerms:
    """The terms of group p..q (see ``_GroupTerms``)."""
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
    return _GroupTerms(max(fw, bw), saved, flops, fw)


def model_peak(c: ChainCosts, groups: Sequence[Sequence[int]]) -> Solution:
    """The chain model's peak and recompute FLOPs of one schedule.

    Raises:
        InvalidSchedule: a group is not a run of consecutive layers in 0..L-1, groups
            overlap, or a group spans two stacks.
    """
    start_of: dict[int, int] = {}
    covered: set[int] = set()
    for g in groups:
        g = list(g)
        if not g or g != list(range(g[0], g[0] + len(g))) or g[0] < 0 or g[-1] >= c.num_layers:
            raise InvalidSchedule(f"group {g} is not a run of consecutive layers in 0..{c.num_layers - 1}")
        if covered & set(g):
            raise InvalidSchedule(f"group {g} overlaps another group")
        if g[-1] >= c.stack_end(g[0]):
            raise InvalidSchedule(f"group {g} spans two layer stacks (stacks start at 0 {c.stack_starts})")
        covered |= set(g)
        start_of[g[0]] = g[-1]
    x = c.shared_checkpoint_bytes if start_of else 0
    m = peak = flops = 0
    seen_group = False
    i = 0
    while i < c.num_layers:
        if i in start_of:
            q = start_of[i]
            g = _group_terms(c, i, q)
            peak = max(peak, m + g.peak_above_bytes + (x if seen_group else 0))
            m += g.saved_bytes
            flops += g.recompute_flops
            seen_group = True
            i = q + 1
        else:
            peak = max(peak, m + x + c.stored_forward_bytes[i],
                       m + (x if seen_group else 0) + c.stored_backward_bytes[i])
            m += c.stored_saved_bytes[i]
            i += 1
    peak = max(peak, m + x + c.head_bytes, c.outer_bytes)
    return Solution(tuple(tuple(g) for g in groups), peak, flops)


class _State(NamedTuple):
    """A partial schedule of layers 0..i-1 in the dynamic program.

    Attributes:
        saved_bytes: M, bytes saved by those layers and still held in backward.
        recompute_flops: recompute FLOPs of their groups.
        peak_bytes: the model peak over their regions so far.
        key: the choices as a tuple, a deterministic tie-break.
        choices: the same choices as a linked list ``((p, q or None), rest)``.
        has_group: whether one of them is a recomputed group.
    """

    saved_bytes: int
    recompute_flops: int
    peak_bytes: int
    key: tuple
    choices: tuple
    has_group: bool


def _prune(states: list[_State], budget: int | None, dims: tuple[str, ...],
           flops_budget: int | None = None) -> list[_State]:
    """Keep the states not dominated on the fields ``dims`` among those with the same
    ``has_group``; drop those over ``budget`` (bytes) or ``flops_budget``."""
    if budget is not None:
        states = [s for s in states if s.peak_bytes <= budget]
    if flops_budget is not None:
        states = [s for s in states if s.recompute_flops <= flops_budget]
    states.sort(key=lambda s: (s.has_group, *(getattr(s, d) for d in dims), s.saved_bytes,
                               s.recompute_flops, s.peak_bytes, s.key))
    kept: list[_State] = []
    if len(dims) == 2:  # sorted on dims[0]: dominated iff not below the best dims[1] so far
        best: dict[bool, Any] = {False: None, True: None}
        for s in states:
            b = best[s.has_group]
            if b is not None and b <= getattr(s, dims[1]):
                continue
            best[s.has_group] = getattr(s, dims[1])
            kept.append(s)
        return kept
    staircase: dict[bool, list[_State]] = {False: [], True: []}
    for s in states:
        others = staircase[s.has_group]
        if any(all(getattr(k, d) <= getattr(s, d) for d in dims[1:]) for k in others):
            continue
        others.append(s)
        kept.append(s)
    return kept


def _solution(final: "_Final") -> Solution:
    return Solution(_groups_of(final.choices), final.peak_bytes, final.recompute_flops)


def _groups_of(choices: tuple) -> tuple[tuple[int, ...], ...]:
    out = []
    while choices:
        (p, q), choices = choices
        if q is not None:
            out.append(tuple(range(p, q + 1)))
    return tuple(sorted(out))


class _Final(NamedTuple):
    """A complete schedule found by the dynamic program."""

    recompute_flops: int
    peak_bytes: int
    key: tuple
    choices: tuple


_SAVED, _FLOPS, _PEAK = "saved_bytes", "recompute_flops", "peak_bytes"


def _solve(c: ChainCosts, budget_bytes: int | None, flops_budget: int | None,
           dims: tuple[str, ...]) -> list[_Final]:
    """The dynamic program: the complete schedules kept when partial ones are compared
    on the ``_State`` fields ``dims``."""
    L = c.num_layers
    x = c.shared_checkpoint_bytes
    group_cache: dict[tuple[int, int], _GroupTerms] = {}
    finals: list[_Final] = []
    # mode 0: no group at all (store everything); mode 1: at least one group, so the
    # shared checkpoint is live in every forward region and the head.
    for mode in (0, 1):
        xf = x if mode else 0
        frontier: list[list[_State]] = [[] for _ in range(L + 1)]
        frontier[0] = [_State(0, 0, 0, (), (), False)]
        for i in range(L):
            states = _prune(frontier[i], budget_bytes, dims, flops_budget)
            frontier[i] = []
            for s in states:
                m, xb = s.saved_bytes, (x if s.has_group else 0)
                stored_peak = max(s.peak_bytes, m + xf + c.stored_forward_bytes[i],
                                  m + xb + c.stored_backward_bytes[i])
                frontier[i + 1].append(_State(
                    m + c.stored_saved_bytes[i], s.recompute_flops, stored_peak,
                    s.key + ((i, -1),), ((i, None), s.choices), s.has_group))
                if not mode:
                    continue
                for q in range(i, c.stack_end(i)):
                    if (i, q) not in group_cache:
                        group_cache[(i, q)] = _group_terms(c, i, q)
                    g = group_cache[(i, q)]
                    group_peak = max(s.peak_bytes, m + g.peak_above_bytes + xb)
                    if budget_bytes is not None and group_peak > budget_bytes:
                        continue
                    frontier[q + 1].append(_State(
                        m + g.saved_bytes, s.recompute_flops + g.recompute_flops, group_peak,
                        s.key + ((i, q),), ((i, q), s.choices), True))
        for s in frontier[L]:
            if s.has_group != bool(mode):
                continue
            peak = max(s.peak_bytes, s.saved_bytes + xf + c.head_bytes, c.outer_bytes)
            if budget_bytes is not None and peak > budget_bytes:
                continue
            if flops_budget is not None and s.recompute_flops > flops_budget:
                continue
            finals.append(_Final(s.recompute_flops, peak, s.key, s.choices))
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
    finals = _solve(c, budget_bytes, None, (_SAVED, _FLOPS, _PEAK))
    finals.sort(key=lambda f: (f.recompute_flops, f.peak_bytes, f.key))
    front: list[Solution] = []
    for f in finals:
        if front and front[-1].peak_bytes <= f.peak_bytes:
            continue
        front.append(_solution(f))
    return front


def least_feasible_peak(c: ChainCosts) -> Solution:
    """The schedule of least model peak (among those, the least recompute)."""
    finals = _solve(c, None, None, (_SAVED, _PEAK))
    return _solution(min(finals, key=lambda f: (f.peak_bytes, f.recompute_flops, f.key)))


def least_recompute(c: ChainCosts, budget_bytes: int) -> Solution:
    """The schedule with the least recompute FLOPs whose model peak is <= ``budget_bytes``
    (among those, the least peak).

    Raises:
        InfeasibleBudget: ``budget_bytes`` is below the least peak any schedule reaches;
            the error carries that least peak (``least_feasible_peak_bytes``).

    Example:
        Two layers; storing both peaks at 30 bytes, recomputing layer 0 alone at 22
        for 5 FLOPs:

        >>> c = ChainCosts((10, 10), (2, 2), (0, 0), (10, 10), (10, 10), (20, 20),
        ...                (20, 20), (12, 12), (5, 5), (5, 5), 0, 0)
        >>> least_recompute(c, 30)
        Solution(groups=(), peak_bytes=30, recompute_flops=0)
        >>> least_recompute(c, 25)
        Solution(groups=((0,),), peak_bytes=22, recompute_flops=5)
    """
    finals = _solve(c, budget_bytes, None, (_SAVED, _FLOPS))
    if not finals:
        raise infeasible(budget_bytes, least_feasible_peak(c).peak_bytes)
    return _solution(min(finals, key=lambda f: (f.recompute_flops, f.peak_bytes, f.key)))


def least_peak(c: ChainCosts, recompute_budget_flops: int) -> Solution:
    """The dual: the schedule with the least model peak whose recompute FLOPs are <=
    ``recompute_budget_flops`` (among those, the least recompute).

    Raises:
        ValueError: ``recompute_budget_flops`` is negative.
    """
    if recompute_budget_flops < 0:
        raise ValueError(f"recompute budget {recompute_budget_flops} FLOPs is negative; it must be >= 0")
    # storing everything costs 0 FLOPs, so some schedule always qualifies
    finals = _solve(c, None, recompute_budget_flops, (_SAVED, _FLOPS, _PEAK))
    return _solution(min(finals, key=lambda f: (f.peak_bytes, f.recompute_flops, f.key)))
