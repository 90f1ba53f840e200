"""The CI gate: size parsing, budget and baseline checks, explanations, exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from remat_pass.recompute import schedule
from remat_pass.cli.main import EXIT_USAGE, main
from remat_pass.report.gate import (
    EXIT_FAILED,
    EXIT_OK,
    check_budget,
    check_regression,
    explain_growth,
    run_gate,
)
from remat_pass.formatting import fmt_bytes, parse_bytes, parse_fraction
from remat_pass.report.schedule_report import report_json, reports_document, write_json
from remat_pass.evaluate.session import Session

CHAIN = ["--model", "remat_pass.models:linear_chain", "--layers", "3"]


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * 2**30), ("2 GiB", 2 * 2**30), ("2gib", 2 * 2**30), ("2G", 2 * 2**30),
    ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("10KB", 10_000), ("3KiB", 3 * 1024),
    ("300000", 300_000), ("7B", 7), (".5MiB", 2**19), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 apples", "-1GiB", "1e9", "2GiBs", -5])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("text,expected", [("5%", 0.05), ("0.05", 0.05), ("0%", 0.0), ("12.5 %", 0.125), (0.1, 0.1)])
def test_parse_fraction(text, expected):
    assert parse_fraction(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["five", "5%%", "-5%", "%"])
def test_parse_fraction_rejects(text):
    with pytest.raises(ValueError):
        parse_fraction(text)


class GeluLinear(torch.nn.Linear):
    """A Linear followed by GELU: the same parameters, one more saved activation."""

    def forward(self, x):
        return torch.nn.functional.gelu(super().forward(x))


def gelu_chain(batch: int = 137, width: int = 256, layers: int = 8, seed: int = 0):
    """``models.linear_chain`` with a GELU after every layer: same parameters (same
    seed), same input, larger activations (a regression of the same model)."""
    from remat_pass.models import linear_chain

    model, inputs, loss_fn = linear_chain(batch=batch, width=width, layers=layers, seed=seed)
    torch.manual_seed(seed)
    grown = torch.nn.Sequential(*[GeluLinear(width, width) for _ in range(layers)])
    grown.load_state_dict(model.state_dict())
    return grown, inputs, loss_fn


def chain_report(batch: int, sched=None) -> dict:
    from remat_pass.models import linear_chain

    session = Session.create(*linear_chain(batch=batch, width=128, layers=3))
    step, report, _ = session.prepare(sched or schedule.none(3))
    return report_json(report, step)


@pytest.fixture(scope="module")
def small():
    return chain_report(64)


@pytest.fixture(scope="module")
def large():
    return chain_report(96)


def test_budget_boundary(small):
    peak = small["peak_bytes"]
    assert check_budget(small, peak).ok
    failed = check_budget(small, peak - 1)
    assert not failed.ok and "EXCEEDS" in failed.headline
    text = "\n".join(failed.details)
    assert small["peak"]["node"] in text and small["live_at_peak"][0]["name"] in text
    assert run_gate([small], budget_bytes=peak).exit_code == EXIT_OK
    assert run_gate([small], budget_bytes=peak - 1).exit_code == EXIT_FAILED


def test_regression_limit_boundary(small, large):
    growth = large["peak_bytes"] / small["peak_bytes"] - 1
    assert growth > 0
    assert check_regression(large, small, growth * 1.001).ok
    failed = check_regression(large, small, growth * 0.999)
    assert not failed.ok and "REGRESSION" in failed.headline
    assert check_regression(small, small, 0.0).ok  # identical report: no growth


def test_explanation_names_the_tensors_that_grew(small, large):
    lines = explain_growth(large, small)
    text = "\n".join(lines)
    # the tensor live at the peak with the largest growth, computed from the two reports
    old = {(t["layer"], t["name"]): t["bytes"] for t in small["live_at_peak"]}
    growth = {(t["layer"], t["name"]): t["bytes"] - old.get((t["layer"], t["name"]), 0) for t in large["live_at_peak"]}
    (layer, name), grew = max(growth.items(), key=lambda kv: (kv[1], kv[0][1]))
    assert grew > 0
    assert f"  {name} (layer {'outer' if layer is None else layer}):" in text
    # per-layer change lines carry the exact difference
    for key, now in large["live_at_peak_by_layer"].items():
        before = small["live_at_peak_by_layer"].get(key, 0)
        if now != before:
            assert f"({'+' if now > before else '-'}{fmt_bytes(abs(now - before))})" in text
    assert "saved activations:" in text


def test_missing_schedule_in_baseline_fails(small):
    other = chain_report(64, schedule.uniform(1, 3))
    result = run_gate([other], baseline=[small])
    assert result.exit_code == EXIT_FAILED and "no baseline for this schedule" in result.text()
    with pytest.raises(ValueError):
        run_gate([small])  # neither budget nor baseline


def test_cli_check_exit_codes(tmp_path, capsys, small):
    base = tmp_path / "base.json"
    # a baseline of the smaller batch, written by the report command
    assert main(["report", *CHAIN, "--batch", "64", "--all-schedules", "--json", str(base)]) == EXIT_OK
    capsys.readouterr()
    # same model, same graph: passes at 0 %
    assert main(["check", *CHAIN, "--batch", "64", "--all-schedules", "--baseline", str(base)]) == EXIT_OK
    assert "8 of 8 checks passed" in capsys.readouterr().out
    # a larger batch is another model (other inputs): refused, saying what differs
    assert main(["check", *CHAIN, "--batch", "96", "--baseline", str(base), "--max-regression", "100%"]) == EXIT_USAGE
    assert "the baseline is of another model" in capsys.readouterr().err
    # same parameters and inputs, more activation memory (a GELU after every Linear):
    # fails with an explanation, passes under a generous limit
    # (at batch 1024 the activations, not the weight gradients, make the peak)
    wide = tmp_path / "wide.json"
    assert main(["report", *CHAIN, "--batch", "1024", "--json", str(wide)]) == EXIT_OK
    capsys.readouterr()
    grown = ["--model", "tests.report.test_gate:gelu_chain", "--layers", "3", "--batch", "1024"]
    assert main(["check", *grown, "--baseline", str(wide), "--max-regression", "1%"]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "new or larger" in out and "layer" in out
    assert main(["check", *grown, "--baseline", str(wide), "--max-regression", "100%"]) == EXIT_OK
    capsys.readouterr()
    # budget: the predicted peak of `none` itself passes, one byte less fails
    peak = json.loads(base.read_text())["reports"][0]["peak_bytes"]
    assert main(["check", *CHAIN, "--batch", "64", "--budget", str(peak)]) == EXIT_OK
    assert main(["check", *CHAIN, "--batch", "64", "--budget", str(peak - 1)]) == EXIT_FAILED
    assert "EXCEEDS the budget" in capsys.readouterr().out
    # a schedule the baseline lacks
    write_json(tmp_path / "none_only.json", reports_document([small]))
    assert main(["check", *CHAIN, "--batch", "64", "--schedule", "uniform", "--recompute-num-layers", "2",
                 "--baseline", str(tmp_path / "none_only.json")]) == EXIT_FAILED
    capsys.readouterr()


def test_cli_check_saved_report_and_usage_errors(tmp_path, capsys, small):
    write_json(tmp_path / "r.json", small)
    md = tmp_path / "summary.md"
    assert main(["check", "--report", str(tmp_path / "r.json"), "--budget", "1GiB", "--markdown", str(md)]) == EXIT_OK
    assert md.read_text().startswith("### remat-pass check passed")
    assert main(["check", "--report", str(tmp_path / "r.json"), "--budget", "1KiB"]) == EXIT_FAILED
    assert main(["check", "--report", str(tmp_path / "r.json"), "--budget", "lots"]) == EXIT_USAGE
    assert "not a number of bytes" in capsys.readouterr().err
    assert main(["check", "--report", str(tmp_path / "r.json")]) == EXIT_USAGE
    assert main(["check", "--report", str(tmp_path / "r.json"), "--baseline", str(tmp_path / "r.json"),
                 "--max-regression", "x"]) == EXIT_USAGE
    assert main(["check", "--report", str(tmp_path / "nope.json"), "--budget", "1GiB"]) == EXIT_USAGE
