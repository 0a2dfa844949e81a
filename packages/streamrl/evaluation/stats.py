"""The statistics of `streamrl eval`: 95 % intervals, pass@k and the quality gate.

Pure functions of counts and lists of numbers, no model and no I/O:

- a rate (k successes of n) gets the Wilson score interval, which stays inside [0, 1] and
  is not degenerate at 0 or n successes (the normal interval of 0/20 is [0, 0]);
- a mean gets mean +- t(0.975, n - 1) * s / sqrt(n) (Student's t; the normal quantile is
  its limit);
- pass@k from n samples with c correct is the unbiased estimator of Chen et al. (2021),
  1 - C(n - c, k) / C(n, k), averaged over problems, with a t interval over problems
  (clipped to [0, 1]);
- the gate (`gate`) fails when the current solve rate is below the baseline's by more
  than the tolerance even at the top of its own 95 % interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile

# Student's t 0.975 quantiles for 1..30 degrees of freedom (standard tables).
_T975 = (
    12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836,
    2.446911851, 2.364624252, 2.306004135, 2.262157163, 2.228138852,
    2.200985160, 2.178812830, 2.160368656, 2.144786688, 2.131449546,
    2.119905299, 2.109815578, 2.100922040, 2.093024054, 2.085963447,
    2.079613845, 2.073873068, 2.068657610, 2.063898562, 2.059538553,
    2.055529439, 2.051830516, 2.048407142, 2.045229642, 2.042272456,
)  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """A point estimate and its 95 % interval [lo, hi]; `n` observations behind it."""

    value: float
    lo: float
    hi: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi, "n": self.n}


def t975(df: int) -> float:
    """Student's t 0.975 quantile for `df` >= 1 degrees of freedom: the table to 30, then
    the Cornish-Fisher expansion about the normal quantile (error below 1e-5 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z95
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def wilson(k: int, n: int, z: float = Z95) -> Estimate:
    """The rate k / n with its Wilson score interval:
    (p + z^2/2n -+ z sqrt(p(1 - p)/n + z^2/4n^2)) / (1 + z^2/n)."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"a rate needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at k = 0 (k = n) the bound is exactly 0 (1); keep float rounding from moving it
    return Estimate(p, 0.0 if k == 0 else center - half, 1.0 if k == n else center + half, n)


def mean_interval(xs: Sequence[float]) -> Estimate:
    """The mean of `xs` with its t interval (one value: the interval is the point)."""
    n = len(xs)
    if n == 0:
        raise ValueError("the mean of no values")
    m = math.fsum(xs) / n
    if n == 1:
        return Estimate(m, m, m, 1)
    s = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * s / math.sqrt(n)
    return Estimate(m, m - half, m + half, n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples of which c are correct:
    1 - C(n - c, k) / C(n, k) (1 when fewer than k samples are wrong)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_estimate(correct: Sequence[int], n: int, k: int) -> Estimate:
    """pass@k over problems (`correct`: each one's correct count of its n samples), the
    mean of the per-problem estimates with its t interval clipped to [0, 1]."""
    e = mean_interval([pass_at_k(n, c, k) for c in correct])
    return Estimate(e.value, max(0.0, e.lo), min(1.0, e.hi), e.n)


# Exit statuses of `streamrl eval`.
EXIT_OK = 0
EXIT_GATE_FAILED = 1  # --gate: the solve rate fell beyond the tolerance
EXIT_USAGE = 2  # bad arguments, config, checkpoint or baseline
EXIT_SANDBOX = 3  # the tool sandbox is unavailable (as `streamrl tools exec`)


@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    baseline: float  # the baseline's solve rate (point estimate)
    current: Estimate  # the current solve rate and its interval
    tolerance: float
    reason: str


def gate(current: Estimate, baseline: float, tolerance: float) -> GateVerdict:
    """The gate rule: fail iff current.hi < baseline - tolerance, i.e. the solve rate fell
    by more than `tolerance` (absolute) and its 95 % interval says so (even its top is that
    far down). A drop within the tolerance, or one the interval cannot tell from noise,
    passes; the baseline's point estimate is taken as exact."""
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"the tolerance is an absolute solve rate in [0, 1], got {tolerance}")
    floor = baseline - tolerance
    passed = not current.hi < floor
    if passed:
        reason = (
            f"solve rate {current.value:.4f} (95% CI [{current.lo:.4f}, {current.hi:.4f}]) "
            f"reaches baseline {baseline:.4f} - tolerance {tolerance:g} = {floor:.4f}"
        )
    else:
        reason = (
            f"solve rate {current.value:.4f} fell below baseline {baseline:.4f} - tolerance "
            f"{tolerance:g} = {floor:.4f}: even the top of its 95% CI, {current.hi:.4f}, is"
        )
    return GateVerdict(passed, baseline, current, tolerance, reason)
