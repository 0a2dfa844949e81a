"""Train step: GRPO moves log-probs the right way, buckets do not recompile, padding."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax
import pytest

from streamrl.config import TrainerConfig
from streamrl.model.llm import Params, init_params
from streamrl.model.spec import ModelSpec
from streamrl.trainer.step import (
    Batch,
    TrainStep,
    build_batch,
    init_state,
    learning_rate_schedule,
    lora_config,
    make_optimizer,
    round_batch,
    round_length,
    standard_promotion,
    token_logprobs,
    token_logprobs_and_entropy,
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


def test_token_entropy_is_that_of_the_distribution_sampled_from(params: Params) -> None:
    """entropy[:, t] = -sum p log p of softmax(logits[:, t-1] / T), in nats: between 0 and
    log(vocab) (ln 50 = 3.912), and the same log-probs as `token_logprobs`."""
    tokens = np.random.default_rng(4).integers(1, SPEC.vocab_size, (2, 32)).astype(np.int32)
    temperature = 0.7
    fn = jax.jit(token_logprobs_and_entropy, static_argnums=(1, 3))
    logp, entropy = (np.asarray(x) for x in fn(params, SPEC, tokens, temperature))
    from streamrl.model.llm import causal_logits

    logits = np.asarray(causal_logits(params, SPEC, tokens), np.float64)[:, :-1] / temperature
    logits -= logits.max(axis=-1, keepdims=True)
    full = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    expected = -(np.exp(full) * full).sum(axis=-1)
    assert entropy.shape == (2, 32) and entropy.dtype == np.float32
    np.testing.assert_array_equal(entropy[:, 0], 0.0)
    np.testing.assert_allclose(entropy[:, 1:], expected, rtol=1e-5)
    assert entropy[:, 1:].min() > 0 and entropy.max() <= math.log(SPEC.vocab_size)
    np.testing.assert_array_equal(
        logp, np.asarray(_token_logprobs(params, SPEC, tokens, temperature))
    )


def test_grpo_step_moves_logprobs_and_does_not_recompile(params: Params) -> None:
    trainer_cfg = TrainerConfig(learning_rate=1e-2)
    optimizer = make_optimizer(trainer_cfg)
    step = TrainStep(SPEC, trainer_cfg, TEMPERATURE, optimizer)
    batch = build_batch(_items(params, [20, 24, 30], seed=0), [1.0, -1.0, 0.0], PAD)
    state = init_state(params, optimizer)

    new_state, metrics = step(state, batch)
    assert int(new_state.step) == 1
    assert {"loss", "grad_norm", "clip_fraction", "ratio_mean", "num_tokens", "kl"} <= set(metrics)
    # the mean entropy of the trained tokens' distributions: within [0, ln 50]
    assert 0.0 < float(metrics["entropy"]) <= math.log(SPEC.vocab_size)
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2)
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


def _run(
    params: Params, cfg: TrainerConfig, batch: Batch, ref: bool = False, sgd: bool = False
) -> tuple[Any, Any]:
    # SGD moves params by lr x gradient, so params compare gradients; Adam's first step is
    # lr x sign(g), which turns float noise on near-zero gradient entries into full steps.
    optimizer = standard_promotion(optax.sgd(1.0)) if sgd else make_optimizer(cfg)
    step = TrainStep(SPEC, cfg, TEMPERATURE, optimizer, max_tokens=40)
    return step(init_state(params, optimizer, with_reference=ref), batch)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(params: Params, loss: str) -> None:
    items = _items(params, [20, 24, 30, 9, 17, 28], seed=4)
    # Off-policy rollout log-probs, so ratios differ from 1 and clipping is exercised.
    items = [(t, m, lp - 0.3 * (i % 3)) for i, (t, m, lp) in enumerate(items)]
    batch = build_batch(items, [1.0, -1.0, 0.5, 2.0, -0.5, 0.0], PAD)
    whole_cfg = TrainerConfig(learning_rate=1e-2, loss=loss)
    micro_cfg = whole_cfg.model_copy(update={"micro_batch_size": 2})
    whole, mw = _run(params, whole_cfg, batch, sgd=True)
    micro, mm = _run(params, micro_cfg, batch, sgd=True)
    np.testing.assert_allclose(float(mm["loss"]), float(mw["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(mm["grad_norm"]), float(mw["grad_norm"]), rtol=1e-4)
    for a, b in zip(jax.tree.leaves(micro.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_learning_rate_warmup_then_cosine() -> None:
    cfg = TrainerConfig(
        learning_rate=1e-3, warmup_steps=10, lr_schedule="cosine", decay_steps=100,
        min_lr_ratio=0.1,
    )  # fmt: skip
    lr = learning_rate_schedule(cfg)
    # 0 at the start, peak after warmup, the cosine's midpoint (1 + 0.1) / 2, then the floor.
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(60)) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5)
    assert float(lr(110)) == pytest.approx(1e-4) and float(lr(500)) == pytest.approx(1e-4)
    flat = learning_rate_schedule(TrainerConfig(learning_rate=3e-4))
    assert float(flat(0)) == float(flat(10_000)) == pytest.approx(3e-4)


def test_kl_to_the_reference_and_recomputed_logps(params: Params) -> None:
    items = _items(params, [20, 24], seed=5)
    batch = build_batch(items, [1.0, -1.0], PAD)
    cfg = TrainerConfig(learning_rate=1e-2, kl_beta=0.5)
    state, m = _run(params, cfg, batch, ref=True)
    assert float(m["kl"]) == pytest.approx(0.0, abs=1e-6)  # the reference is the policy
    optimizer = make_optimizer(cfg)
    step = TrainStep(SPEC, cfg, TEMPERATURE, optimizer)
    state = state.replace(ref_params=params)
    _, m2 = step(state, batch)
    assert float(m2["kl"]) > 0.0  # one update later, the policy has moved off it
    # Ratios against the trainer's own log-probs start at exactly 1, whatever the rollout said.
    stale = [(t, msk, lp - 5.0) for t, msk, lp in items]
    cfg = TrainerConfig(learning_rate=1e-2, use_rollout_logps=False)
    _, m3 = _run(params, cfg, build_batch(stale, [1.0, -1.0], PAD))
    assert float(m3["ratio_mean"]) == pytest.approx(1.0) and float(m3["clip_fraction"]) == 0.0
    _, m4 = _run(params, TrainerConfig(learning_rate=1e-2), build_batch(stale, [1.0, -1.0], PAD))
    assert float(m4["ratio_mean"]) > 100  # exp(5) against the stale rollout log-probs


def test_behaviour_mismatch_metrics_and_truncated_weights(params: Params) -> None:
    items = _items(params, [20, 24], seed=7)
    _, m = _run(params, TrainerConfig(learning_rate=1e-2), build_batch(items, [1.0, -1.0], PAD))
    assert float(m["mismatch_logp_abs"]) == pytest.approx(0.0, abs=1e-5)  # on policy
    assert float(m["correction_fraction"]) == 0.0
    # Rollout log-probs 5 below the trainer's on every sampled token: |d| = 5,
    # k3 = e^5 - 5 - 1 = 142.413 per token, and 2 * 142.413 summed over a row's 10 or 12.
    stale = build_batch([(t, msk, lp - 5.0) for t, msk, lp in items], [1.0, -1.0], PAD)
    cfg = TrainerConfig(learning_rate=1e-2, use_rollout_logps=False, importance_correction="tis")
    _, m = _run(params, cfg, stale)
    assert float(m["mismatch_logp_abs"]) == pytest.approx(5.0, rel=1e-5)
    k3 = math.exp(5) - 6
    assert float(m["mismatch_kl"]) == pytest.approx(k3, rel=1e-4)
    assert float(m["mismatch_kl_seq"]) == pytest.approx(k3 * (10 + 12) / 2, rel=1e-4)
    assert float(m["correction_fraction"]) == 1.0  # every weight e^5 capped at 2
    # A small mismatch inside IcePop's band [1/2, 2] changes nothing.
    near = build_batch([(t, msk, lp - 0.1) for t, msk, lp in items], [1.0, -1.0], PAD)
    cfg = cfg.model_copy(update={"importance_correction": "icepop"})
    _, m = _run(params, cfg, near)
    assert float(m["correction_fraction"]) == 0.0


def test_batch_rows_round_to_the_micro_batch_size(params: Params) -> None:
    batch = build_batch(_items(params, [20, 24, 30], seed=6), [1.0, -1.0, 0.0], PAD, 6)
    assert batch.tokens.shape[0] == 6 and batch.mask[3:].sum() == 0


def test_lora_trains_adapters_on_a_frozen_base(params: Params) -> None:
    cfg = TrainerConfig(learning_rate=1e-2, lora_rank=4, lora_targets=["q_proj", "up_proj"])
    optimizer = make_optimizer(cfg)
    step = TrainStep(SPEC, cfg, TEMPERATURE, optimizer)
    lora = lora_config(cfg)
    state = init_state(params, optimizer, lora=lora, seed=3)
    assert state.base_params is params and state.ref_params is None
    # A fresh adapter (B = 0) leaves the policy unchanged.
    for a, b in zip(
        jax.tree.leaves(state.policy_params(lora)), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = build_batch(_items(params, [20, 24], seed=7), [1.0, -1.0], PAD)
    new, _ = step(state, batch)
    # Only adapters moved: the optimizer never saw the base.
    layer = new.params["model"]["layers_0"]
    assert set(layer) == {"self_attn", "mlp"} and set(layer["mlp"]["up_proj"]) == {
        "lora_a",
        "lora_b",
    }
    assert float(np.abs(np.asarray(layer["mlp"]["up_proj"]["lora_b"])).sum()) > 0
    for a, b in zip(jax.tree.leaves(new.base_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    merged = new.policy_params(lora)
    assert _masked_mean_logp(merged, batch, 0) > _masked_mean_logp(params, batch, 0)
    assert _masked_mean_logp(merged, batch, 1) < _masked_mean_logp(params, batch, 1)
    # KL with LoRA uses the base as the reference (no copy kept).
    kl_cfg = cfg.model_copy(update={"kl_beta": 0.1})
    kl_step = TrainStep(SPEC, kl_cfg, TEMPERATURE, make_optimizer(kl_cfg))
    _, m = kl_step(init_state(params, make_optimizer(kl_cfg), lora=lora), batch)
    assert float(m["kl"]) == pytest.approx(0.0, abs=1e-6)


def _nan_updates() -> optax.GradientTransformation:
    """An optimizer whose every update is NaN (what an overflow in its state gives)."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return jax.tree.map(lambda u: u * np.float32(np.nan), updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _same(a: Any, b: Any) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_a_non_finite_step_keeps_the_old_state(params: Params) -> None:
    cfg = TrainerConfig(learning_rate=1e-2)
    batch = build_batch(_items(params, [20, 24], seed=7), [1.0, -1.0], PAD)
    # A finite loss whose update is not finite (review M1): the weights must not take it.
    optimizer = _nan_updates()
    step = TrainStep(SPEC, cfg, TEMPERATURE, optimizer)
    state = init_state(params, optimizer)
    new_state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(new_state.step) == 0 and _same(new_state.params, params)
    # A NaN in the rollout log-probs: the loss and gradient are NaN; the state is kept too.
    optimizer = make_optimizer(cfg)
    step = TrainStep(SPEC, cfg, TEMPERATURE, optimizer)
    state = init_state(params, optimizer)
    bad = batch.old_logp.copy()
    bad[0, 15] = np.nan
    new_state, metrics = step(state, Batch(batch.tokens, batch.mask, bad, batch.advantages))
    assert not np.isfinite(float(metrics["loss"]))
    assert int(new_state.step) == 0 and _same(new_state.params, params)
    assert _same(new_state.opt_state, state.opt_state)
    # The same step on the good batch moves on.
    new_state, metrics = step(state, batch)
    assert int(new_state.step) == 1 and not _same(new_state.params, params)
