"""A rollout worker's thread pools: blocking environment work fills its own pool and never
holds back the worker's Redis calls (issue 14: blocking work has its own threads)."""

from __future__ import annotations

import asyncio
import threading

from streamrl.rollout.threads import WorkerThreads


def test_blocked_environment_threads_leave_redis_calls_free() -> None:
    release = threading.Event()
    started: list[str] = []
    lock = threading.Lock()

    def blocking_step() -> str:
        with lock:
            started.append(threading.current_thread().name)
        release.wait(30)
        return "stepped"

    async def main() -> tuple[str, list[str], list[str]]:
        threads = WorkerThreads(env_threads=2, redis_threads=1)
        threads.install()
        try:
            steps = [asyncio.create_task(asyncio.to_thread(blocking_step)) for _ in range(3)]
            while len(started) < 2:
                await asyncio.sleep(0.01)
            # both env threads are blocked: a commit still runs, on a Redis thread
            where = await asyncio.wait_for(
                threads.redis_call(lambda: threading.current_thread().name), 10
            )
            queued = list(started)  # the third step waits for an env thread
            release.set()
            results = await asyncio.gather(*steps)
            return where, queued, results
        finally:
            threads.close()

    where, queued, results = asyncio.run(main())
    assert where.startswith("redis")
    assert len(queued) == 2 and all(name.startswith("env") for name in queued)
    assert results == ["stepped"] * 3 and len(started) == 3
