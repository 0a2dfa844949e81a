"""The trainer's loop: groups in, `train_step(state, batch) -> (state, metrics)`, hooks out.

Publishing weights, writing checkpoints and exporting the policy as a Hugging Face
checkpoint hang off the loop as hooks that run every N steps (and once more at the end).
Groups are acknowledged only by the checkpoint hook, once the checkpoint that holds the
update made from them is durable (DESIGN.md, "Delivery"); until then they stay pending on
the trainer's fixed consumer name, and the ids already trained are skipped if delivered
again. A group is judged on its own before it joins a batch: one too stale is dropped, one
the trainer cannot use is dead-lettered; either is acknowledged with the next checkpoint
like a trained one. A step whose loss or gradient is not finite changes nothing (the
state is kept, no hook runs) and dead-letters its groups; a few in a row stop the run.

A trainer that starts where a run already went on (`resume`) restores the newest complete
checkpoint (`streamrl.checkpoints`) that Orbax can restore: its state, the window of the
lineage of group ids it trained, the queues from its snapshot when Redis lost the run,
and the trainer's consumer group rewound to the checkpoint's cut; then it publishes the
restored policy as a new version above every version published before, and sets the
policy floor to it, so that no rollout worker serves the discarded lineage's weights to a
new episode once it has synced.

Traced (`tracer`) on track ("trainer", "loop"): `trainer.batch_wait` (until a step's groups
are in), `train.step` (ending the flows of the groups it trains), `weights.publish`, and a
checkpoint's `checkpoint.snapshot`, `checkpoint.save` (Orbax) and `checkpoint.commit`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, cast

import jax
import numpy as np
import orbax.checkpoint as ocp
import redis
import structlog

from streamrl import checkpoints as ckpts
from streamrl import counters, evalrun
from streamrl.config import Config
from streamrl.errors import FatalError
from streamrl.failpoints import CHECKPOINT_COMMIT, failpoint
from streamrl.liveness import Liveness
from streamrl.metrics import EXAMPLES, POLICY_AGE, POLICY_VERSION, Metrics
from streamrl.model.checkpoint import export_checkpoint
from streamrl.model.lora import LoraConfig
from streamrl.model.spec import ModelSpec
from streamrl.names import Keys
from streamrl.rl.losses import check_rollout_logps, missing_logp_rows
from streamrl.tracing import GROUP_FLOW, Span, Tracer, flow_id
from streamrl.trainer.cluster import Cluster, scalar
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.step import Batch, TrainState, build_batch
from streamrl.transport import Delivery, RedisStreamConsumer, publish, stage_dead_letter
from streamrl.wire import DeadLetter, Group, TrainMetrics, encode

TRAINER_CONSUMER = "trainer"

# The loss's behaviour-policy metrics that go into TrainMetrics (`streamrl.rl.losses`).
MISMATCH_METRICS = ("mismatch_logp_abs", "mismatch_kl", "mismatch_kl_seq", "correction_fraction")

Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # one member's tokens, mask, rollout log-probs


class NonFiniteStepsError(FatalError):
    pass


class Hook(Protocol):
    """Runs after every `every`-th step, and at the end of the run unless the last step
    was such a step (`final=True`); `every` 0: at the end only. Never after a skipped
    (non-finite) step. `at_start`: also before the first step (`final=True`), as the
    publication of version 0 and the evaluator's step-0 snapshot do."""

    every: int

    @property
    def at_start(self) -> bool: ...

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
    # entry id -> the step under which its group is recorded (lineage or set_aside), for
    # every group consumed since the last checkpoint: acknowledged with the next one
    unacked: dict[str, int] = field(default_factory=dict)
    # group id -> that step, for every group trained: never trained again
    consumed: dict[str, int] = field(default_factory=dict)
    # entry id -> that step, for every entry set aside: not judged again when delivered
    # again (by id: a dead letter the operator replays is a new entry, and is judged anew)
    aside: dict[str, int] = field(default_factory=dict)
    # (step, group ids trained at it) for every step of the current state's history
    lineage: list[tuple[int, list[str]]] = field(default_factory=list)
    # (step, entry ids set aside while that step was assembled: dead-lettered or dropped)
    set_aside: list[tuple[int, list[str]]] = field(default_factory=list)
    # groups trained in the current state's history (restored with it): the run's
    # `groups_trained`, which a restart that trains the groups after the cut again does
    # not count twice
    groups_trained: int = 0
    # group ids of each step skipped in a row for a non-finite loss or gradient norm
    nonfinite: list[list[str]] = field(default_factory=list)
    cluster: Cluster = field(default_factory=Cluster)
    liveness: Liveness = field(default_factory=Liveness)  # its heartbeat reads it
    metrics: Metrics | None = None  # examples trained and their policy age (streamrl.metrics)
    tracer: Tracer = field(default_factory=Tracer.disabled)

    def __post_init__(self) -> None:
        self.track = self.tracer.track("trainer", "loop")
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
        """The next `groups_per_step` groups to train on (fewer if stopped); the others read
        on the way are set aside (`_admit`)."""
        want = self.cfg.trainer.groups_per_step
        out: list[Delivery[Group]] = []
        while len(out) < want and not self.stop():
            self.liveness.tick()
            for d in self.input.read(count=want - len(out)):
                if self._admit(d, out):
                    out.append(d)
        return out

    def _admit(self, d: Delivery[Group], taken: list[Delivery[Group]]) -> bool:
        """Whether to train on `d`. Each group is judged on its own, so a bad one never
        takes the good ones of its batch down with it. Not trained, acknowledged with the
        next checkpoint like a trained one, and skipped if delivered again: a group
        trained before or twice in this batch (emitted again after Redis lost the record
        of its first emission); one too far off policy (dropped and counted); one the
        trainer cannot use (dead-lettered with the reason)."""
        gid, step = d.msg.group_id, self.step + 1
        if d.entry_id in self.aside:
            self.log.warning("group_already_set_aside", group_id=gid, entry_id=d.entry_id)
            self.unacked[d.entry_id] = self.aside[d.entry_id]
            return False
        if gid in self.consumed or any(o.msg.group_id == gid for o in taken):
            self.log.warning("group_already_trained", group_id=gid, entry_id=d.entry_id)
            self.unacked[d.entry_id] = self.consumed.get(gid, step)
            return False
        stale = self._stale(d.msg)
        if stale:
            self._set_aside([d], stale, dead=False)
            return False
        try:
            group_rows(d.msg, self.cfg.trainer.needs_rollout_logps)
        except ValueError as err:
            self._set_aside([d], f"group unusable by the trainer: {err}", dead=True)
            return False
        return True

    def _stale(self, group: Group) -> str:
        """Why `group` is too far off policy to train on now ('' when it is not): any
        member whose oldest turn is more than `grouper.off_policy_steps` versions behind
        the trainer's (the grouper checks at emission; the trainer may have moved on)."""
        limit = self.cfg.grouper.off_policy_steps
        lags = [self.version - t.min_version for t in group.members if t.versions]
        if lags and max(lags) > limit:
            return (
                f"stale at the trainer: a member is {max(lags)} policy versions behind "
                f"trainer version {self.version} (grouper.off_policy_steps {limit})"
            )
        return ""

    def _set_aside(self, groups: list[Delivery[Group]], reason: str, *, dead: bool) -> None:
        """Record `groups` as consumed without training, under the step being assembled:
        dead-lettered (`dead`) or dropped, counted, logged; acknowledged with the next
        checkpoint (a crash before it delivers them again, and sets them aside again)."""
        step = self.step + 1
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(self.keys.stats, counters.GROUPS_SET_ASIDE, len(groups))
        for d in groups:
            if dead:
                letter = DeadLetter(
                    source=self.keys.groups,
                    entry_id=d.entry_id,
                    reason=reason,
                    fields=encode(d.msg),
                    consumer=TRAINER_CONSUMER,
                    deliveries=d.deliveries,
                )
                stage_dead_letter(pipe, self.keys, letter)
            else:
                pipe.sadd(self.keys.groups_dropped, d.msg.group_id)
                pipe.hincrby(self.keys.stats, counters.GROUPS_DROPPED, 1)
                pipe.hincrby(self.keys.stats, counters.TRAINER_GROUPS_STALE, 1)
        pipe.execute()
        for d in groups:
            self.aside[d.entry_id] = step
            self.unacked[d.entry_id] = step
            event = "dead_letter" if dead else "group_dropped"
            self.log.error(event, group_id=d.msg.group_id, entry_id=d.entry_id, reason=reason)
        self.set_aside.append((step, [d.entry_id for d in groups]))

    def _batch(self, groups: list[Delivery[Group]]) -> tuple[Batch, list[float], list[int]]:
        """The step's batch (rows padded to the step's multiple), rewards, min versions."""
        items: list[Row] = []
        advantages: list[float] = []
        rewards, min_versions, masked = [], [], 0
        for d in groups:
            rows, n = group_rows(d.msg, self.cfg.trainer.needs_rollout_logps)
            items += rows
            masked += n
            advantages += d.msg.advantages
            rewards += [t.reward for t in d.msg.members]
            min_versions += [t.min_version for t in d.msg.members]
        if masked:
            self.client.hincrby(self.keys.stats, counters.TRAINER_ROWS_MASKED, masked)
            self.log.warning("rows_masked", rows=masked, reason="rollout log-probs all 0.0")
        row_multiple = int(getattr(self.train_step, "row_multiple", 1))
        return build_batch(items, advantages, self.pad_id, row_multiple), rewards, min_versions

    def trace(self, name: str, start_ns: int, **kw: Any) -> None:
        """A span `name` of the loop, from `start_ns` to now (this host's clock)."""
        self.tracer.span(self.track, name, start_ns, time.time_ns(), **kw)

    def train_once(self, groups: list[Delivery[Group]] | None) -> TrainMetrics | None:
        """One step on `groups` (the leader's; None on the other processes, which get the
        batch from the leader); the step's metrics on the leader, None elsewhere. A
        `train.step` span, ending the flows of its groups."""
        start_ns = time.time_ns()
        try:
            return self._train_once(groups)
        finally:
            ids = [d.msg.group_id for d in groups or ()]
            self.trace(
                Span.TRAIN_STEP,
                start_ns,
                ends_flows=[flow_id(GROUP_FLOW, g) for g in ids],
                args={"step": self.step},
            )

    @_busy  # a step's duration (its JIT compile too) is the model's, not a stall
    def _train_once(self, groups: list[Delivery[Group]] | None) -> TrainMetrics | None:
        start = time.monotonic()
        fields = ("tokens", "mask", "old_logp", "advantages")
        if groups is not None:
            batch, rewards, min_versions = self._batch(groups)
            arrays = [np.asarray(getattr(batch, f)) for f in fields]
        shared = self.cluster.broadcast_arrays(arrays if groups is not None else None)
        batch = Batch(**dict(zip(fields, shared, strict=True)))
        before = self.step
        state, m = self.train_step(self.state, batch)
        loss, grad_norm = scalar(m["loss"]), scalar(m["grad_norm"])
        advanced = int(state.step) == before + 1
        if not (advanced and math.isfinite(loss) and math.isfinite(grad_norm)):
            if not advanced:  # the step kept the old state itself (it may donate its input)
                self.state = state
            self._skip(groups, loss, grad_norm)
            return None
        self.state = state
        self.nonfinite.clear()
        if groups is None:
            return None
        for d in groups:
            self.consumed[d.msg.group_id] = self.step
            self.unacked[d.entry_id] = self.step
        self.lineage.append((self.step, [d.msg.group_id for d in groups]))
        self._count(min_versions)
        return TrainMetrics(
            step=self.step,
            version=self.version,
            loss=loss,
            reward_mean=float(np.mean(rewards)),
            num_groups=len(groups),
            num_sequences=len(rewards),
            num_tokens=int(scalar(m["num_tokens"])),
            clip_fraction=scalar(m["clip_fraction"]),
            grad_norm=grad_norm,
            max_policy_lag=self.version - min(min_versions),
            step_time_s=time.monotonic() - start,
            **{k: scalar(m[k]) for k in MISMATCH_METRICS if k in m},
        )

    def _count(self, min_versions: list[int]) -> None:
        """A step's examples (sequences) as counters, each with its policy age: versions
        between its oldest turn's policy and the one trained."""
        if self.metrics is None:
            return
        self.metrics.count(EXAMPLES, len(min_versions))
        for v in min_versions:
            self.metrics.observe(POLICY_AGE, max(0, self.version - v))

    def probe(self) -> dict[str, float]:
        """The version trained (and published) now, for `streamrl.metrics`."""
        return {POLICY_VERSION: self.version}

    def _skip(self, groups: list[Delivery[Group]] | None, loss: float, grad_norm: float) -> None:
        """A step whose loss or gradient norm is not finite: the state stays that of the
        last good step, no hook runs, and its groups are dead-lettered (a bad batch does
        not come back for ever; a cause in the state shows as the next steps failing too).
        After `trainer.max_nonfinite_steps` such steps in a row the run stops."""
        step, limit = self.step + 1, self.cfg.trainer.max_nonfinite_steps
        reason = (
            f"non-finite step {step} (loss {loss}, grad_norm {grad_norm}, or the update): "
            "the state was kept"
        )
        ids = [] if groups is None else [d.msg.group_id for d in groups]
        self.nonfinite.append(ids)
        if groups is not None:
            self.client.hincrby(self.keys.stats, counters.TRAINER_NONFINITE_STEPS, 1)
            self._set_aside(groups, reason, dead=True)
            self.log.error("train_step_skipped", step=step, reason=reason, group_ids=ids)
        if len(self.nonfinite) >= limit:
            raise NonFiniteStepsError(
                f"{len(self.nonfinite)} steps in a row had a non-finite loss or gradient norm "
                f"(trainer.max_nonfinite_steps {limit}), the last: {reason}; their groups "
                f"(dead-lettered): {self.nonfinite}. Stopping the run"
            )

    def record(self, metrics: TrainMetrics) -> None:
        pipe = self.client.pipeline(transaction=True)
        publish(pipe, self.keys.metrics, metrics)
        pipe.hset(self.keys.stats, counters.TRAINER_STEPS, metrics.step)
        self.groups_trained += metrics.num_groups
        pipe.hset(self.keys.stats, counters.GROUPS_TRAINED, self.groups_trained)
        pipe.execute()
        self.log.info(
            "train_step",
            group_ids=self.lineage[-1][1] if self.lineage else [],
            **{k: getattr(metrics, k) for k in metrics.__struct_fields__},
        )

    def checkpoint_meta(self) -> dict[str, Any]:
        """meta.json: the lineage (and set_aside) of the window the loop holds, and
        `lineage_from`, the oldest step a resume from this checkpoint needs: that of the
        oldest group pending at its cut (those after the cut are delivered again)."""
        return {
            "step": self.step,
            "version": self.version,
            "seed": self.cfg.run.seed,
            "lineage": [[step, ids] for step, ids in self.lineage],
            "set_aside": [[step, ids] for step, ids in self.set_aside],
            "lineage_from": min(self.unacked.values(), default=self.step + 1),
            "groups_trained": self.groups_trained,
        }

    def forget_before(self, step: int) -> None:
        """Keep the records (lineage, set_aside and their ids) of `step` on only.

        The window: a group can be delivered again only from the cut of a kept checkpoint
        on, and the oldest such group of each is recorded at its `lineage_from` step or
        later (`window_start`); a group emitted again after that is still skipped while
        its step is in the window. So the records stay bounded by the steps since the
        oldest kept checkpoint's cut (about (keep_checkpoints + 1) x checkpoint_every
        steps of groups), not the run."""
        self.lineage = [(s, ids) for s, ids in self.lineage if s >= step]
        self.set_aside = [(s, ids) for s, ids in self.set_aside if s >= step]
        self.consumed = {g: s for g, s in self.consumed.items() if s >= step}
        self.aside = {e: s for e, s in self.aside.items() if s >= step}

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
            # checkpoints written before the trainer set groups aside have no record of it
            aside = meta.get("set_aside", [])
            self.set_aside = [(int(s), [str(e) for e in ids]) for s, ids in aside]
            self.consumed = {g: s for s, ids in self.lineage for g in ids}
            # checkpoints written before the count was kept: the window's groups
            self.groups_trained = int(
                meta.get("groups_trained", sum(len(ids) for _, ids in self.lineage))
            )
            self.aside = {e: s for s, ids in self.set_aside for e in ids}
        if not c.leader:
            return self.step if restored is not None else None
        self._restore_queues(root, restored)
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
            trained_groups=sum(len(ids) for _, ids in self.lineage),
        )
        return self.step

    def _restore_queues(self, root: Path, restored: tuple[Any, ...] | None) -> None:
        """When `streamrl up --resume` found that Redis lost the run (`RESTORE_PENDING`),
        write back the queue snapshot of the checkpoint the state came from (none: the run
        starts afresh), so that queues and state are one cut; then let the workers start."""
        pending = root / ckpts.RESTORE_PENDING
        if not pending.exists():
            return
        if not self.client.xlen(self.keys.groups):  # made empty by this trainer's consumer
            self.client.delete(self.keys.groups)
        if ckpts.namespace_present(self.client, self.keys):
            self.log.warning("queues_already_present", path=str(pending))
        elif restored is None:
            self.log.error("queues_not_restored", reason="no checkpoint could be restored")
        else:
            counts = ckpts.restore_queues(self.client, self.keys, restored[2])
            self.log.info("queues_restored", step=self.step, path=str(restored[0].path),
                          entries=counts)  # fmt: skip
        pending.unlink()

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
        for hook in self.hooks:  # e.g. version 0: what rollout starts from
            if hook.at_start:
                hook(self, final=True)
        while True:
            wait_ns = time.time_ns()
            groups = self._next_groups()
            self.trace(Span.TRAINER_BATCH_WAIT, wait_ns)
            if groups is None:
                break
            before = self.step
            metrics = self.train_once(groups if self.cluster.leader else None)
            if metrics is not None:
                self.record(metrics)
            if self.step == before:
                continue  # a skipped step: nothing new to publish, checkpoint or export
            for hook in self.hooks:
                if hook.every and self.step % hook.every == 0:
                    hook(self, final=False)
        for hook in self.hooks:
            if not hook.every or self.step % hook.every != 0:
                hook(self, final=True)
        self.log.info("trainer_done", step=self.step, version=self.version)


def window_start(root: Path) -> int:
    """The oldest `lineage_from` of the checkpoints under `root`: the first step whose
    records a resume from any of them may need (0, all, for a checkpoint without it)."""
    starts = []
    for _step, path in ckpts.step_dirs(root):
        try:
            meta = json.loads((path / ckpts.META).read_text())
            starts.append(int(meta["lineage_from"]))
        except (OSError, ValueError, KeyError, TypeError):
            return 0  # unreadable or older: keep everything
    return min(starts, default=0)


def group_rows(group: Group, rollout_logps: bool) -> tuple[list[Row], int]:
    """The group's batch rows, one per member, and how many of them are masked out for
    missing rollout log-probs (`missing_logp_rows`; with `rollout_logps`, the ratio's
    denominator). A member that is not `valid` (an error, a timeout) has an all-0 mask.
    ValueError saying why when the group cannot be trained on: malformed arrays, members
    and advantages that do not match, a non-finite advantage, rollout log-probs that
    `check_rollout_logps` refuses."""
    if len(group.members) != len(group.advantages):
        raise ValueError(f"{len(group.members)} members but {len(group.advantages)} advantages")
    if not all(math.isfinite(a) for a in group.advantages):
        raise ValueError(f"non-finite advantages {group.advantages}")
    rows: list[Row] = []
    masked = 0
    for t in group.members:
        try:
            tokens, mask, logps = t.token_array(), t.mask_array(), t.logprob_array()
            if not len(tokens) == len(mask) == len(logps):
                raise ValueError(
                    f"tokens, mask and logprobs differ in length "
                    f"({len(tokens)}, {len(mask)}, {len(logps)})"
                )
            if not t.valid:  # an error or timeout: counted in its group's statistics only
                mask = np.zeros(len(tokens), np.uint8)
            elif rollout_logps:
                check_rollout_logps(logps, mask)
                if missing_logp_rows(logps, mask)[0]:
                    mask, masked = np.zeros(len(tokens), np.uint8), masked + 1
        except ValueError as err:
            raise ValueError(f"member {t.member}: {err}") from None
        rows.append((tokens, mask, logps))
    return rows, masked


@dataclass
class PublishHook:
    """Publishes the policy as a new version through `publisher` (its channel, signal and
    clean-up): the full params, or, with `adapters` set, the LoRA adapters it picks out
    of the train state (the first version is full all the same: their base)."""

    every: int
    publisher: WeightPublisher
    adapters: Callable[[TrainState], tuple[Any, LoraConfig]] | None = None
    published: int = 0
    at_start: ClassVar[bool] = True  # version 0: what rollout starts from

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
        start_ns = time.time_ns()
        tree = loop.cluster.gather(tree)  # every process takes part; the leader publishes
        if loop.cluster.leader:
            self.publisher.publish(tree, version, loop.step, lora)
        loop.version = version
        self.published += 1
        loop.trace(Span.WEIGHTS_PUBLISH, start_ns, args={"version": version})


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
    at_start: ClassVar[bool] = False

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        if loop.step == 0:
            return  # nothing trained: the starting point needs no checkpoint
        start = time.monotonic()
        c = loop.cluster
        if c.leader:  # the cut: the trainer is between steps, its state is that of step N
            # The groups not yet acked are trained (in the lineage): ids only, no bodies.
            span_ns = time.time_ns()
            snapshot = ckpts.take_snapshot(loop.client, loop.keys, trained=loop.unacked)
            snapshot_s = time.monotonic() - start
            loop.trace(Span.CHECKPOINT_SNAPSHOT, span_ns, args={"step": loop.step})
            ckpts.prepare_dir(self.root, loop.step)
        c.barrier(f"checkpoint-{loop.step}-dir")
        path = ckpts.step_dir(self.root, loop.step)
        state = {
            "params": loop.state.params,
            "opt_state": loop.state.opt_state,
            "step": loop.state.step,
        }
        span_ns = time.time_ns()
        self.checkpointer.save((path / ckpts.STATE).resolve(), state)  # each its own shards
        self.checkpointer.wait_until_finished()
        loop.trace(Span.CHECKPOINT_SAVE, span_ns, args={"step": loop.step})
        c.barrier(f"checkpoint-{loop.step}-state")
        if not c.leader:
            return
        span_ns = time.time_ns()
        ck = ckpts.commit(
            path,
            loop.step,
            loop.checkpoint_meta(),
            snapshot,
            before_commit=lambda: failpoint(CHECKPOINT_COMMIT, loop.log),
        )
        if loop.unacked:
            loop.client.xack(loop.keys.groups, loop.keys.CG_TRAINER, *loop.unacked)
        loop.trace(Span.CHECKPOINT_COMMIT, span_ns, args={"step": loop.step})
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
        loop.forget_before(window_start(self.root))
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
    at_start: ClassVar[bool] = False

    @_busy_hook
    def __call__(self, loop: TrainerLoop, final: bool) -> None:
        start = time.monotonic()
        params = loop.cluster.gather(loop.state.policy_params(self.lora))
        if not loop.cluster.leader:
            return
        write_export(
            self.export_dir, self.spec, params, self.source_dir, loop.cfg, self.max_shard_bytes
        )
        loop.log.info(
            "export_written",
            step=loop.step,
            path=str(self.export_dir),
            write_s=round(time.monotonic() - start, 4),
        )


def write_export(
    export_dir: Path,
    spec: ModelSpec,
    params: Any,
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
        from streamrl.hfchat import chat_template_text  # transformers: not for a stub

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


@dataclass
class EvalSnapshotHook:
    """Writes the policy for the evaluator (`streamrl.evalrun`): a Hugging Face checkpoint
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
            return
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
