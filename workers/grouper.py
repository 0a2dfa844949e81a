"""Grouper worker: assembles groups and computes advantages; any number may run."""

from __future__ import annotations

from streamrl.grouper import Grouper
from streamrl.runtime import WorkerContext


def run(ctx: WorkerContext) -> int:
    grouper = Grouper(ctx.client(), ctx.keys, ctx.cfg, ctx.consumer, ctx.log)
    ctx.log.info("grouper_start", consumer=ctx.consumer)
    grouper.run(ctx.stop, burst=ctx.burst)
    ctx.log.info("grouper_stop")
    return 0
