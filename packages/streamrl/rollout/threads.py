"""A rollout worker's two thread pools, so blocking work never delays its Redis traffic.

`env` becomes the event loop's default executor: blocking environment steps, tool `apply()`
calls and anything else run with `asyncio.to_thread` go there, up to `rollout.env_threads`
at once (default: `max_concurrency`, one per running episode). The worker's own Redis
round trips run on the asyncio client; against a Redis Cluster (whose asyncio pipelines are
not transactions) task reads and trajectory commits run on `redis` instead, a few threads
that no flood of slow environment steps can take: on asyncio's single default pool (6
threads on 2 cores) a handful of blocking steps used to hold every commit back.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

REDIS_THREADS = 4


class WorkerThreads:
    def __init__(self, env_threads: int, redis_threads: int = REDIS_THREADS) -> None:
        self.env = ThreadPoolExecutor(max_workers=env_threads, thread_name_prefix="env")
        self.redis = ThreadPoolExecutor(max_workers=redis_threads, thread_name_prefix="redis")

    def install(self) -> None:
        """Make `env` the running loop's default executor (what `asyncio.to_thread` uses)."""
        asyncio.get_running_loop().set_default_executor(self.env)

    async def redis_call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a Redis thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.redis, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop both pools without waiting for calls in flight (their episodes are being
        cancelled; a blocked step's thread ends with its call)."""
        self.env.shutdown(wait=False, cancel_futures=True)
        self.redis.shutdown(wait=False, cancel_futures=True)
