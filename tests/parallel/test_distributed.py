"""Per-rank memory measured through torch.distributed: 2 processes on gloo, a small model.

Every test launches its ranks with ``launch.run_ranks`` from a fork server (torch is
imported once, not in every rank); every process has ended when a test returns, and
the fork server is stopped when the module ends.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from remat_pass.parallel.distributed import RunOptions, measure_config
from remat_pass.parallel.fsdp_measure import measure_fsdp
from remat_pass.parallel.launch import RankFailed, run_ranks
from remat_pass.parallel.ranks import ParallelConfig

SMALL = (("batch", 4), ("layers", 2), ("seq", 16), ("hidden", 32), ("ffn", 64), ("vocab", 64))


@pytest.fixture(autouse=True, scope="module")
def _fork_server():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    import multiprocessing.forkserver as forkserver

    forkserver._forkserver._stop()
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~10 s on 2 shared cores (2 ranks trace, run and measure)
def test_pipeline_1f1b_predicted_equals_measured_on_every_rank():
    """p = 2, m = 2 (1F1B), one layer per stage: every rank's composed prediction equals
    its measured peak to the byte; gradients bitwise equal to the single-process model;
    stage 0 holds p = 2 microbatches, the last stage 1."""
    config = ParallelConfig(pp=2, microbatches=2, pipeline_schedule="1f1b")
    rows = measure_config(config, RunOptions("remat_pass.models:tiny_llama", SMALL, (("none", None), ("uniform", 1))),
                          deadline_s=300, start_method="forkserver")
    assert [(r.schedule, r.rank) for r in rows] == [("none", 0), ("none", 1), ("uniform(K=1)", 0), ("uniform(K=1)", 1)]
    for r in rows:
        assert r.predicted_peak_bytes == r.measured_peak_bytes, r
        assert r.grads_equal and r.grads_bitwise_vs_single_process, r
    assert [r.in_flight for r in rows if r.schedule == "none"] == [2, 1]
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~15 s on 2 shared cores (2 ranks export, trace, run and measure)
def test_a_model_without_a_pipeline_layout_is_split_and_predicted_exactly_on_every_rank():
    """A plain GPT (tests/helpers/user_models.py: an nn.ModuleList of blocks, no
    attribute of this project) under p = 2, m = 2 (1F1B): split by
    torch.distributed.pipelining at Megatron's even split, every rank's prediction
    equals its measured peak to the byte, gradients bitwise equal to the
    single-process model."""
    config = ParallelConfig(pp=2, microbatches=2, pipeline_schedule="1f1b")
    kwargs = (("batch", 4), ("layers", 4), ("seq", 16), ("hidden", 32))
    rows = measure_config(config, RunOptions("user_models:plain_gpt", kwargs, (("none", None), ("uniform", 1))),
                          deadline_s=300, start_method="forkserver")
    assert [(r.schedule, r.rank) for r in rows] == [("none", 0), ("none", 1), ("uniform(K=1)", 0), ("uniform(K=1)", 1)]
    for r in rows:
        assert r.predicted_peak_bytes == r.measured_peak_bytes, r
        assert r.grads_equal and r.grads_bitwise_vs_single_process, r
    assert [r.stages for r in rows[:2]] == [(0,), (1,)]
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~25 s on 2 shared cores (2 ranks trace, run and measure 3 repeats)
def test_a_transformers_llama_under_its_own_tensor_parallel_plan_is_predicted_exactly_on_every_rank():
    """LlamaForCausalLM (3 layers) at t = 2, sharded by its own _tp_plan
    (parallel.hf_plans): every rank's prediction equals the least of its measured
    repeats, never above any; gradients bitwise equal to none's on the rank and within
    rounding of the single-process model."""
    pytest.importorskip("transformers")
    config = ParallelConfig(tp=2)
    rows = measure_config(config, RunOptions("remat_pass.models.hf_families:llama", (("batch", 4),),
                                             (("none", None), ("uniform", 1)), repeats=3),
                          deadline_s=300, start_method="forkserver")
    assert [(r.schedule, r.rank) for r in rows] == [("none", 0), ("none", 1), ("uniform(K=1)", 0), ("uniform(K=1)", 1)]
    for r in rows:
        assert r.predicted_peak_bytes == r.measured_peak_bytes, r
        assert min(r.measured_runs_bytes) >= r.predicted_peak_bytes
        assert r.grads_equal, r
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~20 s on 2 shared cores
def test_a_transformers_llama_split_by_its_pp_plan_is_predicted_exactly_on_every_rank():
    """LlamaForCausalLM (4 layers) at p = 2, m = 2 (1F1B), its stages from
    base_model_pp_plan (parallel.hf_plans): predicted = measured to the byte on every
    rank, gradients bitwise equal to the single-process model."""
    pytest.importorskip("transformers")
    config = ParallelConfig(pp=2, microbatches=2)
    rows = measure_config(config, RunOptions("remat_pass.models.hf_families:llama", (("batch", 4), ("layers", 4)),
                                             (("none", None), ("uniform", 1))),
                          deadline_s=300, start_method="forkserver")
    assert [(r.schedule, r.rank) for r in rows] == [("none", 0), ("none", 1), ("uniform(K=1)", 0), ("uniform(K=1)", 1)]
    for r in rows:
        assert r.predicted_peak_bytes == r.measured_peak_bytes, r
        assert r.grads_equal and r.grads_bitwise_vs_single_process, r
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~14 s on 2 shared cores (5 measured repeats per rank)
def test_tensor_parallel_predicted_equals_measured_on_every_rank():
    """t = 2 with sequence parallelism: each rank's graph holds its local shards and
    functional collectives; the prediction equals the least measured peak of repeated
    steps (gloo's worker threads release some collective buffers late in single runs,
    see remat_pass.parallel.distributed); gradients bitwise equal to ``none`` on the rank and
    within rounding of the single-process model."""
    config = ParallelConfig(tp=2, sp=True)
    rows = measure_config(config, RunOptions("remat_pass.models:tiny_llama", SMALL, (("none", None),), repeats=5),
                          deadline_s=300, start_method="forkserver")
    assert [r.rank for r in rows] == [0, 1]
    for r in rows:
        assert r.predicted_peak_bytes == r.measured_peak_bytes, r
        assert min(r.measured_runs_bytes) >= r.predicted_peak_bytes
        assert r.grads_equal, r
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~10 s: 2 ranks trace, shard and run 3 measured steps
def test_fsdp2_predicted_equals_measured_on_every_rank():
    """d = 2, fully_shard per layer and on the root (eager): each rank's predicted peak
    equals its least measured peak, and so does the maximum inside every pre-forward /
    pre-backward hook; gradients gathered from the shards match the single-process
    model. (Inside the post-backward hooks of the last layer and the root the
    prediction is lower: gloo's reduce-scatter copies, see remat_pass.parallel.fsdp.)"""
    rows = measure_fsdp(ParallelConfig(fsdp=2), RunOptions("remat_pass.models:tiny_llama", SMALL, (("none", None),),
                                                          repeats=3), deadline_s=300, start_method="forkserver")
    assert [r.rank for r in rows] == [0, 1]
    for r in rows:
        assert r.predicted_peak_bytes == r.measured_peak_bytes, r
        pre = [(h, p, m) for h, p, m in r.hooks if h.startswith("pre_")]
        assert len(pre) == 2 * (2 + 1) and all(p == m for _, p, m in pre), pre
        assert r.grads_equal, r
    assert not multiprocessing.active_children()


def _rank_1_dies(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.recv(torch.empty(1), src=1)  # would wait for the dead rank
    return rank


def _rank_1_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


@pytest.mark.slow  # more than 4 s on 2 cores
def test_a_rank_that_dies_ends_every_other_rank():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as e:
        run_ranks(_rank_1_dies, 2, deadline_s=120, start_method="forkserver")
    assert [(f.rank, f.reason) for f in e.value.failures][:1] == [(1, "ValueError: rank 1 fails on purpose")]
    assert "rank 1" in str(e.value) and time.monotonic() - t0 < 60
    assert not multiprocessing.active_children()


def test_a_hung_rank_is_ended_at_the_deadline():
    with pytest.raises(RankFailed) as e:
        run_ranks(_rank_1_hangs, 2, deadline_s=3, start_method="forkserver")
    assert [f.rank for f in e.value.failures] == [1] and "hung" in e.value.failures[0].reason
    assert not multiprocessing.active_children()
