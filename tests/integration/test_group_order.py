"""`grouper.order = "submission"` against a real redis-server (issue 29, item 6): groups are
written to `groups` in task-cursor order, whatever order they complete in and however many
groupers write them; a dropped group lets the later ones go; `order_window` and
`order_max_wait_s` bound the wait for a cursor that never comes (counted); a group whose
cursor was skipped is written late, counted; the held groups are in the queue snapshot and
come back with it. The default, completion order, writes as groups complete."""

from __future__ import annotations

import time

import redis
import structlog

from streamrl import counters
from streamrl.checkpoints import restore_queues, take_snapshot
from streamrl.config import Config, parse_config
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.transport import make_client, publish
from streamrl.wire import Group, decode
from tests.conftest import entries
from tests.integration.test_grouper import traj

G = 2


def config(**grouper: object) -> Config:
    return parse_config(
        {
            "transport": {"block_ms": 5, "claim_idle_ms": 200, "claim_every_ms": 20},
            "rollout": {"num_generations": G},
            "grouper": {"order": "submission", "off_policy_steps": 4, **grouper},
        }
    )


def complete(rclient: redis.Redis, keys: Keys, cursor: int, version: int = 0) -> None:
    for m in range(G):
        t = traj(cursor, m, float(m), version, n=G, cursor=cursor)
        publish(rclient, keys.trajectories, t)


def written(rclient: redis.Redis, keys: Keys) -> list[str]:
    return [decode(f, Group).group_id for _, f in entries(rclient, keys.groups)]


def stat(rclient: redis.Redis, keys: Keys, name: str) -> int:
    return int(rclient.hget(keys.stats, name) or 0)


def grouper(url: str, keys: Keys, cfg: Config, name: str = "g0") -> Grouper:
    return Grouper(make_client(url), keys, cfg, name, structlog.get_logger())


def drain(*groupers: Grouper) -> None:
    """Each grouper reads until none gets anything."""
    while any([g.step(block_ms=5) for g in groupers]):
        pass


def test_groups_are_written_in_cursor_order(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    a, b = grouper(redis_url, keys, config(), "a"), grouper(redis_url, keys, config(), "b")
    for cursor in (3, 1, 4, 2):  # complete out of order, read by two groupers
        complete(rclient, keys, cursor)
    drain(a, b)
    assert written(rclient, keys) == []  # cursor 0 is not there yet: all four wait
    assert stat(rclient, keys, counters.GROUPS_ORDER_HELD) == 4
    assert stat(rclient, keys, counters.GROUPS) == 0
    complete(rclient, keys, 0)
    drain(b, a)
    assert written(rclient, keys) == ["g0", "g1", "g2", "g3", "g4"]
    assert stat(rclient, keys, counters.GROUPS) == 5
    assert rclient.hlen(keys.groups_order_held) == 0
    assert rclient.get(keys.groups_order_next) == b"5"


def test_a_dropped_group_lets_the_later_ones_go(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = grouper(redis_url, keys, config())
    rclient.set(keys.policy_version, 10)  # version 0 is 10 behind: stale, dropped
    complete(rclient, keys, 2, version=10)
    complete(rclient, keys, 1, version=0)
    drain(g)
    assert written(rclient, keys) == []  # 0 still missing
    complete(rclient, keys, 0, version=10)
    drain(g)
    assert written(rclient, keys) == ["g0", "g2"]  # g1 dropped as stale, not waited for
    assert stat(rclient, keys, counters.GROUPS_DROPPED) == 1


def test_the_window_stops_waiting_and_a_late_group_is_counted(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = grouper(redis_url, keys, config(order_window=2))
    for cursor in (1, 2):
        complete(rclient, keys, cursor)
    drain(g)
    assert written(rclient, keys) == []
    complete(rclient, keys, 3)  # a third held group: cursor 0 is no longer waited for
    drain(g)
    assert written(rclient, keys) == ["g1", "g2", "g3"]
    assert stat(rclient, keys, counters.GROUPS_ORDER_SKIPPED) == 1
    complete(rclient, keys, 0)  # it came after all: written at once, out of order
    drain(g)
    assert written(rclient, keys) == ["g1", "g2", "g3", "g0"]
    assert stat(rclient, keys, counters.GROUPS_OUT_OF_ORDER) == 1


def test_a_group_held_too_long_stops_the_wait(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = grouper(redis_url, keys, config(order_max_wait_s=0.3))
    complete(rclient, keys, 2)
    drain(g)
    assert g.flush_order() == 0 and written(rclient, keys) == []  # not long enough yet
    time.sleep(0.4)
    assert g.flush_order() == 2  # cursors 0 and 1 (a task rollout dead-lettered, say)
    assert written(rclient, keys) == ["g2"]
    assert stat(rclient, keys, counters.GROUPS_ORDER_SKIPPED) == 2


def test_held_groups_travel_with_the_queue_snapshot(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = grouper(redis_url, keys, config())
    complete(rclient, keys, 1)
    drain(g)
    snap = take_snapshot(rclient, keys)
    # Redis lost: the held group and the order's position come back with the snapshot.
    for key in list(rclient.scan_iter(keys.every_key)):
        rclient.delete(key)
    restore_queues(rclient, keys, snap)
    assert rclient.hlen(keys.groups_order_held) == 1
    complete(rclient, keys, 0)
    drain(g)
    assert written(rclient, keys) == ["g0", "g1"]


def test_completion_order_is_the_default(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    cfg = parse_config({"rollout": {"num_generations": G}})
    assert cfg.grouper.order == "completion"
    g = grouper(redis_url, keys, cfg)
    for cursor in (3, 1, 2):
        complete(rclient, keys, cursor)
    drain(g)
    assert written(rclient, keys) == ["g3", "g1", "g2"]
    assert not rclient.exists(keys.groups_order_held, keys.groups_order_next)
