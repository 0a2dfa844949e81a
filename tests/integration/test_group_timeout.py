"""Group timeout policies against a real redis-server: a group of four generations whose
fourth member never comes is dropped, re-run (only that member) or released, once, however
many groupers look."""

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
import redis
import structlog
from structlog.testing import capture_logs

from streamrl.config import Config, parse_config
from streamrl.grouper import Grouper, Outcome
from streamrl.names import Keys
from streamrl.rollout.weights import SyncLock
from streamrl.rollout.worker import RolloutWorker
from streamrl.tasks.registry import make_task
from streamrl.transport import make_async_client, make_client, publish
from streamrl.wire import Group, Task, Trajectory, decode, encode_body, pack_arrays
from tests.conftest import entries

TIMEOUT_S = 0.3
N = 4


def config(policy: str, max_reruns: int = 2, timeout_s: float = TIMEOUT_S) -> Config:
    return parse_config(
        {
            "transport": {"block_ms": 5, "claim_idle_ms": 200, "claim_every_ms": 20},
            "grouper": {
                "group_timeout_s": timeout_s,
                "group_timeout_policy": policy,
                "max_reruns": max_reruns,
            },
        }
    )


def task(cfg: Config, cursor: int) -> Task:
    return make_task(cfg.task, cfg.run.seed, cursor, N)


def traj(t: Task, member: int, reward: float) -> Trajectory:
    """Member `member` of task `t`'s group, as a rollout worker writes it."""
    return Trajectory(
        traj_id=f"{t.group_id}-m{member}",
        group_id=t.group_id,
        task_id=t.task_id,
        member=member,
        num_generations=t.num_generations,
        **pack_arrays([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2]),
        prompt_len=1,
        reward=reward,
        status="ok",
        versions=[0],
        cursor=t.cursor,
    )


REWARDS = [1.0, 0.0, 0.0, 1.0]
MISSING = 2  # the member whose episode never reports


def three_of_four(rclient: redis.Redis, keys: Keys, g: Grouper, cursor: int = 0) -> Task:
    """Write members 0, 1, 3 of the task at `cursor` (member 2 is lost) and group them."""
    t = task(g.cfg, cursor)
    for m in range(N):
        if m != MISSING:
            publish(rclient, keys.trajectories, traj(t, m, REWARDS[m]))
    assert {o.kind for o in g.step()} == {"partial"}
    return t


def grouper(url: str, keys: Keys, cfg: Config, name: str = "g0") -> Grouper:
    return Grouper(make_client(url), keys, cfg, name, structlog.get_logger())


def groups_out(rclient: redis.Redis, keys: Keys) -> list[Group]:
    return [decode(f, Group) for _, f in entries(rclient, keys.groups)]


def tasks_out(rclient: redis.Redis, keys: Keys) -> list[Task]:
    return [decode(f, Task) for _, f in entries(rclient, keys.tasks)]


def stats(rclient: redis.Redis, keys: Keys) -> dict[str, int]:
    raw: Any = rclient.hgetall(keys.stats)
    return {k.decode(): int(v) for k, v in raw.items()}


def past_timeout() -> None:
    time.sleep(TIMEOUT_S + 0.05)


def test_nothing_happens_before_the_timeout_or_when_disabled(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = grouper(redis_url, keys, config("drop"))
    three_of_four(rclient, keys, g)
    assert g.check_timeouts() == []  # younger than the timeout
    off = grouper(redis_url, keys, config("drop", timeout_s=0), "g1")
    past_timeout()
    assert off.check_timeouts() == []  # 0: disabled
    assert rclient.hlen(keys.groups_started) == 1


def test_drop_policy(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, config("drop"))
    t = three_of_four(rclient, keys, g)
    past_timeout()
    with capture_logs() as logs:
        assert g.check_timeouts() == [Outcome("dropped", t.group_id)]
    [ev] = [e for e in logs if e["event"] == "group_dropped"]
    assert ev["group_id"] == t.group_id and ev["missing"] == [MISSING]
    assert "group_timeout_s" in ev["reason"]
    assert g.check_timeouts() == []  # once
    # The late member is dropped like any member of a dropped group.
    publish(rclient, keys.trajectories, traj(t, MISSING, 1.0))
    assert [o.kind for o in g.step()] == ["closed"]
    assert groups_out(rclient, keys) == []
    s = stats(rclient, keys)
    assert s["groups_timed_out"] == 1 and s["groups_dropped"] == 1
    assert s["trajectories_dropped"] == 4 and "groups" not in s
    assert rclient.hlen(keys.groups_started) == 0
    assert not rclient.exists(keys.group_members(t.group_id))


def test_rerun_policy_reruns_only_the_missing_member(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    cfg = config("rerun")
    g = grouper(redis_url, keys, cfg)
    t = three_of_four(rclient, keys, g)
    past_timeout()
    with capture_logs() as logs:
        assert g.check_timeouts() == [Outcome("rerun", t.group_id)]
    [ev] = [e for e in logs if e["event"] == "group_rerun"]
    assert ev["group_id"] == t.group_id and ev["missing"] == [MISSING] and ev["rerun"] == 1
    [rerun] = tasks_out(rclient, keys)
    assert rerun.members == [MISSING] and rerun.member_indices() == [MISSING]
    # The group's own task, so the re-run member keeps its index and trajectory id.
    assert (rerun.task_id, rerun.group_id, rerun.prompt) == (t.task_id, t.group_id, t.prompt)
    assert g.check_timeouts() == []  # the rerun restarted the group's clock
    s = stats(rclient, keys)
    assert s["groups_timed_out"] == 1 and s["groups_rerun"] == 1
    assert int(rclient.hget(keys.groups_reruns, t.group_id) or 0) == 1

    publish(rclient, keys.trajectories, traj(t, MISSING, REWARDS[MISSING]))
    publish(rclient, keys.trajectories, traj(t, MISSING, REWARDS[MISSING]))  # sent twice
    assert [o.kind for o in g.step()] == ["emitted", "duplicate"]
    [group] = groups_out(rclient, keys)
    assert [m.member for m in group.members] == [0, 1, 2, 3]
    assert [m.traj_id for m in group.members] == [f"{t.group_id}-m{i}" for i in range(N)]
    assert [round(a, 4) for a in group.advantages] == [1.0, -1.0, -1.0, 1.0]
    assert stats(rclient, keys)["groups"] == 1
    assert not rclient.hexists(keys.groups_reruns, t.group_id)  # cleaned up with the group
    assert rclient.hlen(keys.groups_started) == 0


class ScriptedRunner:
    """Stands in for the EpisodeRunner: member m of any task gets reward REWARDS[m]."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, int]] = []

    async def run(self, t: Task, member: int, make_episode: object, **_: object) -> Trajectory:
        self.ran.append((t.task_id, member))
        return msgspec.structs.replace(traj(t, member, REWARDS[member]), cursor=-1)  # no cursor


def test_rollout_runs_only_the_rerun_members_and_acks_with_the_last(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """The whole rerun loop: grouper rerun task -> rollout worker runs member 2 only ->
    the group is emitted complete, once."""
    cfg = config("rerun")
    g = grouper(redis_url, keys, cfg)
    t = three_of_four(rclient, keys, g)
    past_timeout()
    assert [o.kind for o in g.check_timeouts()] == ["rerun"]
    runner = ScriptedRunner()

    async def go() -> None:
        aclient = make_async_client(redis_url)
        worker = RolloutWorker(
            client=make_client(redis_url),
            aclient=aclient,
            keys=keys,
            cfg=cfg,
            consumer="r0",
            server=cast(Any, None),
            runner=cast(Any, runner),
            episodes=cast(Any, None),
            follower=cast(Any, SimpleNamespace(lock=SyncLock())),
            log=structlog.get_logger(),
            stop=lambda: False,
        )
        [d] = worker.input.read(1)
        worker._admit(d, {})
        worker._start_waiting()
        assert worker.started == 1
        await asyncio.gather(*worker._episodes)
        await worker._commit_outbox()
        await aclient.aclose()

    asyncio.run(go())
    assert runner.ran == [(t.task_id, MISSING)]
    [written] = [decode(f, Trajectory) for _, f in entries(rclient, keys.trajectories)][-1:]
    assert written.member == MISSING and written.cursor == t.cursor  # the worker adds it
    assert rclient.xpending(keys.tasks, keys.CG_ROLLOUT)["pending"] == 0  # acked
    s = stats(rclient, keys)
    assert s["rerun_tasks_done"] == 1 and "tasks_done" not in s  # not the feeder's task
    assert [o.kind for o in g.step()] == ["emitted"]
    [group] = groups_out(rclient, keys)
    assert [m.member for m in group.members] == [0, 1, 2, 3]


def test_max_reruns_falls_back_to_drop(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, config("rerun", max_reruns=1))
    t = three_of_four(rclient, keys, g)
    past_timeout()
    assert g.check_timeouts() == [Outcome("rerun", t.group_id)]
    past_timeout()  # the re-run member does not come either
    with capture_logs() as logs:
        assert g.check_timeouts() == [Outcome("dropped", t.group_id)]
    [ev] = [e for e in logs if e["event"] == "group_dropped"]
    assert "after 1 reruns (max_reruns 1)" in ev["reason"]
    assert len(tasks_out(rclient, keys)) == 1
    s = stats(rclient, keys)
    assert s["groups_timed_out"] == 2 and s["groups_rerun"] == 1 and s["groups_dropped"] == 1
    assert not rclient.hexists(keys.groups_reruns, t.group_id)
    publish(rclient, keys.trajectories, traj(t, MISSING, 1.0))  # the rerun's member, late
    assert [o.kind for o in g.step()] == ["closed"]
    # max_reruns 0: drop at the first timeout.
    g0 = grouper(redis_url, keys, config("rerun", max_reruns=0), "g1")
    t1 = three_of_four(rclient, keys, g0, cursor=1)
    past_timeout()
    assert g0.check_timeouts() == [Outcome("dropped", t1.group_id)]
    assert len(tasks_out(rclient, keys)) == 1


def test_release_policy(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, config("release"))
    t = three_of_four(rclient, keys, g)
    past_timeout()
    with capture_logs() as logs:
        assert g.check_timeouts() == [Outcome("released", t.group_id)]
    assert [e["group_id"] for e in logs if e["event"] == "group_released"] == [t.group_id]
    [group] = groups_out(rclient, keys)
    assert [m.member for m in group.members] == [0, 1, 3]
    # advantages over the three present: rewards 1, 0, 1, mean 2/3, std sqrt(2/9) = 0.4714;
    # (1 - 2/3) / 0.4714 = 0.7071, (0 - 2/3) / 0.4714 = -1.4142
    assert [round(a, 4) for a in group.advantages] == [0.7071, -1.4142, 0.7071]
    s = stats(rclient, keys)
    assert s["groups_timed_out"] == 1 and s["groups_released"] == 1 and s["groups"] == 1
    assert g.check_timeouts() == []
    publish(rclient, keys.trajectories, traj(t, MISSING, 1.0))  # late: the group is out
    assert [o.kind for o in g.step()] == ["duplicate"]
    assert len(groups_out(rclient, keys)) == 1


def test_release_needs_two_members(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, config("release"))
    t = task(g.cfg, 0)
    publish(rclient, keys.trajectories, traj(t, 0, 1.0))
    g.step()
    past_timeout()
    with capture_logs() as logs:
        assert g.check_timeouts() == [Outcome("dropped", t.group_id)]
    [ev] = [e for e in logs if e["event"] == "group_dropped"]
    assert "release needs 2 members, 1 present" in ev["reason"]
    assert groups_out(rclient, keys) == []
    s = stats(rclient, keys)
    assert s["groups_dropped"] == 1 and "groups_released" not in s


@pytest.mark.parametrize("policy", ["drop", "rerun", "release"])
def test_racing_groupers_decide_once(
    policy: str, rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    cfg = config(policy)
    writer = grouper(redis_url, keys, cfg)
    n_groups = 20
    for cursor in range(n_groups):
        three_of_four(rclient, keys, writer, cursor)
    past_timeout()
    racers = [grouper(redis_url, keys, cfg, f"r{i}") for i in range(4)]
    start = threading.Barrier(len(racers))
    results: list[list[Outcome]] = [[] for _ in racers]

    def race(i: int) -> None:
        start.wait()
        results[i] = racers[i].check_timeouts()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(racers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    decided = [o.group_id for r in results for o in r]
    assert sorted(decided) == sorted({task(cfg, c).group_id for c in range(n_groups)})
    s = stats(rclient, keys)
    assert s["groups_timed_out"] == n_groups
    expected = {"drop": "groups_dropped", "rerun": "groups_rerun", "release": "groups_released"}
    assert s[expected[policy]] == n_groups
    assert len(tasks_out(rclient, keys)) == (n_groups if policy == "rerun" else 0)
    assert len(groups_out(rclient, keys)) == (n_groups if policy == "release" else 0)


def test_run_loop_checks_timeouts(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, config("drop"))
    three_of_four(rclient, keys, g)
    stop = threading.Event()
    th = threading.Thread(target=g.run, args=(stop,))
    th.start()
    try:
        deadline = time.monotonic() + 10
        while not rclient.hget(keys.stats, "groups_dropped") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        th.join(timeout=10)
    assert stats(rclient, keys)["groups_timed_out"] == 1


def stuck_complete_group(rclient: redis.Redis, keys: Keys, cfg: Config, cursor: int = 0) -> Task:
    """A complete group as the grouper leaves it when the entry that completed it is
    dead-lettered after its add answered `complete` (review M8): every member in the hash,
    its start time long past, never emitted, nothing pending."""
    t = task(cfg, cursor)
    for m in range(N):
        rclient.hset(keys.group_members(t.group_id), str(m), encode_body(traj(t, m, REWARDS[m])))
    rclient.hset(keys.groups_started, t.group_id, 1)  # ms since the epoch: long ago
    return t


@pytest.mark.parametrize("timeout_s", [TIMEOUT_S, 0.0], ids=["timeout", "no-timeout"])
def test_a_complete_group_left_unemitted_is_emitted(
    rclient: redis.Redis, redis_url: str, keys: Keys, timeout_s: float
) -> None:
    """Without a group timeout (0) a complete group is looked at once its completing entry
    must have been emitted or dead-lettered: (max_deliveries + 1) x claim_idle_ms; an
    incomplete one still waits for ever."""
    g = grouper(redis_url, keys, config("drop", timeout_s=timeout_s))
    t = stuck_complete_group(rclient, keys, g.cfg)
    waiting = task(g.cfg, 1)
    publish(rclient, keys.trajectories, traj(waiting, 0, 1.0))
    g.step()
    rclient.hset(keys.groups_started, waiting.group_id, 1)  # as old, but incomplete
    with capture_logs() as logs:
        outcomes = g.check_timeouts()
    assert Outcome("emitted", t.group_id) in outcomes
    [ev] = [e for e in logs if e["event"] == "group_emitted"]
    assert ev["group_id"] == t.group_id and "complete but never emitted" in ev["reason"]
    [group] = groups_out(rclient, keys)
    assert [m.member for m in group.members] == [0, 1, 2, 3]
    assert [round(a, 4) for a in group.advantages] == [1.0, -1.0, -1.0, 1.0]
    s = stats(rclient, keys)
    assert s["groups"] == 1 and "groups_released" not in s
    assert s.get("groups_timed_out", 0) == (1 if timeout_s else 0)  # the incomplete one
    assert not rclient.exists(keys.group_members(t.group_id))
    assert not rclient.hexists(keys.groups_started, t.group_id)
    assert rclient.hexists(keys.groups_started, waiting.group_id) == (not timeout_s)
    assert Outcome("emitted", t.group_id) not in g.check_timeouts()  # once
    # the entry that completed it, delivered again after all, finds it emitted
    publish(rclient, keys.trajectories, traj(t, N - 1, REWARDS[N - 1]))
    assert [o.kind for o in g.step()] == ["duplicate"]
    assert len(groups_out(rclient, keys)) == 1
