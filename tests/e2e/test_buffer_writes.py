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


@pytest.mark.slow
def test_resnet18_layout_in_train_mode_sweeps_exactly():
    """torchvision's ResNet-18 layout (four stages of two BasicBlocks, downsampling
    shortcuts, 20 BatchNorm2d in train mode; the issue's 'ResNet in training mode is
    refused'), its four stages as stacks: every schedule predicted == measured, gradients
    bitwise equal, the running statistics after the step equal eager's."""
    import copy

    import torch

    from conv_models import resnet18_like_train
    from remat_pass.evaluate.session import Session
    from remat_pass.measure.run import measure_step
    from remat_pass.recompute import schedule as schedules

    model, inputs, loss_fn = resnet18_like_train()
    eager = copy.deepcopy(model)
    loss_fn(eager(*inputs)).backward()
    session = Session.create(model, inputs, loss_fn)
    assert [s.path for s in session.stack.stacks] == ["layer1", "layer2", "layer3", "layer4"]
    for sch in schedules.distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
    m = measure_step(session.prepare(sch)[0], session.joint)
    assert len(m.buffers) == 3 * sum(isinstance(x, torch.nn.BatchNorm2d) for x in model.modules())
    assert all(torch.equal(m.buffers[n], b) for n, b in eager.named_buffers())
