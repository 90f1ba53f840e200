"""Does ``--recompute-num-layers`` K > 1 lower a pipeline stage's peak? The seed
question, asked where it was asked: pipeline stages with microbatches in flight.

Reads the JSON of ``benchmarks/distributed.py`` (every rank predicted by the
product and measured on gloo) and writes ``examples/recompute_num_layers_megatron.md``:
per configuration and stage, the peak under ``uniform`` K = 1..L_stage and
``block`` N (predicted and measured), which K is lowest, and the split read off the
prediction at the peak: the checkpoints held by the other microbatches in flight
versus the rest (this microbatch's backward timeline with its recompute working set,
the gradient accumulator, receive buffers). Every figure comes from the JSON.

Usage:
    python benchmarks/distributed.py --only pp2-1f1b-m4 pp2-gpipe-m4 pp4-1f1b-m8 pp4-gpipe-m8 --json pp.json
    python examples/recompute_num_layers_megatron.py pp.json [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat_pass.formatting import markdown_table  # noqa: E402

OUT = Path(__file__).resolve().parent / "recompute_num_layers_megatron.md"


def _k(schedule: str) -> int | None:
    return int(schedule.split("=")[1].rstrip(")")) if schedule.startswith("uniform") else None


def stage_section(config: str, rank: int, rows: list[dict]) -> tuple[list[str], dict]:
    """Markdown lines for one rank and its verdict (best K predicted / measured)."""
    table = [[r["schedule"], str(r["predicted_peak_bytes"]), str(r["measured_peak_bytes"]),
              str(r["in_flight"]), str(r["held_bytes"]), str(r["predicted_peak_bytes"] - r["held_bytes"]),
              r["peak_action"]] for r in rows]
    uniform = [r for r in rows if _k(r["schedule"]) is not None]
    best_pred = min(uniform, key=lambda r: (r["predicted_peak_bytes"], _k(r["schedule"])))
    best_meas = min(uniform, key=lambda r: (r["measured_peak_bytes"], _k(r["schedule"])))
    k1 = next(r for r in uniform if _k(r["schedule"]) == 1)
    lines = [f"### {config}, rank {rank} (stage {','.join(map(str, rows[0]['stage']))}, "
             f"{rows[0]['in_flight']} microbatches in flight at the peak)", "",
             markdown_table(["setting", "predicted B", "measured B", "in flight", "held by other microbatches B",
                             "rest B", "peak at"], table), ""]
    verdict = {"config": config, "rank": rank, "in_flight": k1["in_flight"],
               "best_predicted": best_pred["schedule"], "best_measured": best_meas["schedule"],
               "k1_held": k1["held_bytes"], "best_held": best_pred["held_bytes"],
               "k1_rest": k1["predicted_peak_bytes"] - k1["held_bytes"],
               "best_rest": best_pred["predicted_peak_bytes"] - best_pred["held_bytes"],
               "gain": k1["predicted_peak_bytes"] - best_pred["predicted_peak_bytes"]}
    return lines, verdict


def render(data: dict) -> str:
    rows = [r for r in data["rows"] if r["config"].startswith("pp")]
    if not rows:
        raise ValueError("no pipeline rows in the JSON (run benchmarks/distributed.py with pp configurations)")
    out = ["# `--recompute-num-layers` under pipeline parallelism (measured on gloo)", "",
           "Written by `examples/recompute_num_layers_megatron.py` from the JSON of `benchmarks/distributed.py` "
           f"(device: {data.get('device', 'cpu')}). Model: `remat_pass.models:tiny_llama` (hidden 64, 4 heads, "
           "FFN 128, seq 32, vocab 128, fp32), split evenly into stages as Megatron-LM does, each stage running "
           "Megatron's full recompute per stage. Bytes are activation bytes of one training step on that rank: "
           "predicted by composing the stage's per-microbatch timelines in schedule order, measured by the "
           "allocator profiler inside each rank. *held* = checkpoints (saved values) of the other microbatches "
           "in flight at the peak; *rest* = the peak minus *held*: this microbatch's backward timeline (its "
           "recompute working set), the gradient accumulator and the receive / send buffers.", ""]
    verdicts = []
    for config in dict.fromkeys(r["config"] for r in rows):
        for rank in sorted({r["rank"] for r in rows if r["config"] == config}):
            lines, v = stage_section(config, rank, [r for r in rows if r["config"] == config and r["rank"] == rank])
            out += lines
            verdicts.append(v)
    out += ["## Which K is lowest, and why", "",
            markdown_table(["config", "rank", "in flight", "lowest uniform (predicted)", "lowest (measured)",
                            "held at K=1 B", "held at best B", "rest at K=1 B", "rest at best B",
                            "K=1 minus best B"],
                           [[v["config"], str(v["rank"]), str(v["in_flight"]), v["best_predicted"],
                             v["best_measured"], str(v["k1_held"]), str(v["best_held"]), str(v["k1_rest"]),
                             str(v["best_rest"]), str(v["gain"])] for v in verdicts]), ""]
    wins = [v for v in verdicts if v["best_predicted"] != "uniform(K=1)"]
    out += [f"K > 1 is lowest on {len(wins)} of {len(verdicts)} ranks"
            + (": " + ", ".join(f"{v['config']} rank {v['rank']} ({v['in_flight']} in flight)" for v in wins)
               if wins else "") + ".",
            "Read off the table: a larger K stores fewer checkpoints per microbatch (ceil(L_stage/K) layer inputs) "
            "and the stage holds them for every microbatch in flight, while the recompute working set of one "
            "group of K layers exists for one microbatch at a time. So K > 1 wins where *held* falls by more than "
            "*rest* grows: on the stages with the most microbatches in flight (stage 0 under 1F1B holds p, "
            "every stage under GPipe holds m), and K = 1 stays lowest where few are in flight.", "",
            "Not in this document yet: the GPT-3 13B and Llama-2-70B shapes at TP = 8 (issue 12, item 6). They "
            "need the per-rank trace at those shapes without allocating them (meta / fake tensors), which this "
            "branch does not have.", ""]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="JSON written by benchmarks/distributed.py --json")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    try:
        text = render(json.loads(Path(args.json).read_text(encoding="utf-8")))
    except OSError as e:
        ap.error(f"cannot read {args.json}: {e.strerror}")
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        ap.error(f"{args.json} is not the JSON of benchmarks/distributed.py --json: {e}")
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
