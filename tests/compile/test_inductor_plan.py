"""schedule='optimized' under compiler='inductor': planned against the step as Inductor's
code runs it (``steps.replan_step`` with the fx model shifted by what the code saves,
``steps.check_replan`` on the next step)."""

from __future__ import annotations

import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch

import remat_pass
from remat_pass.compile.graph import RematFallbackWarning
from remat_pass.compile.steps import INDUCTOR_ROUNDS, PendingCheck, check_replan
from remat_pass.errors import InfeasibleBudget
from remat_pass.measure.run import profiled_peak_cpu
from remat_pass.models import tiny_gpt

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor's CPU code needs a C++ compiler")


def _step(model, backend):
    """A compiled TinyGPT step (the loss inside the compiled function) and its inputs."""
    ids = torch.randint(0, model.tok.num_embeddings, (4, 128), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(lambda i: torch.nn.functional.cross_entropy(
        model(i).flatten(0, 1), i.roll(-1, 1).flatten()), backend=backend)
    return lambda: compiled(ids).backward()


def _measured_steps(model, step, n: int) -> list[int]:
    """The measured peak of each of ``n`` steps (``.grad`` None before each)."""
    peaks = []
    for _ in range(n):
        for p in model.parameters():
            p.grad = None
        peaks.append(profiled_peak_cpu(step)[0])
    return peaks


def _inductor_peak(model, schedule: str, n: int) -> tuple[int, int]:
    """The measured peak of a Megatron schedule under Inductor (third step) and its
    recompute FLOPs."""
    b = remat_pass.backend(schedule, n, compiler="inductor")
    peaks = _measured_steps(model, _step(model, b), 3)
    torch._dynamo.reset()
    return peaks[-1], b.reports[-1].memory.recompute_flops


@pytest.mark.slow
@needs_cxx
def test_inductor_optimized_fits_a_budget_below_the_fx_least():
    """A budget equal to uniform K=1's measured peak under Inductor: the fx model of the
    graph predicts every schedule above it (the compile used to refuse it with
    InfeasibleBudget), Inductor's code of the least feasible schedule fits; every step
    measures within the budget, as predicted from the code."""
    model, _, _ = tiny_gpt(batch=4)
    budget, _ = _inductor_peak(model, "uniform", 1)
    b = remat_pass.backend("optimized", budget_bytes=budget, compiler="inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematFallbackWarning)
        peaks = _measured_steps(model, _step(model, b), 3)
    assert b.reports[0].peak_bytes > budget  # the fx model's own figure
    assert max(peaks) <= budget
    report = b.step_report()
    assert report.model == "inductor" and report.peak_bytes == peaks[-1]


@pytest.mark.slow
@needs_cxx
def test_inductor_optimized_recomputes_no_more_than_a_fitting_megatron_schedule():
    """A budget equal to block N=4's measured peak under Inductor (recompute the first 4
    of 8 layers): the fx plan at that budget recomputes 5 layers; planned against
    Inductor's code (a plan per step, each from the saving read at the one before, at
    most ``INDUCTOR_ROUNDS``), the step recomputes no more FLOPs than block N=4 and
    measures within the budget, as predicted. (A step that checks a plan may be above
    the budget: the plan before it runs again from the next step.)"""
    model, _, _ = tiny_gpt(batch=4)
    budget, block_flops = _inductor_peak(model, "block", 4)
    b = remat_pass.backend("optimized", budget_bytes=budget, compiler="inductor")
    peaks = _measured_steps(model, _step(model, b), INDUCTOR_ROUNDS + 2)
    assert 2 <= len(b.reports) <= INDUCTOR_ROUNDS + 1
    assert b.reports[0].memory.recompute_flops > block_flops
    running = b.graph_states["0/0"].compiled.planned.report
    assert running.memory.recompute_flops <= block_flops
    assert peaks[-1] <= budget
    report = b.step_report()
    assert report.model == "inductor" and report.peak_bytes == peaks[-1]


def _pending(previous_peak: int) -> PendingCheck:
    return PendingCheck(("sig",), {"0/0": "first-step state"}, previous_peak, 1000)


def _ran(peak: int, sig=("sig",)):
    return SimpleNamespace(signature=lambda: sig), SimpleNamespace(peak_bytes=peak)


def test_check_replan_keeps_a_plan_that_fits_and_waits_for_its_signature():
    assert check_replan(_pending(90), *_ran(100), 100, "raise") is None
    assert check_replan(_pending(90), *_ran(500, ("other",)), 100, "raise") is None


def test_check_replan_goes_back_to_the_first_step_when_the_plan_is_above():
    assert check_replan(_pending(90), *_ran(101), 100, "raise") == {"0/0": "first-step state"}


def test_check_replan_refuses_when_neither_fits():
    with pytest.raises(InfeasibleBudget, match="least feasible peak is 101 bytes"):
        check_replan(_pending(120), *_ran(101), 100, "raise")
    with pytest.warns(RematFallbackWarning):
        assert check_replan(_pending(120), *_ran(101), 100, "fallback") is None
    with pytest.warns(RematFallbackWarning):
        assert check_replan(_pending(101), *_ran(120), 100, "fallback") == {"0/0": "first-step state"}
