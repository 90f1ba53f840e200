"""Draw a predicted (and measured) memory timeline as a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..formatting import MIB
from ..liveness.step_storages import live_bytes_by_layer
from ..liveness.timeline import MemoryReport
from .schedule_report import where
from ..recompute.rewrite import RewrittenStep


def plot_timeline(
    report: MemoryReport,
    path: str | Path,
    measured_timeline: Sequence[int] | None = None,
    *,
    step: RewrittenStep | None = None,
    title: str | None = None,
) -> Path:
    """Draw live activation bytes over the forward and backward steps as a PNG.

    The predicted bytes are stacked by the layer that allocated them when ``step`` is
    given (``step_storages.live_bytes_by_layer``; the stack's top is the timeline), else
    drawn as one area. A dashed line splits forward from backward; the peak is marked
    and labelled with its node and layer.

    ``measured_timeline`` is overlaid as a black line:

    - one value per step (``len == len(report.timeline)``, from
      ``inspection.measured_step_timeline``): drawn on the same x axis;
    - anything else (e.g. ``Measurement.timeline_bytes``, one value per allocator
      event): its steps are not graph steps, so it is drawn against its own top x axis
      (allocator event index) and labelled so.

    Args:
        report: ``liveness.analyze`` output; path: the PNG to write.
        measured_timeline: measured bytes (see above), or None.
        step: the rewritten step, to stack by layer.
        title: the plot title (default: the schedule and the peak).

    Returns:
        ``path`` as a Path.

    Raises:
        ImportError: matplotlib is missing (``pip install 'remat-pass[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "plot_timeline needs matplotlib: pip install 'remat-pass[plot]' (or pip install matplotlib)"
        ) from e
    path = Path(path)
    n = len(report.timeline)
    xs = list(range(n))
    total = [t.live_bytes / MIB for t in report.timeline]
    fig, ax = plt.subplots(figsize=(13, 5.5), dpi=110)
    _draw_predicted(ax, plt, report, step, xs, total)
    n_fw = sum(1 for t in report.timeline if t.phase == "forward")
    _mark_phases(ax, n, n_fw)
    top = max(total) if total else 0
    if n:
        _mark_peak(ax, report, n, n_fw)
    if measured_timeline is not None:
        _draw_measured(ax, [b / MIB for b in measured_timeline], xs)
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, top * 1.3 if top else 1)
    ax.set_xlabel(f"step (graph node: {n_fw} forward, then {n - n_fw} backward)")
    ax.set_ylabel("live activation memory (MiB)")
    ax.set_title(title or f"{report.schedule}: predicted peak {report.peak_bytes / MIB:.2f} MiB "
                          f"(static {report.static_bytes / MIB:.2f} MiB not shown)", fontsize=11)
    handles, labs = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labs[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False, ncol=2 if len(labs) > 24 else 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw_predicted(ax, plt, report: MemoryReport, step: RewrittenStep | None,  # noqa: ANN001 - matplotlib
                    xs: list[int], total: list[float]) -> None:
    """The predicted MiB per step: stacked by layer when ``step`` is given (outer on
    top), else one area; the total as a thin line over it."""
    if step is not None:
        labels, rows = live_bytes_by_layer(step, report.memory if report.memory is not None else report.allocator)
        if labels and labels[0] == "outer":  # outer on top: its spikes do not lift the layers
            labels, rows = labels[1:] + labels[:1], rows[1:] + rows[:1]
        cmap = plt.get_cmap("tab20")
        colors = ["#bbbbbb" if lab == "outer" else cmap((j % 20) / 20 + 0.001) for j, lab in enumerate(labels)]
        ax.stackplot(xs, [[b / MIB for b in r] for r in rows], labels=labels, colors=colors, linewidth=0)
    else:
        ax.fill_between(xs, total, color="#4c72b0", alpha=0.6, linewidth=0, label="predicted (all layers)")
    ax.plot(xs, total, color="#1f1f1f", linewidth=0.6, alpha=0.7, label="predicted total")


def _mark_phases(ax, n: int, n_fw: int) -> None:  # noqa: ANN001 - matplotlib Axes
    """The dashed line between forward and backward and the phase names."""
    ax.axvline(n_fw - 0.5, color="#555555", linestyle="--", linewidth=1)
    # phase names just under the top edge, in axes coordinates: clear of the data and
    # of the peak label, which sits in the headroom above the data
    on_top = ax.get_xaxis_transform()
    ax.text(n_fw / 2, 0.985, "forward", ha="center", va="top", fontsize=9, color="#555555", transform=on_top)
    ax.text(n_fw + (n - n_fw) / 2, 0.985, "backward", ha="center", va="top", fontsize=9, color="#555555",
            transform=on_top)


def _mark_peak(ax, report: MemoryReport, n: int, n_fw: int) -> None:  # noqa: ANN001 - matplotlib Axes
    """A red marker at the predicted peak, labelled with its MiB, phase, layer and node."""
    px, py = report.peak_step, report.peak_bytes / MIB
    ax.plot([px], [py], marker="v", color="red", markersize=9, zorder=5)
    # the label leans away from the nearer edge (the legend sits right of the axes)
    # and from the forward/backward line, on a white box so the line cannot cross it
    side = "right" if px > 0.6 * n else ("left" if px < 0.4 * n else "center")
    if side == "center":
        side = "left" if px >= n_fw else "right"
    ax.annotate(
        f"peak {py:.2f} MiB\n{where(report.peak_phase, report.peak_layer)}, {report.peak_node}",
        (px, py), xytext=({"left": 6, "right": -6}[side], 10), textcoords="offset points", ha=side,
        va="bottom", fontsize=8, color="red", zorder=6,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5},
    )


def _draw_measured(ax, mt: list[float], xs: list[int]) -> None:  # noqa: ANN001 - matplotlib Axes
    """The measured MiB as a black line: on the step axis when there is one value per
    step, else against its own top x axis (allocator event index)."""
    if len(mt) == len(xs):
        ax.plot(xs, mt, color="black", linewidth=1.1, linestyle=":",
                label=f"measured (peak {max(mt) if mt else 0:.2f} MiB)")
    else:
        ax2 = ax.twiny()
        ax2.plot(range(len(mt)), mt, color="black", linewidth=0.8, alpha=0.7,
                 label="measured, per allocator event (own x axis, top)")
        ax2.set_xlabel("allocator event # (measured; not aligned to graph steps)")
        ax2.legend(loc="upper right", fontsize=8)
