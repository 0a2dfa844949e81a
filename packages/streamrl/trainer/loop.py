"""The trainer's loop: groups in, `train_step(state, batch) -> (state, metrics)`, hooks out.

Publishing weights, writing checkpoints and exporting the policy as a Hugging Face
checkpoint hang off the loop as hooks (`streamrl.trainer.hooks`) that run every N steps (and
once more at the end) and return what they did. Groups are acknowledged by the loop only
once a checkpoint hook has committed the checkpoint that holds the update made from them
(DESIGN.md, "Delivery": `checkpointed`); until then they stay pending on the trainer's fixed
consumer name, and the ids already trained are skipped if delivered again. A group is
judged on its own before it joins a batch: one too stale is dropped, one the trainer cannot
use is dead-lettered; either is acknowledged with the next checkpoint like a trained one. A
step whose loss or gradient is not finite changes nothing (the state is kept, no hook runs)
and dead-letters its groups; a few in a row stop the run.

A trainer that starts where a run already went on (`resume`, `streamrl.trainer.resume`)
restores the newest complete checkpoint that Orbax can restore: its state, the window of the
lineage of group ids it trained, the queues from its snapshot when Redis lost the run,
and the trainer's consumer group rewound to the checkpoint's cut; then it publishes the
restored policy as a new version above every version published before (none when the last
version published holds that state already: `resume.rewind`).

Traced (`tracer`) on track ("trainer", "loop"): `trainer.batch_wait` (until a step's groups
are in), `train.step` (ending the flows of the groups it trains), `weights.publish`, and a
checkpoint's `checkpoint.snapshot`, `checkpoint.save` (Orbax) and `checkpoint.commit`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
import redis
import structlog

from streamrl import checkpoints as ckpts
from streamrl import counters
from streamrl.config import Config
from streamrl.errors import FatalError
from streamrl.names import Keys
from streamrl.obs.metrics import EXAMPLES, POLICY_AGE, POLICY_VERSION, SOLVED_REWARD, Metrics
from streamrl.obs.tracing import GROUP_FLOW, Arg, Span, Tracer, flow_id
from streamrl.queues import backlog
from streamrl.rl.clock import PolicyClock, policy_clock
from streamrl.rl.losses import check_rollout_logps, missing_logp_rows
from streamrl.run import incarnation
from streamrl.run.failpoints import TRAINER_RESUME, failpoint
from streamrl.run.liveness import Liveness
from streamrl.trainer import resume as resumption
from streamrl.trainer.cluster import Cluster, scalar
from streamrl.trainer.hooks import Committed, Hook, Published
from streamrl.trainer.resume import CheckpointMeta, Restored
from streamrl.trainer.step import Batch, StepFn, TrainState, build_batch, padded_tokens
from streamrl.transport import Delivery, RedisStreamConsumer, publish, stage_dead_letter
from streamrl.wire import DeadLetter, Group, TrainMetrics, encode, task_figures

TRAINER_CONSUMER = "trainer"

# The loss's behaviour-policy metrics that go into TrainMetrics (`streamrl.rl.losses`).
MISMATCH_METRICS = ("mismatch_logp_abs", "mismatch_kl", "mismatch_kl_seq", "correction_fraction")
# The step's other metrics that go into TrainMetrics when the step reports them (the stub
# step has no policy: neither).
POLICY_METRICS = ("kl", "entropy")

Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # one member's tokens, mask, rollout log-probs


class NonFiniteStepsError(FatalError):
    pass


class FencedError(FatalError):
    """Another trainer took this one's identity over: this one must write nothing more."""


P = ParamSpec("P")
R = TypeVar("R")


# Review N9: a train step is a busy step of the liveness for at most this many times the
# median of the last steps (and never less than run.liveness_timeout_s), once
# STEP_BOUND_AFTER steps are measured (the first ones compile): a step hung in a collective,
# on a device or on a Redis command stops the beat, and `streamrl up` restarts the trainer.
STEP_BOUND_FACTOR = 20
STEP_BOUND_AFTER = 3
STEP_TIMES_KEPT = 32


def _busy(
    method: Callable[Concatenate[TrainerLoop, P], R],
) -> Callable[Concatenate[TrainerLoop, P], R]:
    """A train step of the loop: one busy step of its liveness (`streamrl.run.liveness`),
    bounded by `TrainerLoop.step_bound_s`; its duration is measured for the next bound."""

    @functools.wraps(method)
    def run(loop: TrainerLoop, /, *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.monotonic()
        with loop.liveness.busy(loop.step_bound_s()):
            out = method(loop, *args, **kwargs)
        loop.step_times.append(time.monotonic() - start)
        return out

    return run


@dataclass
class TrainerLoop:
    """State the hooks see: the train state, the step's groups, what is not yet acked."""

    client: redis.Redis
    keys: Keys
    cfg: Config
    state: TrainState
    train_step: StepFn
    log: structlog.stdlib.BoundLogger
    stop: Callable[[], bool]
    pad_id: int
    max_steps: int = 0
    hooks: list[Hook] = field(default_factory=list)
    version: int = 0
    # the run's id (`streamrl.run.incarnation`), recorded by the leader's `resume`
    run_id: str = ""
    # the version is published already (a resume whose restored state it holds): the
    # publish hook's start publishes nothing
    version_held: bool = False
    # the last resume's jump past the restored state's version (review N1): not policy age
    clock: PolicyClock = field(default_factory=lambda: PolicyClock(0))
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
    metrics: Metrics | None = None  # examples trained and their policy age (streamrl.obs.metrics)
    tracer: Tracer = field(default_factory=Tracer.disabled)
    # Review N13: whether this process is still the run's trainer (holds its identity
    # slot), asked on the leader before every hook (publish, checkpoint, export) and
    # acknowledgement; once another trainer has taken over, this one writes nothing more.
    fence: Callable[[], bool] = lambda: True

    def __post_init__(self) -> None:
        self.track = self.tracer.track("trainer", "loop")
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)  # the last steps' s
        # Review N2. entry id -> steps its group entered before this one (Keys.
        # trainer_attempts, read when admitted); groups read for a step but held back while
        # a group whose step died before is trained alone (`_isolate`).
        self.attempts: dict[str, int] = {}
        self.carry: list[Delivery[Group]] = []
        self.full = False  # the step's batch reached trainer.max_batch_tokens
        self.lengths: dict[str, list[int]] = {}  # entry id -> its rows' lengths (admitted)
        self.data_done = False  # the data ended and the pipeline is drained
        self._next_drain_check = 0.0
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

    def step_bound_s(self) -> float | None:
        """How long the next train step may run before the loop counts as stuck (review
        N9); None (unbounded) until `STEP_BOUND_AFTER` steps are measured."""
        if len(self.step_times) < STEP_BOUND_AFTER:
            return None
        median = statistics.median(self.step_times)
        return max(STEP_BOUND_FACTOR * median, self.cfg.run.liveness_timeout_s)

    def collect(self) -> list[Delivery[Group]]:
        """The next `groups_per_step` groups to train on (fewer if stopped); the others read
        on the way are set aside (`_admit`)."""
        want = self.cfg.trainer.groups_per_step
        out: list[Delivery[Group]] = []
        self.full = False
        carried, self.carry = self.carry, []
        for d in carried:
            self._into_batch(d, out, want)
        while len(out) < want and not self.full and not self.stop():
            self.liveness.tick()
            got = self.input.read(count=want - len(out))
            for d in got:
                if self._admit(d, out):
                    self._into_batch(d, out, want)
            if not got and self._drained():
                self.data_done = True
                self.log.info("data_drained", step=self.step, last_groups=len(out))
                break
        return out

    def _into_batch(self, d: Delivery[Group], out: list[Delivery[Group]], want: int) -> None:
        """Put an admitted group into the step's batch `out`, or back for a later step
        when the batch is full: `want` groups, or `trainer.max_batch_tokens` padded tokens
        (then `full`: the step goes with fewer groups). A group past the cap alone is
        dead-lettered."""
        if self.full or len(out) >= want:
            self.carry.append(d)
            return
        cap = self.cfg.trainer.max_batch_tokens
        if cap:
            multiple = getattr(self.train_step, "row_multiple", 1)
            alone = padded_tokens(self.lengths[d.entry_id], multiple)
            if alone > cap:
                self._set_aside([d], f"too big: its rows alone pad to {alone} tokens "
                                f"(trainer.max_batch_tokens {cap})", dead=True)  # fmt: skip
                return
            rows = [n for x in (*out, d) for n in self.lengths[x.entry_id]]
            if padded_tokens(rows, multiple) > cap:
                self.full = True
                self.carry.append(d)
                return
        out.append(d)

    def _drained(self) -> bool:
        """Whether nothing will ever come again (checked at most once a second): the feeder
        wrote its last task (`task.epochs`: it set `feeder_end`), every task and trajectory
        is acknowledged, no group is half filled, and every group was delivered here. The
        groups this loop holds unacknowledged (until its next checkpoint) do not count."""
        now = time.monotonic()
        if now < self._next_drain_check or self.carry:
            return False
        self._next_drain_check = now + 1.0
        k, c = self.keys, self.client
        end, cursor = c.mget([k.feeder_end, k.feeder_cursor])
        if end is None or int(cursor or 0) < int(end) or c.hlen(k.groups_started):
            return False
        if c.hlen(k.groups_order_held_at):  # groups held for their turn (grouper.order)
            return False
        for stream, group, pending_ok in (
            (k.tasks, k.CG_ROLLOUT, False),
            (k.trajectories, k.CG_GROUPER, False),
            (k.groups, k.CG_TRAINER, True),
        ):
            lag, pending = backlog(c, stream, group, 1)
            if lag or (pending and not pending_ok):
                return False
        return True

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
        if self.client.sismember(self.keys.groups_dropped, gid):
            # Dropped by a trainer that died before the checkpoint that acknowledges it: the
            # verdict stands (judged again after the resume's version jump, a stale group
            # could pass and be trained while the dropped set and counters say dropped)
            self._set_aside([d], "dropped before a restart (the dropped set holds it)", dead=False)
            return False
        stale = self._stale(d.msg)
        if stale:
            self._set_aside([d], stale, dead=False)
            return False
        try:
            rows, _ = group_rows(d.msg, self.cfg.trainer.needs_rollout_logps)
            self.lengths[d.entry_id] = [len(tokens) for tokens, _, _ in rows]
        except ValueError as err:
            self._set_aside([d], f"group unusable by the trainer: {err}", dead=True)
            return False
        tries = int(self.client.hget(self.keys.trainer_attempts, d.entry_id) or 0)
        limit = self.cfg.transport.max_deliveries
        if tries >= limit:
            reason = (
                f"poison: the trainer's step died with this group in it {tries} times "
                f"(transport.max_deliveries {limit}; the last times it was trained alone)"
            )
            self._set_aside([d], reason, dead=True)
            return False
        self.attempts[d.entry_id] = tries
        return True

    def _isolate(self, groups: list[Delivery[Group]]) -> list[Delivery[Group]]:
        """Review N2: a group whose earlier step never finished (the trainer died in it: a
        device or host OOM, an exception) is trained alone, so the step that dies again
        is its own and its batch-mates are not blamed with it; the others wait for the
        next steps (`carry`). Each step a group enters is counted first, and the count
        forgotten once the step returns (`_attempted`)."""
        suspects = [d for d in groups if self.attempts.get(d.entry_id, 0) > 0]
        if not suspects or len(groups) == 1:
            return groups
        alone = suspects[0]
        self.carry = [d for d in groups if d is not alone] + self.carry
        self.log.warning(
            "group_isolated",
            group_id=alone.msg.group_id,
            entry_id=alone.entry_id,
            attempts=self.attempts[alone.entry_id],
            reason="a step with it died before: trained alone",
        )
        return [alone]

    def _attempted(self, groups: list[Delivery[Group]], change: int | None) -> None:
        """Count a step each of `groups` enters (`change` +1), in Redis, where it survives
        the trainer; forget the count once the step finished (None), whatever its result:
        only a step that never returned leaves its groups suspect."""
        pipe = self.client.pipeline(transaction=False)
        for d in groups:
            if change is None:
                pipe.hdel(self.keys.trainer_attempts, d.entry_id)
                self.attempts.pop(d.entry_id, None)
            else:
                pipe.hincrby(self.keys.trainer_attempts, d.entry_id, change)
        pipe.execute()

    def _out_of_memory(self, err: Exception) -> bool:
        """Whether the step failed for device or host memory with the state intact (one
        process; no donated buffer of it deleted), so the loop can go on without it."""
        oom = isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err)
        if not oom or self.cluster.count > 1:
            return False
        leaves = jax.tree.leaves(self.state)
        return not any(getattr(x, "is_deleted", lambda: False)() for x in leaves)

    def _step_out_of_memory(self, groups: list[Delivery[Group]], err: Exception) -> None:
        """Review N2: a step that ran out of memory is not the trainer's end. Its groups
        count the attempt (as a step that died would) and come back first: a suspect one is
        trained alone (`_isolate`), so the batch is split down to the group that does not
        fit; that one alone, `transport.max_deliveries` times, is dead-lettered."""
        for d in groups:
            self.attempts[d.entry_id] = self.attempts.get(d.entry_id, 0) + 1
        limit = self.cfg.transport.max_deliveries
        [first] = groups[:1]
        tries = self.attempts[first.entry_id]
        self.log.error("step_out_of_memory", step=self.step + 1, error=str(err)[:500],
                       group_ids=[d.msg.group_id for d in groups])  # fmt: skip
        if len(groups) == 1 and tries >= limit:
            reason = (
                f"poison: the step ran out of memory with this group alone {tries} times "
                f"(transport.max_deliveries {limit}): {str(err)[:200]}"
            )
            self._set_aside(groups, reason, dead=True)
            return
        self.carry = groups + self.carry

    def _stale(self, group: Group) -> str:
        """Why `group` is too far off policy to train on now ('' when it is not): any
        member whose oldest turn is more than `grouper.off_policy_steps` versions behind
        the trainer's (the grouper checks at emission; the trainer may have moved on)."""
        limit = self.cfg.grouper.off_policy_steps
        lags = [self.policy_age(t.min_version) for t in group.members if t.versions]
        if lags and max(lags) > limit:
            return (
                f"stale at the trainer: a member is {max(lags)} policy versions behind "
                f"trainer version {replace(self.clock, version=self.version)} "
                f"(grouper.off_policy_steps {limit})"
            )
        return ""

    def policy_age(self, version: int) -> int:
        """Versions between `version` (a trajectory's turn) and the policy trained now,
        not counting the versions a resume jumped past its restored state (review N1)."""
        return replace(self.clock, version=self.version).age(version)

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
        batch = build_batch(items, advantages, self.pad_id, self.train_step.row_multiple)
        return batch, rewards, min_versions

    def trace(
        self,
        name: str,
        start_ns: int,
        ends_flows: Sequence[int] = (),
        args: Mapping[str, Arg] | None = None,
    ) -> None:
        """A span `name` of the loop, from `start_ns` to now (this host's clock)."""
        self.tracer.span(
            self.track, name, start_ns, time.time_ns(), ends_flows=ends_flows, args=args
        )

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
        if groups:
            self._attempted(groups, +1)
        try:
            state, m = self.train_step(self.state, batch)
        except Exception as err:
            if not (groups and self._out_of_memory(err)):
                raise
            self._step_out_of_memory(groups, err)
            return None
        if groups:
            self._attempted(groups, None)  # the step finished: no group of it is suspect
            for d in groups:
                self.lengths.pop(d.entry_id, None)
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
        ages = [self.policy_age(v) for v in min_versions]
        return TrainMetrics(
            step=self.step,
            version=self.version,
            loss=loss,
            reward_mean=float(np.mean(rewards)),
            solve_rate=float(np.mean(np.asarray(rewards) >= SOLVED_REWARD)),
            policy_age_mean=float(np.mean(ages)),
            tasks=task_figures([d.msg for d in groups], SOLVED_REWARD),
            num_groups=len(groups),
            num_sequences=len(rewards),
            num_tokens=int(scalar(m["num_tokens"])),
            clip_fraction=scalar(m["clip_fraction"]),
            grad_norm=grad_norm,
            max_policy_lag=self.policy_age(min(min_versions)),
            step_time_s=time.monotonic() - start,
            **{k: scalar(m[k]) for k in (*MISMATCH_METRICS, *POLICY_METRICS) if k in m},
        )

    def _count(self, min_versions: list[int]) -> None:
        """A step's examples (sequences) as counters, each with its policy age: versions
        between its oldest turn's policy and the one trained."""
        if self.metrics is None:
            return
        self.metrics.count(EXAMPLES, len(min_versions))
        for v in min_versions:
            self.metrics.observe(POLICY_AGE, self.policy_age(v))

    def probe(self) -> dict[str, float]:
        """The version trained (and published) now, for `streamrl.obs.metrics`."""
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

    def checkpoint_meta(self) -> CheckpointMeta:
        """meta.json: the lineage (and set_aside) of the window the loop holds, and
        `lineage_from`, the oldest step a resume from this checkpoint needs: that of the
        oldest group pending at its cut (those after the cut are delivered again)."""
        return CheckpointMeta(
            step=self.step,
            version=self.version,
            seed=self.cfg.run.seed,
            lineage=list(self.lineage),
            set_aside=list(self.set_aside),
            lineage_from=min(self.unacked.values(), default=self.step + 1),
            groups_trained=self.groups_trained,
        )

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
        `root` (`resume.find_restorable`; None: there is none, the state stays fresh),
        rewind the trainer's consumer group to its cut, and take a policy version above
        every one published before. A fresh run (nothing published, no checkpoint) is left
        as it is. Every process restores the same checkpoint; the leader alone does the
        Redis part. Returns the step the loop resumes from."""
        restored = resumption.find_restorable(
            root, self.state, checkpointer, self.cluster, self.log
        )
        if restored is not None:
            self._take(restored)
        if not self.cluster.leader:
            return self.step if restored is not None else None
        resumption.restore_queues(self.client, self.keys, root, restored, self.log)
        # the run's id: written back with the queues, by `streamrl up`, or here (compose)
        self.run_id = incarnation.create(self.client, self.keys)
        if restored is None and self.client.get(self.keys.policy_version) is None:
            return None  # a fresh run
        failpoint(TRAINER_RESUME, self.log)
        rewound = resumption.rewind(
            self.client, self.keys, restored, reuse=self.cfg.trainer.publish != "lora"
        )
        self.version, start, self.version_held = rewound.version, rewound.start, rewound.held
        # Review N1: the restored state is the checkpoint's version (0: the initial state),
        # published again as `version`; the jump between them is no policy age.
        state_version = max(restored.meta.version, 0) if restored is not None else 0
        before = policy_clock(None, self.client.get(self.keys.policy_offset))
        self.clock = before.resumed(self.version, self.version - state_version)
        self.client.set(self.keys.policy_offset, self.clock.encode())
        self.unacked.clear()
        self.log.info(
            "trainer_resumed",
            step=self.step,
            checkpoint=None if restored is None else str(restored.checkpoint.path),
            version=self.version,
            groups_rewound_to=start,
            version_published_already=self.version_held,
            trained_groups=sum(len(ids) for _, ids in self.lineage),
        )
        return self.step

    def _take(self, restored: Restored) -> None:
        """The restored checkpoint's state and records become the loop's."""
        self.state = self.state.from_checkpoint_tree(restored.tree)
        meta = restored.meta
        self.lineage = [(s, list(ids)) for s, ids in meta.lineage]
        self.set_aside = [(s, list(ids)) for s, ids in meta.set_aside]
        self.consumed = {g: s for s, ids in self.lineage for g in ids}
        self.aside = {e: s for s, ids in self.set_aside for e in ids}
        self.groups_trained = meta.trained

    def _next_groups(self) -> list[Delivery[Group]] | None:
        """The leader's groups for the next step; None when the run stops there. Every
        process learns the leader's decision, so all stop at the same step."""
        groups = None
        if self.cluster.leader:
            done = self.stop() or (self.max_steps != 0 and self.step >= self.max_steps)
            groups = [] if done or self.data_done else self.collect()
            short = len(groups) < self.cfg.trainer.groups_per_step
            if short and not (self.full and groups) and not (self.data_done and groups):
                self.carry = groups + self.carry  # (delivered again after a restart anyway)
                groups = None  # stopped while waiting (the data's last groups: a short step)
            else:
                groups = self._isolate(groups)
        with self.liveness.busy():  # the others wait here while the leader collects
            go = self.cluster.broadcast(np.array([groups is not None]))
        if not bool(go[0]):
            return None
        return groups if self.cluster.leader else []

    def run(self) -> None:
        for hook in self.hooks:  # e.g. version 0: what rollout starts from
            if hook.at_start:
                self._run_hook(hook, final=True)
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
                    self._run_hook(hook, final=False)
        for hook in self.hooks:
            if not hook.every or self.step % hook.every != 0:
                self._run_hook(hook, final=True)
        self.log.info("trainer_done", step=self.step, version=self.version)

    def _run_hook(self, hook: Hook, final: bool) -> None:
        """Run `hook` and act on what it did: a version published is the loop's version; a
        checkpoint committed acknowledges the groups it holds (`checkpointed`)."""
        self._fenced(type(hook).__name__)
        done = hook(self, final)
        if isinstance(done, Published):
            self.version = done.version
        elif isinstance(done, Committed):
            self.checkpointed(done)

    def _fenced(self, what: str) -> None:
        """FencedError when another trainer has taken this one's identity (review N13):
        its publications, checkpoints and acknowledgements would mix with that one's."""
        if self.cluster.leader and not self.fence():
            raise FencedError(
                f"this trainer no longer holds its identity: another trainer of the run took "
                f"it over (this one was cut off from Redis, or a second one started); it "
                f"stops before its {what} at step {self.step}, writing nothing more"
            )

    def checkpointed(self, done: Committed) -> None:
        """The delivery contract (DESIGN.md, "Delivery"): the groups consumed since the last
        checkpoint are acknowledged now that `done` holds the update made from them (or
        their setting aside) durably; then old checkpoints are pruned, the records of groups
        no checkpoint kept can deliver again are forgotten and, with `trim`, the streams
        and what grows with the run are trimmed to that window."""
        if self.unacked:
            self._fenced("acknowledgement")
            pipe = self.client.pipeline(transaction=False)
            pipe.xack(self.keys.groups, self.keys.CG_TRAINER, *self.unacked)
            pipe.hdel(self.keys.trainer_attempts, *self.unacked)
            pipe.execute()
            for entry_id in self.unacked:
                self.attempts.pop(entry_id, None)
        ck, snapshot = done.checkpoint, done.snapshot
        self.log.info(
            "checkpoint_written",
            step=self.step,
            path=str(ck.path),
            acked=len(self.unacked),
            # unfinished at the cut: entries pending or not yet delivered, per stream
            in_flight={x.stream.rsplit(":", 1)[-1]: len(x.entries) for x in snapshot.streams},
            snapshot_bytes=(ck.path / ckpts.QUEUES).stat().st_size,
            snapshot_s=round(done.snapshot_s, 4),
            write_s=round(time.monotonic() - done.started, 4),
        )
        self.unacked.clear()
        root = ck.path.parent
        ckpts.prune(root, done.keep, self.log)
        self.forget_before(resumption.window_start(root))
        if done.trim:
            floor = ckpts.oldest_snapshot(root)
            trimmed = ckpts.trim_streams(self.client, self.keys, floor)
            trimmed |= ckpts.trim_history(
                self.client,
                self.keys,
                floor,
                keep_dead_letters=self.cfg.trainer.keep_dead_letters,
                keep_dead_letter_bytes=int(self.cfg.trainer.keep_dead_letters_mb * 2**20),
                keep_metrics=self.cfg.trainer.keep_metrics,
            )
            if trimmed:
                self.log.info("streams_trimmed", step=self.step, deleted=trimmed)


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
