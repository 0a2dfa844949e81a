"""SIGKILL a rollout worker mid-episode, after its episodes' first turn boundaries were
written (the `episode_saved` failpoint holds it there): a second worker claims its tasks and
resumes each saved member from its turn. Every trajectory is committed once; no completed
turn is played again (the environment's side effects and the model calls say so); the
resumed turns keep their tokens, log-probs and policy versions; the states are gone once
their trajectories are committed.

The real rollout worker CLI on the stub policy, with `tests.plugin_fixtures:
RecordingEnvironment` (slow steps that each append a line to a file)."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import structlog

from streamrl.config import load_config
from streamrl.counters import EPISODES_RESUMED, EPISODES_RESUMED_SAVED_S
from streamrl.names import Keys
from streamrl.run import failpoints
from streamrl.tasks.registry import make_task
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.stub import stub_state
from streamrl.transport import publish
from streamrl.weightsync import RedisChannel
from streamrl.wire import EpisodeState, Task, Trajectory, decode, decode_state
from tests.conftest import entries
from tests.helpers import REPO, spawn_worker, stop
from tests.plugin_fixtures import EFFECTS_ENV, RECORDING_STEPS

STUB = REPO / "configs" / "stub.toml"
G = 4
TASKS = 2
SETS = (
    "task.environment=tests.plugin_fixtures:RecordingEnvironment",
    f"rollout.num_generations={G}",
    "rollout.max_steps=6",
    "transport.claim_idle_ms=1500",
    "transport.claim_every_ms=100",
)


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if line[:1] == "{":
            event = json.loads(line)
            if event.get("event") == name:
                out.append(event)
    return out


def _wait(what: str, ok: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("index", [1, 0], ids=["another-worker", "same-worker-restarted"])
def test_episodes_resume_on_the_worker_that_claims_their_task(
    redis_url: str,
    rclient: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    index: int,
) -> None:
    """`index` 1: another worker claims the tasks; 0: the killed one restarted (what the
    launcher does), claiming its own consumer's entries."""
    effects = tmp_path / "effects.txt"
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    monkeypatch.setenv(EFFECTS_ENV, str(effects))
    monkeypatch.setenv(failpoints.ENV, str(fp_dir))
    cfg = load_config(STUB, [f"run.name={keys.ns}", *SETS])
    publisher = WeightPublisher(
        rclient, keys, RedisChannel(rclient, keys, 4096), structlog.get_logger()
    )
    params = stub_state().params
    publisher.publish(params, 0, 0)
    tasks = [make_task(cfg.task, cfg.run.seed, cursor, G) for cursor in range(TASKS)]
    for t in tasks:
        publish(rclient, keys.tasks, t)
    # The first commit that writes episode states holds the worker (then it is killed).
    failpoints.arm(fp_dir, failpoints.EPISODE_SAVED, 600)
    first = spawn_worker("rollout", redis_url, keys.ns, tmp_path, *SETS, config=STUB)
    log0 = tmp_path / "rollout-0.log"
    _wait("the episode_saved failpoint", lambda: log0.exists() and "failpoint" in log0.read_text())
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert rclient.xlen(keys.trajectories) == 0  # killed mid-episode: nothing committed
    raw: dict[bytes, bytes] = rclient.hgetall(keys.episodes)  # type: ignore[assignment]
    saved = {k.decode(): decode_state(v) for k, v in raw.items()}
    assert saved and all(s.turn >= 1 and not s.committed for s in saved.values())
    a_pid = first.pid

    # The trainer moves on: the resumed turns are sampled at version 1.
    publisher.publish(params, 1, 1)
    monkeypatch.delenv(failpoints.ENV)
    second = spawn_worker("rollout", redis_url, keys.ns, tmp_path, *SETS, config=STUB, index=index)
    try:
        _wait(
            "every trajectory",
            lambda: (
                rclient.xlen(keys.trajectories) >= TASKS * G
                and rclient.xpending(keys.tasks, keys.CG_ROLLOUT)["pending"] == 0
            ),
        )
    finally:
        assert stop(second) == 0
    log1 = tmp_path / f"rollout-{index}.log"  # the killed worker's too with index 0

    # (a) Every member's trajectory is committed once.
    trajs = [decode(f, Trajectory) for _, f in entries(rclient, keys.trajectories)]
    ids = [t.traj_id for t in trajs]
    assert len(ids) == len(set(ids)) == TASKS * G
    by_id = {t.traj_id: t for t in trajs}
    assert all(t.status == "ok" and len(t.versions) == RECORDING_STEPS for t in trajs)

    # Each saved member was resumed from its saved turn, and counted.
    resumed = {e["traj_id"]: e for e in _events(log1, "episode_resumed")}
    assert {tid: e["turn"] for tid, e in resumed.items()} == {
        tid: s.turn for tid, s in saved.items()
    }
    raw = rclient.hgetall(keys.stats)  # type: ignore[assignment]
    stats = {k.decode(): v.decode() for k, v in raw.items()}
    assert int(stats[EPISODES_RESUMED]) == len(saved)
    saved_s = sum(s.model_s + s.env_s for s in saved.values())
    assert float(stats[EPISODES_RESUMED_SAVED_S]) == pytest.approx(saved_s, rel=1e-3)
    assert saved_s > 0

    # (b) No completed turn is played again.
    _check_steps_made_once(effects, tasks, saved, a_pid, second.pid)
    assert "claimed_idle_entry" in log1.read_text()  # the tasks came by XAUTOCLAIM
    [stopped] = _events(log1, "rollout_stop")
    model_turns = sum(RECORDING_STEPS - (saved[tid].turn if tid in saved else 0) for tid in ids)
    assert stopped["engine_steps"] == model_turns

    # (c) The resumed turns keep their tokens, log-probs, mask and policy versions.
    for tid, s in saved.items():
        tr = by_id[tid]
        n = len(np.frombuffer(s.tokens, "<i4"))
        assert tr.tokens[: 4 * n] == s.tokens and tr.logprobs[: 4 * n] == s.logprobs
        assert tr.loss_mask[:n] == s.loss_mask and tr.prompt_len == s.prompt_len
        assert tr.versions == [0] * s.turn + [1] * (RECORDING_STEPS - s.turn)
        assert tr.min_version == 0  # staleness counts the oldest turn
    assert all(
        tr.versions == [1] * RECORDING_STEPS for tid, tr in by_id.items() if tid not in saved
    )

    # The states are gone with their commits.
    assert rclient.hlen(keys.episodes) == 0


def _check_steps_made_once(
    effects: Path, tasks: list[Task], saved: dict[str, EpisodeState], a_pid: int, b_pid: int
) -> None:
    """Each saved step's side effect happened once, on the killed worker; the claiming
    worker made each later step once."""
    lines = [ln.split() for ln in effects.read_text().splitlines()]
    assert all(int(pid) in (a_pid, b_pid) for pid, *_ in lines)
    steps = Counter((g, int(m), int(s)) for _, g, m, s in lines)
    b_steps = Counter((g, int(m), int(s)) for pid, g, m, s in lines if int(pid) == b_pid)
    for t in tasks:
        for m in range(G):
            tid = f"{t.group_id}-m{m}"
            turn = saved[tid].turn if tid in saved else 0
            for s in range(RECORDING_STEPS):
                if s < turn:
                    assert steps[(t.group_id, m, s)] == 1 and b_steps[(t.group_id, m, s)] == 0
                else:
                    assert b_steps[(t.group_id, m, s)] == 1
