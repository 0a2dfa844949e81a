"""The rq job a tool worker runs for each call (rq's JSON serializer carries its kwargs).

The job pushes its result onto the call's result list, where the rollout worker waits with
BLPOP on its event loop; rq's own result store is not used for the answer, so waiting for a
call costs no thread.
"""

from __future__ import annotations

import os
import time

import rq

from streamrl.names import Keys
from streamrl.tools.registry import run_call
from streamrl.tools.sandbox import SubprocessSandbox
from streamrl.wire import ToolResult, encode_body

RESULT_TTL_S = 120

JOB_PATH = "streamrl.tools.jobs.run_tool_call"


def run_tool_call(
    *,
    ns: str,
    call_id: str,
    name: str,
    arguments: str,
    time_limit_s: float,
    output_cap: int,
    deadline: float,
) -> dict[str, object]:
    """Run one tool call and publish its ToolResult; returns it as a dict for rq's record."""
    start = time.monotonic()
    worker = f"tools-{os.getpid()}"
    if time.time() > deadline:
        # The caller has given up on this attempt (and may have sent another): skip it.
        result = ToolResult(call_id=call_id, ok=False, output="", error="expired", worker=worker)
    else:
        out = run_call(SubprocessSandbox(), name, arguments, time_limit_s, output_cap)
        result = ToolResult(
            call_id=call_id,
            ok=out.ok,
            output=out.output,
            error=out.error,
            duration_s=time.monotonic() - start,
            worker=worker,
        )
    job = rq.get_current_job()
    if job is not None:
        key = Keys(ns).tool_result(call_id)
        pipe = job.connection.pipeline(transaction=True)
        pipe.lpush(key, encode_body(result))
        pipe.expire(key, RESULT_TTL_S)
        pipe.execute()
    return {"ok": result.ok, "error": result.error, "duration_s": result.duration_s}
