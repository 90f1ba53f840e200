"""Data-dependent scalars (``.item()``: ``aten._local_scalar_dense``, issue 23): a step
with real values is traced specialized to its batch's values and says so; a fake step,
or an op whose output shape depends on data, is refused naming the op and the Python
line that called it."""

from __future__ import annotations

import json

import pytest
import torch

import scalar_models
from remat_pass.cli.main import main
from remat_pass.errors import UnsupportedGraph
from remat_pass.evaluate.session import Session
from remat_pass.graph.fake_trace import trace_joint_fake
from remat_pass.graph.trace import trace_joint
from remat_pass.recompute import schedule as schedules

pytestmark = pytest.mark.usefixtures("one_thread")


def _line_of(text: str) -> int:
    """The line of ``scalar_models.py`` that holds ``text``."""
    lines = open(scalar_models.__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def test_item_values_specialize_the_graph_and_are_named_with_their_line():
    model, inputs, loss_fn = scalar_models.branchy(layers=3)
    j = trace_joint(model, inputs, loss_fn)
    branch, count = _line_of("y.mean().item()"), _line_of("(x > 0).sum().item()")
    assert len(j.specialized) == 2  # one line per op and Python line, each with its 3 values
    assert all(f"scalar_models.py:{line} (in forward)" in s and "3 calls giving" in s
               for s, line in zip(j.specialized, [branch, count]))
    assert all(n.target is not torch.ops.aten._local_scalar_dense.default for n in j.gm.graph.nodes)
    assert any("holds for this batch" in n for n in j.notes)


def test_another_batch_takes_another_path():
    model, (x,), loss_fn = scalar_models.branchy(layers=1)
    ops = []
    for sign in (1, -1):
        with torch.no_grad():
            model[0].fc.bias.fill_(10.0 * sign)  # the mean's sign picks relu or tanh
        j = trace_joint(model, (x,), loss_fn)
        ops.append({n.target for n in j.gm.graph.nodes if n.op == "call_function"})
    assert torch.ops.aten.relu.default in ops[0] - ops[1]
    assert torch.ops.aten.tanh.default in ops[1] - ops[0]


def test_recording_leaves_the_rng_state_alone():
    model, inputs, loss_fn = scalar_models.branchy(layers=2)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    trace_joint(model, inputs, loss_fn)
    assert torch.equal(torch.rand(3), expected)


def test_specialized_step_sweeps_exactly():
    model, inputs, loss_fn = scalar_models.branchy(layers=3)
    session = Session.create(model, inputs, loss_fn)
    for sch in schedules.distinct_megatron_schedules(3):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
        assert r.max_grad_diff_vs_eager == 0.0


def test_fake_trace_refusal_names_the_op_and_the_python_line():
    model, inputs, loss_fn = scalar_models.branchy(layers=2)
    line = _line_of("y.mean().item()")
    with pytest.raises(UnsupportedGraph, match=rf"_local_scalar_dense.*scalar_models\.py:{line} \(in forward\)"):
        trace_joint_fake(model, inputs, loss_fn)


def test_boolean_mask_indexing_is_specialized_to_the_rows_it_selects_and_sweeps_exactly():
    model = torch.nn.Sequential(scalar_models.MaskSelect(), scalar_models.MaskSelect())
    x = torch.randn(2, scalar_models.D, generator=torch.Generator().manual_seed(3))
    session = Session.create(model, (x,), lambda y: y.sum())
    line = _line_of("y[y > 0]")
    selected = []
    h = x
    with torch.no_grad():
        for layer in model:
            selected.append(int((layer.fc(h) > 0).sum()))
            h = layer(h)
    (note,) = session.joint.specialized
    assert f"aten.index at {scalar_models.__file__}:{line} (in forward)" in note
    assert f"2 calls giving {selected[0]}, {selected[1]} elements selected by a boolean mask" in note
    for sch in schedules.distinct_megatron_schedules(2):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
        assert r.max_grad_diff_vs_eager == 0.0


def test_moe_experts_loop_is_specialized_to_its_routing_and_sweeps_exactly():
    """The eager experts loop (nonzero over the routing, issue 23): traced for this
    batch's tokens per expert, which the notes give; another batch routes otherwise and
    gives another graph; every schedule exact, gradients those of eager PyTorch."""
    model, inputs, loss_fn = scalar_models.moe(layers=3)
    session = Session.create(model, inputs, loss_fn)
    line = _line_of("slot, token = torch.where(mask[e])")
    rows = [n for n in session.joint.specialized if f"aten.nonzero at {scalar_models.__file__}:{line}" in n]
    assert len(rows) == 1 and "rows; the sizes that follow from it" in rows[0]
    counts = [int(c) for c in rows[0].split("calls giving ")[1].split(" rows")[0].split(", ")]
    assert sum(counts) == 3 * 2 * 8 * 2  # layers x tokens x top-2: every token routed twice per layer
    for sch in schedules.distinct_megatron_schedules(3):
        r = session.evaluate(sch)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, sch.provenance
        assert r.max_grad_diff_vs_eager == 0.0
    other = trace_joint(*scalar_models.moe(layers=3, seed=2))
    assert other.specialized != session.joint.specialized


def test_a_scalar_asked_for_only_inside_an_eager_op_is_not_replayed():
    """one_hot asks for its input's min and max (.item()) when it runs eagerly, not on
    fake tensors: those values are skipped, and not named as specializations."""
    model, inputs, loss_fn = scalar_models.moe(layers=1)
    j = trace_joint(model, inputs, loss_fn)
    line = _line_of("one_hot(chosen")
    assert not any(f"scalar_models.py:{line} " in n for n in j.specialized)


def test_data_dependent_shape_refusal_names_the_op_and_the_python_line():
    model = torch.nn.Sequential(scalar_models.MaskedSelect(), scalar_models.MaskedSelect())
    line = _line_of("torch.masked_select(y, y > 0)")
    with pytest.raises(UnsupportedGraph, match=rf"aten\.masked_select.*scalar_models\.py:{line} \(in forward\)"
                                               r".*Fix: its output's shape depends on the data"):
        trace_joint(model, (torch.randn(2, scalar_models.D),), lambda y: y.sum())


def test_fake_trace_of_a_data_dependent_shape_is_refused_naming_the_line():
    model = torch.nn.Sequential(scalar_models.MaskSelect(), scalar_models.MaskSelect())
    line = _line_of("y[y > 0]")
    with pytest.raises(UnsupportedGraph, match=rf"scalar_models\.py:{line} \(in forward\)"):
        trace_joint_fake(model, (torch.randn(2, scalar_models.D),), lambda y: y.sum())


@pytest.mark.slow
def test_sweep_says_the_graph_holds_for_this_batch(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--model", "scalar_models:branchy", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["notes"]) == 2 and all("holds for this batch" in n for n in data["notes"])
    assert capsys.readouterr().err.count("note: the graph holds for this batch") == 2
    assert all(r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in data["rows"])


@pytest.mark.parametrize("fake", [False, True])
def test_flex_attention_is_refused_naming_the_line_and_the_alternative(fake):
    """flex_attention has no backward on CPU (torch 2.13) and no fake-tensor eager path:
    refused naming it, the user's line and scaled_dot_product_attention."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = torch.nn.Sequential(scalar_models.FlexAttention(), scalar_models.FlexAttention())
    line = _line_of("flex_attention(q, k, v)")
    trace = trace_joint_fake if fake else trace_joint
    with pytest.raises(UnsupportedGraph, match=rf"flex_attention \(called at .*scalar_models\.py:{line} "
                                               r"\(in forward\).*scaled_dot_product_attention"):
        trace(model, (torch.randn(2, 4, scalar_models.D),), lambda y: y.sum())


class _EagerOnlyItem(torch.nn.Module):
    """Asks for one more .item() eagerly than while tracing (a TracingContext is active)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(scalar_models.D, scalar_models.D)

    def forward(self, x):
        from torch._guards import TracingContext

        if TracingContext.try_get() is None:
            x = x * float(x.sum().item() > 0)  # eager only
        return self.fc(x) * x.mean().item()


def test_a_scalar_asked_for_at_another_line_than_recorded_is_refused_naming_both():
    model = torch.nn.Sequential(_EagerOnlyItem(), _EagerOnlyItem())
    with pytest.raises(UnsupportedGraph, match=r"test_data_scalars\.py:\d+ \(in forward\).*x\.mean\(\)\.item\(\).*"
                                               r"eager run asked for it at .*test_data_scalars\.py:\d+ \(in forward\)"):
        trace_joint(model, (torch.randn(2, scalar_models.D),), lambda y: y.sum())
