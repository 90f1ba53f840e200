"""One training graph of the torch.compile backend as a state value, and the transitions
that take it from one state to the next.

Every state is a frozen dataclass, and every transition a function of a state that
returns the next one (``dataclasses.replace`` where a state changes a field)::

    capture         Dynamo's graph                      -> Captured
    plan            Captured + AOTAutograd's joint graph -> Planned   (rewritten, reported)
    compile_graph   Captured -> Compiled | Plain | Inference         (``graph_compile``)
    record          Compiled | Recorded -> Recorded                  (its liveness, once its step ran)
    replan          Compiled | Recorded + the step plan's schedule -> Captured (forced), compiled again
    fall_back       Captured | Compiled | Recorded + error -> Plain  (``graph_compile``)

``plan`` runs inside AOTAutograd's partition (the joint graph exists only there);
``compile_graph`` runs the whole compile and returns the state it ends in. The step
transitions over all graphs of a step (composition, re-planning) are in ``steps``;
``backend.RematBackend`` holds the current state of every graph.

The one value filled after its compile returns is ``InductorCode``: AOTAutograd
compiles a graph's backward at its first backward, and Inductor hands its code over
then (``inductor_hooks.capture_inner_compile``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence, Union

import torch
import torch.fx as fx

from ..graph.costs import storage_nbytes
from ..graph.regions import LayerStack
from ..graph.trace import JointGraph
from ..liveness.intervals import storage_bytes
from ..liveness.step_flow import GraphLiveness, graph_liveness
from ..liveness.symbolic_sizes import concrete_step, shape_hints, symbol_sources, symbolic_size
from ..recompute import schedule as schedules
from ..recompute.partition import Partition
from ..recompute.rewrite import RewrittenStep, rewrite
from .compiled_graphs import GraphReport
from .graph import CompileInfo, compile_info, graph_layer_stack, graph_report
from .graph_schedule import GraphScheduler, OpPlan
from .graph_transforms import aot_graphs, dynamo_joint
from .inductor_memory import code_liveness
from .options import BackendOptions


class InductorCode:
    """The wrapper code Inductor generated for one compiled graph (``compiler="inductor"``):
    ``forward`` set while the graph compiles, ``backward`` at its first backward (None
    until then). Written only by that graph's Inductor compile."""

    def __init__(self) -> None:
        self.forward: str | None = None
        self.backward: str | None = None


@dataclasses.dataclass(frozen=True)
class InputStandIn:
    """What a recompile needs of an example input that is not a parameter: its layout,
    dtype, device and ``requires_grad``, and which storage it shares with the other
    inputs (``storage``: an index, ``storage_nbytes``), but no bytes. Holding Dynamo's
    real example input instead would keep one step's activation (the logits at a graph
    break) alive for as long as the backend lives."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    storage: int
    storage_nbytes: int


def stand_ins(example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """``example_inputs`` with every plain tensor that is not an ``nn.Parameter``
    replaced by its InputStandIn (parameters, tensor subclasses and non-tensors kept)."""
    storages: dict[int, int] = {}
    out: list[Any] = []
    for x in example_inputs:
        if type(x) is not torch.Tensor:
            out.append(x)
            continue
        st = x.untyped_storage()
        index = storages.setdefault(st.data_ptr(), len(storages))
        out.append(InputStandIn(tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device,
                                x.requires_grad, index, st.nbytes()))
    return tuple(out)


def example_values(inputs: Sequence[Any]) -> list[Any]:
    """Tensors for ``stand_ins``' stand-ins: zero-filled, with their layouts and their
    shared storages (AOTAutograd traces them with fake tensors; their values are never
    read). Allocated for one recompile and dropped after it."""
    storages: dict[int, torch.UntypedStorage] = {}
    out: list[Any] = []
    for x in inputs:
        if not isinstance(x, InputStandIn):
            out.append(x)
            continue
        st = storages.get(x.storage)
        if st is None:
            st = storages[x.storage] = torch.zeros(x.storage_nbytes, dtype=torch.uint8,
                                                   device=x.device).untyped_storage()
        t = torch.empty(0, dtype=x.dtype, device=x.device).set_(st, x.offset, x.size, x.stride)
        out.append(t.requires_grad_(x.requires_grad))
    return out


@dataclasses.dataclass(frozen=True)
class Captured:
    """A graph Dynamo handed over, to compile.

    Attributes:
        info: what Dynamo says of it (id, placeholder labels, graph break).
        gm: Dynamo's GraphModule.
        example_inputs: the inputs it was captured with, activations as
            ``InputStandIn``s (``example_values`` makes tensors of them); the first
            compile is given Dynamo's real inputs.
        forced: the schedule the step plan chose for it (a re-planned graph), else None.
        roles: the output roles of its previous compile (a re-planned graph), kept when
            AOTAutograd gives no output metadata (``graph_compile``).
    """

    info: CompileInfo
    gm: fx.GraphModule
    example_inputs: tuple[Any, ...]
    forced: schedules.Schedule | Partition | None = None
    roles: tuple[tuple[int | None, ...], tuple[int | None, ...]] = ((), ())

    @property
    def graph_id(self) -> str:
        """Dynamo's id of this graph (``"0/1"``: frame 0, graph 1)."""
        return self.info.graph_id


@dataclasses.dataclass(frozen=True)
class Planned:
    """A graph planned and rewritten inside AOTAutograd's partition.

    Attributes:
        captured: the Captured state it was planned from.
        joint: the JointGraph of AOTAutograd's joint graph (fake example values).
        mutations: its input-mutation epilogue, ``(primal, new value)`` node names.
        stack: its layer stack (no layers: a graph outside the stack).
        allocator: ``"cuda"`` when a primal is on a CUDA device, else ``"cpu"``.
        step: the RewrittenStep (sizes symbolic where the graph's are).
        param_indices: the primals with a static lifetime (parameters, buffers).
        symbols: where each shape symbol is read at run time (``symbol_sources``).
        hints: each shape symbol's compile-time example value (``shape_hints``).
        report: the GraphReport (sizes at the compile-time example).
        op_plan: the op-level optimum planned for it alone, else None.
    """

    captured: Captured
    joint: JointGraph
    mutations: tuple[tuple[str, str], ...]
    stack: LayerStack
    allocator: str
    step: RewrittenStep
    param_indices: tuple[int, ...]
    symbols: tuple[tuple[int, int | None, Any], ...]
    hints: dict[Any, int]
    report: GraphReport
    op_plan: OpPlan | None

    @property
    def graph_id(self) -> str:
        """Dynamo's id of this graph."""
        return self.captured.graph_id

    def aot_graphs(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The rewritten forward and backward in AOTAutograd's calling convention
        (``graph_transforms.aot_graphs``), every node tagged with its layer
        (``meta["remat_layer"]``, for Inductor's fusion choices)."""
        fw, bw = aot_graphs(self.step, self.mutations)
        for gm in (fw, bw):
            for n in gm.graph.nodes:
                n.meta["remat_layer"] = self.step.layer_of.get(n.name)
        return fw, bw


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A graph compiled rewritten.

    Attributes:
        planned: its Planned state.
        run: the callable AOTAutograd (or Inductor) made of it.
        output_joint: per output the caller receives, the forward output holding its
            storage (``graph_transforms.output_roles``).
        output_tangent: per output, its tangent in the backward (None: none).
        code: Inductor's code of it (``compiler="inductor"``), else None.
    """

    planned: Planned
    run: Callable[..., Any]
    output_joint: tuple[int | None, ...]
    output_tangent: tuple[int | None, ...]
    code: InductorCode | None = None

    @property
    def graph_id(self) -> str:
        """Dynamo's id of this graph."""
        return self.planned.graph_id


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A compiled graph that ran in a recorded step, with its liveness.

    Attributes:
        compiled: its Compiled state.
        liveness: its GraphLiveness by model (``"fx"``: from the fx graphs, sizes
            symbolic where the graph's are; ``"inductor"``: from Inductor's code, once
            both its forward and backward code are captured). Never modified: ``record``
            returns a new state with a new dict.
    """

    compiled: Compiled
    liveness: dict[str, GraphLiveness]

    @property
    def graph_id(self) -> str:
        """Dynamo's id of this graph."""
        return self.compiled.graph_id

    @property
    def planned(self) -> Planned:
        """Its Planned state."""
        return self.compiled.planned

    @property
    def run(self) -> Callable[..., Any]:
        """The callable compiled."""
        return self.compiled.run


@dataclasses.dataclass(frozen=True)
class Plain:
    """A training graph compiled without this pass (AOTAutograd's or Inductor's own
    partition), because of ``reason`` (``on_error="fallback"``)."""

    captured: Captured
    run: Callable[..., Any]
    reason: str

    @property
    def graph_id(self) -> str:
        """Dynamo's id of this graph."""
        return self.captured.graph_id


@dataclasses.dataclass(frozen=True)
class Inference:
    """A graph compiled with no backward (no partition ran: an ``eval()`` / ``no_grad``
    graph, or one with no input that requires grad); not rewritten, not recorded."""

    captured: Captured
    run: Callable[..., Any]

    @property
    def graph_id(self) -> str:
        """Dynamo's id of this graph."""
        return self.captured.graph_id


GraphState = Union[Compiled, Recorded, Plain]
"""The state of a training graph between steps."""


def capture(gm: fx.GraphModule, example_inputs: Sequence[Any], graph_id: str, frame: int | None,
            seen_break: bool) -> Captured:
    """The Captured state of the Dynamo graph ``gm`` (``graph_id``, ``frame``: its compile
    id; ``seen_break``: an earlier graph ended at a graph break); ``compile_info``."""
    return Captured(compile_info(gm, graph_id, frame, seen_break), gm, stand_ins(example_inputs))


def plan(captured: Captured, joint_gm: fx.GraphModule, num_fwd_outputs: int, static: tuple[int, ...],
         scheduler: GraphScheduler, earlier: Sequence[GraphReport]) -> Planned:
    """Captured -> Planned: AOTAutograd's joint graph of ``captured`` read
    (``dynamo_joint``), its layer stack found, its schedule chosen and the joint
    rewritten (``rewrite.rewrite``), its peak predicted (``graph.graph_report``).

    Args:
        captured: the graph being compiled.
        joint_gm: AOTAutograd's joint graph (``primals_*`` then ``tangents_*``).
        num_fwd_outputs: forward outputs among the joint's outputs.
        static: the primals with a static lifetime (parameters; used for labels).
        scheduler: the backend's GraphScheduler (its options, memory models).
        earlier: the GraphReports of the graphs compiled before, in compile order (the
            stack an earlier graph found, the schedule a symbolic graph follows).

    Schedule: the one the step plan forced (``captured.forced``), else with
    ``granularity="op"`` the op-level one (``GraphScheduler.op_level``), else with
    ``schedule="optimized"`` the least recompute under ``budget_bytes``
    (``GraphScheduler.optimized``), else the option's Megatron-LM schedule; a graph
    with no layer gets ``none``.

    Raises:
        InvalidSchedule: K / N outside the range of the graph's layer stack.
        InfeasibleBudget: ``optimized`` and no schedule fits the budget (a graph that
            holds the whole step; otherwise decided after the first step).
        UnsupportedGraph: RNG functionalization is on (seed / offset placeholders), or
            the joint mutates a value in place.
    """
    start = time.perf_counter()
    info, options = captured.info, scheduler.options
    joint, mutations = dynamo_joint(joint_gm, num_fwd_outputs, static, info.labels, info.graph_id)
    stack = graph_layer_stack(joint, info, options, earlier)
    devices = {v.device.type for v in joint.primal_values if isinstance(v, torch.Tensor)}
    allocator = "cuda" if "cuda" in devices else "cpu"
    op_plan = None
    if captured.forced is not None:
        sched = captured.forced
    elif options.op_level and stack.num_layers:
        sched, op_plan = scheduler.op_level(joint, stack, allocator, info.graph_id, info.partial)
    elif options.schedule == "optimized" and stack.num_layers:
        sched = scheduler.optimized(joint, stack, info.graph_id, info.frame_id, info.partial, allocator, earlier)
    else:
        sched = options.make_schedule(stack.layers_per_stack if stack.stack_spans else stack.num_layers)
    step = rewrite(joint, stack, sched, in_place=scheduler.in_place)
    report = graph_report(info, step, stack, joint, num_fwd_outputs, allocator, scheduler,
                          time.perf_counter() - start)
    return Planned(captured, joint, tuple(mutations), stack, allocator, step, static,
                   symbol_sources(joint.primal_values), shape_hints(joint), report, op_plan)


def replan(state: Compiled | Recorded, schedule: schedules.Schedule | Partition) -> Captured:
    """Compiled | Recorded -> Captured: the graph to compile again with the step plan's
    ``schedule`` forced (its output roles kept for a compile that gives none)."""
    compiled = state.compiled if isinstance(state, Recorded) else state
    return dataclasses.replace(compiled.planned.captured, forced=schedule,
                               roles=(compiled.output_joint, compiled.output_tangent))


def liveness_model(state: Compiled | Recorded, options: BackendOptions) -> str:
    """Which liveness a step composes for the graph: ``"inductor"`` (its generated
    code) when it runs under Inductor and its backward code is captured, else ``"fx"``."""
    compiled = state.compiled if isinstance(state, Recorded) else state
    code = compiled.code
    return "inductor" if options.compiler == "inductor" and code is not None and code.backward is not None else "fx"


def record(state: Compiled | Recorded, scheduler: GraphScheduler) -> Recorded:
    """Compiled | Recorded -> Recorded: the graph with the liveness its step composes
    (``liveness_model``) read: from the fx graphs (``step_liveness``) and, under
    Inductor once the backward's code is captured, from Inductor's code
    (``inductor_memory.code_liveness``). A Recorded graph that has it is returned as
    it is."""
    model = liveness_model(state, scheduler.options)
    if isinstance(state, Recorded):
        if model in state.liveness:
            return state
        compiled, liveness = state.compiled, dict(state.liveness)
    else:
        compiled, liveness = state, {}
    p = compiled.planned
    fx_model = liveness.get("fx") or step_liveness(p, p.step, scheduler)
    liveness["fx"] = fx_model
    if p.captured.info.made_inputs and not fx_model.made_inputs:
        made = tuple((i, _storage_size(p.joint.primal_values[i], p.allocator)) for i in p.captured.info.made_inputs)
        fx_model = dataclasses.replace(fx_model, made_inputs=made)
        liveness["fx"] = fx_model
    if model == "inductor":
        step = p.step
        dtypes = {n.name: n.meta["val"].dtype for gm in (step.forward, step.backward) for n in gm.graph.nodes
                  if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
        liveness["inductor"] = code_liveness(
            p.graph_id, compiled.code.forward, compiled.code.backward, step.num_fwd_outputs,
            fx_model.tangent_nbytes, dtypes, {str(sym): sym for sym in p.hints}, len(p.joint.primals))
        liveness["inductor"] = dataclasses.replace(liveness["inductor"], made_inputs=fx_model.made_inputs)
    return Recorded(compiled, liveness)


def step_liveness(planned: Planned, step: RewrittenStep, scheduler: GraphScheduler) -> GraphLiveness:
    """The GraphLiveness of ``step``, a rewrite of the planned graph (its own, or a step
    planner's candidate), from its fx graphs; sizes symbolic where the graph's are
    (``symbolic_size``). Op scratch as the per-graph reports count it: calibrated where
    the sizes are concrete; a node with symbolic sizes falls back to the memory model's
    rule."""
    memory = scheduler.memory_model(concrete_step(step)[0], planned.allocator)

    def scratch_of(n: fx.Node) -> Any:
        m = memory.node_memory(n)
        return symbolic_size(0 if m is None else m.scratch_bytes)

    return graph_liveness(planned.graph_id, step,
                          lambda v: symbolic_size(_storage_size(v, planned.allocator)), scratch_of)


def _storage_size(val: torch.Tensor, allocator: str) -> Any:
    """Bytes of ``val``'s storage (a SymInt under dynamic shapes), rounded as the CUDA
    allocator does for ``allocator="cuda"`` when concrete."""
    n = storage_nbytes(val)
    return storage_bytes(val, allocator) if isinstance(n, int) else n
