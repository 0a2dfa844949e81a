"""Sampling requests and results, and the sampling step shared by every decode loop.

`logprobs` of a sampled token is always the log-probability under the temperature-scaled
distribution over the whole vocabulary, BEFORE top-k/top-p truncation and the pad-id
exclusion. The trainer recomputes exactly this from the full vocabulary
(`streamrl.trainer.step.token_logprobs`), so the importance ratio of an unchanged policy is
1 whatever truncation sampling used.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = ["GenRequest", "GenResult", "SamplingParams", "check_sampling", "sample_tokens"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature > 0; top_p in (0, 1] (1.0: off); top_k >= 0 (0: off)."""

    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class GenRequest:
    """A prompt's token ids, how many tokens it may sample, and its RNG seed in [0, 2^32).

    `session`: a key shared by the turns of one conversation (the episode's traj id); the
    engine may keep a finished turn's KV cache for the session's next request, whose prompt
    extends it ("": none, every request prefills its whole prompt).
    """

    prompt: list[int]
    max_new_tokens: int
    seed: int
    session: str = ""


@dataclass(frozen=True)
class GenResult:
    """Sampled tokens (a stop token, if sampled, is the last one) and their log-probs.

    `stopped` says a stop token ended the sample; otherwise max_new_tokens did.
    `started_ns`: when the server took the request to decode it (`time.time_ns()`; 0:
    not said), what splits a model call's time into queue and decode in traces.
    `prefill_tokens`: prompt positions the engine computed for this request (0 for a group
    member that copied another's prefill); `reused_tokens`: prompt positions it took from
    its session's kept KV cache instead.
    """

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    started_ns: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0


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
