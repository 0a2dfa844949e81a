"""Delivery guarantees against a real redis-server."""

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from streamrl.config import TransportConfig
from streamrl.names import Keys
from streamrl.transport import RedisStreamConsumer, as_str, publish
from streamrl.wire import DeadLetter, Task, decode
from tests.conftest import entries

FAST = TransportConfig(block_ms=10, claim_idle_ms=100, claim_every_ms=10, max_deliveries=2)


def _task(i: int) -> Task:
    return Task(
        task_id=f"t{i}",
        group_id=f"g{i}",
        kind="arithmetic",
        prompt="p",
        answer="1",
        num_generations=2,
        cursor=i,
    )


def _consumer(rclient: redis.Redis, keys: Keys, name: str) -> RedisStreamConsumer[Task]:
    return RedisStreamConsumer(rclient, keys, keys.tasks, "cg", name, Task, FAST)


MODES = pytest.mark.parametrize("mode", ["sync", "async"])


def _read(c: RedisStreamConsumer[Task], mode: str, url: str, **kw: Any) -> list[Any]:
    """`c.read(**kw)`, or the same through `aread` on an asyncio client."""
    if mode == "sync":
        return c.read(**kw)

    async def go() -> list[Any]:
        aclient = aioredis.Redis.from_url(url)
        try:
            return await c.aread(aclient, **kw)
        finally:
            await aclient.aclose()

    return asyncio.run(go())


def _pending(rclient: redis.Redis, keys: Keys) -> int:
    return int(rclient.xpending(keys.tasks, "cg")["pending"])


def test_ack_only_after_output(rclient: redis.Redis, keys: Keys) -> None:
    c = _consumer(rclient, keys, "a")
    publish(rclient, keys.tasks, _task(1))
    [d] = c.read()
    assert d.msg.task_id == "t1" and d.deliveries == 1
    # Read but not committed: still pending, nothing written downstream.
    assert _pending(rclient, keys) == 1
    out = keys.scratch("out")
    assert rclient.xlen(out) == 0
    c.commit([d.entry_id], [(out, _task(2))])
    assert _pending(rclient, keys) == 0
    [(_, fields)] = entries(rclient, out)
    assert decode(fields, Task).task_id == "t2"


@MODES
def test_commit_is_one_transaction(
    rclient: redis.Redis, redis_url: str, keys: Keys, mode: str
) -> None:
    c = _consumer(rclient, keys, "a")
    publish(rclient, keys.tasks, _task(1))
    [d] = c.read()
    out = [(keys.scratch("out"), _task(2))]

    async def acommit() -> None:
        aclient = aioredis.Redis.from_url(redis_url)
        try:
            await c.acommit(aclient, [d.entry_id], out)
        finally:
            await aclient.aclose()

    # Watch what the server receives: output and ack must sit inside one MULTI/EXEC.
    monitor_client = redis.Redis(connection_pool=rclient.connection_pool)
    with monitor_client.monitor() as m:
        if mode == "sync":
            c.commit([d.entry_id], out)
        else:
            asyncio.run(acommit())
        seen: list[str] = []
        while not seen or seen[-1] != "EXEC":
            seen.append(str(m.next_command()["command"]).split()[0].upper())
    assert seen[-4:] == ["MULTI", "XADD", "XACK", "EXEC"]


@MODES
def test_claim_from_dead_consumer(
    rclient: redis.Redis, redis_url: str, keys: Keys, mode: str
) -> None:
    dead = _consumer(rclient, keys, "dead")
    publish(rclient, keys.tasks, _task(1))
    [d] = _read(dead, mode, redis_url)
    # `dead` never commits. Before the idle timeout nobody else gets the entry...
    alive = _consumer(rclient, keys, "alive")
    assert _read(alive, mode, redis_url, block_ms=1) == []
    time.sleep(0.15)
    alive._next_claim = 0.0
    [again] = _read(alive, mode, redis_url, block_ms=1)
    assert again.entry_id == d.entry_id and again.deliveries == 2
    alive.commit([again.entry_id])
    assert _pending(rclient, keys) == 0


def _dead_letters(rclient: redis.Redis, keys: Keys) -> list[DeadLetter]:
    return [decode(f, DeadLetter) for _, f in entries(rclient, keys.dead)]


@MODES
def test_undecodable_entry_goes_to_dead_letters(
    rclient: redis.Redis, redis_url: str, keys: Keys, mode: str
) -> None:
    c = _consumer(rclient, keys, "a")
    rclient.xadd(keys.tasks, {"v": "1", "kind": "task", "data": b"\xc1garbage"})
    rclient.xadd(keys.tasks, {"v": "7", "kind": "task", "data": b"x"})
    rclient.xadd(keys.tasks, {"hello": "world"})
    publish(rclient, keys.tasks, _task(2))
    out = _read(c, mode, redis_url)
    assert [d.msg.task_id for d in out] == ["t2"]  # the good entry still comes through
    letters = _dead_letters(rclient, keys)
    assert [dl.reason.split(":")[0] for dl in letters] == [
        "cannot decode task body",
        "schema version '7' != 1 expected",
        "missing schema version field `v`",
    ]
    assert all(dl.source == keys.tasks for dl in letters)
    assert letters[0].fields["data"] == b"\xc1garbage"  # the payload is kept for replay
    assert int(rclient.hget(keys.stats, "dead_letters") or 0) == 3
    # Dead-lettered entries are acknowledged; only the good one is pending.
    assert _pending(rclient, keys) == 1


@MODES
def test_too_many_deliveries_go_to_dead_letters(
    rclient: redis.Redis, redis_url: str, keys: Keys, mode: str
) -> None:
    publish(rclient, keys.tasks, _task(1))
    names = ["c1", "c2", "c3"]
    got = []
    for name in names:
        c = _consumer(rclient, keys, name)
        time.sleep(0.15)
        got.append(_read(c, mode, redis_url, block_ms=1))
    # delivered to c1 (1), claimed by c2 (2 = max_deliveries), claimed by c3 (3 > 2): dead
    assert [len(g) for g in got] == [1, 1, 0]
    [letter] = _dead_letters(rclient, keys)
    assert letter.reason == "delivered 3 times, more than max_deliveries (2)"
    assert letter.deliveries == 3
    assert _pending(rclient, keys) == 0


@MODES
def test_every_claimed_entry_is_checked_against_max_deliveries(
    rclient: redis.Redis, keys: Keys, redis_url: str, mode: str
) -> None:
    """Review L7: the delivery count of each claimed id is its own, even when the claiming
    consumer owns many other pending entries between the ids it claims (they used to push
    a claimed id off the one XPENDING page read, and it counted as a first delivery)."""
    cfg = TransportConfig(block_ms=10, claim_idle_ms=60_000, claim_every_ms=10, max_deliveries=5)
    c = RedisStreamConsumer(rclient, keys, keys.tasks, "cg", "b", Task, cfg)
    ids = [as_str(publish(rclient, keys.tasks, _task(i))) for i in range(32)]
    rclient.xreadgroup("cg", "a", {keys.tasks: ">"}, count=1)  # ids[0]: a, which died
    rclient.xreadgroup("cg", "b", {keys.tasks: ">"}, count=30)  # ids[1:31]: b, working
    rclient.xreadgroup("cg", "a", {keys.tasks: ">"}, count=1)  # ids[31]: a
    for eid in (ids[0], ids[31]):  # long idle, delivered 10 times already
        rclient.xclaim(keys.tasks, "cg", "a", 0, [eid], idle=120_000, retrycount=10)
    assert _read(c, mode, redis_url) == []  # both past max_deliveries: dead letters
    dead = [decode(f, DeadLetter) for _, f in entries(rclient, keys.dead)]
    assert sorted(d.entry_id for d in dead) == [ids[0], ids[31]]
    assert all(d.deliveries == 11 for d in dead)


def test_blocking_reads_outlast_redis_py_default_socket_timeout(redis_url: str) -> None:
    """The workers' clients wait out a blocking read longer than redis-py 8's default
    socket timeout (5 s): a tool result's BLPOP (time_limit_s + result_margin_s, 8 s by
    default) returns None at its own timeout, and a 6 s XREAD BLOCK returns empty. With
    the default they raised TimeoutError after 5 s, retried 30 times: a lost tool call was
    noticed after minutes."""
    from streamrl.transport import make_async_client, make_client

    wait_s = 6

    async def blpop() -> tuple[Any, float]:
        aclient = make_async_client(redis_url)
        start = time.monotonic()
        try:
            got = await aclient.blpop(["nothing"], timeout=wait_s)
        finally:
            await aclient.aclose()
        return got, time.monotonic() - start

    async def both() -> tuple[tuple[Any, float], tuple[Any, float]]:
        def xread() -> tuple[Any, float]:
            client = make_client(redis_url)
            start = time.monotonic()
            try:
                got = client.xread({"nothing-stream": "$"}, block=wait_s * 1000)
            finally:
                client.close()
            return got, time.monotonic() - start

        return await asyncio.gather(blpop(), asyncio.to_thread(xread))

    (got, took), (read, read_took) = asyncio.run(both())
    assert got is None and wait_s - 0.5 <= took < wait_s + 3
    assert not read and wait_s - 0.5 <= read_took < wait_s + 3


def test_a_caller_may_still_set_a_socket_timeout(redis_url: str) -> None:
    """`streamrl status` and the health check give their one-shot clients a short socket
    timeout of their own (a kwarg over the shared options, not a second keyword)."""
    from streamrl.transport import make_async_client, make_client

    client = make_client(redis_url, socket_timeout=2)
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 2 and client.ping()
    client.close()
    aclient = make_async_client(redis_url, socket_timeout=3)
    assert aclient.connection_pool.connection_kwargs["socket_timeout"] == 3
    assert make_client(redis_url).connection_pool.connection_kwargs["socket_timeout"] is None
