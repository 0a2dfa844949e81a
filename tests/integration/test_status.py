"""`streamrl status`'s reader against a real Redis: workers found by their identity slots and
their counter series, liveness from the slots and beats, a frame drawn live."""

from __future__ import annotations

import io
from pathlib import Path

import redis
import structlog
from rich.console import Console

from streamrl import counters
from streamrl.evaluation import watch as evalrun
from streamrl.names import Keys
from streamrl.obs import metrics as m
from streamrl.obs.status import StatusReader, show
from streamrl.transport import publish
from streamrl.wire import TaskFigures, TrainMetrics

LOG = structlog.get_logger()


def _sample(client: redis.Redis, keys: Keys, worker_id: str, **values: float) -> None:
    metrics = m.Metrics(worker_id)
    for name, value in values.items():
        metrics.set(name, value)
    m.Sampler(
        metrics, client, keys.worker_metrics(worker_id), LOG, interval_s=1, keep_samples=10
    ).sample_once()


def test_reader_finds_workers_and_their_state(rclient: redis.Redis, keys: Keys) -> None:
    rclient.set(keys.worker_slot("rollout", 0), "h:1", px=60_000)
    rclient.set(keys.worker_beat("rollout", 0), "h:1 1", px=60_000)
    rclient.set(keys.worker_slot("grouper", 1), "h:2", px=60_000)  # no sample yet
    _sample(rclient, keys, "rollout-0", trajectories_per_min=90.0, policy_version=4)
    _sample(rclient, keys, "trainer-0", examples_per_min=30.0)  # its slot lapsed: gone
    rclient.hset(keys.stats, "trainer_steps", 7)
    clock = [1_000_000.0]
    reader = StatusReader(rclient, keys, clock=lambda: clock[0])
    snap = reader.read()
    by_id = {w.worker_id: w for w in snap.workers}
    assert list(by_id) == ["rollout-0", "grouper-1", "trainer-0"]  # kinds in pipeline order
    assert by_id["rollout-0"].state(snap.beat_age_s.get("rollout-0")) == "live"
    assert by_id["rollout-0"].values[m.TRAJECTORIES_PER_MIN] == 90.0
    assert by_id["grouper-1"].values == {} and by_id["grouper-1"].sample_age_s is None
    assert by_id["trainer-0"].holder is None and by_id["trainer-0"].state(None) == "gone"
    assert snap.stats["trainer_steps"] == "7"
    # The beat did not change for 31 s (two reads apart): the loop is stuck.
    clock[0] += 31
    snap = reader.read()
    rollout = next(w for w in snap.workers if w.worker_id == "rollout-0")
    assert rollout.state(snap.beat_age_s["rollout-0"]) == "no beat"
    rclient.set(keys.worker_beat("rollout", 0), "h:1 2", px=60_000)
    snap = reader.read()
    assert rollout.state(snap.beat_age_s["rollout-0"]) == "live"


def test_a_run_directory_adds_the_evaluators_newest_result(
    rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    evals = evalrun.eval_dir(tmp_path)
    reader = StatusReader(rclient, keys, eval_root=evals)
    assert reader.read().heldout is None  # no evaluation yet
    for step, rate in ((0, 0.0), (5, 0.91)):
        evalrun.write_result(evals, step, {"solve_rate": rate, "step": step})
    heldout = reader.read().heldout
    assert heldout is not None and (heldout["step"], heldout["solve_rate"]) == (5, 0.91)
    assert StatusReader(rclient, keys).read().heldout is None  # Redis alone: no row value


def test_live_view_redraws(rclient: redis.Redis, keys: Keys) -> None:
    rclient.set(keys.worker_slot("grouper", 0), "h:1", px=60_000)
    _sample(rclient, keys, "grouper-0", groups_per_min=12.0)
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=False)
    show(StatusReader(rclient, keys), console, once=False, every_s=0.01, frames=2)
    text = out.getvalue()
    assert "grouper-0" in text and "12.0 groups/min" in text


def test_a_mixture_gets_a_table_per_task(rclient: redis.Redis, keys: Keys, tmp_path: Path) -> None:
    """Issue 32: a mixture's counters per task (the stats hash), its reward and solve rate
    over the trainer's last steps (the metrics stream) and its held-out solve rate (the
    evaluator's newest result), one row per task."""
    for label, field, value in (
        ("arith", counters.TASKS, 30), ("arith", counters.TRAJECTORIES, 112),
        ("arith", counters.GROUPS, 27), ("units", counters.TASKS, 10),
        ("units", counters.GROUPS, 9), ("units", counters.GROUPS_DROPPED, 1),
    ):  # fmt: skip
        rclient.hset(keys.stats, counters.per_task(label, field), value)
    for step, arith_reward in ((1, 0.25), (2, 0.75)):
        m_ = TrainMetrics(
            step=step, version=step, loss=0.0, reward_mean=0.5, num_groups=2, num_sequences=8,
            num_tokens=100, clip_fraction=0.0, grad_norm=1.0, max_policy_lag=0, step_time_s=1.0,
            tasks={
                "arith": TaskFigures(groups=1, sequences=4, reward_mean=arith_reward,
                                     solve_rate=arith_reward),
                "units": TaskFigures(groups=1, sequences=4, reward_mean=0.5, solve_rate=0.0),
            },
        )  # fmt: skip
        publish(rclient, keys.metrics, m_)
    evals = evalrun.eval_dir(tmp_path)
    evalrun.write_result(
        evals, 2, {"solve_rate": 0.4, "step": 2, "tasks": {"arith": {"solve_rate": 0.7},
                                                         "units": {"solve_rate": 0.1}}}
    )  # fmt: skip
    snap = StatusReader(rclient, keys, eval_root=evals).read()
    assert snap.tasks["arith"].reward_mean == 0.5 and snap.tasks["units"].groups == 2
    out = io.StringIO()
    console = Console(file=out, width=160, color_system=None, force_terminal=False)
    show(StatusReader(rclient, keys, eval_root=evals), console, once=True)
    cells = [[c for c in line.split() if c != "│"] for line in out.getvalue().splitlines()]
    rows = {row[0]: row[1:] for row in cells if row[:1] in (["arith"], ["units"])}
    # tasks, trajectories, groups, dropped, reward, solve rate, held-out
    assert rows["arith"][:7] == ["30", "112", "27", "0", "0.500", "50.0%", "0.70"]
    assert rows["units"][:7] == ["10", "0", "9", "1", "0.500", "0.0%", "0.10"]
