"""Metrics sinks on real Redis and real files (`streamrl.obs.sinks`, `sink_backends`): the
exporter turns the trainer's metrics stream, the counters and the evaluator's results into
rows, a resumed exporter writes only what its sinks lack, a failing sink leaves the others
writing; TensorBoard and W&B continue their files across processes without a duplicate."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis
import structlog

from streamrl import counters as c
from streamrl.config import Config, load_config
from streamrl.evaluation import watch as evalrun
from streamrl.names import Keys
from streamrl.obs.sink_backends import (
    TensorBoardSink,
    WandbSink,
    tensorboard_progress,
    wandb_environment,
    wandb_progress,
)
from streamrl.obs.sinks import Exporter, Progress
from streamrl.transport import publish
from streamrl.wire import TrainMetrics
from tests.helpers import TINY
from tests.sinkfiles import Recording, tensorboard_scalars, wandb_rows


def m(step: int, reward: float) -> TrainMetrics:
    return TrainMetrics(
        step=step, version=step, loss=0.1, reward_mean=reward, num_groups=1,
        num_sequences=4, num_tokens=40, clip_fraction=0.0, grad_norm=0.5,
        max_policy_lag=0, step_time_s=0.5, created_at=1_000.0 + step,
    )  # fmt: skip


def config(keys: Keys) -> Config:
    return load_config(TINY, [f"run.name={keys.ns}"])


def result(step: int, solve_rate: float) -> dict[str, object]:
    return {"step": step, "task": "arithmetic", "solve_rate": solve_rate, "written_at": 5.0}


def test_the_exporter_writes_each_new_step_once(
    rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Steps 2 and 3 come twice (trained again after a trainer restart): each is written
    once, with its first figures; every step carries the counters as the pass read them;
    the evaluations at their steps; then a resumed exporter (a new process: it reads the
    stream from its start) writes only what its sink lacks."""
    cfg = config(keys)
    for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)]:
        publish(rclient, keys.metrics, m(step, reward))
    rclient.hset(keys.stats, mapping={c.GROUPS: 6, c.GROUPS_DROPPED: 2, c.GROUPS_STALE: 2})
    root = evalrun.eval_dir(tmp_path)
    evalrun.write_result(root, 0, result(0, 0.0))
    evalrun.write_result(root, 4, result(4, 0.5))
    times = iter([100.0, 130.0, 160.0])
    rec, bad = Recording(), Recording("bad", fail={"step 3": OSError(28, "disk full")})
    exporter = Exporter(rclient, keys, cfg, tmp_path, [rec, bad], structlog.get_logger(),
                        clock=lambda: next(times))  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        exporter.open()  # counters' baseline at t=100
        rclient.hset(keys.stats, c.GROUPS, 16)
        assert exporter.pass_once() == 6
    assert rec.steps == [1, 2, 3, 4] and rec.evals == [0, 4]
    rewards = [rec.values[s]["task/arithmetic/reward"] for s in rec.steps]
    assert rewards == [0.1, 0.2, 0.3, 0.4]  # the first figures of 2 and 3
    assert rec.values[4]["run/groups_total"] == 16.0
    assert rec.values[4]["run/groups_per_min"] == 20.0  # 10 more groups in 30 s
    assert rec.values[4]["drops/stale_total"] == 2.0 and rec.values[4]["drops/other_total"] == 0
    # the failing sink: logged once, written up to its failure, the others went on
    assert bad.steps == [1, 2] and not exporter.sinks[1].alive
    assert [e["sink"] for e in logs if e["event"] == "sink_failed"] == ["bad"]
    # a later pass: the new entries only
    publish(rclient, keys.metrics, m(5, 0.5))
    assert exporter.pass_once() == 1 and rec.steps == [1, 2, 3, 4, 5]
    assert rec.values[5]["run/groups_per_min"] == 0.0  # none in the last 30 s

    # resumed: its sink holds steps 1-4 and the evaluation of 0
    again = Recording(held=Progress(step=4, eval_step=0))
    resumed = Exporter(rclient, keys, cfg, tmp_path, [again], structlog.get_logger())
    resumed.open()
    publish(rclient, keys.metrics, m(6, 0.6))
    assert resumed.pass_once() == 8  # every entry read, the old ones skipped
    assert again.steps == [5, 6] and again.evals == [4]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty $HOME (nothing may be written there), and the W&B environment the sink
    sets restored after the test."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("HOME", str(path))
    for name in wandb_environment(tmp_path, "offline"):
        monkeypatch.setenv(name, "")
    return path


def write(sink: TensorBoardSink | WandbSink, steps: range, evals: list[int]) -> Progress:
    """Open `sink`, write `steps` (then `evals`) as the exporter does, close it."""
    held = sink.open()
    for step in steps:
        if step > held.step:
            sink.write_step(step, {"train/loss": 1.0 / step, "run/groups_total": 4.0 * step}, 0.0)
    for step in evals:
        if step > held.eval_step:
            sink.write_eval(step, {"eval/t/solve_rate": step / 10}, 0.0)
    sink.flush()
    sink.close()
    return held


def test_tensorboard_continues_its_directory(tmp_path: Path) -> None:
    root = tmp_path / "tensorboard"
    assert write(TensorBoardSink(root), range(1, 4), [0, 2]) == Progress(-1, -1)
    # a second process (at once: the same second, another file read after the first)
    held = write(TensorBoardSink(root), range(1, 6), [0, 2, 4])
    assert held == Progress(step=3, eval_step=2) == Progress(3, 2)
    assert len(list(root.glob("events.out.tfevents.*"))) == 2
    scalars = tensorboard_scalars(root)
    assert scalars["train/loss"] == [1, 2, 3, 4, 5] == scalars["run/groups_total"]
    assert scalars["eval/t/solve_rate"] == [0, 2, 4]
    assert tensorboard_progress(root) == Progress(5, 4)


def test_wandb_continues_the_same_run_offline(tmp_path: Path, home: Path) -> None:
    cfg = load_config(TINY, ['logging.sinks=["wandb"]'])
    run_dir = tmp_path / "run"
    assert write(WandbSink(run_dir, cfg), range(1, 4), [0, 2]) == Progress(-1, -1)
    assert os.environ["WANDB_MODE"] == "offline"
    held = write(WandbSink(run_dir, cfg), range(1, 6), [0, 2, 4])
    assert held == Progress(step=3, eval_step=2)
    run_id, rows = wandb_rows(run_dir)
    # one part per process, both within a second: numbered, never the same directory
    parts = sorted({path.parent.name for path, _, _ in rows})
    assert [p.split("-", 3)[:2] + p.rsplit("-", 2)[1:] for p in parts] == [
        ["offline", "run", run_id, "0000"],
        ["offline", "run", run_id, "0001"],
    ]
    trained = [row["trainer/step"] for _, _, row in rows if "trainer/step" in row]
    assert trained == [1, 2, 3, 4, 5]
    assert [row["eval/step"] for _, _, row in rows if "eval/step" in row] == [0, 2, 4]
    assert all("train/loss" in row for _, _, row in rows if "trainer/step" in row)
    steps = [step for _, step, _ in rows]
    assert steps == sorted(set(steps))  # W&B's own steps only go up, across the two files
    assert wandb_progress(run_dir / "wandb", run_id) == (Progress(5, 4), len(rows))
    assert json.loads((run_dir / "wandb" / "streamrl.json").read_text()) == {"run_id": run_id}
    assert list(home.iterdir()) == []  # nothing of W&B in $HOME
