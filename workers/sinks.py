"""Sinks worker: writes the run's figures (the trainer's metrics, the run's counters, the
held-out evaluations) to TensorBoard and W&B (`logging.sinks`; `streamrl.obs.sinks`). One
per run; `streamrl up` starts it when a sink is configured."""

from __future__ import annotations

from streamrl.obs.sink_backends import make_sinks
from streamrl.obs.sinks import Exporter
from streamrl.run.runtime import WorkerContext


def run(ctx: WorkerContext) -> int:
    lc = ctx.cfg.logging
    if not lc.sinks:
        ctx.log.info("sinks_none", reason="logging.sinks is empty")
        return 0
    exporter = Exporter(
        ctx.client(), ctx.keys, ctx.cfg, ctx.run_dir, make_sinks(ctx.cfg, ctx.run_dir), ctx.log
    )
    ctx.log.info("sinks_start", sinks=list(lc.sinks), interval_s=lc.interval_s)
    exporter.run(ctx.stop, ctx.liveness, lc.interval_s)
    ctx.log.info("sinks_stop", unreadable=exporter.unreadable)
    return 0
