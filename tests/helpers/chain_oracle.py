"""The chain dynamic program as it was before the pruned one (``git show
6e26152:solvers/chain.py``), kept as a test oracle: it keeps every Pareto-optimal
(M, recompute) state at every boundary and tries every group length, with no bound.
Slow (seconds at L = 48), exact. Only for ``ChainCosts`` without op-level options."""

from __future__ import annotations

from typing import Any, NamedTuple

from solvers import ChainCosts, Solution

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


def _solution(final: _Final) -> Solution:
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
                for q in range(i, L):
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




def least_recompute(c: ChainCosts, budget_bytes: int) -> Solution | None:
    """The least recompute within the budget (None when nothing fits)."""
    finals = _solve(c, budget_bytes, None, (_SAVED, _FLOPS))
    if not finals:
        return None
    return _solution(min(finals, key=lambda f: (f.recompute_flops, f.peak_bytes, f.key)))


def least_peak_bytes(c: ChainCosts) -> int:
    """The least model peak of any schedule."""
    return min(f.peak_bytes for f in _solve(c, None, None, (_SAVED, _PEAK)))
