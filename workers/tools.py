"""Tool worker: an rq SimpleWorker (no fork per job: ~5 ms a job instead of ~27 ms) that
runs tool calls in the sandbox. rq handles SIGTERM itself (finish the job, then exit)."""

from __future__ import annotations

from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from streamrl.runtime import WorkerContext

# rq's housekeeping (cleaning the jobs of dead workers) runs every 10 minutes by default;
# callers do not depend on it (they time out and resend), but keep the registries tidy.
MAINTENANCE_INTERVAL_S = 15


def run(ctx: WorkerContext) -> int:
    conn = ctx.client()
    queue = Queue(ctx.keys.tool_queue, connection=conn, serializer=JSONSerializer)
    worker = SimpleWorker(
        [queue],
        connection=conn,
        serializer=JSONSerializer,
        name=ctx.consumer,
        maintenance_interval=MAINTENANCE_INTERVAL_S,
    )
    ctx.log.info("tools_start", queue=queue.name)
    worker.work(burst=ctx.burst, logging_level="WARNING", with_scheduler=False)
    ctx.log.info("tools_stop")
    return 0
