"""Op-level policies: Megatron's selective recompute saves exactly what the module
structure says, module kinds are found by data flow in Hugging Face and hand-written
layers, a recompute of dropout without RNG replay is refused, gradients stay bitwise
equal, and bad names are clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from small_models import small_gpt2, small_tiny_gpt
from remat_pass.recompute import schedule as schedules
from remat_pass.compile.options import BackendOptions
from remat_pass.cli.main import EXIT_USAGE, main
from remat_pass.errors import InvalidSchedule
from remat_pass.graph.module_paths import normalize_module_path
from remat_pass.recompute.partition import partition
from remat_pass.recompute.policies import module_kinds, recompute_modules, save_policy
from remat_pass.recompute.rewrite import rewrite
from remat_pass.evaluate.session import Session


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch threads = 1


# --------------------------------------------------------------------------- a Megatron-style GPT


class CoreAttention(nn.Module):
    """Megatron's DotProductAttention: scores, causal mask, softmax, dropout, x values."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v):
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return self.dropout(scores.softmax(-1)) @ v


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.core_attention = CoreAttention(dropout)
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.linear_qkv(x).split(c, -1))
        return self.linear_proj(self.core_attention(q, k, v).transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 4 * hidden)
        self.linear_fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = SelfAttention(hidden, heads, dropout)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class MegatronGPT(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=2, layers=3, dropout=0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, dropout) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.output_layer(self.final_layernorm(x)).flatten(0, 1), ids.roll(-1, 1).flatten())


@pytest.fixture(scope="module")
def megatron_session() -> Session:
    torch.manual_seed(0)
    model = MegatronGPT().train()
    return Session.create(model, (torch.randint(0, 64, (2, 16)),))


def _innermost(node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    values = list(stack.values())
    return normalize_module_path(str(values[-1][0])) if values else ""


def test_selective_saves_what_the_module_structure_says(megatron_session):
    """Megatron-LM ``--recompute-granularity selective`` on a GPT block: in every layer
    the saved values are those of ``none`` minus the core attention's, plus what the
    core attention reads from outside it (q, k, v), plus its values that backward reads
    outside it (its output, read by linear_proj's weight gradient). Computed here from
    the recorded module paths, not from the policy's own data flow."""
    s = megatron_session
    joint, stack = s.joint, s.stack
    p = recompute_modules(joint, stack, ["core_attn"])
    stored = partition(joint, stack, schedules.none(stack.num_layers))
    forward = set(stack.forward_nodes)
    nodes = list(joint.gm.graph.nodes)
    for layer in range(stack.num_layers):
        core_path = f"{stack.path}.{stack.child_names[layer]}.self_attention.core_attention"

        def in_core(n) -> bool:
            path = _innermost(n)
            return path == core_path or path.startswith(core_path + ".")

        core = {n.name for n in nodes if n.name in forward and n.op == "call_function" and in_core(n)}
        assert core, "the core attention records no node"
        reads_in = {a.name for n in nodes if n.name in core for a in n.all_input_nodes
                    if a.name not in core and a.op == "call_function"}
        read_outside = {a.name for b in nodes if b.name not in forward and b.op == "call_function"
                        and not in_core(b) for a in b.all_input_nodes if a.name in core}
        expected = ({v.name for v in stored.saved if stack.layer_of[v.name] == layer} - core) | reads_in | read_outside
        got = {v.name for v in p.saved if stack.layer_of[v.name] == layer}
        assert got == expected, (layer, sorted(got ^ expected), joint.gm.graph)
        recomputed = {n for seg in p.segments for n in seg.nodes if stack.layer_of[n] == layer}
        assert recomputed and recomputed <= core
        assert any("dropout" in n for n in recomputed)  # the attention dropout is recomputed, replayed
    r = s.evaluate(p)
    assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes
    assert r.predicted_peak_bytes < s.evaluate(schedules.none(stack.num_layers)).predicted_peak_bytes


def test_dropout_recomputed_without_replay_is_refused(megatron_session):
    """The negative control: the same partition with the RNG replay of its dropout
    taken away is refused by the rewrite (it would draw new random numbers)."""
    s = megatron_session
    p = recompute_modules(s.joint, s.stack, ["core_attn"])
    i = next(i for i, seg in enumerate(p.segments) if seg.rng_replayed)
    stripped = dataclasses.replace(p, segments=tuple(
        dataclasses.replace(seg, rng_replayed=()) if k == i else seg for k, seg in enumerate(p.segments)))
    with pytest.raises(InvalidSchedule, match="without replaying its RNG state") as e:
        rewrite(s.joint, s.stack, stripped)
    assert p.segments[i].rng_replayed[0] in str(e.value)


@pytest.mark.slow
def test_kinds_found_by_data_flow_in_hugging_face_and_inline_attention():
    """GPT-2 (transformers: attention inside GPT2Attention, no core module) and TinyGPT
    (attention written inline in the block): core attention holds the softmax or
    SDPA, no projection; the MLP holds both projections and the activation."""
    gpt2 = Session.create(*small_gpt2(layers=2, dropout=0.1))
    tiny = Session.create(*small_tiny_gpt(layers=2))
    for s, attention_op in ((gpt2, "_softmax"), (tiny, "_scaled_dot_product_flash_attention_for_cpu")):
        kinds = module_kinds(s.joint, s.stack)
        assert {"core_attn", "mlp", "layernorm"} <= set(kinds)
        by_name = {n.name: n for n in s.joint.gm.graph.nodes}
        for layer in range(s.stack.num_layers):
            ops = {getattr(by_name[n].target, "__name__", "") for n in kinds["core_attn"][layer]}
            assert any(o.startswith(attention_op) for o in ops), ops
            assert not any(o.startswith(("addmm", "native_layer_norm", "gelu")) for o in ops), ops
            mlp_ops = [getattr(by_name[n].target, "__name__", "") for n in kinds["mlp"][layer]]
            assert sum(o.startswith("addmm") for o in mlp_ops) == 2, mlp_ops
            assert not set(kinds["mlp"][layer]) & set(kinds["core_attn"][layer])
        if s is gpt2:  # everything core lies inside the attention module
            for layer, names in kinds["core_attn"].items():
                assert all(_innermost(by_name[n]).startswith(f"transformer.h.{layer}.attn") for n in names)


@pytest.mark.slow
def test_save_policies_keep_gradients_and_refuse_bad_names():
    s = Session.create(*small_gpt2(layers=2, dropout=0.1))
    none = s.evaluate(schedules.none(2))
    for p in (save_policy(s.joint, s.stack, "dots_saveable"),
              save_policy(s.joint, s.stack, "nothing_saveable", schedule=schedules.block(1, 2)),
              recompute_modules(s.joint, s.stack, ["core_attn", "mlp"])):
        r = s.evaluate(p)
        assert r.grads_equal and r.predicted_peak_bytes == r.measured_peak_bytes, p.provenance
        assert r.predicted_peak_bytes < none.predicted_peak_bytes and r.recomputed_nodes > 0
    # dots_saveable recomputes no matmul: its recompute costs bytes moved, no FLOPs
    r = s.evaluate(save_policy(s.joint, s.stack, "dots_saveable"))
    assert r.recompute_flops == 0 and r.recompute_bytes_moved > 0
    with pytest.raises(InvalidSchedule, match="dots_saveable"):
        save_policy(s.joint, s.stack, "dot_saveable")
    with pytest.raises(InvalidSchedule, match="core_attn, mlp, layernorm"):
        recompute_modules(s.joint, s.stack, ["mlp", "attention"])
    with pytest.raises(InvalidSchedule, match="no module of kind moe.*kinds found: core_attn"):
        recompute_modules(s.joint, s.stack, ["moe"])
    with pytest.raises(InvalidSchedule, match="modules of a layer are"):
        save_policy(s.joint, s.stack, "save_only_these_names", ["no_such_module"])
    kept = save_policy(s.joint, s.stack, "save_only_these_names", ["attn.c_proj", "mlp.c_fc"])
    assert s.evaluate(kept).grads_equal


def test_command_line_and_backend_names_are_checked(capsys):
    for argv, legal in ((["sweep", "--recompute-modules", "core_attn,attention"], "core_attn, mlp, layernorm"),
                        (["sweep", "--policy", "dot_saveable"], "dots_saveable"),
                        (["sweep", "--selective", "--policy", "dots_saveable"], "one of --selective")):
        assert main(argv) == EXIT_USAGE
        assert legal in capsys.readouterr().err
    with pytest.raises(InvalidSchedule, match="granularity='op'"):
        BackendOptions(schedule="none", policy="dots_saveable")
    with pytest.raises(InvalidSchedule, match="exactly one of"):
        BackendOptions(schedule="none", granularity="op")
    with pytest.raises(InvalidSchedule, match="not recompute modules"):
        BackendOptions.from_dict({"granularity": "op", "recompute_modules": ["mlp", "attn"]})
    o = BackendOptions.from_dict({"granularity": "op", "recompute_modules": ["core_attn"],
                                  "module_names": {"mlp": ["ffn"]}})
    assert o.schedule == "none" and o.recompute_modules == ("core_attn",) and hash(o)
    assert BackendOptions.from_dict({"granularity": "op", "budget_bytes": 10**6}).schedule == "optimized"
