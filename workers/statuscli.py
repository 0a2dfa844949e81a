"""`streamrl status`: a live terminal dashboard of a run (`streamrl.obs.status`).

    streamrl status runs/stub                      # a run of `streamrl up`
    streamrl status --config configs/tiny.toml     # a compose stack: REDIS_URL (and
                                                   # REDIS_PASSWORD_FILE) name its Redis
    streamrl status runs/stub --once               # one frame, then exit

The run directory of `streamrl up` gives the embedded Redis (its operator's URL and
password) and the run's name; --redis-url or REDIS_URL name another Redis, --config the run
(its run.name, and redis.url / redis.password_file when no URL is given).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import redis

from streamrl.config import ConfigError, load_config
from streamrl.evaluation import watch as evalrun
from streamrl.names import Keys, RunPaths
from streamrl.run.redis_server import url_from_conf
from streamrl.run.rundir import recorded_run
from streamrl.run.runtime import NoRedisError, resolve_redis_url
from streamrl.transport import make_client

STATUS_WIDTH = 120  # columns of a frame printed to a pipe (a terminal's own width else)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("status", help="live dashboard of a run: workers, queues, groups, policy")
    s.add_argument("run_dir", nargs="?", default=None, help="run directory of `streamrl up`")
    s.add_argument("--redis-url", default=None, help="Redis of the run (default: REDIS_URL)")
    s.add_argument("--config", default=None, help="the run's TOML config (its run.name)")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    s.add_argument("--once", action="store_true", help="print one frame and exit")
    s.add_argument("--every", type=float, default=1.0, help="seconds between frames")


def target(args: argparse.Namespace) -> tuple[str, str]:
    """(Redis URL, run name) of the run to show; ValueError says what is missing."""
    run_dir = Path(args.run_dir) if args.run_dir else None
    cfg = load_config(args.config, overrides=args.set) if args.config else None
    run = cfg.run.name if cfg is not None else None
    if run is None and run_dir is not None:
        run = recorded_run(run_dir)
    if run is None:
        raise ValueError(
            "which run? give the run directory of `streamrl up`, or --config with its run.name"
        )
    url = args.redis_url or ""
    if not url and run_dir is not None:
        url = url_from_conf(RunPaths(run_dir).redis) or ""  # the embedded Redis, as its operator
    if not url and cfg is not None:
        url = resolve_redis_url(cfg)
    url = url or os.environ.get("REDIS_URL", "")
    if not url:
        raise ValueError("no Redis: give --redis-url, REDIS_URL, or a run directory")
    return url, run


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from streamrl.obs.status import StatusReader, show

    try:
        url, run = target(args)
    except (ValueError, ConfigError, NoRedisError, OSError) as err:
        print(f"streamrl: {err}", file=sys.stderr)
        return 2
    client = make_client(url, retries=0, busy_wait_s=0, socket_timeout=5)
    console = Console(width=None if sys.stdout.isatty() else STATUS_WIDTH)
    try:
        evals = evalrun.eval_dir(Path(args.run_dir)) if args.run_dir else None
        reader = StatusReader(client, Keys(run), eval_root=evals)
        show(reader, console, once=args.once, every_s=args.every)
    except redis.RedisError as err:
        print(f"streamrl: cannot read the run from Redis: {type(err).__name__}: {err}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
