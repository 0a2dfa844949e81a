"""Grouper worker: assembles groups and computes advantages, and handles groups past
`grouper.group_timeout_s` by the configured policy; any number may run."""

from __future__ import annotations

from streamrl.grouper import Grouper
from streamrl.run.runtime import WorkerContext


def run(ctx: WorkerContext) -> int:
    grouper = Grouper(ctx.client(), ctx.keys, ctx.cfg, ctx.consumer, ctx.log, tracer=ctx.tracer)
    g = ctx.cfg.grouper
    ctx.log.info(
        "grouper_start",
        consumer=ctx.consumer,
        group_timeout_s=g.group_timeout_s,
        group_timeout_policy=g.group_timeout_policy if g.group_timeout_s else None,
    )
    ctx.metrics.probe(grouper.queue_probe)
    grouper.run(ctx.stop, burst=ctx.burst, liveness=ctx.liveness, metrics=ctx.metrics)
    ctx.log.info("grouper_stop")
    return 0
