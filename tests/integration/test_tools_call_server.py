"""A tool worker process whose container sandbox runs calls through each warm container's
call server (`tools.call_server = true`, issue 28): the built-in python and shell tools
answer through rq as on the exec path, and the worker's containers are gone when it stops."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import structlog

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.tools.client import ToolClient
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult
from tests.helpers import sandbox_engine, spawn_worker, stop, wait_for_rq_worker

pytestmark = pytest.mark.integration

CALLS = [
    ("python", {"code": "import os; print(sum(range(10)), os.getuid())"}),
    ("shell", {"command": "echo hi > f; cat f; pwd"}),
    ("shell", {"command": "ls -A"}),  # the file of the call before is gone
    ("python", {"code": "raise ValueError('boom')"}),
]


async def _calls(url: str, keys: Keys) -> list[ToolResult]:
    aclient = make_async_client(url)
    client = ToolClient(make_client(url), aclient, keys, ToolsConfig(), structlog.get_logger())
    try:
        return [
            await client.call(name, json.dumps(args), f"cs-{i}")
            for i, (name, args) in enumerate(CALLS)
        ]
    finally:
        await aclient.aclose()


def test_a_tool_worker_serves_calls_through_the_call_server(
    redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    engine = sandbox_engine(timeout_s=10)
    log = tmp_path / "tools.log"
    proc = spawn_worker(
        "tools", redis_url, keys.ns, tmp_path, 'tools.sandbox="container"',
        "tools.call_server=true", log_path=log,
    )  # fmt: skip
    try:
        wait_for_rq_worker(make_client(redis_url), keys.tool_queue, timeout_s=60)
        results = asyncio.run(_calls(redis_url, keys))
    finally:
        assert stop(proc) == 0
    py, shell, listing, boom = results
    assert py.ok and "45 20001" in py.output, py
    assert shell.ok and "hi\n/work" in shell.output, shell
    assert listing.ok and "hi" not in listing.output, listing
    # A failing program is the call's answer, not a tool error (as on the exec path).
    assert boom.ok and boom.output.startswith("exit status: 1"), boom
    assert "ValueError: boom" in boom.output
    events = [json.loads(x) for x in log.read_text().splitlines() if x[:1] == "{"]
    starts = [e for e in events if e.get("event") == "sandbox_container_start"]
    assert starts and all(e["call_server"] for e in starts)
    ns_label: dict[str, str | list[str] | bool] = {"label": f"streamrl.sandbox={keys.ns}"}
    try:
        assert engine.containers.list(all=True, filters=ns_label) == []
    finally:
        engine.close()
