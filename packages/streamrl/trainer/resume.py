"""A trainer starting where a run already went on: what its checkpoints hold, and restoring one.

A checkpoint (`streamrl.checkpoints`) holds the Orbax state (`TrainState.checkpoint_tree`),
the queue snapshot of its cut, and `CheckpointMeta` (meta.json): the lineage of group ids
trained in the window the trainer keeps, the entries it set aside, and the version it had.
`find_restorable` picks the newest checkpoint that every trainer process can restore; the
leader then writes back its queues when Redis lost the run (`restore_queues`) and rewinds the
trainer's consumer group to its cut (`rewind`), taking a policy version above every one
published before, so no rollout worker serves the discarded lineage's weights to a new
episode once it has synced.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import msgspec
import numpy as np
import orbax.checkpoint as ocp
import redis
import structlog

from streamrl import checkpoints as ckpts
from streamrl.jsontypes import JSONObject
from streamrl.model.spec import PyTree
from streamrl.names import Keys
from streamrl.trainer.cluster import Cluster
from streamrl.trainer.step import TrainState
from streamrl.weightsync import published_state_of

# (step, ids): the group ids trained at a step, or the entry ids set aside while it was
# assembled (dead-lettered or dropped).
StepIds = tuple[int, list[str]]


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True):
    """meta.json of a trainer checkpoint. Defaults: what a checkpoint written before the
    field existed means."""

    step: int
    version: int  # the policy version the trainer had (published last)
    lineage: list[StepIds]  # the steps of the window the trainer keeps
    seed: int | None = None  # run.seed (None: not recorded)
    set_aside: list[StepIds] = msgspec.field(default_factory=list)
    # the oldest step a resume from this checkpoint needs: that of the oldest group pending
    # at its cut (those after the cut are delivered again); 0: keep everything
    lineage_from: int = 0
    # groups trained in the state's history (None: the window's, `trained`)
    groups_trained: int | None = None

    @classmethod
    def read(cls, path: Path) -> CheckpointMeta:
        """The meta.json of the checkpoint directory `path` (OSError, msgspec errors)."""
        return msgspec.json.decode((path / ckpts.META).read_bytes(), type=cls)

    def to_dict(self) -> JSONObject:
        """As the JSON it is written as (lists, not tuples)."""
        out: JSONObject = msgspec.json.decode(msgspec.json.encode(self))
        return out

    @property
    def trained(self) -> int:
        """Groups trained in the state's history: recorded, or the window's."""
        if self.groups_trained is not None:
            return self.groups_trained
        return sum(len(ids) for _, ids in self.lineage)


@dataclass(frozen=True)
class Restored:
    """A checkpoint restored: where it is, its meta, its queue snapshot, its Orbax state."""

    checkpoint: ckpts.Checkpoint
    meta: CheckpointMeta
    snapshot: ckpts.QueueSnapshot
    tree: dict[str, PyTree]  # `TrainState.checkpoint_tree`


def find_restorable(
    root: Path,
    state: TrainState,
    checkpointer: ocp.AbstractCheckpointer,
    cluster: Cluster,
    log: structlog.stdlib.BoundLogger,
) -> Restored | None:
    """The newest checkpoint under `root` that every process restores (into `state`'s
    layout), or None. Incomplete ones are removed first (by the leader); an unreadable one
    is logged and the next older one tried."""
    if cluster.leader:
        ckpts.remove_incomplete(root, log)
    cluster.barrier("resume-clean")
    for step, path in ckpts.step_dirs(root):
        restored = None
        try:
            ck = ckpts.verify(path)
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state.checkpoint_tree())
            tree = checkpointer.restore(ck.state_dir.resolve(), abstract)
            restored = Restored(ck, CheckpointMeta.read(path), ck.snapshot(), tree)
        except Exception as err:  # any unreadable part: the next older one
            log.error("checkpoint_unusable", path=str(path), step=step, error=str(err))
        if all(np.asarray(cluster.gather(np.array([restored is not None]))).ravel()):
            return restored
    return None


def restore_queues(
    client: redis.Redis,
    keys: Keys,
    root: Path,
    restored: Restored | None,
    log: structlog.stdlib.BoundLogger,
) -> None:
    """When `streamrl up --resume` found that Redis lost the run (`RESTORE_PENDING`), or
    Redis holds no run id while the restored checkpoint's snapshot has one (Redis lost the
    run under compose, review N8: what the workers wrote before they noticed is cleared
    first), write back the queue snapshot of the checkpoint the state came from (none: the
    run starts afresh), so that queues and state are one cut; then let the workers start."""
    pending = root / ckpts.RESTORE_PENDING
    lost = (
        not pending.exists()
        and restored is not None
        and keys.run_id in restored.snapshot.strings
        and not client.exists(keys.run_id)
    )
    if not (pending.exists() or lost):
        return  # Redis kept the run
    if lost:
        cleared = ckpts.clear_run_state(client, keys)
        log.error("redis_lost_run", key=keys.run_id, cleared=cleared)
    if not client.xlen(keys.groups):  # made empty by this trainer's consumer
        client.delete(keys.groups)
    if ckpts.namespace_present(client, keys):
        log.warning("queues_already_present", path=str(pending))
    elif restored is None:
        log.error("queues_not_restored", reason="no checkpoint could be restored")
    else:
        counts = ckpts.restore_queues(client, keys, restored.snapshot)
        log.info("queues_restored", step=restored.meta.step,
                 path=str(restored.checkpoint.path), entries=counts)  # fmt: skip
    pending.unlink(missing_ok=True)


@dataclass(frozen=True)
class Rewound:
    """Where a resumed trainer starts: the policy `version` it has, the entry id its
    consumer group was rewound to, and whether that version is published already (`held`:
    the start publishes nothing)."""

    version: int
    start: str
    held: bool = False


def rewind(
    client: redis.Redis, keys: Keys, restored: Restored | None, reuse: bool = True
) -> Rewound:
    """Rewind the trainer's consumer group to the restored cut (none: to the start), and
    take the policy version a resumed trainer has: above every version published and the
    restored one, and at least the policy floor, which it sets to it. Except, with
    `reuse`, when the last version published holds the restored state already (published
    at the checkpoint's step, so by that state: nothing trained since, or a trainer that
    died in the step after its restart's publication): then that version, published
    again by nobody, so a trainer that dies at each start does not add a version each
    time (`reuse` is off for LoRA publication, whose next versions need a base this
    process published)."""
    groups = ckpts.StreamSnapshot(keys.groups, keys.CG_TRAINER, "", [], [])
    meta_version = -1
    if restored is not None:
        meta_version = restored.meta.version
        groups = restored.snapshot.stream(keys.groups) or groups
    start = ckpts.rewind_group(client, groups)
    published = client.get(keys.policy_version)
    floor = client.get(keys.policy_floor)
    floor_version = int(floor) if floor is not None else 0
    if reuse and restored is not None:
        held = published_state_of(client, keys, restored.meta.step)
        if held is not None and held >= max(floor_version, meta_version):
            return Rewound(held, start, held=True)
    version = max(
        int(published) + 1 if published is not None else 0, meta_version + 1, floor_version
    )
    client.set(keys.policy_floor, version)
    return Rewound(version, start)


def window_start(root: Path) -> int:
    """The oldest `lineage_from` of the checkpoints under `root`: the first step whose
    records a resume from any of them may need (0, all, for a checkpoint without it)."""
    starts = []
    for _step, path in ckpts.step_dirs(root):
        try:
            starts.append(CheckpointMeta.read(path).lineage_from)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return 0  # unreadable or older: keep everything
    return min(starts, default=0)
