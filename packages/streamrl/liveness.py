"""Whether a worker's main loop still turns: what its heartbeat's liveness beat says.

The loop calls `tick()` each time round; a step that may rightly outlast the liveness limit
(a train step with its JIT compile, a checkpoint, a weights publication; a tool call, for
up to its own time limit) runs inside `busy()`. Until the first tick the worker is starting
(imports, model load, resume) and counts as live. The heartbeat thread
(`streamrl.identity.Heartbeat`) writes the worker's beat key only while `live(limit_s)`: a
loop that stops turning outside a busy step stops the beat as surely as a stopped process
does (SIGSTOP, a frozen host), and `streamrl up` kills and restarts a worker whose beat is
older than `run.liveness_timeout_s`.

One worker per process: the state is the process's own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_tick: float | None = None  # monotonic time of the last tick; None: starting
        self.busy: dict[int, float] = {}  # busy() steps running now -> their deadlines
        self.next_id = 0


_state = _State()


def tick() -> None:
    """The loop turned once."""
    _state.last_tick = time.monotonic()


@contextmanager
def busy(max_s: float | None = None) -> Iterator[None]:
    """A step that may take longer than the limit without being stuck (for up to `max_s`
    seconds, if given); ticks at its end. Usable as a decorator too (`@busy()`)."""
    deadline = time.monotonic() + max_s if max_s is not None else float("inf")
    with _state.lock:
        token, _state.next_id = _state.next_id, _state.next_id + 1
        _state.busy[token] = deadline
    try:
        yield
    finally:
        with _state.lock:
            del _state.busy[token]
        tick()


def live(limit_s: float) -> bool:
    """Starting, in a busy step (within its `max_s`), or ticked within `limit_s` seconds."""
    now, last = time.monotonic(), _state.last_tick
    with _state.lock:
        busy = any(now < deadline for deadline in _state.busy.values())
    return last is None or busy or now - last < limit_s


def reset() -> None:
    """Back to starting (tests; a process runs one worker)."""
    with _state.lock:
        _state.last_tick = None
        _state.busy.clear()
