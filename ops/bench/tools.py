"""Tool-call round trip and throughput through the real path, against a bare exec.

    DOCKER_HOST=unix:///run/streamrl-podman.sock .venv/bin/python ops/bench/tools.py

Needs a container engine and bubblewrap (ops/sandbox/setup_host.sh; `--backends bwrap`
needs no engine). Measures, side by side in one run, for the container backend:

- bare exec:     `exec_run` of the command in a warm container through the docker SDK
                 (the floor: what any framework pays to run a command in a container);
- sandbox exec:  the same command through `ContainerSandbox.exec` (warm pool, wrapper,
                 limits, output capture, cleanup of the call's leftovers);
- call server:   the same command through the call server of a warm container
                 (`streamrl.tools.callserver`, one attached stream), and
                 `python3 -c 'print(1)'` through both;
- round trip:    a `shell` tool call from the rollout side's `ToolClient` (enqueue on rq in
                 Redis, a tool worker process picks it up, runs it in its container sandbox,
                 pushes the result, BLPOP wakes the caller); `rt via server`: the same with
                 the tool workers' sandboxes on their call servers (`tools.call_server`);
                 and the `python` tool's `print(1)` the same two ways;
- throughput:    calls per second with 1, 2 and 4 tool worker processes, `--inflight` calls
                 in flight from one rollout-side client, on both paths;
and for the bubblewrap backend the same rows but the bare exec: `exec` is fresh namespaces
per call (`BubblewrapSandbox` with `call_server` false), `server` the call server of a warm
namespace (issue 28, item 3).

Latencies are p50/p99 over `--calls` sequential calls; overhead = round trip - bare exec.
`--json` prints one JSON object a line instead of the tables:
`{"row": "round_trip", "backend": "container"|"bwrap", "path": "exec"|"server", "tool":
"shell"|"python", "p50_ms": ..., "p99_ms": ...}`, `{"row": "throughput", "backend": ...,
"path": ..., "workers": N, "inflight": M, "calls_per_s": ...}` and `{"row": "sandbox",
"backend": ..., "path": "bare exec"|"exec"|"server", "tool": ..., "p50_ms": ..., "p99_ms":
...}` (in-process rows: the sandbox object alone, no Redis).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker
import redis
import redis.asyncio as aioredis
import structlog
from rq import Worker

from streamrl.config import load_config
from streamrl.names import Keys
from streamrl.run.launcher import worker_command
from streamrl.run.redis_server import EmbeddedRedis
from streamrl.tools.bwrap import BubblewrapConfig, BubblewrapSandbox
from streamrl.tools.client import ToolClient
from streamrl.tools.containers import (
    CALL_ENV,
    WORKDIR,
    ContainerConfig,
    ContainerSandbox,
    attach_server,
)
from streamrl.tools.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny.toml"
BACKENDS = ("container", "bwrap")
COMMAND = "echo ok"
PYTHON = ["python3", "-c", "print(1)"]
# A tool call of each kind through ToolClient: (tool, arguments, what its output ends with).
TOOL_CALLS = {
    "shell": ("shell", json.dumps({"command": COMMAND}), "ok"),
    "python": ("python", json.dumps({"code": "print(1)"}), "1"),
}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def bare_exec(n: int, image: str) -> list[float]:
    client = docker.from_env()
    c = client.containers.run(
        image, ["sleep", "infinity"], detach=True, network_mode="none", init=True,
        labels={"streamrl.bench": "1"},
    )  # fmt: skip
    try:
        c.exec_run(["/bin/sh", "-c", COMMAND])
        times = []
        for _ in range(n):
            t = time.perf_counter()
            r = c.exec_run(["/bin/sh", "-c", COMMAND])
            times.append(time.perf_counter() - t)
            assert r.exit_code == 0
        return times
    finally:
        c.remove(force=True)


def sandbox_exec(n: int, image: str, argv: list[str], expected: bytes) -> list[float]:
    """`argv` through `ContainerSandbox.exec` with an exec per call (tools.call_server off)."""
    box = ContainerSandbox(
        ContainerConfig(image=image, namespace="bench", pool_size=1, call_server=False)
    )
    box.start()
    try:
        return timed_calls(box, n, argv, expected)
    finally:
        box.close()


def timed_calls(box: Sandbox, n: int, argv: list[str], expected: bytes) -> list[float]:
    """Seconds of each of `n` sequential calls of `argv` in `box` (after one not counted),
    each checked for exit 0 and `expected` on stdout."""
    times = []
    for _ in range(n + 1):
        t = time.perf_counter()
        r = box.exec(argv, b"", 5.0, 4096)
        times.append(time.perf_counter() - t)
        assert r.exit_code == 0 and r.stdout == expected, r
    return times[1:]


def call_server(n: int, image: str, argv: list[str]) -> list[float]:
    """The same calls through the call server of a warm container (issue 28): one attached
    stream kept open, the call forked by the server (python3 -c forked from its
    pre-imported interpreter), its leftovers and writable places cleaned after it."""
    client = docker.from_env()
    box = ContainerSandbox(ContainerConfig(image=image, namespace="bench", pool_size=0))
    container = client.containers.create(image, **box.server_options())
    attached, channel = attach_server(client, container, "bench")
    try:
        channel.ping(timeout_s=30)
        times = []
        for _ in range(n + 1):
            t = time.perf_counter()
            r = channel.call(argv, b"", 5.0, 4096, CALL_ENV, WORKDIR, 1 << 20)
            times.append(time.perf_counter() - t)
            assert r.reusable and r.result.exit_code == 0, r
        return times[1:]
    finally:
        container.remove(force=True)  # killed while attached (see ContainerSandbox._remove)
        attached.close()
        box.close()
        client.close()


class Pipeline:
    """An embedded Redis plus tool worker processes of one run namespace."""

    def __init__(self, tmp: Path, backend: str, call_server: bool) -> None:
        self.tmp = tmp
        self.sets = ["run.name=bench", f"tools.sandbox={backend}"]
        self.sets.append(f"tools.call_server={str(call_server).lower()}")
        self.redis = EmbeddedRedis(tmp / "redis", appendonly=False).start()
        self.keys = Keys("bench")
        self.client = redis.Redis.from_url(self.redis.url)
        self.procs: list[subprocess.Popen[bytes]] = []

    def scale(self, n: int) -> None:
        env = {**os.environ, "REDIS_URL": self.redis.url}
        while len(self.procs) < n:
            i = len(self.procs)
            cmd = worker_command("tools", i, CONFIG, self.tmp / "run", self.sets)
            log = open(self.tmp / f"tools-{i}.log", "ab")  # noqa: SIM115 - lives with the process
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 60
        while len(Worker.all(connection=self.client)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} tool workers did not come up; see {self.tmp}")
            time.sleep(0.1)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=30)
        self.redis.stop()


async def round_trips(pipe: Pipeline, n: int, kind: str) -> list[float]:
    """`n` sequential tool calls of `kind` (TOOL_CALLS) through ToolClient, after 2 warm."""
    tool, args, expected = TOOL_CALLS[kind]
    aclient = aioredis.Redis.from_url(pipe.redis.url)
    cfg = load_config(CONFIG, ["run.name=bench"]).tools
    tc = ToolClient(pipe.client, aclient, pipe.keys, cfg, structlog.get_logger())
    times = []
    for i in range(n + 2):
        t = time.perf_counter()
        r = await tc.call(tool, args, f"rt-{kind}-{i}")
        times.append(time.perf_counter() - t)
        assert r.ok and r.output.strip().endswith(expected), r
    await aclient.aclose()
    return times[2:]


async def throughput(pipe: Pipeline, calls: int, inflight: int, tag: str) -> float:
    aclient = aioredis.Redis.from_url(pipe.redis.url)
    cfg = load_config(CONFIG, ["run.name=bench"]).tools
    tc = ToolClient(pipe.client, aclient, pipe.keys, cfg, structlog.get_logger())
    args = f'{{"command": "{COMMAND}"}}'
    sem = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with sem:
            r = await tc.call("shell", args, f"{tag}-{i}")
            assert r.ok, r

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(calls)))
    rate = calls / (time.perf_counter() - start)
    await aclient.aclose()
    return rate


PATHS = ("exec", "server")  # tools.call_server false / true


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per latency")
    parser.add_argument("--throughput-calls", type=int, default=200)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--image", default="streamrl-sandbox:1")
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
        help="sandbox backends measured (default both)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="JSON lines instead of tables")
    args = parser.parse_args()
    # The sandboxes' log lines go to stderr: stdout holds the tables or the JSON lines.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if "container" in args.backends and not os.environ.get("DOCKER_HOST"):
        sys.exit("DOCKER_HOST is not set: run ops/sandbox/setup_host.sh and export it")
    # In-process rows: (backend, path, tool) -> latencies.
    inproc: dict[tuple[str, str, str], list[float]] = {}
    shell = ["/bin/sh", "-c", COMMAND]
    if "container" in args.backends:
        inproc["container", "bare exec", "shell"] = bare_exec(args.calls, args.image)
        inproc["container", "exec", "shell"] = sandbox_exec(args.calls, args.image, shell, b"ok\n")
        inproc["container", "server", "shell"] = call_server(args.calls, args.image, shell)
        inproc["container", "exec", "python"] = sandbox_exec(args.calls, args.image, PYTHON, b"1\n")
        inproc["container", "server", "python"] = call_server(args.calls, args.image, PYTHON)
    if "bwrap" in args.backends:
        for path in PATHS:
            for tool, argv, out in (("shell", shell, b"ok\n"), ("python", PYTHON, b"1\n")):
                inproc["bwrap", path, tool] = bwrap_exec(args.calls, argv, out, path == "server")
    # Pipeline rows: (backend, path) -> (round trips by tool, calls/s by workers).
    piped = {(b, path): pipeline_rows(args, b, path == "server")
             for b in args.backends for path in PATHS}  # fmt: skip
    if args.json:
        print_json(args, inproc, piped)
        return
    print(f"{args.calls} sequential calls; cpus {os.cpu_count()}; p50 / p99 ms")
    print(f"{'backend':<10} {'tool':<7} {'path':<10} {'sandbox':>16} {'round trip':>16}")
    for (backend, path, tool), xs in inproc.items():
        rt = piped[backend, path][0].get(tool) if path in PATHS else None
        rts = f"{statistics.median(rt) * 1e3:.2f} / {pct(rt, 0.99) * 1e3:.2f}" if rt else "-"
        lat = f"{statistics.median(xs) * 1e3:.2f} / {pct(xs, 0.99) * 1e3:.2f}"
        print(f"{backend:<10} {tool:<7} {path:<10} {lat:>16} {rts:>16}")
    print(f"throughput: {args.throughput_calls} calls, {args.inflight} in flight; calls/s")
    print(f"{'backend':<10} {'workers':>7} {'exec':>8} {'server':>8} {'x exec':>7}")
    for backend in args.backends:
        for n in args.workers:
            slow, fast = piped[backend, "exec"][1][n], piped[backend, "server"][1][n]
            print(f"{backend:<10} {n:>7} {slow:>8.1f} {fast:>8.1f} {fast / slow:>7.2f}")


def bwrap_exec(n: int, argv: list[str], expected: bytes, server: bool) -> list[float]:
    """`argv` through `BubblewrapSandbox.exec`: fresh namespaces per call, or the call
    server of a warm namespace (issue 28, item 3)."""
    box = BubblewrapSandbox(BubblewrapConfig(call_server=server))
    try:
        return timed_calls(box, n, argv, expected)
    finally:
        box.close()


def print_json(
    args: argparse.Namespace,
    inproc: dict[tuple[str, str, str], list[float]],
    piped: dict[tuple[str, str], tuple[dict[str, list[float]], dict[int, float]]],
) -> None:
    """The rows as JSON lines (see the module doc)."""

    def ms(xs: list[float]) -> dict[str, float]:
        return {"p50_ms": round(statistics.median(xs) * 1e3, 3),
                "p99_ms": round(pct(xs, 0.99) * 1e3, 3), "calls": len(xs)}  # fmt: skip

    for (backend, path, tool), xs in inproc.items():
        print(json.dumps({"row": "sandbox", "backend": backend, "path": path,
                          "tool": tool, **ms(xs)}))  # fmt: skip
    for (backend, path), (rt, rates) in piped.items():
        for tool, xs in rt.items():
            print(json.dumps({"row": "round_trip", "backend": backend, "path": path,
                              "tool": tool, **ms(xs)}))  # fmt: skip
        for n, rate in rates.items():
            print(json.dumps({"row": "throughput", "backend": backend, "path": path,
                              "workers": n, "inflight": args.inflight,
                              "calls_per_s": round(rate, 2)}))  # fmt: skip


def pipeline_rows(
    args: argparse.Namespace, backend: str, call_server: bool
) -> tuple[dict[str, list[float]], dict[int, float]]:
    """Round trips and throughput through rq and tool worker processes, whose sandboxes
    (`tools.sandbox` = backend) run calls by exec / fresh namespaces or through their call
    servers (`tools.call_server`)."""
    with tempfile.TemporaryDirectory() as tmp:
        pipe = Pipeline(Path(tmp), backend, call_server)
        try:
            pipe.scale(1)
            rt = {kind: asyncio.run(round_trips(pipe, args.calls, kind)) for kind in TOOL_CALLS}
            rates = {}
            for n in args.workers:
                pipe.scale(n)
                asyncio.run(throughput(pipe, 20, args.inflight, f"warm{n}"))  # warm pools
                rates[n] = asyncio.run(
                    throughput(pipe, args.throughput_calls, args.inflight, f"tp{n}")
                )
        finally:
            pipe.close()
    return rt, rates


if __name__ == "__main__":
    main()
