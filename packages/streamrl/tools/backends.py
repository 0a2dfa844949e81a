"""Choosing a tool worker's sandbox backend.

    kind        what runs a call                                      needs
    container   a warm, hardened container (streamrl.tools.containers) DOCKER_HOST + the image
    bwrap       fresh namespaces under bubblewrap (streamrl.tools.bwrap) bwrap, user namespaces
    subprocess  a child process with rlimits (streamrl.tools.sandbox)    prlimit; NOT isolated
    auto        the first of container, bwrap, subprocess that works here

A worker builds one sandbox at start, passes it to every call, and closes it when it stops
(on SIGTERM too): only the container backend holds anything (its pool), but every backend
has `close()`.
"""

from __future__ import annotations

from typing import Literal, Protocol

import structlog

from streamrl.tools.bwrap import BubblewrapConfig, BubblewrapSandbox
from streamrl.tools.containers import ContainerConfig, ContainerSandbox
from streamrl.tools.sandbox import Sandbox, SandboxUnavailableError, SubprocessSandbox

SandboxKind = Literal["container", "bwrap", "subprocess", "auto"]


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
    plain one. "auto" falls back in the order of the module's table and logs what it
    skipped and why (a warning: every fallback is weaker isolation).
    """
    log = log or structlog.get_logger()
    if kind != "auto":
        sandbox = _build(kind, container, bwrap, subprocess_memory_bytes, log)
        log.info("sandbox_backend", kind=kind)
        return sandbox
    skipped: dict[str, str] = {}
    for candidate in ("container", "bwrap"):
        try:
            sandbox = _build(candidate, container, bwrap, subprocess_memory_bytes, log)
        except SandboxUnavailableError as err:
            skipped[candidate] = str(err)
            continue
        _log_choice(log, candidate, skipped)
        return sandbox
    sandbox = SubprocessSandbox(subprocess_memory_bytes)
    _log_choice(log, "subprocess", skipped)
    return sandbox


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


def _log_choice(log: structlog.stdlib.BoundLogger, kind: str, skipped: dict[str, str]) -> None:
    if skipped:
        log.warning("sandbox_backend", kind=kind, auto=True, skipped=skipped)
    else:
        log.info("sandbox_backend", kind=kind, auto=True)
