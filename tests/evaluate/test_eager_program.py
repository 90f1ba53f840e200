"""The user's eager program predicted without the rewrite: recorded on fake tensors op
by op (``graph/eager_trace``), swept by ``liveness/eager_program``, against the real
eager step under the profiler, with the setting applied as users apply it
(``torch.utils.checkpoint`` per layer, transformers' ``gradient_checkpointing_enable``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from remat_pass.errors import RematError
from remat_pass.evaluate.eager_program import CheckpointedLayer, eager_program, with_checkpoints
from remat_pass.graph.eager_trace import record_eager_step
from remat_pass.models import tiny_gpt
from remat_pass.recompute import schedule as schedules

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def _settings(layers: int) -> list[schedules.Schedule]:
    return [schedules.none(layers), schedules.uniform(1, layers), schedules.block(2, layers)]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_tiny_gpt_eager_program_is_predicted_to_the_byte(use_reentrant):
    """TinyGPT with dropout, its loss outside the model: none, per-layer checkpoint
    (uniform K=1) and block N=2 (each checkpoint stashes the CPU RNG state, 5,056
    bytes, without a dispatched op), reentrant or not."""
    model, (ids,), loss_fn = tiny_gpt(batch=2, seq=32, layers=3, hidden=64, heads=2, vocab=128, dropout=0.1)
    for sch in _settings(3):
        r = eager_program(model, (ids,), loss_fn, sch, use_reentrant=use_reentrant)
        assert r.predicted.peak_bytes == r.measured_peak_bytes, (sch.provenance, r)
        assert r.predicted.notes == ()


def test_an_eager_program_without_weights_is_recorded_as_the_same_program_with_them():
    """TinyGPT built on the meta device (its targets too) and the same TinyGPT with
    weights: per setting (per-layer and grouped checkpoints, dropout included) the same
    ops, the same storages and the same predicted peak on the formula table; the meta one
    is not run, and says so."""
    from remat_pass.evaluate.eager_program import NO_WEIGHTS
    from remat_pass.liveness.eager_program import eager_peak
    from remat_pass.memory.memory_model import MemoryModel

    kw = dict(batch=2, seq=16, layers=3, hidden=32, heads=2, vocab=64, dropout=0.1)
    real, (ids,), loss_fn = tiny_gpt(**kw)
    with torch.device("meta"):
        meta, (meta_ids,), meta_loss_fn = tiny_gpt(**kw)
    assert next(meta.parameters()).is_meta
    table = MemoryModel.table_only("cpu")
    for sch in [*_settings(3), schedules.uniform(3, 3)]:
        r = eager_program(meta, (meta_ids,), meta_loss_fn, sch)
        assert r.measured_peak_bytes is None and NO_WEIGHTS in r.predicted.notes
        with_weights = with_checkpoints(real, sch, None, False) if sch.groups else real
        trace = record_eager_step(with_weights, (ids,), loss_fn)
        without = record_eager_step(with_checkpoints(meta, sch, None, False) if sch.groups else meta,
                                    (meta_ids,), meta_loss_fn)
        assert [n.target for n in without.op_nodes] == [n.target for n in trace.op_nodes]
        assert [(s.nbytes, s.allocated_at, s.freed_before) for s in without.storages] == \
            [(s.nbytes, s.allocated_at, s.freed_before) for s in trace.storages]
        assert r.predicted.peak_bytes == eager_peak(trace, table).peak_bytes, sch.provenance
    assert all(p.is_meta and p.grad is None for p in meta.parameters())


@pytest.mark.parametrize("family", ["llama", pytest.param("t5", marks=pytest.mark.slow)])
def test_transformers_eager_program_is_predicted_to_the_byte(family):
    """transformers' Llama and T5 (loss inside the model; the checkpoint their own
    ``gradient_checkpointing_enable`` per layer). Their ``x * scaling`` saves a wrapped
    number for backward (``MulBackward0._saved_other``), which no dispatched op makes."""
    from remat_pass.models import hf_families

    model, inputs, loss_fn = getattr(hf_families, family)()
    stack = "model.layers" if family == "llama" else "encoder.block"
    layers = len(model.get_submodule(stack))
    for sch in [schedules.none(layers), schedules.uniform(1, layers)]:
        r = eager_program(model, inputs, loss_fn, sch, layers=stack)
        assert r.predicted.peak_bytes == r.measured_peak_bytes, (sch.provenance, r)


def test_a_setting_on_one_stack_checkpoints_that_stack_only():
    """transformers' enable call switches on every GradientCheckpointingLayer of the
    model; a setting on T5's encoder stack leaves its decoder blocks un-checkpointed
    (they were all recomputed, so the eager program was another setting than the
    rewrite's)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from remat_pass.models import hf_families

    model, _, _ = hf_families.t5()
    wrapped = with_checkpoints(model, schedules.block(1, 3), layers="encoder.block")
    on = [name for name, m in wrapped.named_modules()
          if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    assert on == ["encoder.block.0"]
    assert any(isinstance(m, GradientCheckpointingLayer) for m in wrapped.decoder.modules())


@pytest.mark.slow
def test_the_rewrite_uses_at_most_the_eager_programs_memory_on_t5():
    """Issue 19's rule on a two-stack model: at every setting of T5's encoder stack the
    rewritten step's measured peak is at most the eager program's (transformers' own
    checkpointing on the same layers), gradients bitwise equal."""
    from remat_pass.evaluate.session import Session
    from remat_pass.models import hf_families

    model, inputs, loss_fn = hf_families.t5()
    session = Session.create(model, inputs, loss_fn, layers="encoder.block")
    for sch in [schedules.none(3), schedules.uniform(1, 3), schedules.block(1, 3), schedules.block(2, 3)]:
        eager = eager_program(model, inputs, loss_fn, sch, layers="encoder.block")
        rewrite = session.evaluate(sch)
        assert eager.predicted.peak_bytes == eager.measured_peak_bytes, sch.provenance
        assert rewrite.grads_equal, sch.provenance
        assert rewrite.measured_peak_bytes <= eager.measured_peak_bytes, (sch.provenance, rewrite.measured_peak_bytes,
                                                                         eager.measured_peak_bytes)


def test_the_difference_of_the_peaks_is_named_by_op():
    """rewrite - eager at each program's peak, by the op that allocated the bytes: the
    terms sum to the difference of the predicted peaks, each side's to its own peak; on
    the CPU eager dropout keeps a float noise tensor (``empty_like``) where the traced
    step saves a bool mask from ``native_dropout`` (issue 19's cause 4), which the terms
    show at ``none``."""
    from remat_pass.evaluate.eager_program import peak_difference_by_op, rewrite_live_by_op
    from remat_pass.evaluate.session import Session

    model, inputs, loss_fn = tiny_gpt(batch=2, seq=32, layers=3, hidden=64, heads=2, vocab=128, dropout=0.1)
    session = Session.create(model, inputs, loss_fn)
    for sch in _settings(3):
        step, report, _ = session.prepare(sch)
        e = eager_program(model, inputs, loss_fn, sch, measure=False)
        assert sum(b for _, b in e.predicted.live_at_peak_ops) == e.predicted.peak_bytes
        live = rewrite_live_by_op(step, report)
        assert sum(live.values()) == report.peak_bytes
        terms = peak_difference_by_op(e.predicted, live)
        assert sum(d for _, d in terms) == report.peak_bytes - e.predicted.peak_bytes, sch.provenance
        assert all(d for _, d in terms) and "getitem" not in dict(terms)
        if sch.method == "none":
            assert dict(terms)["empty_like"] < 0 < dict(terms)["native_dropout"], terms


def test_the_recording_leaves_the_model_as_it_was():
    """The step is recorded on fake copies: the model's parameters and ``.grad`` are
    untouched, and the trace has every op of forward, loss and backward."""
    model, (ids,), loss_fn = tiny_gpt(batch=2, seq=16, layers=2, hidden=32, heads=2, vocab=64)
    before = [p.detach().clone() for p in model.parameters()]
    trace = record_eager_step(model, (ids,), loss_fn)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    targets = {str(n.target) for n in trace.op_nodes}
    assert {"aten.mm.default", "aten._log_softmax_backward_data.default"} <= targets
    grads = [s for s in trace.storages if s.freed_before is None]
    assert sum(s.nbytes for s in grads) >= sum(p.numel() * 4 for p in model.parameters())


def test_settings_are_applied_per_layer_and_per_group():
    """Single layers run under CheckpointedLayer; a group of K layers under one
    checkpoint around all K (Megatron-LM's ``custom(l, l + K)``), its other layers
    passing their input through; a schedule for another stack length is refused."""
    model, _, _ = tiny_gpt(batch=2, seq=16, layers=4, hidden=32, heads=2, vocab=64)
    with pytest.raises(RematError, match="is for 3 layers"):
        with_checkpoints(model, schedules.uniform(1, 3))
    wrapped = with_checkpoints(model, schedules.block(1, 4))
    assert [type(b).__name__ for b in wrapped.blocks] == ["CheckpointedLayer", "Block", "Block", "Block"]
    assert not isinstance(model.blocks[0], CheckpointedLayer)
    grouped = with_checkpoints(model, schedules.uniform(2, 4))
    assert [type(b).__name__ for b in grouped.blocks] == ["CheckpointedGroup", "GroupedLayer"] * 2
    assert len(list(grouped.parameters())) == len(list(model.parameters()))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_groups_of_layers_are_predicted_to_the_byte_with_the_model_gradients(use_reentrant):
    """uniform K = 2, 3, 4 on TinyGPT with dropout: one checkpoint per group (its RNG
    state stashed once per group) predicted == measured; the gradients of the grouped
    copy equal the model's own (same seed: the checkpoint replays the dropout masks)."""
    model, (ids,), loss_fn = tiny_gpt(batch=2, seq=32, layers=4, hidden=64, heads=2, vocab=128, dropout=0.1)
    peaks = {}
    for k in (2, 3, 4):
        r = eager_program(model, (ids,), loss_fn, schedules.uniform(k, 4), use_reentrant=use_reentrant)
        assert r.predicted.peak_bytes == r.measured_peak_bytes, (k, r)
        peaks[k] = r.measured_peak_bytes
    assert peaks[2] < peaks[3] < peaks[4]  # a larger group recomputes more at once
    grads = []
    for m in (model, with_checkpoints(model, schedules.uniform(2, 4), use_reentrant=use_reentrant)):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss_fn(m(ids)).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_groups_of_layers_of_a_transformers_model_are_refused():
    """transformers checkpoints one layer at a time (its KV cache would be recomputed
    through by one checkpoint around several layers): refused, naming what works."""
    from remat_pass.models import hf_families

    model, _, _ = hf_families.llama()
    with pytest.raises(RematError, match="uniform K=1 and block N"):
        with_checkpoints(model, schedules.uniform(2, len(model.model.layers)), layers="model.layers")


class Scalar(nn.Module):
    def forward(self, x):
        return (x.item() * x).sum()


def test_a_step_that_cannot_run_on_fake_tensors_is_refused():
    with pytest.raises(RematError, match="could not run on fake tensors"):
        record_eager_step(Scalar(), (torch.ones(()),), None)


@pytest.mark.usefixtures("megatron_torn_down")
def test_megatron_core_own_recompute_is_predicted_to_the_byte():
    """Megatron-Core's GPTModel with its own full recompute (``TransformerConfig``
    ``recompute_method`` uniform / block, ``_checkpointed_forward`` with Megatron's
    ``CheckpointFunction`` and RNG tracker), dropout 0.1, gloo world size 1: every
    setting predicted == measured, groups of several layers included; the config is
    restored after each."""
    pytest.importorskip("megatron.core")
    from remat_pass.models.megatron import megatron_gpt

    model, inputs, loss_fn = megatron_gpt(layers=4, hidden=64, heads=4, seq=32, batch=2, vocab=128, dropout=0.1)
    for sch in [schedules.none(4), schedules.uniform(2, 4), schedules.block(1, 4)]:
        r = eager_program(model, inputs, loss_fn, sch, layers="decoder.layers")
        assert r.predicted.peak_bytes == r.measured_peak_bytes, (sch.provenance, r)
    assert model.decoder.config.recompute_granularity is None


@pytest.mark.usefixtures("megatron_torn_down")
def test_megatron_core_uniform_k_that_does_not_divide_the_layers_is_refused(capsys, tmp_path):
    """uniform(K=3) at L = 4: Megatron-Core's own _checkpointed_forward raises IndexError
    on it, so the eager program refuses it by name, and ``sweep --program eager`` lists it
    as not run instead of ending in Megatron's traceback (it did at L = 8, K = 3)."""
    pytest.importorskip("megatron.core")
    from remat_pass import cli
    from remat_pass.models.megatron import megatron_gpt

    model, inputs, loss_fn = megatron_gpt(layers=4, hidden=64, heads=4, seq=32, batch=2, vocab=128, dropout=0.0)
    with pytest.raises(RematError, match=r"cannot run uniform\(K=3\) on 4 layers"):
        eager_program(model, inputs, loss_fn, schedules.uniform(3, 4), layers="decoder.layers")
    assert model.decoder.config.recompute_granularity is None
    rc = cli.main(["sweep", "--model", "remat_pass.models.megatron:megatron_gpt", "--layers", "4",
                   "--program", "eager", "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "not run eagerly (1 settings): uniform(K=3): Megatron-Core cannot run" in out


@pytest.mark.slow
@pytest.mark.usefixtures("megatron_torn_down")
def test_megatron_core_rewrite_is_never_above_its_own_recompute_at_a_large_vocabulary(tmp_path, capsys):
    """Megatron-Core at vocab 32768 (its cross entropy keeps one [s, b, V] fp32 buffer,
    written in place): in every Megatron setting the rewrite's peak <= the eager
    program's (Megatron's own recompute, predicted == measured), the least setting the
    same, and the rewrite's in-place reuse saves bytes at every peak. Before the rewrite
    restored in-place reuse it was 1.5-2x eager's here. Tied embeddings (Megatron-LM's
    default): the two gradients of the shared weight are summed in place, as eager does."""
    pytest.importorskip("megatron.core")
    from remat_pass import cli

    rc = cli.main(["megatron", "--program", "eager", "--json", str(tmp_path / "m.json"), "--",
                   "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                   "--micro-batch-size", "4", "--vocab-size", "32768", "--make-vocab-size-divisible-by", "128",
                   "--attention-dropout", "0.1", "--hidden-dropout", "0.1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = json.loads((tmp_path / "m.json").read_text())["eager_program"]
    assert len(rows) >= 6, rows
    for r in rows:
        assert r["predicted_peak_bytes"] == r["measured_peak_bytes"], r
        assert r["rewrite_predicted_peak_bytes"] <= r["measured_peak_bytes"], r
        assert r["in_place_reuse_bytes"] > 0, r
    least_eager = min(rows, key=lambda r: (r["measured_peak_bytes"], r["schedule"]))
    least_rewrite = min(rows, key=lambda r: (r["rewrite_predicted_peak_bytes"], r["schedule"]))
    assert least_rewrite["rewrite_predicted_peak_bytes"] <= least_eager["measured_peak_bytes"]


class TiedEmbedding(torch.nn.Module):
    """Input embedding and output layer share one weight: backward sums its two
    gradients (``InputBuffer::accumulate``), the largest tensors of the step."""

    def __init__(self, vocab: int = 8192, hidden: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(2)])

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.logsumexp(x @ self.emb.weight.t(), -1).mean()


def test_a_tied_weights_two_gradients_are_summed_as_eager_sums_them():
    """``x @ emb.weight.t()``: the output layer's gradient reaches the weight as a view
    (``t()`` of an ``mm``), and eager adds the embedding's gradient to it out of place
    (``InputBuffer::accumulate`` adds in place only into a tensor that is not a view
    and whose last reference it holds): three [V, h] buffers at the peak, predicted."""
    torch.manual_seed(0)
    model, ids = TiedEmbedding(), torch.randint(0, 8192, (2, 8))
    trace = record_eager_step(model, (ids,), None)
    weight_sized = [str(trace.op_nodes[s.allocated_at].target) for s in trace.storages if s.nbytes == 8192 * 64 * 4]
    assert weight_sized == ["aten.mm.default", "aten.embedding_dense_backward.default", "aten.add.Tensor"]
    for sch in (schedules.none(2), schedules.uniform(1, 2)):
        r = eager_program(model, (ids,), None, sch, layers="layers")
        assert r.predicted.peak_bytes == r.measured_peak_bytes, (sch.provenance, r.predicted.peak_bytes,
                                                                 r.measured_peak_bytes)


class TiedFunction(torch.autograd.Function):
    """An output layer as Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
    computes its weight gradient: ``grad.t().matmul(input)``, a tensor of its own."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class TiedOwnGradient(TiedEmbedding):
    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.logsumexp(TiedFunction.apply(x, self.emb.weight), -1).mean()


def test_a_tied_weights_gradient_of_its_own_is_summed_into_in_place():
    """When the first gradient is a tensor of its own whose last reference autograd's
    input buffer holds (Megatron-LM's output layer), eager adds the second into it in
    place, where the recording on fake tensors (a tensor subclass) adds out of place:
    the recording models eager's rule, so the sum is no third [V, h] buffer and the peak
    is exact (it was 2 MiB over; Megatron-Core with tied embeddings 8 MiB over)."""
    torch.manual_seed(0)
    model, ids = TiedOwnGradient(), torch.randint(0, 8192, (2, 8))
    trace = record_eager_step(model, (ids,), None)
    weight_sized = [str(trace.op_nodes[s.allocated_at].target) for s in trace.storages if s.nbytes == 8192 * 64 * 4]
    assert weight_sized == ["aten.mm.default", "aten.embedding_dense_backward.default"], weight_sized
    for sch in (schedules.none(2), schedules.uniform(1, 2)):
        r = eager_program(model, (ids,), None, sch, layers="layers")
        assert r.predicted.peak_bytes == r.measured_peak_bytes, (sch.provenance, r.predicted.peak_bytes,
                                                                 r.measured_peak_bytes)


def test_a_transformers_sdpa_model_takes_the_eager_steps_branches():
    """transformers' Llama with its default SDPA attention, per-layer checkpoint: on real
    tensors the mask code reads values (``.item()``) and skips the causal mask
    (``is_causal``), on fake tensors ``is_tracing`` said "tracing" and a mask was built:
    predicted 644,552 B against 617,928 B measured before the values were replayed.
    Predicted == measured now, and the recording without weights (the values decided by
    ``arange``'s constants) has the same ops and storages."""
    transformers = pytest.importorskip("transformers")
    from remat_pass.graph.eager_branches import eager_scalar_values
    from remat_pass.models.configs import ModelSpec, build_from_config

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=32)
    built = [build_from_config(cfg, ModelSpec(task="causal-lm", dtype="float32", meta=meta, batch=2, seq=32, seed=0))
             for meta in (False, True)]
    (model, inputs, loss_fn), (meta, meta_inputs, _) = built
    assert model.config._attn_implementation == "sdpa"
    sch = schedules.uniform(1, 2)
    r = eager_program(model, inputs, loss_fn, sch, layers="model.layers")
    assert r.predicted.peak_bytes == r.measured_peak_bytes
    real = with_checkpoints(model, sch, "model.layers")
    with_values = record_eager_step(real, inputs, loss_fn, scalars=eager_scalar_values(real, inputs, loss_fn))
    without = record_eager_step(with_checkpoints(meta, sch, "model.layers"), meta_inputs, loss_fn)
    assert not without.notes
    assert [str(n.target) for n in without.op_nodes] == [str(n.target) for n in with_values.op_nodes]
    assert [(s.nbytes, s.allocated_at, s.freed_before) for s in without.storages] == \
        [(s.nbytes, s.allocated_at, s.freed_before) for s in with_values.storages]


def test_without_weights_a_value_no_constant_decides_takes_the_fake_branches_and_says_so():
    """The same Llama without weights given an ``attention_mask`` (a meta tensor: no
    values): whether SDPA may skip the mask depends on it, so the recording takes the
    branches transformers takes for fake tensors, and its notes say so."""
    transformers = pytest.importorskip("transformers")
    from remat_pass.graph.eager_branches import FAKE_BRANCHES
    from remat_pass.models.configs import ModelSpec, build_from_config

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=32)
    meta, inputs, loss_fn = build_from_config(cfg, ModelSpec(task="causal-lm", dtype="float32", meta=True, batch=2,
                                                             seq=32, seed=0))
    inputs = {**inputs, "attention_mask": torch.ones(2, 32, dtype=torch.long, device="meta")}
    assert record_eager_step(meta, inputs, loss_fn).notes == (FAKE_BRANCHES,)
