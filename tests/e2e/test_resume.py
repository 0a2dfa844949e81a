"""`streamrl up --resume`: a stopped run continues from its newest complete checkpoint, with
Redis's data kept (the embedded server's AOF) or lost (restored from the snapshot)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl import checkpoints as ckpts
from streamrl.names import Keys
from tests.e2e.test_up import assert_nothing_left, started_pids, summary_of, up
from tests.e2e.test_up import resume as resume_run
from tests.helpers import NO_EVALUATOR

# Two `streamrl up` runs each (the first of the session also trains the warm start).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def resume(run_dir: Path, steps: int, *sets: str, env: dict[str, str] | None = None) -> str:
    """`streamrl up --resume` to `steps`, the evaluator off; it must end with status 0.
    Returns what it printed."""
    proc = resume_run(run_dir, steps, NO_EVALUATOR, *sets, timeout_s=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def events(run_dir: Path, worker: str, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / "logs" / f"{worker}.log").read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e["event"] == name]


def check_lineage(run_dir: Path, steps: int) -> list[str]:
    """The final checkpoint's history: steps 1..N without a gap, no group trained twice."""
    ck = ckpts.latest_complete(run_dir / "checkpoints")
    assert ck is not None and ck.step == steps
    lineage = ck.meta()["lineage"]
    assert [s for s, _ in lineage] == list(range(1, steps + 1))
    ids = [g for _, gs in lineage for g in gs]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    return ids


def test_resume_with_redis_kept_continues_without_gap(tmp_path: Path, warm_cache: str) -> None:
    run_dir = tmp_path / "run"
    sets = (f'model.cache_dir="{warm_cache}"', "trainer.checkpoint_every=2")
    proc = up(run_dir, 3, *sets)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    first = summary_of(run_dir)
    assert first["trainer_steps"] == 3 and first["policy_version"] == 3

    out = resume(run_dir, 5, *sets)
    assert "resuming" in out and "checkpoint step 3" in out and "Redis kept" in out
    s = summary_of(run_dir)
    assert s["resumed"] and s["trainer_steps"] == 5
    resumed = events(run_dir, "trainer-0", "trainer_resumed")
    assert [e["step"] for e in resumed] == [3]
    # The first run's last version (3, published at step 3) holds the restored state:
    # the resumed trainer keeps it and publishes nothing at its start (issue 30).
    assert (resumed[0]["version"], resumed[0]["version_published_already"]) == (3, True)
    steps = [e["step"] for e in events(run_dir, "trainer-0", "train_step")]
    assert steps == [1, 2, 3, 4, 5]  # the second run went on from 3
    # The rollout worker of the second run served the restored policy, not older ones.
    loaded = events(run_dir, "rollout-0", "weights_loaded")
    second = [e["version"] for e in loaded if e["pid"] == loaded[-1]["pid"]]
    assert second and min(second) >= 3, [(e["pid"], e["version"]) for e in loaded]
    check_lineage(run_dir, 5)
    # Streams were trimmed at checkpoints (trainer.trim_streams), and the resume still
    # found every group after its cut: once step 3 was the oldest kept checkpoint, the
    # groups of steps 1-2 went.
    trimmed = [e["deleted"] for e in events(run_dir, "trainer-0", "streams_trimmed")]
    assert any(k.endswith(":groups") for d in trimmed for k in d), trimmed
    assert any(k.endswith(":tasks") for d in trimmed for k in d), trimmed
    assert_nothing_left(s)


def test_resume_after_redis_lost_restores_the_queues(
    tmp_path: Path,
    warm_cache: str,
    redis_url: str,
    rclient: redis.Redis,
    keys: Keys,
) -> None:
    run_dir = tmp_path / "run"
    sets = (f'model.cache_dir="{warm_cache}"', f"run.name={keys.ns}", "trainer.checkpoint_every=2")
    env = {"REDIS_URL": redis_url}
    proc = up(run_dir, 2, *sets, env=env)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    ck = ckpts.latest_complete(run_dir / "checkpoints")
    assert ck is not None and ck.step == 2
    snap = ck.snapshot()
    in_flight = sum(len(s.entries) for s in snap.streams)
    assert in_flight > 0  # the backlog the first run left
    # The feeder's cursor at the cut (the first run went on writing tasks after it; those
    # were lost with Redis and are issued again: never trained, so not twice).
    cursor = int(snap.strings[keys.feeder_cursor])
    rclient.delete(*rclient.keys(keys.every_key))  # Redis lost the run

    out = resume(run_dir, 4, *sets, env=env)
    assert "the trainer restores the queues from the checkpoint it restores" in out, out
    [restored] = events(run_dir, "trainer-0", "queues_restored")
    # Every stream as the snapshot held it (which of them had entries at the cut depends on
    # timing: on a slow machine the trainer can have taken every emitted group by then).
    assert restored["step"] == 2
    assert {st.stream: restored["entries"][st.stream] for st in snap.streams} == {
        st.stream: len(st.entries) for st in snap.streams
    }
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 4
    ids = check_lineage(run_dir, 4)
    # The feeder went on from the snapshot's cursor, not from the start.
    assert int(rclient.get(keys.feeder_cursor) or 0) >= cursor > 0
    tasks: Any = rclient.xrange(keys.tasks)
    assert len(ids) == 4 * 4 and tasks is not None
    assert_nothing_left(s)


def test_trainer_of_two_processes_trains_and_restarts_as_one(
    tmp_path: Path, warm_cache: str
) -> None:
    """trainer.num_processes = 2 (jax.distributed, gloo, one CPU device each, one 2-device
    mesh): process 0 reads groups and broadcasts each batch, both run the step. SIGKILL
    process 1 after the first checkpoint: both restart together, resume from it, and the
    run reaches its steps with one lineage."""
    run_dir = tmp_path / "run"
    proc = up(run_dir, 5, f'model.cache_dir="{warm_cache}"', "trainer.num_processes=2",
              "trainer.mesh_data=2", "trainer.checkpoint_every=2", "trainer.groups_per_step=2",
              "run.restart_backoff_s=0.2")  # fmt: skip
    deadline = time.monotonic() + 500
    while ckpts.latest_complete(run_dir / "checkpoints") is None:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    started = started_pids(run_dir)
    os.killpg(started["trainer-1"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 5
    assert s["worker_restarts"]["trainer-0"] == 1 and s["worker_restarts"]["trainer-1"] == 1
    check_lineage(run_dir, 5)
    resumed = events(run_dir, "trainer-0", "trainer_resumed")
    assert len(resumed) == 1 and resumed[0]["step"] >= 2
    joined = events(run_dir, "trainer-1", "trainer_process")
    assert [e["index"] for e in joined] == [1, 1] and joined[0]["count"] == 2
    assert_nothing_left(s, "trainer.num_processes=2", "trainer.mesh_data=2")
