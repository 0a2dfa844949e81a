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
- **trim** when the engine evicted a parked session since the last look, or the pool
  overflows (slots held + requests waiting > slots): the limit drops to 9/10 of the
  episodes running (at least 1). Nothing is preempted: running episodes go on; new ones
  start only once fewer run than the limit.
- **grow** when slots are free, no eviction happened, and the limit binds (as many episodes
  run as it allows, and more wait to start): + min(free, max(1, limit / 8)), up to the hard
  cap (`max_concurrency_cap`).
- **cap by latency** (the model-call latency term): the engine times its decode calls by
  their rows (`Engine.decode_costs`: a bucket, a power of two); a bucket's cost per token
  is its calls' seconds over the active rows they decoded. Once buckets have `MIN_CALLS`
  calls each, the *ceiling* is the largest of them whose cost per token is within
  `LATENCY_MARGIN` of the cheapest; when a larger bucket costs more than that (a bigger
  batch makes every token dearer), the limit is held at the ceiling, trimmed to it if
  above (counted as a trim), and grows no further while it stands. Where batching pays (an
  accelerator's memory-bound decode, and the dev machine's CPU too) the largest bucket is
  the cheapest and nothing is capped. The comparison is made within a run, so a slow minute
  of the machine weighs on both sides alike; it leans toward the bigger batch (in a run of
  many episodes the small calls come in lulls, while the episodes' own Python holds the
  interpreter, and cost more a row than in a run of few: docs/scale.md). The figures are
  counted from the engine's start, without the calls that traced a program.
- otherwise **hold**.

The worker starts the limit at the pool (within the cap: `Config.concurrency_estimate`), so
a run that shares its engine with nothing holds it there; the rule brings it down when
slots are held by more than its episodes (each trim counted, logged and traced) and back up
as they free. Why not more episodes than slots: each extra one evicts a parked session at
its next request, and that session prefills its whole conversation again
(`ops/bench/admission.py` measures what this costs against what the extra episodes win).

An engine without a KV pool (the stub policy) reports no occupancy: the limit grows while
it binds, up to the cap. A fixed `max_concurrency` is a limit that never moves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the engine imports jax; the rule stays light
    from streamrl.model.engine import DecodeCost

TICK_S = 0.25  # how often the worker looks at its engine
TRIM = 0.9  # the limit after a trim, as a share of the episodes running
GROW_DIV = 8  # growth per look: limit / GROW_DIV, at least 1
# A decode bucket is judged once it has this many calls (a call is ~10-50 ms on a CPU).
MIN_CALLS = 64
# The ceiling: the largest bucket whose cost per token is within this share of the cheapest.
LATENCY_MARGIN = 0.05

Action = Literal["grow", "trim", "hold", "fixed"]


@dataclass(frozen=True)
class Occupancy:
    """One look at the engine's KV pool."""

    slots: int  # the pool's slots (rollout.max_batch_size)
    held: int  # slots decoding a request or parked for a session's next turn
    waiting: int  # requests waiting for a slot
    evictions: int  # parked slots taken for other requests since the engine started
    # decode calls by their rows since the engine started (`Engine.decode_costs`)
    costs: Mapping[int, DecodeCost] = field(default_factory=dict)

    @property
    def pressure(self) -> float:
        """Slots held or awaited over the slots (above 1: the pool overflows)."""
        return (self.held + self.waiting) / max(1, self.slots)

    def free(self, running: int) -> int:
        """Slots neither `running` episodes nor anything else holds or awaits."""
        return self.slots - max(running, self.held + self.waiting)


def batch_ceiling(
    costs: Mapping[int, DecodeCost], margin: float = LATENCY_MARGIN, min_calls: int = MIN_CALLS
) -> int | None:
    """The largest decode bucket worth filling, or None while nothing caps it: of the
    buckets with `min_calls` calls, the largest whose seconds per decoded row is within
    `margin` of the cheapest one's, when a larger judged bucket costs more than that."""
    per_token = {
        n: c.seconds / c.active for n, c in costs.items() if c.calls >= min_calls and c.active
    }
    if not per_token:
        return None
    cheapest = min(per_token.values())
    ceiling = max(n for n, p in per_token.items() if p <= cheapest * (1 + margin))
    return ceiling if ceiling < max(per_token) else None


@dataclass
class Admission:
    """The limit on episodes running at once. `auto` False: `limit` stays `cap`."""

    cap: int
    auto: bool
    start: int
    limit: int = 0
    trims: int = 0
    grows: int = 0
    ceiling: int | None = None  # the latency cap (`batch_ceiling`), once buckets say so
    _evictions: int | None = None

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
        if occ is not None:
            evicted = self._evictions is not None and occ.evictions > self._evictions
            self._evictions = occ.evictions
        if evicted or (occ is not None and occ.pressure > 1):
            new = max(1, min(self.limit, int(running * TRIM)))
            if new < self.limit:
                self.limit = new
                self.trims += 1
                return "trim"
            return "hold"
        if occ is not None:
            self.ceiling = batch_ceiling(occ.costs)
            if self.ceiling is not None and self.limit > self.ceiling:
                self.limit = self.ceiling
                self.trims += 1
                return "trim"
        binds = running >= self.limit and waiting_to_start > 0
        room = self.cap - self.limit
        if occ is not None:
            room = min(room, occ.free(running))
        if self.ceiling is not None:
            room = min(room, self.ceiling - self.limit)
        if binds and room > 0:
            self.limit += min(room, max(1, self.limit // GROW_DIV))
            self.grows += 1
            return "grow"
        return "hold"
