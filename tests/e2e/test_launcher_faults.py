"""The launcher's own faults, on `streamrl up` with the stub policy (configs/stub.toml):
a worker that stops beating is killed and restarted (`run.liveness_timeout_s`); a launcher
that was SIGKILLed leaves orphans that `--resume` stops first."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from streamrl import checkpoints as ckpts
from streamrl.run import failpoints, rundir
from tests.e2e.test_up import resume, started_pids, summary_of, up
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


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """`proc` (a `streamrl up`), killed and waited for if the block leaves it running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for_steps(logs: Path, n: int) -> None:
    _wait_for(f"trainer step {n}", lambda: len(_events(logs / "trainer-0.log", "train_step")) >= n)


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
        _wait_for_steps(logs, 3)
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
    # A restarted trainer trains the steps after its checkpoint again: the summary counts
    # each step's reward and groups once, as the state kept them (review code-86b402d, 4).
    trained = _events(logs / "trainer-0.log", "train_step")
    assert len(s["rewards_per_step"]) == steps
    last = {e["step"]: e for e in trained}  # each step as the state kept it
    assert s["rewards_per_step"] == [last[k]["reward_mean"] for k in sorted(last)]
    assert s["groups_trained"] == sum(e["num_groups"] for e in last.values())
    assert not os.path.exists(f"/proc/{pid}")  # the stopped process is gone, not left stopped


def _iso_s(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(200)
def test_a_train_step_longer_than_the_limit_is_no_hang(tmp_path: Path) -> None:
    """Train steps (and their compile) are busy steps: a trainer whose every step outlasts
    `run.liveness_timeout_s` beats on and is never killed (a loop stuck that long would be
    within twice the limit: its beat stops one limit after its last tick). Nor is a worker
    whose start-up outlasts the limit (imports on a busy host: it has not beaten yet, and
    `run.start_timeout_s` judges it), nor any worker of a host that froze for twice the
    limit (every process of the run stopped; the launcher wakes first): silence the
    launcher did not watch is not theirs."""
    run_dir = tmp_path / "run"
    points = tmp_path / "failpoints"
    points.mkdir()
    failpoints.arm(points, failpoints.WORKER_START, 2 * LIVENESS_S)  # one worker, once
    proc = up(
        run_dir,
        2,
        f"run.liveness_timeout_s={LIVENESS_S}",
        f"model.stub_train_step_s={2 * LIVENESS_S + 2}",
        config=STUB,
        env={failpoints.ENV: str(points)},
    )
    with reaped(proc):
        _wait_for_steps(run_dir / "logs", 1)
        workers = started_pids(run_dir).values()  # each leads a process group of its own
        os.kill(proc.pid, signal.SIGSTOP)
        for pid in workers:
            os.killpg(pid, signal.SIGSTOP)
        time.sleep(2 * LIVENESS_S)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.0)  # the launcher looks at beats the frozen workers could not write
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile as hung
                os.killpg(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 2
    assert s["worker_hangs"] == {}
    assert _events(run_dir / "logs" / "launcher.log", "worker_hung") == []
    assert not (points / failpoints.WORKER_START).exists()  # a worker paused at its start


@pytest.mark.timeout(400)
def test_a_resume_after_a_killed_launcher_stops_its_orphans_first(tmp_path: Path) -> None:
    """A second launcher on a run directory in use refuses. The launcher is SIGKILLed mid
    run: its workers and its embedded Redis run on (orphans); `--resume` stops them before
    it starts its own, and the run ends with every step."""
    run_dir = tmp_path / "run"
    # Train steps of 0.25 s: the run must outlast the second launcher's start and refusal
    # (seconds on loaded cores), or the trainer finishes and the launcher stops its workers
    # before it is killed, and there are no orphans to find.
    steps, sets = 40, ("trainer.checkpoint_every=5", "model.stub_train_step_s=0.25")
    proc = up(run_dir, steps, *sets, config=STUB)
    try:
        logs = run_dir / "logs"
        _wait_for("a checkpoint", lambda: _events(logs / "trainer-0.log", "checkpoint_written"))
        second = resume(run_dir, steps, *sets, config=STUB)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "in use by another `streamrl up`" in second.stderr
        assert f"pid {proc.pid}" in second.stderr
        workers = started_pids(run_dir)
        redis_pid = int((run_dir / "redis" / "redis.pid").read_text())
        proc.kill()  # SIGKILL: no shutdown of anything
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    started = {pid: rundir.start_time(pid) for pid in [*workers.values(), redis_pid]}
    try:
        time.sleep(1.0)
        orphans = [pid for pid in started if rundir.start_time(pid)]
        assert len(orphans) == len(workers) + 1, ("the orphans run on", orphans, workers)

        resumed = resume(run_dir, steps, *sets, config=STUB)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert "stopped what the last launcher left running" in resumed.stdout + resumed.stderr
        for pid in orphans:
            assert rundir.start_time(pid) is None, f"orphan {pid} still runs"
        s = summary_of(run_dir)
        assert s["resumed"] and s["trainer_steps"] == steps
        assert not set(s["worker_pids"].values()) & set(workers.values())
    finally:  # a failed check leaves none of the first launcher's processes running
        for pid, start in started.items():
            if start and rundir.start_time(pid) == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


@pytest.mark.timeout(300)
def test_the_trainer_gets_its_own_stop_timeout_for_its_final_checkpoint(tmp_path: Path) -> None:
    """Stopped mid run, the trainer writes a final checkpoint; one that takes longer than
    the other workers' 20 s (a failpoint pauses it 25 s before its commit) is waited for
    up to `run.trainer_stop_timeout_s`, not SIGKILLed at 20 s (review L5)."""
    run_dir, points = tmp_path / "run", tmp_path / "failpoints"
    points.mkdir()
    proc = up(
        run_dir,
        100_000,
        "trainer.checkpoint_every=1000000",  # the final checkpoint only
        "run.trainer_stop_timeout_s=120",
        env={failpoints.ENV: str(points)},
        config=STUB,
    )
    try:
        logs = run_dir / "logs"
        _wait_for_steps(logs, 3)
        failpoints.arm(points, failpoints.CHECKPOINT_COMMIT, 25.0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["worker_exit_codes"]["trainer-0"] == 0, s["worker_exit_codes"]
    assert _events(logs / "trainer-0.log", "failpoint")  # it did pause 25 s
    ck = ckpts.latest_complete(run_dir / "checkpoints")
    assert ck is not None and ck.step == s["trainer_steps"]


@pytest.mark.timeout(200)
def test_worker_logs_roll_over(tmp_path: Path) -> None:
    """Every worker writes its own JSON log under RUN_DIR/logs, rolling over at
    `run.log_max_mb` and keeping `run.log_backups` old ones (review M4, logs)."""
    run_dir = tmp_path / "run"
    host = os.environ.get("DOCKER_HOST") or "unix:///run/streamrl-podman.sock"
    # A tunable of the user's own: the workers keep it, with malloc's huge pages after it
    # (streamrl.run.malloc).
    mine = "glibc.malloc.arena_max=8"
    proc = up(run_dir, 30, "run.log_max_mb=0.02", "run.log_backups=2",
              env={"DOCKER_HOST": host, "GLIBC_TUNABLES": mine}, config=STUB)  # fmt: skip
    # Review N15: every worker inherited DOCKER_HOST, the container engine's socket (root
    # under the README's setup), plug-in code included; only the tool workers get it now.
    _wait_for_steps(run_dir / "logs", 1)
    engine, tunables = {}, {}
    for name, pid in rundir.orphans(run_dir).items():
        if name == rundir.REDIS:
            continue
        with contextlib.suppress(OSError):  # (one that ended since)
            # glibc parses GLIBC_TUNABLES in place: its ':' read back as NUL here
            raw = Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0glibc.", b":glibc.")
            environ = raw.split(b"\0")
            engine[name] = any(e.startswith(b"DOCKER_HOST=") for e in environ)
            tunables[name] = [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "trainer-0" in engine and any(n.startswith("tools-") for n in engine), engine
    assert {n for n, has in engine.items() if has} == {n for n in engine if n.startswith("tools-")}
    want = [f"GLIBC_TUNABLES={mine}:glibc.malloc.hugetlb=1".encode()]
    assert tunables and all(t == want for t in tunables.values()), tunables
    logs = run_dir / "logs"
    rolled = sorted(f.name for f in logs.glob("rollout-0.log*"))
    assert rolled == ["rollout-0.log", "rollout-0.log.1", "rollout-0.log.2"]
    for f in logs.glob("*.log*"):
        assert f.stat().st_size <= 0.02 * 2**20, f
        assert all(json.loads(x) for x in f.read_text().splitlines())  # whole JSON lines
    assert _events(logs / "rollout-0.log", "rollout_stop")  # the newest is the live one
    assert _events(logs / "launcher.log", "run_end")


@pytest.mark.timeout(200)
def test_a_redis_that_fails_for_good_still_leaves_a_summary(tmp_path: Path) -> None:
    """The embedded Redis dies and may not restart (`run.max_restarts = 0`): the run stops
    with exit code 1 and the documented summary.json, its counters the last the launcher
    read (review code-86b402d, 4: a traceback and no summary before)."""
    run_dir = tmp_path / "run"
    proc = up(run_dir, 100_000, "run.max_restarts=0", "run.trainer_stop_timeout_s=5", config=STUB)
    try:
        _wait_for_steps(run_dir / "logs", 2)
        time.sleep(11)  # a progress read (every 10 s) after the first steps
        os.kill(rundir.orphans(run_dir)[rundir.REDIS], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    s = summary_of(run_dir)
    assert s["redis_available"] is False
    assert s["trainer_steps"] >= 2, s  # from the last read before Redis died
    assert "exit_reason" in s and s["worker_exit_codes"], s
