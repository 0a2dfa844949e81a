"""The feeder: writes the data set's prompts to `tasks`, keeping a bounded backlog.

Its cursor lives in Redis and advances in the same transaction as the write, so a feeder
that restarts continues where it stopped, neither skipping nor repeating a prompt. The
cursor names one prompt for ever (a generated one, or a dataset row in a seeded order per
epoch: `streamrl.tasks.data`), so a resumed run continues exactly where the data was. With
`task.epochs` the feeder stops writing after the last row of the last epoch.

The backlog is read from the stream itself: entries not yet delivered to the rollout
workers plus those delivered but not acknowledged. A task that went to the dead letters is
acknowledged there, so it leaves the backlog (a counter of tasks done would never count it,
and enough of them would stop the feeder for good).

Its size is `task.max_backlog`; "auto" sizes it to the live rollout workers' advertised
slots each time it fills (`streamrl.capacity`): workers that join or leave move it.
"""

from __future__ import annotations

import threading

import redis
import structlog

from streamrl import counters
from streamrl.capacity import auto_backlog, live_slots
from streamrl.config import Config
from streamrl.names import Keys
from streamrl.obs.metrics import BACKLOG_TARGET, ROLLOUT_SLOTS, queue_depth, queue_lag
from streamrl.queues import backlog
from streamrl.run.liveness import Liveness
from streamrl.tasks.registry import TaskSource, task_source
from streamrl.transport import publish


class Feeder:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        cfg: Config,
        log: structlog.stdlib.BoundLogger,
        source: TaskSource | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.log = log
        self.source = source if source is not None else task_source(cfg.task, cfg.run.seed)
        self._ended = False
        self.target = 0 if cfg.task.max_backlog == "auto" else int(cfg.task.max_backlog)
        self.rollout_slots: list[int] = []  # the live workers' slots, as last read (auto)

    def _update_target(self) -> int:
        """The backlog to keep now: the configured number, or what the live rollout
        capacity needs ("auto"; logged when it changes)."""
        if self.cfg.task.max_backlog != "auto":
            return self.target
        ttl_ms = max(3 * self.cfg.transport.claim_idle_ms, 5_000)
        slots = live_slots(self.client, self.keys.rollout_capacity, ttl_ms)
        target = auto_backlog(slots, self.cfg.rollout.num_generations)
        if target != self.target or len(slots) != len(self.rollout_slots):
            self.log.info(
                "feeder_backlog_target", target=target, rollout_workers=len(slots),
                slots=sum(slots),
            )  # fmt: skip
        self.target, self.rollout_slots = target, slots
        return target

    def backlog(self) -> tuple[int, int]:
        """(cursor, tasks written but not yet rolled out: undelivered plus pending)."""
        cursor = int(self.client.get(self.keys.feeder_cursor) or 0)
        return cursor, self._waiting()

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
        if self.cfg.task.max_backlog == "auto":
            out[ROLLOUT_SLOTS] = sum(self.rollout_slots)
        return out

    def fill(self) -> int:
        """Write tasks until the backlog is full; returns how many were written."""
        target = self._update_target()
        cursor, backlog = self.backlog()
        room = max(0, target - backlog)
        end = self.source.end
        last = None  # the data's end, when this fill writes up to it
        if end is not None and cursor + room >= end:
            room, last = max(0, end - cursor), end
        for i in range(room):
            task = self.source.task(cursor + i, self.cfg.rollout.num_generations)
            pipe = self.client.pipeline(transaction=True)
            publish(pipe, self.keys.tasks, task)
            pipe.set(self.keys.feeder_cursor, cursor + i + 1)
            pipe.hincrby(self.keys.stats, counters.TASKS, 1)
            pipe.execute()
        if last is not None and not self._ended:
            # After the last write: the trainer ends the run once all before it is done.
            self.client.set(self.keys.feeder_end, last)
            self._ended = True
            self.log.info("feeder_data_end", cursor=last, epochs=self.cfg.task.epochs)
        return room

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
        self.log.info("feeder_start", task=self.cfg.task.name, dataset=self.cfg.task.dataset)
        while not stop.is_set():
            alive.tick()
            if self.fill() == 0:
                if burst:
                    break
                stop.wait(poll_s)
        self.log.info("feeder_stop", cursor=self.backlog()[0])
