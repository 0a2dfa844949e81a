"""Decoder: causality, KV-cache decoding equals the full forward, seeded init."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.config import ModelConfig
from streamrl.model.decoder import (
    Params,
    causal_logits,
    forward,
    init_cache,
    init_params,
    round_batch,
    round_length,
)

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64)
VOCAB = 50

# Eager Flax dispatches op by op, each one compiled on first use: jit is much faster here.
_causal = jax.jit(causal_logits, static_argnums=(1, 2))
_forward = jax.jit(forward, static_argnums=(1, 2))


@pytest.fixture(scope="module")
def params() -> Params:
    return init_params(CFG, VOCAB, seed=3)


def _tokens(b: int, length: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (b, length)), jnp.int32)


def test_params_deterministic_by_seed(params: Params) -> None:
    same = init_params(CFG, VOCAB, seed=3)
    other = init_params(CFG, VOCAB, seed=4)
    leaves, same_leaves = jax.tree.leaves(params), jax.tree.leaves(same)
    assert all(np.array_equal(a, b) for a, b in zip(leaves, same_leaves, strict=True))
    assert not np.array_equal(params["embed"]["embedding"], other["embed"]["embedding"])
    assert all(x.dtype == jnp.float32 for x in leaves)


def test_causal(params: Params) -> None:
    tokens = _tokens(2, 12)
    changed = tokens.at[:, 8].set((tokens[:, 8] + 1) % VOCAB)
    a = _causal(params, CFG, VOCAB, tokens)
    b = _causal(params, CFG, VOCAB, changed)
    assert a.shape == (2, 12, VOCAB) and a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a[:, :8]), np.asarray(b[:, :8]))
    assert not np.allclose(a[:, 8:], b[:, 8:])


def test_cache_decoding_matches_full_forward(params: Params) -> None:
    b, length, prefill, slots = 2, 10, 6, 16
    tokens = _tokens(b, length, seed=1)
    full = _causal(params, CFG, VOCAB, tokens)
    cache = init_cache(CFG, b, slots)
    q = jnp.arange(prefill, dtype=jnp.int32)
    positions = jnp.broadcast_to(q, (b, prefill))
    mask = jnp.broadcast_to(jnp.arange(slots)[None, :] <= q[:, None], (b, prefill, slots))
    logits, cache = _forward(params, CFG, VOCAB, tokens[:, :prefill], positions, mask, cache)
    assert cache is not None
    outs = [logits]
    for t in range(prefill, length):
        step_mask = jnp.broadcast_to(jnp.arange(slots) <= t, (b, 1, slots))
        pos = jnp.full((b, 1), t, jnp.int32)
        logits, cache = _forward(params, CFG, VOCAB, tokens[:, t : t + 1], pos, step_mask, cache)
        assert cache is not None
        outs.append(logits)
    assert int(cache.index) == length
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, atol=1e-5)


def test_buckets() -> None:
    assert [round_batch(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [round_length(n) for n in (0, 1, 32, 33, 64)] == [32, 32, 32, 64, 64]
