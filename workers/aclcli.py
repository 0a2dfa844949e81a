"""`streamrl acl`: the Redis ACL users of a run, for a Redis that `streamrl up` does not start
(a compose stack, an operator's own server).

    streamrl acl --config configs/tiny.toml --out secrets/ [--redis-version 6.2]

writes `secrets/users.acl` (redis.conf: `aclfile /path/users.acl`; it holds password hashes
only) and one `secrets/<role>.password` per role (0600, in a 0700 directory; passwords
already there are kept). Give each worker its own role's file and a URL naming its user:
REDIS_URL=redis://<role>@host:6379/0 and REDIS_PASSWORD_FILE=/run/secrets/<role>.password
(roles: feeder, rollout, tools, grouper, trainer, colocated, sinks; `operator` for `streamrl up`,
`streamrl queues` and `streamrl status`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamrl.config import Config
from streamrl_workers.args import config_arguments


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    a = sub.add_parser("acl", help="write a run's Redis ACL file and per-role password files")
    config_arguments(a, run_dir=False)
    a.add_argument("--out", required=True, help="directory for users.acl and the passwords")
    a.add_argument(
        "--redis-version",
        default="7",
        help="version of the Redis that loads the file (6.2 has no read-only key patterns)",
    )


def main(args: argparse.Namespace, cfg: Config) -> int:
    from streamrl.names import Keys
    from streamrl.run import acl

    try:
        major = int(str(args.redis_version).split(".")[0])
    except ValueError:
        print(
            f"streamrl acl: --redis-version {args.redis_version!r}: give 6.2 or 7", file=sys.stderr
        )
        return 2
    out = acl.private_dir(Path(args.out))
    keys = Keys(cfg.run.name)
    passwords = acl.load_or_create_passwords(out)
    acl.write_private(
        out / "users.acl", acl.render_acl(keys, passwords, read_only_patterns=major >= 7)
    )
    print(f"streamrl acl: run {keys.ns!r}: {out / 'users.acl'} and {len(passwords)} password files")
    return 0
