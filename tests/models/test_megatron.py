"""Megatron-Core on the CPU (remat_pass/models/megatron.py; optional extra ``megatron``,
skipped without it): the setup ends every process group it starts and puts the RNG
tracker and the global memory buffer on the CPU; Megatron-Core's unmodified ``GPTModel``
(local layer spec) sweeps every Megatron setting with predicted == measured peaks and
gradients bitwise equal to the un-rewritten step, its static memory the same under every
schedule, from the Python API and from the command line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402

from remat_pass import cli  # noqa: E402
from remat_pass.evaluate.session import Session  # noqa: E402
from remat_pass.models.megatron import megatron_cpu, megatron_gpt, teardown_megatron_cpu  # noqa: E402
from remat_pass.recompute import schedule  # noqa: E402


@pytest.fixture(autouse=True)
def no_megatron_left():
    """Every test starts and ends without Megatron's state or a process group."""
    teardown_megatron_cpu()
    yield
    teardown_megatron_cpu()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()


def test_setup_runs_megatron_on_the_cpu_and_ends_every_group(caplog):
    cuda_functions = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    with megatron_cpu(seed=3):
        assert dist.get_world_size() == 1 and parallel_state.get_tensor_model_parallel_world_size() == 1
        buffer = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "mpu")
        assert buffer.device.type == "cpu" and buffer.shape == (2, 3)
        tracker = mrandom.get_cuda_rng_tracker()
        expected = torch.Generator().manual_seed(3 + 2718).get_state()
        assert torch.equal(tracker.get_states()[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME], expected)
        before = torch.get_rng_state()
        with caplog.at_level(logging.WARNING), tracker.fork():
            inside = torch.rand(4)  # drawn from the tensor-parallel state
        assert torch.equal(torch.get_rng_state(), before)  # fork() gave the default state back
        assert torch.equal(inside, torch.rand(4, generator=torch.Generator().manual_seed(3 + 2718)))
        assert "CPU RNG state changed" not in caplog.text
    assert (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) == cuda_functions
    assert not dist.is_initialized()


@pytest.mark.slow
def test_gpt_model_sweeps_every_megatron_setting_exactly():
    with megatron_cpu():
        model, inputs, loss_fn = megatron_gpt(batch=2, seq=32, layers=4, hidden=64, heads=4, vocab=128)
        session = Session.create(model, inputs, loss_fn)
        assert [s.path for s in session.stack.stacks] == ["decoder.layers"]
        problems, static = [], set()
        for sch in schedule.megatron_schedules(session.stack.layers_per_stack):
            r = session.evaluate(sch, strict=False)
            static.add(session.report(sch).static_bytes)
            if not r.grads_equal or r.predicted_peak_bytes != r.measured_peak_bytes:
                problems.append(f"{sch.provenance}: grads {r.grads_text()}, predicted {r.predicted_peak_bytes} B, "
                                f"measured {r.measured_peak_bytes} B")
        assert not problems, "\n".join(problems)
        assert len(static) == 1  # the global memory buffer counted once under every schedule


@pytest.mark.slow
def test_command_line_sweeps_the_megatron_factory(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = cli.main(["sweep", "--model", "remat_pass.models.megatron:megatron_gpt", "--layers", "2",
                   "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(schedule.megatron_schedules(2))
    assert all(r["grads_equal"] and r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in rows)


@pytest.mark.slow
def test_sweep_marks_the_uniform_k_megatron_crashes_on(capsys):
    """uniform(K=3) at L = 4: Megatron-Core's own _checkpointed_forward raises IndexError
    (run here); the sweep says so for that K alone."""
    with megatron_cpu():
        model, inputs, loss_fn = megatron_gpt(layers=4, dropout=0.0)
        for k, crashes in ((2, False), (3, True)):
            for m in (model.config, model.decoder.config):
                m.recompute_granularity, m.recompute_method, m.recompute_num_layers = "full", "uniform", k
            try:
                loss_fn(model(**inputs)).backward()
            except IndexError:
                assert crashes, f"K={k}"
            else:
                assert not crashes, f"K={k}"
    assert cli.main(["sweep", "--model", "remat_pass.models.megatron:megatron_gpt", "--layers", "4"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: Megatron-Core")]
    assert len(notes) == 1 and "uniform(K=3)" in notes[0] and "uniform(K=2)" not in notes[0]
