"""Warm start: supervised next-token training on scripted demonstrations of the task.

A random checkpoint (the built-in tiny model) never samples a well-formed tool call, so
GRPO would see only zero rewards. The warm start teaches the episode format from
demonstrations laid out exactly as a rollout episode is, through the checkpoint's own chat
template (`HFDialogue`): prompt with the tool listed (template), the assistant's
calculator call (trained), the tool result (template), the assistant's answer (trained).
The loss is on the assistant's tokens only. A fraction of demonstrations answer wrongly,
so the warm policy leaves room for RL to improve.

Results are cached on disk as a Hugging Face checkpoint directory, keyed by a hash of
everything that affects them, so every worker of a run (and every later run with the same
settings) trains it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from streamrl.chat.hf import HFChat
from streamrl.chat.transcript import Transcript
from streamrl.config import Config, TaskConfig
from streamrl.model.checkpoint import (
    CheckpointError,
    export_checkpoint,
    load_checkpoint,
    policy_dtype,
)
from streamrl.model.llm import DType, Params, causal_logits
from streamrl.model.spec import ModelSpec, PyTree
from streamrl.model.tiny import builtin_key, cache_root, ensure_checkpoint
from streamrl.tasks.registry import demonstration
from streamrl.trainer.step import LENGTH_BUCKET, round_length, standard_promotion

__all__ = [
    "WARMSTART_VERSION",
    "cache_key",
    "cache_path",
    "demonstration_batch",
    "demonstration_length",
    "demonstration_loss",
    "demonstration_transcript",
    "train_demonstrations",
    "warmstart_params",
]

# Task fields that do not change the demonstrations: runs that differ only in these share
# a warm start (the built-in agent and an agent of the OpenAI kind on the same task).
# `id` labels a task and `weight` is its share (a mixture keys its weights apart).
NOT_IN_KEY = {"max_backlog", "agent", "agent_command", "agent_dir", "epochs", "id", "weight"}
# Bump whenever a code change alters what a warm start produces: it is part of the cache key.
# 4: batches of short demonstrations padded to a multiple of 8 tokens, not 32 (the same
# loss and gradient but for float rounding).
WARMSTART_VERSION = 4
# Demonstration batches pad to a multiple of SHORT_BUCKET tokens below LONG_FROM tokens, of
# the trainer's LENGTH_BUCKET from there (`demonstration_length`).
SHORT_BUCKET = 8
LONG_FROM = 256
_LOG_EVERY = 100  # steps between progress events
_WARMUP_FRACTION = 0.05
_FINAL_LR_FRACTION = 0.1
_MAX_GRAD_NORM = 1.0

Log = Callable[..., object]  # e.g. a structlog logger's `info`: log(event, **fields)


def demonstration_transcript(
    cfg: Config, chat: HFChat, cursor: int, rng: random.Random, task: TaskConfig | None = None
) -> Transcript:
    """The scripted episode of the task at `cursor` (of `task`, by default the run's first),
    laid out as a rollout episode.

    prompt with the task's tools listed (mask 0), then each assistant turn (mask 1) with
    the tool result after it up to the next generation prompt (mask 0); each sampled turn
    ends with the template's turn-end token. `rng` decides whether this one errs.
    """
    task = cfg.mixture[0] if task is None else task
    demo = demonstration(task, cfg.model_seed, cursor, rng, cfg.model.warmstart_error_rate)
    dialogue = chat.dialogue(demo.tools)
    t = Transcript()
    t.add_template(dialogue.prompt(demo.task.prompt))
    t.prompt_len = len(t)
    for i, text in enumerate(demo.turns):
        turn = chat.assistant_turn(text)
        t.add_sampled(turn, [0.0] * len(turn), version=0)
        dialogue.assistant(turn)
        if i < len(demo.tool_results):
            t.add_template(dialogue.tool_results([demo.tool_results[i]]))
    return t


def demonstration_batch(
    cfg: Config, chat: HFChat, rng: random.Random, batch: int
) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, L] int32 and mask [B, L] float32 of `batch` demonstrations of random tasks.

    Right-padded with the pad id to L (`demonstration_length` of the longest); mask is 1 on
    assistant tokens.
    """
    episodes = []
    for _ in range(batch):
        cursor, task = _draw(cfg, rng)
        episodes.append(demonstration_transcript(cfg, chat, cursor, rng, task))
    length = demonstration_length(max(len(e) for e in episodes))
    tokens = np.full((batch, length), chat.pad_id, np.int32)
    mask = np.zeros((batch, length), np.float32)
    for i, e in enumerate(episodes):
        tokens[i, : len(e)] = e.tokens
        mask[i, : len(e)] = e.mask
    return tokens, mask


def demonstration_length(n: int) -> int:
    """The padded length of a demonstration batch whose longest is `n` tokens: a multiple of
    SHORT_BUCKET below LONG_FROM, else of the trainer's LENGTH_BUCKET (at least one bucket).

    Each length is a compile of the step, so lengths repeat; but the default config's
    demonstrations are 96-132 tokens, and a multiple of 32 padded nearly every batch to 160
    (0.70 of its tokens real; to 136: 0.82, and a step's CPU 95-107 -> 75 ms here, two
    lengths in 1,000 batches either way). Long ones (the code task's 350-540) gain little
    from finer buckets and would compile more lengths."""
    return round_length(n, SHORT_BUCKET if n < LONG_FROM else LENGTH_BUCKET)


def _draw(cfg: Config, rng: random.Random) -> tuple[int, TaskConfig]:
    """A random task's cursor and its task: of a mixture, a task drawn by weight first."""
    tasks = cfg.mixture
    task = tasks[0] if len(tasks) == 1 else rng.choices(tasks, [t.weight for t in tasks])[0]
    return rng.randrange(task.num_prompts), task


def demonstration_loss(
    params: Params, spec: ModelSpec, tokens: jax.Array, mask: jax.Array
) -> jax.Array:
    """Mean cross-entropy (nats per token) of the mask-1 tokens [B, L] given their prefix.

    Under jit pass `spec` as a static argument.
    """
    logits = causal_logits(params, spec, tokens)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    weights = mask[:, 1:]
    return -jnp.sum(picked * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _optimizer(cfg: Config) -> optax.GradientTransformation:
    steps = cfg.model.warmstart_steps
    lr = cfg.model.warmstart_lr
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=max(1, int(steps * _WARMUP_FRACTION)),
        decay_steps=max(2, steps),
        end_value=lr * _FINAL_LR_FRACTION,
    )
    return standard_promotion(
        optax.chain(optax.clip_by_global_norm(_MAX_GRAD_NORM), optax.adamw(schedule))
    )


def demonstration_step(
    cfg: Config, spec: ModelSpec
) -> tuple[optax.GradientTransformation, jax.stages.Wrapped]:
    """The warm start's optimizer and its jitted step: (params, opt_state, tokens, mask) ->
    (params, opt_state, loss), value and gradient of `demonstration_loss`, then AdamW."""
    optimizer = _optimizer(cfg)

    @jax.jit
    def step(
        params: Params, opt_state: PyTree, tokens: jax.Array, mask: jax.Array
    ) -> tuple[Params, PyTree, jax.Array]:
        loss, grads = jax.value_and_grad(demonstration_loss)(params, spec, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return optimizer, step


def train_demonstrations(
    cfg: Config, spec: ModelSpec, params: Params, chat: HFChat, log: Log | None = None
) -> Params:
    """Run the warm start itself (no cache): `warmstart_steps` AdamW steps from `params`,
    in their dtype."""
    optimizer, step = demonstration_step(cfg, spec)
    opt_state = optimizer.init(params)
    rng = random.Random(cfg.model_seed)
    start = time.perf_counter()
    steps = cfg.model.warmstart_steps
    for i in range(steps):
        # Dispatch is asynchronous: the next batch is assembled (template rendering, about
        # a millisecond per demonstration) while the device runs this step.
        tokens, mask = demonstration_batch(cfg, chat, rng, cfg.model.warmstart_batch)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
        if log is not None and (i % _LOG_EVERY == 0 or i + 1 == steps):
            elapsed = time.perf_counter() - start
            log("warmstart.step", step=i, loss=float(loss), elapsed_s=round(elapsed, 2))
    loss_value = float(loss)
    if not np.isfinite(loss_value):
        raise FloatingPointError(f"warm start diverged: loss {loss_value}")
    return params


def _checkpoint_identity(cfg: Config, ckpt: Path) -> dict[str, object]:
    """What names the starting checkpoint: the built-in model's key, or for a user
    checkpoint its config.json and the name, size and mtime of every file (weights,
    tokenizer and chat template: all change the demonstrations or the result)."""
    if not cfg.model.checkpoint:
        return {"builtin": builtin_key(cfg)}
    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    return {
        "config": hashlib.sha256((ckpt / "config.json").read_bytes()).hexdigest(),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def cache_key(cfg: Config, ckpt: Path | None = None) -> str:
    """sha256 hex of every input of the warm start's result.

    The starting checkpoint (`_checkpoint_identity`), the task section (but `NOT_IN_KEY`:
    what plays the episodes and how many times, which the demonstrations, drawn from the
    task's own definition, never depend on), the model seed (`Config.model_seed`:
    model.seed, else run.seed), the chat template, dtype and warm-start fields of `model`
    (the template's name, not its text), and WARMSTART_VERSION. Not the cache location,
    nor `model.init`.
    """
    ckpt = ensure_checkpoint(cfg) if ckpt is None else ckpt
    inputs: dict[str, object] = {
        "version": WARMSTART_VERSION,
        "checkpoint": _checkpoint_identity(cfg, ckpt),
        "seed": cfg.model_seed,
        "model": cfg.model.model_dump(
            include={
                "chat_template",  # lays out the demonstrations
                "dtype",
                "warmstart_steps",
                "warmstart_batch",
                "warmstart_lr",
                "warmstart_error_rate",
            }
        ),
    }
    if cfg.tasks:  # a mixture: every task, and the weights its demonstrations are drawn by
        inputs["tasks"] = [[t.weight, t.model_dump(exclude=NOT_IN_KEY)] for t in cfg.tasks]
    else:
        inputs["task"] = cfg.task.model_dump(exclude=NOT_IN_KEY)
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def cache_path(cfg: Config, ckpt: Path | None = None) -> Path:
    """The checkpoint directory caching the warm start of this config."""
    return cache_root(cfg.model) / f"warmstart-{cache_key(cfg, ckpt)[:32]}"


def warmstart_params(cfg: Config, log: Log | None = None) -> Params:
    """The warm-started policy of this config, in `model.dtype`: from the cache, else
    trained from the checkpoint's weights and cached.

    Processes starting together (trainer and rollout workers) take a file lock, so one
    trains while the others wait and then read its result.
    """
    ckpt = ensure_checkpoint(cfg)
    dtype = policy_dtype(cfg.model.dtype)
    path = cache_path(cfg, ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        params = _read_cache(path, dtype, log)
        if params is not None:
            return params
        start = time.perf_counter()
        spec, params = load_checkpoint(ckpt, dtype)
        params = train_demonstrations(cfg, spec, params, HFChat.for_model(ckpt, cfg.model), log)
        _write_cache(path, spec, params)
    if log is not None:
        log("warmstart.trained", path=str(path), seconds=round(time.perf_counter() - start, 2))
    return params


def _write_cache(path: Path, spec: ModelSpec, params: Params) -> None:
    """Export to a fresh directory beside `path`, then rename it into place (under the
    lock, so nobody reads a half-written entry; a damaged old entry is replaced)."""
    tmp = Path(tempfile.mkdtemp(prefix=".warmstart-", dir=path.parent))
    try:
        export_checkpoint(tmp, spec, params)
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(path: Path, dtype: DType | None, log: Log | None) -> Params | None:
    if not path.exists():
        return None
    try:
        _, params = load_checkpoint(path, dtype)
    except CheckpointError as err:
        # Writes are atomic, so this is outside damage; retraining repairs it.
        if log is not None:
            log("warmstart.cache_unreadable", path=str(path), error=str(err))
        return None
    if log is not None:
        log("warmstart.cache_hit", path=str(path))
    return params
