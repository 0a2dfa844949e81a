"""The feeder against a real Redis: its backlog is read from the tasks stream, so tasks that
went to the dead letters leave it (review 86b402d M5), a dataset's epochs end it, and a
mixture of tasks is written (and resumed) in its seeded order."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import redis
import structlog
from structlog.testing import capture_logs

from streamrl import counters
from streamrl.capacity import ADVERTISE_SCRIPT
from streamrl.config import parse_config
from streamrl.feeder import Feeder
from streamrl.names import Keys
from streamrl.obs.metrics import LIVE_POLICY_LAG, ROLLOUT_SLOTS, STALE_LAG_LIMIT
from streamrl.run.summary import read_stats
from streamrl.tasks.heldout import heldout_tasks
from streamrl.tasks.mixture import mixture
from streamrl.transport import RedisStreamConsumer
from streamrl.wire import Task, decode
from tests.conftest import entries

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


def test_generated_prompts_end_after_their_epochs(rclient: redis.Redis, keys: Keys) -> None:
    """Issue 29: `task.epochs` ends generated prompts as it ends a dataset: exactly
    num_prompts x epochs tasks, each prompt once per epoch (it used to be ignored)."""
    cfg = parse_config({"task": {"num_prompts": 5, "epochs": 2, "max_backlog": 100}})
    feeder = Feeder(rclient, keys, cfg, LOG)
    assert feeder.fill() == 10 and feeder.fill() == 0
    tasks = [decode(f, Task) for _, f in entries(rclient, keys.tasks)]
    prompts = [t.prompt for t in tasks]
    assert prompts[:5] == prompts[5:] and len(set(prompts[:5])) == 5
    assert [t.cursor for t in tasks] == list(range(10))


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


def test_an_auto_backlog_follows_the_live_rollout_workers(rclient: redis.Redis, keys: Keys) -> None:
    """task.max_backlog = "auto" (issue 29): the feeder keeps C + 2 C / G tasks for each
    rollout worker that advertised its slots within the time-to-live (Redis's clock), none
    while no worker is live, more when a second joins, and fewer once one stops renewing."""
    from streamrl.capacity import ADVERTISE_SCRIPT

    cfg = parse_config(
        {
            "task": {"max_backlog": "auto"},
            "rollout": {"num_generations": 4, "max_concurrency": 8},
            "transport": {"claim_idle_ms": 100},  # ttl: max(3 x 100 ms, 5 s) = 5 s
        }
    )
    feeder = Feeder(rclient, keys, cfg, LOG)
    assert feeder.fill() == 0 and feeder.target == 0  # no rollout worker yet

    def advertise(worker: str, slots: int) -> None:
        rclient.eval(ADVERTISE_SCRIPT, 1, keys.rollout_capacity, worker, slots)

    advertise("rollout-0", 8)
    assert feeder.fill() == 8 + 2 * 2 and feeder.fill() == 0  # 12 tasks, then full
    advertise("rollout-1", 8)
    assert feeder.fill() == 12 and feeder.target == 24  # the second worker's share
    # rollout-0 stops renewing: its advertisement ages past the ttl (set it 6 s back).
    raw = rclient.hget(keys.rollout_capacity, "rollout-0")
    assert isinstance(raw, bytes)
    slots, at = raw.decode().split(":")
    rclient.hset(keys.rollout_capacity, "rollout-0", f"{slots}:{int(at) - 6_000}")
    assert feeder.fill() == 0 and feeder.target == 12  # 24 written, 12 needed now
    assert rclient.hkeys(keys.rollout_capacity) == [b"rollout-1"]  # the stale one deleted
    # A number still sizes it as before, whatever the workers advertise.
    fixed = Feeder(rclient, keys, parse_config({"task": {"max_backlog": 30}}), LOG)
    assert fixed.fill() == 6 and fixed.target == 30


def test_max_backlog_is_a_number_in_range_or_auto() -> None:
    import pytest

    from streamrl.config import ConfigError

    assert parse_config({"task": {"max_backlog": "auto"}}).task.max_backlog == "auto"
    for bad in (0, "many"):
        with pytest.raises(ConfigError, match="max_backlog"):
            parse_config({"task": {"max_backlog": bad}})


def test_the_live_rollout_capacity_is_checked_against_the_staleness_bound(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Issue 29, item 2: rollout workers scaled up with compose (invisible to the config)
    that put more groups in flight than the staleness bound allows are logged with the
    arithmetic, and the lag at the live capacity is a metric `streamrl status` shows; the
    capacity back within the bound is logged too."""
    # C 16, G 4, B 4 (auto for one worker), K 2 (the default is 8: stragglers), one worker
    cfg = parse_config({"grouper": {"off_policy_steps": 2}})
    feeder = Feeder(rclient, keys, cfg, LOG)

    def advertise(*workers: str) -> None:
        rclient.delete(keys.rollout_capacity)
        for w in workers:
            rclient.eval(ADVERTISE_SCRIPT, 1, keys.rollout_capacity, w, 16)

    with capture_logs() as logs:
        advertise("rollout-0")
        feeder.fill()
        assert feeder.queue_probe()[LIVE_POLICY_LAG] == 1.0  # 4 in flight / 4
        advertise("rollout-0", "rollout-1", "rollout-2", "rollout-3")
        feeder.fill()
        probe = feeder.queue_probe()
        assert (probe[LIVE_POLICY_LAG], probe[STALE_LAG_LIMIT], probe[ROLLOUT_SLOTS]) == (
            4.0,
            3.0,
            64.0,
        )
        feeder.fill()  # unchanged: said once
        advertise("rollout-0")
        feeder.fill()
    said = [e for e in logs if e["event"].startswith("rollout_capacity_")]
    assert [e["event"] for e in said] == ["rollout_capacity_does_not_fit", "rollout_capacity_fits"]
    assert "4 x 16 / 4 = 16 groups in flight" in said[0]["problem"]
    assert said[0]["rollout_workers"] == 4


def test_a_mixture_is_written_in_its_order_and_resumes_in_it(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Issue 32: a 3:1 mixture of tasks with ends. Each task written is the mixture's at its
    position (`Mixture.task`), labelled and counted per task in the same transaction; a
    restarted feeder continues at its cursor in the same order; an ended task's positions
    are stepped over, and the mixture ends after the last task of the other."""
    tasks = [
        {"id": "a", "name": "arithmetic", "weight": 3, "num_prompts": 9, "epochs": 2},
        {"id": "b", "name": "arithmetic", "weight": 1, "num_prompts": 2, "epochs": 1,
         "operators": "*"},
    ]  # fmt: skip
    cfg = parse_config({"task": {"max_backlog": 7}, "tasks": tasks})
    mix = mixture(cfg)
    assert mix.end is not None and mix.end > 18 + 2  # b's later positions are holes

    def written() -> list[Task]:
        return [decode(f, Task) for _, f in entries(rclient, keys.tasks)]

    assert Feeder(rclient, keys, cfg, LOG).fill() == 7
    first = written()
    rclient.xtrim(keys.tasks, maxlen=0)  # as if rolled out
    restarted = Feeder(rclient, keys, cfg, LOG)
    rest: list[Task] = []
    while restarted.fill():
        rest += written()
        rclient.xtrim(keys.tasks, maxlen=0)
    cursor = restarted.backlog()[0]
    assert cursor == mix.end and rclient.get(keys.feeder_end) == str(mix.end).encode()
    expected = [t for t in (mix.task(k, 4) for k in range(mix.end)) if t is not None]
    assert len(expected) == 18 + 2
    assert first + rest == expected
    assert [t.kind for t in expected].count("b") == 2
    assert all(("*" in t.prompt) == (t.kind == "b") for t in expected)
    stats = read_stats(rclient, keys)
    assert stats["tasks"] == 20
    assert counters.by_task(stats) == {"a": {"tasks": 18}, "b": {"tasks": 2}}
    assert mix.written(cursor) == {"a": 18, "b": 2}
