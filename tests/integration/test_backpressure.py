"""Backpressure on half-filled groups against a real redis-server: rollout pauses while
`max_partial_groups` groups are being assembled (counted once per pause), and a slow
environment shows in `streamrl queues` as more half-filled groups, growing older."""

import asyncio
import time
from collections.abc import MutableMapping
from typing import Any

import redis
import structlog
from structlog.testing import capture_logs

from streamrl.config import Config, parse_config
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.queues import format_report, inspect
from streamrl.rollout.worker import Backpressure
from streamrl.transport import make_async_client, publish
from streamrl.wire import Trajectory, pack_arrays
from tests.helpers import queues_json

CFG = parse_config(
    {
        "transport": {"block_ms": 5},
        "rollout": {"max_partial_groups": 2, "max_ready_groups": 3},
        "grouper": {"group_timeout_s": 600},  # (required by max_partial_groups)
    }
)


def member(group: int, m: int, reward: float = 0.0) -> Trajectory:
    return Trajectory(
        traj_id=f"g{group}-m{m}", group_id=f"g{group}", task_id=f"t{group}", member=m,
        num_generations=4, **pack_arrays([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2]),
        prompt_len=1, reward=reward, status="ok", versions=[0],
    )  # fmt: skip


def add(rclient: redis.Redis, g: Grouper, *members: Trajectory) -> None:
    for t in members:
        publish(rclient, g.keys.trajectories, t)
    g.step()


def pauses(rclient: redis.Redis, keys: Keys) -> int:
    return int(rclient.hget(keys.stats, "backpressure_pauses") or 0)


def test_rollout_pauses_on_half_filled_groups(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = Grouper(rclient, keys, CFG, "g0", structlog.get_logger())

    async def go() -> list[MutableMapping[str, Any]]:
        aclient = make_async_client(redis_url)
        bp = Backpressure(aclient, keys, CFG, structlog.get_logger())
        with capture_logs() as logs:
            assert not await bp.check()
            add(rclient, g, member(1, 0))
            assert not await bp.check()  # one half-filled group, limit 2
            add(rclient, g, member(2, 0))
            assert await bp.check()
            assert await bp.check()  # still paused: one pause, counted once
            assert pauses(rclient, keys) == 1
            add(rclient, g, *(member(1, m, float(m)) for m in range(1, 4)))  # g1 completes
            assert not await bp.check()
            add(rclient, g, member(3, 0))
            assert await bp.check()
            assert pauses(rclient, keys) == 2
            # The existing limit stays: 3 groups wait for the trainer (g1 and two below).
            add(rclient, g, *(member(2, m, float(m)) for m in range(1, 4)))
            add(rclient, g, *(member(3, m, float(m)) for m in range(1, 4)))
            assert rclient.hlen(keys.groups_started) == 0
            assert await bp.check()
            assert pauses(rclient, keys) == 2  # the pause goes on, with another reason
            rclient.xgroup_create(keys.groups, Keys.CG_TRAINER, "0")  # the trainer takes one
            rclient.xreadgroup(Keys.CG_TRAINER, "trainer", {keys.groups: ">"}, count=1)
            assert g.publish_waiting() == 2
            assert not await bp.check()
        await aclient.aclose()
        return logs

    logs = asyncio.run(go())
    events = [(e["event"], e.get("reason", "")) for e in logs if "backpressure" in e["event"]]
    assert [e for e, _ in events] == [
        "backpressure_paused",
        "backpressure_resumed",
        "backpressure_paused",
        "backpressure_resumed",
    ]
    assert "2 groups are half filled (max_partial_groups 2)" in events[0][1]


def test_off_by_default(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    cfg = parse_config({"transport": {"block_ms": 5}})
    assert cfg.rollout.max_partial_groups == 0
    g = Grouper(rclient, keys, cfg, "g0", structlog.get_logger())
    add(rclient, g, *(member(i, 0) for i in range(20)))

    async def go() -> bool:
        aclient = make_async_client(redis_url)
        paused = await Backpressure(aclient, keys, cfg, structlog.get_logger()).check()
        await aclient.aclose()
        return paused

    assert not asyncio.run(go())
    assert pauses(rclient, keys) == 0


def test_slow_environment_shows_in_queues(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    """Episodes of a slow environment finish one at a time: groups stay half filled longer,
    more of them are open at once, and the oldest one ages."""
    cfg: Config = CFG
    g = Grouper(rclient, keys, cfg, "g0", structlog.get_logger())
    seen = []
    for group in range(3):
        add(rclient, g, member(group, 0))
        time.sleep(0.3)  # the other members' episodes are still running
        report = queues_json(redis_url, keys)
        seen.append((report["partial_groups"], report["oldest_partial_group_s"]))
    assert [n for n, _ in seen] == [1, 2, 3]
    ages = [a for _, a in seen]
    assert ages[0] >= 0.3 and ages[0] < ages[1] < ages[2]

    async def pause() -> None:
        aclient = make_async_client(redis_url)
        assert await Backpressure(aclient, keys, cfg, structlog.get_logger()).check()
        await aclient.aclose()

    asyncio.run(pause())
    report = queues_json(redis_url, keys)
    assert report["stats"]["backpressure_pauses"] == "1"
    text = format_report(inspect(rclient, keys))
    assert "half-filled groups: 3 (oldest" in text
    assert "backpressure_pauses 1" in text


def test_ready_groups_are_what_the_trainer_has_not_taken(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Groups waiting for the trainer are read from the groups stream (its trainer group's
    undelivered entries, which a grouper publishes), not from counters: a trainer restart
    that rewinds and trains groups again counts `groups_trained` twice for them (review
    M5), and then a counter difference says fewer groups wait than do, and rollout would
    not pause."""
    cfg = parse_config({"transport": {"block_ms": 5}, "rollout": {"max_ready_groups": 1}})
    g = Grouper(rclient, keys, cfg, "g0", structlog.get_logger())
    for i in range(3):
        add(rclient, g, *(member(i, m, float(m)) for m in range(4)))
    assert rclient.xlen(keys.groups) == 3

    async def reason() -> str | None:
        g.publish_waiting()  # what the grouper's loop does every WAITING_EVERY_S
        aclient = make_async_client(redis_url)
        try:
            return await Backpressure(aclient, keys, cfg, structlog.get_logger()).reason()
        finally:
            await aclient.aclose()

    assert asyncio.run(reason()) == "3 groups wait for the trainer (max_ready_groups 1)"

    def train(n: int) -> None:  # as the trainer: read, count, acknowledge
        got: Any = rclient.xreadgroup(Keys.CG_TRAINER, "trainer", {keys.groups: ">"}, count=n)
        ids = [e for e, _ in got[0][1]]
        rclient.hincrby(keys.stats, "groups_trained", len(ids))
        rclient.xack(keys.groups, Keys.CG_TRAINER, *ids)

    rclient.xgroup_create(keys.groups, Keys.CG_TRAINER, "0")
    train(2)
    rclient.xgroup_setid(keys.groups, Keys.CG_TRAINER, "0")  # a restart rewinds to its cut
    train(2)  # and trains them again: groups_trained 4 of 3 groups
    assert rclient.hmget(keys.stats, ["groups", "groups_trained"]) == [b"3", b"4"]
    assert asyncio.run(reason()) == "1 groups wait for the trainer (max_ready_groups 1)"
    train(1)
    assert asyncio.run(reason()) is None


def test_rollout_pauses_when_no_grouper_reads(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Every grouper down (review N11): `groups:waiting` expires and no group is emitted,
    so the group counters say nothing waits; the trajectories rollout wrote that no grouper
    put in a group count as ready groups, and rollout pauses after about
    `max_ready_groups x num_generations` of them instead of writing until Redis is full."""
    cfg = parse_config({"transport": {"block_ms": 5}, "rollout": {"max_ready_groups": 3}})
    per_group = cfg.rollout.num_generations

    async def reason() -> str | None:
        aclient = make_async_client(redis_url)
        try:
            return await Backpressure(aclient, keys, cfg, structlog.get_logger()).reason()
        finally:
            await aclient.aclose()

    written = 0
    while asyncio.run(reason()) is None:
        assert written < 10 * per_group, "rollout never paused with no grouper reading"
        publish(rclient, keys.trajectories, member(written // per_group, written % per_group))
        rclient.hincrby(keys.stats, "trajectories", 1)  # as the rollout's commit counts it
        written += 1
    assert written == 3 * per_group
    assert asyncio.run(reason()) == "3 groups wait for the trainer (max_ready_groups 3)"
    # A grouper comes back: it groups them and counts what waits; rollout sees that.
    g = Grouper(rclient, keys, cfg, "g0", structlog.get_logger())
    g.step()
    assert rclient.xlen(keys.groups) == 3
    rclient.xgroup_create(keys.groups, Keys.CG_TRAINER, "$")  # a trainer took them all
    g.publish_waiting()
    assert asyncio.run(reason()) is None
