"""``remat-pass plan`` and ``remat-pass model`` on a tiny GPT-2."""

from __future__ import annotations

import json

import pytest

from remat_pass.cli.main import main
from remat_pass.errors import InfeasibleBudget  # noqa: F401  (the error plan reports)

pytest.importorskip("transformers")

TINY = ["--layers", "2", "--seq", "32", "--batch", "2"]


@pytest.mark.slow
def test_plan_json_and_infeasible(tmp_path, capsys):
    big = tmp_path / "big.json"
    assert main(["plan", *TINY, "--budget", "1GiB", "--json", str(big)]) == 0
    out = capsys.readouterr().out
    assert "schedule" in out and "measured peak" in out and "solve time" in out
    d = json.loads(big.read_text())
    for key in ("budget_bytes", "schedule", "predicted_peak_bytes", "measured_peak_bytes",
                "recompute_flops", "grads_equal", "least_feasible_peak_bytes",
                "unconstrained_peak_bytes"):
        assert key in d, key
    assert d["budget_bytes"] == 2**30 and d["grads_equal"] is True
    # a 1 GiB budget fits everything: nothing is recomputed
    assert d["recompute_flops"] == 0 and d["measured_peak_bytes"] == d["unconstrained_peak_bytes"]
    # the least feasible peak as a budget: fits, within 3 %
    tight = tmp_path / "tight.json"
    assert main(["plan", *TINY, "--budget", str(d["least_feasible_peak_bytes"]), "--json", str(tight)]) == 0
    t = json.loads(tight.read_text())
    assert t["measured_peak_bytes"] <= 1.03 * t["budget_bytes"]
    assert t["predicted_peak_bytes"] <= t["budget_bytes"]
    # below it: an error naming that least peak
    assert main(["plan", *TINY, "--budget", str(d["least_feasible_peak_bytes"] - 1)]) == 2
    assert str(d["least_feasible_peak_bytes"]) in capsys.readouterr().err


@pytest.mark.slow  # more than 4 s on 2 cores
def test_plan_max_batch(tmp_path, capsys):
    path = tmp_path / "mb.json"
    assert main(["plan", *TINY, "--budget", "64MiB", "--max-batch", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["schedule"] for r in rows} >= {"none", "uniform(K=1)", "block(N=2)"}
    for r in rows:
        assert r["batch"] >= 1 and r["peak_bytes"] <= 64 * 2**20 < r["next_peak_bytes"]
    assert "largest batch" in capsys.readouterr().out


@pytest.mark.slow  # more than 4 s on 2 cores
def test_model_prints_formulas(capsys):
    assert main(["model", *TINY]) == 0
    out = capsys.readouterr().out
    assert "peak_uniform(K)" in out and "peak_block(N)" in out and "\\mathrm{peak}" in out
    assert "batch" in out and "seq" in out


def test_an_op_level_plan_of_a_meta_step_says_predicted_only(capsys):
    """`plan --granularity op --meta` printed "gradients DIFFER by 0" and "measured peak -
    (not reported: the gradients differ)" for a step that was never run."""
    argv = ["plan", "--model", "remat_pass.models:tiny_gpt", "--layers", "2", "--no-calibrate", "--meta",
            "--granularity", "op", "--budget", "100MiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gradients          - (predicted only: nothing was run)" in out, out
    assert "measured peak      - (predicted only: nothing was run)" in out, out
    assert "DIFFER" not in out, out


def test_an_op_level_plan_from_a_template_is_the_plan_of_the_whole_trace(tmp_path, capsys):
    """`plan --granularity op --meta` analyses a stack of alike layers from a 4-layer
    template (plan.op_reuse): at a budget between the least and the unconstrained peak,
    its plan (options, predicted peak, recompute) is the whole trace's
    (`--trace-all-layers`); the JSON says nodes are not named (null)."""
    import jsonschema

    from remat_pass.report.documents import document_schema

    config = tmp_path / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "vocab_size": 64, "max_position_embeddings": 64}))
    base = ["plan", "--config", str(config), "--batch", "2", "--seq", "32", "--no-calibrate", "--meta",
            "--granularity", "op"]

    def run(budget: str, *extra: str) -> dict:
        path = tmp_path / f"p{len(extra)}.json"
        assert main([*base, "--budget", budget, "--json", str(path), *extra]) == 0
        doc = json.loads(path.read_text())
        jsonschema.validate(doc, document_schema("remat-pass-plan"))
        return doc

    first = run("1GiB", "--trace-all-layers")
    budget = (first["least_feasible_peak_bytes"] + first["unconstrained_peak_bytes"]) // 2
    whole, reused = run(str(budget), "--trace-all-layers"), run(str(budget))
    out = capsys.readouterr().out
    assert "assembled from a 4-layer template" in out, out
    assert reused["partition"]["saved"] is None and whole["partition"]["saved"]
    assert reused["predicted_peak_bytes"] == whole["predicted_peak_bytes"] <= budget
    for key in ("options", "groups"):
        assert reused["partition"][key] == whole["partition"][key]
    assert reused["recompute_cost"] == whole["recompute_cost"] > 0 and any(reused["partition"]["options"])
    assert reused["recompute_bytes_moved"] == whole["recompute_bytes_moved"]
    assert reused["least_feasible_peak_bytes"] == whole["least_feasible_peak_bytes"]
