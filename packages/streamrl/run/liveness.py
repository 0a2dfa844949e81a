"""Whether a worker's main loop still turns: what its heartbeat's liveness beat says.

The worker process has one `Liveness` (`WorkerContext.liveness`), passed to its loop. The
loop calls `tick()` each time round; a step that may rightly outlast the liveness limit (a
train step with its JIT compile, a checkpoint, a weights publication; a tool call, for up
to its own time limit) runs inside `busy()`. Until the first tick the worker is starting
(imports, model load, resume) and counts as live. The heartbeat thread
(`streamrl.run.identity.Heartbeat`) writes the worker's beat key only while `live(limit_s)`: a
loop that stops turning outside a busy step stops the beat as surely as a stopped process
does (SIGSTOP, a frozen host), and `streamrl up` kills and restarts a worker whose beat is
older than `run.liveness_timeout_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Liveness:
    """The loop's last tick and its busy steps; read by the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_tick: float | None = None  # monotonic time of the last tick; None: starting
        self._busy: dict[int, float] = {}  # busy steps running now -> their deadlines
        self._next_id = 0
        # Called once, at the first tick: the worker's start is over (its trace's
        # `worker.start` span ends there).
        self.on_started: Callable[[], None] | None = None

    def tick(self) -> None:
        """The loop turned once."""
        first = self._last_tick is None
        self._last_tick = time.monotonic()
        if first and self.on_started is not None:
            started, self.on_started = self.on_started, None
            started()

    @contextmanager
    def busy(self, max_s: float | None = None) -> Iterator[None]:
        """A step that may take longer than the limit without being stuck (for up to
        `max_s` seconds, if given); ticks at its end."""
        deadline = time.monotonic() + max_s if max_s is not None else float("inf")
        with self._lock:
            token, self._next_id = self._next_id, self._next_id + 1
            self._busy[token] = deadline
        try:
            yield
        finally:
            with self._lock:
                del self._busy[token]
            self.tick()

    def live(self, limit_s: float) -> bool:
        """Starting, in a busy step (within its `max_s`), or ticked within `limit_s`."""
        now, last = time.monotonic(), self._last_tick
        with self._lock:
            busy = any(now < deadline for deadline in self._busy.values())
        return last is None or busy or now - last < limit_s


class BeatClock:
    """The launcher's clock for the workers' beats: a worker's silence counts only over
    time in which the launcher could have seen it beat. It restarts (beats read before then
    no longer count against anyone) when Redis did not answer, when a read of the beats
    took long (Redis or the host was slow: the workers' own writes waited as long), and when
    the launcher itself did not look for half the limit (it was stopped, or starved of CPU:
    silence it did not watch is not the workers'). A truly hung worker is then found up to
    one limit later, never a live one killed for the launcher's own gap."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.counts_from = 0.0  # monotonic: silence before this does not count
        self._last_look: float | None = None

    def blind(self, at: float) -> None:
        """The beats could not be read at `at` (Redis away or restarted)."""
        self.counts_from, self._last_look = at, at

    def looked(self, start: float, end: float) -> None:
        """The beats were read: the read began at `start` and answered at `end`."""
        gap = None if self._last_look is None else start - self._last_look
        if (gap is not None and gap > self.limit_s / 2) or end - start > self.limit_s / 4:
            self.counts_from = end
        self._last_look = start

    def silent_s(self, beat_changed_at: float, now: float) -> float:
        """How long a worker whose beat last changed at `beat_changed_at` has been silent."""
        return now - max(beat_changed_at, self.counts_from)
