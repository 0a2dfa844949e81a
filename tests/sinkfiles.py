"""What the metrics sinks' tests share: a sink that records what it is given, and the
sinks' files read back (TensorBoard's own reader; W&B's transaction logs through
`streamrl.obs.sink_backends`, wandb shipping no reader of its own)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.obs.sinks import Progress

# Every name a trainer step writes (the list in streamrl.obs.sinks), the tiny task's names.
STEP_NAMES = {
    *(f"train/{n}" for n in (
        "loss", "kl", "entropy", "grad_norm", "clip_fraction", "policy_age_mean",
        "policy_age_max", "examples_per_s", "tokens_per_s", "examples", "groups", "tokens",
        "step_time_s", "policy_version", "mismatch_kl", "mismatch_kl_seq",
        "mismatch_logp_abs", "correction_fraction",
    )),
    "task/arithmetic/reward", "task/arithmetic/solve_rate",
}  # fmt: skip
RUN_NAMES = {
    f"{name}{suffix}"
    for name in (
        "run/trajectories", "run/groups", "run/tool_calls", "drops/all", "drops/stale",
        "drops/stale_at_trainer", "drops/too_few_valid", "drops/nonfinite",
        "drops/zero_variance", "drops/other",
    )
    for suffix in ("_total", "_per_min")
}  # fmt: skip


@dataclass
class Recording:
    """A sink that keeps what it is given (and fails at the stages named in `fail`:
    "open", "step N", "eval", "flush")."""

    name: str = "rec"
    held: Progress = field(default_factory=Progress)
    fail: dict[str, BaseException] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    evals: list[int] = field(default_factory=list)
    values: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> its values
    flushes: int = 0
    closed: bool = False

    def _maybe_fail(self, stage: str) -> None:
        if stage in self.fail:
            raise self.fail[stage]

    def open(self) -> Progress:
        self._maybe_fail("open")
        return Progress(self.held.step, self.held.eval_step)

    def write_step(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._maybe_fail(f"step {step}")
        self.steps.append(step)
        self.values[step] = dict(values)

    def write_eval(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._maybe_fail("eval")
        self.evals.append(step)

    def flush(self) -> None:
        self._maybe_fail("flush")
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def tensorboard_scalars(root: Path) -> dict[str, list[int]]:
    """Tag -> the steps of its values, in the order TensorBoard's EventAccumulator reads
    them from every event file under `root`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_rows(run_dir: Path) -> tuple[str, list[tuple[Path, int, dict[str, Any]]]]:
    """The run's W&B id and its history rows (file, W&B step, values) in file order."""
    from streamrl.obs.sink_backends import WANDB_STATE, wandb_files, wandb_history

    root = run_dir / "wandb"
    run_id: str = json.loads((root / WANDB_STATE).read_text())["run_id"]
    rows = [
        (path, step, row) for path in wandb_files(root, run_id) for step, row in wandb_history(path)
    ]
    return run_id, rows
