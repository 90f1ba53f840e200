"""Evaluate schedules end to end: rewrite, predict, run, measure, compare gradients.

One ``ScheduleResult`` per schedule holds the predicted peak (liveness), the measured
peak (running the rewritten step), and the gradient checks: bitwise equality with the
un-rewritten joint graph run by the same executor, and the largest difference from
plain eager autograd.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

import torch

from . import schedule as schedules
from .errors import GradientMismatch
from .liveness import MemoryReport, analyze
from .measure import (
    eager_grads,
    grads_bitwise_equal,
    max_abs_diff,
    measure_step,
    run_joint,
)
from .regions import LayerStack, assign_layers, find_layer_stack
from .rewrite import RewrittenStep, rewrite
from .schedule import Schedule, megatron_schedules, recompute_fraction
from .trace import JointGraph, trace_joint

__all__ = ["ScheduleResult", "Session", "megatron_schedules", "sweep"]


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """Prediction and measurement of one schedule (all sizes in bytes).

    Attributes:
        schedule: ``"none"``, ``"uniform"``, ``"block"`` or ``"optimized"``.
        recompute_num_layers: K (uniform) or N (block); None otherwise.
        provenance: e.g. ``"uniform(K=4)"``.
        predicted_peak_bytes, measured_peak_bytes: activation peaks; None when the
            gradients differ (a peak is never reported next to wrong gradients).
        error_fraction: (predicted - measured) / measured.
        peak_saving_vs_none_bytes: predicted peak of ``none`` minus this one (0: the
            schedule saves nothing).
        saved_activation_bytes: bytes forward saves for backward.
        recompute_flops, forward_flops: FLOPs (torch.utils.flop_counter formulas).
        peak_phase, peak_layer, peak_node: where the predicted peak is.
        live_at_peak_by_layer: predicted bytes live at the peak, per layer / "outer".
        grads_equal: rewritten gradients bitwise equal to the un-rewritten joint graph's.
        max_grad_diff_vs_eager: largest |difference| from eager autograd's parameter
            gradients (float rounding of the traced ops; not a correctness check).
        pass_time_s: seconds for rewrite + liveness.
        measure_time_s: seconds to run and measure the step (warm-up included).
    """

    schedule: str
    recompute_num_layers: int | None
    provenance: str
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    error_fraction: float
    peak_saving_vs_none_bytes: int | None
    saved_activation_bytes: int
    recompute_flops: int
    forward_flops: int
    peak_phase: str
    peak_layer: int | None
    peak_node: str
    live_at_peak_by_layer: dict[str, int]
    grads_equal: bool
    max_grad_diff_vs_eager: float
    pass_time_s: float
    measure_time_s: float

    @property
    def recompute_fraction(self) -> float:
        """Recompute FLOPs / forward FLOPs."""
        return recompute_fraction(self.recompute_flops, self.forward_flops)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the ``--json`` row)."""
        d = dataclasses.asdict(self)
        d["recompute_fraction"] = self.recompute_fraction
        return d


@dataclasses.dataclass
class Session:
    """A traced step, ready to predict and evaluate many schedules.

    The gradient references are computed on first use, so prediction alone
    (``prepare``: reports, the CI gate, the pytest plugin) never runs the model.

    Attributes:
        joint, stack: the traced step and its layer stack.
        reference_grads: gradients of the un-rewritten joint graph (same executor).
        eager_param_grads: parameter gradients of eager autograd.
        seed: RNG seed used for every run (dropout masks).
    """

    joint: JointGraph
    stack: LayerStack
    example_inputs: Any = None
    loss_fn: Any = None
    seed: int = 0
    _reference_grads: list[Any] | None = dataclasses.field(default=None, repr=False)
    _eager_param_grads: list[Any] | None = dataclasses.field(default=None, repr=False)
    _none_peak: int | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        example_inputs: Any,
        loss_fn: Any = None,
        layers: str | None = None,
        seed: int = 0,
    ) -> "Session":
        """Trace the step and find the layer stack.

        Raises:
            LayerStackNotFound, UnsupportedGraph, RematError: see trace_joint and
                assign_layers.
        """
        find_layer_stack(model, layers)  # fail before tracing when there is none
        joint = trace_joint(model, example_inputs, loss_fn)
        stack = assign_layers(joint, layers)
        return cls(joint, stack, example_inputs, loss_fn, seed)

    @property
    def reference_grads(self) -> list[Any]:
        """Gradients of the un-rewritten joint graph, run by the same executor."""
        if self._reference_grads is None:
            torch.manual_seed(self.seed)
            self._reference_grads = run_joint(self.joint)[1]
        return self._reference_grads

    @reference_grads.setter
    def reference_grads(self, grads: list[Any]) -> None:
        self._reference_grads = grads

    @property
    def eager_param_grads(self) -> list[Any]:
        """Parameter gradients of plain eager autograd (``loss.backward()``)."""
        if self._eager_param_grads is None:
            torch.manual_seed(self.seed)
            self._eager_param_grads = eager_grads(self.joint.model, self.example_inputs, self.loss_fn)[1]
        return self._eager_param_grads

    def prepare(
        self, schedule: Schedule, allocator: str = "cpu"
    ) -> tuple[RewrittenStep, MemoryReport, float]:
        """Rewrite and predict: ``(step, report, seconds)``; see ``liveness.analyze``."""
        t0 = time.perf_counter()
        step = rewrite(self.joint, self.stack, schedule)
        report = analyze(step, allocator)
        return step, report, time.perf_counter() - t0

    def report(self, schedule: Schedule, allocator: str = "cpu") -> MemoryReport:
        """The predicted MemoryReport of ``schedule`` (``prepare`` without the step)."""
        return self.prepare(schedule, allocator)[1]

    def evaluate(self, schedule: Schedule, strict: bool = True) -> ScheduleResult:
        """Rewrite, predict, run and measure ``schedule``.

        Args:
            schedule: the schedule.
            strict: raise when gradients differ; with False the result carries
                ``grads_equal=False`` and no peak figures (None).

        Raises:
            GradientMismatch: (strict) the rewritten step's gradients are not bitwise
                equal to the un-rewritten joint graph's; no peak is reported for it.
        """
        step, report, pass_s = self.prepare(schedule)
        t0 = time.perf_counter()
        m = measure_step(step, self.joint, seed=self.seed)
        measure_s = time.perf_counter() - t0
        equal = grads_bitwise_equal(m.grads, self.reference_grads)
        if strict and not equal:
            self.check_grads(schedule, m.grads)
        return ScheduleResult(
            schedule=schedule.method,
            recompute_num_layers=schedule.recompute_num_layers,
            provenance=schedule.provenance,
            predicted_peak_bytes=report.peak_bytes if equal else None,
            measured_peak_bytes=m.peak_bytes if equal else None,
            error_fraction=(report.peak_bytes - m.peak_bytes) / m.peak_bytes if m.peak_bytes else 0.0,
            peak_saving_vs_none_bytes=(
                self.baseline_peak_bytes() - report.peak_bytes if equal else None
            ),
            saved_activation_bytes=report.saved_activation_bytes,
            recompute_flops=report.recompute_flops,
            forward_flops=report.forward_flops,
            peak_phase=report.peak_phase,
            peak_layer=report.peak_layer,
            peak_node=report.peak_node,
            live_at_peak_by_layer=report.live_at_peak_by_layer,
            grads_equal=equal,
            max_grad_diff_vs_eager=max_abs_diff([m.grads[i] for i in self.joint.param_indices], self.eager_param_grads),
            pass_time_s=pass_s,
            measure_time_s=measure_s,
        )


    def baseline_peak_bytes(self) -> int:
        """Predicted peak of ``none`` (cached)."""
        if self._none_peak is None:
            self._none_peak = self.prepare(schedules.none(self.stack.num_layers))[1].peak_bytes
        return self._none_peak

    def check_grads(self, schedule: Schedule, grads: list[Any]) -> None:
        """Raise GradientMismatch unless ``grads`` equal the reference bit for bit.

        Raises:
            GradientMismatch: names the first primal whose gradient differs.
        """
        if grads_bitwise_equal(grads, self.reference_grads):
            return
        for label, g, ref in zip(self.joint.primal_labels, grads, self.reference_grads):
            if not grads_bitwise_equal([g], [ref]):
                diff = max_abs_diff([g], [ref])
                raise GradientMismatch(
                    f"{schedule.provenance}: the gradient of {label} differs from the "
                    f"un-rewritten step (max |diff| {diff:.3g}); the rewrite is wrong and "
                    "its peak is not reported"
                )
        raise GradientMismatch(f"{schedule.provenance}: gradient count differs")


def sweep(
    session: Session,
    schedule_list: Iterable[Schedule] | None = None,
    progress: Callable[[int, int, Schedule, ScheduleResult], None] | None = None,
) -> list[ScheduleResult]:
    """Evaluate every schedule (default: ``megatron_schedules(L)``), in order.

    Args:
        session: the traced step (``Session.create``).
        schedule_list: schedules to evaluate.
        progress: called after each schedule with (index from 1, total, schedule, result).

    Rows whose gradients differ carry ``grads_equal=False`` and no peak figures.
    """
    todo = list(schedule_list or megatron_schedules(session.stack.num_layers))
    results = []
    for i, s in enumerate(todo, 1):
        r = session.evaluate(s, strict=False)
        results.append(r)
        if progress is not None:
            progress(i, len(todo), s, r)
    return results
