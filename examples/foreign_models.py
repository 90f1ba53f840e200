"""Sweep models this project was not written against: torchvision, timm and the
transformers families outside ``remat_pass.models.hf_families``, one table.

Every model is built from a small config with random weights (no download), in train
mode, fp32 on the CPU, batch 2: images 32x32 or 64x64 (the smallest each design
accepts), sequences of 16 tokens; fewer blocks and narrower widths where the
constructor takes them (each row's note says what was changed). Classifiers (torchvision,
timm) take a cross-entropy loss on random labels; the transformers models return
``.loss`` from ``labels``. Dropout and stochastic depth keep the packages' defaults for
the vision models (their masks are replayed, so gradients are still checked bitwise)
and are 0 for the transformers configs, as in ``examples/hf_families.py``.

Per model (``model_row``): trace the step (``Session.create``; a refusal is a row with
the error's class and message, never a crash of the script), then every distinct
Megatron-LM schedule of its stacks (``schedule.distinct_megatron_schedules``) is
rewritten, predicted and measured (``Session.evaluate``); a row counts as exact when the
predicted peak equals the measured one to the byte, and its gradients are compared bit
for bit with the un-rewritten step (else: within that step's run-to-run difference,
else: differ). With ``--plan``: the layer-level planner's least feasible peak
(``plan.planner.Planner.least_feasible``) against the least predicted peak of the
Megatron settings, and the op-level plan (``plan.op_planner.OpPlanner``, as
``remat-pass plan --granularity op`` drives it) at the budget halfway between the op
level's least feasible and unconstrained peaks, measured: whether its measured peak is
within the budget, its planning time (building the planner and solving), and its
proven gap (``OpPlan.bound``: what, if anything, stopped the search short of the optimum).

torchvision and timm are the ``vision`` extra (pyproject.toml); without them their rows
say ``skipped``.

Usage:
    python examples/foreign_models.py [--models a,b,...] [--plan] [--threads 1] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's remat_pass

from remat_pass.errors import RematError  # noqa: E402
from remat_pass.formatting import markdown_table  # noqa: E402
from remat_pass.recompute.schedule import distinct_megatron_schedules  # noqa: E402
from remat_pass.evaluate.session import Session  # noqa: E402

BATCH, SEQ, VOCAB, CLASSES = 2, 16, 64, 10
Built = tuple[torch.nn.Module, Any, Any, str]


# --------------------------------------------------------------------------- builders


def _classifier(model: torch.nn.Module, size: int, note: str, seed: int = 0) -> Built:
    """``model`` in train mode, a batch of random images ``(BATCH, 3, size, size)`` and a
    cross-entropy loss on random labels (``CLASSES`` classes)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, size, size, generator=g)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return model.train(), images, (lambda logits: F.cross_entropy(logits, labels)), note


def _tv(name: str, size: int, note: str, **kw: Any) -> Callable[[], Built]:
    def build() -> Built:
        from torchvision import models as tvm

        torch.manual_seed(0)
        return _classifier(getattr(tvm, name)(weights=None, num_classes=CLASSES, **kw), size, note)
    return build


def _tv_convnext() -> Built:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    setting = [CNBlockConfig(24, 48, 2), CNBlockConfig(48, 96, 2), CNBlockConfig(96, 192, 2), CNBlockConfig(192, None, 2)]
    return _classifier(ConvNeXt(setting, stochastic_depth_prob=0.1, num_classes=CLASSES), 64,
                       "convnext_tiny's design (torchvision ConvNeXt), depths 2-2-2-2, widths 24-192, 64x64")


def _tv_swin() -> Built:
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(patch_size=[4, 4], embed_dim=24, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                            stochastic_depth_prob=0.2, num_classes=CLASSES)
    return _classifier(model, 32, "swin_t's design (torchvision SwinTransformer), depths 2-2, width 24, window 4, 32x32")


def _tv_vit() -> Built:
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=4, hidden_dim=64, mlp_dim=128,
                              num_classes=CLASSES)
    return _classifier(model, 32, "vit_b_16's design (torchvision VisionTransformer), 3 layers, width 64, patch 8, 32x32")


def _timm(name: str, size: int, note: str, **kw: Any) -> Callable[[], Built]:
    def build() -> Built:
        import timm

        torch.manual_seed(0)
        return _classifier(timm.create_model(name, pretrained=False, num_classes=CLASSES, **kw), size, note)
    return build


def _hf(config_name: str, model_name: str, note: str, experts: str | None = None, **cfg: Any) -> Callable[[], Built]:
    """A transformers model from ``transformers.<config_name>(**cfg)``, eager attention,
    ``labels`` = the ids (next-token loss for causal LMs, every token for masked LMs);
    ``experts``: ``config._experts_implementation`` (None: transformers' default)."""
    def build() -> Built:
        import transformers

        transformers.logging.set_verbosity_error()
        config = getattr(transformers, config_name)(**cfg)
        config._attn_implementation = "eager"
        if experts is not None:
            config._experts_implementation = experts
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config).train()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        return model, {"input_ids": ids, "labels": ids}, None, note
    return build


def _whisper() -> Built:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=SEQ, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(BATCH, 16, 32, generator=g)  # 2 * max_source_positions frames
    labels = torch.randint(3, VOCAB, (BATCH, 8), generator=g)
    return model, {"input_features": feats, "labels": labels}, None, \
        "WhisperForConditionalGeneration, 2+2 layers, d_model 32, 16 mel bins x 32 frames, 8 target tokens"


_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=SEQ, attention_dropout=0.0, tie_word_embeddings=False)

_MOE = dict(num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, router_aux_loss_coef=0.0, **_DEC)

MODELS: dict[str, tuple[str, Callable[[], Built]]] = {
    "tv_resnet18": ("torchvision", _tv("resnet18", 64, "resnet18 as shipped (BatchNorm, train mode), 64x64")),
    "tv_convnext": ("torchvision", _tv_convnext),
    "tv_swin": ("torchvision", _tv_swin),
    "tv_mobilenet_v3_small": ("torchvision", _tv("mobilenet_v3_small", 64, "mobilenet_v3_small as shipped, 64x64")),
    "tv_efficientnet_b0": ("torchvision", _tv("efficientnet_b0", 64, "efficientnet_b0 as shipped, 64x64")),
    "tv_vit": ("torchvision", _tv_vit),
    "timm_resnet18": ("timm", _timm("resnet18", 64, "resnet18 as shipped, 64x64")),
    "timm_convnext_atto": ("timm", _timm("convnext_atto", 64, "convnext_atto, depths 2-2-2-2 (atto: 2-2-6-2), 64x64",
                                         depths=(2, 2, 2, 2))),
    "timm_vit_tiny": ("timm", _timm("vit_tiny_patch16_224", 32, "vit_tiny_patch16, depth 3, 32x32", img_size=32,
                                    depth=3)),
    "timm_deit_tiny": ("timm", _timm("deit_tiny_patch16_224", 32, "deit_tiny_patch16, depth 3, 32x32", img_size=32,
                                     depth=3)),
    "timm_swin": ("timm", _timm("swin_tiny_patch4_window7_224", 32,
                                "swin_tiny's design, depths 2-2, width 24, window 4, 32x32", img_size=32,
                                window_size=4, depths=(2, 2), num_heads=(2, 4), embed_dim=24)),
    "bloom": ("transformers", _hf("BloomConfig", "BloomForCausalLM", "BloomForCausalLM (ALiBi), 3 layers, hidden 32",
                                  vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4, hidden_dropout=0.0,
                                  attention_dropout=0.0)),
    "falcon": ("transformers", _hf("FalconConfig", "FalconForCausalLM", "FalconForCausalLM (rotary, MQA), 3 layers",
                                   vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": ("transformers", _hf("OPTConfig", "OPTForCausalLM", "OPTForCausalLM, 3 layers, hidden 32",
                                vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=32,
                                dropout=0.0, attention_dropout=0.0)),
    "gemma2": ("transformers", _hf("Gemma2Config", "Gemma2ForCausalLM",
                                   "Gemma2ForCausalLM (sliding window 8, soft-capping), 3 layers",
                                   num_key_value_heads=2, head_dim=8, sliding_window=8, **_DEC)),
    "gemma3": ("transformers", _hf("Gemma3TextConfig", "Gemma3ForCausalLM",
                                   "Gemma3ForCausalLM (text), 3 layers, sliding window 8",
                                   num_key_value_heads=2, head_dim=8, sliding_window=8, **_DEC)),
    "mamba": ("transformers", _hf("MambaConfig", "MambaForCausalLM", "MambaForCausalLM (slow path), 3 layers, state 8",
                                  vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3, expand=2,
                                  conv_kernel=4, use_cache=False)),
    "mamba2": ("transformers", _hf("Mamba2Config", "Mamba2ForCausalLM",
                                   "Mamba2ForCausalLM (torch path), 3 layers, 4 heads of 16, chunk 8",
                                   vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3, expand=2,
                                   head_dim=16, num_heads=4, n_groups=1, chunk_size=8, use_cache=False)),
    "deberta_v2": ("transformers", _hf("DebertaV2Config", "DebertaV2ForMaskedLM",
                                       "DebertaV2ForMaskedLM (relative attention c2p+p2c), 3 layers",
                                       vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, max_position_embeddings=SEQ, relative_attention=True,
                                       pos_att_type=["p2c", "c2p"], position_buckets=8, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)),
    "whisper": ("transformers", _whisper),
    "gptj": ("transformers", _hf("GPTJConfig", "GPTJForCausalLM", "GPTJForCausalLM (parallel residual), 3 layers",
                                 vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=4, rotary_dim=4,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)),
    "qwen3_moe": ("transformers", _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                      "Qwen3MoeForCausalLM, 4 experts top-2, transformers' default experts (grouped_mm)",
                                      **_MOE)),
    "qwen3_moe_eager": ("transformers", _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                            "Qwen3MoeForCausalLM, eager experts loop (nonzero over the routing)",
                                            experts="eager", **_MOE)),
    "qwen3_moe_batched": ("transformers", _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                              "Qwen3MoeForCausalLM, experts_implementation batched_mm",
                                              experts="batched_mm", **_MOE)),
}
"""Name -> (source package, builder); the builder returns ``(model, inputs, loss_fn, note)``."""


# --------------------------------------------------------------------------- one row


def _one_line(e: BaseException) -> str:
    """``Class: message`` on one line, install paths shortened."""
    return f"{type(e).__name__}: " + re.sub(r"/\S*/site-packages/", "", " ".join(str(e).split()))


def _cut(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _package_version(source: str) -> str:
    try:
        return f"{source} {__import__(source).__version__}"
    except ImportError:
        return source


def _sweep(session: Session) -> list[dict]:
    rows = []
    for sch in distinct_megatron_schedules(session.stack.layers_per_stack):
        r = session.evaluate(sch, strict=False)
        rows.append({"schedule": sch.provenance, "predicted_peak_bytes": r.predicted_peak_bytes,
                     "measured_peak_bytes": r.measured_peak_bytes, "grads_equal": r.grads_equal,
                     "grads_within_run_to_run": r.grads_within_run_to_run,
                     "max_grad_diff_vs_reference": r.max_grad_diff_vs_reference})
    return rows


def _plan(session: Session, rows: list[dict]) -> dict:
    """The planner columns: layer-level least feasible against the best Megatron
    setting (least predicted peak), and the op-level plan halfway between the op level's
    least feasible and unconstrained peaks, measured."""
    from remat_pass.plan.op_planner import OpPlanner
    from remat_pass.plan.planner import Planner

    t0 = time.perf_counter()
    layer = Planner(session.joint, session.stack, session.report)
    least_sch, least = layer.least_feasible()
    layer_s = time.perf_counter() - t0
    best = min((r for r in rows if r["predicted_peak_bytes"] is not None), key=lambda r: r["predicted_peak_bytes"])
    t0 = time.perf_counter()
    op = OpPlanner(session.joint, session.stack, session.report)
    op_least = op.least_feasible().predicted_peak_bytes
    budget = (op_least + op.unconstrained_peak_bytes) // 2
    plan = op.plan(budget)
    op_s = time.perf_counter() - t0
    points = op.calibrated_points  # per kind: (trade-off points calibrated, points found)
    r = session.evaluate(plan.partition, strict=False)
    return {"layer_least_feasible_bytes": least, "layer_least_schedule": least_sch.provenance,
            "layer_plan_s": layer_s, "best_megatron": best["schedule"],
            "best_megatron_predicted_bytes": best["predicted_peak_bytes"],
            "op_least_feasible_bytes": op_least, "unconstrained_bytes": op.unconstrained_peak_bytes,
            "op_budget_bytes": budget, "op_predicted_bytes": plan.predicted_peak_bytes,
            "op_measured_bytes": r.measured_peak_bytes, "op_grads_equal": r.grads_equal,
            "op_grads_within_run_to_run": r.grads_within_run_to_run, "op_plan_s": op_s,
            "op_recomputed_nodes": plan.recomputed_nodes, "op_bound": plan.bound, "op_gap_cost": plan.gap_cost,
            "op_build_s": op.prepare_s, "op_kinds": len(op.kinds),
            "op_fronts_cut": sum(not f.complete for f in op.layer_fronts),
            "op_points_calibrated": sum(a for a, _ in points), "op_points": sum(b for _, b in points)}


def model_row(name: str, plan: bool = False) -> dict:
    """Trace, sweep (and with ``plan``, plan) one model of ``MODELS``; never raises for
    the model's sake.

    Returns:
        a dict: ``model``, ``source`` (package and version), ``status`` (``traced``;
        ``refused``: the project raised a ``RematError`` saying why; ``error``: any
        other exception, at ``stage``; ``skipped``: the package is not installed),
        ``reason`` (one line), ``note`` (the config), ``stacks`` (path and L each),
        ``rows`` (per schedule: predicted and measured peak bytes, gradients), the
        planner fields with ``plan``, and ``seconds``.

    Raises:
        KeyError: ``name`` is not in ``MODELS``.
    """
    source, build = MODELS[name]
    out: dict[str, Any] = {"model": name, "source": _package_version(source), "status": "traced", "reason": "",
                           "stage": "", "note": "", "stacks": [], "rows": []}
    t0 = time.perf_counter()
    stage = "build"
    try:
        model, inputs, loss_fn, out["note"] = build()
        stage = "trace"
        session = Session.create(model, inputs, loss_fn)
        out["stacks"] = [{"path": s.path, "num_layers": s.num_layers} for s in session.stack.stacks]
        stage = "sweep"
        out["rows"] = _sweep(session)
        if plan:
            stage = "plan"
            out.update(_plan(session, out["rows"]))
    except ImportError as e:
        out.update(status="skipped", reason=f"{e.name or source} is not installed (the vision extra)")
    except RematError as e:
        out.update(status="refused", reason=_one_line(e), stage=stage)
    except Exception as e:  # noqa: BLE001 - a model that raises is a row, never a crash
        out.update(status="error", reason=_one_line(e), stage=stage)
    out["seconds"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------- the table


def _grads(rows: list[dict]) -> str:
    eq = sum(r["grads_equal"] for r in rows)
    within = sum(r["grads_within_run_to_run"] and not r["grads_equal"] for r in rows)
    differ = len(rows) - eq - within
    return f"{eq} bitwise" + (f", {within} within run-to-run" if within else "") + (f", {differ} differ" if differ else "")


def exact_rows(rows: list[dict]) -> int:
    """How many rows' predicted peak equals the measured peak to the byte."""
    return sum(r["measured_peak_bytes"] is not None and r["predicted_peak_bytes"] == r["measured_peak_bytes"]
               for r in rows)


def _kib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1024:,.1f}"


def table_row(d: dict, plan: bool) -> list[str]:
    """One Markdown table row of ``model_row``'s dict."""
    status = d["status"] if d["status"] == "traced" else f"**{d['status']}**" + (
        f" ({d['stage']})" if d["stage"] else "") + f": {_cut(d['reason'])}"
    stacks = ", ".join(f"{s['path']}:{s['num_layers']}" for s in d["stacks"]) or "-"
    rows = d["rows"]
    row = [d["model"], d["source"], status, stacks, str(len(rows)) if rows else "-",
           f"{exact_rows(rows)}/{len(rows)}" if rows else "-", _grads(rows) if rows else "-", f"{d['seconds']:.0f}"]
    if plan:
        if "op_plan_s" not in d:
            return row + ["-"] * 6
        fits = d["op_measured_bytes"] is not None and d["op_measured_bytes"] <= d["op_budget_bytes"]
        exact = d["op_measured_bytes"] == d["op_predicted_bytes"]
        grads = "bitwise" if d["op_grads_equal"] else "within run-to-run" if d["op_grads_within_run_to_run"] else "differ"
        row += [f"{_kib(d['layer_least_feasible_bytes'])} vs {_kib(d['best_megatron_predicted_bytes'])} "
                f"({d['best_megatron']})",
                f"{_kib(d['op_least_feasible_bytes'])} / {_kib(d['unconstrained_bytes'])}",
                f"{_kib(d['op_budget_bytes'])}: {_kib(d['op_predicted_bytes'])} / {_kib(d['op_measured_bytes'])} "
                f"{'≤' if fits else '>'} budget{'' if exact else ' (predicted != measured)'}, grads {grads}",
                f"{d['op_plan_s']:.1f} ({d['op_build_s']:.1f} building)", _bound(d), f"{d['layer_plan_s']:.1f}"]
    return row


def _bound(d: dict) -> str:
    """The op plan's proven-gap cell: exact, or what stopped the search (counts)."""
    if not d["op_bound"]:
        return f"exact, gap 0 ({d['op_kinds']} layer kinds)"
    parts = [f"{d['op_kinds']} layer kinds"]
    if d["op_points_calibrated"] < d["op_points"]:
        parts.append(f"{d['op_points_calibrated']} of {d['op_points']} trade-off points calibrated (time cap)")
    if d["op_fronts_cut"]:
        parts.append(f"{d['op_fronts_cut']} fronts cut by their time bound")
    if d["op_gap_cost"]:
        parts.append(f"HiGHS gap {d['op_gap_cost']} cost units")
    return "bounded: " + ", ".join(parts)


HEADER = ["model", "source", "traced / refused", "stacks (path:L)", "schedules", "predicted == measured",
          "gradients", "s"]
PLAN_HEADER = ["layer least feasible vs best Megatron KiB", "op least / unconstrained KiB",
               "op plan: budget: predicted / measured KiB", "op plan s", "op proven gap / bound", "layer plan s"]


def summary(results: list[dict]) -> str:
    """One paragraph: models traced, exact rows, gradients, refusals with their error
    class, and (with the plan columns) the op-level plans' fit and times."""
    traced = [d for d in results if d["status"] == "traced"]
    rows = [r for d in traced for r in d["rows"]]
    lines = [f"{len(traced)} of {len(results)} models traced; {sum(exact_rows(d['rows']) for d in traced)} of "
             f"{len(rows)} rows predicted == measured to the byte; gradients: {_grads(rows) if rows else '-'}."]
    for d in results:
        if d["status"] != "traced":
            lines.append(f"{d['status']}: {d['model']} ({d['reason'].split(':')[0]}).")
    planned = [d for d in traced if "op_plan_s" in d]
    if planned:
        fits = sum(d["op_measured_bytes"] is not None and d["op_measured_bytes"] <= d["op_budget_bytes"]
                   for d in planned)
        exact = sum(d["op_measured_bytes"] == d["op_predicted_bytes"] for d in planned)
        below = [d["model"] for d in planned if d["layer_least_feasible_bytes"] < d["best_megatron_predicted_bytes"]]
        slow = [f"{d['model']} {d['op_plan_s']:.0f} s" for d in planned if d["op_plan_s"] > 30]
        times = sorted(d["op_plan_s"] for d in planned)
        lines.append(
            f"Op-level plans: measured peak within the budget {fits}/{len(planned)}, predicted == measured "
            f"{exact}/{len(planned)}; plan time median {times[len(times) // 2]:.1f} s, most {times[-1]:.1f} s; "
            f"over 30 s: {', '.join(slow) or 'none'}; bounded (not proven optimal): "
            f"{sum(bool(d['op_bound']) for d in planned)}/{len(planned)}. Layer-level least feasible below the best "
            f"Megatron setting: {', '.join(below) or 'none'}; op-level least feasible below the layer level's: "
            f"{sum(d['op_least_feasible_bytes'] < d['layer_least_feasible_bytes'] for d in planned)}/{len(planned)}.")
    return " ".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help=f"comma-separated names (default: all): {','.join(MODELS)}")
    ap.add_argument("--plan", action="store_true", help="add the layer-level and op-level planner columns")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table (with host and command) to PATH")
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown or args.threads < 1:
        ap.error(f"unknown model(s) {unknown} (allowed: {', '.join(MODELS)})" if unknown
                 else f"--threads must be at least 1 (got {args.threads})")
    torch.set_num_threads(args.threads)
    results = []
    for name in names:
        results.append(model_row(name, args.plan))
        d = results[-1]
        print(f"{name}: {d['status']} {d['reason']} ({d['seconds']:.0f} s)", file=sys.stderr, flush=True)
    text = "\n".join([
        f"`python examples/foreign_models.py{' ' + ' '.join(argv if argv is not None else sys.argv[1:])}`",
        "", f"host: {platform.node()}, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()} ({sys.executable}), torch {torch.__version__}, {args.threads} thread(s), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        summary(results), "",
        markdown_table(HEADER + (PLAN_HEADER if args.plan else []), [table_row(d, args.plan) for d in results]), "",
        *[f"- {d['model']}: {d['note']}" for d in results if d["note"]]])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(f"# Foreign models\n\n{text}\n", encoding="utf-8")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"torch": torch.__version__, "threads": args.threads, "models": results}, fh, indent=1)
    traced = [d for d in results if d["status"] == "traced"]
    ok = all(exact_rows(d["rows"]) == len(d["rows"]) for d in traced) and not any(
        d["status"] == "error" for d in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
