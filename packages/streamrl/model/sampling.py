"""The sampling step shared by every decode loop (the requests and results it serves are in
`streamrl.model.requests`, which needs no JAX; re-exported here).

`logprobs` of a sampled token is always the log-probability under the temperature-scaled
distribution over the whole vocabulary, BEFORE top-k/top-p truncation and the pad-id
exclusion. The trainer recomputes exactly this from the full vocabulary
(`streamrl.trainer.step.token_logprobs`), so the importance ratio of an unchanged policy is
1 whatever truncation sampling used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl.model.requests import GenRequest, GenResult, SamplingParams

__all__ = ["GenRequest", "GenResult", "SamplingParams", "check_sampling", "sample_tokens"]


def sample_tokens(
    logits: jax.Array, keys: jax.Array, sampling: SamplingParams, pad_id: int
) -> tuple[jax.Array, jax.Array]:
    """Tokens [B] int32 and their untruncated log-probs [B] from logits [B, V], one RNG key
    per row. The pad id is never sampled.

    Inverse-CDF sampling: one uniform number per row against the cumulative distribution.
    `jax.random.categorical` draws V Gumbel numbers per row instead, which on a CPU costs
    more than the decode step's matmuls at batch 64.
    """
    scaled = logits / sampling.temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    allowed = _truncate(scaled.at[:, pad_id].set(-jnp.inf), sampling)
    cdf = jnp.cumsum(jax.nn.softmax(allowed, axis=-1), axis=-1)
    # u in (0, 1]: u = 0 would pick index 0 even where it has no mass.
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    target = u * cdf[:, -1]
    tokens = jnp.minimum(jnp.sum(cdf < target[:, None], axis=-1), logits.shape[-1] - 1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def check_sampling(s: SamplingParams) -> None:
    if not s.temperature > 0:
        raise ValueError(f"temperature {s.temperature} must be > 0")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"top_p {s.top_p} must be in (0, 1]")
    if s.top_k < 0:
        raise ValueError(f"top_k {s.top_k} must be >= 0")


def _truncate(scaled: jax.Array, s: SamplingParams) -> jax.Array:
    """Scaled logits [B, V] with tokens outside top-k, then outside the top-p nucleus, at -inf.

    Ties at the cut-off are kept, so a few more than k tokens may survive.
    """
    vocab = scaled.shape[-1]
    if 0 < s.top_k < vocab:
        kth = jax.lax.top_k(scaled, s.top_k)[0][:, -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    if s.top_p < 1.0:
        ordered = -jnp.sort(-scaled, axis=-1)  # descending
        probs = jax.nn.softmax(ordered, axis=-1)
        # Keep a token while the mass before it is below top_p: the smallest set reaching it.
        keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
        cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return scaled
