"""The rollout worker's admission, commits and task ownership against a real redis-server:
members start as slots free, trajectories that end together are committed together, the
backpressure state read in the background holds reading, and a task is never run twice by
its own worker nor taken back from a worker that claimed it (review M2).

The episodes are scripted (a runner that sleeps and returns a trajectory): what is under
test is the worker's loop and its Redis traffic, not the policy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis
import redis.asyncio as aioredis
import structlog
from structlog.testing import capture_logs

from streamrl.agents.flow import CircuitOpenError
from streamrl.checkpoints import restore_queues, take_snapshot
from streamrl.config import Config, parse_config
from streamrl.names import Keys
from streamrl.rollout.admission import Occupancy
from streamrl.rollout.episode import traj_id
from streamrl.rollout.weights import SyncLock
from streamrl.rollout.worker import RolloutWorker
from streamrl.tasks.registry import make_task
from streamrl.transport import ensure_group, make_async_client, make_client, publish
from streamrl.wire import EpisodeState, SavedTurn, Task, Trajectory, decode, encode_state
from tests.conftest import entries
from tests.integration.test_group_timeout import traj

G = 4


def config(claim_idle_ms: int = 100, **rollout: Any) -> Config:
    transport = {"block_ms": 5, "claim_idle_ms": claim_idle_ms, "claim_every_ms": 10}
    # max_deliveries: the own-claim test claims its running task again every 100 ms (and
    # run.max_restarts must exceed it).
    return parse_config(
        {
            "run": {"max_restarts": 100},
            "transport": {**transport, "max_deliveries": 50},
            "rollout": {"num_generations": G, **rollout},
        }
    )


class SleepyRunner:
    """Stands in for the EpisodeRunner: each episode sleeps `episode_s`, then ends ok.

    `together`: the members of a task end at one moment (`episode_s` after the first one
    started), woken by one future, so all of them end in the same turn of the event loop;
    else each sleeps on its own, and on a loaded machine they may end turns apart."""

    def __init__(self, episode_s: float, together: bool = False) -> None:
        self.episode_s = episode_s
        self.together = together
        self._ends: dict[str, asyncio.Future[None]] = {}
        self.ran: list[tuple[str, int]] = []
        self.running = 0
        self.most_running = 0

    async def run(self, t: Task, member: int, make_episode: object, **_: object) -> Trajectory:
        self.ran.append((t.task_id, member))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if self.together:
                if t.task_id not in self._ends:
                    loop = asyncio.get_running_loop()
                    end = self._ends[t.task_id] = loop.create_future()
                    loop.call_later(self.episode_s, end.set_result, None)
                await asyncio.shield(self._ends[t.task_id])
            else:
                await asyncio.sleep(self.episode_s)
        finally:
            self.running -= 1
        return traj(t, member, float(member))


async def _forever(*_: Any) -> None:
    await asyncio.Event().wait()


async def _ready(_stop: Any) -> bool:
    return True


def make_worker(
    redis_url: str,
    keys: Keys,
    cfg: Config,
    runner: SleepyRunner,
    stop: Callable[[], bool],
    consumer: str = "r0",
) -> tuple[RolloutWorker, aioredis.Redis]:
    aclient = make_async_client(redis_url)
    follower = SimpleNamespace(
        lock=SyncLock(), wait_initial=_ready, follow=_forever, loaded_version=0
    )
    worker = RolloutWorker(
        client=make_client(redis_url),
        aclient=aclient,
        keys=keys,
        cfg=cfg,
        consumer=consumer,
        server=cast(Any, SimpleNamespace(serve=_forever, stalled_s=lambda: 0.0)),
        runner=cast(Any, runner),
        episodes=cast(Any, None),
        follower=cast(Any, follower),
        log=structlog.get_logger(),
        stop=stop,
    )
    return worker, aclient


def write_tasks(rclient: redis.Redis, keys: Keys, cfg: Config, n: int) -> list[Task]:
    tasks = [make_task(cfg.task, cfg.run.seed, cursor, G) for cursor in range(n)]
    for t in tasks:
        publish(rclient, keys.tasks, t)
    return tasks


def written(rclient: redis.Redis, keys: Keys) -> list[Trajectory]:
    return [decode(f, Trajectory) for _, f in entries(rclient, keys.trajectories)]


def pending(rclient: redis.Redis, keys: Keys) -> int:
    return int(rclient.xpending(keys.tasks, keys.CG_ROLLOUT)["pending"])


def run_until(worker: RolloutWorker, aclient: aioredis.Redis, done: Callable[[], bool]) -> None:
    """Run the worker until `done()` (checked by the worker's own stop test), 20 s at most."""
    deadline = time.monotonic() + 20

    async def go() -> None:
        try:
            await worker.run()
        finally:
            await aclient.aclose()

    worker.stop = lambda: done() or time.monotonic() > deadline
    asyncio.run(go())
    assert time.monotonic() <= deadline, "the worker did not finish in time"


def test_members_start_as_slots_free(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    """One slot, groups of four: the members run one after another (the config used to
    refuse max_concurrency < num_generations: a task's members had to start together)."""
    cfg = config(max_concurrency=1)
    [t] = write_tasks(rclient, keys, cfg, 1)
    runner = SleepyRunner(0.02)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    run_until(worker, aclient, lambda: len(runner.ran) == G and pending(rclient, keys) == 0)
    assert runner.most_running == 1
    assert sorted(runner.ran) == [(t.task_id, m) for m in range(G)]
    assert sorted(tr.member for tr in written(rclient, keys)) == list(range(G))
    assert all(tr.cursor == t.cursor for tr in written(rclient, keys))
    assert int(rclient.hget(keys.stats, "tasks_done") or 0) == 1


def test_episodes_that_end_together_commit_together(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Eight episodes of two tasks end at the same moment: one commit (one MULTI/EXEC)
    writes their trajectories and acknowledges both tasks, with the counters summed."""
    cfg = config(max_concurrency=2 * G)
    write_tasks(rclient, keys, cfg, 2)
    runner = SleepyRunner(0.3)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    with capture_logs() as logs:
        run_until(worker, aclient, lambda: pending(rclient, keys) == 0 and len(runner.ran) == 8)
    commits = [e for e in logs if e["event"] == "trajectories_committed"]
    assert sum(len(e["trajectories"]) for e in commits) == 2 * G
    assert len(commits) <= 2, [len(e["trajectories"]) for e in commits]  # batched, not 8
    assert len(written(rclient, keys)) == 2 * G
    s = rclient.hgetall(keys.stats)
    assert s[b"trajectories"] == b"8" and s[b"episodes_ok"] == b"8" and s[b"tasks_done"] == b"2"


def test_backpressure_read_in_the_background_holds_reading(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """While more groups wait for the trainer than max_ready_groups, no task is read; once
    the trainer catches up, reading resumes on its own."""
    cfg = config(max_concurrency=G, max_ready_groups=2)
    rclient.hset(keys.stats, mapping={"groups": 5, "groups_trained": 0})
    write_tasks(rclient, keys, cfg, 1)
    runner = SleepyRunner(0.01)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    paused_at: list[float] = []
    released: list[bool] = []

    def done() -> bool:  # called by the worker's loop about every 0.1 s
        if worker.paused and not paused_at:
            paused_at.append(time.monotonic())
        if paused_at and not released and time.monotonic() - paused_at[0] > 0.5:
            # Paused half a second (the loop ran meanwhile): nothing was read.
            [group] = rclient.xinfo_groups(keys.tasks)
            assert group["last-delivered-id"] in (b"0-0", "0-0") and not runner.ran
            rclient.hset(keys.stats, "groups_trained", 5)
            released.append(True)
        return bool(released) and len(runner.ran) == G and pending(rclient, keys) == 0

    with capture_logs() as logs:
        run_until(worker, aclient, done)
    assert released, "rollout never paused"
    assert [e["event"] for e in logs if e["event"].startswith("backpressure")] == [
        "backpressure_paused",
        "backpressure_resumed",
    ]
    assert rclient.hget(keys.stats, "backpressure_pauses") == b"1"


def test_own_task_claimed_again_is_not_run_twice(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Review M2: a heartbeat late by more than claim_idle_ms (a Redis stall, a saturated
    thread pool) let the worker's own XAUTOCLAIM hand it its in-flight task again; it ran
    every member a second time and then crashed on a KeyError. Now the claimed-again entry
    is recognised and left to the episodes already running it."""
    cfg = config(max_concurrency=2 * G)  # free slots: the worker goes on reading
    [t] = write_tasks(rclient, keys, cfg, 1)
    runner = SleepyRunner(0.6)  # idle far past claim_idle_ms (100 ms) with no heartbeat
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    worker._heartbeat = _forever  # type: ignore[method-assign]  # the late heartbeat
    with capture_logs() as logs:
        run_until(worker, aclient, lambda: len(runner.ran) >= G and pending(rclient, keys) == 0)
    assert sorted(runner.ran) == [(t.task_id, m) for m in range(G)]  # each member once
    assert sorted(tr.member for tr in written(rclient, keys)) == list(range(G))
    assert any(e["event"] == "own_task_claimed_again" for e in logs)
    assert worker._failure is None and rclient.xlen(keys.dead) == 0


def test_task_claimed_by_another_worker_is_not_taken_back(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Review M2, across workers: once another consumer has claimed a task (this worker
    looked dead), the heartbeat no longer XCLAIMs it back (the two used to pass it to and
    fro until the dead letters took it); the worker says so and still commits what it ran."""
    cfg = config(claim_idle_ms=1000, max_concurrency=G)  # heartbeat every 333 ms
    write_tasks(rclient, keys, cfg, 1)
    runner = SleepyRunner(1.5)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    owners: list[str] = []
    claimed_at: list[float] = []

    def done() -> bool:  # called by the worker's loop about every 0.1 s
        if not claimed_at and runner.running == G:
            [row] = rclient.xpending_range(keys.tasks, keys.CG_ROLLOUT, "-", "+", 10)
            rclient.xclaim(keys.tasks, keys.CG_ROLLOUT, "r1", 0, [row["message_id"]], justid=True)
            claimed_at.append(time.monotonic())
        if claimed_at and not owners and time.monotonic() - claimed_at[0] > 0.8:
            # Two heartbeats later, still r1's (and r1 has not been idle for claim_idle_ms).
            [row] = rclient.xpending_range(keys.tasks, keys.CG_ROLLOUT, "-", "+", 10)
            owners.append(str(row["consumer"], "utf-8"))  # type: ignore[arg-type]
        return bool(owners) and pending(rclient, keys) == 0

    with capture_logs() as logs:
        run_until(worker, aclient, done)
    assert owners == ["r1"]  # r0's heartbeat left it with r1
    assert any(e["event"] == "task_claimed_by_another_worker" for e in logs)
    assert len(written(rclient, keys)) == G and worker._failure is None


class FailingRunner(SleepyRunner):
    """Member 0 of the first task fails the worker (a tripped circuit breaker, say) at the
    moment every other episode of the wave ends too."""

    async def run(self, t: Task, member: int, make_episode: object, **_: object) -> Trajectory:
        if t.cursor == 0 and member == 0:
            self.ran.append((t.task_id, member))
            await asyncio.sleep(self.episode_s)
            raise CircuitOpenError("1 consecutive tool infrastructure errors")
        return await super().run(t, member, make_episode)


def test_nothing_starts_after_a_failure(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    """Once an episode failed the worker, the slots that free with it start nothing, not
    even the members already read ahead: in CI a second wave of episodes kept the engine
    busy past the worker's stop (and the process, exiting with a daemon engine thread
    inside XLA, aborted and was restarted instead of stopping the run)."""
    cfg = config(max_concurrency=2 * G)
    write_tasks(rclient, keys, cfg, 6)
    runner = FailingRunner(0.2)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    with pytest.raises(CircuitOpenError):
        run_until(worker, aclient, lambda: False)
    assert len(runner.ran) == 2 * G  # the first wave only
    assert len(worker._waiting) == G  # the task read ahead: never started


def test_backpressure_counts_groups_ended_but_not_yet_committed(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """A group whose episodes have all ended is ready in a moment, though Redis does not
    count it yet (its commit is in flight, the grouper has not emitted it): the reader
    counts it, or a burst of ending episodes would read a whole wave past the bound."""
    cfg = config(max_concurrency=G, max_ready_groups=1)
    write_tasks(rclient, keys, cfg, 3)
    # A grouper that takes every trajectory at once counts none waiting (without one,
    # rollout pauses on the trajectories nobody groups: review N11).
    rclient.set(keys.groups_waiting, 0, px=60_000)
    runner = SleepyRunner(0.5, together=True)  # a burst: every member ends in one turn
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    release = asyncio.Event()
    real_commit = worker.input.acommit

    async def held_commit(*args: Any, **kwargs: Any) -> None:
        await release.wait()  # the commits hang ...
        await real_commit(*args, **kwargs)

    worker.input.acommit = held_commit  # type: ignore[method-assign]
    seen: list[tuple[bool, int]] = []

    def done() -> bool:  # called by the worker's loop about every 0.1 s
        # While the second task runs (the first one ended, its commit held), sampled from
        # the second call on: the reader has had a turn of the loop to look.
        if len(runner.ran) == 2 * G and runner.running == G and not release.is_set():
            seen.append((worker.paused, worker.read_tasks))
            if len(seen) == 3:  # ... for a few turns of the loop
                release.set()
        return release.is_set() and len(runner.ran) == 3 * G and pending(rclient, keys) == 0

    run_until(worker, aclient, done)
    # The first read took two tasks (one running, one ahead); the third waited, paused.
    assert seen[1:] == [(True, 2)] * 2, seen
    assert len(written(rclient, keys)) == 3 * G


class ResumingRunner(SleepyRunner):
    """Records the saved state each member started from (None: from the start)."""

    def __init__(self, episode_s: float) -> None:
        super().__init__(episode_s)
        self.resumed: dict[int, int | None] = {}

    async def run(self, t: Task, member: int, make_episode: object, **kw: Any) -> Trajectory:
        resume: EpisodeState | None = kw["resume"]
        self.resumed[member] = None if resume is None else resume.turn
        return await super().run(t, member, make_episode)


def _died_mid_task(rclient: redis.Redis, keys: Keys, cfg: Config) -> Task:
    """Two tasks a dead worker read: of the first it committed member 0 and saved member 1
    at its first turn boundary; of the second it committed every member, not its ack."""
    t, done_task = write_tasks(rclient, keys, cfg, 2)
    ensure_group(rclient, keys.tasks, keys.CG_ROLLOUT)
    rclient.xreadgroup(keys.CG_ROLLOUT, "dead", {keys.tasks: ">"}, count=2)  # then it died

    def put(task: Task, member: int, state: EpisodeState) -> None:
        rclient.hset(keys.episodes, traj_id(task, member), encode_state(state))

    put(t, 0, EpisodeState(traj_id=traj_id(t, 0), committed=True))
    turn = SavedTurn(start=3, end=5, observations=["ok"])
    put(t, 1, EpisodeState(traj_id=traj_id(t, 1), versions=[0], turns=[turn]))
    for m in range(G):
        put(done_task, m, EpisodeState(traj_id=traj_id(done_task, m), committed=True))
    return t


@pytest.mark.parametrize("redis_lost", [False, True])
def test_claimed_task_runs_only_uncommitted_members_from_their_states(
    rclient: redis.Redis, redis_url: str, keys: Keys, redis_lost: bool
) -> None:
    """A task claimed from a dead worker: the member it committed (its marker) is not run
    again, the member it saved at a turn boundary resumes from that state, the others
    start over; a task whose members all committed before its ack is acknowledged without
    running anything. The acks leave no entry in the episodes hash. The same when Redis
    lost the run and the queues came back from a snapshot (the tasks are then delivered as
    new ones, and the hash came back with them)."""
    cfg = config()
    t = _died_mid_task(rclient, keys, cfg)
    if redis_lost:
        snap = take_snapshot(rclient, keys)
        rclient.delete(*rclient.keys(keys.every_key))
        restore_queues(rclient, keys, snap)
        assert rclient.hlen(keys.episodes) == 2 + G
    runner = ResumingRunner(0.05)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    run_until(
        worker,
        aclient,
        lambda: rclient.xlen(keys.trajectories) == 3 and pending(rclient, keys) == 0,
    )
    assert runner.resumed == {1: 1, 2: None, 3: None}
    assert rclient.hget(keys.stats, "tasks_done") == b"2"  # both feeder tasks are done
    assert sorted(tr.traj_id for tr in written(rclient, keys)) == [traj_id(t, m) for m in (1, 2, 3)]
    assert rclient.hlen(keys.episodes) == 0


def test_a_stalled_engine_stops_the_liveness_tick(redis_url: str, keys: Keys) -> None:
    """Review N9: the loop's tick stops while the engine has had work and finished no step
    for run.liveness_timeout_s (a wedged engine thread), so the beat stops and the
    launcher restarts the worker; it ticks again once the engine steps."""
    cfg = parse_config({"run": {"liveness_timeout_s": 2}})
    worker, aclient = make_worker(redis_url, keys, cfg, SleepyRunner(0.1), lambda: True)
    stalled = {"s": 0.0}
    worker.server = cast(Any, SimpleNamespace(stalled_s=lambda: stalled["s"]))
    try:
        with capture_logs() as logs:
            worker._tick()
            assert worker.liveness.live(0.2)
            stalled["s"] = 2.5  # past the limit
            time.sleep(0.3)
            worker._tick()
            worker._tick()
            assert not worker.liveness.live(0.2)  # no tick: the beat would stop
            stalled["s"] = 0.0
            worker._tick()
            assert worker.liveness.live(0.2)
        assert [e["event"] for e in logs].count("engine_stalled") == 1
    finally:
        asyncio.run(aclient.aclose())


class PoolRunner(SleepyRunner):
    """Episodes that each hold one slot of a KV pool of `slots` while they run; a start
    with every slot held by an episode evicts a parked session (counted, as the engine
    does). `foreign` slots are held decoding by something else (a request that arrives
    with none free waits, as in the engine)."""

    def __init__(self, episode_s: float, slots: int, foreign: int = 0) -> None:
        super().__init__(episode_s)
        self.slots = slots
        self.foreign = foreign
        self.evictions = 0

    async def run(self, t: Task, member: int, make_episode: object, **kw: object) -> Trajectory:
        if self.running >= self.slots:
            self.evictions += 1
        return await super().run(t, member, make_episode, **kw)

    def occupancy(self) -> Occupancy:
        held = min(self.running + self.foreign, self.slots)
        return Occupancy(self.slots, held, self.running + self.foreign - held, self.evictions)


def test_auto_admission_fills_the_kv_pool_and_never_overflows_it(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """rollout.max_concurrency = "auto" (issue 29 item 4) on an engine of 8 slots: the limit
    starts at the pool and, no slot being free beyond it, stays there: episodes never
    outnumber the slots (no eviction, no trim), where a fixed max_concurrency of 16 runs
    16 at once and evicts."""
    # no grouper here: the ready-group cap opened (else rollout pauses after 2 B groups)
    cfg = config(max_concurrency="auto", max_concurrency_cap=64, max_batch_size=8,
                 max_ready_groups=1000)  # fmt: skip
    assert (cfg.rollout.admission, cfg.rollout.max_concurrency) == ("auto", 64)
    write_tasks(rclient, keys, cfg, 40)
    runner = PoolRunner(0.1, slots=8)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    worker.server = cast(Any, SimpleNamespace(serve=_forever, stalled_s=lambda: 0.0,
                                              occupancy=runner.occupancy))  # fmt: skip
    limits: list[int] = []

    def done() -> bool:
        limits.append(worker.admission.limit)
        return len(written(rclient, keys)) == 40 * G

    run_until(worker, aclient, done)
    assert set(limits) == {8} and worker.admission.trims == worker.admission.grows == 0
    assert runner.evictions == 0 and runner.most_running == 8
    assert rclient.hget(keys.stats, "admission_trims") is None
    fixed = PoolRunner(0.1, slots=8)
    cfg16 = config(max_concurrency=16, max_batch_size=8, max_ready_groups=1000)
    write_tasks(rclient, keys, cfg16, 8)
    worker, aclient = make_worker(redis_url, keys, cfg16, fixed, lambda: False)
    run_until(worker, aclient, lambda: len(written(rclient, keys)) == 48 * G)
    assert fixed.most_running == 16 and fixed.evictions > 0


def test_auto_admission_follows_slots_that_others_hold(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """A pool of 4 slots, one of them held by something else: the limit starts at the pool
    (4), 4 episodes and the foreign slot overflow it (a request finds no slot): trimmed to
    0.9 x 4 = 3, counted in the stats and logged, no episode preempted (each of the 4
    running ends); once the foreign slot frees, the limit grows back to 4."""
    cfg = config(max_concurrency="auto", max_concurrency_cap=64, max_batch_size=4,
                 max_ready_groups=1000)  # fmt: skip
    write_tasks(rclient, keys, cfg, 16)
    runner = PoolRunner(0.3, slots=4, foreign=1)
    worker, aclient = make_worker(redis_url, keys, cfg, runner, lambda: False)
    worker.server = cast(Any, SimpleNamespace(serve=_forever, stalled_s=lambda: 0.0,
                                              occupancy=runner.occupancy))  # fmt: skip
    limits: list[int] = []

    def done() -> bool:
        limits.append(worker.admission.limit)
        if len(written(rclient, keys)) >= 8 * G:
            runner.foreign = 0  # half the run done: the other holder lets its slot go
        return len(written(rclient, keys)) == 16 * G

    with capture_logs() as logs:
        run_until(worker, aclient, done)
    trims = [e for e in logs if e["event"] == "admission_trimmed"]
    assert trims and trims[0]["was"] == 4 and trims[0]["limit"] == 3
    assert int(rclient.hget(keys.stats, "admission_trims") or 0) == worker.admission.trims >= 1
    assert min(limits) == 3 and limits[-1] == 4 and worker.admission.grows >= 1
    assert runner.evictions == 0 and sorted(t.member for t in written(rclient, keys)) == sorted(
        m for _ in range(16) for m in range(G)
    )
