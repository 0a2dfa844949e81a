"""Hostile tool calls against the real sandboxes: containers through the Docker API (podman
in CI) and bubblewrap.

Every hostile case runs through both backends and checks three things: the outcome is a
clear tool error or a contained result, the same sandbox object serves the next call, and
no process of the call survives it (the call's code carries a marker that is looked for
in the host's /proc). The container fixture also checks that no labelled container is
left behind after close.

Without an engine at DOCKER_HOST (or without bwrap) these tests skip, saying why; CI sets
STREAMRL_REQUIRE_SANDBOX=1, which turns a skip into a failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import structlog

from streamrl.run.redis_server import EmbeddedRedis
from streamrl.tools.backends import WorkerSandbox, builder, make_sandbox
from streamrl.tools.bwrap import BubblewrapConfig, BubblewrapSandbox
from streamrl.tools.containers import LABEL, ContainerConfig, ContainerSandbox
from streamrl.tools.registry import Outcome, interpret, run_call
from streamrl.tools.sandbox import ExecResult, Sandbox, SandboxUnavailableError
from streamrl.wire import ToolResult, decode_body, encode_body
from tests.helpers import sandbox_engine, sandbox_unavailable

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
CAP = 4096
MEMORY = 128 * 2**20
WRITABLE = ["/tmp", "/work", "/var/tmp", "/dev/shm", "/dev/mqueue"]
# One namespace for this test session's containers, so counting them ignores anyone else's.
NS = f"t{uuid.uuid4().hex[:10]}"


def labelled(client: docker.DockerClient, ns: str = NS) -> list[str]:
    """Ids of the sandbox containers of namespace `ns`, running or not."""
    found = client.containers.list(all=True, filters={"label": f"{LABEL}={ns}"})
    return [c.id or "" for c in found]


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    client = sandbox_engine(timeout_s=10)
    yield client
    client.close()


def _container_sandbox(
    engine: docker.DockerClient, call_server: bool
) -> Iterator[ContainerSandbox]:
    # Each fixture its own namespace: at teardown, only its own containers must be gone.
    ns = f"{NS}{'s' if call_server else 'e'}"
    cfg = ContainerConfig(
        namespace=ns,
        memory_bytes=MEMORY,
        pids_limit=32,
        tmpfs_bytes=8 * 2**20,
        pool_size=1,
        call_server=call_server,
    )
    with ContainerSandbox(cfg) as sb:
        sb.start()
        yield sb
    assert labelled(engine, ns) == []


@pytest.fixture(scope="module")
def container_sandbox(engine: docker.DockerClient) -> Iterator[ContainerSandbox]:
    """Containers with an exec per call."""
    yield from _container_sandbox(engine, call_server=False)


@pytest.fixture(scope="module")
def server_sandbox(engine: docker.DockerClient) -> Iterator[ContainerSandbox]:
    """Containers whose call server runs the calls (issue 28)."""
    yield from _container_sandbox(engine, call_server=True)


def _bwrap_sandbox(call_server: bool) -> Iterator[BubblewrapSandbox]:
    try:
        sb = BubblewrapSandbox(
            BubblewrapConfig(
                memory_bytes=256 * 2**20,
                max_processes=32,
                tmpfs_bytes=8 * 2**20,
                call_server=call_server,
            )
        )
    except SandboxUnavailableError as err:
        sandbox_unavailable(str(err))
        raise
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def bwrap_sandbox() -> Iterator[BubblewrapSandbox]:
    """bubblewrap, calls through the call server of a warm namespace (issue 28, item 3)."""
    yield from _bwrap_sandbox(call_server=True)


@pytest.fixture(scope="module")
def bwrap_fresh_sandbox() -> Iterator[BubblewrapSandbox]:
    """bubblewrap, fresh namespaces for every call."""
    yield from _bwrap_sandbox(call_server=False)


@pytest.fixture(params=["container", "server", "bwrap", "bwrap_fresh"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    sb: Sandbox = request.getfixturevalue(f"{request.param}_sandbox")
    return sb


def run(
    sb: Sandbox, code: str, time_limit_s: float = 1.5, stdin: bytes = b""
) -> tuple[ExecResult, Outcome, str]:
    """Run python `code` in the sandbox; returns the raw result, what the agent would see,
    and the marker the code carries (to find its processes on the host)."""
    marker = f"hostile-{uuid.uuid4().hex}"
    code = f"# {marker}\n{textwrap.dedent(code)}"
    r = sb.exec([PY, "-I", "-S", "-c", code], stdin, time_limit_s, CAP)
    return r, interpret(r, time_limit_s), marker


def host_processes_with(marker: str) -> list[int]:
    """Pids of live (non-zombie) host processes whose command line holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(d.name))
    return found


def assert_contained(sb: Sandbox, marker: str) -> None:
    """No process of the call is left, and the sandbox serves the next call."""
    deadline = time.monotonic() + 3
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes_with(marker) == []
    r, out, _ = run(sb, "print(6 * 7)", time_limit_s=10)
    assert out == Outcome(True, "42"), r


# -- the hostile cases, each through both backends


def test_infinite_loop(sandbox: Sandbox) -> None:
    r, out, marker = run(sandbox, "while True: pass", time_limit_s=1.0)
    assert r.timed_out and out.error == "tool timed out after 1s"
    assert r.duration_s < 4
    assert_contained(sandbox, marker)


def test_sleep_past_the_limit(sandbox: Sandbox) -> None:
    r, out, marker = run(sandbox, "import time; print('zz', flush=True); time.sleep(60)", 1.0)
    assert r.timed_out and not out.ok and out.output == "zz\n"
    assert r.duration_s < 4
    assert_contained(sandbox, marker)


def test_fork_bomb(sandbox: Sandbox) -> None:
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    r, out, marker = run(sandbox, code, time_limit_s=1.5)
    assert not out.ok and r.timed_out
    assert_contained(sandbox, marker)


def test_a_gigabyte_of_output(sandbox: Sandbox) -> None:
    code = """
        import sys
        chunk = b"x" * 65536
        for _ in range(16384):
            sys.stdout.buffer.write(chunk)
    """
    r, out, marker = run(sandbox, code, time_limit_s=10)
    assert r.truncated and len(r.stdout) == CAP and r.duration_s < 5
    assert not out.ok and out.error == "tool output exceeded the output cap and was cut"
    assert out.output.endswith("[output truncated]")
    assert_contained(sandbox, marker)


def test_memory_balloon(sandbox: Sandbox) -> None:
    code = """
        blocks = []
        for _ in range(64):
            blocks.append(b"m" * (32 << 20))
        print("allocated", sum(map(len, blocks)))
    """
    r, out, marker = run(sandbox, code, time_limit_s=10)
    assert not out.ok and "allocated" not in out.output
    if isinstance(sandbox, ContainerSandbox):  # the cgroup's OOM killer
        assert r.exit_code == -signal.SIGKILL and "memory limit is 128 MiB" in out.error
    else:  # the address-space rlimit
        assert "MemoryError" in out.error
    assert_contained(sandbox, marker)


def test_no_network(sandbox: Sandbox, redis_server: EmbeddedRedis) -> None:
    targets = [("1.1.1.1", 53), ("127.0.0.1", 6379), ("127.0.0.1", redis_server.port)]
    # The control: from the host, the test's own Redis answers.
    socket.create_connection(("127.0.0.1", redis_server.port), timeout=2).close()
    code = f"""
        import socket
        for host, port in {targets!r}:
            try:
                socket.create_connection((host, port), timeout=1).close()
                print(host, port, "CONNECTED")
            except OSError as err:
                print(host, port, "blocked", err.errno)
    """
    r, out, marker = run(sandbox, code, time_limit_s=10)
    assert out.ok, r
    assert out.output.count("blocked") == 3 and "CONNECTED" not in out.output
    assert_contained(sandbox, marker)


def test_writes_outside_the_tmpfs_fail(sandbox: Sandbox) -> None:
    name = f"streamrl-hostile-{uuid.uuid4().hex}"
    code = f"""
        for d in ["/", "/usr", "/etc", "/usr/bin", "/opt", "/tmp", "/work"]:
            try:
                with open(d.rstrip("/") + "/{name}", "w") as f:
                    f.write("pwned")
                print(d, "written")
            except OSError as err:
                print(d, "denied", err.errno)
    """
    r, out, marker = run(sandbox, code, time_limit_s=10)
    assert out.ok, r
    lines = dict(line.split(" ", 1) for line in out.output.splitlines())
    assert lines.pop("/tmp") == "written" and lines.pop("/work") == "written"
    assert all(v.startswith("denied") for v in lines.values()), lines
    for d in ["/", "/usr", "/etc", "/usr/bin", "/opt", "/tmp"]:  # nothing reached the host
        assert not Path(d, name).exists()
    assert_contained(sandbox, marker)


def test_host_files_and_secrets_stay_hidden(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("STREAMRL_TEST_SECRET", secret)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    paths = ["/etc/shadow", str(secret_file), str(REPO / "pyproject.toml"), "/root"]
    code = f"""
        import os
        print("env", dict(os.environ))
        for p in ["/proc/self/environ", "/proc/1/environ", *{paths!r}]:
            try:
                data = os.listdir(p) if os.path.isdir(p) else open(p, "rb").read()
                print(p, "READ", data)
            except OSError as err:
                print(p, "denied", err.errno)
    """
    r, out, marker = run(sandbox, code, time_limit_s=10)
    assert out.ok, r
    assert secret not in out.output and secret.encode() not in r.stderr
    assert "STREAMRL_TEST_SECRET" not in out.output
    for p in paths:  # (/proc/1 is the sandbox's own init: readable in bwrap, but clean)
        assert f"{p} denied" in out.output, out.output
    assert_contained(sandbox, marker)


def test_killing_its_parents(sandbox: Sandbox) -> None:
    code = """
        import os
        for pid in (1, os.getppid(), -1):
            try:
                os.kill(pid, 9)
                print("killed", pid, flush=True)
            except OSError as err:
                print("denied", pid, err.errno, flush=True)
    """
    _, _, marker = run(sandbox, code, time_limit_s=3)
    # Whatever the call managed to kill, the sandbox and its next call are unharmed.
    assert_contained(sandbox, marker)


def test_binary_garbage_on_stdout(sandbox: Sandbox) -> None:
    code = """
        import sys
        sys.stdout.buffer.write(bytes(range(256)) * 4 + b"\\xff\\xfe\\xc3(")
        sys.stderr.buffer.write(b"\\x00\\x80 on stderr too")
    """
    r, out, marker = run(sandbox, code)
    assert out.ok and len(r.stdout) == 1028
    assert "\ufffd" in out.output  # invalid UTF-8 became replacement characters
    # What the agent gets travels on the wire like any other result.
    result = ToolResult(call_id="c", ok=out.ok, output=out.output, error=out.error, worker="w")
    assert decode_body(encode_body(result), ToolResult) == result
    assert_contained(sandbox, marker)


def test_nothing_leaks_into_the_next_call(sandbox: Sandbox) -> None:
    code = f"""
        import os, time
        for d in {WRITABLE!r}:
            try:
                open(d + "/left-behind", "w").write("x")
            except OSError:
                pass  # not writable in this backend
        if os.fork() == 0:  # a daemon that outlives the call, in its own session
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("done")
    """
    r, out, marker = run(sandbox, code, time_limit_s=5)
    assert out.ok and out.output == "done", r
    assert_contained(sandbox, marker)
    code = f"import os; print([os.listdir(d) for d in {WRITABLE!r} if os.path.isdir(d)])"
    r, out, _ = run(sandbox, code)
    assert out.ok and set(out.output) <= set("[], "), r


def test_a_locked_directory_is_cleaned_up(sandbox: Sandbox) -> None:
    code = """
        import os
        os.makedirs("/work/locked/deeper")
        open("/work/locked/deeper/f", "w").write("x")
        os.chmod("/work/locked/deeper", 0)
        os.chmod("/work/locked", 0)
        print("locked")
    """
    r, out, marker = run(sandbox, code, time_limit_s=5)
    assert out == Outcome(True, "locked"), r
    assert_contained(sandbox, marker)
    r, out, _ = run(sandbox, "import os; print(os.listdir('/work'))")
    assert out.output == "[]", r


def test_calculator_tool_runs_inside(sandbox: Sandbox) -> None:
    # The tool's argv names the host interpreter and script: both are mapped.
    assert run_call(sandbox, "calculator", '{"expression": "37+58"}', 5.0, CAP).output == "95"
    bad = run_call(sandbox, "calculator", '{"expression": "__import__(\\"os\\")"}', 5.0, CAP)
    assert not bad.ok and "unsupported syntax" in bad.error


# -- the container pool and its housekeeping


def _hostname(sb: Sandbox) -> str:
    r, out, _ = run(sb, "import os; print(os.uname().nodename)", time_limit_s=10)
    assert out.ok, r
    return out.output


def test_pool_reuses_a_warm_container(engine: docker.DockerClient) -> None:
    with ContainerSandbox(ContainerConfig(namespace=NS, pool_size=1)) as sb:
        sb.start()
        [warm] = sb.container_ids
        assert _hostname(sb) == _hostname(sb) == warm[:12]
        assert sb.container_ids == [warm]


def test_recycled_after_n_calls(engine: docker.DockerClient) -> None:
    with ContainerSandbox(ContainerConfig(namespace=NS, recycle_after=2)) as sb:
        first, second, third = _hostname(sb), _hostname(sb), _hostname(sb)
        assert first == second != third
        assert len(sb.container_ids) == 1


def test_close_removes_own_containers_only(engine: docker.DockerClient) -> None:
    ns = f"{NS}-close"
    with ContainerSandbox(ContainerConfig(namespace=ns, pool_size=1)) as bystander:
        bystander.start()
        sb = ContainerSandbox(ContainerConfig(namespace=ns, pool_size=2))
        sb.start()
        assert len(labelled(engine, ns)) == 3
        sb.close()
        assert labelled(engine, ns) == bystander.container_ids
        with pytest.raises(SandboxUnavailableError, match="closed"):
            sb.exec(["true"], b"", 1.0, CAP)
    assert labelled(engine, ns) == []


_BUSY_UID = """
import threading, time
for _ in range(1100):
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
print("up", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="starts threads as the stack's uid (root)")
@pytest.mark.parametrize("backend", ["container", "server"])
def test_calls_fork_while_the_stack_uid_is_busy(
    request: pytest.FixtureRequest, backend: str
) -> None:
    """Review N3: calls ran as uid 10001, the uid of every compose image, with nproc 1024;
    rootful podman maps no user namespace, so RLIMIT_NPROC counted the rollout's and
    trainer's threads too, and a big stack made every fork in a sandbox fail. With 1,100
    tasks of uid 10001 on the host a call still forks: it runs as a uid of its own."""
    sb: ContainerSandbox = request.getfixturevalue(f"{backend}_sandbox")
    busy = subprocess.Popen(
        ["/usr/bin/python3", "-c", _BUSY_UID],
        user=10001,
        group=10001,
        stdout=subprocess.PIPE,
        cwd="/",
    )
    try:
        assert busy.stdout is not None and busy.stdout.readline() == b"up\n"
        r = sb.exec(["sh", "-c", "true & wait; echo forked $?; id -u"], b"", 10.0, CAP)
    finally:
        busy.kill()
        busy.communicate()
    assert r.exit_code == 0 and r.stdout.split() == [b"forked", b"0", b"20001"], r
    assert b"can't fork" not in r.stderr


@pytest.mark.parametrize("call_server", [False, True], ids=["exec", "server"])
def test_a_transport_error_mid_call_leaks_no_container(
    engine: docker.DockerClient, call_server: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review N16: a transport error (an overloaded engine's read timeout) while a call
    begins used to leave its container neither idle nor removed, one per failed call for
    the worker's lifetime. Now it goes, and the pool is refilled."""
    import requests

    ns = f"{NS}-n16{'s' if call_server else 'e'}"
    cfg = ContainerConfig(namespace=ns, pool_size=1, call_server=call_server)
    with ContainerSandbox(cfg) as sb:
        sb.start()
        [first] = sb.container_ids

        def timeout(*_: object, **__: object) -> None:
            raise requests.exceptions.ReadTimeout("the engine did not answer in time")

        if call_server:
            [warm] = sb._idle
            assert warm.channel is not None
            monkeypatch.setattr(warm.channel, "call", timeout)
            error: type[BaseException] = requests.exceptions.ReadTimeout
        else:
            monkeypatch.setattr(sb.client.api, "exec_create", timeout)
            error = SandboxUnavailableError
        for _ in range(3):
            with pytest.raises(error):
                sb.exec(["true"], b"", 5.0, CAP)
            if call_server:
                break  # the next call gets a fresh container and its own channel
        monkeypatch.undo()
        assert first not in sb.container_ids and len(sb.container_ids) == 1
        assert sorted(labelled(engine, ns)) == sorted(sb.container_ids)
        assert sb.exec(["sh", "-c", "echo ok"], b"", 5.0, CAP).stdout == b"ok\n"
    assert labelled(engine, ns) == []


def test_max_containers_holds_and_the_calls_queue(engine: docker.DockerClient) -> None:
    """Issue 28: with max_containers 4 and 16 threads calling at once (64 calls), at most 4
    containers of the sandbox exist at any moment (counted on the engine), and every call
    succeeds: the calls past the cap wait for a container."""
    import threading

    ns = f"{NS}-cap"
    cfg = ContainerConfig(namespace=ns, pool_size=1, max_containers=4, max_starting=2)
    counts: list[int] = []
    results: list[ExecResult] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            # The low-level list: no inspect per container (one removed meanwhile is a 500).
            counts.append(len(engine.api.containers(all=True, filters={"label": f"{LABEL}={ns}"})))
            time.sleep(0.01)

    with ContainerSandbox(cfg) as sb:

        def calls() -> None:
            for _ in range(4):
                results.append(sb.exec(["sh", "-c", "sleep 0.05; echo ok"], b"", 10.0, CAP))

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=calls) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        sampler.join()
        assert len(sb.container_ids) <= 1  # the pool: the others went back as pool_full
    assert len(results) == 64 and all(r.stdout == b"ok\n" for r in results), results[:3]
    assert counts and max(counts) <= 4 and max(counts) >= 2, counts
    assert labelled(engine, ns) == []


_OWNER = """
import sys, time
from streamrl.tools.containers import ContainerConfig, ContainerSandbox
sb = ContainerSandbox(ContainerConfig(namespace=sys.argv[1], pool_size=2))
sb.start()
print("ready", flush=True)
time.sleep(120)
"""


def test_reap_orphans_removes_a_dead_owners_containers(engine: docker.DockerClient) -> None:
    ns = f"{NS}-reap"
    owner = subprocess.Popen(
        [PY, "-c", _OWNER, ns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO
    )
    try:
        assert owner.stdout is not None
        assert b"ready\n" in iter(owner.stdout.readline, b"")  # after its log lines
    finally:
        owner.kill()  # SIGKILL: no close() runs, the containers stay behind
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()
    orphans = labelled(engine, ns)
    assert len(orphans) == 2
    with ContainerSandbox(ContainerConfig(namespace=ns)) as live:
        live.start()
        with ContainerSandbox(ContainerConfig(namespace=ns)) as sb:
            # It reaps any dead owner's containers on this host: another test process's
            # reap may have taken these two first (then it reaps fewer here).
            reaped = sb.reap_orphans()
            assert not set(orphans) & set(labelled(engine, ns)), reaped
            # A live owner's container is not an orphan, and neither are one's own.
            assert labelled(engine, ns) == live.container_ids
    assert labelled(engine, ns) == []


_OWNER_MID_CALL = """
import sys, threading, time
from streamrl.tools.containers import ContainerConfig, ContainerSandbox
ns, server, marker = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
sb = ContainerSandbox(ContainerConfig(namespace=ns, pool_size=1, call_server=server))
sb.start()
call = ["sh", "-c", f"sleep 60; echo {marker}"]
threading.Thread(target=sb.exec, args=(call, b"", 120.0, 4096), daemon=True).start()
print("calling", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("call_server", [False, True], ids=["exec", "server"])
def test_a_tool_worker_killed_mid_call_leaves_nothing_once_reaped(
    engine: docker.DockerClient, call_server: bool
) -> None:
    """Issue 28's hostile additions: SIGKILL a sandbox's owner while a call runs. Its
    containers outlive it (no close() ran); the next worker's start-up reap removes them,
    and with them the call's processes: 0 containers, 0 processes left."""
    ns = f"{NS}-kill{'s' if call_server else 'e'}"
    marker = f"midcall-{uuid.uuid4().hex}"
    argv = [PY, "-c", _OWNER_MID_CALL, ns, "1" if call_server else "0", marker]
    owner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        assert owner.stdout is not None
        assert b"calling\n" in iter(owner.stdout.readline, b"")
        deadline = time.monotonic() + 30
        while not host_processes_with(marker):  # the call runs in its container
            assert time.monotonic() < deadline, "the call did not start"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()
    # Left behind by the dead owner (not asserted: another test process's tool worker may
    # reap them first, as the next worker here does).
    with ContainerSandbox(ContainerConfig(namespace=ns)) as next_worker:
        next_worker.reap_orphans()  # what a tool worker does at start (backends.py)
        assert labelled(engine, ns) == []
    deadline = time.monotonic() + 10
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host_processes_with(marker) == []


def test_unavailable_engine_is_a_clear_error() -> None:
    cfg = ContainerConfig(docker_host="unix:///nonexistent/streamrl.sock")
    with pytest.raises(SandboxUnavailableError, match=r"DOCKER_HOST=unix:///nonexistent/"):
        ContainerSandbox(cfg)


def test_missing_image_is_a_clear_error(engine: docker.DockerClient) -> None:
    with pytest.raises(SandboxUnavailableError, match=r"'streamrl-sandbox:missing' is missing"):
        ContainerSandbox(ContainerConfig(namespace=NS, image="streamrl-sandbox:missing"))


def test_auto_picks_containers_then_falls_back(engine: docker.DockerClient) -> None:
    ns = f"{NS}-auto"
    sb = make_sandbox("auto", container=ContainerConfig(namespace=ns))
    try:
        assert isinstance(sb, ContainerSandbox)
        assert len(labelled(engine, ns)) == 1  # the warm pool
    finally:
        sb.close()
    assert labelled(engine, ns) == []
    down = ContainerConfig(namespace=ns, docker_host="unix:///nonexistent/streamrl.sock")
    fallback = make_sandbox("auto", container=down)
    assert isinstance(fallback, BubblewrapSandbox)
    fallback.close()


def _shell_hostname(box: WorkerSandbox) -> str:
    out = run_call(box, "shell", '{"command": "cat /proc/sys/kernel/hostname"}', 5.0, CAP)
    assert out.ok, out
    return out.output.splitlines()[-1]


def test_auto_moves_up_to_containers_once_the_engine_answers(
    engine: docker.DockerClient, bwrap_sandbox: BubblewrapSandbox, tmp_path: Path
) -> None:
    """An engine that was down when the worker started is picked up later (review H3): the
    worker starts on bwrap, probes the engine again on later calls with a backoff, and moves
    its calls into containers once the engine's socket appears."""
    ns = f"{NS}-up"
    real = os.environ["DOCKER_HOST"].removeprefix("unix://")
    link = tmp_path / "engine.sock"  # the engine's socket, once the link exists
    cfg = ContainerConfig(namespace=ns, docker_host=f"unix://{link}")
    box = WorkerSandbox("auto", builder(container=cfg), structlog.get_logger(), retry_min_s=0.2)
    try:
        assert box.active == "bwrap"
        assert run_call(box, "calculator", '{"expression": "1+1"}', 5.0, CAP).output == "2"
        assert _shell_hostname(box) == "sandbox"  # bwrap's
        link.symlink_to(real)
        deadline = time.monotonic() + 10
        while box.active != "container" and time.monotonic() < deadline:
            out = run_call(box, "python", '{"code": "print(6*7)"}', 5.0, CAP)
            assert out.output == "exit status: 0\nstdout:\n42"  # served meanwhile
            time.sleep(0.1)
        assert box.active == "container"
        assert len(labelled(engine, ns)) == 1  # the warm pool, now in use
        assert _shell_hostname(box) == labelled(engine, ns)[0][:12]  # the container's
    finally:
        box.close()
    assert labelled(engine, ns) == []


# Run as a user that holds 200 threads (a JAX process of the same user holds more): bwrap
# must still make its namespaces, and when it cannot (the limit without that user's own
# tasks counted), the call is an infrastructure failure, not the program's exit status 1.
_BUSY_USER = """
import threading
from streamrl.tools import bwrap
from streamrl.tools.sandbox import SandboxUnavailableError
stop = threading.Event()
threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(200)]
for t in threads:
    t.start()
sb = bwrap.BubblewrapSandbox(bwrap.BubblewrapConfig(max_processes=32, call_server=False))
served = bwrap.BubblewrapSandbox(bwrap.BubblewrapConfig(max_processes=32))  # a warm namespace
for box in (sb, served):
    r = box.exec(["/bin/true"], b"", 10.0, 4096)
    print("exit", r.exit_code, r.stderr.decode().strip())
served.close()
bwrap.tasks_of = lambda uid: 0  # as before: 32 tasks for the whole user
try:
    sb.exec(["/bin/true"], b"", 10.0, 4096)
    print("no error")
except SandboxUnavailableError as err:
    print("infra", err)
try:
    bwrap.BubblewrapSandbox(bwrap.BubblewrapConfig(max_processes=32))
    print("no error")
except SandboxUnavailableError as err:
    print("infra", " ".join(str(err).split()))
stop.set()
"""


def test_bwrap_as_a_busy_non_root_user(bwrap_sandbox: BubblewrapSandbox) -> None:
    """Review M6: RLIMIT_NPROC counts every task of the user, bwrap's new namespace too."""
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    cmd = [*(drop if os.geteuid() == 0 else []), PY, "-c", _BUSY_USER]
    p = subprocess.run(cmd, cwd="/", capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    first, first_served, second, second_served = p.stdout.splitlines()
    assert first == first_served == "exit 0 "
    assert second.startswith("infra bubblewrap could not start the call: bwrap: ")
    assert "Resource temporarily unavailable" in second
    # A warm namespace that cannot be made: the sandbox is unavailable, not a call's exit 1.
    assert second_served.startswith("infra bubblewrap cannot make a sandbox here"), second_served
    assert "Resource temporarily unavailable" in second_served
