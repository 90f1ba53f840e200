"""Render results: sweep tables, versioned JSON, Markdown CI summaries (the text of
``model`` and ``plan``: ``plan_report.py``; PNG timelines: ``plot.py``; tables and units:
``formatting.py``).

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
from typing import Any, Callable, Sequence

import jsonschema

from ..formatting import fmt_bytes, markdown_table, mib, natural_key
from ..liveness.timeline import MemoryReport
from ..recompute.rewrite import RewrittenStep
from ..recompute.schedule import describe_groups
from ..evaluate.schedule_result import ScheduleResult

SCHEMA_VERSION = 2  # 2: schedule.k renamed recompute_num_layers (version 1 is still read)
SCHEMA_FILE = Path(__file__).with_name("report_schema.json")


def where(phase: str, layer: int | None) -> str:
    """``backward, layer 3`` / ``forward, outer``."""
    return f"{phase}, {'outer' if layer is None else f'layer {layer}'}"


SWEEP_COLUMNS = (
    "schedule", "predicted MiB", "measured MiB", "error %", "vs none MiB", "saved MiB",
    "recompute % fwd FLOPs", "peak at", "grads equal", "pass s",
)
GIB_FROM = 10 * 2**30
"""A sweep whose largest peak reaches this many bytes is printed in GiB, not MiB (a 70B
model's peaks are six-digit MiB); the JSON keeps exact bytes either way."""


def sweep_unit(results: Sequence[ScheduleResult]) -> str:
    """``"MiB"``, or ``"GiB"`` when the largest predicted peak is ``GIB_FROM`` or more."""
    peaks = [r.predicted_peak_bytes or 0 for r in results]
    return "GiB" if peaks and max(peaks) >= GIB_FROM else "MiB"


def sweep_columns(unit: str = "MiB") -> tuple[str, ...]:
    """SWEEP_COLUMNS with the byte columns in ``unit``."""
    return tuple(c.replace("MiB", unit) for c in SWEEP_COLUMNS)


def _in(unit: str) -> Callable[[float], str]:
    return mib if unit == "MiB" else (lambda n: f"{n / 2**30:.2f}")


def sweep_rows(results: Sequence[ScheduleResult], unit: str = "MiB") -> list[list[str]]:
    """One list of cells per result, in ``sweep_columns(unit)`` order."""
    size = _in(unit)
    return [
        [
            r.provenance,
            size(r.predicted_peak_bytes) if r.grads_match or r.predicted_only else "-",
            size(r.measured_peak_bytes) if r.grads_match else "-",
            f"{100 * r.error_fraction:+.2f}" if r.grads_match else "-",
            _saving(r, size),
            size(r.saved_activation_bytes),
            f"{100 * r.recompute_fraction:.1f}",
            where(r.peak_phase, r.peak_layer),
            ("predicted only" if r.predicted_only else "yes" if r.grads_equal
             else "within" if r.grads_within_run_to_run else "NO"),
            f"{r.pass_time_s:.3f}",
        ]
        for r in results
    ]


def _saving(r: ScheduleResult, size: Callable[[float], str] = mib) -> str:
    if not (r.grads_match or r.predicted_only) or r.peak_saving_vs_none_bytes is None:
        return "-"
    if r.schedule != "none" and r.peak_saving_vs_none_bytes <= 0:
        return "saves nothing" if r.peak_saving_vs_none_bytes == 0 else f"+{size(-r.peak_saving_vs_none_bytes)}"
    return f"-{size(r.peak_saving_vs_none_bytes)}" if r.peak_saving_vs_none_bytes else "0.00"


def write_json(path: str | Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON (UTF-8), creating the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- JSON


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``report_json`` / ``reports_document`` output."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def _layer_key(layer: int | None) -> str:
    return "outer" if layer is None else str(layer)


def report_json(
    report: MemoryReport,
    step: RewrittenStep | None = None,
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
    sched: dict[str, Any] = {"provenance": report.schedule, "method": None, "recompute_num_layers": None,
                             "num_layers": None, "groups": None, "description": None}
    segments = forced = None
    if step is not None:
        s = step.schedule
        if s is not None:
            sched.update(method=s.method, recompute_num_layers=s.recompute_num_layers, num_layers=s.num_layers,
                         groups=[list(g) for g in s.groups],
                         description=describe_groups(s.groups, s.num_layers))
        if step.partition.policy is not None:
            sched["policy"] = step.partition.policy
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
    out["op_scratch"] = op_scratch_json(report)
    if timeline:
        out["timeline"] = [t.live_bytes for t in report.timeline]
    if meta:
        out["meta"] = dict(meta)
    return out


def op_scratch_json(report: MemoryReport) -> dict[str, Any]:
    """The ``op_scratch`` object of a report: the op at the peak and its scratch (bytes,
    and where the figure came from), how far the peak could move when that figure was
    not calibrated, and which ops' figures came from the formula table or nowhere."""
    m = report.peak_scratch
    at_peak = None if m is None else {"node": m.node, "op": m.op, "bytes": m.scratch_bytes,
                                      "source": m.source, "detail": m.detail}
    return {
        "threads": report.threads,
        "at_peak": at_peak,
        "peak_could_move_bytes": report.peak_could_move_bytes,
        "calibrated_ops": len(report.ops_by_source.get("calibrated", ())),
        "table_ops": list(report.ops_by_source.get("table", ())),
        "unmodelled_ops": list(report.ops_by_source.get("none", ())),
    }


def op_scratch_text(op_scratch: dict[str, Any] | None) -> str | None:
    """One sentence on the op scratch at the peak (None for a report without it)."""
    if not op_scratch or op_scratch.get("at_peak") is None:
        return None
    p = op_scratch["at_peak"]
    head = f"`{p['node']}` ({p['op']}): {_bytes_text(p['bytes'])}"
    if p["source"] == "calibrated":
        return head + f", calibrated at {op_scratch['threads']} thread(s)"
    where = "from the formula table" if p["source"] == "table" else "unknown (not calibrated, no table entry)"
    return (head + f", {where}, not calibrated: the peak could move by up to "
            f"{_bytes_text(op_scratch['peak_could_move_bytes'])}")


def _bytes_text(nbytes: int) -> str:
    """``544.2 KiB (557,312 B)``, or ``12 B`` below a KiB."""
    return fmt_bytes(nbytes) if nbytes < 1024 else f"{fmt_bytes(nbytes)} ({nbytes:,} B)"


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


def _upgrade(doc: Any) -> Any:
    """A schema_version 1 document as version 2 (``schedule.k`` -> ``recompute_num_layers``)."""
    if not (isinstance(doc, dict) and doc.get("schema_version") == 1):
        return doc
    doc = dict(doc, schema_version=2)
    if isinstance(doc.get("reports"), list):
        doc["reports"] = [_upgrade(r) for r in doc["reports"]]
    sched = doc.get("schedule")
    if isinstance(sched, dict) and "k" in sched:
        doc["schedule"] = {("recompute_num_layers" if k == "k" else k): v for k, v in sched.items()}
    return doc


def read_reports(path: str | Path) -> list[dict[str, Any]]:
    """The reports in a JSON file written by ``remat-pass report --json`` (one or many),
    validated against ``report_schema.json`` (schema_version 1 files are upgraded).

    Raises:
        ValueError: unreadable, not UTF-8 JSON, not a remat-pass report document, a
            schema_version this remat-pass does not read, or a field missing or of the
            wrong type (the message names the file, the field and what is expected).
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON text ({e}); pass a report written by "
                         "`remat-pass report --json`") from e
    except OSError as e:
        raise ValueError(f"cannot read report {path}: {e.strerror}") from e
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in ("remat-pass-report", "remat-pass-reports"):
        raise ValueError(f"{path} is not a remat-pass report (kind {kind!r}); write one with `remat-pass report --json`")
    if doc.get("schema_version") not in (1, SCHEMA_VERSION):
        raise ValueError(
            f"{path} has schema_version {doc.get('schema_version')!r}; this remat-pass reads 1 and "
            f"{SCHEMA_VERSION}: regenerate it with `remat-pass report --json`")
    doc = _upgrade(doc)
    error = schema_error(doc, kind)
    if error is not None:
        raise ValueError(f"{path}: {error} (schema: remat_pass/report_schema.json)")
    return list(doc["reports"]) if kind == "remat-pass-reports" else [doc]


def schema_error(doc: Any, kind: str, prefix: str = "") -> str | None:
    """Why ``doc`` is not a valid document of ``kind`` (``remat-pass-report`` or
    ``remat-pass-reports``, validated against that branch of ``report_schema.json``):
    ``"field peak_bytes: -1 is less than the minimum of 0"``, or None when valid.
    ``prefix`` is put before the field path (a report inside another document)."""
    full = schema()
    branch = {"$defs": full["$defs"], "$ref": "#/$defs/" + ("report" if kind == "remat-pass-report" else "reports")}
    return validation_message(branch, doc, prefix)


def validation_message(schema_doc: dict[str, Any], doc: Any, prefix: str = "") -> str | None:
    """The most relevant jsonschema error of ``doc`` as ``field a/0/b: message``, or None."""
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema_doc).iter_errors(doc))
    if error is None:
        return None
    field = "/".join([prefix, *map(str, error.absolute_path)] if prefix else map(str, error.absolute_path))
    return f"field {field or '(top level)'}: {error.message}"


# --------------------------------------------------------------------------- Markdown


def _where(peak: dict[str, Any]) -> str:
    return where(peak["phase"], peak["layer"])


def report_markdown(report: MemoryReport, step: RewrittenStep | None = None, top: int = 10) -> str:
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


def _largest_first(t: dict[str, Any]) -> tuple:
    """Tensors by size, then name in natural order (``_softmax_2`` before ``_softmax_10``)."""
    return (-t["bytes"], natural_key(t["name"]))


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
            *([["op scratch at the peak", op_scratch_text(d.get("op_scratch"))]]
              if op_scratch_text(d.get("op_scratch")) else []),
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
            [f"`{t['name']}`", _layer_key(t["layer"]), t["kind"], mib(t["bytes"])]
            for t in sorted(d["live_at_peak"], key=_largest_first)[:top]
        ]),
        "",
    ]
    scratch = d.get("op_scratch") or {}
    if scratch.get("table_ops") or scratch.get("unmodelled_ops"):
        lines += [
            "Op scratch not calibrated: "
            + "; ".join(f"{label}: {', '.join(f'`{o}`' for o in scratch[key])}"
                        for key, label in (("table_ops", "from the formula table"),
                                           ("unmodelled_ops", "unknown (0 assumed)")) if scratch.get(key)),
            "",
        ]
    saved = sorted(d["saved"], key=_largest_first)
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
