"""``benchmarks/op_level.py``: a budget the op-level planner cannot meet (PyTorch's
partitioner measured below this project's least feasible peak) is a recorded row with
the reason, never a traceback, also when torch.compile wraps the planner's error."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from remat_pass.errors import InfeasibleBudget

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "op_level.py"


@pytest.fixture(scope="module")
def op_level():
    spec = importlib.util.spec_from_file_location("op_level_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wrapped(budget: int, least: int) -> BackendCompilerFailed:
    inner = InfeasibleBudget(f"no schedule fits {budget}", least_feasible_peak_bytes=least, budget_bytes=budget)
    try:
        try:
            raise inner
        except InfeasibleBudget as e:
            raise BackendCompilerFailed(lambda: None, e, None) from e
    except BackendCompilerFailed as e:
        return e


def test_an_unplannable_budget_is_a_recorded_row(op_level, monkeypatch):
    grads = [torch.zeros(2)]
    fake = {"peak_bytes": 1_023_752, "step_s": 0.01, "grads": grads, "recompute_flops": 0,
            "recompute_bytes_moved": 0, "recomputed_nodes": 0, "graphs": 1}
    monkeypatch.setattr(op_level, "run", lambda *a, **k: fake)
    monkeypatch.setattr(op_level, "pytorch_row", lambda *a, **k: fake)
    monkeypatch.setattr(op_level, "print_tables", lambda *a, **k: None)

    def remat_row(model, ids, repeats, **options):
        if "budget_bytes" in options:
            raise _wrapped(options["budget_bytes"], 1_036_356)
        return {**fake, "predicted_peak_bytes": 1, "saved_nodes": 0, "partition": "p"}

    monkeypatch.setattr(op_level, "remat_row", remat_row)
    args = argparse.Namespace(budgets=[0.8], repeats=1, flops_per_byte=8)
    rows = op_level.bench_model("tiny", torch.nn.Linear(2, 2), torch.zeros(1), "label", args)
    row = rows[0]
    assert isinstance(_wrapped(1, 2), BackendCompilerFailed)
    assert row["measured_peak_bytes"] is None and "1023752" in row["error"]
    assert op_level.planning_error(ValueError("x")) is None
