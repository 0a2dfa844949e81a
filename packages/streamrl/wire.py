"""Typed wire messages, msgpack-encoded, with a schema version.

A stream entry has three fields: `v` (schema version), `kind` (message type) and `data`
(the msgpack body). Decoding checks the version and the kind before the body, so a reader
can tell "wrong version" from "garbage" and say which in the dead-letter entry. Nothing is
pickled. Token ids, masks and log-probabilities travel as raw little-endian array bytes:
a list of Python ints is several times larger and slower to encode for long episodes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypedDict, TypeVar

import msgspec
import numpy as np
from numpy.typing import ArrayLike

SCHEMA_VERSION = 1

Status = Literal["ok", "timeout", "error", "truncated"]
# Statuses of an episode that infrastructure ended, not the policy (an error: a tool or
# engine failure, an environment that raised; a timeout: the episode's wall clock): such a
# member is masked out of its group's mean and std and out of the loss.
MASKED_STATUSES: frozenset[Status] = frozenset({"error", "timeout"})


class WireError(ValueError):
    """An entry that cannot be decoded; the message is the dead-letter reason."""


class Message(msgspec.Struct, kw_only=True, frozen=True):
    KIND: ClassVar[str] = ""


class Task(Message, frozen=True, kw_only=True):
    """One source prompt; its `num_generations` episodes form one group.

    `members`: the member indices to run, None for all of them. A grouper re-running the
    missing members of a timed-out group sends the same task with only those indices, so a
    re-run member keeps its member index and trajectory id. `data`: the further fields of
    the prompt's data row (JSON-like values), for the task's environment and reward.
    """

    KIND: ClassVar[str] = "task"
    task_id: str
    group_id: str
    kind: str
    prompt: str
    answer: str
    num_generations: int
    cursor: int
    members: list[int] | None = None
    data: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Raised while decoding, this makes the entry a dead letter with the reason.
        if self.members is None:
            return
        bad = [m for m in self.members if not 0 <= m < self.num_generations]
        if bad or not self.members:
            raise ValueError(
                f"task members {self.members} must be one or more indices in "
                f"[0, {self.num_generations})"
            )

    def member_indices(self) -> list[int]:
        """The member indices this task runs, ascending and unique."""
        if self.members is None:
            return list(range(self.num_generations))
        return sorted(set(self.members))


class Trajectory(Message, frozen=True, kw_only=True):
    """One finished episode.

    `tokens` (int32), `loss_mask` (uint8) and `logprobs` (float32) are aligned arrays of the
    whole transcript; the mask is 1 only on tokens the policy sampled, and `logprobs` holds
    the rollout log-probability of those tokens (0 elsewhere). `versions` has the policy
    version of each model turn, in order.
    """

    KIND: ClassVar[str] = "trajectory"
    traj_id: str
    group_id: str
    task_id: str
    member: int
    num_generations: int
    tokens: bytes
    loss_mask: bytes
    logprobs: bytes
    prompt_len: int
    reward: float
    status: Status
    versions: list[int]
    num_tool_calls: int = 0
    error: str = ""
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    worker: str = ""
    cursor: int = -1  # the task's data-set cursor (what a re-run rebuilds it from); -1 unknown
    task: str = ""  # the label of its task (Task.kind): a mixture's per-task figures; "" unknown

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<i4")

    def mask_array(self) -> np.ndarray:
        return np.frombuffer(self.loss_mask, dtype=np.uint8)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype="<f4")

    @property
    def valid(self) -> bool:
        """Whether this member counts: in its group's statistics and in the loss (its
        status is not one of MASKED_STATUSES)."""
        return self.status not in MASKED_STATUSES

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1

    @property
    def max_version(self) -> int:
        return max(self.versions) if self.versions else -1


class ArrayFields(TypedDict):
    """The array fields of a Trajectory, as raw little-endian bytes."""

    tokens: bytes
    loss_mask: bytes
    logprobs: bytes


def pack_arrays(tokens: ArrayLike, loss_mask: ArrayLike, logprobs: ArrayLike) -> ArrayFields:
    """Array fields of a Trajectory from anything numpy can read."""
    t = np.asarray(tokens, dtype="<i4")
    m = np.asarray(loss_mask, dtype=np.uint8)
    lp = np.asarray(logprobs, dtype="<f4")
    if not (t.shape == m.shape == lp.shape) or t.ndim != 1:
        raise ValueError(
            f"trajectory arrays must be 1-D and aligned: {t.shape} {m.shape} {lp.shape}"
        )
    return ArrayFields(tokens=t.tobytes(), loss_mask=m.tobytes(), logprobs=lp.tobytes())


class Group(Message, frozen=True, kw_only=True):
    """A complete group: every member with its GRPO advantage."""

    KIND: ClassVar[str] = "group"
    group_id: str
    task_id: str
    members: list[Trajectory]
    advantages: list[float]
    created_at: float = msgspec.field(default_factory=time.time)


class LoraInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader needs to merge published adapters: `W + (alpha / rank) * A @ B` on
    every layer named in `targets`."""

    rank: int
    alpha: float
    targets: tuple[str, ...]


class Weights(Message, frozen=True, kw_only=True):
    """A published policy version, by reference.

    `channel` "dir": the bytes are the file at `path`; "redis": they are split over
    `chunks` keys (`Keys.weights_chunk(version, i)`, whose common prefix is `path`).
    `nbytes` and `checksum` (`<algorithm>:<hex digest>`, see `streamrl.weightsync`) are
    those of the whole byte string (`streamrl.model.weights`' format). `kind` "lora":
    the bytes are adapters only (`lora` gives rank, alpha, targets), merged into the full
    version `base_version`.
    """

    KIND: ClassVar[str] = "weights"
    version: int
    step: int
    path: str
    nbytes: int
    checksum: str
    kind: Literal["full", "lora"] = "full"
    channel: Literal["dir", "redis"] = "dir"
    chunks: int = 0
    lora: LoraInfo | None = None
    base_version: int = -1
    created_at: float = msgspec.field(default_factory=time.time)


class DeadLetter(Message, frozen=True, kw_only=True):
    """An entry that could not be processed, with why."""

    KIND: ClassVar[str] = "dead"
    source: str
    entry_id: str
    reason: str
    fields: dict[str, bytes]
    consumer: str
    deliveries: int
    created_at: float = msgspec.field(default_factory=time.time)


class TaskFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One task's share of a trainer step (a mixture's per-task figures): its groups and
    sequences, their mean reward and the share that solved (reward >= SOLVED_REWARD)."""

    groups: int
    sequences: int
    reward_mean: float
    solve_rate: float


def task_figures(groups: Sequence[Group], solved_reward: float) -> dict[str, TaskFigures]:
    """A step's figures per task, by the label its trajectories carry ("" where none)."""
    rewards: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for g in groups:
        label = g.members[0].task if g.members else ""
        rewards.setdefault(label, []).extend(t.reward for t in g.members)
        counts[label] = counts.get(label, 0) + 1
    return {
        label: TaskFigures(
            groups=counts[label],
            sequences=len(rs),
            reward_mean=sum(rs) / len(rs) if rs else 0.0,
            solve_rate=sum(r >= solved_reward for r in rs) / len(rs) if rs else 0.0,
        )
        for label, rs in sorted(rewards.items())
    }


class TrainMetrics(Message, frozen=True, kw_only=True):
    """One trainer step's figures."""

    KIND: ClassVar[str] = "metrics"
    step: int
    version: int
    loss: float
    reward_mean: float
    num_groups: int
    num_sequences: int
    num_tokens: int
    clip_fraction: float
    grad_norm: float
    max_policy_lag: int
    step_time_s: float
    created_at: float = msgspec.field(default_factory=time.time)
    # Behaviour-policy mismatch on the step's sampled tokens, d = trainer - rollout
    # log-prob (`streamrl.rl.losses.policy_loss`): mean |d|; k3's KL(rollout || trainer)
    # per token and per sequence; the share of tokens the importance correction changed.
    # 0 in entries written before they were logged.
    mismatch_logp_abs: float = 0.0
    mismatch_kl: float = 0.0
    mismatch_kl_seq: float = 0.0
    correction_fraction: float = 0.0
    # The loss's KL(policy || reference) per token (0 when trainer.kl_beta is 0); the mean
    # entropy (nats) of the trained policy's next-token distribution on the sampled tokens;
    # the share of the step's sequences whose reward reached obs.metrics.SOLVED_REWARD; the
    # mean policy age of its sequences (max_policy_lag is the oldest's). 0 in entries
    # written before they were logged.
    kl: float = 0.0
    entropy: float = 0.0
    solve_rate: float = 0.0
    policy_age_mean: float = 0.0
    # The step's groups by task (`task_figures`): a mixture's per-task reward and solve rate.
    # Empty in entries written before it was logged.
    tasks: dict[str, TaskFigures] = msgspec.field(default_factory=dict)


class ToolResult(Message, frozen=True, kw_only=True):
    """The outcome of one tool call as the agent sees it. `infra`: the tool infrastructure
    failed (no worker answered, the sandbox is down), not the call: the episode ends with
    status error and the circuit breaker counts it."""

    KIND: ClassVar[str] = "tool_result"
    call_id: str
    ok: bool
    output: str
    error: str = ""
    duration_s: float = 0.0
    worker: str = ""
    infra: bool = False
    # The result an earlier execution recorded (the ledger of a non-idempotent tool), not a
    # new run: the rollout counts it (counters.TOOL_LEDGER_HITS).
    ledger_hit: bool = False


MESSAGE_TYPES: dict[str, type[Message]] = {
    t.KIND: t for t in (Task, Trajectory, Group, Weights, DeadLetter, TrainMetrics, ToolResult)
}

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type[Message], msgspec.msgpack.Decoder[Message]] = {
    t: msgspec.msgpack.Decoder(t) for t in MESSAGE_TYPES.values()
}

M = TypeVar("M", bound=Message)

EPISODE_STATE_VERSION = 1


class SavedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One completed turn of an episode: where its sampled ids lie in the transcript
    (`start`:`end`) and the environment's answer, replayed to the agent and the dialogue
    when the episode resumes."""

    start: int
    end: int
    observations: list[str]
    info: dict[str, float] = msgspec.field(default_factory=dict)


class EpisodeState(msgspec.Struct, frozen=True, kw_only=True):
    """An unfinished episode at a turn boundary: everything needed to play on from there
    on another worker (`Keys.episodes`, field = trajectory id). The arrays are those of
    `Trajectory` so far; `versions` the policy version of each completed turn, `turns`
    what each returned; `env` the environment's own state (`Environment.save_state`);
    `run_seed` seeds the turns still to sample (`streamrl.rollout.episode.sample_seed`);
    `model_s`, `env_s`, `elapsed_s` the sampling, environment and wall-clock time spent.

    `committed`: a marker, no state: the member's trajectory is committed, its task not
    yet acknowledged (a worker that claims the task does not run the member again)."""

    schema: int = EPISODE_STATE_VERSION
    traj_id: str
    committed: bool = False
    tokens: bytes = b""
    loss_mask: bytes = b""
    logprobs: bytes = b""
    prompt_len: int = 0
    versions: list[int] = msgspec.field(default_factory=list)
    turns: list[SavedTurn] = msgspec.field(default_factory=list)
    env: dict[str, Any] = msgspec.field(default_factory=dict)
    num_tool_calls: int = 0
    run_seed: int = 0
    model_s: float = 0.0
    env_s: float = 0.0
    elapsed_s: float = 0.0
    worker: str = ""

    @property
    def turn(self) -> int:
        """Model turns completed: the index of the turn to play next."""
        return len(self.turns)


class _Schema(msgspec.Struct):
    schema: int = -1


_schema_decoder = msgspec.msgpack.Decoder(_Schema)
_state_decoder = msgspec.msgpack.Decoder(EpisodeState)


def encode_state(state: EpisodeState) -> bytes:
    """A `Keys.episodes` hash value (msgpack, never pickle)."""
    return _encoder.encode(state)


def decode_state(data: bytes) -> EpisodeState:
    """An episode state from its hash value; WireError names what is wrong with it."""
    try:
        schema = _schema_decoder.decode(data).schema
        if schema != EPISODE_STATE_VERSION:
            raise WireError(f"episode state schema {schema} != {EPISODE_STATE_VERSION} expected")
        return _state_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise WireError(f"cannot decode episode state: {err}") from None


Fields = dict[str, bytes]


def encode_body(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_body(data: bytes, cls: type[M]) -> M:
    try:
        out = _decoders[cls].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise WireError(f"cannot decode {cls.KIND} body: {err}") from None
    assert isinstance(out, cls)
    return out


def encode(msg: Message) -> Fields:
    """Stream entry fields for a message."""
    return {
        "v": str(SCHEMA_VERSION).encode(),
        "kind": msg.KIND.encode(),
        "data": _encoder.encode(msg),
    }


def _field(fields: dict[Any, Any], name: str) -> bytes | None:
    v = fields.get(name.encode(), fields.get(name))
    if isinstance(v, str):
        return v.encode()
    return v if isinstance(v, bytes) else None


def decode(fields: dict[Any, Any], cls: type[M]) -> M:
    """Decode stream entry fields into `cls`; raises WireError with a dead-letter reason."""
    version = _field(fields, "v")
    if version is None:
        raise WireError("missing schema version field `v`")
    if version != str(SCHEMA_VERSION).encode():
        raise WireError(
            f"schema version {version.decode(errors='replace')!r} != {SCHEMA_VERSION} expected"
        )
    kind = _field(fields, "kind")
    if kind != cls.KIND.encode():
        shown = kind.decode(errors="replace") if kind is not None else None
        raise WireError(f"message kind {shown!r} where {cls.KIND!r} was expected")
    data = _field(fields, "data")
    if data is None:
        raise WireError("missing body field `data`")
    return decode_body(data, cls)


def raw_fields(fields: dict[Any, Any]) -> dict[str, bytes]:
    """Entry fields as str -> bytes, for keeping a bad entry in a dead letter."""
    out: dict[str, bytes] = {}
    for k, v in fields.items():
        key = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        out[key] = v if isinstance(v, bytes) else str(v).encode()
    return out
