"""pytest plugin: assert a model's predicted peak memory in a project's own tests.

Installed with remat-pass (entry point ``pytest11: remat_pass``), so any project that
has remat-pass installed gets:

- the ``remat_peak`` fixture, a ``PeakChecker``: ``remat_peak.check(model, inputs,
  loss_fn, schedule="uniform", recompute_num_layers=2, budget="2GiB", baseline="baselines/gpt.json",
  max_regression="5%")`` traces one training step, rewrites it under the schedule,
  predicts its peak by liveness analysis (the step is not run, no GPU; each distinct op
  signature is run once alone on the CPU to calibrate its scratch memory, cached under
  ``~/.cache/remat-pass``, unless ``calibrate=False``) and fails the test with
  ``remat-pass check``'s explanation when the peak (op scratch included) exceeds the
  budget or grows past the baseline, saying when the op at the peak has no calibrated
  figure; it returns the report (``report.report_json`` dict).
- the marker ``@pytest.mark.remat_budget("2GiB")``: the budget ``check`` uses when
  none is passed.
- ``--remat-update-baseline``: ``check`` writes (overwrites) its baseline file instead
  of comparing; commit the file to accept the new figures.
- the ini option ``remat_max_regression`` (default ``0%``): the growth allowed over a
  baseline when ``check`` is not given ``max_regression``.

Relative baseline paths are resolved against the directory of the test file.

Example::

    def test_peak(remat_peak):
        model, inputs, loss_fn = remat_pass.models.linear_chain(layers=4)
        remat_peak.check(model, inputs, loss_fn, schedule="uniform", recompute_num_layers=2,
                         budget="4MiB", baseline="peak_baseline.json")
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--remat-update-baseline`` and the ``remat_max_regression`` ini option."""
    group = parser.getgroup("remat-pass", "predicted peak memory (remat-pass)")
    group.addoption(
        "--remat-update-baseline", action="store_true", default=False,
        help="remat_peak.check writes its baseline file instead of comparing with it",
    )
    parser.addini("remat_max_regression", "growth allowed over a remat-pass baseline peak (e.g. 5%)", default="0%")


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``remat_budget`` marker."""
    config.addinivalue_line(
        "markers", "remat_budget(size): the default budget (e.g. '2GiB') of remat_peak.check in this test"
    )


class PeakChecker:
    """Predict a model's peak and assert it; one per test (the ``remat_peak`` fixture)."""

    def __init__(self, request: pytest.FixtureRequest):
        self._request = request
        marker = request.node.get_closest_marker("remat_budget")
        self.default_budget = _marker_budget(marker) if marker is not None else None
        self.update_baseline = bool(request.config.getoption("--remat-update-baseline"))
        self.default_max_regression = request.config.getini("remat_max_regression") or "0%"

    def predict(
        self,
        model: Any,
        example_inputs: Any = None,
        loss_fn: Any = None,
        *,
        schedule: str = "none",
        recompute_num_layers: int | None = None,
        stack: str | Sequence[str] | None = None,
        allocator: str = "cpu",
        calibrate: bool = True,
        k: int | None = None,
        **factory_kwargs: Any,
    ) -> dict[str, Any]:
        """The predicted report (``report_json`` dict) of one training step.

        Args:
            model: an ``nn.Module`` (then ``example_inputs`` and ``loss_fn`` as for
                ``trace_joint``), or a factory spec ``"module:factory"`` called with
                ``factory_kwargs``.
            schedule: ``none`` | ``uniform`` | ``block`` (Megatron-LM's
                ``--recompute-method``).
            recompute_num_layers: K (uniform) or N (block).
            stack: module path of the layer stack (or paths of several) when not found
                automatically.
            allocator: "cpu" or "cuda" byte model.
            calibrate: calibrate op scratch on this CPU (False: the formula table only).
            k: the old name of ``recompute_num_layers`` (deprecated).

        Raises:
            RematError, ValueError: tracing, layer stack or schedule errors.
        """
        # imported here, not at module level: pytest loads this plugin in every session
        # of an environment that has remat-pass, and most never use it (torch is slow
        # to import)
        from .recompute import schedule as schedules
        from .memory.calibration import CalibrationOptions
        from .report.schedule_report import report_json
        from .evaluate.session import Session
        from .evaluate.traced_step import StepOptions, trace_step

        if k is not None:
            warnings.warn("remat_peak: k= is deprecated, use recompute_num_layers=", DeprecationWarning, stacklevel=3)
            recompute_num_layers = k if recompute_num_layers is None else recompute_num_layers
        step = trace_step(StepOptions(model=model, example_inputs=example_inputs, loss_fn=loss_fn,
                                      factory_kwargs=factory_kwargs, stack=stack))
        session = Session.of_step(step, calibration=CalibrationOptions() if calibrate else None)
        sched = schedules.make(schedule, recompute_num_layers, session.stack.layers_per_stack)
        step, report, _ = session.prepare(sched, allocator)
        return report_json(report, step)

    def check(
        self,
        model: Any,
        example_inputs: Any = None,
        loss_fn: Any = None,
        *,
        budget: str | int | None = None,
        baseline: str | Path | None = None,
        max_regression: str | float | None = None,
        **predict_kwargs: Any,
    ) -> dict[str, Any]:
        """Predict (as ``predict``, which takes the other keywords), then fail the test
        if the peak exceeds ``budget`` (default: the ``remat_budget`` marker) or grows
        more than ``max_regression`` (default: ini ``remat_max_regression``) over
        ``baseline``; the check is ``gate.gate``, as ``remat-pass check`` runs it.

        Returns:
            The report dict (also when the check passes).

        Raises:
            pytest.fail.Exception: the check failed (the message is ``remat-pass check``'s
                explanation), no budget or baseline was given, or the baseline file is
                missing (run pytest with ``--remat-update-baseline`` to write it).
        """
        from .report.gate import gate  # see predict: keep plugin loading free of torch

        budget = budget if budget is not None else self.default_budget
        if budget is None and baseline is None:
            pytest.fail("remat_peak.check needs a budget (argument or @pytest.mark.remat_budget) or a baseline",
                        pytrace=False)
        path = None
        if baseline is not None:
            path = Path(baseline)
            if not path.is_absolute():
                path = Path(self._request.path).parent / path
            if not self.update_baseline and not path.exists():
                pytest.fail(f"no remat-pass baseline at {path}: run pytest --remat-update-baseline to write it, "
                            "then commit it", pytrace=False)
        report = self.predict(model, example_inputs, loss_fn, **predict_kwargs)
        result = gate([report], budget=budget, baseline=path,
                      max_regression=max_regression if max_regression is not None else self.default_max_regression,
                      update_baseline=self.update_baseline)
        if not result.ok:
            # the first line is what pytest's short summary shows: the failures, not the
            # first finding (which may be a check that passed)
            failed = "; ".join(f.headline for f in result.findings if not f.ok)
            pytest.fail(f"remat-pass: {failed}\n{result.text()}", pytrace=False)
        return report


def _marker_budget(marker: Any) -> str | int:
    """The size of ``@pytest.mark.remat_budget(size)``, checked when the test starts.

    Raises:
        pytest.fail.Exception: no size, more than one, or one ``formatting.parse_bytes``
            does not read (the message says what is allowed).
    """
    from .formatting import parse_bytes

    if len(marker.args) != 1 or marker.kwargs:
        pytest.fail(f"@pytest.mark.remat_budget takes one size, e.g. remat_budget('2GiB'); got args {marker.args} "
                    f"kwargs {marker.kwargs}", pytrace=False)
    try:
        parse_bytes(marker.args[0])
    except ValueError as e:
        pytest.fail(f"@pytest.mark.remat_budget({marker.args[0]!r}): {e}", pytrace=False)
    return marker.args[0]


@pytest.fixture
def remat_peak(request: pytest.FixtureRequest) -> PeakChecker:
    """A PeakChecker: ``remat_peak.check(model, inputs, loss_fn, budget=..., baseline=...)``."""
    return PeakChecker(request)


__all__ = ["PeakChecker", "remat_peak"]
