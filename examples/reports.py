"""Generate the output of ``remat-pass inspect``, ``report`` and ``check`` on the default
model (12-layer GPT-2, hidden 256, seq 256, batch 4, fp32, CPU) into examples/reports/.

Run from the repository root (about two minutes on 2 CPU cores):

    python examples/reports.py

Every file is what the command printed or wrote; the ``.txt`` files start with the
command line and end with its exit status. The PNG overlays the timeline measured by
running the step (``--measure``) on the predicted one.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "reports"
BASELINE = ROOT / ".ci" / "baseline" / "default_model.json"


def run(name: str | None, *args: str) -> int:
    """Run ``remat-pass ARGS`` in the repository root; save stdout (and the exit status)
    to ``OUT/name`` when ``name`` is given. Returns the exit status."""
    cmd = [sys.executable, "-m", "remat_pass.cli.main", *args]
    shown = "remat-pass " + " ".join(shlex.quote(a) for a in args)
    print(f"$ {shown}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("USDT:"))
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{shown} failed with exit status {proc.returncode}:\n{err}")
    if name is not None:
        (OUT / name).write_text(f"$ {shown}\n{proc.stdout}(exit status {proc.returncode})\n", encoding="utf-8")
    return proc.returncode


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    u4 = ["--schedule", "uniform", "--recompute-num-layers", "4"]

    # inspect: the summary, saved activations and recompute segments, and the node
    # tables of one layer (the whole table has one row per node: ~2000 rows)
    run("inspect_uniform4.txt", "inspect", *u4, "--section", "summary", "--section", "saved",
        "--section", "segments")
    run("inspect_uniform4_layer3.txt", "inspect", *u4, "--only-layer", "3", "--section", "forward",
        "--section", "backward")
    # a graph dump, as the torch.compile backend writes one per compiled graph, read back
    dump_dir = Path("/tmp/remat-pass-example-dumps")
    run(None, "inspect", *u4, "--section", "summary", "--dump", str(dump_dir))
    run("inspect_graph_dump.txt", "inspect", "--graph", str(dump_dir / "uniform_K_4_.remat.json"),
        "--section", "summary", "--section", "segments")

    # report: Markdown (CI step summary), JSON, PNG with the measured timeline overlaid
    for label, sched in (("uniform4", u4), ("none", ["--schedule", "none"])):
        run(None, "report", *sched, "--measure", "--markdown", rel(OUT / f"report_{label}.md"),
            "--json", rel(OUT / f"report_{label}.json"), "--png", rel(OUT / f"timeline_{label}.png"))
    run(None, "report", "--all-schedules", "--markdown", rel(OUT / "report_all_schedules.md"))

    # check: a budget that passes, one that fails, and a regression against the CI baseline
    run("check_budget_pass.txt", "check", *u4, "--budget", "2GiB")
    run("check_budget_fail.txt", "check", "--all-schedules", "--budget", "150MiB")
    run("check_baseline_pass.txt", "check", "--all-schedules", "--baseline", rel(BASELINE))
    run("check_regression_fail.txt", "check", *u4, "--batch", "5", "--baseline", rel(BASELINE),
        "--max-regression", "5%")


if __name__ == "__main__":
    main()
