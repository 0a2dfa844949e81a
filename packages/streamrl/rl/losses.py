"""Policy-gradient losses, pure jax.numpy functions registered by name.

A loss takes per-token log-probabilities of the current policy `logp` [B, T] and of the
rollout policy `old_logp` [B, T], per-sequence advantages [B], a float32 loss mask [B, T]
(1 on the policy's own sampled tokens) and the clip epsilon, and returns a scalar loss to
minimise plus scalar metrics. No Redis, no Flax: this module is the RL math only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

__all__ = ["LOSSES", "LossFn", "grpo_loss", "register"]


class LossFn(Protocol):
    def __call__(
        self,
        logp: jax.Array,
        old_logp: jax.Array,
        advantages: jax.Array,
        mask: jax.Array,
        clip_epsilon: float,
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


LOSSES: dict[str, LossFn] = {}


def register(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: make a loss selectable as `trainer.loss = name`."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return add


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x over mask-1 entries; 0 (not NaN) when the mask is empty."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@register("grpo")
def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_epsilon: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped-ratio GRPO objective with token-level aggregation.

    ratio = exp(logp - old_logp); per token min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)
    with A the sequence's advantage; loss = -(sum over masked tokens) / (masked tokens, at
    least 1). Metrics: `clip_fraction` (share of masked tokens where the clipped term won,
    i.e. the gradient was cut) and `ratio_mean` (over masked tokens).
    """
    # Unmasked tokens get ratio 1: a pad's arbitrary log-prob must not overflow exp() into
    # inf, since inf * 0 is NaN and would poison the sums.
    log_ratio = jnp.where(mask > 0, logp - old_logp, 0.0)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_epsilon, 1.0 + clip_epsilon) * adv
    objective = jnp.minimum(unclipped, clipped)
    loss = -_masked_mean(objective, mask)
    clip_active = (clipped < unclipped).astype(jnp.float32)
    metrics = {
        "clip_fraction": _masked_mean(clip_active, mask),
        "ratio_mean": _masked_mean(ratio, mask),
    }
    return loss, metrics
