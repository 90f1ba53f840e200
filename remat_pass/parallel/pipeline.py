"""Pipeline parallelism: a stage's per-microbatch memory composed in its rank's action order.

A pipeline stage runs the forward ("F") and backward ("B") of every microbatch in the
order its schedule fixes (``pipeline_schedule.rank_actions``: GPipe, 1F1B, interleaved
1F1B). Between F(j) and B(j) the stage holds microbatch j's saved activations; under
1F1B stage i of p holds up to p - i microbatches at once, under GPipe all m; only one
microbatch's forward or backward working set exists at a time.

``StageProfile`` reads one microbatch's memory off the stage's rewritten step
(``intervals.memory_intervals`` / ``live_timeline``, the one sweep). ``compose`` lays
the rank's actions end to end as the phases of ``liveness.composition`` (one per
action: its receive, then the stage's nodes), with the tensors each holds, and takes
the peak of the one composed timeline. The runtime model is the executor of
``distributed.pipeline_step`` (a Megatron-style loop over gloo/nccl point-to-point,
measured to the byte on CPU); each rule is a kind of tensor of the composition:

- ``"microbatch"``: the running microbatch's own timeline, step by step (at the
  receive of B(j): what microbatch j held since F(j)).
- ``"held"``: between F(j) and B(j), microbatch j's saved values, and its received
  activation when backward reads it.
- ``"received"``: F(j) on a stage that receives: the receive buffer of the activation
  is allocated first (``in_bytes``) and lives until its last use in forward (in
  backward when backward reads it). B(j) on a stage that is not the last: the receive
  buffer of the output gradient (``tangent_bytes``) lives until its last use in
  backward. The last stage's tangent is the loss's ``ones`` and is static.
- ``"sent"``: a sent tensor (F's output, B's input gradient) stays alive until the
  next action's receive has completed (the send is asynchronous and waited after that
  receive; ``send_releases`` where that deadlocks).
- ``"accumulator"``: parameter gradients: the first backward's become the accumulator,
  later ones are added into it in place and freed (``grad_accumulator="in_step"``);
  with ``"static"`` the accumulator exists before the step (Megatron-LM's
  ``main_grad`` buffers) and every backward's gradients are freed after they are added.
- the forward output is dropped once sent (the loss once read); liveness keeps a
  forward output to the end of the step, so the backward timeline leaves it out
  unless backward saves it. What outlives the rank's last action is not in its step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.fx as fx

from ..errors import RematError
from ..liveness.composition import Phase, Place, SpanTensor, compose_step
from ..liveness.intervals import Intervals, memory_intervals
from ..liveness.timeline import live_timeline
from ..memory.memory_model import MemoryModel
from ..recompute.rewrite import RewrittenStep
from .pipeline_schedule import Action

GRAD_ACCUMULATORS = ("in_step", "static")


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
                  allocator: str = "cpu", threads: int | None = None) -> StageProfile:
    """The StageProfile of a stage's rewritten step (see the module docstring).

    Args:
        step: the stage's rewritten step; its joint graph was traced with
            ``output="activation"`` unless ``last`` (then it ends in the loss).
        primal_kinds: ``JointGraph.primal_kinds`` of the stage's joint graph; the
            received activation is its first ``"input"`` primal on a stage that is not
            the first.
        stage: the global stage index; first, last: its position in the pipeline.
        allocator: "cpu" or "cuda" (``intervals.storage_bytes``).
        threads: the intra-op threads the stage runs with (op scratch that grows with
            them); None: this process's ``torch.get_num_threads()``.

    Raises:
        RematError: a stage that is not the first has no input that requires grad.
    """
    # storages, op scratch (the ATen formula table) and collective buffers, as analyze
    iv = memory_intervals(step, MemoryModel.table_only(allocator, threads))[0]
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
    """The rank's peak: ``rank_composition`` composed by ``composition.compose_step``
    (bytes); the split of the peak sums the tensors live there by kind.

    Args:
        profiles: global stage index -> its StageProfile (every stage ``actions`` runs).
        actions: the rank's actions (``pipeline_schedule.rank_actions``).
        releases: ``pipeline_schedule.send_releases(...)[rank]``: the action at which
            each action's sent tensor is waited and freed, after that action's
            receive; default k + 1.
        grad_accumulator: ``"in_step"`` or ``"static"`` (module docstring).

    Raises:
        RematError: unknown accumulator; B before F of a microbatch; a stage without a
            profile.
    """
    phases, tensors, in_flight = rank_composition(profiles, actions, releases, grad_accumulator)
    step = compose_step(phases, tensors)
    if step.peak_bytes <= 0:
        return RankPeak(0, "", "", 0, 0, 0, 0, in_flight)
    by = step.live_bytes_by_kind(step.peak_place.index)
    return RankPeak(step.peak_bytes, step.peak_place.graph, step.peak_place.node, by.get("held", 0),
                    by.get("accumulator", 0), by.get("received", 0) + by.get("sent", 0), by.get("microbatch", 0),
                    in_flight)


def rank_composition(profiles: dict[int, StageProfile], actions: Sequence[Action],
                     releases: Sequence[int] | None = None, grad_accumulator: str = "in_step",
                     ) -> tuple[list[Phase], list[SpanTensor], int]:
    """A rank's step as the phases and tensors of ``liveness.composition``: a phase per
    action (graph ``str(action)``; step 0 ``"recv"``, its receive, then the stage's
    nodes, the microbatch's bytes at each as the phase's ``live``) and the tensors of
    the kinds of the module docstring (bytes).

    Returns:
        ``(phases, tensors, in_flight)``, in_flight the most microbatches a local stage
        held at once (F done, B not). Args and errors: as ``compose``.
    """
    if grad_accumulator not in GRAD_ACCUMULATORS:
        raise RematError(f"grad_accumulator {grad_accumulator!r} is not one of {GRAD_ACCUMULATORS}")
    n = len(actions)
    releases = list(releases) if releases is not None else [k + 1 for k in range(n)]
    held_last, in_flight = _held_until(profiles, actions)
    phases = [_action_phase(a, profiles[a.stage]) for a in actions]
    end = Place(n - 1, phases[-1].num_slots - 1) if actions else None
    first_backward = {a.stage: k for k, a in reversed(list(enumerate(actions))) if a.kind == "B"}
    tensors: list[SpanTensor] = []
    for k, a in enumerate(actions):
        prof, label, after = profiles[a.stage], str(a), Place(k + 1, 0)
        tensors += _action_tensors(k, a, prof)
        if k + 1 == n:
            continue
        last = held_last.get(k, n - 1)
        if a.kind == "F" and last > k:
            tensors.append(SpanTensor("saved", label, "held", prof.saved_bytes + prof.in_held_bytes, after,
                                      Place(last, phases[last].num_slots - 1)))
        if a.kind == "B" and grad_accumulator == "in_step" and first_backward[a.stage] == k:
            tensors.append(SpanTensor("parameter gradients", label, "accumulator", prof.param_grad_bytes, after, end))
        sent, r = (prof.out_send_bytes if a.kind == "F" else prof.input_grad_bytes), releases[k]
        tensors.append(SpanTensor("sent", label, "sent", sent, after, Place(r, 0) if k < r < n else end))
    return phases, [t for t in tensors if t.nbytes], in_flight


def _held_until(profiles: dict[int, StageProfile], actions: Sequence[Action]) -> tuple[dict[int, int], int]:
    """Forward action index -> the last action during which its microbatch is held: the
    one before its backward, or a repeated forward of it (the executor replaces what the
    first one held; absent: to the end), and in_flight.

    Raises:
        RematError: as ``compose``, at the first action in error.
    """
    open_f: dict[tuple[int, int], int] = {}
    last, in_flight = {}, 0
    for k, a in enumerate(actions):
        if a.stage not in profiles:
            raise RematError(f"no profile for stage {a.stage} (action {a})")
        if a.kind == "F":
            if (a.stage, a.microbatch) in open_f:
                last[open_f[(a.stage, a.microbatch)]] = k
            open_f[(a.stage, a.microbatch)] = k
            in_flight = max(in_flight, sum(1 for s, _ in open_f if s == a.stage))
        elif (a.stage, a.microbatch) in open_f:
            last[open_f.pop((a.stage, a.microbatch))] = k - 1
        else:
            raise RematError(f"action {a}: backward of a microbatch whose forward has not run")
    return last, in_flight


def _action_phase(a: Action, prof: StageProfile) -> Phase:
    """Action ``a``'s phase: its receive step, then the stage's nodes, whose microbatch
    bytes per step are the phase's ``live`` (kind ``"microbatch"``)."""
    if a.kind == "F":
        return Phase(str(a), "forward", ("recv",) + tuple(prof.forward_nodes), live=(0, *prof.forward_bytes),
                     live_kind="microbatch")
    return Phase(str(a), "backward", ("recv",) + tuple(prof.backward_nodes), live=(0, *prof.backward_bytes),
                 live_kind="microbatch")


def _action_tensors(k: int, a: Action, prof: StageProfile) -> list[SpanTensor]:
    """What action ``k`` holds in its own phase besides its microbatch's per-step bytes
    (``_action_phase``): the receive buffers it reads to their last use, and in a
    backward what the microbatch held since its forward (``rank_composition``)."""
    label, n_fw, n_bw = str(a), len(prof.forward_bytes), len(prof.backward_bytes)
    if a.kind == "F":
        last = 1 + min(prof.in_last_step, n_fw - 1) if prof.in_last_step >= 0 else 0
        return [SpanTensor("received activation", label, "received", prof.in_bytes, Place(k, 0), Place(k, last))]
    out = [SpanTensor("held since forward", label, "microbatch", prof.saved_bytes + prof.in_held_bytes,
                      Place(k, 0), Place(k, 0))]
    if prof.in_last_step >= n_fw and n_bw:
        out.append(SpanTensor("received activation", label, "received", prof.in_bytes, Place(k, 1),
                              Place(k, 1 + min(prof.in_last_step - n_fw, n_bw - 1))))
    last = 1 + min(prof.tangent_last_step, n_bw - 1) if prof.tangent_last_step >= 0 else 0
    return out + [SpanTensor("output gradient", label, "received", prof.tangent_bytes, Place(k, 0), Place(k, last))]
