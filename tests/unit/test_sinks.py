"""Metrics sinks, the pure part (`streamrl.obs.sinks`): a step's metrics, the run's counters
and an evaluation as named values; the rates; a sink skipping what it holds already; a sink
that fails, logged once and disabled while the others go on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from streamrl import counters as c
from streamrl.config import load_config
from streamrl.obs.sinks import (
    Guarded,
    Progress,
    Rates,
    eval_values,
    run_totals,
    run_values,
    tag_part,
    train_values,
)
from streamrl.run.launcher import SINKS, Launcher, WorkerProc, plan
from streamrl.wire import TrainMetrics
from tests.helpers import TINY
from tests.sinkfiles import RUN_NAMES, STEP_NAMES, Recording


def metrics(step: int, **kw: Any) -> TrainMetrics:
    fields: dict[str, Any] = dict(
        step=step, version=step - 1, loss=0.5, reward_mean=0.25, num_groups=2,
        num_sequences=8, num_tokens=100, clip_fraction=0.125, grad_norm=1.5,
        max_policy_lag=2, step_time_s=0.5, kl=0.01, entropy=1.25, solve_rate=0.125,
        policy_age_mean=1.5, mismatch_kl=0.002,
    )  # fmt: skip
    return TrainMetrics(**{**fields, **kw})


def test_a_step_s_values_by_name() -> None:
    v = train_values(metrics(3), "arithmetic")
    assert set(v) == STEP_NAMES
    assert v["train/examples_per_s"] == 16.0  # 8 sequences in 0.5 s
    assert v["train/tokens_per_s"] == 200.0  # 100 tokens in 0.5 s
    assert (v["train/loss"], v["train/kl"], v["train/entropy"]) == (0.5, 0.01, 1.25)
    assert (v["train/policy_age_mean"], v["train/policy_age_max"]) == (1.5, 2.0)
    assert (v["task/arithmetic/reward"], v["task/arithmetic/solve_rate"]) == (0.25, 0.125)
    assert v["train/policy_version"] == 2.0
    # a step of no measured time (the stub's): no rate rather than a division by zero
    assert train_values(metrics(1, step_time_s=0.0), "x")["train/examples_per_s"] == 0.0


def test_a_task_s_name_is_one_part_of_a_metric_name() -> None:
    assert tag_part("arithmetic") == "arithmetic"
    assert tag_part("my_pkg.tasks:Unit Conv") == "my_pkg.tasks_Unit_Conv"
    assert "task/my_pkg.tasks_Unit_Conv/reward" in train_values(
        metrics(1), "my_pkg.tasks:Unit Conv"
    )


STATS = {
    c.TRAJECTORIES: 40, c.GROUPS: 12, c.TOOL_CALLS: 7, c.GROUPS_DROPPED: 10,
    c.GROUPS_STALE: 3, c.TRAINER_GROUPS_STALE: 1, c.GROUPS_TOO_FEW_VALID: 2,
    c.GROUPS_NONFINITE: 1, c.GROUPS_ZERO_VARIANCE: 5,
}  # fmt: skip


def test_drops_by_reason_and_what_no_reason_names() -> None:
    # zero_variance "keep": its 5 groups were kept, no drops; of the 10 dropped, the reasons
    # name 3 + 1 + 2 + 1 = 7, the other 3 (timeouts) are "other"
    kept = run_totals(STATS, zero_variance_drops=False)
    assert kept == {
        "run/trajectories": 40.0, "run/groups": 12.0, "run/tool_calls": 7.0,
        "drops/all": 10.0, "drops/stale": 3.0, "drops/stale_at_trainer": 1.0,
        "drops/too_few_valid": 2.0, "drops/nonfinite": 1.0, "drops/zero_variance": 0.0,
        "drops/other": 3.0,
    }  # fmt: skip
    # zero_variance "drop": 12 dropped = 3 + 1 + 2 + 1 + 5, nothing else
    dropped = run_totals({**STATS, c.GROUPS_DROPPED: 12}, zero_variance_drops=True)
    assert (dropped["drops/zero_variance"], dropped["drops/other"]) == (5.0, 0.0)
    # a fresh run: every name, all 0
    assert set(run_totals({}, False).values()) == {0.0}


def test_rates_are_per_minute_since_the_last_pass() -> None:
    rates = Rates(100.0, {"run/groups": 0.0, "drops/all": 2.0})
    # 10 groups and 1 drop in 30 s: 20 and 2 a minute
    assert rates.update(130.0, {"run/groups": 10.0, "drops/all": 3.0}) == {
        "run/groups": 20.0,
        "drops/all": 2.0,
    }
    # no time between two passes: 0, not a division by zero
    assert rates.update(130.0, {"run/groups": 11.0, "drops/all": 3.0})["run/groups"] == 0.0
    assert run_values({"run/groups": 11.0}, {"run/groups": 0.5}) == {
        "run/groups_total": 11.0,
        "run/groups_per_min": 0.5,
    }
    assert set(run_values(run_totals({}, False), run_totals({}, False))) == RUN_NAMES


RESULT = {
    "step": 4, "task": "arithmetic", "solve_rate": 0.25,
    "greedy": {
        "episodes": 8,
        "solve_rate": {"value": 0.25, "lo": 0.07, "hi": 0.59, "n": 8},
        "reward_mean": {"value": 0.4, "lo": 0.1, "hi": 0.7, "n": 8},
        "error_rate": {"value": 0.0, "lo": 0.0, "hi": 0.32, "n": 8},
        "truncation_rate": {"value": 0.125, "lo": 0.02, "hi": 0.47, "n": 8},
        "tool_call_wellformed_rate": None,
    },
}  # fmt: skip


def test_an_evaluation_s_values_by_name() -> None:
    assert eval_values(RESULT, "arithmetic") == {
        "eval/arithmetic/solve_rate": 0.25,
        "eval/arithmetic/solve_rate_lo": 0.07,
        "eval/arithmetic/solve_rate_hi": 0.59,
        "eval/arithmetic/reward": 0.4,
        "eval/arithmetic/error_rate": 0.0,
        "eval/arithmetic/truncation_rate": 0.125,
    }
    # a result with the headline only (an older schema): that
    assert eval_values({"step": 1, "solve_rate": 0.5}, "t") == {"eval/t/solve_rate": 0.5}


def test_a_sink_skips_the_steps_it_holds_and_a_step_trained_again() -> None:
    """Resumed with steps 1-3 and the evaluation of step 2 in its files: it writes from 4
    on; a step trained again after a trainer restart (5 below) keeps its first figures."""
    rec = Recording(held=Progress(step=3, eval_step=2))
    g = Guarded(rec, structlog.get_logger())
    g.open()
    for step in (1, 2, 3, 4, 5, 5, 6):
        g.step(step, {"train/loss": float(step)}, 0.0)
    for step in (0, 2, 4):
        g.evaluation(step, {"eval/t/solve_rate": 0.5}, 0.0)
    g.flush()
    g.close()
    assert rec.steps == [4, 5, 6] and rec.evals == [4]
    assert (g.written, g.skipped) == (3, 4)
    assert (g.progress.step, g.progress.eval_step) == (6, 4)
    assert rec.flushes == 1 and rec.closed


FULL = OSError(28, "No space left on device")


@pytest.mark.parametrize(
    ("stage", "error", "logged"),
    [
        ("step 2", FULL, ("write", "OSError: [Errno 28] No space left on device")),
        ("open", ModuleNotFoundError("No module named 'wandb'"),
         ("open", "ModuleNotFoundError: No module named 'wandb'")),
        ("flush", RuntimeError("wandb core went away"),
         ("flush", "RuntimeError: wandb core went away")),
    ],
)  # fmt: skip
def test_a_failing_sink_is_logged_once_and_disabled_the_others_go_on(
    stage: str, error: BaseException, logged: tuple[str, str]
) -> None:
    bad, good = Recording("bad", fail={stage: error}), Recording("good")
    sinks = [Guarded(s, structlog.get_logger()) for s in (bad, good)]
    with structlog.testing.capture_logs() as logs:
        for s in sinks:
            s.open()
        for step in (1, 2, 3, 4):
            for s in sinks:
                s.step(step, {"train/loss": 0.0}, 0.0)
                s.evaluation(step, {"eval/t/solve_rate": 0.0}, 0.0)
            for s in sinks:
                s.flush()
        for s in sinks:
            s.close()
    failed = [e for e in logs if e["event"] == "sink_failed"]
    assert failed == [
        {"event": "sink_failed", "log_level": "error", "sink": "bad",
         "stage": logged[0], "reason": logged[1]},
    ]  # fmt: skip
    assert good.steps == [1, 2, 3, 4] and good.evals == [1, 2, 3, 4] and good.closed
    # the bad sink got nothing after its failure, and was not closed (it is broken)
    written_before = {"step 2": [1], "open": [], "flush": [1]}[stage]
    assert bad.steps == written_before and not bad.closed


def test_the_launcher_runs_the_sinks_worker_last_and_as_optional(tmp_path: Path) -> None:
    """`streamrl up` plans the sinks worker only when a sink is on; one that fails past
    run.max_restarts is given up with a log line, and the run goes on (a trainer that
    fails so stops it)."""
    sinks_on = load_config(TINY, ['logging.sinks=["tensorboard"]', "run.max_restarts=0"])
    assert plan(sinks_on)[-1] == (SINKS, 0)
    assert SINKS not in {name for name, _ in plan(load_config(TINY))}
    launcher = Launcher(sinks_on, str(TINY), [], tmp_path / "run", steps=1)
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait()

    def proc(name: str) -> WorkerProc:
        logs = tmp_path / "logs"
        return WorkerProc(name=name, index=0, popen=failed, log_path=logs / f"{name}-0.log",
                          stderr_path=logs / f"{name}-0.stderr")  # fmt: skip

    launcher.procs = [proc(SINKS)]
    with structlog.testing.capture_logs() as logs:
        assert launcher._check_workers(structlog.get_logger()) is None
        assert launcher._check_workers(structlog.get_logger()) is None  # once
    assert [e["event"] for e in logs] == ["worker_gave_up"] and launcher.procs[0].gave_up
    launcher.procs = [proc("grouper")]
    ended = launcher._check_workers(structlog.get_logger())
    assert ended is not None and ended[1] == 1
