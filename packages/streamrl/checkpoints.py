"""Crash-consistent checkpoints: the trainer's state and a snapshot of the queues, one
directory per step, made visible by one commit marker.

Layout of `<run_dir>/checkpoints`::

    step_00000012/
      state/           the trainer's Orbax state (written through a callback: this module
                       imports no JAX, so the launcher can use it)
      meta.json        step, policy version, seed, and the lineage: group ids per step
      queues.msgpack   the queue snapshot (`QueueSnapshot`), msgpack, no pickle
      COMMIT           written last, atomically (temp file, fsync, rename): the size of
                       every file of the checkpoint, the sha256 of meta and queues and
                       the xxh3_128 of every state file

A directory without a COMMIT, or whose files no longer match it, is not a checkpoint:
`latest_complete` skips it with a logged reason in favour of the newest complete one.

The queue snapshot is one atomic read of Redis (a Lua script): for each stream read by a
consumer group, the group's last-delivered id, its pending ids and every entry still to
be processed (pending or not yet delivered; the groups the trainer already trained are
in its lineage, so only their ids); the groups being assembled; the emitted and dropped
group ids; counters, the feeder cursor, the policy version, the states of the episodes
in flight (`rollout.resume_episodes`). Taken while the trainer's state is that of step N,
it is a consistent cut with it. After the script, a page per command, come the dead
letters up to the last one at the cut and the tool ledger (a record made after the cut
only keeps a replayed call from running twice).

Restart (DESIGN.md, "Checkpoint and restart"):
- Redis kept its data: everything the other workers did since the cut is still there and
  stays; only the trainer's consumer group is rewound to the cut (`rewind_group`: the group
  is re-created there, so no stale pending entry survives), which re-delivers exactly the
  groups consumed after it; those the restored lineage already holds are skipped by id.
- Redis lost the run's data: `restore_queues` writes the snapshot back (entries keep their
  ids; each consumer group starts before them, so all are delivered again). The trainer
  does it, from the checkpoint whose state it restored (`RESTORE_PENDING`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import redis
import structlog
from redis.typing import EncodableT, FieldT

from streamrl.hashing import HASHES, SHA256, XXH3
from streamrl.names import Keys
from streamrl.tasks.base import group_cursor
from streamrl.transport import as_bytes, as_str, entry_id_key, xrange_entries
from streamrl.wire import Message, Task, Trajectory, WireError, decode, decode_state

COMMIT = "COMMIT"
META = "meta.json"
QUEUES = "queues.msgpack"
STATE = "state"
# In the checkpoints root, written by `streamrl up --resume` when Redis lost the run: the
# trainer writes back the queue snapshot of the checkpoint it restores (the one its Orbax
# state comes from, which may be older than the newest complete one) and removes it; the
# other workers start once it is gone.
RESTORE_PENDING = "RESTORE_QUEUES"
_PREFIX = "step_"
SNAPSHOT_VERSION = 1

M = TypeVar("M", bound=Message)
Entry = tuple[str, list[bytes]]  # stream entry id, flat field/value list


class CheckpointCorrupt(RuntimeError):
    """A checkpoint directory that must not be used; the message says why."""


class PartialRunError(RuntimeError):
    """Redis holds only part of a run that has a checkpoint; the message says what."""


class StreamSnapshot(msgspec.Struct, frozen=True):
    stream: str
    group: str
    last_delivered: str  # "" when the consumer group did not exist yet
    pending: list[str]
    entries: list[Entry]  # pending and undelivered entries, ascending ids


class QueueSnapshot(msgspec.Struct, frozen=True):
    version: int
    namespace: str
    taken_ms: int
    streams: list[StreamSnapshot]
    dead: list[Entry]
    groups_started: dict[str, bytes]
    partial_groups: dict[str, dict[str, bytes]]  # group id -> member index -> trajectory
    emitted: list[str]
    dropped: list[str]
    hashes: dict[str, dict[str, bytes]]  # full key -> field -> value
    strings: dict[str, bytes]  # full key -> value

    def stream(self, name: str) -> StreamSnapshot | None:
        return next((s for s in self.streams if s.stream == name), None)


# KEYS: n streams, then dead, started, emitted, dropped, h hashes, s strings, m member
# hashes (those of the group ids in ARGV, in their order).
# ARGV: n, group names (n), h, s, m, group ids (m), k, t, entry ids (t): ids pending on
# the group of stream k whose bodies are not needed (groups the trainer already trained);
# then split, limit: of hash number `split` (the episode states) only the values of at most
# `limit` bytes are copied, and the names of the others returned last (review N10: every
# in-flight episode's state, ~100 MB at scale, was built into Lua strings and a reply
# inside the script, stalling every client of Redis for it).
# -> false when the groups being assembled are not exactly the m given (the caller reads
# them again and retries), else the snapshot, whose dead letters are only the last id of
# the dead stream: the caller copies them after the script, up to that id.
# Every key the script touches is declared (Redis Cluster routes by KEYS and refuses
# undeclared ones), so the member hashes cannot be found inside the script: the caller
# names them from a read of `started` made just before, and the script checks that read
# against `started` as it is now. The script runs atomically, so when the check passes,
# the member hashes it reads are those of every group being assembled at its own instant,
# and the snapshot is one consistent cut as before. It copies no payload the cut does
# not need: a script blocks every client of Redis while it runs. The emitted and dropped
# ids stay in it (`trim_history` keeps them few): an id emitted after the cut, restored
# with a group then half filled, would keep that group from ever being emitted.
_SNAPSHOT = """
local n = tonumber(ARGV[1])
local h = tonumber(ARGV[n + 2])
local s = tonumber(ARGV[n + 3])
local m = tonumber(ARGV[n + 4])
local k = tonumber(ARGV[n + 5 + m])
local t = tonumber(ARGV[n + 6 + m])
local started_key = KEYS[n + 2]
if redis.call('HLEN', started_key) ~= m then return false end
for j = 1, m do
  if redis.call('HEXISTS', started_key, ARGV[n + 4 + j]) == 0 then return false end
end
local skip = {}
for j = 1, t do skip[ARGV[n + 6 + m + j]] = true end
local streams = {}
for i = 1, n do
  local key, cg = KEYS[i], ARGV[1 + i]
  local last, pend, entries = '', {}, {}
  if redis.call('EXISTS', key) == 1 then
    for _, info in ipairs(redis.call('XINFO', 'GROUPS', key)) do
      local name, ld = nil, nil
      for j = 1, #info, 2 do
        if info[j] == 'name' then name = info[j + 1] end
        if info[j] == 'last-delivered-id' then ld = info[j + 1] end
      end
      if name == cg then last = ld end
    end
    if last ~= '' then
      for _, p in ipairs(redis.call('XPENDING', key, cg, '-', '+', 1000000000)) do
        pend[#pend + 1] = p[1]
        if not (i == k and skip[p[1]]) then
          local e = redis.call('XRANGE', key, p[1], p[1])
          if #e == 1 then entries[#entries + 1] = e[1] end
        end
      end
      for _, e in ipairs(redis.call('XRANGE', key, '(' .. last, '+')) do
        entries[#entries + 1] = e
      end
    else
      entries = redis.call('XRANGE', key, '-', '+')
    end
  end
  streams[i] = {last, pend, entries}
end
local dead = redis.call('XREVRANGE', KEYS[n + 1], '+', '-', 'COUNT', 1)
local dead_last = ''
if #dead == 1 then dead_last = dead[1][1] end
local started = redis.call('HGETALL', KEYS[n + 2])
local partial = {}
for j = 1, m do
  partial[j] = {ARGV[n + 4 + j], redis.call('HGETALL', KEYS[n + 4 + h + s + j])}
end
local emitted = redis.call('SMEMBERS', KEYS[n + 3])
local dropped = redis.call('SMEMBERS', KEYS[n + 4])
local split = tonumber(ARGV[n + 7 + m + t])
local limit = tonumber(ARGV[n + 8 + m + t])
local hashes, later = {}, {}
for j = 1, h do
  local key = KEYS[n + 4 + j]
  if j == split then
    local flat = {}
    for _, f in ipairs(redis.call('HKEYS', key)) do
      if redis.call('HSTRLEN', key, f) <= limit then
        flat[#flat + 1] = f
        flat[#flat + 1] = redis.call('HGET', key, f)
      else
        later[#later + 1] = f
      end
    end
    hashes[j] = flat
  else
    hashes[j] = redis.call('HGETALL', key)
  end
end
local strings = {}
for j = 1, s do strings[j] = redis.call('GET', KEYS[n + 4 + h + j]) or false end
local now = redis.call('TIME')
return {streams, dead_last, started, partial, emitted, dropped, hashes, strings,
        now[1] * 1000 + math.floor(now[2] / 1000), later}
"""

# KEYS: stream. ARGV: group, start id. Re-creates the group at `start`: its old pending
# entries go with the old group.
_REWIND = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    for j = 1, #info, 2 do
      if info[j] == 'name' and info[j + 1] == ARGV[1] then
        redis.call('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
      end
    end
  end
end
redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], ARGV[2], 'MKSTREAM')
return 1
"""


def consumed_streams(keys: Keys) -> list[tuple[str, str]]:
    """(stream, consumer group) of every stream a worker type consumes."""
    return [
        (keys.tasks, keys.CG_ROLLOUT),
        (keys.trajectories, keys.CG_GROUPER),
        (keys.groups, keys.CG_TRAINER),
    ]


def _hash_keys(keys: Keys) -> list[str]:
    """Hashes read in the snapshot's script: exact at the cut. The episode states (the
    last, `_SPLIT`) in part: a committed marker must agree with the streams (a marker
    written after the cut would keep a member whose trajectory is not in the snapshot from
    ever running again), so the small values, markers among them, are copied in the
    script; the big ones, states, after it (`_states_after`)."""
    return [
        keys.stats,
        keys.groups_reruns,
        keys.groups_order_held,  # groups decided but held for their turn (grouper.order)
        keys.groups_order_held_at,
        keys.episodes,
    ]


_SPLIT = 5  # the episode states' place in `_hash_keys` (1-based, as the script counts)
# Episode-state values up to this many bytes (every committed marker) are copied inside
# the snapshot's script; bigger ones, the states, after it.
STATE_IN_SCRIPT_BYTES = 512


def _states_after(client: redis.Redis, key: str, names: list[str]) -> dict[str, bytes]:
    """The episode states too big to copy in the snapshot's script, read after it a page
    at a time. A state read now is of the same episode at the same or a later turn boundary,
    which resumes it as well; one that is gone (its task acknowledged since) or is now a
    committed marker (its trajectory committed after the cut, so not in the snapshot's
    streams) is left out: that member runs again from its start, as it must."""
    out: dict[str, bytes] = {}
    for i in range(0, len(names), _PAGE):
        page = names[i : i + _PAGE]
        for name, raw in zip(page, client.hmget(key, page), strict=True):
            if raw is None:
                continue
            value = as_bytes(raw)
            try:
                if decode_state(value).committed:
                    continue
            except WireError:
                pass  # kept as it is: the worker that reads it starts the member over
            out[name] = value
    return out


def _scanned_hash_keys(keys: Keys) -> list[str]:
    """Hashes copied after the script (HSCAN), to which a late superset does no harm: a
    ledger record made after the cut is the result of a call a restored episode makes
    again, and the record keeps its side effect from running twice."""
    return [keys.tool_ledger]


def _string_keys(keys: Keys) -> list[str]:
    return [
        keys.feeder_cursor,
        keys.policy_version,
        keys.policy_floor,
        keys.groups_order_next,
        keys.run_id,
    ]


def _pairs(flat: list[bytes]) -> dict[str, bytes]:
    return {as_str(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}


def _entries(raw: list[list[bytes | list[bytes]]]) -> list[Entry]:
    """Stream entries as the script returns them: [id, [field, value, ...]] each."""
    return [(as_str(eid), [bytes(x) for x in fields]) for eid, fields in raw]


# A group starts or completes between our read of `started` and the script about once per
# grouper write; a handful of tries always finds a quiet moment.
_SNAPSHOT_TRIES = 100
# Entries or fields per command when copying after the script: each command is short, so
# other clients are served between them.
_PAGE = 100


def take_snapshot(client: redis.Redis, keys: Keys, trained: Collection[str] = ()) -> QueueSnapshot:
    """A consistent cut of every queue of the run (see the module docstring and
    `_SNAPSHOT`: read the groups being assembled, then snapshot with their member hashes
    declared, again while that set changed in between).

    `trained`: entry ids of `groups` the trainer has trained but not acknowledged (they
    are in its lineage): the snapshot lists them as pending, without their bodies."""
    pairs = consumed_streams(keys)
    hkeys, skeys = _hash_keys(keys), _string_keys(keys)
    fixed = [s for s, _ in pairs]
    fixed += [keys.dead, keys.groups_started, keys.groups_emitted, keys.groups_dropped]
    fixed += [*hkeys, *skeys]
    k = 1 + [s for s, _ in pairs].index(keys.groups)
    for _ in range(_SNAPSHOT_TRIES):
        gids = [as_str(g) for g in client.hkeys(keys.groups_started)]
        script_keys = [*fixed, *(keys.group_members(g) for g in gids)]
        args: list[int | str] = [len(pairs), *[g for _, g in pairs], len(hkeys), len(skeys)]
        args += [len(gids), *gids, k, len(trained), *trained, _SPLIT, STATE_IN_SCRIPT_BYTES]
        raw: Any = client.eval(_SNAPSHOT, len(script_keys), *script_keys, *args)
        if raw is not None:
            break
    else:
        raise RuntimeError(
            f"no queue snapshot in {_SNAPSHOT_TRIES} tries: the groups being assembled "
            "changed between every read of them and the snapshot"
        )
    streams_raw, dead_last, started, partial, emitted, dropped, hashes, strings, now_ms, later = raw
    streams = [
        StreamSnapshot(
            stream=stream,
            group=group,
            last_delivered=as_str(last),
            pending=[as_str(p) for p in pend],
            entries=_entries(entries),
        )
        for (stream, group), (last, pend, entries) in zip(pairs, streams_raw, strict=True)
    ]
    saved = {key: _pairs(v) for key, v in zip(hkeys, hashes, strict=True)}
    saved[keys.episodes].update(_states_after(client, keys.episodes, [as_str(x) for x in later]))
    saved.update({key: _scan_hash(client, key) for key in _scanned_hash_keys(keys)})
    return QueueSnapshot(
        version=SNAPSHOT_VERSION,
        namespace=keys.ns,
        taken_ms=int(now_ms),
        streams=streams,
        dead=_copy_stream(client, keys.dead, as_str(dead_last)) if dead_last else [],
        groups_started=_pairs(started),
        partial_groups={as_str(gid): _pairs(m) for gid, m in partial},
        emitted=sorted(as_str(x) for x in emitted),
        dropped=sorted(as_str(x) for x in dropped),
        hashes={key: v for key, v in saved.items() if v},
        strings={key: bytes(v) for key, v in zip(skeys, strings, strict=True) if v},
    )


def _copy_stream(client: redis.Redis, stream: str, last: str) -> list[Entry]:
    """The entries of `stream` up to id `last`, a page per command."""
    out: list[Entry] = []
    start = "-"
    while True:
        page = xrange_entries(client, stream, start, last, count=_PAGE)
        # field, value, field, value, ...: what XADD takes back on restore
        out += [(eid, [as_bytes(x) for kv in fields.items() for x in kv]) for eid, fields in page]
        if len(page) < _PAGE:
            return out
        start = "(" + page[-1][0]


def _scan_hash(client: redis.Redis, key: str) -> dict[str, bytes]:
    """Every field of hash `key`, a page per command (HSCAN)."""
    return {as_str(f): bytes(v) for f, v in client.hscan_iter(key, count=_PAGE)}


def encode_snapshot(snap: QueueSnapshot) -> bytes:
    return msgspec.msgpack.encode(snap)


def decode_snapshot(data: bytes) -> QueueSnapshot:
    try:
        snap = msgspec.msgpack.decode(data, type=QueueSnapshot)
    except msgspec.DecodeError as err:
        raise CheckpointCorrupt(f"queue snapshot does not decode: {err}") from None
    if snap.version != SNAPSHOT_VERSION:
        raise CheckpointCorrupt(
            f"queue snapshot version {snap.version}, this code reads {SNAPSHOT_VERSION}"
        )
    return snap


def _run_keys(keys: Keys) -> list[str]:
    """Keys every run holds once it has a checkpoint (and every restore writes)."""
    streams = [s for s, _ in consumed_streams(keys)]
    return [keys.stats, keys.feeder_cursor, keys.policy_version, *streams]


def namespace_present(client: redis.Redis, keys: Keys, checkpointed: bool = False) -> bool:
    """Whether Redis holds this run's data (else it lost it, or never had it).

    A run with a checkpoint (`checkpointed`) is there only whole: its counters, feeder
    cursor, policy version and every consumed stream with its consumer group; when only
    part of it is (keys evicted or deleted), PartialRunError names what is missing, for
    neither "kept" nor "lost" would resume it right. Without a checkpoint, any key of
    the run counts (a run stopped early may not have made them all)."""
    wanted = _run_keys(keys)
    there = [bool(client.exists(k)) for k in wanted]
    if not any(there):
        return False
    if not checkpointed:
        return True
    missing = [k for k, ok in zip(wanted, there, strict=True) if not ok]
    for stream, group in consumed_streams(keys):
        if stream not in missing and not _has_group(client, stream, group):
            missing.append(f"{stream} (consumer group {group})")
    if missing:
        raise PartialRunError(
            f"Redis holds part of run {keys.ns!r}: {', '.join(missing)} missing (evicted, or "
            "deleted by hand). Delete the run's keys to restore its queues from the "
            "checkpoint, or give back what is missing"
        )
    return True


def _has_group(client: redis.Redis, stream: str, group: str) -> bool:
    groups = client.xinfo_groups(stream)
    return any(as_str(g["name"]) == group for g in groups)


def clear_run_state(client: redis.Redis, keys: Keys) -> int:
    """Delete what a restore writes (and `namespace_present` looks at): the leftovers
    that workers wrote into a Redis that had lost the run, before they noticed (review N8).
    Identity slots, metric streams, rq's keys and `groups_waiting` (10 s TTL) stay. Returns
    how many keys went."""
    names = [s for s, _ in consumed_streams(keys)]
    names += [keys.dead, keys.groups_started, keys.groups_emitted, keys.groups_dropped]
    names += [*_hash_keys(keys), *_scanned_hash_keys(keys), *_string_keys(keys)]
    names += [keys.feeder_end, keys.trainer_attempts, keys.groups_attempts, keys.policy_offset]
    names += [as_str(k) for k in client.scan_iter(match=keys.group_members("*"))]
    return int(client.delete(*names)) if names else 0


def restore_queues(client: redis.Redis, keys: Keys, snap: QueueSnapshot) -> dict[str, int]:
    """Write the snapshot into a Redis that holds none of this run's data; returns counts.

    Entries keep their ids; every consumer group is created before its first entry, so
    what was pending at the cut is delivered again like what was not yet delivered.
    """
    if snap.namespace != keys.ns:
        raise CheckpointCorrupt(f"snapshot of run {snap.namespace!r}, not {keys.ns!r}")
    if namespace_present(client, keys):
        raise RuntimeError(f"Redis already holds run {keys.ns!r}: not overwriting it")
    pipe = client.pipeline(transaction=True)
    counts: dict[str, int] = {}
    for s in snap.streams:
        for eid, fields in s.entries:
            pipe.execute_command("XADD", s.stream, eid, *fields)
        pipe.execute_command("XGROUP", "CREATE", s.stream, s.group, "0", "MKSTREAM")
        counts[s.stream] = len(s.entries)
    # A snapshot written before 2026-12-04 kept a dead letter's field names only (an odd
    # count for a DeadLetter, which XADD refuses, failing the whole restore): those letters
    # are lost already and are left out, counted; the queues are restored.
    dead = [(eid, fields) for eid, fields in snap.dead if fields and len(fields) % 2 == 0]
    for eid, fields in dead:
        pipe.execute_command("XADD", keys.dead, eid, *fields)
    counts[keys.dead] = len(dead)
    if len(dead) < len(snap.dead):
        counts["dead_unreadable"] = len(snap.dead) - len(dead)
    counts["partial_groups"] = len(snap.partial_groups)
    hashes = {keys.groups_started: snap.groups_started, **snap.hashes}
    hashes.update({keys.group_members(g): m for g, m in snap.partial_groups.items()})
    for key, mapping in hashes.items():
        if mapping:
            values: dict[FieldT, EncodableT] = {k: v for k, v in mapping.items()}
            pipe.hset(key, mapping=values)
    for key, members in ((keys.groups_emitted, snap.emitted), (keys.groups_dropped, snap.dropped)):
        if members:
            pipe.sadd(key, *members)
    for key, value in snap.strings.items():
        pipe.set(key, value)
    pipe.execute()
    return counts


def rewind_start(s: StreamSnapshot) -> str:
    """Where the group restarts so that it re-delivers its pending entries at the cut and
    everything after: just before the oldest pending id, else its last-delivered id."""
    if s.pending:
        ms, _, seq = min(s.pending, key=entry_id_key).partition("-")
        m, q = int(ms), int(seq or 0)
        return f"{m}-{q - 1}" if q > 0 else (f"{m - 1}-18446744073709551615" if m > 0 else "0")
    return s.last_delivered or "0"


def rewind_group(client: redis.Redis, s: StreamSnapshot) -> str:
    """Re-create the consumer group of `s` at the cut (`rewind_start`); returns the id."""
    start = rewind_start(s)
    client.eval(_REWIND, 1, s.stream, s.group, start)
    return start


def trim_streams(client: redis.Redis, keys: Keys, floor: QueueSnapshot | None) -> dict[str, int]:
    """Delete the entries of each consumed stream that nothing can need again; returns how
    many went, per stream.

    Kept: every entry from the oldest that some consumer group still has pending or not
    yet delivered, and every entry after the cut of `floor` (the oldest kept checkpoint's
    snapshot: a restart may rewind the trainer's group there, and no further). A stream
    that no group reads is left whole. Entries are only ever removed below ids every
    group has passed, so concurrent readers are safe: groups only move forward.
    """
    out: dict[str, int] = {}
    for stream, _group in consumed_streams(keys):
        bound = _consumed_bound(client, stream)
        if bound is None:
            continue
        at_floor = floor.stream(stream) if floor is not None else None
        if at_floor is not None:
            bound = min(bound, rewind_start(at_floor), key=entry_id_key)
        if bound == "0":
            continue
        n = client.xtrim(stream, minid=bound, approximate=False)
        if n:
            out[stream] = int(n)
    return out


def group_floor(keys: Keys, floor: QueueSnapshot) -> int:
    """The lowest data-set cursor whose group can still get a member after the cut of
    `floor` (the oldest kept checkpoint's snapshot): the groups of the tasks and
    trajectories unfinished at the cut, the groups being assembled, and the feeder's next
    cursor. Anything later comes from a task written after the cut, or re-runs a group
    being assembled then; only a dead letter replayed by hand may reach an older group."""
    ids = [*floor.groups_started, *floor.partial_groups]
    ids += [t.group_id for t in _decoded(floor.stream(keys.tasks), Task)]
    ids += [t.group_id for t in _decoded(floor.stream(keys.trajectories), Trajectory)]
    cursors = [c for c in map(group_cursor, ids) if c is not None]
    return min([int(floor.strings.get(keys.feeder_cursor, b"0")), *cursors])


def _decoded(at_cut: StreamSnapshot | None, cls: type[M]) -> list[M]:
    """The entries of `at_cut` that decode as `cls` (the others will be dead letters)."""
    out = []
    for _eid, fields in at_cut.entries if at_cut is not None else []:
        try:
            out.append(decode(dict(zip(fields[::2], fields[1::2], strict=True)), cls))
        except WireError:
            continue
    return out


def trim_history(
    client: redis.Redis,
    keys: Keys,
    floor: QueueSnapshot | None,
    *,
    keep_dead_letters: int,
    keep_metrics: int,
    keep_dead_letter_bytes: int = 0,
) -> dict[str, int]:
    """Keep a window of what grows with the run; returns how many went, per key.

    The emitted and dropped group ids, the tool ledger's records (keyed by the call id,
    which starts with the group id) and the episode states (keyed by the trajectory id:
    those a dead-lettered task left) of groups older than `group_floor` of `floor` go: no
    member of such a group can arrive again, so nothing asks for them (without a kept
    checkpoint, all stay). The dead letters keep the newest `keep_dead_letters`, and of
    those no more than `keep_dead_letter_bytes` take (0: no byte cap), the metrics stream
    the newest `keep_metrics` steps. Read a page per command (SSCAN,
    HSCAN), so other clients are served in between."""
    out: dict[str, int] = {}
    if floor is not None:
        low = group_floor(keys, floor)

        def old(group_id: str) -> bool:
            c = group_cursor(group_id)
            return c is not None and c < low

        for key in (keys.groups_emitted, keys.groups_dropped):
            gone = [m for m in client.sscan_iter(key, count=_PAGE) if old(as_str(m))]
            out[key] = _in_pages(partial(client.srem, key), gone)
        for key in (keys.tool_ledger, keys.episodes):  # fields: `<group id>-...`
            fields = client.hscan_iter(key, count=_PAGE)  # NOVALUES needs Redis 7.4
            gone = [f for f, _ in fields if old(as_str(f).split("-", 1)[0])]
            out[key] = _in_pages(partial(client.hdel, key), gone)
    for stream, keep in ((keys.dead, keep_dead_letters), (keys.metrics, keep_metrics)):
        out[stream] = int(client.xtrim(stream, maxlen=keep, approximate=False))
    if keep_dead_letter_bytes:
        out[keys.dead] += _trim_to_bytes(client, keys.dead, keep_dead_letter_bytes)
    return {key: n for key, n in out.items() if n}


def _trim_to_bytes(client: redis.Redis, stream: str, limit: int) -> int:
    """Keep the newest entries of `stream` that fit in about `limit` bytes of Redis memory
    (review part 3: 1,000 dead letters of whole 1 MB groups were 1 GB in Redis and in every
    snapshot). MEMORY USAGE counts them in Redis, no payload travels; entries are taken as
    of the average size. Returns how many went."""
    used = client.memory_usage(stream, samples=0)
    if used is None or used <= limit:
        return 0
    count = int(client.xlen(stream))
    keep = max(1, int(count * limit / used))
    return int(client.xtrim(stream, maxlen=keep, approximate=False))


def _in_pages(remove: Callable[..., int], items: list[FieldT]) -> int:
    """`remove(*page)` for `items` a page per command; returns how many went."""
    return sum(int(remove(*items[i : i + _PAGE])) for i in range(0, len(items), _PAGE))


def _consumed_bound(client: redis.Redis, stream: str) -> str | None:
    """The oldest id some consumer group of `stream` may still need (pending, or its
    last-delivered id), or None when the stream or its groups do not exist."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return None
    bound: str | None = None
    for g in groups:
        need = as_str(g["last-delivered-id"])
        if g["pending"]:
            summary = client.xpending(stream, g["name"])
            if summary["min"] is not None:
                need = min(need, as_str(summary["min"]), key=entry_id_key)
        bound = need if bound is None else min(bound, need, key=entry_id_key)
    return bound


# ---------------------------------------------------------------------------------------
# Directories and the commit marker.


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def state_dir(self) -> Path:
        return self.path / STATE

    def meta(self) -> dict[str, Any]:
        return dict(json.loads((self.path / META).read_text()))

    def snapshot(self) -> QueueSnapshot:
        return decode_snapshot((self.path / QUEUES).read_bytes())


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Checksums in the commit marker: sha256 for meta and the snapshot (small, and what a
# restore trusts), xxh3_128 for the state files (about 10 GB/s on one core: it catches
# corruption and same-size edits of a large state at little cost).
def _digest(path: Path, kind: str) -> str:
    h = HASHES[kind]()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return str(h.hexdigest())


def _inventory(path: Path) -> dict[str, dict[str, int | str]]:
    files: dict[str, dict[str, int | str]] = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != COMMIT:
            rel = str(p.relative_to(path))
            kind = SHA256 if rel in (META, QUEUES) else XXH3
            files[rel] = {"size": p.stat().st_size, kind: _digest(p, kind)}
    return files


def prepare_dir(root: Path, step: int) -> Path:
    """A fresh directory for checkpoint `step` (a leftover of a cut-off attempt at the same
    step is removed first)."""
    root.mkdir(parents=True, exist_ok=True)
    path = step_dir(root, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()
    return path


def commit(
    path: Path,
    step: int,
    meta: Mapping[str, object],
    snapshot: QueueSnapshot,
    before_commit: Callable[[], None] | None = None,
) -> Checkpoint:
    """Write meta and the queue snapshot beside the state already in `path`, then the
    commit marker; returns the checkpoint once durable."""
    _fsync_write(path / META, json.dumps(meta, sort_keys=True).encode())
    _fsync_write(path / QUEUES, encode_snapshot(snapshot))
    if before_commit is not None:
        before_commit()
    marker = {"step": step, "written_ms": int(time.time() * 1000), "files": _inventory(path)}
    tmp = path / f".{COMMIT}.tmp"
    _fsync_write(tmp, json.dumps(marker, sort_keys=True).encode())
    os.replace(tmp, path / COMMIT)
    _fsync_dir(path)
    _fsync_dir(path.parent)
    return Checkpoint(step, path)


def write_checkpoint(
    root: Path,
    step: int,
    write_state: Callable[[Path], None],
    meta: Mapping[str, object],
    snapshot: QueueSnapshot,
    before_commit: Callable[[], None] | None = None,
) -> Checkpoint:
    """Write checkpoint `step` under `root` and commit it; returns it once durable.

    `write_state(dir)` writes the trainer state into `dir` (which must not exist yet) and
    returns when it is on disk. `before_commit` runs just before the marker (a failpoint).
    """
    path = prepare_dir(root, step)
    write_state(path / STATE)
    return commit(path, step, meta, snapshot, before_commit)


def verify(path: Path, state: bool = True) -> Checkpoint:
    """The checkpoint in `path`, or CheckpointCorrupt saying why it is not one.

    `state` False leaves out the checksums of the state files (their sizes are checked):
    for callers that do not restore the state and would read it all for nothing."""
    marker_path = path / COMMIT
    if not marker_path.is_file():
        raise CheckpointCorrupt("no commit marker: the write was cut off")
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        step = int(marker["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorrupt(f"unreadable commit marker: {err}") from None
    for rel in (META, QUEUES):
        if rel not in files:
            raise CheckpointCorrupt(f"commit marker does not list {rel}")
    for rel, want in files.items():
        p = path / rel
        if not p.is_file():
            raise CheckpointCorrupt(f"{rel} is missing")
        if p.stat().st_size != want["size"]:
            raise CheckpointCorrupt(f"{rel} has {p.stat().st_size} bytes, not {want['size']}")
        checked = (SHA256, XXH3) if state or rel in (META, QUEUES) else ()
        for kind in checked:
            if kind in want and _digest(p, kind) != want[kind]:
                raise CheckpointCorrupt(f"{rel} does not match its {kind}")
    if not (path / STATE).is_dir():
        raise CheckpointCorrupt("the state directory is missing")
    return Checkpoint(step, path)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
                out.append((int(p.name[len(_PREFIX) :]), p))
    return sorted(out, reverse=True)


def latest_complete(
    root: Path, log: structlog.stdlib.BoundLogger | None = None
) -> Checkpoint | None:
    """The newest complete checkpoint under `root`; newer incomplete ones are logged
    (`checkpoint_skipped` with the reason) and passed over."""
    for _step, path in step_dirs(root):
        try:
            return verify(path)
        except CheckpointCorrupt as err:
            if log is not None:
                log.warning("checkpoint_skipped", path=str(path), reason=str(err))
    return None


def prune(root: Path, keep: int, log: structlog.stdlib.BoundLogger | None = None) -> list[Path]:
    """Keep the `keep` newest complete checkpoints; remove older ones and every incomplete
    one older than the newest complete (a newer incomplete one may be being written)."""
    removed, complete = [], 0
    for _step, path in step_dirs(root):
        try:
            verify(path, state=False)
            ok = True
        except CheckpointCorrupt:
            ok = False
        if ok:
            complete += 1
            if complete <= keep:
                continue
        elif complete == 0:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed and log is not None:
        log.info("checkpoints_pruned", removed=[p.name for p in removed])
    return removed


def newest_size(root: Path) -> int:
    """Bytes on disk of the newest complete checkpoint under `root` (0: none): about
    what the next one needs."""
    for _step, path in step_dirs(root):
        try:
            verify(path, state=False)
        except CheckpointCorrupt:
            continue
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return 0


def make_room(root: Path, keep: int, log: structlog.stdlib.BoundLogger) -> list[Path]:
    """Before checkpoint N is written: when the disk has less free room than the newest
    checkpoint takes (and a tenth more), prune to the newest `keep - 1` first, so that the
    checkpoints pruned after a save can make room for it (review N14: a full disk
    crash-looped the trainer, whose pruning ran only after a successful save). Never
    below one complete checkpoint: with `keep` 1 nothing is pruned before the save."""
    if keep < 2:
        return []
    need = newest_size(root)
    free = shutil.disk_usage(root).free
    if not need or free >= need * 1.1:
        return []
    log.warning("checkpoint_disk_short", free_bytes=free, need_bytes=need, keep=keep)
    return prune(root, keep - 1, log)


def oldest_snapshot(root: Path) -> QueueSnapshot | None:
    """The queue snapshot of the oldest complete checkpoint under `root` (the furthest a
    restart can fall back), or None when there is none."""
    for _step, path in reversed(step_dirs(root)):
        try:
            return verify(path, state=False).snapshot()
        except CheckpointCorrupt:
            continue
    return None


def remove_incomplete(root: Path, log: structlog.stdlib.BoundLogger | None = None) -> None:
    """At a trainer's start nothing is being written: every incomplete directory goes."""
    for _step, path in step_dirs(root):
        try:
            verify(path, state=False)  # a corrupt state is skipped by the restore, not removed
        except CheckpointCorrupt as err:
            if log is not None:
                log.warning("checkpoint_removed", path=str(path), reason=str(err))
            shutil.rmtree(path, ignore_errors=True)
