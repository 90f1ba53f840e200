"""`remat-pass sweep`: rows, JSON fields, progress, errors."""

from __future__ import annotations

import json

import pytest

from remat_pass.cli.main import main


@pytest.mark.slow
def test_sweep_json_every_row(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = main(["sweep", "--model", "remat_pass.models:tiny_gpt", "--batch", "2", "--seq", "16",
               "--layers", "3", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "[ 8/8] block(N=3)" in captured.err  # progress: 1 + 3 + 4 rows
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["schedule"], r["recompute_num_layers"]) for r in rows] == (
        [("none", None)] + [("uniform", k) for k in (1, 2, 3)] + [("block", n) for n in range(4)]
    )
    for r in rows:
        assert r["grads_equal"] is True
        assert r["predicted_peak_bytes"] == r["measured_peak_bytes"]
        assert r["max_grad_diff_vs_eager"] < 1e-4
        for key in ("saved_activation_bytes", "recompute_flops", "peak_phase", "peak_layer", "pass_time_s"):
            assert key in r
    # the table on stdout has one line per row
    assert captured.out.count("uniform(K=") == 3 and captured.out.count("block(N=") == 4


def test_sweep_bad_model_spec(capsys):
    assert main(["sweep", "--model", "nocolon"]) == 2
    assert "module:factory" in capsys.readouterr().err


def test_sweep_factory_rejects_argument(capsys):
    assert main(["sweep", "--model", "remat_pass.models:linear_chain", "--seq", "4"]) == 2
    assert "seq" in capsys.readouterr().err


def test_sweep_no_layer_stack(capsys):
    rc = main(["sweep", "--model", "test_errors_factory:no_stack"])
    assert rc == 2
    assert "no layer stack" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _factory_module(tmp_path, monkeypatch):
    (tmp_path / "test_errors_factory.py").write_text(
        "import torch\n"
        "def no_stack():\n"
        "    m = torch.nn.Linear(4, 4)\n"
        "    return m, (torch.randn(2, 4),), lambda y: y.sum()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("argv, words", [
    (["--program", "eager", "--policy", "dots_saveable"], "--program eager does not go with --selective/--recompute-modules/--policy"),
    (["--reentrant"], "--reentrant goes with --program eager"),
])
def test_program_eager_refusals(argv, words, capsys):
    """What the eager program cannot do yet is refused before tracing, exit 2."""
    assert main(["sweep", "--model", "remat_pass.models:tiny_gpt", "--layers", "2", *argv]) == 2
    assert words in capsys.readouterr().err


def test_program_eager_on_the_meta_device_is_predicted_only(tmp_path, capsys):
    """``sweep --meta --program eager``: every row predicted, none run ("not run"), the
    note says so once for every setting; the JSON's eager rows (schema-valid) hold the
    same figures, measured null."""
    import json

    import jsonschema

    from remat_pass.report.documents import document_schema

    argv = ["sweep", "--model", "remat_pass.models:tiny_gpt", "--layers", "2", "--batch", "2", "--seq", "16",
            "--meta", "--program", "eager", "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("the eager program"):out.index("rewrite - eager at each")].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[3:] if line.strip() and not line.startswith("note")}
    assert {"none", "uniform(K=1)", "uniform(K=2)", "block(N=1)"} <= set(rows)
    assert all(r[1:3] == ["not", "run"] and float(r[0]) > 0 for r in rows.values())
    assert "note (eager program, every setting): recorded without weights" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    jsonschema.validate(doc, document_schema("remat-pass-sweep"))
    eager = {r["schedule"]: r for r in doc["eager_program"]}
    assert set(eager) == set(rows)
    assert all(r["measured_peak_bytes"] is None and f"{r['predicted_peak_bytes'] / 2**20:.2f}" == rows[s][0]
               for s, r in eager.items())
    # the difference of the two peaks, by the op that allocated the bytes live at each, sums to it
    assert all(sum(r["difference_by_op"].values()) == r["rewrite_predicted_peak_bytes"] - r["predicted_peak_bytes"]
               for r in eager.values())
    assert all(f"  {s}: " in out[out.index("rewrite - eager at each"):] for s in eager)
    # and by cause (liveness.eager_program.peak_cause), every cause named
    assert all(set(r["difference_by_cause"]) == {"in-place reuse", "copies", "held outputs", "dropout masks", "the rest"}
               and sum(r["difference_by_cause"].values()) == r["rewrite_predicted_peak_bytes"] - r["predicted_peak_bytes"]
               for r in eager.values())
    assert "by cause" in out


@pytest.mark.slow
def test_program_eager_prints_the_eager_program_beside_the_rewrite(capsys):
    """``sweep --program eager``: a row per setting (uniform K=2: one checkpoint around both
    layers) with the eager program
    predicted and measured (equal), the rewrite's prediction and the difference."""
    argv = ["sweep", "--model", "remat_pass.models:tiny_gpt", "--layers", "2", "--batch", "2", "--seq", "16",
            "--program", "eager", "--reentrant"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("the eager program"):out.index("rewrite - eager at each")].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[3:] if line.strip()}
    assert set(rows) == {"none", "uniform(K=1)", "uniform(K=2)", "block(N=0)", "block(N=1)", "block(N=2)"}
    assert all(r[0] == r[1] for r in rows.values())  # eager predicted == measured (MiB)


def test_program_eager_for_the_cuda_target_is_predicted_only(tmp_path, capsys):
    """``sweep --target cuda --program eager``: every eager row predicted in the GPU's
    memory (``evaluate.eager_program.ON_CUDA``), none run, its by-cause terms summing to
    the difference."""
    import json

    from remat_pass.evaluate.eager_program import ON_CUDA

    argv = ["sweep", "--model", "remat_pass.models:tiny_gpt", "--layers", "2", "--batch", "2", "--seq", "16",
            "--target", "cuda", "--program", "eager", "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"note (eager program, every setting): {ON_CUDA}" in out
    eager = json.loads((tmp_path / "s.json").read_text())["eager_program"]
    assert len(eager) >= 4 and all(r["measured_peak_bytes"] is None and ON_CUDA in r["notes"] for r in eager)
    assert all(sum(r["difference_by_cause"].values()) == r["rewrite_predicted_peak_bytes"] - r["predicted_peak_bytes"]
               for r in eager)
