"""`streamrl up` with the stub policy (configs/stub.toml): the whole pipeline at the speed
of Redis and the orchestration, every group accounted for."""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.names import Keys
from streamrl.obs.metrics import read_series
from streamrl.run.redis_server import url_from_conf
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
    assert_nothing_left(s, config=STUB)
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


@pytest.mark.timeout(180)
def test_a_run_of_generated_prompts_ends_when_its_epochs_do(tmp_path: Path) -> None:
    """Issue 29: `task.epochs = 1` with 110 generated prompts and no `--steps`: the feeder
    writes exactly 110 tasks, and the run ends by itself once every group is trained (4
    steps of 25, then a short one of 10), with its summary."""
    prompts = 110
    run_dir = tmp_path / "run"
    proc = up(
        run_dir,
        0,  # no step limit
        f"task.num_prompts={prompts}",
        "task.epochs=1",
        f'model.cache_dir="{tmp_path / "cache"}"',
        config=STUB,
    )
    out, _ = proc.communicate(timeout=170)
    assert proc.returncode == 0, out
    assert "the data's end" in out
    s = summary_of(run_dir)
    assert s["groups"] == s["groups_trained"] == prompts and s["trainer_steps"] == 5
    assert s["trajectories"] == 4 * prompts and s["groups_dropped"] == 0
    steps = _events(run_dir / "logs" / "trainer-0.log", "train_step")
    assert [e["num_groups"] for e in steps] == [PER_STEP] * 4 + [10]
    assert _events(run_dir / "logs" / "trainer-0.log", "data_drained")
    assert_nothing_left(s, config=STUB)


WORKERS = ("feeder-0", "rollout-0", "tools-0", "tools-1", "grouper-0", "trainer-0")
# Launch order of `streamrl up` (Launcher._plan): each worker's Prometheus port offset.
PORT_OFFSET = {"tools-0": 0, "tools-1": 1, "grouper-0": 2, "trainer-0": 3, "rollout-0": 4}


def _free_ports(n: int) -> int:
    """The first of `n` consecutive ports free now, below the kernel's ephemeral range: a
    port in that range may become the local port of any outgoing connection (a worker's
    Redis client) between this check and the worker's bind, which then fails for as long
    as that connection lives (seen: the trainer's Prometheus port, five restarts)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(50):
        base = random.randrange(max(1024, low - 12_000), low - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _status(run_dir: Path) -> str:
    cmd = [sys.executable, "-m", "streamrl_workers.cli", "status", str(run_dir), "--once"]
    out = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _rate(frame: str, worker: str, unit: str) -> float:
    m = re.search(rf"{worker}\s+│ live .*?([\d.]+) {unit}", frame)
    return float(m.group(1)) if m else 0.0


@pytest.mark.timeout(180)
def test_stub_up_counters_and_status(tmp_path: Path) -> None:
    """Every worker of a stub run keeps its counter series in Redis with plausible values
    and serves them to Prometheus; `streamrl status RUN_DIR --once` shows every worker live
    with its rate."""
    run_dir = tmp_path / "run"
    base = _free_ports(len(WORKERS))
    proc = up(
        run_dir,
        100_000,  # stopped below, once seen
        "metrics.interval_s=0.2",
        "metrics.rate_window_s=5",
        f"metrics.prometheus_port={base}",
        f'model.cache_dir="{tmp_path / "cache"}"',
        config=STUB,
    )
    try:
        deadline = time.monotonic() + 90
        frame = ""
        while time.monotonic() < deadline:
            frame = _status(run_dir) if (run_dir / "redis" / "redis.conf").exists() else ""
            rates = [
                _rate(frame, "rollout-0", "traj/min"),
                _rate(frame, "grouper-0", "groups/min"),
                _rate(frame, "trainer-0", "examples/min"),
            ]
            if all(re.search(rf"{w}\s+│ live", frame) for w in WORKERS) and min(rates) > 0:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"status never showed every worker live and busy:\n{frame}")
        assert re.search(r"groups/min\s+│\s+[1-9]", frame), frame
        assert re.search(r"policy version\s+│\s+[1-9]", frame), frame

        url = url_from_conf(run_dir / "redis")
        assert url is not None
        client = redis.Redis.from_url(url)
        keys = Keys("stub")
        last: dict[str, dict[str, float]] = {}
        for w in WORKERS:
            series = read_series(client, keys.worker_metrics(w))
            assert len(series) >= 2, w
            assert [t for t, _ in series] == sorted(t for t, _ in series)
            last[w] = series[-1][1]
            assert 10 < last[w]["rss_mb"] <= last[w]["rss_peak_mb"] < 4096, w
        client.close()
        r, g, t = last["rollout-0"], last["grouper-0"], last["trainer-0"]
        assert r["trajectories_total"] > 0 and r["trajectories_per_min"] > 0
        assert r["tokens_per_s"] > 0 and 0 <= r["engine_batch_occupancy"] <= 1
        assert 0 <= r["active_episodes"] <= 128 and r["policy_version"] >= 0
        assert 0 <= r["reward_mean"] <= 1 and 0 <= r["solve_rate"] <= 1
        assert 0 <= r["policy_age"] <= r["policy_age_max"] <= 16
        assert g["groups_total"] > 0 and g["groups_per_min"] > 0
        assert g["queue.trajectories.depth"] >= g["queue.trajectories.lag"] >= 0
        assert g["queue.groups.depth"] >= 0 and g["groups_half_filled"] >= 0
        assert t["examples_total"] > 0 and t["examples_per_min"] > 0
        assert t["policy_version"] >= 1 and t["policy_age"] >= 0
        f = last["feeder-0"]  # task.max_backlog = "auto": C + 2 C / G for the one worker
        assert f["rollout_slots"] == 128 and f["backlog_target"] == 128 + 2 * 32
        assert 0 <= f["queue.tasks.depth"] <= f["backlog_target"] + 1
        assert last["tools-0"]["queue.tools.depth"] == 0  # the synthetic task calls no tool
        assert not any(k.startswith("device_mem") for v in last.values() for k in v)  # CPU

        port = base + PORT_OFFSET["trainer-0"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        found = re.search(r'^streamrl_examples_total\{worker="trainer-0"\} (\S+)$', text, re.M)
        assert found and float(found.group(1)) > 0, text
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    assert summary_of(run_dir)["groups"] > 0, out
