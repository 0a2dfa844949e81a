"""The sinks of `streamrl.obs.sinks`: TensorBoard (tensorboardX's writer) and W&B (the
`wandb` package), each reading back from its own files what it wrote before (`Progress`).

Both packages are imported when the sink opens, never at import time: a sink whose
package is missing fails at its opening (logged once, the run goes on), and this module
stays light.

TensorBoard. tensorboardX's `SummaryWriter` on RUN_DIR/tensorboard, a new event file per
process (suffix `.<n>.<pid>`, n the files there before: two writers started in the same
second neither share a name nor are read out of order). Its
`flush()` writes to the file before it returns. At opening, the event files there are read
(TFRecord framing, tensorboardX's `Event` protobuf; a torn last record ends a file) for the
highest `train/` and `eval/` steps.

W&B. `wandb.init(id=<the run's id>, resume="allow", dir=RUN_DIR)` in `logging.wandb_mode`
(offline by default), its id drawn once and kept in RUN_DIR/wandb/streamrl.json; each
process writes a part of its own, RUN_DIR/wandb/offline-run-<time>-<id>-<n> (n: the parts
before it; W&B's own name, to the second, is not unique across a quick restart). The
process's W&B environment is set before the import: WANDB_MODE, WANDB_DIR, WANDB_CONFIG_DIR,
WANDB_CACHE_DIR, WANDB_DATA_DIR, WANDB_ARTIFACT_DIR under RUN_DIR/wandb (nothing in $HOME),
WANDB_SILENT, WANDB_CONSOLE off, WANDB_ERROR_REPORTING off (no crash reports sent),
WANDB_DISABLE_GIT and WANDB_DISABLE_CODE; a WANDB_API_KEY in the environment (online mode)
is passed through by W&B itself, never logged. The run's config goes with the run, less
its `redis` section. Each trainer step and each evaluation is a W&B row of its own (W&B's
own steps only go up, and an evaluation may come after later trainer steps), with its x
axis in `trainer/step` or `eval/step` (`define_metric`). wandb ships no reader of its
transaction log, so the opening reads the run's `run-<id>.wandb` files itself (LevelDB log
framing, wandb's `Record` protobuf) for the highest `trainer/step` and `eval/step` written
and the next row: W&B's core process writes whole 32 KiB blocks, so what a killed writer
had logged last may be missing there, and is written again.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from streamrl.config import Config, SinkName
from streamrl.names import RunPaths
from streamrl.obs.sinks import EVAL, EVAL_STEP, STEP_PREFIXES, TRAIN, TRAINER_STEP, Progress, Sink

# the names `logging.sinks` takes (config.SinkName)
TENSORBOARD: SinkName = "tensorboard"
WANDB: SinkName = "wandb"


def make_sinks(cfg: Config, run_dir: Path) -> list[Sink]:
    """The sinks `logging.sinks` names, in its order."""
    made: dict[SinkName, Sink] = {
        TENSORBOARD: TensorBoardSink(RunPaths(run_dir).tensorboard),
        WANDB: WandbSink(run_dir, cfg),
    }
    return [made[name] for name in cfg.logging.sinks]


# -- TensorBoard -------------------------------------------------------------------------------


def tfrecords(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file (an event file): u64 length, u32 its CRC, the data,
    u32 its CRC; CRCs not checked. Stops at a torn record (a writer killed mid-write)."""
    with path.open("rb") as f:
        while True:
            head = f.read(12)
            if len(head) < 12:
                return
            (n,) = struct.unpack("<Q", head[:8])
            data = f.read(n)
            if len(data) < n or len(f.read(4)) < 4:
                return
            yield data


def event_files(root: Path) -> list[Path]:
    """The event files in `root`, in the order TensorBoard reads them (by name)."""
    return sorted(root.glob("events.out.tfevents.*"))


def tensorboard_progress(root: Path) -> Progress:
    """The highest `train/` and `eval/` steps in the event files under `root`."""
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event

    progress = Progress()
    for path in event_files(root):
        for record in tfrecords(path):
            event = Event()
            try:
                event.ParseFromString(record)
            except DecodeError:
                break
            for value in event.summary.value:
                if value.tag.startswith(TRAIN):
                    progress.step = max(progress.step, event.step)
                elif value.tag.startswith(EVAL):
                    progress.eval_step = max(progress.eval_step, event.step)
    return progress


class TensorBoardSink:
    name: str = TENSORBOARD

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writer: Any = None

    def open(self) -> Progress:
        from tensorboardX import SummaryWriter

        self.root.mkdir(parents=True, exist_ok=True)
        progress = tensorboard_progress(self.root)
        # events.out.tfevents.<time>.<host>.<n>.<pid>: TensorBoard reads the files in name
        # order, and two writers of one second (a restart) must not share a name
        n = len(event_files(self.root))
        # flush_secs: the exporter flushes after every pass; the writer's thread need not
        self.writer = SummaryWriter(
            logdir=str(self.root), flush_secs=3600, filename_suffix=f".{n:04d}.{os.getpid()}"
        )
        return progress

    def write_step(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def write_eval(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self.write_step(step, values, wall_time)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# -- W&B ---------------------------------------------------------------------------------------

WANDB_STATE = "streamrl.json"  # {"run_id": ...} under RUN_DIR/wandb
CLOSE_WAIT_S = 10.0  # for W&B's core process to write the last rows, at the close
WANDB_HOME = ".home"  # W&B's config, cache, data and artifact directories

# The framing of W&B's transaction log (LevelDB's log format with W&B's file header).
_HEADER = struct.Struct("<4sHB")  # ":W&B", 0xBEE1, version
_RECORD = struct.Struct("<IHB")  # CRC, length, type
_BLOCK = 32768
_FULL, _LAST = 1, 4


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records (serialized `wandb_internal_pb2.Record`s) of a `run-<id>.wandb` file;
    stops at a torn one."""
    data = path.read_bytes()
    if len(data) < _HEADER.size or _HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        return
    pos, parts = _HEADER.size, b""
    while pos + _RECORD.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD.size:  # a block's tail too short for a header: zeros
            pos += left
            continue
        _crc, length, kind = _RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:
            return
        start = pos + _RECORD.size
        if start + length > len(data):
            return
        parts += data[start : start + length]
        pos = start + length
        if kind in (_FULL, _LAST):
            yield parts
            parts = b""


def wandb_history(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(W&B step, {key: value}) of each history row of a `run-<id>.wandb` file."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    for raw in wandb_records(path):
        # a module that star-imports the protobuf major's classes: no static names
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        try:
            record.ParseFromString(raw)
        except DecodeError:
            return
        if record.WhichOneof("record_type") != "history":
            continue
        row = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        yield record.history.step.num, row


def wandb_parts(root: Path, run_id: str) -> list[Path]:
    """The directories of the W&B run `run_id` under RUN_DIR/wandb, one per process that
    wrote it, oldest first: `offline-run-<time>-<id>-<n>` (online: `run-...`), n the parts
    before it (W&B names them by the second: two in one second must not share one)."""
    found = {
        p
        for mode in ("offline-run", "run")
        for pattern in (f"{mode}-*-{run_id}", f"{mode}-*-{run_id}-*")
        for p in root.glob(pattern)
        if p.is_dir()
    }
    return sorted(found, key=lambda p: p.name.removeprefix("offline-"))


def wandb_files(root: Path, run_id: str) -> list[Path]:
    """The transaction logs (`run-<id>.wandb`) of the W&B run `run_id`, oldest first."""
    logs = [p / f"run-{run_id}.wandb" for p in wandb_parts(root, run_id)]
    return [f for f in logs if f.is_file()]


def wandb_progress(root: Path, run_id: str) -> tuple[Progress, int]:
    """The highest `trainer/step` and `eval/step` the run's files hold, and the next W&B
    step (row) to log."""
    progress, row_next = Progress(), 0
    for path in wandb_files(root, run_id):
        for step, row in wandb_history(path):
            row_next = max(row_next, step + 1)
            if TRAINER_STEP in row:
                progress.step = max(progress.step, int(row[TRAINER_STEP]))
            if EVAL_STEP in row:
                progress.eval_step = max(progress.eval_step, int(row[EVAL_STEP]))
    return progress, row_next


def wandb_environment(root: Path, mode: str) -> dict[str, str]:
    """The W&B environment of the sinks process: files under `root` (RUN_DIR/wandb) only,
    no console capture, no git or code capture, no crash reports."""
    home = root / WANDB_HOME
    return {
        "WANDB_MODE": mode,
        "WANDB_DIR": str(root.parent),  # W&B writes into its `wandb` subdirectory
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
    }


def wandb_run_id(root: Path) -> str:
    """The run's W&B id: the one kept in RUN_DIR/wandb/streamrl.json, else a new one,
    kept there before any W&B file is written."""
    path = root / WANDB_STATE
    if path.is_file():
        run_id = json.loads(path.read_text())["run_id"]
        if isinstance(run_id, str) and run_id:
            return run_id
    run_id = secrets.token_hex(4)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    os.replace(tmp, path)
    return run_id


class WandbSink:
    name: str = WANDB

    def __init__(self, run_dir: Path, cfg: Config) -> None:
        self.run_dir = run_dir
        self.root = RunPaths(run_dir).wandb
        self.cfg = cfg
        self.run: Any = None
        self.row = 0  # the W&B step of the next row
        self.first_row = 0  # the first row of this process's part
        self.sync_file: Path | None = None  # this part's transaction log

    def open(self) -> Progress:
        lc = self.cfg.logging
        if self.root.name != RunPaths.WANDB:
            raise ValueError(f"W&B writes into <dir>/wandb, not {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        os.environ.update(wandb_environment(self.root, lc.wandb_mode))
        import wandb

        run_id = wandb_run_id(self.root)
        progress, self.row = wandb_progress(self.root, run_id)
        part = len(wandb_parts(self.root, run_id))
        self.run = wandb.init(
            project=lc.wandb_project,
            entity=lc.wandb_entity or None,
            name=self.cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=lc.wandb_mode,
            config=self.cfg.model_dump(mode="json", exclude={"redis"}),
            settings=wandb.Settings(
                console="off",
                save_code=False,
                disable_git=True,
                x_disable_stats=True,
                x_disable_meta=True,
                x_sync_dir_suffix=f"{part:04d}",
            ),
        )
        for x in (TRAINER_STEP, EVAL_STEP):
            self.run.define_metric(x, hidden=True)
        for prefix in STEP_PREFIXES:
            self.run.define_metric(f"{prefix}*", step_metric=TRAINER_STEP)
        self.run.define_metric(f"{EVAL}*", step_metric=EVAL_STEP)
        self.first_row, self.sync_file = self.row, Path(self.run.settings.sync_file)
        return progress

    def write_step(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._row({**values, TRAINER_STEP: step})

    def write_eval(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._row({**values, EVAL_STEP: step})

    def _row(self, values: dict[str, float]) -> None:
        """One row of its own: W&B's steps only go up, and an evaluation may come after
        later trainer steps; the x axes are `trainer/step` and `eval/step`."""
        self.run.log(values, step=self.row)
        self.row += 1

    def flush(self) -> None:
        """Nothing: each `log` went to W&B's core process, which writes the file."""

    def close(self) -> None:
        """Finish the run, and wait (up to CLOSE_WAIT_S) until its file holds the last
        row: `finish()` returns before W&B's core process has written its last block, and a
        container stopped then would lose it."""
        self.run.finish()
        if self.sync_file is None or self.row == self.first_row:
            return
        last, deadline = self.row - 1, time.monotonic() + CLOSE_WAIT_S
        while max((step for step, _ in wandb_history(self.sync_file)), default=-1) < last:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.sync_file} lacks rows up to {last} after {CLOSE_WAIT_S} s"
                )
            time.sleep(0.05)
