"""Worker identities and liveness: replica slots claimed in Redis, renewed by a heartbeat.

`streamrl up` gives every worker its index; a replica of a scaled compose service does not
know one, so it claims one (`--index auto`): the lowest index of its worker type whose slot
key is free, or the one whose slot already names it as holder. The holder id is
`<host name>:<pid>`, which a restarted container keeps (its host name is the container id,
its process tree starts the same way), so a restarted replica takes its predecessor's
identity at once (its rq registration, stream consumer name and logs) instead of waiting for
the old claim to expire; a new replica never gets a live replica's index.

The slot key carries a TTL that the worker's heartbeat renews every `ttl_s / 3`: a worker
that dies, hangs or loses Redis lets its slot lapse within `ttl_s`, which is what
`streamrl health --worker` checks (the compose health check) and what frees the index.

Each beat also compares the run's id (`streamrl.run.incarnation`) with the one the worker
recorded at start: Redis that lost the run ends the worker (`on_run_lost`).

With a liveness limit, the heartbeat also writes the worker's beat key (`Keys.worker_beat`:
its holder and a count of beats) at least four times per limit, but only while the
worker's loop is live (`streamrl.run.liveness`): `streamrl up` restarts a worker whose beat
stops changing.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Callable

import redis
import structlog

from streamrl.names import Keys
from streamrl.run import incarnation
from streamrl.run.liveness import Liveness
from streamrl.transport import mget_bytes

HEARTBEAT_TTL_S = 15.0
MAX_INDEX = 1024

SCAN_BATCH = 64


class IdentityError(RuntimeError):
    """No identity could be claimed, or another process holds this one."""


def default_holder(pid: int | None = None) -> str:
    """This process's holder id (or process `pid`'s in this container), `<host name>:<pid>`:
    unique among the processes of one host, and the same for a restarted container (its
    host name is the container's id, and its process tree starts the same way each time, so
    the worker gets the same pid). A container whose host name is not its own (compose's
    `network_mode: host`: every replica has the host's name and, with `init: true`, the
    same pid) adds its container id, `<host name>:<container id>:<pid>` (review N22)."""
    host = socket.gethostname()
    cid = container_id(_read("/proc/self/mountinfo"))
    if cid and not cid.startswith(host):
        host = f"{host}:{cid[:12]}"
    return f"{host}:{os.getpid() if pid is None else pid}"


_CONTAINER_DIR = re.compile(r"containers/([0-9a-f]{64})/")


def container_id(mountinfo: str) -> str | None:
    """The id of the container this process runs in, from its mount table (docker and
    podman mount the container's own /etc/hostname from `.../containers/<id>/...`), or
    None outside a container."""
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and fields[4] in ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf"):
            found = _CONTAINER_DIR.search(fields[3])
            if found:
                return found.group(1)
    return None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def claim_index(
    client: redis.Redis,
    keys: Keys,
    worker: str,
    holder: str,
    ttl_s: float = HEARTBEAT_TTL_S,
    max_index: int = MAX_INDEX,
) -> int:
    """The index of worker type `worker` that `holder` runs as: the slot that names it
    already, else the lowest free one (SET NX: two replicas never win one index)."""
    ttl_ms = int(ttl_s * 1000)
    mine = [i for i, h in sorted(slots_held(client, keys, worker).items()) if h == holder]
    if mine and mine[0] < max_index and renew(client, keys, worker, mine[0], holder, ttl_s):
        return mine[0]
    for index in range(max_index):
        if client.set(keys.worker_slot(worker, index), holder, nx=True, px=ttl_ms):
            return index
    raise IdentityError(f"every one of {max_index} `{worker}` identities is taken")


def renew(
    client: redis.Redis, keys: Keys, worker: str, index: int, holder: str, ttl_s: float
) -> bool:
    """Renew (or, lapsed, take again) slot `worker-index` for `holder`; False when another
    holder has it. WATCH/MULTI, not a script: every role may run it (streamrl.run.acl)."""
    key = keys.worker_slot(worker, index)
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                current = pipe.get(key)
                if current is not None and current != holder.encode():
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.set(key, holder, px=int(ttl_s * 1000))
                pipe.execute()
                return True
            except redis.WatchError:
                continue  # the slot changed between GET and EXEC: look again


def slots_held(client: redis.Redis, keys: Keys, worker: str) -> dict[int, str]:
    """Index -> holder of every live slot of worker type `worker`."""
    out: dict[int, str] = {}
    for start in range(0, MAX_INDEX, SCAN_BATCH):
        indices = range(start, min(start + SCAN_BATCH, MAX_INDEX))
        held = mget_bytes(client, [keys.worker_slot(worker, i) for i in indices])
        out.update({i: h.decode() for i, h in zip(indices, held, strict=True) if h is not None})
    return out


def holder_of(client: redis.Redis, keys: Keys, worker: str, index: int) -> str | None:
    """Who holds slot `worker-index` now (None: nobody, it lapsed)."""
    raw = client.get(keys.worker_slot(worker, index))
    return raw.decode() if isinstance(raw, bytes) else raw


class Heartbeat:
    """Renews a worker's slot every `ttl_s / 3` on a daemon thread until `stop` is set.
    When another holder has taken the slot (two processes claim one identity), `on_lost`
    is called once and the heartbeat ends. A Redis error is logged and retried next beat:
    the slot lapses only if Redis stays away for `ttl_s`. With `liveness`, every beat (at
    least every `liveness_s / 4`) also writes the beat key while the loop is live."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker: str,
        index: int,
        holder: str,
        log: structlog.stdlib.BoundLogger,
        on_lost: Callable[[], None],
        ttl_s: float = HEARTBEAT_TTL_S,
        liveness: Liveness | None = None,
        liveness_s: float = 300.0,
        run_id: Callable[[], str] | None = None,
        on_run_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.run_id = run_id  # the run this worker started in ("": not yet recorded)
        self.on_run_lost = on_run_lost
        self.client = client
        self.keys = keys
        self.worker = worker
        self.index = index
        self.holder = holder
        self.log = log
        self.on_lost = on_lost
        self.ttl_s = ttl_s
        self.liveness = liveness
        self.liveness_s = liveness_s
        self.every_s = ttl_s / 3 if liveness is None else min(ttl_s / 3, liveness_s / 4)
        self.stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self, take: bool = False) -> Heartbeat:
        """Beat once, then on the thread. `take`: the index was given (`streamrl up`
        assigns them, one process each), so the slot is taken whoever held it: the holder
        is this worker's dead predecessor, whose claim has not lapsed yet."""
        if take:
            key = self.keys.worker_slot(self.worker, self.index)
            before = self.client.set(key, self.holder, px=int(self.ttl_s * 1000), get=True)
            if isinstance(before, bytes) and before != self.holder.encode():
                self.log.info("identity_taken_over", slot=key, previous=before.decode())
        self._beat()
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop beating and give the slot up (a clean exit frees the index at once)."""
        self.stop.set()
        self._thread.join(timeout=5)
        key = self.keys.worker_slot(self.worker, self.index)
        try:
            if holder_of(self.client, self.keys, self.worker, self.index) == self.holder:
                self.client.delete(key)
        except redis.RedisError as err:
            self.log.warning("heartbeat_release_failed", error=str(err))

    def _beat(self) -> bool:
        if not self._same_run():
            return False
        if renew(self.client, self.keys, self.worker, self.index, self.holder, self.ttl_s):
            self.beats += 1
            if self.liveness is not None and self.liveness.live(self.liveness_s):
                self.client.set(
                    self.keys.worker_beat(self.worker, self.index),
                    f"{self.holder} {self.beats}",
                    px=int(self.liveness_s * 2000),  # only tidies up: the value is the beat
                )
            return True
        self.log.error(
            "identity_lost",
            slot=self.keys.worker_slot(self.worker, self.index),
            holder=holder_of(self.client, self.keys, self.worker, self.index),
        )
        self.on_lost()
        return False

    def _same_run(self) -> bool:
        """Whether Redis still holds the run this worker recorded at start (review N8);
        once not, `on_run_lost` is called with the reason and the heartbeat ends."""
        expected = self.run_id() if self.run_id is not None else ""
        if not expected:
            return True
        found = incarnation.current(self.client, self.keys)
        if found == expected:
            return True
        reason = incarnation.lost_reason(self.keys, expected, found)
        self.log.error("run_lost", key=self.keys.run_id, expected=expected, found=found)
        if self.on_run_lost is not None:
            self.on_run_lost(reason)
        return False

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                if not self._beat():
                    return
            except redis.RedisError as err:
                self.log.warning("heartbeat_failed", error=f"{type(err).__name__}: {err}")
