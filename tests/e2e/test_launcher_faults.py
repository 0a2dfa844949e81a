"""The launcher's own faults, on `streamrl up` with the stub policy (configs/stub.toml):
a worker that stops beating is killed and restarted (`run.liveness_timeout_s`)."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_up import started_pids, summary_of, up
from tests.helpers import REPO

pytestmark = pytest.mark.e2e

STUB = REPO / "configs" / "stub.toml"
LIVENESS_S = 6.0


def _events(path: Path, name: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [
        e
        for e in (json.loads(line) for line in path.read_text().splitlines() if line[:1] == "{")
        if e.get("event") == name
    ]


def _wait_for(what: str, check: Any, timeout_s: float = 120.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(300)
def test_a_stopped_trainer_is_killed_and_restarted(tmp_path: Path) -> None:
    """SIGSTOP the trainer mid-run: its beat stops, the launcher kills it once its beat is
    `run.liveness_timeout_s` old and restarts it, and the run still ends with every step.
    No other worker (nor the restarted trainer, starting) is taken for hung."""
    run_dir = tmp_path / "run"
    steps = 30
    proc = up(
        run_dir,
        steps,
        f"run.liveness_timeout_s={LIVENESS_S}",
        "trainer.checkpoint_every=5",
        config=STUB,
    )
    try:
        logs = run_dir / "logs"
        _wait_for(
            "the trainer's third step",
            lambda: len(_events(logs / "trainer-0.log", "train_step")) >= 3,
        )
        pid = started_pids(run_dir)["trainer-0"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        hung = _wait_for(
            "the launcher to find the trainer hung",
            lambda: _events(logs / "launcher.log", "worker_hung"),
        )
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert [h["worker"] for h in hung] == ["trainer-0"]
    assert hung[0]["pid"] == pid and hung[0]["silent_s"] > LIVENESS_S
    detected_s = _iso_s(hung[0]["timestamp"]) - stopped
    print(f"stopped trainer found hung {detected_s:.1f} s after SIGSTOP (limit {LIVENESS_S} s)")
    # Its last beat was at most a beat interval (limit / 4) before the stop, and the
    # launcher looks once a second.
    assert detected_s <= LIVENESS_S + 1.0 + 2.0  # a bound on correctness, with slack for load
    s = summary_of(run_dir)
    assert s["worker_hangs"] == {"trainer-0": 1}
    assert s["worker_restarts"]["trainer-0"] == 1
    assert s["trainer_steps"] == steps
    assert not os.path.exists(f"/proc/{pid}")  # the stopped process is gone, not left stopped


def _iso_s(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(200)
def test_a_train_step_longer_than_the_limit_is_no_hang(tmp_path: Path) -> None:
    """Train steps (and their compile) are busy steps: a trainer whose every step outlasts
    `run.liveness_timeout_s` beats on and is never killed (a loop stuck that long would be
    within twice the limit: its beat stops one limit after its last tick)."""
    run_dir = tmp_path / "run"
    proc = up(
        run_dir,
        2,
        f"run.liveness_timeout_s={LIVENESS_S}",
        f"model.stub_train_step_s={2 * LIVENESS_S + 2}",
        config=STUB,
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 2
    assert s["worker_hangs"] == {}
    assert _events(run_dir / "logs" / "launcher.log", "worker_hung") == []
