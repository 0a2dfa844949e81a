"""What `streamrl up` reports: summary.json and the progress line, pure functions of what the
launcher read (the run's counters, the trainer's metrics, the dead letters, the evaluator's
results and its own records of the processes), so the figures users read are unit-tested.

`trajectories` counts writes: a member re-run after a group timeout, or replayed after its
rollout worker died, counts again (`streamrl.counters`). `elapsed_s` is this invocation's.
`dead_letters` is what waits in the dead-letter stream now (a replay takes entries out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import redis
import structlog

from streamrl import counters as c
from streamrl.names import Keys
from streamrl.transport import hgetall_bytes, xrange_entries
from streamrl.wire import Status, TaskFigures, TrainMetrics, WireError, decode

if TYPE_CHECKING:
    from streamrl.evaluation.watch import EvalSummary
    from streamrl.jsontypes import JSON

# What the launcher prints of the summary when the run ends.
SUMMARY_SHOWN = (
    "trainer_steps",
    "policy_version",
    "groups",
    "groups_dropped",
    "dead_letters",
    "tool_calls",
    "max_trajectory_policy_version",
    "mean_reward_first",
    "mean_reward_last",
    "eval_solve_rate_first",
    "eval_solve_rate_last",
)

Stats = Mapping[str, int | float]  # the stats hash, fields decoded (`streamrl.counters`)


@dataclass(frozen=True)
class ProcRecord:
    """One worker as the launcher saw it at the end: its last pid and exit code, its
    restarts and the times it was killed for a silent liveness beat."""

    worker_id: str
    pid: int
    exit_code: int | None
    restarts: int
    hangs: int


def reward_ends(rewards: list[float]) -> tuple[float | None, float | None]:
    """The mean reward of the first and of the last k steps, k = half the steps, at least
    1 and at most 5 (None, None without a step)."""
    if not rewards:
        return None, None
    k = max(1, min(5, len(rewards) // 2))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def summarize(
    *,
    run: str,
    reason: str,
    elapsed_s: float,
    stats: Stats,
    rewards: list[float],
    dead: int | None,
    evals: EvalSummary,
    procs: list[ProcRecord],
    redis_restarts: int,
    resumed: bool,
    available: bool = True,
    task_steps: Sequence[tuple[int, Mapping[str, TaskFigures]]] = (),
) -> dict[str, object]:
    """summary.json. `stats`: the counters (the last read, when Redis is gone for good:
    `available` False, and then no `rewards` per step and `dead` None); `rewards`: each
    step's mean reward, in step order; `evals`: the evaluator's (`evalrun.eval_summary`);
    `task_steps`: each step's figures per task (`TrainMetrics.tasks`), for a mixture's
    `tasks` block (`task_summary`)."""
    first, last = reward_ends(rewards)
    tasks = task_summary(stats, task_steps, evals.get("eval_tasks") or {})
    return {
        "run": run,
        "exit_reason": reason,
        "elapsed_s": round(elapsed_s, 2),  # this invocation's
        "redis_available": available,
        "trainer_steps": stats.get(c.TRAINER_STEPS, 0),
        "policy_version": stats.get(c.POLICY_VERSION, 0),
        "trajectories": stats.get(c.TRAJECTORIES, 0),
        "groups": stats.get(c.GROUPS, 0),
        "groups_trained": stats.get(c.GROUPS_TRAINED, 0),
        "groups_dropped": stats.get(c.GROUPS_DROPPED, 0),
        "trajectories_dropped": stats.get(c.TRAJECTORIES_DROPPED, 0),
        "dead_letters": dead,  # waiting in the dead-letter stream now
        "tool_calls": stats.get(c.TOOL_CALLS, 0),
        "tool_errors": stats.get(c.TOOL_ERRORS, 0),
        "tool_infra_errors": stats.get(c.TOOL_INFRA_ERRORS, 0),
        "episodes": {st: stats.get(c.episodes(st), 0) for st in get_args(Status)},
        "max_trajectory_policy_version": stats.get(c.MAX_TRAJECTORY_POLICY_VERSION, -1),
        "mean_reward_first": first,
        "mean_reward_last": last,
        "rewards_per_step": rewards,
        # held-out greedy solve rates (trainer.eval_every; None when off)
        **evals,
        "worker_pids": {p.worker_id: p.pid for p in procs},
        "worker_exit_codes": {p.worker_id: p.exit_code for p in procs},
        "worker_restarts": {p.worker_id: p.restarts for p in procs},
        "worker_hangs": {p.worker_id: p.hangs for p in procs if p.hangs},
        "redis_restarts": redis_restarts,
        "resumed": resumed,
        **({"tasks": tasks} if tasks else {}),
    }


def task_summary(
    stats: Stats,
    task_steps: Sequence[tuple[int, Mapping[str, TaskFigures]]],
    evals: Mapping[str, Sequence[Sequence[JSON]]],
) -> dict[str, dict[str, object]]:
    """A mixture's figures per task (empty for a run of one task): its counters
    (`counters.PER_TASK`), groups trained, the mean reward of its first and last steps
    (`reward_ends` over the steps that trained any of its groups), its rewards and solve
    rates per step as [step, value], and its held-out solve rates as [step, value]."""
    counts = c.by_task(stats)
    labels = sorted(set(counts) | {label for _, fs in task_steps for label in fs} | set(evals))
    if len(labels) < 2:
        return {}
    out: dict[str, dict[str, object]] = {}
    for label in labels:
        steps = [(step, fs[label]) for step, fs in task_steps if label in fs]
        first, last = reward_ends([f.reward_mean for _, f in steps])
        heldout = [list(e) for e in evals.get(label, [])]
        out[label] = {
            **{field: counts.get(label, {}).get(field, 0) for field in c.PER_TASK},
            "groups_trained": sum(f.groups for _, f in steps),
            "mean_reward_first": first,
            "mean_reward_last": last,
            "rewards_per_step": [[step, f.reward_mean] for step, f in steps],
            "solve_rate_per_step": [[step, f.solve_rate] for step, f in steps],
            "eval": heldout,
            "eval_solve_rate_last": heldout[-1][1] if heldout else None,
        }
    return out


def progress_line(
    elapsed_s: float,
    stats: Stats,
    steps: int,
    groups_per_min: float,
    reward: float,
    dead: int,
    heldout: Mapping[str, object] | None = None,
) -> str:
    """The launcher's progress line; `heldout`: the evaluator's newest result, if any."""
    line = (
        f"[{elapsed_s:6.1f}s] step {stats.get(c.TRAINER_STEPS, 0)}"
        f"/{steps or '-'} | policy v{stats.get(c.POLICY_VERSION, 0)} | "
        f"{groups_per_min:5.1f} groups/min | reward {reward:.3f} | "
        f"traj {stats.get(c.TRAJECTORIES, 0)} | tool calls {stats.get(c.TOOL_CALLS, 0)} | "
        f"dropped {stats.get(c.GROUPS_DROPPED, 0)} | dead {dead}"
    )
    if heldout is not None:
        line += f" | held-out {heldout['solve_rate']:.2f} @ step {heldout['step']}"
    return line


def read_stats(client: redis.Redis, keys: Keys) -> dict[str, int | float]:
    """The run's counters: whole ones, and sums of seconds (HINCRBYFLOAT)."""
    return {k: _number(v) for k, v in hgetall_bytes(client, keys.stats).items()}


def _number(raw: bytes) -> int | float:
    """A counter's value: an int, or a float for a sum kept by HINCRBYFLOAT."""
    try:
        return int(raw)
    except ValueError:
        return float(raw)


def step_metrics(
    client: redis.Redis, keys: Keys, log: structlog.stdlib.BoundLogger
) -> list[TrainMetrics]:
    """Each step's metrics once, by step: the last entry of a step that a restarted trainer
    trained again (the stream keeps the entries of the steps it discarded too)."""
    by_step: dict[int, TrainMetrics] = {}
    unreadable = 0
    for _id, fields in xrange_entries(client, keys.metrics):
        try:
            m = decode(fields, TrainMetrics)
        except WireError:
            unreadable += 1
            continue
        by_step[m.step] = m
    if unreadable:
        log.warning("metrics_unreadable", entries=unreadable, stream=keys.metrics)
    return [by_step[k] for k in sorted(by_step)]
