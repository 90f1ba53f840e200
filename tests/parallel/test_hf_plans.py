"""transformers models on the per-rank paths (``parallel.hf_plans``): their own
tensor-parallel plan, traced per rank with the fake process group (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

pytest.importorskip("transformers")

from remat_pass.cli.main import EXIT_USAGE, main  # noqa: E402
from remat_pass.errors import InvalidOption  # noqa: E402
from remat_pass.models.hf_families import llama, phi3  # noqa: E402
from remat_pass.parallel.hf_plans import RankStep, rank_step_model  # noqa: E402
from remat_pass.parallel.ranks import ParallelConfig, fake_process_group, trace_rank, validate  # noqa: E402


def test_the_models_own_plan_maps_to_pytorchs_parallel_styles():
    model, inputs = rank_step_model(*llama()[:2])
    assert isinstance(model, RankStep) and [t.shape for t in inputs] == [(2, 16), (2, 16)]
    plan, per_layer = model.tensor_parallel_plan(False)
    assert per_layer == {}
    assert isinstance(plan["lm.model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["lm.model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert plan["lm.lm_head"].output_layouts == (Replicate(),)  # colwise_gather_output: logits gathered
    assert plan["lm.model.embed_tokens"].input_layouts == (Replicate(),)  # embedding_rowwise
    assert model(*inputs) == model.lm(input_ids=inputs[0], labels=inputs[1]).loss


def test_every_rank_holds_its_shard_of_the_plan_and_traces_local_shapes():
    """t = 2: q / k / v / gate / up split by output rows, o / down by input columns, the
    embedding by vocabulary rows; the traced graph's primals are the local shards."""
    model, inputs = rank_step_model(*llama(batch=4)[:2])
    config = ParallelConfig(tp=2)
    validate(config, model, 4, 16)
    with fake_process_group(1, 2):
        (graph,) = trace_rank(model, inputs, config, 1)
        params = dict(graph.module.named_parameters())
        placements = {n: p.placements[0] for n, p in params.items() if isinstance(p, DTensor)}
        assert placements["lm.model.layers.0.self_attn.q_proj.weight"] == Shard(0)
        assert placements["lm.model.layers.0.mlp.down_proj.weight"] == Shard(1)
        assert placements["lm.model.embed_tokens.weight"] == Shard(0)
        assert "lm.model.norm.weight" not in placements  # not in the plan: replicated as a plain tensor
    shapes = [tuple(v.shape) for v in graph.joint.primal_values]
    assert (16, 32) in shapes and (64, 32) not in shapes  # q_proj [32, 32] -> [16, 32]; embedding and head [64, 32] split by vocabulary rows
    assert graph.stack.num_layers == 3


def test_a_style_remat_pass_does_not_apply_is_refused_by_name():
    model, _ = rank_step_model(*llama()[:2])
    model.lm._tp_plan = {**model.lm._tp_plan, "model.layers.*.mlp.experts": "grouped_gemm"}
    with pytest.raises(InvalidOption, match="shards model.layers.\\*.mlp.experts as 'grouped_gemm'.*supported: colwise"):
        model.tensor_parallel_plan(False)


def test_sequence_parallel_and_a_model_without_a_plan_exit_2(capsys):
    assert main(["sweep", "--model", "remat_pass.models.hf_families:llama", "--batch", "4", "--tp", "2",
                 "--sp"]) == EXIT_USAGE
    assert "declares no sequence-parallel layouts" in capsys.readouterr().err
    assert main(["sweep", "--model", "remat_pass.models.hf_families:bert", "--batch", "4", "--tp", "2"]) == EXIT_USAGE
    assert "BertForMaskedLM declares no tensor-parallel plan" in capsys.readouterr().err


def test_the_fused_projections_of_phi3_are_gathered_then_split_as_its_plan_says():
    model, _ = rank_step_model(*phi3()[:2])
    plan, _ = model.tensor_parallel_plan(False)
    assert plan["lm.model.layers.*.self_attn.qkv_proj"].output_layouts == (Replicate(),)
    assert plan["lm.model.layers.*.self_attn.o_proj"].input_layouts == (Replicate(),)


def test_keyword_inputs_of_a_model_that_is_not_from_transformers_are_refused():
    with pytest.raises(InvalidOption, match="keyword arguments \\['x'\\]"):
        rank_step_model(nn.Linear(2, 2), {"x": torch.zeros(2, 2)})


def test_pipeline_stages_come_from_the_classes_base_model_pp_plan():
    """Llama, 4 layers over 2 stages: the embedding and layers 0-1 on stage 0, layers
    2-3, the norm and the head on stage 1 (the other stage's outer modules are
    parameterless Identity); the full model's names; the stages run one after another
    give the model's loss."""
    from remat_pass.parallel.stages import split_stages, stack_of
    from remat_pass.parallel.ranks import microbatches

    model, inputs = rank_step_model(*llama(batch=4, layers=4)[:2])
    assert stack_of(model) == ("lm.model.layers", 4)
    mb = microbatches(inputs, 2)[0]
    first, last = split_stages(model, mb, [0, 1], 2)
    def owners(names):  # "lm.model.layers.2.mlp.up_proj.weight" -> "model.layers.2"
        return {".".join(n.split(".")[1:4]) if ".layers." in n else n[3:].rsplit(".", 1)[0] for n in names}

    assert owners(first.param_names.values()) == {"model.embed_tokens", "model.layers.0", "model.layers.1"}
    assert owners(last.param_names.values()) == {"model.layers.2", "model.layers.3", "model.norm", "lm_head"}
    assert set(first.param_names.values()) | set(last.param_names.values()) == set(dict(model.named_parameters()))
    assert last.boundary_shape == (2, 16, 32) and first.boundary_shape == ()
    with torch.no_grad():
        assert torch.allclose(last.module(first.module(mb[0]), mb[1]), model(*mb), rtol=1e-6, atol=0)


def _granite(tied: bool) -> tuple[nn.Module, dict]:
    import transformers

    cfg = transformers.GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                     embedding_multiplier=12.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    return transformers.GraniteForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids}


def test_a_stage_split_that_changes_the_loss_or_ties_the_embeddings_is_refused():
    """Granite multiplies whatever enters its base model as inputs_embeds by its
    embedding_multiplier, the received activation too: the chained stages' second layer
    gives other outputs than the model's, so it is not split; with tied embeddings the split is refused
    before."""
    from remat_pass.parallel.stages import split_stages

    model, inputs = rank_step_model(*_granite(tied=True))
    with pytest.raises(InvalidOption, match="ties its input and output embeddings"):
        split_stages(model, inputs, [0], 2)
    model, inputs = rank_step_model(*_granite(tied=False))
    with pytest.raises(InvalidOption, match=r"GraniteForCausalLM's pipeline stages run one after another give layers \[1\] other outputs than the whole model"):
        split_stages(model, inputs, [0], 2)
