"""Render results: text tables, versioned JSON, Markdown CI summaries and PNG timelines.

JSON: ``report_json`` writes one MemoryReport as a document of kind
``remat-pass-report``; ``reports_document`` wraps several (one per schedule) as kind
``remat-pass-reports``. Both carry ``schema_version`` (``SCHEMA_VERSION``) and are
described field by field by the JSON Schema ``remat_pass/report_schema.json``
(``schema()`` loads it). A reader accepts documents whose major version it knows;
new optional fields do not change the version, a change of meaning or a removed field
does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .sweep import ScheduleResult

if TYPE_CHECKING:
    from .liveness import MemoryReport
    from .rewrite import RewrittenStep

MIB = 2**20
SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("report_schema.json")


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


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A fixed-width text table.

    Args:
        align: one character per column, ``l`` (left) or ``r`` (right); default: the
            first column left, the others right.
    """
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    align = align or "l" + "r" * (len(widths) - 1)

    def line(cells: Sequence[Any]) -> str:
        return "  ".join(
            (str(c).ljust(w) if a == "l" else str(c).rjust(w)) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def fmt_bytes(nbytes: int | None) -> str:
    """``512 B``, ``16.0 KiB``, ``4.00 MiB``, ``1.25 GiB`` (binary units); "" for None."""
    if nbytes is None:
        return ""
    n = abs(nbytes)
    if n < 1024:
        return f"{nbytes} B"
    if n < MIB:
        return f"{nbytes / 1024:.1f} KiB"
    if n < 2**30:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str | Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON (UTF-8)."""
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- JSON


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``report_json`` / ``reports_document`` output."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def _layer_key(layer: int | None) -> str:
    return "outer" if layer is None else str(layer)


def report_json(
    report: "MemoryReport",
    step: "RewrittenStep | None" = None,
    *,
    timeline: bool = False,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One MemoryReport as a JSON-ready dict of kind ``remat-pass-report``.

    Args:
        report: ``liveness.analyze`` output.
        step: the rewritten step, to add the schedule's method / K / groups, the
            recompute segments in run order and the forced saves (null without it).
        timeline: add ``timeline``, the live bytes at every step (forward then backward).
        meta: free-form provenance (model, batch, seq, ...), stored under ``meta``.

    Returns:
        A dict valid against ``report_schema.json`` (``schema_version`` =
        ``SCHEMA_VERSION``); all sizes in bytes, FLOPs as ints. Same report, same dict.
    """
    sched: dict[str, Any] = {"provenance": report.schedule, "method": None, "k": None,
                             "num_layers": None, "groups": None, "description": None}
    segments = forced = None
    if step is not None:
        from .schedule import describe_groups

        s = step.schedule
        sched.update(method=s.method, k=s.k, num_layers=s.num_layers,
                     groups=[list(g) for g in s.groups],
                     description=describe_groups(s.groups, s.num_layers))
        segments = [
            {"group": seg.group, "layers": list(seg.layers), "num_nodes": len(seg.nodes),
             "insert_before": seg.insert_before, "checkpoints": list(seg.checkpoints),
             "rng_replayed": list(seg.rng_replayed)}
            for seg in step.segments
        ]
        forced = dict(step.forced_saves)
    n_fw = sum(1 for t in report.timeline if t.phase == "forward")
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "remat-pass-report",
        "schedule": sched,
        "allocator": report.allocator,
        "peak_bytes": report.peak_bytes,
        "peak": {"step": report.peak_step, "phase": report.peak_phase,
                 "node": report.peak_node, "layer": report.peak_layer},
        "num_steps": {"forward": n_fw, "backward": len(report.timeline) - n_fw},
        "static_bytes": report.static_bytes,
        "saved_activation_bytes": report.saved_activation_bytes,
        "forward_flops": report.forward_flops,
        "recompute_flops": report.recompute_flops,
        "recompute_fraction": report.recompute_fraction,
        "live_at_peak_by_layer": dict(sorted(
            report.live_at_peak_by_layer.items(),
            key=lambda kv: (kv[0] != "outer", int(kv[0]) if kv[0] != "outer" else -1))),
        "live_at_peak": [{"name": t.name, "layer": t.layer, "bytes": t.nbytes, "kind": t.kind}
                         for t in report.live_at_peak],
        "saved": [{"name": t.name, "layer": t.layer, "bytes": t.nbytes} for t in report.saved],
        "segments": segments,
        "forced_saves": forced,
    }
    if timeline:
        out["timeline"] = [t.live_bytes for t in report.timeline]
    if meta:
        out["meta"] = dict(meta)
    return out


def dumps_report(doc: Any) -> str:
    """JSON text of a report document, one tensor (a flat object) per line so that a
    committed baseline diffs line by line; deterministic (key order as built)."""

    def flat(v: Any) -> bool:
        return not isinstance(v, (dict, list)) or (
            isinstance(v, list) and all(not isinstance(e, (dict, list)) for e in v))

    def enc(v: Any, pad: str) -> str:
        if isinstance(v, dict) and v and not all(flat(e) for e in v.values()):
            inner = pad + " "
            items = [f"{inner}{json.dumps(k)}: {enc(e, inner)}" for k, e in v.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(v, list) and v and not all(flat(e) and not isinstance(e, list) for e in v):
            inner = pad + " "
            return "[\n" + ",\n".join(inner + enc(e, inner) for e in v) + "\n" + pad + "]"
        return json.dumps(v)

    return enc(doc, "") + "\n"


def write_report(path: str | Path, doc: Any) -> None:
    """Write a report document with ``dumps_report`` (UTF-8), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_report(doc), encoding="utf-8")


def reports_document(reports: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Several ``report_json`` dicts (one per schedule) as one ``remat-pass-reports`` document."""
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": "remat-pass-reports",
                           "reports": list(reports)}
    if meta:
        doc["meta"] = dict(meta)
    return doc


def read_reports(path: str | Path) -> list[dict[str, Any]]:
    """The reports in a JSON file written by ``remat-pass report --json`` (one or many).

    Raises:
        ValueError: unreadable, not JSON, not a remat-pass report document, or a
            schema_version this remat-pass does not read.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    except OSError as e:
        raise ValueError(f"cannot read report {path}: {e.strerror}") from e
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in ("remat-pass-report", "remat-pass-reports"):
        raise ValueError(f"{path} is not a remat-pass report (kind {kind!r}); write one with `remat-pass report --json`")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path} has schema_version {doc.get('schema_version')!r}; this remat-pass reads "
            f"{SCHEMA_VERSION}: regenerate it with `remat-pass report --json`")
    return list(doc["reports"]) if kind == "remat-pass-reports" else [doc]


# --------------------------------------------------------------------------- Markdown


def _where(peak: dict[str, Any]) -> str:
    return where(peak["phase"], peak["layer"])


def report_markdown(report: "MemoryReport", step: "RewrittenStep | None" = None, top: int = 10) -> str:
    """A Markdown summary that reads well as a GitHub CI step summary.

    Sections: headline (schedule, peak, where), a key-figure table, bytes live at the
    peak by layer, the ``top`` largest tensors live at the peak, the ``top`` largest
    saved activations, and (with ``step``) the recompute segments in run order.

    Args:
        report: ``liveness.analyze`` output.
        step: the rewritten step (adds the schedule's groups and the segments).
        top: rows in the tensor tables.
    """
    d = report_json(report, step)
    return markdown_from_json(d, top)


def markdown_from_json(d: dict[str, Any], top: int = 10) -> str:
    """``report_markdown`` from a ``report_json`` dict (also one read back from disk)."""
    sched = d["schedule"]
    peak = d["peak"]
    steps = d["num_steps"]
    total_steps = steps["forward"] + steps["backward"]
    lines = [
        f"### remat-pass: `{sched['provenance']}`: predicted peak {mib(d['peak_bytes'])} MiB ({_where(peak)})",
        "",
        markdown_table(("", ""), [
            ["predicted peak (activations)", f"**{mib(d['peak_bytes'])} MiB** ({d['peak_bytes']:,} bytes, {d['allocator']} allocator)"],
            ["where", f"{_where(peak)}, node `{peak['node']}`, step {peak['step']} of {total_steps}"
                      f" ({steps['forward']} forward + {steps['backward']} backward)"],
            ["static (parameters, buffers, batch, tangents)", f"{mib(d['static_bytes'])} MiB"],
            ["saved activations", f"{mib(d['saved_activation_bytes'])} MiB in {len(d['saved'])} tensors"],
            ["recompute", f"{100 * d['recompute_fraction']:.1f} % of forward FLOPs ({d['recompute_flops'] / 1e9:.3f} GFLOPs)"],
            ["schedule", f"`{sched['provenance']}`" + (f": {sched['description']}" if sched.get("description") else "")],
        ]),
        "",
        "#### Live at the peak, by layer",
        "",
        markdown_table(("layer", "MiB", "share"), [
            [k, mib(v), f"{100 * v / d['peak_bytes']:.1f} %" if d["peak_bytes"] else ""]
            for k, v in d["live_at_peak_by_layer"].items()
        ]),
        "",
        f"#### Largest tensors live at the peak ({min(top, len(d['live_at_peak']))} of {len(d['live_at_peak'])})",
        "",
        markdown_table(("tensor", "layer", "kind", "MiB"), [
            [f"`{t['name']}`", _layer_key(t["layer"]), t["kind"], mib(t["bytes"])] for t in d["live_at_peak"][:top]
        ]),
        "",
    ]
    saved = sorted(d["saved"], key=lambda t: (-t["bytes"], t["name"]))
    lines += [
        f"#### Top saved activations ({min(top, len(saved))} of {len(saved)})",
        "",
        markdown_table(("tensor", "layer", "MiB"), [
            [f"`{t['name']}`", _layer_key(t["layer"]), mib(t["bytes"])] for t in saved[:top]
        ]) if saved else "The schedule saves nothing.",
        "",
    ]
    if d.get("segments") is not None:
        lines += ["#### Schedule: recompute segments in run order", ""]
        if d["segments"]:
            lines.append(markdown_table(("run", "group", "layers", "nodes", "runs before", "checkpoints"), [
                [i, s["group"], ", ".join(str(x) for x in s["layers"]), s["num_nodes"],
                 f"`{s['insert_before']}`", ", ".join(f"`{c}`" for c in s["checkpoints"])]
                for i, s in enumerate(d["segments"])
            ]))
        else:
            lines.append("Nothing is recomputed.")
        lines.append("")
    return "\n".join(lines)


def summary_markdown(reports: Sequence[dict[str, Any]]) -> str:
    """One row per schedule (``report_json`` dicts): peak, where, saved, recompute."""
    return markdown_table(
        ("schedule", "predicted peak MiB", "peak at", "node", "saved MiB", "recompute % fwd FLOPs"),
        [[f"`{d['schedule']['provenance']}`", mib(d["peak_bytes"]), _where(d["peak"]), f"`{d['peak']['node']}`",
          mib(d["saved_activation_bytes"]), f"{100 * d['recompute_fraction']:.1f}"] for d in reports],
    )


# --------------------------------------------------------------------------- PNG


def plot_timeline(
    report: "MemoryReport",
    path: str | Path,
    measured_timeline: Sequence[int] | None = None,
    *,
    step: "RewrittenStep | None" = None,
    title: str | None = None,
) -> Path:
    """Draw live activation bytes over the forward and backward steps as a PNG.

    The predicted bytes are stacked by the layer that allocated them when ``step`` is
    given (``inspection.live_bytes_by_layer``; the stack's top is the timeline), else
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
    if step is not None:
        from .inspection import live_bytes_by_layer

        labels, rows = live_bytes_by_layer(step, report.allocator)
        if labels and labels[0] == "outer":  # outer on top: its spikes do not lift the layers
            labels, rows = labels[1:] + labels[:1], rows[1:] + rows[:1]
        cmap = plt.get_cmap("tab20")
        colors = ["#bbbbbb" if lab == "outer" else cmap((j % 20) / 20 + 0.001) for j, lab in enumerate(labels)]
        ax.stackplot(xs, [[b / MIB for b in r] for r in rows], labels=labels, colors=colors, linewidth=0)
    else:
        ax.fill_between(xs, total, color="#4c72b0", alpha=0.6, linewidth=0, label="predicted (all layers)")
    ax.plot(xs, total, color="#1f1f1f", linewidth=0.6, alpha=0.7, label="predicted total")
    n_fw = sum(1 for t in report.timeline if t.phase == "forward")
    ax.axvline(n_fw - 0.5, color="#555555", linestyle="--", linewidth=1)
    top = max(total) if total else 0
    ax.text(n_fw / 2, top * 1.02, "forward", ha="center", va="bottom", fontsize=9, color="#555555")
    ax.text(n_fw + (n - n_fw) / 2, top * 1.02, "backward", ha="center", va="bottom", fontsize=9, color="#555555")
    if n:
        px, py = report.peak_step, report.peak_bytes / MIB
        ax.plot([px], [py], marker="v", color="red", markersize=9, zorder=5)
        ax.annotate(
            f"peak {py:.2f} MiB\n{where(report.peak_phase, report.peak_layer)}, {report.peak_node}",
            (px, py), xytext=(0, 14), textcoords="offset points", ha="center", fontsize=8, color="red",
        )
    if measured_timeline is not None:
        mt = [b / MIB for b in measured_timeline]
        if len(mt) == n:
            ax.plot(xs, mt, color="black", linewidth=1.1, linestyle=":",
                    label=f"measured (peak {max(mt) if mt else 0:.2f} MiB)")
        else:
            ax2 = ax.twiny()
            ax2.plot(range(len(mt)), mt, color="black", linewidth=0.8, alpha=0.7,
                     label="measured, per allocator event (own x axis, top)")
            ax2.set_xlabel("allocator event # (measured; not aligned to graph steps)")
            ax2.legend(loc="upper right", fontsize=8)
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, top * 1.15 if top else 1)
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
