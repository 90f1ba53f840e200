"""The CI gate: fail when a predicted peak exceeds a budget or regresses against a baseline.

Used by ``remat-pass check`` (exit status 0 = pass, 1 = a check failed, 2 = bad input)
and by the pytest plugin. It works on ``report.report_json`` dicts, so a report
computed now and one read from a committed JSON file are compared the same way.

A failure explains itself: the peak and the limit, where the peak is, and which
tensors grew: bytes live at the peak by layer (baseline, now, change) and the tensors
live at the peak and the saved activations, matched by layer and node name, that are
new or larger than in the baseline. Node names are those of the rewritten graphs; the
same model and schedule trace to the same names, so the comparison is exact when
nothing changed and names the culprits when something did.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from ..formatting import fmt_bytes, natural_key, parse_bytes, parse_fraction, signed_bytes
from .schedule_report import op_scratch_text, read_reports, reports_document, write_report

EXIT_OK = 0
EXIT_FAILED = 1


@dataclasses.dataclass(frozen=True)
class Finding:
    """The outcome of one check on one schedule.

    Attributes:
        schedule: the schedule's provenance (``uniform(K=4)``).
        check: "budget" or "baseline".
        ok: whether it passed.
        headline: one line: the figures and the verdict.
        details: the explanation (empty when it passed).
    """

    schedule: str
    check: str
    ok: bool
    headline: str
    details: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GateResult:
    """Every finding of a gate run; ``exit_code`` is 0 when all passed, else 1."""

    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(f.ok for f in self.findings)

    @property
    def exit_code(self) -> int:
        """``EXIT_OK`` or ``EXIT_FAILED``."""
        return EXIT_OK if self.ok else EXIT_FAILED

    def text(self) -> str:
        """The findings, failures with their explanations, and a last verdict line."""
        lines = []
        for f in self.findings:
            lines.append(("PASS  " if f.ok else "FAIL  ") + f.headline)
            lines += ["      " + d for d in f.details]
        failed = sum(not f.ok for f in self.findings)
        lines.append(
            f"remat-pass check: {len(self.findings) - failed} of {len(self.findings)} checks passed"
            + ("" if not failed else f"; {failed} failed")
        )
        return "\n".join(lines)


def _where(d: dict[str, Any]) -> str:
    p = d["peak"]
    layer = "outer" if p["layer"] is None else f"layer {p['layer']}"
    return f"{p['phase']}, {layer}, node {p['node']}"


def _pct(new: int, old: int) -> str:
    return f"{100 * (new - old) / old:+.2f} %" if old else "new"


def _layer_key(layer: int | None) -> str:
    return "outer" if layer is None else str(layer)


def what_is_live(report: dict[str, Any], top: int = 8) -> list[str]:
    """Lines naming the bytes live at the peak by layer and the largest live tensors."""
    by_layer = ", ".join(f"{k}: {fmt_bytes(v)}" for k, v in report["live_at_peak_by_layer"].items())
    out = [f"live at the peak by layer: {by_layer}", "largest tensors live at the peak:"]
    for t in sorted(report["live_at_peak"], key=lambda t: (-t["bytes"], natural_key(t["name"])))[:top]:
        out.append(f"  {t['name']} (layer {_layer_key(t['layer'])}, {t['kind']}): {fmt_bytes(t['bytes'])}")
    more = len(report["live_at_peak"]) - top
    if more > 0:
        out.append(f"  ... and {more} more")
    return out


def _by_key(tensors: Sequence[dict[str, Any]]) -> dict[tuple[str, str], int]:
    """Bytes per (layer, node name); a multi-output node's storages are summed."""
    out: dict[tuple[str, str], int] = {}
    for t in tensors:
        key = (_layer_key(t["layer"]), t["name"])
        out[key] = out.get(key, 0) + t["bytes"]
    return out


def explain_growth(current: dict[str, Any], baseline: dict[str, Any], top: int = 10) -> list[str]:
    """Which tensors grew from ``baseline`` to ``current`` (both ``report_json`` dicts).

    Returns:
        Lines: where the peak is now and was; bytes live at the peak per layer that
        changed (baseline -> now); tensors live at the peak that are new or larger,
        matched by (layer, node name), largest growth first; the same for saved
        activations. At most ``top`` tensors per list; the storages of a multi-output
        node (same name) are summed.
    """
    lines = [f"peak now at {_where(current)}; baseline at {_where(baseline)}"]
    cur_l, base_l = current["live_at_peak_by_layer"], baseline["live_at_peak_by_layer"]
    keys = sorted(set(cur_l) | set(base_l), key=lambda k: (k != "outer", int(k) if k != "outer" else -1))
    changed = [(k, base_l.get(k, 0), cur_l.get(k, 0)) for k in keys if base_l.get(k, 0) != cur_l.get(k, 0)]
    if changed:
        lines.append("live at the peak by layer (baseline -> now):")
        for k, old, new in sorted(changed, key=lambda c: -(c[2] - c[1])):
            lines.append(f"  {'outer' if k == 'outer' else 'layer ' + k}: {fmt_bytes(old)} -> {fmt_bytes(new)} ({signed_bytes(new - old)})")
    for field, title in (("live_at_peak", "tensors live at the peak"), ("saved", "saved activations")):
        old, new = _by_key(baseline[field]), _by_key(current[field])
        grew = sorted(
            ((k, old.get(k), b) for k, b in new.items() if b > old.get(k, 0)),
            key=lambda g: (-(g[2] - (g[1] or 0)), g[0]),
        )
        gone = sum(1 for k in old if k not in new)
        total_old, total_new = sum(old.values()), sum(new.values())
        head = (f"{title}: {len(current[field])} tensors, {fmt_bytes(total_new)} "
                f"(baseline {len(baseline[field])}, {fmt_bytes(total_old)})")
        if not grew:
            lines.append(head + "; none new or larger" + (f"; {gone} no longer there" if gone else ""))
            continue
        lines.append(head + f"; {len(grew)} new or larger" + (f", {gone} no longer there" if gone else "") + ":")
        for (layer, name), was, now in grew[:top]:
            label = "new" if was is None else f"{fmt_bytes(was)} ->"
            lines.append(f"  {name} (layer {layer}): {label} {fmt_bytes(now)} ({signed_bytes(now - (was or 0))})")
        if len(grew) > top:
            lines.append(f"  ... and {len(grew) - top} more")
    return lines


def uncalibrated_note(report: dict[str, Any]) -> list[str]:
    """A line when the op at ``report``'s peak has no calibrated scratch figure: which
    op, the figure used and how far the peak could move (empty otherwise)."""
    scratch = report.get("op_scratch")
    if not scratch or not scratch.get("at_peak") or scratch["at_peak"]["source"] == "calibrated":
        return []
    return [f"note: op scratch at the peak {op_scratch_text(scratch)}; calibrate on the target machine "
            "(predict there, without --no-calibrate) to know"]


def check_budget(report: dict[str, Any], budget_bytes: int, top: int = 8) -> Finding:
    """Whether ``report``'s predicted peak (op scratch included) fits ``budget_bytes``
    (peak <= budget passes). The details say when the op at the peak has no calibrated
    scratch figure and how far the peak could move, whether it passes or not."""
    peak = report["peak_bytes"]
    name = report["schedule"]["provenance"]
    ok = peak <= budget_bytes
    verdict = "within" if ok else "EXCEEDS"
    headline = (
        f"{name}: predicted peak {fmt_bytes(peak)} ({peak:,} B) {verdict} the budget "
        f"{fmt_bytes(budget_bytes)} ({budget_bytes:,} B)"
        + ("" if ok else f" by {fmt_bytes(peak - budget_bytes)}")
    )
    details = uncalibrated_note(report) if ok else [f"peak at {_where(report)}", *uncalibrated_note(report),
                                                    *what_is_live(report, top)]
    return Finding(name, "budget", ok, headline, tuple(details))


def check_regression(
    report: dict[str, Any], baseline: dict[str, Any], max_regression_fraction: float, top: int = 10
) -> Finding:
    """Whether ``report``'s peak is at most ``baseline``'s times ``1 + max_regression_fraction``."""
    peak, base = report["peak_bytes"], baseline["peak_bytes"]
    name = report["schedule"]["provenance"]
    limit = base * (1 + max_regression_fraction)
    ok = peak <= limit
    change = _pct(peak, base)
    headline = (
        f"{name}: predicted peak {fmt_bytes(peak)} ({peak:,} B) vs baseline {fmt_bytes(base)} "
        f"({base:,} B): {change}, limit +{100 * max_regression_fraction:g} %"
        + ("" if ok else " -> REGRESSION")
    )
    notes = []
    if report.get("allocator") != baseline.get("allocator"):
        notes.append(f"note: allocator {report.get('allocator')} vs baseline {baseline.get('allocator')}")
    details = () if ok else tuple(notes + explain_growth(report, baseline, top))
    return Finding(name, "baseline", ok, headline, details)


IDENTITY_FIELDS = (
    (("static_bytes",), "static bytes (parameters, buffers and inputs)"),
    (("schedule", "num_layers"), "L, the layers of the stack(s)"),
)
"""What a report records of its model: a baseline of another model (other parameter
or input shapes, other layer count) differs in one of them."""


def check_same_model(reports: Sequence[dict[str, Any]], base_by_name: dict[str, dict[str, Any]]) -> None:
    """Refuse a baseline whose reports are of another model than ``reports``.

    Compares, for each schedule present in both, the fields of ``IDENTITY_FIELDS``: the
    static bytes (every parameter, buffer and input: another width, vocabulary, batch or
    sequence length changes them) and L.

    Raises:
        ValueError: a field differs; the message names the schedule, the field and both
            values.
    """
    for r in reports:
        b = base_by_name.get(r["schedule"]["provenance"])
        if b is None:
            continue
        for path, what in IDENTITY_FIELDS:
            now, then = r, b
            for key in path:
                now, then = now.get(key), then.get(key)
            if now is not None and then is not None and now != then:
                raise ValueError(
                    f"the baseline is of another model: {r['schedule']['provenance']} has {what} = {now:,} "
                    f"now and {then:,} in the baseline; compare against a baseline of this model (same "
                    "parameters, inputs and layers), or write a new one with `remat-pass report --json`"
                )


def run_gate(
    reports: Sequence[dict[str, Any]],
    *,
    budget_bytes: int | None = None,
    baseline: Sequence[dict[str, Any]] | None = None,
    max_regression_fraction: float = 0.0,
    top: int = 10,
) -> GateResult:
    """Check every report against the budget and / or the baseline.

    Args:
        reports: ``report_json`` dicts, one per schedule.
        budget_bytes: the largest allowed predicted peak (bytes), or None.
        baseline: baseline ``report_json`` dicts, matched to ``reports`` by schedule
            provenance; a schedule without a baseline fails (say what to do).
        max_regression_fraction: allowed growth over the baseline peak (0.05 = 5 %).

    Returns:
        A GateResult; ``exit_code`` 1 when any check failed.

    Raises:
        ValueError: neither a budget nor a baseline was given, no report, or the
            baseline is of another model (``check_same_model``).
    """
    if budget_bytes is None and baseline is None:
        raise ValueError("nothing to check: give a budget (--budget 2GiB) and/or a baseline (--baseline report.json)")
    if not reports:
        raise ValueError("no report to check")
    findings: list[Finding] = []
    base_by_name = {b["schedule"]["provenance"]: b for b in baseline or ()}
    if baseline is not None:
        check_same_model(reports, base_by_name)
    for r in reports:
        name = r["schedule"]["provenance"]
        if budget_bytes is not None:
            findings.append(check_budget(r, budget_bytes, top))
        if baseline is not None:
            if name not in base_by_name:
                findings.append(Finding(
                    name, "baseline", False,
                    f"{name}: no baseline for this schedule (baseline has: "
                    f"{', '.join(sorted(base_by_name)) or 'nothing'})",
                    ("write one with `remat-pass report ... --json PATH` and commit it",),
                ))
            else:
                findings.append(check_regression(r, base_by_name[name], max_regression_fraction, top))
    return GateResult(tuple(findings))


def gate(
    reports: Sequence[dict[str, Any]],
    *,
    budget: str | int | None = None,
    baseline: str | Path | None = None,
    max_regression: str | float = "0%",
    update_baseline: bool = False,
) -> GateResult:
    """The gate as the CLI (``remat-pass check``) and the pytest plugin call it: parse the
    budget and regression limit, read (or, with ``update_baseline``, write) the baseline
    file, and ``run_gate``.

    Args:
        reports: ``report_json`` dicts, one per schedule.
        budget: largest allowed predicted peak: bytes or a size such as ``"2GiB"``.
        baseline: path of a baseline report file (``remat-pass report --json``).
        max_regression: allowed growth over the baseline peak (``"5%"`` or ``0.05``).
        update_baseline: write ``reports`` into the baseline file (replacing the rows of
            the same schedules) instead of comparing; the result then has only the
            budget findings.

    Returns:
        The GateResult (no findings when there is nothing to check after an update).

    Raises:
        ValueError: a malformed budget or limit, an unreadable or invalid baseline file,
            or neither a budget nor a baseline.
    """
    budget_bytes = parse_bytes(budget) if budget is not None else None
    limit = parse_fraction(max_regression)
    base_docs = None
    if baseline is not None and update_baseline:
        path = Path(baseline)
        names = {r["schedule"]["provenance"] for r in reports}
        kept = [d for d in (read_reports(path) if path.exists() else []) if d["schedule"]["provenance"] not in names]
        write_report(path, reports_document([*kept, *reports]))
    elif baseline is not None:
        base_docs = read_reports(baseline)
    if budget_bytes is None and base_docs is None:
        if update_baseline:
            return GateResult(())
        raise ValueError("nothing to check: give a budget (--budget 2GiB) and/or a baseline (--baseline report.json)")
    return run_gate(reports, budget_bytes=budget_bytes, baseline=base_docs, max_regression_fraction=limit)
