"""Per-stage plans under a device memory: the least-recompute setting per rank, and
whether Megatron-LM's flags (one setting for every stage) can express it."""

from __future__ import annotations

import pytest

from remat_pass.errors import InfeasibleBudget
from remat_pass.parallel.ranks import ParallelConfig, RankPrediction
from remat_pass.parallel.plan import megatron_flags, plan_stages, predict_config, stage_plan_text
from remat_pass.parallel.pipeline import RankPeak

MIB = 1 << 20


def pred(rank: int, schedule: str, peak_mib: int, flops: int) -> RankPrediction:
    peak = RankPeak(peak_mib * MIB, "B1", "mm", 0, 0, 0, peak_mib * MIB, 1)
    return RankPrediction(rank, (rank,), schedule, peak, 1 * MIB, {}, flops)


# stage 0 (holds p microbatches) needs recompute; stage 1 fits without
STAGE0 = [pred(0, "none", 10, 0), pred(0, "uniform(K=1)", 4, 100), pred(0, "block(N=1)", 7, 50)]
STAGE1 = [pred(1, "none", 5, 0), pred(1, "uniform(K=1)", 3, 100), pred(1, "block(N=1)", 4, 50)]


def test_one_setting_every_stage_can_share_is_printed_as_megatron_flags():
    plan = plan_stages([STAGE0, STAGE1], 5 * MIB)  # peak + 1 MiB static: stage 0 fits only uniform
    assert plan.expressible is False  # stage 1 alone would choose block(N=1), stage 0 uniform(K=1)
    assert [p.schedule for p in plan.chosen] == ["uniform(K=1)", "block(N=1)"]
    assert plan.shared == "uniform(K=1)" and plan.gain_flops == 100 - 50
    assert plan.flags == "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    assert "cannot express" in stage_plan_text(ParallelConfig(pp=2, microbatches=2), plan)


def test_a_plan_every_stage_agrees_on_is_expressible():
    alike = [pred(1, p.schedule, p.peak_bytes // MIB, p.recompute_flops) for p in STAGE0]
    plan = plan_stages([STAGE0, alike], 8 * MIB)  # peak + 1 MiB static: block(N=1) fits both
    assert plan.expressible and plan.flags == megatron_flags("block", 1) and plan.gain_flops == 0
    assert [p.schedule for p in plan.chosen] == ["block(N=1)", "block(N=1)"]


def test_a_setting_that_costs_one_stage_more_recompute_than_it_needs_is_not_expressible():
    plan = plan_stages([STAGE0, STAGE1], 8 * MIB)  # stage 0 block(N=1), stage 1 none
    assert [p.schedule for p in plan.chosen] == ["block(N=1)", "none"]
    assert not plan.expressible and plan.shared == "block(N=1)" and plan.gain_flops == 50


def test_no_recompute_when_everything_fits():
    plan = plan_stages([STAGE0, STAGE1], 11 * MIB)
    assert plan.expressible and plan.flags == "(no recompute flags)"


def test_a_rank_that_fits_under_no_setting_is_infeasible_with_its_least_need():
    with pytest.raises(InfeasibleBudget, match="rank 0 .* needs at least 5.00 MiB") as e:
        plan_stages([STAGE0, STAGE1], 4 * MIB)
    assert e.value.least_feasible_peak_bytes == 5 * MIB


def test_predictions_without_weights_equal_those_with_and_alike_ranks_and_stages_equal_their_own_traces():
    """A transformers Llama (4 layers) at t = 2 x p = 4, m = 4: every rank's
    predictions built on the meta device (fake tensors, DTensor shards of fakes) equal
    those with weights byte for byte, and giving the ranks of a tensor-parallel group
    the predictions of its first rank, and the middle stages 1 and 2 one trace
    (``alike``), equals tracing each one."""
    pytest.importorskip("transformers")
    from remat_pass.models.configs import build_factory
    from remat_pass.parallel.hf_plans import rank_step_model

    config = ParallelConfig(tp=2, pp=4, microbatches=4)
    settings = [("none", None), ("uniform", 1), ("block", 1)]

    def figures(preds):
        return [[(p.rank, p.schedule, p.peak_bytes, p.static_bytes, p.peak.node, p.recompute_flops) for p in r]
                for r in preds]

    real = rank_step_model(*build_factory("remat_pass.models.hf_families:llama", batch=4, layers=4)[:2])
    meta = rank_step_model(*build_factory("remat_pass.models.hf_families:llama", meta=True, batch=4, layers=4)[:2])
    assert next(meta[0].parameters()).is_meta
    each = figures(predict_config(*real, config, settings))
    assert figures(predict_config(*meta, config, settings)) == each
    assert figures(predict_config(*meta, config, settings, alike=True)) == each
