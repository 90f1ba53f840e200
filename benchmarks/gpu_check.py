"""One prepared check of the CUDA target: predicted (``--target cuda``: a fake trace on
the CPU with the GPU's kernels and allocator modelled) against measured on the GPU.

    python benchmarks/gpu_check.py [--device auto|cuda|cpu] [--quick] [--models gpt2,llama,bert]
        [--dtypes float32,bfloat16] [--json gpu_check.json]

For GPT-2 (the default model), a Llama and a BERT at sizes that fit, in fp32 and bf16,
under none, uniform K=1 and 2, block N=2 and the optimized schedule (budget halfway
between the least feasible peak and none's): the predicted peak, the measured peak
(CUDA: ``max_memory_allocated`` above ``memory_allocated`` at the start of the step,
after a warm-up step; CPU: the profiler's allocator events), their difference, and the
gradients (bitwise against the un-rewritten step on the same device, and the largest
difference from eager autograd). One table on stdout, the rows as JSON with ``--json``.
The user's eager program (``evaluate.eager_program``, without the rewrite) follows per
model under none, uniform K=1 and block N=2 (``check_eager``; ``--no-eager`` leaves it
out): predicted for the GPU (``eager_program(gpu=...)``) against the same
``max_memory_allocated`` measurement of the eager step.

On CUDA the allocator runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
(set before CUDA starts; ``--default-allocator`` leaves it), under which every block is
split at 512 bytes and the 512-byte rounding of the prediction is exact
(``cuda_target``); without it a large block may be charged up to 1 MiB more. The
GPU's compute capability and cuDNN version are read from the device. The goal is
|predicted - measured| <= 0.5 % of measured.

``--device auto`` (the default) is ``cuda``: without a CUDA device the script exits 2
with one line saying so (it used to fall back to a full-size CPU run). With
``--device cpu`` (what CI runs, with ``--quick``) the same rows compare the CPU target's
prediction with the CPU measurement, and also check that the fake trace
(no weights) predicts the same bytes as the real one. Exit 1 when a gradient differs or
a fake prediction differs from the real one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--default-allocator" not in sys.argv:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat_pass.recompute import schedule as schedules  # noqa: E402
from remat_pass.models.configs import ModelSpec, build_from_config  # noqa: E402
from remat_pass.memory.cuda_target import CudaKernels, GpuSpec  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.liveness.timeline import analyze  # noqa: E402
from remat_pass.plan.planner import Planner  # noqa: E402
from remat_pass.recompute.rewrite import rewrite  # noqa: E402
from remat_pass.evaluate.session import Session  # noqa: E402

SIZES = {  # (layers, hidden, heads, seq, batch, vocab)
    "full": (4, 512, 8, 512, 4, 8192),
    "quick": (2, 64, 4, 32, 2, 256),
}


def model_config(name: str, size: str):  # noqa: ANN201
    """A small transformers config of ``name`` (gpt2, llama, bert)."""
    import transformers

    layers, hidden, heads, seq, _, vocab = SIZES[size]
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                      n_positions=seq, bos_token_id=0, eos_token_id=0)
    elif name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                       num_attention_heads=heads, num_key_value_heads=heads // 2,
                                       vocab_size=vocab, max_position_embeddings=seq)
    elif name == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                      intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq)
    else:
        raise ValueError(f"model {name!r} is not one of gpt2, llama, bert")
    return cfg


def build(name: str, dtype: str, size: str, meta: bool, seed: int = 0):  # noqa: ANN201
    """``(model, inputs, loss_fn)`` on the CPU (or the meta device)."""
    _, _, _, seq, batch, _ = SIZES[size]
    cfg = model_config(name, size)
    task = "masked-lm" if name == "bert" else "causal-lm"
    return build_from_config(cfg, ModelSpec(task=task, dtype=dtype, meta=meta, batch=batch, seq=seq, seed=seed))


def to_device(x, device: str):  # noqa: ANN001, ANN201
    if isinstance(x, dict):
        return {k: v.to(device) for k, v in x.items()}
    return x.to(device)


def check(name: str, dtype: str, size: str, device: str) -> list[dict]:
    """The rows of one (model, dtype): predicted vs measured for every schedule."""
    torch.manual_seed(0)
    if device == "cuda":
        # predicted: fake trace on the CPU with the GPU's kernels and allocator modelled
        model, inputs, loss_fn = build(name, dtype, size, meta=True)
        gpu = GpuSpec.detect()
        predicted = Session.create(model, inputs, loss_fn, fake=True, kernels=lambda: CudaKernels(gpu))
        allocator = "cuda"
        model, inputs, loss_fn = build(name, dtype, size, meta=False)
        measured = Session.create(model.to("cuda"), to_device(inputs, "cuda"), loss_fn)
    else:
        model, inputs, loss_fn = build(name, dtype, size, meta=False)
        measured = Session.create(model, inputs, loss_fn)
        predicted, allocator = measured, "cpu"
        meta_model, meta_inputs, _ = build(name, dtype, size, meta=True)
        fake = Session.create(meta_model, meta_inputs, loss_fn)
    L = measured.stack.num_layers
    todo = [schedules.none(L), schedules.uniform(1, L), schedules.uniform(2, L), schedules.block(min(2, L), L)]
    planner = Planner(predicted.joint, predicted.stack, lambda s: predicted.report(s, allocator))
    least = planner.least_feasible()[1]
    budget = least + (planner.unconstrained_peak_bytes - least) // 2
    todo.append(planner.plan(budget).schedule)
    rows = []
    for sched in todo:
        pred = predicted.report(sched, allocator).peak_bytes
        t0 = time.perf_counter()
        r = measured.evaluate(sched, strict=False)
        row = {"model": name, "dtype": dtype, "device": device, "schedule": sched.provenance,
               "predicted_peak_bytes": pred, "measured_peak_bytes": r.measured_peak_bytes,
               "error_fraction": (pred - r.measured_peak_bytes) / r.measured_peak_bytes
               if r.measured_peak_bytes else None,
               "grads_equal": r.grads_equal, "max_grad_diff_vs_eager": r.max_grad_diff_vs_eager,
               "seconds": time.perf_counter() - t0}
        if device != "cuda":
            # under the real session's memory model (op scratch calibrated on this CPU): the
            # fake session cannot run its ops, and the formula table alone misses the bf16
            # matmul scratch of some CPUs
            fake_step = rewrite(fake.joint, fake.stack, sched)
            row["fake_equals_real"] = analyze(fake_step, memory=measured.memory_model(fake_step, allocator)).peak_bytes == pred
        if sched.method == "optimized":
            row["budget_bytes"] = budget
        row["program"] = "rewrite"
        rows.append(row)
    return rows


def measure_eager_cuda(model, inputs, loss_fn, sched, layers: str) -> int:  # noqa: ANN001
    """The user's eager step under ``sched`` on CUDA (the setting applied as
    ``eager_program`` applies it): ``max_memory_allocated`` above ``memory_allocated`` at
    the step's start, after two warm-up steps, ``.grad`` None before each (bytes)."""
    from remat_pass.evaluate.eager_program import with_checkpoints
    from remat_pass.graph.flat_step import extract_loss, split_inputs

    m = with_checkpoints(model, sched, layers) if sched.groups else model
    args, kwargs = split_inputs(inputs)
    params = list(m.parameters())
    for i in range(3):
        for q in params:
            q.grad = None
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        extract_loss(m(*args, **kwargs), loss_fn).backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    for q in params:
        q.grad = None
    return peak


def same_recording(real, meta, loss_fn, sched, layers: str) -> bool:  # noqa: ANN001
    """Whether the eager step recorded without weights (``meta``: model, inputs) has the
    ops and storages (sizes, allocation and death) of the one recorded with them
    (``real``, its values replayed): the op scratch aside, which the real one
    calibrates."""
    from remat_pass.evaluate.eager_program import with_checkpoints
    from remat_pass.graph.eager_branches import eager_scalar_values
    from remat_pass.graph.eager_trace import record_eager_step

    traces = []
    for (model, inputs), scalars in ((real, True), (meta, False)):
        m = with_checkpoints(model, sched, layers) if sched.groups else model
        trace = record_eager_step(m, inputs, loss_fn, scalars=eager_scalar_values(m, inputs, loss_fn) if scalars
                                  else None)
        traces.append(([str(n.target) for n in trace.op_nodes],
                       [(st.nbytes, st.allocated_at, st.freed_before) for st in trace.storages]))
    return traces[0] == traces[1]


def check_eager(name: str, dtype: str, size: str, device: str) -> list[dict]:
    """The rows of the user's eager program (``evaluate.eager_program``: the model as
    written, transformers' ``gradient_checkpointing_enable`` on the recomputed layers)
    under none, uniform K=1 and block N=2: on CUDA predicted for the detected GPU
    (``gpu=``) against ``measure_eager_cuda``; on the CPU predicted against the CPU
    measurement, and the recording without weights against the one with them
    (``same_recording``)."""
    from remat_pass.evaluate.eager_program import eager_program
    from remat_pass.graph.regions import find_layer_stacks

    torch.manual_seed(0)
    model, inputs, loss_fn = build(name, dtype, size, meta=False)
    (layers, children), = find_layer_stacks(model)
    L = len(children)
    rows = []
    for sched in (schedules.none(L), schedules.uniform(1, L), schedules.block(min(2, L), L)):
        t0 = time.perf_counter()
        row = {"model": name, "dtype": dtype, "device": device, "schedule": sched.provenance, "program": "eager"}
        if device == "cuda":
            pred = eager_program(model, inputs, loss_fn, sched, layers=layers, measure=False,
                                 gpu=GpuSpec.detect()).predicted.peak_bytes
            cuda_model, cuda_inputs, _ = build(name, dtype, size, meta=False)
            measured = measure_eager_cuda(cuda_model.to("cuda"), to_device(cuda_inputs, "cuda"), loss_fn, sched, layers)
        else:
            r = eager_program(model, inputs, loss_fn, sched, layers=layers)
            pred, measured = r.predicted.peak_bytes, r.measured_peak_bytes
            meta_model, meta_inputs, _ = build(name, dtype, size, meta=True)
            row["fake_equals_real"] = same_recording((model, inputs), (meta_model, meta_inputs), loss_fn, sched, layers)
        row.update(predicted_peak_bytes=pred, measured_peak_bytes=measured,
                   error_fraction=(pred - measured) / measured if measured else None,
                   grads_equal=True, max_grad_diff_vs_eager=None, seconds=time.perf_counter() - t0)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--quick", action="store_true", help="tiny sizes (what CI runs on the CPU)")
    p.add_argument("--models", default="gpt2,llama,bert")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--default-allocator", action="store_true",
                   help="do not set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--no-eager", action="store_true", help="leave out the rows of the user's eager program")
    args = p.parse_args(argv)
    device = "cuda" if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} needs CUDA, and this PyTorch ({torch.__version__}) sees no CUDA "
              "device; --device cpu [--quick] runs the CPU comparison instead", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    size = "quick" if args.quick else "full"
    rows = []
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            rows += check(name, dtype, size, device)
            if not args.no_eager:
                rows += check_eager(name, dtype, size, device)
            print(f"{name} {dtype}: {len(rows)} rows", file=sys.stderr, flush=True)
    header = ["model", "dtype", "program", "schedule", "predicted B", "measured B", "error %", "grads equal", "max |grad - eager|"]
    if device != "cuda":
        header.append("fake == real")
    table = []
    for r in rows:
        cells = [r["model"], r["dtype"], r.get("program", "rewrite"), r["schedule"], str(r["predicted_peak_bytes"]), str(r["measured_peak_bytes"]),
                 f"{100 * r['error_fraction']:+.3f}" if r["error_fraction"] is not None else "-",
                 "yes" if r["grads_equal"] else "NO",
                 f"{r['max_grad_diff_vs_eager']:.2e}" if r["max_grad_diff_vs_eager"] is not None else "-"]
        if device != "cuda":
            cells.append("yes" if r["fake_equals_real"] else "NO")
        table.append(cells)
    print(f"device {device}" + (f" ({torch.cuda.get_device_name()}, {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')})"
                                if device == "cuda" else "") + f", sizes {size} {SIZES[size]}")
    print(text_table(header, table))
    worst = max((abs(r["error_fraction"]) for r in rows if r["error_fraction"] is not None), default=0.0)
    print(f"largest |predicted - measured| / measured: {100 * worst:.3f} % (goal 0.5 %)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "size": size, "rows": rows}, indent=2) + "\n")
    ok = all(r["grads_equal"] and r.get("fake_equals_real", True) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
