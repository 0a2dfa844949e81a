"""Group-relative advantages against golden values worked out by hand."""

import math

import numpy as np
import pytest

from streamrl.rl.advantages import (
    ADVANTAGES,
    dr_grpo_advantages,
    grpo_advantages,
    is_zero_variance,
    masked_advantages,
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


def test_masked_members_take_no_part_in_the_statistics() -> None:
    # rewards -1.5, -3.0, and 7.0 for a member masked out (an infrastructure error or a
    # timeout): mean (-1.5 + -3.0) / 2 = -2.25, deviations +0.75 and -0.75, std 0.75.
    # grpo (epsilon 0): +0.75/0.75 = 1, -0.75/0.75 = -1; the masked member gets 0.
    rewards, valid = [-1.5, -3.0, 7.0], [True, True, False]
    assert masked_advantages(grpo_advantages, rewards, valid, 0.0) == [1.0, -1.0, 0.0]
    # dr_grpo: r - mean = -1.5 - -2.25 = 0.75, -3.0 - -2.25 = -0.75
    assert masked_advantages(dr_grpo_advantages, rewards, valid, 0.0) == [0.75, -0.75, 0.0]
    # unmasked, 7.0 would count: mean (-1.5 - 3.0 + 7.0) / 3 = 0.8333, and -1.5 - 0.8333
    # = -2.3333 for the first member under dr_grpo
    assert dr_grpo_advantages(rewards, 0.0)[0] == pytest.approx(-2.3333, abs=1e-4)


def test_masked_members_in_the_middle_keep_their_places() -> None:
    # valid rewards 1, 0, 1 (members 0, 2, 4): mean 2/3, deviations 1/3, -2/3, 1/3,
    # variance (1/9 + 4/9 + 1/9) / 3 = 2/9, std sqrt(2)/3 = 0.4714;
    # 1/3 / 0.4714 = 0.7071, -2/3 / 0.4714 = -1.4142; masked members 1 and 3 get 0
    adv = masked_advantages(
        grpo_advantages, [1.0, 9.0, 0.0, -9.0, 1.0], [True, False, True, False, True], 0.0
    )
    assert [round(a, 4) for a in adv] == [0.7071, 0.0, -1.4142, 0.0, 0.7071]


def test_masked_all_or_none() -> None:
    # no member valid: nothing to compare, every advantage 0
    assert masked_advantages(grpo_advantages, [1.0, 0.0], [False, False], 0.0) == [0.0, 0.0]
    # every member valid: the plain advantages (1, 0: mean 0.5, std 0.5 -> +1, -1)
    assert masked_advantages(grpo_advantages, [1.0, 0.0], [True, True], 0.0) == [1.0, -1.0]
    with pytest.raises(ValueError, match="2 rewards, 1 valid flags"):
        masked_advantages(grpo_advantages, [1.0, 0.0], [True], 0.0)
