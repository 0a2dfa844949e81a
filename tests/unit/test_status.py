"""The pure parts of `streamrl status`: how workers' figures combine, and a frame."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
from rich.console import Console

from streamrl.obs import metrics as m
from streamrl.obs.status import Snapshot, WorkerState, average, largest, render, total
from streamrl.run.rundir import record
from streamrl_workers.cli import build_parser
from streamrl_workers.statuscli import target

REPO = Path(__file__).resolve().parents[2]


def _workers() -> list[WorkerState]:
    return [
        WorkerState(
            "rollout-0", "h:1", "h:1 3", 0.2, {m.TRAJECTORIES_PER_MIN: 120.0, m.REWARD_MEAN: 0.5}
        ),
        WorkerState(
            "rollout-1", "h:2", "h:2 3", 0.3, {m.TRAJECTORIES_PER_MIN: 80.0, m.REWARD_MEAN: 0.7}
        ),
        # its slot lapsed: its last sample no longer counts
        WorkerState("rollout-2", None, None, 40.0, {m.TRAJECTORIES_PER_MIN: 999.0}),
        WorkerState(
            "grouper-0",
            "h:3",
            "h:3 9",
            0.1,
            {m.queue_depth("trajectories"): 6.0, m.GROUPS_PER_MIN: 50.0},
        ),
        WorkerState(
            "grouper-1",
            "h:4",
            "h:4 9",
            0.1,
            {m.queue_depth("trajectories"): 4.0, m.GROUPS_PER_MIN: 10.0},
        ),
        WorkerState(
            "trainer-0", "h:5", "h:5 2", 0.1, {m.POLICY_VERSION: 12.0, m.EXAMPLES_PER_MIN: 400.0}
        ),
    ]


def test_figures_combine_by_meaning() -> None:
    ws = _workers()
    assert total(ws, m.TRAJECTORIES_PER_MIN) == 200.0  # 120 + 80; the gone worker's not
    assert total(ws, m.GROUPS_PER_MIN) == 60.0
    assert largest(ws, m.queue_depth("trajectories")) == 6.0  # one stream seen twice
    assert average(ws, m.REWARD_MEAN) == 0.6
    assert total(ws, m.SOLVE_RATE) is None


def test_a_frame_shows_workers_queues_and_the_pipeline() -> None:
    snap = Snapshot("demo", _workers(), {"trainer_steps": "12"}, {"rollout-1": 45.0}, 0.0)
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render(snap))
    text = out.getvalue()
    assert "run demo" in text
    assert "rollout-0 │ live" in text and "120.0 traj/min" in text
    assert "rollout-1 │ no beat" in text  # its beat has not changed for 45 s
    assert "rollout-2 │ gone" in text
    assert "grouper-0 │ live" in text and "50.0 groups/min" in text
    assert "400.0 examples/min" in text
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") >= 2}
    assert "200.0" in lines["trajectories/min"] and "60.0" in lines["groups/min"]
    assert "12" in lines["policy version"] and "0.600" in lines["reward"]
    assert "6" in lines["trajectories"]  # the queue's depth
    assert lines["held-out solve rate"].split("│")[2].strip() == "-"  # no run directory
    snap.heldout = {"step": 10, "solve_rate": 0.987}
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render(snap))
    assert "0.99 @ step 10" in out.getvalue()


def _feeder(values: dict[str, float]) -> WorkerState:
    return WorkerState("feeder-0", "h:6", "h:6 1", 0.1, values)


def _backlog_row(*workers: WorkerState) -> str:
    snap = Snapshot("demo", [*_workers(), *workers], {}, {}, 0.0)
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render(snap))
    lines = {ln.split("│")[1].strip(): ln for ln in out.getvalue().splitlines() if "│" in ln}
    return lines["tasks backlog / target"].split("│")[2].strip()


def test_status_says_whether_the_backlog_or_rollout_is_the_limit() -> None:
    """Issue 29: capacity, backlog and which side holds the run back."""
    depth, lag = m.queue_depth("tasks"), m.queue_lag("tasks")
    full = _feeder({depth: 96.0, lag: 0.0, m.BACKLOG_TARGET: 96.0, m.ROLLOUT_SLOTS: 64.0})
    assert _backlog_row(full) == "96 / 96 (the backlog is the limit)"
    queued = _feeder({depth: 96.0, lag: 30.0, m.BACKLOG_TARGET: 96.0})
    assert _backlog_row(queued) == "96 / 96 (rollout is the limit)"
    assert _backlog_row(_feeder({depth: 10.0, lag: 0.0, m.BACKLOG_TARGET: 96.0})).endswith(
        "(feeder keeps up)"
    )
    assert _backlog_row() == "-"  # no feeder sample


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["status", *argv])


def test_target_from_a_run_dir_or_a_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_PASSWORD_FILE", raising=False)
    run_dir = tmp_path / "run"
    (run_dir / "redis").mkdir(parents=True)
    # What `streamrl up` leaves: its embedded Redis's config and the launcher's record.
    (run_dir / "redis" / "redis.conf").write_text("port 6399\nrequirepass pw\n")
    record(run_dir, {}, "myrun")
    assert target(_args(str(run_dir))) == ("redis://:pw@127.0.0.1:6399/0", "myrun")
    # --redis-url wins over the run directory's Redis; --config names the run.
    url = "redis://operator@h:1/0"
    assert target(_args(str(run_dir), "--redis-url", url)) == (url, "myrun")
    config = str(REPO / "configs" / "stub.toml")
    monkeypatch.setenv("REDIS_URL", url)
    assert target(_args("--config", config)) == (url, "stub")
    with pytest.raises(ValueError, match="which run"):
        target(_args())
    monkeypatch.delenv("REDIS_URL")
    with pytest.raises(ValueError, match="no Redis"):
        target(_args("--config", config))
