"""The grouper's scoring rule, with no Redis: golden values worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from streamrl import counters
from streamrl.config import GrouperConfig
from streamrl.grouper.scoring import score, stale_reason
from streamrl.wire import Group, Status, Trajectory, decode_body


def member(
    i: int, reward: float, status: Status = "ok", versions: tuple[int, ...] = (5,)
) -> Trajectory:
    return Trajectory(
        traj_id=f"g-{i}",
        group_id="g",
        task_id="t",
        member=i,
        num_generations=4,
        tokens=b"",
        loss_mask=b"",
        logprobs=b"",
        prompt_len=0,
        reward=reward,
        status=status,
        versions=list(versions),
    )


def cfg(**kw: object) -> GrouperConfig:
    return GrouperConfig.model_validate({"advantage_epsilon": 1e-6, **kw})


def test_grpo_advantages_of_a_complete_group() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5, so (r - 0.5) / (0.5 + 1e-6):
    # 0.5 / 0.500001 = 0.999998
    d = score([member(2, 0.0), member(0, 1.0), member(3, 1.0), member(1, 0.0)], 5, cfg())
    assert (d.action, d.reason, d.counter) == ("emit", "", "")
    assert d.group is not None
    assert [m.member for m in d.group.members] == [0, 1, 2, 3]  # in member order
    assert d.group.advantages == pytest.approx([0.999998, -0.999998, -0.999998, 0.999998])
    assert decode_body(d.body, Group) == d.group and d.kind == Group.KIND


def test_dr_grpo_and_a_masked_member() -> None:
    # member 1 ended in error: advantage 0 and no part in the mean of the others, 3, 1, 2:
    # mean 2, so dr_grpo (r - mean) gives 1, -1, 0; member 1's reward (100) moves nothing
    members = [member(0, 3.0), member(1, 100.0, "error"), member(2, 1.0), member(3, 2.0)]
    d = score(members, 5, cfg(advantage="dr_grpo"))
    assert d.action == "emit" and d.group is not None
    assert d.group.advantages == pytest.approx([1.0, 0.0, -1.0, 0.0])


def test_zero_variance_is_counted_kept_or_dropped() -> None:
    same = [member(i, 0.5) for i in range(4)]
    kept = score(same, 5, cfg())
    assert (kept.action, kept.counter) == ("emit", counters.GROUPS_ZERO_VARIANCE)
    assert kept.group is not None and kept.group.advantages == [0.0] * 4
    dropped = score(same, 5, cfg(zero_variance="drop"))
    assert (dropped.action, dropped.counter) == ("drop", counters.GROUPS_ZERO_VARIANCE)
    assert dropped.reason == "zero variance: every reward is 0.5"


def test_too_few_valid_members() -> None:
    # 1 of 4 valid (two timeouts, one error): under min_valid_members 2
    members = [member(0, 1.0), member(1, 0.0, "timeout"), member(2, 0.0, "error")]
    members.append(member(3, 0.0, "timeout"))
    d = score(members, 5, cfg())
    assert (d.action, d.counter) == ("drop", counters.GROUPS_TOO_FEW_VALID)
    assert d.reason.startswith("1 of 4 members valid")


def test_a_reward_not_finite_drops_before_anything_else() -> None:
    # member 3 is also stale (version 1 is 4 behind 5): the non-finite reward is told first
    members = [member(0, 1.0), member(1, math.nan), member(2, 0.0), member(3, 0.0, versions=(1,))]
    d = score(members, 5, cfg())
    assert (d.action, d.counter) == ("drop", counters.GROUPS_NONFINITE)
    assert d.reason == "reward not finite: member 1 has reward nan"


def test_an_advantage_not_finite_drops_the_group() -> None:
    # rewards 1.7e308 and 1e308: finite, but their sum overflows float64, so the mean is inf
    # and r - mean is -inf (numpy's overflow warning silenced: the rule is what is tested)
    with np.errstate(over="ignore"):
        d = score([member(0, 1.7e308), member(1, 1e308)], 5, cfg(advantage="dr_grpo"))
    assert (d.action, d.counter) == ("drop", counters.GROUPS_NONFINITE)
    assert d.reason.startswith("advantage not finite: member 0")


def test_one_stale_member_drops_the_whole_group() -> None:
    # off_policy_steps 2, trainer at 5: version 3 is 2 behind (kept), version 2 is 3 (dropped),
    # whatever the member's other, newer turns
    fresh = [member(0, 1.0, versions=(3, 5)), member(1, 0.0, versions=(4,))]
    k2 = cfg(off_policy_steps=2)
    assert score(fresh, 5, k2).action == "emit"
    stale = [member(0, 1.0), member(1, 0.0, versions=(2, 5))]
    d = score(stale, 5, k2)
    assert (d.action, d.counter) == ("drop", counters.GROUPS_STALE)  # its reason counted
    assert d.reason == "stale: member 1's policy version 2 is 3 behind trainer version 5"
    # a member without model turns has no version to be stale by
    assert stale_reason(member(0, 1.0, versions=()), 100, 0) == ""
