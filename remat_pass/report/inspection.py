"""Look inside a rewritten step: per-node tables, saved activations, recompute segments.

Two readers use this module:

- ``remat-pass inspect --model module:factory``: trace, rewrite under a schedule, print.
- ``remat-pass inspect --graph PATH``: read a file written by ``dump_step`` (the
  torch.compile backend writes one per compiled graph) and print the same tables, so a
  user can see what the pass did inside their own training job.

Everything printed comes from ``describe_step(step, report)``, a JSON-ready dict; a dump
file is that dict, so a table read back from disk is the table printed live, byte for
byte.

The figures (what each step allocates, frees and holds as scratch, the bytes of each
saved value) are ``liveness.step_storages``', which counts storages exactly as
``liveness.analyze`` does; this module only gathers them with the nodes' names, ops,
shapes and reasons, and formats them. "freed here" lists the storages whose last step
is this one (they are dropped right after it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..graph.costs import node_flops
from ..formatting import fmt_bytes, text_table
from ..liveness.intervals import Intervals
from ..liveness.step_storages import report_memory, saved_storages, sized_intervals, step_storages
from ..liveness.timeline import MemoryReport
from .schedule_report import report_json, schema_error, validation_message
from ..recompute.rewrite import RewrittenStep

DUMP_FORMAT = "remat-pass-graph"
DUMP_FORMAT_VERSION = 1
DUMP_SUFFIX = ".remat.json"
DUMP_SCHEMA_FILE = Path(__file__).with_name("dump_schema.json")


# --------------------------------------------------------------------------- description


def op_name(node: fx.Node) -> str:
    """A short op name: ``aten.mm``, ``getitem``, ``run_with_rng_state(aten.native_dropout)``."""
    t = node.target
    if node.op != "call_function":
        return node.op
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.overloadpacket.__name__}" if t.namespace == "aten" else str(t.overloadpacket)
    name = getattr(t, "__name__", str(t))
    if name in ("run_and_save_rng_state", "run_with_rng_state"):
        inner = node.args[0] if name == "run_and_save_rng_state" else node.args[1]
        if isinstance(inner, torch._ops.OpOverload):
            return f"{name}(aten.{inner.overloadpacket.__name__})"
    return name


def _shape_dtype(val: Any) -> tuple[str, str]:
    if isinstance(val, torch.Tensor):
        shape = "[" + ", ".join(str(s) for s in val.shape) + "]"
        return shape, str(val.dtype).replace("torch.", "")
    if isinstance(val, (tuple, list)):
        parts = [_shape_dtype(v) for v in val]
        return "(" + ", ".join(p[0] for p in parts) + ")", "(" + ", ".join(p[1] for p in parts) + ")"
    return "", ""


def describe_step(
    step: RewrittenStep, report: MemoryReport, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything ``remat-pass inspect`` prints, as a JSON-ready dict (the dump format).

    Args:
        step: the rewritten step.
        report: ``liveness.analyze(step, allocator)`` of the same step.
        meta: free-form provenance (model, batch, ...) stored under ``"meta"``.

    Returns:
        ``{"format", "format_version", "meta", "report" (report.report_json), "nodes",
        "saved", "segments", "code"}``. ``nodes``: one dict per step, forward then
        backward, with ``step, graph, name, op, layer, kind, shape, dtype, alloc_bytes``
        (bytes this node allocates; 0 for views and tuple elements), ``scratch_bytes``
        (modelled scratch, live during this step only), ``saved`` (a forward
        value that backward reads), ``freed`` (storages dropped right after this step),
        ``freed_bytes``, ``live_bytes`` (the timeline), ``flops``.
    """
    iv = sized_intervals(step, report_memory(report))
    nodes = _node_rows(step, report, iv)
    return {
        "format": DUMP_FORMAT,
        "format_version": DUMP_FORMAT_VERSION,
        "meta": dict(meta or {}),
        "report": report_json(report, step),
        "nodes": nodes,
        "saved": _saved_rows(step, iv),
        "segments": _segment_rows(step, nodes),
        "code": {"forward": step.forward.code, "backward": step.backward.code},
    }


def _node_rows(step: RewrittenStep, report: MemoryReport, iv: Intervals) -> list[dict[str, Any]]:
    """One row per step (see ``describe_step``)."""
    per_step = step_storages(iv)
    saved_names = set(step.saved)
    rows = []
    for i, n in enumerate(iv.steps):
        graph = "forward" if i < len(iv.fw_steps) else "backward"
        shape, dtype = _shape_dtype(n.meta.get("val"))
        here = per_step[i]
        rows.append({
            "step": i,
            "graph": graph,
            "name": n.name,
            "op": op_name(n),
            "layer": step.layer_of.get(n.name),
            "kind": step.kind_of.get(n.name, graph),
            "shape": shape,
            "dtype": dtype,
            "alloc_bytes": here.alloc_bytes,
            "scratch_bytes": here.scratch_bytes,
            "saved": graph == "forward" and n.name in saved_names,
            "freed": [st.name for st in here.freed],
            "freed_bytes": here.freed_bytes,
            "live_bytes": report.timeline[i].live_bytes if i < len(report.timeline) else None,
            "flops": node_flops(n),
        })
    return rows


def _why_saved(step: RewrittenStep, name: str) -> str:
    """The reason ``name`` is saved, from the Partition (RNG states are added by the
    rewrite, one per replayed random op)."""
    if name.endswith("_rng_state"):
        return f"RNG state replayed by the recompute of {name[: -len('_rng_state')]}"
    saved = step.partition.reason_of(name)
    if saved is not None and saved.reason == "read outside its group":
        return "group output: " + saved.detail
    if saved is not None and saved.reason == "checkpoint":
        seg = next(s for s in step.segments if name in s.checkpoints)
        return f"checkpoint of group {seg.group} (layers {_layers_text(seg.layers)})"
    if saved is not None and saved.reason in ("stored layer", "outer"):
        return "read by backward (stored, not recomputed)"
    return saved.reason + (f": {saved.detail}" if saved and saved.detail else "") if saved else "saved"


def _saved_rows(step: RewrittenStep, iv: Intervals) -> list[dict[str, Any]]:
    """One row per saved value, in the order forward returns them."""
    fw_by_name = {n.name: n for n in step.forward.graph.nodes}
    rows = []
    for saved in saved_storages(step, iv):
        n = fw_by_name.get(saved.name)
        shape, dtype = _shape_dtype(n.meta.get("val") if n is not None else None)
        rows.append({
            "name": saved.name,
            "layer": step.layer_of.get(saved.name),
            "shape": shape,
            "dtype": dtype,
            "bytes": saved.nbytes,
            "alias_of": saved.alias_of,
            "static": saved.static,
            "why": _why_saved(step, saved.name),
        })
    return rows


def _segment_rows(step: RewrittenStep, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per recompute segment, in run order, with what it allocates and costs."""
    recomputed = [row for row in nodes if row["kind"] == "recompute"]
    rows = []
    pos = 0
    for order, seg in enumerate(step.segments):
        mine = recomputed[pos: pos + len(seg.nodes)]
        pos += len(seg.nodes)
        rows.append({
            "order": order,
            "group": seg.group,
            "layers": list(seg.layers),
            "num_nodes": len(seg.nodes),
            "first_step": mine[0]["step"] if mine else None,
            "insert_before": seg.insert_before,
            "checkpoints": list(seg.checkpoints),
            "rng_replayed": list(seg.rng_replayed),
            "recompute_bytes": sum(r["alloc_bytes"] for r in mine),
            "recompute_flops": sum(r["flops"] for r in mine),
        })
    return rows


def _layers_text(layers: Sequence[int]) -> str:
    layers = list(layers)
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


# --------------------------------------------------------------------------- dump / load


def dump_step(step: RewrittenStep, report: MemoryReport, folder: str | Path, name: str,
              meta: dict[str, Any] | None = None) -> Path:
    """Write ``describe_step(step, report)`` to ``folder/<name>.remat.json``.

    ``remat-pass inspect --graph PATH`` reads it back (``load_dump``). The torch.compile
    backend calls this once per compiled graph; ``name`` is made file-safe (characters
    other than letters, digits, ``._-`` become ``_``).

    Args:
        step, report: the rewritten step and its liveness report.
        folder: created if missing.
        name: file stem, e.g. ``graph_0``.
        meta: provenance stored in the file (model, schedule request, ...).

    Returns:
        The path written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "graph"
    path = folder / f"{safe}{DUMP_SUFFIX}"
    # meta values that are not JSON (a Schedule, a Path) are stored as their str()
    path.write_text(json.dumps(describe_step(step, report, meta), indent=1, default=str) + "\n",
                    encoding="utf-8")
    return path


def load_dump(path: str | Path) -> dict[str, Any]:
    """Read a file written by ``dump_step``, validated against ``dump_schema.json`` (its
    ``report`` against ``report_schema.json``).

    Raises:
        ValueError: the file cannot be read, is not UTF-8 JSON, not a remat-pass graph
            dump, of a newer format version than this remat-pass reads, or a field is
            missing or of the wrong type (the message names the file, the field and
            what is expected).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON text ({e}); pass a file written by dump_step / the backend") from e
    except OSError as e:
        raise ValueError(f"cannot read graph dump {path}: {e.strerror}") from e
    if not isinstance(data, dict) or data.get("format") != DUMP_FORMAT:
        raise ValueError(
            f"{path} is not a remat-pass graph dump (format {data.get('format') if isinstance(data, dict) else None!r},"
            f" expected {DUMP_FORMAT!r}); pass a *{DUMP_SUFFIX} file written by dump_step / the backend"
        )
    if data.get("format_version", 0) > DUMP_FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {data.get('format_version')}; this remat-pass reads up to "
            f"{DUMP_FORMAT_VERSION}: upgrade remat-pass"
        )
    error = validation_message(json.loads(DUMP_SCHEMA_FILE.read_text(encoding="utf-8")), data)
    if error is None:
        error = schema_error(data["report"], "remat-pass-report", prefix="report")
    if error is not None:
        raise ValueError(f"{path}: {error} (schema: remat_pass/dump_schema.json)")
    return data


# --------------------------------------------------------------------------- rendering


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str) -> str:
    return text_table(header, [[("" if c is None else str(c)) for c in r] for r in rows], align)


NODE_COLUMNS = ("step", "node", "op", "layer", "kind", "shape", "dtype", "allocates",
                "saved/recomputed", "live", "freed here")


def node_table(desc: dict[str, Any], graph: str = "both", layer: str | None = None,
               max_freed: int = 4) -> str:
    """The per-node table of the forward and / or backward graph.

    Args:
        desc: ``describe_step`` output (or a loaded dump).
        graph: "forward", "backward" or "both".
        layer: only nodes of this layer ("outer" or an index as text); None: all.
        max_freed: names listed in "freed here" before ``+N more``.

    Raises:
        ValueError: ``graph`` is not one of forward, backward, both.
    """
    if graph not in ("forward", "backward", "both"):
        raise ValueError(f"graph {graph!r} is not one of forward, backward, both")
    rows = []
    for r in desc["nodes"]:
        if graph != "both" and r["graph"] != graph:
            continue
        if layer is not None and ("outer" if r["layer"] is None else str(r["layer"])) != layer:
            continue
        mark = "saved" if r["saved"] else ("recomputed" if r["kind"] == "recompute" else "")
        freed = r["freed"][:max_freed]
        more = len(r["freed"]) - len(freed)
        freed_text = ", ".join(freed) + (f" +{more} more" if more > 0 else "")
        if r["freed"]:
            freed_text += f" ({fmt_bytes(r['freed_bytes'])})"
        rows.append([
            r["step"], r["name"], r["op"], "outer" if r["layer"] is None else r["layer"],
            r["kind"], r["shape"], r["dtype"], fmt_bytes(r["alloc_bytes"]) if r["alloc_bytes"] else "",
            mark, fmt_bytes(r["live_bytes"]), freed_text,
        ])
    return _table(NODE_COLUMNS, rows, "rllrlllrlrl")


SAVED_COLUMNS = ("saved activation", "layer", "shape", "dtype", "size", "why saved")


def saved_table(desc: dict[str, Any]) -> str:
    """The saved activations (forward outputs that backward reads), in forward order."""
    rows = []
    for s in desc["saved"]:
        size = f"alias of {s['alias_of']}" if s["alias_of"] else ("static" if s["static"] else fmt_bytes(s["bytes"]))
        rows.append([s["name"], "outer" if s["layer"] is None else s["layer"], s["shape"], s["dtype"], size, s["why"]])
    total = sum(s["bytes"] for s in desc["saved"] if not s["static"])
    return _table(SAVED_COLUMNS, rows, "lrllrl") + f"\n{len(rows)} saved values, {fmt_bytes(total)}"


SEGMENT_COLUMNS = ("run", "group", "layers", "nodes", "at step", "before node", "allocates",
                   "GFLOPs", "checkpoints", "RNG replayed")


def segments_table(desc: dict[str, Any]) -> str:
    """The recompute segments in the order they run in backward."""
    if not desc["segments"]:
        return "no recompute segments (nothing is recomputed)"
    rows = [
        [s["order"], s["group"], _layers_text(s["layers"]), s["num_nodes"], s["first_step"],
         s["insert_before"], fmt_bytes(s["recompute_bytes"]), f"{s['recompute_flops'] / 1e9:.3f}",
         ", ".join(s["checkpoints"]), len(s["rng_replayed"])]
        for s in desc["segments"]
    ]
    return _table(SEGMENT_COLUMNS, rows, "rrrrrlrrlr")


def summary(desc: dict[str, Any]) -> str:
    """Schedule, peak and where, graph sizes: a few lines."""
    rep = desc["report"]
    fw = sum(1 for r in desc["nodes"] if r["graph"] == "forward")
    bw = len(desc["nodes"]) - fw
    rc = sum(1 for r in desc["nodes"] if r["kind"] == "recompute")
    peak = rep["peak"]
    where = f"{peak['phase']}, {'outer' if peak['layer'] is None else 'layer ' + str(peak['layer'])}"
    lines = [
        f"schedule: {rep['schedule']['provenance']}" + (f" ({rep['schedule']['description']})" if rep["schedule"].get("description") else ""),
        f"graphs: forward {fw} steps, backward {bw} steps ({rc} recomputed)",
        f"predicted peak: {fmt_bytes(rep['peak_bytes'])} of activations ({rep['peak_bytes']:,} bytes) at step "
        f"{peak['step']} ({where}, node {peak['node']}); static {fmt_bytes(rep['static_bytes'])} ({rep['allocator']} allocator)",
        f"saved activations: {fmt_bytes(rep['saved_activation_bytes'])}; "
        f"recompute {100 * rep['recompute_fraction']:.1f} % of forward FLOPs",
    ]
    for k, v in sorted(desc.get("meta", {}).items()):
        lines.append(f"{k}: {v}")
    return "\n".join(lines)


SECTIONS = ("summary", "forward", "backward", "saved", "segments", "code")


def render(desc: dict[str, Any], sections: Sequence[str] = ("summary", "forward", "backward", "saved", "segments"),
           layer: str | None = None) -> str:
    """Text for ``remat-pass inspect``: the chosen sections, each under a title.

    Raises:
        ValueError: an unknown section (allowed: SECTIONS), or ``layer`` names no layer
            of the graph (allowed: "outer" and the layer indices present).
    """
    if layer is not None:
        present = {"outer" if r["layer"] is None else str(r["layer"]) for r in desc["nodes"]}
        if layer not in present:
            ints = sorted(int(x) for x in present if x != "outer")
            raise ValueError(
                f"layer {layer!r} is not in this graph: give 'outer' or an index in "
                f"{ints[0]}..{ints[-1]}" if ints else f"layer {layer!r} is not in this graph: give 'outer'"
            )
    out = []
    for sec in sections:
        if sec not in SECTIONS:
            raise ValueError(f"section {sec!r} is not one of {SECTIONS}")
        if sec == "summary":
            out.append(summary(desc))
        elif sec in ("forward", "backward"):
            out.append(f"== {sec} graph ==\n" + node_table(desc, sec, layer))
        elif sec == "saved":
            out.append("== saved activations ==\n" + saved_table(desc))
        elif sec == "segments":
            out.append("== recompute segments, in run order ==\n" + segments_table(desc))
        elif sec == "code":
            out.append("== forward code ==\n" + desc["code"]["forward"].strip()
                       + "\n\n== backward code ==\n" + desc["code"]["backward"].strip())
    return "\n\n".join(out) + "\n"
