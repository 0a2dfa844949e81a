"""Metrics sinks under `streamrl up` (issue 32): with `logging.sinks = ["tensorboard",
"wandb"]` the sinks worker writes every metric at every trainer step, and the held-out
evaluations at theirs, into RUN_DIR/tensorboard and an offline W&B run in RUN_DIR/wandb,
read back here with TensorBoard's own reader and W&B's transaction log; a killed and
resumed run continues both, no step missing and none twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from streamrl.run import rundir
from tests.e2e.test_up import assert_nothing_left, resume, started_pids, summary_of, up
from tests.helpers import REPO
from tests.sinkfiles import RUN_NAMES, STEP_NAMES, tensorboard_scalars, wandb_rows

pytestmark = pytest.mark.e2e

SINKS = ('logging.sinks=["tensorboard","wandb"]', "logging.interval_s=0.5")
EVAL_NAMES = {
    f"eval/arithmetic/{n}"
    for n in ("solve_rate", "solve_rate_lo", "solve_rate_hi", "reward", "error_rate",
              "truncation_rate")
}  # fmt: skip
STUB = REPO / "configs" / "stub.toml"


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x[:1] == "{") if e.get("event") == name]


def assert_every_step_once(run_dir: Path, steps: int, names: set[str]) -> None:
    """TensorBoard and W&B hold each of `names` at every step 1..`steps`, once."""
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    every = list(range(1, steps + 1))
    assert {n: s for n, s in scalars.items() if n in names and s != every} == {}
    assert names <= set(scalars), sorted(names - set(scalars))
    run_id, rows = wandb_rows(run_dir)
    trained = [row for _, _, row in rows if "trainer/step" in row]
    assert [row["trainer/step"] for row in trained] == every
    assert [sorted(names - set(row)) for row in trained] == [[] for _ in every]
    assert all(f"-{run_id}-" in path.parent.name for path, _, _ in rows)  # one W&B run


@pytest.mark.timeout(300)
def test_up_writes_every_metric_at_every_step(tmp_path: Path, warm_cache: str) -> None:
    """The tiny config, 2 steps, the evaluator at the start and at step 2 (its last)."""
    run_dir = tmp_path / "run"
    sets = (*SINKS, "trainer.eval_every=2", "trainer.eval_tasks=2")
    proc = up(run_dir, 2, f'model.cache_dir="{warm_cache}"', *sets)
    out, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 2 and s["worker_exit_codes"]["sinks-0"] == 0
    assert_nothing_left(s, *sets)
    assert_every_step_once(run_dir, 2, STEP_NAMES | RUN_NAMES)
    # the evaluations at their steps (the final one was written after the trainer stopped:
    # the launcher stops the sinks worker last)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert {n: scalars.get(n) for n in EVAL_NAMES} == {n: [0, 2] for n in EVAL_NAMES}
    _, rows = wandb_rows(run_dir)
    evals = [row for _, _, row in rows if "eval/step" in row]
    assert [row["eval/step"] for row in evals] == [0, 2]
    assert all(set(row) >= EVAL_NAMES for row in evals)
    heldout = json.loads((run_dir / "eval" / "step-2.json").read_text())["solve_rate"]
    assert evals[-1]["eval/arithmetic/solve_rate"] == heldout
    log = run_dir / "logs" / "sinks-0.log"
    assert _events(log, "sink_failed") == [] and len(_events(log, "sink_closed")) == 2


@pytest.mark.timeout(300)
def test_a_killed_and_resumed_run_continues_both_sinks(tmp_path: Path) -> None:
    """The stub policy (fast steps). The launcher and the trainer are SIGKILLed at step 6
    or so, past the checkpoint of step 4; `--resume` stops the orphans (the sinks worker
    among them, which makes a last pass) and the trainer goes on from step 4, training the
    steps after it again: the sinks skip those and write every later one."""
    run_dir = tmp_path / "run"
    sets = (*SINKS, "trainer.checkpoint_every=4", "model.stub_train_step_s=0.3",
            f'model.cache_dir="{tmp_path / "cache"}"')  # fmt: skip
    proc = up(run_dir, 100, *sets, config=STUB)
    logs = run_dir / "logs"
    try:
        end = time.monotonic() + 120
        while len(_events(logs / "trainer-0.log", "train_step")) < 6:
            assert time.monotonic() < end and proc.poll() is None, "no 6 steps"
            time.sleep(0.2)
        trainer = started_pids(run_dir)["trainer-0"]
        proc.kill()  # SIGKILL: no shutdown
        os.killpg(trainer, signal.SIGKILL)  # its steps after the checkpoint are lost
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    killed_at = len(_events(logs / "trainer-0.log", "train_step"))
    orphans = [p for p in started_pids(run_dir).values() if rundir.start_time(p)]
    try:
        resumed = resume(run_dir, killed_at + 4, *sets, config=STUB, timeout_s=200)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    finally:  # a failed check leaves none of the first launcher's processes running
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    s = summary_of(run_dir)
    assert s["resumed"] and s["trainer_steps"] == killed_at + 4
    [resumed_from] = [e["step"] for e in _events(logs / "trainer-0.log", "trainer_resumed")]
    steps = [e["step"] for e in _events(logs / "trainer-0.log", "train_step")]
    # the steps after the checkpoint were trained twice (unless one was written at the kill)
    assert steps == [*range(1, killed_at + 1), *range(resumed_from + 1, killed_at + 5)]
    synthetic = {n.replace("arithmetic", "synthetic") for n in STEP_NAMES}
    assert_every_step_once(run_dir, killed_at + 4, synthetic | RUN_NAMES)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    _, rows = wandb_rows(run_dir)
    assert len({path.parent for path, _, _ in rows}) == 2  # the first part, the resumed one
    # the resumed sinks found in their files what the first sinks process wrote (it was
    # stopped by the resume, after a last pass), and went on from there
    opened = [(e["sink"], e["step"]) for e in _events(logs / "sinks-0.log", "sink_open")]
    assert opened == [("tensorboard", -1), ("wandb", -1), ("tensorboard", killed_at),
                      ("wandb", killed_at)]  # fmt: skip
