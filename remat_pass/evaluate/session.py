"""Evaluate schedules end to end: rewrite, predict, run, measure, compare gradients.

One ``ScheduleResult`` (``schedule_result``) per schedule holds the predicted peak
(liveness), the measured peak (running the rewritten step), and the gradient checks:
bitwise equality with the un-rewritten joint graph run by the same executor, and the
largest difference from plain eager autograd.

Kernels whose backward is not bitwise reproducible run to run (a parallel reduction
whose order depends on thread timing: transformers' Mixtral experts on 2 threads): when
a schedule's gradients are not bitwise equal to the reference, the un-rewritten step is
run ``REFERENCE_RUNS`` times with the same seed (the reference among them), and each
gradient is compared with the largest difference observed between those runs (per
gradient, so a gradient that is reproducible must still be equal), and the result says
so (``grads_within_run_to_run``).
Those runs sample the reduction orders; one run of the rewritten step can still land
just outside what they saw. A correct rewrite runs the same kernels, so its runs come
from the same distribution; a wrong one differs at every run. So a schedule outside the
envelope is run again, up to ``SCHEDULE_RERUNS`` times, against twice as many runs of
the un-rewritten step each time, and is within when one of its runs is.

A step without weights (a fake trace: a model on the meta device, or predicted for a
device this machine does not have) is predicted only: its results say so
(``predicted_only``) and carry no measured figure.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch

from ..recompute import schedule as schedules
from ..memory.calibration import CalibrationOptions, Calibrator
from ..errors import GradientMismatch, RematError
from ..graph.costs import bytes_moved
from ..liveness.timeline import MemoryReport, analyze
from ..memory.memory_model import MemoryModel
from ..measure.run import (
    eager_grads,
    grads_bitwise_equal,
    max_abs_diff,
    JointRun,
    measure_step,
    reference_run,
    run_joint,
    run_step,
)
from ..recompute.partition import Partition
from ..graph.regions import LayerStack
from ..recompute.rewrite import RewrittenStep, rewrite
from ..recompute.schedule import Schedule, megatron_schedules
from .schedule_result import ScheduleResult, predicted_result, report_fields
from ..graph.trace import JointGraph, RealLayouts
from .traced_step import StepOptions, TracedStep, trace_step

__all__ = ["Session", "megatron_schedules", "sweep"]

REFERENCE_RUNS = 8
"""Runs of the un-rewritten step that measure its run-to-run difference when it is not
bitwise reproducible (twice that when a schedule's gradients fall outside it)."""

SCHEDULE_RERUNS = 4
"""Further runs of a rewritten step whose gradients fall outside the un-rewritten step's
run-to-run difference, when that step is not bitwise reproducible; before each, the
un-rewritten step's runs are doubled, up to ``MAX_REFERENCE_RUNS``."""

MAX_REFERENCE_RUNS = 64
"""The most runs of the un-rewritten step that measure its run-to-run difference (16
runs of Mixtral's experts on 2 threads left one run of the un-rewritten step itself in
six outside them, now and then)."""


@dataclasses.dataclass
class Session:
    """A traced step, ready to predict and evaluate many schedules.

    The gradient references are computed on first use. Prediction alone (``prepare``:
    reports, the CI gate, the pytest plugin) runs the un-rewritten step once, before
    its first rewrite, when ``runs_reference`` (by default: when it calibrates): the
    real layout of every value is known from that run (``real_layouts``), and a step
    that cannot run is refused. It never runs for a fake step.

    Every rewrite of a session takes the same layouts (``real_layouts``: the reference
    run's when ``runs_reference``, else none), whatever ran before: the reference run
    is cached here, never written into the traced step.

    Attributes:
        joint, stack: the traced step and its layer stack.
        reference_grads: gradients of the un-rewritten joint graph (same executor).
        eager_param_grads: parameter gradients of eager autograd.
        seed: RNG seed used for every run (dropout masks).
        calibrator: calibrates the op scratch of every step predicted on the CPU
            (``calibration.Calibrator``); None: the formula table only.
        check_runs_first: whether the step is run before its first rewrite (True /
            False); None (default): when it calibrates on the CPU (``runs_reference``).
    """

    joint: JointGraph
    stack: LayerStack
    example_inputs: Any = None
    loss_fn: Any = None
    seed: int = 0
    calibrator: Calibrator | None = None
    check_runs_first: bool | None = None
    _reference: JointRun | None = dataclasses.field(default=None, repr=False)
    _reference_grads: list[Any] | None = dataclasses.field(default=None, repr=False)
    _eager_param_grads: list[Any] | None = dataclasses.field(default=None, repr=False)
    _none_peak: int | None = dataclasses.field(default=None, repr=False)
    _envelope: list[Any] | None = dataclasses.field(default=None, repr=False)
    _reference_runs: int = dataclasses.field(default=0, repr=False)
    _reference_is_a_run: bool = dataclasses.field(default=False, repr=False)

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        example_inputs: Any,
        loss_fn: Any = None,
        layers: str | Sequence[str] | None = None,
        seed: int = 0,
        calibration: CalibrationOptions | None = CalibrationOptions(),
        fake: bool = False,
        kernels: Callable[[], ContextManager[Any]] | None = None,
    ) -> "Session":
        """Trace the step and find the layer stacks (``layers``: a module path, several,
        or None to find every stack; see ``regions.find_layer_stacks``), through the
        one builder (``traced_step.trace_step``).

        A model whose parameters, buffers or inputs are meta or fake tensors is traced
        with ``fake_trace.trace_joint_fake`` (predicted only), as is any model when
        ``fake``.

        Args:
            calibration: how op scratch is calibrated on this machine (the default
                caches figures under ``~/.cache/remat-pass``); None: the formula table
                only (``memory_model``). A fake step is never calibrated (its shapes
                may not fit this machine): the formula table only.
            fake: trace with fake tensors even if the model has weights (to predict for
                another device: the trace then runs under ``kernels``).
            kernels: a context manager factory active while tracing a fake step
                (``cuda_target.CudaKernels`` for the CUDA target).

        Raises:
            LayerStackNotFound, UnsupportedGraph, RematError: see trace_joint,
                trace_joint_fake and assign_layers (``trace_step``).
        """
        step = trace_step(StepOptions(model=model, example_inputs=example_inputs, loss_fn=loss_fn, stack=layers,
                                      fake=fake, kernels=kernels))
        return cls.of_step(step, seed, calibration)

    @classmethod
    def of_step(cls, step: TracedStep, seed: int = 0,
                calibration: CalibrationOptions | None = CalibrationOptions(),
                check_runs_first: bool | None = None) -> "Session":
        """The session of a traced step (``traced_step.trace_step``, the one builder).

        Args:
            step: the traced step (traced whole: a reused stack's template is fake).
            seed: RNG seed of every run.
            calibration: see ``create``; a fake step is never calibrated.
            check_runs_first: see the attribute (None: when it calibrates).
        """
        calibrator = Calibrator(calibration) if calibration is not None and not step.joint.fake else None
        return cls(step.joint, step.stack, step.example_inputs, step.loss_fn, seed, calibrator, check_runs_first)

    def check_runs(self) -> None:
        """Run the un-rewritten step once (its gradients become ``reference_grads``),
        so that a traced step that cannot run on the real tensors is refused before
        any peak is predicted for it. ``prepare`` calls it first when
        ``runs_reference``; a fake step is never run.

        Raises:
            UnsupportedGraph: names the node that fails and the op whose real memory
                layout first differed from the traced one (``measure.run_graph``).
        """
        if not self.predicted_only:
            self.reference_grads  # noqa: B018 - runs the step

    @property
    def predicted_only(self) -> bool:
        """The step has no weights (a fake trace): it can be predicted, not run."""
        return self.joint.fake

    @property
    def runs_reference(self) -> bool:
        """Whether prediction runs the un-rewritten step before its first rewrite and
        rewrites with its real layouts: ``check_runs_first``, by default when the
        session calibrates on the CPU; never for a fake step."""
        if self.predicted_only:
            return False
        if self.check_runs_first is not None:
            return self.check_runs_first
        return self.calibrator is not None and self._on_cpu()

    @property
    def real_layouts(self) -> RealLayouts:
        """The real layouts every rewrite of this session takes: the reference run's
        (``measure.run.reference_run``, run once on first use) when
        ``runs_reference``, else none.

        Raises:
            UnsupportedGraph: the step cannot run on the real tensors.
        """
        return self._reference_run_result().layouts if self.runs_reference else RealLayouts()

    def _reference_run_result(self) -> JointRun:
        """The cached run of the un-rewritten step (seeded with ``seed``)."""
        if self._reference is None:
            torch.manual_seed(self.seed)
            self._reference = reference_run(self.joint)
        return self._reference

    @property
    def reference_grads(self) -> list[Any]:
        """Gradients of the un-rewritten joint graph, run by the same executor."""
        if self._reference_grads is None:
            self._reference_grads = self._reference_run_result().grads
            self._reference_is_a_run = True
        return self._reference_grads

    @reference_grads.setter
    def reference_grads(self, grads: list[Any]) -> None:
        self._reference_grads = grads
        self._reference_is_a_run = False

    def run_to_run_grad_diffs(self, runs: int = REFERENCE_RUNS) -> list[float]:
        """Per gradient of the un-rewritten step, the largest |difference| between
        ``runs`` of it with the same seed (all 0.0: bitwise reproducible in those runs).

        Called once a schedule's gradients are not bitwise equal to the reference. Two
        runs that agree prove nothing (Mixtral on 2 threads agrees with itself now and
        then), so it runs ``runs`` times in all: the differences take a few discrete
        values, from the order of a parallel reduction, and a handful of runs sees the
        range. Each gradient's elementwise minimum and maximum over the runs are kept,
        so the largest difference of any two runs is ``max(hi - lo)``. Computed once;
        a larger ``runs`` adds runs.
        """
        if self._envelope is None:
            # the envelope is of the step's own runs: ``reference_grads`` is one of them
            # when this session ran it (a schedule's gradients are compared with it, so
            # its order must be in the envelope: once in CI it was the only run outside
            # the other 16); one a caller set, which no run may reproduce, widens nothing
            if self._reference_is_a_run:
                first = self.reference_grads
            else:
                torch.manual_seed(self.seed)
                first = run_joint(self.joint)[1]
            self._envelope = [None if g is None else (g.clone(), g.clone()) for g in first]
            self._reference_runs = 1
        while self._reference_runs < runs:
            self._reference_run()
        return [0.0 if e is None else float((e[1].double() - e[0].double()).abs().max()) if e[0].numel() else 0.0
                for e in self._envelope]

    def _reference_run(self) -> list[Any]:
        """One more run of the un-rewritten step, folded into the envelope."""
        torch.manual_seed(self.seed)
        grads = run_joint(self.joint)[1]
        assert self._envelope is not None
        for e, g in zip(self._envelope, grads):
            if e is not None and g is not None:
                torch.minimum(e[0], g, out=e[0])
                torch.maximum(e[1], g, out=e[1])
        self._reference_runs += 1
        return grads

    @property
    def eager_param_grads(self) -> list[Any]:
        """Parameter gradients of plain eager autograd (``loss.backward()``)."""
        if self._eager_param_grads is None:
            torch.manual_seed(self.seed)
            self._eager_param_grads = eager_grads(self.joint.model, self.example_inputs, self.loss_fn)[1]
        return self._eager_param_grads

    def prepare(
        self, schedule: Schedule | Partition, allocator: str = "cpu", in_place: bool = True
    ) -> tuple[RewrittenStep, MemoryReport, float]:
        """Rewrite and predict: ``(step, report, seconds)``; see ``liveness.analyze``.
        ``in_place`` as ``rewrite.rewrite`` (False: the functional trace's allocations,
        every op a new storage).

        ``schedule`` may be a Partition (an op-level policy). The rewrite takes
        ``real_layouts`` (so the first call runs the un-rewritten step once when
        ``runs_reference``: calibrating needs the real layout of every value). The
        memory model is ``memory_model(step, allocator)``: calibrated on the CPU at the
        current thread count (the seconds include calibrating new signatures).

        Raises:
            UnsupportedGraph: (``runs_reference``) the traced step cannot run on the
                real tensors (``check_runs``).
        """
        t0 = time.perf_counter()
        step = rewrite(self.joint, self.stack, schedule, self.real_layouts, in_place=in_place)
        report = analyze(step, memory=self.memory_model(step, allocator))
        return step, report, time.perf_counter() - t0

    def memory_model(self, step: RewrittenStep, allocator: str = "cpu") -> MemoryModel:
        """The MemoryModel of ``step`` at the current thread count: every op signature
        calibrated on this CPU (``calibrator``), the formula table for the rest, or the
        table only without a calibrator or for a CUDA allocator."""
        if self.calibrator is None or not self._on_cpu():
            return MemoryModel.table_only(allocator)
        return self.calibrator.memory_model([step], allocator)

    def _on_cpu(self) -> bool:
        return all(v.device.type == "cpu" for v in self.joint.primal_values if isinstance(v, torch.Tensor))

    def report(self, schedule: Schedule | Partition, allocator: str = "cpu") -> MemoryReport:
        """The predicted MemoryReport of ``schedule`` (``prepare`` without the step)."""
        return self.prepare(schedule, allocator)[1]

    def evaluate(self, schedule: Schedule | Partition, strict: bool = True) -> ScheduleResult:
        """Rewrite, predict, run and measure ``schedule``.

        Args:
            schedule: the schedule, or a Partition (an op-level policy).
            strict: raise when gradients differ; with False the result carries
                ``grads_equal=False`` and no peak figures (None).

        Raises:
            GradientMismatch: (strict) the rewritten step's gradients are not bitwise
                equal to the un-rewritten joint graph's, nor within its run-to-run
                difference; no peak is reported for it.
            RematError: the step is predicted only (``predict`` it instead).
        """
        if self.predicted_only:
            raise RematError(
                f"{schedule.provenance}: this step was traced without weights (meta or fake tensors, or for "
                "another device), so it can be predicted but not run or measured; use predict()")
        step, report, pass_s = self.prepare(schedule)
        t0 = time.perf_counter()
        m = measure_step(step, self.joint, seed=self.seed)
        measure_s = time.perf_counter() - t0
        equal = grads_bitwise_equal(m.grads, self.reference_grads)
        within, diff, noise = False, 0.0, 0.0
        if not equal:
            within, diff, noise = self._within_run_to_run(m.grads)
            reruns = 0
            while not within and noise > 0 and reruns < SCHEDULE_RERUNS:
                reruns += 1
                torch.manual_seed(self.seed)
                runs = min(MAX_REFERENCE_RUNS, 2 * REFERENCE_RUNS << reruns)
                within, diff, noise = self._within_run_to_run(run_step(step, self.joint)[1], runs)
        if strict and not (equal or within):
            self.check_grads(schedule, m.grads)
        ok = equal or within
        layer_level = step.schedule
        recomputed = [n for n in step.backward.graph.nodes if step.kind_of.get(n.name) == "recompute"]
        return ScheduleResult(
            schedule=layer_level.method if layer_level is not None else "none",
            recompute_num_layers=layer_level.recompute_num_layers if layer_level is not None else None,
            provenance=step.provenance,
            predicted_peak_bytes=report.peak_bytes if ok else None,
            measured_peak_bytes=m.peak_bytes if ok else None,
            error_fraction=(report.peak_bytes - m.peak_bytes) / m.peak_bytes if m.peak_bytes else 0.0,
            peak_saving_vs_none_bytes=(
                self.baseline_peak_bytes() - report.peak_bytes if ok else None
            ),
            **report_fields(report),
            grads_equal=equal,
            max_grad_diff_vs_eager=max_abs_diff([m.grads[i] for i in self.joint.param_indices], self.eager_param_grads),
            pass_time_s=pass_s,
            measure_time_s=measure_s,
            max_grad_diff_vs_reference=diff,
            run_to_run_grad_diff=noise,
            grads_within_run_to_run=within,
            policy=step.partition.policy,
            saved_nodes=len(step.partition.saved),
            recomputed_nodes=len(step.partition.recomputed_names),
            recompute_bytes_moved=sum(bytes_moved(n) for n in recomputed),
        )

    def _within_run_to_run(self, grads: list[Any], runs: int = REFERENCE_RUNS) -> tuple[bool, float, float]:
        """``(within, largest |grad - reference|, largest run-to-run difference)``:
        within when the un-rewritten step is not reproducible and every gradient differs
        from the reference by at most the difference between its own ``runs`` runs
        (twice that many when it does not)."""
        ref = self.reference_grads
        if len(grads) != len(ref):
            return False, float("inf"), 0.0
        diffs = [max_abs_diff([g], [r]) for g, r in zip(grads, ref)]
        noise = self.run_to_run_grad_diffs(runs)
        within = max(noise) > 0 and all(d <= n for d, n in zip(diffs, noise))
        if not within and max(noise) > 0:  # not reproducible: look at more runs once
            noise = self.run_to_run_grad_diffs(min(MAX_REFERENCE_RUNS, 2 * runs))
            within = all(d <= n for d, n in zip(diffs, noise))
        return within, max(diffs, default=0.0), max(noise, default=0.0)


    def baseline_peak_bytes(self, allocator: str = "cpu") -> int:
        """Predicted peak of ``none`` (cached for the CPU allocator)."""
        if allocator != "cpu":
            return self.prepare(schedules.none(self.stack.layers_per_stack), allocator)[1].peak_bytes
        if self._none_peak is None:
            self._none_peak = self.prepare(schedules.none(self.stack.layers_per_stack))[1].peak_bytes
        return self._none_peak

    def predict(self, schedule: Schedule | Partition, allocator: str = "cpu", none_peak_bytes: int | None = None) -> ScheduleResult:
        """The predicted-only result of ``schedule`` (nothing runs).

        Args:
            allocator: "cpu" or "cuda" (``liveness.analyze``).
            none_peak_bytes: the predicted peak of ``none`` under that allocator, when
                the caller has it (saves a rewrite).
        """
        t0 = time.perf_counter()
        report = self.report(schedule, allocator)
        none_peak = none_peak_bytes if none_peak_bytes is not None else self.baseline_peak_bytes(allocator)
        return predicted_result(schedule, report, none_peak, time.perf_counter() - t0)

    def check_grads(self, schedule: Schedule | Partition, grads: list[Any]) -> None:
        """Raise GradientMismatch unless ``grads`` equal the reference bit for bit.

        Raises:
            GradientMismatch: names the first primal whose gradient differs (beyond
                the un-rewritten step's run-to-run difference, when it has one).
        """
        if grads_bitwise_equal(grads, self.reference_grads):
            return
        noise = self.run_to_run_grad_diffs()
        for label, g, ref, n in zip(self.joint.primal_labels, grads, self.reference_grads, noise):
            diff = max_abs_diff([g], [ref])
            if not grads_bitwise_equal([g], [ref]) and not (n > 0 and diff <= n):
                also = f"; its own runs differ by {n:.3g}" if n else ""
                raise GradientMismatch(
                    f"{schedule.provenance}: the gradient of {label} differs from the "
                    f"un-rewritten step (max |diff| {diff:.3g}{also}); the rewrite is wrong and "
                    "its peak is not reported"
                )
        raise GradientMismatch(f"{schedule.provenance}: gradient count differs")


def sweep(
    session: Session,
    schedule_list: Iterable[Schedule] | None = None,
    progress: Callable[[int, int, Schedule, ScheduleResult], None] | None = None,
) -> list[ScheduleResult]:
    """Evaluate every schedule (default: ``megatron_schedules`` of the stacks), in order.

    Args:
        session: the traced step (``Session.create``).
        schedule_list: schedules to evaluate.
        progress: called after each schedule with (index from 1, total, schedule, result).

    Rows whose gradients differ (``grads_match`` False) carry no peak figures.
    """
    todo = list(schedule_list or megatron_schedules(session.stack.layers_per_stack))
    results = []
    for i, s in enumerate(todo, 1):
        r = session.evaluate(s, strict=False)
        results.append(r)
        if progress is not None:
            progress(i, len(todo), s, r)
    return results
