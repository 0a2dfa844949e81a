"""A real rollout worker process (the CLI) loads the latest published version before its
first episode, and so does the same worker restarted after a newer version appeared."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis
import structlog

from streamrl.config import load_config
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.tiny import ensure_checkpoint
from streamrl.names import Keys
from streamrl.tasks.registry import make_task
from streamrl.trainer.publish import WeightPublisher
from streamrl.transport import publish
from streamrl.weightsync import RedisChannel
from streamrl.wire import Trajectory, decode
from tests.helpers import TINY, spawn_worker, stop
from tests.policies import always_eos


def _trajectories(client: redis.Redis, keys: Keys, n: int, timeout_s: float) -> list[Trajectory]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out: Any = client.xrange(keys.trajectories)
        if len(out) >= n:
            return [decode(fields, Trajectory) for _, fields in out]
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {n} trajectories after {timeout_s}s")


def test_rollout_worker_starts_on_the_latest_version(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    sets = [
        f'model.cache_dir="{tmp_path / "cache"}"',
        "model.init=checkpoint",
        "rollout.max_steps=1",
        "rollout.sync_mode=pause",
    ]
    cfg = load_config(TINY, [f"run.name={keys.ns}", *sets])
    _, params = load_checkpoint(ensure_checkpoint(cfg))
    log = structlog.get_logger()
    pub = WeightPublisher(rclient, keys, RedisChannel(rclient, keys, 64 << 10), log, keep=2)
    for v in range(3):
        pub.publish(always_eos(params, 1 + v / 10), v, v)

    def one_task(cursor: int, expect: int) -> list[Trajectory]:
        publish(rclient, keys.tasks, make_task(cfg.task, 0, cursor, 2))
        return _trajectories(rclient, keys, expect, timeout_s=120)[expect - 2 :]

    worker = spawn_worker("rollout", redis_url, keys.ns, tmp_path, *sets)
    try:
        first = one_task(0, 2)
    finally:
        assert stop(worker) == 0
    assert [t.versions for t in first] == [[2], [2]]

    pub.publish(always_eos(params, 1.3), 3, 3)
    worker = spawn_worker("rollout", redis_url, keys.ns, tmp_path, *sets)
    try:
        again = one_task(1, 4)
    finally:
        assert stop(worker) == 0
    assert [t.versions for t in again] == [[3], [3]]
    events = [json.loads(line) for line in (tmp_path / "rollout-0.log").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "rollout_ready"] == [2, 3]
    assert [e["version"] for e in events if e["event"] == "weights_loaded"] == [2, 3]
    assert not [e for e in events if e["event"] == "weights_refused"]
