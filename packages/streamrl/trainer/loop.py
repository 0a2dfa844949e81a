"""The trainer's loop: groups in, `train_step(state, batch) -> (state, metrics)`, hooks out.

Publishing weights, writing checkpoints and exporting the policy as a Hugging Face
checkpoint hang off the loop as hooks that run every N steps (and once more at the end).
Groups are acknowledged only by the checkpoint hook, once the checkpoint that holds the
update made from them is durable (DESIGN.md, "Delivery"); until then they stay pending on
the trainer's fixed consumer name, and the ids already trained are skipped if delivered
again.

A trainer that starts where a run already went on (`resume`) restores the newest complete
checkpoint (`streamrl.checkpoints`): its state, the lineage of group ids it trained, and
the trainer's consumer group rewound to the checkpoint's cut; then it publishes the
restored policy as a new version above every version published before, and sets the
policy floor to it, so that no rollout worker serves the discarded lineage's weights to a
new episode once it has synced.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import jax
import numpy as np
import orbax.checkpoint as ocp
import redis
import structlog

from streamrl import checkpoints as ckpts
from streamrl.config import Config
from streamrl.errors import FatalError
from streamrl.failpoints import CHECKPOINT_COMMIT, failpoint
from streamrl.liveness import Liveness
from streamrl.model.checkpoint import export_checkpoint
from streamrl.model.lora import LoraConfig
from streamrl.model.spec import ModelSpec
from streamrl.names import Keys
from streamrl.rl.losses import check_rollout_logps
from streamrl.trainer.cluster import Cluster, scalar
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.step import Batch, TrainState, build_batch
from streamrl.transport import Delivery, RedisStreamConsumer, publish
from streamrl.wire import Group, TrainMetrics

TRAINER_CONSUMER = "trainer"


class NonFiniteLossError(FatalError):
    pass


class Hook(Protocol):
    """Runs after every `every`-th step, and at the end of the run unless the last step
    was such a step (`final=True`); `every` 0: at the end only."""

    every: int

    def __call__(self, loop: TrainerLoop, final: bool) -> None: ...


F = TypeVar("F", bound=Callable[..., Any])


def _busy(method: F) -> F:
    """A method of the loop that is one busy step of its liveness (`streamrl.liveness`)."""

    @functools.wraps(method)
    def run(loop: TrainerLoop, *args: Any, **kwargs: Any) -> Any:
        with loop.liveness.busy():
            return method(loop, *args, **kwargs)

    return cast(F, run)


def _busy_hook(call: F) -> F:
    """A hook's call, one busy step of its loop's liveness (a checkpoint, a publication)."""

    @functools.wraps(call)
    def run(hook: Any, loop: TrainerLoop, final: bool) -> Any:
        with loop.liveness.busy():
            return call(hook, loop, final)

    return cast(F, run)


@dataclass
class TrainerLoop:
    """State the hooks see: the train state, the step's groups, what is not yet acked."""

    client: redis.Redis
    keys: Keys
    cfg: Config
    state: TrainState
    train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]
    log: structlog.stdlib.BoundLogger
    stop: Callable[[], bool]
    pad_id: int
    max_steps: int = 0
    hooks: list[Hook] = field(default_factory=list)
    version: int = 0
    unacked: list[str] = field(default_factory=list)
    trained_ids: set[str] = field(default_factory=set)
    # (step, group ids trained at it) for every step of the current state's history
    lineage: list[tuple[int, list[str]]] = field(default_factory=list)
    cluster: Cluster = field(default_factory=Cluster)
    liveness: Liveness = field(default_factory=Liveness)  # its heartbeat reads it

    def __post_init__(self) -> None:
        if not self.cluster.leader:
            return  # only the leader reads groups
        self.input = RedisStreamConsumer(
            self.client,
            self.keys,
            self.keys.groups,
            self.keys.CG_TRAINER,
            TRAINER_CONSUMER,
            Group,
            self.cfg.transport,
            self.log,
            claim=False,
            pending_first=True,
        )

    @property
    def step(self) -> int:
        return int(self.state.step)

    def collect(self) -> list[Delivery[Group]]:
        """The next `groups_per_step` groups never trained before (fewer if stopped)."""
        want = self.cfg.trainer.groups_per_step
        out: list[Delivery[Group]] = []
        while len(out) < want and not self.stop():
            self.liveness.tick()
            for d in self.input.read(count=want - len(out)):
                # Trained before, or twice in this batch (a group emitted again after Redis
                # lost the record of its first emission): acked with the next checkpoint.
                if d.msg.group_id in self.trained_ids or any(
                    o.msg.group_id == d.msg.group_id for o in out
                ):
                    self.log.warning(
                        "group_already_trained", group_id=d.msg.group_id, entry_id=d.entry_id
                    )
                    self.unacked.append(d.entry_id)
                    continue
                out.append(d)
        return out

    def _batch(self, groups: list[Delivery[Group]]) -> tuple[Batch, list[float], list[int]]:
        """The step's batch (rows padded to the step's multiple), rewards, min versions."""
        items, advantages, rewards, min_versions = [], [], [], []
        for d in groups:
            for traj, adv in zip(d.msg.members, d.msg.advantages, strict=True):
                mask = traj.mask_array() if traj.valid else None
                items.append(
                    (
                        traj.token_array(),
                        _zeros_like(traj) if mask is None else mask,
                        traj.logprob_array(),
                    )
                )
                advantages.append(adv)
                rewards.append(traj.reward)
                min_versions.append(traj.min_version)
        if self.cfg.trainer.use_rollout_logps:
            for _, mask, logps in items:
                check_rollout_logps(logps, mask)
        row_multiple = int(getattr(self.train_step, "row_multiple", 1))
        return build_batch(items, advantages, self.pad_id, row_multiple), rewards, min_versions

    @_busy  # a step's duration (its JIT compile too) is the model's, not a stall
    def train_once(self, groups: list[Delivery[Group]] | None) -> TrainMetrics | None:
        """One step on `groups` (the leader's; None on the other processes, which get the
        batch from the leader); the step's metrics on the leader, None elsewhere."""
        start = time.monotonic()
        fields = ("tokens", "mask", "old_logp", "advantages")
        if groups is not None:
            batch, rewards, min_versions = self._batch(groups)
            arrays = [np.asarray(getattr(batch, f)) for f in fields]
        shared = self.cluster.broadcast_arrays(arrays if groups is not None else None)
        batch = Batch(**dict(zip(fields, shared, strict=True)))
        self.state, m = self.train_step(self.state, batch)
        loss = scalar(m["loss"])
        if not math.isfinite(loss):
            raise NonFiniteLossError(f"loss is {loss} at step {self.step}: stopping the run")
        if groups is None:
            return None
        for d in groups:
            self.trained_ids.add(d.msg.group_id)
            self.unacked.append(d.entry_id)
        self.lineage.append((self.step, [d.msg.group_id for d in groups]))
        return TrainMetrics(
            step=self.step,
            version=self.version,
            loss=loss,
            reward_mean=float(np.mean(rewards)),
            num_groups=len(groups),
            num_sequences=len(rewards),
            num_tokens=int(scalar(m["num_tokens"])),
            clip_fraction=scalar(m["clip_fraction"]),
            grad_norm=scalar(m["grad_norm"]),
            max_policy_lag=self.version - min(min_versions),
            step_time_s=time.monotonic() - start,
        )

    def record(self, metrics: TrainMetrics) -> None:
        pipe = self.client.pipeline(transaction=True)
        publish(pipe, self.keys.metrics, metrics)
        pipe.hset(self.keys.stats, "trainer_steps", metrics.step)
        pipe.hincrby(self.keys.stats, "groups_trained", metrics.num_groups)
        pipe.execute()
        self.log.info(
            "train_step",
            group_ids=self.lineage[-1][1] if self.lineage else [],
            **{k: getattr(metrics, k) for k in metrics.__struct_fields__},
        )

    def checkpoint_meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "version": self.version,
            "seed": self.cfg.run.seed,
            "lineage": [[step, ids] for step, ids in self.lineage],
        }

    def resume(self, root: Path, checkpointer: ocp.AbstractCheckpointer) -> int | None:
        """Continue a run that already went on: restore the newest usable checkpoint under
        `root` (None: there is none, the state stays fresh), rewind the trainer's consumer
        group to its cut, and take a policy version above every one published before.
        A fresh run (nothing published, no checkpoint) is left as it is. Every process
        restores the same checkpoint; the leader alone does the Redis part."""
        c = self.cluster
        if c.leader:
            ckpts.remove_incomplete(root, self.log)
        c.barrier("resume-clean")
        restored = None
        for step, path in ckpts.step_dirs(root):
            try:
                ck = ckpts.verify(path)
                meta, snap = ck.meta(), ck.snapshot()
                target = {
                    "params": self.state.params,
                    "opt_state": self.state.opt_state,
                    "step": self.state.step,
                }
                abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
                tree = checkpointer.restore(ck.state_dir.resolve(), abstract)
                ok = True
            except Exception as err:  # any unreadable part: the next older one
                self.log.error("checkpoint_unusable", path=str(path), step=step, error=str(err))
                ok = False
            if all(np.asarray(c.gather(np.array([ok]))).ravel()):
                restored = (ck, meta, snap, tree)
                break
        if restored is not None:
            ck, meta, snap, tree = restored
            self.state = self.state.replace(
                params=tree["params"], opt_state=tree["opt_state"], step=tree["step"]
            )
            self.lineage = [(int(s), [str(g) for g in ids]) for s, ids in meta["lineage"]]
            self.trained_ids = {g for _, ids in self.lineage for g in ids}
        if not c.leader:
            return self.step if restored is not None else None
        published = self.client.get(self.keys.policy_version)
        if restored is None and published is None:
            return None  # a fresh run
        groups = ckpts.StreamSnapshot(self.keys.groups, self.keys.CG_TRAINER, "", [], [])
        meta_version = -1
        if restored is not None:
            meta_version = int(restored[1]["version"])
            groups = restored[2].stream(self.keys.groups) or groups
        start = ckpts.rewind_group(self.client, groups)
        floor = self.client.get(self.keys.policy_floor)
        version = max(
            int(published) + 1 if published is not None else 0,
            meta_version + 1,
            int(floor) if floor is not None else 0,
        )
        self.client.set(self.keys.policy_floor, version)
        self.version = version
        self.unacked.clear()
        self.log.info(
            "trainer_resumed",
            step=self.step,
            checkpoint=None if restored is None else str(restored[0].path),
            version=version,
            groups_rewound_to=start,
            trained_groups=len(self.trained_ids),
        )
        return self.step

    def _next_groups(self) -> list[Delivery[Group]] | None:
        """The leader's groups for the next step; None when the run stops there. Every
        process learns the leader's decision, so all stop at the same step."""
        groups = None
        if self.cluster.leader:
            done = self.stop() or (self.max_steps != 0 and self.step >= self.max_steps)
            groups = [] if done else self.collect()
            if len(groups) < self.cfg.trainer.groups_per_step:
                groups = None  # stopped while waiting
        with self.liveness.busy():  # the others wait here while the leader collects
            go = self.cluster.broadcast(np.array([groups is not None]))
        if not bool(go[0]):
            return None
        return groups if self.cluster.leader else []

    def run(self) -> None:
        for hook in self.hooks:  # version 0: what rollout starts from
            if isinstance(hook, PublishHook):
                hook(self, final=True)
        while True:
            groups = self._next_groups()
            if groups is None:
                break
            metrics = self.train_once(groups if self.cluster.leader else None)
            if metrics is not None:
                self.record(metrics)
            for hook in self.hooks:
                if hook.every and self.step % hook.every == 0:
                    hook(self, final=False)
        for hook in self.hooks:
            if not hook.every or self.step % hook.every != 0:
                hook(self, final=True)
        self.log.info("trainer_done", step=self.step, version=self.version)


def _zeros_like(traj: Any) -> np.ndarray:
    return np.zeros(len(traj.token_array()), dtype=np.uint8)


@dataclass
class PublishHook:
    """Publishes the policy as a new version through `publisher` (its channel, signal and
    clean-up): the full params, or, with `adapters` set, the LoRA adapters it picks out
    of the train state (the first version is full all the same: their base)."""

    every: int
    publisher: WeightPublisher
    adapters: Callable[[TrainState], tuple[Any, LoraConfig]] | None = None
    published: int = 0

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        version = loop.version + 1 if self.published else loop.version
        lora: LoraConfig | None = None
        if self.adapters is None:
            tree = loop.state.params
        elif not self.published:
            # Under LoRA training the full version is the frozen base the adapters apply to.
            tree = loop.state.base_params
        else:
            tree, lora = self.adapters(loop.state)
        tree = loop.cluster.gather(tree)  # every process takes part; the leader publishes
        if loop.cluster.leader:
            self.publisher.publish(tree, version, loop.step, lora)
        loop.version = version
        self.published += 1


@dataclass
class CheckpointHook:
    """Writes checkpoint N (`streamrl.checkpoints`: the Orbax state, the queue snapshot,
    the commit marker), then acknowledges the groups it holds, prunes old ones and trims
    the streams of entries no one can need again and what grows with the run to its window
    (`trim`)."""

    every: int
    root: Path
    keep: int
    checkpointer: ocp.AbstractCheckpointer
    trim: bool = True  # after each checkpoint (ckpts.trim_streams, ckpts.trim_history)

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        if loop.step == 0:
            return  # nothing trained: the starting point needs no checkpoint
        start = time.monotonic()
        c = loop.cluster
        if c.leader:  # the cut: the trainer is between steps, its state is that of step N
            # The groups not yet acked are trained (in the lineage): ids only, no bodies.
            snapshot = ckpts.take_snapshot(loop.client, loop.keys, trained=loop.unacked)
            snapshot_s = time.monotonic() - start
            ckpts.prepare_dir(self.root, loop.step)
        c.barrier(f"checkpoint-{loop.step}-dir")
        path = ckpts.step_dir(self.root, loop.step)
        state = {
            "params": loop.state.params,
            "opt_state": loop.state.opt_state,
            "step": loop.state.step,
        }
        self.checkpointer.save((path / ckpts.STATE).resolve(), state)  # each its own shards
        self.checkpointer.wait_until_finished()
        c.barrier(f"checkpoint-{loop.step}-state")
        if not c.leader:
            return
        ck = ckpts.commit(
            path,
            loop.step,
            loop.checkpoint_meta(),
            snapshot,
            before_commit=lambda: failpoint(CHECKPOINT_COMMIT, loop.log),
        )
        if loop.unacked:
            loop.client.xack(loop.keys.groups, loop.keys.CG_TRAINER, *loop.unacked)
        loop.log.info(
            "checkpoint_written",
            step=loop.step,
            path=str(ck.path),
            acked=len(loop.unacked),
            # unfinished at the cut: entries pending or not yet delivered, per stream
            in_flight={x.stream.rsplit(":", 1)[-1]: len(x.entries) for x in snapshot.streams},
            snapshot_bytes=(ck.path / ckpts.QUEUES).stat().st_size,
            snapshot_s=round(snapshot_s, 4),
            write_s=round(time.monotonic() - start, 4),
        )
        loop.unacked.clear()
        ckpts.prune(self.root, self.keep, loop.log)
        if self.trim:
            floor = ckpts.oldest_snapshot(self.root)
            trimmed = ckpts.trim_streams(loop.client, loop.keys, floor)
            trimmed |= ckpts.trim_history(
                loop.client,
                loop.keys,
                floor,
                keep_dead_letters=loop.cfg.trainer.keep_dead_letters,
                keep_metrics=loop.cfg.trainer.keep_metrics,
            )
            if trimmed:
                loop.log.info("streams_trimmed", step=loop.step, deleted=trimmed)


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

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        start = time.monotonic()
        params = loop.cluster.gather(loop.state.policy_params(self.lora))
        if not loop.cluster.leader:
            return
        parent = self.export_dir.parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.export_dir.name}-", dir=parent))
        old = parent / f"{tmp.name}-old"
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the export from other users
        try:
            export_checkpoint(tmp, self.spec, params, self.max_shard_bytes)
            from streamrl.hfchat import chat_template_text  # transformers: not for a stub

            template = chat_template_text(loop.cfg.model.chat_template)
            for name in TOKENIZER_FILES:
                if template is not None and name in TEMPLATE_FILES:
                    continue
                if (self.source_dir / name).is_file():
                    shutil.copyfile(self.source_dir / name, tmp / name)
            if template is not None:
                (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
            if self.export_dir.exists():
                os.rename(self.export_dir, old)
            os.rename(tmp, self.export_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
        loop.log.info(
            "export_written",
            step=loop.step,
            path=str(self.export_dir),
            write_s=round(time.monotonic() - start, 4),
        )
