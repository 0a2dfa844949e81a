"""`streamrl up`: start Redis and every worker as its own process, show progress, stop.

The run ends after the trainer's `--steps` (the trainer exits 0 when it has written its
final checkpoint), on Ctrl-C or SIGTERM (exit code 0; the trainer gets
`run.trainer_stop_timeout_s` for its final checkpoint before SIGKILL, the others 20 s), or
with exit code 1 naming the worker and its log when a worker fails for good: a worker that
crashes is restarted alone after a backoff (1 s, doubling), up to `run.max_restarts` times
within `run.restart_window_s` (a restarted trainer resumes from its newest complete
checkpoint); a worker whose liveness beat stops for `run.liveness_timeout_s`
(`streamrl.run.liveness`) is SIGKILLed and restarted the same way; a worker that exits with a
fatal error (exit code 3: a tripped circuit breaker, `trainer.max_nonfinite_steps`
non-finite steps in a row) is not restarted. The embedded Redis is restarted from its AOF
when it dies; the workers ride out the gap (`streamrl.transport.make_client`). Every worker
runs in its own session, so stopping one kills its whole process group (tool subprocesses
included) and nothing is left behind.

The launcher holds a lock on the run directory and records the processes it starts
(`streamrl.run.rundir`). `streamrl up --resume RUN_DIR` continues a stopped or crashed run:
it first stops what a launcher that died left running, then the embedded Redis comes back
from the run directory's AOF; if Redis holds none of the run's data (an external one that
was flushed, a lost AOF), the queues are restored from the newest complete checkpoint's
snapshot. The policy floor is raised above every version published before, so the rollout
workers wait for the trainer's restored policy before any episode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import redis
import structlog

from streamrl import checkpoints as ckpts
from streamrl.config import Config
from streamrl.errors import FATAL_EXIT_CODE
from streamrl.evaluation import watch as evalrun
from streamrl.names import Keys, RunPaths
from streamrl.obs.metrics import GROUPS_PER_MIN, newest_sample, prometheus_port
from streamrl.run import incarnation, rundir
from streamrl.run.acl import private_dir, worker_role
from streamrl.run.identity import default_holder
from streamrl.run.liveness import BeatClock
from streamrl.run.logs import LOG_DIR_ENV, cap_file, configure_logging, redact_url
from streamrl.run.malloc import with_hugetlb
from streamrl.run.redis_server import EmbeddedRedis, free_port
from streamrl.run.runtime import (
    PASSWORD_FILE_ENV,
    NoRedisError,
    refuse_eviction,
    resolve_redis_url,
    run_log,
)
from streamrl.run.summary import (
    SUMMARY_SHOWN,
    ProcRecord,
    progress_line,
    read_stats,
    step_metrics,
    summarize,
)
from streamrl.run.supervise import (
    Popen,
    Supervised,
    kill,
    restart_decision,
    terminate,
)
from streamrl.trainer import COORDINATOR_ENV
from streamrl.transport import make_client, mget_bytes, waits_out, xrevrange_entries
from streamrl.weightsync import published_state_of
from streamrl.wire import TrainMetrics, WireError, decode

STOP_TIMEOUT_S = 20.0


class RunDirError(RuntimeError):
    pass


@dataclass(kw_only=True)
class WorkerProc(Supervised):
    """A worker `name-index` the launcher runs (`Supervised`: restarts and hangs), its log
    and the file its output goes to, and its liveness beat as last read."""

    name: str
    index: int
    popen: Popen
    log_path: Path
    stderr_path: Path
    beat: str | None = None  # its liveness beat as last read
    beat_at: float = field(default_factory=time.monotonic)  # when it last changed (or spawn)
    gave_up: bool = False  # an optional worker (SINKS) past its restarts: left stopped

    @property
    def worker_id(self) -> str:
        return f"{self.name}-{self.index}"

    def record(self) -> ProcRecord:
        """What the summary says of it."""
        p = self.popen
        return ProcRecord(self.worker_id, p.pid, p.returncode, len(self.restarts), self.hangs)


@dataclass(kw_only=True)
class EvalProc(Supervised):
    """The run's evaluator (`streamrl eval --watch`, trainer.eval_every): its own process
    and session, outside the Redis workers (it shares only the run directory). Restarted
    when it exits before the run drains it, up to run.max_restarts in run.restart_window_s;
    after that the run goes on without it."""

    cmd: list[str]
    env: dict[str, str]
    err_path: Path
    gave_up: bool = False

    def start(self) -> EvalProc:
        self.popen = _start_session(self.cmd, self.env, self.err_path)
        return self

    def check(self, cfg: Config, log: structlog.stdlib.BoundLogger) -> None:
        """Restart it (after a backoff) when it exited; give up past the restart limit."""
        if self.popen is None or self.gave_up:
            return
        now = time.monotonic()
        if self.restart_at is not None:
            if self.restart_due(now):
                self.restarted(_start_session(self.cmd, self.env, self.err_path), now)
                log.info("evaluator_restarted", pid=self.popen.pid, n=len(self.restarts))
            return
        rc = self.popen.poll()
        if rc is None:
            return
        delay = self.schedule_restart(now, cfg.run)
        if delay is None:
            self.gave_up = True
            log.error("evaluator_failed", exit_code=rc, stderr=str(self.err_path))
            return
        log.warning("evaluator_exited", exit_code=rc, restart_in_s=delay)

    def drain(self, cfg: Config, root: Path, stopping: Callable[[], bool], log: Any) -> bool:
        """Ask it to evaluate what is pending and exit; wait up to trainer.eval_timeout_s
        (or until `stopping()`), restarting it as `check` does. Whether it finished."""
        evalrun.request_drain(root)
        deadline = time.monotonic() + cfg.trainer.eval_timeout_s
        while self.popen is not None and not self.gave_up and not stopping():
            if self.restart_at is None and self.popen.poll() == 0:
                return True
            if time.monotonic() >= deadline:
                log.warning("evaluator_drain_timeout", after_s=cfg.trainer.eval_timeout_s)
                return False
            self.check(cfg, log)
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.popen is not None:
            terminate([(self.popen, STOP_TIMEOUT_S)])


class Launcher:
    def __init__(
        self,
        cfg: Config,
        config_path: str,
        overrides: list[str],
        run_dir: Path,
        steps: int,
        out: TextIO | None = None,
        resume: bool = False,
    ) -> None:
        self.cfg = cfg
        self.config_path = str(Path(config_path).resolve())
        self.overrides = overrides
        self.run_dir = run_dir.resolve()
        self.paths = RunPaths(self.run_dir)
        self.steps = steps or cfg.trainer.max_steps
        self.keys = Keys(cfg.run.name)
        self.out = out or sys.stderr
        self.resume = resume
        self.redis_restarts: list[float] = []
        self.procs: list[WorkerProc] = []
        self.evaluator: EvalProc | None = None
        self._env: dict[str, str] = {}
        self.redis: EmbeddedRedis | None = None
        self._stop_signal: str | None = None
        self._stopped = False
        self.started = time.monotonic()
        self._next_watch = 0.0  # the next liveness check
        self._beats = BeatClock(cfg.run.liveness_timeout_s)  # whose silence counts since when
        # The counters as last read: the summary's, should Redis fail for good.
        self._last_stats: dict[str, int | float] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._prepare_dir()
            lock = rundir.RunDirLock(self.run_dir).acquire()
        except (RunDirError, rundir.RunDirBusyError) as err:
            print(f"streamrl: {err}", file=sys.stderr)
            return 2
        try:
            logs = self.paths.logs
            logs.mkdir(parents=True, exist_ok=True)
            file = run_log(logs, "launcher", self.cfg)
            return self._run(configure_logging("launcher", file=file, run=self.cfg.run.name))
        finally:
            lock.release()

    def _run(self, log: structlog.stdlib.BoundLogger) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            url = resolve_redis_url(self.cfg)
            if not url and self.cfg.redis.cluster:
                raise NoRedisError(
                    "redis.cluster = true needs the URL of a node of the cluster (REDIS_URL "
                    "or redis.url): the embedded Redis of `streamrl up` is a single server"
                )
            if self.resume:
                self._stop_orphans(log)
            if not url:
                # One ACL user per worker type; this process is the operator.
                self.redis = EmbeddedRedis(
                    self.paths.redis,
                    keys=self.keys,
                    appendfsync=self.cfg.redis.appendfsync,
                    startup_timeout_s=self.cfg.redis.startup_timeout_s,
                ).start()
                self._record()
                url = self.redis.url
            log.info("redis", url=redact_url(url), embedded=self.redis is not None)
            # Few retries: the monitor loop must stay free to restart a Redis that died.
            # Its own reads wait out no LOADING or BUSY (they are skipped, `_monitor`); the
            # calls before and after it do, as the workers' do.
            cluster = self.cfg.redis.cluster
            client = make_client(url, 1, cluster=cluster, busy_wait_s=self.cfg.redis.busy_wait_s)
            quick = make_client(url, 1, cluster=cluster, busy_wait_s=0)
            refuse_eviction(client)
            if self.resume:
                self._resume_queues(client, log)
            else:
                self._check_namespace(client)
                incarnation.create(client, self.keys)  # the run's id (review N8)
            self._spawn_all()
            self._record()
            log.info("workers_started", pids={p.worker_id: p.popen.pid for p in self.procs})
            reason, code = self._monitor(quick, log)
            self._shutdown(log, drain_eval=code == 0 and self._stop_signal is None)
            self._write_summary(client, reason, log)
            client.close()
            quick.close()
        except (RunDirError, NoRedisError, ckpts.PartialRunError) as err:
            print(f"\nstreamrl: {err}", file=sys.stderr)
            code = 2
        finally:
            self._shutdown(log)
            if self.redis is not None:
                self.redis.stop()
        log.info("run_end", exit_code=code)
        return code

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._stop_signal = signal.Signals(signum).name

    def _prepare_dir(self) -> None:
        if self.resume:
            if not self.run_dir.is_dir() or not any(self.run_dir.iterdir()):
                raise RunDirError(f"nothing to resume: {self.run_dir} holds no run")
            return
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            raise RunDirError(
                f"run directory {self.run_dir} already holds a run; choose a new --run-dir, "
                f"or continue it with `streamrl up --resume {self.run_dir}`"
            )
        # Owner only: the AOF, logs and checkpoints hold prompts, tool output, the model.
        private_dir(self.run_dir)

    def _resume_queues(self, client: redis.Redis, log: structlog.stdlib.BoundLogger) -> None:
        """Before any worker starts: queues back from the snapshot if Redis lost them, and
        the policy floor above every version published so far."""
        ck = ckpts.latest_complete(self.paths.checkpoints, log)
        run_id = incarnation.current(client, self.keys)
        if ck is not None and run_id is None and self.keys.run_id in ck.snapshot().strings:
            # Redis lost the run (review N8): what its workers wrote before they noticed
            # is no part of it
            cleared = ckpts.clear_run_state(client, self.keys)
            log.warning("redis_lost_run", key=self.keys.run_id, cleared=cleared)
            kept = False
        else:
            kept = ckpts.namespace_present(client, self.keys, checkpointed=ck is not None)
        if kept:
            how = "Redis kept the queues"
            incarnation.create(client, self.keys)  # (a run from before the id: one now)
        elif ck is not None:
            # The trainer restores them, from the checkpoint whose state it can restore,
            # and the run's id with them.
            (ck.path.parent / ckpts.RESTORE_PENDING).touch()
            how = "the trainer restores the queues from the checkpoint it restores"
        else:
            how = "no checkpoint and no queues: starting afresh"
            incarnation.create(client, self.keys)
        published = client.get(self.keys.policy_version)
        floor = int(published) + 1 if published is not None else 0
        if kept and ck is not None:
            # the last version holds the checkpoint's state: the trainer keeps it
            # (`trainer.resume.rewind`), so rollout may serve it at once
            held = published_state_of(client, self.keys, ck.step)
            floor = floor if held is None else held
        client.set(self.keys.policy_floor, floor)
        where = f"checkpoint step {ck.step}" if ck is not None else "no checkpoint"
        log.info("resume", checkpoint=None if ck is None else str(ck.path), kept=kept, floor=floor)
        print(f"streamrl: resuming {self.run_dir} from {where}; {how}", file=self.out, flush=True)

    def _stop_orphans(self, log: structlog.stdlib.BoundLogger) -> None:
        """Stop the workers and embedded Redis that a launcher of this run left running
        when it died (`streamrl.run.rundir`), before anything of this one starts."""
        timeout_s = max(STOP_TIMEOUT_S, self.cfg.run.trainer_stop_timeout_s)  # its checkpoint
        found = rundir.stop_orphans(self.run_dir, log, timeout_s)
        if found:
            names = ", ".join(f"{n} (pid {pid})" for n, pid in sorted(found.items()))
            print(f"streamrl: stopped what the last launcher left running: {names}", file=self.out)

    def _record(self) -> None:
        """Record the processes this launcher runs now, for a `--resume` after its death."""
        pids = {p.worker_id: p.popen.pid for p in self.procs}
        if self.redis is not None and self.redis.proc is not None:
            pids[rundir.REDIS] = self.redis.proc.pid
        # The evaluator too: one a killed launcher left would go on beside the resumed
        # run's, claim its snapshots and write its final result after the summary.
        if self.evaluator is not None and self.evaluator.popen is not None:
            pids[rundir.EVALUATOR] = self.evaluator.popen.pid
        ports = {p.worker_id: self._port(p.name, p.index) for p in self.procs}
        rundir.record(self.run_dir, pids, self.cfg.run.name, {w: n for w, n in ports.items() if n})

    def _port(self, name: str, index: int) -> int:
        """Worker `name-index`'s Prometheus port: `metrics.prometheus_port` plus its place
        in the launch order (`_plan`: tools, grouper, trainer or colocated, rollout,
        feeder; each by index), the same across its restarts; 0 when off."""
        return prometheus_port(self.cfg.metrics.prometheus_port, self._plan().index((name, index)))

    def _check_namespace(self, client: redis.Redis) -> None:
        if client.exists(self.keys.stats, self.keys.tasks):
            raise RunDirError(
                f"Redis already holds a run named {self.cfg.run.name!r}; set another run.name "
                "or delete its keys"
            )

    # -- workers ---------------------------------------------------------------------------

    def _plan(self) -> list[tuple[str, int]]:
        return plan(self.cfg)

    def _spawn_all(self) -> None:
        # Each worker writes its JSON log itself, rolling over by size (streamrl.run.logs).
        logs = str(self.paths.logs)
        # Transparent huge pages for malloc (streamrl.run.malloc): a train step on the CPU
        # spent a third of its CPU faulting in its buffers again at every step without.
        self._env = {**with_hugetlb(os.environ), "PYTHONUNBUFFERED": "1", LOG_DIR_ENV: logs}
        if self.redis is None:
            # An external Redis: every worker gets what this process was given (REDIS_URL
            # and REDIS_PASSWORD_FILE from the environment, or the config's).
            self._env["REDIS_URL"] = self.cfg.redis_url()
        self._new_coordinator()
        for name, index in self._plan():
            self.procs.append(self._spawn(name, index, self._env))
        if self.cfg.trainer.eval_every:
            evalrun.clear_drain(evalrun.eval_dir(self.run_dir))
            self.evaluator = EvalProc(
                cmd=evaluator_command(
                    self.config_path, self.run_dir, self.overrides, self.cfg.trainer.eval_tasks
                ),
                env={**with_hugetlb(os.environ), "PYTHONUNBUFFERED": "1"},
                err_path=self.paths.stderr("evaluator"),
            ).start()

    def _new_coordinator(self) -> None:
        """A fresh address for the trainer processes' coordination service (process 0
        serves it); each start of the trainer group gets its own."""
        if self.cfg.trainer.num_processes > 1:
            self._env[COORDINATOR_ENV] = f"127.0.0.1:{free_port()}"

    def _credentials(self, name: str) -> dict[str, str]:
        """The environment that gives a worker its own role's Redis user (the embedded
        Redis): a URL without a password, and the file that holds it."""
        if self.redis is None:
            return {}
        url, password_file = self.redis.role_url(worker_role(name))
        return {"REDIS_URL": url, PASSWORD_FILE_ENV: str(password_file)}

    def _spawn(self, name: str, index: int, env: dict[str, str]) -> WorkerProc:
        env = {**env, **self._credentials(name)}
        if name not in ENGINE_USERS:
            # Review N15: the container engine's socket (root, under the README's setup)
            # only for the workers that run sandboxes, not for plug-in code elsewhere.
            env = {k: v for k, v in env.items() if k not in ENGINE_ENV}
        cmd = worker_command(name, index, self.config_path, self.run_dir, self.overrides)
        port = self._port(name, index)
        if port:
            cmd += ["--set", f"metrics.prometheus_port={port}"]  # after the run's overrides
        if name in TRAINS and self.steps:
            cmd += ["--steps", str(self.steps)]
        log_path = self.paths.log(f"{name}-{index}")
        err_path = self.paths.stderr(f"{name}-{index}")
        popen = _start_session(cmd, env, err_path)
        return WorkerProc(
            name=name, index=index, popen=popen, log_path=log_path, stderr_path=err_path
        )

    def _monitor(self, client: redis.Redis, log: structlog.stdlib.BoundLogger) -> tuple[str, int]:
        next_progress = 0.0
        while True:
            if self._stop_signal:
                log.info("stop_requested", signal=self._stop_signal)
                return f"stopped by {self._stop_signal}", 0
            if self.redis is not None and not self.redis.alive:
                failed = self._restart_redis(log)
                if failed is not None:
                    print(f"\nstreamrl: {failed}", file=sys.stderr)
                    return failed, 1
            ended = self._check_workers(log)
            if ended is not None:
                return ended
            if self.evaluator is not None:
                was = self.evaluator.popen
                self.evaluator.check(self.cfg, log)
                if self.evaluator.popen is not was:  # restarted: a new pid to record
                    self._record()
            self._watch_liveness(client, log)
            if time.monotonic() >= next_progress:
                try:
                    self._progress(client)
                except redis.RedisError as err:  # the line waits for the next tick
                    if not (
                        isinstance(err, redis.ConnectionError | redis.TimeoutError)
                        or waits_out(err)
                    ):
                        raise
                next_progress = time.monotonic() + (1.0 if self.out.isatty() else 10.0)
                self._cap_stderr()
            time.sleep(0.2)

    def _cap_stderr(self) -> None:
        """Roll over the workers' (and the evaluator's) stderr files past run.log_max_mb,
        as their logs roll (`logs.cap_file`)."""
        run = self.cfg.run
        paths = [p.stderr_path for p in self.procs]
        if self.evaluator is not None:
            paths.append(self.evaluator.err_path)
        for path in paths:
            cap_file(path, run.log_max_mb, run.log_backups)

    def _check_workers(self, log: structlog.stdlib.BoundLogger) -> tuple[str, int] | None:
        """Restarts that are due; the run's end when the trainer finished or a worker
        failed for good."""
        for p in self.procs:
            if p.restart_at is not None:
                if p.restart_due(time.monotonic()):
                    self._restart(p, log)
                continue
            rc = p.popen.poll()
            if rc is None or p.gave_up:
                continue
            if p.name in TRAINS and rc == 0:
                if p.index > 0:
                    continue  # a trainer process other than 0: the leader says when
                if self.steps:
                    return f"trainer finished {self.steps} steps", 0
                # trainer.max_steps, or the data ended (task.epochs) and all was trained
                return "trainer finished: its step limit, or the data's end", 0
            failed = self._supervise(p, rc, log)
            if failed is not None:
                print(f"\nstreamrl: {failed}", file=sys.stderr)
                return failed, 1
        return None

    def _watch_liveness(self, client: redis.Redis, log: structlog.stdlib.BoundLogger) -> None:
        """SIGKILL a worker whose liveness beat (`streamrl.run.liveness`) has not changed for
        `run.liveness_timeout_s`, or that has not beaten once `run.start_timeout_s` after
        its start; `_check_workers` then restarts it like a crash. The clock
        (`BeatClock`) counts only time in which a beat could have been seen: it restarts
        after Redis did not answer or answered slowly, or the launcher itself did not look."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + LIVENESS_POLL_S
        running = [p for p in self.procs if p.restart_at is None and p.popen.poll() is None]
        if not running:
            return
        try:
            raw = mget_bytes(client, [self.keys.worker_beat(p.name, p.index) for p in running])
        except redis.RedisError:
            self._beats.blind(now)
            return
        self._beats.looked(now, time.monotonic())
        run = self.cfg.run
        for p, value in zip(running, raw, strict=True):
            beat = value.decode() if isinstance(value, bytes) else None
            if beat not in (None, p.beat) and beat.split(" ")[0] == default_holder(p.popen.pid):
                p.beat, p.beat_at = beat, now
            # Before its first beat the worker is starting: judged by the start limit.
            starting = p.beat is None
            setting, limit = (
                ("run.start_timeout_s", max(run.start_timeout_s, run.liveness_timeout_s))
                if starting
                else ("run.liveness_timeout_s", run.liveness_timeout_s)
            )
            silent_s = self._beats.silent_s(p.beat_at, now)
            if silent_s <= limit:
                continue
            p.hangs += 1
            log.error("worker_hung", worker=p.worker_id, pid=p.popen.pid, silent_s=silent_s,
                      starting=starting)  # fmt: skip
            since = "since its start" if starting else "for"
            print(
                f"\nstreamrl: worker {p.worker_id} has not beaten {since} {silent_s:.0f}s "
                f"({setting} = {limit:g}): killing it",
                file=sys.stderr,
            )
            kill(p.popen)

    def _supervise(self, p: WorkerProc, rc: int, log: structlog.stdlib.BoundLogger) -> str | None:
        """A worker exited: schedule its restart, or say why the run must stop."""
        run = self.cfg.run
        if rc == FATAL_EXIT_CODE:
            log.error("worker_fatal", worker=p.worker_id, code=rc)
            return f"worker {p.worker_id} stopped with a fatal error; see {p.stderr_path}"
        delay = p.schedule_restart(time.monotonic(), run)
        if delay is None and p.name == SINKS:
            p.gave_up = True
            log.error("worker_gave_up", worker=p.worker_id, code=rc, restarts=len(p.restarts))
            print(
                f"\nstreamrl: worker {p.worker_id} exited with code {rc} after "
                f"{len(p.restarts)} restarts; the run goes on without it (see {p.stderr_path})",
                file=sys.stderr,
            )
            return None
        if delay is None:
            log.error("worker_failed", worker=p.worker_id, code=rc, restarts=len(p.restarts))
            return (
                f"worker {p.worker_id} exited with code {rc} after {len(p.restarts)} restarts "
                f"within {run.restart_window_s:g}s (run.max_restarts = {run.max_restarts}); "
                f"see {p.stderr_path}"
            )
        log.warning("worker_crashed", worker=p.worker_id, code=rc, restart_in_s=round(delay, 2))
        if p.name == "trainer" and self.cfg.trainer.num_processes > 1:
            # One logical trainer: the others would wait in a collective for ever. All of
            # its processes restart together (and resume from the checkpoint).
            for q in self.procs:
                if q.name == "trainer" and q is not p and q.restart_at is None:
                    kill(q.popen)
                    q.restart_at = p.restart_at
                    log.warning("worker_stopped_with_group", worker=q.worker_id)
            self._new_coordinator()
        return None

    def _restart_redis(self, log: structlog.stdlib.BoundLogger) -> str | None:
        """The embedded Redis died: start it again on its port, from its AOF."""
        assert self.redis is not None and self.redis.proc is not None
        code = self.redis.proc.returncode
        run = self.cfg.run
        now = time.monotonic()
        if (
            restart_decision(self.redis_restarts, now, run.max_restarts, run.restart_window_s)
            is None
        ):
            log.error("redis_failed", code=code, restarts=len(self.redis_restarts))
            where = self.paths.redis / "redis.log"
            return f"the embedded Redis exited with code {code} too often; see {where}"
        log.warning("redis_crashed", code=code)
        try:
            self.redis.start()
        except Exception as err:
            log.error("redis_restart_failed", error=str(err))
            return f"the embedded Redis could not be restarted: {err}"
        self.redis_restarts.append(time.monotonic())
        self._record()
        self._beats.blind(time.monotonic())
        log.info(
            "redis_restarted",
            pid=self.redis.proc.pid,
            n=len(self.redis_restarts),
            down_s=round(time.monotonic() - now, 3),
        )
        return None

    def _restart(self, p: WorkerProc, log: structlog.stdlib.BoundLogger) -> None:
        fresh = self._spawn(p.name, p.index, self._env)
        p.restarted(fresh.popen, time.monotonic())
        p.beat, p.beat_at = None, fresh.beat_at
        self._record()
        log.info("worker_restarted", worker=p.worker_id, pid=p.popen.pid, n=len(p.restarts))

    def _shutdown(self, log: structlog.stdlib.BoundLogger, drain_eval: bool = False) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left: after
        STOP_TIMEOUT_S, or `run.trainer_stop_timeout_s` for the trainer (its final
        checkpoint). Then the evaluator: with `drain_eval` (the trainer finished) it first
        evaluates what is pending, the final policy (`EvalProc.drain`)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._stop_workers(log, [p for p in self.procs if p.name != SINKS])
            if drain_eval and self.evaluator is not None:
                print("\nevaluating the final policy on the held-out split ...", file=self.out)
                root = evalrun.eval_dir(self.run_dir)
                self.evaluator.drain(self.cfg, root, lambda: bool(self._stop_signal), log)
        finally:
            if self.evaluator is not None:
                self.evaluator.stop()
            # last: its final pass writes the run's last steps and evaluation
            self._stop_workers(log, [p for p in self.procs if p.name == SINKS])

    def _stop_workers(self, log: structlog.stdlib.BoundLogger, procs: list[WorkerProc]) -> None:
        """The process groups of `procs` stopped: the trainer gets its final checkpoint's
        time (`run.trainer_stop_timeout_s`), the others STOP_TIMEOUT_S."""
        limits = [
            self.cfg.run.trainer_stop_timeout_s if p.name in TRAINS else STOP_TIMEOUT_S
            for p in procs
        ]

        def killed(i: int) -> None:
            log.warning("worker_kill", worker=procs[i].worker_id, after_s=limits[i])

        terminate([(p.popen, lim) for p, lim in zip(procs, limits, strict=True)], on_kill=killed)

    # -- reporting -------------------------------------------------------------------------

    def _stats(self, client: redis.Redis) -> dict[str, int | float]:
        self._last_stats = read_stats(client, self.keys)
        return self._last_stats

    def _progress(self, client: redis.Redis) -> None:
        s = self._stats(client)
        last = xrevrange_entries(client, self.keys.metrics, count=1)
        dead = int(client.xlen(self.keys.dead))
        try:
            reward = decode(last[0][1], TrainMetrics).reward_mean if last else float("nan")
        except WireError:
            reward = float("nan")
        # The groupers' own rate over metrics.rate_window_s: not the run's count over the
        # time since this launcher started, which a --resume inflates.
        rate = sum(
            newest_sample(client, self.keys.worker_metrics(p.worker_id)).get(GROUPS_PER_MIN, 0.0)
            for p in self.procs
            if p.name == "grouper"
        )
        heldout = None
        if self.evaluator is not None:
            heldout = evalrun.latest_result(evalrun.eval_dir(self.run_dir))
        elapsed = time.monotonic() - self.started
        line = progress_line(elapsed, s, self.steps, rate, reward, dead, heldout)
        end = "\r" if self.out.isatty() else "\n"
        print(line, end=end, file=self.out, flush=True)

    def _write_summary(
        self, client: redis.Redis, reason: str, log: structlog.stdlib.BoundLogger
    ) -> None:
        """summary.json: the run's counters from Redis, or, when Redis is gone for good,
        those the launcher last read (`redis_available` false; no rewards, no dead-letter
        count)."""
        try:
            s = self._stats(client)
            steps = step_metrics(client, self.keys, log)
            rewards = [m.reward_mean for m in steps]
            task_steps = [(m.step, m.tasks) for m in steps]
            dead: int | None = int(client.xlen(self.keys.dead))
            available = True
        except redis.RedisError as err:
            log.error("summary_without_redis", error=str(err))
            s, rewards, task_steps, dead, available = self._last_stats, [], [], None, False
        summary = summarize(
            run=self.cfg.run.name,
            reason=reason,
            elapsed_s=time.monotonic() - self.started,
            stats=s,
            rewards=rewards,
            dead=dead,
            evals=evalrun.eval_summary(evalrun.eval_dir(self.run_dir)),
            procs=[p.record() for p in self.procs],
            redis_restarts=len(self.redis_restarts),
            resumed=self.resume,
            available=available,
            task_steps=task_steps,
        )
        path = self.paths.summary
        path.write_text(json.dumps(summary, indent=2) + "\n")
        shown = {k: summary[k] for k in SUMMARY_SHOWN}
        print(f"\n{reason}; summary in {path}\n{json.dumps(shown)}", file=self.out, flush=True)


def plan(cfg: Config) -> list[tuple[str, int]]:
    """The workers `streamrl up` runs for `cfg`, (name, index) in launch order: tools,
    grouper, trainer or colocated, rollout, feeder, and the sinks worker when
    `logging.sinks` names any."""
    out = [("tools", i) for i in range(cfg.tools.num_workers)]
    out += [("grouper", i) for i in range(cfg.grouper.num_workers)]
    if cfg.run.colocated:  # rollout and training in one process, alternating
        out += [("colocated", 0)]
    else:
        out += [("trainer", i) for i in range(cfg.trainer.num_processes)]
        out += [("rollout", i) for i in range(cfg.rollout.num_workers)]
    out += [("feeder", 0)]
    if cfg.logging.sinks:
        out += [(SINKS, 0)]
    return out


TRAINS = ("trainer", "colocated")  # the workers whose clean exit ends the run
# The metrics sinks (streamrl.obs.sinks): optional (past run.max_restarts the run goes on
# without it) and stopped last, after the evaluator's final evaluation, which it writes.
SINKS = "sinks"
LIVENESS_POLL_S = 1.0  # how often the launcher reads the workers' liveness beats


# The workers that start sandbox containers (the evaluator too, which runs its tool calls
# itself): the only ones that get the container engine's address.
ENGINE_USERS = ("tools",)
ENGINE_ENV = ("DOCKER_HOST", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY", "CONTAINER_HOST")


def worker_command(
    name: str, index: int, config: str | Path, run_dir: str | Path, overrides: list[str]
) -> list[str]:
    """argv of `streamrl worker NAME` run with this interpreter."""
    args = ["worker", name, "--config", str(config), "--run-dir", str(run_dir)]
    return _cli([*args, "--index", str(index)], overrides)


def evaluator_command(
    config: str | Path, run_dir: str | Path, overrides: list[str], tasks: int
) -> list[str]:
    """argv of the run's evaluator, `streamrl eval --watch RUN_DIR`, with this interpreter."""
    args = ["eval", "--watch", str(run_dir), "--config", str(config), "--n", str(tasks)]
    return _cli(args, overrides)


def check_plugins_apart(config: str | Path, overrides: list[str]) -> int:
    """`streamrl check-plugins` in a process of its own (review N19): the user's plug-in
    code is imported and run there, never in the launcher, which holds the operator's
    password and parents every worker. Its environment has no Redis address, password file
    or container engine. Returns its exit code (2, its message printed, when a plug-in
    fails)."""
    drop = {"REDIS_URL", PASSWORD_FILE_ENV, COORDINATOR_ENV, *ENGINE_ENV}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    cmd = _cli(["check-plugins", "--config", str(config)], overrides)
    done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, check=False)
    return done.returncode


def _cli(args: list[str], overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "streamrl_workers.cli", *args]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def _start_session(cmd: list[str], env: dict[str, str], err_path: Path) -> subprocess.Popen[bytes]:
    """A worker or the evaluator in a session of its own (stopping it stops its whole
    process group), all it prints appended to `err_path` (its log is its own)."""
    with open(err_path, "ab") as err:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, start_new_session=True
        )
