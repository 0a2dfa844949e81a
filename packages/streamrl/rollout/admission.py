"""How many episodes a rollout worker runs at once: fixed, or following its engine (issue 29
item 4, `rollout.max_concurrency = "auto"`).

A fixed `max_concurrency` either starves the engine (too few episodes to fill its decode
batch while the others wait on tools) or overfills its KV pool: an agentic episode holds a
slot across its turns (parked while its tools run, `streamrl.model.engine`), and once more
episodes run than the pool has slots, every new request evicts a parked session, which
then prefills its whole conversation again, or waits for a slot.

`Admission` is the pure rule (no clock, no engine: each `update` is one look at the
engine's counters, taken every `TICK_S` by the worker). An episode holds one slot from its
first model call to its end, so the pool takes exactly `slots` episodes without eviction:

- **free** = slots - max(episodes running, slots held + requests waiting for one): the
  slots neither an episode of this worker nor anything else holds or awaits.
- **busy**: the share of the time since the last look the engine spent in its steps.
- **trim** when the engine evicted a parked session since the last look, or the pool
  overflows (slots held + requests waiting > slots): the limit drops to 9/10 of the
  episodes running (at least 1). Nothing is preempted: running episodes go on; new ones
  start only once fewer run than the limit.
- **grow** when slots are free, no eviction happened, the engine was busy less than
  `SATURATED` (0.9) of the time, and the limit binds (as many episodes run as it allows,
  and more wait to start): + min(free, max(1, limit / 8)), up to the hard cap
  (`max_concurrency_cap`).
- otherwise **hold**.

The worker starts the limit at half the pool (`start_limit`; within the cap), and it grows
from there while the engine has time to spare: an engine busy all the time gains nothing
from more episodes, which only wait for it, and on a host where a decode step's cost
grows with the rows it covers (a CPU; parked slots below the highest active one
included), they slow it. Measured on the tiny model (`ops/bench/admission.py`): an engine
of 16 slots saturated from 8 episodes up, where 8 gave 4 % more goodput than 16. It
stops at the pool: once more episodes run than slots, each extra one evicts a parked
session at its next request, and that session prefills its whole conversation again.
Trims (counted, logged and traced) bring it down when slots are held by more than its
episodes, growth back up as they free.

An engine without a KV pool (the stub policy) reports no occupancy: the limit starts at
the cap and grows while it binds (it is there already). A fixed `max_concurrency` is a
limit that never moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TICK_S = 0.25  # how often the worker looks at its engine
TRIM = 0.9  # the limit after a trim, as a share of the episodes running
GROW_DIV = 8  # growth per look: limit / GROW_DIV, at least 1
SATURATED = 0.9  # the engine's busy share from which more episodes only wait for it
START_DIV = 2  # an engine with a KV pool: the limit starts at the pool / START_DIV

Action = Literal["grow", "trim", "hold", "fixed"]


@dataclass(frozen=True)
class Occupancy:
    """One look at the engine's KV pool."""

    slots: int  # the pool's slots (rollout.max_batch_size)
    held: int  # slots decoding a request or parked for a session's next turn
    waiting: int  # requests waiting for a slot
    evictions: int  # parked slots taken for other requests since the engine started
    busy_s: float = 0.0  # seconds the engine spent in its steps since it started
    at_s: float = 0.0  # when this look was taken (a monotonic clock; 0: not known)

    @property
    def pressure(self) -> float:
        """Slots held or awaited over the slots (above 1: the pool overflows)."""
        return (self.held + self.waiting) / max(1, self.slots)

    def free(self, running: int) -> int:
        """Slots neither `running` episodes nor anything else holds or awaits."""
        return self.slots - max(running, self.held + self.waiting)


def start_limit(estimate: int, pooled: bool) -> int:
    """The limit adaptive admission starts at: half of `estimate` (the pool within the
    cap, `Config.concurrency_estimate`) for an engine with a KV pool, else `estimate`."""
    return max(1, estimate // START_DIV) if pooled else estimate


@dataclass
class Admission:
    """The limit on episodes running at once. `auto` False: `limit` stays `cap`."""

    cap: int
    auto: bool
    start: int
    limit: int = 0
    trims: int = 0
    grows: int = 0
    _evictions: int | None = None
    _busy: tuple[float, float] | None = None  # the last look's (busy_s, at_s)

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.cap:
            raise ValueError(f"start {self.start} must be in [1, cap {self.cap}]")
        self.limit = self.start if self.auto else self.cap

    def update(self, running: int, waiting_to_start: int, occ: Occupancy | None) -> Action:
        """One look: `running` episodes, `waiting_to_start` members read and not started,
        the engine's occupancy (None: no KV pool). Returns what it did to `limit`."""
        if not self.auto:
            return "fixed"
        evicted = False
        busy: float | None = None  # the engine's busy share since the last look
        if occ is not None:
            evicted = self._evictions is not None and occ.evictions > self._evictions
            self._evictions = occ.evictions
            if self._busy is not None and occ.at_s > self._busy[1]:
                busy = (occ.busy_s - self._busy[0]) / (occ.at_s - self._busy[1])
            self._busy = (occ.busy_s, occ.at_s)
        if evicted or (occ is not None and occ.pressure > 1):
            new = max(1, min(self.limit, int(running * TRIM)))
            if new < self.limit:
                self.limit = new
                self.trims += 1
                return "trim"
            return "hold"
        binds = running >= self.limit and waiting_to_start > 0
        room = self.cap - self.limit
        if occ is not None:
            room = min(room, occ.free(running))
        # a clocked look's first is the busy share's baseline, as for the evictions
        spare = busy < SATURATED if busy is not None else occ is None or occ.at_s == 0
        if binds and room > 0 and spare:
            self.limit += min(room, max(1, self.limit // GROW_DIV))
            self.grows += 1
            return "grow"
        return "hold"
