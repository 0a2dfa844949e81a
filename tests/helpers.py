"""Helpers that start real worker processes through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import docker
import pytest
import redis
from rq import Worker

from streamrl.names import Keys
from streamrl.run import incarnation
from streamrl.run.launcher import worker_command

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.toml"
# configs/tiny.toml evaluates held-out every few steps in a process of its own: the tests
# that launch a run and are not about evaluation leave it out (a later --set wins).
NO_EVALUATOR = "trainer.eval_every=0"


def model_cache_dir() -> Path | None:
    """The persistent model cache of this checkout (built-in checkpoints and warm starts),
    shared by every test session (the `warm_cache` fixture), or None when
    STREAMRL_TEST_MODEL_CACHE= (empty) turns it off. tests/compose seeds the stack's model
    volume from it."""
    path = os.environ.get("STREAMRL_TEST_MODEL_CACHE", str(REPO / "build" / "model-cache"))
    return Path(path).resolve() if path else None


def spawn_worker(
    name: str,
    redis_url: str,
    ns: str,
    run_dir: Path,
    *sets: str,
    burst: bool = False,
    index: int = 0,
    log_path: Path | None = None,
    config: Path = TINY,
) -> subprocess.Popen[bytes]:
    """`streamrl worker NAME` as a subprocess, logging to `log_path` (or run_dir/NAME.log).
    The run is created first, as `streamrl up` does (its id: a worker other than the
    trainer waits for it)."""
    with redis.Redis.from_url(redis_url) as client:
        incarnation.create(client, Keys(ns))
    cmd = worker_command(name, index, config, run_dir, [f"run.name={ns}", *sets])
    if burst:
        cmd.append("--burst")
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    with open(log_path or run_dir / f"{name}-{index}.log", "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def wait_for_rq_worker(client: redis.Redis, queue: str, n: int = 1, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = [w for w in Worker.all(connection=client) if queue in w.queue_names()]
        if len(workers) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"no rq worker on {queue} after {timeout_s}s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> int:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def live_in_group(pgid: int) -> list[int]:
    """Pids of processes in a process group that are not zombies (PID 1 here may be slow to
    reap what it inherits, and a zombie holds no resources)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(d))
    return pids


def queues_json(redis_url: str, keys: Keys) -> dict[str, Any]:
    """`streamrl queues --json` for the run `keys`, as an operator runs it."""
    p = subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "queues", "--config",
         "configs/tiny.toml", "--set", f"run.name={keys.ns}", "--json"],
        cwd=REPO, env={**os.environ, "REDIS_URL": redis_url}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def run_generate(*args: str) -> subprocess.CompletedProcess[str]:
    """`streamrl generate ARGS` as a subprocess, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "generate", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def sandbox_unavailable(why: str) -> NoReturn:
    """Skip a test that needs the container engine, saying why; fail it where the sandbox
    is required (STREAMRL_REQUIRE_SANDBOX=1: CI, and `make test` as root)."""
    if os.environ.get("STREAMRL_REQUIRE_SANDBOX") == "1":
        pytest.fail(f"STREAMRL_REQUIRE_SANDBOX=1 but {why}")
    pytest.skip(why)


def sandbox_engine(timeout_s: int = 30) -> docker.DockerClient:
    """A client of the real container engine at DOCKER_HOST, or `sandbox_unavailable`."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host.startswith("unix://"):
        sandbox_unavailable(
            f"DOCKER_HOST={host!r} is not a unix socket (run ops/sandbox/setup_host.sh and "
            "export it)"
        )
    try:
        client = docker.from_env(timeout=timeout_s)
        client.ping()
    except Exception as err:
        sandbox_unavailable(f"no container engine answers at DOCKER_HOST={host}: {err}")
    return client


def committed_trajectories(log: Path) -> list[dict[str, Any]]:
    """Every trajectory a rollout worker's log says it committed (its
    `trajectories_committed` events, one per commit of a batch), each with the batch's
    `timestamp`."""
    out: list[dict[str, Any]] = []
    for line in log.read_text().splitlines():
        if line[:1] != "{":
            continue
        event = json.loads(line)
        if event.get("event") == "trajectories_committed":
            out.extend({**t, "timestamp": event.get("timestamp")} for t in event["trajectories"])
    return out


def devices_env(devices: int) -> dict[str, str]:
    """This environment with `devices` forced host CPU devices (JAX reads the flag once, at
    start: a mesh test runs its script in a process of its own), compiling as the test
    processes do (tests/conftest.py: XLA's cheapest compile)."""
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    }


def run_on_devices(script: str, devices: int, *args: str, timeout_s: float = 600) -> Any:
    """Run `script` (python -c, from the repo root, with `args`) on `devices` forced host
    devices; the JSON of its last stdout line. Its stderr's tail when it fails."""
    r = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=devices_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
