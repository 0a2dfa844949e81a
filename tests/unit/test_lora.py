"""LoRA adapters: a fresh adapter is a no-op, merged equals unmerged equals attached, only
adapters learn, attached adapters shard like their kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.model.llm import causal_logits, init_params
from streamrl.model.lora import (
    LoraConfig,
    LoraError,
    apply_lora,
    attach_lora,
    init_lora,
    merge_lora,
    num_adapter_params,
)
from streamrl.model.sharding import TENSOR, _param_spec
from streamrl.model.spec import ModelSpec

SPEC = ModelSpec.from_config(
    {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
)
PARAMS = init_params(SPEC, 0)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
CFG = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
_logits = jax.jit(causal_logits, static_argnums=1)


def test_fresh_adapter_changes_nothing() -> None:
    lora = init_lora(PARAMS, CFG, seed=1)
    # 2 layers x (q 32x4+4x32, v 32x4+4x16, down 48x4+4x32)
    assert num_adapter_params(lora) == 2 * ((128 + 128) + (128 + 64) + (192 + 128))
    np.testing.assert_array_equal(
        _logits(apply_lora(PARAMS, lora, CFG), SPEC, TOKENS), _logits(PARAMS, SPEC, TOKENS)
    )


def test_merged_equals_unmerged_and_base_is_untouched() -> None:
    lora = jax.tree.map(lambda x: x + 0.05, init_lora(PARAMS, CFG, seed=1))
    merged = apply_lora(PARAMS, lora, CFG)  # once, outside: what a server would hold

    @jax.jit
    def unmerged(params: object, adapters: object) -> jax.Array:
        return causal_logits(apply_lora(params, adapters, CFG), SPEC, TOKENS)

    np.testing.assert_allclose(unmerged(PARAMS, lora), _logits(merged, SPEC, TOKENS), atol=1e-5)
    assert not np.allclose(_logits(merged, SPEC, TOKENS), _logits(PARAMS, SPEC, TOKENS))
    # W' = W + (alpha/rank) A B exactly
    a, b = lora["model"]["layers_1"]["self_attn"]["q_proj"].values()
    want = PARAMS["model"]["layers_1"]["self_attn"]["q_proj"]["kernel"] + 2.0 * (a @ b)
    np.testing.assert_allclose(
        merged["model"]["layers_1"]["self_attn"]["q_proj"]["kernel"], want, atol=1e-6
    )
    # untargeted leaves are shared, not copied; the base kernel itself is unchanged
    emb = "embed_tokens"
    assert merged["model"][emb]["embedding"] is PARAMS["model"][emb]["embedding"]
    assert not np.allclose(
        PARAMS["model"]["layers_1"]["self_attn"]["q_proj"]["kernel"],
        merged["model"]["layers_1"]["self_attn"]["q_proj"]["kernel"],
    )


def test_merge_for_serving_is_apply_lora_bit_for_bit_and_shares_the_rest() -> None:
    lora = jax.tree.map(lambda x: x + 0.05, init_lora(PARAMS, CFG, seed=1))
    merged = merge_lora(PARAMS, lora, CFG)
    want = apply_lora(PARAMS, lora, CFG)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)
    assert str(jax.tree.structure(merged)) == str(jax.tree.structure(PARAMS))
    k = merged["model"]["layers_0"]["self_attn"]["k_proj"]["kernel"]  # not a target
    assert k is PARAMS["model"]["layers_0"]["self_attn"]["k_proj"]["kernel"]


def test_attached_equals_merged() -> None:
    lora = jax.tree.map(lambda x: x + 0.05, init_lora(PARAMS, CFG, seed=1))
    attached = attach_lora(PARAMS, lora, CFG)
    np.testing.assert_allclose(
        _logits(attached, SPEC, TOKENS), _logits(apply_lora(PARAMS, lora, CFG), SPEC, TOKENS),
        atol=1e-5,
    )  # fmt: skip
    down = attached["model"]["layers_1"]["mlp"]["down_proj"]
    base = PARAMS["model"]["layers_1"]["mlp"]["down_proj"]
    assert down["kernel"] is base["kernel"]  # the kernels are the base's own arrays
    assert down["lora_a"] is lora["model"]["layers_1"]["mlp"]["down_proj"]["lora_a"]
    np.testing.assert_allclose(
        down["lora_b"], 2.0 * lora["model"]["layers_1"]["mlp"]["down_proj"]["lora_b"]
    )
    assert set(attached["model"]["layers_1"]["self_attn"]["k_proj"]) == {"kernel"}  # untargeted
    assert "lora_a" not in PARAMS["model"]["layers_1"]["mlp"]["down_proj"]  # base untouched


def test_attached_adapters_shard_like_their_kernels() -> None:
    def spec(*names: str) -> object:
        return _param_spec(tuple(jax.tree_util.DictKey(n) for n in names), None)

    P = jax.sharding.PartitionSpec
    # q_proj: kernel [in, out] split by output -> B [rank, out] too, A replicated.
    assert spec("q_proj", "kernel") == spec("q_proj", "lora_b") == P(None, TENSOR)
    assert spec("q_proj", "lora_a") == P()
    # down_proj: kernel [in, out] split by input -> A [in, rank] too, B replicated.
    assert spec("down_proj", "kernel") == spec("down_proj", "lora_a") == P(TENSOR, None)
    assert spec("down_proj", "lora_b") == P()


def test_only_adapters_get_gradients() -> None:
    lora = init_lora(PARAMS, CFG, seed=1)

    def loss(adapters: object) -> jax.Array:
        logits = causal_logits(apply_lora(PARAMS, adapters, CFG), SPEC, TOKENS)
        return -jax.nn.log_softmax(logits)[..., 3].mean()

    grads = jax.grad(loss)(lora)
    gb = grads["model"]["layers_0"]["self_attn"]["q_proj"]["lora_b"]
    ga = grads["model"]["layers_0"]["self_attn"]["q_proj"]["lora_a"]
    assert float(jnp.abs(gb).max()) > 0  # B learns first (A is random, B zero)
    assert float(jnp.abs(ga).max()) == 0  # dL/dA = dL/dW B^T = 0 while B is 0
    lora2 = jax.tree.map(lambda p, g: p - 0.5 * g, lora, grads)
    assert float(loss(lora2)) < float(loss(lora))


def test_bad_targets_are_named() -> None:
    with pytest.raises(LoraError, match=r"LoRA targets \['qproj'\] not among"):
        LoraConfig(rank=4, alpha=8.0, targets=("qproj",))
    with pytest.raises(LoraError, match="rank 0 must be at least 1"):
        LoraConfig(rank=0, alpha=1.0)
