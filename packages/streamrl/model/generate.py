"""Batched sampling with the KV cache, compiled once per shape bucket.

A batch of prompts of different lengths is left-padded into a [B, P] buffer (B rounded up
to a power of two, P to a multiple of 32) and decoded for at most N new tokens, N fixed per
Generator, so steady state reuses a handful of compiled programs. Pads are masked out of
attention and each prompt's positions start at 0 at its first real token, so a prompt's
result does not depend on the padding it got or on its batch-mates; each request samples
from its own RNG stream, `fold_in(PRNGKey(seed), step)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from streamrl.config import ModelConfig
from streamrl.model.decoder import (
    Params,
    forward,
    init_cache,
    round_batch,
    round_length,
)

__all__ = ["GenRequest", "GenResult", "Generator", "SamplingParams", "sample_tokens"]

_SEED_LIMIT = 2**32  # seeds travel to the device as uint32


@dataclass(frozen=True)
class SamplingParams:
    """temperature > 0; top_p in (0, 1] (1.0: off); top_k >= 0 (0: off)."""

    temperature: float
    top_p: float
    top_k: int


@dataclass(frozen=True)
class GenRequest:
    """A prompt's token ids, how many tokens it may sample, and its RNG seed in [0, 2^32)."""

    prompt: list[int]
    max_new_tokens: int
    seed: int


@dataclass(frozen=True)
class GenResult:
    """Sampled tokens (a stop token, if sampled, is the last one) and their log-probs.

    `stopped` says a stop token ended the sample; otherwise max_new_tokens did.
    """

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


class _Outputs:
    """Device results of one batch: tokens/logprobs [B, N], lengths/stopped [B]."""

    def __init__(self, out: tuple[jax.Array, ...]) -> None:
        # One transfer per array; per-row tolist() on device arrays would sync B times.
        self.tokens, self.logprobs, self.lengths, self.stopped = (np.asarray(a) for a in out)

    def result(self, row: int) -> GenResult:
        n = int(self.lengths[row])
        return GenResult(
            tokens=self.tokens[row, :n].tolist(),
            logprobs=self.logprobs[row, :n].tolist(),
            stopped=bool(self.stopped[row]),
        )


class Generator:
    """Samples up to `max_new_tokens` (N) tokens per request, batched, with a KV cache.

    Log-probabilities: `logprobs[i]` is log softmax(logits / temperature)[token], the
    probability under the temperature-scaled distribution over the whole vocabulary, BEFORE
    top-k/top-p truncation and the pad-id exclusion. The trainer recomputes exactly this
    from the full vocabulary (`token_logprobs`), so the importance ratio of an unchanged
    policy is 1 whatever truncation sampling used.

    `compile_count` counts traces of the compiled program: it rises once per new
    (batch bucket, prompt bucket) pair and never in steady state. Each compile costs
    seconds on a CPU; `min_batch` rounds small batches up (padding rows cost little next to
    a compile), so fewer batch buckets ever compile.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        stop_ids: Sequence[int],
        pad_id: int,
        max_new_tokens: int,
        sampling: SamplingParams,
        min_batch: int = 1,
    ) -> None:
        _check_sampling(sampling)
        if not 0 <= pad_id < vocab_size:
            raise ValueError(f"pad_id {pad_id} outside the vocabulary of {vocab_size}")
        if not 1 <= max_new_tokens < cfg.max_seq_len:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} must be in [1, max_seq_len {cfg.max_seq_len})"
            )
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.stop_ids = tuple(int(s) for s in stop_ids)
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.min_batch = round_batch(max(1, min_batch))
        self.compile_count = 0
        self._run = jax.jit(self._decode)

    def check(self, request: GenRequest) -> None:
        """Raise ValueError, naming the sizes, for a request this Generator cannot serve."""
        n, m = len(request.prompt), request.max_new_tokens
        if n < 1:
            raise ValueError("prompt is empty: at least one token is needed to sample from")
        if not 1 <= m <= self.max_new_tokens:
            raise ValueError(
                f"max_new_tokens {m} must be in [1, {self.max_new_tokens}] (the Generator's N)"
            )
        if n + m > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt of {n} tokens plus max_new_tokens {m} = {n + m} exceeds "
                f"max_seq_len {self.cfg.max_seq_len}"
            )
        if not 0 <= request.seed < _SEED_LIMIT:
            raise ValueError(f"seed {request.seed} outside [0, 2^32)")
        if min(request.prompt) < 0 or max(request.prompt) >= self.vocab_size:
            raise ValueError(f"prompt has token ids outside [0, {self.vocab_size})")

    def generate(self, params: Params, requests: list[GenRequest]) -> list[GenResult]:
        """One result per request, in order. Raises ValueError (see `check`) before any work."""
        if not requests:
            return []
        for r in requests:
            self.check(r)
        b = max(round_batch(len(requests)), self.min_batch)
        p = round_length(max(len(r.prompt) for r in requests))
        prompts = np.full((b, p), self.pad_id, np.int32)
        pad_len = np.full((b,), p, np.int32)
        max_new = np.zeros((b,), np.int32)  # 0: a batch-padding row, done before it starts
        seeds = np.zeros((b,), np.uint32)
        for i, r in enumerate(requests):
            prompts[i, p - len(r.prompt) :] = r.prompt
            pad_len[i] = p - len(r.prompt)
            max_new[i] = r.max_new_tokens
            seeds[i] = r.seed
        out = _Outputs(self._run(params, prompts, pad_len, max_new, seeds))
        return [out.result(i) for i in range(len(requests))]

    def _sample(self, logits: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
        return sample_tokens(logits, keys, self.sampling, self.pad_id)

    def _decode(
        self,
        params: Params,
        prompts: jax.Array,
        pad_len: jax.Array,
        max_new: jax.Array,
        seeds: jax.Array,
    ) -> tuple[jax.Array, ...]:
        """Prefill the left-padded prompts [B, P], then sample until N tokens or all done.

        Returns tokens [B, N] int32, logprobs [B, N] float32, lengths [B] int32 (valid
        prefix of each row) and stopped [B] bool.
        """
        self.compile_count += 1  # runs once per trace, i.e. once per compiled bucket
        cfg, n_new = self.cfg, self.max_new_tokens
        b, p = prompts.shape
        slots = jnp.arange(p + n_new, dtype=jnp.int32)
        key_valid = slots[None, :] >= pad_len[:, None]  # [B, S]: pads are never attended
        prompt_len = p - pad_len
        q_slots = jnp.arange(p, dtype=jnp.int32)
        positions = jnp.maximum(q_slots[None, :] - pad_len[:, None], 0)
        mask = key_valid[:, None, :] & (slots[None, None, :] <= q_slots[None, :, None])
        cache = init_cache(cfg, b, p + n_new)
        logits, cache = forward(params, cfg, self.vocab_size, prompts, positions, mask, cache)
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        stop_ids = jnp.asarray(self.stop_ids, jnp.int32).reshape(-1)

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            i, last, cache, done, toks, lps, lengths, stopped = carry
            tok, lp = self._sample(last, jax.vmap(jax.random.fold_in, (0, None))(keys, i))
            active = ~done
            toks = toks.at[:, i].set(jnp.where(active, tok, self.pad_id))
            lps = lps.at[:, i].set(jnp.where(active, lp, 0.0))
            lengths = lengths + active.astype(jnp.int32)
            hit = active & (tok[:, None] == stop_ids[None, :]).any(axis=-1)
            stopped = stopped | hit
            done = done | hit | (lengths >= max_new)
            # The sampled token goes in at slot p + i; it sees its prompt and earlier samples.
            step_mask = (key_valid & (slots[None, :] <= p + i))[:, None, :]
            pos = (prompt_len + i)[:, None]
            logits, cache = forward(
                params, cfg, self.vocab_size, tok[:, None], pos, step_mask, cache
            )
            return i + 1, logits[:, 0], cache, done, toks, lps, lengths, stopped

        def cond(carry: tuple[Any, ...]) -> jax.Array:
            return (carry[0] < n_new) & ~jnp.all(carry[3])

        init = (
            jnp.zeros((), jnp.int32),
            logits[:, -1],
            cache,
            max_new <= 0,
            jnp.full((b, n_new), self.pad_id, jnp.int32),
            jnp.zeros((b, n_new), jnp.float32),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), jnp.bool_),
        )
        out = jax.lax.while_loop(cond, body, init)
        return out[4], out[5], out[6], out[7]


def sample_tokens(
    logits: jax.Array, keys: jax.Array, sampling: SamplingParams, pad_id: int
) -> tuple[jax.Array, jax.Array]:
    """Tokens [B] int32 and their untruncated log-probs [B] from logits [B, V], one RNG key
    per row. The pad id is never sampled."""
    scaled = logits / sampling.temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    allowed = _truncate(scaled.at[:, pad_id].set(-jnp.inf), sampling)
    tokens = jax.vmap(jax.random.categorical)(keys, allowed).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _check_sampling(s: SamplingParams) -> None:
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
