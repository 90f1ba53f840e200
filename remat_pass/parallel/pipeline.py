"""Pipeline parallelism: a stage's per-microbatch memory composed in its rank's action order.

A pipeline stage (Huang et al. 2019, GPipe; Narayanan et al. 2021, 1F1B and interleaved
1F1B in Megatron-LM) runs the forward ("F") and backward ("B") of every microbatch in
an order its schedule fixes. Between F(j) and B(j) the stage holds microbatch j's saved
activations; under 1F1B stage i of p holds up to p - i microbatches at once, under GPipe
all m; only one microbatch's forward or backward working set exists at a time.

``StageProfile`` reads one microbatch's memory off the stage's rewritten step
(``intervals.live_intervals`` / ``live_timeline``, the one sweep); ``compose`` replays a
rank's actions and adds what the other microbatches hold. The runtime model is the
executor of ``distributed_run.pipeline_step`` (a Megatron-style loop over gloo/nccl
point-to-point, measured to the byte on CPU):

- F(j) on a stage that receives: the receive buffer of the activation is allocated
  first (``in_bytes``); it lives until its last use (inside forward, or in backward
  when backward reads it, then it is held with the saved activations in between).
- a sent tensor (F's output, B's input gradient) stays alive until the next action's
  receive has completed (the send is asynchronous and waited after that receive).
- B(j) on a stage that is not the last: the receive buffer of the output gradient
  (``tangent_bytes``) lives until its last use in backward. The last stage's tangent
  is the loss's ``ones`` and is static.
- parameter gradients: the first backward's become the accumulator, later ones are
  added into it in place and freed (``grad_accumulator="in_step"``); with ``"static"``
  the accumulator exists before the step (Megatron-LM's ``main_grad`` buffers) and
  every backward's gradients are freed after they are added.
- the forward output is dropped once sent (the loss once read); liveness keeps a
  forward output to the end of the step, so the backward timeline leaves it out
  unless backward saves it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.fx as fx

from ..errors import InvalidOption, RematError
from ..liveness.intervals import Intervals, memory_intervals
from ..liveness.timeline import live_timeline
from ..memory.memory_model import MemoryModel
from ..recompute.rewrite import RewrittenStep

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved")
GRAD_ACCUMULATORS = ("in_step", "static")


@dataclasses.dataclass(frozen=True)
class Action:
    """One action of a rank: forward or backward of microbatch ``microbatch`` on
    (global) stage ``stage``."""

    stage: int
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@s{self.stage}" if self.stage else "")


@dataclasses.dataclass(frozen=True)
class StageProfile:
    """One microbatch of one pipeline stage, in activation bytes.

    Attributes:
        stage: the global stage index (0 .. p*v - 1).
        schedule: the recompute schedule's provenance (``uniform(K=1)``).
        forward_bytes: live bytes at every forward step (saved values as they are
            produced, the output included; received activation excluded).
        backward_bytes: live bytes at every backward step (this microbatch's saved
            values until their last use, recomputed values, gradients; the forward
            output excluded unless saved; received activation and tangent excluded).
        forward_nodes, backward_nodes: the node run at each step.
        saved_bytes: what the microbatch holds between its F and its B.
        in_bytes: the received activation (0 on the first stage).
        in_last_step: last step (joint numbering: forward steps, then backward) that
            reads it; ``>= len(forward_bytes)`` when backward reads it.
        out_send_bytes: the output sent to the next stage and not saved (0 on the last
            stage).
        tangent_bytes: the received output gradient (0 on the last stage).
        tangent_last_step: last backward step (backward numbering) that reads it (-1:
            none).
        input_grad_bytes: the gradient sent to the previous stage (0 on the first).
        param_grad_bytes: the parameter gradients one backward produces.
        static_bytes: parameters, buffers and the microbatch's token ids / targets
            (liveness' static, less the received activation and tangent).
    """

    stage: int
    schedule: str
    forward_bytes: tuple[int, ...]
    backward_bytes: tuple[int, ...]
    forward_nodes: tuple[str, ...]
    backward_nodes: tuple[str, ...]
    saved_bytes: int
    in_bytes: int
    in_last_step: int
    out_send_bytes: int
    tangent_bytes: int
    tangent_last_step: int
    input_grad_bytes: int
    param_grad_bytes: int
    static_bytes: int

    @property
    def in_held_bytes(self) -> int:
        """Bytes of the received activation held from F to B (backward reads it)."""
        return self.in_bytes if self.in_last_step >= len(self.forward_bytes) else 0


def stage_profile(step: RewrittenStep, primal_kinds: Sequence[str], stage: int, first: bool, last: bool,
                  allocator: str = "cpu") -> StageProfile:
    """The StageProfile of a stage's rewritten step (see the module docstring).

    Args:
        step: the stage's rewritten step; its joint graph was traced with
            ``output="activation"`` unless ``last`` (then it ends in the loss).
        primal_kinds: ``JointGraph.primal_kinds`` of the stage's joint graph; the
            received activation is its first ``"input"`` primal on a stage that is not
            the first.
        stage: the global stage index; first, last: its position in the pipeline.
        allocator: "cpu" or "cuda" (``intervals.storage_bytes``).

    Raises:
        RematError: a stage that is not the first has no input that requires grad.
    """
    # storages, op scratch (the ATen formula table) and collective buffers, as analyze
    iv = memory_intervals(step, MemoryModel.table_only(allocator))[0]
    n_fw = len(iv.fw_steps)
    fw_out = next(n for n in reversed(step.forward.graph.nodes) if n.op == "output").args[0]
    out_node = fw_out[0]
    out_sid = _storage_of(iv, out_node)
    out_storage = iv.storages[out_sid] if out_sid is not None else None
    sent_alone = out_storage is not None and out_storage.kind == "output"
    everything = live_timeline(iv)
    without_output = live_timeline(iv, select=lambda s: s is not out_storage) if sent_alone else everything
    fw_placeholders = [n for n in step.forward.graph.nodes if n.op == "placeholder"]
    in_bytes, in_last = 0, -1
    if not first:
        inputs = [i for i, k in enumerate(primal_kinds) if k == "input"]
        if not inputs:
            raise RematError(f"pipeline stage {stage} has no input activation (no example input tensor)")
        s = iv.storages[iv.sid_of[fw_placeholders[inputs[0]]]]
        in_bytes, in_last = s.nbytes, s.last
    tangent_bytes, tangent_last = 0, -1
    bw_placeholders = [n for n in step.backward.graph.nodes if n.op == "placeholder"]
    if not last and bw_placeholders:
        tangent = bw_placeholders[-1]
        t = iv.storages[iv.sid_of[tangent]]
        tangent_bytes, tangent_last = t.nbytes, (t.last - n_fw if t.last >= n_fw else -1)
    grads = next(n for n in reversed(step.backward.graph.nodes) if n.op == "output").args[0]
    param_sids, input_grad = set(), 0
    for i, g in enumerate(grads):
        sid = _storage_of(iv, g) if isinstance(g, fx.Node) else None
        if sid is None or iv.storages[sid].static:
            continue
        if primal_kinds[i] == "param":
            param_sids.add(sid)
        elif primal_kinds[i] == "input" and not first:
            input_grad = iv.storages[sid].nbytes
    saved = sorted({s for s in iv.saved_sids if isinstance(s, int) and not iv.storages[s].static})
    return StageProfile(
        stage=stage,
        schedule=step.provenance,
        forward_bytes=tuple(everything[:n_fw]),
        backward_bytes=tuple(without_output[n_fw:]),
        forward_nodes=tuple(n.name for n in iv.fw_steps),
        backward_nodes=tuple(n.name for n in iv.bw_steps),
        saved_bytes=sum(iv.storages[s].nbytes for s in saved),
        in_bytes=in_bytes,
        in_last_step=in_last,
        out_send_bytes=out_storage.nbytes if (sent_alone and not last) else 0,
        tangent_bytes=tangent_bytes,
        tangent_last_step=tangent_last,
        input_grad_bytes=input_grad,
        param_grad_bytes=sum(iv.storages[s].nbytes for s in sorted(param_sids)),
        static_bytes=sum(s.nbytes for s in iv.storages if s.static) - in_bytes - tangent_bytes,
    )


def _storage_of(iv: Intervals, node: Any) -> int | None:
    """Index into ``iv.storages`` of a node's tensor value (None otherwise)."""
    sid = iv.sid_of.get(node) if isinstance(node, fx.Node) else None
    return sid if isinstance(sid, int) else None


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


@dataclasses.dataclass(frozen=True)
class RankPeak:
    """The composed peak of one rank.

    Attributes:
        peak_bytes: peak activation bytes of the rank's step.
        action: the action running at the peak (``B1``, or ``B1@s2`` for stage 2).
        node: the stage's node running there ("recv" for a receive buffer).
        held_bytes: bytes held by the other microbatches in flight (saved values and
            held received activations).
        accumulator_bytes: accumulated parameter gradients.
        buffer_bytes: receive buffers and sent tensors not yet released.
        microbatch_bytes: this microbatch's own timeline at that step.
        in_flight: the most microbatches any local stage held at once (F done, B not).
    """

    peak_bytes: int
    action: str
    node: str
    held_bytes: int
    accumulator_bytes: int
    buffer_bytes: int
    microbatch_bytes: int
    in_flight: int


def compose(profiles: dict[int, StageProfile], actions: Sequence[Action], releases: Sequence[int] | None = None,
            grad_accumulator: str = "in_step") -> RankPeak:
    """Replay ``actions`` over the stages' profiles: the rank's peak (module docstring).

    Args:
        profiles: global stage index -> its StageProfile (every stage ``actions`` runs).
        actions: the rank's actions (``rank_actions``).
        releases: ``send_releases(...)[rank]``: the action at which each action's sent
            tensor is waited and freed, after that action's receive; default k + 1.
        grad_accumulator: ``"in_step"`` or ``"static"`` (module docstring).

    Raises:
        RematError: unknown accumulator; B before F of a microbatch; a stage without a
            profile.
    """
    if grad_accumulator not in GRAD_ACCUMULATORS:
        raise RematError(f"grad_accumulator {grad_accumulator!r} is not one of {GRAD_ACCUMULATORS}")
    releases = list(releases) if releases is not None else [k + 1 for k in range(len(actions))]
    held: dict[tuple[int, int], int] = {}
    acc: dict[int, int] = {}
    pending: dict[int, int] = {}  # release action index -> bytes sent and not yet waited
    best = RankPeak(0, "", "", 0, 0, 0, 0, 0)
    in_flight = 0

    def consider(a: Action, node: str, others: int, buffers: int, own: int) -> None:
        nonlocal best
        total = others + sum(acc.values()) + buffers + own
        if total > best.peak_bytes:
            best = RankPeak(total, str(a), node, others, sum(acc.values()), buffers, own, 0)

    for k, a in enumerate(actions):
        if a.stage not in profiles:
            raise RematError(f"no profile for stage {a.stage} (action {a})")
        prof = profiles[a.stage]
        n_fw = len(prof.forward_bytes)
        own = 0
        if a.kind == "B":
            own = held.pop((a.stage, a.microbatch), -1)
            if own < 0:
                raise RematError(f"action {a}: backward of a microbatch whose forward has not run")
        others = sum(held.values())
        consider(a, "recv", others, sum(pending.values()) + (prof.in_bytes if a.kind == "F" else prof.tangent_bytes),
                 own)
        pending.pop(k, None)
        sends = sum(pending.values())
        if a.kind == "F":
            for i, live in enumerate(prof.forward_bytes):
                x = prof.in_bytes if i <= prof.in_last_step else 0
                consider(a, prof.forward_nodes[i], others, sends + x, live)
            held[(a.stage, a.microbatch)] = prof.saved_bytes + prof.in_held_bytes
            in_flight = max(in_flight, sum(1 for s, _ in held if s == a.stage))
            sent = prof.out_send_bytes
        else:
            for i, live in enumerate(prof.backward_bytes):
                x = prof.in_bytes if i + n_fw <= prof.in_last_step else 0
                t = prof.tangent_bytes if i <= prof.tangent_last_step else 0
                consider(a, prof.backward_nodes[i], others, sends + x + t, live)
            if grad_accumulator == "in_step":
                acc.setdefault(a.stage, prof.param_grad_bytes)
            sent = prof.input_grad_bytes
        if sent:
            pending[releases[k]] = pending.get(releases[k], 0) + sent
    return dataclasses.replace(best, in_flight=in_flight)
