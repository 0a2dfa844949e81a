"""Generator: rollout log-probs match the trainer's, batch invariance, stops, buckets.

Every compile costs seconds on a CPU, so the tests share a few shape buckets:
(4 rows, 32 prompt slots), (1, 32) and (4, 64) for the main generator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.config import ModelConfig
from streamrl.model.decoder import Params, causal_logits, init_params
from streamrl.model.generate import Generator, GenRequest, GenResult, SamplingParams, _truncate
from streamrl.trainer.step import token_logprobs

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=64)
VOCAB = 50
PAD = 0
STOP_IDS = (5, 6)
N = 12
TEMPERATURE = 0.8

_token_logprobs = jax.jit(token_logprobs, static_argnums=(1, 2, 4))
_causal = jax.jit(causal_logits, static_argnums=(1, 2))


@pytest.fixture(scope="module")
def params() -> Params:
    return init_params(CFG, VOCAB, seed=0)


@pytest.fixture(scope="module")
def gen() -> Generator:
    sampling = SamplingParams(temperature=TEMPERATURE, top_p=0.95, top_k=30)
    return Generator(CFG, VOCAB, STOP_IDS, pad_id=PAD, max_new_tokens=N, sampling=sampling)


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(7, VOCAB, length).tolist()


def _right_padded(seqs: list[list[int]], length: int = 64) -> jax.Array:
    out = np.full((len(seqs), length), PAD, np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return jnp.asarray(out)


def _same(a: GenResult, b: GenResult) -> None:
    assert a.tokens == b.tokens
    assert a.stopped == b.stopped
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_logprobs_match_trainer_recompute(params: Params, gen: Generator) -> None:
    # The importance ratio is 1 only if the trainer recomputes exactly what rollout reported.
    requests = [GenRequest(_prompt(n, n), N, seed=n) for n in (3, 17, 30)]
    results = gen.generate(params, requests)
    seqs = [q.prompt + r.tokens for q, r in zip(requests, results, strict=True)]
    recomputed = np.asarray(_token_logprobs(params, CFG, VOCAB, _right_padded(seqs), TEMPERATURE))
    for i, (q, r) in enumerate(zip(requests, results, strict=True)):
        assert len(r.tokens) == len(r.logprobs) >= 1
        np.testing.assert_allclose(
            r.logprobs, recomputed[i, len(q.prompt) : len(seqs[i])], atol=1e-4
        )


def test_result_independent_of_batch_mates(params: Params, gen: Generator) -> None:
    target = GenRequest(_prompt(9, 1), N, seed=77)
    alone = gen.generate(params, [target])[0]
    shorter = GenRequest(_prompt(2, 2), 4, seed=5)
    longer = GenRequest(_prompt(45, 3), N, seed=6)  # prompt bucket 64: 55 pads before target
    _same(alone, gen.generate(params, [shorter, target, longer])[1])
    _same(alone, gen.generate(params, [longer, shorter, longer, target])[3])


def test_stop_token_ends_result(params: Params, gen: Generator) -> None:
    requests = [GenRequest(_prompt(4, s), N, seed=s) for s in range(4)]
    results = gen.generate(params, requests)
    assert any(r.stopped for r in results)
    for r in results:
        if r.stopped:
            assert r.tokens[-1] in STOP_IDS and not set(STOP_IDS) & set(r.tokens[:-1])
        else:
            assert len(r.tokens) == N and not set(STOP_IDS) & set(r.tokens)


def test_top_k_one_is_greedy_and_max_new_tokens(params: Params) -> None:
    greedy = Generator(CFG, VOCAB, [], PAD, N, SamplingParams(1.0, 1.0, 1), min_batch=2)
    requests = [GenRequest(_prompt(6, 4), 3, seed=0), GenRequest(_prompt(11, 5), N, seed=1)]
    results = greedy.generate(params, requests)
    assert [len(r.tokens) for r in results] == [3, N]
    assert not any(r.stopped for r in results)
    seqs = [q.prompt + r.tokens for q, r in zip(requests, results, strict=True)]
    logits = np.array(_causal(params, CFG, VOCAB, _right_padded(seqs)))
    logits[:, :, PAD] = -np.inf
    for i, (q, r) in enumerate(zip(requests, results, strict=True)):
        expected = logits[i, len(q.prompt) - 1 : len(seqs[i]) - 1].argmax(axis=-1)
        assert r.tokens == expected.tolist()
    # Another seed cannot change a greedy sample; one request pads up to min_batch 2, so
    # it runs the program already compiled.
    reseeded = GenRequest(requests[1].prompt, N, seed=99)
    assert greedy.generate(params, [reseeded])[0].tokens == results[1].tokens
    assert greedy.compile_count == 1


def test_never_samples_pad(params: Params, gen: Generator) -> None:
    # Zero the blocks' output projections so the final hidden state is the normalized input
    # embedding; with every embedding row e = ones and the pad row 2e, the pad logit beats
    # every other by d_model = 32: unmasked, pad would be sampled every time.
    rigged = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if path[-2].key in ("o", "down") else x, params
    )
    embedding = np.ones((VOCAB, CFG.d_model), np.float32)
    embedding[PAD] = 2.0
    rigged["embed"]["embedding"] = jnp.asarray(embedding)
    requests = [GenRequest(_prompt(5, s), N, seed=s) for s in range(4)]
    for r in gen.generate(rigged, requests):
        assert PAD not in r.tokens
        # Reported log-probs are untruncated: the pad keeps nearly all the mass.
        np.testing.assert_allclose(r.logprobs, -32.0 / TEMPERATURE, atol=1e-3)


def test_no_recompile_in_same_bucket(params: Params, gen: Generator) -> None:
    gen.generate(params, [GenRequest(_prompt(10, s), N, seed=s) for s in range(4)])
    before = gen.compile_count
    # 3 rows (bucket 4) and prompts of 20-22 tokens (bucket 32): the same program.
    gen.generate(params, [GenRequest(_prompt(20 + s, s), N, seed=s) for s in range(3)])
    assert gen.compile_count == before


def test_rejects_oversized_requests(gen: Generator) -> None:
    with pytest.raises(ValueError, match=r"prompt of 60 tokens plus max_new_tokens 5 = 65"):
        gen.check(GenRequest([1] * 60, 5, 0))
    with pytest.raises(ValueError, match="max_seq_len 64"):
        gen.generate({}, [GenRequest([1] * 60, 5, 0)])
    with pytest.raises(ValueError, match=r"max_new_tokens 13 must be in \[1, 12\]"):
        gen.check(GenRequest([1], 13, 0))
    with pytest.raises(ValueError, match="max_new_tokens 0"):
        gen.check(GenRequest([1], 0, 0))
    with pytest.raises(ValueError, match="empty"):
        gen.check(GenRequest([], 1, 0))


def test_truncation_top_k_then_top_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05. top_p 0.7: the mass before token 1 is 0.5 < 0.7 (kept),
    # before token 2 it is 0.8 (dropped). top_k 3 drops token 3 only.
    scaled = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]], jnp.float32))
    kept = np.isfinite(np.asarray(_truncate(scaled, SamplingParams(1.0, 0.7, 0))))
    np.testing.assert_array_equal(kept, [[False, True, False, True]])
    kept = np.isfinite(np.asarray(_truncate(scaled, SamplingParams(1.0, 1.0, 3))))
    np.testing.assert_array_equal(kept, [[True, True, False, True]])
    kept = np.isfinite(np.asarray(_truncate(scaled, SamplingParams(1.0, 0.4, 0))))
    np.testing.assert_array_equal(kept, [[False, True, False, False]])
