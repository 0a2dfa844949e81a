"""GRPO loss against golden values worked out by hand."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.rl.losses import LOSSES, grpo_loss, register


def _f32(x: object) -> jnp.ndarray:
    return jnp.asarray(x, jnp.float32)


def test_registered_by_name() -> None:
    assert LOSSES["grpo"] is grpo_loss
    with pytest.raises(ValueError, match="already registered"):
        register("grpo")(grpo_loss)


def test_clip_golden_values() -> None:
    # Two sequences of one token each, ratio exp(log 1.5) = 1.5, eps 0.2.
    # Row 0, A = +1: min(1.5 * 1, clip(1.5, 0.8, 1.2) * 1) = min(1.5, 1.2) = 1.2 (clipped).
    # Row 1, A = -1: min(1.5 * -1, 1.2 * -1) = min(-1.5, -1.2) = -1.5 (not clipped).
    # loss = -(1.2 + -1.5) / 2 = 0.15; clip_fraction = 1/2; ratio_mean = 1.5.
    logp = _f32([[math.log(1.5)], [math.log(1.5)]])
    old = _f32([[0.0], [0.0]])
    loss, m = grpo_loss(logp, old, _f32([1.0, -1.0]), _f32([[1.0], [1.0]]), 0.2)
    np.testing.assert_allclose(float(loss), 0.15, atol=1e-6)
    np.testing.assert_allclose(float(m["clip_fraction"]), 0.5, atol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), 1.5, atol=1e-6)


def test_low_ratio_golden_values() -> None:
    # ratio 0.5, eps 0.2: A = -2: min(0.5 * -2, 0.8 * -2) = min(-1.0, -1.6) = -1.6 (clipped);
    # A = +2: min(1.0, 1.6) = 1.0 (not clipped). loss = -(-1.6 + 1.0) / 2 = 0.3.
    logp = _f32([[math.log(0.5)], [math.log(0.5)]])
    old = _f32([[0.0], [0.0]])
    loss, m = grpo_loss(logp, old, _f32([-2.0, 2.0]), _f32([[1.0], [1.0]]), 0.2)
    np.testing.assert_allclose(float(loss), 0.3, atol=1e-6)
    np.testing.assert_allclose(float(m["clip_fraction"]), 0.5, atol=1e-6)


def test_mask_and_token_level_aggregation() -> None:
    # Row 0 has 3 masked tokens at ratio 1, A = 1 -> objective 1 each (sum 3).
    # Row 1 has 1 masked token at ratio 1, A = -3 -> objective -3.
    # Token-level: -(3 + -3) / 4 = 0. The unmasked tokens carry huge log-ratios that must
    # neither count nor turn into inf/NaN.
    logp = _f32([[0.0, 0.0, 0.0, 50.0], [0.0, 90.0, 90.0, 90.0]])
    old = _f32(np.zeros((2, 4)))
    mask = _f32([[1, 1, 1, 0], [1, 0, 0, 0]])
    loss, m = grpo_loss(logp, old, _f32([1.0, -3.0]), mask, 0.2)
    np.testing.assert_allclose(float(loss), 0.0, atol=1e-6)
    np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, atol=1e-6)
    np.testing.assert_allclose(float(m["clip_fraction"]), 0.0, atol=1e-6)
    # Same row 0 alone: -(1 + 1 + 1) / 3 = -1.
    loss, _ = grpo_loss(logp[:1], old[:1], _f32([1.0]), mask[:1], 0.2)
    np.testing.assert_allclose(float(loss), -1.0, atol=1e-6)


def test_empty_mask_gives_zero_not_nan() -> None:
    logp = _f32([[-1.0, -2.0]])
    loss, m = grpo_loss(logp, _f32([[0.0, 0.0]]), _f32([1.0]), _f32([[0.0, 0.0]]), 0.2)
    assert float(loss) == 0.0
    assert float(m["clip_fraction"]) == 0.0
    assert float(m["ratio_mean"]) == 0.0
