"""The run's incarnation: noticing that Redis lost the run (review N8).

A Redis that comes back empty (an external one without persistence, a failover to a replica
without the data, a lost volume, a FLUSHALL) used to be noticed by nobody: workers recreated
empty consumer groups and the feeder wrote the data set again from cursor 0, so groups were
trained twice and the run's counters, versions and partial groups were gone.

Now a run has an id (`Keys.run_id`, random), written when the run is created: by
`streamrl up` before its workers start, else (compose) by the trainer at its start. It is in
every checkpoint's queue snapshot and comes back with it. Every worker records the id at
start (waiting for it where the trainer writes it) and its heartbeat compares it each beat;
the trainer compares before every publication, checkpoint and acknowledgement, the feeder
before every fill. Once the id is gone or changed, the worker stops at once with a fatal
error (RunLostError, exit 3) and writes nothing more: `streamrl up` stops the run saying
why, and `streamrl up --resume` restores the queues from the newest checkpoint. In compose,
the restarted trainer finds its checkpoints and no id, and restores the queues itself
(`streamrl.trainer.resume.restore_queues`); the other workers wait for the id to come back.
"""

from __future__ import annotations

import threading
import uuid

import redis
import structlog

from streamrl.errors import FatalError
from streamrl.names import Keys
from streamrl.transport import as_str

WAIT_POLL_S = 0.2
WAIT_LOG_S = 30.0  # a worker still waiting for its run says so this often


class RunLostError(FatalError):
    """Redis no longer holds the run this worker started in."""


def lost_reason(keys: Keys, expected: str, found: str | None) -> str:
    """Why a worker that started in run `expected` must stop, seeing `found` now."""
    now = "is gone" if found is None else f"was replaced by {found}"
    return (
        f"Redis lost the run: its id {keys.run_id} ({expected or 'none'}) {now}. Its "
        "queues, counters and versions went with it; this worker stops rather than start "
        "the run's data again. Restore the queues from the newest checkpoint: `streamrl up "
        "--resume RUN_DIR`, or in compose restart the trainer (it restores them), then the "
        "other workers"
    )


def current(client: redis.Redis, keys: Keys) -> str | None:
    """The run's id now (None: Redis holds none)."""
    raw = client.get(keys.run_id)
    return None if raw is None else as_str(raw)


def create(client: redis.Redis, keys: Keys) -> str:
    """The run's id, written first if Redis holds none (SET NX: two creators agree)."""
    client.set(keys.run_id, uuid.uuid4().hex, nx=True)
    found = current(client, keys)
    if found is None:  # deleted in between: the caller goes on with none recorded
        raise RunLostError(lost_reason(keys, "", None))
    return found


def check(client: redis.Redis, keys: Keys, expected: str) -> None:
    """RunLostError unless Redis still holds run `expected`."""
    found = current(client, keys)
    if found != expected:
        raise RunLostError(lost_reason(keys, expected, found))


def wait_for(
    client: redis.Redis, keys: Keys, stop: threading.Event, log: structlog.stdlib.BoundLogger
) -> str | None:
    """The run's id once Redis holds it (the launcher, or the trainer, writes it); None
    when stopped first."""
    waited = 0.0
    while not stop.is_set():
        found = current(client, keys)
        if found is not None:
            return found
        if waited % WAIT_LOG_S < WAIT_POLL_S:
            log.info("waiting_for_run", key=keys.run_id, waited_s=round(waited, 1))
        stop.wait(WAIT_POLL_S)
        waited += WAIT_POLL_S
    return None
