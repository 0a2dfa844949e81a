"""The call server as the main process of a real sandbox container (podman through the
Docker API), reached through the container's attached stdio (issue 28, item 1).

The container is made as `ContainerSandbox` makes its own (no network, read-only root,
tmpfs, no-new-privileges, memory and pid limits, an init as PID 1), except that the server
runs as root with only CAP_SETUID, CAP_SETGID and CAP_KILL, so that it can run each call
as uid 20001 and stop what the call leaves behind.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import docker
import pytest

from streamrl.tools.callclient import CallChannel, Reply
from streamrl.tools.containers import (
    WORKDIR,
    ContainerConfig,
    ContainerSandbox,
    _remove_quietly,
    attach_server,
)
from tests.helpers import sandbox_engine

pytestmark = pytest.mark.integration

NS = f"t{uuid.uuid4().hex[:10]}"
COUNT_CALL_UID = """
import os
def uid(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(l.split()[1] for l in f if l.startswith("Uid:"))
    except OSError:
        return None
print(sum(1 for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
          and uid(p) == "20001"))
"""
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR}


@dataclass
class Served:
    container: Any
    channel: CallChannel
    attached: Any

    def call(self, argv: list[str], stdin: bytes = b"", limit_s: float = 5.0) -> Reply:
        return self.channel.call(argv, stdin, limit_s, 4096, ENV, WORKDIR, 1 << 20)


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    client = sandbox_engine(timeout_s=10)
    yield client
    client.close()


@pytest.fixture
def served(engine: docker.DockerClient) -> Iterator[Served]:
    cfg = ContainerConfig(namespace=NS, memory_bytes=128 * 2**20, pids_limit=32, pool_size=0)
    with ContainerSandbox(cfg) as sandbox:
        options = sandbox.server_options()
    container = engine.containers.create(cfg.image, **options)
    try:
        attached, channel = attach_server(engine, container, "the test's engine")
        try:
            yield Served(container, channel, attached)
        finally:
            attached.close()
    finally:
        _remove_quietly(container)  # podman may refuse while the server exits at EOF


def test_calls_run_as_the_call_uid_in_a_fresh_workdir(served: Served) -> None:
    info = served.channel.ping(timeout_s=30)
    assert info["call_uid"] == 20001 and info["python_fork"] is True
    # The server's stderr and stdout are two pipes that podman multiplexes onto the one
    # stream: its start-up line may come after the ping's answer (seen once under load).
    deadline = time.monotonic() + 10
    while "dropped from root" not in served.channel.server_stderr:
        assert time.monotonic() < deadline, served.channel.server_stderr
        served.channel.ping(timeout_s=30)
        time.sleep(0.05)
    reply = served.call(["sh", "-c", "id -u; pwd; echo left > /work/f; mkdir /tmp/d"])
    assert reply.result.exit_code == 0 and reply.reusable, reply
    assert reply.result.stdout == b"20001\n/work\n"
    # The next call finds the writable places empty again.
    reply = served.call(["sh", "-c", "ls -A /work /tmp; cat", "x"], stdin=b"in")
    assert reply.result.stdout == b"/tmp:\n\n/work:\nin", reply
    assert reply.result.exit_code == 0


def test_python_calls_are_forked_from_the_server(served: Served) -> None:
    reply = served.call(["python3", "-c", "import os, sys; print(os.getuid(), sys.argv)", "a"])
    assert reply.result.stdout == b"20001 ['-c', 'a']\n", reply
    reply = served.call(["python3", "-c", "raise SystemExit(3)"])
    assert reply.result.exit_code == 3 and reply.reusable


def test_a_call_cannot_kill_the_server_or_pid_1(served: Served) -> None:
    pid = served.channel.ping(timeout_s=30)["pid"]
    reply = served.call(["sh", "-c", f"kill -9 1 {pid} 2>&1; kill -9 -1; echo $?"])
    assert b"Operation not permitted" in reply.result.stdout, reply
    after = served.channel.ping(timeout_s=10)
    assert after["pid"] == pid  # the same server answers
    reply = served.call(["cat", f"/proc/{pid}/environ"])
    assert reply.result.exit_code == 1 and b"Permission denied" in reply.result.stderr


_REPLACE = """
import ctypes, os, sys
pid = int(sys.argv[1])
tries = {
    "stdin": lambda: open(f"/proc/{pid}/fd/0", "wb"),
    "stdout": lambda: open(f"/proc/{pid}/fd/1", "wb"),
    "mem": lambda: open(f"/proc/{pid}/mem", "r+b"),
    "exe": lambda: os.readlink(f"/proc/{pid}/exe"),
}
for name, attempt in tries.items():
    try:
        attempt()
        print(name, "OPENED")
    except OSError as err:
        print(name, type(err).__name__)
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", libc.ptrace(16, pid, None, None), ctypes.get_errno())  # PTRACE_ATTACH
"""


def test_a_call_cannot_replace_or_trace_the_server(served: Served) -> None:
    """Issue 28: a call tries to take the server's place: write its requests or answers
    through its stdin or stdout, write its memory, read its executable's path, or ptrace
    it. Every attempt is refused, and the same server answers afterwards."""
    pid = served.channel.ping(timeout_s=30)["pid"]
    reply = served.call(["python3", "-c", _REPLACE, str(pid)])
    out = reply.result.stdout.decode()
    assert "OPENED" not in out, out
    for name in ("stdin", "stdout", "mem", "exe"):
        assert f"{name} PermissionError" in out, out
    assert "ptrace -1 1" in out, out  # EPERM
    assert served.channel.ping(timeout_s=10)["pid"] == pid and reply.reusable


def test_limits_end_the_call_and_retire_the_container(served: Served) -> None:
    start = time.monotonic()
    reply = served.call(["sh", "-c", "sleep 30 & sleep 30"], limit_s=0.5)
    assert reply.result.timed_out and not reply.reusable
    assert time.monotonic() - start < 10
    # Nothing of the timed-out call runs on: no process of uid 20001 but this call's.
    reply = served.call(["python3", "-c", COUNT_CALL_UID])
    assert reply.result.stdout == b"0\n", reply
    reply = served.call(["yes"])
    assert reply.result.truncated and len(reply.result.stdout) == 4096 and not reply.reusable


def test_a_dead_server_is_a_broken_channel_not_a_hang(served: Served, engine: Any) -> None:
    assert served.call(["true"]).reusable
    served.container.kill()
    start = time.monotonic()
    reply = served.call(["true"])
    assert not reply.reusable and reply.result.exit_code is None
    assert reply.error is not None and "call server" in reply.error
    assert time.monotonic() - start < 10
