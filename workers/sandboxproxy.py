"""`streamrl sandbox-proxy`: the Docker API filter between the tools service and the engine.

    streamrl sandbox-proxy --upstream unix:///run/streamrl-podman.sock \\
        --listen unix:///run/sandbox/docker.sock --image streamrl-sandbox:1 --group tools

Runs where the engine's socket is (as root for a root engine); the tools service gets only
the --listen socket, as DOCKER_HOST. What passes: streamrl.tools.proxy. Needs no run config.
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sandbox-proxy",
        help="serve a Docker API socket that allows only the container sandbox's requests",
    )
    p.add_argument("--upstream", required=True, help="the engine's socket, unix:///path")
    p.add_argument("--listen", required=True, help="the socket to serve, unix:///path")
    p.add_argument(
        "--image", default=None, help="the only image containers may use (default: the sandbox's)"
    )
    p.add_argument(
        "--mode", default="0660", type=lambda s: int(s, 8), help="the listening socket's mode"
    )
    p.add_argument("--group", default=None, help="group (name or gid) of the listening socket")
    # The caps a create may ask for, one container; compose sets them to the tools
    # config's values (review N6: only the proxy's ceilings held before, 16 GiB, 4096 pids,
    # 64 CPUs).
    p.add_argument("--max-memory-mb", type=int, default=None, help="memory of one container")
    p.add_argument("--max-pids", type=int, default=None, help="pids limit of one container")
    p.add_argument("--max-cpus", type=float, default=None, help="CPUs of one container")
    p.add_argument(
        "--max-containers",
        type=int,
        default=None,
        help="live containers created through the proxy; one more create is refused (429)",
    )
    p.add_argument(
        "--stream-idle-s",
        type=float,
        default=None,
        help="close an exec or attach stream that moved no byte this long",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning"],
        help="debug logs every forwarded request",
    )


def main(args: argparse.Namespace) -> int:
    from streamrl.run.logs import configure_logging
    from streamrl.tools.proxy import run
    from streamrl.tools.proxy_rules import ProxyConfig

    given = {
        "image": args.image,
        "max_memory_bytes": None if args.max_memory_mb is None else args.max_memory_mb * 2**20,
        "max_pids": args.max_pids,
        "max_cpus": args.max_cpus,
        "max_containers": args.max_containers,
        "stream_idle_s": args.stream_idle_s,
    }
    try:
        cfg = ProxyConfig(
            upstream=args.upstream,
            listen=args.listen,
            socket_mode=args.mode,
            socket_group=args.group,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as err:
        print(f"streamrl sandbox-proxy: {err}", file=sys.stderr)
        return 2
    level = getattr(logging, args.log_level.upper())
    return run(cfg, configure_logging("sandbox-proxy", level=level))
