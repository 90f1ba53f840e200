"""Training-mode BatchNorm (buffer writes, issue 23) through the command line: sweep,
report and check run on a ResNet-like stack in train mode, every row predicted ==
measured with gradients bitwise equal."""

from __future__ import annotations

import json

import pytest
from remat_pass.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "conv_models:tiny_resnet_train"


@pytest.mark.slow
def test_sweep_report_check_of_a_batchnorm_train_step(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--model", MODEL, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8  # none, uniform K=1..3, block N=0..3
    for r in rows:
        assert r["grads_equal"] is True and r["predicted_peak_bytes"] == r["measured_peak_bytes"], r["provenance"]
    report = tmp_path / "report.json"
    assert main(["report", "--model", MODEL, "--measure", "--json", str(report)]) == 0
    assert "0 of" in capsys.readouterr().out  # "... 0 of N steps differ"
    peak = json.loads(report.read_text())["peak_bytes"]
    assert peak == rows[0]["measured_peak_bytes"]
    assert main(["check", "--model", MODEL, "--budget", str(peak)]) == 0
    assert main(["check", "--model", MODEL, "--budget", str(peak - 1)]) == 1
