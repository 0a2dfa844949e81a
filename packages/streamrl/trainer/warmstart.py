"""Warm start: supervised next-token training on scripted demonstrations of the task.

A randomly initialised policy never samples a well-formed tool call, so GRPO would see only
zero rewards. This stands in for starting from an instruct checkpoint: the tiny model first
learns the episode format from demonstrations laid out exactly as a rollout episode is
(prompt template, the assistant's calculator call, the tool result, the assistant's answer),
with the loss on the assistant's tokens only. A fraction of demonstrations answer wrongly,
so the warm policy leaves room for RL to improve.

Results are cached on disk by a hash of everything that affects them, so every worker of a
run (and every later run with the same settings) trains it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from streamrl.chat import ChatFormat, Transcript
from streamrl.config import Config
from streamrl.model.decoder import Params, causal_logits, init_params, param_shapes, round_length
from streamrl.model.weights import (
    WeightsError,
    params_from_bytes,
    params_to_bytes,
    write_bytes_atomic,
)
from streamrl.tasks.arithmetic import demonstration, make_task
from streamrl.tokenizer import CharTokenizer
from streamrl.trainer.step import standard_promotion

__all__ = [
    "WARMSTART_VERSION",
    "cache_key",
    "cache_path",
    "demonstration_batch",
    "demonstration_loss",
    "demonstration_transcript",
    "train_demonstrations",
    "warmstart_params",
]

# Bump whenever a code change alters what a warm start produces: it is part of the cache key.
WARMSTART_VERSION = 1
VOCAB_SIZE = CharTokenizer.VOCAB_SIZE
_LOG_EVERY = 50  # steps between progress events
_WARMUP_FRACTION = 0.05
_FINAL_LR_FRACTION = 0.1
_MAX_GRAD_NORM = 1.0
_DEFAULT_CACHE = Path.home() / ".cache" / "streamrl" / "warmstart"

Log = Callable[..., Any]  # e.g. a structlog logger's `info`: log(event, **fields)


def demonstration_transcript(
    cfg: Config, chat: ChatFormat, cursor: int, rng: random.Random
) -> Transcript:
    """The scripted episode of the task at `cursor`, laid out as a rollout episode.

    prompt template (mask 0), calculator call turn (mask 1), tool result template (mask 0),
    answer turn (mask 1). `rng` decides whether this demonstration answers wrongly.
    """
    task = make_task(cfg.task, cfg.run.seed, cursor, cfg.rollout.num_generations)
    demo = demonstration(task, rng, cfg.model.warmstart_error_rate)
    t = Transcript()
    t.add_template(chat.prompt(task.prompt))
    t.prompt_len = len(t)
    call = chat.assistant_turn(demo.turns[0])
    t.add_sampled(call, [0.0] * len(call), version=0)
    t.add_template(chat.tool_results([demo.tool_results[0]]))
    answer = chat.assistant_turn(demo.turns[1])
    t.add_sampled(answer, [0.0] * len(answer), version=0)
    return t


def demonstration_batch(
    cfg: Config, chat: ChatFormat, rng: random.Random, batch: int
) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, L] int32 and mask [B, L] float32 of `batch` demonstrations of random tasks.

    Right-padded with the pad id to L, a multiple of 32; mask is 1 on assistant tokens.
    """
    episodes = [
        demonstration_transcript(cfg, chat, rng.randrange(cfg.task.num_prompts), rng)
        for _ in range(batch)
    ]
    length = round_length(max(len(e) for e in episodes))
    tokens = np.full((batch, length), chat.tok.pad_id, np.int32)
    mask = np.zeros((batch, length), np.float32)
    for i, e in enumerate(episodes):
        tokens[i, : len(e)] = e.tokens
        mask[i, : len(e)] = e.mask
    return tokens, mask


def demonstration_loss(
    params: Params, cfg: Config, tokens: jax.Array, mask: jax.Array
) -> jax.Array:
    """Mean cross-entropy (nats per token) of the mask-1 tokens [B, L] given their prefix."""
    logits = causal_logits(params, cfg.model, VOCAB_SIZE, tokens)[:, :-1]
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


def train_demonstrations(cfg: Config, log: Log | None = None) -> Params:
    """Run the warm start itself (no cache): `warmstart_steps` AdamW steps from init."""
    params = init_params(cfg.model, VOCAB_SIZE, cfg.run.seed)
    optimizer = _optimizer(cfg)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params: Params, opt_state: Any, tokens: jax.Array, mask: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(demonstration_loss)(params, cfg, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    chat = ChatFormat(CharTokenizer())
    rng = random.Random(cfg.run.seed)
    start = time.perf_counter()
    for i in range(cfg.model.warmstart_steps):
        tokens, mask = demonstration_batch(cfg, chat, rng, cfg.model.warmstart_batch)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
        last = i + 1 == cfg.model.warmstart_steps
        if log is not None and (i % _LOG_EVERY == 0 or last):
            elapsed = time.perf_counter() - start
            log("warmstart.step", step=i, loss=float(loss), elapsed_s=round(elapsed, 2))
    loss_value = float(loss)
    if not np.isfinite(loss_value):
        raise FloatingPointError(f"warm start diverged: loss {loss_value}")
    return params


def cache_key(cfg: Config) -> str:
    """sha256 hex of every input of the warm start's result.

    The model and task sections (without `model.init`, `model.warmstart_cache` and
    `task.max_backlog`, which do not change the result), the run seed, the vocabulary and
    WARMSTART_VERSION.
    """
    inputs = {
        "version": WARMSTART_VERSION,
        "vocab": VOCAB_SIZE,
        "seed": cfg.run.seed,
        "model": cfg.model.model_dump(exclude={"init", "warmstart_cache"}),
        "task": cfg.task.model_dump(exclude={"max_backlog"}),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def cache_path(cfg: Config) -> Path:
    """Where the warm start of this config is cached."""
    root = Path(cfg.model.warmstart_cache).expanduser() if cfg.model.warmstart_cache else None
    return (root or _DEFAULT_CACHE) / f"warmstart-{cache_key(cfg)[:32]}.msgpack"


def warmstart_params(cfg: Config, log: Log | None = None) -> Params:
    """The warm-started policy of this config: from the cache, else trained and cached.

    Processes starting together (trainer and rollout workers) take a file lock, so one
    trains while the others wait and then read its result.
    """
    path = cache_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        params = _read_cache(cfg, path, log)
        if params is not None:
            return params
        start = time.perf_counter()
        params = train_demonstrations(cfg, log)
        write_bytes_atomic(path, params_to_bytes(params))
    if log is not None:
        log("warmstart.trained", path=str(path), seconds=round(time.perf_counter() - start, 2))
    return params


def _read_cache(cfg: Config, path: Path, log: Log | None) -> Params | None:
    if not path.exists():
        return None
    try:
        params = params_from_bytes(param_shapes(cfg.model, VOCAB_SIZE), path.read_bytes())
    except WeightsError as err:
        # Writes are atomic, so this is outside damage; retraining repairs it.
        if log is not None:
            log("warmstart.cache_unreadable", path=str(path), error=str(err))
        return None
    if log is not None:
        log("warmstart.cache_hit", path=str(path))
    return params
