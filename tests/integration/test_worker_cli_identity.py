"""`streamrl worker NAME --index auto` and `streamrl health` as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis

from streamrl.names import Keys
from streamrl.run.identity import holder_of
from tests.helpers import REPO, TINY


def _cli(redis_url: str, *args: str, **kw: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "REDIS_URL": redis_url}
    cmd = [sys.executable, "-m", "streamrl_workers.cli", *args]
    return subprocess.Popen(cmd, env=env, cwd=REPO, **kw)  # type: ignore[call-overload]


def _health(redis_url: str, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": redis_url}
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "health", "--config", str(TINY),
           "--set", f"run.name={ns}", *args]  # fmt: skip
    return subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


def _wait(cond: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError("condition not met")


def test_auto_indices_heartbeats_and_health(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    assert _health(redis_url, keys.ns).returncode == 0  # Redis answers
    missing = _health(redis_url, keys.ns, "--worker", "grouper")
    assert missing.returncode == 1 and "no grouper worker of host" in missing.stdout
    procs = [
        _cli(
            redis_url,
            "worker",
            "grouper",
            "--config",
            str(TINY),
            "--set",
            f"run.name={keys.ns}",
            "--run-dir",
            str(tmp_path),
            "--index",
            "auto",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    try:
        _wait(lambda: None not in (holder_of(rclient, keys, "grouper", i) for i in (0, 1)))
        holders = {holder_of(rclient, keys, "grouper", i) for i in (0, 1)}
        assert {h.rsplit(":", 1)[1] for h in holders if h} == {str(p.pid) for p in procs}
        assert _health(redis_url, keys.ns, "--worker", "grouper").returncode == 0
        assert _health(redis_url, keys.ns, "--worker", "grouper", "--index", "1").returncode == 0
        assert _health(redis_url, keys.ns, "--worker", "grouper", "--index", "2").returncode == 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    # a clean exit gives the identity up at once
    assert [holder_of(rclient, keys, "grouper", i) for i in (0, 1)] == [None, None]
    assert _health(redis_url, keys.ns, "--worker", "grouper").returncode == 1


def test_health_fails_without_redis(tmp_path: Path) -> None:
    start = time.monotonic()
    r = _health("redis://127.0.0.1:1/0", "x")
    assert r.returncode == 1 and "Redis does not answer" in r.stdout
    assert time.monotonic() - start < 15  # a health check answers quickly, without retries


def test_a_second_trainer_is_refused(redis_url: str, rclient: redis.Redis, keys: Keys,
                                     tmp_path: Path) -> None:  # fmt: skip
    """Review N13: a second trainer of a run (`--scale trainer=2`, `--index auto`) used to
    claim index 1 and run as a second leader: rewinding the first one's consumer group,
    publishing and checkpointing beside it. It is refused, with the reason, and the first
    one goes on."""
    stub = REPO / "configs" / "stub.toml"

    def trainer(log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return _cli(
                redis_url, "worker", "trainer", "--config", str(stub), "--set",
                f"run.name={keys.ns}", "--run-dir", str(tmp_path), "--index", "auto",
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    first = trainer(tmp_path / "first.log")
    try:
        _wait(lambda: holder_of(rclient, keys, "trainer", 0) is not None)
        second = trainer(tmp_path / "second.log")
        assert second.wait(timeout=120) == 3  # fatal: not restarted by `streamrl up`
        out = (tmp_path / "second.log").read_text()
        assert "trainer process index 1 is outside 0..0" in out, out
        assert "another trainer of this run holds" in out
        assert first.poll() is None  # the first one runs on
        assert holder_of(rclient, keys, "trainer", 0) == f"{os.uname().nodename}:{first.pid}"
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_a_replica_whose_identity_was_taken_exits_non_zero(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Review N22: a replica whose identity another process took stopped with exit 0,
    which compose's `on-failure` restart policy does not restart: the replica was gone
    for good. It exits 4 now (and compose starts it again, to claim a free index)."""
    from streamrl.run import incarnation

    incarnation.create(rclient, keys)
    proc = _cli(
        redis_url, "worker", "grouper", "--config", str(TINY), "--set", f"run.name={keys.ns}",
        "--run-dir", str(tmp_path), "--index", "auto",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait(lambda: holder_of(rclient, keys, "grouper", 0) is not None)
        rclient.set(keys.worker_slot("grouper", 0), "elsewhere:1", px=60_000)  # taken
        assert proc.wait(timeout=60) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_sees_a_stuck_loop(rclient: redis.Redis, keys: Keys) -> None:
    """Review N9: the health check looked at the identity slot, which the heartbeat thread
    renews whatever the worker's loop does. A worker whose slot is held but whose liveness
    beat has lapsed (its loop stuck past 2 x run.liveness_timeout_s) is unhealthy."""
    from streamrl_workers.health import check

    rclient.set(keys.worker_slot("grouper", 3), "somehost:7", px=60_000)
    why = check(rclient, keys, "grouper", 3)
    assert why is not None and "its loop is stuck" in why
    rclient.set(keys.worker_beat("grouper", 3), "somehost:7 12", px=60_000)
    assert check(rclient, keys, "grouper", 3) is None


def test_a_stray_module_in_the_launch_directory_shadows_nothing(
    redis_url: str, tmp_path: Path
) -> None:
    """Review N19: workers run as `python -m streamrl_workers.cli`, so the launch directory
    came first on sys.path and a stray redis.py there replaced the real module in every
    worker. It comes last now; a plug-in package there is still importable."""
    (tmp_path / "redis.py").write_text("raise ImportError('the stray redis.py was imported')\n")
    (tmp_path / "myplugin.py").write_text("VALUE = 42\n")
    env = {**os.environ, "REDIS_URL": redis_url}
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "health", "--config", str(TINY)]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       check=False)  # fmt: skip
    assert r.returncode == 0 and "healthy" in r.stdout, r.stdout + r.stderr
    probe = "import streamrl_workers, myplugin, redis; print(myplugin.VALUE, redis.__file__)"
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    value, path = r.stdout.split()
    assert value == "42" and "site-packages" in path, r.stdout + r.stderr
