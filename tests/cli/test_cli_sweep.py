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
