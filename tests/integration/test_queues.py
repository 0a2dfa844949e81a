"""`streamrl queues` against a real redis-server: lengths, lag, pending, oldest pending age,
dead letters by source, half-filled groups; dead letters replayed into their stream."""

import os
import subprocess
import sys
import time
from typing import Any

import redis
import structlog

from streamrl.config import TaskConfig, parse_config
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.queues import format_report, inspect, replay_dead
from streamrl.tasks.arithmetic import make_task
from streamrl.transport import RedisStreamConsumer, publish
from streamrl.wire import Task, Trajectory, pack_arrays
from tests.helpers import REPO, queues_json

CFG = parse_config({"transport": {"block_ms": 5}})


def _traj(member: int) -> Trajectory:
    return Trajectory(
        traj_id=f"g7:{member}", group_id="g7", task_id="t7", member=member, num_generations=4,
        **pack_arrays([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2]), prompt_len=1, reward=1.0,
        status="ok", versions=[0],
    )  # fmt: skip


def test_inspect_and_replay(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    first_written = time.time()  # the entries' ids carry the server's clock, this one's
    for cursor in range(3):
        publish(rclient, keys.tasks, make_task(TaskConfig(), 0, cursor, 4))
    rclient.xadd(keys.tasks, {"v": "1", "kind": "task", "data": b"\xc1 broken"})
    log = structlog.get_logger()
    consumer = RedisStreamConsumer(rclient, keys, keys.tasks, keys.CG_ROLLOUT, "r0", Task,
                                   CFG.transport, log)  # fmt: skip
    got = consumer.read(count=2)  # two delivered, not acked: pending
    assert len(got) == 2
    grouper = Grouper(rclient, keys, CFG, "g0", log)
    for m in range(2):  # half a group
        publish(rclient, keys.trajectories, _traj(m))
    grouper.step()
    time.sleep(0.2)  # every entry is now at least this old
    report = inspect(rclient, keys)
    age_bound = time.time() - first_written + 0.002  # ids are whole milliseconds
    tasks = next(s for s in report.streams if s.name == keys.tasks)
    [group] = tasks.groups
    assert tasks.length == 4 and group.name == "rollout" and group.pending == 2
    assert group.lag == 2 and group.oldest_pending_s is not None
    assert 0.2 <= group.oldest_pending_s <= age_bound
    assert report.partial_groups == 1 and report.oldest_partial_group_s is not None
    assert 0.2 <= report.oldest_partial_group_s <= age_bound
    text = format_report(report)
    assert "half-filled groups: 1" in text and keys.tasks in text

    # The broken entry goes to the dead letters on its next read; then it is replayed.
    consumer.read(count=5)
    report = inspect(rclient, keys)
    assert report.dead_by_source == {keys.tasks: 1}
    moved = replay_dead(rclient, keys, source=keys.tasks)
    assert len(moved) == 1 and rclient.xlen(keys.dead) == 0
    newest: Any = rclient.xrevrange(keys.tasks, count=1)
    last = newest[0][1]
    assert last[b"data"] == b"\xc1 broken"  # back in its stream, unchanged

    # The command line, as an operator runs it.
    out = queues_json(redis_url, keys)
    assert out["partial_groups"] == 1 and {s["name"] for s in out["streams"]} >= {keys.tasks}


def test_no_redis_is_a_clear_error(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    p = subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "queues", "--config",
         "configs/tiny.toml", "--run-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 2 and "no Redis" in p.stderr
