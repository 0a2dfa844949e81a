"""The pure parts of streamrl.obs.metrics: windowed rates, percentiles, the sample's names."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.config import ConfigError, parse_config
from streamrl.obs import metrics as m
from streamrl.run.launcher import Launcher
from streamrl.tools.client import timed_out
from streamrl.tools.registry import process_report
from streamrl.tools.sandbox import ExecResult
from streamrl.wire import ToolResult


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_percentile_interpolates_between_ranks() -> None:
    # [1, 2, 3, 4]: p50 at rank 1.5 -> 2.5; p90 at rank 2.7 -> 3 + 0.7 = 3.7; p0 1, p100 4
    xs = [1.0, 2.0, 3.0, 4.0]
    assert m.percentile(xs, 50) == pytest.approx(2.5)
    assert m.percentile(xs, 90) == pytest.approx(3.7)
    assert m.percentile(xs, 0) == 1.0
    assert m.percentile(xs, 100) == 4.0
    assert m.percentile([7.0], 99) == 7.0
    assert math.isnan(m.percentile([], 50))


def test_rate_is_over_the_window_not_since_start() -> None:
    # 60 s window, per minute. 0..60 s: 600 events (10/s) -> 600/min; then 60 s with
    # none: the window holds only the idle minute -> 0/min, not 300/min since start.
    rate = m.Rate(60.0, t0=0.0)
    assert rate.update(30.0, 300.0) == pytest.approx(600.0)  # 300 in 30 s since start
    assert rate.update(60.0, 600.0) == pytest.approx(600.0)
    assert rate.update(90.0, 600.0) == pytest.approx(300.0)  # from t=30: 300 in 60 s
    assert rate.update(120.0, 600.0) == pytest.approx(0.0)  # from t=60: nothing since


def test_rate_per_second() -> None:
    rate = m.Rate(10.0, t0=0.0, per_s=1.0)
    assert rate.update(2.0, 50.0) == pytest.approx(25.0)


def test_window_drops_old_values() -> None:
    w = m.Window(10.0)
    w.add(0.0, 1.0)
    w.add(5.0, 2.0)
    w.add(9.0, 3.0)
    assert w.values(9.0) == [1.0, 2.0, 3.0]
    assert w.values(12.0) == [2.0, 3.0]  # t=0 is 12 s old
    assert w.values(30.0) == []


def test_sample_reports_the_contract_names() -> None:
    clock = Clock()
    metrics = m.Metrics("rollout-0", rate_window_s=60.0, clock=clock)
    metrics.count("trajectories", 30)
    metrics.count(m.TOKENS, 600)
    for latency in (0.1, 0.2, 0.3, 0.4):
        metrics.observe(m.TOOL_LATENCY_S, latency)
    for err in (1, 0, 0, 0):
        metrics.observe(m.TOOL_ERROR, err)
    for reward in (1.0, 0.0, 1.0, 0.5):
        metrics.observe(m.REWARD, reward)
        metrics.observe(m.SOLVED, float(reward >= m.SOLVED_REWARD))
    for age in (0, 1, 3):
        metrics.observe(m.POLICY_AGE, age)
    metrics.set(m.ACTIVE_EPISODES, 7)
    metrics.probe(lambda: {m.queue_depth("tasks"): 12.0})
    clock.t += 30  # 30 s after the process started
    s = metrics.sample()
    assert s[m.TRAJECTORIES_TOTAL] == 30
    assert s[m.TRAJECTORIES_PER_MIN] == pytest.approx(60.0)  # 30 in half a minute
    assert s[m.TOKENS_PER_S] == pytest.approx(20.0)  # 600 in 30 s
    assert "tokens_total" not in s
    assert s[m.TOOL_LATENCY_P50_S] == pytest.approx(0.25)
    assert s[m.TOOL_LATENCY_P90_S] == pytest.approx(0.37)
    assert s[m.TOOL_LATENCY_P99_S] == pytest.approx(0.397)
    assert s[m.TOOL_ERROR_RATE] == pytest.approx(0.25)
    assert s[m.REWARD_MEAN] == pytest.approx(0.625)
    assert s[m.SOLVE_RATE] == pytest.approx(0.5)
    assert s[m.POLICY_AGE] == pytest.approx(4 / 3)
    assert s[m.POLICY_AGE_MAX] == 3
    assert s[m.ACTIVE_EPISODES] == 7
    assert s["queue.tasks.depth"] == 12
    # A minute later with no events: rates and windows empty out, totals stay.
    clock.t += 61
    s = metrics.sample()
    assert s[m.TRAJECTORIES_TOTAL] == 30
    assert s[m.TRAJECTORIES_PER_MIN] == pytest.approx(0.0)
    assert m.TOOL_LATENCY_P50_S not in s and m.REWARD_MEAN not in s


def test_counters_of_other_names_get_a_total_and_a_rate() -> None:
    clock = Clock()
    metrics = m.Metrics("tools-0", clock=clock)
    metrics.count("jobs", 6)
    tokens = [0]
    metrics.count_from(m.TOKENS, lambda: tokens[0])
    clock.t += 60
    tokens[0] = 120
    s = metrics.sample()
    assert s["jobs_total"] == 6 and s["jobs_per_min"] == pytest.approx(6.0)
    assert s[m.TOKENS_PER_S] == pytest.approx(2.0)


def test_a_failing_probe_is_skipped() -> None:
    metrics = m.Metrics("grouper-0")

    def broken() -> dict[str, float]:
        raise OSError("gone")

    metrics.probe(broken)
    metrics.probe(lambda: {m.GROUPS_HALF_FILLED: 2.0})
    assert metrics.sample() == {m.GROUPS_HALF_FILLED: 2.0}


def test_memory_probe_reads_this_process() -> None:
    mem = m.memory_probe()
    assert 1 < mem[m.RSS_MB] <= mem[m.RSS_PEAK_MB]


def test_prometheus_names_and_ports() -> None:
    assert m.prometheus_name("queue.tasks.depth") == "streamrl_queue_tasks_depth"
    assert m.prometheus_port(9100, 3) == 9103
    assert m.prometheus_port(0, 3) == 0


def test_config_section() -> None:
    cfg = parse_config({"metrics": {"interval_s": 0.5, "prometheus_port": 9100}})
    assert cfg.metrics.interval_s == 0.5 and cfg.metrics.rate_window_s == 60.0
    with pytest.raises(ConfigError, match=r"metrics.rate_window_s \(0.5\) is shorter"):
        parse_config({"metrics": {"interval_s": 2, "rate_window_s": 0.5}})
    with pytest.raises(ConfigError, match=r"field `metrics\.keep_samples`"):
        parse_config({"metrics": {"keep_samples": 1}})


def test_up_gives_each_worker_its_own_port(tmp_path: Path) -> None:
    cfg = parse_config({"metrics": {"prometheus_port": 9100}, "tools": {"num_workers": 2}})
    launcher = Launcher(cfg, "c.toml", [], tmp_path, 0)
    ports = {f"{n}-{i}": launcher._port(n, i) for n, i in launcher._plan()}
    assert ports == {
        "tools-0": 9100,
        "tools-1": 9101,
        "grouper-0": 9102,
        "trainer-0": 9103,
        "rollout-0": 9104,
        "feeder-0": 9105,
    }
    off = Launcher(parse_config({}), "c.toml", [], tmp_path, 0)
    assert {off._port(n, i) for n, i in off._plan()} == {0}


def test_tool_timeouts_are_told_from_other_errors() -> None:
    def result(error: str, infra: bool = False) -> ToolResult:
        return ToolResult(call_id="c", ok=not error, output="", error=error, infra=infra)

    limit = process_report(
        ExecResult(None, b"", b"", timed_out=True, truncated=False, duration_s=2.0), 2.0
    )
    assert timed_out(result(limit.error))  # "timed out after 2s"
    assert timed_out(result("no tool worker answered within 3s, 2 attempts", infra=True))
    assert not timed_out(result("exit status: 1"))
    assert not timed_out(result(""))


def test_the_device_memory_probe_never_starts_jax_s_backends() -> None:
    """JAX imported but its backends not started (a multi-process trainer before its
    `jax.distributed.initialize`): the probe answers nothing and starts nothing; once the
    worker started them it may ask (CPU devices report no memory: still nothing)."""
    code = (
        "import jax\n"
        "from jax._src import xla_bridge\n"
        "from streamrl.obs.metrics import device_memory_probe\n"
        "assert device_memory_probe() == {}\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "jax.devices()\n"
        "assert xla_bridge.backends_are_initialized()\n"
        "assert device_memory_probe() == {}\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
