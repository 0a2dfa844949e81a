"""`rollout.mode = "sync"`'s batch rule against a real redis-server and a real grouper: a
batch starts at most a step's worth of tasks beyond the groups dropped since it began
(by the grouper, or dead-lettered by the trainer), and a new version begins a new batch."""

import asyncio

import redis
import structlog
from structlog.testing import capture_logs

from streamrl.config import parse_config
from streamrl.counters import GROUPS_SET_ASIDE
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.rollout.worker import SyncBatches
from streamrl.transport import Delivery, make_async_client, publish
from streamrl.wire import Task, Trajectory, pack_arrays

CFG = parse_config(
    {
        "transport": {"block_ms": 5},
        "rollout": {"mode": "sync"},
        "grouper": {"zero_variance": "drop"},
        "trainer": {"groups_per_step": 2},
    }
)


def task(group: int, members: list[int] | None = None) -> Delivery[Task]:
    msg = Task(task_id=f"t{group}", group_id=f"g{group}", kind="synthetic", prompt="p",
               answer="", num_generations=4, cursor=group, members=members)  # fmt: skip
    return Delivery(f"{group}-0", msg, 1)


def member(group: int, m: int, reward: float) -> Trajectory:
    return Trajectory(
        traj_id=f"g{group}-m{m}", group_id=f"g{group}", task_id=f"t{group}", member=m,
        num_generations=4, **pack_arrays([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2]),
        prompt_len=1, reward=reward, status="ok", versions=[0],
    )  # fmt: skip


def group(rclient: redis.Redis, g: Grouper, n: int, tied: bool) -> None:
    for m in range(4):
        publish(rclient, g.keys.trajectories, member(n, m, 1.0 if tied else float(m)))
    g.step()


def test_a_batch_replaces_its_dropped_groups_until_the_next_version(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    g = Grouper(rclient, keys, CFG, "g0", structlog.get_logger())
    rclient.hset(keys.stats, "groups_dropped", 5)  # earlier batches' drops: not this one's

    async def go() -> None:
        aclient = make_async_client(redis_url)
        batches = SyncBatches(aclient, keys, CFG, structlog.get_logger())
        with capture_logs() as logs:
            assert await batches.room(0) == 2
            batches.count([task(1), task(2)])
            assert await batches.room(0) == 0  # a step's worth in flight
            group(rclient, g, 1, tied=False)
            assert await batches.room(0) == 0  # emitted: the trainer's, not replaced
            group(rclient, g, 2, tied=True)  # zero variance: dropped
            assert await batches.room(0) == 1
            batches.count([task(3), task(2, members=[1])])  # a re-run is not a new task
            assert await batches.room(0) == 0
            # The trainer dead-letters a group it cannot use; its stale drops are counted
            # in groups_dropped already and not twice.
            rclient.hincrby(keys.stats, GROUPS_SET_ASIDE, 2)
            rclient.hincrby(keys.stats, "trainer_groups_stale", 1)
            rclient.hincrby(keys.stats, "groups_dropped", 1)
            assert await batches.room(0) == 2
            batches.count([task(4), task(5)])
            assert await batches.room(0) == 0
            assert await batches.room(1) == 2  # the next version: a new batch
            assert batches.batches == 2
        await aclient.aclose()
        [done] = [e for e in logs if e["event"] == "sync_batch_done"]
        assert (done["version"], done["tasks"], done["dropped"]) == (0, 5, 3)

    asyncio.run(go())
