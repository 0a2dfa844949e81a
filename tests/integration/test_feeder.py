"""The feeder against a real Redis: its backlog is read from the tasks stream, so tasks that
went to the dead letters leave it (review 86b402d M5), and a dataset's epochs end it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import redis
import structlog

from streamrl.config import parse_config
from streamrl.feeder import Feeder
from streamrl.names import Keys
from streamrl.tasks.heldout import heldout_tasks
from streamrl.transport import RedisStreamConsumer
from streamrl.wire import Task, decode

LOG = structlog.get_logger()


def test_dead_lettered_tasks_leave_the_backlog(rclient: redis.Redis, keys: Keys) -> None:
    cfg = parse_config(
        {
            "task": {"max_backlog": 2},
            "transport": {"max_deliveries": 1, "claim_idle_ms": 100, "claim_every_ms": 10},
        }
    )
    feeder = Feeder(rclient, keys, cfg, LOG)
    assert feeder.fill() == 2 and feeder.fill() == 0  # the backlog is full

    def consumer(name: str) -> RedisStreamConsumer[Task]:
        return RedisStreamConsumer(
            rclient, keys, keys.tasks, keys.CG_ROLLOUT, name, Task, cfg.transport, LOG
        )

    # a rollout worker takes both tasks and dies on them (no ack): still in the backlog
    assert len(consumer("rollout-0").read(2)) == 2
    assert feeder.backlog() == (2, 2) and feeder.fill() == 0
    # the next worker claims them past max_deliveries: both go to the dead letters ...
    time.sleep(0.15)  # past claim_idle_ms, so the entries count as idle
    assert consumer("rollout-1").read(2) == []
    assert rclient.xlen(keys.dead) == 2
    # ... which acknowledges them: the feeder writes again (main at 86b402d stalled here for
    # good, its backlog being cursor - tasks_done)
    assert feeder.backlog() == (2, 0)
    assert feeder.fill() == 2


def test_dataset_epochs_end_the_feed(rclient: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    cfg = parse_config(
        {"task": {"name": "synthetic", "dataset": str(data), "epochs": 2, "max_backlog": 4}}
    )
    assert Feeder(rclient, keys, cfg, LOG).fill() == 4
    rclient.xtrim(keys.tasks, maxlen=0)  # as if rolled out (no rollout group yet)
    restarted = Feeder(rclient, keys, cfg, LOG)  # continues from the cursor in Redis
    assert restarted.fill() == 2 and restarted.fill() == 0
    assert restarted.backlog()[0] == 6
    assert rclient.hget(keys.stats, "tasks") == b"6"


def test_burst_feeder_fills_the_backlog_once(rclient: redis.Redis, keys: Keys) -> None:
    cfg = parse_config({"task": {"max_backlog": 3}})
    Feeder(rclient, keys, cfg, LOG).run(threading.Event(), burst=True)  # returns by itself
    assert rclient.xlen(keys.tasks) == 3


def test_the_feeder_never_writes_a_held_out_task(rclient: redis.Redis, keys: Keys) -> None:
    # 200 questions, 120 training prompts: the feeder's two whole cycles of cursors (what a
    # long run writes) against the first 40 held-out tasks of `streamrl eval`.
    cfg = parse_config({"task": {"num_prompts": 120, "max_operand": 9, "max_backlog": 240}})
    assert Feeder(rclient, keys, cfg, LOG).fill() == 240
    entries: Any = rclient.xrange(keys.tasks)
    fed = {decode(fields, Task).prompt for _, fields in entries}
    held = {t.prompt for t in heldout_tasks(cfg.task, cfg.run.seed, 40, 4)}
    assert len(fed) > 60 and len(held) == 40 and not fed & held
