"""The lines under a sweep's table that answer its question: which setting has the least
peak, which is the least recompute that fits the device, what sets the peak when every
setting peaks alike, with Megatron-LM's flags for each setting named.

The table itself is ``schedule_report.sweep_rows``; these lines read the same
ScheduleResults (predicted activation peaks, bytes), so they describe the same program:
the rewritten step of each setting, static memory apart unless a device size is given.
"""

from __future__ import annotations

from typing import Sequence

from ..evaluate.schedule_result import ScheduleResult
from ..formatting import fmt_bytes
from ..memory.static_memory import StaticMemory
from ..recompute.schedule import megatron_flags


def _usable(results: Sequence[ScheduleResult]) -> list[ScheduleResult]:
    """The rows whose figures stand: predicted only, or gradients that match."""
    return [r for r in results if r.predicted_peak_bytes is not None and (r.predicted_only or r.grads_match)]


def _flags(r: ScheduleResult) -> str:
    if r.policy is not None or r.schedule not in ("none", "uniform", "block"):
        return ""
    return f"; Megatron-LM: {megatron_flags(r.schedule, r.recompute_num_layers)}"


def _least_recompute(rows: Sequence[ScheduleResult]) -> ScheduleResult:
    """Least recompute FLOPs, then the lower peak, then the first in sweep order."""
    return min(rows, key=lambda r: (r.recompute_flops, r.predicted_peak_bytes))


def sweep_summary(results: Sequence[ScheduleResult], static: StaticMemory,
                  device_memory_bytes: int | None = None) -> list[str]:
    """Summary lines of a sweep (``remat-pass sweep`` prints them under the table).

    Args:
        results: the sweep's rows, ``none`` first.
        static: the step's static memory (added to each peak for ``device_memory_bytes``).
        device_memory_bytes: the device's size (``--device-memory``), or None.

    Returns:
        One line for the least peak (the least recompute among equal peaks); one for the
        least recompute that fits the device (or what the least needs) when a size is
        given; when every setting peaks at the same bytes, one saying recompute saves
        nothing there and what the peak holds (the parameter gradients when they are
        most of it). Empty when no row has figures.
    """
    rows = _usable(results)
    if not rows:
        return []
    base = rows[0]
    least_peak = min(r.predicted_peak_bytes for r in rows)
    best = _least_recompute([r for r in rows if r.predicted_peak_bytes == least_peak])
    saving = base.predicted_peak_bytes - least_peak
    lines = [f"least peak: {best.provenance}, {fmt_bytes(least_peak)}"
             + (f" ({fmt_bytes(saving)} below {base.provenance}'s {fmt_bytes(base.predicted_peak_bytes)}, "
                f"recomputing {100 * best.recompute_fraction:.1f} % of forward FLOPs)" if saving > 0 else "")
             + _flags(best)]
    if device_memory_bytes is not None:
        fit = [r for r in rows if static.total_bytes + r.predicted_peak_bytes <= device_memory_bytes]
        if fit:
            r = _least_recompute(fit)
            lines.append(f"least recompute that fits {fmt_bytes(device_memory_bytes)}: {r.provenance} "
                         f"({fmt_bytes(r.predicted_peak_bytes)} + static {fmt_bytes(static.total_bytes)} = "
                         f"{fmt_bytes(r.predicted_peak_bytes + static.total_bytes)}){_flags(r)}")
        else:
            need = least_peak + static.total_bytes
            lines.append(f"no setting fits {fmt_bytes(device_memory_bytes)}: the least needs {fmt_bytes(need)} "
                         f"({fmt_bytes(need - device_memory_bytes)} more), {best.provenance}")
    if len(rows) > 1 and all(r.predicted_peak_bytes == least_peak for r in rows):
        lines.append(_equal_peaks_line(base, static))
    return lines


def _equal_peaks_line(base: ScheduleResult, static: StaticMemory) -> str:
    where = f"{base.peak_phase}" + (f", layer {base.peak_layer}" if base.peak_layer not in (None, "outer") else "")
    text = (f"every setting peaks at {fmt_bytes(base.predicted_peak_bytes)} ({where}, {base.peak_node}): recompute "
            "saves nothing at this shape")
    grads = static.gradient_bytes
    if grads and 2 * grads >= base.predicted_peak_bytes:
        text += (f"; the parameter gradients ({fmt_bytes(grads)}, allocated in backward and kept to the step's end) "
                 f"are most of the peak, more than the saved activations ({fmt_bytes(base.saved_activation_bytes)}); "
                 "recompute matters from a larger batch or sequence")
    else:
        text += "; the peak lies outside what recompute changes (see 'peak at')"
    return text
