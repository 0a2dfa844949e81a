"""The feeder: writes the data set's prompts to `tasks`, keeping a bounded backlog.

Its cursor lives in Redis and advances in the same transaction as the write, so a feeder
that restarts continues where it stopped, neither skipping nor repeating a prompt.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
import structlog

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.tasks.registry import make_task
from streamrl.transport import publish


class Feeder:
    def __init__(
        self, client: redis.Redis, keys: Keys, cfg: Config, log: structlog.stdlib.BoundLogger
    ) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self.log = log

    def backlog(self) -> tuple[int, int]:
        """(cursor, tasks written but not yet rolled out)."""
        raw: Any = self.client.mget([self.keys.feeder_cursor])
        cursor = int(raw[0] or 0)
        done = int(self.client.hget(self.keys.stats, "tasks_done") or 0)
        return cursor, cursor - done

    def fill(self) -> int:
        """Write tasks until the backlog is full; returns how many were written."""
        cursor, backlog = self.backlog()
        room = self.cfg.task.max_backlog - backlog
        for i in range(max(0, room)):
            task = make_task(
                self.cfg.task, self.cfg.run.seed, cursor + i, self.cfg.rollout.num_generations
            )
            pipe = self.client.pipeline(transaction=True)
            publish(pipe, self.keys.tasks, task)
            pipe.set(self.keys.feeder_cursor, cursor + i + 1)
            pipe.hincrby(self.keys.stats, "tasks", 1)
            pipe.execute()
        return max(0, room)

    def run(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        self.log.info("feeder_start", task=self.cfg.task.name)
        while not stop.is_set():
            if self.fill() == 0:
                stop.wait(poll_s)
        self.log.info("feeder_stop", cursor=self.backlog()[0])
