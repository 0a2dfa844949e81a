"""Group-relative advantages, pure and registered by name.

An advantage function maps one group's rewards (the samples of one prompt) and an epsilon
to one advantage per sample: `fn(rewards, epsilon) -> list[float]`.

    grpo      (r - mean(r)) / (std(r) + epsilon)     (Shao et al. 2024)
    dr_grpo   r - mean(r), epsilon unused            (Liu et al. 2025: no std, no bias
                                                      toward low-variance prompts)

`masked_advantages` applies one of them to the valid members of a group only: the others
(an episode that infrastructure ended) get 0 and move neither the mean nor the std.

A group whose rewards are all equal (`is_zero_variance`) gets advantages of exactly 0 from
both: it carries no learning signal, and a caller may drop it (DAPO's dynamic sampling).

Imports NumPy only: the grouper computes advantages and must start in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "ADVANTAGES",
    "AdvantageFn",
    "dr_grpo_advantages",
    "grpo_advantages",
    "is_zero_variance",
    "masked_advantages",
    "register",
]

AdvantageFn = Callable[[Sequence[float], float], list[float]]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage {name!r} registered twice")
        ADVANTAGES[name] = fn
        return fn

    return deco


def is_zero_variance(rewards: Sequence[float] | np.ndarray, tol: float = 0.0) -> bool:
    """Whether max(r) - min(r) <= tol, i.e. the group has no learning signal.

    The range, not the std: equal rewards of 0.1 have a float64 mean of 0.1 + 1.4e-17, so
    their std is 1.4e-17, not 0. An empty group counts as zero-variance.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return True
    return bool(r.max() - r.min() <= tol)


def _centered(rewards: Sequence[float]) -> np.ndarray:
    """r - mean(r) in float64; exactly 0 for an all-equal group (see is_zero_variance)."""
    r = np.asarray(rewards, dtype=np.float64)
    if is_zero_variance(r):
        return np.zeros_like(r)
    centered: np.ndarray = r - r.mean()
    return centered


@register("grpo")
def grpo_advantages(rewards: Sequence[float], epsilon: float) -> list[float]:
    """(r_i - mean(r)) / (std(r) + epsilon), std the population standard deviation.

        `masked_advantages` applies one of them to the valid members of a group only: the others
    (an episode that infrastructure ended) get 0 and move neither the mean nor the std.

    A group whose rewards are all equal gets advantages of exactly 0 (even with epsilon 0,
        where the rounding residue of the mean divided by its own std would be +-1).
    """
    centered = _centered(rewards)
    if not centered.any():
        return _floats(centered)
    return _floats(centered / (centered.std() + epsilon))


@register("dr_grpo")
def dr_grpo_advantages(rewards: Sequence[float], epsilon: float) -> list[float]:
    """r_i - mean(r): no division by the group's std (epsilon is accepted and unused)."""
    del epsilon  # same signature as every advantage function
    return _floats(_centered(rewards))


def _floats(a: np.ndarray) -> list[float]:
    return [float(x) for x in a]


def masked_advantages(
    fn: AdvantageFn, rewards: Sequence[float], valid: Sequence[bool], epsilon: float
) -> list[float]:
    """`fn` over the rewards of the valid members only, in their places; 0 for the others,
    which take no part in the mean or the std. Non-finite rewards give non-finite
    advantages without a warning: the caller checks them."""
    if len(rewards) != len(valid):
        raise ValueError(f"{len(rewards)} rewards, {len(valid)} valid flags")
    with np.errstate(all="ignore"):  # an overflowing mean is the caller's to reject
        scored = iter(fn([r for r, ok in zip(rewards, valid, strict=True) if ok], epsilon))
    return [next(scored) if ok else 0.0 for ok in valid]
