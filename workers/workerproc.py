"""`streamrl worker NAME`: one worker process, its identity claimed and kept alive.

`--index N` runs replica N (what `streamrl up` passes); `--index auto` (what the compose
stack passes) claims the lowest free index of the worker type, or the one this container
held before a restart (streamrl.run.identity). Either way a heartbeat renews the identity's slot
in Redis while the process lives: `streamrl health --worker NAME` reads it; and a liveness
beat while the worker's loop turns (`streamrl.run.liveness`): `streamrl up` reads that. Its
counters are sampled into Redis (and served to Prometheus) while it runs (`streamrl.obs.metrics`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

import redis

from streamrl import checkpoints as ckpts
from streamrl.config import Config
from streamrl.errors import FATAL_EXIT_CODE, FatalError
from streamrl.names import RunPaths
from streamrl.obs.tracing import Span
from streamrl.run import incarnation
from streamrl.run.failpoints import WORKER_START, failpoint
from streamrl.run.identity import Heartbeat, claim_index, default_holder
from streamrl.run.logs import redact_url
from streamrl.run.runtime import (
    NONBLOCKING_TIMEOUT_S,
    WORKER_NAMES,
    WorkerContext,
    make_context,
    stop_on_signals,
)
from streamrl_workers.args import config_arguments

IDENTITY_LOST_EXIT_CODE = 4  # not 0: a supervisor (compose on-failure) starts it again


def index_argument(value: str) -> int | str:
    """`--index`: a replica number, or `auto`."""
    if value == "auto":
        return value
    try:
        index = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither an index nor `auto`") from None
    if index < 0:
        raise argparse.ArgumentTypeError(f"index {index} is negative")
    return index


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser("worker", help="run one worker process (the form compose uses)")
    w.add_argument("name", choices=WORKER_NAMES)
    config_arguments(w)
    w.add_argument("--steps", type=int, default=0, help="stop after N trainer steps")
    w.add_argument(
        "--index",
        type=index_argument,
        default=0,
        help="replica index of this worker, or `auto`: claim a free one (scaled replicas)",
    )
    w.add_argument("--burst", action="store_true", help="exit once the input is drained")


def main(args: argparse.Namespace, cfg: Config, run_dir: Path) -> int:
    """Run the worker `args.name` until it stops; its exit status. NoRedisError propagates
    (the CLI reports it)."""
    holder = default_holder()
    lost = threading.Event()  # another process took this worker's identity

    def on_lost() -> None:
        lost.set()
        ctx.stop.set()

    ctx = make_context(args.name, 0 if args.index == "auto" else args.index, cfg, run_dir,
                       max_steps=args.steps, burst=args.burst)  # fmt: skip
    try:
        if args.index == "auto":
            index = claim_index(ctx.client(), ctx.keys, args.name, holder)
            ctx = make_context(
                args.name, index, cfg, run_dir, max_steps=args.steps, burst=args.burst
            )
        ctx.holder = holder
        failpoint(WORKER_START, ctx.log)
        beat = Heartbeat(
            ctx.client(socket_timeout=NONBLOCKING_TIMEOUT_S),
            ctx.keys,
            args.name,
            ctx.index,
            holder,
            ctx.log,
            on_lost,
            liveness=ctx.liveness,
            liveness_s=cfg.run.liveness_timeout_s,
            run_id=lambda: ctx.run_id,
            on_run_lost=lambda reason: _run_lost(ctx, reason),
        ).start(take=args.index != "auto")
        ctx.open_trace()
        _trace_start(ctx)
    except redis.RedisError as err:  # after the client's retries: Redis is not there
        ctx.log.error("redis_unreachable", error=f"{type(err).__name__}: {err}")
        print(
            f"streamrl: cannot reach Redis at {redact_url(ctx.redis_url)} (REDIS_URL or "
            f"redis.url): {type(err).__name__}: {err}",
            file=sys.stderr,
        )
        return 1
    stop_on_signals(ctx.stop, ctx.log)
    ctx.log.info("worker_identity", index=ctx.index, holder=holder, auto=args.index == "auto")
    if args.name not in ("trainer", "colocated"):  # those restore the queues themselves
        wait_for_queues(ctx)
        # the run this worker works in (the trainer records it once resumed)
        found = incarnation.wait_for(ctx.client(), ctx.keys, ctx.stop, ctx.log)
        if found is None:  # stopped while waiting
            beat.close()
            ctx.tracer.close()
            return IDENTITY_LOST_EXIT_CODE if lost.is_set() else 0
        ctx.run_id = found
    module = importlib.import_module(f"streamrl_workers.{args.name}")
    # Every sample also goes into the trace, as counter tracks beside the spans.
    sampler = ctx.start_metrics(sinks=[ctx.tracer.counter])
    try:
        code: int = module.run(ctx)
    except FatalError as err:
        ctx.log.error("worker_fatal", error=f"{type(err).__name__}: {err}")
        print(f"streamrl: {type(err).__name__}: {err}", file=sys.stderr)
        code = FATAL_EXIT_CODE
    except Exception:
        ctx.log.exception("worker_failed")
        raise
    finally:
        sampler.close()  # a last sample: the series ends with the final totals
        ctx.tracer.close()
        beat.close()
    if code == FATAL_EXIT_CODE:
        exit_fatal()
    if lost.is_set() and code == 0:
        # Review N22: a replica whose identity another took (it was cut off from Redis
        # past its slot's TTL) stopped; exit 0 would keep compose's `on-failure` from
        # starting it again, and the replica would be gone for good.
        ctx.log.warning("worker_identity_lost_exit", code=IDENTITY_LOST_EXIT_CODE)
        return IDENTITY_LOST_EXIT_CODE
    return code


def _trace_start(ctx: WorkerContext) -> None:
    """The `worker.start` span: from the trace's opening to the main loop's first turn
    (model build, warm start, first weights: what the report counts as starting)."""
    tracer, start_ns = ctx.tracer, time.time_ns()
    if not tracer.enabled:
        return
    track = tracer.track("worker", ctx.worker_id)

    def started() -> None:
        tracer.span(track, Span.WORKER_START, start_ns, time.time_ns())

    ctx.liveness.on_started = started


def wait_for_queues(ctx: WorkerContext) -> None:
    """Under `streamrl up --resume` after Redis lost the run, wait (until stopped) while
    the trainer writes back the queues of the checkpoint it restores
    (`checkpoints.RESTORE_PENDING`): a worker that started on empty queues would begin the
    run's data again."""
    pending = RunPaths(ctx.run_dir).checkpoints / ckpts.RESTORE_PENDING
    if pending.exists():
        ctx.log.info("waiting_for_queues", path=str(pending))
    while pending.exists() and not ctx.stop.wait(0.2):
        pass


def _run_lost(ctx: WorkerContext, reason: str) -> None:
    """Redis lost the run (the heartbeat saw its id gone): stop now, writing nothing more
    (a graceful stop would run final writes against the emptied Redis)."""
    ctx.log.error("worker_fatal", error=f"RunLostError: {reason}")
    print(f"streamrl: RunLostError: {reason}", file=sys.stderr)
    exit_fatal()


def exit_fatal() -> None:
    """Exit with FATAL_EXIT_CODE now, skipping the interpreter's finalization: a daemon
    thread still in native code (an engine step that outlived its join, inside XLA) makes
    it abort (SIGABRT, "terminate called after throwing an instance of ''"), and the
    launcher would restart the worker as crashed instead of stopping the run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FATAL_EXIT_CODE)
