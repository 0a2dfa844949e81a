"""HF checkpoint directories and specs without torch: errors name the problem; the KV-cache
path (per-row write positions, rows at different lengths) equals the plain forward."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from streamrl.model.checkpoint import (
    CheckpointError,
    build_tiny_checkpoint,
    export_checkpoint,
    hf_name,
    load_checkpoint,
)
from streamrl.model.llm import Params, causal_logits, forward, init_cache, init_params
from streamrl.model.spec import ModelSpec, RopeScaling, SpecError

TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
QWEN3 = ModelSpec(family="qwen3", head_dim=16, qk_norm=True, **TINY)
QWEN2 = ModelSpec(family="qwen2", head_dim=8, attention_bias=True, tie_word_embeddings=True, **TINY)
LLAMA = ModelSpec(
    family="llama",
    head_dim=8,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(
        "llama3",
        8.0,
        original_max_position_embeddings=16,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    ),
    bos_token_id=1,
    eos_token_ids=(2, 3),
    **TINY,
)
WEIGHTS = "model.safetensors"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    build_tiny_checkpoint(tmp_path, QWEN3, seed=0)
    return tmp_path


def _equal_trees(a: Params, b: Params) -> bool:
    flat_a, flat_b = (
        jax.tree_util.tree_flatten_with_path(a)[0],
        jax.tree_util.tree_flatten_with_path(b)[0],
    )
    if [p for p, _ in flat_a] != [p for p, _ in flat_b]:
        return False
    return all(np.array_equal(x, y) for (_, x), (_, y) in zip(flat_a, flat_b, strict=True))


# --- loading and export -----------------------------------------------------------------


@pytest.mark.parametrize("spec", [QWEN3, QWEN2, LLAMA], ids=lambda s: s.family)
def test_tiny_checkpoint_round_trip(spec: ModelSpec, tmp_path: Path) -> None:
    build_tiny_checkpoint(tmp_path, spec, seed=5)
    loaded_spec, params = load_checkpoint(tmp_path)
    assert loaded_spec == spec
    assert _equal_trees(params, init_params(spec, 5))
    names = set(load_file(tmp_path / WEIGHTS))
    assert ("lm_head.weight" in names) == (not spec.tie_word_embeddings)
    assert sum(x.size for x in jax.tree.leaves(params)) == spec.num_params()


def test_init_params_deterministic() -> None:
    assert _equal_trees(init_params(QWEN3, 1), init_params(QWEN3, 1))
    a, b = init_params(QWEN3, 1), init_params(QWEN3, 2)
    assert not np.array_equal(a["lm_head"]["kernel"], b["lm_head"]["kernel"])


def test_hf_names() -> None:
    path = ("model", "layers_11", "self_attn", "q_proj", "kernel")
    assert hf_name(path) == ("model.layers.11.self_attn.q_proj.weight", True)
    assert hf_name(("model", "embed_tokens", "embedding")) == ("model.embed_tokens.weight", False)
    assert hf_name(("model", "norm", "weight")) == ("model.norm.weight", False)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing config\.json"):
        load_checkpoint(tmp_path)


def test_no_weight_files(ckpt: Path) -> None:
    (ckpt / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_weights_file(ckpt: Path, damage: str) -> None:
    """A weights file that is not readable safetensors is a CheckpointError naming it (the
    evaluator sets such a snapshot aside), never the library's own exception."""
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(b"not safetensors" if damage == "garbage" else data[:200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        load_checkpoint(ckpt)


def _rewrite(ckpt: Path, change: dict[str, np.ndarray | None]) -> None:
    tensors = load_file(ckpt / WEIGHTS)
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, ckpt / WEIGHTS, metadata={"format": "pt"})


def test_missing_tensor(ckpt: Path) -> None:
    _rewrite(ckpt, {"model.layers.1.self_attn.k_norm.weight": None})
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.k_norm"
    ):
        load_checkpoint(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    _rewrite(ckpt, {"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn"):
        load_checkpoint(ckpt)


def test_wrong_shape(ckpt: Path) -> None:
    _rewrite(ckpt, {"model.layers.0.mlp.up_proj.weight": np.zeros((32, 48), np.float32)})
    message = r"up_proj\.weight has shape \[32, 48\], expected \[48, 32\]"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ckpt)


def test_unsupported_dtype(ckpt: Path) -> None:
    _rewrite(ckpt, {"model.norm.weight": np.zeros(32, np.int8)})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has dtype I8"):
        load_checkpoint(ckpt)


def test_ignored_tensors(tmp_path: Path) -> None:
    """A stored copy of a tied head and old RoPE buffers are skipped, as transformers does."""
    build_tiny_checkpoint(tmp_path, QWEN2, seed=0)
    extra = {
        "lm_head.weight": np.zeros((64, 32), np.float32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(4, np.float32),
    }
    _rewrite(tmp_path, dict(extra))
    _, params = load_checkpoint(tmp_path)
    assert _equal_trees(params, init_params(QWEN2, 0))


def test_sharded_and_missing_shard(tmp_path: Path) -> None:
    params = init_params(LLAMA, 0)
    export_checkpoint(tmp_path, LLAMA, params, max_shard_bytes=10_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / WEIGHTS).exists()
    assert _equal_trees(load_checkpoint(tmp_path)[1], params)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"shard {shards[1]} \(holding .+\) is missing"):
        load_checkpoint(tmp_path)


def test_export_replaces_stale_files(tmp_path: Path) -> None:
    export_checkpoint(tmp_path, QWEN3, init_params(QWEN3, 0), max_shard_bytes=10_000)
    export_checkpoint(tmp_path, QWEN3, init_params(QWEN3, 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHTS]
    assert _equal_trees(load_checkpoint(tmp_path)[1], init_params(QWEN3, 1))


def test_export_rejects_params_of_another_spec(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="k_proj/bias is not part of this spec"):
        export_checkpoint(tmp_path, QWEN3, init_params(QWEN2, 0))
    with pytest.raises(CheckpointError, match="parameters lack lm_head/kernel"):
        export_checkpoint(
            tmp_path, dataclasses.replace(QWEN2, tie_word_embeddings=False), init_params(QWEN2, 0)
        )


def _edit_config(ckpt: Path, **changes: Any) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


def test_unsupported_model_type(ckpt: Path) -> None:
    _edit_config(ckpt, model_type="mistral")
    with pytest.raises(CheckpointError, match=r"'mistral'; supported: qwen2, qwen3, llama"):
        load_checkpoint(ckpt)


def test_bad_config_field_named(ckpt: Path) -> None:
    _edit_config(ckpt, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        load_checkpoint(ckpt)


def test_bfloat16_load(ckpt: Path) -> None:
    spec, params = load_checkpoint(ckpt, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    export_checkpoint(ckpt / "bf16", spec, params)
    assert json.loads((ckpt / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _, again = load_checkpoint(ckpt / "bf16")
    assert _equal_trees(again, params)
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    logits = jax.jit(causal_logits, static_argnums=1)(again, spec, tokens)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


# --- spec parsing -----------------------------------------------------------------------


def _config(**changes: Any) -> dict[str, Any]:
    return {"model_type": "llama", **TINY, **changes}


def test_old_rope_layout() -> None:
    old = _config(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        bos_token_id=1,
        eos_token_id=[2, 3],
        max_position_embeddings=32768,
    )
    assert ModelSpec.from_config(old) == LLAMA
    linear = ModelSpec.from_config(_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    assert linear.rope_theta == 10000.0


def test_defaults_follow_transformers() -> None:
    spec = ModelSpec.from_config({"model_type": "qwen2", **TINY})
    assert spec.attention_bias and not spec.tie_word_embeddings
    assert (spec.head_dim, spec.max_position_embeddings, spec.eos_token_ids) == (8, 32768, ())
    qwen3 = ModelSpec.from_config({"model_type": "qwen3", **TINY})
    assert qwen3.head_dim == 128 and qwen3.qk_norm  # Qwen3Config's default head_dim


@pytest.mark.parametrize(
    "spec",
    [
        QWEN2,
        QWEN3,
        LLAMA,
        dataclasses.replace(
            QWEN3,
            rope_scaling=RopeScaling(
                "yarn", 4.0, original_max_position_embeddings=4096, beta_fast=16.0, truncate=False
            ),
        ),
        dataclasses.replace(LLAMA, rope_scaling=RopeScaling("linear", 2.0), attention_bias=True),
    ],
)
def test_to_config_round_trip(spec: ModelSpec) -> None:
    config = json.loads(json.dumps(spec.to_config()))
    assert config["rope_parameters"]["rope_theta"] == spec.rope_theta
    assert ModelSpec.from_config(config) == spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "`hidden_size`"),
        ({"num_hidden_layers": "2"}, "`num_hidden_layers` must be a positive integer"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"rope_scaling": {"type": "longrope"}}, "rope_scaling.*'longrope'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_type": "linear"}}, r"rope_parameters\.factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    ],
)
def test_bad_fields_named(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_config(_config(**changes))


def test_missing_field_named() -> None:
    config = _config()
    del config["intermediate_size"]
    with pytest.raises(SpecError, match="missing field `intermediate_size`"):
        ModelSpec.from_config(config)
    with pytest.raises(SpecError, match="missing field `model_type`"):
        ModelSpec.from_config(TINY)


# --- KV cache ---------------------------------------------------------------------------


def _cached_logits(params: Params, spec: ModelSpec, tokens: np.ndarray) -> list[np.ndarray]:
    """Logits of `tokens` [2, 10] fed through the cache in pieces, rows out of step.

    Row 0 prefills 6 tokens, row 1 only 3 (its pad writes go to slot S: dropped); then
    both take a 2-token chunk, then single tokens. Row 1 lives at slots offset by 5, so
    slot and position differ, as in a shared pool of cache slots.
    """
    slots, offset = 20, np.array([0, 5])
    step = jax.jit(
        lambda p, t, pos, w, m, c: forward(p, spec, t, pos, cache=c, write_pos=w, attn_mask=m)
    )
    cache = init_cache(spec, 2, slots)
    done = np.array([0, 0])  # tokens of each row already in the cache
    out: list[np.ndarray] = [np.zeros((0, spec.vocab_size), np.float32) for _ in range(2)]
    for sizes in ([6, 3], [2, 2], [1, 1], [1, 1]):
        width = max(sizes)
        cols = np.arange(width)
        real = cols[None] < np.array(sizes)[:, None]  # [2, width]
        positions = done[:, None] + cols[None]
        chunk = np.where(real, np.take_along_axis(tokens, np.minimum(positions, 9), 1), 0)
        write = np.where(real, positions + offset[:, None], slots)
        # query at position p sees the slots of positions 0..p of its own row
        slot_pos = np.arange(slots)[None, None, :] - offset[:, None, None]
        mask = (slot_pos >= 0) & (slot_pos <= positions[:, :, None])
        logits, cache = step(
            params,
            jnp.asarray(chunk, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            jnp.asarray(write, jnp.int32),
            jnp.asarray(mask),
            cache,
        )
        for row in range(2):
            out[row] = np.concatenate([out[row], np.asarray(logits)[row, : sizes[row]]])
        done += np.array(sizes)
    return out


@pytest.mark.parametrize("spec", [QWEN3, LLAMA], ids=lambda s: s.family)
def test_cache_matches_full_forward(spec: ModelSpec) -> None:
    params = init_params(spec, 3, std=0.3)
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (2, 10))
    full = np.asarray(jax.jit(causal_logits, static_argnums=1)(params, spec, jnp.asarray(tokens)))
    assert np.abs(full).max() > 0.5  # not a comparison of near-zero numbers
    cached = _cached_logits(params, spec, tokens)
    np.testing.assert_allclose(cached[0], full[0, :10], rtol=0, atol=1e-5)
    np.testing.assert_allclose(cached[1], full[1, :7], rtol=0, atol=1e-5)


def test_forward_with_cache_requires_mask() -> None:
    params = init_params(QWEN2, 0)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="write_pos"):
        forward(params, QWEN2, tokens, tokens, cache=init_cache(QWEN2, 1, 4))


def test_the_policy_dtype_rule_is_stated_once() -> None:
    """code review 86b402d ("Other literals repeated", 3): `model.dtype`'s JAX dtype was
    spelled in workers/rollout.py, workers/trainer.py, evaluation.py and warmstart.py."""
    import re

    from streamrl.model import checkpoint

    assert checkpoint.policy_dtype("bfloat16") == jnp.bfloat16
    assert checkpoint.policy_dtype("float32") == jnp.float32
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.dtype 'float16'"):
        checkpoint.policy_dtype("float16")
    root = Path(__file__).parents[2]
    sources = [*root.glob("packages/streamrl/**/*.py"), *root.glob("workers/*.py")]
    rule = re.compile(r'jnp\.bfloat16 if .*"bfloat16"|"bfloat16": jnp\.bfloat16')
    assert [p.relative_to(root) for p in sources if rule.search(p.read_text())] == [
        Path("packages/streamrl/model/checkpoint.py")
    ]
