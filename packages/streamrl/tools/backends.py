"""Choosing a tool worker's sandbox backend.

    kind        what runs a call                                      needs
    container   a warm, hardened container (streamrl.tools.containers) DOCKER_HOST + the image
    bwrap       fresh namespaces under bubblewrap (streamrl.tools.bwrap) bwrap, user namespaces
    subprocess  a child process with rlimits (streamrl.tools.sandbox)    prlimit; NOT isolated
    auto        container, else bwrap; never subprocess

Only `tools.sandbox = "subprocess"`, set explicitly, runs code the policy wrote without
isolation (logged at error level at every start). Under `auto` with neither isolating
backend here, a tool that runs such code (`Tool.needs_isolation`: python, shell, the code
task's tests, every user tool unless it says otherwise) fails each call with
`SandboxUnavailableError` naming the fix (an infrastructure error for the rollout side); a
tool that needs no isolation (the calculator, a parser) runs as a plain subprocess with
limits. `auto` probes the stronger backends again on later calls, with a backoff, so an
engine that was down at start is picked up once it answers; the container backend itself
retries the engine on every call, so an outage costs the calls made during it, not the
worker's life.

A worker builds one `WorkerSandbox` at start, picks a sandbox from it for every call, and
closes it when it stops (on SIGTERM too): only the container backend holds anything (its
pool), but every backend has `close()`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from streamrl.config import SandboxKind
from streamrl.tools.bwrap import BubblewrapConfig, BubblewrapSandbox
from streamrl.tools.containers import ContainerConfig, ContainerSandbox
from streamrl.tools.sandbox import Sandbox, SandboxUnavailableError, SubprocessSandbox

# The isolating backends, strongest first: what `auto` may use.
ISOLATING: tuple[SandboxKind, ...] = ("container", "bwrap")
FIX = (
    "run `make sandbox-host` (as root) and export "
    "DOCKER_HOST=unix:///run/streamrl-podman.sock "
    "CONTAINERS_CONF=/etc/streamrl/containers.conf (containers); or install bubblewrap "
    '(apt-get install bubblewrap); or set tools.sandbox = "subprocess" to run it with '
    "no isolation at all"
)
# `auto` probes the backends it lacks again after this long, doubling up to the cap.
RETRY_MIN_S = 2.0
RETRY_MAX_S = 15.0


class ClosableSandbox(Sandbox, Protocol):
    def close(self) -> None: ...


def make_sandbox(
    kind: SandboxKind,
    *,
    container: ContainerConfig | None = None,
    bwrap: BubblewrapConfig | None = None,
    subprocess_memory_bytes: int = 512 * 2**20,
    log: structlog.stdlib.BoundLogger | None = None,
) -> ClosableSandbox:
    """A ready sandbox of `kind`; raises `SandboxUnavailableError` if that kind cannot run.

    `container` configures the container backend (image, namespace label, worker id,
    limits, pool; DOCKER_HOST is read from the environment unless it sets `docker_host`);
    its orphans (containers of dead workers) are reaped and its pool warmed before this
    returns. `bwrap` configures the bubblewrap backend and `subprocess_memory_bytes` the
    plain one. "auto" is the first isolating backend that works (container, bwrap), never
    the plain one: with neither, the error says why each failed and how to fix it.
    """
    log = log or structlog.get_logger()
    if kind != "auto":
        sandbox = _build(kind, container, bwrap, subprocess_memory_bytes, log)
        log.info("sandbox_backend", kind=kind)
        return sandbox
    skipped: dict[str, str] = {}
    for candidate in ISOLATING:
        try:
            sandbox = _build(candidate, container, bwrap, subprocess_memory_bytes, log)
        except SandboxUnavailableError as err:
            skipped[candidate] = str(err)
            continue
        _log_choice(log, candidate, skipped)
        return sandbox
    raise SandboxUnavailableError(f"no isolating sandbox here ({_reasons(skipped)}); {FIX}")


def builder(
    *,
    container: ContainerConfig | None = None,
    bwrap: BubblewrapConfig | None = None,
    subprocess_memory_bytes: int = 512 * 2**20,
    log: structlog.stdlib.BoundLogger | None = None,
) -> Callable[[SandboxKind], ClosableSandbox]:
    """`kind -> a ready sandbox of that kind` (no "auto"), for `WorkerSandbox`."""
    blog = log or structlog.get_logger()

    def build(kind: SandboxKind) -> ClosableSandbox:
        return _build(kind, container, bwrap, subprocess_memory_bytes, blog)

    return build


class WorkerSandbox:
    """The sandboxes of one tool worker, per `tools.sandbox` (see the module doc).

    `build(kind)` makes a ready sandbox of one concrete kind or raises
    `SandboxUnavailableError` (`builder`; tests inject their own); `clock` is monotonic
    seconds. An explicit container or bwrap that cannot start raises here, as a worker that
    cannot serve its configuration should; `auto` starts with whatever it has, even
    nothing. Thread-safe.
    """

    def __init__(
        self,
        kind: SandboxKind,
        build: Callable[[SandboxKind], ClosableSandbox],
        log: structlog.stdlib.BoundLogger,
        *,
        clock: Callable[[], float] = time.monotonic,
        retry_min_s: float = RETRY_MIN_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self.kind = kind
        self._build = build
        self.log = log
        self._clock = clock
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._retry_s = retry_min_s
        self._next_probe = clock()
        self._lock = threading.Lock()
        self._current: ClosableSandbox | None = None
        self._current_kind: SandboxKind | None = None
        self._plain: ClosableSandbox | None = None
        self._skipped: dict[str, str] = {}
        if kind == "auto":
            self._probe()
        else:
            self._current, self._current_kind = build(kind), kind
            if kind == "subprocess":
                self.log.error(
                    "sandbox_backend",
                    kind=kind,
                    isolated=False,
                    warning="tools.sandbox = subprocess: tool calls run with rlimits only, "
                    "as this worker's user, with its network and file system",
                )
            else:
                self.log.info("sandbox_backend", kind=kind)

    @property
    def active(self) -> SandboxKind | None:
        """The backend that runs calls now (None: `auto` found no isolating one yet)."""
        return self._current_kind

    def for_call(self, tool: str, needs_isolation: bool) -> Sandbox:
        """The sandbox for one call of `tool`; raises `SandboxUnavailableError` (with the
        fix) when the tool needs isolation and no isolating backend is up."""
        with self._lock:
            weaker = self.kind == "auto" and self._current_kind != ISOLATING[0]
            if weaker and self._clock() >= self._next_probe:
                self._probe()
            if self._current is not None:
                return self._current
            if not needs_isolation:
                if self._plain is None:
                    self._plain = self._build("subprocess")
                return self._plain
        raise SandboxUnavailableError(
            f"tool `{tool}` runs code the policy wrote and needs an isolating sandbox, "
            f"but none is available here ({_reasons(self._skipped)}); to fix it, {FIX}"
        )

    def close(self) -> None:
        with self._lock:
            boxes = [b for b in (self._current, self._plain) if b is not None]
            self._current = self._plain = None
            self._current_kind = None
        for box in boxes:
            box.close()

    def _probe(self) -> None:
        """Try the isolating backends stronger than the current one, strongest first; while
        the strongest is not up, schedule the next probe (under the lock, or from
        `__init__`)."""
        for kind in ISOLATING:
            if kind == self._current_kind:
                break
            try:
                box = self._build(kind)
            except SandboxUnavailableError as err:
                self._skipped[kind] = str(err)
                continue
            self._switch(kind, box)
            break
        if self._current_kind == ISOLATING[0]:
            return
        self._next_probe = self._clock() + self._retry_s
        if self._current_kind is None:
            self.log.error(
                "sandbox_unavailable", skipped=dict(self._skipped), retry_in_s=self._retry_s,
                fix=FIX,
            )  # fmt: skip
        self._retry_s = min(2 * self._retry_s, self._retry_max_s)

    def _switch(self, kind: SandboxKind, box: ClosableSandbox) -> None:
        old, old_kind = self._current, self._current_kind
        self._current, self._current_kind = box, kind
        self._skipped.pop(kind, None)
        self._retry_s = self._retry_min_s
        if old_kind is None and not self._skipped:
            self.log.info("sandbox_backend", kind=kind, auto=True)
        else:  # a weaker backend than asked for, or a stronger one than before
            self.log.warning(
                "sandbox_backend", kind=kind, auto=True, replaced=old_kind,
                skipped=dict(self._skipped),
            )  # fmt: skip
        if old is not None:
            with contextlib.suppress(SandboxUnavailableError):
                old.close()


def _build(
    kind: SandboxKind,
    container: ContainerConfig | None,
    bwrap: BubblewrapConfig | None,
    subprocess_memory_bytes: int,
    log: structlog.stdlib.BoundLogger,
) -> ClosableSandbox:
    if kind == "container":
        sandbox = ContainerSandbox(container or ContainerConfig(), log)
        try:
            sandbox.reap_orphans()
            sandbox.start()
        except BaseException:
            sandbox.close()
            raise
        return sandbox
    if kind == "bwrap":
        return BubblewrapSandbox(bwrap)
    if kind == "subprocess":
        return SubprocessSandbox(subprocess_memory_bytes)
    raise ValueError(f"unknown sandbox kind {kind!r}")


def _reasons(skipped: dict[str, str]) -> str:
    return "; ".join(f"{kind}: {why}" for kind, why in skipped.items()) or "none probed"


def _log_choice(log: structlog.stdlib.BoundLogger, kind: str, skipped: dict[str, str]) -> None:
    if skipped:
        log.warning("sandbox_backend", kind=kind, auto=True, skipped=skipped)
    else:
        log.info("sandbox_backend", kind=kind, auto=True)
