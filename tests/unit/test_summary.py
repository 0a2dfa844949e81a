"""summary.json and the progress line as pure functions, on figures worked by hand."""

from __future__ import annotations

import pytest

from streamrl import counters as c
from streamrl.run.summary import ProcRecord, progress_line, reward_ends, summarize

PROCS = [
    ProcRecord("trainer-0", 101, 0, restarts=2, hangs=1),  # crashed twice, hung once
    ProcRecord("rollout-0", 102, -15, restarts=0, hangs=0),
]


def summary(**kw: object) -> dict[str, object]:
    args: dict[str, object] = {
        "run": "r",
        "reason": "trainer finished 7 steps",
        "elapsed_s": 12.3456,
        "stats": {},
        "rewards": [],
        "dead": 0,
        "evals": {},
        "procs": PROCS,
        "redis_restarts": 0,
        "resumed": False,
    }
    return summarize(**{**args, **kw})  # type: ignore[arg-type]


def test_reward_ends_take_half_the_steps_up_to_five() -> None:
    # 7 steps: k = min(5, 7 // 2) = 3; (0.1 + 0.2 + 0.3) / 3 = 0.2, (0.5 + 0.6 + 0.7) / 3 = 0.6
    first, last = reward_ends([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert (first, last) == (pytest.approx(0.2), pytest.approx(0.6))
    assert reward_ends([0.5]) == (0.5, 0.5)  # k is at least 1
    assert reward_ends([float(i) for i in range(20)]) == (2.0, 17.0)  # k 5: 10/5, 85/5
    assert reward_ends([]) == (None, None)


def test_restarts_hangs_and_exit_codes() -> None:
    s = summary(redis_restarts=1)
    assert s["worker_restarts"] == {"trainer-0": 2, "rollout-0": 0}
    assert s["worker_hangs"] == {"trainer-0": 1}  # only the workers that hung
    assert s["worker_exit_codes"] == {"trainer-0": 0, "rollout-0": -15}
    assert s["worker_pids"] == {"trainer-0": 101, "rollout-0": 102}
    assert (s["redis_restarts"], s["elapsed_s"]) == (1, 12.35)


def test_a_zero_variance_drop_and_a_replayed_dead_letter() -> None:
    # 10 groups emitted, 3 more dropped for zero variance (12 trajectories: 3 groups of 4);
    # 3 entries were dead-lettered and 2 replayed since: 1 waits in the stream now
    stats = {
        c.GROUPS: 10,
        c.GROUPS_DROPPED: 3,
        c.GROUPS_ZERO_VARIANCE: 3,
        c.TRAJECTORIES_DROPPED: 12,
        c.DEAD_LETTERS: 3,
        c.EPISODES_OK: 50,
        c.EPISODES_TIMEOUT: 2,
    }
    s = summary(stats=stats, dead=1)
    assert (s["groups"], s["groups_dropped"], s["trajectories_dropped"]) == (10, 3, 12)
    assert s["dead_letters"] == 1  # what waits now, not the 3 ever written
    assert s["episodes"] == {"ok": 50, "timeout": 2, "error": 0, "truncated": 0}
    assert s["max_trajectory_policy_version"] == -1  # none recorded


def test_redis_lost_for_good() -> None:
    # the counters as last read, no per-step rewards, no dead-letter count
    s = summary(stats={c.TRAINER_STEPS: 4}, rewards=[], dead=None, available=False)
    assert (s["redis_available"], s["trainer_steps"], s["dead_letters"]) == (False, 4, None)
    assert (s["mean_reward_first"], s["mean_reward_last"], s["rewards_per_step"]) == (
        None,
        None,
        [],
    )


def test_the_progress_line() -> None:
    stats = {c.TRAINER_STEPS: 3, c.POLICY_VERSION: 4, c.TRAJECTORIES: 96, c.TOOL_CALLS: 40}
    line = progress_line(7.25, stats, 20, 12.5, 0.4567, 2, {"solve_rate": 0.5, "step": 2})
    assert line == (
        "[   7.2s] step 3/20 | policy v4 |  12.5 groups/min | reward 0.457 | traj 96 | "
        "tool calls 40 | dropped 0 | dead 2 | held-out 0.50 @ step 2"
    )
    assert progress_line(0.0, {}, 0, 0.0, float("nan"), 0).startswith("[   0.0s] step 0/- |")
