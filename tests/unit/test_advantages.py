import math

import pytest

from streamrl.rl.advantages import ADVANTAGES, grpo_advantages


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


def test_registry() -> None:
    assert ADVANTAGES["grpo"] is grpo_advantages
    assert grpo_advantages([], 1e-6) == []
