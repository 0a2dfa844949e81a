"""Weight sync end to end: the trainer's publisher, both channels, the rollout follower,
the real engine (tiny model) and a real Redis server.

Checked here: damaged versions (flipped byte, truncated, deleted; file and Redis chunks)
are refused with a clear logged reason while the engine keeps serving the last good
version; the chunked Redis round trip and its clean-up; LoRA adapters published alone and
merged by the reader serve exactly what `apply_lora` merged serves; the three sync modes'
version tags per model turn; a (re)starting follower loads the latest version first.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import pytest
import redis
import structlog
from structlog.testing import capture_logs

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Action, Agent, Environment, Reset, StepResult
from streamrl.chat.hf import HFChat
from streamrl.config import Config, parse_config
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.lora import LoraConfig, apply_lora, init_lora
from streamrl.model.sampling import GenRequest, GenResult, SamplingParams
from streamrl.model.weights import params_from_bytes, params_to_bytes
from streamrl.names import Keys
from streamrl.rollout.engine_server import EngineServer
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.loader import WeightLoader
from streamrl.rollout.weights import SyncLock, SyncMode, WeightFollower
from streamrl.run.liveness import Liveness
from streamrl.trainer.cluster import Cluster
from streamrl.trainer.hooks import PublishHook
from streamrl.trainer.publish import WeightPublisher
from streamrl.transport import make_async_client
from streamrl.weightsync import DirChannel, RedisChannel, WeightsChannel, read_published
from streamrl.wire import Trajectory, Weights, decode
from tests.policies import always_eos, scripted_task, tiny_policy

GREEDY = SamplingParams(temperature=1.0, top_p=1.0, top_k=1)
LOG = structlog.get_logger()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, HFChat, Any, Any]:
    return tiny_policy(tmp_path_factory.mktemp("cache"))


def _engine(model: Any, params: Any) -> Engine:
    _, chat, spec, _ = model
    return Engine(
        spec,
        params,
        EngineConfig(
            num_slots=8,
            kv_cache_size=128,
            max_prompt_length=127,
            max_new_tokens=16,
            sampling=GREEDY,
            stop_ids=tuple(chat.stop_ids),
            pad_id=chat.pad_id,
            decode_chunk=4,
        ),
    )


def _scaled(params: Any, factor: float) -> Any:
    return jax.tree.map(lambda x: x * np.asarray(factor, x.dtype), params)


def _equal(a: Any, b: Any) -> bool:
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _outputs(engine: Engine, chat: HFChat) -> list[GenResult]:
    prompts = ["Compute 1+1 with the calculator.", "What is 7-3?", "Hello"]
    return engine.generate([GenRequest(chat.encode(p), 12, i) for i, p in enumerate(prompts)])


def _channel(kind: str, client: redis.Redis, keys: Keys, tmp_path: Path) -> WeightsChannel:
    if kind == "redis":
        return RedisChannel(client, keys, chunk_bytes=4096)  # several chunks per version
    return DirChannel(tmp_path / "weights")


def _follower(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    mode: SyncMode = "continue",
    server: EngineServer | None = None,
    load: Callable[[Weights, Weights | None], Any] | None = None,
    weights_dir: Path | None = None,
) -> WeightFollower:
    """`weights_dir`: where `dir` versions are (`_channel`'s); None: Redis versions only."""
    params = model[3]
    server = server or EngineServer(_engine(model, params), -1, LOG)
    loader = load or WeightLoader(rclient, keys, params, params, weights_dir=weights_dir)
    aclient = make_async_client(redis_url)  # connects in the test's event loop
    return WeightFollower(aclient, keys, server, loader, SyncLock(), LOG, mode)


def _engine_of(follower: WeightFollower) -> Engine:
    """The engine behind a follower's server (an EngineServer in these tests)."""
    assert isinstance(follower.server, EngineServer)
    return follower.server.engine


async def _close(*followers: WeightFollower) -> None:
    for f in followers:
        await f.aclient.aclose()


def _check(follower: WeightFollower, check: Callable[[], Awaitable[None]]) -> None:
    """Run `check` on an event loop, then close the follower's client."""

    async def go() -> None:
        try:
            await check()
        finally:
            await _close(follower)

    asyncio.run(go())


# -- damaged versions ---------------------------------------------------------------------


def _damage(kind: str, how: str, msg: Weights, client: redis.Redis, keys: Keys) -> None:
    if kind == "dir":
        path = Path(msg.path)
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        elif how == "truncate":
            path.write_bytes(bytes(data[:-100]))
        else:
            path.unlink()
        return
    middle = keys.weights_chunk(msg.version, msg.chunks // 2)
    last = keys.weights_chunk(msg.version, msg.chunks - 1)
    if how == "flip":
        byte: Any = client.getrange(middle, 10, 10)
        client.setrange(middle, 10, bytes([byte[0] ^ 0xFF]))
    elif how == "truncate":
        value: Any = client.get(last)
        client.set(last, value[:-100])
    else:
        client.delete(middle)


REASONS = {
    ("dir", "flip"): r"weights file .*v000001\.weights has checksum xxh3_128:[0-9a-f]{32}, exp",
    ("dir", "truncate"): r"weights file .*v000002\.weights has \d+ bytes, expected \d+",
    ("dir", "delete"): r"weights file .*v000003\.weights is missing",
    ("redis", "flip"): r"weights \{t\w+\}:weights:v000001:0\.\.\d+ in Redis has checksum xxh3_1",
    ("redis", "truncate"): r"weights \{t\w+\}:weights:v000002:0\.\.\d+ in Redis has \d+ bytes, exp",
    ("redis", "delete"): r"in Redis: chunks \[\d+\] are missing \(deleted or never written\)",
}


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_damaged_versions_are_refused_and_the_last_good_one_serves(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    kind: str,
) -> None:
    _, chat, _, params = model
    good = _scaled(params, 1.5)
    pub = WeightPublisher(rclient, keys, _channel(kind, rclient, keys, tmp_path), LOG, keep=8)
    follower = _follower(model, rclient, redis_url, keys, weights_dir=tmp_path / "weights")
    engine = _engine_of(follower)
    expected = _outputs(_engine(model, good), chat)

    async def check() -> None:
        pub.publish(good, 0, 0)
        assert await follower.poll(block_ms=1000)
        for version, how in enumerate(["flip", "truncate", "delete"], start=1):
            msg = pub.publish(_scaled(params, 0.5), version, version)
            _damage(kind, how, msg, rclient, keys)
            with capture_logs() as logs:
                assert not await follower.poll(block_ms=1000)
            [refusal] = [e for e in logs if e["event"] == "weights_refused"]
            assert refusal["log_level"] == "error" and refusal["version"] == version
            assert refusal["serving_version"] == 0
            assert re.search(REASONS[kind, how], refusal["reason"]), refusal["reason"]
            assert follower.refused == version and follower.loaded_version == 0
            assert follower.lock.is_open  # episodes start again, on version 0
            assert follower.server.version == 0 and _equal(engine.params, good)
            assert _outputs(engine, chat) == expected  # still serving the last good version
        pub.publish(_scaled(params, 0.5), 4, 4)  # the next good version is taken
        assert await follower.poll(block_ms=1000)
        assert follower.server.version == 4 and _equal(engine.params, _scaled(params, 0.5))

    _check(follower, check)


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_a_missing_version_that_newer_ones_superseded_is_skipped_not_refused(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    kind: str,
) -> None:
    """A fast trainer prunes a version (weights_keep) between its signal and the follower's
    load: since newer versions exist, that is no damage to report; the follower skips it
    (`weights_superseded`) and takes the newest at its next poll. The same loss with no
    newer version stays a refusal (the damaged-versions test)."""
    _, _, _, params = model
    pub = WeightPublisher(rclient, keys, _channel(kind, rclient, keys, tmp_path), LOG, keep=8)
    follower = _follower(model, rclient, redis_url, keys, weights_dir=tmp_path / "weights")

    async def check() -> None:
        pub.publish(params, 0, 0)
        assert await follower.poll(block_ms=1000)
        v1 = pub.publish(_scaled(params, 0.5), 1, 1)
        pub.publish(_scaled(params, 0.25), 2, 2)
        _damage(kind, "delete", v1, rclient, keys)  # pruned before the follower got to it
        with capture_logs() as logs:
            assert not await follower.load(v1)
        assert [e["event"] for e in logs if e["event"].startswith("weights_")] == [
            "weights_superseded"
        ]
        assert follower.superseded == 1 and follower.refused == 0
        assert follower.loaded_version == 0 and follower.lock.is_open
        assert await follower.poll(block_ms=1000)  # the newest, v2
        assert follower.loaded_version == 2

    _check(follower, check)


# -- chunked Redis ------------------------------------------------------------------------


def test_chunked_redis_round_trip_and_clean_up(
    model: Any, rclient: redis.Redis, keys: Keys
) -> None:
    params = model[3]
    data = params_to_bytes(params)
    channel = RedisChannel(rclient, keys, chunk_bytes=4096)
    pub = WeightPublisher(rclient, keys, channel, LOG, keep=2)
    msg = pub.publish(params, 0, 0)
    assert msg.channel == "redis" and msg.nbytes == len(data)
    assert msg.chunks >= -(-len(data) // 4096) > 2
    assert msg.path == keys.weights_blob(0)
    sizes = [rclient.strlen(keys.weights_chunk(0, i)) for i in range(msg.chunks)]
    assert all(0 < n <= 4096 for n in sizes) and sum(sizes) == len(data)
    assert read_published(msg, rclient, keys, None).tobytes() == data
    assert _equal(params_from_bytes(params, read_published(msg, rclient, keys, None)), params)
    # Publishing goes on: only the last two versions stay in Redis.
    for v in range(1, 5):
        pub.publish(_scaled(params, 1 + v / 10), v, v)
    held: Any = rclient.hgetall(keys.weights_chunks)
    assert {int(k) for k in held} == {3, 4}
    stored = {k.decode() for k in rclient.scan_iter(keys.weights_chunk_pattern)}
    assert stored == {keys.weights_chunk(v, i) for v in (3, 4) for i in range(msg.chunks)}
    assert [m.version for m in _published(rclient, keys)] == [3, 4]  # entries of kept only
    # A restarted trainer (a new publisher) cleans up what the last one left.
    WeightPublisher(rclient, keys, channel, LOG, keep=2).publish(params, 5, 5)
    held = rclient.hgetall(keys.weights_chunks)
    assert {int(k) for k in held} == {5}
    assert [m.version for m in _published(rclient, keys)] == [5]
    # trim=False: the stream keeps every entry (the files or chunks still go).
    pub = WeightPublisher(rclient, keys, channel, LOG, keep=1, trim=False)
    for v in (6, 7, 8):
        pub.publish(params, v, v)
    assert [m.version for m in _published(rclient, keys)] == [5, 6, 7, 8]


# -- LoRA ---------------------------------------------------------------------------------


def _adapters(params: Any, cfg: LoraConfig) -> Any:
    """Adapters whose B is not zero, so that merging them changes the model."""
    adapters = init_lora(params, cfg, seed=3)
    rng = np.random.default_rng(4)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            x + np.asarray(rng.standard_normal(x.shape) * 0.5, x.dtype)
            if str(getattr(path[-1], "key", "")) == "lora_b"
            else x
        ),
        adapters,
    )


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_lora_publish_serves_exactly_the_merged_model(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    kind: str,
) -> None:
    _, chat, _, ckpt_params = model
    base = _scaled(ckpt_params, 1.25)  # the trainer's base differs from the checkpoint
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    adapters = _adapters(base, lora)
    expected = _outputs(_engine(model, apply_lora(base, adapters, lora)), chat)
    assert expected != _outputs(_engine(model, base), chat)  # the adapters matter

    channel = _channel(kind, rclient, keys, tmp_path)
    pub = WeightPublisher(rclient, keys, channel, LOG, keep=1)
    # A train state that holds adapters beside the frozen base (what LoRA training keeps).
    state = SimpleNamespace(params=adapters, base_params=base)
    loop: Any = SimpleNamespace(
        cfg=parse_config({}),
        version=0,
        version_held=False,
        step=0,
        state=state,
        cluster=Cluster(),
        liveness=Liveness(),
        trace=lambda *args, **kw: None,  # the loop's spans (weights.publish): not traced here
    )
    hook = PublishHook(1, pub, adapters=lambda st: (st.params, lora))
    follower = _follower(model, rclient, redis_url, keys, weights_dir=tmp_path / "weights")

    async def go() -> None:
        late = _follower(model, rclient, redis_url, keys, weights_dir=tmp_path / "weights")
        try:
            await check(late)
        finally:
            await _close(follower, late)

    async def check(late: WeightFollower) -> None:
        hook(loop, final=True)  # version 0: full, the base
        assert await follower.poll(block_ms=1000)
        for step in (1, 2):
            loop.step = step
            hook(loop, final=False)  # adapters only
            assert await follower.poll(block_ms=1000)
        assert follower.server.version == 2
        assert _outputs(_engine_of(follower), chat) == expected
        # A worker that starts now finds adapters newest: it loads their base first.
        assert await late.wait_initial(lambda: False)
        assert late.loaded_version == 2
        assert _outputs(_engine_of(late), chat) == expected

    asyncio.run(go())
    full, *loras = _published(rclient, keys)
    assert full.kind == "full" and all(m.kind == "lora" for m in loras)
    assert all(m.base_version == 0 and m.lora is not None and m.lora.rank == 4 for m in loras)
    assert loras[0].nbytes * 10 < full.nbytes  # only adapter bytes travel
    # keep=1: version 2 and the base it needs stay, version 1 is gone, and its entry.
    assert [m.version for m in _published(rclient, keys)] == [0, 2]
    if kind == "redis":
        held: Any = rclient.hgetall(keys.weights_chunks)
        assert {int(k) for k in held} == {0, 2}
    else:
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
            "v000000.weights",
            "v000002.weights",
        ]


def test_attached_lora_serving_takes_adapter_bytes_only(
    model: Any, rclient: redis.Redis, redis_url: str, keys: Keys, tmp_path: Path
) -> None:
    # rollout.lora_serving = "attached": the adapters sit beside the kernels, which stay
    # the base's own arrays; greedy outputs are the merged model's up to float rounding.
    _, chat, _, ckpt_params = model
    base = _scaled(ckpt_params, 1.25)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    adapters = _adapters(base, lora)
    expected = _outputs(_engine(model, apply_lora(base, adapters, lora)), chat)
    pub = WeightPublisher(rclient, keys, _channel("redis", rclient, keys, tmp_path), LOG)
    loader = WeightLoader(rclient, keys, ckpt_params, ckpt_params, "attached", weights_dir=None)
    follower = _follower(model, rclient, redis_url, keys, load=loader)

    async def go() -> None:
        try:
            pub.publish(base, 0, 0)
            assert await follower.poll(block_ms=1000)
            pub.publish(adapters, 1, 1, lora)
            assert await follower.poll(block_ms=1000)
        finally:
            await _close(follower)

    asyncio.run(go())
    served = _engine_of(follower).params
    q = served["model"]["layers_0"]["self_attn"]["q_proj"]
    assert q["kernel"] is loader.base["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_allclose(
        q["lora_b"], adapters["model"]["layers_0"]["self_attn"]["q_proj"]["lora_b"] * 2.0
    )
    assert "lora_a" not in served["model"]["layers_0"]["self_attn"]["k_proj"]
    got = _outputs(_engine_of(follower), chat)
    assert [g.tokens for g in got] == [e.tokens for e in expected]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.logprobs, e.logprobs, atol=1e-4)


def _published(client: redis.Redis, keys: Keys) -> list[Weights]:
    out: Any = client.xrange(keys.weights)
    return [decode(fields, Weights) for _, fields in out]


# -- restart ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_a_starting_worker_loads_the_latest_version_first(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    kind: str,
) -> None:
    params = model[3]
    pub = WeightPublisher(rclient, keys, _channel(kind, rclient, keys, tmp_path), LOG, keep=3)
    for v in range(3):
        pub.publish(_scaled(params, 1 + v / 10), v, v)

    fresh = _follower(model, rclient, redis_url, keys, weights_dir=tmp_path / "weights")
    again = _follower(model, rclient, redis_url, keys, weights_dir=tmp_path / "weights")

    async def go() -> None:
        try:
            await check()
        finally:
            await _close(fresh, again)

    async def check() -> None:
        assert await fresh.wait_initial(lambda: False)
        assert fresh.loaded_version == fresh.server.version == 2 and fresh.syncs == 1
        assert _equal(_engine_of(fresh).params, _scaled(params, 1.2))
        # The newest damaged: the newest good one (version 1) serves instead.
        msg = pub.publish(_scaled(params, 1.3), 3, 3)
        _damage(kind, "flip", msg, rclient, keys)
        assert await again.wait_initial(lambda: False)
        assert again.loaded_version == 2 and again.refused == 1

    asyncio.run(go())


# -- sync modes ---------------------------------------------------------------------------


class GatedEnv(Environment):
    """Two turns: the first step answers once `go` is set, the second ends the episode."""

    def __init__(self, go: bool = False) -> None:
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        if go:
            self.go.set()
        self.turns = 0

    async def reset(self) -> Reset:
        return Reset(prompt="Compute 1+1 with the calculator.")

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            self.reached.set()
            await self.go.wait()
            return StepResult(observations=["2"], done=False)
        return StepResult(observations=[], done=True, reward=1.0)

    async def close(self) -> None:
        return None


async def _start(
    lock: SyncLock, runner: EpisodeRunner, env: GatedEnv, i: int
) -> asyncio.Task[Trajectory]:
    """What the rollout worker does: wait for the lock, count the episode, run it."""
    await lock.wait_open()
    lock.enter()

    def pair() -> tuple[Agent, Environment]:
        return ToolAgent(), env

    async def run() -> Trajectory:
        try:
            return await runner.run(scripted_task(i, "gated"), 0, pair)
        finally:
            lock.leave()

    return asyncio.create_task(run())


async def _until(cond: Callable[[], bool], timeout_s: float = 20) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", ["continue", "finish", "pause"])
def test_sync_modes_tag_each_turn_with_its_version(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    mode: SyncMode,
) -> None:
    """Episode A is between its two model turns when version 1 is published (loading is
    held until the test lets it go). B tries to start during the sync.

    continue: A's second turn, asked for while version 1 loads, runs at once on version 0.
    pause:    the same turn waits for the load, and runs on version 1.
    finish:   version 1 is loaded while A runs, but swapped in only once A is done (its
              second turn on version 0).
    B starts after the swap in every mode: version 1 only.
    """
    cfg, chat, _, params = model
    eos = always_eos(params)
    pub = WeightPublisher(rclient, keys, DirChannel(tmp_path / "weights"), LOG)
    loader = WeightLoader(rclient, keys, params, params, weights_dir=tmp_path / "weights")
    loading, proceed = threading.Event(), threading.Event()

    def slow_load(msg: Weights, base: Weights | None) -> Any:
        if msg.version > 0:
            loading.set()
            assert proceed.wait(30)
        return loader(msg, base)

    server = EngineServer(_engine(model, params), -1, LOG)
    follower = _follower(model, rclient, redis_url, keys, mode, server, slow_load)
    runner = EpisodeRunner(server, chat.dialogue, cfg.rollout, 0, "test", LOG)

    async def go() -> tuple[Trajectory, Trajectory]:
        pub.publish(eos, 0, 0)
        assert await follower.poll(block_ms=1000)
        serving = asyncio.create_task(server.serve())
        try:
            env_a, env_b = GatedEnv(), GatedEnv(go=True)
            a = await _start(follower.lock, runner, env_a, 0)
            await asyncio.wait_for(env_a.reached.wait(), 20)
            pub.publish(eos, 1, 1)
            sync = asyncio.create_task(follower.poll(block_ms=1000))
            await _until(loading.is_set)
            assert not follower.lock.is_open  # no new episode starts during a sync
            b_start = asyncio.create_task(_start(follower.lock, runner, env_b, 1))
            if mode == "finish":
                proceed.set()  # version 1 loads while A still runs...
                await asyncio.sleep(0.5)
                assert not sync.done()  # ...but waits for A to finish
                assert not b_start.done() and server.version == 0
                env_a.go.set()  # A's second turn: version 0, then the swap
            else:
                env_a.go.set()  # A asks for its second turn while version 1 loads
                if mode == "continue":
                    await asyncio.wait_for(asyncio.shield(a), 20)  # version 0, at once
                else:
                    await asyncio.sleep(0.5)
                    assert not a.done()  # the engine waits for version 1
                assert not b_start.done() and server.version == 0
                proceed.set()
            assert await asyncio.wait_for(sync, 20)
            b = await asyncio.wait_for(b_start, 20)
            return await asyncio.wait_for(a, 20), await asyncio.wait_for(b, 20)
        finally:
            proceed.set()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await _close(follower)

    a, b = asyncio.run(go())
    assert a.status == b.status == "ok"
    assert a.versions == {"continue": [0, 0], "finish": [0, 0], "pause": [0, 1]}[mode]
    assert b.versions == [1, 1]
    assert follower.loaded_version == 1 and server.swaps == 2
    if mode == "pause":
        assert server.stall_s > 0.3  # A's second turn waited for the load


@pytest.mark.parametrize("mode", ["finish", "pause"])
def test_sync_with_nothing_running_swaps_at_once(
    model: Any,
    rclient: redis.Redis,
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    mode: SyncMode,
) -> None:
    params = model[3]
    pub = WeightPublisher(rclient, keys, DirChannel(tmp_path / "weights"), LOG)
    follower = _follower(model, rclient, redis_url, keys, mode, weights_dir=tmp_path / "weights")

    async def go() -> None:
        serving = asyncio.create_task(follower.server.serve())
        try:
            for v in range(3):
                pub.publish(_scaled(params, 1 + v / 10), v, v)
                assert await asyncio.wait_for(follower.poll(block_ms=1000), 20)
                assert follower.server.version == v and follower.lock.is_open
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await _close(follower)

    asyncio.run(go())
    assert follower.server.stall_s == 0
