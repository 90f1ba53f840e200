"""A step that writes buffers in place (BatchNorm2d in train mode, issue 23), measured:
predicted == measured peak under every schedule, gradients bitwise equal to the
un-rewritten graph, the buffers' values after the step equal eager's, and the model's
own buffers left as they were."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from conv_models import tiny_resnet_train
from remat_pass.evaluate.session import Session
from remat_pass.measure.run import eager_grads, measure_step
from remat_pass.recompute import schedule as schedules

pytestmark = pytest.mark.usefixtures("one_thread")


def test_batchnorm_train_step_exact_under_every_schedule():
    model, inputs, loss_fn = tiny_resnet_train(layers=3)
    eager = copy.deepcopy(model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    loss_fn(eager(*inputs)).backward()
    session = Session.create(model, inputs, loss_fn)
    assert session.stack.path == "layers" and session.stack.num_layers == 3
    for sch in schedules.distinct_megatron_schedules(3):
        r = session.evaluate(sch)
        assert r.grads_equal, sch.provenance
        assert r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
        m = measure_step(session.prepare(sch)[0], session.joint)
        assert m.buffers.keys() == dict(eager.named_buffers()).keys()
        for name, value in eager.named_buffers():
            assert torch.equal(m.buffers[name], value), (sch.provenance, name)
    for name, value in model.named_buffers():  # analysing the step never trains the model
        assert torch.equal(value, before[name]), name


def test_eager_grads_leave_the_buffers_as_they_were():
    model, inputs, loss_fn = tiny_resnet_train(layers=1)
    before = {n: b.clone() for n, b in model.named_buffers()}
    eager_grads(model, inputs, loss_fn)
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())


def test_the_buffers_new_values_are_counted_in_the_peak():
    """The new running statistics are forward outputs held to the step's end: their
    storages (a new num_batches_tracked, the running mean and variance BatchNorm's
    functional op returns) are live at the (backward) peak, and the peak with them is the
    measured one."""
    model, inputs, loss_fn = tiny_resnet_train(layers=2)
    session = Session.create(model, inputs, loss_fn)
    step, report, _ = session.prepare(schedules.none(2))
    out = list(step.forward.graph.output_node().args[0])[1: step.num_fwd_outputs]
    written = sum(b.numel() * b.element_size() for b in model.buffers())
    assert sum(n.meta["val"].untyped_storage().nbytes() for n in out) == written
    assert report.peak_phase == "backward"
    live = [t.name for t in report.live_at_peak]  # a tuple's elements under its op's name
    allocated_by = [n.args[0].name if n.target is operator.getitem else n.name for n in out]
    assert all(live.count(a) >= allocated_by.count(a) for a in allocated_by)
    assert report.peak_bytes == session.evaluate(schedules.none(2)).measured_peak_bytes
