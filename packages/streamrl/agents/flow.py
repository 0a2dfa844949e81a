"""Flow control of an episode's outside calls: concurrency limits, per-tool rate limits and
a circuit breaker for tool infrastructure errors sustained over a window."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from streamrl.errors import FatalError


class RateLimiter:
    """A token bucket: `rate` calls per second on average, bursts up to `burst`."""

    def __init__(
        self, rate: float, burst: int = 1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def delay(self) -> float:
        """Seconds until a call may start (0 when a token is there); takes no token."""
        self._refill()
        return max(0.0, (1.0 - self._tokens) / self.rate)

    async def acquire(self) -> None:
        """Wait for a token and take it (callers are served in arrival order)."""
        async with self._lock:
            while (wait := self.delay()) > 0:
                await asyncio.sleep(wait)
            self._tokens -= 1.0


class CircuitOpenError(FatalError):
    """Tool infrastructure errors sustained for the breaker's window: the run stops (it is
    not the policy's fault, and every further episode would fail the same way)."""


# The breaker judges recovery on the last tenth of its window: a success ends a failing
# spell when the calls of that stretch fail at less than the error rate.
_RECENT_FRACTION = 0.1


class CircuitBreaker:
    """Trips when tool infrastructure errors are sustained: a failing spell (from its first
    error, through every call since) has lasted `window_s`, held at least `min_calls`
    calls, and failed at `error_rate` or more. A success ends the spell when the calls of
    the last tenth of the window fail at less than `error_rate`, so a burst of errors (a
    tool worker restarting with many calls in flight) is forgotten once calls succeed
    again, while errors that go on, even in waves, trip it. `min_calls` 0: never trips.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        error_rate: float = 0.9,
        min_calls: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.error_rate = error_rate
        self.min_calls = min_calls
        self.clock = clock
        self.failing_since: float | None = None
        self.calls = 0  # of the failing spell
        self.failures = 0
        self.last_error = ""
        self._recent: deque[tuple[float, bool]] = deque()  # (time, failed)

    def _note(self, now: float, failed: bool) -> None:
        horizon = now - self.window_s * _RECENT_FRACTION
        while self._recent and self._recent[0][0] <= horizon:
            self._recent.popleft()
        self._recent.append((now, failed))

    def success(self) -> None:
        now = self.clock()
        self._note(now, False)
        if self.failing_since is None:
            return
        self.calls += 1
        failed = sum(f for _, f in self._recent)
        if failed < self.error_rate * len(self._recent):
            self.failing_since = None

    def failure(self, error: str) -> None:
        """Record one; raises CircuitOpenError when this one trips the breaker."""
        now = self.clock()
        self._note(now, True)
        if self.failing_since is None:
            self.failing_since, self.calls, self.failures = now, 0, 0
        self.calls += 1
        self.failures += 1
        self.last_error = error
        lasted = now - self.failing_since
        if (
            self.min_calls
            and self.calls >= self.min_calls
            and lasted >= self.window_s
            and self.failures >= self.error_rate * self.calls
        ):
            raise CircuitOpenError(
                f"tool infrastructure errors for {lasted:g}s: {self.failures} of "
                f"{self.calls} calls failed (tools.breaker_window_s = {self.window_s:g}, "
                f"tools.breaker_error_rate = {self.error_rate:g}); last: {error}"
            )
