"""Checkpoints: the queue snapshot is a consistent cut, restores into an empty Redis, rewinds
a consumer group without stale pending entries; the commit marker decides what counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from streamrl import checkpoints as ck
from streamrl.names import Keys
from streamrl.tasks.base import Prompt, build_task
from streamrl.transport import as_str, ensure_group, entry_id_key, publish
from streamrl.wire import DeadLetter, Trajectory, decode, pack_arrays
from tests.conftest import entries


def _add(client: redis.Redis, stream: str, n: int, tag: str, ms: int | None = None) -> list[str]:
    """n entries; with `ms`, ids ms-0, ms-1, ... (one millisecond: the ids just before an
    entry are then known exactly), else ids Redis picks."""
    out = []
    for i in range(n):
        fields: Any = {"v": b"1", "data": f"{tag}{i}".encode()}
        eid: Any = client.xadd(stream, fields, id=f"{ms}-{i}" if ms is not None else "*")
        out.append(eid.decode())
    return out


def _read(client: redis.Redis, stream: str, group: str, consumer: str, n: int) -> list[str]:
    resp: Any = client.xreadgroup(group, consumer, {stream: ">"}, count=n)
    return [eid.decode() for _s, es in resp or [] for eid, _f in es]


def _populate(client: redis.Redis, keys: Keys) -> dict[str, list[str]]:
    """A run in progress: tasks acked, pending and new; a partial group; trained groups."""
    for stream, group in ck.consumed_streams(keys):
        ensure_group(client, stream, group)
    tasks = _add(client, keys.tasks, 5, "task")
    got = _read(client, keys.tasks, keys.CG_ROLLOUT, "rollout-1", 3)
    client.xack(keys.tasks, keys.CG_ROLLOUT, got[0])  # task0 done, task1-2 pending
    trajs = _add(client, keys.trajectories, 2, "traj")
    groups = _add(client, keys.groups, 4, "group")
    _read(client, keys.groups, keys.CG_TRAINER, "trainer", 3)
    client.xack(keys.groups, keys.CG_TRAINER, groups[0])  # group0 in an earlier checkpoint
    client.hset(keys.group_members("g7"), mapping={"0": b"m0", "2": b"m2"})
    client.hset(keys.groups_started, "g7", 12345)
    client.sadd(keys.groups_emitted, "g1", "g2")
    client.sadd(keys.groups_dropped, "g3")
    client.hset(keys.stats, mapping={"groups": 2, "trainer_steps": 1})
    client.set(keys.feeder_cursor, 5)
    client.set(keys.policy_version, 3)
    client.xadd(keys.dead, {"v": b"1", "data": b"bad"})
    return {"tasks": tasks, "trajs": trajs, "groups": groups}


def test_snapshot_holds_exactly_the_unfinished_work(rclient: redis.Redis, keys: Keys) -> None:
    ids = _populate(rclient, keys)
    snap = ck.take_snapshot(rclient, keys)
    tasks = snap.stream(keys.tasks)
    assert tasks is not None
    assert tasks.pending == ids["tasks"][1:3]
    assert [e for e, _ in tasks.entries] == ids["tasks"][1:]  # task0 was acked
    assert tasks.last_delivered == ids["tasks"][2]
    trajs = snap.stream(keys.trajectories)
    assert trajs is not None and [e for e, _ in trajs.entries] == ids["trajs"]
    groups = snap.stream(keys.groups)
    assert groups is not None
    assert groups.pending == ids["groups"][1:3]
    assert [e for e, _ in groups.entries] == ids["groups"][1:]
    assert snap.partial_groups == {"g7": {"0": b"m0", "2": b"m2"}}
    assert snap.groups_started == {"g7": b"12345"}
    assert snap.emitted == ["g1", "g2"] and snap.dropped == ["g3"]
    assert snap.strings[keys.feeder_cursor] == b"5"
    assert snap.hashes[keys.stats]["trainer_steps"] == b"1"
    assert len(snap.dead) == 1
    assert ck.decode_snapshot(ck.encode_snapshot(snap)) == snap


def test_restore_into_an_empty_redis_delivers_the_unfinished_work_again(
    rclient: redis.Redis, keys: Keys
) -> None:
    ids = _populate(rclient, keys)
    snap = ck.take_snapshot(rclient, keys)
    rclient.delete(*rclient.keys(keys.every_key))  # Redis lost the run
    assert not ck.namespace_present(rclient, keys)
    counts = ck.restore_queues(rclient, keys, snap)
    assert counts[keys.tasks] == 4 and counts[keys.groups] == 3
    # Everything still to do is delivered to a fresh consumer, with its original id.
    assert _read(rclient, keys.tasks, keys.CG_ROLLOUT, "rollout-2", 10) == ids["tasks"][1:]
    assert _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 10) == ids["groups"][1:]
    assert rclient.hgetall(keys.group_members("g7")) == {b"0": b"m0", b"2": b"m2"}
    assert rclient.get(keys.feeder_cursor) == b"5"
    assert rclient.sismember(keys.groups_emitted, "g2")
    assert rclient.xlen(keys.dead) == 1
    # New entries get ids after the restored ones.
    new = _add(rclient, keys.tasks, 1, "later")[0]
    assert entry_id_key(new) > entry_id_key(ids["tasks"][-1])


def test_restore_refuses_to_overwrite_a_live_run(rclient: redis.Redis, keys: Keys) -> None:
    _populate(rclient, keys)
    snap = ck.take_snapshot(rclient, keys)
    with pytest.raises(RuntimeError, match="already holds"):
        ck.restore_queues(rclient, keys, snap)


def test_rewind_redelivers_from_the_cut_and_leaves_no_stale_pending(
    rclient: redis.Redis, keys: Keys
) -> None:
    ids = _populate(rclient, keys)
    snap = ck.take_snapshot(rclient, keys)
    # After the cut the trainer read and acked the rest (a newer checkpoint that is lost).
    _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 10)
    rclient.xack(keys.groups, keys.CG_TRAINER, *ids["groups"][1:3])
    later = _add(rclient, keys.groups, 1, "later")
    s = snap.stream(keys.groups)
    assert s is not None
    start = ck.rewind_group(rclient, s)
    assert entry_id_key(start) < entry_id_key(ids["groups"][1])
    info: Any = rclient.xpending(keys.groups, keys.CG_TRAINER)
    assert info["pending"] == 0  # the old group's pending entries are gone with it
    got = _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 10)
    assert got == ids["groups"][1:] + later
    # Other groups are untouched.
    pend: Any = rclient.xpending(keys.tasks, keys.CG_ROLLOUT)
    assert pend["pending"] == 2


def test_rewind_start_just_before_the_oldest_pending() -> None:
    s = ck.StreamSnapshot("s", "g", "9-0", ["5-3", "7-0"], [])
    assert ck.rewind_start(s) == "5-2"
    assert ck.rewind_start(ck.StreamSnapshot("s", "g", "9-0", ["5-0"], [])) == (
        "4-18446744073709551615"
    )
    assert ck.rewind_start(ck.StreamSnapshot("s", "g", "9-0", [], [])) == "9-0"
    assert ck.rewind_start(ck.StreamSnapshot("s", "g", "", [], [])) == "0"


def _write(root: Path, step: int, snap: ck.QueueSnapshot, **kw: Any) -> ck.Checkpoint:
    def state(d: Path) -> None:
        d.mkdir()
        (d / "params.bin").write_bytes(bytes(range(200)))

    return ck.write_checkpoint(root, step, state, {"step": step}, snap, **kw)


def test_commit_marker_decides_and_prune_keeps_the_newest(
    tmp_path: Path, rclient: redis.Redis, keys: Keys
) -> None:
    snap = ck.take_snapshot(rclient, keys)
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _write(root, step, snap)
    latest = ck.latest_complete(root)
    assert latest is not None and latest.step == 6 and latest.meta() == {"step": 6}
    assert latest.snapshot() == snap

    # Cut off before the marker: ignored in favour of the newest complete one.
    class Killed(Exception):
        pass

    def die() -> None:
        raise Killed

    with pytest.raises(Killed):
        _write(root, 8, snap, before_commit=die)
    assert (root / "step_00000008" / ck.QUEUES).is_file()
    skipped: list[dict[str, Any]] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            skipped.append({"event": event, **kw})

    latest = ck.latest_complete(root, Log())  # type: ignore[arg-type]
    assert latest is not None and latest.step == 6
    assert skipped[0]["event"] == "checkpoint_skipped"
    assert "commit marker" in skipped[0]["reason"]

    # Truncated state file, damaged snapshot: refused, named.
    (root / "step_00000006" / "state" / "params.bin").write_bytes(b"short")
    with pytest.raises(ck.CheckpointCorrupt, match=r"params\.bin"):
        ck.verify(root / "step_00000006")
    latest = ck.latest_complete(root)
    assert latest is not None and latest.step == 4
    q = root / "step_00000004" / ck.QUEUES
    q.write_bytes(q.read_bytes()[:-1] + b"\x00")
    with pytest.raises(ck.CheckpointCorrupt, match="sha256"):
        ck.verify(root / "step_00000004")

    _write(root, 10, snap)
    _write(root, 12, snap)
    removed = ck.prune(root, keep=2)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["step_00000010", "step_00000012"], (left, removed)
    marker = json.loads((root / "step_00000012" / ck.COMMIT).read_text())
    assert marker["step"] == 12 and "state/params.bin" in marker["files"]


def _ids(client: redis.Redis, stream: str) -> list[str]:
    out: Any = client.xrange(stream)
    return [eid.decode() for eid, _ in out]


def test_trim_keeps_what_a_consumer_or_a_kept_checkpoint_may_need(
    rclient: redis.Redis, keys: Keys
) -> None:
    for stream, group in ck.consumed_streams(keys):
        ensure_group(rclient, stream, group)
    # tasks: 0-3 acknowledged, 4-5 pending, 6-9 not yet delivered.
    tasks = _add(rclient, keys.tasks, 10, "task", ms=1000)
    _read(rclient, keys.tasks, keys.CG_ROLLOUT, "rollout-1", 6)
    rclient.xack(keys.tasks, keys.CG_ROLLOUT, *tasks[:4])
    # groups: the trainer took 0-2 and checkpointed them (the floor: the oldest kept
    # checkpoint), then took and acknowledged 3-5 in a later one.
    groups = _add(rclient, keys.groups, 6, "group")
    _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 3)
    rclient.xack(keys.groups, keys.CG_TRAINER, *groups[:3])
    floor = ck.take_snapshot(rclient, keys)
    _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 3)
    rclient.xack(keys.groups, keys.CG_TRAINER, *groups[3:])
    # trajectories: a stream its consumer group never read from.
    trajs = _add(rclient, keys.trajectories, 3, "traj")
    unread = _add(rclient, keys.scratch("other"), 2, "x")  # not a consumed stream

    deleted = ck.trim_streams(rclient, keys, floor)
    assert deleted == {keys.tasks: 3, keys.groups: 2}
    # Kept from each stream's cut in the floor on (the entry at the cut stays too: the
    # rewind starts after it): tasks from just before the oldest pending one.
    assert _ids(rclient, keys.tasks) == tasks[3:]
    assert _ids(rclient, keys.groups) == groups[2:]
    assert _ids(rclient, keys.trajectories) == trajs
    assert _ids(rclient, keys.scratch("other")) == unread
    # Without the floor (no checkpoint kept): tasks from the oldest pending, groups from
    # the last delivered.
    assert ck.trim_streams(rclient, keys, None) == {keys.tasks: 1, keys.groups: 3}
    assert _ids(rclient, keys.tasks) == tasks[4:]
    assert _ids(rclient, keys.groups) == groups[5:]
    # Trimming again removes nothing; the pending tasks are still delivered on a claim.
    assert ck.trim_streams(rclient, keys, None) == {}
    claimed: Any = rclient.xautoclaim(keys.tasks, keys.CG_ROLLOUT, "rollout-2", 0)
    assert [e.decode() for e, _ in claimed[1]] == tasks[4:6]


def test_a_restart_rewinds_to_a_trimmed_floor(rclient: redis.Redis, keys: Keys) -> None:
    # Trimmed to the oldest kept checkpoint, a rewind to it still re-delivers everything
    # consumed after its cut.
    ensure_group(rclient, keys.groups, keys.CG_TRAINER)
    groups = _add(rclient, keys.groups, 8, "group")
    _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 2)
    rclient.xack(keys.groups, keys.CG_TRAINER, *groups[:2])
    floor = ck.take_snapshot(rclient, keys)
    _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 4)
    rclient.xack(keys.groups, keys.CG_TRAINER, *groups[2:6])
    assert ck.trim_streams(rclient, keys, floor) == {keys.groups: 1}
    at_floor = floor.stream(keys.groups)
    assert at_floor is not None
    ck.rewind_group(rclient, at_floor)
    assert _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 10) == groups[2:]


def test_snapshot_stores_only_the_ids_of_groups_already_trained(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Review H2: the groups pending on the trainer at the cut are trained (they are in the
    lineage), so neither a rewind nor a restore needs their bodies: the snapshot keeps their
    ids, not a copy of every payload trained since the last checkpoint."""
    ensure_group(rclient, keys.groups, keys.CG_TRAINER)
    body = b"x" * 200_000
    trained = [
        rclient.xadd(keys.groups, {"v": b"1", "data": body + bytes([i])}).decode()  # type: ignore[union-attr]
        for i in range(40)
    ]
    assert _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 100) == trained
    waiting = _add(rclient, keys.groups, 2, "group")  # emitted, not yet read by the trainer

    whole = ck.encode_snapshot(ck.take_snapshot(rclient, keys))
    assert len(whole) > 40 * 200_000  # without the ids: every trained payload copied
    snap = ck.take_snapshot(rclient, keys, trained=trained)
    size = len(ck.encode_snapshot(snap))
    assert size < 20_000, size  # ids only
    groups = snap.stream(keys.groups)
    assert groups is not None
    assert groups.pending == trained
    assert [e for e, _ in groups.entries] == waiting

    # Redis lost: restored, then rewound at the cut, the trainer is delivered what it has
    # not trained yet; the trained ids are in its lineage.
    rclient.delete(*rclient.keys(keys.every_key))
    ck.restore_queues(rclient, keys, snap)
    start = ck.rewind_group(rclient, groups)
    assert entry_id_key(start) < entry_id_key(trained[0])
    assert _read(rclient, keys.groups, keys.CG_TRAINER, "trainer", 100) == waiting


def _traj(cursor: int) -> Trajectory:
    task = build_task("synthetic", Prompt(text="p"), cursor, 2)
    return Trajectory(
        traj_id=f"{task.group_id}-m0",
        group_id=task.group_id,
        task_id=task.task_id,
        member=0,
        num_generations=2,
        **pack_arrays([1, 2], [0, 1], [0.0, -0.1]),
        prompt_len=1,
        reward=1.0,
        status="ok",
        versions=[0],
        cursor=cursor,
    )


def test_trim_keeps_a_window_of_group_ids_ledger_dead_letters_and_metrics(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Review M4: the emitted and dropped ids, the tool ledger, the episode states, the
    dead letters and the metrics keep a window, not the whole run. Ids, ledger records
    and episode states go once their group is older than every group the oldest kept
    checkpoint can still redeliver (a task or trajectory unfinished at its cut, a
    half-filled group, the feeder's next cursor)."""
    for stream, group in ck.consumed_streams(keys):
        ensure_group(rclient, stream, group)
    gid = [build_task("synthetic", Prompt(text="p"), c, 2).group_id for c in range(30)]
    rclient.sadd(keys.groups_emitted, *gid[:20])
    rclient.sadd(keys.groups_dropped, gid[3], gid[15])
    for c in (2, 9, 16):
        rclient.hset(keys.tool_ledger, f"{gid[c]}-m1-0-0#abcdef012345", b"r")
    rclient.hset(keys.tool_ledger, "reward-call#abcdef012345", b"r")  # no group: kept
    # Episode states: a dead-lettered task's stay behind; one of a task in flight.
    rclient.hset(keys.episodes, mapping={f"{gid[5]}-m0": b"s", f"{gid[13]}-m1": b"s"})
    # At the cut: the task of group 13 pending, a trajectory of group 14 unread, group 11
    # half filled, the feeder about to write cursor 20. The oldest group that can still
    # get a member: 11.
    publish(rclient, keys.tasks, build_task("synthetic", Prompt(text="p"), 13, 2))
    _read(rclient, keys.tasks, keys.CG_ROLLOUT, "rollout-1", 1)
    publish(rclient, keys.trajectories, _traj(14))
    rclient.hset(keys.group_members(gid[11]), "0", b"m")
    rclient.hset(keys.groups_started, gid[11], 1)
    rclient.set(keys.feeder_cursor, 20)
    for i in range(10):
        rclient.xadd(keys.dead, {"v": b"1", "data": f"dead{i}".encode()})
        rclient.xadd(keys.metrics, {"v": b"1", "data": f"step{i}".encode()})
    floor = ck.take_snapshot(rclient, keys)
    assert ck.group_floor(keys, floor) == 11

    deleted = ck.trim_history(rclient, keys, floor, keep_dead_letters=3, keep_metrics=4)
    assert deleted == {
        keys.groups_emitted: 11,
        keys.groups_dropped: 1,
        keys.tool_ledger: 2,
        keys.episodes: 1,
        keys.dead: 7,
        keys.metrics: 6,
    }
    emitted: Any = rclient.smembers(keys.groups_emitted)
    assert sorted(m.decode() for m in emitted) == gid[11:20]
    assert rclient.smembers(keys.groups_dropped) == {gid[15].encode()}
    assert sorted(rclient.hkeys(keys.tool_ledger)) == [
        f"{gid[16]}-m1-0-0#abcdef012345".encode(),
        b"reward-call#abcdef012345",
    ]
    assert rclient.hkeys(keys.episodes) == [f"{gid[13]}-m1".encode()]
    dead: Any = rclient.xrange(keys.dead)
    assert [fields[b"data"] for _, fields in dead] == [b"dead7", b"dead8", b"dead9"]
    assert rclient.xlen(keys.metrics) == 4
    # No checkpoint kept: no floor, the ids stay; the streams keep their length.
    assert ck.trim_history(rclient, keys, None, keep_dead_letters=3, keep_metrics=4) == {}
    assert rclient.scard(keys.groups_emitted) == 9


def test_a_same_size_edit_of_the_state_fails_verify(tmp_path: Path) -> None:
    """Review L4: the commit marker holds a checksum of every state file, not only its size."""
    snap = ck.QueueSnapshot(ck.SNAPSHOT_VERSION, "run", 0, [], [], {}, {}, [], [], {}, {})
    root = tmp_path / "checkpoints"
    _write(root, 2, snap)
    ck.verify(root / "step_00000002")
    state = root / "step_00000002" / "state" / "params.bin"
    data = bytearray(state.read_bytes())
    data[100] ^= 0xFF
    state.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointCorrupt, match=r"state/params\.bin does not match its xxh3"):
        ck.verify(root / "step_00000002")
    assert ck.latest_complete(root) is None


def test_namespace_present_means_every_key_of_a_checkpointed_run(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Review L11: one key left of a run that has a checkpoint is not "Redis kept the
    queues": a Redis that lost part of the run is named, not resumed as if it kept it."""
    assert not ck.namespace_present(rclient, keys, checkpointed=True)  # nothing: lost
    _populate(rclient, keys)
    assert ck.namespace_present(rclient, keys, checkpointed=True)
    rclient.delete(keys.feeder_cursor)
    with pytest.raises(ck.PartialRunError, match=r"part of run .*feeder:cursor"):
        ck.namespace_present(rclient, keys, checkpointed=True)
    assert ck.namespace_present(rclient, keys)  # no checkpoint yet: any key is the run
    rclient.set(keys.feeder_cursor, 5)
    rclient.xgroup_destroy(keys.groups, keys.CG_TRAINER)
    with pytest.raises(ck.PartialRunError, match=r"consumer group trainer"):
        ck.namespace_present(rclient, keys, checkpointed=True)
    # What a restore writes is a whole run.
    snap_keys = Keys(keys.ns + "r")
    _populate(rclient, snap_keys)
    snap = ck.take_snapshot(rclient, snap_keys)
    rclient.delete(*rclient.keys(snap_keys.every_key))
    ck.restore_queues(rclient, snap_keys, snap)
    assert ck.namespace_present(rclient, snap_keys, checkpointed=True)


def test_a_restored_dead_letter_is_the_letter_that_was_written(
    rclient: redis.Redis, keys: Keys
) -> None:
    """The snapshot keeps each dead letter's fields and values: restored, the letter decodes
    to what was dead-lettered, reason and payload (the snapshot once kept the names only)."""
    letter = DeadLetter(source=keys.tasks, entry_id="1-0", reason="malformed", fields={"x": b"y"},
                        consumer="rollout-0", deliveries=3)  # fmt: skip
    publish(rclient, keys.dead, letter)
    snap = ck.take_snapshot(rclient, keys)
    rclient.delete(*rclient.keys(keys.every_key))  # Redis lost the run
    ck.restore_queues(rclient, keys, snap)
    [(_, fields)] = entries(rclient, keys.dead)
    assert decode(fields, DeadLetter) == letter


def test_an_older_snapshots_dead_letters_without_values_do_not_fail_the_restore(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Snapshots written before the fix kept a dead letter's field names only (v, kind,
    data: an odd count XADD refuses); the queues still come back, the letter counted lost."""
    _populate(rclient, keys)
    snap = ck.take_snapshot(rclient, keys)
    old = msgspec.structs.replace(snap, dead=[("9-0", [b"v", b"kind", b"data"])])
    rclient.delete(*rclient.keys(keys.every_key))
    counts = ck.restore_queues(rclient, keys, old)
    assert counts[keys.dead] == 0 and counts["dead_unreadable"] == 1
    assert counts[keys.tasks] == 4 and rclient.xlen(keys.dead) == 0


def _state(traj: str, nbytes: int, turn_tokens: int = 0) -> bytes:
    from streamrl.wire import EpisodeState, encode_state

    return encode_state(EpisodeState(traj_id=traj, tokens=b"\x01" * nbytes,
                                     prompt_len=turn_tokens))  # fmt: skip


def test_the_snapshot_script_does_not_copy_the_episode_states(
    rclient: redis.Redis, keys: Keys
) -> None:
    """Review N10: every in-flight episode's state was read with HGETALL inside the
    snapshot's script: about 100 MB at scale built as Lua strings and a reply while every
    client of Redis waited. Now the script copies only the small values (the committed
    markers, whose agreement with the streams matters) and the states are read after it,
    a page at a time: 256 states of 200 KB cost the script under 20 ms (the review's bound
    is 100 ms; 0.85 ms measured here, against 113 ms before)."""
    from streamrl.wire import EpisodeState, decode_state, encode_state

    big = {f"g{i}-m0": _state(f"g{i}-m0", 200_000) for i in range(256)}
    marker = encode_state(EpisodeState(traj_id="g999-m1", committed=True))
    for i in range(0, len(big), 32):
        rclient.hset(keys.episodes, mapping=dict(list(big.items())[i : i + 32]))
    rclient.hset(keys.episodes, "g999-m1", marker)
    rclient.config_set("slowlog-log-slower-than", 0)
    rclient.slowlog_reset()
    try:
        snap = ck.take_snapshot(rclient, keys)
        log: Any = rclient.slowlog_get(1000)
    finally:
        rclient.config_set("slowlog-log-slower-than", 10000)
    [script_us] = [e["duration"] for e in log if e["command"].split()[0].upper() == b"EVAL"]
    assert script_us < 20_000, script_us  # 0.85 ms here; 113 ms when it copied them
    states = snap.hashes[keys.episodes]
    assert states == {**big, "g999-m1": marker}  # every one, byte for byte
    assert decode_state(states["g999-m1"]).committed


def test_a_state_read_after_the_script_that_became_a_marker_is_left_out(
    rclient: redis.Redis, keys: Keys
) -> None:
    """A big state is read after the script; if its trajectory was committed meanwhile,
    Redis now holds a committed marker written after the cut: kept, it would keep the
    member from running again although its trajectory is not in the snapshot's streams.
    It is left out (the member runs again from its start); a later state of the same
    episode is kept (it resumes as well); a state gone (task acknowledged) is left out."""
    from streamrl.wire import EpisodeState, encode_state

    later = _state("a", 2000, turn_tokens=7)
    rclient.hset(keys.episodes, mapping={
        "a": later,
        "b": encode_state(EpisodeState(traj_id="b", committed=True)),
    })  # fmt: skip
    got = ck._states_after(rclient, keys.episodes, ["a", "b", "c"])
    assert got == {"a": later}


def test_dead_letters_are_capped_in_bytes_too(rclient: redis.Redis, keys: Keys) -> None:
    """Issue 30 item 5: the dead letters were capped by count only (1,000), each a whole
    payload: 1,000 groups of 1 MB were 1 GB in Redis and in every snapshot. Past
    `keep_dead_letter_bytes` of Redis memory the oldest go; the newest stay."""
    ids = [rclient.xadd(keys.dead, {"v": b"1", "data": bytes([i]) * 100_000}) for i in range(20)]
    used = rclient.memory_usage(keys.dead, samples=0)
    assert used is not None and used > 2_000_000
    deleted = ck.trim_history(rclient, keys, None, keep_dead_letters=1000, keep_metrics=10,
                              keep_dead_letter_bytes=500_000)  # fmt: skip
    left = [e for e, _ in entries(rclient, keys.dead)]
    assert 3 <= len(left) <= 5 and deleted[keys.dead] == 20 - len(left)
    assert [as_str(e) for e in left] == [as_str(i) for i in ids[-len(left) :]]  # the newest
    after = rclient.memory_usage(keys.dead, samples=0)
    assert after is not None and after <= 600_000
