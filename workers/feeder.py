"""Feeder worker: streams the task's prompts into `tasks`, one group id per prompt."""

from __future__ import annotations

from streamrl.feeder import Feeder
from streamrl.run.runtime import WorkerContext


def run(ctx: WorkerContext) -> int:
    feeder = Feeder(ctx.client(), ctx.keys, ctx.cfg, ctx.log, run_id=ctx.run_id)
    ctx.metrics.probe(feeder.queue_probe)
    feeder.run(
        ctx.stop, burst=ctx.burst, liveness=ctx.liveness
    )  # burst: fill the backlog once, then exit
    return 0
