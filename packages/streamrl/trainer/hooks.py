"""The trainer loop's hooks: optional work that runs every N steps (and once more at the end).

A hook does its work and returns what it did, for the loop to act on: `PublishHook` the
version it published (`Published`), `CheckpointHook` the checkpoint it committed
(`Committed`), which the loop then acknowledges the groups of (DESIGN.md, "Delivery"). No
hook writes into the loop. `ExportHook` and `EvalSnapshotHook` write the policy as a Hugging
Face checkpoint, for users and for the evaluator.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Concatenate, ParamSpec, Protocol, TypeVar

import orbax.checkpoint as ocp
import structlog

from streamrl import checkpoints as ckpts
from streamrl.config import Config
from streamrl.evaluation import watch as evalrun
from streamrl.model.checkpoint import export_checkpoint
from streamrl.model.lora import LoraConfig
from streamrl.model.spec import ModelSpec, PyTree
from streamrl.names import RunPaths
from streamrl.obs.tracing import Span
from streamrl.run.failpoints import CHECKPOINT_COMMIT, failpoint
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.step import TrainState

if TYPE_CHECKING:
    from streamrl.trainer.loop import TrainerLoop


@dataclass(frozen=True)
class Published:
    """A hook published the policy as `version`: the loop's version from now on."""

    version: int


@dataclass(frozen=True)
class Committed:
    """A hook committed `checkpoint` (durable), whose queue snapshot is `snapshot`, taken
    in `snapshot_s` from `started` (monotonic); the store keeps the newest `keep`, and with
    `trim` the streams are trimmed to what a checkpoint kept may need."""

    checkpoint: ckpts.Checkpoint
    snapshot: ckpts.QueueSnapshot
    snapshot_s: float
    started: float
    keep: int
    trim: bool


class Hook(Protocol):
    """Runs after every `every`-th step, and at the end of the run unless the last step
    was such a step (`final=True`); `every` 0: at the end only. Never after a skipped
    (non-finite) step. `at_start`: also before the first step (`final=True`), as the
    publication of version 0 and the evaluator's step-0 snapshot do. Returns what it did
    (`Published`, `Committed`) or None."""

    every: int

    @property
    def at_start(self) -> bool: ...

    def __call__(self, loop: TrainerLoop, /, final: bool) -> Published | Committed | None: ...


H = TypeVar("H")
P = ParamSpec("P")
R = TypeVar("R")


def _busy_hook(
    call: Callable[Concatenate[H, TrainerLoop, P], R],
) -> Callable[Concatenate[H, TrainerLoop, P], R]:
    """A hook's call, one busy step of its loop's liveness (a checkpoint, a publication)
    for at most `run.trainer_stop_timeout_s` (review N9: a stuck filesystem or a peer-less
    collective stops the beat)."""

    @functools.wraps(call)
    def run(hook: H, loop: TrainerLoop, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with loop.liveness.busy(loop.cfg.run.trainer_stop_timeout_s):
            return call(hook, loop, *args, **kwargs)

    return run


@dataclass
class PublishHook:
    """Publishes the policy as a new version through `publisher` (its channel, signal and
    clean-up): the full params, or, with `adapters` set, the LoRA adapters it picks out
    of the train state (the first version is full all the same: their base)."""

    every: int
    publisher: WeightPublisher
    adapters: Callable[[TrainState], tuple[PyTree, LoraConfig]] | None = None
    version: int = -1  # the last version published (-1: none yet)
    at_start: ClassVar[bool] = True  # version 0: what rollout starts from

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> Published:
        """The first publication is the loop's version (0, or a resumed trainer's; none
        when that version is published already, `TrainerLoop.version_held`); each later one
        the next."""
        first = self.version < 0
        if first and loop.version_held:  # a resume whose state that version holds
            self.version = loop.version
            return Published(loop.version)
        version = loop.version if first else self.version + 1
        lora: LoraConfig | None = None
        if self.adapters is None:
            tree = loop.state.params
        elif first:
            # Under LoRA training the full version is the frozen base the adapters apply to.
            tree = loop.state.base_params
        else:
            tree, lora = self.adapters(loop.state)
        start_ns = time.time_ns()
        tree = loop.cluster.gather(tree)  # every process takes part; the leader publishes
        if loop.cluster.leader:
            self.publisher.publish(tree, version, loop.step, lora)
        self.version = version
        loop.trace(Span.WEIGHTS_PUBLISH, start_ns, args={"version": version})
        return Published(version)


@dataclass
class CheckpointHook:
    """Writes checkpoint N (`streamrl.checkpoints`: the Orbax state, the queue snapshot,
    the commit marker) and returns it committed (on the leader; None on the other processes
    and at step 0). The loop then acknowledges the groups it holds, prunes the checkpoints
    to the newest `keep` and, with `trim`, trims the streams of entries no one can need
    again and what grows with the run to its window (`TrainerLoop.checkpointed`)."""

    every: int
    root: Path
    keep: int
    checkpointer: ocp.AbstractCheckpointer
    trim: bool = True  # after each checkpoint (ckpts.trim_streams, ckpts.trim_history)
    at_start: ClassVar[bool] = False

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> Committed | None:
        if loop.step == 0:
            return None  # nothing trained: the starting point needs no checkpoint
        start = time.monotonic()
        c = loop.cluster
        if c.leader:  # the cut: the trainer is between steps, its state is that of step N
            # The groups not yet acked are trained (in the lineage): ids only, no bodies.
            span_ns = time.time_ns()
            snapshot = ckpts.take_snapshot(loop.client, loop.keys, trained=loop.unacked)
            snapshot_s = time.monotonic() - start
            loop.trace(Span.CHECKPOINT_SNAPSHOT, span_ns, args={"step": loop.step})
            if self.root.is_dir():
                ckpts.make_room(self.root, self.keep, loop.log)
            ckpts.prepare_dir(self.root, loop.step)
        c.barrier(f"checkpoint-{loop.step}-dir")
        path = ckpts.step_dir(self.root, loop.step)
        span_ns = time.time_ns()
        try:
            self._save(path, loop)  # each process writes its own shards
        except OSError as err:
            # A full disk (review N14): with one process, free the oldest checkpoint that
            # the prune after this one would remove anyway, and write it again, once.
            if err.errno != errno.ENOSPC or c.count > 1 or self.keep < 2:
                raise
            loop.log.warning("checkpoint_disk_full", step=loop.step, error=str(err))
            ckpts.prepare_dir(self.root, loop.step)  # the partial write goes
            if not ckpts.prune(self.root, self.keep - 1, loop.log):
                raise
            self._save(path, loop)
        loop.trace(Span.CHECKPOINT_SAVE, span_ns, args={"step": loop.step})
        c.barrier(f"checkpoint-{loop.step}-state")
        if not c.leader:
            return None
        span_ns = time.time_ns()
        ck = ckpts.commit(
            path,
            loop.step,
            loop.checkpoint_meta().to_dict(),
            snapshot,
            before_commit=lambda: failpoint(CHECKPOINT_COMMIT, loop.log),
        )
        loop.trace(Span.CHECKPOINT_COMMIT, span_ns, args={"step": loop.step})
        return Committed(ck, snapshot, snapshot_s, start, self.keep, self.trim)

    def _save(self, path: Path, loop: TrainerLoop) -> None:
        self.checkpointer.save((path / ckpts.STATE).resolve(), loop.state.checkpoint_tree())
        self.checkpointer.wait_until_finished()


# Files of a checkpoint directory that are not weights: the tokenizer (fast or slow), its
# chat template and the generation defaults. Copied as they are into an export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Where transformers looks for a chat template besides tokenizer_config.json; a template
# file wins over the config's key when it loads the export.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass
class ExportHook:
    """Writes the policy as a Hugging Face checkpoint directory at `export_dir`.

    The trained weights and their config.json (`export_checkpoint`), plus the tokenizer,
    chat template and generation config copied from `source_dir`, the checkpoint the run
    started from: `AutoModelForCausalLM.from_pretrained(export_dir)` and
    `AutoTokenizer.from_pretrained(export_dir)` load the trained policy. When the run's
    `model.chat_template` names a template, the export carries that one as
    chat_template.jinja (a base model trained with it chats as it was trained). `every` 0: only at
    the end of the run. Each export replaces the last as a whole (written beside it, then
    renamed into place), so a reader never finds a half-written one.
    """

    every: int
    export_dir: Path
    spec: ModelSpec
    source_dir: Path
    max_shard_bytes: int | None = None
    lora: LoraConfig | None = None  # LoRA training: the adapters are merged into the export
    at_start: ClassVar[bool] = False

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        start = time.monotonic()
        params = loop.cluster.gather(loop.state.policy_params(self.lora))
        if not loop.cluster.leader:
            return None
        write_export(
            self.export_dir, self.spec, params, self.source_dir, loop.cfg, self.max_shard_bytes
        )
        loop.log.info(
            "export_written",
            step=loop.step,
            path=str(self.export_dir),
            write_s=round(time.monotonic() - start, 4),
        )
        return None


def write_export(
    export_dir: Path,
    spec: ModelSpec,
    params: PyTree,
    source_dir: Path,
    cfg: Config,
    max_shard_bytes: int | None = None,
    stamp: bool = False,
) -> None:
    """`params` as a Hugging Face checkpoint directory at `export_dir` (ExportHook's doc),
    written beside it and renamed into place; `stamp`: with the time it was written
    (`evalrun.SNAPSHOT_WRITTEN`)."""
    parent = export_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}-", dir=parent))
    old = parent / f"{tmp.name}-old"
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the export from other users
    try:
        export_checkpoint(tmp, spec, params, max_shard_bytes)
        from streamrl.chat.hf import chat_template_text  # transformers: not for a stub

        template = chat_template_text(cfg.model.chat_template)
        for name in TOKENIZER_FILES:
            if template is not None and name in TEMPLATE_FILES:
                continue
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, tmp / name)
        if template is not None:
            (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
        if stamp:
            (tmp / evalrun.SNAPSHOT_WRITTEN).write_text(repr(time.time()))
        if export_dir.exists():
            os.rename(export_dir, old)
        os.rename(tmp, export_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def remove_partial_writes(run_dir: Path, log: structlog.stdlib.BoundLogger) -> list[str]:
    """Remove what a trainer killed mid-write left (review part 3: one model size per
    kill, for ever): weight versions' temporary files (`weightsync.write_bytes_atomic`),
    exports and eval snapshots written beside their place (`export_checkpoint`). At the
    trainer's start, when no write of its own is under way and no other trainer writes
    (review N13). Returns the names removed."""
    paths = RunPaths(run_dir)
    pending = evalrun.eval_dir(run_dir) / evalrun.PENDING
    found = [
        *paths.weights.glob(".*.tmp"),
        *paths.root.glob(f".{paths.export.name}-*"),
        *pending.glob(".step-*"),
    ]
    for p in found:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if found:
        log.info("partial_writes_removed", paths=[str(p.relative_to(run_dir)) for p in found])
    return [p.name for p in found]


@dataclass
class EvalSnapshotHook:
    """Writes the policy for the evaluator (`streamrl.evaluation.watch`): a Hugging Face checkpoint
    directory at RUN_DIR/eval/pending/step-N at the start of the run (step 0, as
    PublishHook), every `every` steps and at the end, unless step N was written before (a
    resumed run); removes the older pending snapshots (the evaluator takes the newest)
    unless `keep_all`."""

    every: int
    root: Path  # RUN_DIR/eval
    spec: ModelSpec
    source_dir: Path
    lora: LoraConfig | None = None
    keep_all: bool = False  # trainer.eval_all: never prune
    at_start: ClassVar[bool] = True  # the step-0 snapshot: the policy before RL

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        start = time.monotonic()
        params = loop.cluster.gather(loop.state.policy_params(self.lora))
        if not loop.cluster.leader or evalrun.has_step(self.root, loop.step):
            return None
        path = self.root / evalrun.PENDING / f"step-{loop.step}"
        write_export(path, self.spec, params, self.source_dir, loop.cfg, stamp=True)
        pruned = [] if self.keep_all else evalrun.prune_pending(self.root, loop.step)
        loop.log.info(
            "eval_snapshot_written",
            step=loop.step,
            path=str(path),
            pruned=pruned,
            write_s=round(time.monotonic() - start, 4),
        )
        return None
