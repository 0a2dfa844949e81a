"""Every Redis stream, consumer-group and key name of a run, built in one place.

All names live under the run namespace in braces (`{<ns>}:tasks`, ...), so two runs can share
one Redis server without seeing each other's data, and the braces are a Redis Cluster hash
tag: every key of a run hashes to one slot, so the multi-key scripts and MULTI/EXEC blocks
of a run work on a cluster, and different runs spread over its nodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from streamrl.config import NAME_PATTERN

_NS = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class Keys:
    """Names of one run's streams and keys."""

    ns: str

    def __post_init__(self) -> None:
        if not _NS.match(self.ns):
            raise ValueError(f"invalid run namespace {self.ns!r}")

    def _k(self, *parts: str) -> str:
        # Only the tag is hashed by a cluster; `_NS` keeps braces out of the namespace.
        return ":".join((f"{{{self.ns}}}", *parts))

    @property
    def prefix(self) -> str:
        """What every key of the run starts with (`{<ns>}:`)."""
        return self._k("")

    def scratch(self, *parts: str) -> str:
        """A key of the run that no worker uses (benchmarks, tests): it shares the run's
        hash slot and its ACL patterns like every other key."""
        return self._k("scratch", *parts)

    # Key patterns (globs) for the ACL rules of `streamrl.run.acl`: built from `_k` like every
    # name, so they follow it. The namespace holds no glob character, and the braces of
    # the hash tag are none either in Redis's glob matching (only `*?[\\` are).
    @property
    def every_key(self) -> str:
        """Pattern of every key of the run."""
        return self._k("*")

    @property
    def weights_chunk_pattern(self) -> str:
        """Pattern of every `weights_chunk` key (never `weights_chunks`, the hash)."""
        return self._k("weights", "v*")

    @property
    def tool_result_pattern(self) -> str:
        """Pattern of every `tool_result` list."""
        return self._k("toolres", "*")

    def worker_slots(self, worker: str) -> str:
        """Pattern of the identity slot keys of one worker type (`worker_slot`)."""
        return self._k("worker", worker, "*")

    # Streams (docs/ARCHITECTURE.md, section 2: who writes and reads each).
    @property
    def tasks(self) -> str:
        return self._k("tasks")

    @property
    def trajectories(self) -> str:
        return self._k("trajectories")

    @property
    def groups(self) -> str:
        return self._k("groups")

    @property
    def weights(self) -> str:
        return self._k("weights")

    @property
    def dead(self) -> str:
        return self._k("dead")

    @property
    def metrics(self) -> str:
        """Trainer metrics, one entry per step."""
        return self._k("metrics")

    def streams(self) -> tuple[str, ...]:
        return (
            self.tasks,
            self.trajectories,
            self.groups,
            self.weights,
            self.dead,
            self.metrics,
        )

    def worker_metrics(self, worker_id: str) -> str:
        """Stream of one worker process's counter samples (`streamrl.obs.metrics`), one entry
        per `metrics.interval_s`, trimmed to ~`metrics.keep_samples` (`worker_id`:
        `<worker>-<index>`)."""
        return self._k("metrics", worker_id)

    def worker_metrics_of(self, worker: str) -> str:
        """Pattern of the `worker_metrics` streams of one worker type (its ACL)."""
        return self._k("metrics", f"{worker}-*")

    @property
    def every_worker_metrics(self) -> str:
        """Pattern of every `worker_metrics` stream (what `streamrl status` scans)."""
        return self._k("metrics", "*")

    # Consumer groups: one per reading worker type.
    CG_ROLLOUT = "rollout"
    CG_GROUPER = "grouper"
    CG_TRAINER = "trainer"

    # Keys.
    @property
    def stats(self) -> str:
        """Hash of run counters (trajectories, groups, tool_calls, ...)."""
        return self._k("stats")

    @property
    def policy_version(self) -> str:
        """The trainer's latest published policy version (an integer)."""
        return self._k("policy", "version")

    def weights_blob(self, version: int) -> str:
        """Prefix of one published version's chunk keys (the `redis` weights channel)."""
        return self._k("weights", f"v{version:06d}")

    def weights_chunk(self, version: int, index: int) -> str:
        """String key holding chunk `index` of a published version's bytes."""
        return f"{self.weights_blob(version)}:{index}"

    @property
    def weights_chunks(self) -> str:
        """Hash version -> chunk count of the versions held in Redis (what to delete)."""
        return self._k("weights", "chunks")

    @property
    def rollout_capacity(self) -> str:
        """Hash rollout worker -> "<episode slots>:<ms, Redis clock>" its heartbeat renews:
        the live rollout capacity the feeder sizes its backlog to (`streamrl.capacity`)."""
        return self._k("rollout", "capacity")

    @property
    def feeder_cursor(self) -> str:
        """Next data-set position the feeder writes."""
        return self._k("feeder", "cursor")

    @property
    def feeder_end(self) -> str:
        """The first cursor with no task (`task.epochs`), set by the feeder once it wrote
        the last task: the trainer ends the run when everything before it is trained or
        dropped."""
        return self._k("feeder", "end")

    def group_members(self, group_id: str) -> str:
        """Hash member index -> encoded trajectory of a group being assembled."""
        return self._k("group", group_id, "members")

    @property
    def groups_emitted(self) -> str:
        """Set of group ids already written to `groups` (each is emitted once)."""
        return self._k("groups", "emitted")

    @property
    def groups_started(self) -> str:
        """Hash group id -> ms of its first member's arrival, for groups being assembled."""
        return self._k("groups", "started")

    @property
    def groups_dropped(self) -> str:
        """Set of group ids dropped by a policy (late members are dropped too)."""
        return self._k("groups", "dropped")

    @property
    def groups_order_next(self) -> str:
        """grouper.order submission: the next task cursor whose group may be written."""
        return self._k("groups", "order", "next")

    @property
    def groups_order_held(self) -> str:
        """grouper.order submission: hash cursor -> its encoded group ('' when the cursor's
        group was dropped), for cursors past `groups_order_next` held for their turn."""
        return self._k("groups", "order", "held")

    @property
    def groups_order_held_at(self) -> str:
        """grouper.order submission: hash cursor -> Redis ms its group (or drop) was held."""
        return self._k("groups", "order", "held_at")

    @property
    def trainer_attempts(self) -> str:
        """Hash `groups` entry id -> trainer steps the group entered, kept across trainer
        restarts and rewinds (review N2): a group whose steps keep dying is isolated, then
        dead-lettered at `transport.max_deliveries`. Cleared with the group's ack."""
        return self._k("trainer", "attempts")

    @property
    def groups_attempts(self) -> str:
        """Hash group id -> timeout checks of it that began and never ended (a grouper
        died or raised deciding on it), kept across grouper restarts (review N2): at
        `transport.max_deliveries` the group is dropped without being read again."""
        return self._k("groups", "attempts")

    @property
    def groups_waiting(self) -> str:
        """How many groups wait for the trainer (its consumer group's lag in `groups`), as
        a grouper last read it from Redis (with a TTL): what rollout's backpressure reads."""
        return self._k("groups", "waiting")

    @property
    def groups_reruns(self) -> str:
        """Hash group id -> times its missing members were re-run after group_timeout."""
        return self._k("groups", "reruns")

    @property
    def run_id(self) -> str:
        """The run's incarnation (review N8): a random id written when the run is created,
        kept in every checkpoint's snapshot and written back with it. Every worker records
        it at start and stops (fatal) once Redis no longer holds it: Redis lost the run."""
        return self._k("run")

    @property
    def policy_offset(self) -> str:
        """Versions a resumed trainer's first publish jumped past its restored state's
        (review N1): the policy age of a trajectory is `policy_version - policy_offset -
        its oldest turn's version`, so the jump is no age. Set by the trainer's resume."""
        return self._k("policy", "offset")

    @property
    def policy_floor(self) -> str:
        """Lowest policy version a rollout worker may serve (set on resume: the versions
        below it belong to a trainer lineage that a restored checkpoint discarded)."""
        return self._k("policy", "floor")

    @property
    def episodes(self) -> str:
        """Hash trajectory id -> encoded `EpisodeState` of each unfinished episode at its
        last turn boundary (or the marker of a member committed before its task's ack)."""
        return self._k("episodes")

    @property
    def tool_ledger(self) -> str:
        """Hash idempotency key -> encoded result of non-idempotent tool calls already run."""
        return self._k("tools", "ledger")

    def tool_ledger_claim(self, key: str) -> str:
        """String key holding the claim token of one ledger key while a call runs; a key of
        its own because claims expire one by one."""
        return f"{self.tool_ledger}:claim:{key}"

    @property
    def tool_queue(self) -> str:
        """rq queue name of this run's tool calls. rq builds its own keys from it
        (`rq:queue:{<ns>}:tools`, `rq:job:<id>`, ...): those are not in the run's slot."""
        return self._k("tools")

    def tool_result(self, call_id: str, nonce: str) -> str:
        """List a tool worker pushes one attempt's result onto: the call's id and a nonce
        the calling execution drew for that attempt, so that no other execution of the call
        (a replayed or re-run episode, whose call ids are the same) pops it."""
        return self._k("toolres", call_id, nonce)

    def worker_slot(self, worker: str, index: int) -> str:
        """String key holding who runs worker `<worker>-<index>` (its holder id), with a TTL
        its heartbeat renews: the identity claim of a replica, and its liveness."""
        return self._k("worker", worker, str(index))

    def worker_beat(self, worker: str, index: int) -> str:
        """String key holding worker `<worker>-<index>`'s liveness beat (its holder id and
        a count of beats), written only while the worker's loop turns: `streamrl up`
        restarts a worker whose beat stops changing (`streamrl.run.liveness`). Under
        `worker_slots`, so each worker's ACL allows it."""
        return f"{self.worker_slot(worker, index)}:beat"


@dataclass(frozen=True)
class RunPaths:
    """Every directory and file of a run directory (RUN_DIR), named in one place, as `Keys`
    names the run's Redis keys."""

    root: Path

    CHECKPOINTS = "checkpoints"  # the trainer's step directories (`streamrl.checkpoints`)
    LOGS = "logs"  # one JSON log and one stderr file per worker, and the launcher's
    EXPORT = "export"  # the trained policy as a Hugging Face checkpoint
    EVAL = "eval"  # the evaluator's snapshots and results (`streamrl.evaluation.watch`)
    TRACES = "traces"  # one <worker>.pftrace per worker process (`streamrl.obs.tracing`)
    WEIGHTS = "weights"  # the `dir` weights channel's versions (`streamrl.weightsync`)
    REDIS = "redis"  # the embedded Redis: its AOF, config, log and secrets
    SUMMARY = "summary.json"  # what `streamrl up` reports at the end
    TENSORBOARD = "tensorboard"  # the sinks worker's TensorBoard event files (obs.sinks)
    WANDB = "wandb"  # the sinks worker's W&B files: offline runs, W&B's own dirs (obs.sinks)

    @property
    def checkpoints(self) -> Path:
        return self.root / self.CHECKPOINTS

    @property
    def logs(self) -> Path:
        return self.root / self.LOGS

    @property
    def export(self) -> Path:
        return self.root / self.EXPORT

    @property
    def eval(self) -> Path:
        return self.root / self.EVAL

    @property
    def traces(self) -> Path:
        return self.root / self.TRACES

    @property
    def weights(self) -> Path:
        return self.root / self.WEIGHTS

    @property
    def redis(self) -> Path:
        return self.root / self.REDIS

    @property
    def summary(self) -> Path:
        return self.root / self.SUMMARY

    @property
    def tensorboard(self) -> Path:
        return self.root / self.TENSORBOARD

    @property
    def wandb(self) -> Path:
        return self.root / self.WANDB

    def log(self, worker_id: str) -> Path:
        """A worker's (or "launcher"'s) JSON log."""
        return self.logs / f"{worker_id}.log"

    def stderr(self, worker_id: str) -> Path:
        """What a worker process printed (its log is the JSON one)."""
        return self.logs / f"{worker_id}.stderr"
