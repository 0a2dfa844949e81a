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
- **grow** (an engine that counts no tokens; else the climb below) when slots are free, no
  eviction happened, and the limit binds (as many episodes run as it allows, and more wait
  to start): + min(free, max(1, limit / 8)), up to the hard cap (`max_concurrency_cap`).
- otherwise **hold**.

The worker starts the limit at the pool (within the cap: `Config.concurrency_estimate`), so
a run that shares its engine with nothing holds it there; the rule brings it down when
slots are held by more than its episodes (each trim counted, logged and traced) and back up
as they free. Why not more episodes than slots: each extra one evicts a parked session at
its next request, and that session prefills its whole conversation again
(`ops/bench/admission.py` measures what this costs against what the extra episodes win).

An engine without a KV pool (the stub policy) reports no occupancy: the limit grows while
it binds, up to the cap. A fixed `max_concurrency` is a limit that never moves.

**Following throughput** (an engine that counts its tokens, `Occupancy.tokens`): slots are
not the only thing episodes share. On a host whose cores also run the episodes' own work
(tool calls, templates, commits), more episodes than the engine needs to stay busy only
wait, and take the CPU its steps need: on a 2-core development machine the tiny model's
multi-turn episodes gave the most tokens/s at 4 at once, 0.81-0.87 of that at 6-16, while
on a faster one 16 gave the most, 8 0.91 (docs/BENCHMARKS.md, the admission sections): where
the knee lies is the host's, so the limit finds it. Beside the KV rule, the limit then climbs the
hill of the engine's tokens/s, one step at a time: it measures a window of PROBE_LOOKS
looks at one limit (after SETTLE_LOOKS looks for the episodes to follow a change), and
moves max(1, limit / PROBE_DIV) in its direction (down first: it starts at the pool). Steps
are judged against the best window so far (measured again at each window at its limit): a
step down stays while its tokens/s is at least 1 - PROBE_TOL of the best (so small losses do
not add up), a step up only above 1 + PROBE_TOL of it (more episodes must pay for
themselves); otherwise the limit goes back to the best one, the direction turns, and the
next step waits twice as many windows as the last (at most PATIENCE_MAX). A window in which
the limit did not bind (fewer episodes to run than it allows) says nothing about it: the
limit holds. Steps up stay
within the free slots; the KV trim comes first. An accelerator, whose steps gain from
bigger batches, keeps the limit up where its tokens/s is highest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

TICK_S = 0.25  # how often the worker looks at its engine
TRIM = 0.9  # the limit after a trim, as a share of the episodes running
GROW_DIV = 8  # growth per look: limit / GROW_DIV, at least 1
# Following throughput (an engine that counts its tokens):
PROBE_LOOKS = 16  # looks in a window at one limit (4 s)
SETTLE_LOOKS = 4  # looks after a change before its window starts
PROBE_DIV = 4  # a step: limit / PROBE_DIV, at least 1
PROBE_TOL = 0.05  # what a step up must win, a step down may lose, of tokens/s
PATIENCE_MAX = 8  # windows at most between steps after refused ones

# grow / lower: the limit moved up / down (lower: a throughput step); trim: the KV rule cut it
Action = Literal["grow", "lower", "trim", "hold", "fixed"]


@dataclass(frozen=True)
class Occupancy:
    """One look at the engine's KV pool."""

    slots: int  # the pool's slots (rollout.max_batch_size)
    held: int  # slots decoding a request or parked for a session's next turn
    waiting: int  # requests waiting for a slot
    evictions: int  # parked slots taken for other requests since the engine started
    tokens: int | None = None  # tokens the engine sampled since it started (None: not counted)

    @property
    def pressure(self) -> float:
        """Slots held or awaited over the slots (above 1: the pool overflows)."""
        return (self.held + self.waiting) / max(1, self.slots)

    def free(self, running: int) -> int:
        """Slots neither `running` episodes nor anything else holds or awaits."""
        return self.slots - max(running, self.held + self.waiting)


@dataclass
class _Probe:
    """The throughput climb's state: the window being measured and the best one so far."""

    direction: int = -1  # the next step's sign (down first: the limit starts at the pool)
    patience: int = 1  # windows measured at a limit before the next step from it
    # (limit, tokens a look) of the best window: steps are judged against it, so steps down
    # that each lose a little cannot add up to more than PROBE_TOL
    best: tuple[int, float] | None = None
    settle: int = SETTLE_LOOKS  # looks left before the window starts
    looks: int = 0
    binds: int = 0
    since: int | None = None  # tokens at the window's start
    waited: int = 0  # windows measured at this limit since it was set

    def restart(self) -> None:
        """A trim: what was measured no longer holds."""
        self.best = None
        self.changed()

    def changed(self) -> None:
        self.settle, self.looks, self.binds, self.since, self.waited = SETTLE_LOOKS, 0, 0, None, 0

    def look(self, tokens: int, binds: bool) -> float | None:
        """Count one look; at a window's end, its tokens a look (None: no window ended, or
        one in which the limit did not bind most of the time: nothing learnt of it)."""
        if self.settle > 0:
            self.settle -= 1
            return None
        if self.since is None:
            self.since = tokens
            return None
        self.looks += 1
        self.binds += binds
        if self.looks < PROBE_LOOKS:
            return None
        rate, bound = (tokens - self.since) / self.looks, 2 * self.binds >= self.looks
        self.since, self.looks, self.binds = tokens, 0, 0
        if not bound:
            self.best = None
            return None
        return rate

    def wait_more(self) -> bool:
        """True while the limit must be measured for more windows before the next step."""
        self.waited += 1
        return self.waited < self.patience


@dataclass
class Admission:
    """The limit on episodes running at once. `auto` False: `limit` stays `cap`."""

    cap: int
    auto: bool
    start: int
    limit: int = 0
    trims: int = 0
    grows: int = 0
    lowers: int = 0
    _evictions: int | None = None
    _probe: _Probe = field(default_factory=_Probe)

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
            self._probe.restart()
            if new < self.limit:
                self.limit = new
                self.trims += 1
                return "trim"
            return "hold"
        if occ is not None and occ.tokens is not None:
            return self._follow(running, waiting_to_start, occ, occ.tokens)
        binds = running >= self.limit and waiting_to_start > 0
        room = self.cap - self.limit
        if occ is not None:
            room = min(room, occ.free(running))
        if binds and room > 0:
            self.limit += min(room, max(1, self.limit // GROW_DIV))
            self.grows += 1
            return "grow"
        return "hold"

    def _follow(self, running: int, waiting_to_start: int, occ: Occupancy, tokens: int) -> Action:
        """One look of the throughput climb (the module's docstring)."""
        p = self._probe
        rate = p.look(tokens, running >= self.limit and waiting_to_start > 0)
        if rate is None:
            return "hold"
        if p.best is not None and p.best[0] != self.limit:
            best_limit, best_rate = p.best
            up = self.limit > best_limit
            kept = rate > best_rate * (1 + PROBE_TOL) if up else rate >= best_rate * (1 - PROBE_TOL)
            if not kept:  # back to the best; the next step goes the other way, later
                p.direction = -1 if up else 1
                p.patience = min(PATIENCE_MAX, 2 * p.patience)
                return self._move(best_limit, running, occ)
            p.patience = 1
            if rate > best_rate:
                p.best = (self.limit, rate)
        else:  # the first window, or one more at the best limit: its rate as it is now
            p.best = (self.limit, rate)
        if p.wait_more():
            return "hold"
        step = max(1, self.limit // PROBE_DIV)
        return self._move(self.limit + p.direction * step, running, occ)

    def _move(self, target: int, running: int, occ: Occupancy) -> Action:
        """Set the limit to `target` within [1, cap] and, going up, the free slots."""
        if target > self.limit:
            target = min(target, self.cap, self.limit + max(0, occ.free(running)))
            if target == self.limit:  # no room above: a step down instead
                self._probe.direction = -1
                target = self.limit - max(1, self.limit // PROBE_DIV)
        target = max(1, target)
        if target == self.limit:
            return "hold"
        action: Action = "grow" if target > self.limit else "lower"
        if action == "grow":
            self.grows += 1
        else:
            self.lowers += 1
        self.limit = target
        self._probe.changed()
        return action
