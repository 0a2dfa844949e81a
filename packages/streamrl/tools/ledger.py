"""The tool ledger: a non-idempotent tool call runs once per idempotency key.

When a rollout worker dies, another replays its episode; sampling seeds are stable per
trajectory and turn, so the replay makes the same calls under the same call ids. A call to a
tool with side effects (one named in `tools.non_idempotent`, or an in-process tool whose
`idempotent` is False) goes through the ledger: the first execution records its result in the
run's hash `Keys.tool_ledger`; a replay of the same call gets the recorded result back and the
tool does not run again.

Two executions of one key at the same time (a resent call while the first is still running,
two rollout workers on one task) do not both run: the one that sets the key's claim (SET NX
with a TTL) runs; the other waits for the recorded result up to a bound, then reports a tool
error. A claim expires on its own when its holder died without releasing it.

Recorded are results of the call's own making (success and tool errors); an infrastructure
error (`ToolResult.infra`) is not recorded, so the call can be retried. Records are
msgpack-encoded `ToolResult`s (streamrl.wire), never pickled. Each hit bumps the stats
counter `tool_ledger_hits` and logs `tool_ledger_hit` with the key (never the arguments).

`ToolLedger` serves the tool workers (blocking redis client, inside an rq job);
`AsyncToolLedger` serves the rollout worker's in-process tools (asyncio client).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import redis
import redis.asyncio as aioredis
import structlog

from streamrl import counters
from streamrl.names import Keys
from streamrl.wire import ToolResult, decode_body, encode_body

POLL_S = 0.05  # how often a waiting execution looks for the holder's record

# KEYS: ledger hash, claim key. ARGV: ledger key, claim token, claim TTL (ms).
# -> {1, record} (recorded: a hit), {2, ''} (claimed: run it), {0, ''} (claimed by another
# execution). One script, so no execution can record between our look at the hash and our
# claim. It counts nothing: a tool worker may write no stats (review N18); the hit comes
# back marked `ledger_hit` and the rollout counts it.
_CLAIM = """
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if rec then
  return {1, rec}
end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then
  return {2, ''}
end
return {0, ''}
"""

# KEYS: ledger hash, claim key. ARGV: ledger key, claim token, record ('' records nothing).
# -> 1 when the record was written, 0 when not (nothing to record, or one was there first).
# The claim is deleted only while it is still ours (it may have expired and been retaken).
_FINISH = """
local wrote = 0
if ARGV[3] ~= '' then wrote = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[3]) end
if redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
return wrote
"""

_HIT, _CLAIMED = 1, 2


def ledger_key(call_id: str, name: str, arguments: str | Mapping[str, object]) -> str:
    """`<call_id>#<12 hex digits>`: the call id (stable per trajectory, turn and call index)
    plus a hash of the tool name and its arguments, so that a replay that makes a different
    call at the same place gets a different key. JSON arguments are hashed in canonical form
    (sorted keys, no spaces): the same call in different whitespace is the same call."""
    digest = hashlib.blake2b(f"{name}\0{_canonical(arguments)}".encode(), digest_size=6)
    return f"{call_id}#{digest.hexdigest()}"


def _canonical(arguments: str | Mapping[str, object]) -> str:
    value: object = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # not JSON: the text itself is the call
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _busy(key: str, call_id: str, wait_s: float) -> ToolResult:
    return ToolResult(
        call_id=call_id,
        ok=False,
        output="",
        error=(
            f"this call (idempotency key {key}) is already running elsewhere and gave no "
            f"result within {wait_s:g}s"
        ),
    )


def _decode(data: bytes | str) -> ToolResult:
    # A client made with decode_responses would hand back str; ours never do.
    return decode_body(data if isinstance(data, bytes) else data.encode(), ToolResult)


def _body(result: ToolResult) -> bytes:
    """What `_FINISH` records: nothing for an infrastructure error (it may be retried)."""
    return b"" if result.infra else encode_body(result)


class _Ledger:
    def __init__(
        self,
        keys: Keys,
        log: structlog.stdlib.BoundLogger,
        claim_ttl_s: float,
        wait_s: float,
    ) -> None:
        if claim_ttl_s <= 0:
            raise ValueError(f"claim_ttl_s must be > 0, got {claim_ttl_s}")
        self.keys = keys
        self.log = log
        self.claim_ttl_s = claim_ttl_s
        self.wait_s = max(0.0, wait_s)

    def _claim_args(self, key: str, token: str) -> tuple[list[str], list[str | int]]:
        keys = [self.keys.tool_ledger, self.keys.tool_ledger_claim(key)]
        return keys, [key, token, max(1, round(self.claim_ttl_s * 1000))]

    def _finish_args(
        self, key: str, token: str, body: bytes
    ) -> tuple[list[str], list[str | bytes]]:
        return [self.keys.tool_ledger, self.keys.tool_ledger_claim(key)], [key, token, body]

    def _hit(self, key: str, record: bytes) -> ToolResult:
        self.log.info("tool_ledger_hit", key=key)
        return msgspec.structs.replace(_decode(record), ledger_hit=True)

    def _finished(self, key: str, result: ToolResult, wrote: int) -> None:
        # One line per execution under a claim: what an audit counts side effects from.
        self.log.info("tool_ledger_ran", key=key, infra=result.infra, recorded=bool(wrote))
        if not result.infra and not wrote:
            # Our claim expired while the call ran and another execution recorded first:
            # the side effect may have happened twice. The first record stands.
            self.log.warning("tool_ledger_conflict", key=key, claim_ttl_s=self.claim_ttl_s)


class ToolLedger(_Ledger):
    """The ledger through a blocking client (a tool worker's rq job).

    `claim_ttl_s`: a claim's lifetime (longer than the slowest run: only a holder that died
    leaves a claim to expire); `wait_s`: how long a second execution of a running key waits
    for its record."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        log: structlog.stdlib.BoundLogger,
        *,
        claim_ttl_s: float,
        wait_s: float,
    ) -> None:
        super().__init__(keys, log, claim_ttl_s, wait_s)
        self.client = client
        self._claim = client.register_script(_CLAIM)
        self._finish = client.register_script(_FINISH)

    def recorded(self, key: str) -> ToolResult | None:
        """The result recorded under `key`, if any (does not count as a hit)."""
        data = self.client.hget(self.keys.tool_ledger, key)
        return None if data is None else _decode(data)

    def record(self, key: str, result: ToolResult) -> bool:
        """Record `result` unless one is there already or it is an infrastructure error;
        True when it was written."""
        if result.infra:
            return False
        return bool(self.client.hsetnx(self.keys.tool_ledger, key, encode_body(result)))

    def claim(self, key: str) -> str | None:
        """Claim `key` for one execution: its token, or None when the key is recorded or
        claimed by another execution. Release it with `finish`."""
        token = uuid.uuid4().hex
        state, _ = self._claim(*self._claim_args(key, token))
        return token if state == _CLAIMED else None

    def finish(self, key: str, token: str, result: ToolResult | None) -> bool:
        """Record `result` (None or an infrastructure error: nothing) and release the claim."""
        body = b"" if result is None else _body(result)
        return bool(self._finish(*self._finish_args(key, token, body)))

    def run_once(self, key: str, call_id: str, run: Callable[[], ToolResult]) -> ToolResult:
        """`run()`'s result, or the one recorded under `key` when the call already ran."""
        deadline = time.monotonic() + self.wait_s
        while True:
            token = uuid.uuid4().hex
            state, record = self._claim(*self._claim_args(key, token))
            if state == _HIT:
                return self._hit(key, record)
            if state == _CLAIMED:
                try:
                    result = run()
                except BaseException:
                    self.finish(key, token, None)
                    raise
                self._finished(key, result, self.finish(key, token, result))
                return result
            if time.monotonic() >= deadline:
                self.log.warning("tool_ledger_busy", key=key, wait_s=self.wait_s)
                return _busy(key, call_id, self.wait_s)
            time.sleep(POLL_S)


class AsyncToolLedger(_Ledger):
    """The ledger through an asyncio client (a rollout worker's in-process tools).

    `claim_ttl_s`: a claim's lifetime (longer than the slowest call of a non-idempotent
    tool: only a holder that died leaves a claim to expire); `wait_s`: how long a second
    execution of a running key waits for its record (shorter than the episode's step
    timeout)."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        log: structlog.stdlib.BoundLogger,
        *,
        claim_ttl_s: float = 300.0,
        wait_s: float = 20.0,
    ) -> None:
        super().__init__(keys, log, claim_ttl_s, wait_s)
        self.client = client
        self._claim = client.register_script(_CLAIM)
        self._finish = client.register_script(_FINISH)

    async def recorded(self, key: str) -> ToolResult | None:
        """The result recorded under `key`, if any (does not count as a hit)."""
        data = await self.client.hget(self.keys.tool_ledger, key)
        return None if data is None else _decode(data)

    async def record(self, key: str, result: ToolResult) -> bool:
        """Record `result` unless one is there already or it is an infrastructure error;
        True when it was written."""
        if result.infra:
            return False
        return bool(await self.client.hsetnx(self.keys.tool_ledger, key, encode_body(result)))

    async def claim(self, key: str) -> str | None:
        """Claim `key` for one execution: its token, or None when the key is recorded or
        claimed by another execution. Release it with `finish`."""
        token = uuid.uuid4().hex
        state, _ = await self._claim(*self._claim_args(key, token))
        return token if state == _CLAIMED else None

    async def finish(self, key: str, token: str, result: ToolResult | None) -> bool:
        """Record `result` (None or an infrastructure error: nothing) and release the claim."""
        body = b"" if result is None else _body(result)
        return bool(await self._finish(*self._finish_args(key, token, body)))

    async def run_once(
        self, key: str, call_id: str, run: Callable[[], Awaitable[ToolResult]]
    ) -> ToolResult:
        """`await run()`'s result, or the one recorded under `key` when the call already
        ran. An exception of `run` (ToolInfraError, cancellation) records nothing."""
        deadline = time.monotonic() + self.wait_s
        while True:
            token = uuid.uuid4().hex
            state, record = await self._claim(*self._claim_args(key, token))
            if state == _HIT:  # in the rollout itself: counted here (rollout writes stats)
                await self.client.hincrby(self.keys.stats, counters.TOOL_LEDGER_HITS, 1)
                return self._hit(key, record)
            if state == _CLAIMED:
                try:
                    result = await run()
                except BaseException:
                    await self.finish(key, token, None)
                    raise
                self._finished(key, result, await self.finish(key, token, result))
                return result
            if time.monotonic() >= deadline:
                self.log.warning("tool_ledger_busy", key=key, wait_s=self.wait_s)
                return _busy(key, call_id, self.wait_s)
            await asyncio.sleep(POLL_S)
