"""streamrl.obs.metrics against a real Redis and a real HTTP scrape: the sampler's series stays
bounded, the Prometheus endpoint serves the values, a Redis outage is not fatal."""

from __future__ import annotations

import threading
import urllib.request

import pytest
import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from streamrl.names import Keys
from streamrl.obs import metrics as m
from streamrl.run.redis_server import free_port

LOG = structlog.get_logger()


def _sampler(client: redis.Redis, keys: Keys, metrics: m.Metrics, **kw: object) -> m.Sampler:
    args: dict[str, object] = {"interval_s": 0.05, "keep_samples": 10, **kw}
    return m.Sampler(
        metrics,
        client,
        keys.worker_metrics(metrics.worker_id),
        LOG,
        **args,  # type: ignore[arg-type]
    )


def test_series_is_bounded_and_holds_the_values(rclient: redis.Redis, keys: Keys) -> None:
    metrics = m.Metrics("grouper-0")
    seen: list[tuple[str, float, int]] = []
    sampler = _sampler(rclient, keys, metrics, sinks=[lambda n, v, t: seen.append((n, v, t))])
    for i in range(300):
        metrics.count("groups")
        metrics.set(m.GROUPS_HALF_FILLED, i % 3)
        sampler.sample_once()
    key = keys.worker_metrics("grouper-0")
    # MAXLEN ~ trims whole macro nodes (100 entries on this server): bounded, not exact.
    assert 10 <= rclient.xlen(key) <= 10 + 100
    series = m.read_series(rclient, key)
    last = series[-1][1]
    assert last[m.GROUPS_TOTAL] == 300 and last[m.GROUPS_HALF_FILLED] == 299 % 3
    assert last[m.GROUPS_PER_MIN] > 0
    assert [t for t, _ in series] == sorted(t for t, _ in series)
    # Every value of every sample went to the sink, with one timestamp per sample.
    assert len(seen) == 300 * len(last)
    assert {n for n, _, _ in seen} == set(last)


def test_thread_samples_until_closed(rclient: redis.Redis, keys: Keys) -> None:
    metrics = m.Metrics("feeder-0")
    metrics.probe(lambda: {m.queue_depth("tasks"): 5.0})
    sampler = _sampler(rclient, keys, metrics).start()
    done = threading.Event()
    while sampler.samples < 3 and not done.wait(0.02):
        pass
    sampler.close()
    n = rclient.xlen(keys.worker_metrics("feeder-0"))
    assert n >= 4  # three on the timer, one at close
    last = m.read_series(rclient, keys.worker_metrics("feeder-0"), count=1)[0][1]
    assert last["queue.tasks.depth"] == 5.0


def test_prometheus_endpoint_serves_the_values(rclient: redis.Redis, keys: Keys) -> None:
    port = free_port()
    metrics = m.Metrics("rollout-3")
    metrics.count("trajectories", 12)
    metrics.set(m.ACTIVE_EPISODES, 7)
    metrics.observe(m.TOOL_LATENCY_S, 0.25)
    metrics.probe(lambda: {m.queue_depth("tools"): 4.0})
    sampler = _sampler(rclient, keys, metrics, interval_s=60, prometheus_port=port)
    sampler.start()
    try:
        sampler.sample_once()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        sampler.close()
    assert 'streamrl_trajectories_total{worker="rollout-3"} 12.0' in text
    assert 'streamrl_active_episodes{worker="rollout-3"} 7.0' in text
    assert 'streamrl_tool_latency_p50_s{worker="rollout-3"} 0.25' in text
    assert 'streamrl_queue_tools_depth{worker="rollout-3"} 4.0' in text
    assert "# TYPE streamrl_trajectories_total counter" in text
    assert "streamrl_trajectories_per_min" in text


def test_redis_errors_are_retried_not_fatal(keys: Keys) -> None:
    """A Redis that does not answer: each sample fails, is counted and logged; the thread
    keeps going and close() still returns."""
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.05, retry=Retry(NoBackoff(), 0))
    metrics = m.Metrics("tools-0")
    sampler = _sampler(dead, keys, metrics).start()
    stop = threading.Event()
    while sampler.failures < 2 and not stop.wait(0.02):
        pass
    sampler.close()
    assert sampler.failures >= 2 and sampler.samples == 0
    with pytest.raises(redis.ConnectionError):
        sampler.sample_once()


def test_the_endpoint_binds_loopback_and_a_taken_port_is_no_crash(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Review N20: the endpoint bound every interface by default (now loopback unless
    `metrics.prometheus_host` says otherwise: compose's scrapers are on the network), and a
    port in use raised out of the worker's start, a crash loop on the same port. Now the
    worker logs it and runs on without the endpoint."""
    import socket

    from streamrl.config import parse_config

    assert parse_config({}).metrics.prometheus_host == "127.0.0.1"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        metrics = m.Metrics("rollout-0")
        sampler = _sampler(rclient, keys, metrics, interval_s=60, prometheus_port=port)
        with structlog.testing.capture_logs() as logs:
            sampler.start()  # raised OSError (EADDRINUSE)
        try:
            sampler.sample_once()  # the series still goes to Redis
        finally:
            sampler.close()
    [said] = [e for e in logs if e["event"] == "prometheus_unavailable"]
    assert said["port"] == port and "in use" in said["error"].lower()
    assert rclient.xlen(keys.worker_metrics("rollout-0")) >= 1
