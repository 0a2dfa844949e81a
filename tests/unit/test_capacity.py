"""The backlog rollout capacity needs (streamrl.capacity.auto_backlog), worked by hand."""

from __future__ import annotations

import pytest

from streamrl.capacity import auto_backlog


def test_one_worker_needs_its_slots_and_two_waves() -> None:
    # C = 64, G = 4: 64 tasks may each hold one running member (stragglers), and a wave of
    # reads is 64 / 4 = 16 tasks: 64 + 2 * 16 = 96.
    assert auto_backlog([64], 4) == 96
    # C = 256, G = 4: 256 + 2 * 64 = 384 (the backlog issue 29's run needed by hand).
    assert auto_backlog([256], 4) == 384


def test_waves_round_up_per_worker_and_workers_add() -> None:
    # C = 10, G = 4: a wave is ceil(10 / 4) = 3 tasks: 10 + 6 = 16; two such workers: 32.
    assert auto_backlog([10], 4) == 16
    assert auto_backlog([10, 10], 4) == 32
    # Workers of different sizes: (128 + 2 * 32) + (1 + 2 * 1) = 192 + 3.
    assert auto_backlog([128, 1], 4) == 195


def test_no_live_worker_needs_nothing_and_bad_group_size_is_refused() -> None:
    assert auto_backlog([], 4) == 0 and auto_backlog([0], 4) == 0
    with pytest.raises(ValueError, match="group_size"):
        auto_backlog([8], 0)
