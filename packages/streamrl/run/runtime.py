"""What every worker process shares: its identity, config, Redis and a stop signal."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from urllib.parse import quote, urlsplit, urlunsplit

import redis
import structlog

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.obs.metrics import Metrics, Sampler, Sink, device_memory_probe, memory_probe
from streamrl.obs.tracing import Tracer, open_tracer
from streamrl.run import incarnation
from streamrl.run.acl import read_password_file
from streamrl.run.identity import HEARTBEAT_TTL_S, renew
from streamrl.run.liveness import Liveness
from streamrl.run.logs import LOG_DIR_ENV, LogFile, configure_logging
from streamrl.transport import RQ_NEEDS_ONE_REDIS, make_client

# A command of a client that never blocks fails after this long on a half-open socket.
NONBLOCKING_TIMEOUT_S = 10.0

# A file holding the password of REDIS_URL's user: how `streamrl up` hands each worker
# its own role's credentials, never on a command line (see `streamrl.run.acl`).
PASSWORD_FILE_ENV = "REDIS_PASSWORD_FILE"

WORKER_NAMES = ("feeder", "rollout", "tools", "grouper", "trainer", "colocated", "sinks")


class NoRedisError(RuntimeError):
    pass


def refuse_eviction(client: redis.Redis) -> None:
    """Raise NoRedisError unless every server behind `client` keeps keys when its memory
    is full (`maxmemory-policy noeviction`: writes then fail loudly). Any other policy may
    evict the emitted set, a group's members or the tool ledger without an error, which
    breaks exactly-once silently. Read from INFO (no CONFIG right needed)."""
    info = client.info("memory")
    # A cluster client answers per node.
    nodes = info.values() if "maxmemory_policy" not in info else [info]
    for node in nodes:
        policy = node.get("maxmemory_policy")
        if policy != "noeviction":
            raise NoRedisError(
                f"Redis's maxmemory-policy is {policy}: it may evict the run's keys (the "
                "emitted groups, the tool ledger) without an error; set maxmemory-policy "
                "noeviction (redis.conf, or CONFIG SET maxmemory-policy noeviction)"
            )


@dataclass
class WorkerContext:
    """Identity and shared handles of one worker process."""

    name: str
    index: int
    cfg: Config
    run_dir: Path
    redis_url: str
    log: structlog.stdlib.BoundLogger
    max_steps: int = 0
    burst: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    liveness: Liveness = field(default_factory=Liveness)  # what its loop says (heartbeat)
    # the holder id of its identity slot (`streamrl.run.identity`; "": none claimed)
    holder: str = ""
    # the run's id when this worker started in it (`streamrl.run.incarnation`; "": not yet)
    run_id: str = ""
    metrics: Metrics = field(init=False)  # its counters (streamrl.obs.metrics)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.worker_id, self.cfg.metrics.rate_window_s)
        self.metrics.probe(memory_probe)
        self.metrics.probe(device_memory_probe)  # nothing unless the worker imported JAX

    # its spans and counters (RUN_DIR/traces/<worker_id>.pftrace once `open_trace` ran)
    tracer: Tracer = field(default_factory=Tracer.disabled)

    @property
    def keys(self) -> Keys:
        return Keys(self.cfg.run.name)

    @property
    def worker_id(self) -> str:
        return f"{self.name}-{self.index}"

    @property
    def consumer(self) -> str:
        """Consumer name in stream groups: unique per process, so a restarted worker's
        old pending entries are claimed like any dead consumer's."""
        return f"{self.worker_id}-{os.getpid()}"

    def holds_identity(self, client: redis.Redis) -> bool:
        """Whether this process still holds its identity slot (True when it claimed none):
        false once another process has taken it (a new replica while this one was cut off
        from Redis), which is then the worker of that index. A slot that lapsed (this
        process paused past its TTL: SIGSTOP, a long GC) and that nobody took is taken back,
        as the heartbeat's next renewal would: nobody else is this worker. RunLostError when
        Redis no longer holds the run this worker recorded (`run_id`)."""
        if self.run_id:
            incarnation.check(client, self.keys, self.run_id)
        if not self.holder:
            return True
        return renew(client, self.keys, self.name, self.index, self.holder, HEARTBEAT_TTL_S)

    def client(self, socket_timeout: float | None = None) -> redis.Redis:
        """A client of the run's Redis. `socket_timeout`: for one that never blocks (the
        heartbeat's, the trainer's fence), so a half-open socket fails a command instead
        of hanging it (review N9); the worker's own clients block in stream reads."""
        r = self.cfg.redis
        return make_client(
            self.redis_url,
            cluster=r.cluster,
            busy_wait_s=r.busy_wait_s,
            socket_timeout=socket_timeout,
        )

    def start_metrics(self, sinks: Iterable[Sink] | None = None) -> Sampler:
        """Start the thread that samples `metrics` every `metrics.interval_s` into the
        worker's series in Redis, to `sinks`, and for the Prometheus endpoint (when
        `metrics.prometheus_port` is set); `close()` it on the way out."""
        m = self.cfg.metrics
        # A client of its own, with no retries: a sample that fails is dropped and the
        # next one tries again (the worker's own clients wait out outages instead).
        client = make_client(
            self.redis_url,
            retries=0,
            cluster=self.cfg.redis.cluster,
            busy_wait_s=0,
            socket_timeout=NONBLOCKING_TIMEOUT_S,
        )
        return Sampler(
            self.metrics,
            client,
            self.keys.worker_metrics(self.worker_id),
            self.log,
            interval_s=m.interval_s,
            keep_samples=m.keep_samples,
            prometheus_port=m.prometheus_port,
            prometheus_addr=m.prometheus_host,
            sinks=sinks,
        ).start()

    def open_trace(self) -> Tracer:
        """Open this worker's tracer (`trace.enabled`), its clock offset measured against
        the run's Redis: once its identity (`worker_id`) is settled; closed at its exit."""
        self.tracer = open_tracer(self.cfg.trace, self.run_dir, self.worker_id, self.client())
        if self.tracer.enabled:
            self.log.info(
                "trace_open", path=str(self.tracer.path), clock_offset_ns=self.tracer.offset_ns
            )
        return self.tracer


def with_password(url: str, password: str) -> str:
    """`url` carrying `password` (for its user; none named: the default user)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def resolve_redis_url(cfg: Config) -> str:
    """The Redis URL this process connects with, in memory only: REDIS_URL (else
    redis.url) with the password of REDIS_PASSWORD_FILE (else redis.password_file), if
    either names one; empty when no Redis is configured."""
    url = cfg.redis_url()
    path = os.environ.get(PASSWORD_FILE_ENV, "") or cfg.redis.password_file
    if not url or not path:
        return url
    try:
        return with_password(url, read_password_file(path))
    except (OSError, ValueError) as err:
        raise NoRedisError(f"cannot read the Redis password: {err}") from err


def make_context(
    name: str,
    index: int,
    cfg: Config,
    run_dir: str | Path,
    *,
    max_steps: int = 0,
    burst: bool = False,
) -> WorkerContext:
    url = resolve_redis_url(cfg)
    if not url:
        raise NoRedisError(
            "no Redis to connect to: set REDIS_URL or redis.url "
            "(`streamrl up` starts an embedded one)"
        )
    if cfg.redis.cluster and name == "tools":
        raise NoRedisError(RQ_NEEDS_ONE_REDIS)
    log_dir = os.environ.get(LOG_DIR_ENV)  # set by `streamrl up`; else stdout
    log = configure_logging(
        name,
        file=run_log(Path(log_dir), f"{name}-{index}", cfg) if log_dir else None,
        worker_id=f"{name}-{index}",
        pid=os.getpid(),
        run=cfg.run.name,
    )
    return WorkerContext(
        name=name,
        index=index,
        cfg=cfg,
        run_dir=Path(run_dir),
        redis_url=url,
        log=log,
        max_steps=max_steps,
        burst=burst,
    )


def run_log(log_dir: Path, name: str, cfg: Config) -> LogFile:
    """The rolling log file `<log_dir>/<name>.log` of a process of `streamrl up`."""
    return LogFile(log_dir / f"{name}.log", cfg.run.log_max_mb, cfg.run.log_backups)


def stop_on_signals(stop: threading.Event, log: structlog.stdlib.BoundLogger) -> None:
    """SIGTERM and SIGINT set `stop`: the worker finishes its current step and exits."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        log.info("stop_signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
