"""The rq job a tool worker runs for each call (rq's JSON serializer carries its kwargs).

The job pushes its result onto the result list of its attempt (the call id and the
caller's nonce), where the rollout worker waits with
BLPOP on its event loop; rq's own result store is not used for the answer, so waiting for a
call costs no thread.

A tool worker process holds one `ToolRuntime` for all its jobs (`install` at start,
`uninstall` at exit): its sandbox (the container backend's warm pool lives across calls),
its tools and its tracer. A job run in a process where none is installed fails as an
infrastructure error saying so; nothing is built behind the caller's back. A
failure of the sandbox itself (engine down, image missing, an API error, no isolating
sandbox for a tool that needs one) comes back as a ToolResult with `infra` set: the rollout
side ends that episode with status error and counts it for its circuit breaker.

A call with a `ledger_key` (a tool in `tools.non_idempotent`) runs at most once per key: a
replay gets the result recorded in the run's tool ledger (`streamrl.tools.ledger`).

With the worker's tracer installed, each call adds two spans on its track
("call", call_id): `tool.queue`, from its enqueue (the time the caller put in the job, on
the Redis clock) to the job's start here, and `tool.exec`, the call run (ledger and
sandbox) up to its result's publication.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import rq
import structlog

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.obs.tracing import Span, Tracer, server_time_ns
from streamrl.tools.backends import WorkerSandbox, builder
from streamrl.tools.bwrap import BubblewrapConfig
from streamrl.tools.containers import ContainerConfig
from streamrl.tools.ledger import ToolLedger
from streamrl.tools.registry import TOOLS, Outcome, Tool, run_call
from streamrl.tools.sandbox import SandboxUnavailableError
from streamrl.wire import ToolResult, encode_body

RESULT_TTL_S = 120
# A ledger claim outlives rq's job timeout (time limit + 5 s, set by the client), so only a
# worker that died hard leaves a claim behind for its TTL to clear.
CLAIM_MARGIN_S = 10


@dataclass
class ToolRuntime:
    """What a tool worker process runs its calls with: the sandbox, the tools
    (`registry.load_tools`: built-in and tools.extra) and the tracer of its spans."""

    sandbox: WorkerSandbox
    tools: dict[str, Tool] = field(default_factory=lambda: dict(TOOLS))
    tracer: Tracer = field(default_factory=Tracer.disabled)


class NoToolRuntimeError(RuntimeError):
    pass


# rq calls a job as a plain function, so the process's runtime is its one piece of module
# state: set by `install`, cleared by `uninstall`, read by the job.
_installed: list[ToolRuntime] = []


def open_sandbox(
    cfg: ToolsConfig, namespace: str, worker_id: str, log: structlog.stdlib.BoundLogger
) -> WorkerSandbox:
    """The sandboxes `cfg.sandbox` names (auto: the strongest isolating one that works here,
    probed again while it is not the container; see `streamrl.tools.backends`)."""
    container = ContainerConfig(
        image=cfg.image,
        namespace=namespace,
        worker_id=worker_id,
        memory_bytes=cfg.memory_mb * 2**20,
        # each of /tmp and /work: 64 MiB, or a quarter of a smaller container's memory
        tmpfs_bytes=min(64 * 2**20, cfg.memory_mb * 2**20 // 4),
        pids_limit=cfg.pids_limit,
        cpus=cfg.cpus,
        pool_size=cfg.pool_size,
        max_containers=cfg.max_containers,
        max_starting=cfg.max_starting,
        recycle_after=cfg.recycle_after,
        call_server=cfg.call_server,
    )
    bwrap = BubblewrapConfig(
        max_processes=max(4, cfg.pids_limit),
        call_server=cfg.call_server,
        recycle_after=cfg.recycle_after,
    )
    return WorkerSandbox(cfg.sandbox, builder(container=container, bwrap=bwrap, log=log), log)


def install(runtime: ToolRuntime) -> None:
    """Run this process's calls with `runtime` (one at a time: `uninstall` first)."""
    if _installed:
        raise RuntimeError("a tool runtime is installed already in this process")
    _installed.append(runtime)


def uninstall() -> None:
    """Close the installed runtime's sandbox (its warm containers go) and forget it."""
    if _installed:
        _installed.pop().sandbox.close()


def installed() -> ToolRuntime:
    """The installed runtime; NoToolRuntimeError in a process that installed none."""
    if not _installed:
        raise NoToolRuntimeError(
            "no tool runtime in this process: tool calls run in a tool worker "
            "(`streamrl worker tools`) or the evaluator, which install one"
        )
    return _installed[0]


def _run(name: str, arguments: str, time_limit_s: float, output_cap: int) -> tuple[Outcome, bool]:
    """(outcome, infra): a sandbox failure is an infrastructure error, not a tool error."""
    try:
        rt = installed()
        return run_call(rt.sandbox, name, arguments, time_limit_s, output_cap, rt.tools), False
    except SandboxUnavailableError as err:
        return Outcome(False, "", f"sandbox unavailable: {err}"), True
    except Exception as err:
        structlog.get_logger().exception("sandbox_failed", tool=name)
        return Outcome(False, "", f"sandbox failed: {type(err).__name__}: {err}"), True


def execute_call(
    call_id: str, name: str, arguments: str, time_limit_s: float, output_cap: int, worker: str
) -> ToolResult:
    """One call with the installed runtime, as a tool worker's job runs it (no ledger, no
    result list): `streamrl eval` runs its tool calls so."""
    return _execute(call_id, name, arguments, time_limit_s, output_cap, worker)


def _execute(
    call_id: str, name: str, arguments: str, time_limit_s: float, output_cap: int, worker: str
) -> ToolResult:
    start = time.monotonic()
    out, infra = _run(name, arguments, time_limit_s, output_cap)
    return ToolResult(
        call_id=call_id,
        ok=out.ok,
        output=out.output,
        error=out.error,
        duration_s=time.monotonic() - start,
        worker=worker,
        infra=infra,
    )


def run_tool_call(
    *,
    ns: str,
    call_id: str,
    nonce: str,
    name: str,
    arguments: str,
    time_limit_s: float,
    output_cap: int,
    deadline: float,
    ledger_key: str = "",
    enqueued_ns: int = 0,
) -> dict[str, object]:
    """Run one call and publish its ToolResult; returns it as a dict for rq's record.

    With a `ledger_key` the call runs once per key (a job run outside a tool worker has no
    connection, so no ledger: it just runs). `deadline`: when the caller stops listening
    for this attempt, in seconds on the Redis clock. `enqueued_ns`: when the caller
    enqueued it, on the Redis clock (0: not said)."""
    tracer = _installed[0].tracer if _installed else None
    start_ns = time.time_ns()
    track = 0
    if tracer is not None and tracer.enabled:
        track = tracer.track("call", call_id)
        if enqueued_ns:
            queued_ns = min(tracer.local_ns(enqueued_ns), start_ns)
            tracer.span(track, Span.TOOL_QUEUE, queued_ns, start_ns)
    worker = f"tools-{os.getpid()}"
    job = rq.get_current_job()
    # The deadline is on the Redis clock (the caller's offset to it): so is `now`, from
    # the job's own connection; a job run without one has only this host's clock.
    now = server_time_ns(job.connection) / 1e9 if job is not None else time.time()
    if now > deadline:
        # The caller has given up on this attempt and sent another; it still listens on
        # this attempt's list, where an "expired" would end its call. Skip it.
        structlog.get_logger().warning("tool_call_expired", call_id=call_id, worker=worker)
        return {"ok": False, "error": "expired", "duration_s": 0.0}
    if ledger_key and job is not None:
        ledger = ToolLedger(
            job.connection,
            Keys(ns),
            structlog.get_logger().bind(worker=worker, run=ns, call_id=call_id),
            claim_ttl_s=math.ceil(time_limit_s) + CLAIM_MARGIN_S,
            wait_s=deadline - now,  # the caller stops listening then
        )
        result = ledger.run_once(
            ledger_key,
            call_id,
            lambda: _execute(call_id, name, arguments, time_limit_s, output_cap, worker),
        )
    else:
        result = _execute(call_id, name, arguments, time_limit_s, output_cap, worker)
    if tracer is not None:  # before the result is out: its caller's wait ends after this
        tracer.span(track, Span.TOOL_EXEC, start_ns, time.time_ns())
    if job is not None:
        key = Keys(ns).tool_result(call_id, nonce)
        pipe = job.connection.pipeline(transaction=True)
        pipe.lpush(key, encode_body(result))
        pipe.expire(key, RESULT_TTL_S)
        pipe.execute()
    return {"ok": result.ok, "error": result.error, "duration_s": result.duration_s}
