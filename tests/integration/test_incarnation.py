"""A Redis that lost the run is noticed (review N8): the run has an id (`Keys.run_id`) that
every worker records at start and compares as it goes, so a Redis that comes back empty
stops the workers instead of letting the feeder start the data again at cursor 0; the
trainer that starts in it restores the queues from its checkpoint, clearing what the
workers wrote before they noticed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest
import redis
import structlog

from streamrl.config import parse_config
from streamrl.feeder import Feeder
from streamrl.names import Keys
from streamrl.run import incarnation
from streamrl.run.identity import Heartbeat
from streamrl.transport import publish
from tests.integration.test_trainer_loop import ScriptedStep, checkpointer, config, group, make_loop

__all__ = ["checkpointer"]  # a fixture, used by name

LOG = structlog.get_logger()


def lose_the_run(client: redis.Redis, keys: Keys) -> int:
    """What a Redis that lost the run looks like to it: none of its keys (FLUSHALL on a
    server other tests share would take theirs too)."""
    names = list(client.scan_iter(match=keys.every_key))
    return int(client.delete(*names)) if names else 0


def test_the_feeder_refuses_instead_of_starting_again(rclient: redis.Redis, keys: Keys) -> None:
    cfg = parse_config({"task": {"max_backlog": 4}})
    run_id = incarnation.create(rclient, keys)
    feeder = Feeder(rclient, keys, cfg, LOG, run_id=run_id)
    assert feeder.fill() == 4
    assert lose_the_run(rclient, keys) > 0
    with pytest.raises(incarnation.RunLostError, match=r"Redis lost the run: its id .* is gone"):
        feeder.fill()
    # nothing written: no cursor 0, no task, no counter
    assert rclient.exists(keys.feeder_cursor, keys.tasks, keys.stats) == 0
    # A run created anew there (another id) is not this feeder's run either.
    incarnation.create(rclient, keys)
    with pytest.raises(incarnation.RunLostError, match="was replaced by"):
        feeder.fill()
    assert rclient.exists(keys.feeder_cursor) == 0


def test_the_heartbeat_notices_and_ends_the_worker(rclient: redis.Redis, keys: Keys) -> None:
    run_id = incarnation.create(rclient, keys)
    reasons: list[str] = []
    beat = Heartbeat(rclient, keys, "grouper", 0, "host:1", LOG, on_lost=lambda: None,
                     run_id=lambda: run_id, on_run_lost=reasons.append)  # fmt: skip
    assert beat._beat() and reasons == []
    lose_the_run(rclient, keys)
    assert not beat._beat()
    [reason] = reasons
    assert "Redis lost the run" in reason and "streamrl up --resume" in reason
    # and a worker that has not recorded a run yet (waiting for it) is not ended
    waiting = Heartbeat(rclient, keys, "grouper", 1, "host:2", LOG, on_lost=lambda: None,
                        run_id=lambda: "", on_run_lost=reasons.append)  # fmt: skip
    assert waiting._beat() and len(reasons) == 1


def test_a_trainer_starting_in_a_redis_that_lost_the_run_restores_it(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """Compose: no launcher marks the restore. The trainer restarted after the loss finds
    its checkpoint and no run id in Redis: it clears what workers wrote meanwhile and
    writes the checkpoint's queues back, with the run's id."""
    root = tmp_path / "checkpoints"
    for i in range(1, 7):
        publish(rclient, keys.groups, group(f"g{i}"))
    first = make_loop(config(), rclient, keys, root, ScriptedStep(["ok"] * 4), checkpointer,
                      4, checkpoint_every=2)  # fmt: skip
    first.resume(root, checkpointer)
    run_id = first.run_id
    assert run_id and incarnation.current(rclient, keys) == run_id
    first.run()  # checkpoints at steps 2 and 4; groups g5, g6 wait
    lose_the_run(rclient, keys)
    # before they noticed, workers wrote into the empty Redis
    publish(rclient, keys.groups, group("leftover"))
    rclient.hincrby(keys.stats, "trajectories", 7)
    again = make_loop(config(), rclient, keys, root, ScriptedStep(["ok"] * 2), checkpointer,
                      6, checkpoint_every=2)  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        assert again.resume(root, checkpointer) == 4
        again.run()
    assert again.run_id == run_id  # the run's own id, back with its queues
    events = [e["event"] for e in logs]
    assert "redis_lost_run" in events and "queues_restored" in events
    trained = [g for e in logs if e["event"] == "train_step" for g in e["group_ids"]]
    assert trained == ["g5", "g6"]  # the checkpoint's waiting groups; not the leftover
    stats: Any = rclient.hgetall(keys.stats)
    assert b"trajectories" not in stats  # the leftover counter went with the rest
