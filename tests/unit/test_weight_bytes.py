"""Weight-sync pieces without a server: the fast writer is byte for byte Flax's, the
channel module stays light, the sync lock, the config fields."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flax.serialization
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import redis

from streamrl.config import ConfigError, parse_config
from streamrl.model.lora import LoraConfig, init_lora
from streamrl.model.weights import (
    WeightsError,
    adapters_template,
    lora_config,
    lora_info,
    params_to_bytes,
)
from streamrl.names import Keys
from streamrl.rollout.weights import SyncLock
from streamrl.weightsync import DirChannel, RedisChannel
from tests.conftest import REPO

TREES: list[dict[str, Any]] = [
    {"scalar": np.ones((), np.float32), "int8": np.arange(3, dtype=np.int8)},
    {"bf16": jnp.zeros((2, 3), jnp.bfloat16), "nested": {"empty": np.zeros((0, 4), np.float32)}},
    {"jax": jnp.arange(70_000, dtype=jnp.int32).reshape(7, 10_000)},  # bin32, shape uint16
    {f"k{i}": np.full((i,), i, np.uint8) for i in range(40)},  # map16, fixext sizes, bin8
    {"x" * 40: np.zeros((300,), np.float16), "y" * 300: np.zeros((3,), ml_dtypes.bfloat16)},
    {"big": np.zeros((17_000,), np.float32), "odd": np.zeros((5, 0, 3), np.int64)},
]


@pytest.mark.parametrize("tree", TREES)
def test_fast_writer_is_byte_for_byte_flax(tree: dict[str, Any]) -> None:
    assert params_to_bytes(tree) == flax.serialization.to_bytes(tree)


def test_trees_the_fast_writer_leaves_to_flax() -> None:
    for tree in ({"t": (np.ones(2), np.ones(3))}, {"s": 1.5}, {"c": np.ones(2, np.complex64)}):
        assert params_to_bytes(tree) == flax.serialization.to_bytes(tree)
    big_endian = {"be": np.arange(4, dtype=">f4")}
    assert params_to_bytes(big_endian) == flax.serialization.to_bytes(big_endian)


def test_channel_module_imports_no_model_stack() -> None:
    code = "import sys, streamrl.weightsync; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.split()
    assert not [m for m in out if m.split(".")[0] in ("jax", "flax", "jaxlib", "orbax")]


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
