"""The trainer's loop on real Redis and real Orbax checkpoints, with scripted steps: a
non-finite step keeps the state and runs no hook, and too many in a row stop the run
naming their groups."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import msgspec
import numpy as np
import orbax.checkpoint as ocp
import pytest
import redis
import structlog

from streamrl import checkpoints as ckpts
from streamrl.config import Config, parse_config
from streamrl.counters import GROUPS_SET_ASIDE, TRAINER_GROUPS_STALE, TRAINER_NONFINITE_STEPS
from streamrl.names import Keys
from streamrl.queues import replay_dead
from streamrl.run.summary import step_metrics
from streamrl.trainer.hooks import CheckpointHook, PublishHook
from streamrl.trainer.loop import NonFiniteStepsError, TrainerLoop
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.step import Batch, TrainState
from streamrl.trainer.stub import stub_state
from streamrl.transport import as_str, publish
from streamrl.weightsync import DirChannel
from streamrl.wire import (
    DeadLetter,
    Group,
    TrainMetrics,
    Trajectory,
    Weights,
    decode,
    pack_arrays,
)

LOG = structlog.get_logger()


def group(gid: str, versions: tuple[list[int], ...] = ([0], [0])) -> Group:
    members = [
        Trajectory(
            traj_id=f"{gid}-{k}",
            group_id=gid,
            task_id=f"t-{gid}",
            member=k,
            num_generations=len(versions),
            **pack_arrays([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7]),
            prompt_len=1,
            reward=float(k),
            status="ok",
            versions=v,
        )
        for k, v in enumerate(versions)
    ]
    advantages = [float(k) - 0.5 for k in range(len(versions))]
    return Group(group_id=gid, task_id=f"t-{gid}", members=members, advantages=advantages)


class ScriptedStep:
    """A train step that plays `script`: "ok" advances the stub state; "nan" returns a
    finite loss with NaN params and a NaN gradient norm (review M1: what a finite loss
    with non-finite gradients gave)."""

    row_multiple = 1

    def __init__(self, script: list[str]) -> None:
        self.script: Iterator[str] = iter(script)

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        bad = next(self.script) == "nan"
        params = jnp.full((16,), jnp.nan if bad else 1.0, jnp.float32)
        metrics = {
            "loss": 1.0,
            "grad_norm": math.nan if bad else 0.5,
            "clip_fraction": 0.0,
            "num_tokens": float(np.sum(batch.mask)),
        }
        return state.replace(step=state.step + 1, params={"stub": params}), metrics


def config(**trainer: Any) -> Config:
    return parse_config(
        {
            "model": {"kind": "stub", "init": "checkpoint"},
            "trainer": {"groups_per_step": 1, **trainer},
            "grouper": {"off_policy_steps": 1000},  # the groups' version 0 stays fresh
            "transport": {"block_ms": 50},
        }
    )


@pytest.fixture
def checkpointer() -> Iterator[ocp.StandardCheckpointer]:
    c = ocp.StandardCheckpointer()
    yield c
    c.close()


def make_loop(
    cfg: Config,
    rclient: redis.Redis,
    keys: Keys,
    root: Path,
    step: Any,
    checkpointer: ocp.StandardCheckpointer,
    max_steps: int = 100,
    checkpoint_every: int = 1,
) -> TrainerLoop:
    publisher = WeightPublisher(rclient, keys, DirChannel(root.parent / "weights"), LOG)
    return TrainerLoop(
        client=rclient,
        keys=keys,
        cfg=cfg,
        state=stub_state(),
        train_step=step,
        log=LOG,
        stop=lambda: False,
        pad_id=0,
        max_steps=max_steps,
        hooks=[
            PublishHook(1, publisher),
            CheckpointHook(checkpoint_every, root, cfg.trainer.keep_checkpoints, checkpointer),
        ],
    )


def dead_groups(client: redis.Redis, keys: Keys) -> list[str]:
    raw: Any = client.xrange(keys.dead)
    return [decode(decode(f, DeadLetter).fields, Group).group_id for _, f in raw]


def test_a_non_finite_step_keeps_the_state_and_runs_no_hook(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    entries = [as_str(publish(rclient, keys.groups, group(f"g{i}"))) for i in range(6)]
    root = tmp_path / "checkpoints"
    cfg = config(max_nonfinite_steps=3)
    loop = make_loop(
        cfg, rclient, keys, root, ScriptedStep(["nan", "ok", "nan", "nan", "nan"]), checkpointer
    )
    with pytest.raises(NonFiniteStepsError, match="3 steps in a row") as err:
        loop.run()
    # The error names the groups of the failed steps in a row.
    assert "['g2'], ['g3'], ['g4']" in str(err.value)
    # One good step: one checkpoint, one version over the initial 0; nothing NaN in either.
    assert [s for s, _ in ckpts.step_dirs(root)] == [1]
    assert rclient.get(keys.policy_version) == b"1"
    assert loop.step == 1 and bool(jnp.all(loop.state.params["stub"] == 1.0))
    restored = checkpointer.restore((root / "step_00000001" / ckpts.STATE).resolve())
    assert np.all(np.asarray(restored["params"]["stub"]) == 1.0)
    # The failed steps' groups are dead-lettered, counted; g0's was acknowledged with
    # checkpoint 1, the last three wait for the next checkpoint.
    assert dead_groups(rclient, keys) == ["g0", "g2", "g3", "g4"]
    assert rclient.hget(keys.stats, TRAINER_NONFINITE_STEPS) == b"4"
    meta = ckpts.verify(root / "step_00000001").meta()
    assert meta["lineage"] == [[1, ["g1"]]] and meta["set_aside"] == [[1, [entries[0]]]]
    pending: Any = rclient.xpending(keys.groups, keys.CG_TRAINER)
    assert pending["pending"] == 3


def test_a_group_too_stale_when_taken_is_dropped_not_trained(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    # Issue 15 item 4: every member is checked when the trainer takes the group (the
    # trainer may have moved on since the grouper emitted it), the oldest one included.
    publish(rclient, keys.groups, group("g0", ([5], [4])))
    stale = as_str(publish(rclient, keys.groups, group("g1", ([3], [5]))))  # 3 behind v6
    publish(rclient, keys.groups, group("g2", ([5], [4])))
    root = tmp_path / "checkpoints"
    cfg = parse_config(
        {
            **{"model": {"kind": "stub", "init": "checkpoint"}},
            "trainer": {"groups_per_step": 1},
            "grouper": {"off_policy_steps": 2},
            "transport": {"block_ms": 50},
        }
    )
    loop = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok", "ok"]), checkpointer, 2)
    loop.version = 5  # what a resumed trainer publishes first
    loop.run()
    meta = ckpts.verify(root / "step_00000002").meta()
    assert meta["lineage"] == [[1, ["g0"]], [2, ["g2"]]]
    assert meta["set_aside"] == [[2, [stale]]]  # taken at version 6: dropped, counted
    assert rclient.hget(keys.stats, TRAINER_GROUPS_STALE) == b"1"
    assert rclient.hget(keys.stats, GROUPS_SET_ASIDE) == b"1"
    assert rclient.hget(keys.stats, "groups_dropped") == b"1"
    assert rclient.sismember(keys.groups_dropped, "g1")
    assert rclient.xlen(keys.dead) == 0
    pending: Any = rclient.xpending(keys.groups, keys.CG_TRAINER)
    assert pending["pending"] == 0  # acknowledged with checkpoint 2


def test_the_lineage_keeps_a_window_and_still_skips_duplicates(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    # Review M4: meta.json's lineage and the trainer's set of consumed ids hold the groups
    # a resume can deliver again (from the oldest kept checkpoint's cut on), not the run.
    steps, keep = 40, 2
    root = tmp_path / "checkpoints"
    cfg = config(keep_checkpoints=keep)
    for i in range(steps):
        publish(rclient, keys.groups, group(f"g{i}"))
        if i in (10, 30):  # a group emitted again (Redis lost the record of its emission)
            publish(rclient, keys.groups, group(f"g{i - 1}"))
    loop = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok"] * steps), checkpointer, steps)
    sizes: list[tuple[int, int]] = []

    @dataclass
    class Probe:  # runs after the checkpoint hook: what the loop holds then
        every: int = 1
        at_start: bool = False

        def __call__(self, loop: TrainerLoop, final: bool) -> None:
            sizes.append((len(loop.lineage), len(loop.consumed)))

    loop.hooks.append(Probe())
    with structlog.testing.capture_logs() as logs:
        loop.run()
    assert loop.step == steps
    # Every group trained once: the duplicates were skipped, not trained.
    trained = [e["group_ids"] for e in logs if e["event"] == "train_step"]
    assert trained == [[f"g{i}"] for i in range(steps)]
    skipped = [e["group_id"] for e in logs if e["event"] == "group_already_trained"]
    assert skipped == ["g9", "g29"]
    # The window: the steps from the oldest kept checkpoint's cut on (keep steps at
    # checkpoint_every 1; a duplicate pending at a cut reaches back to its group's step,
    # 2 more here, until that checkpoint is pruned), however long the run.
    assert len(sizes) == steps and sizes[-1] == (keep, keep)
    assert max(n for n, _ in sizes) <= keep + 2 and max(n for _, n in sizes) <= keep + 2
    meta = ckpts.verify(root / f"step_{steps:08d}").meta()
    assert len(meta["lineage"]) <= keep + 1 and meta["lineage_from"] == steps
    assert meta["lineage"][-1] == [steps, [f"g{steps - 1}"]]

    # A resumed trainer (Redis kept) is delivered the groups after the cut again and skips
    # them: the window holds them.
    publish(rclient, keys.groups, group("g-new"))
    again = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok"]), checkpointer, steps + 1)
    assert again.resume(root, checkpointer) == steps
    with structlog.testing.capture_logs() as logs:
        again.run()
    trained = [e["group_ids"] for e in logs if e["event"] == "train_step"]
    assert trained == [["g-new"]]


def test_a_dead_lettered_group_replayed_by_the_operator_trains(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    # A non-finite step's groups are dead-lettered; once the cause is mended the operator
    # replays them (`streamrl queues --replay-dead`): a new entry of the same group, which
    # the trainer must train, not skip as already handled.
    first = [as_str(publish(rclient, keys.groups, group(f"g{i}"))) for i in range(2)]
    root = tmp_path / "checkpoints"
    step = ScriptedStep(["nan", "ok", "ok"])
    loop = make_loop(config(), rclient, keys, root, step, checkpointer, max_steps=1)
    loop.run()
    meta = ckpts.verify(root / "step_00000001").meta()
    assert meta["lineage"] == [[1, ["g1"]]] and meta["set_aside"] == [[1, [first[0]]]]
    assert replay_dead(rclient, keys) != []
    loop.max_steps = 2
    loop.run()
    assert [ids for _, ids in loop.lineage] == [["g1"], ["g0"]]


def test_groups_trained_counts_the_state_s_groups_across_a_restart(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """A trainer restarted from its checkpoint trains the groups after the cut again: the
    run's `groups_trained` counts the groups in the state's history (3 here), not every
    training of them (4: review code-86b402d, 4, summary.json)."""
    root = tmp_path / "checkpoints"
    cfg = config()
    for i in range(3):
        publish(rclient, keys.groups, group(f"g{i}"))
    first = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok"] * 3), checkpointer, 3, 2)
    first.run()  # steps 1-3, checkpoints at 2 and (final) 3
    shutil.rmtree(root / "step_00000003")  # as if killed before the last one
    assert rclient.hget(keys.stats, "groups_trained") == b"3"
    again = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok"]), checkpointer, 3, 2)
    assert again.resume(root, checkpointer) == 2
    with structlog.testing.capture_logs() as logs:
        again.run()
    assert [e["group_ids"] for e in logs if e["event"] == "train_step"] == [["g2"]]
    assert rclient.hget(keys.stats, "groups_trained") == b"3"


def test_the_summary_takes_each_step_s_metrics_once(rclient: redis.Redis, keys: Keys) -> None:
    """The metrics stream keeps a restarted trainer's discarded steps too (2 and 3 below,
    trained again): the summary's rewards are one per step, the last training of each;
    an unreadable entry is logged, not silently dropped (review code-86b402d, 4)."""

    def m(step: int, reward: float) -> TrainMetrics:
        return TrainMetrics(
            step=step, version=step, loss=0.0, reward_mean=reward, num_groups=1,
            num_sequences=2, num_tokens=6, clip_fraction=0.0, grad_norm=0.1,
            max_policy_lag=0, step_time_s=0.01,
        )  # fmt: skip

    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)]:
        publish(rclient, keys.metrics, m(step, reward))
    rclient.xadd(keys.metrics, {"kind": "metrics", "v": "99", "body": "not msgpack"})
    with structlog.testing.capture_logs() as logs:
        got = step_metrics(rclient, keys, structlog.get_logger())
    assert [(x.step, x.reward_mean) for x in got] == [(1, 0.1), (2, 0.25), (3, 0.35), (4, 0.4)]
    assert [e["entries"] for e in logs if e["event"] == "metrics_unreadable"] == [1]


def test_the_data_is_drained_only_when_nothing_can_come_again(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """Issue 29 (runs that end): the trainer ends the run only once the feeder wrote its
    last task (feeder_end), every task and trajectory is acknowledged, no group is half
    filled and every group reached it; each of those alone keeps the run going."""
    from streamrl.transport import ensure_group

    cfg = parse_config({"trainer": {"groups_per_step": 2}})
    loop = make_loop(cfg, rclient, keys, tmp_path / "ckpt", lambda s, b: (s, None), checkpointer)

    def drained() -> bool:
        loop._next_drain_check = 0.0  # the once-a-second limit, not under test
        return loop._drained()

    assert not drained()  # no end: the data goes on (task.epochs = 0)
    rclient.set(keys.feeder_end, 2)
    rclient.set(keys.feeder_cursor, 1)
    assert not drained()  # the feeder has a task left to write
    rclient.set(keys.feeder_cursor, 2)
    ensure_group(rclient, keys.tasks, keys.CG_ROLLOUT)
    task_id = rclient.xadd(keys.tasks, {"t": "1"})
    assert not drained()  # a task not yet read by rollout
    rclient.xreadgroup(keys.CG_ROLLOUT, "r0", {keys.tasks: ">"})
    assert not drained()  # read, its episodes running (not acknowledged)
    rclient.xack(keys.tasks, keys.CG_ROLLOUT, task_id)
    rclient.hset(keys.groups_started, "g0", 1)
    assert not drained()  # a half-filled group
    rclient.hdel(keys.groups_started, "g0")
    ensure_group(rclient, keys.groups, keys.CG_TRAINER)
    rclient.xadd(keys.groups, {"g": "1"})
    assert not drained()  # a group not yet delivered to the trainer
    rclient.xreadgroup(keys.CG_TRAINER, "trainer", {keys.groups: ">"})
    assert drained()  # delivered (held until its checkpoint acknowledges it): done


POISON = 99  # a token id that makes PoisonStep die


class StepDiedError(RuntimeError):
    """What a step that kills its trainer looks like to the next start (an exception out of
    the step; a host OOM kill is the same there)."""


class PoisonStep(ScriptedStep):
    """A step that raises `error` (by default one that kills the trainer; MemoryError is
    a device OOM, which the loop survives) whenever its batch holds a POISON token, and
    advances the stub state otherwise."""

    def __init__(self, error: type[Exception] = StepDiedError) -> None:
        super().__init__([])
        self.error = error

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        if np.any(np.asarray(batch.tokens) == POISON):
            if self.error is MemoryError:
                raise MemoryError("RESOURCE_EXHAUSTED: out of memory (the poison group)")
            raise self.error("the step died (the poison group)")
        self.script = iter(["ok"])
        return super().__call__(state, batch)


def poison(gid: str) -> Group:
    g = group(gid)
    members = [
        msgspec.structs.replace(m, **pack_arrays([1, POISON, 3], [0, 1, 1], [0.0, -0.5, -0.7]))
        for m in g.members
    ]
    return msgspec.structs.replace(g, members=members)


def _run_until_idle(loop: TrainerLoop) -> None:
    """Run the loop until it has nothing more to take: stop once a read brings nothing."""
    idle = {"n": 0}
    base_read = loop.input.read

    def read(count: int | None = None, block_ms: int | None = None) -> Any:
        got = base_read(count=count, block_ms=block_ms)
        idle["n"] = 0 if got else idle["n"] + 1
        return got

    loop.input.read = read  # type: ignore[method-assign]  # counts the empty reads
    loop.stop = lambda: idle["n"] >= 3
    loop.run()


class FreshGroupsStep(ScriptedStep):
    """Advances the stub state and, as rollout would, emits the next group sampled by the
    version published now; dies (a SIGKILL's effect: no final checkpoint) at `die_at`."""

    def __init__(
        self, rclient: redis.Redis, keys: Keys, die_at: int = 0, emit: bool = True
    ) -> None:
        super().__init__([])
        self.rclient, self.keys, self.die_at, self.emit = rclient, keys, die_at, emit

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        if self.die_at and int(state.step) + 1 == self.die_at:
            raise SystemExit("killed")
        version = int(self.rclient.get(self.keys.policy_version) or 0)
        n = int(self.rclient.xlen(self.keys.groups))
        if self.emit:
            g = group(f"g{n + 1:02d}", ([version], [version]))
            publish(self.rclient, self.keys.groups, g)
        self.script = iter(["ok"])
        return super().__call__(state, batch)


def test_a_restart_judges_rewound_groups_by_the_lag_they_had(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """Review N1: a trainer restarted k steps after its checkpoint publishes a version above
    every one published, and judged the groups it trains again (those of the steps after
    the checkpoint, each fresh when first taken) against it: k - 1 steps' worth dropped as
    stale, lost work. The jump is not policy age: each rewound group is judged with the lag
    it had, and the groupers judge against the same (policy:offset). Checkpoint at step 5,
    killed in step 9: steps 6-8's groups are trained again, none dropped."""
    root = tmp_path / "checkpoints"
    cfg = parse_config(
        {
            "model": {"kind": "stub", "init": "checkpoint"},
            "trainer": {"groups_per_step": 1},
            "grouper": {"off_policy_steps": 2},
            "transport": {"block_ms": 50},
        }
    )
    publish(rclient, keys.groups, group("g01"))
    first = make_loop(cfg, rclient, keys, root, FreshGroupsStep(rclient, keys, die_at=9),
                      checkpointer, 20, checkpoint_every=5)  # fmt: skip
    with pytest.raises(SystemExit):
        first.run()
    assert [s for s, _ in first.lineage][-1] == 8
    # The restarted trainer trains what the dead one left (steps 6-9's groups; rollout's
    # later groups are of the new lineage, judged as usual: tests/unit/test_policy_clock.py).
    again = make_loop(cfg, rclient, keys, root, FreshGroupsStep(rclient, keys, emit=False),
                      checkpointer, 9, checkpoint_every=5)  # fmt: skip
    assert again.resume(root, checkpointer) == 5
    assert again.version > 8  # above every version published: the jump
    with structlog.testing.capture_logs() as logs:
        again.run()
    steps = {e["step"]: e["group_ids"] for e in logs if e["event"] == "train_step"}
    assert [steps[s] for s in (6, 7, 8, 9)] == [["g06"], ["g07"], ["g08"], ["g09"]], steps
    assert rclient.hget(keys.stats, TRAINER_GROUPS_STALE) is None
    assert max(e["max_policy_lag"] for e in logs if e["event"] == "train_step") <= 2
    # The groupers judge against the same version: the trainer's less the jump.
    from streamrl.grouper import Grouper

    grouper = Grouper(rclient, keys, cfg, "g", LOG)
    assert grouper.trainer_version() == replace(again.clock, version=again.version)


def test_a_start_that_trains_nothing_publishes_no_new_version(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """Issue 30: each trainer start published its restored state as a new version, so a
    trainer that dies in its first step (a crash loop) added a version per start for the
    same weights, and every rollout worker synced them. A start whose restored state the
    last published version already holds (published at the checkpoint's step) publishes
    nothing and keeps that version; one after which other weights were published (a
    discarded lineage's) still takes a version above them."""
    root = tmp_path / "checkpoints"
    cfg = config()
    for i in range(1, 8):
        publish(rclient, keys.groups, group(f"g{i}"))

    def start(die_at: int, max_steps: int = 20) -> TrainerLoop:
        step = FreshGroupsStep(rclient, keys, die_at=die_at, emit=False)
        loop = make_loop(cfg, rclient, keys, root, step, checkpointer, max_steps,
                         checkpoint_every=2)  # fmt: skip
        loop.resume(root, checkpointer)
        return loop

    def published() -> list[tuple[int, int]]:  # (version, step) of every weights entry
        raw: Any = rclient.xrange(keys.weights)
        return [(w.version, w.step) for w in (decode(f, Weights) for _, f in raw)]

    first = start(die_at=4)  # versions 0-3 at steps 0-3, checkpoint at step 2, dies in 4
    with pytest.raises(SystemExit):
        first.run()
    assert published()[-1] == (3, 3)
    again = start(die_at=3)  # version 3 is a discarded lineage's: a new version, state 2
    assert (again.version, again.version_held) == (4, False)
    with pytest.raises(SystemExit):
        again.run()  # publishes version 4 (step 2), dies in step 3
    assert published()[-1] == (4, 2)
    for _ in range(3):  # the crash loop: version 4 holds the restored state already
        looped = start(die_at=3)
        assert (looped.version, looped.version_held) == (4, True)
        with pytest.raises(SystemExit):
            looped.run()
        assert published()[-1] == (4, 2)
        assert int(rclient.get(keys.policy_version) or -1) == 4
    last = start(die_at=0, max_steps=4)  # the fault is gone: training goes on from 4
    with structlog.testing.capture_logs() as logs:
        last.run()
    assert published()[-2:] == [(5, 3), (6, 4)]
    assert [e["step"] for e in logs if e["event"] == "train_step"] == [3, 4]
    assert last.clock.offset == 2  # version 4 is state 2's: its jump still is no policy age


def test_a_trainer_whose_identity_was_taken_writes_nothing_more(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """Review N13: a trainer cut off from Redis while a new one took its identity over
    would, back again, publish, checkpoint and acknowledge beside the new one. The loop
    asks before each hook and acknowledgement whether it still holds its identity; once
    not, it stops (FencedError, fatal) with nothing more written: no version, no checkpoint,
    its groups since the last checkpoint left pending for the trainer that holds it."""
    from streamrl.trainer.loop import FencedError

    root = tmp_path / "checkpoints"
    for i in range(1, 6):
        publish(rclient, keys.groups, group(f"g{i}"))
    held = {"yes": True}

    class Step(ScriptedStep):
        def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
            if int(state.step) == 2:  # in step 3: another trainer takes the identity over
                held["yes"] = False
            return super().__call__(state, batch)

    loop = make_loop(config(), rclient, keys, root, Step(["ok"] * 5), checkpointer,
                     5, checkpoint_every=2)  # fmt: skip
    loop.fence = lambda: held["yes"]
    with pytest.raises(FencedError, match=r"no longer holds its identity.*PublishHook at step 3"):
        loop.run()
    assert int(rclient.get(keys.policy_version) or -1) == 2  # nothing published after
    assert [s for s, _ in ckpts.step_dirs(root)] == [2]
    pending: Any = rclient.xpending(keys.groups, Keys.CG_TRAINER)
    assert pending["pending"] == 1  # step 3's group: not acknowledged


def test_a_hung_train_step_stops_the_liveness_beat(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer
) -> None:
    """Review N9: a train step was a busy step without a bound, so a step hung on a device,
    in a collective or on a Redis command kept the liveness beat going for ever. Once a
    few steps are measured, a step is busy for at most STEP_BOUND_FACTOR x their median
    (never less than run.liveness_timeout_s); past it the loop is not live, its beat
    stops and `streamrl up` restarts the trainer."""
    import threading
    import time

    from streamrl.trainer.loop import STEP_BOUND_AFTER

    cfg = parse_config(
        {
            "model": {"kind": "stub", "init": "checkpoint"},
            "trainer": {"groups_per_step": 1},
            "grouper": {"off_policy_steps": 1000},
            "transport": {"block_ms": 50},
            "run": {"liveness_timeout_s": 2},
        }
    )
    for i in range(STEP_BOUND_AFTER + 1):
        publish(rclient, keys.groups, group(f"g{i}"))
    hang = threading.Event()
    release = threading.Event()

    class Hangs(ScriptedStep):
        def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
            if int(state.step) == STEP_BOUND_AFTER:
                hang.set()
                release.wait(30)
            return super().__call__(state, batch)

    loop = make_loop(cfg, rclient, keys, tmp_path / "checkpoints",
                     Hangs(["ok"] * (STEP_BOUND_AFTER + 1)), checkpointer,
                     STEP_BOUND_AFTER + 1, checkpoint_every=100)  # fmt: skip
    runner = threading.Thread(target=loop.run)
    runner.start()
    try:
        assert hang.wait(30)
        assert loop.step_bound_s() == 2  # the floor: these steps take milliseconds
        assert loop.liveness.live(2.0)  # in its step, within the bound
        time.sleep(2.5)
        assert not loop.liveness.live(2.0)  # past it: the beat stops
    finally:
        release.set()
        runner.join(30)
    assert loop.step == STEP_BOUND_AFTER + 1 and loop.liveness.live(2.0)


class TwoCheckpointDisk(ocp.StandardCheckpointer):
    """A disk with room for two checkpoints: a save while two complete ones are there
    fails with ENOSPC (what Orbax raises on a full disk)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.full = 0

    def save(self, directory: Any, *args: Any, **kwargs: Any) -> None:
        import errno
        import os

        complete = [p for _, p in ckpts.step_dirs(self.root) if (p / ckpts.COMMIT).exists()]
        if len(complete) >= 2:
            self.full += 1
            (Path(directory).parent / "partial.bin").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        super().save(directory, *args, **kwargs)


def test_a_full_disk_prunes_before_it_crash_loops(rclient: redis.Redis, keys: Keys,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """Review N14: old checkpoints were pruned only after a successful save, so a disk
    full at the save crashed the trainer at the same step after every restart while the
    checkpoints that could make room stayed. Now the save that hits ENOSPC frees the
    oldest checkpoint (the one the prune after it would remove anyway) and writes again;
    the run goes on and keeps `keep_checkpoints` of them."""
    root = tmp_path / "checkpoints"
    disk = TwoCheckpointDisk(root)
    cfg = config(keep_checkpoints=2)
    for i in range(1, 7):
        publish(rclient, keys.groups, group(f"g{i}"))
    loop = make_loop(cfg, rclient, keys, root, ScriptedStep(["ok"] * 6), disk, 6,
                     checkpoint_every=2)  # fmt: skip
    try:
        with structlog.testing.capture_logs() as logs:
            loop.run()
    finally:
        disk.close()
    assert disk.full == 1 and loop.step == 6
    assert "checkpoint_disk_full" in [e["event"] for e in logs]
    assert [s for s, _ in ckpts.step_dirs(root)] == [6, 4]
    assert ckpts.latest_complete(root) is not None
    assert not (ckpts.step_dir(root, 6) / "partial.bin").exists()


def test_a_disk_short_of_room_prunes_before_the_save(
    rclient: redis.Redis, keys: Keys, tmp_path: Path, checkpointer: ocp.StandardCheckpointer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """With less free room than the newest checkpoint takes, the oldest one goes before
    the next is written (`checkpoints.make_room`); never the last one (keep 1)."""
    from collections import namedtuple

    root = tmp_path / "checkpoints"
    for i in range(1, 7):
        publish(rclient, keys.groups, group(f"g{i}"))
    loop = make_loop(config(keep_checkpoints=2), rclient, keys, root,
                     ScriptedStep(["ok"] * 6), checkpointer, 4, checkpoint_every=2)  # fmt: skip
    loop.run()
    assert [s for s, _ in ckpts.step_dirs(root)] == [4, 2]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpts.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 10))
    with structlog.testing.capture_logs() as logs:
        removed = ckpts.make_room(root, 2, LOG)
    assert [p.name for p in removed] == [ckpts.step_dir(root, 2).name]
    assert "checkpoint_disk_short" in [e["event"] for e in logs]
    assert ckpts.make_room(root, 1, LOG) == [] and ckpts.latest_complete(root) is not None
