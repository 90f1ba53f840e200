"""Pipeline schedules: the order in which each rank runs its forwards and backwards, and
where it waits each send.

A pipeline stage (Huang et al. 2019, GPipe; Narayanan et al. 2021, 1F1B and interleaved
1F1B in Megatron-LM) runs the forward ("F") and backward ("B") of every microbatch in
an order its schedule fixes (``rank_actions``); a send is waited where the rendezvous
point-to-point of gloo cannot deadlock (``send_releases``). ``pipeline`` composes a
rank's memory in this order.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..errors import InvalidOption, RematError

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclasses.dataclass(frozen=True)
class Action:
    """One action of a rank: forward or backward of microbatch ``microbatch`` on
    (global) stage ``stage``."""

    stage: int
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@s{self.stage}" if self.stage else "")


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Megatron-LM's even split: ``num_stages`` consecutive ranges of L / num_stages
    layers (``--num-layers`` must be divisible by the number of stages,
    ``pipeline-model-parallel-size`` x ``virtual-pipeline-model-parallel-size``).

    Raises:
        InvalidOption: L is smaller than or not divisible by ``num_stages``.

    Example:
        >>> stage_layers(8, 4)
        [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    """
    if num_stages < 1 or num_layers < num_stages or num_layers % num_stages:
        raise InvalidOption(
            f"{num_layers} layers cannot be split evenly into {num_stages} pipeline stages: the number of "
            f"stages (pp x vpp) must divide L={num_layers}; legal values: "
            f"{[d for d in range(1, num_layers + 1) if num_layers % d == 0]}"
        )
    per = num_layers // num_stages
    return [range(i * per, (i + 1) * per) for i in range(num_stages)]


def rank_actions(schedule: str, rank: int, num_ranks: int, num_microbatches: int,
                 virtual_stages: int = 1) -> list[Action]:
    """The order in which ``rank`` runs its forwards and backwards.

    - ``gpipe``: all m forwards, then all m backwards (Huang et al. 2019).
    - ``1f1b``: Megatron-LM's ``forward_backward_pipelining_without_interleaving``:
      min(p - rank - 1, m) warm-up forwards, then one forward and one backward in
      turn, then the remaining backwards. (torch.distributed.pipelining's
      ``Schedule1F1B`` runs the same sequence.)
    - ``interleaved``: Megatron-LM's ``forward_backward_pipelining_with_interleaving``
      with v model chunks per rank; rank r holds stages c * p + r (c = 0..v-1);
      warm-up (p - rank - 1) * 2 + (v - 1) * p virtual microbatches (all when m = p);
      virtual microbatch k runs chunk (k mod p*v) // p forward (reversed for
      backward) on microbatch (k // (p*v)) * p + k mod p.

    Raises:
        InvalidOption: an unknown schedule; m < 1; interleaved with v < 2 or m not a
            multiple of p; 1f1b / interleaved with m < p.

    Example:
        >>> [str(a) for a in rank_actions("1f1b", 0, 2, 3)]
        ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    validate_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    p, m = num_ranks, num_microbatches
    if schedule == "gpipe":
        return [Action(rank, "F", j) for j in range(m)] + [Action(rank, "B", j) for j in range(m)]
    if schedule == "1f1b":
        warm = min(p - rank - 1, m)
        out = [Action(rank, "F", j) for j in range(warm)]
        for j in range(m - warm):
            out += [Action(rank, "F", warm + j), Action(rank, "B", j)]
        return out + [Action(rank, "B", j) for j in range(m - warm, m)]
    v = virtual_stages
    total = m * v
    warm = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)

    def virtual(k: int, kind: str) -> Action:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + rank, kind, (k // (p * v)) * p + k % p)

    out = [virtual(k, "F") for k in range(warm)]
    for k in range(total - warm):
        out += [virtual(warm + k, "F"), virtual(k, "B")]
    return out + [virtual(k, "B") for k in range(total - warm, total)]


def validate_schedule(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Check a pipeline schedule's settings (see ``rank_actions``).

    Raises:
        InvalidOption: the message names the setting and its legal values.
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if schedule not in PIPELINE_SCHEDULES:
        raise InvalidOption(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")
    if p < 1 or m < 1:
        raise InvalidOption(f"pipeline size {p} and microbatches {m} must both be 1 or more")
    if schedule == "interleaved":
        if v < 2:
            raise InvalidOption(f"the interleaved schedule needs --vpp 2 or more model chunks per rank (got {v})")
        if m % p:
            raise InvalidOption(f"the interleaved schedule needs microbatches divisible by the pipeline size "
                             f"{p} (Megatron-LM's rule); got {m}: use one of {[p * k for k in range(1, 5)]}")
    elif v != 1:
        raise InvalidOption(f"--vpp {v} needs --pipeline-schedule interleaved ({schedule} has one chunk per rank)")
    if schedule in ("1f1b", "interleaved") and m < p:
        raise InvalidOption(f"{schedule} needs at least as many microbatches as pipeline stages: m={m} < p={p}; "
                         f"use --microbatches {p} or more, or gpipe")


def _source(a: Action, num_stages: int) -> tuple[int, str, int] | None:
    """The action whose result ``a`` receives (None: nothing to receive)."""
    if a.kind == "F":
        return (a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
    return (a.stage + 1, "B", a.microbatch) if a.stage < num_stages - 1 else None


def _sends(a: Action, num_stages: int) -> bool:
    return (a.kind == "F" and a.stage < num_stages - 1) or (a.kind == "B" and a.stage > 0)


def simulate(actions_by_rank: Sequence[Sequence[Action]], num_stages: int,
             releases: Sequence[Sequence[int]]) -> list[list[tuple[int, ...]]]:
    """Run the ranks' action lists over rendezvous point-to-point (gloo: a send
    completes once its receiver has posted the receive). Each action first posts and
    waits its receive, then waits the sends it releases (``releases[r][k]``: the action
    index at which rank r waits the send of its action k; ``len`` = the end of the
    step), then runs and posts its own send.

    Returns:
        For every rank and action, the vector clock at its start: for each rank q, the
        last action of q known to have posted its receive (-1: none).

    Raises:
        RematError: the orders deadlock (names each rank's blocked action).
    """
    world = len(actions_by_rank)
    where = {(a.stage, a.kind, a.microbatch): (r, k) for r, acts in enumerate(actions_by_rank)
             for k, a in enumerate(acts)}
    pos = [0] * world
    posted: set[tuple[int, int]] = set()
    done: dict[tuple[int, int], tuple[int, ...]] = {}  # (rank, k) -> clock when its send was posted
    clocks: list[list[tuple[int, ...]]] = [[] for _ in range(world)]
    clock = [[-1] * world for _ in range(world)]
    waits = [{} for _ in range(world)]  # rank -> release index -> [receiver (rank, k)]
    for r, acts in enumerate(actions_by_rank):
        for k, a in enumerate(acts):
            if _sends(a, num_stages):
                dest = _dest(a, num_stages)
                if dest not in where:
                    raise RematError(f"rank {r}: {a} sends to {dest}, which no rank runs")
                waits[r].setdefault(releases[r][k], []).append(where[dest])
    while any(pos[r] < len(acts) for r, acts in enumerate(actions_by_rank)):
        progressed = False
        for r, acts in enumerate(actions_by_rank):
            while pos[r] <= len(acts):
                k = pos[r]
                if k < len(acts):
                    posted.add((r, k))
                    clock[r][r] = k
                    src = _source(acts[k], num_stages)
                    sender = where.get(src) if src is not None else None
                    if src is not None and sender not in done:
                        break
                    if sender is not None:
                        clock[r] = [max(x, y) for x, y in zip(clock[r], done[sender])]
                if not all(rcv in posted for rcv in waits[r].get(k, ())):
                    break
                if k == len(acts):
                    pos[r] += 1
                    break
                clocks[r].append(tuple(clock[r]))
                done[(r, k)] = tuple(clock[r])
                pos[r] += 1
                progressed = True
        if not progressed and any(pos[r] < len(acts) for r, acts in enumerate(actions_by_rank)):
            blocked = [f"rank {r}: {acts[pos[r]]}" for r, acts in enumerate(actions_by_rank) if pos[r] < len(acts)]
            raise RematError("the pipeline action orders deadlock: " + "; ".join(blocked))
    return clocks


def _dest(a: Action, num_stages: int) -> tuple[int, str, int]:
    return (a.stage + 1, "F", a.microbatch) if a.kind == "F" else (a.stage - 1, "B", a.microbatch)


def send_releases(actions_by_rank: Sequence[Sequence[Action]], num_stages: int) -> list[list[int]]:
    """Where each rank waits (and frees) the tensor each of its actions sends.

    Megatron-style first: the send of action k is waited at action k + 1, after that
    action's receive (``distributed.pipeline_step``). Where that deadlocks under
    rendezvous sends (interleaved 1F1B: two ranks each waiting for the other to post a
    receive), every send is instead waited at the first later action at which it is
    known complete: the first whose receive brings word (by the vector clocks of
    ``simulate``) that the receiver has posted its receive; the wait then cannot block.

    Returns:
        ``releases[r][k]``: the action index of rank r at which the send of its action
        k is waited (``len(actions)``: the end of the step).
    """
    nxt = [[k + 1 for k in range(len(acts))] for acts in actions_by_rank]
    try:
        simulate(actions_by_rank, num_stages, nxt)
        return nxt
    except RematError:
        pass
    end = [[len(acts)] * len(acts) for acts in actions_by_rank]
    clocks = simulate(actions_by_rank, num_stages, end)
    where = {(a.stage, a.kind, a.microbatch): (r, k) for r, acts in enumerate(actions_by_rank)
             for k, a in enumerate(acts)}
    out = []
    for r, acts in enumerate(actions_by_rank):
        rel = []
        for k, a in enumerate(acts):
            q, i = where[_dest(a, num_stages)] if _sends(a, num_stages) else (r, -1)
            rel.append(next((k2 for k2 in range(k + 1, len(acts)) if clocks[r][k2][q] >= i), len(acts)))
        out.append(rel)
    simulate(actions_by_rank, num_stages, out)
    return out
