"""Fake-tensor planning: a model without weights traces into the real joint graph, node
for node, and predicts the same bytes for every Megatron schedule (issue 11)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat_pass.recompute import schedule as schedules
from remat_pass.errors import RematError, UnsupportedGraph
from remat_pass.graph.fake_trace import check_trace_device, has_no_data, trace_joint_fake
from remat_pass.liveness.timeline import analyze
from remat_pass.graph.regions import assign_layers
from remat_pass.recompute.rewrite import rewrite
from remat_pass.evaluate.session import Session
from remat_pass.graph.trace import trace_joint

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


def node_signature(gm: torch.fx.GraphModule) -> list[tuple]:
    """Op, shapes, dtypes, strides, storage offset, storage-sharing group, device and
    requires_grad of every node's value, in graph order (the group: the index of the
    first node whose value used that storage)."""
    first_of: dict[int, int] = {}
    out = []

    def leaf(v, i):  # noqa: ANN001, ANN202
        if isinstance(v, torch.Tensor):
            group = first_of.setdefault(v.untyped_storage()._cdata, i)
            return (tuple(v.shape), str(v.dtype), tuple(v.stride()), v.storage_offset(), group,
                    v.device.type, v.requires_grad)
        if isinstance(v, (tuple, list)):
            return tuple(leaf(e, i) for e in v)
        return repr(v) if isinstance(v, (int, float, bool, type(None))) else type(v).__name__

    for i, n in enumerate(gm.graph.nodes):
        out.append((n.op, str(n.target) if n.op != "placeholder" else "", leaf(n.meta.get("val"), i)))
    return out


CONFIGS = {
    "llama": lambda L: (transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64), transformers.AutoModelForCausalLM),
    "gpt2": lambda L: (transformers.GPT2Config(
        n_layer=L, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0),
        transformers.AutoModelForCausalLM),
    "bert": lambda L: (transformers.BertConfig(
        num_hidden_layers=L, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256,
        max_position_embeddings=64), transformers.AutoModelForMaskedLM),
    "t5": lambda L: (transformers.T5Config(
        num_layers=L, num_decoder_layers=L, d_model=64, d_ff=128, d_kv=16, num_heads=4, vocab_size=256,
        decoder_start_token_id=0, pad_token_id=0), transformers.AutoModelForSeq2SeqLM),
}


def real_and_meta(name: str, layers: int, dtype: torch.dtype = torch.float32):
    """The same config with random weights and on the meta device, and their batches."""
    config, auto = CONFIGS[name](layers)
    torch.manual_seed(0)
    real = auto.from_config(config, dtype=dtype).train()
    with torch.device("meta"):
        meta = auto.from_config(config, dtype=dtype).train()
    ids = torch.randint(1, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    meta_ids = torch.empty(2, 32, dtype=torch.long, device="meta")
    return real, {"input_ids": ids, "labels": ids}, meta, {"input_ids": meta_ids, "labels": meta_ids}


def check_fake_equals_real(name: str, layers: int, dtype: torch.dtype = torch.float32, measure: bool = True) -> None:
    """Node for node, every distinct Megatron schedule predicted to the byte (CPU and CUDA
    allocators) under the same memory model, and the real step measures what both
    predict."""
    real, inputs, meta, meta_inputs = real_and_meta(name, layers, dtype)
    session = Session.create(real, inputs)
    fake = trace_joint_fake(meta, meta_inputs)
    assert fake.fake and not session.joint.fake
    assert node_signature(fake.gm) == node_signature(session.joint.gm)
    stack = assign_layers(fake)
    assert stack.path == session.stack.path
    for sched in schedules.distinct_megatron_schedules(stack.layers_per_stack):
        for allocator in ("cpu", "cuda"):
            # The same memory model for both: the real session's (op scratch calibrated on
            # this CPU; a bf16 matmul's scratch depends on the CPU's ISA, so the formula
            # table alone is not the right value on every machine).
            fake_step = rewrite(fake, stack, sched)
            predicted = analyze(fake_step, memory=session.memory_model(fake_step, allocator)).peak_bytes
            assert predicted == session.report(sched, allocator).peak_bytes, (name, sched.provenance, allocator)
        if measure:
            r = session.evaluate(sched)
            assert r.grads_equal
            assert r.measured_peak_bytes == r.predicted_peak_bytes, (name, sched.provenance)


def test_meta_llama_is_the_real_graph_and_predicts_the_same_bytes():
    """Llama (GQA, SDPA) on the meta device: the joint graph of the real model node for
    node, the same predicted peak for every Megatron schedule."""
    check_fake_equals_real("llama", 2, measure=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5"])
def test_fake_equals_real_and_the_real_run_measures_it(name):
    check_fake_equals_real(name, 3)


@pytest.mark.slow
def test_fake_equals_real_bf16():
    check_fake_equals_real("llama", 3, torch.bfloat16)


def test_trace_joint_refuses_a_meta_model():
    """The old silent failure (a joint graph without its backward) is an error that
    names the meta tensor and the function to use."""
    _, _, meta, meta_inputs = real_and_meta("gpt2", 1)
    with pytest.raises(UnsupportedGraph, match="meta device.*trace_joint_fake"):
        trace_joint(meta, meta_inputs)


def test_a_joint_graph_without_gradients_is_refused():
    """Negative control, the bug of issue 11 replayed: fakes on device meta (what
    AOTAutograd made of meta parameters) lose the backward of ``nll_loss``; the joint
    graph comes out without any gradient and is refused, never returned."""
    from remat_pass.graph.flat_step import flatten_step
    from remat_pass.graph.trace import capture_joint, joint_graph

    _, _, meta, meta_inputs = real_and_meta("gpt2", 1)
    flat = flatten_step(meta, meta_inputs, None)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    on_meta = [mode.from_tensor(v) for v in flat.primal_values]
    assert on_meta[0].device.type == "meta"
    joint, nfo = capture_joint(flat.fn, on_meta, dynamic=False, fake_mode=mode)
    with pytest.raises(UnsupportedGraph, match="no backward"):
        joint_graph(flat, joint, nfo, meta, on_meta, {}, None, primal_values=on_meta, fake=True)


def test_fake_cuda_is_refused_before_tracing():
    if torch.cuda.is_available():
        pytest.skip("this build can trace fake CUDA tensors")
    with pytest.raises(RematError, match="cannot trace fake CUDA"):
        check_trace_device("cuda")
    with pytest.raises(ValueError, match="not a device"):
        check_trace_device("gpu0")


def test_a_model_built_under_fake_tensor_mode_traces_and_is_predicted_only():
    """Parameters that are FakeTensors on the CPU: trace_joint traces them (as the real
    model would) and the step is predicted only."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        x = torch.empty(4, 8)
    assert has_no_data(model, (x,))
    session = Session.create(model, (x,), lambda y: y.sum())
    real = Session.create(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]), (torch.randn(4, 8),),
                          lambda y: y.sum())
    assert session.predicted_only and not real.predicted_only
    for sched in schedules.distinct_megatron_schedules(3):
        assert session.report(sched).peak_bytes == real.report(sched).peak_bytes
    with pytest.raises(RematError, match="predicted but not run"):
        session.evaluate(schedules.none(3))
    r = session.predict(schedules.uniform(1, 3))
    assert r.predicted_only and r.measured_peak_bytes is None and r.grads_equal is None


def test_tied_weights_stay_tied():
    """GPT-2 ties its embedding and head: one primal, one gradient, one storage."""
    real, inputs, meta, meta_inputs = real_and_meta("gpt2", 1)
    fake = trace_joint_fake(meta, meta_inputs)
    assert fake.primal_labels == trace_joint(real, inputs).primal_labels
    assert "lm_head.weight" not in fake.primal_labels


def test_a_closure_constant_on_the_meta_device_is_named():
    """A loss that closes over targets made on the meta device: they have no values.
    (The shipped tiny_gpt used to; it now makes its batch on the CPU.)"""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        inputs = (torch.randn(2, 4),)
        targets = torch.randn(2, 4)

    def loss_fn(out):
        return torch.nn.functional.mse_loss(out, targets)

    with pytest.raises(UnsupportedGraph, match="closes over.*meta device"):
        trace_joint_fake(model, inputs, loss_fn)


def test_reading_values_names_the_op():
    """A forward that calls .item() fails on a meta model as on a real one, naming the op."""

    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x):
            if x.sum().item() > 0:
                x = x * 2
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    with torch.device("meta"):
        model = ReadsValues()
        x = torch.empty(2, 4)
    with pytest.raises(UnsupportedGraph, match="_local_scalar_dense"):
        trace_joint_fake(model, (x,))


@pytest.mark.slow
def test_symbolic_fake_trace_equals_the_real_one():
    """batch and seq as symbols: the meta model's symbolic peaks are the real model's."""
    from remat_pass.liveness.symbolic import default_symbols, trace_symbolic

    real, inputs, meta, meta_inputs = real_and_meta("gpt2", 2)
    sym_real = trace_symbolic(real, inputs, None, default_symbols(inputs))
    sym_fake = trace_symbolic(meta, meta_inputs, None, default_symbols(meta_inputs))
    assert sym_fake.joint.fake
    for sched in schedules.distinct_megatron_schedules(2):
        assert sym_fake.peak(sched) == sym_real.peak(sched)
        assert sym_fake.peak_at(sched, batch=8, seq=48) == sym_real.peak_at(sched, batch=8, seq=48)


def test_trace_model_is_the_one_choice_of_real_or_fake():
    """``fake_trace.trace_model`` traces a model with weights for real, one on the meta
    device (or any, with ``fake=True``) with fake tensors under the given kernels, node
    for node the same graph; a pipeline stage (``output="activation"``: its output's
    tangent a placeholder) alike."""
    from remat_pass.graph.fake_trace import trace_model

    entered = []

    class Kernels:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    def chain():
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    torch.manual_seed(0)
    real = trace_model(chain(), (torch.randn(3, 4),), lambda y: y.sum(), kernels=Kernels)
    assert not real.fake and not entered
    with torch.device("meta"):
        meta_model = chain()
    meta = trace_model(meta_model, (torch.empty(3, 4, device="meta"),), lambda y: y.sum(), kernels=Kernels)
    fake = trace_model(chain(), (torch.randn(3, 4),), lambda y: y.sum(), fake=True)
    assert meta.fake and fake.fake and entered == [True]
    assert node_signature(meta.gm) == node_signature(fake.gm)
    assert [n.target for n in real.gm.graph.nodes] == [n.target for n in meta.gm.graph.nodes]
    stage_real = trace_model(chain(), (torch.randn(3, 4),), None, output="activation")
    stage_fake = trace_model(chain(), (torch.randn(3, 4),), None, fake=True, output="activation")
    assert stage_fake.fake and not stage_real.fake
    assert node_signature(stage_fake.gm) == node_signature(stage_real.gm)
    assert [n.op for n in stage_fake.gm.graph.nodes].count("placeholder") == len(stage_fake.primal_values) + 1
