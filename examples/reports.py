"""Generate the output of ``remat-pass inspect``, ``report`` and ``check`` on the default
model (12-layer GPT-2, hidden 256, seq 256, batch 4, fp32, CPU) into examples/reports/.

Run from the repository root (about three minutes on 2 idle CPU cores):

    python examples/reports.py            # into examples/reports/
    python examples/reports.py --out DIR  # elsewhere (tests/e2e/test_examples.py compares)

Every file is what the command printed or wrote; the ``.txt`` files start with the
command line and end with its exit status. The PNG overlays the timeline measured by
running the step (``--measure``) on the predicted one. ``host.txt`` names the machine
(``op_signature.host_identity`` and the intra-op threads): the figures that include
calibrated op scratch are exact for that host; another CPU may calibrate other bytes.

The regression demo compares the default model against a baseline of the same model
before a change that added dropout (``gpt2_without_dropout``): its masks are new saved
activations, which ``check`` lists.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "reports"
BASELINE = ROOT / ".ci" / "baseline" / "default_model.json"
TEXT_SUFFIXES = (".txt", ".md", ".json")
"""The files compared with what the code prints; the PNGs are not (their pixels depend on
the matplotlib version and its fonts)."""


def gpt2_without_dropout(**kwargs: Any) -> Any:
    """The default model (``remat_pass.models:gpt2``) with dropout 0: the baseline of
    the regression demo, the model before a change that added dropout."""
    from remat_pass.models import gpt2

    return gpt2(dropout=0.0, **kwargs)


def host() -> str:
    """What the calibrated figures of the outputs hold for: the host's identity
    (torch, CPU model and ISA) and the intra-op thread count."""
    import torch

    from remat_pass.graph.op_signature import host_identity

    return f"{host_identity('cpu')}|threads {torch.get_num_threads()}\n"


def run(out: Path, name: str | None, *args: str) -> int:
    """Run ``remat-pass ARGS`` in the repository root; save stdout (and the exit status)
    to ``out/name`` when ``name`` is given. Returns the exit status."""
    cmd = [sys.executable, "-m", "remat_pass.cli.main", *args]
    shown = "remat-pass " + " ".join(shlex.quote(a) for a in args)
    print(f"$ {shown}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("USDT:"))
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{shown} failed with exit status {proc.returncode}:\n{err}")
    if name is not None:
        (out / name).write_text(f"$ {shown}\n{proc.stdout}(exit status {proc.returncode})\n", encoding="utf-8")
    return proc.returncode


def rel(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it (as the committed
    outputs name it), else absolute."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write into (default: examples/reports)")
    out = parser.parse_args(argv).out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "host.txt").write_text(host(), encoding="utf-8")
    u4 = ["--schedule", "uniform", "--recompute-num-layers", "4"]

    # inspect: the summary, saved activations and recompute segments, and the node
    # tables of one layer (the whole table has one row per node: ~2000 rows)
    run(out, "inspect_uniform4.txt", "inspect", *u4, "--section", "summary", "--section", "saved",
        "--section", "segments")
    run(out, "inspect_uniform4_layer3.txt", "inspect", *u4, "--only-layer", "3", "--section", "forward",
        "--section", "backward")
    # a graph dump, as the torch.compile backend writes one per compiled graph, read back
    dump_dir = Path("/tmp/remat-pass-example-dumps")
    baseline_before = Path("/tmp/remat-pass-example-baseline.json")
    run(out, None, "inspect", *u4, "--section", "summary", "--dump", str(dump_dir))
    run(out, "inspect_graph_dump.txt", "inspect", "--graph", str(dump_dir / "uniform_K_4_.remat.json"),
        "--section", "summary", "--section", "segments")

    # report: Markdown (CI step summary), JSON, PNG with the measured timeline overlaid
    for label, sched in (("uniform4", u4), ("none", ["--schedule", "none"])):
        run(out, None, "report", *sched, "--measure", "--markdown", rel(out / f"report_{label}.md"),
            "--json", rel(out / f"report_{label}.json"), "--png", rel(out / f"timeline_{label}.png"))
    run(out, None, "report", "--all-schedules", "--markdown", rel(out / "report_all_schedules.md"))

    # check: a budget that passes, one that fails, the CI baseline, and a regression against a
    # baseline of the model before dropout was added
    run(out, "check_budget_pass.txt", "check", *u4, "--budget", "2GiB")
    run(out, "check_budget_fail.txt", "check", "--all-schedules", "--budget", "150MiB")
    run(out, "check_baseline_pass.txt", "check", "--all-schedules", "--baseline", rel(BASELINE))
    run(out, None, "report", "--model", "examples.reports:gpt2_without_dropout", *u4, "--json", str(baseline_before))
    run(out, "check_regression_fail.txt", "check", *u4, "--baseline", str(baseline_before), "--max-regression", "5%")


if __name__ == "__main__":
    main()
