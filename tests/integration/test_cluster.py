"""Redis Cluster: a real three-node cluster, the cluster client, runs on different nodes.

Every key of a run carries its `{ns}` hash tag, so the grouper's scripts, the checkpoint
snapshot and restore, the tool ledger and every MULTI/EXEC touch one slot: none of them may
get CROSSSLOT, and runs spread over the nodes.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import structlog
from redis.cluster import RedisCluster

from streamrl import checkpoints as ck
from streamrl.config import ToolsConfig, load_config
from streamrl.grouper import Grouper
from streamrl.names import Keys
from streamrl.run.runtime import NoRedisError, make_context
from streamrl.tools.client import ToolClient
from streamrl.tools.ledger import AsyncToolLedger, ToolLedger, ledger_key
from streamrl.transport import (
    RQ_NEEDS_ONE_REDIS,
    is_cluster,
    make_async_client,
    make_client,
    publish,
)
from streamrl.wire import ToolResult
from tests.integration.test_checkpoints import _add, _populate, _read
from tests.integration.test_grouper import CFG, groups_out, traj
from tests.integration.test_ledger import lines

pytestmark = pytest.mark.timeout(120)

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


@pytest.fixture(scope="module")
def cclient(redis_cluster: list[str]) -> Iterator[redis.Redis]:
    client = make_client(redis_cluster[0], cluster=True)
    assert is_cluster(client)
    yield client
    client.close()


def _node(client: redis.Redis, keys: Keys) -> str:
    cluster: Any = client
    node = cluster.get_node_from_key(keys.stats)
    return f"{node.host}:{node.port}"


@pytest.fixture
def runs(cclient: redis.Redis) -> list[Keys]:
    """Three fresh runs, one on each node of the cluster."""
    by_node: dict[str, Keys] = {}
    while len(by_node) < 3:
        keys = Keys(f"t{uuid.uuid4().hex[:12]}")
        by_node.setdefault(_node(cclient, keys), keys)
    return list(by_node.values())


def test_runs_land_on_different_nodes_and_keep_one_slot(
    cclient: redis.Redis, runs: list[Keys]
) -> None:
    assert len({_node(cclient, k) for k in runs}) == 3
    for keys in runs:
        cclient.set(keys.feeder_cursor, 1)
        cclient.hset(keys.group_members("g1"), "0", b"m")
        nodes = {_node(cclient, keys)}
        nodes |= {f"{n.host}:{n.port}" for n in [_keynode(cclient, keys.group_members("g1"))]}
        assert len(nodes) == 1


def _keynode(client: redis.Redis, key: str) -> Any:
    cluster: Any = client
    return cluster.get_node_from_key(key)


def test_groupers_race_on_every_node(
    redis_cluster: list[str], cclient: redis.Redis, runs: list[Keys]
) -> None:
    """Two groupers per run, three runs at once: every group of every run exactly once."""
    n_groups, n = 30, 4
    workers = []
    for r, keys in enumerate(runs):
        items = [traj(gi, m, float((gi + m) % 3)) for gi in range(n_groups) for m in range(n)]
        items += random.Random(r).sample(items, 20)  # re-sent members
        random.Random(r + 10).shuffle(items)
        pipe = cclient.pipeline(transaction=True)  # one slot: a cluster MULTI/EXEC
        for it in items:
            publish(pipe, keys.trajectories, it)
        pipe.execute()
        for i in range(2):
            client = make_client(redis_cluster[i], cluster=True)
            workers.append(Grouper(client, keys, CFG, f"g{i}", structlog.get_logger()))
    threads = [threading.Thread(target=w.run, args=(threading.Event(), True)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)
    for keys in runs:
        out = groups_out(cclient, keys)
        ids = [g.group_id for g in out]
        assert len(ids) == len(set(ids)) == n_groups
        assert all(sorted(t.member for t in g.members) == list(range(n)) for g in out)
        assert cclient.xpending(keys.trajectories, keys.CG_GROUPER)["pending"] == 0
        assert cclient.hlen(keys.groups_started) == 0


def _forget(client: redis.Redis, keys: Keys) -> None:
    """Redis lost the run: every key of its slot, read on the node that holds it."""
    node = _keynode(client, keys.stats)
    cluster: Any = client
    found = cluster.keys(keys.every_key, target_nodes=node)
    for key in found:
        client.delete(key)


def test_snapshot_and_restore_on_every_node(cclient: redis.Redis, runs: list[Keys]) -> None:
    for keys in runs:
        ids = _populate(cclient, keys)
        snap = ck.take_snapshot(cclient, keys)
        assert snap.partial_groups == {"g7": {"0": b"m0", "2": b"m2"}}
        _forget(cclient, keys)
        assert not ck.namespace_present(cclient, keys)
        counts = ck.restore_queues(cclient, keys, snap)  # one MULTI/EXEC
        assert counts[keys.tasks] == 4 and counts[keys.groups] == 3
        assert _read(cclient, keys.tasks, keys.CG_ROLLOUT, "r2", 10) == ids["tasks"][1:]
        assert cclient.hgetall(keys.group_members("g7")) == {b"0": b"m0", b"2": b"m2"}
        # And the rewind script, on the restored trainer group.
        _read(cclient, keys.groups, keys.CG_TRAINER, "trainer", 10)
        s = snap.stream(keys.groups)
        assert s is not None
        ck.rewind_group(cclient, s)
        assert _read(cclient, keys.groups, keys.CG_TRAINER, "t2", 10) == ids["groups"][1:]
        _add(cclient, keys.tasks, 1, "later")


def test_snapshot_retries_when_the_groups_being_assembled_change(
    cclient: redis.Redis, runs: list[Keys], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group that starts between the read of `started` and the script: the script sees
    another set than the one whose member hashes it was given, and the snapshot is taken
    again (never one that misses the new group's members)."""
    keys = runs[0]
    _populate(cclient, keys)
    real = cclient.hkeys
    calls: list[int] = []

    def stale_then_real(name: str) -> Any:
        calls.append(1)
        got: Any = real(name)
        if len(calls) == 1:  # what we read is stale: g8 starts right after
            cclient.hset(keys.group_members("g8"), "1", b"late")
            cclient.hset(keys.groups_started, "g8", 1)
        return got

    monkeypatch.setattr(cclient, "hkeys", stale_then_real)
    snap = ck.take_snapshot(cclient, keys)
    assert len(calls) == 2
    assert snap.partial_groups["g8"] == {"1": b"late"} and set(snap.groups_started) == {"g7", "g8"}


def test_ledger_on_every_node(
    redis_cluster: list[str], cclient: redis.Redis, runs: list[Keys], tmp_path: Path
) -> None:
    for r, keys in enumerate(runs):
        ledger = ToolLedger(cclient, keys, structlog.get_logger(), claim_ttl_s=10, wait_s=1)
        key = ledger_key("c-0", "shell", "{}")
        result = ToolResult(call_id="c-0", ok=True, output=f"run {r}")
        assert ledger.run_once(key, "c-0", lambda res=result: res) == result  # type: ignore[misc]
        hit = ledger.run_once(key, "c-0", lambda: pytest.fail("ran twice"))
        assert hit == msgspec.structs.replace(result, ledger_hit=True)
        effects = tmp_path / f"effects{r}"
        # two racing executions of one call, each on its own asyncio cluster client
        assert asyncio.run(_race(redis_cluster[r], keys, effects)) == ["run 1", "run 1"]
        assert lines(effects) == 1


async def _race(url: str, keys: Keys, effects: Path) -> list[str]:
    async def run() -> ToolResult:
        with effects.open("a") as f:
            f.write("x\n")
        await asyncio.sleep(0.3)  # the other execution finds the claim held
        return ToolResult(call_id="c-1", ok=True, output=f"run {lines(effects)}")

    async def once() -> str:
        aclient = make_async_client(url, cluster=True)
        try:
            ledger = AsyncToolLedger(aclient, keys, structlog.get_logger(), wait_s=10)
            return (await ledger.run_once(ledger_key("c-1", "append", "{}"), "c-1", run)).output
        finally:
            await aclient.aclose()

    return list(await asyncio.gather(once(), once()))


def test_tool_queue_is_refused_on_a_cluster(
    redis_cluster: list[str], cclient: redis.Redis, runs: list[Keys], tmp_path: Path
) -> None:
    async def call() -> None:
        aclient = make_async_client(redis_cluster[0], cluster=True)
        try:
            client = ToolClient(cclient, aclient, runs[0], ToolsConfig(), structlog.get_logger())
            await client.call("calculator", "{}", "c-0")
        finally:
            await aclient.aclose()

    with pytest.raises(RuntimeError, match="needs a single Redis"):
        asyncio.run(call())
    cfg = load_config(TINY, ["redis.cluster=true", f"redis.url={redis_cluster[0]}"])
    with pytest.raises(NoRedisError) as err:
        make_context("tools", 0, cfg, tmp_path)
    assert str(err.value) == RQ_NEEDS_ONE_REDIS
    assert is_cluster(make_context("grouper", 0, cfg, tmp_path).client())
    assert not isinstance(make_client(redis_cluster[0]), RedisCluster)
