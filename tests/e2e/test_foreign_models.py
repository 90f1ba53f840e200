"""``examples/foreign_models.py`` (issue 23 item 5): its row of a model the project was
not written against is the truth — traced, every Megatron setting predicted == measured
to the byte, gradients bitwise equal to the un-rewritten step — and a model that cannot
be traced is a row naming the reason, never a crash. The torchvision / timm rows need
the ``vision`` extra (skipped without it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from remat_pass.evaluate.session import Session
from remat_pass.recompute.schedule import distinct_megatron_schedules

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("foreign_models", ROOT / "examples" / "foreign_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_exact_row(d: dict) -> None:
    """Traced; the rows are the distinct Megatron settings of the stacks found; every
    row's predicted peak equals its measured peak; gradients bitwise equal."""
    assert d["status"] == "traced", d["reason"]
    expected = [s.provenance for s in distinct_megatron_schedules(tuple(s["num_layers"] for s in d["stacks"]))]
    assert [r["schedule"] for r in d["rows"]] == expected
    for r in d["rows"]:
        assert r["measured_peak_bytes"] is not None and r["predicted_peak_bytes"] == r["measured_peak_bytes"], r
        assert r["grads_equal"], r


@pytest.mark.slow
def test_opt_row_is_traced_and_exact(script):
    pytest.importorskip("transformers")
    d = script.model_row("opt")
    assert d["stacks"] == [{"path": "model.decoder.layers", "num_layers": 3}]
    assert_exact_row(d)
    assert script.exact_rows(d["rows"]) == len(d["rows"])


@pytest.mark.slow
def test_opt_plan_columns_fit_their_budget(script):
    pytest.importorskip("transformers")
    d = script.model_row("opt", plan=True)
    assert_exact_row(d)
    assert d["op_least_feasible_bytes"] <= d["op_budget_bytes"] <= d["unconstrained_bytes"]
    assert d["op_measured_bytes"] == d["op_predicted_bytes"] <= d["op_budget_bytes"]
    assert d["op_grads_equal"]
    assert d["op_least_feasible_bytes"] <= d["layer_least_feasible_bytes"] <= d["best_megatron_predicted_bytes"]


@pytest.mark.slow
def test_data_dependent_moe_is_traced_for_its_routing_and_exact(script):
    """transformers' eager experts loop (issue 23: was refused at nonzero) is traced
    specialized to the batch's routing; the session's notes give the tokens per expert."""
    pytest.importorskip("transformers")
    assert_exact_row(script.model_row("qwen3_moe_eager"))
    model, inputs, loss_fn, _ = script.MODELS["qwen3_moe_eager"][1]()
    notes = Session.create(model, inputs, loss_fn).joint.specialized
    routed = [n for n in notes if n.startswith("aten.nonzero at ") and "torch.where(expert_mask[expert_idx])" in n]
    assert len(routed) == 1 and "rows; the sizes that follow from it (e.g. the tokens routed to each expert)" in routed[0]


@pytest.mark.slow
def test_moe_bound_routing_is_exact_and_costs_at_least_the_batch_routing(script):
    """Qwen3-MoE's eager loop with its router bound (``routing.bound_routing``): every
    Megatron setting exact, gradients equal to eager's under that routing, no peak below
    the batch routing's."""
    pytest.importorskip("transformers")
    from remat_pass.graph.routing import bound_routing

    peaks = []
    for capacity in (None, 24):
        model, inputs, loss_fn, _ = script.MODELS["qwen3_moe_eager"][1]()
        session = Session.create(model if capacity is None else bound_routing(model, capacity), inputs, loss_fn)
        rows = [session.evaluate(s) for s in distinct_megatron_schedules(session.stack.layers_per_stack)]
        assert all(r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes for r in rows)
        assert all(r.max_grad_diff_vs_eager == 0.0 for r in rows)
        peaks.append([r.measured_peak_bytes for r in rows])
    assert all(b <= w for b, w in zip(*peaks)), peaks


@pytest.mark.slow
@pytest.mark.parametrize("name,package", [("tv_resnet18", "torchvision"), ("timm_vit_tiny", "timm")])
def test_vision_rows_are_traced_and_exact(script, name, package):
    pytest.importorskip(package)
    assert_exact_row(script.model_row(name))


def test_unknown_model_exits_2_naming_the_allowed(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.main(["--models", "opt,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "bloom" in err
