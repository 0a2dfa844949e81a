"""`streamrl health`: the compose stack's health check, exit 0 when healthy, 1 when not.

    streamrl health --config C                      # Redis answers
    streamrl health --config C --worker tools       # and this container's tools worker
                                                    # holds its identity (its heartbeat runs)
                                                    # and its loop turns (its liveness beat)
    streamrl health --config C --worker tools --index 2   # replica 2, whoever runs it

Prints one line saying what it found. Imports no model code: it runs in milliseconds.
"""

from __future__ import annotations

import argparse
import socket
import sys

import redis

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.run.identity import holder_of, slots_held
from streamrl.run.runtime import WORKER_NAMES, NoRedisError, resolve_redis_url
from streamrl.transport import make_client
from streamrl_workers.args import config_arguments


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    h = sub.add_parser("health", help="exit 0 when Redis (and a worker's heartbeat) is alive")
    config_arguments(h, run_dir=False)
    h.add_argument("--worker", choices=WORKER_NAMES, help="check this worker type's heartbeat")
    h.add_argument("--index", type=int, default=None, help="replica (default: this host's)")


def check(client: redis.Redis, keys: Keys, worker: str | None, index: int | None) -> str | None:
    """Why the check fails, or None when healthy."""
    try:
        client.ping()
    except redis.RedisError as err:
        return f"Redis does not answer: {type(err).__name__}: {err}"
    if worker is None:
        return None
    if index is not None:
        if holder_of(client, keys, worker, index) is None:
            return f"{worker}-{index} has no live heartbeat"
        return _beating(client, keys, worker, index)
    host = socket.gethostname()
    mine = [i for i, h in slots_held(client, keys, worker).items() if h.rsplit(":", 1)[0] == host]
    if mine:
        return _beating(client, keys, worker, mine[0])
    return f"no {worker} worker of host {host} has a live heartbeat"


def _beating(client: redis.Redis, keys: Keys, worker: str, index: int) -> str | None:
    """Review N9: the identity slot is renewed by the heartbeat thread whatever the worker's
    loop does; its liveness beat key is written only while the loop turns, and lapses 2 x
    run.liveness_timeout_s after the last beat: a stuck loop is unhealthy then."""
    if client.exists(keys.worker_beat(worker, index)):
        return None
    return (
        f"{worker}-{index} holds its identity but its loop is stuck: no liveness beat for "
        "2 x run.liveness_timeout_s"
    )


def main(args: argparse.Namespace, cfg: Config) -> int:
    try:
        url = resolve_redis_url(cfg)  # REDIS_URL plus this role's REDIS_PASSWORD_FILE
    except NoRedisError as err:
        print(f"unhealthy: {err}")
        return 1
    if not url:
        print("unhealthy: no Redis configured (REDIS_URL or redis.url)")
        return 1
    # No retries (the workers' clients ride out outages for ~20 s, LOADING and BUSY for
    # redis.busy_wait_s): a health check answers at once.
    client = make_client(url, retries=0, cluster=cfg.redis.cluster, busy_wait_s=0, socket_timeout=2)
    why = check(client, Keys(cfg.run.name), args.worker, args.index)
    print(f"unhealthy: {why}" if why else "healthy")
    sys.stdout.flush()
    return 1 if why else 0
