"""Tool-call deadlines are on the Redis clock (review N7): a tool host whose wall clock runs
ahead of the rollout host's still answers the calls it takes in time."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from collections.abc import Iterator

import pytest
import redis
import structlog
from rq import Queue
from rq.serializers import JSONSerializer

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.tools import jobs
from streamrl.tools.backends import WorkerSandbox, builder
from streamrl.tools.client import ToolClient
from streamrl.tools.registry import TOOLS
from streamrl.tools.rqguard import ToolCallJob, ToolCallWorker
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult

SKEW_S = 30.0


@pytest.fixture
def runtime() -> Iterator[None]:
    log = structlog.get_logger()
    jobs.uninstall()
    # the plain subprocess sandbox: the calculator needs no isolation
    sandbox = WorkerSandbox("subprocess", builder(log=log), log)
    jobs.install(jobs.ToolRuntime(sandbox, {"calculator": TOOLS["calculator"]}))
    yield
    jobs.uninstall()


def _skewed(offset_s: float) -> types.SimpleNamespace:
    """The `time` module as a host whose wall clock is `offset_s` ahead sees it."""
    return types.SimpleNamespace(
        time=lambda: time.time() + offset_s,
        time_ns=lambda: time.time_ns() + int(offset_s * 1e9),
        monotonic=time.monotonic,
        monotonic_ns=time.monotonic_ns,
        sleep=time.sleep,
    )


def test_a_tool_host_clock_ahead_still_answers(
    redis_url: str, rclient: redis.Redis, keys: Keys, runtime: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    results: list[ToolResult] = []

    def rollout_side() -> None:
        async def go() -> None:
            aclient = make_async_client(redis_url)
            cfg = ToolsConfig(time_limit_s=2.0, result_margin_s=3.0, retries=0)
            client = ToolClient(make_client(redis_url), aclient, keys, cfg, structlog.get_logger())
            try:
                results.append(await client.call("calculator", '{"expression": "6*7"}', "c0"))
            finally:
                await aclient.aclose()

        asyncio.run(go())

    caller = threading.Thread(target=rollout_side)
    caller.start()
    queue = Queue(
        keys.tool_queue, connection=rclient, serializer=JSONSerializer, job_class=ToolCallJob
    )
    waited = time.monotonic() + 10
    while queue.count == 0:
        assert time.monotonic() < waited, "the call was never enqueued"
        time.sleep(0.01)
    # The tool host's wall clock runs SKEW_S ahead (more than the call's whole budget of 5 s).
    monkeypatch.setattr(jobs, "time", _skewed(SKEW_S))
    worker = ToolCallWorker(
        [queue], connection=rclient, serializer=JSONSerializer, log=structlog.get_logger()
    )
    worker.work(burst=True)
    caller.join(timeout=20)
    assert not caller.is_alive()
    [result] = results
    assert (result.ok, result.output, result.error) == (True, "42", "")
