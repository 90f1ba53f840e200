"""The CUDA target on a CPU-only machine: the SDPA backend PyTorch's
``select_sdp_backend`` would pick, and the aten op it puts into the traced step."""

from __future__ import annotations

import json

import pytest
import torch

from remat_pass.memory.cuda_target import GPUS, GpuSpec, select_sdpa_backend
from remat_pass.evaluate.workload import WorkloadOptions, load_workload


def qkv(dtype=torch.bfloat16, heads=8, kv_heads=8, seq=64, dim=64):
    q = torch.empty(2, heads, seq, dim, dtype=dtype, device="meta")
    k = torch.empty(2, kv_heads, seq, dim, dtype=dtype, device="meta")
    return q, k, k.clone()


MASK = torch.empty(2, 1, 64, 64, dtype=torch.bool, device="meta")
T4 = GpuSpec("t4", (7, 5), cudnn_version=None)
NEW_CUDNN = GpuSpec("h100", (9, 0), cudnn_version=91600)

# (case, q/k/v, keyword arguments, gpu, backend) — sdp_utils.cpp's checks in priority order
CASES = [
    ("bf16 causal: flash", qkv(), {"is_causal": True}, GPUS["h100"], "flash"),
    ("fp32: efficient (flash is fp16/bf16 only)", qkv(torch.float32), {}, GPUS["h100"], "efficient"),
    ("bf16 with a mask: efficient (flash takes no mask)", qkv(), {"attn_mask": MASK}, GPUS["h100"], "efficient"),
    ("bf16 GQA: flash supports grouped-query attention", qkv(kv_heads=2), {"enable_gqa": True}, GPUS["h100"],
     "flash"),
    ("fp32 GQA: efficient does not, math", qkv(torch.float32, kv_heads=2), {"enable_gqa": True}, GPUS["h100"],
     "math"),
    ("bf16 GQA with a mask: math", qkv(kv_heads=2), {"attn_mask": MASK, "enable_gqa": True}, GPUS["h100"],
     "math"),
    ("bf16 on sm75: no flash, efficient has no bf16 below sm80: math", qkv(), {}, T4, "math"),
    ("fp16 on sm75: efficient", qkv(torch.float16), {}, T4, "efficient"),
    ("cuDNN newer than 9.15 on sm90 goes first", qkv(), {"is_causal": True}, NEW_CUDNN, "cudnn"),
    ("cuDNN supports GQA", qkv(kv_heads=2), {"enable_gqa": True}, NEW_CUDNN, "cudnn"),
]


@pytest.mark.parametrize("case,tensors,kwargs,gpu,backend", CASES, ids=[c[0] for c in CASES])
def test_sdpa_backend_choice(case, tensors, kwargs, gpu, backend):
    assert select_sdpa_backend(*tensors, gpu=gpu, **kwargs) == backend


TINY_GQA_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                  "max_position_embeddings": 64}


@pytest.mark.parametrize("dtype,op", [("bfloat16", "_scaled_dot_product_flash_attention"),
                                      ("float32", "_scaled_dot_product_attention_math")])
def test_a_gqa_llama_traces_with_the_kernel_the_gpu_runs(tmp_path, dtype, op):
    """transformers calls SDPA with enable_gqa=True when there is no mask: bf16 runs
    flash (saves a log-sum-exp, no s x s tensor); fp32 falls back to math (before, the
    memory-efficient kernel was chosen and its backward refused the key/value heads)."""
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(TINY_GQA_LLAMA))
    w = load_workload(WorkloadOptions(config=str(path), meta=True, dtype=dtype, target="cuda", batch=2, seq=48,
                                      calibrate=False))
    targets = {str(n.target) for n in w.joint.gm.graph.nodes if n.op == "call_function"}
    attention = {t for t in targets if "scaled_dot_product" in t}
    assert any(op in t for t in attention) or (op.endswith("_math") and not attention), attention
    seq_squared = [n for n in w.joint.gm.graph.nodes  # [batch, heads, seq, seq] probabilities
                   if isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape) == (2, 4, 48, 48)]
    assert bool(seq_squared) == (dtype == "float32")
