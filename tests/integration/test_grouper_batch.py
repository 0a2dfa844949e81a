"""A read batch through the grouper against a real redis-server: two pipelined round trips,
with the outcomes and the Redis state that handling each delivery on its own gives."""

from collections.abc import Callable
from typing import Any

import pytest
import redis
import structlog
from redis.connection import Connection

from streamrl.config import Config
from streamrl.grouper import Grouper, Outcome
from streamrl.grouper.scoring import OutcomeKind
from streamrl.names import Keys
from streamrl.transport import make_client, publish
from streamrl.wire import Trajectory
from tests.integration.test_grouper import CFG, groups_out, traj

TRAINER_VERSION = 5  # with off_policy_steps 1, a member of version 3 is stale

BATCH_CFG = CFG.model_copy(
    update={
        "transport": CFG.transport.model_copy(update={"read_count": 64}),
    }
)
DROP_CFG = BATCH_CFG.model_copy(
    update={"grouper": BATCH_CFG.grouper.model_copy(update={"zero_variance": "drop"})}
)


def command_names(packed: bytes | list[Any]) -> list[str]:
    """The command names in one write of RESP-encoded commands, read by their lengths (a
    payload cannot pass for a command)."""
    buf = packed if isinstance(packed, bytes) else b"".join(bytes(c) for c in packed)
    names, pos = [], 0
    while pos < len(buf):
        end = buf.index(b"\r\n", pos)
        assert buf[pos : pos + 1] == b"*"
        n, pos = int(buf[pos + 1 : end]), end + 2
        args = []
        for _ in range(n):
            end = buf.index(b"\r\n", pos)
            size, pos = int(buf[pos + 1 : end]), end + 2
            args.append(buf[pos : pos + size])
            pos += size + 2
        names.append(args[0].decode().upper())
    return names


class RecordingConnection(Connection):
    """A connection that notes the commands of each write to its socket, one entry per
    round trip (a pipeline is one write), and calls `before_send` with them first."""

    def __init__(
        self,
        *args: Any,
        sent: list[list[str]],
        before_send: Callable[[list[str]], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.sent = sent
        self.before_send = before_send

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        names = command_names(command)
        self.before_send(names)
        self.sent.append(names)
        super().send_packed_command(command, check_health)


def recording_grouper(
    url: str, keys: Keys, cfg: Config, before_send: Callable[[list[str]], None] = lambda names: None
) -> tuple[Grouper, list[list[str]]]:
    sent: list[list[str]] = []
    client = make_client(
        url, connection_class=RecordingConnection, sent=sent, before_send=before_send
    )
    g = Grouper(client, keys, cfg, "g0", structlog.get_logger())
    sent.clear()  # the connection's handshake and the consumer group's creation
    return g, sent


def undecodable(rclient: redis.Redis, keys: Keys, group: int) -> None:
    """Member 0 of `group` as a foreign writer left it: bytes no decoder takes."""
    rclient.hset(keys.group_members(f"g{group}"), "0", b"\x00not a trajectory")


def state(rclient: redis.Redis, keys: Keys, groups: range) -> dict[str, Any]:
    """Everything the grouper writes, with the run's namespace taken out."""
    return {
        "stats": rclient.hgetall(keys.stats),
        "groups": [
            (g.group_id, [m.traj_id for m in g.members], g.advantages)
            for g in groups_out(rclient, keys)
        ],
        "emitted": rclient.smembers(keys.groups_emitted),
        "dropped": rclient.smembers(keys.groups_dropped),
        "started": set(rclient.hkeys(keys.groups_started)),  # (the values are times)
        "held": {gi: rclient.hgetall(keys.group_members(f"g{gi}")) for gi in groups},
        "pending": rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"],
    }


def spread(group: int, member: int, version: int = TRAINER_VERSION) -> Trajectory:
    return traj(group, member, float(member % 2), version=version)


# Each scenario: the trajectories of one batch, in order, with the outcome each must get.
MIXED: list[tuple[Trajectory, OutcomeKind]] = [
    # two groups interleaved, each completed inside the batch
    (spread(1, 0), "partial"),
    (spread(2, 0), "partial"),
    (spread(1, 1), "partial"),
    (spread(1, 2), "partial"),
    (spread(2, 1), "partial"),
    (spread(1, 3), "emitted"),
    (spread(1, 2), "duplicate"),  # re-sent after its group completed in this batch
    (spread(2, 2), "partial"),
    (spread(2, 2), "partial"),  # re-sent before
    (spread(2, 3), "emitted"),
    (spread(2, 0), "duplicate"),
    # a stale member drops its group; members after it find the group closed
    (spread(3, 0), "partial"),
    (spread(3, 1, version=3), "dropped"),
    (spread(3, 2), "closed"),
    (spread(3, 3), "closed"),
    # a stale member re-sent after its group completed in this batch: the group stays emitted
    (spread(4, 0), "partial"),
    (spread(4, 1), "partial"),
    (spread(4, 2), "partial"),
    (spread(4, 3), "emitted"),
    (spread(4, 1, version=3), "dropped"),
    # every member ended with error
    *[(traj(5, m, 0.0, version=TRAINER_VERSION, status="error"), "partial") for m in range(3)],
    (traj(5, 3, 0.0, version=TRAINER_VERSION, status="error"), "dropped"),
    (traj(5, 1, 0.0, version=TRAINER_VERSION, status="error"), "closed"),
    # a stored member no decoder takes (member 0, written by undecodable())
    (spread(6, 1), "partial"),
    (spread(6, 2), "partial"),
    (spread(6, 3), "dropped"),
    (spread(6, 3), "closed"),
    # a stale first member: the group is dropped before it was added to
    (spread(7, 0, version=3), "dropped"),
    (spread(7, 1), "closed"),
]

ZERO_VARIANCE = [
    *[(traj(8, m, 1.0, version=TRAINER_VERSION), "partial") for m in range(3)],
    (traj(8, 3, 1.0, version=TRAINER_VERSION), "dropped"),
    (traj(8, 2, 1.0, version=TRAINER_VERSION), "closed"),
    *[(spread(9, m), "partial") for m in range(3)],
    (spread(9, 3), "emitted"),
]
ZERO_VARIANCE_KEPT = [
    (t, {"dropped": "emitted", "closed": "duplicate"}.get(k, k)) for t, k in ZERO_VARIANCE
]


@pytest.mark.parametrize(
    ("scenario", "cfg"),
    [(MIXED, BATCH_CFG), (ZERO_VARIANCE, DROP_CFG), (ZERO_VARIANCE_KEPT, BATCH_CFG)],
    ids=["mixed", "zero_variance_dropped", "zero_variance_kept"],
)
def test_batch_matches_one_delivery_at_a_time(
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    scenario: list[tuple[Trajectory, OutcomeKind]],
    cfg: Config,
) -> None:
    """The same trajectories in two runs: one step for the whole batch, and handle() for
    each delivery (the one-by-one reference). Same outcomes, same Redis state."""
    runs = [keys, Keys(f"{keys.ns}b")]
    batch, single = (
        Grouper(make_client(redis_url), k, cfg, "g0", structlog.get_logger()) for k in runs
    )
    for run in runs:
        rclient.set(run.policy_version, TRAINER_VERSION)
        undecodable(rclient, run, 6)
        for t, _ in scenario:
            publish(rclient, run.trajectories, t)
    want = [Outcome(kind, t.group_id) for t, kind in scenario]

    assert batch.step() == want
    deliveries = single.input.read()
    assert len(deliveries) == len(scenario)
    version = single.trainer_version()
    assert [single.handle(d, version) for d in deliveries] == want

    groups = range(1, 10)
    assert state(rclient, runs[0], groups) == state(rclient, runs[1], groups)
    assert state(rclient, runs[0], groups)["pending"] == 0


# A batch with no stale member of a group added to before it: one pair of round trips.
ONE_PAIR = [(t, kind) for t, kind in MIXED if t.group_id not in ("g3", "g4")]
# The first pipeline: every delivery's add, but the stale member of g7 (a drop, at 20).
ADDS = ["EVAL", *["EVALSHA"] * 19, "EVAL", "EVALSHA"]
# The second: each delivery whose add completed its group, first or re-sent: the emits of
# g1 and g2, then the drops of g5 and g6.
FINISHES = ["EVAL", *["EVALSHA"] * 3, "EVAL", *["EVALSHA"] * 3]


def run_one_pair(rclient: redis.Redis, keys: Keys, g: Grouper, sent: list[list[str]]) -> None:
    rclient.set(keys.policy_version, TRAINER_VERSION)
    undecodable(rclient, keys, 6)
    for t, _ in ONE_PAIR:
        publish(rclient, keys.trajectories, t)
    assert len(ADDS) == len(ONE_PAIR)
    assert g.step() == [Outcome(kind, t.group_id) for t, kind in ONE_PAIR]
    # The read (idle entries claimed first), the trainer version, then the two pipelines,
    # each sending a script's body with its first call only.
    assert sent == [["XAUTOCLAIM"], ["XREADGROUP"], ["MGET"], ADDS, FINISHES]
    assert [grp.group_id for grp in groups_out(rclient, keys)] == ["g1", "g2"]
    stats = rclient.hgetall(keys.stats)
    assert stats[b"groups"] == b"2" and stats[b"groups_dropped"] == b"3"
    # g5: its 4 members held (the last one's add completed it), then 1 re-sent; g6 the
    # same; g7: its stale member, then 1 closed
    assert stats[b"trajectories_dropped"] == b"12"
    assert rclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0


def test_a_batch_is_two_round_trips(rclient: redis.Redis, redis_url: str, keys: Keys) -> None:
    g, sent = recording_grouper(redis_url, keys, BATCH_CFG)
    run_one_pair(rclient, keys, g, sent)


def test_script_cache_flushed_before_each_pipeline(
    rclient: redis.Redis, redis_url: str, keys: Keys
) -> None:
    """SCRIPT FLUSH (or a server restart) just before each pipeline costs nothing: each
    pipeline brings the bodies of the scripts it runs."""
    flushes: list[bool] = []

    def flush(names: list[str]) -> None:
        if "EVAL" in names:
            flushes.append(rclient.script_flush())

    g, sent = recording_grouper(redis_url, keys, BATCH_CFG, before_send=flush)
    run_one_pair(rclient, keys, g, sent)
    assert flushes == [True, True]
