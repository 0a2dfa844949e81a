"""What every worker process shares: its identity, config, Redis and a stop signal."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import redis
import structlog

from streamrl.config import Config
from streamrl.logs import configure_logging
from streamrl.names import Keys
from streamrl.transport import make_client

# host:port of trainer process 0's coordination service (trainer.num_processes > 1)
COORDINATOR_ENV = "STREAMRL_COORDINATOR"

WORKER_NAMES = ("feeder", "rollout", "tools", "grouper", "trainer", "colocated")


class NoRedisError(RuntimeError):
    pass


@dataclass
class WorkerContext:
    """Identity and shared handles of one worker process."""

    name: str
    index: int
    cfg: Config
    run_dir: Path
    redis_url: str
    log: structlog.stdlib.BoundLogger
    max_steps: int = 0
    burst: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def keys(self) -> Keys:
        return Keys(self.cfg.run.name)

    @property
    def worker_id(self) -> str:
        return f"{self.name}-{self.index}"

    @property
    def consumer(self) -> str:
        """Consumer name in stream groups: unique per process, so a restarted worker's
        old pending entries are claimed like any dead consumer's."""
        return f"{self.worker_id}-{os.getpid()}"

    def client(self) -> redis.Redis:
        return make_client(self.redis_url)


def make_context(
    name: str,
    index: int,
    cfg: Config,
    run_dir: str | Path,
    *,
    max_steps: int = 0,
    burst: bool = False,
) -> WorkerContext:
    url = cfg.redis_url()
    if not url:
        raise NoRedisError(
            "no Redis to connect to: set REDIS_URL or redis.url "
            "(`streamrl up` starts an embedded one)"
        )
    log = configure_logging(name, worker_id=f"{name}-{index}", pid=os.getpid(), run=cfg.run.name)
    return WorkerContext(
        name=name,
        index=index,
        cfg=cfg,
        run_dir=Path(run_dir),
        redis_url=url,
        log=log,
        max_steps=max_steps,
        burst=burst,
    )


def stop_on_signals(stop: threading.Event, log: structlog.stdlib.BoundLogger) -> None:
    """SIGTERM and SIGINT set `stop`: the worker finishes its current step and exits."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("stop_signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
