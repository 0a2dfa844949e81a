"""The feeder: writes the data set's prompts to `tasks`, keeping a bounded backlog.

Its cursor lives in Redis and advances in the same transaction as the write, so a feeder
that restarts continues where it stopped, neither skipping nor repeating a prompt. The
cursor names one prompt for ever (a generated one, or a dataset row in a seeded order per
epoch: `streamrl.tasks.data`), so a resumed run continues exactly where the data was. With
`task.epochs` the feeder stops writing after the last row of the last epoch. A mixture of
tasks (`[[tasks]]`) is one sequence of positions whose seeded order says which task each is
(`streamrl.tasks.mixture`); the cursor is the position, so it resumes in the same order.

The backlog is read from the stream itself: entries not yet delivered to the rollout
workers plus those delivered but not acknowledged. A task that went to the dead letters is
acknowledged there, so it leaves the backlog (a counter of tasks done would never count it,
and enough of them would stop the feeder for good).

Its size is `task.max_backlog`; "auto" sizes it to the live rollout workers' advertised
slots each time it fills (`streamrl.capacity`): workers that join or leave move it. The
same live slots are checked against the config's staleness bound (`streamrl.fit`): workers
scaled up with compose may put more groups in flight than the config was checked for.
"""

from __future__ import annotations

import threading

import redis
import structlog

from streamrl import counters
from streamrl.capacity import auto_backlog, live_slots
from streamrl.config import Config
from streamrl.fit import Fit, fit_live
from streamrl.names import Keys
from streamrl.obs.metrics import (
    BACKLOG_TARGET,
    LIVE_POLICY_LAG,
    ROLLOUT_SLOTS,
    STALE_LAG_LIMIT,
    queue_depth,
    queue_lag,
)
from streamrl.queues import backlog
from streamrl.run import incarnation
from streamrl.run.liveness import Liveness
from streamrl.tasks.mixture import Mixture, mixture
from streamrl.transport import as_str, publish


class Feeder:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        cfg: Config,
        log: structlog.stdlib.BoundLogger,
        source: Mixture | None = None,
        run_id: str = "",
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.log = log
        self.source = source if source is not None else mixture(cfg)
        self.run_id = run_id  # the run it writes into ("": not checked)
        self._ended = False
        self.target = 0 if cfg.task.max_backlog == "auto" else int(cfg.task.max_backlog)
        self.rollout_slots: list[int] = []  # the live workers' slots, as last read
        self.live_fit: Fit | None = None  # the config at the live capacity (check_live_fit)
        self._live_key: tuple[int, int] | None = None
        self._live_problem = False

    def _update_target(self) -> int:
        """The backlog to keep now: the configured number, or what the live rollout
        capacity needs ("auto"; logged when it changes). The live capacity is checked
        against the config's staleness bound too (`check_live_fit`)."""
        ttl_ms = max(3 * self.cfg.transport.claim_idle_ms, 5_000)
        slots = live_slots(self.client, self.keys.rollout_capacity, ttl_ms)
        self.check_live_fit(slots)
        if self.cfg.task.max_backlog != "auto":
            self.rollout_slots = slots
            return self.target
        target = auto_backlog(slots, self.cfg.rollout.num_generations)
        if target != self.target or len(slots) != len(self.rollout_slots):
            self.log.info(
                "feeder_backlog_target", target=target, rollout_workers=len(slots),
                slots=sum(slots),
            )  # fmt: skip
        self.target, self.rollout_slots = target, slots
        return target

    def check_live_fit(self, slots: list[int]) -> Fit | None:
        """Issue 29, item 2: what the config implies with the rollout workers live now
        (`streamrl.fit.fit_live`); a config that fits `rollout.num_workers` may not fit the
        workers compose scaled up. When the live capacity changes, a capacity that would
        drop most groups as stale is logged as a warning with the arithmetic and the
        settings that fit (and its return to fitting as info); the lag is a metric that
        `streamrl status` shows. None while no rollout worker is live."""
        key = (len(slots), sum(slots))
        if key != self._live_key:
            self._live_key = key
            self.live_fit = fit_live(self.cfg, slots) if slots else None
            problems = self.live_fit.problems() if self.live_fit else []
            if problems:
                self.log.warning(
                    "rollout_capacity_does_not_fit", rollout_workers=len(slots),
                    slots=sum(slots), problem=problems[0],
                )  # fmt: skip
            elif self._live_problem and slots:
                self.log.info("rollout_capacity_fits", rollout_workers=len(slots), slots=sum(slots))
            self._live_problem = bool(problems)
        return self.live_fit

    def backlog(self) -> tuple[int, int]:
        """(cursor, tasks written but not yet rolled out: undelivered plus pending).
        RunLostError, with `run_id` set, when Redis no longer holds that run (review N8):
        its cursor would read 0, and the data would start again."""
        cursor, run = self.client.mget([self.keys.feeder_cursor, self.keys.run_id])
        found = None if run is None else as_str(run)
        if self.run_id and found != self.run_id:
            raise incarnation.RunLostError(incarnation.lost_reason(self.keys, self.run_id, found))
        return int(cursor or 0), self._waiting()

    def _waiting(self) -> int:
        lag, pending = self._tasks_backlog()
        return lag + pending

    def _tasks_backlog(self) -> tuple[int, int]:
        """The rollout group's (lag, pending) in `tasks`, the lag counted up to one past
        the backlog bound where Redis does not say it."""
        return backlog(self.client, self.keys.tasks, Keys.CG_ROLLOUT, self.target + 1)

    def queue_probe(self) -> dict[str, float]:
        """The tasks queue as counters (`streamrl.obs.metrics`): its depth (what the rollout
        workers have not finished) and lag (not yet delivered to them)."""
        lag, pending = self._tasks_backlog()
        out: dict[str, float] = {queue_depth("tasks"): lag + pending, queue_lag("tasks"): lag}
        out[BACKLOG_TARGET] = self.target
        out[ROLLOUT_SLOTS] = sum(self.rollout_slots)
        if self.live_fit is not None and self.live_fit.checked:
            out[LIVE_POLICY_LAG] = self.live_fit.lag_rollout_bound
            out[STALE_LAG_LIMIT] = self.live_fit.limit
        return out

    def fill(self) -> int:
        """Write tasks until the backlog is full; returns how many were written."""
        target = self._update_target()
        cursor, backlog = self.backlog()
        room = max(0, target - backlog)
        end = self.source.end
        written = 0
        while written < room and (end is None or cursor < end):
            task = self.source.task(cursor, self.cfg.rollout.num_generations)
            cursor += 1
            if task is None:  # a mixture's task that has ended: its positions are holes
                continue
            pipe = self.client.pipeline(transaction=True)
            publish(pipe, self.keys.tasks, task)
            pipe.set(self.keys.feeder_cursor, cursor)
            pipe.hincrby(self.keys.stats, counters.TASKS, 1)
            if self.cfg.tasks:  # a mixture: per task too
                pipe.hincrby(self.keys.stats, counters.per_task(task.kind, counters.TASKS), 1)
            pipe.execute()
            written += 1
        if end is not None and cursor >= end and not self._ended:
            # After the last write (holes after it stepped over): the trainer ends the run
            # once all before it is done.
            self.client.set(self.keys.feeder_cursor, end)
            self.client.set(self.keys.feeder_end, end)
            self._ended = True
            self.log.info("feeder_data_end", cursor=end, tasks=self.source.written(end))
        return written

    def run(
        self,
        stop: threading.Event,
        poll_s: float = 0.1,
        burst: bool = False,
        liveness: Liveness | None = None,
    ) -> None:
        """Keep the backlog full until `stop`; `burst`: return as soon as nothing more can
        be written (the backlog is full, or the data has ended). Ticks `liveness` each
        time round."""
        alive = liveness or Liveness()
        self.log.info(
            "feeder_start",
            tasks={t.label: t.dataset or "generated" for t in self.cfg.mixture},
            weights=list(self.source.schedule.parts),
        )
        while not stop.is_set():
            alive.tick()
            if self.fill() == 0:
                if burst:
                    break
                stop.wait(poll_s)
        self.log.info("feeder_stop", cursor=self.backlog()[0])
