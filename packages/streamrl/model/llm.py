"""Flax Linen decoder of the Qwen2/Qwen2.5, Qwen3 and Llama 3 families, exact to transformers.

One module tree serves all three families; a `ModelSpec` switches the differences (q/k/v
biases for Qwen2, per-head q/k RMSNorm for Qwen3, the RoPE scaling of Llama 3.1 or YaRN,
a tied or separate output head). Parameters mirror the Hugging Face names, so a checkpoint
tensor maps to one leaf by a rule (`checkpoint.hf_name`):

    model.layers.3.self_attn.q_proj.weight [out, in]
        <-> params["model"]["layers_3"]["self_attn"]["q_proj"]["kernel"] [in, out]

Dense layers are `Linear` modules holding `kernel` [in, out] (and `bias`): a LoRA adapter
can later add its own leaves beside `kernel` in the same scope without renaming anything.

Computation runs in the parameters' dtype (float32 by default; bfloat16 for a bf16
checkpoint), as transformers does, with RMSNorm statistics, RoPE angles and the attention
softmax in float32; every matmul asks for a float32 result and rounds it once to the
parameters' dtype (the value torch's bfloat16 matmul gives; on a CPU with bfloat16 matrix
units XLA then takes them, several times faster than its bfloat16-output dot). Logits are
computed and returned in float32.

Decoding uses a `KVCache` of S slots per row, kept in blocks of `KV_BLOCK`. Each call writes
its T new keys and values at per-row slots `write_pos[b, t]` and then attends over the first
S' <= S slots (the mask's width, whole blocks) under the caller's mask, so every row of a
batch (a continuous-batching pool of sequences) can sit at its own length while all shapes
stay static under jit.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence
from typing import TypedDict, cast

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from streamrl.model.spec import ModelSpec, PyTree, RopeScaling

__all__ = [
    "CausalLM",
    "KVCache",
    "Params",
    "causal_logits",
    "causal_mask",
    "forward",
    "init_cache",
    "init_params",
    "param_shapes",
    "rope_frequencies",
]


class _Scatter(TypedDict, total=False):
    """Keyword arguments of an `.at[...].set` into the cache."""

    mode: str
    unique_indices: bool


Params = PyTree  # nested dict of jax arrays, {"model": {...}, "lm_head": {...}} (see module doc)
DType = DTypeLike

# Finite, so that a fully masked query row (a padding slot) gives a uniform softmax over
# garbage instead of NaN; such rows are never read.
_MASKED = float(np.finfo(np.float32).min)


KV_BLOCK = 64  # cache positions per block (see `KVCache`)


class KVCache(flax.struct.PyTreeNode):
    """Keys and values of every layer, in blocks of `KV_BLOCK` positions (the last block of
    a row may be shorter): k[i][j] is [B, num_kv_heads, head_dim, n_j] and v[i][j] is
    [B, num_kv_heads, n_j, head_dim], positions sum(n_0..n_{j-1}) onwards.

    The layouts are the ones a decode step reads fastest: q @ k and p @ v then contract
    without transposing the cache (on XLA:CPU, the [B, S, H, D] layout made attention ten
    times slower than the rest of a decode step at batch 64). The blocks are arrays of
    their own so that attending over the first positions of every row (a decode step's
    live span) reads the first blocks as they lie: a slice of one [.., S] array is copied
    out in full first, which cost more than attending over all S. Keys are stored after
    RoPE (and Qwen3's k_norm), so a slot never needs re-rotating.
    """

    k: tuple[tuple[jax.Array, ...], ...]
    v: tuple[tuple[jax.Array, ...], ...]

    @property
    def length(self) -> int:
        """Positions per row."""
        return sum(block.shape[-1] for block in self.k[0])

    def prefix(self, blocks: int) -> KVCache:
        """The first `blocks` blocks of every layer (no copy)."""
        return KVCache(
            k=tuple(layer[:blocks] for layer in self.k), v=tuple(layer[:blocks] for layer in self.v)
        )

    def with_prefix(self, part: KVCache) -> KVCache:
        """This cache with its first blocks replaced by `part`'s."""
        n = len(part.k[0])
        return KVCache(
            k=tuple(p + full[n:] for p, full in zip(part.k, self.k, strict=True)),
            v=tuple(p + full[n:] for p, full in zip(part.v, self.v, strict=True)),
        )


def block_sizes(length: int) -> list[int]:
    """Positions of each block of a `length`-position cache row: KV_BLOCK each, the last
    one shorter when length is not a multiple."""
    sizes = [KV_BLOCK] * (length // KV_BLOCK)
    return [*sizes, length % KV_BLOCK] if length % KV_BLOCK else sizes


def init_cache(spec: ModelSpec, batch: int, length: int, dtype: DType = jnp.float32) -> KVCache:
    """An all-zero cache of `length` positions for each of `batch` rows."""
    heads, dim = spec.num_key_value_heads, spec.head_dim
    layers = range(spec.num_hidden_layers)
    sizes = block_sizes(length)
    # A buffer of its own for each block: a program that donates the cache (updates it in
    # place) cannot take one buffer twice.
    return KVCache(
        k=tuple(tuple(jnp.zeros((batch, heads, dim, n), dtype) for n in sizes) for _ in layers),
        v=tuple(tuple(jnp.zeros((batch, heads, n, dim), dtype) for n in sizes) for _ in layers),
    )


# ---------------------------------------------------------------------------------------
# RoPE. Frequencies are computed once per spec in NumPy float32 with the same operations,
# in the same order, as transformers' torch float32 code (`_compute_*_parameters`), so the
# angles agree to the last bit or two.


def rope_frequencies(spec: ModelSpec) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling applied to cos and sin)."""
    dim = spec.head_dim
    pos_freqs = spec.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32), 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    return _yarn_inv_freq(spec, pos_freqs, scaling)


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth band between."""
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    assert s.original_max_position_embeddings is not None
    old_len = float(s.original_max_position_embeddings)
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    spec: ModelSpec, pos_freqs: np.ndarray, s: RopeScaling
) -> tuple[np.ndarray, float]:
    """YaRN: interpolate low frequencies, keep high ones, a linear ramp between."""
    assert s.original_max_position_embeddings is not None
    dim, base, factor = spec.head_dim, spec.rope_theta, s.factor
    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = s.beta_fast or 32
    beta_slow = s.beta_slow or 1

    original = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        ratio = original / (rotations * 2 * math.pi)
        return (dim * math.log(ratio)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention)


def rope_cos_sin(
    spec: ModelSpec, positions: jax.Array, dtype: DType
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim] for positions [B, T] (rotate-half layout), in `dtype`."""
    inv_freq, scaling = rope_frequencies(spec)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([angles, angles], axis=-1)
    return (jnp.cos(emb) * scaling).astype(dtype), (jnp.sin(emb) * scaling).astype(dtype)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D] rotated: x * cos + rotate_half(x) * sin (cos, sin [B, T, D])."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


# ---------------------------------------------------------------------------------------
# Modules. Initialisers here only fix shapes (`param_shapes` runs `init` abstractly);
# values come from `init_params` or a checkpoint.


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w as a float32 result rounded once to x's dtype: for bfloat16, the value of a
    bfloat16-output dot, but on a CPU with bfloat16 matrix units XLA:CPU computes it there
    (64 x 512 x 1536: 0.21 ms against 0.94 ms). Float32 is unchanged."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class Linear(nn.Module):
    """y [..., features] = x [..., in] @ kernel [in, features] (+ bias [features]), plus
    (x @ lora_a) @ lora_b when the params hold a LoRA adapter beside the kernel
    (`streamrl.model.lora.attach_lora`, which pre-scales lora_b)."""

    features: int
    use_bias: bool
    dtype: DType

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (x.shape[-1], self.features)
        kernel = self.param("kernel", nn.initializers.zeros_init(), shape, self.dtype)
        y = _matmul(x, kernel)
        if self.has_variable("params", "lora_a"):
            a: jax.Array = self.get_variable("params", "lora_a")
            b: jax.Array = self.get_variable("params", "lora_b")
            y = y + _matmul(_matmul(x, a), b)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    """weight * x / rms(x) over the last axis; statistics in float32, as transformers does."""

    eps: float
    dtype: DType

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones_init(), (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return weight * (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)


class Embed(nn.Module):
    """Token embedding [V, H]; `attend` is the tied output projection."""

    num_embeddings: int
    features: int
    dtype: DType

    def setup(self) -> None:
        shape = (self.num_embeddings, self.features)
        self.embedding = self.param("embedding", nn.initializers.zeros_init(), shape, self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.embedding.T, preferred_element_type=jnp.float32)


LayerKV = tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]  # a layer's key and value blocks


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention: q [B, T, Hq, D], k/v [B, S, Hkv, D], mask [B, T, S] -> [B, T, Hq*D].

    Query head h reads key/value head h // (Hq / Hkv), transformers' `repeat_kv` order.
    """
    b, t, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, t, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * dim**-0.5, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    out = out.astype(v.dtype)
    return out.reshape(b, t, heads * dim)


def _attend_cached(
    q: jax.Array, kt: Sequence[jax.Array], v: Sequence[jax.Array], mask: jax.Array
) -> jax.Array:
    """`_attend` over cache blocks: q [B, T, Hq, D], kt[j] [B, Hkv, D, n_j], v[j]
    [B, Hkv, n_j, D], mask [B, T, sum n_j].

    Scores are computed block by block (a batched matmul of one [T*G, D] matrix per batch
    row and kv head against the block) and joined for one softmax; the output sums each
    block's share. (A broadcast multiply-and-sum, faster over one whole-cache array, made
    XLA:CPU materialize the query's broadcast once for all blocks: 30x slower.)
    """
    b, t, heads, dim = q.shape
    kv_heads = kt[0].shape[1]
    g = heads // kv_heads
    grouped = q.reshape(b, t, kv_heads, g, dim).transpose(0, 2, 1, 3, 4)
    grouped = grouped.reshape(b, kv_heads, t * g, dim)
    rows_mask = jnp.repeat(mask, g, axis=1)[:, None]  # [B, 1, T*G, S]
    # [B, Hkv, T*G, n] per block, batched over (batch, kv head).
    parts = [
        jnp.einsum("bkqd,bkds->bkqs", grouped, block, preferred_element_type=jnp.float32)
        for block in kt
    ]
    scores = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    scores = jnp.where(rows_mask, scores * dim**-0.5, _MASKED)
    # Probabilities in the compute dtype, as `_attend` has them (the plain forward).
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = None
    start = 0
    for block in v:
        n = block.shape[2]
        p = probs[..., start : start + n]
        start += n
        # [B, Hkv, T*G, D] (T = 1: [B, Hkv, G, D]), batched over (batch, kv head).
        part = jnp.einsum("bkqs,bksd->bkqd", p, block, preferred_element_type=jnp.float32)
        out = part if out is None else out + part
    assert out is not None
    out = out.astype(q.dtype).reshape(b, kv_heads, t, g, dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, heads * dim)


def _to_cache(x: jax.Array, dtype: DType) -> jax.Array:
    """x as a cache of `dtype` stores it. A cache wider than x (a float32 pool for a
    bfloat16 policy) holds exactly x's values: XLA may otherwise skip rounding them to x's
    dtype (excess precision), and decoding would then drift from the model's own forward
    (0.1 in log-probs, measured), which the trainer computes."""
    if jnp.dtype(dtype).itemsize > x.dtype.itemsize:
        info = jnp.finfo(x.dtype)
        return jax.lax.reduce_precision(x.astype(dtype), info.nexp, info.nmant)
    return x.astype(dtype)


def _write_blocks(
    kv: LayerKV, k: jax.Array, v: jax.Array, write_pos: jax.Array, in_bounds: bool
) -> LayerKV:
    """Write k, v [B, T, Hkv, D] at positions write_pos [B, T] of a layer's cache blocks.

    A position outside a block (or past the cache) writes nothing there. With `in_bounds`
    and one token per row (a decode step), each block takes an in-place update of every
    row at a position clamped into the block, of the new key/value where it lies there and
    of what the block held otherwise: no bounds checks, no copy. Otherwise a scatter drops
    the writes that fall outside each block.
    """
    b, t = write_pos.shape
    rows = jnp.arange(b)[:, None]
    new_k, new_v = [], []
    start = 0
    for kb, vb in zip(*kv, strict=True):
        n = kb.shape[-1]
        local = write_pos - start
        inside = (local >= 0) & (local < n)
        start += n
        ck, cv = _to_cache(k, kb.dtype), _to_cache(v, vb.dtype)
        if in_bounds and t == 1:
            at = jnp.clip(local, 0, n - 1)
            ck = jnp.where(inside[..., None, None], ck, kb[rows, :, :, at])
            cv = jnp.where(inside[..., None, None], cv, vb[rows, :, at])
            how: _Scatter = {"mode": "promise_in_bounds", "unique_indices": True}
        else:
            at = jnp.where(inside, local, n)  # n: out of range, dropped
            how = {"mode": "drop"}
        # Index arrays on the batch and slot axes, slices between: the update's shape is
        # [B, T, H, D] for both layouts.
        new_k.append(kb.at[rows, :, :, at].set(ck, **how))
        new_v.append(vb.at[rows, :, at].set(cv, **how))
    return tuple(new_k), tuple(new_v)


class Attention(nn.Module):
    """Self-attention; with a cache, new keys/values are scattered in before attending.

    `in_bounds`: the caller promises no two writes of a row share a slot, which lets a
    decode step update the cache blocks in place (`_write_blocks`); otherwise each block
    takes a scatter that drops the writes outside it, at about four times the cost per
    decode step on a CPU. Writes at slots >= S are dropped either way.
    """

    spec: ModelSpec
    dtype: DType
    in_bounds: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: LayerKV | None,
        write_pos: jax.Array | None,
    ) -> tuple[jax.Array, LayerKV | None]:
        s, dt = self.spec, self.dtype
        b, t, _ = x.shape
        q_heads, kv_heads, dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        q = Linear(q_heads * dim, s.attention_bias, dt, name="q_proj")(x)
        k = Linear(kv_heads * dim, s.attention_bias, dt, name="k_proj")(x)
        v = Linear(kv_heads * dim, s.attention_bias, dt, name="v_proj")(x)
        q = q.reshape(b, t, q_heads, dim)
        k = k.reshape(b, t, kv_heads, dim)
        v = v.reshape(b, t, kv_heads, dim)
        if s.qk_norm:
            q = RMSNorm(s.rms_norm_eps, dt, name="q_norm")(q)
            k = RMSNorm(s.rms_norm_eps, dt, name="k_norm")(k)
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
        new_kv = None
        if kv is None:
            out = _attend(q, k, v, mask)
        else:
            assert write_pos is not None
            new_kv = _write_blocks(kv, k, v, write_pos, self.in_bounds)
            # A mask narrower than the cache attends over its first blocks only: a decode
            # step reads no more of the cache than its rows hold.
            span = mask.shape[-1]
            ends = list(itertools.accumulate(blk.shape[-1] for blk in new_kv[0]))
            if span not in ends:
                raise ValueError(f"attn_mask width {span} is not at a cache block boundary")
            read = ends.index(span) + 1
            out = _attend_cached(q, new_kv[0][:read], new_kv[1][:read], mask)
        return Linear(s.hidden_size, s.o_proj_bias, dt, name="o_proj")(out), new_kv


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    spec: ModelSpec
    dtype: DType

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        size, dt = self.spec.intermediate_size, self.dtype
        gate = Linear(size, False, dt, name="gate_proj")(x)
        up = Linear(size, False, dt, name="up_proj")(x)
        return Linear(self.spec.hidden_size, False, dt, name="down_proj")(jax.nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    spec: ModelSpec
    dtype: DType
    in_bounds: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: LayerKV | None,
        write_pos: jax.Array | None,
    ) -> tuple[jax.Array, LayerKV | None]:
        eps, dt = self.spec.rms_norm_eps, self.dtype
        h = RMSNorm(eps, dt, name="input_layernorm")(x)
        a, new_kv = Attention(self.spec, dt, self.in_bounds, name="self_attn")(
            h, cos, sin, mask, kv, write_pos
        )
        x = x + a
        h = RMSNorm(eps, dt, name="post_attention_layernorm")(x)
        return x + MLP(self.spec, dt, name="mlp")(h), new_kv


class DecoderStack(nn.Module):
    """HF's `model`: embed_tokens, layers_{i}, norm. Returns final hidden states [B, T, H]."""

    spec: ModelSpec
    dtype: DType
    in_bounds: bool = False

    def setup(self) -> None:
        s, dt = self.spec, self.dtype
        self.embed_tokens = Embed(s.vocab_size, s.hidden_size, dt)
        # A list attribute names its members layers_0, layers_1, ...
        self.layers = [DecoderLayer(s, dt, self.in_bounds) for _ in range(s.num_hidden_layers)]
        self.norm = RMSNorm(s.rms_norm_eps, dt)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[LayerKV, ...] | None,
        write_pos: jax.Array | None,
    ) -> tuple[jax.Array, tuple[LayerKV, ...] | None]:
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.spec, positions, self.dtype)
        new_kv: list[LayerKV] = []
        for i, layer in enumerate(self.layers):
            x, layer_kv = layer(x, cos, sin, mask, None if kv is None else kv[i], write_pos)
            if layer_kv is not None:
                new_kv.append(layer_kv)
        return self.norm(x), (tuple(new_kv) if kv is not None else None)


class CausalLM(nn.Module):
    """tokens [B, T] -> logits [B, T, V] in `dtype`, plus the updated per-layer keys/values."""

    spec: ModelSpec
    dtype: DType
    in_bounds: bool = False

    def setup(self) -> None:
        self.model = DecoderStack(self.spec, self.dtype, self.in_bounds)
        if not self.spec.tie_word_embeddings:
            self.lm_head = Linear(self.spec.vocab_size, False, self.dtype)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: tuple[LayerKV, ...] | None = None,
        write_pos: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[LayerKV, ...] | None]:
        h, new_kv = self.model(tokens, positions, mask, kv, write_pos)
        if self.spec.tie_word_embeddings:
            return self.model.embed_tokens.attend(h), new_kv
        return self.lm_head(h), new_kv


# ---------------------------------------------------------------------------------------
# Functional API.


def param_shapes(spec: ModelSpec, dtype: DType = jnp.float32) -> Params:
    """The parameter pytree with jax.ShapeDtypeStruct leaves (traced abstractly; nothing runs)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 1, 1), jnp.bool_)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    variables = jax.eval_shape(CausalLM(spec, dtype).init, key, tokens, tokens, mask)
    return variables["params"]


def init_params(
    spec: ModelSpec, seed: int, dtype: DType = jnp.float32, *, std: float = 0.02
) -> Params:
    """Random parameters; the same (spec, seed) gives the same values in any process.

    Norm weights are 1, biases 0, every matrix N(0, std^2). Values are drawn with NumPy, one
    generator per parameter seeded by (seed, crc32 of its path): Flax's own `init` would
    compile one XLA random kernel per parameter, seconds on a CPU at every start.
    """

    def draw(path: jax.tree_util.KeyPath, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        kind = name.rsplit("/", 1)[-1]
        if kind == "weight":
            return jnp.ones(leaf.shape, dtype)
        if kind == "bias":
            return jnp.zeros(leaf.shape, dtype)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        value = rng.standard_normal(leaf.shape, dtype=np.float32) * np.float32(std)
        return jnp.asarray(value, dtype)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(spec, dtype))


def causal_mask(length: int) -> jax.Array:
    """[1, L, L] bool: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((length, length), jnp.bool_))[None]


def forward(
    params: Params,
    spec: ModelSpec,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    cache: KVCache | None = None,
    write_pos: jax.Array | None = None,
    attn_mask: jax.Array | None = None,
    in_bounds: bool = False,
) -> tuple[jax.Array, KVCache | None]:
    """Logits [B, T, V] float32 of tokens [B, T] int32 at RoPE positions [B, T] int32.

    Without a cache the T tokens attend among themselves under attn_mask [B, T, T] bool
    (default: causal). With a cache (S slots per row), each token's key and value are
    first written at slot write_pos[b, t] of row b ([B, T] int32; a slot >= S drops the
    write; `in_bounds` promises no two writes of a row share a slot, which lets a decode
    step (T = 1) update each block in place, much faster), then every query attends over
    the first S' <= S slots under attn_mask [B, T, S'] bool, which is then required, must
    end at a cache block boundary (`block_sizes`) and must admit the slots just written
    (S' < S: the live span of a decode step; the slots past it are written but not read).
    Returns the updated cache, or None. Under jit pass `spec` as a static argument; the
    cache keeps its own dtype.
    """
    b, t = tokens.shape
    kv: tuple[LayerKV, ...] | None = None
    if cache is None:
        if attn_mask is None:
            attn_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
    else:
        if write_pos is None or attn_mask is None:
            raise ValueError("forward with a cache needs write_pos [B, T] and attn_mask [B, T, S]")
        kv = tuple(zip(cache.k, cache.v, strict=True))
    dtype = params["model"]["embed_tokens"]["embedding"].dtype
    out = CausalLM(spec, dtype, in_bounds).apply(
        {"params": params}, tokens, positions, attn_mask, kv, write_pos
    )
    logits, new_kv = cast(tuple[jax.Array, tuple[LayerKV, ...] | None], out)
    new_cache = None
    if new_kv is not None:
        new_cache = KVCache(k=tuple(k for k, _ in new_kv), v=tuple(v for _, v in new_kv))
    return logits.astype(jnp.float32), new_cache


def causal_logits(params: Params, spec: ModelSpec, tokens: jax.Array | np.ndarray) -> jax.Array:
    """Logits [B, L, V] float32 of tokens [B, L] (positions 0..L-1, causal, no cache).

    Right padding never changes the logits of earlier positions, so no padding mask is needed.
    """
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    logits, _ = forward(params, spec, jnp.asarray(tokens, jnp.int32), positions)
    return logits
