"""Hardened containers for tool calls, driven through the Docker API (podman serves it).

A `ContainerSandbox` keeps a small pool of warm containers and runs each call in one of
them with `exec`. A container has no network, a read-only root, tmpfs /tmp and /work, no
capabilities, no-new-privileges, an init as PID 1, and memory, pid and CPU limits. Its own
processes (init, a keep-alive `sleep`) run as nobody; calls run as uid 20001, so a call
can neither signal them nor be signalled by them.

One call runs under a wrapper shell, in the image as /opt/streamrl/sh, execute-only so the
kernel makes it non-dumpable (the call cannot ptrace it or write its memory). The wrapper
waits for a go-line on stdin (so no output races the HTTP upgrade), runs the call, then
kills every leftover process of the call's uid, empties every writable place (/work, /tmp,
/var/tmp, /dev/shm, /dev/mqueue) and removes SysV IPC objects: the next call finds the
container as new. A call that hits any limit (time, output cap, memory, pids),
dies of a signal or disturbs its wrapper gets its container recycled: killed, removed and
replaced. Containers are also recycled after `recycle_after` calls or `max_age_s`.

Every container is labelled with its namespace, worker and owning process (host, pid, pid
start time); `close()` removes a sandbox's own containers and `reap_orphans()` removes those
whose owner is dead. The image is built by ops/sandbox/setup_host.sh (nothing is pulled).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import selectors
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import docker
import docker.errors
import requests
import structlog
from docker.models.containers import Container
from docker.types import Ulimit

from streamrl.tools.callclient import (
    CallChannel,
    CallChannelError,
    Reply,
    exec_result,
    serve_once,
    server_command,
)
from streamrl.tools.sandbox import ExecResult, SandboxUnavailableError, portable_argv

DEFAULT_IMAGE = "streamrl-sandbox:1"
LABEL = "streamrl.sandbox"  # value: the namespace
LABEL_WORKER = "streamrl.worker"
LABEL_OWNER = "streamrl.owner"  # host:pid:start ticks of the owning process
LABEL_CREATED = "streamrl.created"  # unix seconds
# Sent on every engine request: a random token per sandbox, to which the sandbox proxy
# binds the containers and execs it creates (review N6: compose's tool workers share a uid).
OWNER_HEADER = "X-Streamrl-Owner"
WORKDIR = "/work"
# Every place a call may write (podman mounts tmpfs on /var/tmp and /dev/shm of a read-only
# container too): emptied after each call.
WRITABLE = (WORKDIR, "/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")
# A call's whole environment on the call-server path (an exec gets the image's PATH and
# LANG, then these two).
CALL_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": WORKDIR,
    "TMPDIR": "/tmp",
}
WRAPPER = "/opt/streamrl/sh"
_DEFAULT_URL = "unix:///var/run/docker.sock"  # the SDK's, when DOCKER_HOST is unset
SETUP_HINT = "run ops/sandbox/setup_host.sh (as root) and export DOCKER_HOST"

# $@ is the call's argv. `kill -9 -1` reaches every process this uid may signal in the
# container's pid namespace except the wrapper itself: the call's leftovers, never init or
# the keep-alive (other uid). Then every writable place is emptied (podman mounts tmpfs on
# /var/tmp and /dev/shm of a read-only container too) and SysV IPC objects go. A cleanup
# that fails kills the wrapper, which recycles the container.
_WRAPPER_SCRIPT = """read -r _ || exit 125
"$@"
rc=$?
kill -9 -1 2>/dev/null
set --
for d in WRITABLE; do [ -d "$d" ] && set -- "$@" "$d"; done
{ find "$@" -mindepth 1 -delete || {
  find "$@" -mindepth 1 -type d -exec chmod u+rwx {} \\;
  find "$@" -mindepth 1 -delete
} } 2>/dev/null || kill -9 $$
ipcrm --all 2>/dev/null
exit $rc
""".replace("WRITABLE", " ".join(WRITABLE))
_GO = b"go\n"
# Exit statuses after which a container is not reused: the wrapper's own failure (125) and
# death by a signal (128+n), which is also how a killed wrapper shows.
_WRAPPER_FAILED = 125
_SIGNALLED = 128
_SIGKILL_STATUS = 128 + 9
_FRAME = struct.Struct(">BxxxL")  # the Docker API's stream multiplexing header
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Podman reports on the call's stderr that its stdin copier lost the attach socket when a
# call exits without reading all of its stdin: not the call's output, so it is dropped.
_PODMAN_ATTACH_NOISE = re.compile(
    rb"Error: (?:read|write) unixpacket \S*attach: (?:read|write): connection reset by peer\n\Z"
)
_ENGINE_ERRORS = (docker.errors.DockerException, requests.RequestException, OSError)
# A create that had to wait for a start slot (max_starting) waits up to this much more, so
# the creates let through together do not all reach the engine in the same instant.
_START_JITTER_S = 0.02
# RLIMIT_NPROC of a container's processes (see `_run_options`).
_NPROC = 8192


def _own_owner() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid)}"


@dataclass(frozen=True)
class ContainerConfig:
    """How the sandbox's containers are made. Sizes are bytes, times seconds."""

    image: str = DEFAULT_IMAGE
    namespace: str = "default"  # value of the `streamrl.sandbox` label (e.g. the run name)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    memory_bytes: int = 256 * 2**20  # RAM of one container, tmpfs included; no swap
    pids_limit: int = 64  # processes and threads in one container, init included
    cpus: float = 1.0  # CPU share of one container
    tmpfs_bytes: int = 64 * 2**20  # size of each of /tmp and /work
    # uid:gid the calls run as: none of the stack's (10001), see callserver.DEFAULT_CALL_UID
    call_user: str = "20001:20001"
    keeper_user: str = "65534:65534"  # uid:gid of the container's init and keep-alive
    recycle_after: int = 200  # calls before a container is replaced
    max_age_s: float = 3600.0  # a container older than this is replaced at its next use
    pool_size: int = 1  # warm containers kept idle
    # Containers this sandbox holds at once (idle, running a call or starting): a call
    # that finds none idle and the cap reached waits for one (up to api_timeout_s).
    max_containers: int = 8
    max_starting: int = 2  # container creates and starts in flight at once
    api_timeout_s: float = 30.0  # one Docker API request
    docker_host: str | None = None  # engine URL; None: DOCKER_HOST from the environment
    # Calls through the call server, the container's main process, over one attached
    # stream (streamrl.tools.callserver); False: an exec per call.
    call_server: bool = True

    def __post_init__(self) -> None:
        if not _NAME_OK.match(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must match {_NAME_OK.pattern}")
        if self.memory_bytes < 16 * 2**20 or self.tmpfs_bytes < 2**20:
            raise ValueError("memory_bytes must be >= 16 MiB and tmpfs_bytes >= 1 MiB")
        if 2 * self.tmpfs_bytes > self.memory_bytes:  # the sandbox proxy refuses it too
            raise ValueError(
                f"tmpfs_bytes ({self.tmpfs_bytes}) x 2 (/tmp and /work) must fit in "
                f"memory_bytes ({self.memory_bytes}): tmpfs pages are the container's memory"
            )
        if self.pids_limit < 8 or self.recycle_after < 1 or self.pool_size < 0:
            raise ValueError("pids_limit must be >= 8, recycle_after >= 1, pool_size >= 0")
        if self.max_containers < self.pool_size + 1 or self.max_starting < 1:
            raise ValueError(
                f"max_containers ({self.max_containers}) must be >= pool_size + 1 "
                f"({self.pool_size + 1}: the warm pool and a call) and max_starting >= 1"
            )
        if not 0.01 <= self.cpus <= 1024 or self.max_age_s <= 0 or self.api_timeout_s <= 0:
            raise ValueError("cpus must be in [0.01, 1024]; max_age_s, api_timeout_s > 0")
        if self.call_user.split(":")[0] == self.keeper_user.split(":")[0]:
            raise ValueError("call_user and keeper_user must differ (see the module doc)")


@dataclass
class _Warm:
    container: Container
    started: float  # time.monotonic()
    calls: int = 0
    attached: _Attached | None = None  # the call server's stdio (call_server only)
    channel: CallChannel | None = None


class ContainerSandbox:
    """The container backend of the `Sandbox` protocol; thread-safe, one call per container.

    Construction checks that the engine answers and has the image, and raises
    `SandboxUnavailableError` otherwise; `start()` warms the pool (else the first call
    starts a container). Call `close()` (or use it as a context manager) to remove the
    sandbox's containers.
    """

    def __init__(
        self, config: ContainerConfig, log: structlog.stdlib.BoundLogger | None = None
    ) -> None:
        self.cfg = config
        self.log = (log or structlog.get_logger()).bind(sandbox="container", ns=config.namespace)
        url = config.docker_host or os.environ.get("DOCKER_HOST")
        # What error messages call the engine: the URL, and where it came from.
        self.where = f"DOCKER_HOST={url}" if url else f"{_DEFAULT_URL} (DOCKER_HOST is unset)"
        self.client = _connect(config, url or _DEFAULT_URL, self.where)
        # This sandbox's token (the SDK's session sends it on every request): the proxy
        # binds what this sandbox creates to it. A direct engine ignores it.
        self.client.api.headers[OWNER_HEADER] = secrets.token_hex(16)
        self.owner = _own_owner()
        self._idle: list[_Warm] = []
        self._live: dict[str, _Warm] = {}
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)  # a container went idle or left
        self._creating = 0  # creates reserved under max_containers, not yet in _live
        self._starts = threading.BoundedSemaphore(config.max_starting)
        self._closed = False
        try:
            self.client.images.get(config.image)
        except docker.errors.ImageNotFound:
            self.client.close()
            raise SandboxUnavailableError(
                f"sandbox image {config.image!r} is missing on the engine at {self.where}; "
                f"images are built, never pulled: {SETUP_HINT}"
            ) from None
        except _ENGINE_ERRORS as err:
            self.client.close()
            raise SandboxUnavailableError(f"engine at {self.where}: {err}") from err

    def __enter__(self) -> ContainerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def container_ids(self) -> list[str]:
        """Ids of the containers this sandbox holds now (idle or running a call)."""
        with self._lock:
            return list(self._live)

    def start(self) -> None:
        """Fill the pool up to `pool_size` warm containers (as `max_containers` allows)."""
        while True:
            with self._lock:
                if self._closed or len(self._idle) >= self.cfg.pool_size or not self._room():
                    return
                self._creating += 1
            warm = self._new_container()
            with self._lock:
                self._idle.append(warm)
                self._free.notify()

    def exec(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        if self.cfg.call_server:
            return self._serve(portable_argv(argv, "python3"), stdin, time_limit_s, output_cap)
        start = time.monotonic()
        warm, exec_id, stream = self._attach(portable_argv(argv, "python3"))
        # The limit counts from the call's start, not from a container start before it.
        deadline = time.monotonic() + time_limit_s
        try:
            try:
                out, err, timed_out, cut = _pump(stream.raw, _GO + stdin, deadline, output_cap)
            finally:
                stream.close()
            status = None if timed_out or cut else self._exit_status(exec_id, deadline)
        except BaseException:
            self._remove(warm, "error")
            raise
        warm.calls += 1
        reusable = status is not None and status < _SIGNALLED and status != _WRAPPER_FAILED
        if reusable and not self._expired(warm):
            self._release(warm)
        elif reusable:
            self._recycle(warm, "expired")
        else:
            self._recycle(
                warm, "timeout" if timed_out else "output_cap" if cut else f"exit_{status}"
            )
        err = _PODMAN_ATTACH_NOISE.sub(b"", err)
        if status == _SIGKILL_STATUS:
            err += self._sigkill_note()
        return ExecResult(
            exit_code=_exit_code(status),
            stdout=out,
            stderr=err,
            timed_out=timed_out,
            truncated=cut,
            duration_s=time.monotonic() - start,
        )

    def _serve(
        self, argv: list[str], stdin: bytes, time_limit_s: float, output_cap: int
    ) -> ExecResult:
        """One call through a warm container's call server. A channel found broken before
        the call began (the container died while idle) is retried once in a fresh one."""

        def call(channel: CallChannel) -> Reply:
            return channel.call(
                argv, stdin, time_limit_s, output_cap, CALL_ENV, WORKDIR, self.cfg.tmpfs_bytes
            )

        def retried(reply: Reply) -> None:
            self.log.warning("sandbox_server_retry", error=reply.error)

        reply = serve_once(self._acquire, _channel, self._settle, call, retried)
        r = reply.result
        killed = r.exit_code == -9 and not (r.timed_out or r.truncated)
        return exec_result(reply, self._sigkill_note() if killed else b"")

    def _settle(self, warm: _Warm, reply: Reply | None) -> None:
        """After a call server's call: the container back to the pool, or retired (its
        reply says it may not serve again, it served its time, or the call raised)."""
        if reply is None:
            self._recycle(warm, "error")  # neither idle nor kept: not leaked (N16)
            return
        warm.calls += 1
        if reply.reusable and not self._expired(warm):
            self._release(warm)
        else:
            self._recycle(warm, _reason(reply))

    def _sigkill_note(self) -> bytes:
        mib = self.cfg.memory_bytes >> 20
        return f"\n[sandbox: killed by SIGKILL (the memory limit is {mib} MiB)]".encode()

    def close(self) -> None:
        """Remove every container of this sandbox; later calls raise."""
        with self._lock:
            self._closed = True
            live = list(self._live.values())
            self._idle.clear()
            self._free.notify_all()  # calls waiting for a container: the sandbox is closed
        for warm in live:
            self._remove(warm, "close")
        left = self.container_ids
        self.client.close()
        if left:
            raise SandboxUnavailableError(
                f"could not remove sandbox containers {left}; reap_orphans() will once "
                "this process is gone"
            )

    def reap_orphans(self) -> int:
        """Remove sandbox containers whose owner is dead; returns how many.

        A container of any namespace whose owning process ran on this host and is gone (pid
        missing or reused) goes. Of this namespace, one owned on another host goes once it
        is older than twice `max_age_s`: a live owner replaces its containers by then.
        """
        removed = 0
        try:
            # sparse: the list's own entries (labels included), no inspect of each one. A
            # full list inspects every container it found, and one removed meanwhile (by
            # another worker) failed the whole list: podman answers 500, not 404, so the
            # SDK's ignore_removed does not help; `auto` then fell back to bwrap (CI).
            found = self.client.containers.list(all=True, filters={"label": LABEL}, sparse=True)
        except _ENGINE_ERRORS as err:
            raise SandboxUnavailableError(f"cannot list containers: {err}") from err
        for c in found:
            labels: dict[str, str] = c.attrs.get("Labels") or {}
            alive = _owner_alive(labels.get(LABEL_OWNER, ""))
            age = time.time() - float(labels.get(LABEL_CREATED, "0"))
            stale = labels.get(LABEL) == self.cfg.namespace and age > 2 * self.cfg.max_age_s
            if alive is False or (alive is None and stale):
                try:
                    _remove_quietly(c)
                except docker.errors.APIError as err:
                    self.log.error("sandbox_reap_failed", id=c.short_id, error=str(err))
                    continue
                removed += 1
        self.log.info("sandbox_reap", removed=removed, seen=len(found))
        return removed

    # -- the pool

    def _room(self) -> bool:
        """Whether one more container fits under `max_containers` (caller holds _lock)."""
        return len(self._live) + self._creating < self.cfg.max_containers

    def _acquire(self) -> _Warm:
        """A warm container for one call: an idle one, else a new one; with
        `max_containers` held and none idle, the call waits for one to come free."""
        deadline = time.monotonic() + self.cfg.api_timeout_s
        while True:
            warm, stale, create = self._take(deadline)
            for s in stale:
                self._remove(s, "expired")
            if warm is not None:
                return warm
            if create:
                return self._new_container()
            # Only expired ones were idle: their removal made room; look again.

    def _take(self, deadline: float) -> tuple[_Warm | None, list[_Warm], bool]:
        """Under the lock: (an idle container, the expired idle ones met, whether a create
        is reserved). Waits while the cap is reached and none is idle."""
        stale: list[_Warm] = []
        with self._lock:
            while True:
                if self._closed:
                    raise SandboxUnavailableError("the container sandbox is closed")
                while self._idle:
                    candidate = self._idle.pop()
                    if not self._expired(candidate):
                        return candidate, stale, False
                    stale.append(candidate)
                if stale:
                    return None, stale, False
                if self._room():
                    self._creating += 1
                    return None, stale, True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxUnavailableError(
                        f"no sandbox container came free in {self.cfg.api_timeout_s:g} s "
                        f"(tools.max_containers {self.cfg.max_containers}, all busy)"
                    )
                self._free.wait(left)

    def _release(self, warm: _Warm) -> None:
        with self._lock:
            keep = not self._closed and len(self._idle) < self.cfg.pool_size
            if keep:
                self._idle.append(warm)
                self._free.notify()
        if not keep:
            self._remove(warm, "pool_full")

    def _recycle(self, warm: _Warm, reason: str) -> None:
        self._remove(warm, reason)
        try:
            self.start()
        except SandboxUnavailableError as err:
            # The call's result stands; the next call meets the engine's failure itself.
            self.log.warning("sandbox_refill_failed", error=str(err))

    def _expired(self, warm: _Warm) -> bool:
        age = time.monotonic() - warm.started
        return warm.calls >= self.cfg.recycle_after or age >= self.cfg.max_age_s

    def _new_container(self) -> _Warm:
        """Create and start a container on a reservation (`_creating`) the caller took,
        with at most `max_starting` creates in flight."""
        if not self._starts.acquire(blocking=False):
            self._starts.acquire()
            time.sleep(random.uniform(0, _START_JITTER_S))
        try:
            return self._create_and_start()
        finally:
            self._starts.release()

    def _create_and_start(self) -> _Warm:
        t = time.monotonic()
        options = self.server_options() if self.cfg.call_server else self._run_options()
        try:
            container = self.client.containers.create(self.cfg.image, **options)
        except BaseException as err:
            with self._lock:
                self._creating -= 1
                self._free.notify_all()
            if isinstance(err, _ENGINE_ERRORS):
                raise SandboxUnavailableError(
                    f"cannot create a sandbox container from {self.cfg.image!r} at "
                    f"{self.where}: {err}"
                ) from err
            raise
        warm = _Warm(container, time.monotonic())
        with self._lock:
            self._live[container.id or ""] = warm
            self._creating -= 1
            closed = self._closed
        try:
            if closed:  # close() ran meanwhile: this one must not outlive it
                raise SandboxUnavailableError("the container sandbox is closed")
            if self.cfg.call_server:
                self._start_server(warm)
            else:
                container.start()
        except BaseException as err:
            self._remove(warm, "start_failed")
            if isinstance(err, _ENGINE_ERRORS):
                raise SandboxUnavailableError(
                    f"cannot start a sandbox container at {self.where}: {err}"
                ) from err
            raise
        self.log.info(
            "sandbox_container_start",
            id=container.short_id,
            s=time.monotonic() - t,
            call_server=self.cfg.call_server,
        )
        return warm

    def _run_options(self) -> dict[str, Any]:
        """`containers.create` arguments: the hardening, limits and labels."""
        cfg = self.cfg
        tmpfs = f"rw,nosuid,nodev,noexec,size={cfg.tmpfs_bytes}"
        return {
            "command": ["sleep", "infinity"],
            "name": f"streamrl-{cfg.namespace}-{uuid.uuid4().hex[:12]}",
            "user": cfg.keeper_user,
            "working_dir": WORKDIR,
            "network_mode": "none",
            "read_only": True,
            "tmpfs": {"/tmp": tmpfs, WORKDIR: tmpfs},
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "init": True,
            "mem_limit": cfg.memory_bytes,
            "memswap_limit": cfg.memory_bytes,
            "pids_limit": cfg.pids_limit,
            "nano_cpus": int(cfg.cpus * 1e9),
            # Explicit limits replace the engine's defaults, which may exceed what the
            # engine itself may grant (podman as root asks for nofile=1048576).
            "ulimits": [
                Ulimit(name="core", soft=0, hard=0),
                Ulimit(name="nofile", soft=1024, hard=1024),
                # RLIMIT_NPROC counts the call uid's processes on the whole host (rootful
                # podman, no user namespace), across every sandbox: the pids cgroup
                # (pids_limit) bounds each container, and this leaves room for 128 of them
                # at their pids limit (64) while staying below what an engine may grant
                # (runc cannot raise it above the engine's own: 32768 here).
                Ulimit(name="nproc", soft=_NPROC, hard=_NPROC),
            ],
            "labels": {
                LABEL: cfg.namespace,
                LABEL_WORKER: cfg.worker_id,
                LABEL_OWNER: self.owner,
                LABEL_CREATED: f"{time.time():.0f}",
            },
        }

    def _start_server(self, warm: _Warm) -> None:
        """Attach to the created container, start it, and wait for its server's answer."""
        warm.attached, warm.channel = attach_server(
            self.client, warm.container, self.where, grace_s=self.cfg.api_timeout_s
        )
        try:
            warm.channel.ping(timeout_s=self.cfg.api_timeout_s)
        except (CallChannelError, ValueError) as err:
            raise SandboxUnavailableError(
                f"the call server in {warm.container.short_id} did not answer: {err}"
            ) from err

    def server_options(self) -> dict[str, Any]:
        """`containers.create` arguments of a container whose main process is the call
        server (`streamrl.tools.callserver`): the same hardening, limits and labels, but
        the server runs as root with only CAP_SETUID, CAP_SETGID and CAP_KILL (to run each
        call as `call_user` and stop its leftovers), reading requests on its stdin."""
        return {
            **self._run_options(),
            "command": server_command(WRITABLE, self.cfg.call_user),
            "user": "0:0",
            "cap_add": ["SETUID", "SETGID", "KILL"],
            "stdin_open": True,
        }

    def _remove(self, warm: _Warm, reason: str) -> None:
        try:
            # Killed while attached: closing the stream first makes the server exit, and
            # podman refuses a removal that meets the container stopping on its own.
            _remove_quietly(warm.container)
        except docker.errors.APIError as err:
            # It stays on the books: close() tries again, reap_orphans() after a crash.
            self.log.error(
                "sandbox_container_remove_failed",
                id=warm.container.short_id,
                reason=reason,
                error=str(err),
            )
            return
        except _ENGINE_ERRORS as err:
            raise SandboxUnavailableError(f"engine at {self.where}: {err}") from err
        finally:
            if warm.attached is not None:
                warm.attached.close()
                warm.attached = None
        with self._lock:
            self._live.pop(warm.container.id or "", None)
            self._free.notify_all()
        self.log.info(
            "sandbox_container_remove",
            id=warm.container.short_id,
            reason=reason,
            calls=warm.calls,
            age_s=round(time.monotonic() - warm.started, 3),
        )

    # -- one call

    def _attach(self, argv: list[str]) -> tuple[_Warm, str, _Attached]:
        """A container for the call and the call's started exec in it."""
        for attempt in range(2):
            warm = self._acquire()
            try:
                return warm, *self._begin(warm, argv)
            except docker.errors.APIError as err:
                # The container died between calls (its keep-alive was OOM-killed, say):
                # retry once in a fresh one; a second refusal is the engine's failure.
                self._recycle(warm, "exec_refused")
                if attempt:
                    raise SandboxUnavailableError(f"the engine refuses execs: {err}") from err
            except BaseException:
                # A transport error (a read timeout of an overloaded engine, say): the
                # container is neither idle nor kept, so it goes (review N16: it leaked).
                self._recycle(warm, "exec_failed")
                raise
        raise AssertionError("unreachable")

    def _begin(self, warm: _Warm, argv: list[str]) -> tuple[str, _Attached]:
        """Create and start the call's exec; returns its id and the attached stream."""
        api = self.client.api
        try:
            created = api.exec_create(
                warm.container.id,
                [WRAPPER, "-c", _WRAPPER_SCRIPT, "sandbox", *argv],
                stdin=True,
                stdout=True,
                stderr=True,
                user=self.cfg.call_user,
                workdir=WORKDIR,
                environment={"HOME": WORKDIR, "TMPDIR": "/tmp"},
            )
            attached = api.exec_start(created["Id"], socket=True)
        except docker.errors.APIError:
            raise
        except _ENGINE_ERRORS as err:
            raise SandboxUnavailableError(f"engine at {self.where}: {err}") from err
        return created["Id"], _Attached(attached, self.where)

    def _exit_status(self, exec_id: str, deadline: float) -> int | None:
        """The exec's exit status once the engine reports it stopped; None if it cannot."""
        while True:
            try:
                info = self.client.api.exec_inspect(exec_id)
            except docker.errors.APIError:
                return None  # the container went away under the call
            except _ENGINE_ERRORS as err:
                raise SandboxUnavailableError(f"engine at {self.where}: {err}") from err
            if not info.get("Running") or time.monotonic() > deadline:
                code = info.get("ExitCode")
                return None if info.get("Running") or code is None else int(code)
            time.sleep(0.005)


def attach_server(
    client: docker.DockerClient, container: Container, where: str, grace_s: float = 5.0
) -> tuple[_Attached, CallChannel]:
    """Attach to a created (not yet started) call-server container's stdio, then start it:
    the attached stream and the channel over it. Close the stream to end the server."""
    attached = _Attached(
        client.api.attach_socket(
            str(container.id), params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        ),
        where,
    )
    try:
        container.start()
    except BaseException:
        attached.close()
        raise
    return attached, CallChannel(attached.raw, grace_s=grace_s)


class _Closable(Protocol):
    def close(self) -> object: ...


class _Attached:
    """An exec's hijacked HTTP connection: the raw socket under the SDK's wrappers."""

    def __init__(self, attached: _Closable, where: str) -> None:
        # For unix and tcp hosts the SDK hands back a SocketIO over the connection's socket
        # (TLS and ssh transports are not supported).
        self._io = attached
        raw = getattr(attached, "_sock", attached)
        if not isinstance(raw, socket.socket):
            self.close()
            raise SandboxUnavailableError(f"unsupported engine transport at {where}")
        self.raw = raw

    def close(self) -> None:
        # Each wrapper holds a reference that keeps the socket open: close outside in.
        response = getattr(self._io, "_response", None)
        if response is not None:
            response.close()
        self._io.close()
        raw = getattr(self._io, "_sock", None)
        if isinstance(raw, socket.socket):
            raw.close()


def _channel(warm: _Warm) -> CallChannel:
    assert warm.channel is not None  # a call-server container (tools.call_server)
    return warm.channel


def _reason(reply: Reply) -> str:
    """Why a call server's container is retired after a call (or 'expired')."""
    r = reply.result
    if reply.error is not None:
        return "server_error"
    if r.timed_out or r.truncated:
        return "timeout" if r.timed_out else "output_cap"
    if r.exit_code is not None and r.exit_code < 0:
        return f"signal_{-r.exit_code}"
    return "expired" if reply.reusable else "unclean"


def _connect(cfg: ContainerConfig, url: str, where: str) -> docker.DockerClient:
    """A client of the engine at `url` (unix or plain tcp; TLS and ssh are not supported)."""
    client = None
    try:
        if url.startswith("unix://"):
            # Probe first: the SDK leaks its socket when a unix socket does not answer.
            with socket.socket(socket.AF_UNIX) as probe:
                probe.settimeout(cfg.api_timeout_s)
                probe.connect(url.removeprefix("unix://"))
        client = docker.DockerClient(base_url=url, timeout=int(cfg.api_timeout_s))
        client.ping()
    except _ENGINE_ERRORS as err:
        if client is not None:
            client.close()
        raise SandboxUnavailableError(
            f"no container engine answers at {where}: {err}; {SETUP_HINT}"
        ) from err
    return client


def _remove_quietly(container: Container, tries: int = 5) -> None:
    """Kill and remove a container; one already gone is fine.

    Podman may refuse while a killed process is still being torn down ("given PIDs did
    not die within timeout"); the next try finds it stopped.
    """
    for attempt in range(tries):
        try:
            container.remove(force=True, v=True)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError:
            if attempt == tries - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


def _exit_code(status: int | None) -> int | None:
    """A wrapper status as `subprocess` reports it: death by signal n is -n."""
    if status is not None and _SIGNALLED < status <= _SIGNALLED + 64:
        return _SIGNALLED - status
    return status


def _pump(
    sock: socket.socket, stdin: bytes, deadline: float, cap: int
) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin and read the exec's multiplexed stdout/stderr, up to `cap` bytes each,
    until the stream ends or the deadline passes; returns (stdout, stderr, timed_out,
    truncated). Sending never blocks, so a call that does not read its stdin cannot
    stall the worker."""
    sock.setblocking(False)
    todo = memoryview(stdin)
    streams = {1: bytearray(), 2: bytearray()}
    frames = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    timed_out = truncated = done = False
    try:
        while not (done or truncated):
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for _, events in sel.select(timeout=min(left, 0.5)):
                if events & selectors.EVENT_WRITE:
                    todo = _send_some(sock, todo)
                    if not todo:
                        sel.modify(sock, selectors.EVENT_READ)
                if events & selectors.EVENT_READ:
                    chunk = _recv_some(sock)
                    done = chunk == b""
                    frames += chunk or b""
                    truncated = _demux(frames, streams, cap)
    finally:
        sel.close()
    return bytes(streams[1]), bytes(streams[2]), timed_out, truncated


def _send_some(sock: socket.socket, todo: memoryview) -> memoryview:
    """Send what the socket takes now; half-close once all is sent (the call sees EOF)."""
    try:
        todo = todo[sock.send(todo[:65536]) :]
    except BlockingIOError:
        return todo
    except OSError:  # the call is gone and its stdin with it
        todo = todo[:0]
    if not todo:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
    return todo


def _recv_some(sock: socket.socket) -> bytes | None:
    """The next bytes of the stream, b"" at its end, None if none are ready."""
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return None
    except OSError:  # reset by the engine: the exec is over
        return b""


def _demux(frames: bytearray, streams: dict[int, bytearray], cap: int) -> bool:
    """Move complete frames into their streams (stdout 1, anything else to stderr);
    returns True once a stream passed `cap` (it is cut to `cap`)."""
    while len(frames) >= _FRAME.size:
        kind, size = _FRAME.unpack_from(frames)
        if len(frames) < _FRAME.size + size:
            break
        buf = streams[1 if kind == 1 else 2]
        buf += frames[_FRAME.size : _FRAME.size + size]
        del frames[: _FRAME.size + size]
        if len(buf) > cap:
            del buf[cap:]
            return True
    return False


def _start_ticks(pid: int) -> str:
    """When a process started (clock ticks since boot): with the pid, names it uniquely."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def _owner_alive(owner: str) -> bool | None:
    """Whether a container's owner (host:pid:start ticks) still runs; None when it ran on
    another host, so this one cannot tell."""
    host, _, rest = owner.partition(":")
    pid, _, ticks = rest.partition(":")
    if host != socket.gethostname():
        return None
    return pid.isdigit() and ticks != "" and _start_ticks(int(pid)) == ticks
