"""Identical layers analysed once (layer_reuse): the liveness of an L-layer stack
assembled from rewrites of a 4-layer template equals the full rewrite's, storage by
storage and step by step, for every Megatron schedule and optimized ones."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from remat_pass.recompute import schedule as schedules
from remat_pass.errors import UnsupportedGraph
from remat_pass.liveness.intervals import memory_intervals
from remat_pass.liveness.layer_reuse import ReusedLayers, ReusedLayersModel
from remat_pass.liveness.layer_roles import (
    block_order,
    requirements,
    roles_of,
    schedule_of_roles,
    template_role_strings,
    valid_roles,
)
from remat_pass.liveness.timeline import analyze, live_timeline
from remat_pass.memory.memory_model import MemoryModel
from remat_pass.graph.regions import assign_layers
from remat_pass.recompute.rewrite import rewrite
from remat_pass.liveness.symbolic import SymbolicModel
from remat_pass.graph.trace import trace_joint
from remat_pass.models.configs import ModelSpec, build_from_config, load_config
from remat_pass.liveness.layer_roles import TEMPLATE_LAYERS
from remat_pass.evaluate.session import Session
from remat_pass.evaluate.workload import WorkloadOptions, load_workload

from small_models import load_hetero, small_tiny_gpt


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def traced(build, layers: int):  # noqa: ANN001, ANN201
    model, inputs, loss_fn = build(layers)
    joint = trace_joint(model, inputs, loss_fn)
    return joint, assign_layers(joint)


def storages(iv) -> list[tuple]:  # noqa: ANN001
    return sorted((s.first, s.last, s.nbytes, s.kind) for s in iv.storages if not s.static)


def check_against_full(template, full, allocator: str, extra: list[schedules.Schedule]) -> ReusedLayers:  # noqa: ANN001
    """Every storage's interval, the timeline and the report of the assembled step equal
    the full rewrite's for every distinct Megatron schedule and ``extra``."""
    (tj, ts), (fj, fs) = template, full
    L = fs.num_layers
    reuse = ReusedLayers(tj, ts, L, allocator)
    todo = {s.groups: s for s in schedules.megatron_schedules(L) + extra}
    for sched in todo.values():
        iv, _ = reuse.intervals(sched)
        step = rewrite(fj, fs, sched)
        full_iv = memory_intervals(step, MemoryModel.table_only(allocator))[0]
        assert storages(iv) == storages(full_iv), sched.provenance
        assert live_timeline(iv) == live_timeline(full_iv), sched.provenance
        got, want = reuse.report(sched), analyze(step, allocator)
        for field in ("peak_bytes", "peak_step", "peak_phase", "peak_layer", "saved_activation_bytes",
                      "static_bytes", "forward_flops", "recompute_flops", "live_at_peak_by_layer"):
            assert getattr(got, field) == getattr(want, field), (sched.provenance, field)
    return reuse


def test_roles_and_block_order():
    assert roles_of(schedules.uniform(2, 5)) == ("F", "E", "F", "E", "G1")
    assert roles_of(schedules.block(2, 4)) == ("G1", "G1", "S", "S")
    assert roles_of(schedules.none(3)) == ("S", "S", "S")
    for roles in (("F", "M", "E", "S"), ("S", "G1", "F", "E")):
        assert roles_of(schedule_of_roles(roles)) == roles
    assert not valid_roles(("F", "S")) and not valid_roles(("M", "E")) and not valid_roles(("S", "F"))
    # the top layer's backward runs around its group's recompute, lower members after it
    assert block_order(("F", "E"))[4:] == [
        "head_bw", ("backward", 1, 0), ("recompute", 0, 0), ("recompute", 1, 0), ("backward", 1, 1),
        ("backward", 0, 1), "post"]


def test_templates_cover_what_a_schedule_needs():
    needed = requirements(roles_of(schedules.uniform(5, 23))) | requirements(roles_of(schedules.block(7, 23)))
    chosen = template_role_strings(needed)
    assert all(len(t) == 4 and valid_roles(t) for t in chosen)
    assert needed <= set().union(*(requirements(t) for t in chosen))


def tiny(layers: int):
    return small_tiny_gpt(layers=layers)


def test_tiny_gpt_every_megatron_schedule_equals_the_full_rewrite():
    check_against_full(traced(tiny, 4), traced(tiny, 6), "cpu",
                       [schedules.optimized(((1, 2), (4,)), 6), schedules.optimized(((0, 1, 2, 3),), 6)])


def test_heterogeneous_layers_are_refused():
    """Layers of one class whose shapes differ (benchmarks/hetero.py) are not reused."""
    model, inputs, loss_fn = load_hetero().hetero_gpt(batch=2, seq=8)
    joint = trace_joint(model, inputs, loss_fn)
    stack = assign_layers(joint)
    with pytest.raises(UnsupportedGraph, match="not identical|differ"):
        ReusedLayers(joint, stack, 12).report(schedules.uniform(2, 12))


def gpt2(layers: int):
    from small_models import small_gpt2

    return small_gpt2(layers=layers, dropout=0.1)


def llama_bf16(layers: int):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    ids = torch.empty(2, 32, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}, None


@pytest.mark.slow
def test_gpt2_with_dropout_equals_the_full_rewrite():
    """Dropout: the RNG states each recomputed layer saves follow the layer's role."""
    extra = [schedules.optimized(((1, 2), (4,), (5, 6)), 8), schedules.optimized(((0, 1, 2, 3, 4),), 8)]
    check_against_full(traced(gpt2, 4), traced(gpt2, 8), "cuda", extra)


@pytest.mark.slow
def test_llama_bf16_cuda_kernels_equals_the_full_rewrite():
    """A fake bf16 Llama (GQA) traced with the CUDA kernels modelled, CUDA allocator."""
    from remat_pass.memory.cuda_target import CudaKernels
    from remat_pass.graph.fake_trace import trace_joint_fake

    def fake(layers: int):  # noqa: ANN202
        model, inputs, _ = llama_bf16(layers)
        with CudaKernels():
            joint = trace_joint_fake(model, inputs)
        return joint, assign_layers(joint)

    reuse = check_against_full(fake(4), fake(7), "cuda", [schedules.optimized(((2, 3, 4), (6,)), 7)])
    assert collections.Counter(t[0] for t in reuse.templates) == collections.Counter(
        t[0] for t in reuse.templates)  # deterministic template choice (same set each run)


@pytest.mark.slow
def test_chain_model_from_reused_layers_is_the_full_one():
    """The planner's chain costs calibrated from the assembled profiles equal those of
    the symbolic model of the full trace (CPU allocator, exact bytes)."""
    from remat_pass.plan.chain_calibration import chain_costs

    (tj, ts), (fj, fs) = traced(gpt2, 4), traced(gpt2, 7)
    reuse = ReusedLayers(tj, ts, 7, "cpu")
    assert chain_costs(ReusedLayersModel.create(reuse)) == chain_costs(SymbolicModel.from_joint(fj, fs))
    # the planner on the template plans the 7-layer stack as the full trace's does
    from remat_pass.plan.planner import Planner

    reused = Planner(tj, ts, reuse.report, model=ReusedLayersModel.create(reuse))
    full = Planner(fj, fs, lambda sched: analyze(rewrite(fj, fs, sched), "cpu"))
    assert reused.least_feasible() == full.least_feasible()
    budget = (reused.least_feasible()[1] + reused.unconstrained_peak_bytes) // 2
    assert reused.plan(budget).schedule == full.plan(budget).schedule


UNLIKE_LAYERS = {  # six layers whose attention differs past the fourth: a 4-layer template never sees it
    # identical modules; the forward picks each layer's mask from config.layer_types
    "llama4_full_then_chunked": {"model_type": "llama4_text", "hidden_size": 32, "intermediate_size": 64,
                                 "intermediate_size_mlp": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
                                 "max_position_embeddings": 64, "pad_token_id": 0, "moe_layers": [],
                                 "no_rope_layers": [1] * 6, "attention_chunk_size": 4,
                                 "layer_types": ["full_attention"] * 4 + ["chunked_attention"] * 2},
    "gemma3_5_sliding_1_full": {"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "head_dim": 16, "vocab_size": 64, "max_position_embeddings": 64, "sliding_window": 8},
    "qwen2_max_window_layers_4": {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "vocab_size": 64, "max_position_embeddings": 64, "use_sliding_window": True,
                                  "sliding_window": 8, "max_window_layers": 4},
}


# one model in the fast suite (Qwen2, the quickest), the other two with the slow tests
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "qwen2_max_window_layers_4" else n
                                  for n in sorted(UNLIKE_LAYERS)])
def test_layers_unlike_past_the_template_are_all_traced(tmp_path, name):
    """Gemma 3's 5:1 sliding/full pattern, Qwen2's max_window_layers, Llama 4's
    layer_types read only by the model's forward: the layers are not all alike, so the
    config model is traced whole (said in the log), and the decision matters: the 4-layer
    template, had it been reused, predicts other peaks than the whole trace (it predicted
    20,480 B too much for Gemma 3, 49,152 B too little for Qwen2)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(UNLIKE_LAYERS[name]))
    options = WorkloadOptions(config=str(path), meta=True, batch=2, seq=32, calibrate=False)
    logged: list[str] = []
    whole = load_workload(options, log=logged.append)
    assert whole.reuse is None and any("not all alike" in line for line in logged), logged
    assert whole.session.stack.num_layers == 6
    config = load_config(path)
    spec = ModelSpec(task="causal-lm", meta=True, batch=2, seq=32, layers=TEMPLATE_LAYERS)
    session = Session.create(*build_from_config(config, spec), fake=True)
    reuse = ReusedLayers(session.joint, session.stack, 6, "cpu")
    assert any(reuse.report(s).peak_bytes != whole.report(s).peak_bytes for s in schedules.megatron_schedules(6))


def test_a_stack_of_like_layers_is_still_reused(tmp_path):
    config = dict(UNLIKE_LAYERS["qwen2_max_window_layers_4"], use_sliding_window=False)
    path = tmp_path / "qwen2.json"
    path.write_text(json.dumps(config))
    w = load_workload(WorkloadOptions(config=str(path), meta=True, batch=1, seq=16, calibrate=False),
                      log=lambda _: None)
    assert w.reuse is not None
