"""Policy losses against golden values worked out by hand.

Most cases share one batch, B = 2 sequences of T = 3 tokens, old_logp = 0 so that
ratio = exp(logp) is whatever we put in, epsilon = 0.2 (clip range [0.8, 1.2]):

    row 0, A = +1, ratios [1.5, 0.5, 1.0], mask [1, 1, 1]
        1.5: min(1.5 * 1, 1.2 * 1) = 1.2    clipped high (ratio > 1.2 with A > 0)
        0.5: min(0.5 * 1, 0.8 * 1) = 0.5    not clipped (A > 0 only clips above)
        1.0: min(1.0, 1.0)         = 1.0
        objective sum 2.7 over 3 tokens
    row 1, A = -1, ratios [1.5, 0.5, pad], mask [1, 1, 0]
        1.5: min(-1.5, -1.2) = -1.5         not clipped (A < 0 only clips below)
        0.5: min(-0.5, -0.8) = -0.8         clipped low (ratio < 0.8 with A < 0)
        pad: log-ratio 100, exp(100) = inf in float32: must be ignored, not NaN
        objective sum -2.3 over 2 tokens

Masked tokens N = 5; all objectives sum to 2.7 + -2.3 = 0.4.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.rl.losses import (
    LOSSES,
    LossConfig,
    check_rollout_logps,
    dapo_loss,
    dr_grpo_loss,
    grpo_loss,
    missing_logp_rows,
    policy_loss,
    register,
)

LN2 = math.log(2.0)
METRICS = {"clip_fraction", "clip_low_fraction", "clip_high_fraction", "ratio_mean", "kl"}


def _f32(x: object) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def _batch() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logp, old_logp, advantages, mask) of the module docstring's batch."""
    logp = _f32([[math.log(1.5), math.log(0.5), 0.0], [math.log(1.5), math.log(0.5), 100.0]])
    return logp, _f32(np.zeros((2, 3))), _f32([1.0, -1.0]), _f32([[1, 1, 1], [1, 1, 0]])


def _close(x: jax.Array, expected: float) -> None:
    np.testing.assert_allclose(float(x), expected, atol=1e-6)


# --- registry and config ------------------------------------------------------------------


def test_registered_by_name() -> None:
    assert sorted(LOSSES) == ["dapo", "dr_grpo", "grpo"]
    assert (LOSSES["grpo"], LOSSES["dapo"], LOSSES["dr_grpo"]) == (
        grpo_loss,
        dapo_loss,
        dr_grpo_loss,
    )
    with pytest.raises(ValueError, match="already registered"):
        register("grpo")(grpo_loss)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon_high": 0.0}, "epsilon_high"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"aggregation": "constant"}, "max_tokens"),  # max_tokens 0 by default
        ({"max_tokens": -1}, "max_tokens"),
        ({"kl_beta": -0.1}, "kl_beta"),
        ({"kl_estimator": "k2"}, "kl_estimator"),
    ],
)
def test_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)  # type: ignore[arg-type]


def test_config_derived() -> None:
    assert LossConfig().upper_epsilon == 0.2  # None: symmetric
    assert LossConfig(epsilon_high=0.28).upper_epsilon == 0.28
    assert not LossConfig().needs_reference
    assert LossConfig(kl_beta=0.1).needs_reference


# --- aggregations, one per registered name --------------------------------------------------


def test_dapo_token_aggregation_golden() -> None:
    # sum over all masked tokens / N: -(0.4) / 5 = -0.08
    # clip_low 1/5 (row 1, ratio 0.5), clip_high 1/5 (row 0, ratio 1.5), total 2/5
    # ratio_mean (1.5 + 0.5 + 1.0 + 1.5 + 0.5) / 5 = 1.0; kl 0 (beta 0)
    loss, m = dapo_loss(*_batch(), LossConfig())
    _close(loss, -0.08)
    assert set(m) == METRICS
    assert all(v.dtype == jnp.float32 and v.shape == () for v in m.values())
    _close(m["clip_low_fraction"], 0.2)
    _close(m["clip_high_fraction"], 0.2)
    _close(m["clip_fraction"], 0.4)
    _close(m["ratio_mean"], 1.0)
    _close(m["kl"], 0.0)


def test_grpo_sequence_aggregation_golden() -> None:
    # mean over sequences of the per-sequence token mean:
    # row 0: 2.7 / 3 = 0.9; row 1: -2.3 / 2 = -1.15; loss = -(0.9 + -1.15) / 2 = 0.125
    loss, m = grpo_loss(*_batch(), LossConfig())
    _close(loss, 0.125)
    _close(m["clip_fraction"], 0.4)  # metrics are per token whatever the aggregation


def test_dr_grpo_constant_aggregation_golden() -> None:
    # sum / (sequences * max_tokens) = -(0.4) / (2 * 4) = -0.05
    loss, _ = dr_grpo_loss(*_batch(), LossConfig(max_tokens=4))
    _close(loss, -0.05)
    # the normaliser is the constant, not the tokens present: max_tokens 8 halves it
    loss, _ = dr_grpo_loss(*_batch(), LossConfig(max_tokens=8))
    _close(loss, -0.025)


def test_name_fixes_aggregation() -> None:
    # Each registered loss is policy_loss with its aggregation, whatever cfg says.
    cfg = LossConfig(aggregation="token", max_tokens=4)
    direct = {
        "grpo": dataclasses.replace(cfg, aggregation="sequence"),
        "dapo": cfg,
        "dr_grpo": dataclasses.replace(cfg, aggregation="constant"),
    }
    for name, direct_cfg in direct.items():
        named, _ = LOSSES[name](*_batch(), cfg)
        assert float(named) == float(policy_loss(*_batch(), direct_cfg)[0]), name


def test_dr_grpo_needs_max_tokens() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        dr_grpo_loss(*_batch(), LossConfig())


# --- clipping -------------------------------------------------------------------------------


def test_clip_higher_moves_only_the_upper_bound() -> None:
    # epsilon_high 0.4, clip range [0.8, 1.4]: row 0 ratio 1.5 is still clipped, now at
    # 1.4: row 0 sum 1.4 + 0.5 + 1.0 = 2.9; row 1 unchanged (its clip is the lower one),
    # -2.3. loss = -(2.9 + -2.3) / 5 = -0.12 (vs -0.08 symmetric)
    loss, m = dapo_loss(*_batch(), LossConfig(epsilon_high=0.4))
    _close(loss, -0.12)
    _close(m["clip_high_fraction"], 0.2)
    _close(m["clip_low_fraction"], 0.2)
    # epsilon_high 0.6, range [0.8, 1.6]: ratio 1.5 is inside, not clipped: row 0 sum
    # 1.5 + 0.5 + 1.0 = 3.0; loss = -(3.0 + -2.3) / 5 = -0.14; only the low clip remains
    loss, m = dapo_loss(*_batch(), LossConfig(epsilon_high=0.6))
    _close(loss, -0.14)
    _close(m["clip_high_fraction"], 0.0)
    _close(m["clip_low_fraction"], 0.2)
    _close(m["clip_fraction"], 0.2)


def test_clip_single_tokens() -> None:
    # Two one-token sequences at ratio 1.5, eps 0.2, token aggregation:
    # A = +1: min(1.5, 1.2) = 1.2 (clipped high); A = -1: min(-1.5, -1.2) = -1.5 (not)
    # loss = -(1.2 + -1.5) / 2 = 0.15
    logp, old, mask = (
        _f32([[math.log(1.5)], [math.log(1.5)]]),
        _f32([[0.0], [0.0]]),
        _f32([[1], [1]]),
    )
    loss, m = dapo_loss(logp, old, _f32([1.0, -1.0]), mask, LossConfig())
    _close(loss, 0.15)
    _close(m["clip_high_fraction"], 0.5)
    _close(m["clip_low_fraction"], 0.0)
    # ratio 0.5: A = -2: min(-1.0, 0.8 * -2) = -1.6 (clipped low); A = +2: min(1.0, 1.6) =
    # 1.0 (not). loss = -(-1.6 + 1.0) / 2 = 0.3
    logp = _f32([[math.log(0.5)], [math.log(0.5)]])
    loss, m = dapo_loss(logp, old, _f32([-2.0, 2.0]), mask, LossConfig())
    _close(loss, 0.3)
    _close(m["clip_low_fraction"], 0.5)
    _close(m["clip_high_fraction"], 0.0)


def test_grpo_rejects_asymmetric_clip() -> None:
    with pytest.raises(ValueError, match="dapo"):
        grpo_loss(*_batch(), LossConfig(epsilon_high=0.28))
    # the same value twice is symmetric: as with epsilon_high None, 0.125
    loss, _ = grpo_loss(*_batch(), LossConfig(epsilon=0.2, epsilon_high=0.2))
    _close(loss, 0.125)


# --- KL penalty -----------------------------------------------------------------------------


def _kl_batch() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logp, old_logp, advantages, mask, ref_logp): ratio 1, A = 0, so only KL remains.

    d = ref_logp - logp per token:
        row 0: logp [ln 1/4, ln 1/2], ref [ln 1/2, ln 1/2] -> d [ln 2, 0], mask [1, 1]
        row 1: logp [ln 1/8, -80],    ref [ln 1/2, 80]     -> d [ln 4, 160], mask [1, 0]
    The pad's d = 160 would give exp(160) = inf in float32, and inf * 0 = NaN.
    """
    logp = _f32([[math.log(0.25), math.log(0.5)], [math.log(0.125), -80.0]])
    ref = _f32([[math.log(0.5), math.log(0.5)], [math.log(0.5), 80.0]])
    return logp, logp, _f32([0.0, 0.0]), _f32([[1, 1], [1, 0]]), ref


def test_kl_k1_golden() -> None:
    # k1 = logp - ref = -d: [-ln 2, 0, -ln 4], masked mean -3 ln 2 / 3 = -ln 2
    # beta 0.5, token aggregation: loss = 0 (policy term, A = 0) + 0.5 * -ln 2
    logp, old, adv, mask, ref = _kl_batch()
    loss, m = dapo_loss(logp, old, adv, mask, LossConfig(kl_beta=0.5, kl_estimator="k1"), ref)
    _close(m["kl"], -LN2)
    _close(loss, -0.5 * LN2)


def test_kl_k3_golden() -> None:
    # k3 = exp(d) - d - 1: d = ln 2 -> 2 - ln 2 - 1 = 1 - ln 2; d = 0 -> 0;
    # d = ln 4 -> 4 - 2 ln 2 - 1 = 3 - 2 ln 2. Masked mean (4 - 3 ln 2) / 3 = 0.64019...
    logp, old, adv, mask, ref = _kl_batch()
    loss, m = dapo_loss(logp, old, adv, mask, LossConfig(kl_beta=0.5), ref)
    _close(m["kl"], (4 - 3 * LN2) / 3)
    _close(loss, 0.5 * (4 - 3 * LN2) / 3)  # 0.32009...
    # sequence aggregation: row 0 mean (1 - ln 2) / 2, row 1 mean 3 - 2 ln 2;
    # loss = 0.5 * ((1 - ln 2) / 2 + 3 - 2 ln 2) / 2 = (3.5 - 2.5 ln 2) / 4 = 0.44178...
    loss, _ = grpo_loss(logp, old, adv, mask, LossConfig(kl_beta=0.5), ref)
    _close(loss, (3.5 - 2.5 * LN2) / 4)


def test_kl_adds_to_the_policy_term() -> None:
    # The shared batch (dapo loss -0.08) with ref_logp = logp - ln 2 on every token, so
    # d = -ln 2 and k3 = 1/2 + ln 2 - 1 = ln 2 - 0.5 on each of the 5 masked tokens.
    # loss = -0.08 + 0.1 * (ln 2 - 0.5) = -0.060685...
    logp, old, adv, mask = _batch()
    ref = logp - LN2
    loss, m = dapo_loss(logp, old, adv, mask, LossConfig(kl_beta=0.1), ref)
    _close(m["kl"], LN2 - 0.5)
    _close(loss, -0.08 + 0.1 * (LN2 - 0.5))


def test_beta_zero_ignores_ref_logp() -> None:
    logp, old, adv, mask = _batch()
    for ref in (None, _f32(np.full((2, 3), np.nan))):  # not read at all: NaN cannot leak
        loss, m = dapo_loss(logp, old, adv, mask, LossConfig(), ref)
        _close(loss, -0.08)
        assert float(m["kl"]) == 0.0


def test_beta_positive_requires_ref_logp() -> None:
    for name in LOSSES:
        with pytest.raises(ValueError, match="ref_logp"):
            LOSSES[name](*_batch(), LossConfig(kl_beta=0.1, max_tokens=4))


# --- masks ----------------------------------------------------------------------------------


def test_empty_row_counts_in_no_aggregation() -> None:
    # Row 0 of the shared batch alone, then with an appended all-masked-out row (as the
    # trainer's power-of-two batch padding adds): every aggregation gives the same.
    # token: -2.7 / 3 = -0.9; sequence: -(2.7 / 3) / 1 = -0.9; constant: -2.7 / (1 * 4)
    logp, old, adv, mask = _batch()
    padded = (logp, old, adv, mask.at[1].set(0.0))
    alone = (logp[:1], old[:1], adv[:1], mask[:1])
    cfg = LossConfig(max_tokens=4)
    for name, expected in (("dapo", -0.9), ("grpo", -0.9), ("dr_grpo", -2.7 / 4)):
        for batch in (alone, padded):
            loss, m = LOSSES[name](*batch, cfg)
            _close(loss, expected)
            _close(m["clip_high_fraction"], 1 / 3)


def test_all_empty_mask_gives_zero_not_nan() -> None:
    logp, old, adv, _ = _batch()
    empty = _f32(np.zeros((2, 3)))
    ref = logp + 100.0
    cfg = LossConfig(max_tokens=4, kl_beta=0.1)
    for name in LOSSES:
        loss, m = LOSSES[name](logp, old, adv, empty, cfg, ref)
        assert float(loss) == 0.0, name
        assert all(float(v) == 0.0 for v in m.values()), name
        grad = jax.grad(lambda lp, n=name: LOSSES[n](lp, old, adv, empty, cfg, ref)[0])(logp)
        assert np.all(np.asarray(grad) == 0.0), name


# --- gradients ------------------------------------------------------------------------------


def test_gradient_token_aggregation() -> None:
    # d loss / d logp_t = -A * ratio / N for an unclipped token (d ratio / d logp = ratio),
    # 0 for a clipped one (clip() is flat there) and for a masked-out one. N = 5:
    #   row 0: clipped 0; -(1 * 0.5) / 5 = -0.1; -(1 * 1.0) / 5 = -0.2
    #   row 1: -(-1 * 1.5) / 5 = 0.3; clipped 0; pad 0
    logp, old, adv, mask = _batch()

    def loss(lp: jax.Array, cfg: LossConfig) -> jax.Array:
        return dapo_loss(lp, old, adv, mask, cfg)[0]

    grad = jax.jit(jax.grad(loss), static_argnums=1)(logp, LossConfig())
    np.testing.assert_allclose(np.asarray(grad), [[0, -0.1, -0.2], [0.3, 0, 0]], atol=1e-6)


def test_gradient_sequence_and_constant_aggregation() -> None:
    # sequence: token weight 1 / (rows * tokens of its row): row 0 1/6, row 1 1/4
    #   row 0: -0.5 / 6 = -1/12, -1.0 / 6 = -1/6; row 1: 1.5 / 4 = 0.375
    # constant (max_tokens 4): weight 1 / (2 * 4) = 1/8
    #   row 0: -0.5 / 8 = -0.0625, -1 / 8 = -0.125; row 1: 1.5 / 8 = 0.1875
    logp, old, adv, mask = _batch()
    cfg = LossConfig(max_tokens=4)
    grad = jax.grad(lambda lp: grpo_loss(lp, old, adv, mask, cfg)[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), [[0, -1 / 12, -1 / 6], [0.375, 0, 0]], atol=1e-6)
    grad = jax.grad(lambda lp: dr_grpo_loss(lp, old, adv, mask, cfg)[0])(logp)
    np.testing.assert_allclose(np.asarray(grad), [[0, -0.0625, -0.125], [0.1875, 0, 0]], atol=1e-6)


def test_gradient_kl() -> None:
    # A = 0, so only the KL term has a gradient; beta 0.5, token aggregation, N = 3.
    # k3 = exp(d) - d - 1, d = ref - logp: d k3 / d logp = -exp(d) + 1
    #   d = ln 2: 0.5 * (1 - 2) / 3 = -1/6; d = 0: 0; d = ln 4: 0.5 * (1 - 4) / 3 = -0.5
    # k1 = logp - ref: d k1 / d logp = 1 -> 0.5 / 3 = 1/6 on each masked token
    logp, old, adv, mask, ref = _kl_batch()
    for estimator, expected in (
        ("k3", [[-1 / 6, 0.0], [-0.5, 0.0]]),
        ("k1", [[1 / 6, 1 / 6], [1 / 6, 0.0]]),
    ):
        cfg = LossConfig(kl_beta=0.5, kl_estimator=estimator)  # type: ignore[arg-type]
        grad = jax.grad(lambda lp, c=cfg: dapo_loss(lp, old, adv, mask, c, ref)[0])(logp)
        np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)


def test_old_and_ref_logp_are_constants() -> None:
    # On-policy steps pass old_logp = logp: the ratio is 1 but its gradient must still
    # be A / N (exp(logp - stop_gradient(logp))), not 0.
    logp, _, adv, mask = _batch()
    cfg = LossConfig(kl_beta=0.1)

    def loss(lp: jax.Array) -> jax.Array:
        return dapo_loss(lp, lp, adv, mask, cfg, lp)[0]

    # ratio 1 everywhere, d = 0 so the k3 gradient 1 - exp(0) = 0: -A / 5 per masked token
    grad = jax.grad(loss)(logp)
    np.testing.assert_allclose(np.asarray(grad), [[-0.2, -0.2, -0.2], [0.2, 0.2, 0.0]], atol=1e-6)


def test_shape_mismatch_is_an_error() -> None:
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="advantages"):
        dapo_loss(logp, old, adv[:, None], mask, LossConfig())
    with pytest.raises(ValueError, match="mask"):
        dapo_loss(logp, old, adv, mask[:, :2], LossConfig())
    with pytest.raises(ValueError, match="ref_logp"):
        dapo_loss(logp, old, adv, mask, LossConfig(kl_beta=0.1), logp[:1])


# --- rollout log-probs ----------------------------------------------------------------------


def test_rollout_logps_accepted() -> None:
    # one exact 0.0 among negative masked log-probs is a near-certain token, allowed;
    # values off the mask (NaN, 0, positive) are never read; an all-unmasked row (batch
    # padding) is fine
    old = np.array(
        [[0.0, -0.5, 0.0, -1.2], [np.nan, -0.1, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32
    )
    mask = np.array([[0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    check_rollout_logps(old, mask)
    check_rollout_logps(old[0], mask[0])  # one sequence, 1-D


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.nan, r"NaN or infinite log-probs in rows \[1\]"),
        (-np.inf, r"NaN or infinite log-probs in rows \[1\]"),
        (np.inf, r"NaN or infinite log-probs in rows \[1\]"),
        (0.25, r"positive log-probs in rows \[1\]"),
    ],
)
def test_rollout_logps_invalid_value(bad: float, message: str) -> None:
    old = np.array([[0.0, -0.5, -0.7], [0.0, -0.3, bad]], np.float32)
    mask = np.array([[0, 1, 1], [0, 1, 1]], np.float32)
    with pytest.raises(ValueError, match=message):
        check_rollout_logps(old, mask)


def test_rollout_logps_missing() -> None:
    # row 1's masked tokens are all exactly 0.0: what transcripts hold when the engine
    # reported no log-probs; it passes the check and is found as missing (to be masked
    # out). Row 0 has one exact 0.0 among others (a near-certain token); row 2 has no
    # sampled token at all.
    old = np.array([[0.0, -0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[0, 1, 1], [0, 1, 1], [0, 0, 0]], np.float32)
    check_rollout_logps(old, mask)
    assert missing_logp_rows(old, mask).tolist() == [False, True, False]
    assert missing_logp_rows(old[1], mask[1]).tolist() == [True]  # one sequence, 1-D
    with pytest.raises(ValueError, match="shape"):
        check_rollout_logps(old, mask[:, :2])


# --- staleness: importance correction and behaviour-policy mismatch ------------------------
#
# B = 2, T = 2, the trainer's own log-probs as the proximal policy (old_logp = logp, so the
# clipped ratio is 1 everywhere and the policy term of a token is -A), every trainer
# log-prob ln 0.5, behaviour log-probs chosen for the weights w = exp(logp - behav_logp):
#
#     row 0, A = +1, mask [1, 1]: w = [3, 1]      (behav ln(1/6), ln(1/2))
#     row 1, A = -2, mask [1, 0]: w = [0.25, pad] (behav ln 2; the pad's -100 is ignored)
#
# "none":          per-token -1, -1, +2            sum  0    / 3 tokens =  0
# "tis",    C = 2: weights 2, 1, 0.25: -2, -1, +0.5 sum -2.5  / 3        = -0.833333
#                  one token of three capped (w = 3 > 2)
# "icepop", C = 2: band [0.5, 2]: 3 and 0.25 out: 0, -1, 0  sum -1 / 3    = -0.333333
#                  two tokens of three masked out
# Mismatch, d = ln w = [ln 3, 0, ln 0.25]:
#     mismatch_logp_abs = (ln 3 + 0 + ln 4) / 3 = (1.098612 + 1.386294) / 3 = 0.828302
#     k3 = w - ln w - 1: 3 - 1.098612 - 1 = 0.901388; 0; 0.25 + 1.386294 - 1 = 0.636294
#     mismatch_kl     = (0.901388 + 0 + 0.636294) / 3 = 0.512561
#     mismatch_kl_seq = (0.901388 + 0.636294) / 2 rows = 0.768841


def _stale_batch() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logp, behav_logp, advantages, mask) of the block above."""
    h = math.log(0.5)
    logp = _f32([[h, h], [h, h]])
    behav = _f32([[math.log(1 / 6), h], [math.log(2.0), -100.0]])
    return logp, behav, _f32([1.0, -2.0]), _f32([[1, 1], [1, 0]])


@pytest.mark.parametrize(
    ("correction", "loss", "fraction"),
    [("none", 0.0, 0.0), ("tis", -2.5 / 3, 1 / 3), ("icepop", -1 / 3, 2 / 3)],
)
def test_importance_correction_golden(correction: str, loss: float, fraction: float) -> None:
    logp, behav, adv, mask = _stale_batch()
    cfg = LossConfig(correction=correction, correction_cap=2.0)  # type: ignore[arg-type]
    out, m = dapo_loss(logp, logp, adv, mask, cfg, behav_logp=behav)
    _close(out, loss)
    _close(m["correction_fraction"], fraction)
    _close(m["mismatch_logp_abs"], (math.log(3) + math.log(4)) / 3)
    k3 = (3 - math.log(3) - 1, 0.25 + math.log(4) - 1)
    _close(m["mismatch_kl"], sum(k3) / 3)
    _close(m["mismatch_kl_seq"], sum(k3) / 2)
    np.testing.assert_allclose(float(m["mismatch_kl"]), 0.512561, atol=1e-6)
    np.testing.assert_allclose(float(m["mismatch_kl_seq"]), 0.768841, atol=1e-6)


def test_truncated_weight_is_a_constant_factor_of_the_gradient() -> None:
    # d loss / d logp_t = -A * w'_t / N (ratio 1 inside the clip; w' has no gradient):
    # row 0: -1 * 2 / 3, -1 * 1 / 3; row 1: +2 * 0.25 / 3 = 0.166667, pad 0.
    logp, behav, adv, mask = _stale_batch()
    cfg = LossConfig(correction="tis", correction_cap=2.0)

    def f(lp: jax.Array, bl: jax.Array) -> jax.Array:
        # The proximal log-probs are the trainer's own, taken as a constant (as the step does).
        return dapo_loss(lp, jax.lax.stop_gradient(lp), adv, mask, cfg, behav_logp=bl)[0]

    g_logp, g_behav = jax.grad(f, argnums=(0, 1))(logp, behav)
    np.testing.assert_allclose(g_logp, [[-2 / 3, -1 / 3], [0.5 / 3, 0.0]], atol=1e-6)
    np.testing.assert_allclose(g_behav, np.zeros((2, 2)), atol=0)


def test_far_off_policy_tokens_stay_finite() -> None:
    # A behaviour log-prob of -1000 on a sampled token: w = e^999 overflows float32; the
    # clamp keeps the weight at the cap and the metrics finite (d clamped to 20).
    logp, _, adv, mask = _stale_batch()
    behav = _f32([[-1000.0, math.log(0.5)], [math.log(0.5), 0.0]])
    for correction in ("tis", "icepop", "none"):
        cfg = LossConfig(correction=correction, correction_cap=2.0)
        out, m = grpo_loss(logp, logp, adv, mask, cfg, behav_logp=behav)
        assert np.isfinite(float(out)) and all(np.isfinite(float(v)) for v in m.values())
    _close(m["mismatch_logp_abs"], 20.0 / 3)


def test_mismatch_is_zero_on_policy_and_absent_without_behaviour() -> None:
    logp, _, adv, mask = _stale_batch()
    _, m = dapo_loss(logp, logp, adv, mask, LossConfig(), behav_logp=logp)
    for k in ("mismatch_logp_abs", "mismatch_kl", "mismatch_kl_seq", "correction_fraction"):
        _close(m[k], 0.0)
    _, m = dapo_loss(logp, logp, adv, mask, LossConfig())
    assert set(m) == METRICS


def test_correction_needs_behaviour_logps_and_a_cap_above_one() -> None:
    logp, _, adv, mask = _stale_batch()
    with pytest.raises(ValueError, match="needs behav_logp"):
        dapo_loss(logp, logp, adv, mask, LossConfig(correction="tis"))
    with pytest.raises(ValueError, match="correction_cap"):
        LossConfig(correction="tis", correction_cap=1.0)
    with pytest.raises(ValueError, match="correction must be"):
        LossConfig(correction="is")  # type: ignore[arg-type]
