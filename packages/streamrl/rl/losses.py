"""Policy-gradient losses, pure jax.numpy functions registered by name.

Every loss is the clipped-ratio objective of `policy_loss`, with an optional KL penalty
toward a reference policy; the registered names differ in how per-token losses become
one scalar and in how the ratio is clipped:

    name      aggregation                                           clip
    grpo      mean over sequences of each sequence's token mean     [1 - eps, 1 + eps]
    dapo      sum over all tokens / number of tokens                [1 - eps, 1 + eps_high]
    dr_grpo   sum over all tokens / (sequences * max_tokens)        [1 - eps, 1 + eps_high]

A registered loss is `fn(logp, old_logp, advantages, mask, cfg, ref_logp=None,
behav_logp=None)`; the name fixes `cfg.aggregation` (so `LossConfig.aggregation` only
matters to direct calls of `policy_loss`). No Redis, no Flax: this module is the RL math
only, plus one host-side NumPy check of rollout log-probs.

Staleness. Three policies meet in a step: the behaviour policy that sampled the tokens
(the rollout's log-probs, `behav_logp`), the proximal policy the ratio is taken against
(`old_logp`: the rollout's log-probs again, or the trainer's own before its update) and
the policy being trained (`logp`). With `old_logp` the trainer's own, the clipped ratio
knows nothing of how stale the samples are; `cfg.correction` weighs each token by the
proximal-to-behaviour ratio w = exp(old_logp - behav_logp), a constant (the decoupled
objective of AReaL; Yao et al.'s truncated importance sampling):

    "tis"     w' = min(w, C)                      every token kept, its weight capped
    "icepop"  w' = 1 if 1/C <= w <= C else 0      tokens too far off policy masked out

with C = `cfg.correction_cap`. The loss's normaliser is unchanged (a masked-out token
still counts in it). Given `behav_logp`, the loss also reports how far the behaviour
policy is from the trainer's (`mismatch_*` metrics below), whatever the correction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import jax
import jax.numpy as jnp
import numpy as np

from streamrl.config import Correction, KlEstimator

__all__ = [
    "LOSSES",
    "LossConfig",
    "LossFn",
    "check_rollout_logps",
    "dapo_loss",
    "dr_grpo_loss",
    "grpo_loss",
    "policy_loss",
    "register",
]

Aggregation = Literal["token", "sequence", "constant"]
_AGGREGATIONS = get_args(Aggregation)
_KL_ESTIMATORS = get_args(KlEstimator)
_CORRECTIONS = get_args(Correction)
# Log-ratios are clamped to this before exp() in the weights and the mismatch metrics: a
# token the behaviour policy found 1e-9 times as likely must not overflow float32.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Hyperparameters of `policy_loss`. Frozen and hashable, so it can be a static jit arg.

    epsilon: lower clip, ratio >= 1 - epsilon; in (0, 1).
    epsilon_high: upper clip, ratio <= 1 + epsilon_high (DAPO "clip higher"); > 0, or
        None for epsilon (symmetric).
    aggregation: how masked per-token losses become the scalar loss (N = masked tokens):
        "token": sum / N over the whole batch (DAPO); long sequences weigh more.
        "sequence": mean over non-empty sequences of each one's masked mean (GRPO).
        "constant": sum / (non-empty sequences * max_tokens) (Dr. GRPO): no length bias.
    max_tokens: the constant of "constant" aggregation, e.g. the generation budget in
        tokens; > 0 required then, unused otherwise.
    kl_beta: weight of the KL(policy || reference) penalty, >= 0; 0 needs no reference.
    kl_estimator: per-token KL estimate with d = ref_logp - logp: "k1" is -d (unbiased,
        can be negative), "k3" is exp(d) - d - 1 (Schulman; unbiased and >= 0).
    correction: importance weight against the behaviour policy (module docstring):
        "none", "tis" (truncated at correction_cap) or "icepop" (tokens whose weight
        leaves [1 / correction_cap, correction_cap] masked); not "none" needs behav_logp.
    correction_cap: C, > 1.
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    aggregation: Aggregation = "token"
    max_tokens: int = 0
    kl_beta: float = 0.0
    kl_estimator: KlEstimator = "k3"
    correction: Correction = "none"
    correction_cap: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 < self.epsilon < 1.0:
            raise ValueError(f"LossConfig.epsilon must be in (0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high > 0.0:
            raise ValueError(
                f"LossConfig.epsilon_high must be > 0 (or None), got {self.epsilon_high}"
            )
        if self.aggregation not in _AGGREGATIONS:
            raise ValueError(
                f"LossConfig.aggregation must be one of {_AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.max_tokens < 0:
            raise ValueError(f"LossConfig.max_tokens must be >= 0, got {self.max_tokens}")
        if self.aggregation == "constant" and self.max_tokens == 0:
            raise ValueError(
                "LossConfig.max_tokens must be > 0 for 'constant' aggregation (dr_grpo): "
                "set it to the generation budget in tokens"
            )
        if not self.kl_beta >= 0.0:
            raise ValueError(f"LossConfig.kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_estimator not in _KL_ESTIMATORS:
            raise ValueError(
                f"LossConfig.kl_estimator must be one of {_KL_ESTIMATORS}, "
                f"got {self.kl_estimator!r}"
            )
        if self.correction not in _CORRECTIONS:
            raise ValueError(
                f"LossConfig.correction must be one of {_CORRECTIONS}, got {self.correction!r}"
            )
        if not self.correction_cap > 1.0:
            raise ValueError(f"LossConfig.correction_cap must be > 1, got {self.correction_cap}")

    @property
    def upper_epsilon(self) -> float:
        """The upper clip actually used: epsilon_high, or epsilon when that is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads `ref_logp`, i.e. the trainer must run a reference pass."""
        return self.kl_beta > 0.0


class LossFn(Protocol):
    def __call__(
        self,
        logp: jax.Array,
        old_logp: jax.Array,
        advantages: jax.Array,
        mask: jax.Array,
        cfg: LossConfig,
        ref_logp: jax.Array | None = None,
        behav_logp: jax.Array | None = None,
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


def _check_shapes(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    ref_logp: jax.Array | None,
) -> None:
    # Broadcasting would silently turn a [B] mask or a [B, 1] advantage into wrong math.
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    named = {"old_logp": old_logp, "mask": mask}
    if ref_logp is not None:
        named["ref_logp"] = ref_logp
    for name, x in named.items():
        if x.shape != logp.shape:
            raise ValueError(f"{name} has shape {x.shape}, logp has {logp.shape}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = {logp.shape[:1]}, got {advantages.shape}")


def _kl_per_token(
    logp: jax.Array, ref_logp: jax.Array, valid: jax.Array, estimator: KlEstimator
) -> jax.Array:
    """[B, T] KL(policy || reference) estimate per token; 0 off the mask."""
    # Zeroing d off the mask before exp(): a pad's arbitrary log-probs could overflow to
    # inf, and inf * 0 is NaN in the sums and in the gradient.
    d = jnp.where(valid, ref_logp - logp, 0.0)
    if estimator == "k1":
        return -d
    return jnp.exp(d) - d - 1.0


def _aggregate(per_token: jax.Array, mask: jax.Array, cfg: LossConfig) -> jax.Array:
    """Scalar from [B, T] per-token losses (already 0 off the mask) per cfg.aggregation."""
    if cfg.aggregation == "token":
        return jnp.sum(per_token) / jnp.maximum(jnp.sum(mask), 1.0)
    tokens_per_row = jnp.sum(mask, axis=1)
    # Rows without a masked token (the trainer pads B up to a power of two) must neither
    # count as a sequence nor divide by zero.
    rows = jnp.sum((tokens_per_row > 0).astype(jnp.float32))
    if cfg.aggregation == "sequence":
        row_means = jnp.sum(per_token, axis=1) / jnp.maximum(tokens_per_row, 1.0)
        return jnp.sum(row_means) / jnp.maximum(rows, 1.0)
    return jnp.sum(per_token) / (jnp.maximum(rows, 1.0) * float(cfg.max_tokens))


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    behav_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped-ratio policy-gradient loss with an optional KL penalty; lower is better.

    logp [B, T]: log-probs of the tokens under the policy being trained (the only input
    gradients flow through); old_logp [B, T]: under the policy that sampled them;
    advantages [B]: one per sequence; mask [B, T] float32, 1 on the policy's own sampled
    tokens; ref_logp [B, T]: under the reference policy, required iff cfg.kl_beta > 0 and
    ignored otherwise. old_logp and ref_logp are constants (stop_gradient). All in float32.

    Per masked token, with ratio = exp(logp - old_logp) and A the sequence's advantage:
        loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + kl_beta * kl_t
    then aggregated per cfg.aggregation. Returns (loss, metrics), metrics float32 scalars
    over masked tokens: clip_low_fraction (share where the lower clip cut the gradient:
    ratio < 1 - eps with A < 0), clip_high_fraction (ratio > 1 + eps_high with A > 0),
    clip_fraction (their sum), ratio_mean, kl (masked mean of kl_t; 0 when kl_beta = 0).

    behav_logp [B, T]: under the behaviour policy (the rollout's log-probs; a constant),
    required iff cfg.correction is not "none". With it the per-token loss is multiplied by
    the correction weight w' (module docstring), and the metrics gain, with
    d = logp - behav_logp on masked tokens (logp taken as a constant):
        mismatch_logp_abs   masked mean of |d|
        mismatch_kl         masked mean of exp(d) - d - 1: k3's estimate, per token, of
                            KL(behaviour || trainer) (the tokens were sampled by the
                            behaviour policy)
        mismatch_kl_seq     mean over non-empty sequences of the sum of that estimate over
                            the sequence's tokens (its per-sequence KL)
        correction_fraction share of masked tokens the correction changed: weight capped
                            ("tis") or token masked out ("icepop"); 0 with "none"
    """
    _check_shapes(logp, old_logp, advantages, mask, ref_logp)
    if behav_logp is not None and behav_logp.shape != logp.shape:
        raise ValueError(f"behav_logp has shape {behav_logp.shape}, logp has {logp.shape}")
    if cfg.needs_reference and ref_logp is None:
        raise ValueError(f"kl_beta = {cfg.kl_beta} > 0 needs ref_logp (reference log-probs)")
    if cfg.correction != "none" and behav_logp is None:
        raise ValueError(
            f"correction {cfg.correction!r} needs behav_logp (the rollout's log-probs)"
        )
    logp = logp.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    mask = mask.astype(jnp.float32)
    valid = mask > 0
    # Unmasked tokens get ratio 1: a pad's arbitrary log-prob must not overflow exp() into
    # inf, since inf * 0 is NaN and would poison the sums.
    ratio = jnp.exp(jnp.where(valid, logp - old_logp, 0.0))
    adv = advantages.astype(jnp.float32)[:, None]
    unclipped = ratio * adv
    lower, upper = 1.0 - cfg.epsilon, 1.0 + cfg.upper_epsilon
    clipped = jnp.clip(ratio, lower, upper) * adv
    per_token = -jnp.minimum(unclipped, clipped)

    extra: dict[str, jax.Array] = {}
    if behav_logp is not None:
        behav = jax.lax.stop_gradient(behav_logp.astype(jnp.float32))
        weight, changed = _correction_weight(old_logp, behav, valid, cfg)
        per_token = per_token * weight  # the policy term only, not the KL penalty
        extra = _mismatch(jax.lax.stop_gradient(logp), behav, mask, valid)
        extra["correction_fraction"] = _masked_mean(changed.astype(jnp.float32), mask)

    if ref_logp is not None and cfg.needs_reference:
        ref = jax.lax.stop_gradient(ref_logp.astype(jnp.float32))
        kl = _kl_per_token(logp, ref, valid, cfg.kl_estimator)
        per_token = per_token + cfg.kl_beta * kl
        kl_mean = _masked_mean(kl, mask)
    else:
        kl_mean = jnp.zeros((), jnp.float32)

    loss = _aggregate(per_token * mask, mask, cfg)
    # The clipped term "won" exactly where it is strictly smaller; A = 0 never clips.
    taken = clipped < unclipped
    clip_low = _masked_mean((taken & (ratio < lower)).astype(jnp.float32), mask)
    clip_high = _masked_mean((taken & (ratio > upper)).astype(jnp.float32), mask)
    metrics = {
        "clip_fraction": clip_low + clip_high,
        "clip_low_fraction": clip_low,
        "clip_high_fraction": clip_high,
        "ratio_mean": _masked_mean(ratio, mask),
        "kl": kl_mean,
        **extra,
    }
    return loss, metrics


def _log_ratio(num: jax.Array, den: jax.Array, valid: jax.Array) -> jax.Array:
    """num - den on the mask (clamped to +-_MAX_LOG_RATIO), 0 off it."""
    return jnp.clip(jnp.where(valid, num - den, 0.0), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _correction_weight(
    old_logp: jax.Array, behav_logp: jax.Array, valid: jax.Array, cfg: LossConfig
) -> tuple[jax.Array, jax.Array]:
    """([B, T] weight w', [B, T] bool where the correction changed w) per cfg.correction;
    w = exp(old_logp - behav_logp), the proximal-to-behaviour ratio (constants)."""
    w = jnp.exp(_log_ratio(old_logp, behav_logp, valid))
    cap = cfg.correction_cap
    if cfg.correction == "tis":
        return jnp.minimum(w, cap), w > cap
    if cfg.correction == "icepop":
        inside = (w >= 1.0 / cap) & (w <= cap)
        return inside.astype(jnp.float32), ~inside
    return jnp.ones_like(w), jnp.zeros(w.shape, bool)


def _mismatch(
    logp: jax.Array, behav_logp: jax.Array, mask: jax.Array, valid: jax.Array
) -> dict[str, jax.Array]:
    """The behaviour-policy mismatch metrics of `policy_loss` (logp, behav_logp constant)."""
    d = _log_ratio(logp, behav_logp, valid)
    k3 = (jnp.exp(d) - d - 1.0) * mask
    tokens_per_row = jnp.sum(mask, axis=1)
    rows = jnp.sum((tokens_per_row > 0).astype(jnp.float32))
    return {
        "mismatch_logp_abs": _masked_mean(jnp.abs(d), mask),
        "mismatch_kl": _masked_mean(k3, mask),
        "mismatch_kl_seq": jnp.sum(k3) / jnp.maximum(rows, 1.0),
    }


# How each registered loss aggregates: the trainer weighs its micro-batches by the same rule.
LOSS_AGGREGATION: dict[str, Aggregation] = {
    "grpo": "sequence",
    "dapo": "token",
    "dr_grpo": "constant",
}


@register("grpo")
def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    behav_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO (Shao et al. 2024): sequence aggregation, symmetric clip.

    An asymmetric cfg.epsilon_high is an error rather than silently dropped: that is "dapo".
    """
    if cfg.epsilon_high is not None and cfg.epsilon_high != cfg.epsilon:
        raise ValueError(
            f"loss 'grpo' clips symmetrically but epsilon_high = {cfg.epsilon_high} != "
            f"epsilon = {cfg.epsilon}; use loss 'dapo' for clip-higher"
        )
    cfg = dataclasses.replace(cfg, aggregation=LOSS_AGGREGATION["grpo"])
    return policy_loss(logp, old_logp, advantages, mask, cfg, ref_logp, behav_logp)


@register("dapo")
def dapo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    behav_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DAPO (Yu et al. 2025): token aggregation, upper clip 1 + epsilon_high.

    The paper uses epsilon = 0.2, epsilon_high = 0.28; with epsilon_high None the clip is
    symmetric and this is plain token-level GRPO.
    """
    cfg = dataclasses.replace(cfg, aggregation=LOSS_AGGREGATION["dapo"])
    return policy_loss(logp, old_logp, advantages, mask, cfg, ref_logp, behav_logp)


@register("dr_grpo")
def dr_grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    behav_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Dr. GRPO (Liu et al. 2025): constant normaliser (cfg.max_tokens > 0 required).

    Pair it with the "dr_grpo" advantages (no std normalisation), as the paper does.
    """
    cfg = dataclasses.replace(cfg, aggregation=LOSS_AGGREGATION["dr_grpo"])
    return policy_loss(logp, old_logp, advantages, mask, cfg, ref_logp, behav_logp)


def check_rollout_logps(old_logp: np.ndarray, mask: np.ndarray) -> None:
    """Host-side check that rollout log-probs can stand in for old_logp; raise if not.

    old_logp, mask: [B, T] (or [T]) arrays, mask > 0 on the policy's sampled tokens. Only
    masked tokens are checked. Raises ValueError naming the rows when:
      - a masked log-prob is NaN or infinite (-inf would make the ratio inf);
      - a masked log-prob is > 0 (log-softmax is <= 0 exactly, even in float32).
    A row whose masked log-probs are all exactly 0.0 passes: see `missing_logp_rows`.
    """
    lp = np.atleast_2d(np.asarray(old_logp, dtype=np.float64))
    m = np.atleast_2d(np.asarray(mask)) > 0
    if lp.shape != m.shape:
        raise ValueError(f"old_logp has shape {lp.shape}, mask has {m.shape}")
    problems = []
    non_finite = np.flatnonzero(np.any(m & ~np.isfinite(lp), axis=1))
    if non_finite.size:
        problems.append(f"NaN or infinite log-probs in rows {non_finite[:8].tolist()}")
    positive = np.flatnonzero(np.any(m & np.isfinite(lp) & (lp > 0.0), axis=1))
    if positive.size:
        problems.append(f"positive log-probs in rows {positive[:8].tolist()}")
    if problems:
        raise ValueError(
            "rollout log-probs cannot be used as old_logp: "
            + "; ".join(problems)
            + ". Make the engine report sampled-token log-probs, or recompute them in the "
            "trainer (use_rollout_logps off)."
        )


def missing_logp_rows(old_logp: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[B] bool: rows with sampled tokens whose masked log-probs are all exactly 0.0.

    Transcripts fill 0.0 where the engine reported nothing, and a real row would need
    every sampled token to have probability 1 to float32 precision (a policy so collapsed
    on an easy prompt that its log-softmax rounds to 0: possible late in training, and
    then the row has nothing left to teach). Either way the row's log-probs are
    unavailable: the trainer masks it out of the loss instead of using them.
    """
    lp = np.atleast_2d(np.asarray(old_logp))
    m = np.atleast_2d(np.asarray(mask)) > 0
    return np.asarray(m.any(axis=1) & ~np.any(m & (lp != 0.0), axis=1))
