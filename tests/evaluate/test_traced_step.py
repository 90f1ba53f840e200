"""The one builder of a traced step (``traced_step.trace_step``): a module, a factory
or a config; real, meta or fake; the target; layer reuse. ``Session.create``, the
workload, the pytest plugin and per-rank tracing all go through it, so one set of
options gives one graph whichever way it is asked for."""

from __future__ import annotations

import pytest
import torch

from remat_pass.errors import LayerStackNotFound
from remat_pass.evaluate.session import Session
from remat_pass.evaluate.traced_step import StepOptions, trace_step
from remat_pass.evaluate.workload import WorkloadOptions
from remat_pass.models.configs import ConfigError
from remat_pass.models.shipped import linear_chain
from remat_pass.recompute import schedule as schedules

FACTORY = "remat_pass.models:linear_chain"


def _targets(joint) -> list[str]:
    return [str(n.target) for n in joint.gm.graph.nodes]


def test_a_module_a_factory_and_session_create_give_one_graph():
    """The same step asked for as a module, as a factory spec (with its keyword
    arguments) and through ``Session.create``: node for node the same joint graph and
    layer stack, traced with weights."""
    module = trace_step(StepOptions(*linear_chain(batch=4, width=8, layers=3)))
    factory = trace_step(StepOptions(FACTORY, factory_kwargs={"batch": 4, "width": 8, "layers": 3}))
    session = Session.create(*linear_chain(batch=4, width=8, layers=3), calibration=None)
    for step in (module, factory):
        assert _targets(step.joint) == _targets(session.joint)
        assert step.stack.layers_per_stack == session.stack.layers_per_stack == (3,)
        assert not step.predicted_only and step.reuse is None
    assert factory.description == FACTORY


def test_meta_fake_and_the_cuda_target_trace_fake():
    """Without weights (``meta``), with ``fake`` or for the CUDA target the step is
    traced with fake tensors: the same graph as the real trace, predicted only, and
    its Session is never calibrated; the same peak as the real trace's."""
    real = trace_step(StepOptions(FACTORY, batch=4, layers=3, factory_kwargs={"width": 8}))
    meta = trace_step(StepOptions(FACTORY, batch=4, layers=3, meta=True, factory_kwargs={"width": 8}))
    fake = trace_step(StepOptions(*linear_chain(batch=4, width=8, layers=3), fake=True))
    cuda = trace_step(StepOptions(*linear_chain(batch=4, width=8, layers=3), target="cuda"))
    assert not real.predicted_only
    for step in (meta, fake, cuda):
        assert step.predicted_only and _targets(step.joint) == _targets(real.joint)
        assert Session.of_step(step).calibrator is None
    none = schedules.none(3)
    peaks = {Session.of_step(s, calibration=None).report(none).peak_bytes for s in (real, meta, fake)}
    assert len(peaks) == 1, peaks


def test_options_are_checked_before_tracing():
    """An unknown target or GPU, and a model without a layer stack, are refused before
    anything is traced."""
    with pytest.raises(ConfigError, match="target 'tpu'"):
        trace_step(StepOptions(FACTORY, target="tpu"))
    with pytest.raises(ConfigError, match="gpu 'z80'"):
        trace_step(StepOptions(FACTORY, gpu="z80"))
    with pytest.raises(LayerStackNotFound):
        trace_step(StepOptions(torch.nn.Linear(4, 4), (torch.randn(2, 4),), lambda y: y.sum()))


def test_the_workload_describes_its_step_as_step_options():
    """The command line's options map onto the builder's one for one (layer reuse
    unless every layer is traced)."""
    o = WorkloadOptions(model=FACTORY, meta=True, dtype="bfloat16", batch=2, seq=8, layers=3, stack=("0",),
                        target="cuda", gpu="a100", seed=3, allocator="cuda")
    s = o.step_options()
    assert (s.model, s.meta, s.dtype, s.batch, s.seq, s.layers, s.stack, s.target, s.gpu, s.seed, s.allocator) == (
        FACTORY, True, "bfloat16", 2, 8, 3, ("0",), "cuda", "a100", 3, "cuda")
    assert s.reuse_layers and not WorkloadOptions(trace_all_layers=True).step_options().reuse_layers
