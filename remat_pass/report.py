"""Render results: text tables, JSON and Markdown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .sweep import ScheduleResult

MIB = 2**20


def mib(nbytes: float) -> str:
    """Bytes as MiB with 2 decimals."""
    return f"{nbytes / MIB:.2f}"


def where(phase: str, layer: int | None) -> str:
    """``backward, layer 3`` / ``forward, outer``."""
    return f"{phase}, {'outer' if layer is None else f'layer {layer}'}"


SWEEP_COLUMNS = (
    "schedule", "predicted MiB", "measured MiB", "error %", "vs none MiB", "saved MiB",
    "recompute % fwd FLOPs", "peak at", "grads equal", "pass s",
)


def sweep_rows(results: Sequence[ScheduleResult]) -> list[list[str]]:
    """One list of cells per result, in SWEEP_COLUMNS order."""
    return [
        [
            r.provenance,
            mib(r.predicted_peak_bytes) if r.grads_equal else "-",
            mib(r.measured_peak_bytes) if r.grads_equal else "-",
            f"{100 * r.error_fraction:+.2f}" if r.grads_equal else "-",
            _saving(r),
            mib(r.saved_activation_bytes),
            f"{100 * r.recompute_fraction:.1f}",
            where(r.peak_phase, r.peak_layer),
            "yes" if r.grads_equal else "NO",
            f"{r.pass_time_s:.3f}",
        ]
        for r in results
    ]


def _saving(r: ScheduleResult) -> str:
    if not r.grads_equal or r.peak_saving_vs_none_bytes is None:
        return "-"
    if r.schedule != "none" and r.peak_saving_vs_none_bytes <= 0:
        return "saves nothing" if r.peak_saving_vs_none_bytes == 0 else f"+{mib(-r.peak_saving_vs_none_bytes)}"
    return f"-{mib(r.peak_saving_vs_none_bytes)}" if r.peak_saving_vs_none_bytes else "0.00"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width text table."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str | Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON (UTF-8)."""
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
