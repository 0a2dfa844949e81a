"""The stub policy on real Redis: the trainer's publisher writes the stub's tiny versions
through both channels, the rollout follower loads them into the stub server (a damaged
one refused), and episodes run on the stub are tagged with the version of each turn."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import cast

import msgspec
import numpy as np
import pytest
import redis
import structlog
from structlog.testing import capture_logs

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Action, Agent, Environment, Reset, StepResult
from streamrl.config import parse_config
from streamrl.names import Keys
from streamrl.rl.losses import check_rollout_logps
from streamrl.rollout.engine_server import EngineServer
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.stub import StubDialogue, StubLoader, StubServer
from streamrl.rollout.weights import SyncLock, WeightFollower
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.stub import stub_state
from streamrl.transport import make_async_client
from streamrl.weightsync import DirChannel, RedisChannel, WeightsChannel
from streamrl.wire import Trajectory
from tests.policies import scripted_task

LOG = structlog.get_logger()


class TwoSteps(Environment):
    """Two model turns: the first step replies, the second ends the episode."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self) -> Reset:
        return Reset(prompt="alpha bravo charlie")

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult(observations=["step 1 done"], done=False)
        return StepResult(observations=[], done=True, reward=0.5)

    async def close(self) -> None:
        return None


def _pair() -> tuple[Agent, Environment]:
    return ToolAgent(), TwoSteps()


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_stub_serves_published_versions(
    rclient: redis.Redis, redis_url: str, keys: Keys, tmp_path: Path, kind: str
) -> None:
    channel: WeightsChannel = (
        RedisChannel(rclient, keys, 4096) if kind == "redis" else DirChannel(tmp_path / "w")
    )
    pub = WeightPublisher(rclient, keys, channel, LOG)
    params = stub_state().params
    server = StubServer(latency_s=0.01, turn_tokens=8)
    cfg = parse_config({"model": {"kind": "stub"}}).rollout
    runner = EpisodeRunner(server, StubDialogue, cfg, 0, "test", LOG)

    async def go() -> list[Trajectory]:
        aclient = make_async_client(redis_url)
        # The follower is annotated with the engine server, whose interface the stub has.
        served = cast(EngineServer, server)
        follower = WeightFollower(
            aclient,
            keys,
            served,
            StubLoader(rclient, keys, tmp_path / "w"),
            SyncLock(),
            LOG,
            "continue",
        )
        try:
            pub.publish(params, 0, 0)
            assert await follower.wait_initial(lambda: False)  # before any episode
            assert server.version == 0
            first = await runner.run(scripted_task(0, "stub"), 0, _pair)
            pub.publish(params, 1, 1)
            assert await follower.poll(block_ms=1000)
            assert server.version == follower.loaded_version == 1
            # A damaged version is refused; version 1 goes on serving.
            msg = pub.publish(params, 2, 2)
            if kind == "dir":
                Path(msg.path).write_bytes(Path(msg.path).read_bytes()[:-8])
            else:
                rclient.delete(keys.weights_chunk(2, 0))
            assert not await follower.poll(block_ms=1000)
            assert follower.refused == 1 and server.version == 1
            many = await asyncio.gather(
                *(runner.run(scripted_task(i, "stub"), 0, _pair) for i in range(1, 33))
            )
            return [first, *many]
        finally:
            await aclient.aclose()

    trajs = asyncio.run(go())
    assert all(t.status == "ok" and t.reward == 0.5 for t in trajs)
    assert trajs[0].versions == [0, 0]
    assert all(t.versions == [1, 1] for t in trajs[1:])
    for t in trajs:  # what the trainer checks before it uses rollout log-probs
        check_rollout_logps(t.logprob_array(), t.mask_array())
        assert int(np.sum(t.mask_array())) == 16  # two turns of 8 sampled tokens


def test_a_weights_path_outside_the_weights_directory_or_not_a_file_is_refused(
    rclient: redis.Redis, redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    """Review L6: a `dir` signal names its file's path; the reader opens only regular files
    in RUN_DIR/weights. A path elsewhere (a copy of a good version, right size and
    checksum), a directory, a FIFO (which would block the loader thread for ever) are
    refused (`weights_refused`) and the last good version goes on serving: no crash, so no
    crash loop on the newest version at every restart."""
    weights = tmp_path / "weights"
    pub = WeightPublisher(rclient, keys, DirChannel(weights), LOG)
    params = stub_state().params
    server = StubServer(latency_s=0.01, turn_tokens=8)
    outside = tmp_path / "elsewhere" / "v000001.weights"
    outside.parent.mkdir()
    fifo = weights / "v000003.weights"

    async def go() -> None:
        aclient = make_async_client(redis_url)
        loader = StubLoader(rclient, keys, weights)
        follower = WeightFollower(
            aclient, keys, cast(EngineServer, server), loader, SyncLock(), LOG, "continue"
        )
        try:
            good = pub.publish(params, 0, 0)
            assert await follower.poll(block_ms=1000)
            outside.write_bytes(Path(good.path).read_bytes())
            bad = [
                msgspec.structs.replace(good, version=1, path=str(outside)),
                msgspec.structs.replace(good, version=2, path=str(weights)),
            ]
            os.mkfifo(fifo)
            bad.append(msgspec.structs.replace(good, version=3, path=str(fifo)))
            reasons = []
            for msg in bad:
                with capture_logs() as logs:
                    loaded = await asyncio.wait_for(follower.load(msg), timeout=10)
                assert not loaded
                [refusal] = [e for e in logs if e["event"] == "weights_refused"]
                reasons.append(refusal["reason"])
            assert follower.refused == 3 and server.version == follower.loaded_version == 0
            assert "is not in the weights directory" in reasons[0]
            assert "is not a regular file" in reasons[1] and "is not a regular file" in reasons[2]
        finally:
            await aclient.aclose()

    asyncio.run(go())
