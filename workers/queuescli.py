"""`streamrl queues`: each stream's length, lag, pending entries, oldest pending age, dead
letters, half-filled groups (`partial_groups`, `oldest_partial_group_s`) and the group
policies' counters (timed out, rerun, released, backpressure pauses); `--replay-dead` puts
dead letters back into their source stream after a fix.

    streamrl queues --config configs/tiny.toml --run-dir runs/demo [--json]
    streamrl queues --config configs/tiny.toml --run-dir runs/demo --replay-dead [--source S]

Redis: REDIS_URL, else `redis.url` (the password in REDIS_PASSWORD_FILE or
`redis.password_file`), else the embedded Redis of the run directory (while `streamrl up`
runs), as its operator user.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from streamrl.config import Config
from streamrl.names import RunPaths
from streamrl_workers.args import config_arguments


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    q = sub.add_parser("queues", help="inspect a run's queues; replay dead letters")
    config_arguments(q)
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.add_argument("--replay-dead", action="store_true", help="move dead letters back")
    q.add_argument("--source", default=None, help="replay only dead letters of this stream")
    q.add_argument("--limit", type=int, default=0, help="replay at most N (0: all)")


def main(args: argparse.Namespace, cfg: Config, run_dir: Path) -> int:
    """Report on (or replay the dead letters of) the run `cfg` names (loaded by `cli.main`)."""
    import redis

    from streamrl.names import Keys
    from streamrl.queues import format_report, inspect, replay_dead
    from streamrl.run.redis_server import url_from_conf
    from streamrl.run.runtime import NoRedisError, resolve_redis_url
    from streamrl.transport import make_client

    try:
        url = resolve_redis_url(cfg) or url_from_conf(RunPaths(run_dir).redis)
    except (NoRedisError, OSError, ValueError) as err:
        print(f"streamrl queues: {err}", file=sys.stderr)
        return 2
    if not url:
        print(
            f"streamrl queues: no Redis: set REDIS_URL or redis.url, or point --run-dir at a "
            f"run started by `streamrl up` (no {run_dir / 'redis' / 'redis.conf'})",
            file=sys.stderr,
        )
        return 2
    client = make_client(url, retries=3, cluster=cfg.redis.cluster)
    keys = Keys(cfg.run.name)
    try:
        if args.replay_dead:
            moved = replay_dead(client, keys, args.source, args.limit)
            print(json.dumps({"replayed": [{"dead": d, "new": n} for d, n in moved]}))
            return 0
        report = inspect(client, keys)
    except redis.ConnectionError as err:
        print(f"streamrl queues: cannot reach Redis: {err}", file=sys.stderr)
        return 3
    finally:
        client.close()
    print(json.dumps(dataclasses.asdict(report)) if args.json else format_report(report))
    return 0
