"""How `streamrl up` keeps a process running: one `Supervised` record for a worker and for the
evaluator alike (restarted after a backoff when it exits, up to `run.max_restarts` within
`run.restart_window_s`), and one way to stop processes (`terminate`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamrl.config import MAX_BACKOFF_S, RunConfig

Popen = subprocess.Popen[bytes]


def restart_decision(
    restarts: list[float], now: float, max_restarts: int, window_s: float
) -> int | None:
    """The number of this restart within the window (1, 2, ...), or None when the worker
    has used up `max_restarts` in the last `window_s` seconds (or may never restart)."""
    recent = [t for t in restarts if now - t <= window_s]
    if len(recent) >= max_restarts:
        return None
    return len(recent) + 1


def backoff_s(nth: int, base_s: float) -> float:
    """Wait before the nth restart in a window: base, 2 x base, 4 x base, ... capped."""
    return min(MAX_BACKOFF_S, base_s * 2.0 ** (nth - 1))


@dataclass
class Supervised:
    """A process the launcher keeps running: its Popen (None before it starts), the
    monotonic times of its restarts, when a restart is due (it has exited), and how many
    times it was killed for a liveness beat that stopped."""

    popen: Popen | None = None
    restarts: list[float] = field(default_factory=list)
    restart_at: float | None = None
    hangs: int = 0

    def schedule_restart(self, now: float, run: RunConfig) -> float | None:
        """It exited: its restart is due after the backoff (returned, in seconds), or None
        when it has used up its restarts."""
        nth = restart_decision(self.restarts, now, run.max_restarts, run.restart_window_s)
        if nth is None:
            return None
        delay = backoff_s(nth, run.restart_backoff_s)
        self.restart_at = now + delay
        return delay

    def restart_due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at

    def restarted(self, popen: Popen, now: float) -> None:
        """It runs again as `popen`."""
        self.popen, self.restart_at = popen, None
        self.restarts.append(now)


def signal_group(popen: Popen, sig: signal.Signals) -> None:
    """`sig` to the process group `popen` leads (its session: a worker and its children)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def kill(popen: Popen) -> None:
    """SIGKILL its process group, at once (a hung worker), and reap it."""
    signal_group(popen, signal.SIGKILL)
    popen.wait()


def terminate(
    procs: Sequence[tuple[Popen, float]],
    group: bool = True,
    on_kill: Callable[[int], None] | None = None,
) -> None:
    """Stop processes: SIGTERM to each (to its process group with `group`), wait for each
    until its own limit in seconds (counted from the SIGTERM), then SIGKILL (the group's
    stragglers too) and reap. `on_kill(i)`: the i-th process outlived its limit."""

    def send(popen: Popen, sig: signal.Signals) -> None:
        if group:
            signal_group(popen, sig)
        elif popen.poll() is None:
            popen.send_signal(sig)

    for popen, _ in procs:
        send(popen, signal.SIGTERM)
    start = time.monotonic()
    for i, (popen, limit_s) in enumerate(procs):
        try:
            popen.wait(timeout=max(0.1, start + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            if on_kill is not None:
                on_kill(i)
    for popen, _ in procs:
        send(popen, signal.SIGKILL)
        popen.wait()
