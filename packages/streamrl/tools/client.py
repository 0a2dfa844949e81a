"""The rollout side of a tool call: enqueue on rq, await the result without a thread.

A call that gets no result within `time_limit_s + result_margin_s` (its tool worker was
killed, say) is sent again up to `retries` times, then reported to the agent as a tool
error. rq itself would notice a killed worker's job only at its next maintenance pass.

Each attempt's result comes back on a list of its own, keyed by the call id and a nonce this
execution draws (`Keys.tool_result`); an execution waits on its own attempts' lists only, so
a result left by another execution of the call (a replayed episode has the same call ids)
never reaches it, while a slow earlier attempt of its own still may answer.

A call to a tool named in `tools.non_idempotent` carries its idempotency key (call id plus a
hash of name and arguments); the tool worker runs it once per key (`streamrl.tools.ledger`),
so neither a resend nor a replayed episode repeats its side effect.

Traced on the call's track ("call", call_id): `tool.wait`, the whole call (a free slot of
`max_parallel_calls`, every attempt, the result), and each attempt's `tool.enqueue`. The
job carries its enqueue time on the Redis clock (`Tracer.shared_ns`): the tools worker's
`tool.queue` starts there.

An attempt's deadline is written on the Redis clock too (this host's offset to it measured
once, at start), and the tool worker compares it with Redis TIME: a tool host whose wall
clock runs ahead or behind neither expires live calls nor cuts their queueing budget.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid

import redis
import redis.asyncio as aioredis
import structlog
from rq import Queue
from rq.serializers import JSONSerializer

from streamrl import counters
from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.obs.metrics import TOOL_ERROR, TOOL_LATENCY_S, TOOL_TIMEOUT, Metrics
from streamrl.obs.tracing import Span, Tracer, clock_offset_ns
from streamrl.tools import JOB_PATH
from streamrl.tools.ledger import ledger_key
from streamrl.tools.registry import TIMED_OUT
from streamrl.transport import RQ_NEEDS_ONE_REDIS, is_cluster
from streamrl.wire import ToolResult, WireError, decode_body

_JOB_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
NO_ANSWER = "no tool worker answered within"  # a lost call's error starts so


def timed_out(result: ToolResult) -> bool:
    """Whether a call ran out of time: past its time limit in the sandbox, or no tool
    worker answered it in time."""
    return result.error.startswith((TIMED_OUT, NO_ANSWER))


class ToolClient:
    """Sends tool calls to the tool workers of one run."""

    def __init__(
        self,
        client: redis.Redis,
        aclient: aioredis.Redis,
        keys: Keys,
        cfg: ToolsConfig,
        log: structlog.stdlib.BoundLogger,
        metrics: Metrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.keys = keys
        self.tracer = tracer or Tracer.disabled()
        self.cfg = cfg
        self.aclient = aclient
        self.log = log
        self.queue = Queue(keys.tool_queue, connection=client, serializer=JSONSerializer)
        # Built by every rollout worker, tools or not: a cluster is refused at the first call.
        self._on_cluster = is_cluster(client)
        self._slots = asyncio.Semaphore(cfg.max_parallel_calls)
        self.metrics = metrics
        # A call's deadline is written on the Redis clock, which the tool host reads too:
        # two hosts' wall clocks are never compared (review N7).
        self._offset_ns = clock_offset_ns(client)[0]

    def _count(self, result: ToolResult, latency_s: float) -> None:
        """A call's latency (queueing here, on rq and in the sandbox), error and timeout,
        as the windowed series of `streamrl.obs.metrics`."""
        if self.metrics is None:
            return
        self.metrics.observe(TOOL_LATENCY_S, latency_s)
        self.metrics.observe(TOOL_ERROR, float(not result.ok))
        self.metrics.observe(TOOL_TIMEOUT, float(timed_out(result)))

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        """Run one call; infrastructure failures come back as a ToolResult error."""
        if self._on_cluster:
            raise RuntimeError(RQ_NEEDS_ONE_REDIS)
        start, start_ns = time.monotonic(), time.time_ns()
        track = self.tracer.track("call", call_id)
        async with self._slots:
            result = await self._call(name, arguments, call_id, track)
        self.tracer.span(track, Span.TOOL_WAIT, start_ns, time.time_ns())
        self._count(result, time.monotonic() - start)
        pipe = self.aclient.pipeline(transaction=False)
        pipe.hincrby(self.keys.stats, counters.TOOL_CALLS, 1)
        if not result.ok:
            pipe.hincrby(self.keys.stats, counters.TOOL_ERRORS, 1)
        if result.infra:
            pipe.hincrby(self.keys.stats, counters.TOOL_INFRA_ERRORS, 1)
        if result.ledger_hit:
            pipe.hincrby(self.keys.stats, counters.TOOL_LEDGER_HITS, 1)
        await pipe.execute()
        return result

    async def _call(self, name: str, arguments: str, call_id: str, track: int) -> ToolResult:
        wait_s = self.cfg.time_limit_s + self.cfg.result_margin_s
        start = time.monotonic()
        key = ledger_key(call_id, name, arguments) if name in self.cfg.non_idempotent else ""
        results: list[str] = []  # this execution's result lists, one per attempt
        for attempt in range(self.cfg.retries + 1):
            nonce = uuid.uuid4().hex
            results.append(self.keys.tool_result(call_id, nonce))
            enqueue_ns = time.time_ns()
            await asyncio.to_thread(
                self._enqueue, name, arguments, call_id, nonce, attempt, wait_s, key
            )
            self.tracer.span(track, Span.TOOL_ENQUEUE, enqueue_ns, time.time_ns())
            got = await self.aclient.blpop(results, timeout=wait_s)
            if got is not None:
                data = got[1] if isinstance(got[1], bytes) else str(got[1]).encode()
                try:
                    return decode_body(data, ToolResult)
                except WireError as err:
                    return ToolResult(call_id=call_id, ok=False, output="", error=str(err))
            self.log.warning("tool_call_lost", call_id=call_id, attempt=attempt, wait_s=wait_s)
        return ToolResult(
            call_id=call_id,
            ok=False,
            output="",
            error=(
                f"{NO_ANSWER} {wait_s:g}s, {self.cfg.retries + 1} attempts "
                "(tool infrastructure error)"
            ),
            duration_s=time.monotonic() - start,
            infra=True,
        )

    def _enqueue(
        self,
        name: str,
        arguments: str,
        call_id: str,
        nonce: str,
        attempt: int,
        wait_s: float,
        key: str,
    ) -> None:
        self.queue.enqueue_call(
            JOB_PATH,
            kwargs={
                "ns": self.keys.ns,
                "call_id": call_id,
                "nonce": nonce,  # the attempt's result list
                "name": name,
                "arguments": arguments,
                "time_limit_s": self.cfg.time_limit_s,
                "output_cap": self.cfg.output_cap_bytes,
                # on the Redis clock (seconds): the tool host compares it with Redis TIME
                "deadline": (time.time_ns() + self._offset_ns) / 1e9 + wait_s,
                "ledger_key": key,  # "": the tool is idempotent, run every call
                "enqueued_ns": self.tracer.shared_ns(time.time_ns()),  # on the Redis clock
            },
            # One job per attempt of one execution: two executions of a call at once (a
            # re-run while the first is alive) must not overwrite each other's job and nonce.
            job_id=_JOB_ID_UNSAFE.sub("_", f"{self.keys.ns}-{call_id}-a{attempt}-{nonce}"),
            timeout=math.ceil(self.cfg.time_limit_s) + 5,
            ttl=math.ceil(wait_s) + 1,
            result_ttl=60,
            failure_ttl=600,
        )
