"""Group-relative advantages against golden values worked out by hand."""

import math

import numpy as np
import pytest

from streamrl.rl.advantages import (
    ADVANTAGES,
    dr_grpo_advantages,
    grpo_advantages,
    is_zero_variance,
)


def test_grpo_golden_values() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, deviations +-0.5, population std sqrt(4*0.25/4) = 0.5
    # advantages: +0.5/0.5 = 1, -0.5/0.5 = -1 (epsilon 0 here)
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0], 0.0) == [1.0, -1.0, -1.0, 1.0]


def test_grpo_golden_uneven() -> None:
    # rewards 3, 0, 0: mean 1; deviations 2, -1, -1; variance (4+1+1)/3 = 2, std sqrt(2)
    # with epsilon 0.1: 2/(1.41421356+0.1) = 1.32082..., -1/1.51421356 = -0.66041...
    adv = grpo_advantages([3.0, 0.0, 0.0], 0.1)
    assert adv[0] == pytest.approx(2 / (math.sqrt(2) + 0.1))
    assert adv[1] == pytest.approx(-1 / (math.sqrt(2) + 0.1))
    assert adv[2] == adv[1]


def test_zero_variance_group_is_zero() -> None:
    # all rewards 1: every deviation is 0, std 0, 0/(0+eps) = 0
    assert grpo_advantages([1.0, 1.0, 1.0, 1.0], 1e-6) == [0.0, 0.0, 0.0, 0.0]
    # all rewards 0.1: the float64 mean is 0.1 + 1.4e-17, so deviations and std are both
    # 1.4e-17 and, with epsilon 0, a naive (r - mean) / std would give -1, -1, -1
    assert np.std([0.1, 0.1, 0.1]) > 0.0
    assert grpo_advantages([0.1, 0.1, 0.1], 0.0) == [0.0, 0.0, 0.0]
    assert dr_grpo_advantages([0.1, 0.1, 0.1], 0.0) == [0.0, 0.0, 0.0]


def test_dr_grpo_golden_values() -> None:
    # rewards 3, 0, 0: mean 1 -> 3 - 1 = 2, 0 - 1 = -1, -1; no division by std sqrt(2)
    assert dr_grpo_advantages([3.0, 0.0, 0.0], 1e-6) == [2.0, -1.0, -1.0]
    # rewards 1, 0, 0, 1: mean 0.5 -> +-0.5 (grpo would scale these to +-1)
    assert dr_grpo_advantages([1.0, 0.0, 0.0, 1.0], 0.0) == [0.5, -0.5, -0.5, 0.5]
    # epsilon is unused
    assert dr_grpo_advantages([3.0, 0.0, 0.0], 5.0) == [2.0, -1.0, -1.0]


def test_is_zero_variance() -> None:
    assert is_zero_variance([1.0, 1.0, 1.0])
    assert is_zero_variance([0.1, 0.1, 0.1])  # though np.std of it is 1.4e-17
    assert not is_zero_variance([1.0, 0.0])
    # tol is on the range max - min: 1.05 - 1.0 = 0.05
    assert not is_zero_variance([1.0, 1.05])
    assert is_zero_variance([1.0, 1.05], tol=0.1)
    assert not is_zero_variance([1.0, 1.05], tol=0.01)
    assert is_zero_variance([])  # no samples, no signal
    assert is_zero_variance([7.0])


def test_registry() -> None:
    assert sorted(ADVANTAGES) == ["dr_grpo", "grpo"]
    assert ADVANTAGES["grpo"] is grpo_advantages
    assert ADVANTAGES["dr_grpo"] is dr_grpo_advantages
    assert grpo_advantages([], 1e-6) == []
    assert dr_grpo_advantages([], 1e-6) == []
