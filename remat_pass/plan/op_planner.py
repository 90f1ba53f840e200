"""The op-level optimum under a peak budget: per layer, which values are saved and which
are recomputed, combined with whole-layer recompute groups, checked by liveness.

1. Layer kinds: layers whose forward ops match node for node (same ops, shapes, reads)
   are one kind; each kind is solved once.
2. Per kind, ``solvers.oplevel.solve_layer_front`` gives every Pareto-optimal (saved
   bytes, recompute cost) decision of a layer (integer programs, HiGHS), exactly unless
   a time bound (``SolveLimits``) stops it, which the plan then says (``OpPlan.bound``)
   with its proven gap.
3. Each decision becomes a chain-model option (``solvers.StoredOption``), calibrated by
   liveness: the step with every layer of the kind taking it is rewritten and profiled
   (``symbolic.profile_step``), and the layer's saved bytes and forward / backward peaks
   above the bytes saved below it are read off, as ``chain_calibration.chain_costs`` does
   for stored layers and groups.
4. The chain solver (``solvers.least_recompute``) picks, exactly in its model, the
   groups and every stored layer's option of least recompute cost whose peak fits; the
   answer is built (``partition.op_level_partition``), rewritten and analysed by
   liveness, and solved again with a tighter model budget while the analysed peak
   exceeds the budget (``solvers.resolve``): the planner skeleton every level shares
   (``planner.ChainPlanner``; the layer level is the same with no options). So the
   returned plan's predicted peak always fits; a budget below the least feasible peak
   is ``InfeasibleBudget``.

Cost model (``CostModel``): a recomputed op costs ``max(FLOPs, flops_per_byte * bytes
moved)``, the roofline (Williams et al. 2009) with the machine balance
``flops_per_byte`` (FLOP/s over memory bytes/s; 8 by default, about a CPU core's):
FLOPs for compute-bound ops (``costs.node_flops``: matmuls, attention), bytes read and
written for memory-bound ones (``costs.bytes_moved``: pointwise ops, norms, copies);
views cost nothing. ``CostModel(timed=True)`` instead times every forward op on the
machine (``time_forward_ops``: nanoseconds, median of a few runs). Groups are costed
the same way (their recomputed nodes). Reported figures are FLOPs and bytes moved,
separately.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import statistics
import time
from typing import Any, Callable, Hashable

import torch
import torch.fx as fx

from solvers import ChainCosts, CheckedPlan, Solution, StoredOption, least_feasible_peak
from solvers.resolve import lowest_front
from solvers.front_pool import solve_layer_fronts
from solvers.oplevel import (External, LayerDecision, LayerFront, LayerGraph, SolveLimits, Unit, Value,
                             spread_order)

from ..recompute import schedule as schedules
from ..graph.layer_alike import alike_key, node_evidence
from ..graph.costs import RNG_STATE_BYTES, bytes_moved, is_random, node_flops, same_storage, tensor_val
from ..errors import InvalidSchedule
from ..liveness.intervals import storage_bytes
from ..liveness.timeline import MemoryReport
from ..recompute.partition import OpLevelChoice, Partition, op_level_partition
from ..graph.regions import LayerStack
from ..recompute.rewrite import rewrite
from ..liveness.symbolic import SymbolicModel, profile_step
from ..liveness.symbolic_sizes import SizeConverter
from .chain_calibration import chain_costs, layer_terms
from .planner import ChainAnswer, ChainPlanner
from ..graph.trace import JointGraph

POLICY = "op_optimal"


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The recompute cost of one op, an integer (see the module docstring).

    Attributes:
        flops_per_byte: the machine balance of the roofline (FLOPs per byte moved).
        timed: use measured nanoseconds instead (``time_forward_ops``).
    """

    flops_per_byte: int = 8
    timed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.flops_per_byte, int) or self.flops_per_byte < 0:
            raise InvalidSchedule(f"flops_per_byte must be an integer >= 0, got {self.flops_per_byte!r}")


def roofline_cost(node: fx.Node, flops_per_byte: int) -> int:
    """``max(FLOPs, flops_per_byte * bytes moved)`` of one node (0 for non-ops)."""
    return max(int(node_flops(node)), flops_per_byte * bytes_moved(node))


def time_forward_ops(joint: JointGraph, stack: LayerStack, repeats: int = 3) -> dict[str, int]:
    """Nanoseconds each forward op takes on this machine: the forward nodes run one by
    one on the real example values, ``repeats`` times after a warm-up, the median kept.
    The RNG state is restored afterwards.

    Raises:
        InvalidSchedule: the step has no real values (a graph Dynamo captured).
    """
    if joint.model is None:
        raise InvalidSchedule("timing ops needs the real example values; this graph has only fake ones")
    forward = set(stack.forward_nodes)
    nodes = [n for n in joint.gm.graph.nodes if n.name in forward]
    samples: dict[str, list[int]] = {n.name: [] for n in nodes if n.op == "call_function"}
    with torch.random.fork_rng(), torch.no_grad():
        for run in range(repeats + 1):
            env: dict[fx.Node, Any] = {}
            primal = iter(joint.primal_values)
            for n in nodes:
                if n.op == "placeholder":
                    env[n] = next(primal)
                elif n.op == "get_attr":
                    env[n] = functools.reduce(getattr, n.target.split("."), joint.gm)
                else:
                    args = fx.node.map_arg(n.args, env.__getitem__)
                    kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
                    t0 = time.perf_counter_ns()
                    env[n] = n.target(*args, **kwargs)
                    if run:
                        samples[n.name].append(time.perf_counter_ns() - t0)
    return {name: int(statistics.median(ts)) for name, ts in samples.items()}


# --------------------------------------------------------------------------- layer kinds


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """Layers whose forward ops match node for node, solved once.

    Attributes:
        layers: the layers of this kind.
        nodes: per layer, its computed forward nodes in graph order (they correspond
            by position across the kind's layers).
        units: per unit of ``graph``, the positions of its nodes.
        graph: the integer program's view of the first layer (``solvers.oplevel``).
    """

    layers: tuple[int, ...]
    nodes: tuple[tuple[str, ...], ...]
    units: tuple[tuple[int, ...], ...]
    graph: LayerGraph

    def recomputable_in(self, layer: int, decision: LayerDecision) -> set[str]:
        """The joint node names ``decision`` recomputes in ``layer`` (one of the kind's)."""
        names = self.nodes[self.layers.index(layer)]
        return {names[p] for u in decision.recomputed for p in self.units[u]}


class _Reads:
    """Who reads each forward value in backward, per layer."""

    def __init__(self, joint: JointGraph, stack: LayerStack):
        forward = set(stack.forward_nodes)
        self.by: dict[fx.Node, set[int | None]] = {}
        for b in joint.gm.graph.nodes:
            if b.name in forward or b.op != "call_function":
                continue
            for a in b.all_input_nodes:
                if a.name in forward:
                    self.by.setdefault(a, set()).add(stack.layer_of.get(b.name))


def _signature(nodes: list[fx.Node], reads: _Reads, layer: int) -> Hashable:
    """What must match for two layers to be one kind, by the one rule of
    ``graph.layer_alike``: the ``alike_key`` of the layer's ``node_evidence`` (its
    computed forward nodes, node for node; equal keys: alike layers)."""
    return alike_key(node_evidence(nodes, reads.by, layer))


def layer_kinds(joint: JointGraph, stack: LayerStack, cost_of: Callable[[fx.Node], int],
                allocator: str = "cpu") -> list[LayerKind]:
    """Group the stack's layers into kinds and build each kind's ``LayerGraph``."""
    forward = set(stack.forward_nodes)
    per_layer: dict[int, list[fx.Node]] = {}
    for n in joint.gm.graph.nodes:
        layer = stack.layer_of.get(n.name)
        if n.name in forward and n.op == "call_function" and layer is not None:
            per_layer.setdefault(layer, []).append(n)
    reads = _Reads(joint, stack)
    by_signature: dict[tuple, list[int]] = {}
    for layer in sorted(per_layer):
        by_signature.setdefault(_signature(per_layer[layer], reads, layer), []).append(layer)
    kinds = []
    for layers in by_signature.values():
        graph, units = _layer_graph(per_layer[layers[0]], layers[0], reads, cost_of, joint, allocator)
        kinds.append(LayerKind(tuple(layers), tuple(tuple(n.name for n in per_layer[i]) for i in layers),
                               units, graph))
    return kinds


def _layer_graph(nodes: list[fx.Node], layer: int, reads: _Reads, cost_of: Callable[[fx.Node], int],
                 joint: JointGraph, allocator: str) -> tuple[LayerGraph, tuple[tuple[int, ...], ...]]:
    """The integer program's view of one layer: units (an op and its getitems), values
    (tensors), storages (views share one; views of a primal or of a kept outside value
    cost nothing) and the outside values its ops read."""
    position = {n: i for i, n in enumerate(nodes)}
    unit_of: dict[fx.Node, int] = {}
    members: list[list[fx.Node]] = []
    for n in nodes:
        owner = n.args[0] if n.target is operator.getitem and n.args[0] in position else None
        if owner is not None:
            unit_of[n] = unit_of[owner]
            members[unit_of[n]].append(n)
        else:
            unit_of[n] = len(members)
            members.append([n])
    value_of: dict[fx.Node, int] = {}
    values: list[Value] = []
    storage_of: dict[Any, int] = {}  # an inside value, or ("outside", node)
    sizes: list[int] = []
    externals: dict[fx.Node, int] = {}
    ext_list: list[External] = []
    for n in nodes:
        val = tensor_val(n)
        if val is None:
            continue
        owner = members[unit_of[n]][0]
        candidates = list(n.all_input_nodes) + (list(owner.all_input_nodes) if owner is not n else [])
        base = next((a for a in candidates if tensor_val(a) is not None and same_storage(val, tensor_val(a))), None)
        if base is not None and base in value_of:
            storage = values[value_of[base]].storage
        elif base is not None:  # a view of an outside value: holding it holds that value
            key = ("outside", base)
            if key not in storage_of:
                kept = base.op != "call_function" or base in reads.by
                storage_of[key] = len(sizes)
                sizes.append(0 if kept else storage_bytes(tensor_val(base), allocator))
            storage = storage_of[key]
        else:
            storage = len(sizes)
            sizes.append(storage_bytes(val, allocator))
        reader_layers = reads.by.get(n, set())
        values.append(Value(storage, read_by_backward=layer in reader_layers,
                            must_save=bool(reader_layers - {layer})))
        value_of[n] = len(values) - 1
    units = []
    for group in members:
        inputs, exts = set(), set()
        for n in group:
            for a in n.all_input_nodes:
                if a in position and unit_of[a] != unit_of[n]:
                    if a in value_of:
                        inputs.add(value_of[a])
                elif a not in position and a.op == "call_function":
                    if a not in externals:
                        kept = a in reads.by or tensor_val(a) is None
                        externals[a] = len(ext_list)
                        ext_list.append(External(0 if kept else storage_bytes(tensor_val(a), allocator), kept))
                    exts.add(externals[a])
        op = group[0]
        units.append(Unit(tuple(value_of[n] for n in group if n in value_of), tuple(sorted(inputs)),
                          tuple(sorted(exts)), cost=cost_of(op), random=is_random(op)))
    device = next((v.device.type for v in joint.primal_values if isinstance(v, torch.Tensor)), "cpu")
    graph = LayerGraph(tuple(units), tuple(values), tuple(sizes), tuple(ext_list),
                       rng_state_bytes=RNG_STATE_BYTES.get(device, 16))
    return graph, tuple(tuple(position[n] for n in group) for group in members)



# --------------------------------------------------------------------------- the planner


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """The op-level optimum for one peak budget, predicted and checked.

    Attributes:
        budget_bytes: the peak budget asked for.
        partition: the chosen Partition (``policy`` ``op_optimal``; its schedule holds
            the whole-layer groups), or for a stack analysed from a template
            (``op_reuse``) its ``OpDecision`` (groups and options, no node names).
        options: per layer, the chain option chosen (0: every value saved; k: the k-th
            point of its kind's trade-off); empty when all 0.
        model_peak_bytes: the chain model's peak of the choice.
        predicted_peak_bytes: liveness peak of the rewritten step.
        recompute_cost: the chain model's recompute cost (the cost model's unit).
        recompute_flops, recompute_bytes_moved: of the recomputed nodes (liveness step).
        forward_flops: FLOPs of the forward graph.
        saved_nodes, recomputed_nodes: how many values are saved / nodes recomputed.
        least_feasible_peak_bytes: least liveness peak the planner reaches.
        unconstrained_peak_bytes: liveness peak with every value saved.
        solve_time_s: seconds in the solver and its checks for this budget.
        resolves: how often the model budget was tightened by the liveness check.
        bound: what stopped the search short of the exact optimum (``OpPlanner.bound_note``);
            None when nothing did.
        gap_cost: the largest proven gap of a layer trade-off point (cost units).
    """

    budget_bytes: int
    partition: Any
    options: tuple[int, ...]
    model_peak_bytes: int
    predicted_peak_bytes: int
    recompute_cost: int
    recompute_flops: int
    recompute_bytes_moved: int
    forward_flops: int
    saved_nodes: int
    recomputed_nodes: int
    least_feasible_peak_bytes: int
    unconstrained_peak_bytes: int
    solve_time_s: float
    resolves: int
    bound: str | None = None
    gap_cost: int = 0

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The whole-layer recompute groups."""
        return self.partition.schedule.groups if self.partition.schedule is not None else ()


class OpPlanner(ChainPlanner[Partition, OpPlan]):
    """The op level: the op-level optimum of one traced step, checked with liveness
    (``planner.ChainPlanner`` with each layer's trade-off points as chain options; its
    decisions are Partitions, ``partition``). ``plan_many`` compares the chain model's
    recompute cost.

    Args:
        joint, stack: the traced step (concrete shapes) and its layer stack.
        predict: ``predict(partition) -> MemoryReport`` of the rewritten step (e.g.
            ``sweep.Session.report``).
        cost_model: how a recomputed op is costed (``CostModel``).
        allocator: ``cpu`` or ``cuda`` sizes for the layer programs.
        limits: the time bounds of each kind's integer programs and front
            (``solvers.oplevel.SolveLimits``; default its defaults).
        calibrate_layers: the layers whose terms calibrate the points (None: all).

    Attributes:
        kinds: the layer kinds; fronts: each kind's trade-off points;
            layer_fronts: how each was found (``solvers.oplevel.LayerFront``: its proven
            gap, whether a bound cut it).
        costs: the chain model with one option per trade-off point.
        unconstrained_peak_bytes: liveness peak with every value saved.
        prepare_s: seconds spent building all of it.
    """

    def __init__(self, joint: JointGraph, stack: LayerStack, predict: Callable[[Partition], MemoryReport],
                 cost_model: CostModel = CostModel(), allocator: str = "cpu", limits: SolveLimits | None = None,
                 calibrate_layers: frozenset[int] | None = None):
        t0 = time.perf_counter()
        self.calibrate_layers = calibrate_layers
        self.joint, self.stack, self.cost_model = joint, stack, cost_model
        timed = time_forward_ops(joint, stack) if cost_model.timed else None
        self.cost_of: Callable[[fx.Node], int] = (
            (lambda n: timed.get(n.name.removesuffix("_recompute"), 0)) if timed is not None
            else (lambda n: roofline_cost(n, cost_model.flops_per_byte)))
        self.kinds = layer_kinds(joint, stack, self.cost_of, allocator)
        self.limits = limits if limits is not None else SolveLimits()
        self.layer_fronts: list[LayerFront] = solve_layer_fronts([k.graph for k in self.kinds], self.limits)
        self.fronts = [list(f.points) for f in self.layer_fronts]
        self.kind_of = {layer: i for i, k in enumerate(self.kinds) for layer in k.layers}
        self.model = SymbolicModel.from_joint(joint, stack)
        self._conv = SizeConverter(self.model.joint)
        super().__init__(self._chain_costs(), self.partition, predict)
        self.name_schedules(stack.layers_per_stack)
        # the layer level's lowest answers (whole layers only), so the op level's least
        # is never above the layer level's
        whole = dataclasses.replace(self.costs, stored_options=())
        low = least_feasible_peak(whole)
        self.named_groups += tuple(s.groups for s in [low, *lowest_front(whole, low, 3)])
        self.unconstrained_peak_bytes = self.solution_report(Solution((), 0, 0)).peak_bytes
        self.prepare_s = time.perf_counter() - t0

    # -- the chain model with options
    def _step_costs(self, decision: Partition | schedules.Schedule) -> tuple[dict, dict, dict, dict]:
        """Per layer: saved bytes, forward and backward peaks above the bytes saved by
        the layers below, and recompute cost, of the step rewritten by ``decision``."""
        step = rewrite(self.model.joint, self.stack, decision)
        L = self.stack.num_layers
        cost = {i: 0 for i in range(L)}
        for n in step.backward.graph.nodes:
            if step.kind_of.get(n.name) == "recompute" and step.layer_of.get(n.name) is not None:
                cost[step.layer_of[n.name]] += self.cost_of(n)
        return (*layer_terms(profile_step(step, self._conv), L), cost)

    def _chain_costs(self) -> ChainCosts:
        """``chain_calibration.chain_costs`` with group costs in the cost model's unit and
        each layer's options, calibrated by liveness.

        A layer's option changes its own terms (saved bytes, forward and backward peaks
        above the layers below, recompute cost) by the same amount in every layer of
        its kind, so one profile measures as many points as the kind has layers: in
        profile r, the kind's j-th layer takes the ``r * m + j``-th point of
        ``solvers.oplevel.spread_order`` (m layers; past the end it wraps around), and
        each point's change from storing the layer whole (``none``) is added to every
        layer's own ``none`` terms. With ``calibrate_layers`` only those layers take
        points (the others stay stored): a template's interior layers (``op_reuse``). Past ``limits.calibrate_time_s`` the profiles stop
        and the points not calibrated are left out of ``fronts`` (``calibrated_points``).
        """
        L, per_stack = self.stack.num_layers, self.stack.layers_per_stack
        base = chain_costs(self.model)
        last = self._step_costs(schedules.uniform(1, per_stack))[3]
        member = self._step_costs(schedules.uniform(max(per_stack), per_stack))[3]
        stored = self._step_costs(schedules.none(per_stack))
        change: list[dict[int, tuple[int, int, int, int]]] = [{} for _ in self.kinds]
        measured = [tuple(i for i in k.layers if self.calibrate_layers is None or i in self.calibrate_layers) or k.layers
                    for k in self.kinds]
        rounds = max(-(-len(f) // len(m)) for m, f in zip(measured, self.fronts) if f) if any(self.fronts) else 0
        order = [spread_order(len(f)) for f in self.fronts]
        t0 = time.perf_counter()
        for r in range(rounds):
            if r and time.perf_counter() - t0 > self.limits.calibrate_time_s:
                break
            names: set[str] = set()
            point_of: dict[int, int] = {}
            for ki, (kind, front) in enumerate(zip(self.kinds, self.fronts)):
                for j, layer in enumerate(measured[ki]):
                    if front:
                        point_of[layer] = order[ki][(r * len(measured[ki]) + j) % len(front)]
                        names |= kind.recomputable_in(layer, front[point_of[layer]])
            terms = self._step_costs(op_level_partition(
                self.model.joint, self.stack, OpLevelChoice(POLICY, frozenset(names))))
            for layer, t in point_of.items():
                change[self.kind_of[layer]].setdefault(t, tuple(terms[f][layer] - stored[f][layer] for f in range(4)))
        kept = [sorted(c) for c in change]
        self.option_change = [[c[t] for t in k] for c, k in zip(change, kept)]
        self.calibrated_points = [(len(k), len(f)) for k, f in zip(kept, self.fronts)]
        self.fronts = [[front[t] for t in k] for k, front in zip(kept, self.fronts)]
        options = []
        for i in range(L):
            ki = self.kind_of.get(i)
            if ki is None:  # a layer with no forward op (never called): nothing to trade
                options.append(())
                continue
            options.append(tuple(
                StoredOption(*(stored[f][i] + change[ki][t][f] for f in range(4)), f"{POLICY}[{t}]")
                for t in kept[ki]))
        return dataclasses.replace(
            base, last_recompute_flops=tuple(last[i] for i in range(L)),
            member_recompute_flops=tuple(member[i] if i + 1 < base.stack_end(i) else 0 for i in range(L)),
            stored_options=tuple(options))

    # -- from a chain solution to a Partition, predicted
    def partition(self, sol: Solution) -> Partition:
        """The Partition of a chain-model solution: its groups whole, every stored
        layer with option k > 0 recomputing what its kind's k-th trade-off point does."""
        L = self.stack.num_layers
        names: set[str] = set()
        for layer, option in enumerate(sol.options):
            if option:
                kind = self.kinds[self.kind_of[layer]]
                decision = self.fronts[self.kind_of[layer]][option - 1]
                names |= kind.recomputable_in(layer, decision)
        schedule = schedules.optimized(sol.groups, self.stack.layers_per_stack) if sol.groups else None
        return op_level_partition(self.joint, self.stack, OpLevelChoice(POLICY, frozenset(names)), schedule)

    @property
    def front_gap_cost(self) -> int:
        """The largest proven gap of a trade-off point (cost units; 0: all optimal)."""
        return max((f.gap_cost for f in self.layer_fronts), default=0)

    def bound_note(self) -> str | None:
        """What stopped the search short of the exact optimum, or None when nothing did:
        the kinds whose front a time bound cut, and the proven gap."""
        cut = [k for k, f in zip(self.kinds, self.layer_fronts) if not f.complete]
        uncalibrated = [(k, n) for k, n in zip(self.kinds, self.calibrated_points) if n[0] < n[1]]
        if not cut and not self.front_gap_cost and not uncalibrated:
            return None
        parts = []
        if uncalibrated:
            parts.append(f"calibration stopped after {self.limits.calibrate_time_s:g} s: "
                         + ", ".join(f"layers {list(k.layers)} {a} of {b} trade-off points" for k, (a, b) in uncalibrated))
        if cut:
            parts.append(f"the trade-off of {len(cut)} layer kind(s) (layers "
                         f"{', '.join(str(k.layers[0]) for k in cut)}) was cut by its time bound "
                         f"({self.limits.front_time_s:g} s per kind, {self.limits.fronts_time_s:g} s for "
                         "all kinds; its least-bytes end kept)")
        if self.front_gap_cost:
            parts.append(f"HiGHS stopped at its time limit ({self.limits.program_time_s:g} s per program) "
                         f"with a proven gap of {self.front_gap_cost} cost units")
        return "; ".join(parts)

    def least_feasible(self) -> CheckedPlan:
        """The choice of least liveness peak the planner finds (``solvers.resolve``)."""
        return self.least_feasible_checked()

    def _plan_value(self, answer: ChainAnswer[Partition]) -> OpPlan:
        checked, part, rep = answer.checked, answer.decision, answer.report
        step = rewrite(self.joint, self.stack, part)
        recomputed = [n for n in step.backward.graph.nodes if step.kind_of.get(n.name) == "recompute"]
        return OpPlan(
            budget_bytes=answer.budget_bytes, partition=part, options=checked.options,
            model_peak_bytes=int(checked.model_peak_bytes), predicted_peak_bytes=rep.peak_bytes,
            recompute_cost=int(checked.recompute_flops), recompute_flops=rep.recompute_flops,
            recompute_bytes_moved=sum(bytes_moved(n) for n in recomputed), forward_flops=rep.forward_flops,
            saved_nodes=len(part.saved), recomputed_nodes=len(part.recomputed_names),
            least_feasible_peak_bytes=answer.least.predicted_peak_bytes,
            unconstrained_peak_bytes=self.unconstrained_peak_bytes, solve_time_s=answer.solve_time_s,
            resolves=checked.resolves, bound=self.bound_note(), gap_cost=self.front_gap_cost)

    def _cost(self, plan: OpPlan) -> int:
        return plan.recompute_cost
