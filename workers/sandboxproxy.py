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

    image = {"image": args.image} if args.image else {}
    try:
        cfg = ProxyConfig(
            upstream=args.upstream,
            listen=args.listen,
            socket_mode=args.mode,
            socket_group=args.group,
            **image,
        )
    except ValueError as err:
        print(f"streamrl sandbox-proxy: {err}", file=sys.stderr)
        return 2
    level = getattr(logging, args.log_level.upper())
    return run(cfg, configure_logging("sandbox-proxy", level=level))
