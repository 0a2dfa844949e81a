"""No silent downgrade (review H3): on a host with no container engine and no bubblewrap,
`tools.sandbox = "auto"` refuses the tools that run policy-written code with an
infrastructure error that names the fix, and still runs the calculator; `subprocess` runs
everything only when a config says so, and says so as an error.

The bare host is simulated for real: DOCKER_HOST points at a socket that does not exist
and PATH holds only `prlimit` (no bwrap)."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import structlog

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult
from tests.helpers import REPO, spawn_worker, stop, wait_for_rq_worker

NO_ENGINE = "unix:///nonexistent/streamrl-podman.sock"


@pytest.fixture
def bare_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """This process's environment (and so its children's) as on a host with neither an
    engine nor bwrap; returns it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prlimit = shutil.which("prlimit")
    assert prlimit is not None
    (bin_dir / "prlimit").symlink_to(prlimit)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("DOCKER_HOST", NO_ENGINE)
    return dict(os.environ)


async def _call(url: str, keys: Keys, name: str, args: dict[str, str]) -> ToolResult:
    from streamrl.tools.client import ToolClient

    aclient = make_async_client(url)
    client = ToolClient(make_client(url), aclient, keys, ToolsConfig(), structlog.get_logger())
    try:
        return await client.call(name, json.dumps(args), f"c-{time.monotonic_ns()}")
    finally:
        await aclient.aclose()


def log_events(path: Path, name: str) -> list[dict[str, object]]:
    lines = path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x[:1] == "{") if e.get("event") == name]


def test_auto_on_a_bare_host_refuses_python_and_runs_the_calculator(
    bare_host: dict[str, str], redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path)  # tools.sandbox = "auto"
    try:
        wait_for_rq_worker(rclient, keys.tool_queue)
        python = asyncio.run(_call(redis_url, keys, "python", {"code": "print(1)"}))
        assert not python.ok and python.infra  # the episode ends as an error; breaker counts
        assert "tool `python` runs code the policy wrote" in python.error
        assert "make sandbox-host" in python.error and "bubblewrap" in python.error
        assert 'tools.sandbox = "subprocess"' in python.error
        calc = asyncio.run(_call(redis_url, keys, "calculator", {"expression": "6*7"}))
        assert calc.ok and calc.output == "42" and not calc.infra
        assert w.poll() is None
    finally:
        assert stop(w) == 0
    [unavailable] = log_events(tmp_path / "tools-0.log", "sandbox_unavailable")[:1]
    assert unavailable["level"] == "error"


def tools_exec(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "tools", "exec",
         "--config", "configs/tiny.toml", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_tools_exec_on_a_bare_host(bare_host: dict[str, str]) -> None:
    p = tools_exec(bare_host, "--tool", "python", "--args", '{"code": "print(1)"}')
    assert p.returncode == 3, p.stderr
    assert "streamrl tools exec: sandbox unavailable: tool `python` runs code" in p.stderr
    assert "make sandbox-host" in p.stderr and not p.stdout
    p = tools_exec(bare_host, "--tool", "calculator", "--args", '{"expression": "2**10"}')
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ok"] and out["output"] == "1024" and out["sandbox"] == "SubprocessSandbox"
    # Explicitly unisolated: it runs, and the log says so at error level.
    p = tools_exec(bare_host, "--set", "tools.sandbox=subprocess", "--tool", "python",
                   "--args", '{"code": "print(6*7)"}')  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["output"] == "exit status: 0\nstdout:\n42"
    logged = [json.loads(x) for x in p.stderr.splitlines() if x[:1] == "{"]
    [backend] = [e for e in logged if e.get("event") == "sandbox_backend"]
    assert backend["level"] == "error" and backend["kind"] == "subprocess"
