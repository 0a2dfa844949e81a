"""Replica identities and heartbeats against a real Redis (streamrl.run.identity)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis
import structlog

from streamrl.names import Keys
from streamrl.run.identity import HEARTBEAT_TTL_S, Heartbeat, claim_index, holder_of, renew
from streamrl.run.liveness import Liveness
from streamrl.transport import make_client

LOG = structlog.get_logger()


def test_replicas_get_distinct_indices_and_a_restart_keeps_its_own(
    rclient: redis.Redis, keys: Keys
) -> None:
    a, b, c = (claim_index(rclient, keys, "tools", h, ttl_s=30) for h in ("ca", "cb", "cc"))
    assert (a, b, c) == (0, 1, 2)
    assert claim_index(rclient, keys, "grouper", "ca", ttl_s=30) == 0  # per worker type
    # cb's container restarts (same hostname): it takes index 1 again at once
    assert claim_index(rclient, keys, "tools", "cb", ttl_s=30) == 1
    # ca exits cleanly and frees 0; a new replica takes the lowest free index, while a
    # restarted cc still finds its own, higher one first
    rclient.delete(keys.worker_slot("tools", 0))
    assert claim_index(rclient, keys, "tools", "cc", ttl_s=30) == 2
    assert claim_index(rclient, keys, "tools", "cd", ttl_s=30) == 0


def test_racing_replicas_never_share_an_index(redis_url: str, keys: Keys) -> None:
    got: list[int] = []
    lock = threading.Lock()

    def claim(holder: str) -> None:
        client = make_client(redis_url)
        index = claim_index(client, keys, "rollout", holder, ttl_s=30)
        with lock:
            got.append(index)

    threads = [threading.Thread(target=claim, args=(f"h{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(8))


def test_heartbeat_keeps_the_slot_and_lapses_when_it_stops(
    rclient: redis.Redis, keys: Keys
) -> None:
    index = claim_index(rclient, keys, "feeder", "me", ttl_s=0.6)
    beat = Heartbeat(rclient, keys, "feeder", index, "me", LOG, on_lost=lambda: None, ttl_s=0.6)
    beat.start()
    time.sleep(1.5)  # several TTLs: only the beats keep the slot
    assert holder_of(rclient, keys, "feeder", index) == "me" and beat.beats >= 3
    beat.stop.set()  # a hung or dead worker stops beating ...
    time.sleep(1.0)
    assert holder_of(rclient, keys, "feeder", index) is None  # ... and its slot lapses


def test_a_stolen_identity_is_reported(rclient: redis.Redis, keys: Keys) -> None:
    lost = threading.Event()
    index = claim_index(rclient, keys, "trainer", "first", ttl_s=0.6)
    beat = Heartbeat(rclient, keys, "trainer", index, "first", LOG, on_lost=lost.set, ttl_s=0.6)
    beat.start()
    rclient.set(keys.worker_slot("trainer", index), "second")  # another process took it
    assert lost.wait(2.0)
    assert not renew(rclient, keys, "trainer", index, "first", 0.6)
    beat.close()  # does not delete the other holder's claim
    assert holder_of(rclient, keys, "trainer", index) == "second"


def test_close_releases_the_slot(rclient: redis.Redis, keys: Keys) -> None:
    index = claim_index(rclient, keys, "grouper", "me", ttl_s=30)
    Heartbeat(rclient, keys, "grouper", index, "me", LOG, on_lost=lambda: None).start().close()
    assert holder_of(rclient, keys, "grouper", index) is None


def test_a_given_index_takes_its_slot_from_a_dead_predecessor(
    rclient: redis.Redis, keys: Keys
) -> None:
    """`streamrl up` restarts a crashed worker with the same index at once: its slot still
    names the dead process (the TTL has not run out), and must not stop the new one."""
    rclient.set(keys.worker_slot("grouper", 0), "host:111", px=30_000)  # the dead one
    lost = threading.Event()
    beat = Heartbeat(rclient, keys, "grouper", 0, "host:222", LOG, lost.set, ttl_s=0.6)
    beat.start(take=True)
    time.sleep(0.5)
    assert not lost.is_set() and holder_of(rclient, keys, "grouper", 0) == "host:222"
    beat.close()
    # without `take` (an --index auto replica) a held slot is another's: reported as lost
    rclient.set(keys.worker_slot("grouper", 1), "host:111", px=30_000)
    other = Heartbeat(rclient, keys, "grouper", 1, "host:333", LOG, lost.set, ttl_s=0.6)
    other.start()
    assert lost.is_set()
    other.close()


def test_the_liveness_beat_follows_the_loop_not_the_thread(
    rclient: redis.Redis, keys: Keys
) -> None:
    """The beat key changes while the worker starts, while its loop ticks and during a busy
    step; it stops when the loop stops ticking, though the heartbeat thread runs on (and
    the identity slot stays renewed)."""
    alive = Liveness()
    beat_key = keys.worker_beat("feeder", 7)

    def beats_within(s: float) -> set[bytes]:
        seen: set[bytes] = set()
        end = time.monotonic() + s
        while time.monotonic() < end:
            value = rclient.get(beat_key)
            if value is not None:
                seen.add(value)  # type: ignore[arg-type]
            time.sleep(0.05)
        return seen

    beat = Heartbeat(
        rclient, keys, "feeder", 7, "host:7", LOG, lambda: None, 30, alive, liveness_s=0.8
    ).start(take=True)
    try:
        assert len(beats_within(0.7)) >= 2  # starting: no tick yet, live
        alive.tick()
        assert len(beats_within(0.5)) >= 2  # the loop just ticked
        time.sleep(0.9)  # the loop stops ticking: the beat stops
        assert len(beats_within(1.0)) == 1
        assert holder_of(rclient, keys, "feeder", 7) == "host:7"  # identity kept
        with alive.busy():  # a long step: live again
            assert len(beats_within(1.0)) >= 2
        assert bytes(rclient.get(beat_key)).startswith(b"host:7 ")  # type: ignore[arg-type]
    finally:
        beat.close()


def test_replicas_on_the_host_network_get_distinct_holders() -> None:
    """Review N22: under compose's `network_mode: host` every replica has the host's name
    and, with `init: true`, the same pid, so `<host name>:<pid>` named two replicas alike.
    Two real containers on the host network each find their own container id in their
    mount table, which the holder id then carries."""
    from streamrl.run.identity import container_id
    from streamrl.tools.containers import DEFAULT_IMAGE
    from tests.helpers import sandbox_engine

    engine = sandbox_engine()
    found: dict[str, str | None] = {}
    try:
        for _ in range(2):
            box = engine.containers.run(
                DEFAULT_IMAGE, ["cat", "/proc/self/mountinfo"], network_mode="host", detach=True
            )
            try:
                box.wait(timeout=60)
                found[str(box.id)] = container_id(box.logs(stdout=True, stderr=False).decode())
            finally:
                box.remove(force=True)
    finally:
        engine.close()
    assert len(found) == 2
    assert all(cid == seen for cid, seen in found.items())  # each its own id
    assert container_id("") is None  # outside a container: hostname:pid as before


def test_the_fence_takes_back_a_lapsed_slot_and_refuses_a_taken_one(
    redis_url: str, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's fence (`WorkerContext.holds_identity`) asks before each hook whether
    another trainer took its identity. A trainer paused past the slot's TTL (SIGSTOP, a long
    GC, a swapped-out host) finds its slot lapsed, not taken: nobody else is the trainer, so
    it takes the slot back and goes on, as its heartbeat thread would a moment later. (It
    read the lapse as a takeover and stopped, fatal, when its main thread asked before the
    heartbeat thread renewed: a CI run of test_stalled_trainer_pauses_rollout, paused 18 s
    against the 15 s TTL.) A slot that names another holder still fences it."""
    from streamrl.config import load_config
    from streamrl.run.runtime import make_context
    from tests.helpers import TINY

    monkeypatch.setenv("REDIS_URL", redis_url)
    ctx = make_context("trainer", 0, load_config(TINY, overrides=[f"run.name={keys.ns}"]),
                       tmp_path)  # fmt: skip
    ctx.holder = "host:1"
    client = make_client(redis_url)
    slot = keys.worker_slot("trainer", 0)
    client.set(slot, "host:1", px=30_000)
    assert ctx.holds_identity(client)
    client.delete(slot)  # the TTL ran out while the process was stopped
    assert ctx.holds_identity(client)
    assert holder_of(client, keys, "trainer", 0) == "host:1"  # taken back, with a TTL
    assert 0 < int(client.pttl(slot)) <= HEARTBEAT_TTL_S * 1000
    client.set(slot, "host:2", px=30_000)  # a second trainer took it over
    assert not ctx.holds_identity(client)
    assert holder_of(client, keys, "trainer", 0) == "host:2"  # left to that one
