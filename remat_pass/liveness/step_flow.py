"""What crosses between the graphs of a training step that ``torch.compile`` split at
graph breaks, and how long each crossing tensor lives.

A step runs the compiled graphs' forwards in program order, F1 .. FN, then, when
``loss.backward()`` runs, their backwards in reverse, BN .. B1: each graph's
``CompiledFunctionBackward`` runs once the gradients of its outputs are ready, and
among ready nodes autograd's CPU queue takes the most recently created first
(``torch/csrc/autograd/engine.cpp``, ``ReadyQueue`` ordered by ``sequence_nr``). The
order that ran is observed, not assumed (``backward_order``).

Each graph's own storages come from its liveness (``GraphLiveness``: the intervals of
``intervals.live_intervals`` with forward outputs held only to their own last use, or
Inductor's buffers, ``inductor_memory``). What crosses between graphs, and the rules
``step_flow`` applies (the semantics of the CPython 3.11 frames Dynamo generates and of
AOTAutograd's runtime, ``torch/_functorch/_aot_autograd/runtime_wrappers.py``):

1. A forward output of graph g that a later graph h reads (the tensor at a break):
   Dynamo's rewritten frame calls graph g, then the resume function with the stack and
   live locals as arguments (``torch/_dynamo/symbolic_convert.py``,
   ``create_call_resume_at``); every frame of the resume chain holds what it passed on
   its value stack until its call returns, so the tensor lives until the user's
   forward returns (the end of the last forward), and after that wherever a graph
   still reads it (h saved it for its backward: until its last use in B_h).
2. A graph's saved tensors live from its forward to their last use in its backward
   (``_backward_impl`` clears ``ctx`` and steals the arguments): the per-graph rule.
3. The gradient B_h returns for an input that graph g produced is B_g's tangent: it
   lives from its allocation in B_h to its last use in B_g.
4. A differentiable output that receives no gradient gets a tangent of zeros
   (``autograd.Function`` materializes them), made when B_g starts and dead at its last
   use in B_g (Hugging Face's ``present`` key/values under ``use_cache=True``).
5. The loss tangent (``ones_like(loss)``, made by ``torch.autograd.backward``) lives
   from before the first backward to the end of the step; the loss itself is held by
   the caller to the end.
6. Other outputs the caller does not keep (an HF model's logits after ``.loss``) die
   when the user's forward returns, unless a graph saved them. An output the caller
   still held when the backward pass ended (``held``: the recorder's storage weak
   references; ``out = model(...); out.loss.backward()`` keeps ``out.logits``) lives
   to the end of the step.
7. A parameter gradient is stolen into ``.grad`` and kept to the end of the step when
   ``.grad`` was None; when ``.grad`` exists (or an earlier backward of the step
   already set it) it is added in place and freed when its backward returns.
8. An input Dynamo makes at each call (a Python float passed as a 0-dim float64
   tensor under dynamic shapes) lives from the call to its last read in the graph
   (in its backward when it is saved).

9. Eager ops the step ran around its graphs, when recorded (``EagerOps``, from
   ``compile.eager_recorder``): each run of them is a phase of its own (after a
   graph's forward, before a graph's backward, after the last one), each storage they
   allocate lives from its op to where it was found dead (an eager op, or a graph's
   last read of it as an input or tangent); a graph output lives at least to the last
   eager op it was seen alive at; a tangent an eager op gave is theirs (rules 4 and 5
   do not count it), and one given not contiguous (the expanded ``ones`` of a
   ``sum``'s backward) is copied by AOTAutograd, live in that graph's backward; with
   an eager loss no graph output is the loss (rule 5).

Not modelled (listed in ``StepFlow.notes`` when seen): eager ops not recorded (the
first step of a signature), an output read by two graphs' backwards (autograd sums the
gradients), and held outputs kept past the step: a loop that rebinds ``out`` only when
the next forward returns holds them through that forward (the note gives their bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .intervals import Storage, live_intervals
from ..recompute.rewrite import RewrittenStep
from .composition import Phase, Place, SpanTensor


@dataclasses.dataclass(frozen=True)
class GraphLiveness:
    """One compiled graph's forward and backward storages, as the step composition
    needs them. Step indices are local: ``0 .. nf-1`` forward, ``nf ..`` backward.

    Attributes:
        graph_id: the graph's id.
        forward_steps, backward_steps: what runs at each step (node names or code lines).
        step_layers: the layer of each step, forward then backward (None: outer).
        storages: every storage with its local interval (``intervals.Storage``); static
            ones (primals, tangents) are skipped by the composition; forward outputs
            live only to their own last use in the graph.
        output_sids: index into ``storages`` of each forward output (None: no
            activation, e.g. an alias of an input).
        gradient_sids: index into ``storages`` of the gradient of each primal (None).
        input_last: per primal, the last local step that reads it (-1: none).
        tangent_last: per tangent, the last local step that reads it (-1: none).
        tangent_nbytes: per tangent, its size.
        made_inputs: ``(primal, bytes)`` of each input made at every call, not by the
            caller (``CompileInfo.made_inputs``): live from the call to its last read
            (a saved one: its last read in the backward).
    """

    graph_id: str
    forward_steps: tuple[str, ...]
    backward_steps: tuple[str, ...]
    step_layers: tuple[int | None, ...]
    storages: tuple[Storage, ...]
    output_sids: tuple[int | None, ...]
    gradient_sids: tuple[int | None, ...]
    input_last: tuple[int, ...]
    tangent_last: tuple[int, ...]
    tangent_nbytes: tuple[Any, ...]
    made_inputs: tuple[tuple[int, Any], ...] = ()

    def map_sizes(self, size: Callable[[Any], Any]) -> "GraphLiveness":
        """A copy with every size passed through ``size`` (e.g. a symbolic size
        evaluated at the shapes of one step)."""
        return dataclasses.replace(
            self,
            storages=tuple(dataclasses.replace(s, nbytes=size(s.nbytes)) for s in self.storages),
            tangent_nbytes=tuple(size(b) for b in self.tangent_nbytes),
            made_inputs=tuple((i, size(b)) for i, b in self.made_inputs),
        )


def graph_liveness(graph_id: str, step: RewrittenStep, size_of: Callable[[torch.Tensor], Any],
                   scratch_of: Callable[[fx.Node], Any] | None = None) -> GraphLiveness:
    """The GraphLiveness of a rewritten step run as fx code (``compiler="eager"``).

    Args:
        graph_id: the graph's id.
        step: its RewrittenStep (sizes may be symbolic).
        size_of, scratch_of: as ``intervals.live_intervals``.
    """
    iv = live_intervals(step, size_of, scratch_of, hold_outputs=False)
    fw_placeholders = [n.name for n in step.forward.graph.nodes if n.op == "placeholder"]
    bw_placeholders = [n.name for n in step.backward.graph.nodes if n.op == "placeholder"]
    tangents = bw_placeholders[len(step.saved) + len(step.backward_primal_indices):]
    static = {s.name: s for s in iv.storages if s.static}
    return GraphLiveness(
        graph_id=graph_id,
        forward_steps=tuple(n.name for n in iv.fw_steps),
        backward_steps=tuple(n.name for n in iv.bw_steps),
        step_layers=tuple(step.layer_of.get(n.name) for n in iv.steps),
        storages=tuple(iv.storages),
        output_sids=tuple(iv.output_sids),
        gradient_sids=tuple(iv.gradient_sids),
        input_last=tuple(static[p].last if p in static else -1 for p in fw_placeholders),
        tangent_last=tuple(static[t].last if t in static else -1 for t in tangents),
        tangent_nbytes=tuple(static[t].nbytes if t in static else 0 for t in tangents),
    )


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One call of a compiled graph in a step, and where its inputs came from.

    Attributes:
        graph: the graph's GraphLiveness (concrete sizes for ``compose_step``).
        label: its name in the step (the graph id; ``"0/0#2"`` for a second call).
        inputs_from: per primal, ``(call index, output index)`` of the earlier call
            whose output it is, or None (a parameter, a batch tensor).
        output_joint: per output the caller receives, the index of the graph's forward
            output holding its storage (None: an alias of an input).
        output_tangent: per output the caller receives, the index of its tangent in
            the backward (None: no tangent, e.g. an integer output).
        grad_kept: per primal, True: its gradient is stolen into ``.grad`` and kept;
            False: added into an existing ``.grad`` (freed when the backward returns);
            None: no leaf (no gradient, or one passed back to an earlier graph).
    """

    graph: GraphLiveness
    label: str
    inputs_from: tuple[tuple[int, int] | None, ...]
    output_joint: tuple[int | None, ...]
    output_tangent: tuple[int | None, ...]
    grad_kept: tuple[bool | None, ...]


@dataclasses.dataclass(frozen=True)
class StepFlow:
    """A step's phases in run order, every tensor with its places, and what the
    composition does not model (``notes``, empty when the step is modelled fully)."""

    phases: tuple[Phase, ...]
    tensors: tuple[SpanTensor, ...]
    notes: tuple[str, ...]


EAGER = "eager"  # the graph name of the phases and tensors of the eager ops of a step


@dataclasses.dataclass(frozen=True)
class EagerSegment:
    """Eager ops of a step that ran one after another, with no graph between them.

    Attributes:
        position: ``("forward", c)``: after call c's forward (before the next call's, or
            before backward); ``("backward", c)``: before call c's backward starts;
            ``("end",)``: after the last compiled backward.
        ops: what runs at each step (the ops' names).
        scratch: per op, the bytes it uses only while it runs (its scratch, the
            wrapped numbers of its Python scalars).
    """

    position: tuple
    ops: tuple[str, ...]
    scratch: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class EagerTensor:
    """A storage an eager op of the step allocated: from its op (``("eager",
    position, slot)``) to the last place it was live (an ``_Places.eager_place``)."""

    name: str
    kind: str
    nbytes: Any
    start: tuple
    end: tuple


@dataclasses.dataclass(frozen=True)
class EagerOps:
    """What the eager code of a step did between and around its compiled graphs, as
    recorded while it ran (``compile.eager_recorder``).

    Attributes:
        segments: the runs of eager ops, each a phase of the step.
        tensors: the storages the eager ops allocated.
        output_ends: ``((call, output), place)``: the last place a graph output was
            seen alive (eager code read it, or held it): its end is at least there.
        tangents: ``(call, tangent)`` of each tangent of a graph's backward that an
            eager op made (a gradient of the eager loss, the loss tangent): counted in
            ``tensors``, not by rules 4 and 5.
        made_inputs: ``(call, primal)`` of inputs that recorded eager ops made (counted
            in ``tensors``, not by rule 8).
        loss_eager: the backward's root is not a graph output (an eager loss).
        copied: ``(call, tangent)`` of tangents an eager op gave in a layout the graph
            was not traced for (not contiguous): AOTAutograd's copy lives from the
            start of that graph's backward to its last read there.
    """

    segments: tuple[EagerSegment, ...]
    tensors: tuple[EagerTensor, ...]
    output_ends: tuple[tuple[tuple[int, int], tuple], ...] = ()
    tangents: frozenset[tuple[int, int]] = frozenset()
    made_inputs: frozenset[tuple[int, int]] = frozenset()
    loss_eager: bool = False
    copied: frozenset[tuple[int, int]] = frozenset()


class _Places:
    """Local steps of each call -> places in the step's phases (the eager ops' phases,
    ``EagerOps.segments``, between them)."""

    def __init__(self, calls: Sequence[GraphCall], backward_order: Sequence[int], eager: "EagerOps | None" = None):
        self.calls = calls
        segments = {s.position: s for s in (eager.segments if eager is not None else ())}
        self.phases: list[Phase] = []
        self.fw_phase: dict[int, int] = {}
        self.bw_phase: dict[int, int] = {}
        self.eager_phase: dict[tuple, int] = {}
        for c, call in enumerate(calls):
            self.fw_phase[c] = len(self.phases)
            self.phases.append(Phase(call.label, "forward", call.graph.forward_steps,
                                     call.graph.step_layers[: len(call.graph.forward_steps)]))
            self._eager(segments.get(("forward", c)), "forward")
        self.forward_end = self.end(self.fw_phase[len(calls) - 1]) if calls else Place(0, 0)
        for c in backward_order:
            self._eager(segments.get(("backward", c)), "backward")
            self.bw_phase[c] = len(self.phases)
            g = calls[c].graph
            self.phases.append(Phase(calls[c].label, "backward", g.backward_steps,
                                     g.step_layers[len(g.forward_steps):]))
        self._eager(segments.get(("end",)), "backward")
        self.step_end = self.end(len(self.phases) - 1)
        first = len(calls) + sum(1 for pos in self.eager_phase if pos[0] == "forward")
        self.first_backward = Place(first, 0) if first < len(self.phases) else self.step_end

    def _eager(self, segment: "EagerSegment | None", kind: str) -> None:
        if segment is not None:
            self.eager_phase[segment.position] = len(self.phases)
            self.phases.append(Phase(EAGER, kind, segment.ops, (), segment.scratch, "eager scratch"))

    def end(self, phase: int) -> Place:
        return Place(phase, self.phases[phase].num_slots - 1)

    def local(self, c: int, i: int) -> Place:
        """Local step ``i`` of call ``c``; a backward step of a call whose backward did
        not run maps to the end of its forward."""
        nf = len(self.calls[c].graph.forward_steps)
        f = self.fw_phase[c]
        if i < 0:
            return Place(f, 0)
        if i < nf:
            return Place(f, i)
        if c in self.bw_phase:
            p = self.bw_phase[c]
            return Place(p, min(i - nf, self.phases[p].num_slots - 1))
        return self.end(f)

    def eager_place(self, where: tuple) -> Place:
        """An ``EagerOps`` place: ``("eager", position, slot)``, ``("forward_end", c)``,
        ``("backward_end", c)``, ``("input", c, primal)`` (its last read in call c),
        ``("tangent", c, t)`` (its last read in c's backward) or ``("step_end",)``."""
        kind = where[0]
        if kind == "eager":
            return Place(self.eager_phase[where[1]], where[2])
        if kind == "step_end":
            return self.step_end
        c = where[1]
        g = self.calls[c].graph
        if kind == "input" and where[2] < len(g.input_last) and g.input_last[where[2]] >= 0:
            return self.local(c, g.input_last[where[2]])
        if kind == "tangent" and c in self.bw_phase and where[2] < len(g.tangent_last) and g.tangent_last[where[2]] >= 0:
            return self.local(c, g.tangent_last[where[2]])
        if kind in ("backward_end", "tangent") and c in self.bw_phase:
            return self.end(self.bw_phase[c])
        return self.end(self.fw_phase[c])


def step_flow(calls: Sequence[GraphCall], backward_order: Sequence[int],
              loss: tuple[int, int] | None = None,
              held: Sequence[tuple[int, int]] = (), eager: EagerOps | None = None) -> StepFlow:
    """The phases and tensors of a step of several graph calls (rules 1-9 above), and
    of the eager ops around them (``eager``).

    Args:
        calls: the graph calls in the order their forwards ran.
        backward_order: indices of the calls whose backward ran, in the order they ran.
        loss: ``(call, output)`` the caller holds through backward and calls backward
            on; default: output 0 of the last call.
        held: ``(call, output)`` of the outputs the caller still held when the backward
            pass ended (``step_recorder.RecordedStep.held``): live to the end of the step.
        eager: the eager ops recorded in the step (None: not recorded): their phases
            between the graphs' and their storages; a graph output lives at least to
            where it was last seen alive, and the tangents and inputs they made are
            theirs.

    Returns:
        The StepFlow (``composition.compose_step`` turns it into the timeline).

    Raises:
        ValueError: a call in ``backward_order`` twice or out of range.
    """
    if len(set(backward_order)) != len(backward_order) or any(not 0 <= c < len(calls) for c in backward_order):
        raise ValueError(f"backward_order {list(backward_order)} must name distinct calls of 0..{len(calls) - 1}")
    loss = loss if loss is not None else (len(calls) - 1, 0)
    if eager is not None and eager.loss_eager:
        loss = (-1, -1)  # no graph output is the loss
    at = _Places(calls, backward_order, eager)
    consumers: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for h, call in enumerate(calls):
        for pi, src in enumerate(call.inputs_from):
            if src is not None:
                consumers.setdefault(src, []).append((h, pi))
    notes: list[str] = []
    for (g, k), cons in sorted(consumers.items()):
        backs = [(h, pi) for h, pi in cons if h in at.bw_phase and calls[h].graph.gradient_sids[pi] is not None]
        if len(backs) > 1:
            notes.append(f"output {k} of {calls[g].label} gets gradients from {len(backs)} graphs; autograd "
                         "sums them (not modelled)")
    if backward_order:
        notes += [f"the backward of {call.label} (call {c}) was not observed to run; its backward steps are "
                  "counted at the end of its forward (not modelled)"
                  for c, call in enumerate(calls) if c not in at.bw_phase and call.graph.backward_steps]
    tensors: list[SpanTensor] = []
    for c, call in enumerate(calls):
        tensors += _call_tensors(c, calls, at, consumers, loss, frozenset(held), eager)
        if c in at.bw_phase:
            tensors += _tangents(c, calls, at, consumers, loss, eager)
    for e in eager.tensors if eager is not None else ():
        start = at.eager_place(e.start)
        tensors.append(SpanTensor(e.name, EAGER, e.kind, e.nbytes, start, max(start, at.eager_place(e.end))))
    kept = [t for t in tensors if t.kind == "held output"]
    if kept:
        notes.append(f"the caller held {len(kept)} output(s) after backward ({_total(kept)} bytes, counted live to "
                     "the end of the step); a loop that keeps them until the next forward returns (`out = "
                     f"model(...)` rebinds only then) holds them through that forward too: up to {_total(kept)} "
                     "bytes more there")
    return StepFlow(tuple(at.phases), tuple(tensors), tuple(notes))


def _total(tensors: Sequence[SpanTensor]) -> Any:
    return sum((t.nbytes for t in tensors[1:]), tensors[0].nbytes)


def _call_tensors(c: int, calls: Sequence[GraphCall], at: _Places,
                  consumers: dict[tuple[int, int], list[tuple[int, int]]],
                  loss: tuple[int, int], held: frozenset[tuple[int, int]],
                  eager: EagerOps | None) -> list[SpanTensor]:
    """The call's own storages, re-timed where they cross (rules 1, 2, 3, 5-8) and
    where the eager ops were seen to hold them."""
    call, g = calls[c], calls[c].graph
    seen = {k: at.eager_place(w) for (cc, k), w in (eager.output_ends if eager is not None else ()) if cc == c}
    made_eagerly = eager.made_inputs if eager is not None else frozenset()
    outputs: dict[int, list[int]] = {}
    for k, j in enumerate(call.output_joint):
        sid = g.output_sids[j] if j is not None and j < len(g.output_sids) else None
        if sid is not None:
            outputs.setdefault(sid, []).append(k)
    joint_outputs = {sid for sid in g.output_sids if sid is not None}
    gradients: dict[int, int] = {}
    for pi, sid in enumerate(g.gradient_sids):
        if sid is not None:
            gradients.setdefault(sid, pi)
    nf = len(g.forward_steps)
    out: list[SpanTensor] = []
    for sid, s in enumerate(g.storages):
        if s.static or not s.nbytes:
            continue
        start, end, kind = at.local(c, s.first), at.local(c, s.last), s.kind
        if sid in outputs:
            ks = outputs[sid]
            if any((c, k) == loss for k in ks):
                end, kind = at.step_end, "loss"
            elif any((c, k) in held for k in ks):
                end, kind = at.step_end, "held output"
            else:
                cons = [hp for k in ks for hp in consumers.get((c, k), [])]
                end = max(end, at.forward_end)
                for h, pi in cons:
                    last = calls[h].graph.input_last[pi]
                    if last >= 0:
                        end = max(end, at.local(h, last))
                kind = "crossing" if cons else "dropped output"
                for k in ks:
                    if k in seen:
                        end, kind = max(end, seen[k]), kind if cons else "eager input"
        elif sid in joint_outputs:
            end = max(end, at.end(at.fw_phase[c]))
        elif sid in gradients:
            pi = gradients[sid]
            src = call.inputs_from[pi]
            if src is not None:
                p, k = src
                t = calls[p].output_tangent[k] if k < len(calls[p].output_tangent) else None
                if t is not None and p in at.bw_phase:
                    last = calls[p].graph.tangent_last[t]
                    end = max(end, at.local(p, last) if last >= 0 else Place(at.bw_phase[p], 0))
                kind = "passed gradient"
            elif call.grad_kept[pi] is True:
                end, kind = at.step_end, "gradient"
            elif call.grad_kept[pi] is False:
                end, kind = at.local(c, nf + len(g.backward_steps) - 1), "added gradient"
        out.append(SpanTensor(s.name, call.label, kind, s.nbytes, start, end, s.layer))
    for pi, nbytes in g.made_inputs:  # made by Dynamo's frame just before the call
        last = g.input_last[pi] if pi < len(g.input_last) else -1
        if (c, pi) in made_eagerly:  # the eager recording counts it
            continue
        out.append(SpanTensor(f"input {pi}", call.label, "made input", nbytes, at.local(c, 0),
                              at.local(c, last) if last >= 0 else at.local(c, 0)))
    return out


def _tangents(c: int, calls: Sequence[GraphCall], at: _Places,
              consumers: dict[tuple[int, int], list[tuple[int, int]]],
              loss: tuple[int, int], eager: EagerOps | None) -> list[SpanTensor]:
    """The tangents autograd makes for the call's backward (rules 4 and 5); a tangent
    that a later graph's backward provides is that graph's ``passed gradient``, one an
    eager op made is the eager recording's."""
    call, g = calls[c], calls[c].graph
    out = []
    for t, nbytes in enumerate(g.tangent_nbytes):
        if not nbytes or (eager is not None and (c, t) in eager.tangents):
            continue
        if eager is not None and (c, t) in eager.copied:
            start, last = Place(at.bw_phase[c], 0), g.tangent_last[t]
            out.append(SpanTensor(f"tangent {t}", call.label, "copied tangent", nbytes, start,
                                  max(start, at.local(c, last)) if last >= 0 else start))
            continue
        ks = [k for k, tt in enumerate(call.output_tangent) if tt == t]
        name = f"tangent {t}"
        if any((c, k) == loss for k in ks):
            out.append(SpanTensor(name, call.label, "loss tangent", nbytes, at.first_backward, at.step_end))
            continue
        passed = any(h in at.bw_phase and calls[h].graph.gradient_sids[pi] is not None
                     for k in ks for h, pi in consumers.get((c, k), []))
        if passed:
            continue
        start = Place(at.bw_phase[c], 0)
        last = g.tangent_last[t]
        out.append(SpanTensor(name, call.label, "zero tangent", nbytes, start,
                              max(start, at.local(c, last)) if last >= 0 else start))
    return out
