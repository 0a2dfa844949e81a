"""The continuous-batching engine with a real (tiny, random) model."""

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.llm import Params, causal_logits, init_params
from streamrl.model.sampling import GenRequest, SamplingParams
from streamrl.model.spec import ModelSpec

SPEC = ModelSpec.from_config(
    {
        "model_type": "qwen2",
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
)
PARAMS = init_params(SPEC, 0, std=0.3)  # a peaked random model: varied but not uniform
SAMPLING = SamplingParams(temperature=0.8, top_p=1.0, top_k=0)
STOP = 5


ENGINES: dict[SamplingParams, Engine] = {}


def config(**changes: object) -> EngineConfig:
    """The module's engine config (8 slots of 160, 24 new tokens, decode chunks of 4)."""
    fields: dict[str, object] = {
        "num_slots": 8,
        "kv_cache_size": 160,
        "max_prompt_length": 96,
        "max_new_tokens": 24,
        "sampling": SAMPLING,
        "stop_ids": (STOP,),
        "pad_id": 0,
        "decode_chunk": 4,
    }
    return EngineConfig(**(fields | changes))  # type: ignore[arg-type]


def engine(sampling: SamplingParams = SAMPLING) -> Engine:
    """One engine per sampling setting for the module: each compiles its own programs
    (seconds on a CPU), and an idle engine is as good as new."""
    if sampling not in ENGINES:
        ENGINES[sampling] = Engine(SPEC, PARAMS, config(sampling=sampling))
    assert not ENGINES[sampling].has_work()
    return ENGINES[sampling]


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(6, 97, n).tolist()


_causal = jax.jit(causal_logits, static_argnums=1)


@jax.jit
def _log_softmax_rows(params: Params, padded: jax.Array, temperature: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(causal_logits(params, SPEC, padded)[0] / temperature, axis=-1)


def _padded(tokens: list[int]) -> jax.Array:
    """tokens right-padded to [1, 160]: every length runs the same compiled programs (the
    padding and, below, the cut are numpy's; as eager JAX ops each length compiled its own,
    about 0.45 s a length on these cores)."""
    padded = np.zeros((1, 160), np.int32)
    padded[0, : len(tokens)] = tokens
    return jnp.asarray(padded)


def plain_logits(tokens: list[int]) -> np.ndarray:
    """Logits [len, V] of a plain causal forward."""
    return np.asarray(_causal(PARAMS, SPEC, _padded(tokens))[0])[: len(tokens)]


def reference_logprobs(tokens: list[int], temperature: float) -> np.ndarray:
    """log softmax(logits/T) of each token given the ones before it, by a plain forward."""
    logp = np.asarray(_log_softmax_rows(PARAMS, _padded(tokens), jnp.float32(temperature)))
    return logp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]


def test_logprobs_match_a_plain_forward() -> None:
    reqs = [GenRequest(prompt(i, 10 + 7 * i), 24, seed=i) for i in range(5)]
    for req, res in zip(reqs, engine().generate(reqs), strict=True):
        full = req.prompt + res.tokens
        ref = reference_logprobs(full, SAMPLING.temperature)[len(req.prompt) - 1 :]
        np.testing.assert_allclose(res.logprobs, ref, atol=1e-4)


def test_same_sample_alone_batched_or_joining_late() -> None:
    reqs = [GenRequest(prompt(i, 5 + 13 * i), 24, seed=100 + i) for i in range(6)]
    alone = [engine().generate([r])[0] for r in reqs]
    batched = engine().generate(reqs)
    # Continuous: half start, a few steps run, then the rest join mid-flight.
    e = engine()
    handles = [e.submit(r) for r in reqs[:3]]
    done = dict(e.step())
    done.update(e.step())
    handles += [e.submit(r) for r in reqs[3:]]
    while len(done) < len(reqs):
        done.update(e.step())
    late = [done[h] for h in handles]
    for a, b, c in zip(alone, batched, late, strict=True):
        assert a.tokens == b.tokens == c.tokens
        # float32 sums in other batch shapes: equal to rounding
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-4)


def test_group_members_share_a_prefill() -> None:
    p = prompt(7, 40)
    group = [GenRequest(p, 24, seed=s) for s in range(4)]
    e = engine()
    prefills, copies = e.prefills, e.slot_copies
    shared = e.generate(group)
    assert (e.prefills - prefills, e.slot_copies - copies) == (1, 3)  # prefilled once
    alone = [engine().generate([r])[0] for r in group]
    assert [r.tokens for r in shared] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in shared}) > 1  # members sample independently


def test_stop_tokens_and_budget() -> None:
    e = engine()
    res = e.generate([GenRequest(prompt(i, 12), 24, seed=i) for i in range(16)])
    for r in res:
        assert len(r.tokens) <= 24
        if r.stopped:
            assert r.tokens[-1] == STOP and STOP not in r.tokens[:-1]
        else:
            assert len(r.tokens) == 24 and STOP not in r.tokens


def test_greedy_is_argmax() -> None:
    greedy = SamplingParams(temperature=1.0, top_p=1.0, top_k=1)
    req = GenRequest(prompt(3, 20), 8, seed=0)
    [r] = engine(sampling=greedy).generate([req])
    seq = list(req.prompt)
    for tok in r.tokens:
        logits = plain_logits(seq)[-1].copy()
        logits[0] = -np.inf  # the pad id is never sampled
        assert tok == int(np.argmax(logits))
        seq.append(tok)


def test_steady_state_compiles_nothing() -> None:
    e = engine()
    reqs = [GenRequest(prompt(i, 30), 24, seed=i) for i in range(8)]
    e.generate(reqs)
    before = dict(e.compile_counts)
    e.generate([GenRequest(prompt(50 + i, 30), 24, seed=i) for i in range(8)])
    assert e.compile_counts == before


def test_stop_strings_cut_the_sample() -> None:
    detok = lambda ids: " ".join(map(str, ids))  # noqa: E731
    e = Engine(
        SPEC,
        PARAMS,
        EngineConfig(
            num_slots=4,
            kv_cache_size=160,
            max_prompt_length=96,
            max_new_tokens=24,
            sampling=SAMPLING,
            stop_ids=(),
            pad_id=0,
            decode_chunk=8,
            stop_strings=("x",),
        ),
        detokenize=lambda ids: detok(ids) + ("x" if len(ids) >= 3 else ""),
    )
    [r] = e.generate([GenRequest(prompt(1, 10), 24, seed=1)])
    assert r.stopped and len(r.tokens) == 3 and len(r.logprobs) == 3


def test_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match=r"max_new_tokens \(160\) must be in \[1, kv_cache_size"):
        EngineConfig(
            num_slots=1,
            kv_cache_size=160,
            max_prompt_length=100,
            max_new_tokens=160,
            sampling=SAMPLING,
            stop_ids=(),
            pad_id=0,
        )
    with pytest.raises(ValueError, match=r"prompt of 97 tokens exceeds max_prompt_length \(96\)"):
        engine().submit(GenRequest(prompt(0, 97), 4, seed=0))
    with pytest.raises(ValueError, match=r"prompt of 90 tokens \+ max_new_tokens 24 = 114"):
        small = EngineConfig(
            num_slots=1,
            kv_cache_size=100,
            max_prompt_length=96,
            max_new_tokens=24,
            sampling=SAMPLING,
            stop_ids=(),
            pad_id=0,
        )
        Engine(SPEC, PARAMS, small).submit(GenRequest(prompt(0, 90), 24, seed=0))


def test_unaligned_cache_size_is_padded_not_widened() -> None:
    """kv_cache_size 157 allocates 160 positions per slot (aligned rows decode faster) but
    requests are still checked against 157, and the padding changes no sample."""
    cfg = EngineConfig(
        num_slots=8,
        kv_cache_size=157,
        max_prompt_length=140,
        max_new_tokens=24,
        sampling=SAMPLING,
        stop_ids=(STOP,),
        pad_id=0,
        decode_chunk=4,
    )
    odd = Engine(SPEC, PARAMS, cfg)
    assert odd.pool_len == 160 and odd.pool.length == 160
    reqs = [GenRequest(prompt(i, 20 + 9 * i), 24, seed=i) for i in range(4)]
    assert [r.tokens for r in odd.generate(reqs)] == [r.tokens for r in engine().generate(reqs)]
    with pytest.raises(ValueError, match=r"= 158 exceeds kv_cache_size \(157\)"):
        odd.submit(GenRequest(prompt(0, 134), 24, seed=0))


def test_span_buckets() -> None:
    from streamrl.model.engine import span_bucket

    assert [span_bucket(n, 264) for n in (1, 64, 65, 96, 97, 129, 192, 193, 256, 257)] == [
        64, 64, 128, 128, 128, 192, 192, 256, 256, 264,
    ]  # fmt: skip
    assert [span_bucket(n, 1408) for n in (257, 385, 513, 769, 1025)] == [
        384, 512, 768, 1024, 1408,
    ]  # fmt: skip
    assert span_bucket(100, 72) == 72  # never past the pool


def test_cache_blocks() -> None:
    """The pool is kept in blocks of KV_BLOCK positions (the last one shorter), so a decode
    call's live span is whole blocks; a mask that ends inside a block is refused."""
    from streamrl.model.llm import block_sizes, forward, init_cache

    assert block_sizes(160) == [64, 64, 32]
    assert block_sizes(128) == [64, 64]
    assert block_sizes(20) == [20]
    cache = init_cache(SPEC, 2, 160)
    assert cache.length == 160 and [b.shape[-1] for b in cache.k[1]] == [64, 64, 32]
    assert [b.shape[-2] for b in cache.v[0]] == [64, 64, 32]
    assert cache.prefix(2).length == 128
    tokens = jnp.ones((2, 1), jnp.int32)
    mask = jnp.ones((2, 1, 100), jnp.bool_)
    with pytest.raises(ValueError, match="attn_mask width 100 is not at a cache block boundary"):
        forward(PARAMS, SPEC, tokens, tokens, cache=cache, write_pos=tokens, attn_mask=mask)


def test_live_span_attention_samples_what_the_whole_cache_does() -> None:
    """Decoding over the live span (the first span_bucket(reach) positions) instead of all
    kv_cache_size positions: the same tokens and, to rounding, the same log-probs, for rows
    of mixed lengths whose reach crosses span buckets (64, then 128 -> 160) mid-sample;
    each span compiles once."""
    results = []
    counts = []
    for live in (True, False):
        e = Engine(SPEC, PARAMS, config(max_new_tokens=40, stop_ids=(), live_span=live))
        short = [GenRequest(prompt(190 + i, n), 40, seed=i) for i, n in enumerate((5, 20))]
        reqs = [GenRequest(prompt(200 + i, n), 40, seed=i) for i, n in enumerate((5, 50, 60, 90))]
        results.append(e.generate(short) + e.generate(reqs))
        counts.append(e.compile_counts["decode"])
    for on, off in zip(*results, strict=True):
        assert on.tokens == off.tokens
        np.testing.assert_allclose(on.logprobs, off.logprobs, atol=1e-5)
    # The short pair reaches 60 (span 64); then the 90-token prompt reaches 94 -> 130
    # (spans 128, 160): three decode programs with the live span; two without (one per
    # row bucket, 2 and 4 rows).
    assert counts == [3, 2]


def test_bf16_policy_decodes_from_a_float32_pool() -> None:
    """On a CPU a bfloat16 policy's KV pool is float32 by default (`pool_dtype`: XLA:CPU
    would convert a bf16 pool in full at every decode step). With either pool the
    log-probs an engine reports are the bf16 model's, a plain forward of the sampled
    sequence (the trainer's computation), to float32 rounding: the float32 pool holds the
    bf16 keys/values exactly (without `llm._to_cache` XLA kept them unrounded and the
    log-probs drifted by up to 0.11)."""
    from streamrl.model.engine import pool_dtype

    assert pool_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert pool_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    cfg = config(num_slots=4, kv_cache_size=96, max_prompt_length=64, stop_ids=())
    default = Engine(SPEC, params16, cfg)
    assert default.pool.k[0][0].dtype == jnp.float32
    bf16_pool = Engine(SPEC, params16, cfg, dtype=jnp.bfloat16)
    assert bf16_pool.pool.k[0][0].dtype == jnp.bfloat16
    reqs = [GenRequest(prompt(300 + i, 9 + 11 * i), 24, seed=i) for i in range(4)]
    for engine16 in (default, bf16_pool):
        for req, res in zip(reqs, engine16.generate(reqs), strict=True):
            full = req.prompt + res.tokens
            padded = jnp.zeros((1, 96), jnp.int32).at[0, : len(full)].set(jnp.asarray(full))
            logits = _causal(params16, SPEC, padded)[0, : len(full)] / SAMPLING.temperature
            logp = jax.nn.log_softmax(logits, axis=-1)
            ref = np.asarray(logp[jnp.arange(len(full) - 1), jnp.asarray(full[1:])])
            np.testing.assert_allclose(res.logprobs, ref[len(req.prompt) - 1 :], atol=1e-5)


def test_bf16_matmuls_round_a_float32_result_once() -> None:
    """A bfloat16 layer's matmul is the float32 product rounded once to bfloat16 (what
    torch's bfloat16 matmul gives), and logits come out of the tied head in float32."""
    from streamrl.model.llm import Embed, Linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 40)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 24)), jnp.bfloat16)
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    y = cast(jax.Array, Linear(24, False, jnp.bfloat16).apply({"params": {"kernel": w}}, x))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(y, np.float32), np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float32)
    )
    table = jnp.asarray(rng.standard_normal((24, 40)), jnp.bfloat16)
    head = Embed(24, 40, jnp.bfloat16)
    logits = cast(jax.Array, head.apply({"params": {"embedding": table}}, x, method="attend"))
    assert logits.dtype == jnp.float32
    want = np.asarray(x, np.float32) @ np.asarray(table, np.float32).T
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5)
