"""Weight-sync pieces without a server: the byte layout (golden bytes, in-place decoding,
damage), checksums, the channel module stays light, the sync lock, the config fields."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import msgspec
import numpy as np
import pytest
import redis
import xxhash

from streamrl.config import ConfigError, parse_config
from streamrl.model.lora import LoraConfig, init_lora
from streamrl.model.weights import (
    WeightsError,
    adapters_template,
    lora_config,
    lora_info,
    params_from_bytes,
    params_to_bytes,
    params_to_pieces,
)
from streamrl.names import Keys
from streamrl.rollout.weights import SyncLock
from streamrl.weightsync import (
    ALIGN,
    HASH_ON_THREAD_BYTES,
    DirChannel,
    RedisChannel,
    as_aligned,
    check_checksum,
    checksum,
    overlapped,
    split_chunks,
)

TREES: list[dict[str, Any]] = [
    {"scalar": np.ones((), np.float32), "int8": np.arange(3, dtype=np.int8)},
    {"bf16": jnp.ones((2, 3), jnp.bfloat16), "nested": {"empty": np.zeros((0, 4), np.float32)}},
    {"jax": jnp.arange(70_000, dtype=jnp.int32).reshape(7, 10_000)},
    {f"k{i}": np.full((i,), i, np.uint8) for i in range(40)},  # many unaligned sizes
    {"x" * 40: np.ones((300,), np.float16), "y" * 300: np.ones((3,), ml_dtypes.bfloat16)},
    {"big": np.ones((17_000,), np.float32), "odd": np.zeros((5, 0, 3), np.int16)},
]


def test_layout_golden_bytes() -> None:
    # Worked by hand from the layout in streamrl.model.weights' docstring.
    tree = {"a": np.array([1, 2], np.int8), "b": np.array([7.0], "<f4")}
    header = (
        b"\x92"  # array of 2 leaves
        + b"\x95\xa5['a']\xa4int8\x91\x02\x00\x02"  # path, dtype, [2], offset 0, 2 bytes
        + b"\x95\xa5['b']\xa7float32\x91\x01\x40\x04"  # [1], offset 64, 4 bytes
    )
    assert len(header) == 36
    want = (
        b"SRLWTS01"
        + (36).to_bytes(8, "little")
        + header
        + bytes(64 - 16 - 36)  # data starts at 64
        + b"\x01\x02"
        + bytes(62)  # b's offset 64 is aligned
        + np.float32(7.0).tobytes()
    )
    assert params_to_bytes(tree) == want
    back = params_from_bytes(tree, want)
    assert back["a"].tolist() == [1, 2] and back["b"].tolist() == [7.0]


@pytest.mark.parametrize("tree", TREES)
def test_round_trip_in_place(tree: dict[str, Any]) -> None:
    data = params_to_bytes(tree)
    buf = as_aligned(data)
    assert buf.ctypes.data % ALIGN == 0 and buf.tobytes() == data
    back = params_from_bytes(jax.eval_shape(lambda: tree), buf)
    assert str(jax.tree.structure(back)) == str(jax.tree.structure(tree))
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert np.asarray(a).dtype == b.dtype and np.array_equal(np.asarray(a), b)
        # On the CPU backend every non-empty array is the reader's buffer, used in place.
        if b.size:
            at = b.unsafe_buffer_pointer() - buf.ctypes.data
            assert 0 < at < buf.size and at % ALIGN == 0


def test_big_endian_arrays_travel_little_endian() -> None:
    tree = {"be": np.arange(4, dtype=">f4")}
    assert params_to_bytes(tree) == params_to_bytes({"be": np.arange(4, dtype="<f4")})
    back = params_from_bytes({"be": np.zeros(4, np.float32)}, params_to_bytes(tree))
    assert back["be"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match=r"\['o'\]: cannot publish dtype object"):
        params_to_pieces({"o": np.array([None])})


def _with_header(data: bytes, edit: Any) -> bytes:
    """`data` with its header re-encoded after `edit(leaves)` (a list of lists), the
    arrays' bytes where they were (these headers are short: data starts at 64)."""
    hlen = int.from_bytes(data[8:16], "little")
    leaves = msgspec.msgpack.decode(data[16 : 16 + hlen])
    edit(leaves)
    header = msgspec.msgpack.encode(leaves)
    assert 16 + max(hlen, len(header)) <= 64
    prefix = data[:8] + len(header).to_bytes(8, "little") + header
    return prefix + bytes(64 - len(prefix)) + data[64:]


def test_damaged_layouts_are_weights_errors() -> None:
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.int32)}
    data = params_to_bytes(tree)
    cases: list[tuple[bytes, str]] = [
        (data[:10], "not even a header"),
        (b"XXXXXXXX" + data[8:], "magic b'XXXXXXXX'"),
        (data[:8] + (10**9).to_bytes(8, "little") + data[16:], "header of 1000000000 bytes"),
        (data[:16] + b"\xc1" + data[17:], "bad header"),
        (data[: len(data) - 4], r"\['b'\] ends at byte \d+, past the end"),
        (_with_header(data, lambda h: h[1].__setitem__(0, "['c']")), r"hold \['c'\] where"),
        (_with_header(data, lambda h: h[1].__setitem__(3, 65)), r"\['b'\] has a bad offset"),
        (_with_header(data, lambda h: h[1].__setitem__(4, 21)), r"\['b'\] has a bad offset"),
        (_with_header(data, lambda h: h[0].__setitem__(1, "int16")), r"are int16\[2, 3\], exp"),
        (_with_header(data, lambda h: h[0].__setitem__(2, [3, 2])), r"are float32\[3, 2\], ex"),
        (_with_header(data, lambda h: h.pop()), "weights have 1 arrays, expected 2"),
    ]
    for bad, reason in cases:
        with pytest.raises(WeightsError, match=reason):
            params_from_bytes(tree, bad)


def test_split_chunks() -> None:
    big = np.arange(10_000, dtype=np.uint8)
    pieces: list[bytes | memoryview] = [b"head", bytes(60), big.data, b"x" * 100, b"tail"]
    whole = b"".join(pieces)
    for limit in (1024, 4096, 20_000):
        chunks = split_chunks(pieces, limit)
        assert b"".join(chunks) == whole
        assert all(0 < len(c) <= limit for c in chunks)
        # The big array travels as views of its own memory, not copies.
        views = [
            c
            for c in chunks
            if isinstance(c, memoryview) and np.shares_memory(np.frombuffer(c, np.uint8), big)
        ]
        assert sum(len(v) for v in views) == big.nbytes
    # Only small pieces: joined, up to the limit each.
    small = [bytes([i]) * 5 for i in range(40)]
    chunks = split_chunks(small, 160)
    assert [len(c) for c in chunks] == [160, 40] and b"".join(chunks) == b"".join(small)
    assert split_chunks([], 64) == [b""]


def test_overlapped_runs_big_versions_on_the_pool_and_small_ones_at_once() -> None:
    where: list[str] = []

    def work(x: int) -> int:
        where.append(threading.current_thread().name)
        if x < 0:
            raise WeightsError("bad")
        return 2 * x

    with ThreadPoolExecutor(1, thread_name_prefix="hasher") as pool:
        small = overlapped(pool, HASH_ON_THREAD_BYTES - 1, work, 3)
        assert where == [threading.current_thread().name]  # ran already, here
        big = overlapped(pool, HASH_ON_THREAD_BYTES, work, 4)
        assert (small(), big()) == (6, 8) and where[1].startswith("hasher")
        failed = overlapped(pool, HASH_ON_THREAD_BYTES, work, -1)
        with pytest.raises(WeightsError, match="bad"):
            failed()
        with pytest.raises(WeightsError, match="bad"):
            overlapped(pool, 0, work, -1)


def test_checksums() -> None:
    data = b"weights" * 1000
    pieces: list[bytes | memoryview] = [data[:10], memoryview(data)[10:]]
    fast, slow = checksum("xxh3_128", *pieces), checksum("sha256", *pieces)
    assert fast == "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)
    assert slow == "sha256:" + hashlib.sha256(data).hexdigest()
    buf = as_aligned(data)
    check_checksum(buf, fast, "w")
    check_checksum(buf, slow, "w")
    buf[3] ^= 1
    with pytest.raises(WeightsError, match=r"w has checksum xxh3_128:[0-9a-f]{32}, expected"):
        check_checksum(buf, fast, "w")
    with pytest.raises(WeightsError, match="unknown checksum algorithm 'md5'"):
        check_checksum(buf, "md5:00", "w")


def test_lora_config_travels_and_is_checked() -> None:
    cfg = LoraConfig(rank=2, alpha=4.0, targets=("q_proj",))
    assert lora_config(lora_info(cfg)) == cfg
    with pytest.raises(WeightsError, match="without their LoRA config"):
        lora_config(None)
    bad = lora_info(cfg).__class__(rank=0, alpha=1.0, targets=("q_proj",))
    with pytest.raises(WeightsError, match="bad LoRA config in weights: LoRA rank 0"):
        lora_config(bad)
    params = {"layer": {"q_proj": {"kernel": np.ones((8, 6), np.float32)}}}
    shapes = adapters_template(params, cfg)
    real = init_lora(params, cfg, seed=0)
    assert shapes["layer"]["q_proj"]["lora_a"].shape == real["layer"]["q_proj"]["lora_a"].shape
    with pytest.raises(WeightsError, match="do not fit this model"):
        adapters_template(params, LoraConfig(rank=2, alpha=4.0, targets=("v_proj",)))


def test_sync_lock() -> None:
    async def go() -> None:
        lock = SyncLock()
        lock.enter()
        lock.close()
        with pytest.raises(RuntimeError, match="while weights sync"):
            lock.enter()
        idle = asyncio.create_task(lock.wait_idle())
        opened = asyncio.create_task(lock.wait_open())
        await asyncio.sleep(0.01)
        assert not idle.done() and not opened.done()
        lock.leave()
        await asyncio.wait_for(idle, 1)
        # Reopened, then closed again before the waiter ran: it keeps waiting.
        lock.reopen()
        lock.close()
        await asyncio.sleep(0.01)
        assert not opened.done()
        lock.reopen()
        await asyncio.wait_for(opened, 1)
        lock.enter()
        assert lock.episodes == 1

    asyncio.run(go())


def test_weight_sync_config() -> None:
    cfg = parse_config(
        {
            "trainer": {
                "weights_channel": "redis",
                "weights_chunk_mb": 8,
                "publish": "lora",
                "lora_rank": 4,
            },
            "rollout": {"sync_mode": "pause"},
        }
    )
    assert cfg.trainer.weights_channel == "redis" and cfg.trainer.weights_chunk_mb == 8
    assert cfg.trainer.publish == "lora" and cfg.rollout.sync_mode == "pause"
    default = parse_config({})
    assert (default.trainer.weights_channel, default.trainer.publish) == ("dir", "full")
    assert default.rollout.sync_mode == "continue" and default.trainer.weights_keep == 2
    assert default.trainer.weights_checksum == "xxh3_128"
    assert default.rollout.lora_serving == "merged"
    assert default.trainer.trim_streams is True
    assert parse_config({"rollout": {"lora_serving": "attached"}}).rollout.lora_serving == (
        "attached"
    )
    with pytest.raises(ConfigError, match=r"field `rollout\.lora_serving`"):
        parse_config({"rollout": {"lora_serving": "unmerged"}})
    with pytest.raises(ConfigError, match=r"field `trainer\.weights_checksum`"):
        parse_config({"trainer": {"weights_checksum": "md5"}})
    with pytest.raises(ConfigError, match=r"field `trainer\.weights_channel`"):
        parse_config({"trainer": {"weights_channel": "nfs"}})
    with pytest.raises(ConfigError, match=r"field `trainer\.weights_chunk_mb`"):
        parse_config({"trainer": {"weights_chunk_mb": 0}})
    with pytest.raises(ConfigError, match=r"field `rollout\.sync_mode`"):
        parse_config({"rollout": {"sync_mode": "interrupt"}})


def test_lora_publishing_needs_lora_training() -> None:
    with pytest.raises(ConfigError, match=r'trainer\.publish = "lora" needs trainer\.lora_rank'):
        parse_config({"trainer": {"publish": "lora"}})
    with pytest.raises(ConfigError, match=r"trainer\.lora_targets \['qkv'\] not among"):
        parse_config({"trainer": {"lora_rank": 4, "lora_targets": ["qkv"]}})


def test_trainer_wires_the_configured_channel(tmp_path: Path) -> None:
    from streamrl_workers.trainer import publish_hook

    def ctx(*sets: str) -> Any:
        cfg = parse_config({}, overrides=list(sets))
        client = redis.Redis()  # never connected here
        return SimpleNamespace(
            cfg=cfg, client=lambda: client, keys=Keys("t"), log=None, run_dir=tmp_path
        )

    hook = publish_hook(ctx("trainer.weights_channel=redis", "trainer.weights_chunk_mb=8"))
    assert isinstance(hook.publisher.channel, RedisChannel)
    assert hook.publisher.channel.chunk_bytes == 8 << 20 and hook.publisher.keep == 2
    hook = publish_hook(ctx("trainer.weights_keep=5", "trainer.publish_every=3"))
    assert isinstance(hook.publisher.channel, DirChannel) and hook.every == 3
    assert hook.publisher.channel.directory == tmp_path / "weights"
    assert hook.publisher.keep == 5 and hook.adapters is None
    assert hook.publisher.checksum == "xxh3_128"
    assert hook.publisher.trim is True
    assert publish_hook(ctx("trainer.trim_streams=false")).publisher.trim is False
    hook = publish_hook(ctx("trainer.weights_checksum=sha256"))
    assert hook.publisher.checksum == "sha256"
