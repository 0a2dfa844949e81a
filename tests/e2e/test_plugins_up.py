"""`streamrl up` on the user's own code: broken plug-ins stop the run at start (a bad path)
or cost only their own episodes (an environment that raises, a reward that is not a
number). The worked example package trains end to end with its tool run by the tool
workers in tests/e2e/test_mixture_up.py (a mixture of it and the arithmetic task)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_up import summary_of, up
from tests.helpers import REPO, committed_trajectories

pytestmark = pytest.mark.e2e

STUB = REPO / "configs" / "stub.toml"
# The fixtures' plug-ins load by import path in every worker process.
WITH_TESTS = {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
}


def events(path: Path, name: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x[:1] == "{") if e.get("event") == name]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ('task.name="no_such_package.tasks:Task"', "field `task.name`: cannot import `no_such_"),
        ('tools.extra=["tests.plugin_fixtures:BAD_SCHEMA"]', "tool `bad`: parameters.required"),
        ("task.options.turnz=3", "unknown key `task.options.turnz`"),
    ],
    ids=["bad-import-path", "bad-tool-schema", "unknown-option"],
)
def test_a_bad_plugin_stops_the_run_at_start(tmp_path: Path, setting: str, message: str) -> None:
    start = time.monotonic()
    proc = up(tmp_path / "run", 1, setting, config=STUB, env=WITH_TESTS)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert message in out
    assert time.monotonic() - start < 30  # no worker was started
    assert not (tmp_path / "run" / "logs").exists()


def test_broken_environment_and_rewards_cost_only_their_episodes(tmp_path: Path) -> None:
    """Per group: member 0's environment raises, member 1's reward is NaN, member 2's a
    string; each such episode ends with status error, counted, and the run goes on."""
    stub = STUB.read_text()  # the stub policy's config without the synthetic task's options
    config = tmp_path / "flaky.toml"
    config.write_text(stub[: stub.index("[task.options]")] + stub[stub.index("[model]") :])
    run_dir = tmp_path / "run"
    proc = up(
        run_dir,
        3,
        'task.name="tests.plugin_fixtures:FlakyTask"',
        "trainer.groups_per_step=4",
        "trainer.checkpoint_every=3",
        "grouper.min_valid_members=1",  # one valid member of four: its group still trains
        config=config,
        env=WITH_TESTS,
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 3 and set(s["worker_restarts"].values()) == {0}
    assert s["episodes"]["error"] == 3 * s["episodes"]["ok"] > 0
    trajectories = committed_trajectories(run_dir / "logs" / "rollout-0.log")
    errors = {t["traj_id"][-2:]: t["error"] for t in trajectories if t["status"] == "error"}
    assert "RuntimeError: environment exploded" in errors["m0"]
    assert "RewardError: reward returned nan, not a finite number" in errors["m1"]
    assert "RewardError: reward returned str 'high', not a number" in errors["m2"]
    assert all(
        t["status"] == "ok" and t["reward"] == 3.0
        for t in trajectories
        if t["traj_id"].endswith("m3")
    )
