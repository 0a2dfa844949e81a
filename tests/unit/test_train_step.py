"""Train step: GRPO moves log-probs the right way, buckets do not recompile, padding."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from streamrl.config import TrainerConfig
from streamrl.model.llm import Params, init_params
from streamrl.model.spec import ModelSpec
from streamrl.trainer.step import (
    Batch,
    build_batch,
    init_state,
    make_optimizer,
    make_train_step,
    round_batch,
    round_length,
    token_logprobs,
)

SPEC = ModelSpec.from_config(
    {
        "model_type": "qwen2",
        "vocab_size": 50,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    }
)
PAD = 0
TEMPERATURE = 1.0

_token_logprobs = jax.jit(token_logprobs, static_argnums=(1, 3))


@pytest.fixture(scope="module")
def params() -> Params:
    return init_params(SPEC, seed=0, std=0.1)


def _items(
    params: Params, lengths: list[int], seed: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Random sequences whose second half is 'sampled', with on-policy rollout log-probs."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, SPEC.vocab_size, n).astype(np.int32) for n in lengths]
    masks = [(np.arange(n) >= n // 2).astype(np.uint8) for n in lengths]
    probe = build_batch(
        [(s, m, np.zeros(len(s))) for s, m in zip(seqs, masks, strict=True)], [0.0] * len(seqs), PAD
    )
    logp = np.asarray(_token_logprobs(params, SPEC, probe.tokens, TEMPERATURE))
    return [(s, m, logp[i, : len(s)]) for i, (s, m) in enumerate(zip(seqs, masks, strict=True))]


def _masked_mean_logp(params: Params, batch: Batch, row: int) -> float:
    logp = np.asarray(_token_logprobs(params, SPEC, batch.tokens, TEMPERATURE))
    mask = np.asarray(batch.mask)
    return float((logp[row] * mask[row]).sum() / mask[row].sum())


def test_buckets() -> None:
    assert [round_batch(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [round_length(n) for n in (0, 1, 32, 33, 64)] == [32, 32, 32, 64, 64]


def test_build_batch_pads_to_buckets() -> None:
    items = [
        (np.arange(1, 6), np.array([0, 0, 1, 1, 1]), np.array([0, 0, -1.0, -2.0, -3.0])),
        (np.arange(1, 34), np.ones(33), np.full(33, -0.5)),
        (np.arange(1, 11), np.zeros(10), np.full(10, -9.0)),  # log-probs under mask 0 drop
    ]
    batch = build_batch(items, [1.0, -1.0, 0.5], pad_id=PAD)
    assert batch.tokens.shape == batch.mask.shape == batch.old_logp.shape == (4, 64)
    assert batch.advantages.shape == (4,)
    assert batch.tokens.dtype == np.int32 and batch.mask.dtype == np.float32
    assert batch.old_logp.dtype == np.float32 and batch.advantages.dtype == np.float32
    np.testing.assert_array_equal(batch.tokens[0, :7], [1, 2, 3, 4, 5, PAD, PAD])
    np.testing.assert_array_equal(batch.old_logp[0, :5], [0, 0, -1, -2, -3])
    assert batch.old_logp[2].sum() == 0.0
    assert batch.mask.sum() == 3 + 33
    assert batch.mask[3].sum() == 0 and batch.advantages[3] == 0  # the padding row
    np.testing.assert_array_equal(batch.tokens[3], np.full(64, PAD))
    with pytest.raises(ValueError, match=r"differ in length \(3, 2, 3\)"):
        build_batch([(np.ones(3), np.ones(2), np.ones(3))], [0.0], PAD)
    with pytest.raises(ValueError, match="1 sequences but 2 advantages"):
        build_batch(items[:1], [0.0, 1.0], PAD)
    with pytest.raises(ValueError, match="empty batch"):
        build_batch([], [], PAD)


def test_token_logprobs_are_the_shifted_log_softmax(params: Params) -> None:
    tokens = np.random.default_rng(3).integers(1, SPEC.vocab_size, (2, 32)).astype(np.int32)
    temperature = 0.7
    logp = np.asarray(_token_logprobs(params, SPEC, tokens, temperature))
    from streamrl.model.llm import causal_logits

    logits = np.asarray(causal_logits(params, SPEC, tokens), np.float64) / temperature
    logits -= logits.max(axis=-1, keepdims=True)
    full = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    expected = np.take_along_axis(full[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    assert logp.shape == (2, 32) and logp.dtype == np.float32
    np.testing.assert_array_equal(logp[:, 0], 0.0)
    np.testing.assert_allclose(logp[:, 1:], expected, atol=1e-5)


def test_grpo_step_moves_logprobs_and_does_not_recompile(params: Params) -> None:
    trainer_cfg = TrainerConfig(learning_rate=1e-2)
    optimizer = make_optimizer(trainer_cfg)
    step = make_train_step(SPEC, trainer_cfg, TEMPERATURE, optimizer)
    batch = build_batch(_items(params, [20, 24, 30], seed=0), [1.0, -1.0, 0.0], PAD)
    state = init_state(params, optimizer)

    new_state, metrics = step(state, batch)
    assert int(new_state.step) == 1
    assert set(metrics) == {"loss", "grad_norm", "clip_fraction", "ratio_mean", "num_tokens"}
    assert float(metrics["num_tokens"]) == 10 + 12 + 15
    # On-policy: every ratio is 1 and nothing is clipped.
    np.testing.assert_allclose(float(metrics["ratio_mean"]), 1.0, atol=1e-4)
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["grad_norm"]) > 0.0
    # A = +1 raises the row's sampled tokens' log-probs, A = -1 lowers them.
    assert _masked_mean_logp(new_state.params, batch, 0) > _masked_mean_logp(params, batch, 0)
    assert _masked_mean_logp(new_state.params, batch, 1) < _masked_mean_logp(params, batch, 1)

    # Another batch in the same bucket (B 4, L 32): no new compile.
    other = build_batch(_items(params, [7, 31, 12, 9], seed=1), [0.5, -0.5, 1.0, -1.0], PAD)
    assert other.tokens.shape == batch.tokens.shape
    new_state, _ = step(new_state, other)
    assert int(new_state.step) == 2
    assert step.compile_count == 1
