"""Continuous batching: one decode loop over a fixed pool of KV-cache slots.

Every concurrent sequence of a rollout worker owns one slot of the pool
(`num_slots` x `kv_cache_size` positions per layer, rounded up to a multiple of 8). Each `step()`:

1. admits waiting requests into free slots: their prompts (all but the last token) are
   prefilled, bucketed by count and length; members of a group that share a prompt are
   prefilled once and the slot is copied to the others;
2. runs `decode_chunk` decode steps over the active slots in one device call; each slot
   feeds its own last token at its own position, so sequences of any lengths decode
   together, and a sequence admitted now joins the very next chunk;
3. frees the slots of finished sequences at once (stop token, stop string or token budget).

Slots are handed out lowest-first, so the active ones stay packed at the low end and a
decode call covers only the first `bucket(highest active slot)` rows. Shapes are bucketed
(powers of two for rows, multiples of 64 for prompt lengths), so steady state compiles
nothing new; `compile_counts` says how many traces each program took.

Sampling: temperature, top-p, top-k; token i of a request draws from
`fold_in(PRNGKey(seed), i)`, so a request samples the same whatever its batch-mates or
chunking. `logprobs[i]` is the log-probability under the temperature-scaled distribution
over the whole vocabulary, before top-k/top-p (see `streamrl.model.sampling`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from streamrl.model.llm import KVCache, forward, init_cache
from streamrl.model.sampling import (
    GenRequest,
    GenResult,
    SamplingParams,
    check_sampling,
    sample_tokens,
)
from streamrl.model.sharding import (
    DATA,
    MeshError,
    cache_sharding,
    check_spec,
    shard_cache,
    shard_params,
)
from streamrl.model.spec import ModelSpec

PROMPT_BUCKET = 64
POOL_ALIGN = 8


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the pool and the decode loop.

    A request fits when its prompt is at most `max_prompt_length` tokens and prompt plus
    its `max_new_tokens` (at most the engine's) fit in one slot of `kv_cache_size`.
    """

    num_slots: int
    kv_cache_size: int
    max_prompt_length: int
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    pad_id: int
    decode_chunk: int = 8
    max_prefill: int = 16
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_sampling(self.sampling)
        for name in ("max_prompt_length", "max_new_tokens"):
            if not 1 <= getattr(self, name) < self.kv_cache_size:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be in [1, kv_cache_size "
                    f"({self.kv_cache_size}))"
                )
        if self.num_slots < 1 or self.decode_chunk < 1 or self.max_prefill < 1:
            raise ValueError("num_slots, decode_chunk and max_prefill must be at least 1")


@dataclass
class _Seq:
    handle: int
    request: GenRequest
    slot: int = -1
    length: int = 0  # positions of the slot holding keys/values
    last: int = 0  # the token fed next
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False


class Engine:
    """A continuous-batching generator over one model and one KV pool (not thread-safe:
    one thread drives `submit` and `step`)."""

    def __init__(
        self,
        spec: ModelSpec,
        params: Any,
        cfg: EngineConfig,
        detokenize: Callable[[list[int]], str] | None = None,
        dtype: Any = jnp.float32,
        mesh: Mesh | None = None,
    ) -> None:
        if cfg.stop_strings and detokenize is None:
            raise ValueError("stop strings need a detokenize function")
        self.spec = spec
        self.cfg = cfg
        self.detokenize = detokenize
        self.mesh = mesh
        self._row_multiple = 1
        if mesh is not None:
            check_spec(spec, mesh)
            self._row_multiple = mesh.shape[DATA]
            if cfg.num_slots % self._row_multiple:
                raise MeshError(
                    f"num_slots ({cfg.num_slots}) is not divisible by data={self._row_multiple}"
                )
        self.params = params
        self.set_params(params)
        # Slots per row rounded up to a multiple of 8: a decode step's attention runs about
        # twice as fast over 256 or 264 positions as over 257 (vectorised rows on a CPU).
        self.pool_len = round_up(cfg.kv_cache_size, POOL_ALIGN)
        self.pool: KVCache = init_cache(spec, cfg.num_slots, self.pool_len, dtype)
        if mesh is not None:
            self.pool = shard_cache(self.pool, mesh)
        self._waiting: deque[_Seq] = deque()
        self._slots: list[_Seq | None] = [None] * cfg.num_slots
        self._ids = itertools.count()
        self.compile_counts = {"prefill": 0, "copy": 0, "decode": 0}
        # The pool is updated in place where the backend supports donation (XLA on the CPU
        # does not, and warns).
        donate = jax.default_backend() != "cpu"
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,) if donate else ())
        self._copy = jax.jit(self._copy_fn, donate_argnums=(0,) if donate else ())
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,) if donate else ())
        self.tokens_generated = 0
        self.prefills = 0  # prompts prefilled
        self.slot_copies = 0  # slots filled by copying a group member's prefill

    # -- public ----------------------------------------------------------------------------

    def set_params(self, params: Any) -> None:
        """Serve these params from the next step on (placed on the mesh, if any)."""
        self.params = shard_params(params, self.mesh) if self.mesh is not None else params

    def check(self, request: GenRequest) -> None:
        """Raise ValueError naming the sizes for a request this engine cannot serve."""
        n, m = len(request.prompt), request.max_new_tokens
        if n < 1:
            raise ValueError("prompt is empty: at least one token is needed to sample from")
        if n > self.cfg.max_prompt_length:
            raise ValueError(
                f"prompt of {n} tokens exceeds max_prompt_length ({self.cfg.max_prompt_length})"
            )
        if not 1 <= m <= self.cfg.max_new_tokens:
            raise ValueError(f"max_new_tokens {m} must be in [1, {self.cfg.max_new_tokens}]")
        if n + m > self.cfg.kv_cache_size:
            raise ValueError(
                f"prompt of {n} tokens + max_new_tokens {m} = {n + m} exceeds kv_cache_size "
                f"({self.cfg.kv_cache_size})"
            )
        if not 0 <= request.seed < 2**32:
            raise ValueError(f"seed {request.seed} outside [0, 2^32)")
        vocab = self.spec.vocab_size
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise ValueError(f"prompt has token ids outside [0, {vocab})")

    def submit(self, request: GenRequest) -> int:
        """Queue a request; returns its handle. Raises ValueError (see `check`)."""
        self.check(request)
        seq = _Seq(handle=next(self._ids), request=request)
        self._waiting.append(seq)
        return seq.handle

    def cancel(self, handle: int) -> None:
        """Forget a request (its episode gave up); its slot is freed now."""
        self._waiting = deque(s for s in self._waiting if s.handle != handle)
        for i, s in enumerate(self._slots):
            if s is not None and s.handle == handle:
                self._slots[i] = None

    @property
    def active(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.active > 0

    def step(self) -> list[tuple[int, GenResult]]:
        """Admit, decode one chunk, return the requests that finished."""
        self._admit()
        if self.active == 0:
            return []
        return self._decode_chunk()

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Run requests to completion (a convenience for tests, benchmarks and the CLI)."""
        handles = [self.submit(r) for r in requests]
        done: dict[int, GenResult] = {}
        while len(done) < len(handles):
            done.update(self.step())
        return [done[h] for h in handles]

    # -- admission and prefill -------------------------------------------------------------

    def _admit(self) -> None:
        free = [i for i, s in enumerate(self._slots) if s is None]
        if not free or not self._waiting:
            return
        admitted: list[_Seq] = []
        while self._waiting and len(admitted) < len(free):
            admitted.append(self._waiting.popleft())
        for seq, slot in zip(admitted, free, strict=False):
            seq.slot = slot
            seq.length = len(seq.request.prompt) - 1
            seq.last = seq.request.prompt[-1]
            self._slots[slot] = seq
        # One prefill per distinct prompt; group members get a copy of its slot.
        firsts: dict[tuple[int, ...], _Seq] = {}
        copies: list[tuple[int, int]] = []
        for seq in admitted:
            key = tuple(seq.request.prompt)
            if key in firsts:
                copies.append((firsts[key].slot, seq.slot))
            else:
                firsts[key] = seq
        todo = [s for s in firsts.values() if s.length > 0]
        for i in range(0, len(todo), self.cfg.max_prefill):
            self._prefill_batch(todo[i : i + self.cfg.max_prefill])
        self.prefills += len(todo)
        if copies:
            self._copy_slots(copies)
            self.slot_copies += len(copies)

    def _prefill_batch(self, seqs: list[_Seq]) -> None:
        b = round_up(pow2(len(seqs)), self._row_multiple)
        p = min(round_up(max(s.length for s in seqs), PROMPT_BUCKET), self.pool_len)
        tokens = np.full((b, p), self.cfg.pad_id, np.int32)
        lengths = np.zeros((b,), np.int32)
        slots = np.full((b,), self.cfg.num_slots, np.int32)  # out of range: dropped
        for i, s in enumerate(seqs):
            tokens[i, : s.length] = s.request.prompt[: s.length]
            lengths[i] = s.length
            slots[i] = s.slot
        self.pool = self._prefill(self.params, self.pool, tokens, lengths, slots)

    def _copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        m = pow2(len(pairs))
        src = np.zeros((m,), np.int32)
        dst = np.full((m,), self.cfg.num_slots, np.int32)
        for i, (a, b) in enumerate(pairs):
            src[i], dst[i] = a, b
        self.pool = self._copy(self.pool, src, dst)

    # -- decode ----------------------------------------------------------------------------

    def _decode_chunk(self) -> list[tuple[int, GenResult]]:
        top = max(i for i, s in enumerate(self._slots) if s is not None)
        n = min(round_up(pow2(top + 1), self._row_multiple), self.cfg.num_slots)
        last = np.zeros((n,), np.int32)
        lengths = np.zeros((n,), np.int32)
        budget = np.zeros((n,), np.int32)  # 0: an empty slot, done before it starts
        seeds = np.zeros((n,), np.uint32)
        produced = np.zeros((n,), np.int32)
        for i, s in enumerate(self._slots[:n]):
            if s is None:
                continue
            last[i], lengths[i], seeds[i] = s.last, s.length, s.request.seed
            produced[i] = len(s.tokens)
            budget[i] = s.request.max_new_tokens - len(s.tokens)
        pool, toks, lps, counts, stopped = self._decode(
            self.params, self.pool, last, lengths, budget, seeds, produced
        )
        self.pool = pool
        toks, lps = np.asarray(toks), np.asarray(lps)
        counts, stopped = np.asarray(counts), np.asarray(stopped)
        return self._collect(n, toks, lps, counts, stopped)

    def _collect(
        self, n: int, toks: np.ndarray, lps: np.ndarray, counts: np.ndarray, stopped: np.ndarray
    ) -> list[tuple[int, GenResult]]:
        finished = []
        for i, s in enumerate(self._slots[:n]):
            if s is None:
                continue
            c = int(counts[i])
            before = len(s.tokens)
            s.tokens.extend(toks[i, :c].tolist())
            s.logprobs.extend(lps[i, :c].tolist())
            self.tokens_generated += c
            s.length += c
            s.last = s.tokens[-1] if s.tokens else s.last
            s.stopped = bool(stopped[i]) or self._hit_stop_string(s, before)
            if s.stopped or len(s.tokens) >= s.request.max_new_tokens:
                finished.append((s.handle, GenResult(s.tokens, s.logprobs, s.stopped)))
                self._slots[i] = None
        return finished

    def _hit_stop_string(self, s: _Seq, before: int) -> bool:
        """Cut the sample right after the token that completed a stop string (only tokens
        from this chunk can complete one)."""
        if not self.cfg.stop_strings or self.detokenize is None:
            return False
        for end in range(before + 1, len(s.tokens) + 1):
            text = self.detokenize(s.tokens[:end])
            if any(stop in text for stop in self.cfg.stop_strings):
                del s.tokens[end:], s.logprobs[end:]
                return True
        return False

    # -- device programs -------------------------------------------------------------------

    def _constrain(self, pool: KVCache) -> KVCache:
        """Keep the pool's layout on the mesh across programs (no resharding between calls)."""
        if self.mesh is None:
            return pool
        sharding = cache_sharding(self.mesh)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), pool)

    def _prefill_fn(
        self, params: Any, pool: KVCache, tokens: jax.Array, lengths: jax.Array, slots: jax.Array
    ) -> KVCache:
        """Write the keys/values of right-padded prompts [b, p] into pool rows `slots`."""
        self.compile_counts["prefill"] += 1
        b, p = tokens.shape
        s = self.pool_len
        rows = jnp.minimum(slots, self.cfg.num_slots - 1)
        cache = jax.tree.map(lambda x: x[rows], pool)
        q = jnp.arange(p, dtype=jnp.int32)
        k = jnp.arange(s, dtype=jnp.int32)
        mask = (k[None, None, :] <= q[None, :, None]) & (k[None, None, :] < lengths[:, None, None])
        positions = jnp.broadcast_to(q, (b, p))
        _, cache = forward(
            params,
            self.spec,
            tokens,
            positions,
            cache=cache,
            write_pos=positions,
            attn_mask=mask,
            in_bounds=True,
        )
        assert cache is not None
        return self._constrain(
            jax.tree.map(lambda full, part: full.at[slots].set(part, mode="drop"), pool, cache)
        )

    def _copy_fn(self, pool: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
        self.compile_counts["copy"] += 1
        return self._constrain(jax.tree.map(lambda x: x.at[dst].set(x[src], mode="drop"), pool))

    def _decode_fn(
        self,
        params: Any,
        pool: KVCache,
        last: jax.Array,
        lengths: jax.Array,
        budget: jax.Array,
        seeds: jax.Array,
        produced: jax.Array,
    ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array, jax.Array]:
        """`decode_chunk` steps over the first n slots. Returns the pool, tokens and
        log-probs [n, K], how many tokens each row produced [n] and whether it stopped [n]."""
        self.compile_counts["decode"] += 1
        n = last.shape[0]
        chunk = self.cfg.decode_chunk
        s = self.pool_len
        stop_ids = jnp.asarray(self.cfg.stop_ids, jnp.int32).reshape(-1)
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        k_slots = jnp.arange(s, dtype=jnp.int32)
        view = jax.tree.map(lambda x: x[:n], pool)

        def body(carry: tuple[Any, ...], i: jax.Array) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            cache, tok, length, done, count = carry
            mask = (k_slots[None, :] <= length[:, None])[:, None, :]
            logits, cache = forward(
                params, self.spec, tok[:, None], length[:, None], cache=cache,
                write_pos=length[:, None], attn_mask=mask, in_bounds=True,
            )  # fmt: skip
            step_keys = jax.vmap(jax.random.fold_in)(keys, produced + count)
            new, lp = sample_tokens(logits[:, 0], step_keys, self.cfg.sampling, self.cfg.pad_id)
            active = ~done
            hit = active & (new[:, None] == stop_ids[None, :]).any(axis=-1)
            count = count + active.astype(jnp.int32)
            done = done | hit | (count >= budget)
            length = length + active.astype(jnp.int32)
            tok = jnp.where(active, new, tok)
            return (cache, tok, length, done, count), (new, lp, active, hit)

        init = (view, last, lengths, budget <= 0, jnp.zeros_like(budget))
        (view, _, _, _, counts), (toks, lps, actives, hits) = jax.lax.scan(
            body, init, jnp.arange(chunk, dtype=jnp.int32)
        )
        pool = self._constrain(jax.tree.map(lambda full, part: full.at[:n].set(part), pool, view))
        stopped = (hits & actives).any(axis=0)
        return pool, toks.T, lps.T, counts, stopped
