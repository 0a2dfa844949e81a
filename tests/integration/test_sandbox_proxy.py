"""`streamrl sandbox-proxy` in front of the real engine (podman in CI). What the proxy costs
a call is measured by ops/bench/sandbox_proxy.py, not here.

The real CLI serves a temporary socket; the real `ContainerSandbox` runs tool calls through
it; a plain docker SDK client then tries what a tool worker must not do (a privileged
container, a bind mount of /, another image, the host's network, an exec as root, another
container) and gets 403 each time, with nothing created on the engine.

Without an engine at DOCKER_HOST these tests skip, saying why; CI sets
STREAMRL_REQUIRE_SANDBOX=1, which turns a skip into a failure.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from streamrl.tools.containers import LABEL, OWNER_HEADER, ContainerConfig, ContainerSandbox
from tests.helpers import sandbox_engine

pytestmark = pytest.mark.integration

NS = f"px{uuid.uuid4().hex[:10]}"  # this module's sandbox containers
CAP = 4096
MEMORY = 128 * 2**20


@pytest.fixture(scope="module")
def engine() -> Iterator[docker.DockerClient]:
    """A client of the real engine (DOCKER_HOST), for setting up and checking only."""
    client = sandbox_engine()
    yield client
    client.close()


@pytest.fixture(scope="module")
def proxy(
    engine: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """The proxy CLI serving a temp socket; yields its URL and its log file."""
    yield from _serve_proxy(tmp_path_factory.mktemp("proxy"))


def _serve_proxy(tmp: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    sock, log = tmp / "docker.sock", tmp / "proxy.log"
    upstream = os.environ["DOCKER_HOST"]
    argv = [sys.executable, "-m", "streamrl_workers.cli", "sandbox-proxy"]
    argv += ["--upstream", upstream, "--listen", f"unix://{sock}", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.05)
        yield f"unix://{sock}", log
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, log.read_text()
    assert not sock.exists()  # removed on the way out


def labelled(engine: docker.DockerClient, ns: str = NS) -> list[str]:
    found = engine.containers.list(all=True, filters={"label": f"{LABEL}={ns}"})
    return [c.id or "" for c in found]


def sandbox_config(url: str | None, ns: str = NS, call_server: bool = False) -> ContainerConfig:
    return ContainerConfig(
        namespace=ns,
        memory_bytes=MEMORY,
        pids_limit=32,
        tmpfs_bytes=8 * 2**20,
        docker_host=url,
        call_server=call_server,
    )


def py(sb: ContainerSandbox, code: str, stdin: bytes = b"", limit: float = 10.0) -> Any:
    return sb.exec(["python3", "-c", code], stdin, limit, CAP)


def test_the_socket_is_group_only(proxy: tuple[str, Path]) -> None:
    assert os.stat(proxy[0].removeprefix("unix://")).st_mode & 0o777 == 0o660


@pytest.fixture(scope="module", params=["exec", "call_server"])
def sandbox(
    request: pytest.FixtureRequest, proxy: tuple[str, Path], engine: docker.DockerClient
) -> Iterator[ContainerSandbox]:
    """The real container sandbox, whose only engine is the proxy: calls by exec, or through
    each container's call server (tools.call_server: root server, attach)."""
    cfg = sandbox_config(proxy[0], call_server=request.param == "call_server")
    with ContainerSandbox(cfg) as sb:
        sb.reap_orphans()
        sb.start()
        yield sb
    assert labelled(engine) == []


def test_tool_calls_run_through_the_proxy(sandbox: ContainerSandbox) -> None:
    r = py(sandbox, "import os; print(6 * 7, os.getuid())")
    assert (r.exit_code, r.stdout) == (0, b"42 20001\n")
    data = os.urandom(200_000).hex().encode()  # 400 kB: more than one socket buffer
    code = "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
    r = py(sandbox, code, stdin=data)
    assert (r.exit_code, r.stdout) == (0, f"{hashlib.sha256(data).hexdigest()}\n".encode())
    r = py(sandbox, "import time; print('zz', flush=True); time.sleep(60)", limit=1.0)
    assert r.timed_out and r.stdout == b"zz\n" and r.duration_s < 5
    r = py(sandbox, "import sys; sys.stdout.write('x' * 100_000)")
    assert r.truncated and len(r.stdout) == CAP
    r = py(sandbox, "import sys; sys.exit(3)")
    assert r.exit_code == 3
    r = py(sandbox, "print('after')")  # the recycled pool still serves
    assert r.stdout == b"after\n"


def _refused(call: Any) -> str:
    with pytest.raises(docker.errors.APIError) as info:
        call()
    assert info.value.status_code == 403, info.value
    text = str(info.value.explanation)
    assert "refused by the streamrl sandbox proxy" in text
    return text


def test_what_a_tool_worker_must_not_do_is_refused(
    proxy: tuple[str, Path], engine: docker.DockerClient, sandbox: ContainerSandbox
) -> None:
    url, log = proxy
    client = docker.DockerClient(base_url=url, timeout=30)
    client.api.headers[OWNER_HEADER] = secrets.token_hex(16)  # a tool worker's, not sandbox's
    hardened = sandbox._run_options()  # what the sandbox sends, varied one thing at a time
    names = [f"streamrl-{NS}-evil-{i}" for i in range(6)]
    variations: list[tuple[dict[str, Any], str]] = [
        ({"privileged": True}, "HostConfig.Privileged is not allowed"),
        ({"volumes": {"/": {"bind": "/host", "mode": "rw"}}}, "Volumes is not allowed"),
        ({"image": "docker.io/library/alpine:3"}, "Image must be the sandbox image"),
        ({"network_mode": "host"}, 'HostConfig.NetworkMode must be "none"'),
        ({"user": "0:0"}, "User 0:0 and CapAdd are only for the call server"),
        ({"user": "0:0", "cap_add": ["SETUID"]}, "only for the call server's own command"),
    ]
    unrelated = engine.containers.create(
        sandbox.cfg.image, ["sleep", "infinity"], name=f"unrelated-{NS}"
    )
    try:
        for name, (change, reason) in zip(names, variations, strict=True):
            opts = {**hardened, "name": name, **change}
            image = opts.pop("image", sandbox.cfg.image)
            assert reason in _refused(functools.partial(client.containers.create, image, **opts))
        cid = sandbox.container_ids[0]
        for user in ("0:0", "root", "0"):
            why = _refused(functools.partial(client.api.exec_create, cid, ["id"], user=user))
            assert "User must" in why
        why = _refused(lambda: client.api.exec_create(cid, ["id"], user="1:1", privileged=True))
        assert "Privileged must be false" in why
        uid = unrelated.id or ""
        for call in (
            lambda: client.containers.get(uid),
            lambda: client.api.start(uid),
            lambda: client.api.remove_container(uid, force=True),
            lambda: client.api.exec_create(uid, ["id"], user="1:1"),
        ):
            assert "is not a sandbox container: it has no streamrl.sandbox label" in _refused(call)
        assert "must filter on the label" in _refused(lambda: client.containers.list(all=True))
        assert "is not a request" in _refused(client.images.list)
        assert "is not a request" in _refused(lambda: client.volumes.create("evil"))
        assert "only the sandbox image" in _refused(lambda: client.images.get("alpine:3"))
        unrelated.reload()
        assert unrelated.status == "created"  # never started, still there
    finally:
        unrelated.remove(force=True)
        client.close()
    # names from the list call alone: `containers.list` inspects each container it listed,
    # and one that another test removed in between fails the inspect ("no such container")
    on_engine = {n.lstrip("/") for c in engine.api.containers(all=True) for n in c["Names"]}
    assert on_engine.isdisjoint(names)
    assert set(labelled(engine)) == set(sandbox.container_ids)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    reasons = [e["reason"] for e in events if e["event"] == "sandbox_proxy_refused"]
    assert any("HostConfig.Privileged is not allowed" in r for r in reasons)
    assert any("only for the call server's own command" in r for r in reasons)


def test_a_sandbox_is_bound_to_the_client_that_made_it(
    proxy: tuple[str, Path], sandbox: ContainerSandbox
) -> None:
    """Review N6: every tool worker of a compose stack is the proxy's peer as the same uid,
    so the peer's credentials cannot tell one from another. Each sandbox sends a random
    owner token of its own (OWNER_HEADER); the proxy binds a container, and each exec, to
    the token that made it: another client (another tool worker) can neither exec into,
    attach to nor start it, and a client without a token may not create or exec at all.
    The sandbox's own calls go on."""
    url, _ = proxy
    cid = sandbox.container_ids[0]
    user = sandbox.cfg.call_user
    other = docker.DockerClient(base_url=url, timeout=30)
    anonymous = docker.DockerClient(base_url=url, timeout=30)
    try:
        other.api.headers[OWNER_HEADER] = secrets.token_hex(16)
        why = _refused(lambda: other.api.exec_create(cid, ["id"], user=user))
        assert "another client's sandbox" in why
        assert "another client's sandbox" in _refused(lambda: other.api.start(cid))
        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        with pytest.raises(docker.errors.APIError, match="another client's sandbox"):
            other.api.attach_socket(cid, params=params)
        why = _refused(lambda: anonymous.api.exec_create(cid, ["id"], user=user))
        assert OWNER_HEADER in why
        opts = {**sandbox._run_options(), "name": f"streamrl-{NS}-anonymous"}
        image = opts.pop("image", sandbox.cfg.image)
        why = _refused(functools.partial(anonymous.containers.create, image, **opts))
        assert OWNER_HEADER in why
        # An exec made by the owner is the owner's too.
        own = sandbox.client.api.exec_create(cid, ["true"], user=user)["Id"]
        assert "another client's exec" in _refused(lambda: other.api.exec_inspect(own))
        assert sandbox.client.api.exec_inspect(own)["ID"] == own
    finally:
        other.close()
        anonymous.close()
    r = py(sandbox, "print('mine')")
    assert (r.exit_code, r.stdout) == (0, b"mine\n"), r


def _raw(url: str, request: bytes) -> tuple[int, str]:
    """Send one raw request to the proxy; its status and the message of its JSON body."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(url.removeprefix("unix://"))
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)["message"] if status != 200 else body.decode()


def test_framing_the_sdk_never_sends_is_refused(proxy: tuple[str, Path]) -> None:
    url = proxy[0]
    chunked = (
        b"POST /v1.41/containers/create HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    )
    status, message = _raw(url, chunked)
    assert status == 403 and "Transfer-Encoding on a request" in message
    status, message = _raw(url, b"GET /_ping HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert status == 431 and "request head over" in message
    big = b"POST /v1.41/containers/create HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n"
    status, message = _raw(url, big)
    assert status == 413 and "over the 1048576 byte limit" in message
    status, message = _raw(url, b"GET /v1.41/_ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, message) == (200, "OK")  # and the proxy still serves


@pytest.fixture
def tight_proxy(engine: docker.DockerClient, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A proxy with compose-like caps: 256 MiB, 64 pids, 1 CPU, 2 live containers, streams
    idle for 2 s closed."""
    flags = ["--max-memory-mb", "256", "--max-pids", "64", "--max-cpus", "1"]
    flags += ["--max-containers", "2", "--stream-idle-s", "2"]
    yield from _serve_proxy(tmp_path, *flags)


def test_the_proxy_enforces_its_flags(
    tight_proxy: tuple[str, Path], engine: docker.DockerClient
) -> None:
    """Review N6: caps from flags (a create over them is refused), a live-container quota
    (the third create is refused, 429, until one is removed), and an attach stream that
    moves nothing for --stream-idle-s is closed (the call server then ends: its container is
    replaced at the next call, which still succeeds)."""
    url, log = tight_proxy
    ns = f"{NS}-tight"
    big = ContainerConfig(namespace=ns, docker_host=url, memory_bytes=512 * 2**20, pool_size=0)
    with ContainerSandbox(big) as sb, pytest.raises(Exception, match="Memory"):
        sb.exec(["true"], b"", 5.0, CAP)
    fits = dict(namespace=ns, docker_host=url, memory_bytes=256 * 2**20, pids_limit=64)
    with ContainerSandbox(ContainerConfig(**fits, pool_size=2)) as two:  # type: ignore[arg-type]
        two.start()
        assert len(two.container_ids) == 2
        third = ContainerSandbox(ContainerConfig(**fits, pool_size=0))  # type: ignore[arg-type]
        with pytest.raises(Exception, match="quota") as info:
            third.exec(["true"], b"", 5.0, CAP)
        assert "429" in str(info.value)
        # Idle past --stream-idle-s: the proxy closes both call servers' streams.
        deadline = time.monotonic() + 30
        while log.read_text().count("sandbox_proxy_stream_idle") < 2:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        r = two.exec(["sh", "-c", "echo still"], b"", 10.0, CAP)
        assert r.stdout == b"still\n", r
    # `two` closed: its containers are gone, so the quota has room again.
    with third:
        assert third.exec(["sh", "-c", "echo room"], b"", 10.0, CAP).stdout == b"room\n"
    assert labelled(engine, ns) == []
