"""The rollout worker's loop: read tasks, run their members' episodes (all
`num_generations`, or the members a re-run task names), emit trajectories, acknowledge a
task only with the write of its last trajectory.

Up to `max_concurrency` episodes run at once on one event loop. No new episode starts while
weights sync (the follower's lock), or while too many groups wait for the trainer or are
half filled (backpressure). Entries still being worked on are touched regularly, so a long
episode is not mistaken for the work of a dead consumer and claimed by another worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis
import redis.asyncio as aioredis
import structlog

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.rollout.engine_server import EngineServer
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.weights import WeightFollower
from streamrl.tasks.registry import Episodes
from streamrl.transport import Delivery, RedisStreamConsumer
from streamrl.wire import Task, Trajectory

BACKPRESSURE_PAUSES = "backpressure_pauses"  # stats counter: times rollout entered a pause


class Backpressure:
    """Whether rollout may start a new task: not while `max_ready_groups` groups wait for
    the trainer, nor while `max_partial_groups` groups are half filled (HLEN of the
    groups-started hash). Each move into the paused state is counted once in stats
    (`backpressure_pauses`) and logged with its reason, as is the resume."""

    def __init__(
        self,
        aclient: aioredis.Redis,
        keys: Keys,
        cfg: Config,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.aclient = aclient
        self.keys = keys
        self.cfg = cfg
        self.log = log
        self.paused_since: float | None = None  # monotonic time of the pause, None: running

    async def reason(self) -> str | None:
        """Why no task may start now, or None."""
        rcfg = self.cfg.rollout
        pipe = self.aclient.pipeline(transaction=False)
        pipe.hmget(self.keys.stats, ["groups", "groups_trained"])
        pipe.hlen(self.keys.groups_started)
        raw, partial = await pipe.execute()
        ready = int(raw[0] or 0) - int(raw[1] or 0)
        if ready >= rcfg.max_ready_groups:
            return f"{ready} groups wait for the trainer (max_ready_groups {rcfg.max_ready_groups})"
        if rcfg.max_partial_groups and int(partial) >= rcfg.max_partial_groups:
            return (
                f"{partial} groups are half filled (max_partial_groups {rcfg.max_partial_groups})"
            )
        return None

    async def check(self) -> bool:
        """True while rollout must wait."""
        why = await self.reason()
        if why is not None and self.paused_since is None:
            self.paused_since = time.monotonic()
            await self.aclient.hincrby(self.keys.stats, BACKPRESSURE_PAUSES, 1)
            self.log.info("backpressure_paused", reason=why)
        elif why is None and self.paused_since is not None:
            paused_s = time.monotonic() - self.paused_since
            self.paused_since = None
            self.log.info("backpressure_resumed", paused_s=round(paused_s, 3))
        return why is not None


class RolloutWorker:
    def __init__(
        self,
        *,
        client: redis.Redis,
        aclient: aioredis.Redis,
        keys: Keys,
        cfg: Config,
        consumer: str,
        server: EngineServer,
        runner: EpisodeRunner,
        episodes: Episodes,
        follower: WeightFollower,
        log: structlog.stdlib.BoundLogger,
        stop: Callable[[], bool],
    ) -> None:
        self.aclient = aclient
        self.keys = keys
        self.cfg = cfg
        self.server = server
        self.runner = runner
        self.episodes = episodes
        self.follower = follower
        self.log = log
        self.stop = stop
        self.input = RedisStreamConsumer(
            client, keys, keys.tasks, keys.CG_ROLLOUT, consumer, Task, cfg.transport, log
        )
        self.backpressure = Backpressure(aclient, keys, cfg, log)
        self.active = 0
        self.started = 0
        self._capacity = asyncio.Condition()
        self._remaining: dict[str, int] = {}
        self._episodes: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None

    async def run(self) -> None:
        """Serve until `stop()` is true; re-raises the first failure of a component."""
        if not await self.follower.wait_initial(self.stop):
            return
        self.log.info("rollout_ready", version=self.follower.loaded_version)
        parts = [
            asyncio.create_task(self.server.serve(), name="model-server"),
            asyncio.create_task(self.follower.follow(self.stop), name="weights"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._task_loop(), name="tasks"),
        ]
        try:
            while not self.stop() and self._failure is None:
                done = [p for p in parts if p.done()]
                for p in done:
                    p.result()  # re-raises a component's error: the process stops with it
                    raise RuntimeError(f"component {p.get_name()} stopped unexpectedly")
                await asyncio.sleep(0.1)
            if self._failure is not None:
                raise self._failure
        finally:
            for t in [*parts, *self._episodes]:
                t.cancel()
            await asyncio.gather(*parts, *self._episodes, return_exceptions=True)

    async def _task_loop(self) -> None:
        n = self.cfg.rollout.num_generations
        while not self.stop():
            async with self._capacity:
                await self._capacity.wait_for(
                    lambda: self.active + n <= self.cfg.rollout.max_concurrency
                )
            if await self._backpressured():
                await asyncio.sleep(0.2)
                continue
            await self.follower.lock.wait_open()
            deliveries = await asyncio.to_thread(self.input.read, 1)
            for d in deliveries:
                await self.follower.lock.wait_open()  # a sync may have begun during the read
                self._start(d)

    async def _backpressured(self) -> bool:
        return await self.backpressure.check()

    def _start(self, d: Delivery[Task]) -> None:
        """Start the task's episodes: every member, or those a re-run task names."""
        task = d.msg
        members = task.member_indices()
        self._remaining[d.entry_id] = len(members)
        for member in members:
            self.follower.lock.enter()
            self.active += 1
            self.started += 1
            ep = asyncio.create_task(self._episode(d, member), name=f"{task.group_id}-m{member}")
            self._episodes.add(ep)
            ep.add_done_callback(self._episode_done)

    def _episode_done(self, ep: asyncio.Task[None]) -> None:
        self._episodes.discard(ep)
        if not ep.cancelled() and ep.exception() is not None and self._failure is None:
            self._failure = ep.exception()

    async def _episode(self, d: Delivery[Task], member: int) -> None:
        try:
            traj = await self.runner.run(d.msg, member, lambda: self.episodes.make(d.msg, member))
            # The cursor lets a grouper rebuild the task to re-run a member lost to a timeout.
            await self._emit(d, msgspec.structs.replace(traj, cursor=d.msg.cursor))
        finally:
            self.active -= 1
            self.follower.lock.leave()
            async with self._capacity:
                self._capacity.notify_all()

    async def _emit(self, d: Delivery[Task], traj: Trajectory) -> None:
        self._remaining[d.entry_id] -= 1
        last = self._remaining[d.entry_id] == 0
        stats = self.keys.stats

        # The feeder's backlog counts its own tasks done; a re-run task is not one of them.
        done = "tasks_done" if d.msg.members is None else "rerun_tasks_done"

        def counters(p: Any) -> None:
            p.hincrby(stats, "trajectories", 1)
            p.hincrby(stats, f"episodes_{traj.status}", 1)
            if last:
                p.hincrby(stats, done, 1)

        await asyncio.to_thread(
            self.input.commit,
            [d.entry_id] if last else [],
            [(self.keys.trajectories, traj)],
            counters,
        )
        if last:
            del self._remaining[d.entry_id]
        self.log.info(
            "trajectory",
            traj_id=traj.traj_id,
            entry_id=d.entry_id,
            status=traj.status,
            reward=traj.reward,
            versions=traj.versions,
            tokens=len(traj.token_array()),
            tool_calls=traj.num_tool_calls,
            error=traj.error or None,
        )

    async def _heartbeat(self) -> None:
        every = self.cfg.transport.claim_idle_ms / 3000
        while True:
            await asyncio.sleep(every)
            if self._remaining:
                await asyncio.to_thread(self.input.touch, list(self._remaining))
