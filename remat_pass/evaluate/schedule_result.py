"""The result of one schedule (``ScheduleResult``): its predicted and measured peak and its
gradient checks, as ``sweep.Session.evaluate`` gives it, or predicted only, from a
MemoryReport (``predicted_result``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..liveness.timeline import MemoryReport
from ..recompute.partition import Partition
from ..recompute.schedule import Schedule, recompute_fraction


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """Prediction and measurement of one schedule (all sizes in bytes).

    Attributes:
        schedule: ``"none"``, ``"uniform"``, ``"block"`` or ``"optimized"``.
        recompute_num_layers: K (uniform) or N (block); None otherwise.
        provenance: e.g. ``"uniform(K=4)"``.
        predicted_peak_bytes, measured_peak_bytes: activation peaks; None when the
            gradients differ (a peak is never reported next to wrong gradients);
            ``measured_peak_bytes`` is None for a predicted-only result.
        error_fraction: (predicted - measured) / measured (None: predicted only).
        peak_saving_vs_none_bytes: predicted peak of ``none`` minus this one (0: the
            schedule saves nothing).
        saved_activation_bytes: bytes forward saves for backward.
        recompute_flops, forward_flops: FLOPs (torch.utils.flop_counter formulas).
        peak_phase, peak_layer, peak_node: where the predicted peak is.
        live_at_peak_by_layer: predicted bytes live at the peak, per layer / "outer".
        grads_equal: rewritten gradients bitwise equal to the un-rewritten joint graph's
            (None: predicted only, nothing was run).
        max_grad_diff_vs_eager: largest |difference| from eager autograd's parameter
            gradients (float rounding of the traced ops; not a correctness check).
        pass_time_s: seconds for rewrite + liveness.
        measure_time_s: seconds to run and measure the step (warm-up included).
        max_grad_diff_vs_reference: largest |difference| from the un-rewritten step's
            gradients (0.0 when bitwise equal).
        run_to_run_grad_diff: largest |difference| between runs of the un-rewritten
            step itself with the same seed (0.0: bitwise reproducible, or not rerun
            because the gradients were bitwise equal).
        grads_within_run_to_run: not bitwise equal, but the un-rewritten step is not
            reproducible either and every gradient is within the difference observed
            between its own runs.
        policy: the op-level policy of the stored layers (``Partition.policy``), None
            for a layer-level schedule.
        saved_nodes: how many forward values are saved for backward (RNG states not
            counted).
        recomputed_nodes: how many forward nodes backward recomputes.
        recompute_bytes_moved: bytes the recomputed nodes read and write
            (``costs.bytes_moved``; their FLOPs are ``recompute_flops``).
        predicted_only: nothing was run (no weights, or another device): every figure
            is a prediction.
        static_bytes: static memory (parameters, buffers, batch, optimizer states,
            master weights, workspaces) when known (``static_memory``), else None.
        static: its parts (``StaticMemory.to_dict``), or None.
    """

    schedule: str
    recompute_num_layers: int | None
    provenance: str
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    error_fraction: float | None
    peak_saving_vs_none_bytes: int | None
    saved_activation_bytes: int
    recompute_flops: int
    forward_flops: int
    peak_phase: str
    peak_layer: int | None
    peak_node: str
    live_at_peak_by_layer: dict[str, int]
    grads_equal: bool | None
    max_grad_diff_vs_eager: float | None
    pass_time_s: float
    measure_time_s: float
    policy: str | None = None
    saved_nodes: int = 0
    recomputed_nodes: int = 0
    recompute_bytes_moved: int = 0
    max_grad_diff_vs_reference: float = 0.0
    run_to_run_grad_diff: float = 0.0
    grads_within_run_to_run: bool = False

    @property
    def grads_match(self) -> bool:
        """Bitwise equal, or within the un-rewritten step's own run-to-run difference."""
        return self.grads_equal or self.grads_within_run_to_run

    def grads_text(self) -> str:
        """``equal``, ``within run-to-run (1.2e-09 <= 3.5e-10 ...)`` or ``DIFFER (...)``."""
        if self.grads_equal:
            return "equal"
        if self.grads_within_run_to_run:
            return (f"within run-to-run: differ by {self.max_grad_diff_vs_reference:.2g}, the un-rewritten step "
                    f"by {self.run_to_run_grad_diff:.2g} between its own runs (backward not bitwise reproducible)")
        return f"DIFFER by {self.max_grad_diff_vs_reference:.2g}"
    predicted_only: bool = False
    static_bytes: int | None = None
    static: dict[str, Any] | None = None

    @property
    def recompute_fraction(self) -> float:
        """Recompute FLOPs / forward FLOPs."""
        return recompute_fraction(self.recompute_flops, self.forward_flops)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the ``--json`` row)."""
        d = dataclasses.asdict(self)
        d["recompute_fraction"] = self.recompute_fraction
        return d


def report_fields(report: MemoryReport) -> dict[str, Any]:
    """The ScheduleResult fields read off the predicted MemoryReport."""
    return dict(saved_activation_bytes=report.saved_activation_bytes, recompute_flops=report.recompute_flops,
                forward_flops=report.forward_flops, peak_phase=report.peak_phase, peak_layer=report.peak_layer,
                peak_node=report.peak_node, live_at_peak_by_layer=report.live_at_peak_by_layer)


def predicted_result(schedule: Schedule | Partition, report: MemoryReport, none_peak_bytes: int,
                     pass_time_s: float, static: Any = None) -> ScheduleResult:
    """A predicted-only ScheduleResult from a MemoryReport (no run, no gradients).

    Args:
        schedule: a Schedule, or a Partition (an op-level policy on its layer schedule).
        static: the step's ``static_memory.StaticMemory`` (None: unknown).
    """
    layer_level = schedule if isinstance(schedule, Schedule) else schedule.schedule
    return ScheduleResult(
        schedule=layer_level.method if layer_level is not None else "none",
        recompute_num_layers=layer_level.recompute_num_layers if layer_level is not None else None,
        provenance=schedule.provenance,
        policy=None if isinstance(schedule, Schedule) else schedule.policy,
        predicted_peak_bytes=report.peak_bytes,
        measured_peak_bytes=None,
        error_fraction=None,
        peak_saving_vs_none_bytes=none_peak_bytes - report.peak_bytes,
        **report_fields(report),
        grads_equal=None,
        max_grad_diff_vs_eager=None,
        pass_time_s=pass_time_s,
        measure_time_s=0.0,
        predicted_only=True,
        static_bytes=None if static is None else static.total_bytes,
        static=None if static is None else static.to_dict(),
    )
