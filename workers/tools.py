"""Tool worker: an rq SimpleWorker (no fork per job: ~5 ms a job instead of ~27 ms) that
runs tool calls in the sandbox, and no other job (`streamrl.tools.rqguard`). rq handles
SIGTERM itself (finish the job, then exit); the sandbox (its warm containers) is closed on
the way out."""

from __future__ import annotations

from rq import Queue
from rq.serializers import JSONSerializer

from streamrl.obs.metrics import queue_depth
from streamrl.run.runtime import WorkerContext
from streamrl.tools.jobs import ToolRuntime, install, open_sandbox, uninstall
from streamrl.tools.registry import load_tools
from streamrl.tools.rqguard import ToolCallJob, ToolCallWorker

# rq's housekeeping (cleaning the jobs of dead workers) runs every 10 minutes by default;
# callers do not depend on it (they time out and resend), but keep the registries tidy.
MAINTENANCE_INTERVAL_S = 15


def run(ctx: WorkerContext) -> int:
    tools = load_tools(ctx.cfg.tools)  # the user's tools (tools.extra): a bad one stops here
    conn = ctx.client()
    queue = Queue(
        ctx.keys.tool_queue, connection=conn, serializer=JSONSerializer, job_class=ToolCallJob
    )
    worker = ToolCallWorker(
        [queue],
        connection=conn,
        serializer=JSONSerializer,
        name=ctx.consumer,
        maintenance_interval=MAINTENANCE_INTERVAL_S,
        # rq waits for a job worker_ttl - 15 s at a time: a turn, and a liveness tick, at
        # least four times per liveness limit
        worker_ttl=15 + max(1, int(ctx.cfg.run.liveness_timeout_s / 4)),
        log=ctx.log,
        liveness=ctx.liveness,
        # past this its caller has given up on it (and sent it again)
        call_limit_s=ctx.cfg.tools.time_limit_s + ctx.cfg.tools.result_margin_s,
    )
    ctx.metrics.probe(lambda: {queue_depth("tools"): queue.count})  # jobs not yet taken
    worker.take_over_name()  # a restarted container's predecessor: gone, name still held
    sandbox = open_sandbox(ctx.cfg.tools, ctx.keys.ns, ctx.consumer, ctx.log)
    install(ToolRuntime(sandbox, tools, ctx.tracer))
    ctx.log.info("tools_start", queue=queue.name, tools=sorted(tools))
    try:
        worker.work(burst=ctx.burst, logging_level="WARNING", with_scheduler=False)
    finally:
        uninstall()
    ctx.log.info("tools_stop")
    return 0
