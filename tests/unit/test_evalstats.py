"""`streamrl eval`'s statistics against values worked out by hand (z = 1.959964,
z^2 = 3.841459), and the gate rule."""

from __future__ import annotations

import pytest

from streamrl.evaluation.stats import (
    Estimate,
    gate,
    mean_interval,
    pass_at_k,
    pass_at_k_estimate,
    t975,
    wilson,
)


def _est(e: Estimate, value: float, lo: float, hi: float, n: int) -> None:
    assert e.n == n
    assert (e.value, e.lo, e.hi) == pytest.approx((value, lo, hi), abs=1e-6)


def test_wilson_golden() -> None:
    # 0 of 10: p = 0; 1 + z^2/n = 1.3841459; centre (0 + 3.841459 / 20) / 1.3841459 = 0.138767;
    # half z sqrt(0 + 3.841459 / 400) / 1.3841459 = 1.959964 * 0.0979982 / 1.3841459 = 0.138767.
    _est(wilson(0, 10), 0.0, 0.0, 0.277533, 10)
    # 5 of 10: centre 0.5; half 1.959964 sqrt(0.025 + 0.0096036) / 1.3841459 = 0.263407.
    _est(wilson(5, 10), 0.5, 0.236593, 0.763407, 10)
    # 10 of 10 mirrors 0 of 10.
    _est(wilson(10, 10), 1.0, 1 - 0.277533, 1.0, 10)
    # 70 of 100: 1 + z^2/n = 1.0384146; centre 0.7192073 / 1.0384146 = 0.692601;
    # half 1.959964 sqrt(0.0021 + 0.0000960) / 1.0384146 = 0.088450.
    _est(wilson(70, 100), 0.7, 0.604151, 0.781051, 100)
    with pytest.raises(ValueError):
        wilson(3, 2)
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_mean_interval_golden() -> None:
    # [1, 2, 3, 4]: mean 2.5, s = sqrt(5 / 3) = 1.290994, t(3) = 3.182446,
    # half 3.182446 * 1.290994 / 2 = 2.054260.
    _est(mean_interval([1.0, 2.0, 3.0, 4.0]), 2.5, 0.445740, 4.554260, 4)
    # 40 zeros and 10 ones: mean 0.2, s = sqrt(50 * 0.16 / 49) = 0.404061, t(49) = 2.009575
    # (beyond the table: the expansion), half 2.009575 * 0.404061 / sqrt(50) = 0.114833.
    _est(mean_interval([0.0] * 40 + [1.0] * 10), 0.2, 0.085167, 0.314833, 50)
    _est(mean_interval([3.0]), 3.0, 3.0, 3.0, 1)
    with pytest.raises(ValueError):
        mean_interval([])


def test_t_quantiles() -> None:
    assert t975(1) == pytest.approx(12.706205, abs=1e-6)
    assert t975(30) == pytest.approx(2.042272, abs=1e-6)
    assert t975(31) == pytest.approx(2.039513, abs=1e-5)
    assert t975(120) == pytest.approx(1.979930, abs=1e-5)
    assert t975(10**9) == pytest.approx(1.959964, abs=1e-6)


def test_pass_at_k_golden() -> None:
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # k = 1: c / n
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # one wrong sample cannot fill k = 2
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5) = 21, C(10,5) = 252
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    # Two problems, pass@2 of [0.5, 0]: mean 0.25, s = 0.353553, t(1) = 12.706205,
    # half 12.706205 * 0.353553 / sqrt(2) = 3.176551: clipped to [0, 1].
    _est(pass_at_k_estimate([1, 0], 4, 2), 0.25, 0.0, 1.0, 2)


def test_gate_fails_only_when_the_interval_is_wholly_below_the_floor() -> None:
    # Baseline 0.9, tolerance 0.1: the floor is 0.8.
    v = gate(wilson(0, 10), 0.9, 0.1)  # top of the interval 0.2775 < 0.8
    assert not v.passed and "0.2775" in v.reason
    # 7 of 10 is below the floor, but its interval reaches 0.8922: noise, it passes.
    assert gate(wilson(7, 10), 0.9, 0.1).passed
    # 70 of 100 is as far down and its interval stops at 0.7811: it fails.
    assert not gate(wilson(70, 100), 0.9, 0.1).passed
    # Against itself a result always passes (its top is at least its point estimate).
    for k in (0, 3, 10):
        assert gate(wilson(k, 10), k / 10, 0.0).passed
    # The top exactly at the floor passes: "below" is strict.
    assert gate(Estimate(0.7, 0.6, 0.8, 100), 0.9, 0.1).passed
    with pytest.raises(ValueError):
        gate(wilson(1, 2), 0.5, 1.5)
