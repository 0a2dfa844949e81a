"""Failpoints: named places where a test (or an operator rehearsing a failure) can make a
worker pause, so that a kill lands exactly there: mid checkpoint write, mid weight sync.

Off unless `STREAMRL_FAILPOINT_DIR` names a directory. A failpoint is armed by creating
the file `<dir>/<name>` holding a pause in seconds; the first process to reach the point
consumes the file (each arming fires once), logs `failpoint` with its name and pid, and
pauses. Workers started by `streamrl up` inherit the variable.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import structlog

ENV = "STREAMRL_FAILPOINT_DIR"

CHECKPOINT_COMMIT = "checkpoint_commit"  # trainer: state written, commit marker not yet
WEIGHTS_PUBLISH = "weights_publish"  # trainer: weights written, not yet signalled
WEIGHTS_LOAD = "weights_load"  # rollout: a new version is loading under the sync lock
EPISODE_SAVED = "episode_saved"  # rollout: episode states written at a turn boundary
# trainer: a checkpoint restored (and its queues written back, if Redis lost them), its
# consumer group not yet rewound, no version taken
TRAINER_RESUME = "trainer_resume"
# any worker: started, its heartbeat not yet (a start-up slow on a busy host)
WORKER_START = "worker_start"
NAMES = (
    CHECKPOINT_COMMIT, WEIGHTS_PUBLISH, WEIGHTS_LOAD, EPISODE_SAVED, TRAINER_RESUME, WORKER_START
)  # fmt: skip


def arm(directory: str | Path, name: str, pause_s: float) -> None:
    """Arm `name` once (what a test calls)."""
    if name not in NAMES:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(NAMES)}")
    path = Path(directory) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pause_s}\n")
    os.replace(tmp, path)


def _take(name: str) -> float | None:
    root = os.environ.get(ENV)
    if not root:
        return None
    path = Path(root) / name
    try:
        text = path.read_text()
        path.unlink()
    except (FileNotFoundError, IsADirectoryError):
        return None  # not armed, or another process took it
    try:
        return max(0.0, float(text.strip() or 0))
    except ValueError:
        return 0.0


def failpoint(name: str, log: structlog.stdlib.BoundLogger) -> None:
    pause = _take(name)
    if pause is not None:
        log.warning("failpoint", name=name, pause_s=pause, pid=os.getpid())
        time.sleep(pause)


async def afailpoint(name: str, log: structlog.stdlib.BoundLogger) -> None:
    pause = _take(name)
    if pause is not None:
        log.warning("failpoint", name=name, pause_s=pause, pid=os.getpid())
        await asyncio.sleep(pause)
