"""How many episodes a rollout worker runs at once: fixed, or following its engine (issue 29
item 4, `rollout.max_concurrency = "auto"`).

A fixed `max_concurrency` either starves the engine (too few episodes to fill its decode
batch while the others wait on tools) or overfills its KV pool: an agentic episode holds a
slot across its turns (parked while its tools run, `streamrl.model.engine`), and once more
episodes run than the pool has slots, every new request evicts a parked session, which
then prefills its whole conversation again, or waits for a slot.

`Admission` is the pure rule (no clock, no engine: each `update` is one look at the
engine's counters, taken every `TICK_S` by the worker):

- **pressure** = (slots decoding or parked + requests waiting for a slot) / slots.
- **trim** when the engine evicted a parked session since the last look, or pressure is
  above `high`: the limit drops to 9/10 of the episodes running (at least 1). Nothing is
  preempted: running episodes go on; new ones start only once fewer run than the limit.
- **grow** when pressure is below `low`, no eviction happened, and the limit binds (as
  many episodes run as it allows, and more wait to start): + max(1, limit / 8), up to the
  hard cap (`max_concurrency_cap`).
- otherwise **hold**.

An engine without a KV pool (the stub policy) reports no occupancy: the limit grows
while it binds, up to the cap. A fixed `max_concurrency` is a limit that never moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TICK_S = 0.25  # how often the worker looks at its engine
TRIM = 0.9  # the limit after a trim, as a share of the episodes running
GROW_DIV = 8  # growth per look: limit / GROW_DIV, at least 1

Action = Literal["grow", "trim", "hold", "fixed"]


@dataclass(frozen=True)
class Occupancy:
    """One look at the engine's KV pool."""

    slots: int  # the pool's slots (rollout.max_batch_size)
    held: int  # slots decoding a request or parked for a session's next turn
    waiting: int  # requests waiting for a slot
    evictions: int  # parked slots taken for other requests since the engine started

    @property
    def pressure(self) -> float:
        return (self.held + self.waiting) / max(1, self.slots)


@dataclass
class Admission:
    """The limit on episodes running at once. `auto` False: `limit` stays `cap`."""

    cap: int
    auto: bool
    start: int
    low: float = 0.8
    high: float = 0.95
    limit: int = 0
    trims: int = 0
    grows: int = 0
    _evictions: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.cap:
            raise ValueError(f"start {self.start} must be in [1, cap {self.cap}]")
        if not 0 < self.low < self.high:
            raise ValueError(f"need 0 < low ({self.low}) < high ({self.high})")
        self.limit = self.start if self.auto else self.cap

    def update(self, running: int, waiting_to_start: int, occ: Occupancy | None) -> Action:
        """One look: `running` episodes, `waiting_to_start` members read and not started,
        the engine's occupancy (None: no KV pool). Returns what it did to `limit`."""
        if not self.auto:
            return "fixed"
        evicted = False
        if occ is not None:
            evicted = self._evictions is not None and occ.evictions > self._evictions
            self._evictions = occ.evictions
        if evicted or (occ is not None and occ.pressure > self.high):
            new = max(1, min(self.limit, int(running * TRIM)))
            if new < self.limit:
                self.limit = new
                self.trims += 1
                return "trim"
            return "hold"
        binds = running >= self.limit and waiting_to_start > 0
        if binds and (occ is None or occ.pressure < self.low) and self.limit < self.cap:
            self.limit = min(self.cap, self.limit + max(1, self.limit // GROW_DIV))
            self.grows += 1
            return "grow"
        return "hold"
