"""What a group gets: one pure rule for a complete group and a timed-out one released.

No Redis here: `score(members, trainer_version, gcfg)` decides from the members alone, so the
rule is tested with golden values (tests/unit/test_grouper_scoring.py). A member that ended
in error or timeout is masked out of the statistics; the group is dropped, with its reason
and counter, for a reward or advantage that is not finite, any member too far off policy,
fewer valid members than `min_valid_members`, or (if so configured) rewards all equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from streamrl import counters
from streamrl.config import GrouperConfig
from streamrl.rl.advantages import ADVANTAGES, is_zero_variance, masked_advantages
from streamrl.rl.clock import TrainerVersion, clock_of
from streamrl.wire import Group, Trajectory, encode_body

# What one trajectory or timeout check did: `partial`, `emitted`, `duplicate`, `dropped`,
# `closed` (a member of a group already dropped), or, after a group timeout, `rerun` (a task
# re-runs its missing members) or `released` (emitted incomplete). `complete` only stands in
# while the completed group's emit or drop runs.
OutcomeKind = Literal[
    "partial", "complete", "emitted", "duplicate", "dropped", "closed", "rerun", "released"
]
# What a group should get: `emit` or `drop` (a complete group), or after a timeout `drop`,
# `rerun` (its missing members) or `release` (emitted with the members it has).
Action = Literal["emit", "drop", "rerun", "release"]


@dataclass(frozen=True)
class Outcome:
    """What one trajectory or timeout check did to a group (`OutcomeKind`); a timeout check
    emits (or drops) a complete group that was never emitted, too."""

    kind: OutcomeKind
    group_id: str


EMITTED: tuple[OutcomeKind, ...] = ("emitted", "released")  # outcomes that wrote a group


@dataclass(frozen=True)
class Decision:
    """What a group should get (`action`), with the message to write (the group, or the
    rerun task: `body` of wire kind `kind`), the reason logged, an extra stats counter
    (`streamrl.counters`; '' none), and the group emitted or released."""

    action: Action
    reason: str
    body: bytes = b""
    kind: str = ""
    counter: str = ""
    group: Group | None = None


def build_group(members: list[Trajectory], epsilon: float, estimator: str = "grpo") -> Group:
    """The group, members in order, with advantages (`ADVANTAGES[estimator]`).

    A member that is not `valid` (it ended in error or timeout: infrastructure, not the
    policy's doing) gets advantage 0 and takes no part in the group's statistics.
    """
    members = sorted(members, key=lambda t: t.member)
    advantages = masked_advantages(
        ADVANTAGES[estimator], [m.reward for m in members], [m.valid for m in members], epsilon
    )
    return Group(
        group_id=members[0].group_id,
        task_id=members[0].task_id,
        members=members,
        advantages=advantages,
    )


def stale_reason(t: Trajectory, trainer_version: TrainerVersion, off_policy_steps: int) -> str:
    """Why `t` is too far off policy to train on; '' when it is not."""
    clock = clock_of(trainer_version)
    lag = clock.age(t.min_version)
    if t.versions and lag > off_policy_steps:
        return (
            f"stale: member {t.member}'s policy version {t.min_version} is {lag} behind "
            f"trainer version {clock}"
        )
    return ""


def score(
    members: list[Trajectory], trainer_version: TrainerVersion, gcfg: GrouperConfig
) -> Decision:
    """Emit the group with its advantages, or drop it with the reason: a reward or an
    advantage not finite, a member too far off policy (each member, however early it
    arrived), fewer valid members than min_valid_members, or rewards all equal under
    zero_variance `drop`. The one rule for a complete group and a timed-out one released."""
    members = sorted(members, key=lambda t: t.member)
    for m in members:
        if not math.isfinite(m.reward):
            reason = f"reward not finite: member {m.member} has reward {m.reward}"
            return Decision("drop", reason, counter=counters.GROUPS_NONFINITE)
    for m in members:
        if stale := stale_reason(m, trainer_version, gcfg.off_policy_steps):
            return Decision("drop", stale, counter=counters.GROUPS_STALE)
    rewards = [m.reward for m in members if m.valid]
    if len(rewards) < gcfg.min_valid_members:
        return Decision(
            "drop",
            f"{len(rewards)} of {len(members)} members valid (the others ended in error "
            f"or timeout), fewer than grouper.min_valid_members ({gcfg.min_valid_members})",
            counter=counters.GROUPS_TOO_FEW_VALID,
        )
    group = build_group(members, gcfg.advantage_epsilon, gcfg.advantage)
    for m, a in zip(members, group.advantages, strict=True):
        if not math.isfinite(a):
            reason = f"advantage not finite: member {m.member} has advantage {a}"
            return Decision("drop", reason, counter=counters.GROUPS_NONFINITE)
    zero_variance = is_zero_variance(rewards)
    if zero_variance and gcfg.zero_variance == "drop":
        reason = f"zero variance: every reward is {rewards[0]:g}"
        return Decision("drop", reason, counter=counters.GROUPS_ZERO_VARIANCE)
    return Decision(
        "emit",
        "",
        body=encode_body(group),
        kind=Group.KIND,
        counter=counters.GROUPS_ZERO_VARIANCE if zero_variance else "",
        group=group,
    )
