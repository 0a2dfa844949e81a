"""Group-relative advantages (GRPO), pure and registered by name.

Imports NumPy only: the grouper computes advantages and must start in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

AdvantageFn = Callable[[Sequence[float], float], list[float]]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage {name!r} registered twice")
        ADVANTAGES[name] = fn
        return fn

    return deco


@register("grpo")
def grpo_advantages(rewards: Sequence[float], epsilon: float) -> list[float]:
    """(r_i - mean(r)) / (std(r) + epsilon), std the population standard deviation.

    A group whose rewards are all equal gets advantages of exactly 0.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return []
    centered = r - r.mean()
    return (centered / (r.std() + epsilon)).tolist()
