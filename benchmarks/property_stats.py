"""Count the rows of long property-test logs (``tests/e2e/test_properties.py`` with
``$REMAT_PROPERTY_LOG``): how many distinct stacks and schedule runs, how many predicted
the measured peak to the byte, how far off the others were, wrong gradients, optimized
plans over their budget, refusals and errors.

Rows are de-duplicated on (spec, threads, schedule): several logs of runs with
different ``--hypothesis-seed`` can be counted together.

Usage:
    python benchmarks/property_stats.py /work/prop/long_*.jsonl [--list 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read_rows(paths: list[Path]) -> list[dict]:
    """Every JSON line of ``paths`` (a torn last line is skipped)."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    return rows


def summarize(rows: list[dict]) -> dict:
    """The counts of the docstring above, from log rows; all sizes in bytes."""
    runs: dict[tuple, dict] = {}
    refused: dict[str, dict] = {}
    errors: dict[tuple, dict] = {}
    for r in rows:
        if "refused" in r:
            refused[r["spec"]] = r
        elif "error" in r:
            errors[(r["spec"], r["threads"], tuple(r.get("choice", ())))] = r
        elif "schedule" in r:
            runs[(r["spec"], r["threads"], r["schedule"])] = r
    ran = list(runs.values())
    wrong_grads = [r for r in ran if not r["grads_equal"]]
    compared = [r for r in ran if r["grads_equal"]]
    exact = [r for r in compared if r["predicted_bytes"] == r["measured_bytes"]]
    off = [r for r in compared if r["predicted_bytes"] != r["measured_bytes"]]
    over = [r for r in compared if r["budget_bytes"] is not None and r["measured_bytes"] > r["budget_bytes"]]
    by_threads = {}
    for t in sorted({r["threads"] for r in ran}):
        of_t = [r for r in compared if r["threads"] == t]
        by_threads[t] = (sum(r["predicted_bytes"] == r["measured_bytes"] for r in of_t), len(of_t))
    return {
        "stacks": len({r["spec"] for r in rows}),
        "runs": len(ran),
        "exact": len(exact),
        "off": off,
        "wrong_grads": wrong_grads,
        "optimized": sum(r["budget_bytes"] is not None for r in ran),
        "over_budget": over,
        "refused": list(refused.values()),
        "errors": list(errors.values()),
        "by_threads": by_threads,
        "seconds": [r["seconds"] for r in ran if "seconds" in r],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="JSON Lines logs of the property test")
    parser.add_argument("--list", type=int, default=10, metavar="N",
                        help="list up to N rows of each kind of failure (default 10)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        parser.error(f"no such log file: {', '.join(missing)}")
    s = summarize(read_rows(args.logs))
    compared = s["exact"] + len(s["off"])
    print(f"distinct stacks: {s['stacks']}; distinct (stack, threads, schedule) runs: {s['runs']}")
    if compared:
        print(f"predicted == measured to the byte: {s['exact']} of {compared} ({100 * s['exact'] / compared:.1f} %)")
    for t, (ok, n) in s["by_threads"].items():
        print(f"  {t} thread(s): {ok} of {n}")
    print(f"wrong gradients: {len(s['wrong_grads'])}")
    print(f"optimized plans: {s['optimized']}, measured over budget: {len(s['over_budget'])}")
    print(f"refused (the traced step cannot run, node named): {len(s['refused'])} stacks")
    print(f"errors: {len(s['errors'])}")
    if s["seconds"]:
        print(f"seconds per run: median {statistics.median(s['seconds']):.2f}, max {max(s['seconds']):.2f}")
    if s["off"]:
        diffs = sorted(r["predicted_bytes"] - r["measured_bytes"] for r in s["off"])
        print(f"predicted - measured where they differ (B): min {diffs[0]}, median {statistics.median(diffs)}, "
              f"max {diffs[-1]}")
    for title, rows, fields in (
            ("differ", s["off"], ("threads", "schedule", "predicted_bytes", "measured_bytes", "peak_node")),
            ("wrong gradients", s["wrong_grads"], ("threads", "schedule")),
            ("over budget", s["over_budget"], ("threads", "schedule", "budget_bytes", "measured_bytes")),
            ("errors", s["errors"], ("threads", "choice", "error")),
            ("refused", s["refused"], ("threads", "choice", "refused"))):
        for r in rows[: args.list]:
            print(f"[{title}] {r['spec']} " + " ".join(f"{f}={r.get(f)}" for f in fields))
    return 1 if s["wrong_grads"] or s["off"] or s["over_budget"] or s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
