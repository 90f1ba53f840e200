"""The op-level optimum of an L-layer stack of alike layers planned from a short
template (``liveness.layer_reuse``), so that a 70B model is planned per op without
tracing its 80 layers.

1. ``op_planner.OpPlanner`` runs on the template (``layer_roles.TEMPLATE_LAYERS``
   layers, the same model): the layer kind, its exact trade-off front (integer
   programs, ``solvers.oplevel``) and each point's change of a layer's chain terms
   (saved bytes, forward and backward peaks above the layers below, recompute cost),
   calibrated by liveness of the template's rewrites. The template's layers must be one
   kind (``UnsupportedGraph`` otherwise: trace all layers).
2. The L-layer chain model is the layer level's (``chain_calibration.chain_costs`` of
   ``ReusedLayersModel``) with every stored layer's options: its own stored terms from
   the reused liveness of ``none`` plus each point's change, as ``OpPlanner`` does on a
   whole trace (the change is a layer's own, the same in every layer of the kind).
3. Every answer is checked by liveness of the L-layer step assembled from template
   rewrites in which a stored layer taking the k-th point has the role ``S<k>``
   (``ReusedLayers`` with ``op_names``), equal to the full rewrite's liveness
   (``tests/plan/test_op_reuse.py`` compares them), and solved again while it is over
   the budget (``planner.ChainPlanner``).

The decision is an ``OpDecision`` (groups and per-layer options): the L-layer
Partition is never built, so node names are not listed (``--trace-all-layers`` lists
them).
"""

from __future__ import annotations

import dataclasses
import time
from solvers import ChainCosts, CheckedPlan, Solution, StoredOption, least_feasible_peak
from solvers.oplevel import SolveLimits
from solvers.resolve import lowest_front

from ..recompute import schedule as schedules
from ..errors import UnsupportedGraph
from ..graph.costs import bytes_moved
from ..liveness.layer_reuse import ReusedLayers, ReusedLayersModel
from ..liveness.layer_roles import block_type
from ..liveness.timeline import MemoryReport, analyze
from ..recompute.rewrite import rewrite
from ..recompute.schedule import Schedule
from .chain_calibration import chain_costs, layer_terms
from .op_planner import POLICY, CostModel, OpPlan, OpPlanner
from .planner import ChainAnswer, ChainPlanner


@dataclasses.dataclass(frozen=True)
class OpDecision:
    """An op-level choice on an L-layer stack analysed from a template.

    Attributes:
        groups: the whole-layer recompute groups.
        options: per layer, 0 (every value saved, or in a group) or k (the k-th point of
            the layer kind's trade-off, ``ReusedOpPlanner.fronts``).
        num_layers: L.
    """

    groups: tuple[tuple[int, ...], ...]
    options: tuple[int, ...]
    num_layers: int
    policy: str = POLICY

    @property
    def schedule(self) -> Schedule | None:
        """The layer-level schedule of the groups (None: no group)."""
        return schedules.optimized(self.groups, self.num_layers) if self.groups else None

    @property
    def layer_schedule(self) -> Schedule:
        """The groups as a Schedule (``none`` when there is no group)."""
        return self.schedule or schedules.none(self.num_layers)

    @property
    def provenance(self) -> str:
        """What it is, for people: ``op_optimal`` on its groups."""
        return f"{POLICY} on {self.layer_schedule.provenance}"


class ReusedOpPlanner(ChainPlanner[OpDecision, OpPlan]):
    """The op level of an L-layer stack from its template (module docstring).

    Args:
        reuse: the stack analysed from a template (``layer_reuse.ReusedLayers``; one
            stack, its template's layers alike).
        cost_model, limits: as ``OpPlanner``.

    Attributes:
        template_planner: the ``OpPlanner`` of the template (its kinds and fronts).
        kinds, fronts, layer_fronts, calibrated_points: the template planner's.
        stack: the template's layer stack; num_layers: L.
        unconstrained_peak_bytes, prepare_s: as ``OpPlanner``.

    Raises:
        UnsupportedGraph: the template's layers are not one kind, or more than one stack.
    """

    def __init__(self, reuse: ReusedLayers, cost_model: CostModel = CostModel(), limits: SolveLimits | None = None):
        t0 = time.perf_counter()
        template, tstack, allocator = reuse.template, reuse.stack, reuse.allocator
        if len(tstack.layers_per_stack) != 1:
            raise UnsupportedGraph("op level from a template needs one layer stack: add --trace-all-layers")
        # points calibrated in the template's interior layers, as most of the L layers are
        interior = frozenset(range(1, tstack.num_layers))
        inner = OpPlanner(template, tstack, lambda p: analyze(rewrite(template, tstack, p), allocator),
                          cost_model, allocator, limits, interior)
        if len(inner.kinds) != 1 or inner.kinds[0].layers != tuple(range(tstack.num_layers)):
            raise UnsupportedGraph(f"the template's layers are {len(inner.kinds)} kinds, not one: "
                                   "op level from a template needs alike layers; add --trace-all-layers")
        self.template_planner = inner
        self.kinds, self.fronts, self.layer_fronts = inner.kinds, inner.fronts, inner.layer_fronts
        self.calibrated_points, self.limits = inner.calibrated_points, inner.limits
        self.stack, self.num_layers = tstack, reuse.num_layers
        kind = inner.kinds[0]
        self.reuse = ReusedLayers(template, tstack, reuse.num_layers, allocator,
                                  op_names=lambda j, k: frozenset(kind.recomputable_in(j, inner.fronts[0][k - 1])))
        super().__init__(self._chain_costs(ReusedLayersModel.create(reuse)), self._decision, self.report)
        self.name_schedules((self.num_layers,))
        whole = dataclasses.replace(self.costs, stored_options=())
        low = least_feasible_peak(whole)
        self.named_groups += tuple(s.groups for s in [low, *lowest_front(whole, low, 3)])
        self.unconstrained_peak_bytes = self.solution_report(Solution((), 0, 0)).peak_bytes
        self.prepare_s = time.perf_counter() - t0

    def _template_layer(self, i: int) -> int:
        """The template layer whose terms layer ``i`` of L takes: the first, the last, or a middle one."""
        n = self.stack.num_layers
        return 0 if i == 0 else n - 1 if i == self.num_layers - 1 else 1

    def _chain_costs(self, model: ReusedLayersModel) -> ChainCosts:
        """The layer level's chain model of L layers with each stored layer's options:
        its stored terms (reused liveness of ``none``) plus each calibrated point's change."""
        L, inner = self.num_layers, self.template_planner
        base = chain_costs(model)
        stored = layer_terms(self.reuse.profile(schedules.none(L)), L)
        change = inner.option_change[0]
        last, member = inner.costs.last_recompute_flops, inner.costs.member_recompute_flops
        options = tuple(
            tuple(StoredOption(*(stored[f][i] + c[f] for f in range(3)), c[3], f"{POLICY}[{t}]")
                  for t, c in enumerate(change))
            for i in range(L))
        return dataclasses.replace(
            base, last_recompute_flops=tuple(last[self._template_layer(i)] for i in range(L)),
            member_recompute_flops=tuple(member[1] if i + 1 < L else 0 for i in range(L)),
            stored_options=options)

    def _decision(self, sol: Solution) -> OpDecision:
        return OpDecision(tuple(sol.groups), tuple(sol.options) or (0,) * self.num_layers, self.num_layers)

    def report(self, decision: OpDecision, with_timeline: bool = False) -> MemoryReport:
        """The liveness report of ``decision``'s L-layer step (bytes, FLOPs), assembled
        from template rewrites (``ReusedLayers.report`` with options)."""
        return self.reuse.report(decision.layer_schedule, with_timeline, decision.options, decision.provenance)

    def recomputed_nodes(self, decision: OpDecision) -> list:
        """The template nodes each recomputed step of ``decision``'s L-layer step runs."""
        lay = self.reuse.layout(decision.layer_schedule, decision.options)
        return [n for b in lay.order for n in self.reuse.block_types[block_type(b, lay.roles)].recomputed]

    @property
    def front_gap_cost(self) -> int:
        """The largest proven gap of a trade-off point (cost units; 0: all optimal)."""
        return self.template_planner.front_gap_cost

    def bound_note(self) -> str | None:
        """What stopped the search short of the exact optimum (``OpPlanner.bound_note``)."""
        return self.template_planner.bound_note()

    def least_feasible(self) -> CheckedPlan:
        """The choice of least liveness peak the planner finds (``solvers.resolve``)."""
        return self.least_feasible_checked()

    def _plan_value(self, answer: ChainAnswer[OpDecision]) -> OpPlan:
        checked, dec, rep = answer.checked, answer.decision, answer.report
        recomputed = self.recomputed_nodes(dec)
        return OpPlan(
            budget_bytes=answer.budget_bytes, partition=dec, options=checked.options,
            model_peak_bytes=int(checked.model_peak_bytes), predicted_peak_bytes=rep.peak_bytes,
            recompute_cost=int(checked.recompute_flops), recompute_flops=rep.recompute_flops,
            recompute_bytes_moved=sum(bytes_moved(n) for n in recomputed), forward_flops=rep.forward_flops,
            saved_nodes=len(rep.saved), recomputed_nodes=len(recomputed),
            least_feasible_peak_bytes=answer.least.predicted_peak_bytes,
            unconstrained_peak_bytes=self.unconstrained_peak_bytes, solve_time_s=answer.solve_time_s,
            resolves=checked.resolves, bound=self.bound_note(), gap_cost=self.front_gap_cost)

    def _cost(self, plan: OpPlan) -> int:
        return plan.recompute_cost

