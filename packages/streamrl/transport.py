"""Redis streams with consumer groups: at-least-once delivery that loses nothing.

- An input entry is acknowledged only in the same MULTI/EXEC that writes its outputs
  (`commit`); a consumer whose output is durable later (the trainer's checkpoint) acks then.
- Entries pending on a consumer that stopped answering are claimed with XAUTOCLAIM once
  they have been idle for `claim_idle_ms`.
- An entry that cannot be decoded or carries another schema version moves to the
  dead-letter stream with its reason, acknowledged in the same transaction; so does one
  claimed after more than `max_deliveries` deliveries (the count is checked on a claim).
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypedDict, TypeVar, cast

import redis
import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.typing import EncodableT, FieldT, StreamRangeResponse

from streamrl import counters
from streamrl.config import TransportConfig
from streamrl.names import Keys
from streamrl.wire import DeadLetter, Message, WireError, decode, encode, raw_fields

M = TypeVar("M", bound=Message)
T = TypeVar("T")
R = TypeVar("R")

Pipeline = redis.client.Pipeline | aioredis.client.Pipeline  # a transaction, sync or asyncio
PipelineOp = Callable[[Pipeline], None]


@dataclass(frozen=True)
class Delivery(Generic[M]):
    """One decoded entry handed to a consumer."""

    entry_id: str
    msg: M
    deliveries: int


class Consumer(Protocol[M]):
    """What a worker needs from its input stream; RedisStreamConsumer is the real one."""

    def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery[M]]: ...

    def commit(
        self,
        entry_ids: Sequence[str],
        outputs: Sequence[tuple[str, Message]] = (),
        extra: PipelineOp | None = None,
    ) -> None: ...


def ensure_group(client: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Create a consumer group (and its stream) unless it exists."""
    try:
        client.xgroup_create(stream, group, id=start_id, mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


def publish(client: redis.Redis | Pipeline, stream: str, msg: Message) -> object:
    """Append one message to a stream; returns its entry id (or the pipeline)."""
    fields: dict[FieldT, EncodableT] = {k: v for k, v in encode(msg).items()}
    return client.xadd(stream, fields)


def as_str(x: object) -> str:
    """A reply's field as text (bytes decoded; an int or a str as it is written)."""
    return x.decode() if isinstance(x, bytes) else str(x)


# -- typed replies ---------------------------------------------------------------------
# redis-py types a reply's strings `bytes | str` (str only with decode_responses, which no
# client here sets), a stream entry's fields as possibly None (an entry deleted while
# pending) and an empty range as None. These read replies as the callers use them: text
# where they decode, bytes where they decode a message or a number.

RawFields = dict[bytes | str, bytes | str]  # a stream entry's fields, as redis-py types them
Entry = tuple[str, RawFields]  # a stream entry: its id (as text) and its fields
# An entry of an XREADGROUP or XAUTOCLAIM reply: no fields for one deleted while pending.
ReadEntry = tuple[bytes | str, RawFields | None]


class _AutoclaimArgs(TypedDict):
    """XAUTOCLAIM's arguments (`RedisStreamConsumer._autoclaim_args`)."""

    name: str
    groupname: str
    consumername: str
    min_idle_time: int
    start_id: str
    count: int


def as_bytes(x: bytes | str) -> bytes:
    """A reply's string as bytes (as our clients return it)."""
    return x if isinstance(x, bytes) else x.encode()


def _maybe_bytes(x: bytes | str | None) -> bytes | None:
    return None if x is None else as_bytes(x)


def _entries(reply: StreamRangeResponse | None) -> list[Entry]:
    """XRANGE/XREVRANGE entries (never deleted ones: their fields are there)."""
    return [(as_str(eid), fields or {}) for eid, fields in reply or ()]


def hgetall_str(client: redis.Redis, key: str) -> dict[str, str]:
    """HGETALL, fields and values as text."""
    return {as_str(k): as_str(v) for k, v in client.hgetall(key).items()}


def hgetall_bytes(client: redis.Redis, key: str) -> dict[str, bytes]:
    """HGETALL, fields as text and values as stored (bytes)."""
    return {as_str(k): as_bytes(v) for k, v in client.hgetall(key).items()}


def hvals_bytes(client: redis.Redis, key: str) -> list[bytes]:
    """HVALS, as stored (bytes)."""
    return [as_bytes(v) for v in client.hvals(key)]


def mget_bytes(client: redis.Redis, keys: Sequence[str]) -> list[bytes | None]:
    """MGET: each key's value as stored, None where it is missing."""
    return [_maybe_bytes(v) for v in client.mget(keys)]


def xrange_entries(
    client: redis.Redis, stream: str, start: str = "-", end: str = "+", count: int | None = None
) -> list[Entry]:
    """XRANGE of `stream` from `start` to `end` (at most `count` entries)."""
    return _entries(client.xrange(stream, start, end, count=count))


def xrevrange_entries(client: redis.Redis, stream: str, count: int | None = None) -> list[Entry]:
    """The last `count` entries of `stream` (all without it), newest first."""
    return _entries(client.xrevrange(stream, count=count))


async def aget_bytes(aclient: aioredis.Redis, key: str) -> bytes | None:
    """GET on an asyncio client: the value as stored, None where it is missing."""
    return _maybe_bytes(await aclient.get(key))


async def ahmget_bytes(
    aclient: aioredis.Redis, key: str, fields: Sequence[str]
) -> list[bytes | None]:
    """HMGET on an asyncio client: each field's value as stored, None where it is missing."""
    return [_maybe_bytes(v) for v in await aclient.hmget(key, list(fields))]


async def ahkeys_str(aclient: aioredis.Redis, key: str) -> list[str]:
    """HKEYS on an asyncio client, as text."""
    return [as_str(f) for f in await aclient.hkeys(key)]


async def axrevrange_entries(
    aclient: aioredis.Redis, stream: str, count: int | None = None
) -> list[Entry]:
    """`xrevrange_entries` on an asyncio client."""
    return _entries(await aclient.xrevrange(stream, count=count))


class RedisStreamConsumer(Generic[M]):
    """A named consumer in a consumer group of one stream, decoding entries as `cls`."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        stream: str,
        group: str,
        consumer: str,
        cls: type[M],
        cfg: TransportConfig,
        log: structlog.stdlib.BoundLogger | None = None,
        *,
        claim: bool = True,
        pending_first: bool = False,
    ) -> None:
        self.client = client
        self.keys = keys
        self.stream = stream
        self.group = group
        self.name = consumer
        self.cls = cls
        self.cfg = cfg
        self.claim = claim
        # Entries this consumer name read before a restart and never acknowledged: a fixed
        # consumer name (the trainer's) reads them again first, from id 0.
        self._read_from = "0" if pending_first else ">"
        self.log = (log or structlog.get_logger()).bind(stream=stream, consumer=consumer)
        self._next_claim = 0.0
        self._claim_cursor = "0-0"
        ensure_group(client, stream, group)

    # -- reading ---------------------------------------------------------------------------

    def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery[M]]:
        """Claimed idle entries first, then new ones; bad entries go to the dead letters."""
        count = count or self.cfg.read_count
        out: list[Delivery[M]] = []
        if self._claim_due():
            claim = self.client.xautoclaim(**self._autoclaim_args(count))
            out.extend(self._claimed(claim[0], claim[1]))
            if out:
                return out
        block = self.cfg.block_ms if block_ms is None else block_ms
        history = self._read_from != ">"
        resp: Any = self.client.xreadgroup(
            self.group,
            self.name,
            {self.stream: self._read_from},
            count=count,
            block=None if history else (block or None),
        )
        entries = [e for _stream, es in resp or [] for e in es]
        if history:
            if not entries:
                self._read_from = ">"
                return self.read(count, block_ms)
            self._read_from = as_str(entries[-1][0])
        out.extend(self._decode_entries(entries, 1 if not history else 2))
        return out

    async def aread(
        self, aclient: aioredis.Redis, count: int | None = None, block_ms: int | None = None
    ) -> list[Delivery[M]]:
        """`read` on an asyncio client: the same claims, history and dead letters, without
        a thread. (A busy event loop holds the GIL: a thread that must take it back several
        times per round trip waits up to the 5 ms switch interval each time, which made a
        rollout worker's reads 20 ms long at 800 episodes/s.) The rare writes (dead
        letters, acknowledging deleted entries) stay synchronous, on a thread."""
        count = count or self.cfg.read_count
        if self._claim_due():
            claim = await aclient.xautoclaim(**self._autoclaim_args(count))
            if claim[1]:
                claimed = await asyncio.to_thread(self._claimed, claim[0], claim[1])
                if claimed:
                    return claimed
            else:
                self._claim_cursor = as_str(claim[0])
        block = self.cfg.block_ms if block_ms is None else block_ms
        if self._read_from != ">":  # the history is read once, at start: the sync path
            return await asyncio.to_thread(self.read, count, block_ms)
        resp: Any = await aclient.xreadgroup(
            self.group, self.name, {self.stream: ">"}, count=count, block=block or None
        )
        entries = [e for _stream, es in resp or [] for e in es]
        if any(fields is None for _, fields in entries):
            return await asyncio.to_thread(self._decode_entries, entries, 1)
        return self._decode_entries(entries, 1)

    def _decode_entries(self, entries: Sequence[ReadEntry], deliveries: int) -> list[Delivery[M]]:
        out: list[Delivery[M]] = []
        for entry_id, fields in entries:
            if fields is None:  # 6.2 answers a deleted-but-pending entry with no fields
                self.client.xack(self.stream, self.group, entry_id)
                continue
            d = self._decode(as_str(entry_id), fields, deliveries=deliveries)
            if d is not None:
                out.append(d)
        return out

    async def acommit(
        self,
        aclient: aioredis.Redis,
        entry_ids: Sequence[str],
        outputs: Sequence[tuple[str, Message]] = (),
        extra: PipelineOp | None = None,
    ) -> None:
        """`commit` on an asyncio client (one MULTI/EXEC, no thread)."""
        pipe = aclient.pipeline(transaction=True)
        self._stage_commit(pipe, entry_ids, outputs, extra)
        await pipe.execute()

    def _claim_due(self) -> bool:
        """Whether to look for idle entries now (at most every `claim_every_ms`)."""
        if not self.claim or time.monotonic() < self._next_claim:
            return False
        self._next_claim = time.monotonic() + self.cfg.claim_every_ms / 1000
        return True

    def _autoclaim_args(self, count: int) -> _AutoclaimArgs:
        """XAUTOCLAIM of up to `count` entries idle past `claim_idle_ms`, from the cursor."""
        return {
            "name": self.stream,
            "groupname": self.group,
            "consumername": self.name,
            "min_idle_time": self.cfg.claim_idle_ms,
            "start_id": self._claim_cursor,
            "count": count,
        }

    def _claimed(self, cursor: bytes | str, claimed: Sequence[ReadEntry]) -> list[Delivery[M]]:
        """Deliveries of an XAUTOCLAIM reply (its cursor and entries): counted,
        dead-lettered past max_deliveries."""
        self._claim_cursor = as_str(cursor)
        entries = [(as_str(eid), fields) for eid, fields in claimed]
        if not entries:
            return []
        counts = self._delivery_counts([eid for eid, _ in entries])
        out: list[Delivery[M]] = []
        for entry_id, fields in entries:
            deliveries = counts.get(entry_id, 1)
            if fields is None:  # deleted from the stream while pending
                self.client.xack(self.stream, self.group, entry_id)
                continue
            self.log.warning("claimed_idle_entry", entry_id=entry_id, deliveries=deliveries)
            if deliveries > self.cfg.max_deliveries:
                self.dead_letter(
                    entry_id,
                    fields,
                    f"delivered {deliveries} times, more than max_deliveries "
                    f"({self.cfg.max_deliveries})",
                    deliveries,
                )
                continue
            d = self._decode(entry_id, fields, deliveries)
            if d is not None:
                out.append(d)
        return out

    def _delivery_counts(self, ids: list[str]) -> dict[str, int]:
        """The delivery count of each of `ids` (just claimed), one XPENDING per id in one
        round trip: a range over them would also hold this consumer's other pending
        entries, and a page of it could leave some of `ids` out."""
        pipe = self.client.pipeline(transaction=False)
        for eid in ids:
            pipe.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
        rows = pipe.execute()
        return {as_str(r["message_id"]): int(r["times_delivered"]) for row in rows for r in row}

    def _decode(self, entry_id: str, fields: RawFields, deliveries: int) -> Delivery[M] | None:
        try:
            msg = decode(fields, self.cls)
        except WireError as err:
            self.dead_letter(entry_id, fields, str(err), deliveries)
            return None
        return Delivery(entry_id=entry_id, msg=msg, deliveries=deliveries)

    # -- writing ---------------------------------------------------------------------------

    def commit(
        self,
        entry_ids: Sequence[str],
        outputs: Sequence[tuple[str, Message]] = (),
        extra: PipelineOp | None = None,
    ) -> None:
        """Write `outputs` (and `extra` commands) and acknowledge `entry_ids`, atomically."""
        pipe = self.client.pipeline(transaction=True)
        self._stage_commit(pipe, entry_ids, outputs, extra)
        pipe.execute()

    def _stage_commit(
        self,
        pipe: Pipeline,
        entry_ids: Sequence[str],
        outputs: Sequence[tuple[str, Message]],
        extra: PipelineOp | None,
    ) -> None:
        """Queue a commit's commands on `pipe` (a transaction, sync or asyncio)."""
        for stream, msg in outputs:
            publish(pipe, stream, msg)
        if extra is not None:
            extra(pipe)
        if entry_ids:
            pipe.xack(self.stream, self.group, *entry_ids)

    def touch(self, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries this consumer is still working on, so that a long
        job is not claimed by others as if its consumer had died (XCLAIM ... JUSTID keeps the
        delivery count)."""
        if entry_ids:
            self.client.xclaim(
                self.stream,
                self.group,
                self.name,
                min_idle_time=0,
                message_ids=list(entry_ids),
                justid=True,
            )

    def dead_letter(self, entry_id: str, fields: RawFields, reason: str, deliveries: int) -> None:
        """Move an entry to the dead-letter stream with its reason (and ack it)."""
        letter = DeadLetter(
            source=self.stream,
            entry_id=entry_id,
            reason=reason,
            fields=raw_fields(fields),
            consumer=self.name,
            deliveries=deliveries,
        )
        self.commit([entry_id], extra=lambda p: stage_dead_letter(p, self.keys, letter))
        self.log.error("dead_letter", entry_id=entry_id, reason=reason, deliveries=deliveries)


def stage_dead_letter(pipe: Pipeline, keys: Keys, letter: DeadLetter) -> None:
    """Queue on `pipe` what every dead letter writes: the letter in `<run>:dead` and the
    count. Acknowledging its entry is the caller's part (at once, or with a checkpoint)."""
    publish(pipe, keys.dead, letter)
    pipe.hincrby(keys.stats, counters.DEAD_LETTERS, 1)


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as (ms, seq), for ordering ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# A worker rides out a Redis restart (the launcher brings a crashed server back from its
# AOF in about a second): each command is retried on connection errors with backoff (up
# to 1 s apart), about 20 s in all, before the error propagates and the worker restarts.
# Replies that say Redis is there but cannot serve yet, LOADING (a restarted server
# loading its AOF: minutes for a large one) and BUSY (a script past its time limit), are
# waited out for `busy_wait_s` (`redis.busy_wait_s`) instead of a count of tries.
_RETRIES = 30
_BACKOFF = ExponentialBackoff(cap=1.0, base=0.05)
BUSY_WAIT_S = 600.0
_MAX_BACKOFF_STEP = 16  # backoff(n) is capped long before: keeps 2**n a small number


def waits_out(err: BaseException) -> bool:
    """Whether `err` is a reply to wait out: LOADING, or BUSY (which redis-py raises as a
    plain ResponseError; BUSYGROUP and BUSYKEY are other errors)."""
    return isinstance(err, redis.BusyLoadingError) or (
        isinstance(err, redis.ResponseError) and _BUSY.search(str(err)) is not None
    )


# BUSY as the reply, or in a pipeline's error ("Command # 1 (...) of pipeline caused
# error: BUSY ...", "Transaction discarded because of: BUSY ...")
_BUSY = re.compile(r"(?:^|: )BUSY ")


class _Budget(Generic[R]):
    """What one command's retries have spent: connection errors by count, LOADING and BUSY
    by time since the first of them. `R`: what the client's `fail` returns."""

    def __init__(
        self,
        retry: WaitingRetry | AsyncWaitingRetry,
        fail: Callable[..., R],
        check: _Check,
        count: bool,
    ) -> None:
        retry.backoff.reset()
        self.retry = retry
        self.fail = fail  # the client's: disconnect (with the count of failures if `count`)
        self.check = check
        self.with_count = count
        self.failures = 0  # every failure (the backoff's step)
        self.errors = 0  # connection errors and timeouts
        self.busy_since: float | None = None

    def failed(self, error: Exception) -> R:
        """Count a failure and tell the client's `fail` (what it returns); raise `error`
        when it is no reply to retry."""
        if isinstance(error, redis.ResponseError) and not waits_out(error):
            raise error  # a real error reply (WRONGTYPE, NOGROUP, ...): never retried
        if self.check is not None and not self.check(error):
            raise error
        self.failures += 1
        if not waits_out(error):
            self.errors += 1
        elif self.busy_since is None:
            self.busy_since = time.monotonic()
        return self.fail(error, self.failures) if self.with_count else self.fail(error)

    def delay(self, error: Exception) -> float:
        """The wait before the next try; raise `error` when the budget is spent."""
        if waits_out(error):
            assert self.busy_since is not None
            spent = time.monotonic() - self.busy_since > self.retry.busy_wait_s
        else:
            retries = self.retry.get_retries()
            spent = retries >= 0 and self.errors > retries
        if spent:
            raise error
        return self.retry.backoff.compute(min(self.failures, _MAX_BACKOFF_STEP))


_RETRIED = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)
_Fail = Callable[..., object]  # what the client does after a failure (disconnect)
_AsyncFail = Callable[..., Awaitable[object]]  # `_Fail` of the asyncio client
_Check = Callable[[Exception], bool] | None  # the client's own test of an error


class WaitingRetry(Retry):
    """redis-py's Retry that also waits out LOADING and BUSY for `busy_wait_s` (`_Budget`)."""

    def __init__(self, backoff: ExponentialBackoff, retries: int, busy_wait_s: float) -> None:
        super().__init__(backoff, retries, (*_RETRIED, socket.timeout))
        self.backoff = backoff
        self.busy_wait_s = busy_wait_s

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: _Fail,
        is_retryable: _Check = None,
        with_failure_count: bool = False,
    ) -> T:
        budget = _Budget(self, fail, is_retryable, with_failure_count)
        while True:
            try:
                return do()
            except self._supported_errors as error:
                budget.failed(error)
                time.sleep(budget.delay(error))


class AsyncWaitingRetry(AsyncRetry):
    """The asyncio twin of `WaitingRetry`."""

    def __init__(self, backoff: ExponentialBackoff, retries: int, busy_wait_s: float) -> None:
        super().__init__(backoff, retries, _RETRIED)
        self.backoff = backoff
        self.busy_wait_s = busy_wait_s

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: _AsyncFail,
        is_retryable: _Check = None,
        with_failure_count: bool = False,
    ) -> T:
        budget = _Budget(self, fail, is_retryable, with_failure_count)
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                await budget.failed(error)
                await asyncio.sleep(budget.delay(error))


def _options(retry: Retry | AsyncRetry) -> dict[str, object]:
    """Connection options both clients share: timeouts that fit blocking stream reads,
    and `retry` on connection errors, LOADING and BUSY. No socket timeout: redis-py 8's
    default (5 s) cut every blocking read longer than that (a tool result's BLPOP waits
    time_limit_s + result_margin_s, 8 s by default; `transport.block_ms` may be 10 s) into
    timeouts retried 30 times, so a lost tool call was noticed after minutes, not 8 s; and
    the asyncio client then sends each command under asyncio.wait_for, which on Python
    3.11 can swallow a cancel (run/tasks.py)."""
    return {
        "socket_connect_timeout": 5,
        "socket_timeout": None,
        "health_check_interval": 30,
        "retry": retry,
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }


def _cluster_options(retry: Retry | AsyncRetry) -> dict[str, object]:
    """`_options` for a Redis Cluster client: the cluster retries a whole command (and
    re-routes it after a failover) on connection errors with `retry`; no socket timeout,
    as on a single server, so a blocking read (BLPOP, XREADGROUP BLOCK) outlasts 5 s."""
    return {"socket_connect_timeout": 5, "socket_timeout": None, "retry": retry}


def make_client(
    url: str,
    retries: int = _RETRIES,
    *,
    cluster: bool = False,
    busy_wait_s: float = BUSY_WAIT_S,
    **kwargs: object,
) -> redis.Redis:
    """A Redis client for `url` with timeouts that fit blocking stream reads, retrying
    commands across a short Redis outage (`retries` times, backoff up to 1 s) and LOADING
    or BUSY replies for `busy_wait_s`. A retried command whose first attempt did land
    (its reply was lost) runs twice: harmless for SET, HSET, XACK, the scripts' guarded
    writes; an `XADD *` in it adds a second entry (the consumers skip a repeated group,
    member, task or call by its id; a counter beside it counts twice). With `cluster`, a
    `RedisCluster` that discovers the cluster from the node `url` names (every key of a run
    is in one slot: `streamrl.names`)."""
    retry = WaitingRetry(_BACKOFF, retries, busy_wait_s)
    if cluster:
        # The commands, scripts and one-slot transactions the workers use are the same on
        # both; the callers' annotations name the single-server client.
        return cast(
            redis.Redis, RedisCluster.from_url(url, **{**_cluster_options(retry), **kwargs})
        )
    return redis.Redis.from_url(url, **{**_options(retry), **kwargs})


def make_async_client(
    url: str, *, cluster: bool = False, busy_wait_s: float = BUSY_WAIT_S, **kwargs: Any
) -> aioredis.Redis:
    """The asyncio twin of `make_client`."""
    retry = AsyncWaitingRetry(_BACKOFF, _RETRIES, busy_wait_s)
    if cluster:
        client = AsyncRedisCluster.from_url(url, **{**_cluster_options(retry), **kwargs})
        return cast(aioredis.Redis, client)
    return aioredis.Redis.from_url(url, **{**_options(retry), **kwargs})


def is_cluster(client: redis.Redis | aioredis.Redis) -> bool:
    """Whether `client` is a Redis Cluster client (see `make_client`)."""
    return isinstance(client, RedisCluster | AsyncRedisCluster)


# rq keeps its own keys (`rq:queue:...`, `rq:job:<id>`, ...) outside the run's hash slot
# and touches several in one transaction or script, which a cluster refuses (CROSSSLOT).
RQ_NEEDS_ONE_REDIS = (
    "the tool queue (rq) needs a single Redis, not a cluster (redis.cluster = true): run "
    "tasks that call tools against a single Redis server"
)
