"""Queue inspection and dead-letter replay for operators (`streamrl queues`).

`inspect` reads, per stream of a run: its length, and per consumer group the entries not
yet delivered (lag), the delivered but unacknowledged ones (pending) and the age of the
oldest pending entry; the dead letters by source stream; and the groups being assembled
(half-filled groups) with the age of the oldest, and the counters of the group-timeout
and backpressure policies. `replay_dead` puts dead letters back
into their source stream, unchanged, and removes them from the dead-letter stream, in one
transaction each: after a fix, the work they carry is done once more, not twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from streamrl import counters
from streamrl.names import Keys
from streamrl.transport import as_str, hgetall_str, hvals_bytes, xrange_entries
from streamrl.wire import DeadLetter, WireError, decode

LAG_COUNT_CAP = 100_000  # entries counted at most when Redis does not report the lag


@dataclass
class GroupInfo:
    name: str
    consumers: int
    lag: int | None  # entries not yet delivered to the group
    pending: int
    oldest_pending_s: float | None  # age of the oldest unacknowledged entry


@dataclass
class StreamInfo:
    name: str
    length: int
    groups: list[GroupInfo] = field(default_factory=list)


@dataclass
class QueueReport:
    streams: list[StreamInfo]
    dead_by_source: dict[str, int]
    partial_groups: int
    oldest_partial_group_s: float | None
    stats: dict[str, str]


def _entry_age_s(entry_id: str | bytes, now_ms: float) -> float:
    ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return max(0.0, (now_ms - ms) / 1000)


def _groups(client: redis.Redis, stream: str, now_ms: float) -> list[GroupInfo]:
    out = []
    for g in client.xinfo_groups(stream):
        name = as_str(g["name"])
        oldest = None
        if int(g["pending"]):
            summary = client.xpending(stream, name)
            oldest = _entry_age_s(summary["min"], now_ms)
        out.append(
            GroupInfo(
                name=name,
                consumers=int(g["consumers"]),
                lag=_lag(client, stream, g, LAG_COUNT_CAP),
                pending=int(g["pending"]),
                oldest_pending_s=oldest,
            )
        )
    return out


def backlog(
    client: redis.Redis,
    stream: str,
    group: str,
    cap: int,
    count_after: Callable[[str, str, int], int] | None = None,
) -> tuple[int, int]:
    """(lag, pending) of consumer group `group` on `stream`: the entries not yet delivered
    to it, and those delivered but not acknowledged. (0, 0) without a stream; every entry
    is lag before the group exists. Where Redis does not report the lag (6.2; entries
    deleted past the group's position on 7), the entries after its last delivered one are
    counted, up to `cap`: by `count_after(stream, exclusive start id, cap)` when given (a
    script: no payload crosses the wire), else by XRANGE."""
    length = int(client.xlen(stream))
    if length == 0:
        return 0, 0  # (or no stream yet: XINFO would fail)
    groups = client.xinfo_groups(stream)
    found = next((g for g in groups if as_str(g["name"]) == group), None)
    if found is None:  # no reader has joined yet: every entry waits
        return length, 0
    return _lag(client, stream, found, cap, count_after), int(found["pending"])


def _lag(
    client: redis.Redis,
    stream: str,
    group: Any,
    cap: int,
    count_after: Callable[[str, str, int], int] | None = None,
) -> int:
    """The lag of a consumer group as XINFO GROUPS reports it (`group`), or, where Redis
    does not (before 7; entries deleted past its position on 7), the entries after its
    last delivered one, up to `cap`: by `count_after(stream, exclusive start id, cap)`
    when given (a script: no payload crosses the wire), else by XRANGE."""
    lag = group.get("lag")
    if lag is not None:
        return int(lag)
    after = f"({as_str(group['last-delivered-id'])}"
    if count_after is not None:
        return int(count_after(stream, after, cap))
    return len(xrange_entries(client, stream, after, count=cap))


def partial_groups(client: redis.Redis, keys: Keys, now_ms: float) -> tuple[int, float | None]:
    """Groups with members held but not yet emitted or dropped, and the oldest one's age
    (since its first member arrived)."""
    raw = hvals_bytes(client, keys.groups_started)
    if not raw:
        return 0, None
    return len(raw), max(0.0, (now_ms - min(int(v) for v in raw)) / 1000)


def inspect(client: redis.Redis, keys: Keys) -> QueueReport:
    now_ms = time.time() * 1000
    streams = []
    for name in keys.streams():
        info = StreamInfo(name=name, length=int(client.xlen(name)))  # 0 when missing
        if client.exists(name):  # XINFO GROUPS fails on a stream that does not exist
            info.groups = _groups(client, name, now_ms)
        streams.append(info)
    dead: dict[str, int] = {}
    for _, fields in xrange_entries(client, keys.dead):
        try:
            letter = decode(fields, DeadLetter)
            dead[letter.source] = dead.get(letter.source, 0) + 1
        except WireError:
            dead["(undecodable)"] = dead.get("(undecodable)", 0) + 1
    partial, oldest = partial_groups(client, keys, now_ms)
    stats = hgetall_str(client, keys.stats)
    return QueueReport(streams, dead, partial, oldest, stats)


def replay_dead(
    client: redis.Redis, keys: Keys, source: str | None = None, limit: int = 0
) -> list[tuple[str, str]]:
    """Move dead letters (of `source`, or all) back into their source stream; returns
    (dead entry id, new entry id) pairs. Undecodable dead entries stay where they are."""
    moved: list[tuple[str, str]] = []
    for dead_id, fields in xrange_entries(client, keys.dead):
        if limit and len(moved) >= limit:
            break
        try:
            letter = decode(fields, DeadLetter)
        except WireError:
            continue
        if source is not None and letter.source != source:
            continue
        if not letter.source.startswith(keys.prefix):
            continue  # never write outside this run's namespace
        pipe = client.pipeline(transaction=True)
        fields_out: dict[FieldT, EncodableT] = {k: v for k, v in letter.fields.items()}
        pipe.xadd(letter.source, fields_out)
        pipe.xdel(keys.dead, dead_id)
        new_id, _ = pipe.execute()
        moved.append((dead_id, new_id.decode() if isinstance(new_id, bytes) else str(new_id)))
    return moved


def format_report(r: QueueReport) -> str:
    def age(s: float | None) -> str:
        return "-" if s is None else f"{s:.1f}s"

    lines = [f"{'stream':<28} {'length':>7} {'group':<9} {'lag':>6} {'pending':>8} {'oldest':>9}"]
    for s in r.streams:
        if not s.groups:
            lines.append(f"{s.name:<28} {s.length:>7} {'-':<9} {'-':>6} {'-':>8} {'-':>9}")
        for g in s.groups:
            lag = "?" if g.lag is None else str(g.lag)
            lines.append(
                f"{s.name:<28} {s.length:>7} {g.name:<9} {lag:>6} {g.pending:>8} "
                f"{age(g.oldest_pending_s):>9}"
            )
    dead = ", ".join(f"{k}: {v}" for k, v in sorted(r.dead_by_source.items())) or "none"
    lines.append(f"dead letters: {dead}")
    lines.append(f"half-filled groups: {r.partial_groups} (oldest {age(r.oldest_partial_group_s)})")
    policy = [f"{k} {r.stats[k]}" for k in counters.POLICY_COUNTERS if k in r.stats]
    if policy:
        lines.append("group policies: " + ", ".join(policy))
    return "\n".join(lines)
