"""`streamrl up` with the stub policy (configs/stub.toml): the whole pipeline at the speed
of Redis and the orchestration, every group accounted for."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_up import assert_nothing_left, summary_of, up
from tests.helpers import REPO, committed_trajectories

pytestmark = pytest.mark.e2e

STUB = REPO / "configs" / "stub.toml"
GROUPS, PER_STEP = 1000, 25


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in (json.loads(line) for line in path.read_text().splitlines() if line[:1] == "{")
        if e.get("event") == name
    ]


@pytest.mark.timeout(180)
def test_stub_up_runs_a_thousand_groups(tmp_path: Path) -> None:
    """1,000 prompts, one epoch: the feeder writes exactly 1,000 tasks, so every group the
    run makes is trained (40 steps of 25) and each is counted once."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(GROUPS)))
    cache = tmp_path / "cache"
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = up(
        run_dir,
        GROUPS // PER_STEP,
        f'task.dataset="{data}"',
        "task.epochs=1",
        f'model.cache_dir="{cache}"',
        config=STUB,
    )
    out, _ = proc.communicate(timeout=170)
    wall_s = time.monotonic() - start
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    print(f"1000 stub groups: wall {wall_s:.1f} s, launcher elapsed {s['elapsed_s']} s")
    assert s["trainer_steps"] == s["policy_version"] == GROUPS // PER_STEP
    assert s["groups"] == s["groups_trained"] == GROUPS
    assert s["trajectories"] == 4 * GROUPS
    assert s["episodes"] == {"ok": 4 * GROUPS, "truncated": 0, "timeout": 0, "error": 0}
    assert s["groups_dropped"] == s["trajectories_dropped"] == s["dead_letters"] == 0
    assert s["tool_calls"] == 0
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    assert_nothing_left(s)
    assert not cache.exists()  # no tiny checkpoint built, no warm start
    assert wall_s < 120  # about 15 s on 2 cores; the bound only catches a stall

    logs = run_dir / "logs"
    steps = _events(logs / "trainer-0.log", "train_step")
    assert [e["num_groups"] for e in steps] == [PER_STEP] * (GROUPS // PER_STEP)
    assert all(e["loss"] == 0.0 and e["num_tokens"] > 0 for e in steps)
    # Groups acknowledged only with the checkpoints that hold them: all 1,000 by the last.
    ckpts = _events(logs / "trainer-0.log", "checkpoint_written")
    assert [e["step"] for e in ckpts] == [10, 20, 30, 40]
    assert sum(e["acked"] for e in ckpts) == GROUPS
    # Rollout waited for version 0, then followed the trainer's versions turn by turn.
    rollout = logs / "rollout-0.log"
    assert _events(rollout, "rollout_ready")[0]["version"] == 0
    versions = [t["versions"] for t in committed_trajectories(rollout)]
    assert len(versions) == 4 * GROUPS
    assert all(len(v) == 2 and 0 <= v[0] <= v[1] <= GROUPS // PER_STEP for v in versions)
    assert max(v[-1] for v in versions) > 1
    stop = _events(rollout, "rollout_stop")[0]
    assert stop["weights_refused"] == 0 and stop["weight_syncs"] > 1
    assert stop["engine_steps"] == 2 * 4 * GROUPS  # two model calls per episode
