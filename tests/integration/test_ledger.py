"""Side effects once: non-idempotent tool calls through the tool ledger, on a real Redis.

A replayed episode makes the same calls under the same call ids; a tool with side effects
(here: one that appends a line to a file) must not run twice for one idempotency key.
"""

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from msgspec.structs import replace

from streamrl.agents.base import Action, ToolInfraError
from streamrl.agents.envs import ToolEnvironment, ToolLimits, ToolRecord
from streamrl.agents.tools import CallContext, FunctionTool, Tool, ToolOutput
from streamrl.chat.transcript import ToolCall
from streamrl.config import ToolsConfig
from streamrl.jsontypes import JSONObject
from streamrl.names import Keys
from streamrl.tools.client import ToolClient
from streamrl.tools.ledger import AsyncToolLedger, ToolLedger, ledger_key
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult
from tests.helpers import spawn_worker, stop, wait_for_rq_worker

TEXT: JSONObject = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}
PREFIX = "g1-m0-2"  # what the episode runner passes: <traj_id>-<turn>


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def hits(rclient: redis.Redis, keys: Keys) -> int:
    return int(rclient.hget(keys.stats, "tool_ledger_hits") or 0)


async def no_reward(answer: str | None, calls: list[ToolRecord], ctx: CallContext) -> float:
    return 0.0


def appender(path: Path, *, idempotent: bool, delay_s: float = 0.0) -> FunctionTool:
    """A tool with a visible side effect: each run appends a line; returns the line count."""

    def append(text: str) -> str:
        with path.open("a") as f:
            f.write(text + "\n")
        time.sleep(delay_s)
        return f"{text}: run {lines(path)}"

    return FunctionTool("append", "append a line", TEXT, append, idempotent=idempotent)


async def step(
    url: str, keys: Keys, tool: Tool, text: str = "hi", wait_s: float = 30.0
) -> list[str]:
    """One turn of a fresh environment (a replay builds a fresh one) that calls `tool`."""
    aclient = make_async_client(url)
    try:
        ledger = AsyncToolLedger(aclient, keys, structlog.get_logger(), wait_s=wait_s)
        env = ToolEnvironment("p", [tool], no_reward, ToolLimits(), ledger=ledger)
        action = Action("t", calls=[ToolCall(tool.name, json.dumps({"text": text}))])
        return (await env.step(action, PREFIX)).observations
    finally:
        await aclient.aclose()


def test_in_process_tool_runs_once_per_key(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    tool = appender(effects, idempotent=False)
    first = asyncio.run(step(redis_url, keys, tool))
    replay = asyncio.run(step(redis_url, keys, tool))
    assert lines(effects) == 1
    assert first == replay == ["hi: run 1"]
    assert hits(rclient, keys) == 1
    # A replay that makes another call at the same place is another key: it runs.
    assert asyncio.run(step(redis_url, keys, tool, text="ho")) == ["ho: run 2"]
    assert hits(rclient, keys) == 1


def test_idempotent_tool_runs_every_time(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    tool = appender(effects, idempotent=True)
    assert asyncio.run(step(redis_url, keys, tool)) == ["hi: run 1"]
    assert asyncio.run(step(redis_url, keys, tool)) == ["hi: run 2"]
    assert hits(rclient, keys) == 0
    assert rclient.hlen(keys.tool_ledger) == 0


class FlakyAppend(Tool):
    """Non-idempotent; its first call fails in the infrastructure, before any effect."""

    name, description, parameters = "append", "append a line", TEXT
    idempotent = False

    def __init__(self, path: Path) -> None:
        self.path, self.calls = path, 0

    async def apply_async(self, args: dict[str, Any], ctx: CallContext) -> ToolOutput:
        self.calls += 1
        if self.calls == 1:
            raise ToolInfraError("service unreachable")
        with self.path.open("a") as f:
            f.write(f"{args['text']}\n")
        return ToolOutput(True, f"run {lines(self.path)}")


def test_infra_error_is_not_recorded(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    tool = FlakyAppend(effects)
    with pytest.raises(ToolInfraError):
        asyncio.run(step(redis_url, keys, tool))
    assert rclient.hlen(keys.tool_ledger) == 0
    assert rclient.keys(keys.tool_ledger_claim("*")) == []  # the claim went with it
    # The retry runs the call (it never ran); the replay after that is a hit.
    assert asyncio.run(step(redis_url, keys, tool)) == ["run 1"]
    assert asyncio.run(step(redis_url, keys, tool)) == ["run 1"]
    assert tool.calls == 2 and lines(effects) == 1 and hits(rclient, keys) == 1


def test_blocking_ledger_records_results_not_infra_errors(rclient: redis.Redis, keys: Keys) -> None:
    ledger = ToolLedger(rclient, keys, structlog.get_logger(), claim_ttl_s=10, wait_s=1)
    key = ledger_key("c-0", "shell", "{}")
    runs: list[ToolResult] = []

    def run(infra: bool) -> ToolResult:
        runs.append(ToolResult(call_id="c-0", ok=False, output="", error="e", infra=infra))
        return runs[-1]

    assert ledger.run_once(key, "c-0", lambda: run(True)).infra
    assert ledger.recorded(key) is None
    tool_error = ledger.run_once(key, "c-0", lambda: run(False))
    hit = ledger.run_once(key, "c-0", lambda: run(False))
    assert hit == replace(tool_error, ledger_hit=True) and tool_error == ledger.recorded(key)
    # a tool worker's ledger counts nothing (it may write no stats): the rollout that gets
    # the result marked `ledger_hit` does (test_sandbox_call_runs_once_per_key)
    assert len(runs) == 2 and hits(rclient, keys) == 0
    assert not ledger.record(key, ToolResult(call_id="c-0", ok=True, output="x"))  # first stays


def test_concurrent_in_process_calls_run_once(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Two rollout workers replaying one episode at the same time: one runs, one waits."""
    effects = tmp_path / "effects"
    tool = appender(effects, idempotent=False, delay_s=0.3)

    async def both() -> list[list[str]]:
        return list(await asyncio.gather(step(redis_url, keys, tool), step(redis_url, keys, tool)))

    assert asyncio.run(both()) == [["hi: run 1"], ["hi: run 1"]]
    assert lines(effects) == 1 and hits(rclient, keys) == 1


def test_waiting_for_a_running_call_is_bounded(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    effects = tmp_path / "effects"
    tool = appender(effects, idempotent=False, delay_s=1.0)

    async def both() -> list[list[str]]:
        slow = asyncio.create_task(step(redis_url, keys, tool))
        deadline = time.monotonic() + 30
        while not effects.exists():  # until the first holds the claim and runs the tool
            assert time.monotonic() < deadline and not slow.done()
            await asyncio.sleep(0.01)
        impatient = await step(redis_url, keys, tool, wait_s=0.2)
        return [await slow, impatient]

    ran, waited = asyncio.run(both())
    assert ran == ["hi: run 1"] and lines(effects) == 1
    assert waited[0].startswith("error: this call (idempotency key g1-m0-2-0#")
    assert "already running elsewhere" in waited[0]


# The sandbox path: a real tool worker process, the plain subprocess sandbox (so the shell
# command can leave its mark in the test's directory).
SUBPROCESS = 'tools.sandbox="subprocess"'
ONCE = ToolsConfig(non_idempotent=["shell"])


async def shell(url: str, keys: Keys, cfg: ToolsConfig, command: str, call_id: str) -> ToolResult:
    aclient = make_async_client(url)
    client = ToolClient(make_client(url), aclient, keys, cfg, structlog.get_logger())
    try:
        return await client.call("shell", json.dumps({"command": command}), call_id)
    finally:
        await aclient.aclose()


def test_sandbox_call_runs_once_per_key(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    command = f"echo ran >> {effects}; wc -l < {effects}"
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path, SUBPROCESS)
    try:
        wait_for_rq_worker(rclient, keys.tool_queue)
        first = asyncio.run(shell(redis_url, keys, ONCE, command, "g1-m0-2-0"))
        replay = asyncio.run(shell(redis_url, keys, ONCE, command, "g1-m0-2-0"))
        assert first.ok and first.output.endswith("stdout:\n1")
        # the recorded result itself: same output, worker, duration; marked a hit
        assert replay == replace(first, ledger_hit=True) and not first.ledger_hit
        assert lines(effects) == 1 and hits(rclient, keys) == 1
        # The same calls to a tool not in tools.non_idempotent run every time.
        plain = asyncio.run(shell(redis_url, keys, ToolsConfig(), command, "g1-m0-2-0"))
        again = asyncio.run(shell(redis_url, keys, ToolsConfig(), command, "g1-m0-2-0"))
        assert plain.output.endswith("stdout:\n2") and again.output.endswith("stdout:\n3")
        assert hits(rclient, keys) == 1
    finally:
        assert stop(w) == 0


def test_concurrent_sandbox_calls_run_once(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    command = f"echo ran >> {effects}; sleep 0.5; wc -l < {effects}"
    workers = [
        spawn_worker("tools", redis_url, keys.ns, tmp_path, SUBPROCESS, index=i) for i in (0, 1)
    ]
    try:
        wait_for_rq_worker(rclient, keys.tool_queue, n=2)

        async def both() -> list[ToolResult]:
            calls = [shell(redis_url, keys, ONCE, command, "g1-m0-2-0") for _ in range(2)]
            return list(await asyncio.gather(*calls))

        a, b = asyncio.run(both())
        assert a.ok and a.output.endswith("stdout:\n1") and a.ledger_hit != b.ledger_hit
        assert replace(a, ledger_hit=False) == replace(b, ledger_hit=False)
        assert lines(effects) == 1 and hits(rclient, keys) == 1
    finally:
        assert [stop(w) for w in workers] == [0, 0]


def test_two_executions_of_one_call_queued_together_are_both_answered(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Two executions of one call (a re-run while the first is alive) queued before any tool
    worker takes them: each attempt is its own rq job, so neither overwrites the other's
    (and its result list); the ledger runs the side effect once and both get its result."""
    effects = tmp_path / "effects"
    command = f"echo ran >> {effects}; wc -l < {effects}"
    cfg = ToolsConfig(non_idempotent=["shell"], time_limit_s=5.0, result_margin_s=10.0)

    async def both() -> list[ToolResult]:
        calls = [asyncio.create_task(shell(redis_url, keys, cfg, command, "g1-m0-2-0"))
                 for _ in range(2)]  # fmt: skip
        while rclient.llen(f"rq:queue:{keys.tool_queue}") < 2:  # both queued, none taken
            await asyncio.sleep(0.05)
        worker = spawn_worker("tools", redis_url, keys.ns, tmp_path, SUBPROCESS)
        try:
            return list(await asyncio.gather(*calls))
        finally:
            assert stop(worker) == 0

    a, b = asyncio.run(both())
    assert a.ok and a.output.endswith("stdout:\n1"), (a, b)
    assert replace(a, ledger_hit=False) == replace(b, ledger_hit=False)  # one ran, one hit
    assert lines(effects) == 1 and a.ledger_hit != b.ledger_hit and hits(rclient, keys) == 1
