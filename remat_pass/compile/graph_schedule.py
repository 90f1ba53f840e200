"""How the torch.compile backend chooses one compiled graph's schedule.

``GraphScheduler`` holds the backend's options and its op-scratch calibrator and gives,
for one graph Dynamo captured: the memory model of a concrete step (calibrated on this
CPU, else the formula table), the predicted report of a schedule, the optimized
schedule under ``budget_bytes`` (``planner.Planner``), and the op-level Partition
(``op_planner.OpPlanner``, or a module-kind / save policy) with the planner and its
choice (``OpPlan``, which the step's re-planning, ``step_planning``, starts from).
This module sees one graph; ``graph_state.plan`` keeps its answer in the graph's state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.fx as fx

from ..recompute import schedule as schedules
from .options import BackendOptions
from ..memory.calibration import Calibrator
from .compiled_graphs import GraphReport
from ..errors import InfeasibleBudget, UnsupportedGraph
from ..liveness.symbolic_sizes import concrete_step, is_symbolic_tensor
from ..liveness.timeline import MemoryReport, analyze
from ..memory.memory_model import MemoryModel
from solvers import Solution, model_peak

from ..plan.op_planner import CostModel, OpPlanner
from ..recompute.partition import Partition
from ..plan.planner import Planner
from ..recompute.policies import recompute_modules, save_policy
from ..graph.regions import LayerStack
from ..recompute.rewrite import rewrite
from ..graph.trace import JointGraph


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """A graph's op-level optimum as planned alone: its planner (calibrated on the graph)
    and the chain-model Solution chosen (groups, per-layer options)."""

    planner: OpPlanner
    solution: Solution


class GraphScheduler:
    """The schedule of one compiled graph under the backend's options (see the module
    docstring); the calibrator is made on first use and kept for every graph (a cache,
    the one state the scheduler holds)."""

    def __init__(self, options: BackendOptions):
        self.options = options
        self._calibrator: Calibrator | None = None

    @property
    def in_place(self) -> bool:
        """Whether graphs are rewritten with in-place reuse (``rewrite.rewrite``): not
        under ``compiler="inductor"``, which takes functional graphs and reinplaces them
        by its own rules (its scheduler fails on the in-place ops of a rewritten graph)."""
        return self.options.compiler != "inductor"

    def memory_model(self, step: Any, allocator: str) -> MemoryModel:
        """The memory model of a concrete step: op scratch calibrated on this CPU
        (``calibrate`` option; the table for a CUDA allocator), else the table only."""
        if not self.options.calibrate or allocator != "cpu":
            return MemoryModel.table_only(allocator)
        if self._calibrator is None:
            self._calibrator = Calibrator()
        return self._calibrator.memory_model([step], allocator)

    def eager_memory_model(self, nodes: Sequence[fx.Node], allocator: str) -> MemoryModel:
        """The memory model of the eager ops of a step (``eager_recorder``): as
        ``memory_model``, for their recorded op nodes."""
        if not self.options.calibrate or allocator != "cpu":
            return MemoryModel.table_only(allocator)
        if self._calibrator is None:
            self._calibrator = Calibrator()
        return self._calibrator.memory_model_of(nodes, allocator)

    def predict(self, joint: JointGraph, stack: LayerStack, schedule: schedules.Schedule | Partition,
                allocator: str) -> MemoryReport:
        """The predicted report of ``schedule`` on the graph at its example sizes."""
        concrete = concrete_step(rewrite(joint, stack, schedule, in_place=self.in_place))[0]
        return analyze(concrete, memory=self.memory_model(concrete, allocator))

    def optimized(self, joint: JointGraph, stack: LayerStack, graph_id: str, frame_id: Any, partial: bool,
                  allocator: str, earlier: Sequence[GraphReport]) -> schedules.Schedule:
        """The least-recompute schedule whose predicted peak fits ``budget_bytes``
        (``planner.Planner`` on this graph: chain-model solve, checked by liveness).

        A graph with symbolic sizes reuses the groups chosen for the latest concrete
        graph of its frame (``earlier``: the reports so far) with the same number of
        layers. A graph that may be part of a step of several graphs (``partial``)
        whose least feasible peak is above the budget gets its least feasible
        schedule: the step decides after its first run (the graph's own peak is not
        the step's), and so does every graph under ``compiler="inductor"`` (its
        peak is read from Inductor's code after the first step, often below the fx
        graph's).

        Raises:
            InfeasibleBudget: the budget is below the least feasible peak of a graph
                that holds the whole step (not under Inductor).
            UnsupportedGraph: a symbolic graph with no earlier concrete graph to follow.
        """
        symbolic = any(is_symbolic_tensor(n.meta.get("val")) for n in joint.gm.graph.nodes)
        if symbolic:
            for r in reversed(earlier):
                s = r.step.schedule
                if r.frame_id == frame_id and not r.symbolic and s.num_layers == stack.num_layers:
                    return s
            raise UnsupportedGraph(
                f"graph {graph_id}: schedule='optimized' solves on concrete sizes and "
                "this graph's are symbolic with no earlier concrete graph of its frame; "
                "compile with dynamic=False (torch.compile(..., dynamic=False))"
            )
        planner = Planner(joint, stack, lambda s: self.predict(joint, stack, s, allocator))
        try:
            return planner.plan(int(self.options.budget_bytes)).schedule
        except InfeasibleBudget:
            if not (partial or self.options.compiler == "inductor"):
                raise
            return planner.least_feasible()[0]

    def op_level(self, joint: JointGraph, stack: LayerStack, allocator: str, graph_id: str,
                 partial: bool = False) -> tuple[Partition, OpPlan | None]:
        """The op-level Partition of this graph: the op-level optimum under
        ``budget_bytes`` (``op_planner.OpPlanner``, concrete sizes only; returned with
        its OpPlan), or the recompute modules / save policy in the layers the schedule
        stores (no OpPlan). A graph that may be part of a step of several graphs
        (``partial``) whose least feasible peak is above the budget gets its least
        feasible choice: the step decides after its first run (every graph under
        ``compiler="inductor"``: its code is read after the first step).

        Raises:
            InfeasibleBudget: the budget is below the least feasible peak of a graph
                that holds the whole step (not under Inductor).
            UnsupportedGraph: the op-level optimum of a graph with symbolic sizes.
            InvalidSchedule: a module kind the graph's layers do not have, or a name
                of a save policy that is not in the graph.
        """
        o = self.options
        if o.schedule == "optimized":
            if any(is_symbolic_tensor(n.meta.get("val")) for n in joint.gm.graph.nodes):
                raise UnsupportedGraph(
                    f"graph {graph_id}: the op-level optimum solves on concrete sizes and this graph's "
                    "are symbolic; compile with dynamic=False (torch.compile(..., dynamic=False))")
            planner = OpPlanner(joint, stack, lambda p: self.predict(joint, stack, p, allocator),
                                CostModel(o.flops_per_byte), allocator)
            try:
                plan = planner.plan(int(o.budget_bytes))
                solution = model_peak(planner.costs, plan.groups, plan.options)
            except InfeasibleBudget:
                if not (partial or o.compiler == "inductor"):
                    raise
                solution = planner.least_feasible().solution
            return planner.partition(solution), OpPlan(planner, solution)
        groups = o.make_schedule(stack.num_layers)
        if o.recompute_modules:
            return recompute_modules(joint, stack, o.recompute_modules, dict(o.module_names), groups), None
        return save_policy(joint, stack, o.policy, o.policy_names, groups), None
