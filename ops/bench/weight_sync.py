"""Weight sync: publish-to-serving time against moving the same bytes, and rollout stall.

    .venv/bin/python ops/bench/weight_sync.py [--repeats 5] [--stall-s 6] [--every-ms 500]

Redis is the embedded redis-server as `streamrl up` runs it (AOF on, fsync every second).

Part 1, sync time. Two models: the built-in tiny policy of configs/tiny.toml and a ~20 M
parameter Qwen2-family model (ops/bench/decode.py's). For each channel (`dir`, `redis`),
publish kind (`full`, `lora`: rank 16 adapters on every dense layer) and number of
rollout followers (1, 2; each its own process with a real WeightFollower, WeightLoader and
EngineServer), it measures side by side:

- sync:  from the trainer side starting to publish (serialize, checksum, write through
         the channel, signal) to every follower serving the new version (fetched,
         checked, decoded, merged for LoRA, swapped into its engine);
- bytes: the same number of raw bytes written through the same channel, signalled the
         same way and read back by every follower (no serialization, no checksum, no
         decoding): the floor a sync through that channel can reach;
- ratio: sync / bytes, the median of each repeat's ratio (a sync and its byte move run
         back to back, so slow spells of the machine hit both).

publish ms and write ms: the trainer side's part of each (until `publish` returns, until
the raw bytes are written and signalled).

Part 2, rollout stall. One engine (tiny model, 16 slots) decodes 16 concurrent episodes of
3 turns x 24 tokens without pause, gated by the real SyncLock, while a simulated trainer
(its own process) publishes a new version every `--every-ms` (a step that takes that long,
then a publish). Per sync mode and channel: tokens/s and its loss against the same
workload with no publishing (median of the runs without syncs, interleaved), the engine's
stall (time it held or swapped weights with work waiting, over wall time), and the share
of wall time no new episode could start (the lock closed).

Part 1 also runs each LoRA row with `rollout.lora_serving = "attached"` (the adapters
beside the kernels, nothing merged: `lora attached`), and measures what that costs
decoding: one engine's tokens/s serving merged against attached adapters.

Medians over `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis
import redis.asyncio as aioredis
import structlog

from streamrl.config import LoraServing, load_config
from streamrl.model.checkpoint import build_tiny_checkpoint, load_checkpoint
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.lora import (
    TARGETS,
    LoraConfig,
    attach_lora,
    init_lora,
    merge_lora,
    num_adapter_params,
)
from streamrl.model.sampling import GenRequest, SamplingParams
from streamrl.model.spec import ModelSpec
from streamrl.model.tiny import ensure_checkpoint
from streamrl.names import Keys
from streamrl.rollout.engine_server import EngineServer
from streamrl.rollout.loader import WeightLoader
from streamrl.rollout.weights import SyncLock, SyncMode, WeightFollower
from streamrl.run.redis_server import EmbeddedRedis
from streamrl.trainer.publish import WeightPublisher
from streamrl.transport import publish
from streamrl.weightsync import DirChannel, RedisChannel, WeightsChannel
from streamrl.wire import Weights, decode

REPO = Path(__file__).resolve().parents[2]
SPEC_20M = {
    "model_type": "qwen2",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
LORA = LoraConfig(rank=16, alpha=32.0, targets=TARGETS)
CHUNK = 4 << 20  # trainer.weights_chunk_mb's default
SLOTS, TURNS, TURN_TOKENS, PROMPT = 16, 3, 24, 16


def quiet_log() -> structlog.stdlib.BoundLogger:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    log: structlog.stdlib.BoundLogger = structlog.get_logger()
    return log


# Bench-only keys, beside the run's own (both come from Keys).
def served_key(ns: str, raw: bool) -> str:
    return Keys(ns).scratch("bench", "raw" if raw else "served")


def ready_key(ns: str) -> str:
    return Keys(ns).scratch("bench", "ready")


TRAINER_CMD, TRAINER_DONE = "wsbench:trainer:cmd", "wsbench:trainer:done"


def small_engine(spec: ModelSpec, params: Any, slots: int = 4) -> Engine:
    cfg = EngineConfig(
        num_slots=slots,
        kv_cache_size=128,
        max_prompt_length=127,
        max_new_tokens=TURN_TOKENS,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
        stop_ids=(),  # no stop: every turn is TURN_TOKENS long
        pad_id=0,
        decode_chunk=8,
    )
    return Engine(spec, params, cfg)


def blpop(client: redis.Redis, key: str, timeout_s: float) -> bytes | None:
    """BLPOP in short blocks (the client's socket times out after 5 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got: Any = client.blpop([key], timeout=2)
        if got is not None:
            value: bytes = got[1]
            return value
    return None


def fetch_raw(msg: Weights, client: redis.Redis, keys: Keys) -> bytes:
    """The bytes of a raw publish, as a follower would fetch them, checked for nothing."""
    if msg.channel == "dir":
        return Path(msg.path).read_bytes()
    pipe = client.pipeline(transaction=False)
    for i in range(msg.chunks):
        pipe.get(keys.weights_chunk(msg.version, i))
    return b"".join(pipe.execute())


# -- follower process ---------------------------------------------------------------------


async def follower_main(url: str, ns: str, ckpt: str, index: int, lora_serving: str) -> None:
    log = quiet_log()
    spec, params = load_checkpoint(ckpt)
    server = EngineServer(small_engine(spec, params), -1, log)
    keys, raw_keys = Keys(ns), Keys(f"{ns}-raw")
    client = redis.Redis.from_url(url)
    aclient = aioredis.Redis.from_url(url)
    serving: LoraServing = "attached" if lora_serving == "attached" else "merged"
    # The trainer process's temporary directory is not known here: the bench trusts its own.
    loader = WeightLoader(client, keys, params, params, serving, weights_dir=Path("/"))
    follower = WeightFollower(aclient, keys, server, loader, SyncLock(), log)
    parts = [
        asyncio.create_task(server.serve()),
        asyncio.create_task(raw_loop(aclient, client, raw_keys, ns, index)),
    ]
    client.rpush(ready_key(ns), index)
    while not any(p.done() for p in parts):
        if await follower.poll(block_ms=500):
            note = json.dumps([index, follower.loaded_version, time.time()])
            client.rpush(served_key(ns, raw=False), note)
    for p in parts:
        p.result()


async def raw_loop(
    aclient: aioredis.Redis, client: redis.Redis, keys: Keys, ns: str, index: int
) -> None:
    last = "0-0"
    while True:
        resp: Any = await aclient.xread({keys.weights: last}, block=500)
        for entry_id, fields in resp[0][1] if resp else []:
            last = entry_id.decode()
            msg = decode(fields, Weights)
            data = await asyncio.to_thread(fetch_raw, msg, client, keys)
            assert len(data) == msg.nbytes
            client.rpush(served_key(ns, raw=True), json.dumps([index, msg.version, time.time()]))


# -- simulated trainer process ------------------------------------------------------------


def trainer_main(url: str, ckpt: str, tmp: str) -> None:
    """Publishes on command: a step of `every_ms` (asleep: the trainer's compute is
    elsewhere), then a publish, for `duration_s`."""
    log = quiet_log()
    _, params = load_checkpoint(ckpt)
    client = redis.Redis.from_url(url)
    while True:
        raw = blpop(client, TRAINER_CMD, 3600)
        if raw is None:
            return
        cmd = json.loads(raw)
        keys = Keys(cmd["ns"])
        pub = WeightPublisher(client, keys, channel_for(cmd["channel"], client, keys, tmp), log)
        pub.base_version = 0
        version, end = cmd["start_version"], time.monotonic() + cmd["duration_s"]
        next_at = time.monotonic() + cmd["every_ms"] / 1000
        while time.monotonic() < end:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += cmd["every_ms"] / 1000
            pub.publish(params, version, version)
            version += 1
        client.rpush(TRAINER_DONE, version - cmd["start_version"])


def channel_for(name: str, client: redis.Redis, keys: Keys, tmp: str) -> WeightsChannel:
    if name == "redis":
        return RedisChannel(client, keys, CHUNK)
    return DirChannel(Path(tmp) / keys.ns)


# -- part 1: sync time --------------------------------------------------------------------


def spawn(mode: str, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, f"--{mode}", *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def wait_served(client: redis.Redis, key: str, n: int, version: int) -> float:
    """When the last of `n` followers reported serving `version` (epoch seconds)."""
    ends = []
    for _ in range(n):
        got = blpop(client, key, 300)
        if got is None:
            raise TimeoutError(f"a follower did not report version {version}")
        _, v, t = json.loads(got)
        if v != version:
            raise RuntimeError(f"a follower served version {v}, expected {version}")
        ends.append(t)
    return max(ends)


def nonzero_adapters(params: Any) -> Any:
    rng = np.random.default_rng(0)
    adapters = init_lora(params, LORA, seed=0)
    return jax.tree.map(
        lambda x: x + np.asarray(rng.standard_normal(x.shape) * 0.01, x.dtype), adapters
    )


def sync_rows(
    url: str,
    tmp: str,
    name: str,
    ckpt: str,
    followers: int,
    repeats: int,
    checksums: list[str],
    lora_serving: str = "merged",
) -> list[dict[str, Any]]:
    """Rows of sync against byte-move time; with `lora_serving` "attached", LoRA only."""
    log = quiet_log()
    client = redis.Redis.from_url(url)
    _, params = load_checkpoint(ckpt)
    adapters = nonzero_adapters(params)
    ns = f"wsb{uuid.uuid4().hex[:8]}"
    keys, raw_keys = Keys(ns), Keys(f"{ns}-raw")
    procs = [spawn("follower", url, ns, ckpt, str(i), lora_serving) for i in range(followers)]
    rows = []
    try:
        for _ in range(followers):
            if blpop(client, ready_key(ns), 600) is None:
                raise TimeoutError("followers did not start")
        version = raw_version = 0
        for channel in ("dir", "redis"):
            pub = WeightPublisher(client, keys, channel_for(channel, client, keys, tmp), log)
            raw_channel = channel_for(channel, client, raw_keys, tmp)
            runs = [("full", c) for c in checksums] + [("lora", checksums[0])]
            if lora_serving == "attached":
                runs = runs[-1:]
            for kind, algorithm in runs:
                pub.checksum = algorithm  # type: ignore[assignment]
                if kind == "lora" and pub.base_version < 0:
                    pub.publish(params, version, version)
                    wait_served(client, served_key(ns, False), followers, version)
                    version += 1
                syncs, moves, pubs, writes, nbytes = [], [], [], [], 0
                for rep in range(repeats + 1):  # the first: a warm-up
                    start = time.time()
                    if kind == "full":
                        msg = pub.publish(params, version, version)
                    else:
                        msg = pub.publish(adapters, version, version, LORA)
                    published = time.time() - start
                    sync = wait_served(client, served_key(ns, False), followers, version) - start
                    version += 1
                    nbytes = msg.nbytes
                    data = os.urandom(nbytes)
                    start = time.time()
                    where = raw_channel.write(raw_version, [data])
                    publish(
                        client,
                        raw_keys.weights,
                        Weights(
                            version=raw_version,
                            step=0,
                            path=where.path,
                            nbytes=nbytes,
                            checksum="",
                            channel=channel,
                            chunks=where.chunks,
                        ),
                    )
                    written = time.time() - start
                    move = wait_served(client, served_key(ns, True), followers, raw_version)
                    move -= start
                    raw_channel.prune({raw_version})
                    raw_version += 1
                    if rep:
                        syncs.append(sync)
                        moves.append(move)
                        pubs.append(published)
                        writes.append(written)
                rows.append(
                    dict(
                        model=name,
                        channel=channel,
                        kind=kind if kind == "full" else f"lora {lora_serving}",
                        checksum=algorithm,
                        followers=followers,
                        nbytes=nbytes,
                        sync=statistics.median(syncs),
                        move=statistics.median(moves),
                        publish=statistics.median(pubs),
                        write=statistics.median(writes),
                        ratio=statistics.median(a / b for a, b in zip(syncs, moves, strict=True)),
                    )
                )
                print_sync_row(rows[-1])
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
    return rows


def print_sync_row(r: dict[str, Any]) -> None:
    print(
        f"| {r['model']} | {r['channel']} | {r['kind']} | {r['checksum']} | {r['followers']} | "
        f"{r['nbytes'] / 2**20:.2f} | {r['publish'] * 1e3:.1f} | {r['sync'] * 1e3:.1f} | "
        f"{r['write'] * 1e3:.1f} | {r['move'] * 1e3:.1f} | {r['ratio']:.2f} |",
        flush=True,
    )


def decode_rows(models: dict[str, str], repeats: int) -> None:
    """What attached adapters cost decoding: tokens/s of one engine (16 slots, 16 requests
    of TURN_TOKENS new tokens) serving merged against attached adapters, same weights."""
    print("\n| model | LoRA serving | tokens/s | x merged |")
    print("|---|---|---:|---:|")
    for name, ckpt in models.items():
        spec, params = load_checkpoint(ckpt)
        adapters = nonzero_adapters(params)
        rates = {}
        for serving in ("merged", "attached"):
            fn = merge_lora if serving == "merged" else attach_lora
            engine = small_engine(spec, jax.block_until_ready(fn(params, adapters, LORA)), SLOTS)
            prompt = list(range(1, PROMPT + 1))
            runs = []
            for rep in range(repeats + 1):  # the first: compiles
                reqs = [GenRequest(prompt, TURN_TOKENS, seed=rep * 100 + i) for i in range(SLOTS)]
                start = time.perf_counter()
                out = engine.generate(reqs)
                took = time.perf_counter() - start
                if rep:
                    runs.append(sum(len(r.tokens) for r in out) / took)
            rates[serving] = statistics.median(runs)
            print(
                f"| {name} | {serving} | {rates[serving]:.0f} | "
                f"{rates[serving] / rates['merged']:.2f} |",
                flush=True,
            )


# -- part 2: rollout stall ----------------------------------------------------------------


async def stall_run(
    url: str,
    engine: Engine,
    params: Any,
    tmp: str,
    channel: str,
    mode: SyncMode,
    every_ms: int,
    duration_s: float,
    warmup_s: float,
) -> dict[str, float]:
    """One run: 16 episodes decoding for warmup + duration seconds; publishing (if
    `every_ms`) during the measured part only."""
    log = quiet_log()
    client = redis.Redis.from_url(url)
    aclient = aioredis.Redis.from_url(url)
    keys = Keys(f"wss{uuid.uuid4().hex[:8]}")
    WeightPublisher(client, keys, channel_for(channel, client, keys, tmp), log).publish(
        params, 0, 0
    )
    server = EngineServer(engine, -1, log)
    loader = WeightLoader(client, keys, params, params, weights_dir=Path(tmp) / keys.ns)
    follower = WeightFollower(aclient, keys, server, loader, SyncLock(), log, mode)
    stopped = False
    assert await follower.wait_initial(lambda: stopped)
    rng = np.random.default_rng(0)

    async def episodes(i: int) -> None:
        lock = follower.lock
        n = 0
        while not stopped:
            await lock.wait_open()
            lock.enter()
            try:
                prompt = rng.integers(2, engine.spec.vocab_size, PROMPT).tolist()
                for turn in range(TURNS):
                    req = GenRequest(prompt, TURN_TOKENS, seed=i * 10_000 + n * 10 + turn)
                    result, _ = await server.generate(req)
                    prompt = prompt + result.tokens + [3, 4, 5, 6]  # a short tool result
            finally:
                lock.leave()
            n += 1

    parts = [
        asyncio.create_task(server.serve()),
        asyncio.create_task(follower.follow(lambda: stopped)),
        *(asyncio.create_task(episodes(i)) for i in range(SLOTS)),
    ]
    try:
        await asyncio.sleep(warmup_s)
        if every_ms:
            cmd = dict(
                ns=keys.ns,
                channel=channel,
                every_ms=every_ms,
                duration_s=duration_s,
                start_version=1,
            )
            client.rpush(TRAINER_CMD, json.dumps(cmd))
        t0, tok0 = time.monotonic(), engine.tokens_generated
        stall0, sync0, n0 = server.stall_s, follower.sync_s, follower.syncs
        await asyncio.sleep(duration_s)
        wall = time.monotonic() - t0
        out = dict(
            tps=(engine.tokens_generated - tok0) / wall,
            stall=(server.stall_s - stall0) / wall,
            closed=(follower.sync_s - sync0) / wall,
            syncs=follower.syncs - n0,
            refused=follower.refused,
        )
        if every_ms and await asyncio.to_thread(blpop, client, TRAINER_DONE, 60) is None:
            raise TimeoutError("the simulated trainer did not finish")
        return out
    finally:
        stopped = True
        for p in parts:
            p.cancel()
        await asyncio.gather(*parts, return_exceptions=True)
        await aclient.aclose()


def stall_rows(
    url: str, tmp: str, ckpt: str, every: list[int], duration_s: float, repeats: int
) -> None:
    spec, params = load_checkpoint(ckpt)
    engine = small_engine(spec, params, slots=SLOTS)
    trainer = spawn("trainer", url, ckpt, tmp)
    configs: list[tuple[str, SyncMode, int]] = [("dir", "continue", 0)]
    for ms in every:
        for channel in ("dir", "redis"):
            for mode in ("continue", "pause", "finish"):
                configs.append((channel, mode, ms))
    results: dict[tuple[str, SyncMode, int], list[dict[str, float]]] = {c: [] for c in configs}
    try:
        asyncio.run(stall_run(url, engine, params, tmp, "dir", "continue", 0, 5.0, 5.0))
        for _ in range(repeats):  # interleaved: the machine's drift hits every config alike
            for c in [*configs, configs[0]]:  # no publishing: at both ends of each round
                r = asyncio.run(stall_run(url, engine, params, tmp, *c, duration_s, 1.0))
                results[c].append(r)
    finally:
        trainer.terminate()
        trainer.wait(30)
    bases = [r["tps"] for r in results[configs[0]]]
    base = statistics.median(bases)
    print(
        f"\nno publishing: {base:.0f} tokens/s (median of {len(bases)} runs, "
        f"{min(bases):.0f} to {max(bases):.0f})\n"
    )
    print(
        "| every | channel | sync mode | syncs/run | tokens/s | loss | engine stall | "
        "no new episode |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for c in configs[1:]:
        rs = results[c]

        def med(k: str, rs: list[dict[str, float]] = rs) -> float:
            return statistics.median(r[k] for r in rs)

        print(
            f"| {c[2]} ms | {c[0]} | {c[1]} | {med('syncs'):.0f} | {med('tps'):.0f} | "
            f"{1 - med('tps') / base:.1%} | {med('stall'):.2%} | {med('closed'):.1%} |",
            flush=True,
        )
        assert all(r["refused"] == 0 for r in rs)


# -- main ---------------------------------------------------------------------------------


def build_models(tmp: str) -> dict[str, str]:
    cfg = load_config(
        REPO / "configs" / "tiny.toml", [f'model.cache_dir="{tmp}/cache"', "model.init=checkpoint"]
    )
    big = Path(tmp) / "20m"
    build_tiny_checkpoint(big, ModelSpec.from_config(SPEC_20M), seed=0)
    return {"tiny": str(ensure_checkpoint(cfg)), "20M": str(big)}


def describe(name: str, ckpt: str) -> str:
    spec, params = load_checkpoint(ckpt)
    lora = num_adapter_params(init_lora(params, LORA, seed=0))
    return (
        f"{name}: {spec.num_params() / 1e6:.2f} M params, LoRA rank 16 x 7 targets: "
        f"{lora / 1e6:.3f} M"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stall-repeats", type=int, default=3)
    parser.add_argument("--stall-s", type=float, default=6.0, help="measured seconds per run")
    parser.add_argument("--every-ms", type=int, nargs="+", default=[500])
    parser.add_argument("--followers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", default=["tiny", "20M"], choices=["tiny", "20M"])
    parser.add_argument(
        "--checksum",
        nargs="+",
        default=["xxh3_128"],
        choices=["xxh3_128", "sha256"],
        help="checksums of full syncs (LoRA syncs use the first)",
    )
    parser.add_argument("--skip-sync", action="store_true")
    parser.add_argument("--skip-stall", action="store_true")
    parser.add_argument(
        "--follower", nargs=5, metavar=("URL", "NS", "CKPT", "INDEX", "LORA_SERVING")
    )
    parser.add_argument("--trainer", nargs=3, metavar=("URL", "CKPT", "TMP"))
    args = parser.parse_args()
    if args.follower:
        url, ns, ckpt, index, serving = args.follower
        asyncio.run(follower_main(url, ns, ckpt, int(index), serving))
        return
    if args.trainer:
        trainer_main(*args.trainer)
        return
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        models = build_models(tmp)
        print(
            f"jax {jax.__version__} on {jax.default_backend()}; cpus {os.cpu_count()}; "
            f"Redis AOF on (everysec); chunks of {CHUNK >> 20} MiB"
        )
        for name, ckpt in models.items():
            print(describe(name, ckpt))
        if not args.skip_sync:
            print(
                "\n| model | channel | kind | checksum | followers | MiB | publish ms | sync ms "
                "| write ms | bytes ms | ratio |"
            )
            print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
            for name, ckpt in models.items():
                if name not in args.models:
                    continue
                for n in args.followers:
                    sync_rows(server.url, tmp, name, ckpt, n, args.repeats, args.checksum)
                    sync_rows(
                        server.url, tmp, name, ckpt, n, args.repeats, args.checksum, "attached"
                    )
            decode_rows(models, args.repeats)
        if not args.skip_stall:
            stall_rows(
                server.url, tmp, models["tiny"], args.every_ms, args.stall_s, args.stall_repeats
            )


if __name__ == "__main__":
    main()
