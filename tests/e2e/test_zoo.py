"""Sweep every Megatron schedule over every zoo model: exact gradients and peaks, or a clear refusal."""

from __future__ import annotations

import pytest
import torch

from remat_pass.recompute import schedule as schedules
from remat_pass.errors import InvalidSchedule
from remat_pass.evaluate.session import Session
from zoo import ZOO
from zoo.common import ZooEntry, stack, x
from zoo.ops import SDPA


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def own_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False))


def assert_own_parameters(model: torch.nn.Module, params: list[tuple[str, torch.Tensor]]) -> None:
    """Tracing (or refusing) never replaces the model's own parameters."""
    after = own_parameters(model)
    assert [n for n, _ in after] == [n for n, _ in params] and all(
        p is q for (_, p), (_, q) in zip(after, params)
    ), "tracing replaced the model's own parameters"


def zoo_params() -> list:
    """One pytest param per entry. Entries whose op scratch depends on the CPU model
    and thread count (LayerNorm backward, matrix_exp, BatchNorm eval, conv and group
    norm, CPU flash attention, bf16 / fp16 matmuls) pass through calibration: no
    figure in a test depends on the machine."""
    return [pytest.param(e, id=e.name) for e in ZOO]


@pytest.mark.parametrize("entry", zoo_params())
def test_zoo(entry: ZooEntry):
    """For every distinct Megatron schedule: gradients bitwise equal to the un-rewritten
    joint graph, predicted peak == measured peak, gradients within the entry's tolerance of
    eager autograd, no layer silently left empty; or, for an entry the pass refuses, the
    RematError (and message) it names."""
    for module in entry.requires:
        pytest.importorskip(module)
    model, inputs, loss_fn = entry.build()
    params = own_parameters(model)
    if entry.refusal is not None:
        with pytest.raises(entry.refusal.error, match=entry.refusal.match) as info:
            Session.create(model, inputs, loss_fn, layers=entry.layers)
        assert str(info.value), "a RematError without a message"
        assert_own_parameters(model, params)
        return

    torch.manual_seed(0)
    session = Session.create(model, inputs, loss_fn, layers=entry.layers)
    assert_own_parameters(model, params)

    L = session.stack.num_layers
    if entry.num_layers is not None:
        assert L == entry.num_layers, f"stack {session.stack.path!r} has L={L}, expected {entry.num_layers}"
    if entry.expect_stack_path is not None:
        assert session.stack.path == entry.expect_stack_path, (
            f"stack found at {session.stack.path!r}, expected {entry.expect_stack_path!r}"
        )
    empty = [i for i in range(L) if not session.stack.nodes_of_layer(i)]
    assert empty == list(entry.empty_layers), (
        f"layers {empty} of {session.stack.path!r} hold no graph node "
        f"(expected {list(entry.empty_layers)})"
    )
    problems = []
    for sch in schedules.distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(sch, strict=False)
        if not r.grads_equal:
            problems.append(f"{sch.provenance}: gradients differ from the un-rewritten graph")
        elif r.predicted_peak_bytes != r.measured_peak_bytes:
            problems.append(
                f"{sch.provenance}: predicted {r.predicted_peak_bytes} B != measured "
                f"{r.measured_peak_bytes} B (peak at {r.peak_phase} {r.peak_node})"
            )
        if not r.max_grad_diff_vs_eager <= entry.eager_grad_tolerance:
            problems.append(f"{sch.provenance}: max |grad - eager| {r.max_grad_diff_vs_eager:.3g}")
    assert not problems, "\n".join(problems)
    if entry.check is not None:
        entry.check(session)


def test_zoo_names_are_unique():
    names = [e.name for e in ZOO]
    assert len(names) == len(set(names))


def test_schedule_for_another_length_is_refused():
    s = Session.create(stack(2), (x(),), None)
    with pytest.raises(InvalidSchedule, match="L=3"):
        s.evaluate(schedules.uniform(1, 3))


def test_sdpa_without_dropout_needs_no_rng_replay():
    """Attention with dropout_p=0 draws no random numbers: no RNG state is saved."""
    torch.manual_seed(0)
    s = Session.create(stack(2, SDPA), (x(),), None)
    step, _, _ = s.prepare(schedules.uniform(1, 2))
    assert [seg.rng_replayed for seg in step.segments] == [(), ()]
