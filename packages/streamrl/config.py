"""Run configuration: one TOML file per run, validated against a documented schema.

Every field carries a one-line description and its bounds; checks that span fields are
validators; an unknown key is an error that names it. This module imports no JAX, so a bad
config fails in milliseconds, before any worker loads the model stack.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "parse_config",
]


# A run name (the Redis namespace of its keys: streamrl.names checks it there too).
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
# The longest wait before `streamrl up` restarts a crashed worker (the launcher's cap).
MAX_BACKOFF_S = 60.0

# Value sets that modules outside the schema take too: each is defined here once and
# imported there (code review 86b402d, item 6), so a new value cannot reach one side only.
SyncMode = Literal["continue", "finish", "pause"]
LoraServing = Literal["merged", "attached"]
SandboxKind = Literal["auto", "container", "bwrap", "subprocess"]
KlEstimator = Literal["k1", "k3"]
Correction = Literal["none", "tis", "icepop"]
Checksum = Literal["xxh3_128", "sha256"]
ChannelName = Literal["dir", "redis"]


# A field whose value the config derives from the others ("auto" in TOML, or 0): resolved by
# `Config` (`Config.derived` names those it filled in); a section built alone keeps 0.
AUTO = 0


def _auto(v: object) -> object:
    return AUTO if v == "auto" else v


class ConfigError(ValueError):
    """A config file that cannot be used; the message names every offending field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# The dense layers LoRA adapters can attach to (streamrl.model.lora uses this list).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RunConfig(_Section):
    name: str = Field(
        "streamrl",
        description="Run namespace: every Redis stream and key of this run starts with it.",
        pattern=NAME_PATTERN,
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for data, initialisation, sampling.")
    colocated: bool = Field(
        False,
        description=(
            "One process alternates rollout and training on the same devices (the "
            "`colocated` worker) instead of a trainer and rollout workers of their own."
        ),
    )
    max_restarts: int = Field(
        8,
        ge=0,
        le=1000,
        description=(
            "`streamrl up` restarts a worker that crashes, up to this many times within "
            "restart_window_s, then stops the run with an error; 0: never restart. More "
            "than transport.max_deliveries, so that an entry that kills its worker each "
            "time it is read is dead-lettered before the run stops."
        ),
    )
    restart_window_s: float = Field(
        300.0, gt=0, le=86400, description="Window over which a worker's restarts count."
    )
    restart_backoff_s: float = Field(
        1.0,
        ge=0,
        le=600,
        description=(
            "Wait before a restart; doubles with each restart in the window "
            f"(max {MAX_BACKOFF_S:g} s)."
        ),
    )
    trainer_stop_timeout_s: float = Field(
        600.0,
        ge=1,
        le=86400,
        description=(
            "On stop, how long `streamrl up` lets the trainer write its final checkpoint "
            "after SIGTERM before it SIGKILLs it (the other workers get 20 s)."
        ),
    )
    log_max_mb: float = Field(
        100.0,
        gt=0,
        le=1_000_000,
        description="`streamrl up`: a worker's JSON log rolls over at this size (MiB).",
    )
    log_backups: int = Field(
        5, ge=1, le=1000, description="Rolled-over logs kept per worker (`<id>.log.1`, ...)."
    )
    liveness_timeout_s: float = Field(
        300.0,
        ge=2,
        le=86400,
        description=(
            "`streamrl up` kills and restarts a worker whose liveness beat is older than this "
            "(a stopped process; a main loop stuck outside start-up, train steps, checkpoints)."
        ),
    )
    start_timeout_s: float = Field(
        600.0,
        ge=2,
        le=86400,
        description=(
            "`streamrl up` kills and restarts a worker that has not beaten once this long "
            "after its start (a start-up that hangs). Until its first beat a worker is "
            "starting (imports, model load, restore: slow on a busy host), which "
            "`run.liveness_timeout_s` does not judge."
        ),
    )


class RedisConfig(_Section):
    url: str = Field(
        "",
        description=(
            "Redis URL, without a password; empty starts an embedded redis-server in the "
            "run directory. The REDIS_URL environment variable overrides it."
        ),
    )
    password_file: str = Field(
        "",
        description=(
            "File holding the password of the URL's user (first line); the "
            "REDIS_PASSWORD_FILE environment variable overrides it."
        ),
    )
    cluster: bool = Field(
        False,
        description=(
            "The URL names one node of a Redis Cluster (needs an external Redis: the "
            "embedded server is a single one; rq, the tool queue, cannot run on a cluster)."
        ),
    )
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "everysec", description="AOF fsync policy of the embedded server."
    )
    busy_wait_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description=(
            "How long a Redis command waits out LOADING (a restarted server loading its AOF) "
            "and BUSY (a script past its time limit) replies before it fails."
        ),
    )
    startup_timeout_s: float = Field(
        10.0, gt=0, le=120, description="Seconds to wait for the embedded server to answer."
    )

    @field_validator("url")
    @classmethod
    def _no_password(cls, url: str) -> str:
        # A config file is read by others, and `streamrl up` copies --set into every
        # worker's command line, which any local user can read.
        if url and urlsplit(url).password:
            raise ValueError(
                "a password in redis.url would be shown to others (a config file, or a "
                "command line that `streamrl up` copies into every worker's): pass the URL "
                "in the REDIS_URL environment variable instead, or leave the password out "
                "and name a file that holds it with redis.password_file (or "
                "REDIS_PASSWORD_FILE)"
            )
        return url


class TransportConfig(_Section):
    block_ms: int = Field(
        200, ge=1, le=10_000, description="How long one XREADGROUP blocks waiting for entries (ms)."
    )
    read_count: int = Field(16, ge=1, le=1024, description="Entries read per XREADGROUP call.")
    claim_idle_ms: int = Field(
        5_000,
        ge=100,
        le=3_600_000,
        description="Idle time (ms) after which a pending entry is claimed (XAUTOCLAIM).",
    )
    claim_every_ms: int = Field(
        1_000, ge=10, le=600_000, description="How often (ms) a consumer looks for idle entries."
    )
    max_deliveries: int = Field(
        5,
        ge=1,
        le=1000,
        description="An entry delivered more than this many times moves to the dead-letter stream.",
    )


# A plug-in reference: a built-in or registered name, or `package.module:Name`.
PLUGIN_REF = r"^[A-Za-z_][A-Za-z0-9_.-]*(:[A-Za-z_][A-Za-z0-9_.]*)?$"
MAX_MIXTURE = 64  # tasks in a mixture ([[tasks]]) at most
OPENAI_AGENT = "openai:"  # task.agent's prefix for an agent of the OpenAI kind (issue 31)


class TaskConfig(_Section):
    id: str = Field(
        "",
        description=(
            "The task's label in a mixture ([[tasks]]): what its counters, metrics and eval "
            "results are reported under; empty: the name. Unique within the mixture."
        ),
        pattern=r"^$|^[A-Za-z0-9_.-]{1,64}$",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1_000_000,
        description=(
            "A mixture entry's share of the tasks the feeder writes ([[tasks]]): weights are "
            "relative, resolved to parts per thousand of their sum (streamrl.tasks.mixture); "
            "ignored for a single [task]."
        ),
    )
    name: str = Field(
        "arithmetic",
        description=(
            "The task: built-in `arithmetic` (calculator tool, exact answer), `code` (write a "
            "Python function; hidden unit tests in the sandbox give the reward) or "
            "`synthetic` (configured step latencies, for measurement); a name an installed "
            "package registers in the `streamrl.tasks` entry-point group; or the import "
            "path `package.module:Name` of a `streamrl.api.TaskDef` subclass."
        ),
        pattern=PLUGIN_REF,
    )
    environment: str = Field(
        "",
        description=(
            "Environment of each episode instead of the task's own: `package.module:Name`, "
            "called as Name(ctx) -> streamrl.api.Environment; empty: the task's."
        ),
        pattern=r"^$|" + PLUGIN_REF,
    )
    agent: str = Field(
        "",
        description=(
            "Agent of each episode instead of the task's own: built-in `tool` or `model`, "
            "`package.module:Name` called as Name(ctx) -> streamrl.api.Agent, or "
            "`openai:package.module:main`, an async function main(base_url, api_key, prompt, "
            "data) -> answer that talks to the rollout worker's OpenAI-compatible endpoint "
            "(streamrl.endpoint.agent)."
        ),
        pattern=r"^$|^" + OPENAI_AGENT + PLUGIN_REF.removeprefix("^") + "|" + PLUGIN_REF,
    )
    agent_command: list[str] = Field(
        default_factory=list,
        description=(
            'An external agent program instead (e.g. ["python3", "agent.py"]): run once '
            "per episode in a sandbox whose network reaches only the rollout worker's "
            "OpenAI-compatible endpoint, with OPENAI_BASE_URL and OPENAI_API_KEY set, the "
            "task's prompt and data as JSON on stdin; its stdout is the answer "
            "(streamrl.endpoint.command). Needs bubblewrap on the rollout worker's host, or "
            'tools.sandbox = "subprocess" (no isolation). Empty: task.agent plays.'
        ),
        max_length=256,
    )
    agent_dir: str = Field(
        "",
        description=(
            "Directory of the agent program's files, bound read-only at /agent, its working "
            "directory (empty: a scratch /work). Only with agent_command."
        ),
    )
    reward: str = Field(
        "",
        description=(
            "Reward instead of the task's own: `package.module:name` of a function "
            "(answer, calls, ctx) -> float (or a coroutine); a result that is not a finite "
            "number makes that episode an error."
        ),
        pattern=r"^$|" + PLUGIN_REF,
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "The task's own settings ([task.options]), validated by the pydantic model the "
            "task declares (TaskDef.Options): unknown or ill-typed options are errors."
        ),
    )
    dataset: str = Field(
        "",
        description=(
            "Prompts from data instead of the task's generator: a local .jsonl or .parquet "
            "file, or a directory written by datasets' save_to_disk; empty: generated."
        ),
    )
    split: str = Field(
        "train",
        description="Split of a saved DatasetDict directory (ignored for a single split).",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
    )
    eval_dataset: str = Field(
        "",
        description=(
            "Held-out data of a dataset task, for `streamrl eval` (same formats as dataset); "
            "rows whose prompt a training row has are left out. Generated tasks need none."
        ),
    )
    eval_split: str = Field(
        "test", description="Split of a saved DatasetDict eval_dataset directory."
    )
    prompt_field: str = Field(
        "prompt", min_length=1, description="Dataset column that holds a task's prompt text."
    )
    answer_field: str = Field(
        "answer",
        description="Dataset column of the reference answer (optional in rows; empty: none).",
    )
    shuffle: bool = Field(
        True,
        description="Visit dataset rows in an order seeded by run.seed and the epoch.",
    )
    epochs: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Passes over the dataset (or the num_prompts generated prompts), then the feeder "
            "stops writing: exactly rows (or num_prompts) x epochs tasks; 0: no end."
        ),
    )
    num_prompts: int = Field(
        10_000, ge=1, le=10_000_000, description="Distinct generated prompts (cycled)."
    )
    max_operand: int = Field(
        99, ge=1, le=1_000_000, description="Largest operand of an arithmetic question."
    )
    operators: str = Field(
        "+-",
        description="Operators the arithmetic questions use, from '+-*'.",
        pattern=r"^[+\-*]{1,3}$",
    )
    max_backlog: int | Literal["auto"] = Field(
        "auto",
        description=(
            "Feeder keeps at most this many tasks written but not yet rolled out (queued or "
            "in flight). With slow stragglers a group stays open until its last member "
            "ends, so rollout can hold up to one task per running episode: below "
            "rollout.num_workers x max_concurrency plus a wave, the feeder starves rollout. "
            '"auto": the live rollout workers\' advertised slots C each need C + 2 C / G '
            "(streamrl.capacity), following workers that join and leave."
        ),
    )

    @field_validator("max_backlog")
    @classmethod
    def _backlog_bounds(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 1_000_000:
            raise ValueError(f'task.max_backlog must be in [1, 1000000] or "auto", got {v}')
        return v

    @property
    def label(self) -> str:
        """What this task is reported under: its id, else its name."""
        return self.id or self.name

    @model_validator(mode="after")
    def _agent_program(self) -> TaskConfig:
        if self.agent_command and self.agent:
            raise ValueError(
                f"task.agent_command runs the agent program; task.agent = {self.agent!r} "
                "names another agent: set one of them"
            )
        if self.agent_dir and not self.agent_command:
            raise ValueError("task.agent_dir is the agent program's: set task.agent_command")
        return self


class ModelConfig(_Section):
    kind: Literal["transformer", "stub"] = Field(
        "transformer",
        description=(
            "`transformer`: the JAX policy; `stub`: no model at all, each model call answers "
            "stub_turn_tokens tokens after stub_latency_s and a train step takes "
            "stub_train_step_s (measures the orchestration alone)."
        ),
    )
    stub_latency_s: float = Field(
        0.02, ge=0, le=3600, description="Stub model only: seconds one model call takes."
    )
    stub_turn_tokens: int = Field(
        16, ge=1, le=131072, description="Stub model only: tokens one model call answers."
    )
    stub_train_step_s: float = Field(
        0.0, ge=0, le=3600, description="Stub model only: seconds one trainer step takes."
    )
    chat_template: str = Field(
        "",
        description=(
            "Jinja chat template file used instead of the checkpoint's (needed to train a "
            "base model that ships none); `chatml`: the built-in ChatML template with "
            "Hermes tool calls; empty: the checkpoint's own."
        ),
    )
    checkpoint: str = Field(
        "",
        description=(
            "Hugging Face checkpoint directory (config.json, safetensors, tokenizer, chat "
            "template) of a Qwen2/Qwen2.5, Qwen3 or Llama 3 model; empty: the built-in tiny "
            "model, built locally from the fields below."
        ),
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter and compute dtype of the policy."
    )
    family: Literal["qwen2", "qwen3", "llama"] = Field(
        "qwen2", description="Built-in tiny model only: architecture family."
    )
    d_model: int = Field(64, ge=8, le=8192, description="Built-in tiny model only: hidden size.")
    num_layers: int = Field(2, ge=1, le=128, description="Built-in tiny model only: blocks.")
    num_heads: int = Field(4, ge=1, le=128, description="Built-in tiny model only: query heads.")
    num_kv_heads: int = Field(
        2, ge=1, le=128, description="Built-in tiny model only: key/value heads."
    )
    d_ff: int = Field(192, ge=8, le=65536, description="Built-in tiny model only: MLP size.")
    max_seq_len: int = Field(
        512, ge=16, le=131072, description="Built-in tiny model only: longest sequence."
    )
    rope_theta: float = Field(
        10000.0, gt=0, description="Built-in tiny model only: RoPE base frequency."
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description=(
            "Seed of the starting policy: the built-in tiny model's random weights and the "
            "warm start (which demonstrations, in what order). Unset: run.seed. Set it to "
            "compare runs of several run.seed values from one starting policy, as RL runs "
            "start from one base model (the warm start is then trained once for all of "
            "them); the held-out split then also leaves out the warm start's prompts."
        ),
    )
    init: Literal["checkpoint", "warmstart"] = Field(
        "checkpoint",
        description=(
            "Initial policy: the checkpoint's weights as they are, or those plus a short "
            "supervised warm start on the task's demonstrations (what the random built-in "
            "tiny model needs before RL can start)."
        ),
    )
    warmstart_steps: int = Field(
        2000, ge=1, le=1_000_000, description="Supervised steps of the warm start."
    )
    warmstart_batch: int = Field(4, ge=1, le=4096, description="Sequences per warm-start step.")
    warmstart_lr: float = Field(2e-3, gt=0, le=1.0, description="Warm-start learning rate.")
    warmstart_error_rate: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Fraction of warm-start demonstrations that answer wrongly (room for RL).",
    )
    cache_dir: str = Field(
        "",
        description=(
            "Where the built-in checkpoint and warm starts are cached by content hash "
            "(empty: ~/.cache/streamrl)."
        ),
    )

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                f"({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if (self.d_model // self.num_heads) % 2:
            raise ValueError("model.d_model / model.num_heads must be even for RoPE")
        return self

    @model_validator(mode="after")
    def _stub(self) -> ModelConfig:
        if self.kind == "stub" and self.init == "warmstart":
            raise ValueError(
                'model.init = "warmstart" trains a real model before RL, and model.kind = '
                '"stub" has none: set model.init = "checkpoint" (the stub ignores it)'
            )
        return self


class RolloutConfig(_Section):
    num_workers: int = Field(1, ge=1, le=256, description="Rollout worker processes.")
    mode: Literal["async", "sync"] = Field(
        "async",
        description=(
            "`async`: rollout runs ahead of the trainer, bounded by backpressure and "
            "grouper.off_policy_steps. `sync`: the on-policy loop of classic GRPO, a batch "
            "per policy version: rollout starts tasks with the version it serves while "
            "started tasks less dropped groups stay below trainer.groups_per_step (a dropped "
            "group is replaced by another task), then starts nothing until the trainer has "
            "trained that step and published the next version; every trajectory is trained "
            "by the version that sampled it (policy lag 0). Needs rollout.num_workers = 1 "
            "and trainer.publish_every = 1."
        ),
    )
    num_generations: int = Field(
        4, ge=2, le=1024, description="Episodes per task (the GRPO group size)."
    )
    max_concurrency: int = Field(
        16,
        ge=1,
        le=4096,
        description=(
            'Episodes running at once. "auto": adaptive admission (rollout.admission = '
            '"auto") with rollout.max_concurrency_cap as this number.'
        ),
    )
    admission: Literal["fixed", "auto"] = Field(
        "fixed",
        description=(
            "`fixed`: max_concurrency episodes run at once. `auto` (what max_concurrency = "
            '"auto" sets): the limit follows the engine (streamrl.rollout.admission): it '
            "starts at the KV pool's slots (one an episode), drops below the episodes "
            "running (none preempted) when the engine evicts a parked session or a request "
            "finds no slot, is held at its latency ceiling (the largest decode batch whose "
            "cost per token is within 5 % of the cheapest, once measured), and grows while "
            "slots are free, the ceiling allows and the limit binds; max_concurrency is then "
            "the hard cap."
        ),
    )
    max_concurrency_cap: int = Field(
        256,
        ge=1,
        le=4096,
        description='The hard cap of max_concurrency = "auto" (its max_concurrency).',
    )
    max_model_calls: int = Field(
        0,
        ge=0,
        le=4096,
        description="Model calls in flight per rollout worker at most; 0: max_concurrency.",
    )
    max_steps: int = Field(3, ge=1, le=1000, description="Model turns per episode at most.")
    env_threads: int = Field(
        0,
        ge=0,
        le=65536,
        description=(
            "Threads for blocking environment steps and tool apply() calls (the event "
            "loop's default executor, what asyncio.to_thread uses); the worker's Redis "
            "reads and commits have threads of their own. 0: max_concurrency."
        ),
    )
    max_prompt_length: int = Field(
        128,
        ge=1,
        le=131072,
        description="Longest first prompt (system, tools, task) in tokens; longer: episode error.",
    )
    max_response_length: int = Field(
        128,
        ge=1,
        le=131072,
        description="Tokens an episode may add after its prompt: all turns and tool results.",
    )
    max_turn_tokens: int = Field(
        48, ge=1, le=131072, description="New tokens one model turn may sample."
    )
    kv_cache_size: int = Field(
        256,
        ge=2,
        le=131072,
        description="Positions of one KV-cache slot: at least prompt plus response length.",
    )
    decode_chunk: int = Field(
        8, ge=1, le=1024, description="Decode steps per device call of the engine."
    )
    kv_reuse: bool = Field(
        True,
        description=(
            "Keep an episode's KV cache between its turns: a finished turn's engine slot is "
            "parked and the next turn prefills only the tokens added since (tool results, "
            "template); parked slots are evicted least recently used when new work needs "
            "one and dropped at each weight swap. Samples equal those without reuse to "
            "float32 rounding (see the README's policy section). false: every turn "
            "prefills its whole transcript."
        ),
    )
    mesh_data: int = Field(
        1, ge=1, le=4096, description="Devices along the mesh's data axis (KV slots split)."
    )
    mesh_tensor: int = Field(
        1, ge=1, le=4096, description="Devices along the mesh's tensor axis (heads split)."
    )
    episode_timeout_s: float = Field(
        60.0, gt=0, le=86400, description="Wall-clock limit of one episode."
    )
    model_call_timeout_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description=(
            "Limit of one model call, from the episode's request to its result (waiting "
            "for the engine included): a call past it is cancelled, its engine slot freed, "
            "and the episode ends with status timeout. 0: none of its own (the episode's "
            "limit applies). Leave room for the first call's compilation."
        ),
    )
    env_step_timeout_s: float = Field(
        30.0,
        gt=0,
        le=86400,
        description="Limit of one environment step (all tool calls of a turn); then: error.",
    )
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1: off).")
    top_k: int = Field(0, ge=0, le=1_000_000, description="Top-k sampling (0: off).")
    max_batch_size: int = Field(
        32, ge=1, le=4096, description="KV-cache slots: sequences the engine decodes together."
    )
    max_ready_groups: int = Field(
        AUTO,
        ge=0,
        le=1_000_000,
        description=(
            "Backpressure: rollout reads no new task while this many groups (or more) wait "
            'for the trainer. "auto" (or 0): two trainer steps of groups, '
            "2 x trainer.groups_per_step."
        ),
    )
    max_partial_groups: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Backpressure: no new task starts while this many groups are half filled "
            "(members arrived, group not yet emitted or dropped); 0: no limit. Groups that "
            "never complete count until grouper.group_timeout_s clears them."
        ),
    )
    resume_episodes: bool = Field(
        True,
        description=(
            "Save each episode's state at every turn boundary; a task claimed from a dead "
            "worker resumes its members from their last completed turn instead of anew."
        ),
    )
    sync_mode: SyncMode = Field(
        "continue",
        description=(
            "Weight sync (no new episode starts meanwhile): `continue`, running episodes go "
            "on while the new version loads and switch to it at the next decode chunk; "
            "`finish`, they finish on the old version, then it is swapped; `pause`, their "
            "model calls wait while it loads, then go on with it."
        ),
    )
    lora_serving: LoraServing = Field(
        "merged",
        description=(
            'How adapter-only versions (trainer.publish = "lora") are served: `merged` '
            "into the kernels (each sync rewrites every adapted kernel; decoding at the "
            "plain model's speed) or `attached` beside them (a sync costs the adapters' "
            "bytes only; each decoding step computes x @ A @ B per adapted layer; the "
            "engine's programs compile once more, per shape bucket, for that structure)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _auto_concurrency(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("max_concurrency") == "auto":
            cap = data.get("max_concurrency_cap", cls.model_fields["max_concurrency_cap"].default)
            return {**data, "max_concurrency": cap, "admission": "auto"}
        return data

    @field_validator("max_ready_groups", mode="before")
    @classmethod
    def _ready_auto(cls, v: object) -> object:
        return _auto(v)

    @property
    def max_episode_tokens(self) -> int:
        """The positions one episode's conversation may fill: its first prompt's and its
        responses' lengths (within `kv_cache_size`, checked)."""
        return self.max_prompt_length + self.max_response_length

    @model_validator(mode="after")
    def _sizes(self) -> RolloutConfig:
        total = self.max_episode_tokens
        if total > self.kv_cache_size:
            raise ValueError(
                f"rollout.max_prompt_length ({self.max_prompt_length}) + "
                f"rollout.max_response_length ({self.max_response_length}) = {total} exceeds "
                f"rollout.kv_cache_size ({self.kv_cache_size})"
            )
        if self.max_turn_tokens >= self.kv_cache_size:
            raise ValueError(
                f"rollout.max_turn_tokens ({self.max_turn_tokens}) must be below "
                f"rollout.kv_cache_size ({self.kv_cache_size})"
            )
        return self


class ToolsConfig(_Section):
    num_workers: int = Field(2, ge=1, le=1024, description="Tool worker processes (rq workers).")
    time_limit_s: float = Field(
        5.0, gt=0, le=3600, description="A tool call's process is killed after this many seconds."
    )
    output_cap_bytes: int = Field(
        4096, ge=16, le=64 * 2**20, description="Tool output kept at most; the rest is cut."
    )
    result_margin_s: float = Field(
        3.0,
        gt=0,
        le=600,
        description=(
            "The caller gives up on a call this long after its time limit (a dead tool worker "
            "is noticed within time_limit_s + result_margin_s)."
        ),
    )
    retries: int = Field(
        1, ge=0, le=10, description="Times a call lost to a dead tool worker is sent again."
    )
    max_parallel_calls: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Sandbox tool calls in flight per rollout worker at most.",
    )
    max_external_calls: int = Field(
        16,
        ge=1,
        le=100_000,
        description="Calls to external services (tools of kind `external`) in flight at most.",
    )
    rate_limits: dict[str, float] = Field(
        default_factory=dict,
        description="Calls per second per rollout worker, by tool name (e.g. {python = 20}).",
    )
    breaker_window_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description=(
            "The run stops with an error once tool infrastructure errors (no worker answered, "
            "sandbox down) have gone on this long at breaker_error_rate or more."
        ),
    )
    breaker_error_rate: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "Fraction of sandbox and external calls failing with infrastructure errors that "
            "counts as failing (over the spell, and over the window's last tenth to recover)."
        ),
    )
    breaker_min_calls: int = Field(
        20,
        ge=0,
        le=1_000_000,
        description="Calls a failing spell must hold before the breaker trips; 0: never trips.",
    )
    sandbox: SandboxKind = Field(
        "auto",
        description=(
            "Where a call's code runs: `container` (hardened containers through the Docker "
            "API at DOCKER_HOST), `bwrap` (bubblewrap namespaces), `subprocess` (rlimits "
            "only, NO isolation: only when set explicitly, logged as an error at each start), "
            "`auto`: container, else bwrap, probed again while the container is not up; "
            "with neither, tools that run policy-written code fail as infrastructure errors "
            "(the calculator still runs, as a plain subprocess)."
        ),
    )
    image: str = Field("streamrl-sandbox:1", description="Container image of the sandbox.")
    memory_mb: int = Field(256, ge=16, le=1 << 20, description="Memory of one sandbox, MiB.")
    pids_limit: int = Field(64, ge=8, le=1 << 16, description="Processes of one sandbox.")
    cpus: float = Field(1.0, gt=0, le=1024, description="CPU share of one sandbox container.")
    pool_size: int = Field(1, ge=0, le=1024, description="Warm containers per tool worker.")
    max_containers: int = Field(
        8,
        ge=1,
        le=4096,
        description=(
            "Containers one tool worker holds at once (idle, running a call or starting); "
            "a call that finds the cap reached and none idle waits for one. At least "
            "pool_size + 1."
        ),
    )
    max_starting: int = Field(
        2, ge=1, le=256, description="Container creates one tool worker has in flight at once."
    )
    call_server: bool = Field(
        True,
        description=(
            "Run calls through a call server in each warm sandbox: a container's main "
            "process (one attached stream, calls forked in the container, `python3 -c` forked "
            "from a pre-imported interpreter: about 10 ms a call against about 100-200 ms for "
            "an exec), or PID 1 of a warm bubblewrap namespace (about 10 ms against 30-45 ms "
            "for fresh namespaces; docs/BENCHMARKS.md). false: an exec per container call, "
            "fresh namespaces per bubblewrap call."
        ),
    )
    recycle_after: int = Field(
        200,
        ge=1,
        le=1_000_000,
        description="Calls a container or warm bubblewrap namespace serves before it is replaced.",
    )
    non_idempotent: list[str] = Field(
        default_factory=list,
        description=(
            "Tools whose calls have side effects that must not repeat: each call runs once per "
            "idempotency key (call id + arguments); a replayed call gets the recorded result. "
            "Checked against the tools (built-in and extra) when a worker starts."
        ),
    )
    extra: list[str] = Field(
        default_factory=list,
        description=(
            "The user's own tools, run by the tool workers: `package.module:NAME` of a "
            "streamrl.api.WorkerTool (or a list of them); the rollout worker reads their "
            "schemas, the tool workers run them (policy-written code only in the sandbox)."
        ),
    )

    @field_validator("extra")
    @classmethod
    def _extra_refs(cls, v: list[str]) -> list[str]:
        for ref in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$", ref):
                raise ValueError(f"`{ref}` is not an import path `package.module:NAME`")
        return v

    @field_validator("rate_limits")
    @classmethod
    def _positive_rates(cls, v: dict[str, float]) -> dict[str, float]:
        for name, rate in v.items():
            if not rate > 0:
                raise ValueError(f"rate of tool `{name}` must be > 0 calls per second")
        return v

    @model_validator(mode="after")
    def _pool_fits(self) -> ToolsConfig:
        if self.max_containers < self.pool_size + 1:
            raise ValueError(
                f"tools.max_containers ({self.max_containers}) must be at least "
                f"tools.pool_size + 1 ({self.pool_size + 1}): the warm pool and a call"
            )
        return self


class GrouperConfig(_Section):
    num_workers: int = Field(1, ge=1, le=1024, description="Grouper processes.")
    off_policy_steps: int = Field(
        8,
        ge=0,
        le=1_000_000,
        description=(
            "A trajectory whose oldest turn is more than this many policy versions behind the "
            "trainer is dropped (with its group) and counted. With trainer.groups_per_step "
            '"auto" the trainer publishes about one version per mean episode time while '
            "rollout is the limit, so the default 8 keeps a group whose slowest member takes "
            "up to about 9 mean episode times (stragglers)."
        ),
    )
    advantage_epsilon: float = Field(
        1e-6, gt=0, le=1, description="Added to the group reward std before dividing."
    )
    advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo",
        description="Group advantage: `grpo` (r - mean) / (std + eps); `dr_grpo` r - mean.",
    )
    min_valid_members: int = Field(
        2,
        ge=1,
        le=1024,
        description=(
            "A group with fewer valid members (not ended in error or timeout) is dropped and "
            "counted; 2: the fewest with a spread to learn from."
        ),
    )
    zero_variance: Literal["keep", "drop"] = Field(
        "keep",
        description=(
            "A group whose rewards are all equal (advantages all 0): kept (it still counts "
            "for KL and the step's batch) or dropped; counted either way."
        ),
    )
    group_timeout_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description=(
            "A group still incomplete this many seconds after its first member arrived is "
            "handled by group_timeout_policy; 0: never (groups wait for ever)."
        ),
    )
    group_timeout_policy: Literal["drop", "rerun", "release"] = Field(
        "drop",
        description=(
            "What a timed-out group gets: `drop` (it and its late members are dropped), "
            "`rerun` (a task re-runs only its missing members; the timeout starts again), "
            "`release` (emitted with the members present, if at least 2)."
        ),
    )
    max_reruns: int = Field(
        2,
        ge=0,
        le=1000,
        description=(
            "Policy `rerun`: a group that times out again after this many reruns is dropped "
            "(logged with the reason); 0: drop at the first timeout."
        ),
    )
    order: Literal["completion", "submission"] = Field(
        "completion",
        description=(
            "The order groups are written to the trainer in: `completion` (as they complete: "
            "no group waits for another) or `submission` (task order: a group waits until "
            "every earlier task's group was written or dropped, within order_window and "
            "order_max_wait_s; with the same seed and a policy whose samples do not depend "
            "on timing, e.g. rollout.mode sync, two runs train on identical batches)."
        ),
    )
    order_window: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description=(
            "order `submission`: the most groups (and drops) held waiting for an earlier "
            "task's; one more skips the missing cursors before the oldest held (counted in "
            "groups_order_skipped)."
        ),
    )
    order_max_wait_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description=(
            "order `submission`: a group held this long stops waiting (the missing cursors "
            "before it are skipped and counted): a task dead-lettered by rollout never makes "
            "a group."
        ),
    )


class TrainerConfig(_Section):
    groups_per_step: int = Field(
        AUTO,
        ge=0,
        le=65536,
        description=(
            'Groups per optimizer step. "auto" (or 0): the groups the rollout workers keep in '
            "flight, rollout.num_workers x rollout.max_concurrency / rollout.num_generations "
            "(rounded up; one worker when run.colocated): one step a wave, so a group's "
            "policy lag in versions does not grow with the rollout's scale."
        ),
    )
    max_batch_tokens: int = Field(
        0,
        ge=0,
        le=2**40,
        description=(
            "Cap on a step's padded batch (rows x padded length, as the batch is built: "
            "rows to a power of two, length to a multiple of 32); 0: none. A group that "
            "would take the batch past it waits for the next step (which then has fewer "
            "groups); one past it alone is dead-lettered. Keeps the longest groups of a "
            "run from making a batch the device cannot hold."
        ),
    )
    learning_rate: float = Field(1e-4, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    b1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    b2: float = Field(0.99, ge=0, lt=1, description="AdamW second-moment decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global-norm gradient clip.")
    clip_epsilon: float = Field(
        0.2, gt=0, lt=1, description="Ratio clip epsilon: the ratio is kept >= 1 - epsilon."
    )
    clip_epsilon_high: float = Field(
        0.0,
        ge=0,
        lt=10,
        description="Upper clip (DAPO's clip higher): ratio <= 1 + this; 0: clip_epsilon.",
    )
    loss: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "grpo",
        description=(
            "Registered loss: `grpo` (sequence-level mean), `dapo` (token-level mean, clip "
            "higher), `dr_grpo` (constant length normaliser; pair with grouper.advantage = "
            "dr_grpo)."
        ),
    )
    kl_beta: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Weight of the KL penalty to the frozen reference (the starting policy); "
        "0: no reference pass at all.",
    )
    kl_estimator: KlEstimator = Field("k3", description="KL estimator: k1 or k3.")
    use_rollout_logps: bool = Field(
        True,
        description=(
            "Importance ratio against the rollout's log-probs (required on every sampled "
            "token); false: against log-probs the trainer recomputes before its update."
        ),
    )
    importance_correction: Correction = Field(
        "none",
        description=(
            "Staleness correction (needs use_rollout_logps = false: the ratio is then taken "
            "against the trainer's own log-probs, and each token's loss is weighted by "
            "w = trainer / rollout probability of its token, a constant): `tis` caps w at "
            "importance_cap (truncated importance sampling), `icepop` drops tokens whose w "
            "leaves [1/importance_cap, importance_cap]; `none`: no weight."
        ),
    )
    importance_cap: float = Field(
        2.0,
        gt=1,
        le=1000,
        description="C of importance_correction: the cap (tis) or the band [1/C, C] (icepop).",
    )
    micro_batch_size: int = Field(
        0,
        ge=0,
        le=65536,
        description="Sequences per micro-batch, gradients accumulated over a step; 0: one.",
    )
    warmup_steps: int = Field(
        0, ge=0, le=100_000_000, description="Linear learning-rate warmup from 0, in steps."
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant, or cosine decay over decay_steps."
    )
    decay_steps: int = Field(
        1000, ge=1, le=100_000_000, description="Steps of the cosine decay after warmup."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Cosine decay ends at learning_rate x this."
    )
    mesh_data: int = Field(
        1, ge=1, le=4096, description="Trainer mesh: devices on the data axis (batch rows)."
    )
    mesh_fsdp: int = Field(
        1,
        ge=1,
        le=4096,
        description="Trainer mesh: devices on the fsdp axis (batch rows and parameter shards).",
    )
    num_processes: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Processes of the one logical trainer (jax.distributed; `streamrl up` starts "
            "them as trainer-0..N-1 and passes STREAMRL_COORDINATOR). Process 0 reads groups "
            "and broadcasts each batch; the mesh spans every process's devices."
        ),
    )
    publish_every: int = Field(
        1, ge=1, le=1_000_000, description="Publish a new policy version every N steps."
    )
    weights_channel: ChannelName = Field(
        "dir",
        description=(
            "Where published weights travel: `dir`, a file in RUN_DIR/weights (atomic "
            "rename; every worker must see that directory), or `redis`, chunked keys in the "
            "run's Redis (no shared file system needed)."
        ),
    )
    weights_chunk_mb: int = Field(
        4, ge=1, le=256, description="Size of one Redis key of published weights (MiB)."
    )
    weights_checksum: Checksum = Field(
        "xxh3_128",
        description=(
            "Checksum of published weights, verified by every rollout worker before use: "
            "`xxh3_128` (~10x faster; detects corruption and truncation) or `sha256` "
            "(cryptographic: for a weights store that others can write to)."
        ),
    )
    weights_keep: int = Field(
        2,
        ge=1,
        le=1000,
        description=(
            "Published versions kept (files or Redis keys), plus the full version that kept "
            "adapters apply to; older ones are deleted after each publish."
        ),
    )
    publish: Literal["full", "lora"] = Field(
        "full",
        description=(
            "What a publish carries: all parameters, or LoRA adapters only (merged by rollout "
            "into the last full version, which is published first)."
        ),
    )
    checkpoint_every: int = Field(
        5, ge=1, le=1_000_000, description="Write an Orbax checkpoint every N steps."
    )
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="Checkpoints kept on disk.")
    trim_streams: bool = Field(
        True,
        description=(
            "After each checkpoint, delete the entries of tasks, trajectories and groups "
            "that every consumer has acknowledged and no kept checkpoint can rewind to, and "
            "the weights entries of deleted versions, so Redis holds in-flight work, not "
            "the run's history. false: keep every entry (offline analysis of the streams)."
        ),
    )
    keep_dead_letters: int = Field(
        1_000,
        ge=1,
        le=10_000_000,
        description=(
            "Dead letters kept in <run>:dead (each holds its entry's payload): the oldest "
            "beyond this are deleted after each checkpoint (with trim_streams)."
        ),
    )
    keep_dead_letters_mb: float = Field(
        256.0,
        ge=0,
        le=1_000_000,
        description=(
            "And at most this much of Redis memory (MiB) for them, the newest kept (each "
            "holds a whole group or task): they are copied into every checkpoint too; 0: "
            "no byte cap."
        ),
    )
    keep_metrics: int = Field(
        10_000,
        ge=1,
        le=10_000_000,
        description=(
            "Trainer steps kept in the metrics stream (and so in summary.json's rewards): "
            "the oldest beyond this are deleted after each checkpoint (with trim_streams)."
        ),
    )
    export_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Export the policy as a Hugging Face checkpoint to RUN_DIR/export every N steps "
            "(0: at the end of the run only)."
        ),
    )
    eval_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Held-out evaluation during the run (0: off): the trainer writes the policy as a "
            "snapshot at the start, every N steps and at the end (RUN_DIR/eval/pending/"
            "step-N), and the evaluator process that `streamrl up` starts evaluates the "
            "newest one greedily on `eval_tasks` held-out tasks (skipping older snapshots it "
            "fell behind on) into RUN_DIR/eval/step-N.json. Needs model.kind transformer."
        ),
    )
    eval_tasks: int = Field(
        100, ge=1, le=1_000_000, description="Held-out tasks of each evaluation (eval_every)."
    )
    eval_all: bool = Field(
        False,
        description=(
            "Evaluate every snapshot, oldest first, none skipped (learning curves: "
            "ops/bench/learning.py); the run's end waits for all of them (eval_timeout_s). "
            "Off: the evaluator takes the newest and drops those it fell behind on."
        ),
    )
    eval_niceness: int = Field(
        10,
        ge=0,
        le=19,
        description=(
            "The evaluator process's niceness (os.nice): evaluation takes only the CPU that "
            "rollout and the trainer leave."
        ),
    )
    eval_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        description=(
            "After the last step, how long `streamrl up` waits for the evaluator to evaluate "
            "the final snapshot before stopping it."
        ),
    )
    max_steps: int = Field(
        0, ge=0, le=100_000_000, description="Stop after this many steps (0: run until stopped)."
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description=(
            "Steps in a row whose loss or gradient norm is not finite (each one skipped: the "
            "state kept, its groups dead-lettered) after which the run stops with an error."
        ),
    )

    lora_rank: int = Field(
        0,
        ge=0,
        le=4096,
        description="Train LoRA adapters of this rank on a frozen base; 0: train every weight.",
    )
    lora_alpha: float = Field(16.0, gt=0, le=1e6, description="LoRA scale numerator (alpha).")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Dense layers that get adapters (q/k/v/o_proj, gate/up/down_proj).",
    )

    @field_validator("groups_per_step", mode="before")
    @classmethod
    def _batch_auto(cls, v: object) -> object:
        return _auto(v)

    @model_validator(mode="after")
    def _lora(self) -> TrainerConfig:
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or not self.lora_targets:
            raise ValueError(
                f"trainer.lora_targets {unknown or '[]'} not among {sorted(LORA_TARGETS)}"
            )
        if self.publish == "lora" and self.lora_rank == 0:
            raise ValueError(
                'trainer.publish = "lora" needs trainer.lora_rank > 0 (adapters to publish)'
            )
        return self

    @model_validator(mode="after")
    def _clip_higher(self) -> TrainerConfig:
        high = self.clip_epsilon_high
        if self.loss == "grpo" and high and high != self.clip_epsilon:
            raise ValueError(
                f"trainer.clip_epsilon_high ({high:g}) differs from trainer.clip_epsilon "
                f"({self.clip_epsilon:g}) but trainer.loss grpo clips symmetrically: "
                "use loss dapo for clip higher"
            )
        return self

    @property
    def needs_rollout_logps(self) -> bool:
        """Whether the loss reads the rollout's log-probs (the ratio's denominator, or the
        importance correction's), so every sampled token must have one."""
        return self.use_rollout_logps or self.importance_correction != "none"

    @model_validator(mode="after")
    def _correction(self) -> TrainerConfig:
        if self.importance_correction != "none" and self.use_rollout_logps:
            raise ValueError(
                f"trainer.importance_correction = {self.importance_correction!r} needs "
                "trainer.use_rollout_logps = false: with the ratio already taken against the "
                "rollout's log-probs the correction weight is 1 on every token"
            )
        return self


class MetricsConfig(_Section):
    """Counters of every worker as time series (`streamrl.obs.metrics`)."""

    interval_s: float = Field(
        1.0,
        ge=0.05,
        le=3600,
        description="Seconds between two samples of a worker's counters (its metrics thread).",
    )
    keep_samples: int = Field(
        3600,
        ge=10,
        le=1_000_000,
        description=(
            "Samples kept in Redis per worker (`{run}:metrics:<worker>`, trimmed with "
            "XADD MAXLEN ~: a few more may stay)."
        ),
    )
    rate_window_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description=(
            "Sliding window of the rates (trajectories, groups, examples per minute, "
            "tokens/s), tool latency percentiles and error rates, reward and policy age."
        ),
    )
    prometheus_port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "Serve the Prometheus text format on this port (0: off). `streamrl up` gives "
            "each worker this port plus its place in the launch order (0, 1, ...)."
        ),
    )
    prometheus_host: str = Field(
        "127.0.0.1",
        min_length=1,
        max_length=255,
        description=(
            "The address the Prometheus endpoint binds: loopback by default; 0.0.0.0 where "
            "a scraper on the network reads it (the compose stack). A port in use is "
            "logged and the worker runs on without the endpoint."
        ),
    )

    @model_validator(mode="after")
    def _window(self) -> MetricsConfig:
        if self.rate_window_s < self.interval_s:
            raise ValueError(
                f"metrics.rate_window_s ({self.rate_window_s:g}) is shorter than "
                f"metrics.interval_s ({self.interval_s:g}): a rate needs two samples"
            )
        return self


class TraceConfig(_Section):
    """Perfetto traces (`streamrl.obs.tracing`): each worker process writes its spans and
    counters to RUN_DIR/traces/<worker>.pftrace; `streamrl trace RUN_DIR` merges them."""

    enabled: bool = Field(
        True, description="Write each worker's trace file (a span costs ~1-2 us of CPU)."
    )
    flush_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description=(
            "Packets held are written at least this often (seconds): what a crash of the "
            "worker may lose at most, besides a chunk not yet full."
        ),
    )
    chunk_packets: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="Packets held before they are written in one write, between flushes.",
    )
    max_mb: float = Field(
        256.0,
        ge=0,
        le=1_000_000,
        description=(
            "A worker's trace file past this (MiB) rolls over to <worker>.1.pftrace, "
            "replacing the one before: at most twice this per worker; 0: no cap."
        ),
    )


SinkName = Literal["tensorboard", "wandb"]


class LoggingConfig(_Section):
    """Metrics sinks (`streamrl.obs.sinks`): the run's figures in TensorBoard and W&B,
    written by one process (the `sinks` worker) from what the run already records."""

    sinks: list[SinkName] = Field(
        default_factory=list,
        description=(
            'Where the sinks worker writes the run\'s figures: "tensorboard" (event files '
            'in RUN_DIR/tensorboard), "wandb" (RUN_DIR/wandb); empty: no sinks worker.'
        ),
    )
    interval_s: float = Field(
        2.0,
        ge=0.1,
        le=3600,
        description=(
            "Seconds between two reads of the run's metrics by the sinks worker; each read "
            "writes the new steps and flushes every sink."
        ),
    )
    wandb_project: str = Field(
        "streamrl",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="W&B project of the run (`wandb sync` uploads offline runs into it).",
    )
    wandb_entity: str = Field(
        "",
        max_length=128,
        pattern=r"^[A-Za-z0-9_.-]*$",
        description="W&B entity (user or team); empty: the account's default.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "offline: W&B writes files under RUN_DIR/wandb only, never the network "
            "(upload them later with `wandb sync`); online: streams to the W&B server "
            "(needs WANDB_API_KEY in the environment)."
        ),
    )

    @field_validator("sinks")
    @classmethod
    def _once_each(cls, v: list[SinkName]) -> list[SinkName]:
        if len(set(v)) != len(v):
            raise ValueError(f"a sink is named twice: {v}")
        return v


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis.")
    transport: TransportConfig = Field(
        default_factory=TransportConfig,
        description="Stream delivery.",
    )
    task: TaskConfig = Field(default_factory=TaskConfig, description="Data set.")
    tasks: list[TaskConfig] = Field(
        default_factory=list,
        max_length=MAX_MIXTURE,
        description=(
            "A mixture of tasks ([[tasks]], each a [task] table with its weight): the "
            "feeder draws the tasks it writes from them by weight, in an order seeded by "
            "run.seed (streamrl.tasks.mixture). [task] then holds only the feeder's "
            "max_backlog. Empty: [task] alone."
        ),
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="Rollout workers.",
    )
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tool workers.")
    grouper: GrouperConfig = Field(
        default_factory=GrouperConfig,
        description="Grouping and advantages.",
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="Trainer.",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Counters as time series, Prometheus."
    )
    trace: TraceConfig = Field(
        default_factory=TraceConfig,
        description="Perfetto trace files of the workers.",
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig,
        description="Metrics sinks: TensorBoard, W&B.",
    )

    _derived: tuple[str, ...] = PrivateAttr(())

    @model_validator(mode="after")
    def _derive(self) -> Config:
        """Fill in the "auto" fields (issue 29): the trainer's batch from the groups in
        flight, the ready-group cap from the batch."""
        derived = []
        if self.trainer.groups_per_step == AUTO:
            batch = max(
                1,
                math.ceil(
                    self.rollout_workers * self.concurrency_estimate / self.rollout.num_generations
                ),
            )
            object.__setattr__(
                self, "trainer", self.trainer.model_copy(update={"groups_per_step": batch})
            )
            derived.append("trainer.groups_per_step")
        if self.rollout.max_ready_groups == AUTO:
            ready = 2 * self.trainer.groups_per_step
            object.__setattr__(
                self, "rollout", self.rollout.model_copy(update={"max_ready_groups": ready})
            )
            derived.append("rollout.max_ready_groups")
        self._derived = tuple(derived)
        return self

    @property
    def mixture(self) -> tuple[TaskConfig, ...]:
        """The run's tasks: the [[tasks]] mixture, or [task] alone."""
        return tuple(self.tasks) if self.tasks else (self.task,)

    @model_validator(mode="after")
    def _mixture(self) -> Config:
        if not self.tasks:
            return self
        misplaced = sorted(self.task.model_fields_set - {"max_backlog"})
        if misplaced:
            raise ValueError(
                "[[tasks]] is a mixture: [task] then holds only the feeder's max_backlog, "
                f"but it sets {', '.join('task.' + f for f in misplaced)}: move them into "
                "the [[tasks]] entries"
            )
        seen: dict[str, int] = {}
        for i, t in enumerate(self.tasks):
            if "max_backlog" in t.model_fields_set:
                raise ValueError(
                    f"tasks[{i}].max_backlog: the feeder keeps one backlog for the mixture, "
                    "task.max_backlog"
                )
            if t.agent.startswith(OPENAI_AGENT) or t.agent_command:
                raise ValueError(
                    f"tasks[{i}] ({t.label}): an agent of the OpenAI kind (task.agent = "
                    '"openai:..." or task.agent_command) plays a single [task] only, not a '
                    "mixture"
                )
            if t.epochs and self.grouper.order == "submission":
                raise ValueError(
                    f'tasks[{i}].epochs ({t.epochs}) with grouper.order = "submission": a '
                    "mixture's task that ends leaves positions with no task, which submission "
                    "order would wait for; end the run with --steps (or trainer.max_steps)"
                )
            if t.label in seen:
                raise ValueError(
                    f"tasks[{i}] and tasks[{seen[t.label]}] are both reported as "
                    f"{t.label!r}: give one of them an id"
                )
            seen[t.label] = i
        return self

    @property
    def rollout_workers(self) -> int:
        """Rollout workers the run starts: one in the colocated process, else num_workers."""
        return 1 if self.run.colocated else self.rollout.num_workers

    @property
    def concurrency_estimate(self) -> int:
        """Episodes a rollout worker runs at once: max_concurrency, or under adaptive
        admission what its engine's KV pool holds (rollout.max_batch_size, within the
        cap; the stub policy has no pool: the cap)."""
        r = self.rollout
        if r.admission == "fixed" or self.model.kind == "stub":
            return r.max_concurrency
        return min(r.max_concurrency, r.max_batch_size)

    @property
    def derived(self) -> tuple[str, ...]:
        """The fields this config derived from the others ("auto"), as `section.key`."""
        return self._derived

    @property
    def model_seed(self) -> int:
        """The starting policy's seed: model.seed, else run.seed."""
        return self.run.seed if self.model.seed is None else self.model.seed

    @model_validator(mode="after")
    def _lengths(self) -> Config:
        if not self.model.checkpoint and self.rollout.kv_cache_size > self.model.max_seq_len:
            raise ValueError(
                f"rollout.kv_cache_size ({self.rollout.kv_cache_size}) exceeds "
                f"model.max_seq_len ({self.model.max_seq_len}) of the built-in model"
            )
        return self

    @model_validator(mode="after")
    def _eval(self) -> Config:
        if self.trainer.eval_every and self.model.kind != "transformer":
            raise ValueError(
                f"trainer.eval_every ({self.trainer.eval_every}) needs model.kind = "
                f'"transformer": a {self.model.kind} model has no policy to evaluate'
            )
        return self

    @model_validator(mode="after")
    def _trainer_processes(self) -> Config:
        if self.trainer.num_processes > 1 and self.run.colocated:
            raise ValueError(
                f"trainer.num_processes ({self.trainer.num_processes}) needs a trainer of its "
                "own: run.colocated runs one process"
            )
        t = self.trainer
        if t.num_processes > 1 and (t.mesh_data * t.mesh_fsdp) % t.num_processes:
            raise ValueError(
                f"trainer.mesh_data x trainer.mesh_fsdp ({t.mesh_data * t.mesh_fsdp} devices) "
                f"must span all trainer.num_processes ({t.num_processes}): a multiple of it"
            )
        return self

    @model_validator(mode="after")
    def _sync_rollout(self) -> Config:
        if self.rollout.mode != "sync":
            return self
        if self.rollout.num_workers != 1:
            raise ValueError(
                f'rollout.mode = "sync" needs rollout.num_workers = 1 (not '
                f"{self.rollout.num_workers}): one worker counts each batch's tasks"
            )
        if self.trainer.publish_every != 1:
            raise ValueError(
                f'rollout.mode = "sync" needs trainer.publish_every = 1 (not '
                f"{self.trainer.publish_every}): rollout waits for a new version after "
                "every step"
            )
        return self

    @model_validator(mode="after")
    def _partial_groups(self) -> Config:
        if self.rollout.max_partial_groups and not self.grouper.group_timeout_s:
            raise ValueError(
                f"rollout.max_partial_groups ({self.rollout.max_partial_groups}) needs "
                "grouper.group_timeout_s > 0: a group that never completes (a member dead-"
                "lettered) would count against it for ever and, with enough of them, stop "
                "rollout"
            )
        return self

    @model_validator(mode="after")
    def _valid_members(self) -> Config:
        if self.grouper.min_valid_members > self.rollout.num_generations:
            raise ValueError(
                f"grouper.min_valid_members ({self.grouper.min_valid_members}) exceeds "
                f"rollout.num_generations ({self.rollout.num_generations}): every group "
                "would be dropped"
            )
        return self

    @model_validator(mode="after")
    def _restarts(self) -> Config:
        restarts, deliveries = self.run.max_restarts, self.transport.max_deliveries
        if restarts and restarts <= deliveries:
            raise ValueError(
                f"run.max_restarts ({restarts}) must exceed transport.max_deliveries "
                f"({deliveries}): an entry that kills its worker each time it is read takes "
                f"{deliveries} crashes to reach the dead letters, and the run would stop at "
                f"{restarts + 1} crashes (review N12); 0 restarts: never restart"
            )
        return self

    @model_validator(mode="after")
    def _tool_wait(self) -> Config:
        wait = (self.tools.time_limit_s + self.tools.result_margin_s) * (self.tools.retries + 1)
        if self.rollout.env_step_timeout_s < wait:
            raise ValueError(
                f"rollout.env_step_timeout_s ({self.rollout.env_step_timeout_s:g}) is shorter "
                f"than a tool call may wait: (tools.time_limit_s + tools.result_margin_s) x "
                f"(tools.retries + 1) = {wait:g}"
            )
        return self

    def redis_url(self) -> str:
        """The Redis URL this process should use: REDIS_URL, else the configured one."""
        return os.environ.get("REDIS_URL", "") or self.redis.url


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key `{loc}`")
        elif loc:
            lines.append(f"field `{loc}`: {e['msg']}")
        else:
            lines.append(e["msg"])
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


_OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)=(.*)$")


def _apply_override(data: dict[str, object], item: str) -> None:
    """`section.key=value`, or deeper (`task.options.latency_s=0.5`); the value is TOML,
    or a bare string."""
    m = _OVERRIDE.match(item)
    if not m:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    path, raw = m.groups()
    *tables, key = path.split(".")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as run.name=foo
    sub = data
    for i, name in enumerate(tables):
        # copied on the way down: the caller's nested tables stay as they were
        nested = sub.get(name, {})
        if not isinstance(nested, dict):
            raise ConfigError(f"override {item!r}: `{'.'.join(tables[: i + 1])}` is not a table")
        sub[name] = sub = dict(nested)
    sub[key] = value


def parse_config(
    data: Mapping[str, object], source: str = "<dict>", overrides: list[str] | None = None
) -> Config:
    """Validate a parsed TOML document (plus `section.key=value` overrides)."""
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides or []:
        _apply_override(doc, item)
    try:
        return Config.model_validate(doc)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read and validate a TOML config file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML in {p}: {err}") from None
    return parse_config(data, source=str(p), overrides=overrides)
