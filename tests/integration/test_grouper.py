"""Group assembly against a real redis-server: exactly once, with racing groupers."""

import random
import threading
from collections.abc import MutableMapping
from typing import Any

import redis
import structlog
from structlog.testing import capture_logs

from streamrl.config import Config, parse_config
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.transport import make_client, publish
from streamrl.wire import Group, Status, Trajectory, decode, encode_body, pack_arrays
from tests.conftest import entries

CFG = parse_config(
    {
        "transport": {"block_ms": 5, "claim_idle_ms": 200, "claim_every_ms": 20},
        "grouper": {"off_policy_steps": 1},
    }
)


def traj(
    group: int,
    member: int,
    reward: float,
    version: int = 0,
    n: int = 4,
    status: Status = "ok",
    cursor: int = -1,
) -> Trajectory:
    return Trajectory(
        traj_id=f"g{group}:{member}",
        group_id=f"g{group}",
        task_id=f"t{group}",
        member=member,
        num_generations=n,
        **pack_arrays([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2]),
        prompt_len=1,
        reward=reward,
        status=status,
        versions=[version],
        cursor=cursor,
    )


def groups_out(rclient: redis.Redis, keys: Keys) -> list[Group]:
    return [decode(f, Group) for _, f in entries(rclient, keys.groups)]


def grouper(url: str, keys: Keys, name: str, cfg: Config = CFG) -> Grouper:
    return Grouper(make_client(url), keys, cfg, name, structlog.get_logger())


def test_group_emitted_with_advantages(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, "g0")
    for m, r in enumerate([1.0, 0.0, 0.0, 1.0]):
        publish(rclient, keys.trajectories, traj(1, m, r, version=m % 2))
    kinds = [o.kind for o in g.step()]
    assert kinds == ["partial", "partial", "partial", "emitted"]
    [group] = groups_out(rclient, keys)
    assert [t.member for t in group.members] == [0, 1, 2, 3]
    # mean 0.5, population std 0.5: advantages +-1 (minus the epsilon's tiny effect)
    assert [round(a, 4) for a in group.advantages] == [1.0, -1.0, -1.0, 1.0]
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups"] == b"1"
    assert stats[b"max_trajectory_policy_version"] == b"1"
    assert not rclient.exists(keys.group_members("g1"))  # partial state cleaned up
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0


def test_duplicates_ignored(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, "g0")
    for m in [0, 1, 1, 0, 2, 3, 3, 2]:  # a re-run task sends members again
        publish(rclient, keys.trajectories, traj(1, m, float(m)))
    g.step()
    assert len(groups_out(rclient, keys)) == 1


def test_error_members_get_zero_advantage(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, "g0")
    publish(rclient, keys.trajectories, traj(1, 0, 1.0))
    publish(rclient, keys.trajectories, traj(1, 1, 0.0, status="error"))
    publish(rclient, keys.trajectories, traj(1, 2, 0.0))
    publish(rclient, keys.trajectories, traj(1, 3, 1.0))
    g.step()
    [group] = groups_out(rclient, keys)
    # scored rewards 1, 0, 1: mean 2/3, std sqrt(2/9)=0.4714; (1-2/3)/0.4714 = 0.7071
    assert [round(a, 4) for a in group.advantages] == [0.7071, 0.0, -1.4142, 0.7071]


def test_zero_variance_groups_kept_or_dropped_and_counted(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    keep = grouper(redis_url, keys, "g0")
    for m in range(4):
        publish(rclient, keys.trajectories, traj(1, m, 1.0))
    keep.step()
    [kept] = groups_out(rclient, keys)
    assert kept.advantages == [0.0] * 4
    drop_cfg = CFG.model_copy(
        update={"grouper": CFG.grouper.model_copy(update={"zero_variance": "drop"})}
    )
    drop = grouper(redis_url, keys, "g1", cfg=drop_cfg)
    for m in range(4):
        publish(rclient, keys.trajectories, traj(2, m, 0.0))
    for m in range(4):  # a group with spread is emitted as ever
        publish(rclient, keys.trajectories, traj(3, m, float(m)))
    kinds = [o.kind for o in drop.step()]
    assert kinds == ["partial"] * 3 + ["dropped"] + ["partial"] * 3 + ["emitted"]
    assert [g.group_id for g in groups_out(rclient, keys)] == ["g1", "g3"]
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups_zero_variance"] == b"2" and stats[b"groups_dropped"] == b"1"
    assert stats[b"groups"] == b"2"


def test_dr_grpo_advantages_are_not_scaled(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    cfg = CFG.model_copy(
        update={"grouper": CFG.grouper.model_copy(update={"advantage": "dr_grpo"})}
    )
    g = grouper(redis_url, keys, "g0", cfg=cfg)
    for m, r in enumerate([1.0, 0.0, 0.0, 0.0]):
        publish(rclient, keys.trajectories, traj(1, m, r))
    g.step()
    [group] = groups_out(rclient, keys)
    assert group.advantages == [0.75, -0.25, -0.25, -0.25]  # r - mean, mean 0.25


def test_stale_trajectory_drops_group(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g = grouper(redis_url, keys, "g0")
    rclient.set(keys.policy_version, 5)
    publish(rclient, keys.trajectories, traj(1, 0, 1.0, version=5))
    publish(rclient, keys.trajectories, traj(1, 1, 1.0, version=3))  # 2 behind > off_policy 1
    publish(rclient, keys.trajectories, traj(1, 2, 1.0, version=4))
    publish(rclient, keys.trajectories, traj(1, 3, 1.0, version=4))
    assert [o.kind for o in g.step()] == ["partial", "dropped", "closed", "closed"]
    assert groups_out(rclient, keys) == []
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups_dropped"] == b"1" and stats[b"groups_stale"] == b"1"  # its reason
    assert stats[b"trajectories_dropped"] == b"4"
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0


def test_two_groupers_racing(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    n_groups, n = 60, 4
    items = [traj(gi, m, float((gi + m) % 3)) for gi in range(n_groups) for m in range(n)]
    items += random.Random(0).sample(items, 40)  # re-sent members
    random.Random(1).shuffle(items)
    workers = [grouper(redis_url, keys, f"g{i}") for i in range(2)]
    pipe = rclient.pipeline(transaction=False)
    for it in items:
        publish(pipe, keys.trajectories, it)
    pipe.execute()
    # Both read the same stream through one consumer group, in burst mode (they stop once
    # the stream is drained and nothing is pending).
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop, True)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    out = groups_out(rclient, keys)
    ids = [g.group_id for g in out]
    assert len(ids) == len(set(ids)) == n_groups  # every group exactly once, none lost
    assert all(sorted(t.member for t in g.members) == list(range(n)) for g in out)
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0


def test_crash_between_add_and_emit(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    """A grouper that dies after seeing its group complete leaves the entry pending;
    a second grouper claims it and emits the group once."""
    a = grouper(redis_url, keys, "a")
    for m in range(3):
        publish(rclient, keys.trajectories, traj(1, m, float(m)))
    a.step()
    publish(rclient, keys.trajectories, traj(1, 3, 1.0))
    [d] = a.input.read()
    a._add(  # the first script only: `a` dies before emitting
        keys=a._assembly_keys("g1"),
        args=["g1", 3, encode_body(d.msg), 4, d.entry_id, keys.CG_GROUPER, 0],
    )
    assert groups_out(rclient, keys) == []
    b = grouper(redis_url, keys, "b")
    b.run(threading.Event(), burst=True)
    [group] = groups_out(rclient, keys)
    assert group.group_id == "g1" and len(group.members) == 4
    assert rclient.hlen(keys.groups_started) == 0  # assembled groups leave no start time


def dropped_reasons(logs: list[MutableMapping[str, Any]]) -> dict[str, str]:
    return {e["group_id"]: e["reason"] for e in logs if e["event"] == "group_dropped"}


def test_infrastructure_failures_are_masked_and_too_few_valid_drop_the_group(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """A member that ended in error or timeout takes no part in its group's statistics; a
    group with fewer than min_valid_members valid members is dropped, counted."""
    g = grouper(redis_url, keys, "g0")
    assert g.cfg.grouper.min_valid_members == 2
    statuses: list[Status] = ["ok", "timeout", "error", "ok"]
    for m, (r, st) in enumerate(zip([1.0, 5.0, 7.0, 0.0], statuses, strict=True)):
        publish(rclient, keys.trajectories, traj(1, m, r, status=st))
    # one valid member (member 3), three masked
    statuses = ["timeout", "error", "timeout", "ok"]
    for m, st in enumerate(statuses):
        publish(rclient, keys.trajectories, traj(2, m, 1.0, status=st))
    with capture_logs() as logs:
        kinds = [o.kind for o in g.step()]
    assert kinds == ["partial"] * 3 + ["emitted"] + ["partial"] * 3 + ["dropped"]
    [group] = groups_out(rclient, keys)
    # valid rewards 1 and 0 (members 0 and 3): mean 0.5, std 0.5 -> +1 and -1; the timeout
    # (reward 5) and the error (reward 7) get 0 and move neither the mean nor the std
    assert [round(a, 4) for a in group.advantages] == [1.0, 0.0, 0.0, -1.0]
    reason = dropped_reasons(logs)["g2"]
    assert reason == (
        "1 of 4 members valid (the others ended in error or timeout), fewer than "
        "grouper.min_valid_members (2)"
    )
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups_too_few_valid"] == b"1" and stats[b"groups_dropped"] == b"1"
    assert stats[b"groups"] == b"1"
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0


def test_non_finite_rewards_or_advantages_drop_the_group(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Review M1: a NaN reward (or rewards whose advantages overflow) drops the group,
    counted; no Group with a non-finite advantage is ever written."""
    g = grouper(redis_url, keys, "g0")
    for m, r in enumerate([1.0, float("nan"), 0.0, 1.0]):
        publish(rclient, keys.trajectories, traj(1, m, r))
    for m, r in enumerate([1.0, 0.0, float("inf"), 1.0]):
        publish(rclient, keys.trajectories, traj(2, m, r, status="error" if m == 2 else "ok"))
    # finite rewards whose sum overflows: mean inf, so every advantage is NaN
    for m, r in enumerate([1.7e308, 1.7e308, 0.0, 0.0]):
        publish(rclient, keys.trajectories, traj(3, m, r))
    for m, r in enumerate([1.0, 0.0, 0.0, 1.0]):  # and a sound group goes through
        publish(rclient, keys.trajectories, traj(4, m, r))
    with capture_logs() as logs:
        kinds = [o.kind for o in g.step()]
    assert kinds == (["partial"] * 3 + ["dropped"]) * 3 + ["partial"] * 3 + ["emitted"]
    [group] = groups_out(rclient, keys)
    assert group.group_id == "g4" and [round(a, 4) for a in group.advantages] == [1, -1, -1, 1]
    reasons = dropped_reasons(logs)
    assert reasons["g1"] == "reward not finite: member 1 has reward nan"
    assert reasons["g2"] == "reward not finite: member 2 has reward inf"
    assert reasons["g3"].startswith("advantage not finite: member 0 has advantage nan")
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups_nonfinite"] == b"3" and stats[b"groups_dropped"] == b"3"


def test_every_member_is_checked_for_staleness_when_the_group_is_emitted(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Review item 4: member 0 was fresh when it arrived, but the trainer moved on before
    the group completed: the group is dropped at emission, not only for its last member."""
    g = grouper(redis_url, keys, "g0")
    publish(rclient, keys.trajectories, traj(1, 0, 1.0, version=0))
    assert [o.kind for o in g.step()] == ["partial"]
    rclient.set(keys.policy_version, 2)  # member 0 is now 2 behind > off_policy_steps 1
    for m in range(1, 4):
        publish(rclient, keys.trajectories, traj(1, m, float(m % 2), version=2))
    with capture_logs() as logs:
        assert [o.kind for o in g.step()] == ["partial", "partial", "dropped"]
    assert groups_out(rclient, keys) == []
    assert dropped_reasons(logs)["g1"] == (
        "stale: member 0's policy version 0 is 2 behind trainer version 2"
    )
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups_dropped"] == b"1" and b"groups" not in stats
    assert stats[b"groups_stale"] == b"1"  # the drop's reason, counted once


def test_a_group_dropped_between_add_and_emit_is_not_emitted(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """Review L8: grouper A's add completes the group; before A's emit, grouper B drops
    the group for a stale re-sent member. A must not emit it: dropped and emitted both
    would count it twice and train it."""
    rclient.set(keys.policy_version, 5)
    a, b = grouper(redis_url, keys, "a"), grouper(redis_url, keys, "b")
    for m in range(4):
        publish(rclient, keys.trajectories, traj(1, m, float(m % 2), version=5))
    adds = a._run_scripts
    raced: list[str] = []

    def adds_then_b_drops(calls: list[Any]) -> list[Any]:
        out = adds(calls)
        if not raced:  # after A's first round trip (the adds), before its emits
            publish(rclient, keys.trajectories, traj(1, 1, 0.0, version=3))  # stale
            raced.extend(o.kind for o in b.step())
        return out

    a._run_scripts = adds_then_b_drops  # type: ignore[method-assign]
    assert [o.kind for o in a.step()] == ["partial", "partial", "partial", "closed"]
    assert raced == ["dropped"]
    assert groups_out(rclient, keys) == []
    assert not rclient.sismember(keys.groups_emitted, "g1")
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups_dropped"] == b"1" and b"groups" not in stats
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0
