"""`streamrl up` as a subprocess: the whole pipeline on real Redis, real processes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.config import load_config
from streamrl.names import Keys
from streamrl.run.acl import ROLES
from streamrl.run.launcher import plan
from tests.helpers import NO_EVALUATOR, REPO, TINY, committed_trajectories, live_in_group

pytestmark = pytest.mark.e2e


def up_command(config: Path, steps: int, *args: str, sets: tuple[str, ...] = ()) -> list[str]:
    """argv of `streamrl up --config CONFIG --steps STEPS ARGS...` with `--set` for each
    of `sets`, in this interpreter."""
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", str(config),
           "--steps", str(steps), *args]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    return cmd


def up(
    run_dir: Path,
    steps: int,
    *sets: str,
    env: dict[str, str] | None = None,
    config: Path = TINY,
) -> subprocess.Popen[str]:
    """`streamrl up` of a new run in `run_dir`, the evaluator off, started: its output
    (stdout and stderr) in the pipe that `communicate()` reads."""
    return subprocess.Popen(
        up_command(config, steps, "--run-dir", str(run_dir), sets=(NO_EVALUATOR, *sets)),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def resume(
    run_dir: Path,
    steps: int,
    *sets: str,
    config: Path = TINY,
    timeout_s: float = 240,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`streamrl up --resume RUN_DIR` to `steps`, with the overrides `sets` (and `env` over
    this environment), run to its end."""
    return subprocess.run(
        up_command(config, steps, "--resume", str(run_dir), sets=sets),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def summary_of(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def started_pids(run_dir: Path) -> dict[str, int]:
    """Worker id -> pid of the workers as the launcher first started them."""
    pids: dict[str, int] = next(
        json.loads(line)["pids"]
        for line in (run_dir / "logs" / "launcher.log").read_text().splitlines()
        if '"workers_started"' in line
    )
    return pids


def assert_nothing_left(summary: dict[str, Any], *sets: str, config: Path = TINY) -> None:
    """Every worker the run's config plans (`config` with the overrides `sets` that shape
    the plan) ran as a process of its own, and none left a process behind."""
    planned = {f"{name}-{i}" for name, i in plan(load_config(config, list(sets)))}
    assert set(summary["worker_pids"]) == planned
    pids = list(summary["worker_pids"].values())
    assert len(set(pids)) == len(pids)
    for pid in pids:
        assert live_in_group(pid) == [], f"processes left in the group of {pid}"


def test_up_runs_the_pipeline(tmp_path: Path, warm_cache: str) -> None:
    """The default job, with weights synced every step at max_concurrency 32. A tight
    backpressure bound keeps rollout from queueing more version-0 groups than the trainer
    uses, so later groups must come from published versions. The bound is soft by up to
    two waves (18 groups here: 8 running and one read ahead, then a second wave read in
    the moment between a wave's commit and the grouper's emission), so the run is 6 steps
    of 4 groups."""
    run_dir = tmp_path / "run"
    proc = up(
        run_dir,
        6,
        f'model.cache_dir="{warm_cache}"',
        "rollout.max_concurrency=32",
        "rollout.max_ready_groups=4",
        "trainer.publish_every=1",
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 6
    assert s["policy_version"] == 6
    assert s["max_trajectory_policy_version"] >= 1  # rollout served a published version
    assert s["tool_calls"] > 0
    assert s["dead_letters"] == 0
    assert s["groups"] >= 24 and s["trajectories"] >= 96
    assert s["mean_reward_first"] is not None and 0 <= s["mean_reward_last"] <= 1
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    assert_nothing_left(s)
    # One JSON log per worker, every line an event.
    for name in s["worker_pids"]:
        lines = (run_dir / "logs" / f"{name}.log").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        assert events and all(e["worker"] == name.split("-")[0] for e in events)
    # The embedded Redis is gone and no password of its ACL users reached a log (nor its
    # config: users.acl holds hashes); the run directory is the owner's alone.
    passwords = [p.read_text().strip() for p in (run_dir / "redis" / "secrets").iterdir()]
    assert len(passwords) == len(ROLES) and all(passwords)
    for f in [*(run_dir / "logs").iterdir(), run_dir / "redis" / "redis.conf"]:
        assert not any(pw in f.read_text() for pw in passwords), f
    assert run_dir.stat().st_mode & 0o077 == 0
    assert "trainer finished 6 steps" in out


def test_up_trains_lora_adapters_and_syncs_them_through_redis(
    tmp_path: Path, warm_cache: str
) -> None:
    """LoRA training on the frozen warm-started base; each version after the first carries
    only the adapters, through chunked Redis keys; rollout merges and serves them."""
    run_dir = tmp_path / "run"
    proc = up(
        run_dir, 3, f'model.cache_dir="{warm_cache}"', "trainer.lora_rank=4",
        "trainer.publish=lora", "trainer.weights_channel=redis", "trainer.learning_rate=1e-3",
        "rollout.max_ready_groups=4",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 3 and s["policy_version"] == 3
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    published = [
        json.loads(line)
        for line in (run_dir / "logs" / "trainer-0.log").read_text().splitlines()
        if line.startswith("{") and '"weights_published"' in line
    ]
    kinds = [e.get("kind") for e in published]
    assert kinds[0] == "full" and set(kinds[1:]) == {"lora"}, kinds
    assert max(e["nbytes"] for e in published[1:]) < published[0]["nbytes"] / 10
    rollout = (run_dir / "logs" / "rollout-0.log").read_text()
    assert '"weights_refused"' not in rollout or '"weights_refused": 0' in rollout
    # Rollout merged the adapters and served them. (Not "a trajectory of version >= 1":
    # in flight tasks may fill all 3 steps with version 0 before the first adapters load,
    # a race the trainer's first compile decides; a CI run on loaded cores lost it.)
    loaded = [
        json.loads(line)
        for line in rollout.splitlines()
        if line.startswith("{") and '"weights_loaded"' in line
    ]
    assert any(e["version"] >= 1 and e.get("kind") == "lora" for e in loaded), loaded
    assert_nothing_left(s)


def test_up_colocated_alternates_rollout_and_training(tmp_path: Path, warm_cache: str) -> None:
    """run.colocated: one process holds the engine and the trainer; the run completes its
    steps, rollout serves published versions, and the trainer paused the engine each step."""
    run_dir = tmp_path / "run"
    proc = up(run_dir, 3, f'model.cache_dir="{warm_cache}"', "run.colocated=true",
              "rollout.max_ready_groups=4")  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 3 and s["policy_version"] == 3
    assert s["max_trajectory_policy_version"] >= 1
    assert set(s["worker_pids"]) == {"tools-0", "tools-1", "grouper-0", "colocated-0", "feeder-0"}
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    stop = [
        json.loads(line)
        for line in (run_dir / "logs" / "colocated-0.log").read_text().splitlines()
        if line.startswith("{") and '"colocated_stop"' in line
    ]
    assert stop and stop[0]["training_phases"] == 3
    assert_nothing_left(s, "run.colocated=true")


def _sandbox_containers(namespace: str) -> int | None:
    """Containers labelled with this run's sandbox namespace (None: no engine here)."""
    if not os.environ.get("DOCKER_HOST"):
        return None
    import docker

    client = docker.from_env()
    try:
        found = client.containers.list(all=True, filters={"label": f"streamrl.sandbox={namespace}"})
        return len(found)
    finally:
        client.close()


@pytest.mark.timeout(600)  # its own warm start first: about 140 s alone, twice that in a busy suite
def test_up_runs_the_code_task_in_sandboxes(tmp_path: Path, warm_cache: str) -> None:
    """The code task: its own (short) warm start, then episodes whose reward comes from
    hidden tests run in the sandbox; containers when an engine answers (CI), and none is
    left behind."""
    if not os.environ.get("DOCKER_HOST") and shutil.which("bwrap") is None:
        # `auto` never runs the policy's code unisolated: with neither backend, every call
        # would be an infrastructure error and the breaker would stop the run.
        if os.environ.get("STREAMRL_REQUIRE_SANDBOX") == "1":
            pytest.fail("STREAMRL_REQUIRE_SANDBOX=1 but neither DOCKER_HOST nor bwrap is here")
        pytest.skip("no isolating sandbox here (DOCKER_HOST unset, no bwrap): make sandbox-host")
    run_dir = tmp_path / "run"
    # A run name of its own: the containers counted at the end are this run's only (a
    # second suite on the engine, running this test at the same time, has its own).
    name = f"e2ecode{uuid.uuid4().hex[:8]}"
    # 250 warm-start steps (the config's 400 are for learning): 46 tool calls in a run here,
    # where 120 made none. The test needs calls, not skill: 2 groups a step (the config's 4
    # are for learning) halve the episodes it plays.
    proc = up(run_dir, 3, f'model.cache_dir="{warm_cache}"', f"run.name={name}",
              "model.warmstart_steps=250", "trainer.groups_per_step=2",
              config=REPO / "configs" / "code.toml")  # fmt: skip
    out, _ = proc.communicate(timeout=540)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 3 and s["dead_letters"] == 0
    assert s["tool_calls"] > 0, s  # hidden tests (and python trials) ran in the sandbox
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    assert_nothing_left(s)
    backends = set()
    for i in range(2):
        for line in (run_dir / "logs" / f"tools-{i}.log").read_text().splitlines():
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "sandbox_backend":
                backends.add(event["kind"])
    if os.environ.get("STREAMRL_REQUIRE_SANDBOX") == "1":
        assert backends == {"container"}
    assert _sandbox_containers(name) in (0, None)
    trajectories = committed_trajectories(run_dir / "logs" / "rollout-0.log")
    assert any(t["status"] == "ok" for t in trajectories)


def test_bad_input_and_ctrl_c(
    tmp_path: Path, warm_cache: str, redis_url: str, rclient: redis.Redis, keys: Keys
) -> None:
    """External Redis (REDIS_URL); malformed entries go to the dead letters and every worker
    keeps running; Ctrl-C stops the run with exit 0 and nothing left behind."""
    run_dir = tmp_path / "run"
    proc = up(
        run_dir,
        1000,
        f'model.cache_dir="{warm_cache}"',
        f"run.name={keys.ns}",
        env={"REDIS_URL": redis_url},
    )
    deadline = time.monotonic() + 400
    while int(rclient.hget(keys.stats, "trainer_steps") or 0) < 1:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    rclient.xadd(keys.tasks, {"v": "1", "kind": "task", "data": b"\xc1 not msgpack"})
    rclient.xadd(keys.trajectories, {"v": "9", "kind": "trajectory", "data": b""})
    start_steps = int(rclient.hget(keys.stats, "trainer_steps") or 0)
    # The bad task waits behind the feeder's backlog; go on until both were dead-lettered
    # and training advanced past them.
    while (
        int(rclient.hget(keys.stats, "trainer_steps") or 0) < start_steps + 2
        or rclient.xlen(keys.dead) < 2
    ):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["exit_reason"] == "stopped by SIGINT"
    assert s["dead_letters"] == 2
    assert s["trainer_steps"] >= start_steps + 2  # training went on after the bad input
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    assert_nothing_left(s)


def test_crashed_workers_are_restarted_alone(
    tmp_path: Path, warm_cache: str, redis_url: str, rclient: redis.Redis, keys: Keys
) -> None:
    """SIGKILL the grouper and a tool worker mid-run: each is restarted alone (after its
    backoff), the run goes on to its steps, and the summary counts the restarts."""
    run_dir = tmp_path / "run"
    proc = up(run_dir, 4, f'model.cache_dir="{warm_cache}"', f"run.name={keys.ns}",
              "run.restart_backoff_s=0.5", env={"REDIS_URL": redis_url})  # fmt: skip
    deadline = time.monotonic() + 400
    while int(rclient.hget(keys.stats, "trainer_steps") or 0) < 1:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    started = started_pids(run_dir)
    for name in ("grouper-0", "tools-1"):
        os.killpg(started[name], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    s = summary_of(run_dir)
    assert s["trainer_steps"] == 4
    assert s["worker_restarts"]["grouper-0"] == 1 and s["worker_restarts"]["tools-1"] == 1
    assert s["worker_pids"]["grouper-0"] != started["grouper-0"]
    assert all(code == 0 for code in s["worker_exit_codes"].values()), s["worker_exit_codes"]
    assert_nothing_left(s)


def test_unknown_config_key_fails_fast(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("[trainer]", "[trainer]\nlerning_rate = 1.0"))
    start = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl_workers.cli",
            "up",
            "--config",
            str(bad),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert "unknown key `trainer.lerning_rate`" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing started
    assert time.monotonic() - start < 10


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "streamrl_workers.cli", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def test_a_config_that_drops_most_work_as_stale_starts_nothing(tmp_path: Path) -> None:
    """Issue 29's combination (C 64, G 4, B 4, K 2: 16 groups in flight, 4 steps while one
    runs) is refused by `up` and by a worker alone, with the arithmetic; `up --explain`
    prints the derived values and the same refusal; a fitting config explains with exit 0."""
    run_dir = tmp_path / "run"
    bad = ("--set", "rollout.max_concurrency=64")
    start = time.monotonic()
    r = _cli("up", "--config", str(TINY), "--run-dir", str(run_dir), "--steps", "1", *bad)
    assert r.returncode == 2, r.stderr
    assert "1 x 64 / 4 = 16 groups in flight" in r.stderr
    assert "trainer.groups_per_step >= 6" in r.stderr and "--explain" in r.stderr
    assert not run_dir.exists()  # nothing started
    w = _cli("worker", "feeder", "--config", str(TINY), "--run-dir", str(run_dir), *bad)
    assert w.returncode == 2 and "dropped as stale" in w.stderr, w.stderr
    assert time.monotonic() - start < 20
    explained = _cli("up", "--config", str(TINY), "--explain", *bad)
    assert explained.returncode == 2
    assert "policy lag, rollout the limit  4 versions" in explained.stdout
    assert "REFUSED: most groups would be dropped as stale" in explained.stdout
    ok = _cli("up", "--config", str(TINY), "--explain")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "groups in flight               4 (groups of 4)" in ok.stdout
    assert "fits:" in ok.stdout and not run_dir.exists()


def test_stalled_trainer_pauses_rollout(
    tmp_path: Path, warm_cache: str, redis_url: str, rclient: redis.Redis, keys: Keys
) -> None:
    """Backpressure: while the trainer is stopped (SIGSTOP), rollout pauses at its bound
    instead of filling the queues; the pause is counted; the run goes on when the trainer
    does."""
    run_dir = tmp_path / "run"
    bound = 3
    proc = up(run_dir, 3, f'model.cache_dir="{warm_cache}"', f"run.name={keys.ns}",
              f"rollout.max_ready_groups={bound}", "trainer.groups_per_step=2",
              env={"REDIS_URL": redis_url})  # fmt: skip

    def stat(name: str) -> int:
        return int(rclient.hget(keys.stats, name) or 0)

    try:
        deadline = time.monotonic() + 400
        while stat("trainer_steps") < 1:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        pid = started_pids(run_dir)["trainer-0"]
        os.kill(pid, signal.SIGSTOP)
        try:
            samples = []
            for _ in range(18):  # settled within 3 s in every run seen; the last 8 checked
                # What backpressure bounds: groups emitted and neither trained nor set aside
                # (stale ones the trainer read before it stopped are set aside, not trained).
                ready = stat("groups") - stat("groups_trained") - stat("groups_set_aside")
                samples.append((ready, stat("trajectories")))
                time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Tasks running when the pause began still finish (max_concurrency / group size);
        # and a task whose last member is done but whose group the grouper has not emitted
        # yet counts neither as running nor as ready, so as many may start in that gap.
        # The count rollout reads is the grouper's, published every 0.2 s: on loaded cores
        # one more wave can start on a stale one (a CI run saw 12 = 3 + 9 here). And the
        # trainer may have taken its next batch (groups_per_step, 2) before it stopped: those
        # left the lag backpressure reads but are not trained yet (a CI run saw 16; a fresh
        # clone's run on slow cores 18: 3 ready, then the 15 groups in flight or ended and
        # not emitted yet, the grouper behind). Without backpressure the feeder's backlog
        # (32 tasks) and more would be ready: the bound below still tells the two apart.
        r = load_config(TINY).rollout
        in_flight = r.max_concurrency // r.num_generations
        taken = 2  # trainer.groups_per_step above
        assert max(ready for ready, _ in samples) <= bound + taken + 4 * in_flight, samples
        assert len({traj for _, traj in samples[-8:]}) == 1, samples  # rollout stopped
        assert stat("backpressure_pauses") >= 1
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:  # a failed check: stop the run, leave no process behind
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    assert summary_of(run_dir)["trainer_steps"] == 3
