"""Counters of one worker process as time series: kept in Redis, sent to sinks (the trace),
exported in the Prometheus text format.

Each worker process has a `Metrics`: its own prometheus_client `CollectorRegistry` and the
raw material its loop records on the hot path, each a dict or deque update under a lock
(no I/O, no allocation beyond one tuple):

- `count(name, n)`: a counter of events (trajectories, groups, examples, tokens); its total
  and its rate over the sliding window `metrics.rate_window_s` (never since start: a
  resumed run's counters start again at zero, and a rate is the growth of a total between
  two samples of this process, so nothing before the window counts);
- `observe(name, value)`: a value per event (a tool call's latency, a reward, a policy
  age), kept for the window; reported as its mean, max or percentiles;
- `set(name, value)`: a level (active episodes, policy version);
- `count_from(name, fn)`: a counter whose total the worker keeps itself (read at a sample);
- `probe(fn)`: levels read when a sample is taken (queue depths from Redis, RSS).

A `Sampler` thread takes a sample every `metrics.interval_s`: the flat name -> value map
of every contract name that applies (see the names below). It (a) appends it to the
worker's bounded stream `Keys.worker_metrics(worker_id)` (XADD MAXLEN ~ keep_samples; one
field `values`, JSON), (b) calls each sink `sink(name, value, ts_ns)` (`Tracer.counter`
has that signature), (c) sets the registry's gauges, which `prometheus_client` serves on
`metrics.prometheus_port` when it is not 0. A Redis error in the sampler is logged and
the next sample tries again; a probe or sink that fails is logged and skipped: counters
never stop a worker. The worker's loop never waits for the sampler.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol
from wsgiref.simple_server import WSGIServer

import msgspec
import redis
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from streamrl.transport import xrange_entries, xrevrange_entries

# -- the contract's names (per worker process; each writes those that apply to it) --------
ACTIVE_EPISODES = "active_episodes"
ENGINE_BATCH_OCCUPANCY = "engine_batch_occupancy"  # 0..1: busy slots over all slots
TOKENS_PER_S = "tokens_per_s"
POLICY_VERSION = "policy_version"
POLICY_AGE = "policy_age"  # versions behind the trainer; mean over the window
POLICY_AGE_MAX = "policy_age_max"
TRAJECTORIES_TOTAL = "trajectories_total"
TRAJECTORIES_PER_MIN = "trajectories_per_min"
GROUPS_TOTAL = "groups_total"
GROUPS_PER_MIN = "groups_per_min"
EXAMPLES_TOTAL = "examples_total"
EXAMPLES_PER_MIN = "examples_per_min"
GROUPS_HALF_FILLED = "groups_half_filled"
OLDEST_HALF_FILLED_S = "oldest_half_filled_s"
TOOL_LATENCY_P50_S = "tool_latency_p50_s"
TOOL_LATENCY_P90_S = "tool_latency_p90_s"
TOOL_LATENCY_P99_S = "tool_latency_p99_s"
TOOL_ERROR_RATE = "tool_error_rate"
TOOL_TIMEOUT_RATE = "tool_timeout_rate"
RSS_MB = "rss_mb"
RSS_PEAK_MB = "rss_peak_mb"
DEVICE_MEM_MB = "device_mem_mb"
DEVICE_MEM_PEAK_MB = "device_mem_peak_mb"
REWARD_MEAN = "reward_mean"
SOLVE_RATE = "solve_rate"
BACKLOG_TARGET = "backlog_target"  # feeder: the tasks backlog it keeps (task.max_backlog)
ROLLOUT_SLOTS = "rollout_slots"  # feeder: the live rollout workers' slots
# feeder: versions behind a group reaches the trainer at the live capacity, and the lag past
# which most groups are dropped as stale (streamrl.fit, with the live rollout workers)
LIVE_POLICY_LAG = "live_policy_lag"
STALE_LAG_LIMIT = "stale_lag_limit"

# Raw series behind the names above (what the hot path records).
TRAJECTORIES = "trajectories"
GROUPS = "groups"
EXAMPLES = "examples"
TOKENS = "tokens"
TOOL_LATENCY_S = "tool_latency_s"
TOOL_ERROR = "tool_error"  # 1 per failed call, 0 per good one: the window's mean is a rate
TOOL_TIMEOUT = "tool_timeout"
REWARD = "reward"
SOLVED = "solved"  # 1 per trajectory of reward >= SOLVED_REWARD, else 0

SOLVED_REWARD = 1.0  # a trajectory with at least this reward solved its task

QUEUE_STREAMS = ("tasks", "trajectories", "groups", "tools")


def queue_depth(stream: str) -> str:
    """`queue.<stream>.depth`: entries the stream's reading stage has not finished
    (not yet delivered plus delivered and unacknowledged; rq: jobs queued)."""
    return f"queue.{stream}.depth"


def queue_lag(stream: str) -> str:
    """`queue.<stream>.lag`: entries not yet delivered to the reading stage."""
    return f"queue.{stream}.lag"


MB = 1024 * 1024
WINDOW_CAP = 50_000  # values kept per observed series at most (the window bounds it first)


class Sink(Protocol):
    def __call__(self, name: str, value: float, ts_ns: int) -> None: ...


# -- pure parts: windows, rates, percentiles -----------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending `sorted_values`, linear between the two
    nearest ranks (numpy's default): [1, 2, 3, 4] -> p50 = 2.5, p90 = 3.7. NaN if empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class Window:
    """Values observed over the last `span_s` seconds (at most `cap` of them)."""

    def __init__(self, span_s: float, cap: int = WINDOW_CAP) -> None:
        self.span_s = span_s
        self._items: deque[tuple[float, float]] = deque(maxlen=cap)

    def add(self, t: float, value: float) -> None:
        self._items.append((t, value))

    def values(self, now: float) -> list[float]:
        """The values of (now - span_s, now], dropping older ones."""
        start = now - self.span_s
        while self._items and self._items[0][0] <= start:
            self._items.popleft()
        return [v for _, v in self._items]


class Rate:
    """A counter's growth per `per_s` seconds over the last `span_s` seconds, from the
    totals sampled at given times. Starts with (t0, 0): a process's counters start at
    zero, so before a window has passed the rate is over the time since its start."""

    def __init__(self, span_s: float, t0: float, per_s: float = 60.0) -> None:
        self.span_s = span_s
        self.per_s = per_s
        self._points: deque[tuple[float, float]] = deque([(t0, 0.0)])

    def update(self, now: float, total: float) -> float:
        """Record `total` at `now`; the rate between the oldest point still inside the
        window (or the last one before it) and now."""
        self._points.append((now, total))
        # Keep one point at or before the window's start: the rate then spans the window.
        while len(self._points) > 2 and self._points[1][0] <= now - self.span_s:
            self._points.popleft()
        t, v = self._points[0]
        if now - t <= 0:
            return 0.0
        return (total - v) / (now - t) * self.per_s


Stat = Callable[[list[float]], float]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def maximum(values: list[float]) -> float:
    return max(values) if values else math.nan


def pct(q: float) -> Stat:
    def stat(values: list[float]) -> float:
        return percentile(sorted(values), q)

    return stat


@dataclass(frozen=True)
class _RateSpec:
    total: str | None  # name of the total (None: only the rate is reported)
    rate: str
    per_s: float


# What each raw series is reported as (the contract's names). A series not listed here
# is reported under its own name (count: its total; observe: its window mean).
COUNTED: dict[str, _RateSpec] = {
    TRAJECTORIES: _RateSpec(TRAJECTORIES_TOTAL, TRAJECTORIES_PER_MIN, 60.0),
    GROUPS: _RateSpec(GROUPS_TOTAL, GROUPS_PER_MIN, 60.0),
    EXAMPLES: _RateSpec(EXAMPLES_TOTAL, EXAMPLES_PER_MIN, 60.0),
    TOKENS: _RateSpec(None, TOKENS_PER_S, 1.0),
}
OBSERVED: dict[str, dict[str, Stat]] = {
    TOOL_LATENCY_S: {
        TOOL_LATENCY_P50_S: pct(50),
        TOOL_LATENCY_P90_S: pct(90),
        TOOL_LATENCY_P99_S: pct(99),
    },
    TOOL_ERROR: {TOOL_ERROR_RATE: mean},
    TOOL_TIMEOUT: {TOOL_TIMEOUT_RATE: mean},
    REWARD: {REWARD_MEAN: mean},
    SOLVED: {SOLVE_RATE: mean},
    POLICY_AGE: {POLICY_AGE: mean, POLICY_AGE_MAX: maximum},
}


def prometheus_name(name: str) -> str:
    """`queue.tasks.depth` -> `streamrl_queue_tasks_depth` (Prometheus allows [a-zA-Z0-9_:])."""
    return "streamrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


# -- one process's metrics -----------------------------------------------------------------


class Metrics:
    """The counters of one worker process (see the module docstring). Thread-safe: the
    worker's threads and event loop record, the sampler thread reads."""

    def __init__(
        self,
        worker_id: str,
        rate_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.rate_window_s = rate_window_s
        self.clock = clock
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._t0 = clock()
        self._totals: dict[str, float] = {}
        self._rates: dict[str, Rate] = {}
        self._windows: dict[str, Window] = {}
        self._levels: dict[str, float] = {}
        self._probes: list[Callable[[], Mapping[str, float]]] = []
        self._sources: dict[str, Callable[[], float]] = {}
        self._gauges: dict[str, Gauge] = {}
        self._counters: dict[str, Counter] = {}

    # hot path ---------------------------------------------------------------------------
    def count(self, name: str, n: float = 1.0) -> None:
        with self._lock:
            self._totals[name] = self._totals.get(name, 0.0) + n
            counter = self._counters.get(name)
            if counter is None:
                counter = self._counters[name] = self._new_counter(name)
        counter.inc(n)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            window = self._windows.get(name)
            if window is None:
                window = self._windows[name] = Window(self.rate_window_s)
            window.add(self.clock(), value)

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._levels[name] = float(value)

    def count_from(self, name: str, total: Callable[[], float]) -> None:
        """A counter whose running total the worker keeps itself (an engine's tokens):
        `total()` is read at each sample, on the sampler thread."""
        self._sources[name] = total

    def probe(self, fn: Callable[[], Mapping[str, float]]) -> None:
        """Call `fn` at each sample (on the sampler thread) for levels to report."""
        self._probes.append(fn)

    # sampler side -----------------------------------------------------------------------
    def sample(self, log: structlog.stdlib.BoundLogger | None = None) -> dict[str, float]:
        """Every value now, by contract name (NaN-free: a window with no values is left
        out). Probes run here, outside the lock; one that fails is logged and skipped."""
        probed: dict[str, float] = {}
        for fn in list(self._probes):  # a copy: the worker may add one meanwhile
            try:
                probed.update(fn())
            except Exception as err:
                if log is not None:
                    log.warning("metrics_probe_failed", error=f"{type(err).__name__}: {err}")
        sourced = {name: float(total()) for name, total in list(self._sources.items())}
        now = self.clock()
        out: dict[str, float] = {}
        with self._lock:
            for name, total in sourced.items():
                self._totals[name] = total
            for name, total in self._totals.items():
                spec = COUNTED.get(name, _RateSpec(f"{name}_total", f"{name}_per_min", 60.0))
                rate = self._rates.get(name)
                if rate is None:
                    rate = self._rates[name] = Rate(self.rate_window_s, self._t0, spec.per_s)
                if spec.total is not None:
                    out[spec.total] = total
                out[spec.rate] = rate.update(now, total)
            windows = {name: w.values(now) for name, w in self._windows.items()}
            out.update(self._levels)
        for name, values in windows.items():
            for stat_name, stat in OBSERVED.get(name, {name: mean}).items():
                if values:
                    out[stat_name] = stat(values)
        out.update(probed)
        self._export(out)
        return out

    def _new_counter(self, name: str) -> Counter:
        # A Prometheus counter of the raw series (`_total` is added by the library).
        return Counter(
            prometheus_name(name),
            f"{name} counted by this worker",
            ["worker"],
            registry=self.registry,
        ).labels(self.worker_id)

    def _export(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            if name.endswith("_total") and name[: -len("_total")] in self._counters:
                continue  # exported by its counter
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = self._gauges[name] = Gauge(
                    prometheus_name(name), name, ["worker"], registry=self.registry
                ).labels(self.worker_id)
            gauge.set(value)


# -- probes every worker gets --------------------------------------------------------------


def memory_probe() -> dict[str, float]:
    """This process's resident memory and its high-water mark (/proc/self/status), MiB."""
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out[RSS_MB] = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                out[RSS_PEAK_MB] = int(line.split()[1]) / 1024
    return out


def device_memory_probe() -> dict[str, float]:
    """Device memory in use and its peak, MiB, summed over local devices: only where JAX is
    already imported (never imported here: the light workers must not load it) and its
    devices answer (`memory_stats()` is None on CPU), and only once the worker itself has
    started JAX's backends: asking for devices first would start them here, on the sampler's
    thread, before a multi-process trainer's `jax.distributed.initialize` (a CI run's
    trainer process died of it: "Unable to initialize backend 'cpu'")."""
    jax: ModuleType | None = sys.modules.get("jax")
    bridge: ModuleType | None = sys.modules.get("jax._src.xla_bridge")
    if jax is None or bridge is None or not bridge.backends_are_initialized():
        return {}
    used = peak = 0
    answered = False
    for device in jax.local_devices():
        stats = device.memory_stats()
        if not stats:
            continue
        answered = True
        used += int(stats.get("bytes_in_use", 0))
        peak += int(stats.get("peak_bytes_in_use", 0))
    if not answered:
        return {}
    return {DEVICE_MEM_MB: used / MB, DEVICE_MEM_PEAK_MB: peak / MB}


# -- the sampler ---------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
VALUES_FIELD = "values"


def encode_sample(values: Mapping[str, float]) -> bytes:
    return _encoder.encode(values)


def decode_sample(fields: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """The values of one entry of a worker's metrics stream."""
    raw = fields.get(VALUES_FIELD.encode(), fields.get(VALUES_FIELD))
    if raw is None:
        return {}
    data = msgspec.json.decode(raw)
    return {str(k): float(v) for k, v in data.items()}


class Sampler:
    """Takes a sample of `metrics` every `interval_s` on a daemon thread: into the stream
    `key` (bounded at ~`keep_samples`), to each sink, and into the registry that the
    Prometheus endpoint (`prometheus_port`, 0: none) serves."""

    def __init__(
        self,
        metrics: Metrics,
        client: redis.Redis,
        key: str,
        log: structlog.stdlib.BoundLogger,
        *,
        interval_s: float,
        keep_samples: int,
        prometheus_port: int = 0,
        prometheus_addr: str = "127.0.0.1",
        sinks: Iterable[Sink] | None = None,
    ) -> None:
        self.metrics = metrics
        self.client = client
        self.key = key
        self.log = log
        self.interval_s = interval_s
        self.keep_samples = keep_samples
        self.prometheus_port = prometheus_port
        self.prometheus_addr = prometheus_addr
        self.sinks = list(sinks or ())
        self.samples = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._server: WSGIServer | None = None

    def start(self) -> Sampler:
        if self.prometheus_port:
            try:
                self._server, _ = start_http_server(
                    self.prometheus_port, addr=self.prometheus_addr, registry=self.metrics.registry
                )
                self.log.info("prometheus_serving", port=self.prometheus_port)
            except OSError as err:  # a port in use: no endpoint, not a crash loop (N20)
                self.log.error(
                    "prometheus_unavailable", port=self.prometheus_port,
                    addr=self.prometheus_addr, error=str(err),
                )  # fmt: skip
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (after a last sample, so the series ends with the final
        totals), and the endpoint."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def sample_once(self) -> dict[str, float]:
        """One sample: to Redis, to the sinks. A Redis error propagates (the thread logs
        it); a failing sink is logged and skipped."""
        values = self.metrics.sample(self.log)
        ts_ns = time.time_ns()
        for sink in self.sinks:
            for name, value in values.items():
                try:
                    sink(name, value, ts_ns)
                except Exception as err:
                    self.log.warning(
                        "metrics_sink_failed", name=name, error=f"{type(err).__name__}: {err}"
                    )
                    break
        self.client.xadd(
            self.key,
            {VALUES_FIELD: encode_sample(values)},
            maxlen=self.keep_samples,
            approximate=True,
        )
        self.samples += 1
        return values

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.interval_s)
            try:
                self.sample_once()
            except redis.RedisError as err:
                self.failures += 1
                self.log.warning("metrics_sample_failed", error=f"{type(err).__name__}: {err}")
            except Exception:
                # Counters never stop a worker: a defect here shows in the log, every sample.
                self.failures += 1
                self.log.exception("metrics_sample_failed")
            if stopping:
                return


def prometheus_port(base: int, offset: int) -> int:
    """The port of a worker of `streamrl up`: `metrics.prometheus_port` plus the worker's
    place in the launch order (0, 1, 2, ...); 0 (off) stays 0."""
    return base + offset if base else 0


def newest_sample(client: redis.Redis, key: str) -> dict[str, float]:
    """The values of a worker's newest sample ({} when it has none)."""
    series = read_series(client, key, count=1)
    return series[-1][1] if series else {}


def read_series(
    client: redis.Redis, key: str, count: int | None = None
) -> list[tuple[float, dict[str, float]]]:
    """(unix seconds, values) of a worker's samples, oldest first (the last `count`)."""
    raw = (
        xrevrange_entries(client, key, count=count)[::-1] if count else xrange_entries(client, key)
    )
    out = []
    for eid, fields in raw:
        with contextlib.suppress(msgspec.DecodeError, ValueError):
            out.append((int(eid.split("-")[0]) / 1000, decode_sample(fields)))
    return out
