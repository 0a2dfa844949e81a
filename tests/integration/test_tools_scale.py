"""Scaling the tool workers spreads the calls: one worker runs its calls one after another,
three run three at once (issue 13: 3 tool workers serve calls that 1 cannot keep up with).

Each call records, inside its own process, when it started and ended; what is asserted is
how many calls overlapped and which workers served them, never how long anything took."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import structlog

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.tools.client import ToolClient
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult
from tests.helpers import spawn_worker, stop, wait_for_rq_worker

# python needs isolation; the plain backend, named explicitly, keeps this test off the engine
# (what is measured is rq's spread of the calls over workers, not the sandbox).
SUBPROCESS = 'tools.sandbox="subprocess"'
CALLS = 6
# Room for a call that waits in the queue behind five others on the one worker.
WAIT = ToolsConfig(time_limit_s=10.0, result_margin_s=10.0)
WINDOW = "import time, json; t = time.time(); time.sleep(1.0); print(json.dumps([t, time.time()]))"


async def calls(url: str, keys: Keys, n: int) -> list[ToolResult]:
    aclient = make_async_client(url)  # the rollout worker's client: timeouts fit BLPOP
    client = ToolClient(make_client(url), aclient, keys, WAIT, structlog.get_logger())
    try:
        args = json.dumps({"code": WINDOW})
        tag = time.monotonic_ns()
        return await asyncio.gather(*(client.call("python", args, f"w{tag}-{i}") for i in range(n)))
    finally:
        await aclient.aclose()


def max_overlap(results: list[ToolResult]) -> int:
    """The most calls whose [start, end] windows held one instant."""
    windows = []
    for r in results:
        assert r.ok, r
        out = r.output.split("stdout:\n", 1)[1]
        windows.append(json.loads(out))
    events = sorted([(s, 1) for s, _ in windows] + [(e, -1) for _, e in windows])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def serve(redis_url: str, keys: Keys, tmp_path: Path, workers: int) -> tuple[int, set[str]]:
    procs = [
        spawn_worker("tools", redis_url, keys.ns, tmp_path, SUBPROCESS, index=i)
        for i in range(workers)
    ]
    try:
        wait_for_rq_worker(make_client(redis_url), keys.tool_queue, n=workers)
        results = asyncio.run(calls(redis_url, keys, CALLS))
    finally:
        for p in procs:
            assert stop(p) == 0
    return max_overlap(results), {r.worker for r in results}


def test_three_tool_workers_serve_three_calls_at_once(
    redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    overlap, served_by = serve(redis_url, keys, tmp_path / "one", 1)
    assert overlap == 1 and len(served_by) == 1  # one worker: the calls queue behind each other
    overlap, served_by = serve(redis_url, Keys(f"{keys.ns}-3"), tmp_path / "three", 3)
    assert overlap == 3 and len(served_by) == 3  # three: three at a time, each serving
