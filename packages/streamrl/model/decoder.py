"""Decoder-only transformer of the policy (Llama-like), in Flax Linen.

Token embedding tied with the output projection, pre-RMSNorm blocks, grouped-query
attention with rotary position embeddings (RoPE), SwiGLU MLP, final RMSNorm. Parameters are
float32. There is no learned position table: positions enter only through RoPE, so a
sequence may sit anywhere in a padded buffer as long as its `positions` count from 0.

Decoding uses a fixed-size key/value cache (`KVCache`): each call writes its T new keys and
values at slots `[index, index + T)` of every row and attends over all S slots under the
caller's mask, so shapes never change while decoding and nothing recompiles.
"""

from __future__ import annotations

import zlib
from typing import Any, cast

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from streamrl.config import ModelConfig

__all__ = [
    "LENGTH_BUCKET",
    "Decoder",
    "KVCache",
    "Params",
    "causal_logits",
    "causal_mask",
    "forward",
    "init_cache",
    "init_params",
    "param_shapes",
    "round_batch",
    "round_length",
]

Params = Any  # a nested dict of float32 jax arrays, as Flax's `init` returns it

# Finite, so that a fully masked query row (a padding slot) gives a uniform softmax over
# garbage instead of NaN; such rows are never read.
_MASKED = float(jnp.finfo(jnp.float32).min)
_EMBED_STD = 0.02
_NORM_EPS = 1e-6


class KVCache(flax.struct.PyTreeNode):
    """Keys and values of every layer, written at slot `index` by the next forward call.

    k[i], v[i]: [B, S, num_kv_heads, head_dim] float32 for layer i; index: int32 scalar,
    the first slot the next call writes (the same slot for every row: rows align by
    left-padding).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    index: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    """An empty cache of `length` slots per row for `batch` rows."""
    head_dim = cfg.d_model // cfg.num_heads
    shape = (batch, length, cfg.num_kv_heads, head_dim)
    zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in range(cfg.num_layers))
    return KVCache(k=zeros, v=zeros, index=jnp.zeros((), jnp.int32))


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate x [B, T, H, D] by its positions [B, T] (rotate-half convention)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, :, None] * freqs  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dense(features: int, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, param_dtype=jnp.float32, name=name)


class Attention(nn.Module):
    """Grouped-query self-attention; with a cache, keys come from the cache's S slots."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
        index: jax.Array | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.d_model // cfg.num_heads
        group = cfg.num_heads // cfg.num_kv_heads
        q = _dense(cfg.num_heads * hd, "q")(x).reshape(b, t, cfg.num_heads, hd)
        k = _dense(cfg.num_kv_heads * hd, "k")(x).reshape(b, t, cfg.num_kv_heads, hd)
        v = _dense(cfg.num_kv_heads * hd, "v")(x).reshape(b, t, cfg.num_kv_heads, hd)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        new_kv = None
        if kv is not None:
            assert index is not None
            zero = jnp.zeros((), jnp.int32)
            start = (zero, index, zero, zero)
            k = jax.lax.dynamic_update_slice(kv[0], k, start)
            v = jax.lax.dynamic_update_slice(kv[1], v, start)
            new_kv = (k, v)
        # [B, T, Hkv, G, D] x [B, S, Hkv, D] -> [B, Hkv, G, T, S]
        qg = q.reshape(b, t, cfg.num_kv_heads, group, hd)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k) * (hd**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, cfg.num_heads * hd)
        return _dense(cfg.d_model, "o")(out), new_kv


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + swiglu(norm(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
        index: jax.Array | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        cfg = self.cfg
        h = nn.RMSNorm(epsilon=_NORM_EPS, param_dtype=jnp.float32, name="attn_norm")(x)
        a, new_kv = Attention(cfg, name="attn")(h, positions, mask, kv, index)
        x = x + a
        h = nn.RMSNorm(epsilon=_NORM_EPS, param_dtype=jnp.float32, name="mlp_norm")(x)
        gate = _dense(cfg.d_ff, "gate")(h)
        up = _dense(cfg.d_ff, "up")(h)
        x = x + _dense(cfg.d_model, "down")(jax.nn.silu(gate) * up)
        return x, new_kv


class Decoder(nn.Module):
    """The whole model: tokens [B, T] -> logits [B, T, V] (and an updated cache)."""

    cfg: ModelConfig
    vocab_size: int

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        embed = nn.Embed(
            self.vocab_size,
            self.cfg.d_model,
            embedding_init=nn.initializers.normal(_EMBED_STD),
            param_dtype=jnp.float32,
            name="embed",
        )
        x = embed(tokens)
        ks, vs = [], []
        for i in range(self.cfg.num_layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            index = None if cache is None else cache.index
            x, new_kv = Block(self.cfg, name=f"block_{i}")(x, positions, mask, kv, index)
            if new_kv is not None:
                ks.append(new_kv[0])
                vs.append(new_kv[1])
        x = nn.RMSNorm(epsilon=_NORM_EPS, param_dtype=jnp.float32, name="final_norm")(x)
        logits = embed.attend(x)  # tied output projection
        new_cache = None
        if cache is not None:
            step = jnp.asarray(tokens.shape[1], jnp.int32)
            new_cache = KVCache(k=tuple(ks), v=tuple(vs), index=cache.index + step)
        return logits, new_cache


def param_shapes(cfg: ModelConfig, vocab_size: int) -> Any:
    """The parameter pytree with jax.ShapeDtypeStruct leaves (a template; nothing computed)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 1, 1), jnp.bool_)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return jax.eval_shape(Decoder(cfg, vocab_size).init, key, tokens, tokens, mask)["params"]


def init_params(cfg: ModelConfig, vocab_size: int, seed: int) -> Params:
    """Fresh float32 parameters; the same seed gives the same parameters in any process.

    Shapes come from the Flax module (abstractly, via eval_shape); values are drawn with
    NumPy, one generator per parameter seeded by (seed, crc32 of its path). Flax's own
    `init` would compile one XLA random kernel per parameter, several seconds on a CPU,
    which every worker start and test would pay. Kernels are N(0, 1/fan_in), the output
    projections of each block (`o`, `down`) further scaled by 1/sqrt(2 * num_layers) so the
    residual stream keeps unit scale at init; norm scales are 1; the tied embedding is
    N(0, 0.02^2).
    """
    shapes = param_shapes(cfg, vocab_size)
    residual_scale = (2.0 * cfg.num_layers) ** -0.5

    def draw(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        names = [str(getattr(p, "key", p)) for p in path]
        rng = np.random.default_rng([seed, zlib.crc32("/".join(names).encode())])
        if names[-1] == "scale":
            value = np.ones(leaf.shape, np.float32)
        elif names[-1] == "embedding":
            value = rng.normal(0.0, _EMBED_STD, leaf.shape)
        else:
            std = leaf.shape[0] ** -0.5
            if names[-2] in ("o", "down"):
                std *= residual_scale
            value = rng.normal(0.0, std, leaf.shape)
        return jnp.asarray(value, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def forward(
    params: Params,
    cfg: ModelConfig,
    vocab_size: int,
    tokens: jax.Array,
    positions: jax.Array,
    attn_mask: jax.Array,
    cache: KVCache | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Logits [B, T, V] float32 of tokens [B, T] int32 at positions [B, T] int32.

    attn_mask [B, T, S] bool says which keys each query sees: S = T without a cache, else
    the cache's slot count (the new tokens are written at slots [cache.index, +T) before
    attending, so the mask must admit them). Returns the cache advanced by T, or None.
    """
    out = Decoder(cfg, vocab_size).apply({"params": params}, tokens, positions, attn_mask, cache)
    return cast(tuple[jax.Array, KVCache | None], out)


def causal_mask(length: int) -> jax.Array:
    """[1, L, L] bool: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((length, length), jnp.bool_))[None]


def causal_logits(
    params: Params, cfg: ModelConfig, vocab_size: int, tokens: jax.Array
) -> jax.Array:
    """Logits [B, L, V] of right-padded tokens [B, L] (positions 0..L-1, causal, no cache).

    Right padding never changes the logits of earlier positions, so no padding mask is needed.
    """
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    mask = jnp.broadcast_to(causal_mask(length), (b, length, length))
    logits, _ = forward(params, cfg, vocab_size, tokens, positions, mask)
    return logits


LENGTH_BUCKET = 32  # sequence lengths round up to a multiple of this, so shapes repeat


def round_batch(n: int) -> int:
    """Batch bucket: n rounded up to a power of two (at least 1)."""
    return 1 << max(0, (n - 1).bit_length())


def round_length(n: int) -> int:
    """Length bucket: n rounded up to a multiple of LENGTH_BUCKET (at least one bucket)."""
    return max(1, -(-n // LENGTH_BUCKET)) * LENGTH_BUCKET
