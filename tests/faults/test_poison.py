"""Poison, as issue 30 names its scenarios: a group that makes the train step raise or the
trainer die is dead-lettered after `transport.max_deliveries` attempts and the run goes on
(the count survives restarts and rewinds); a step out of device memory splits its batch
down to the group that does not fit, without a restart; a batch is capped by its padded
tokens; a group whose timeout check kills its grouper is dropped unread. On real Redis and
real Orbax checkpoints, with scripted steps (tests/integration/test_trainer_loop.py's).
The process-level scenarios are in test_scenarios.py; the kill-anything run in
test_faults.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import orbax.checkpoint as ocp
import pytest
import redis
import structlog
from structlog.testing import capture_logs

from streamrl.config import Config, parse_config
from streamrl.grouper import Outcome
from streamrl.names import Keys
from streamrl.transport import publish
from streamrl.wire import DeadLetter, Trajectory, decode, pack_arrays
from tests.integration.test_group_timeout import config as timeout_config
from tests.integration.test_group_timeout import grouper as new_grouper
from tests.integration.test_group_timeout import (
    groups_out,
    stuck_complete_group,
)
from tests.integration.test_trainer_loop import (
    PoisonStep,
    ScriptedStep,
    StepDiedError,
    _run_until_idle,
    checkpointer,
    config,
    dead_groups,
    group,
    make_loop,
    poison,
)

__all__ = ["checkpointer"]  # a fixture, used by name


def poison_config(per_step: int) -> Config:
    """The stub trainer, `per_step` groups a step, a group dead-lettered at its 3rd try."""
    return parse_config(
        {
            "model": {"kind": "stub", "init": "checkpoint"},
            "trainer": {"groups_per_step": per_step},
            "grouper": {"off_policy_steps": 1000},
            "transport": {"block_ms": 50, "max_deliveries": 3},
        }
    )


@pytest.mark.parametrize("per_step", [1, 2])
def test_a_group_that_kills_every_step_is_dead_lettered_not_looped(
    rclient: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    checkpointer: ocp.StandardCheckpointer,
    per_step: int,
) -> None:
    """Review N2: a group whose step dies (an exception; a host OOM kill is the same to
    the next start) came first again after every restart, for ever: the rewind
    resets Redis' delivery count. A count of the steps each group entered, kept in Redis
    across restarts, isolates a group whose step never finished (trained alone next time,
    so a batch-mate is not blamed) and dead-letters it once it reached
    transport.max_deliveries; the groups around it train."""
    root = tmp_path / "checkpoints"
    cfg = poison_config(per_step)
    for g in (group("g0"), poison("g1"), *(group(f"g{i}") for i in range(2, 6))):
        publish(rclient, keys.groups, g)
    deaths = 0
    events: list[str] = []
    trained: list[str] = []  # every step's groups, over every run
    for _ in range(10):  # a restart per death, as the launcher or compose would
        loop = make_loop(cfg, rclient, keys, root, PoisonStep(), checkpointer, 10)
        loop.resume(root, checkpointer)
        loop.max_steps = loop.step + 10
        with structlog.testing.capture_logs() as logs:
            try:
                _run_until_idle(loop)
                break
            except StepDiedError:
                deaths += 1
            finally:
                events += [e["event"] for e in logs]
                trained += [g for e in logs if e["event"] == "train_step" for g in e["group_ids"]]
    assert deaths == 3, deaths  # max_deliveries steps died with it, then never again
    assert dead_groups(rclient, keys) == ["g1"]
    raw: Any = rclient.xrange(keys.dead)
    letter = decode(raw[0][1], DeadLetter)
    assert "3 times" in letter.reason and "max_deliveries" in letter.reason
    assert sorted(trained) == ["g0", "g2", "g3", "g4", "g5"], trained  # each once
    # With batch-mates, the group was trained alone after its first death (g0, its first
    # batch-mate, trained alone and is not blamed).
    assert ("group_isolated" in events) == (per_step > 1), events


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_step_out_of_memory_splits_the_batch_without_a_restart(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer,
    per_step: int,
) -> None:  # fmt: skip
    """Issue 30 item 3: a step that runs out of device memory (XLA's RESOURCE_EXHAUSTED,
    MemoryError) ended the trainer. Now the loop goes on: the batch's groups count the
    attempt and come back first, the suspect one trained alone (its batch-mates train in
    the next steps), and the group that does not fit even alone is dead-lettered after
    transport.max_deliveries tries; no restart, each other group trained once."""
    root = tmp_path / "checkpoints"
    cfg = poison_config(per_step)
    for g in (group("g0"), poison("g1"), *(group(f"g{i}") for i in range(2, 6))):
        publish(rclient, keys.groups, g)
    loop = make_loop(cfg, rclient, keys, root, PoisonStep(MemoryError), checkpointer, 10)
    with structlog.testing.capture_logs() as logs:
        _run_until_idle(loop)  # raises nothing
    events = [e["event"] for e in logs]
    assert events.count("step_out_of_memory") == 3
    assert dead_groups(rclient, keys) == ["g1"]
    raw: Any = rclient.xrange(keys.dead)
    assert "ran out of memory with this group alone 3 times" in decode(raw[0][1], DeadLetter).reason
    trained = [g for e in logs if e["event"] == "train_step" for g in e["group_ids"]]
    assert sorted(trained) == ["g0", "g2", "g3", "g4", "g5"], trained  # each once
    assert ("group_isolated" in events) == (per_step > 1), events


def test_a_batch_is_capped_by_its_padded_tokens(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """trainer.max_batch_tokens: a group that would take the step's padded batch past the
    cap waits for the next step (which goes with fewer groups than groups_per_step), and
    one past the cap alone is dead-lettered."""
    from streamrl.trainer.step import LENGTH_BUCKET

    root = tmp_path / "checkpoints"
    # two rows of one bucket each: 2 x 32 tokens a group; two groups pad to 4 x 32
    cfg = config(groups_per_step=2, max_batch_tokens=2 * LENGTH_BUCKET)
    long = group("big")
    tokens = list(range(1, LENGTH_BUCKET + 3))  # past one bucket: pads to two
    members = [
        msgspec.structs.replace(
            m, **pack_arrays(tokens, [0] + [1] * (len(tokens) - 1), [0.0] * len(tokens))
        )
        for m in long.members
    ]
    publish(rclient, keys.groups, group("g1"))
    publish(rclient, keys.groups, msgspec.structs.replace(long, members=members))
    for gid in ("g2", "g3", "g4"):
        publish(rclient, keys.groups, group(gid))
    loop = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok"] * 3), checkpointer, 3)
    with structlog.testing.capture_logs() as logs:
        loop.run()
    steps = [e["group_ids"] for e in logs if e["event"] == "train_step"]
    assert steps == [["g1"], ["g2"], ["g3"]], steps  # one group per step fits the cap
    assert dead_groups(rclient, keys) == ["big"]
    raw: Any = rclient.xrange(keys.dead)
    assert "pad to 128 tokens (trainer.max_batch_tokens 64)" in decode(raw[0][1], DeadLetter).reason


def test_a_group_that_kills_its_grouper_is_dropped_not_looped(
    rclient: redis.Redis, redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review N2 (the grouper's side): a stuck complete group whose scoring raised (or
    whose members were big enough to OOM a grouper) was read and scored again by every
    grouper about once a second, each dying in turn, for ever. The checks that began and
    never ended are counted in Redis across grouper restarts; past max_deliveries the group
    is dropped without being read again, and the groups around it are decided as usual."""
    from streamrl.grouper import timeouts

    cfg = timeout_config("drop", timeout_s=0.0)  # the stuck complete group of review M8
    poison = stuck_complete_group(rclient, keys, cfg, cursor=0)
    real = timeouts.score

    def score(members: list[Trajectory], *args: Any, **kwargs: Any) -> Any:
        if members[0].group_id == poison.group_id:
            raise MemoryError("the group's members do not fit")  # the grouper dies here
        return real(members, *args, **kwargs)

    monkeypatch.setattr(timeouts, "score", score)
    deaths = 0
    for _ in range(cfg.transport.max_deliveries):  # each a fresh grouper: a restart
        with pytest.raises(MemoryError):
            new_grouper(redis_url, keys, cfg).check_timeouts()
        deaths += 1
    healthy = stuck_complete_group(rclient, keys, cfg, cursor=1)
    with capture_logs() as logs:
        outcomes = new_grouper(redis_url, keys, cfg).check_timeouts()
    assert deaths == cfg.transport.max_deliveries
    assert set(outcomes) == {
        Outcome("dropped", poison.group_id),
        Outcome("emitted", healthy.group_id),
    }
    [ev] = [e for e in logs if e["event"] == "group_dropped"]
    assert "deciding on it failed 5 times" in ev["reason"], ev
    assert rclient.sismember(keys.groups_dropped, poison.group_id)
    assert not rclient.exists(keys.group_members(poison.group_id))
    assert rclient.hlen(keys.groups_attempts) == 0  # nothing left counting
    assert [g.group_id for g in groups_out(rclient, keys)] == [healthy.group_id]
