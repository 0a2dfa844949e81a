"""Tool calls through real rq worker processes and a real Redis."""

import asyncio
import signal
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import structlog

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.obs import metrics as m
from streamrl.tools.client import ToolClient
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult, encode_body
from tests.helpers import spawn_worker, stop, wait_for_rq_worker

T = TypeVar("T")
FAST = ToolsConfig(time_limit_s=0.5, result_margin_s=0.5, retries=1)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _calls(
    url: str,
    keys: Keys,
    cfg: ToolsConfig,
    calls: list[tuple[str, str]],
    metrics: m.Metrics | None = None,
) -> list[ToolResult]:
    aclient = make_async_client(url)
    log = structlog.get_logger()
    client = ToolClient(make_client(url), aclient, keys, cfg, log, metrics)
    try:
        return list(
            await asyncio.gather(
                *(
                    client.call(name, args, f"c{i}-{time.monotonic_ns()}")
                    for i, (name, args) in enumerate(calls)
                )
            )
        )
    finally:
        await aclient.aclose()


def test_calls_and_bad_arguments(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path)
    metrics = m.Metrics("rollout-0")
    try:
        wait_for_rq_worker(rclient, keys.tool_queue)
        good, bad, unknown = run(
            _calls(
                redis_url,
                keys,
                ToolsConfig(),
                [
                    ("calculator", '{"expression": "37+58"}'),
                    ("calculator", '{"expression": '),
                    ("nope", "{}"),
                ],
                metrics,
            )
        )
        assert good.ok and good.output == "95"
        assert not bad.ok and bad.error.startswith("arguments are not valid JSON")
        assert not unknown.ok and "unknown tool" in unknown.error
        # The worker survived the bad input and keeps serving.
        [again] = run(
            _calls(redis_url, keys, ToolsConfig(), [("calculator", '{"expression": "6*7"}')])
        )
        assert again.output == "42"
        assert w.poll() is None
        stats = rclient.hgetall(keys.stats)
        assert stats[b"tool_calls"] == b"4" and stats[b"tool_errors"] == b"2"
        # The rollout side's counters: two of three calls failed, none ran out of time.
        s = metrics.sample()
        assert s[m.TOOL_ERROR_RATE] == pytest.approx(2 / 3) and s[m.TOOL_TIMEOUT_RATE] == 0
        assert 0 < s[m.TOOL_LATENCY_P50_S] <= s[m.TOOL_LATENCY_P99_S] < 30
    finally:
        assert stop(w) == 0
    # The tools worker's own series: its queue, sampled until it stopped.
    last = m.newest_sample(rclient, keys.worker_metrics("tools-0"))
    assert last[m.queue_depth("tools")] == 0 and last[m.RSS_MB] > 0


def test_killed_tool_worker_fails_fast_then_recovers(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path)
    wait_for_rq_worker(rclient, keys.tool_queue)
    w.send_signal(signal.SIGKILL)
    w.wait()
    start = time.monotonic()
    metrics = m.Metrics("rollout-0")
    [lost] = run(_calls(redis_url, keys, FAST, [("calculator", '{"expression": "1+1"}')], metrics))
    elapsed = time.monotonic() - start
    assert not lost.ok and "no tool worker answered" in lost.error
    assert metrics.sample()[m.TOOL_TIMEOUT_RATE] == 1.0
    # (time_limit 0.5 + margin 0.5) x 2 attempts: the agent hears within seconds, not minutes
    assert elapsed < 5
    w2 = spawn_worker("tools", redis_url, keys.ns, tmp_path, index=1)
    try:
        # The killed worker stays registered with rq until its TTL: wait for the new one.
        wait_for_rq_worker(rclient, keys.tool_queue, n=2)
        [ok] = run(_calls(redis_url, keys, FAST, [("calculator", '{"expression": "2+2"}')]))
        assert ok.ok and ok.output == "4"
    finally:
        stop(w2)


def test_a_stale_result_never_reaches_another_execution(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Review M3: a result left by an earlier execution of the same call (a rollout that
    died waiting, a resent attempt) is never popped by this one: each execution waits on
    result lists keyed by nonces of its own."""
    call_id = "g000000001-m0-0-0"  # deterministic: the same in every execution of a member
    stale = encode_body(ToolResult(call_id=call_id, ok=True, output="999"))
    old_key = f"{keys.prefix}toolres:{call_id}"  # as results were keyed before: call id alone
    other = keys.tool_result(call_id, uuid.uuid4().hex)  # another execution's attempt
    for key in (old_key, other):
        rclient.lpush(key, stale)
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path)
    try:
        wait_for_rq_worker(rclient, keys.tool_queue)

        async def call() -> ToolResult:
            aclient = make_async_client(redis_url)
            client = ToolClient(make_client(redis_url), aclient, keys, FAST, structlog.get_logger())
            try:
                return await client.call("calculator", '{"expression": "1+1"}', call_id)
            finally:
                await aclient.aclose()

        got = run(call())
        assert got.ok and got.output == "2"
        assert rclient.llen(old_key) == rclient.llen(other) == 1  # left for their own
    finally:
        assert stop(w) == 0
