"""Per-rank memory of parallel training steps: predicted vs measured on real process groups.

    python benchmarks/distributed.py [--json PATH] [--only NAME ...] [--device cpu|cuda] [--repeats N]

For each configuration the ranks are first planned in this process with the fake
process group (``parallel_plan.predict_config``: no processes), then launched
(``launch.run_ranks``, gloo on CPU, nccl on CUDA): every rank traces its own stages,
runs one warm-up and ``repeats`` measured steps of its pipeline schedule per recompute
setting, and compares its gradients with the single-process model. Printed per rank:
the prediction (fake process group; the rank's own trace must give the same), the
least measured peak, the spread of the repeats, the gradients. Configurations: TP=2
with and without SP, PP=2 and PP=4 with 1F1B and GPipe (m = 4, 8), interleaved 1F1B
(p = 2, v = 2), TP=2 x PP=2, FSDP2 with 2 ranks; settings none / uniform K / block N
(FSDP2: none, eager ``fully_shard``). A rank that fails ends every other rank and is
reported (which rank, why). On CUDA machines ``--device cuda`` runs the same ranks
with nccl, one GPU per rank (not run on this project's CPU machines).

The models: ``remat_pass.models:tiny_llama`` (hidden 64, 4 heads, FFN 128, seq 32,
vocab 128; the project's own pipeline layout and tensor-parallel plan), fp32; the
Hugging Face ``LlamaForCausalLM`` of ``remat_pass.models.hf_families:llama`` (hidden 32,
4 heads, 2 KV heads, seq 16, vocab 64) split and sharded by its own ``base_model_pp_plan``
and ``_tp_plan`` (rows named ``hf-llama/...``); and a plain ``nn.ModuleList`` GPT
with no attribute of this project (``tests/helpers/user_models.py``, rows
``plain-gpt/...``), split by ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # user_models

from remat_pass.parallel.distributed import RunOptions, measure_config  # noqa: E402
from remat_pass.parallel.fsdp_measure import measure_fsdp  # noqa: E402
from remat_pass.formatting import text_table  # noqa: E402
from remat_pass.parallel.launch import RankFailed  # noqa: E402
from remat_pass.models import build  # noqa: E402
from remat_pass.parallel.hf_plans import rank_step_model  # noqa: E402
from remat_pass.parallel.ranks import ParallelConfig, validate  # noqa: E402
from remat_pass.parallel.plan import predict_config  # noqa: E402

FACTORY = "remat_pass.models:tiny_llama"
HF_LLAMA = "remat_pass.models.hf_families:llama"
PLAIN_GPT = "user_models:plain_gpt"
SHORT = {FACTORY: "", HF_LLAMA: "hf-llama/", PLAIN_GPT: "plain-gpt/"}
NONE, U1, U2, B1 = ("none", None), ("uniform", 1), ("uniform", 2), ("block", 1)


@dataclasses.dataclass(frozen=True)
class Case:
    config: ParallelConfig
    factory_kwargs: tuple[tuple[str, int], ...]
    settings: tuple[tuple[str, int | None], ...]
    repeats: int = 1
    factory: str = FACTORY

    @property
    def name(self) -> str:
        """The configuration's name, prefixed by the model's (``hf-llama/tp2``)."""
        return SHORT[self.factory] + self.config.name


CASES = [
    Case(ParallelConfig(tp=2), (("batch", 4), ("layers", 4)), (NONE, U1, U2, B1), repeats=5),
    Case(ParallelConfig(tp=2, sp=True), (("batch", 4), ("layers", 4)), (NONE, U1, U2, B1), repeats=5),
    Case(ParallelConfig(pp=2, microbatches=4), (("batch", 8), ("layers", 4)), (NONE, U1, U2, B1)),
    Case(ParallelConfig(pp=2, microbatches=4, pipeline_schedule="gpipe"), (("batch", 8), ("layers", 4)),
         (NONE, U1, U2, B1)),
    Case(ParallelConfig(pp=4, microbatches=8), (("batch", 8), ("layers", 8)), (NONE, U1, U2, B1)),
    Case(ParallelConfig(pp=4, microbatches=8, pipeline_schedule="gpipe"), (("batch", 8), ("layers", 8)),
         (NONE, U1, U2, B1)),
    Case(ParallelConfig(pp=2, microbatches=4, pipeline_schedule="interleaved", vpp=2), (("batch", 8), ("layers", 8)),
         (NONE, U1, U2)),
    Case(ParallelConfig(tp=2, sp=True, pp=2, microbatches=4), (("batch", 8), ("layers", 4)), (NONE, U1), repeats=3),
    Case(ParallelConfig(fsdp=2), (("batch", 8), ("layers", 4)), (NONE,), repeats=3),
    Case(ParallelConfig(tp=2), (("batch", 4), ("layers", 4)), (NONE, U1, U2, B1), repeats=5, factory=HF_LLAMA),
    Case(ParallelConfig(pp=2, microbatches=4), (("batch", 8), ("layers", 4)), (NONE, U1, U2, B1), factory=HF_LLAMA),
    Case(ParallelConfig(pp=4, microbatches=8), (("batch", 8), ("layers", 8)), (NONE, U1, U2, B1), factory=HF_LLAMA),
    Case(ParallelConfig(pp=4, microbatches=8, pipeline_schedule="gpipe"), (("batch", 8), ("layers", 8)),
         (NONE, U1, U2, B1), factory=HF_LLAMA),
    Case(ParallelConfig(pp=2, microbatches=4, pipeline_schedule="interleaved", vpp=2), (("batch", 8), ("layers", 8)),
         (NONE, U1, U2), factory=HF_LLAMA),
    Case(ParallelConfig(tp=2, pp=2, microbatches=4), (("batch", 8), ("layers", 4)), (NONE, U1), repeats=3,
         factory=HF_LLAMA),
    Case(ParallelConfig(fsdp=2), (("batch", 8), ("layers", 4)), (NONE,), repeats=3, factory=HF_LLAMA),
    Case(ParallelConfig(pp=2, microbatches=4), (("batch", 8), ("layers", 4)), (NONE, U1, U2, B1), factory=PLAIN_GPT),
]


def run_case(case: Case, device: str) -> tuple[list[dict], str | None]:
    """Predict (fake process group) and measure one configuration; JSON rows and the
    failure (None when every rank returned)."""
    model, inputs = rank_step_model(*build(case.factory, **dict(case.factory_kwargs))[:2])
    validate(case.config, model, inputs[0].shape[0], inputs[0].shape[1])
    options = RunOptions(case.factory, case.factory_kwargs, case.settings, repeats=case.repeats, device=device)
    try:
        if case.config.fsdp > 1:
            return [fsdp_row(r) for r in measure_fsdp(case.config, options)], None
        fake = predict_config(model, inputs, case.config, case.settings, "cuda" if device == "cuda" else "cpu")
        measured = measure_config(case.config, options)
    except RankFailed as e:
        return [], str(e) + "".join(f"\n--- rank {f.rank} ---\n{f.detail}" for f in e.failures[:1] if f.detail)
    by_key = {(p.schedule, p.rank): p for rank_preds in fake for p in rank_preds}
    rows = []
    for r in measured:
        p = by_key[(r.schedule, r.rank)]
        rows.append({
            "config": r.config, "schedule": r.schedule, "rank": r.rank, "stage": list(r.stages),
            "predicted_peak_bytes": p.peak_bytes, "measured_peak_bytes": r.measured_peak_bytes,
            "grads_equal": r.grads_equal, "measured_runs_bytes": list(r.measured_runs_bytes),
            "rank_trace_predicted_peak_bytes": r.predicted_peak_bytes,
            "error_fraction": (p.peak_bytes - r.measured_peak_bytes) / r.measured_peak_bytes,
            "in_flight": p.peak.in_flight, "held_bytes": p.peak.held_bytes, "peak_action": p.peak.action,
            "accumulator_bytes": p.peak.accumulator_bytes, "buffer_bytes": p.peak.buffer_bytes,
            "microbatch_bytes": p.peak.microbatch_bytes,
            "peak_node": p.peak.node, "static_bytes": p.static_bytes,
            "grads_bitwise_vs_single_process": r.grads_bitwise_vs_single_process,
            "max_grad_diff_vs_single_process": r.max_grad_diff_vs_single_process,
        })
    return rows, None


def fsdp_row(r) -> dict:  # noqa: ANN001
    return {"config": r.config, "schedule": r.schedule, "rank": r.rank, "stage": [0],
            "predicted_peak_bytes": r.predicted_peak_bytes, "measured_peak_bytes": r.measured_peak_bytes,
            "grads_equal": r.grads_equal, "measured_runs_bytes": list(r.measured_runs_bytes),
            "rank_trace_predicted_peak_bytes": r.predicted_peak_bytes,
            "error_fraction": (r.predicted_peak_bytes - r.measured_peak_bytes) / r.measured_peak_bytes,
            "in_flight": 1, "held_bytes": 0, "peak_action": r.predicted_where, "peak_node": r.predicted_where,
            "static_bytes": r.static_bytes, "grads_bitwise_vs_single_process": False,
            "max_grad_diff_vs_single_process": r.max_grad_diff_vs_single_process,
            "hooks": [{"hook": h, "predicted_bytes": p, "measured_bytes": m} for h, p, m in r.hooks]}


def table(rows: list[dict]) -> str:
    return text_table(
        ["config", "rank", "stage", "schedule", "predicted", "measured", "diff", "runs (max)", "in flight",
         "peak at", "grads"],
        [[r["config"], str(r["rank"]), ",".join(map(str, r["stage"])), r["schedule"], str(r["predicted_peak_bytes"]),
          str(r["measured_peak_bytes"]), f"{100 * r['error_fraction']:+.3f}%",
          str(max(r["measured_runs_bytes"])), str(r["in_flight"]), r["peak_action"] + " " * 0,
          "equal" if r["grads_equal"] else "DIFFER"] for r in rows],
        "lrrlrrrrrll")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write one row per (configuration, schedule, rank)")
    ap.add_argument("--only", nargs="*", metavar="NAME", help="configurations to run (e.g. tp2-sp pp2-1f1b-m4)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, metavar="N",
                    help="measured steps per setting and rank, instead of each configuration's own (1-5)")
    args = ap.parse_args(argv)
    names = [case.name for case in CASES]
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        ap.error(f"--only: no configuration named {', '.join(unknown)}; the names are: {', '.join(names)}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1 measured step")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs CUDA, and this PyTorch sees no CUDA device")
    torch.set_num_threads(1)
    rows, failures = [], []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        t0 = time.perf_counter()
        if args.repeats:
            case = dataclasses.replace(case, repeats=args.repeats)
        got, failure = run_case(case, args.device)
        print(f"{case.name}: {case.config.world_size} ranks, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        if failure:
            print(f"{case.name} FAILED: {failure}", file=sys.stderr)
            failures.append(case.name)
        for r in got:
            r["config"] = SHORT[case.factory] + r["config"]
        rows += got
        if got:
            print(table(got), flush=True)
            inconsistent = [r for r in got if r["rank_trace_predicted_peak_bytes"] != r["predicted_peak_bytes"]]
            if inconsistent:
                print(f"  fake-process-group and rank traces disagree on {len(inconsistent)} rows", flush=True)
            for h in (r.get("hooks") or [] for r in got[:1]):
                print(text_table(["FSDP hook", "predicted", "measured (least)", "diff"],
                                 [[x["hook"], str(x["predicted_bytes"]), str(x["measured_bytes"]),
                                   str(x["predicted_bytes"] - x["measured_bytes"])] for x in h]) if h else "")
    exact = sum(r["predicted_peak_bytes"] == r["measured_peak_bytes"] for r in rows)
    worst = max((abs(r["error_fraction"]) for r in rows), default=0.0)
    print(f"\n{exact} of {len(rows)} rank rows predicted to the byte; largest |error| {100 * worst:.4f}%; "
          f"gradients equal on {sum(r['grads_equal'] for r in rows)} of {len(rows)}"
          + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "rows": rows}, indent=1), encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if failures or not all(r["grads_equal"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
