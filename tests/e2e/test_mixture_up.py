"""A mixture of tasks through `streamrl up` (issue 32): configs/mixture.toml, arithmetic and
the unit-conversion example drawn 3:1, killed mid-run and resumed. Every task written is the
mixture's at its position, before the kill and after it; the counts per task are the
order's; status, summary.json, the report, the TensorBoard sink and the held-out
evaluation (each task's own split) all give every figure per task.

The same run shows the worked example package training through `streamrl up` (it had a
run of its own): its task by its entry-point name with its options, its environment in the
rollout worker and its `convert` tool in the tool workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from streamrl.config import load_config
from streamrl.run import rundir
from streamrl.tasks.base import group_cursor
from streamrl.tasks.mixture import Mixture, mixture
from tests.e2e.test_sinks_up import _events
from tests.e2e.test_up import resume, started_pids, summary_of, up
from tests.helpers import REPO, committed_trajectories
from tests.sinkfiles import tensorboard_scalars

pytestmark = pytest.mark.e2e

MIXTURE = REPO / "configs" / "mixture.toml"
LABELS = ("arithmetic", "unitconv")
# The flow, not the skill: a short warm start (the config's 1500 steps learn both tasks'
# formats for `make`-style runs), a checkpoint every 3 steps, the evaluator at the start and
# at the last step only, 3 held-out tasks of each task.
SETS = (
    "model.warmstart_steps=400",  # calls, not skill: convert and calculator calls
    'logging.sinks=["tensorboard"]',
    "logging.interval_s=0.5",
    "trainer.checkpoint_every=3",
    "trainer.eval_every=1000",
    "trainer.eval_tasks=3",
)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "streamrl_workers.cli", *args]
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def _status_rows(run_dir: Path) -> dict[str, list[str]]:
    """`streamrl status RUN_DIR --once`'s tasks table: label -> its cells."""
    out = _cli("status", str(run_dir), "--once", timeout=60)
    assert out.returncode == 0, out.stderr
    cells = [[c for c in line.split() if c != "│"] for line in out.stdout.splitlines()]
    return {row[0]: row[1:] for row in cells if row[:1] and row[0] in LABELS and len(row) > 4}


def _kill_after(run_dir: Path, proc: subprocess.Popen[str], steps: int) -> dict[str, list[str]]:
    """Once the trainer logged `steps` steps: status's tasks table, then SIGKILL to the
    launcher and the trainer (no shutdown; the trainer's steps after its checkpoint lost)."""
    logs = run_dir / "logs"
    try:
        end = time.monotonic() + 400
        while len(_events(logs / "trainer-0.log", "train_step")) < steps:
            assert time.monotonic() < end and proc.poll() is None, f"no {steps} steps"
            time.sleep(0.2)
        live = _status_rows(run_dir)  # while the run is up: its Redis answers
        trainer = started_pids(run_dir)["trainer-0"]
        proc.kill()
        os.killpg(trainer, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    return live


def _resume(run_dir: Path, steps: int, sets: tuple[str, ...]) -> None:
    orphans = [p for p in started_pids(run_dir).values() if rundir.start_time(p)]
    try:
        resumed = resume(run_dir, steps, *sets, config=MIXTURE, timeout_s=400)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    finally:  # a failed check leaves none of the first launcher's processes running
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
def test_a_mixture_reports_per_task_and_resumes_in_its_order(
    tmp_path: Path, warm_cache: str
) -> None:
    run_dir = tmp_path / "run"
    sets = (f'model.cache_dir="{warm_cache}"', *SETS)
    live = _kill_after(run_dir, up(run_dir, 100, *sets, config=MIXTURE), 4)  # past step 3's
    assert set(live) == set(LABELS), live
    assert all(int(live[label][0]) > 0 for label in LABELS)  # tasks written of each
    # the trainer's 4 steps so far: arithmetic's reward and solve rate (3 of 4 groups)
    assert live["arithmetic"][4] != "-" and live["arithmetic"][5].endswith("%"), live
    killed_at = len(_events(run_dir / "logs" / "trainer-0.log", "train_step"))
    last = killed_at + 3
    # The killed launcher's evaluator goes on (its own session), recorded for the resume
    # to stop: left beside the resumed run's, it took the final snapshot and wrote its
    # result after the summary (a CI run saw it).
    old_evaluator = rundir.orphans(run_dir)[rundir.EVALUATOR]
    _resume(run_dir, last, sets)
    found = _events(run_dir / "logs" / "launcher.log", "orphans_found")
    assert found and found[-1]["procs"][rundir.EVALUATOR] == old_evaluator, found
    s = summary_of(run_dir)
    assert s["resumed"] and s["trainer_steps"] == last
    _assert_in_order(run_dir, s, mixture(load_config(MIXTURE, list(sets))))
    _assert_per_task(run_dir, s, last)


def _assert_in_order(run_dir: Path, s: dict[str, Any], mix: Mixture) -> None:
    """The tasks written of each are the order's (3:1 in every block of 4), exactly; every
    trajectory of both parts is of the task at its group's position; the example's tool
    and the calculator answered in the tool workers."""
    tasks = s["tasks"]
    assert set(tasks) == set(LABELS)
    written = {label: tasks[label]["tasks"] for label in LABELS}
    assert written == mix.written(sum(written.values())), written
    assert written["arithmetic"] >= 3 * written["unitconv"] - 3
    logs = run_dir / "logs"
    trajectories = [
        t for f in sorted(logs.glob("rollout-0*.log")) for t in committed_trajectories(f)
    ]
    assert trajectories
    wrong = [
        (t["traj_id"], t["task"])
        for t in trajectories
        if t["task"] != mix.label_at(group_cursor(t["traj_id"].rsplit("-m", 1)[0]) or 0)
    ]
    assert wrong == []
    assert all(t["status"] != "error" for t in trajectories), [t["error"] for t in trajectories]
    calls = {label: sum(t["tool_calls"] for t in trajectories if t["task"] == label)
             for label in LABELS}  # fmt: skip
    assert all(calls.values()), calls
    for name in ("tools-0", "tools-1"):
        started = _events(logs / f"{name}.log", "tools_start")[0]["tools"]
        assert {"calculator", "convert"} <= set(started)


def _assert_per_task(run_dir: Path, s: dict[str, Any], last: int) -> None:
    """summary.json, the evaluator's results, the report and TensorBoard per task."""
    for label in LABELS:
        t = s["tasks"][label]
        assert t["trajectories"] > 0 and t["groups"] > 0 and t["groups_trained"] > 0, (label, t)
        assert t["rewards_per_step"] and t["mean_reward_last"] is not None
        # the evaluator at step 0 and at the last step (and the resumed step), on each task's
        # held-out split
        steps = [e[0] for e in t["eval"]]
        assert steps[0] == 0 and steps[-1] == last, steps
    final = json.loads((run_dir / "eval" / f"step-{last}.json").read_text())
    assert final["task"] == "mixture" and final["n"] == 6
    assert {label: part["n"] for label, part in final["tasks"].items()} == dict.fromkeys(LABELS, 3)
    report = _cli("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    md = (run_dir / "report" / "report.md").read_text()
    assert "## Tasks of the mixture" in md and "`arithmetic`" in md and "`unitconv`" in md
    assert (run_dir / "report" / "tasks.png").stat().st_size > 0
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    for label in LABELS:
        for name in ("reward", "solve_rate", "tasks_total", "trajectories_total",
                     "groups_total"):  # fmt: skip
            assert f"task/{label}/{name}" in scalars, (label, name, sorted(scalars))
        assert scalars[f"eval/{label}/solve_rate"] == scalars["eval/all/solve_rate"]
    assert scalars["eval/all/solve_rate"][0] == 0 and scalars["eval/all/solve_rate"][-1] == last
