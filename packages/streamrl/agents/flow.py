"""Flow control of an episode's outside calls: concurrency limits, per-tool rate limits and
a circuit breaker for tool infrastructure errors."""

from __future__ import annotations

import asyncio
import time
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
    """Too many consecutive tool infrastructure errors: the run stops (it is not the policy's
    fault, and every further episode would fail the same way)."""


class CircuitBreaker:
    """Counts consecutive infrastructure errors; any success resets the count. Trips at
    `max_consecutive` (0: never)."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.last_error = ""

    def success(self) -> None:
        self.consecutive = 0

    def failure(self, error: str) -> None:
        """Record one; raises CircuitOpenError when this one trips the breaker."""
        self.consecutive += 1
        self.last_error = error
        self.check()

    def check(self) -> None:
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise CircuitOpenError(
                f"{self.consecutive} consecutive tool infrastructure errors "
                f"(tools.max_consecutive_tool_errors = {self.max_consecutive}); "
                f"last: {self.last_error}"
            )
