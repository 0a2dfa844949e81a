"""Continuous batching: one decode loop over a fixed pool of KV-cache slots.

Every concurrent sequence of a rollout worker owns one slot of the pool
(`num_slots` x `kv_cache_size` positions per layer, rounded up to a multiple of 8). Each `step()`:

1. admits waiting requests into free slots: their prompts (all but the last token) are
   prefilled, bucketed by count and length; members of a group that share a prompt are
   prefilled once and the slot is copied to the others;
2. runs `decode_chunk` decode steps over the active slots in one device call; each slot
   feeds its own last token at its own position, so sequences of any lengths decode
   together, and a sequence admitted now joins the very next chunk. Attention reads only
   the live span, the first `span_bucket(longest reach)` positions of each slot (64, 128,
   192, 256, 384, ...; `live_span`): the pool's first cache blocks (`llm.KVCache`), not
   all `kv_cache_size` positions; on a CPU a decode step's attention is bound by reading
   the cache;
3. frees the slots of finished sequences at once (stop token, stop string or token budget),
   or parks them (below).

A decode call gathers the active slots' rows (their live span) into a batch of
`bucket(active slots)` rows and scatters them back after, so neither an empty slot nor a
parked one costs a decode call anything, wherever it lies in the pool. Shapes are bucketed
(powers of two for rows, multiples of 64 for prompt lengths, two span buckets per doubling),
so steady state compiles nothing new; `compile_counts` says how many traces each program
took.

KV reuse across turns (`kv_reuse`): an agentic episode's turns are requests of one
`session` (its traj id) whose prompts each extend the last: the previous prompt, the tokens
sampled for it, then tool results and template tokens. When a sequence of a session
finishes, its slot is not freed but parked with the tokens its keys/values hold (prompt and
sample, all but the last sampled token, which was never fed). The session's next request
takes the parked slot back and prefills only from the first token where its prompt departs
from them (normally: the last sampled token, the tool results, the template), at their
positions after the kept prefix; the suffix's length is bucketed (`suffix_bucket`: 16, 24,
32, 48, 64, ...), so such prefills compile one program per (rows, length) bucket. A parked
slot is evicted, least recently parked first, when a new request finds no free slot (its
session then prefills its whole prompt again: counted in `evictions`); `end_session` frees
it (the episode ended), and new params (`set_params`) drop every parked slot, since keys and
values computed by the old params are not what the new ones compute. A sequence admitted
before a `set_params` is not parked either. Parked slots are not decoded (a decode call
takes only the active ones).

Exactness: a reused position's keys/values were computed by an earlier call (the previous
turn's prefill or a decode step) where without reuse this turn's prefill computes them; the
two are the same function of the same tokens, computed through differently shaped float32
matmuls, so they agree to rounding (not bit for bit), as a request's samples already do
across batch-mates (see tests/unit/test_engine_kv.py for the measured bounds).

Sampling: temperature, top-p, top-k; token i of a request draws from
`fold_in(PRNGKey(seed), i)`, so a request samples the same whatever its batch-mates or
chunking. `logprobs[i]` is the log-probability under the temperature-scaled distribution
over the whole vocabulary, before top-k/top-p (see `streamrl.model.sampling`).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from streamrl.model.llm import KV_BLOCK, DType, KVCache, Params, forward, init_cache
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
SUFFIX_BUCKET = 16  # shortest suffix prefill (see `suffix_bucket`)
SPAN_BUCKET = 64  # fewest cache positions a decode call attends over (see `span_bucket`)
POOL_ALIGN = 8


class DecodeCost(NamedTuple):
    """Decode calls of one row bucket since the engine started (see `Engine.decode_costs`)."""

    calls: int
    active: int  # active rows summed over the calls (each decodes `decode_chunk` tokens)
    seconds: float  # their wall time, from the call to its results on the host


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def half_pow2(n: int, least: int) -> int:
    """The least of 2^k and 3 x 2^(k-1) that holds n, at least `least` (a power of two):
    padding stays under half, two buckets per doubling."""
    p = max(pow2(n), least)
    return p * 3 // 4 if p >= 2 * least and n <= p * 3 // 4 else p


def suffix_bucket(n: int) -> int:
    """The padded length of a suffix prefill of n tokens: 16, 24, 32, 48, 64, 96, ...
    (`half_pow2` from `SUFFIX_BUCKET`)."""
    return half_pow2(n, SUFFIX_BUCKET)


def span_bucket(n: int, pool_len: int) -> int:
    """The cache positions a decode call attends over when its rows need the first n:
    64, 128, 192, 256, 384, 512, 768, ... (`half_pow2` from `SPAN_BUCKET`, rounded up to
    whole cache blocks), at most the pool's length."""
    return min(pool_len, round_up(half_pow2(n, SPAN_BUCKET), KV_BLOCK))


def pool_dtype(param_dtype: DType, backend: str | None = None) -> np.dtype:
    """The KV pool's dtype for a policy computing in `param_dtype`: float32 on a CPU, the
    params' dtype elsewhere. XLA:CPU converts a bfloat16 pool to float32 in full at every
    decode step (a bfloat16 policy decoded 2x slower with a bfloat16 pool than with a float32
    one; ops/bench/decode.py). It costs twice the memory and changes no sample: the pool
    holds the keys/values rounded to the params' dtype (`llm._to_cache`)."""
    backend = backend or jax.default_backend()
    return jnp.dtype(jnp.float32) if backend == "cpu" else jnp.dtype(param_dtype)


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
    kv_reuse: bool = True
    live_span: bool = True

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
    start: int = 0  # prompt positions taken from the session's parked slot
    prefilled: int = 0  # prompt positions computed for it
    epoch: int = 0  # the params it was admitted under (`Engine._epoch`)


@dataclass
class _Parked:
    """A finished session's slot: positions [0, len(tokens)) hold these tokens' keys/values."""

    slot: int
    tokens: list[int]


class Engine:
    """A continuous-batching generator over one model and one KV pool (not thread-safe:
    one thread drives `submit` and `step`)."""

    def __init__(
        self,
        spec: ModelSpec,
        params: Params,
        cfg: EngineConfig,
        detokenize: Callable[[list[int]], str] | None = None,
        dtype: DType | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        """`dtype`: the KV pool's; None: `pool_dtype` of the params' dtype."""
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
        self._parked: OrderedDict[str, _Parked] = OrderedDict()  # least recently parked first
        self._epoch = 0
        self.invalidated = 0  # parked slots dropped by new params
        self.set_params(params)
        # Slots per row rounded up to a multiple of 8: a decode step's attention runs about
        # twice as fast over 256 or 264 positions as over 257 (vectorised rows on a CPU).
        self.pool_len = round_up(cfg.kv_cache_size, POOL_ALIGN)
        if dtype is None:
            dtype = pool_dtype(jax.tree.leaves(params)[0].dtype)
        self.pool: KVCache = init_cache(spec, cfg.num_slots, self.pool_len, dtype)
        if mesh is not None:
            self.pool = shard_cache(self.pool, mesh)
        self._waiting: deque[_Seq] = deque()
        # requests the last admission found no slot for (every slot decoding): what adaptive
        # admission reads as waiting (the queue itself also holds, between two steps,
        # requests that will take their session's parked slot back)
        self.unplaced = 0
        self._slots: list[_Seq | None] = [None] * cfg.num_slots
        self._ids = itertools.count()
        self.compile_counts = {"prefill": 0, "copy": 0, "decode": 0}
        # Every program donates the pool: it is updated in place, never copied (XLA on the
        # CPU supports donation since JAX 0.4.x; a copy of a 64-slot pool cost about as much
        # as a decode step's attention).
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._copy = jax.jit(self._copy_fn, donate_argnums=(0,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,), static_argnames=("span",))
        self.tokens_generated = 0
        self.prefills = 0  # prompts prefilled (whole, or the suffix after a reused prefix)
        self.slot_copies = 0  # slots filled by copying a group member's prefill
        self.prefill_tokens = 0  # prompt positions computed
        self.reuse_hits = 0  # requests that took back their session's parked slot
        self.reused_tokens = 0  # prompt positions those did not compute again
        self.evictions = 0  # parked slots taken for other requests
        self.decode_calls = 0  # decode chunks run
        self.decode_rows = 0  # rows those covered (active slots, plus padding to a bucket)
        self.decode_active = 0  # active rows of those (the rest: padding to the bucket)
        self.decode_positions = 0  # rows x live span summed: the positions attended
        # Wall seconds of the decode calls by their rows (a bucket), with the calls and the
        # active rows they decoded: what a token costs at each batch size (adaptive
        # admission's latency term). Calls that traced a program are left out (a compile
        # is not the batch's cost). Every bucket's key exists from the start and its value
        # is replaced whole, so another thread may copy the dict at any time.
        self.decode_costs: dict[int, DecodeCost] = {
            self._row_bucket(a): DecodeCost(0, 0, 0.0) for a in range(1, cfg.num_slots + 1)
        }

    def _row_bucket(self, active: int) -> int:
        """The rows of a decode call over `active` slots: a power of two (a multiple of the
        mesh's data axis), at most the pool's slots."""
        return min(round_up(pow2(active), self._row_multiple), self.cfg.num_slots)

    # -- public ----------------------------------------------------------------------------

    def set_params(self, params: Params) -> None:
        """Serve these params from the next step on (placed on the mesh, if any). Parked
        slots are dropped: their keys/values are the old params'."""
        self.params = shard_params(params, self.mesh) if self.mesh is not None else params
        self._epoch += 1
        self.invalidated += len(self._parked)
        self._parked.clear()

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
        """Forget a request (its episode gave up); its slot is freed now, not parked."""
        self._waiting = deque(s for s in self._waiting if s.handle != handle)
        for i, s in enumerate(self._slots):
            if s is not None and s.handle == handle:
                self._slots[i] = None

    def end_session(self, session: str) -> None:
        """The session has no more turns: free its parked slot, if any."""
        self._parked.pop(session, None)

    @property
    def active(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def kv_stats(self) -> dict[str, int]:
        """Prefill, KV-reuse and decode-batch counters since the engine started."""
        return {
            "prefills": self.prefills,
            "prefill_tokens": self.prefill_tokens,
            "reuse_hits": self.reuse_hits,
            "reused_tokens": self.reused_tokens,
            "evictions": self.evictions,
            "invalidated": self.invalidated,
            "parked": len(self._parked),
            "decode_calls": self.decode_calls,
            "decode_rows": self.decode_rows,
            "decode_active": self.decode_active,
            "decode_positions": self.decode_positions,
        }

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
        admitted = self._assign_slots()
        if not admitted:
            return
        for seq in admitted:
            seq.length = len(seq.request.prompt) - 1
            seq.last = seq.request.prompt[-1]
            seq.epoch = self._epoch
            self._slots[seq.slot] = seq
            if seq.start:
                self.reuse_hits += 1
                self.reused_tokens += seq.start
        # One prefill per distinct prompt; group members get a copy of its slot.
        firsts: dict[tuple[int, ...], _Seq] = {}
        copies: list[tuple[int, int]] = []
        suffixes: list[_Seq] = []
        for seq in admitted:
            if seq.start:
                if seq.length > seq.start:
                    suffixes.append(seq)
                continue
            key = tuple(seq.request.prompt)
            if key in firsts:
                copies.append((firsts[key].slot, seq.slot))
            else:
                firsts[key] = seq
        todo = [s for s in firsts.values() if s.length > 0]
        for i in range(0, len(todo), self.cfg.max_prefill):
            self._prefill_batch(todo[i : i + self.cfg.max_prefill], suffix=False)
        for i in range(0, len(suffixes), self.cfg.max_prefill):
            self._prefill_batch(suffixes[i : i + self.cfg.max_prefill], suffix=True)
        self.prefills += len(todo) + len(suffixes)
        if copies:
            self._copy_slots(copies)
            self.slot_copies += len(copies)

    def _assign_slots(self) -> list[_Seq]:
        """Take waiting requests into slots: their session's parked slot, else the lowest
        free one, else the least recently parked one (an eviction)."""
        if not self._waiting:
            self.unplaced = 0
            return []
        admitted: list[_Seq] = []
        if self._parked:  # requests whose session parked a slot take it back first
            rest: deque[_Seq] = deque()
            for seq in self._waiting:
                parked = self._parked.pop(seq.request.session, None)
                if parked is None:
                    rest.append(seq)
                    continue
                seq.slot = parked.slot
                seq.start = _common_prefix(parked.tokens, seq.request.prompt[:-1])
                admitted.append(seq)
            self._waiting = rest
        taken = {p.slot for p in self._parked.values()} | {s.slot for s in admitted}
        free = [i for i, s in enumerate(self._slots) if s is None and i not in taken]
        free.reverse()  # lowest last: popped first
        while self._waiting:
            if free:
                slot = free.pop()
            elif self._parked:
                slot = self._parked.popitem(last=False)[1].slot
                self.evictions += 1
            else:
                break
            seq = self._waiting.popleft()
            seq.slot = slot
            admitted.append(seq)
        self.unplaced = len(self._waiting)
        return admitted

    def _prefill_batch(self, seqs: list[_Seq], suffix: bool) -> None:
        """Prefill prompt positions [start, length) of each sequence (start 0: the whole
        prompt but its last token), right-padded to a bucketed length p. A row's window
        starts at `start`, or earlier when [start, start + p) would overrun the slot: the
        window then recomputes some kept positions (same tokens, same positions)."""
        b = round_up(pow2(len(seqs)), self._row_multiple)
        need = max(s.length - s.start for s in seqs)
        bucket = suffix_bucket(need) if suffix else round_up(need, PROMPT_BUCKET)
        p = min(bucket, self.pool_len)
        tokens = np.full((b, p), self.cfg.pad_id, np.int32)
        starts = np.zeros((b,), np.int32)
        ends = np.zeros((b,), np.int32)
        slots = np.full((b,), self.cfg.num_slots, np.int32)  # out of range: dropped
        for i, s in enumerate(seqs):
            w = min(s.start, self.pool_len - p)
            tokens[i, : s.length - w] = s.request.prompt[w : s.length]
            starts[i], ends[i], slots[i] = w, s.length, s.slot
            s.prefilled = s.length - w
            self.prefill_tokens += s.length - w
        self.pool = self._prefill(self.params, self.pool, tokens, starts, ends, slots)

    def _copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        m = pow2(len(pairs))
        src = np.zeros((m,), np.int32)
        dst = np.full((m,), self.cfg.num_slots, np.int32)
        for i, (a, b) in enumerate(pairs):
            src[i], dst[i] = a, b
        self.pool = self._copy(self.pool, src, dst)

    # -- decode ----------------------------------------------------------------------------

    def _decode_chunk(self) -> list[tuple[int, GenResult]]:
        # The active slots, lowest first, as the call's rows; the rest of the bucket are
        # padding rows: slot num_slots, out of range (their writes are dropped).
        active = [(i, s) for i, s in enumerate(self._slots) if s is not None]
        n = self._row_bucket(len(active))
        rows = np.full((n,), self.cfg.num_slots, np.int32)
        last = np.zeros((n,), np.int32)
        lengths = np.zeros((n,), np.int32)
        budget = np.zeros((n,), np.int32)  # 0: a padding row, done before it starts
        seeds = np.zeros((n,), np.uint32)
        produced = np.zeros((n,), np.int32)
        for j, (i, s) in enumerate(active):
            rows[j], last[j], lengths[j], seeds[j] = i, s.last, s.length, s.request.seed
            produced[j] = len(s.tokens)
            budget[j] = s.request.max_new_tokens - len(s.tokens)
        # A padding row still writes its token's key/value at its length, in its copy of
        # the pool's last row; the scatter back drops it.
        lengths[len(active) :] = self.pool_len - 1
        # The live span: every position a row reads in this chunk (its length plus the
        # chunk's tokens, no more than its budget) lies below `span`. Active rows are those
        # with a budget (an empty slot has none; a row without one has finished).
        reach = int((lengths + np.minimum(self.cfg.decode_chunk, budget))[budget > 0].max())
        span = span_bucket(reach, self.pool_len) if self.cfg.live_span else self.pool_len
        traced, start = self.compile_counts["decode"], time.perf_counter()
        pool, toks, lps, counts, stopped = self._decode(
            self.params, self.pool, rows, last, lengths, budget, seeds, produced, span=span
        )
        self.pool = pool
        self.decode_calls += 1
        self.decode_rows += n
        self.decode_active += len(active)
        self.decode_positions += n * span
        toks, lps = np.asarray(toks), np.asarray(lps)
        counts, stopped = np.asarray(counts), np.asarray(stopped)
        if self.compile_counts["decode"] == traced:
            c = self.decode_costs[n]
            self.decode_costs[n] = DecodeCost(
                c.calls + 1, c.active + len(active), c.seconds + time.perf_counter() - start
            )
        return self._collect([i for i, _ in active], toks, lps, counts, stopped)

    def _collect(
        self,
        slots: list[int],
        toks: np.ndarray,
        lps: np.ndarray,
        counts: np.ndarray,
        stopped: np.ndarray,
    ) -> list[tuple[int, GenResult]]:
        """Take row j's tokens into the sequence of slot `slots[j]`."""
        finished = []
        for j, i in enumerate(slots):
            s = self._slots[i]
            assert s is not None
            c = int(counts[j])
            before = len(s.tokens)
            s.tokens.extend(toks[j, :c].tolist())
            s.logprobs.extend(lps[j, :c].tolist())
            self.tokens_generated += c
            s.length += c
            s.last = s.tokens[-1] if s.tokens else s.last
            s.stopped = bool(stopped[j]) or self._hit_stop_string(s, before)
            if s.stopped or len(s.tokens) >= s.request.max_new_tokens:
                result = GenResult(
                    s.tokens,
                    s.logprobs,
                    s.stopped,
                    prefill_tokens=s.prefilled,
                    reused_tokens=s.start,
                )
                finished.append((s.handle, result))
                self._slots[i] = None
                self._park(s)
        return finished

    def _park(self, s: _Seq) -> None:
        """Keep a finished session's slot for its next turn (see the module docstring)."""
        session = s.request.session
        if not (self.cfg.kv_reuse and session) or s.epoch != self._epoch:
            return
        held = s.request.prompt + s.tokens
        # All but the last sampled token were fed (a stop string's cut drops fed ones).
        self._parked.pop(session, None)
        self._parked[session] = _Parked(s.slot, held[: len(held) - 1])

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
        kept: KVCache = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), pool)
        return kept

    def _prefill_fn(
        self,
        params: Params,
        pool: KVCache,
        tokens: jax.Array,
        starts: jax.Array,
        ends: jax.Array,
        slots: jax.Array,
    ) -> KVCache:
        """Write the keys/values of right-padded token windows [b, p], at positions
        starts[i] onwards (positions before are kept: they attend to them), into pool rows
        `slots`; a row's tokens end at ends[i]."""
        self.compile_counts["prefill"] += 1
        _, p = tokens.shape
        s = self.pool_len
        rows = jnp.minimum(slots, self.cfg.num_slots - 1)
        cache = jax.tree.map(lambda x: x[rows], pool)
        positions = starts[:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]
        k = jnp.arange(s, dtype=jnp.int32)[None, None, :]
        mask = (k <= positions[:, :, None]) & (k < ends[:, None, None])
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
        params: Params,
        pool: KVCache,
        rows: jax.Array,
        last: jax.Array,
        lengths: jax.Array,
        budget: jax.Array,
        seeds: jax.Array,
        produced: jax.Array,
        *,
        span: int,
    ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array, jax.Array]:
        """`decode_chunk` steps over pool rows `rows` [n] (num_slots: a padding row),
        attending over the first `span` positions of each (the live span: what those rows
        hold and write). Returns the pool, tokens and log-probs [n, K], how many tokens each
        row produced [n] and whether it stopped [n]."""
        self.compile_counts["decode"] += 1
        chunk = self.cfg.decode_chunk
        stop_ids = jnp.asarray(self.cfg.stop_ids, jnp.int32).reshape(-1)
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        k_slots = jnp.arange(span, dtype=jnp.int32)
        # The live span's blocks of the rows, gathered: the rest of the pool is not touched.
        live = pool.prefix(-(-span // KV_BLOCK))
        gather = jnp.minimum(rows, self.cfg.num_slots - 1)
        view = jax.tree.map(lambda x: x[gather], live)

        def body(carry: _Carry, i: jax.Array) -> tuple[_Carry, tuple[jax.Array, ...]]:
            cache, tok, length, done, count = carry
            mask = (k_slots[None, :] <= length[:, None])[:, None, :]
            logits, written = forward(
                params, self.spec, tok[:, None], length[:, None], cache=cache,
                write_pos=length[:, None], attn_mask=mask, in_bounds=True,
            )  # fmt: skip
            assert written is not None  # (traced once: a cache in, a cache out)
            cache = written
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
        live = jax.tree.map(lambda full, part: full.at[rows].set(part, mode="drop"), live, view)
        pool = self._constrain(pool.with_prefix(live))
        stopped = (hits & actives).any(axis=0)
        return pool, toks.T, lps.T, counts, stopped


# The decode loop's carry: the cache view, and per row the last token, the length, whether
# it stopped and how many tokens it produced.
_Carry = tuple[KVCache, jax.Array, jax.Array, jax.Array, jax.Array]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
