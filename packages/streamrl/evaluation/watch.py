"""Held-out evaluation during a run (`trainer.eval_every`), off the training path.

The trainer writes the policy as a Hugging Face checkpoint directory (a snapshot) at the
start, every `eval_every` steps and at the end, into RUN_DIR/eval/pending/step-N
(`EvalSnapshotHook`), and removes older pending snapshots as it does (nobody will evaluate
them: the evaluator takes the newest), unless `trainer.eval_all` keeps every one. The
evaluator, its own process that `streamrl up` starts (`streamrl eval --watch RUN_DIR`, at
`trainer.eval_niceness`), claims the newest pending snapshot by renaming it into
eval/running/, evaluates it greedily on `trainer.eval_tasks` held-out tasks
(`streamrl.evaluation`, the rollout's own episode code) and writes eval/step-N.json (a
`streamrl eval --json` result plus `written_at`, the time the snapshot was written), then
deletes the snapshot. A snapshot it cannot read is moved to eval/failed/ and the evaluator
goes on. When the trainer is done, `streamrl up` writes eval/DRAIN: the evaluator evaluates
what is pending and exits. A restarted evaluator first returns what it had claimed to
pending/.

File operations only: the trainer and the evaluator share the run directory, never Redis.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from streamrl.jsontypes import JSON, JSONObject, json_object
from streamrl.names import RunPaths

if TYPE_CHECKING:
    import structlog

PENDING = "pending"
RUNNING = "running"
FAILED = "failed"
DRAIN = "DRAIN"
SNAPSHOT_WRITTEN = "snapshot_written_at"  # a file in each snapshot: time.time() at write
_STEP = re.compile(r"^step-(\d+)$")
_RESULT = re.compile(r"^step-(\d+)\.json$")


def eval_dir(run_dir: Path) -> Path:
    return RunPaths(run_dir).eval


def _steps(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = pattern.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def pending(root: Path) -> list[tuple[int, Path]]:
    """(step, snapshot dir) waiting for the evaluator, oldest first."""
    return _steps(root / PENDING, _STEP)


def result_path(root: Path, step: int) -> Path:
    return root / f"step-{step}.json"


def has_step(root: Path, step: int) -> bool:
    """Whether step N's snapshot was written before (pending, being evaluated, evaluated or
    set aside): a resumed trainer does not write it again."""
    return any(
        p.exists()
        for p in (
            root / PENDING / f"step-{step}",
            root / RUNNING / f"step-{step}",
            root / FAILED / f"step-{step}",
            result_path(root, step),
        )
    )


def prune_pending(root: Path, below: int) -> list[int]:
    """Remove the pending snapshots of steps below `below` (the evaluator takes the newest
    only); the steps removed."""
    removed = []
    for step, path in pending(root):
        if step < below:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    return removed


def claim(root: Path, every: bool = False) -> tuple[int, Path, list[int]] | None:
    """Take the newest pending snapshot (renamed into running/, so a second evaluator cannot
    take it too) and drop the older ones: (step, its dir, steps skipped), or None. `every`
    (trainer.eval_all): the oldest, dropping none."""
    while True:
        waiting = pending(root)
        if not waiting:
            return None
        step, path = waiting[0] if every else waiting[-1]
        running = root / RUNNING
        running.mkdir(parents=True, exist_ok=True)
        target = running / path.name
        try:
            os.rename(path, target)
        except FileNotFoundError:  # pruned or claimed meanwhile: look again
            continue
        return step, target, [] if every else prune_pending(root, step)


def release_claims(root: Path) -> list[int]:
    """Return what a previous evaluator had claimed to pending/ (it died mid-evaluation)."""
    released = []
    for step, path in _steps(root / RUNNING, _STEP):
        (root / PENDING).mkdir(parents=True, exist_ok=True)
        os.rename(path, root / PENDING / path.name)
        released.append(step)
    return released


def set_aside(root: Path, path: Path) -> Path:
    """Move a snapshot the evaluator could not read to failed/."""
    failed = root / FAILED
    failed.mkdir(parents=True, exist_ok=True)
    target = failed / path.name
    shutil.rmtree(target, ignore_errors=True)
    os.rename(path, target)
    return target


def write_result(root: Path, step: int, result: Mapping[str, object]) -> Path:
    """eval/step-N.json, written beside and renamed into place (never half-written)."""
    root.mkdir(parents=True, exist_ok=True)
    path = result_path(root, step)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _read_result(path: Path) -> JSONObject | None:
    try:
        data = json.loads(path.read_text())
        float(data["solve_rate"])
        int(data["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data if isinstance(data, dict) else None


def read_results(root: Path) -> list[JSONObject]:
    """The run's evaluation results, by step (unreadable files skipped)."""
    return [r for _, path in _steps(root, _RESULT) if (r := _read_result(path)) is not None]


def results_after(root: Path, step: int) -> list[JSONObject]:
    """The results of the steps after `step`, by step, parsing no other file (the sinks
    worker asks at each pass; unreadable files skipped)."""
    paths = [path for s, path in _steps(root, _RESULT) if s > step]
    return [r for path in paths if (r := _read_result(path)) is not None]


def latest_result(root: Path) -> JSONObject | None:
    """The result of the highest step that reads, parsing no other file (the launcher's
    progress line asks every few seconds, and a long run has many results)."""
    for _, path in reversed(_steps(root, _RESULT)):
        result = _read_result(path)
        if result is not None:
            return result
    return None


# -- reading a result (a JSON document: `read_results` checked only its solve rate and step)


def task_results(result: JSONObject) -> JSONObject:
    """A mixture's result per task (`tasks`, by task label); {} for a run of one task."""
    return json_object(result.get("tasks") or {})


class EvalSummary(TypedDict):
    """What summary.json tells of the held-out evaluations (`eval_summary`)."""

    eval_solve_rate_first: JSON
    eval_solve_rate_last: JSON
    eval_step_first: JSON
    eval_step_last: JSON
    eval: list[list[JSON]]  # [step, solve rate] of each evaluation
    eval_tasks: dict[str, list[list[JSON]]]  # a mixture's: task label -> [step, solve rate]


def eval_summary(root: Path) -> EvalSummary:
    """What summary.json tells of the held-out evaluations: the first and last solve rate
    and their steps, and every (step, solve rate)."""
    results = read_results(root)
    first = results[0] if results else None
    last = results[-1] if results else None
    return {
        "eval_solve_rate_first": first["solve_rate"] if first else None,
        "eval_solve_rate_last": last["solve_rate"] if last else None,
        "eval_step_first": first["step"] if first else None,
        "eval_step_last": last["step"] if last else None,
        "eval": [[r["step"], r["solve_rate"]] for r in results],
        # a mixture's: each task's held-out solve rate by step
        "eval_tasks": {
            label: [
                [r["step"], json_object(task_results(r)[label])["solve_rate"]]
                for r in results
                if label in task_results(r)
            ]
            for label in dict.fromkeys(k for r in results for k in task_results(r))
        },
    }


def request_drain(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / DRAIN).touch()


def clear_drain(root: Path) -> None:
    (root / DRAIN).unlink(missing_ok=True)


def drain_requested(root: Path) -> bool:
    return (root / DRAIN).exists()


def snapshot_written_at(path: Path) -> float | None:
    try:
        return float((path / SNAPSHOT_WRITTEN).read_text())
    except (OSError, ValueError):
        return None


def watch(
    root: Path,
    evaluate: Callable[[int, Path], Mapping[str, object]],
    stop: Callable[[], bool],
    log: structlog.stdlib.BoundLogger,
    poll_s: float = 0.5,
    every: bool = False,
) -> int:
    """The evaluator's loop: evaluate the newest pending snapshot with `evaluate(step,
    dir)` into eval/step-N.json until `stop()`, or, once drain is requested, until nothing
    is pending. A snapshot `evaluate` cannot read (it raises SnapshotError) is set aside.
    `every`: each snapshot, oldest first (`claim`). Returns the number evaluated."""
    released = release_claims(root)
    if released:
        log.info("eval_claims_released", steps=released)
    done = 0
    while not stop():
        taken = claim(root, every)
        if taken is None:
            if drain_requested(root):
                break
            time.sleep(poll_s)
            continue
        step, path, skipped = taken
        if skipped:
            log.info("eval_skipped", steps=skipped, evaluating=step)
        try:
            result = evaluate(step, path)
        except SnapshotError as err:
            log.error("eval_snapshot_unreadable", step=step, error=str(err))
            set_aside(root, path)
            continue
        result = {**result, "step": step, "written_at": snapshot_written_at(path)}
        write_result(root, step, result)
        shutil.rmtree(path, ignore_errors=True)
        done += 1
        log.info("eval_written", step=step, solve_rate=result.get("solve_rate"))
    return done


class SnapshotError(RuntimeError):
    """A snapshot the evaluator cannot load (damaged, or not the run's model)."""
