"""The memory model: op scratch calibrated per signature, the formula table, the cache,
the report of the op at the peak, and budgets that hold (``remat-pass plan``).

No figure here depends on the CPU or the thread count: every expected byte count is
either measured (calibration, the profiler) or computed by a formula from the thread
count the test runs with."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from remat_pass.recompute import schedule as schedules
from remat_pass.memory.calibration import CalibrationOptions, Calibrator
from remat_pass.cli.main import main
from remat_pass.report.gate import gate
from remat_pass.liveness.timeline import analyze
from remat_pass.measure.run import measured_step_timeline, profile_memory_events
from remat_pass.memory.memory_model import MemoryModel
from remat_pass.graph.op_signature import cpu_flags, op_call, signature_of
from remat_pass.report.schedule_report import markdown_from_json, read_reports, report_json, write_report
from remat_pass.memory.scratch_table import table_entry
from remat_pass.graph.op_scratch import flash_attention_bytes
from remat_pass.evaluate.session import Session
from zoo import ZOO


class ScratchLayer(nn.Module):
    """LayerNorm, flash attention, GELU and a dropout: ops with scratch on CPU."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return x + F.dropout(F.gelu(self.fc(a)), 0.1)


class ScratchStack(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(ScratchLayer() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def scratch_stack():
    """``(model, inputs, loss_fn)``: a GELU output summed (stride-0 gradient), and an mse
    loss closing over a target (its 0-dim result keeps an input-sized storage)."""
    torch.manual_seed(0)
    target = torch.randn(3, 20, 16)
    return ScratchStack(), (torch.randn(3, 20, 16),), lambda y: F.mse_loss(y, target) + y.sum()


def conv_stack():
    """The zoo's Conv2d + GroupNorm stack: oneDNN convolution scratch, no table entry."""
    return next(e for e in ZOO if e.name == "conv_groupnorm_layers").build()


@pytest.fixture(scope="module")
def scratch_session() -> Session:
    model, inputs, loss_fn = scratch_stack()
    return Session.create(model, inputs, loss_fn)


@pytest.mark.parametrize("threads", [1, 2])
def test_calibrated_timeline_equals_measured_at_every_step(scratch_session, threads):
    """Predicted live bytes equal the measured ones at every step, not only at the peak,
    at 1 and 2 threads (calibration keys on the thread count)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for sched in (schedules.none(2), schedules.uniform(1, 2))[:3 - threads]:
            step, report, _ = scratch_session.prepare(sched)
            measured = measured_step_timeline(step, scratch_session.joint)
            predicted = tuple(t.live_bytes for t in report.timeline)
            diff = [(i, report.timeline[i].node, p, m) for i, (p, m) in enumerate(zip(predicted, measured)) if p != m]
            assert not diff, f"{sched.provenance} at {threads} threads: {diff[:5]}"
            assert report.threads == threads
            assert report.ops_by_source["calibrated"] and not report.ops_by_source["none"]
    finally:
        torch.set_num_threads(old)


def test_table_matches_calibration_on_native_kernels(scratch_session):
    """Every node of the step with a table formula for an ATen native kernel (no oneDNN,
    no MKL, no ISA dispatch) gets the calibrated figures, at the thread count of the run:
    LayerNorm backward, flash attention and its backward, mse_loss, dropout, the
    reductions and the wrapped scalars."""
    step, report, _ = scratch_session.prepare(schedules.none(2))
    native = {"native_layer_norm", "native_layer_norm_backward", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward", "mse_loss", "native_dropout",
              "native_dropout_backward", "sum", "mean", "mul", "add"}
    checked = 0
    for n in [n for g in (step.forward, step.backward) for n in g.graph.nodes if n.op == "call_function"]:
        call = op_call(n)
        sig = signature_of(n, report.threads)
        if call is None or sig is None or sig.op.split(".")[1] not in native:
            continue
        entry = table_entry(sig, call.op, cpu_flags())
        measured = report.memory.calibrated[sig.key]
        assert entry is not None, sig.op
        assert entry.transient_bytes == measured.transient_bytes, (n.name, sig.op, entry, measured)
        if entry.output_storage_bytes is not None:
            assert entry.output_storage_bytes == measured.output_storage_bytes, (n.name, sig.op)
        checked += 1
    assert checked >= 10


def _measured_transient(fn) -> int:
    """Peak of the allocator's running sum during ``fn`` minus what is left at its end
    (``fn``'s result kept alive), after two warm-up calls."""
    fn(), fn()
    kept = []
    events = profile_memory_events(lambda: kept.append(fn()))
    running = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        running += nbytes
        peak = max(peak, running)
    return peak - running


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_flash_attention_formula_is_measured(dtype, threads):
    """The one flash-attention formula (``op_scratch.flash_attention_bytes``: the table's
    and Inductor's) is the measured scratch of both CPU kernels, float32 and float64
    (whose accumulators are double: twice the float32 bytes), at 1 and 2 threads; query
    length 200 takes the 64-row query blocks. The gradient's (B, T, H, D) view is
    contiguous, so the backward makes no ``grad_out.contiguous()`` copy."""
    aten = torch.ops.aten
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        b, h, length, d = 2, 2, 200, 16
        q, k, v = (torch.randn(b, h, length, d, dtype=dtype) for _ in range(3))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        grad = torch.randn(b, length, h, d, dtype=dtype).transpose(1, 2)
        forward = _measured_transient(lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True))
        backward = _measured_transient(lambda: aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True))
    finally:
        torch.set_num_threads(old)
    es = q.element_size()
    assert forward == flash_attention_bytes(length, length, d, es, threads, backward=False)
    assert backward == flash_attention_bytes(length, length, d, es, threads, backward=True)
    assert forward == threads * (64 * 200 + 2 * 64 + 64 * 16) * max(4, es)


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("backward", [False, True])
def test_flash_attention_formula_of_a_symbolic_length_is_the_concrete_one(element_size, backward):
    """A query length that is a sympy symbol (Inductor's code under dynamic shapes)
    gives an expression equal to the concrete formula at every length, across the
    block-size thresholds (32 / 192 / 768 rows, keys of 512)."""
    import sympy

    s = sympy.Symbol("s0", positive=True, integer=True)
    expr = flash_attention_bytes(s, s, 16, element_size, 2, backward)
    for n in (1, 20, 32, 33, 191, 192, 200, 512, 767, 768, 1024, 4096):
        assert int(expr.subs(s, n)) == flash_attention_bytes(n, n, 16, element_size, 2, backward)


def test_signature_keys_on_strides_and_threads():
    """gelu_backward of a stride-0 gradient (the backward of ``sum``) and of a dense one
    are two signatures; so is one op at 1 and at 2 threads."""

    def f(x, g):
        return torch.ops.aten.gelu_backward.default(g.expand(4, 64), x), \
            torch.ops.aten.gelu_backward.default(g.expand(4, 64).contiguous(), x)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 64), torch.randn(()))
    a, b = [n for n in gm.graph.nodes if n.target is torch.ops.aten.gelu_backward.default]
    assert signature_of(a, 1).key != signature_of(b, 1).key
    assert signature_of(a, 1).key != signature_of(a, 2).key
    cal = Calibrator(CalibrationOptions(use_cache=False))
    keys = cal.calibrate([a, b], 1)
    model = MemoryModel.table_only("cpu", 1).with_calibration(
        {k: cal._entries[k] for k in keys}, {})
    ma, mb = model.node_memory(a), model.node_memory(b)
    assert ma.source == mb.source == "calibrated"
    for node, m in ((a, ma), (b, mb)):  # the table agrees with what was measured
        assert table_entry(signature_of(node, 1), torch.ops.aten.gelu_backward.default,
                           cpu_flags()).transient_bytes == m.scratch_bytes


def test_calibration_failure_is_reported_not_raised():
    """An op that raises on the synthetic inputs (``multinomial`` of normal values, some
    negative) gets no figure: the model says why and falls back; nothing raises."""
    gm = make_fx(lambda p: torch.ops.aten.multinomial.default(p, 2), tracing_mode="fake")(torch.rand(3, 5))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    cal = Calibrator(CalibrationOptions(use_cache=False))
    (key,) = cal.calibrate([node], 1)
    assert key not in cal._entries and "calibration failed" in cal._failed[key]
    model = cal.memory_model([], "cpu", 1).with_calibration({}, {key: cal._failed[key]})
    m = model.node_memory(node)
    assert m.source == "none" and "calibration failed: RuntimeError" in m.detail


def test_cache_is_reused_and_a_bad_file_is_recalibrated(scratch_session, tmp_path):
    options = CalibrationOptions(cache_dir=tmp_path)

    def session(calibrator: Calibrator) -> Session:
        s = scratch_session
        return Session(s.joint, s.stack, s.example_inputs, s.loss_fn, 0, calibrator)

    first = Calibrator(options)
    peak = session(first).prepare(schedules.none(2))[1].peak_bytes
    assert first.calibrated_signatures > 0 and first.path.exists()
    second = Calibrator(options)
    assert session(second).prepare(schedules.none(2))[1].peak_bytes == peak
    assert second.calibrated_signatures == 0  # every figure read from the cache
    first.path.write_text("{not json", encoding="utf-8")
    with pytest.warns(UserWarning, match="calibration cache"):
        again = Calibrator(options)
    assert session(again).prepare(schedules.none(2))[1].peak_bytes == peak
    assert again.calibrated_signatures > 0
    header, *entries = again.path.read_text().splitlines()
    assert json.loads(header)["host"] == again.host and len(entries) == again.calibrated_signatures


def test_report_names_the_op_scratch_at_the_peak(scratch_session, tmp_path):
    """The JSON (valid against the schema) and the Markdown name the op at the peak and
    its scratch; without calibration they say it is not calibrated and by how much the
    peak could move, and so does the gate's budget check."""
    step, report, _ = scratch_session.prepare(schedules.none(2))
    doc = report_json(report, step)
    path = tmp_path / "r.json"
    write_report(path, doc)
    (back,) = read_reports(path)
    at = back["op_scratch"]["at_peak"]
    assert at["node"] == report.peak_node and at["source"] == "calibrated"
    assert back["op_scratch"]["peak_could_move_bytes"] == 0
    assert "op scratch at the peak" in markdown_from_json(back)

    table_only = analyze(step, memory=MemoryModel.table_only("cpu"))
    d = report_json(table_only, step)
    assert d["op_scratch"]["at_peak"]["source"] in ("table", "none")
    assert d["op_scratch"]["peak_could_move_bytes"] > 0
    md = markdown_from_json(d)
    assert "not calibrated" in md and "could move" in md
    text = gate([d], budget=d["peak_bytes"]).text()
    assert "PASS" in text and "not calibrated" in text and "could move" in text


def test_plan_fails_when_the_measured_peak_exceeds_the_budget(capsys):
    """``plan`` without calibration on a conv stack (no table entry for oneDNN
    convolution): the schedule predicted to fit measures over the budget, an error (exit
    1) with the figures; calibrated, that budget is refused as infeasible (exit 2), and
    the calibrated peak of ``none`` as a budget holds (exit 0)."""
    args = ["plan", "--model", "tests.memory.test_memory_model:conv_stack", "--stack", "blocks"]
    session = Session.create(*conv_stack(), calibration=None)
    budget = session.report(schedules.none(session.stack.num_layers)).peak_bytes
    assert main([*args, "--no-calibrate", "--budget", str(budget)]) == 1
    out, err = capsys.readouterr()
    assert "exceeds the budget" in err and "OVER BUDGET" in out and "not calibrated" in out
    # calibrated, that budget is refused before anything runs: below the least feasible peak
    assert main([*args, "--budget", str(budget)]) == 2
    assert "least feasible peak" in capsys.readouterr().err
    calibrated = Session.create(*conv_stack())
    budget = calibrated.report(schedules.none(calibrated.stack.num_layers)).peak_bytes
    rc = main([*args, "--budget", str(budget)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "OVER BUDGET" not in out and "calibrated at" in out


def test_no_warning_from_a_fresh_cache(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Calibrator(CalibrationOptions(cache_dir=tmp_path / "new"))
