"""Who owns a run directory: one `streamrl up` at a time, and the processes it started.

`streamrl up` holds an exclusive flock on `RUN_DIR/launcher.lock` for its whole life; the
kernel drops it when the launcher dies, however it dies, so a second launcher on the same
directory refuses to start while the first lives, and starts after a crash. The launcher
records the pid and start time of every process it starts (the embedded Redis, each
worker) in `RUN_DIR/launcher.procs.json` (with the run's namespace and the workers'
Prometheus ports, which `streamrl status` reads); `streamrl up --resume` of a run whose launcher
was SIGKILLed stops those still running (its orphans) before it starts its own. A pid
names the same process only with the same start time: a reused pid is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from pathlib import Path

import structlog

LOCK_FILE = "launcher.lock"
PROCS_FILE = "launcher.procs.json"
REDIS = "redis"  # the embedded server's name in the record (workers go by their ids)
EVALUATOR = "evaluator"  # the run's evaluator's (trainer.eval_every), its own session


class RunDirBusyError(RuntimeError):
    """Another launcher holds the run directory."""


class RunDirLock:
    """The launcher's exclusive hold on a run directory (`acquire`, then `release`)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirBusyError(
                f"run directory {self.path.parent} is in use by another `streamrl up` "
                f"(pid {holder}); stop it first, or choose another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock
            self._fd = None


def start_time(pid: int) -> int | None:
    """Process `pid`'s start time (clock ticks since boot), or None when it is gone or a
    zombie (a PID 1 that reaps slowly may hold it, and it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def record(
    run_dir: Path, pids: dict[str, int], run: str = "", ports: dict[str, int] | None = None
) -> None:
    """Write the record of the processes the launcher runs now (name -> pid), with the
    run's namespace and the workers' Prometheus ports (what `streamrl status` reads)."""
    procs = {name: {"pid": pid, "start": start_time(pid)} for name, pid in pids.items()}
    path = run_dir / PROCS_FILE
    tmp = path.with_suffix(".tmp")
    data = {"launcher": os.getpid(), "run": run, "procs": procs, "prometheus_ports": ports or {}}
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def recorded_run(run_dir: Path) -> str | None:
    """The run namespace the record of `run_dir` names (None: no record, or none in it)."""
    try:
        data = json.loads((run_dir / PROCS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return str(data.get("run") or "") or None


def orphans(run_dir: Path) -> dict[str, int]:
    """Name -> pid of the recorded processes that still run (same pid, same start)."""
    try:
        data = json.loads((run_dir / PROCS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {
        name: int(p["pid"])
        for name, p in data.get("procs", {}).items()
        if p.get("start") is not None and start_time(int(p["pid"])) == p["start"]
    }


def stop_orphans(
    run_dir: Path, log: structlog.stdlib.BoundLogger, timeout_s: float
) -> dict[str, int]:
    """Stop what a dead launcher left running: its workers' process groups (SIGTERM, then
    SIGKILL after `timeout_s`), then its embedded Redis (which fsyncs its AOF on SIGTERM).
    Returns what was found (name -> pid)."""
    found = orphans(run_dir)
    if not found:
        return found
    log.warning("orphans_found", procs=found)
    workers = {n: p for n, p in found.items() if n != REDIS}
    _stop({n: (p, start_time(p)) for n, p in workers.items()}, timeout_s, group=True)
    if REDIS in found:
        pid = found[REDIS]
        _stop({REDIS: (pid, start_time(pid))}, timeout_s, group=False)
    log.info("orphans_stopped", procs=found)
    return found


def _stop(procs: dict[str, tuple[int, int | None]], timeout_s: float, group: bool) -> None:
    def running() -> list[int]:
        return [pid for pid, start in procs.values() if start and start_time(pid) == start]

    def send(sig: signal.Signals) -> None:
        for pid in running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig) if group else os.kill(pid, sig)

    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    send(signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
