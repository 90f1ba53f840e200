"""Rank functions for the Megatron-Core tensor-parallel tests (picklable, run by
``parallel.launch.run_ranks`` in spawned gloo processes): one TP rank's step under the
given schedules, predicted and measured on the real process group, and Megatron-Core's own recompute (the eager
program) predicted and measured there."""

from __future__ import annotations

from typing import Any

MEASUREMENTS = 2
"""Each row is measured this often on the real group and the least peak kept: gloo's
worker threads now and then allocate a buffer inside the profiled window (+256 B or
+16 KiB on one rank in about 1 row of 24, seen here); they only ever add bytes."""

SHAPE = dict(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256, dropout=0.1)


def schedules_of(layers: int) -> list[Any]:
    """The schedules the tests sweep: none, uniform K=1, block N=1."""
    from remat_pass.recompute import schedule

    return [schedule.none(layers), schedule.uniform(1, layers), schedule.block(1, layers)]


def tp_rank_step(rank: int, world: int, shape: dict) -> dict:
    """On a real group of ``world`` ranks (``world`` = the TP size): Megatron-Core's
    ``GPTModel`` shards of this rank, every schedule of ``schedules_of`` predicted and
    measured (bytes; the least of ``MEASUREMENTS`` runs) with its gradients compared bitwise to the un-rewritten step's, and
    the eager program under each (predicted, measured bytes)."""
    from remat_pass.evaluate.eager_program import eager_program
    from remat_pass.evaluate.session import Session
    from remat_pass.measure.run import grads_bitwise_equal, measure_step
    from remat_pass.models.megatron import megatron_gpt, teardown_megatron_cpu

    try:
        model, inputs, loss_fn = megatron_gpt(**shape, tensor_parallel=world)
        session = Session.create(model, inputs, loss_fn, calibration=None)
        rows = {}
        for s in schedules_of(shape["layers"]):
            # every rank runs the same collectives in the same order: no rank-dependent
            # re-runs (Session.evaluate re-runs the reference when gradients differ)
            step, report, _ = session.prepare(s)
            runs = [measure_step(step, session.joint, seed=session.seed) for _ in range(MEASUREMENTS)]
            rows[s.provenance] = (report.peak_bytes, min(m.peak_bytes for m in runs),
                                  all(grads_bitwise_equal(m.grads, session.reference_grads) for m in runs))
        eager = {}
        for s in schedules_of(shape["layers"]):  # Megatron-Core's own recompute, run eagerly
            runs = [eager_program(model, inputs, loss_fn, s, layers="decoder.layers") for _ in range(MEASUREMENTS)]
            eager[s.provenance] = (runs[0].predicted.peak_bytes, min(r.measured_peak_bytes for r in runs))
        return {"rows": rows, "eager": eager, "params": sum(p.numel() for p in model.parameters())}
    finally:
        teardown_megatron_cpu()
