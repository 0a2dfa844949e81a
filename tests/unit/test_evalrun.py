"""The evaluator's file protocol (streamrl.evaluation.watch): claims, skips, drain, results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from streamrl.config import ConfigError, parse_config
from streamrl.evaluation import watch as evalrun

LOG = structlog.get_logger()


def _snapshot(root: Path, step: int, written_at: float = 100.0) -> Path:
    path = root / evalrun.PENDING / f"step-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w")
    (path / evalrun.SNAPSHOT_WRITTEN).write_text(repr(written_at))
    return path


def test_claim_takes_the_newest_and_drops_the_older(tmp_path: Path) -> None:
    for step in (0, 10, 20):
        _snapshot(tmp_path, step)
    taken = evalrun.claim(tmp_path)
    assert taken is not None
    step, path, skipped = taken
    assert (step, skipped) == (20, [0, 10])
    assert path == tmp_path / evalrun.RUNNING / "step-20" and path.is_dir()
    assert evalrun.pending(tmp_path) == [] and evalrun.claim(tmp_path) is None
    assert evalrun.has_step(tmp_path, 20) and not evalrun.has_step(tmp_path, 10)


def test_claim_every_takes_the_oldest_and_drops_none(tmp_path: Path) -> None:
    for step in (0, 10, 20):
        _snapshot(tmp_path, step)
    steps = []
    while (taken := evalrun.claim(tmp_path, every=True)) is not None:
        steps.append(taken[0])
        assert taken[2] == []
    assert steps == [0, 10, 20]


def test_release_returns_what_a_dead_evaluator_claimed(tmp_path: Path) -> None:
    _snapshot(tmp_path, 5)
    assert evalrun.claim(tmp_path) is not None
    assert evalrun.release_claims(tmp_path) == [5]
    assert [s for s, _ in evalrun.pending(tmp_path)] == [5]


def test_prune_pending_keeps_the_newer(tmp_path: Path) -> None:
    for step in (0, 10, 20):
        _snapshot(tmp_path, step)
    assert evalrun.prune_pending(tmp_path, 20) == [0, 10]
    assert [s for s, _ in evalrun.pending(tmp_path)] == [20]


def _result(step: int, rate: float) -> dict[str, Any]:
    return {"step": step, "solve_rate": rate, "task": "arithmetic"}


def test_results_and_summary_by_step(tmp_path: Path) -> None:
    assert evalrun.eval_summary(tmp_path)["eval_solve_rate_first"] is None
    for step, rate in ((20, 0.9), (0, 0.1), (10, 0.5)):
        evalrun.write_result(tmp_path, step, _result(step, rate))
    (tmp_path / "step-30.json").write_text("{not json")  # skipped, not fatal
    s = evalrun.eval_summary(tmp_path)
    assert s["eval_solve_rate_first"] == 0.1 and s["eval_solve_rate_last"] == 0.9
    assert (s["eval_step_first"], s["eval_step_last"]) == (0, 20)
    assert s["eval"] == [[0, 0.1], [10, 0.5], [20, 0.9]]
    assert not list(tmp_path.glob(".*.tmp"))
    # The newest readable result, step 30's damaged file passed over.
    latest = evalrun.latest_result(tmp_path)
    assert latest is not None and (latest["step"], latest["solve_rate"]) == (20, 0.9)
    assert evalrun.latest_result(tmp_path / "none") is None


def test_watch_evaluates_newest_sets_aside_unreadable_and_drains(tmp_path: Path) -> None:
    _snapshot(tmp_path, 0, written_at=1.5)
    _snapshot(tmp_path, 3)
    bad = _snapshot(tmp_path, 7)
    (bad / "model.safetensors").write_bytes(b"damaged")
    seen: list[int] = []

    def evaluate(step: int, path: Path) -> dict[str, Any]:
        seen.append(step)
        if (path / "model.safetensors").read_bytes() == b"damaged":
            raise evalrun.SnapshotError("not a readable safetensors file")
        if step == 7:
            raise AssertionError("unreachable")
        # A later snapshot appears while this one is evaluated: evaluated next.
        if step == 3 and not evalrun.has_step(tmp_path, 9):
            _snapshot(tmp_path, 9, written_at=2.5)
        return _result(step, step / 10)

    # The newest (7) is unreadable: set aside, and the evaluator goes on with what is left
    # (nothing: 0 and 3 were dropped when 7 was claimed), then drains.
    evalrun.request_drain(tmp_path)
    assert evalrun.watch(tmp_path, evaluate, lambda: False, LOG, poll_s=0.01) == 0
    assert seen == [7] and (tmp_path / evalrun.FAILED / "step-7").is_dir()
    assert evalrun.has_step(tmp_path, 7)  # a resumed trainer does not write it again

    evalrun.clear_drain(tmp_path)
    _snapshot(tmp_path, 3)
    calls = iter([False, False, True])
    seen.clear()
    assert evalrun.watch(tmp_path, evaluate, lambda: next(calls), LOG, poll_s=0.01) == 2
    assert seen == [3, 9]
    r = json.loads((tmp_path / "step-9.json").read_text())
    assert (r["step"], r["solve_rate"], r["written_at"]) == (9, 0.9, 2.5)
    assert not (tmp_path / evalrun.RUNNING / "step-9").exists()  # deleted once evaluated


def test_eval_every_needs_a_transformer() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.eval_every"):
        parse_config(
            {"model": {"kind": "stub", "init": "checkpoint"}, "trainer": {"eval_every": 5}}
        )
    with pytest.raises(ConfigError, match=r"trainer\.eval_niceness"):
        parse_config({"trainer": {"eval_niceness": 20}})


def test_a_baseline_that_cannot_judge_this_run_is_refused(tmp_path: Path) -> None:
    """Review N21: a NaN solve rate in the baseline passed every policy (`hi < NaN` is
    false), and a baseline of another split, threshold or of more tasks was taken as one.
    Each is a usage error now; a like-for-like baseline still gives a verdict."""
    from streamrl.evaluation import EvalError, gate_result, read_baseline

    rate = {"value": 0.5, "lo": 0.2, "hi": 0.8, "n": 8}
    result = {"task": "arith", "n": 8, "solve_threshold": 1.0, "split": {"digest": "abc"},
              "greedy": {"solve_rate": rate}, "solve_rate": 0.5}  # fmt: skip

    def baseline(**changes: object) -> Path:
        path = tmp_path / "baseline.json"
        path.write_text(json.dumps({**result, **changes}))
        return path

    for bad in (float("nan"), float("inf"), 1.5, -0.1):
        with pytest.raises(EvalError, match=r"is not in \[0, 1\]"):
            read_baseline(baseline(solve_rate=bad))
    with pytest.raises(EvalError, match="split is"):
        gate_result(result, read_baseline(baseline(split={"digest": "xyz"})), 0.1)
    with pytest.raises(EvalError, match=r"solve_threshold is 0\.5"):
        gate_result(result, read_baseline(baseline(solve_threshold=0.5)), 0.1)
    with pytest.raises(EvalError, match="evaluates 8 tasks, the baseline 64"):
        gate_result(result, read_baseline(baseline(n=64)), 0.1)
    assert gate_result(result, read_baseline(baseline()), 0.1).passed
    assert not gate_result(result, read_baseline(baseline(solve_rate=0.95)), 0.1).passed
