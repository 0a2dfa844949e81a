"""Immutable train state and the jitted policy-gradient step.

`train_step(state, batch) -> (state, metrics)` is pure and compiled once per batch bucket:
build_batch pads B up to a power of two and L up to a multiple of 32, so steady-state
training compiles nothing new.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from streamrl.config import TrainerConfig
from streamrl.model.llm import Params, causal_logits
from streamrl.model.spec import ModelSpec
from streamrl.rl.losses import LOSSES

__all__ = [
    "Batch",
    "TrainState",
    "TrainStep",
    "build_batch",
    "init_state",
    "make_optimizer",
    "make_train_step",
    "round_batch",
    "round_length",
    "standard_promotion",
    "token_logprobs",
]

LENGTH_BUCKET = 32  # sequence lengths round up to a multiple of this, so shapes repeat


def round_batch(n: int) -> int:
    """Batch bucket: n rounded up to a power of two (at least 1)."""
    return 1 << max(0, (n - 1).bit_length())


def round_length(n: int) -> int:
    """Length bucket: n rounded up to a multiple of LENGTH_BUCKET (at least one bucket)."""
    return max(1, -(-n // LENGTH_BUCKET)) * LENGTH_BUCKET


class TrainState(flax.struct.PyTreeNode):
    """step: int32 scalar (optimizer steps taken); params; opt_state (optax state)."""

    step: jax.Array
    params: Params
    opt_state: Any


@flax.struct.dataclass
class Batch:
    """One training batch, padded to its bucket.

    tokens [B, L] int32; mask [B, L] float32 (1 on the policy's own sampled tokens, 0 on
    template, tool output and padding); old_logp [B, L] float32 (rollout log-prob of each
    token given the ones before it, 0 where mask is 0); advantages [B] float32.
    """

    tokens: jax.Array | np.ndarray
    mask: jax.Array | np.ndarray
    old_logp: jax.Array | np.ndarray
    advantages: jax.Array | np.ndarray


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW at a constant learning rate."""
    return standard_promotion(
        optax.chain(
            optax.clip_by_global_norm(cfg.max_grad_norm),
            optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
        )
    )


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """tx with JAX's standard dtype promotion scoped to its init and update.

    optax's Adam computes its bias correction as `b1 ** count` (a Python float to the power
    of an int32 array), which the strict promotion our code and tests run under rejects.
    The optimizer's arithmetic is optax's to get right; everything else stays strict.
    """

    def init(params: optax.Params) -> optax.OptState:
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(
        updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.OptState]:
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )


def build_batch(
    items: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    advantages: list[float],
    pad_id: int,
) -> Batch:
    """Right-pad (tokens, mask, logprobs) sequences into a bucketed Batch.

    Each item is three aligned 1-D arrays of one transcript. L rounds up to a multiple of
    32, B to a power of two; padding rows and columns have mask 0 and advantage 0.
    """
    if len(items) != len(advantages):
        raise ValueError(f"{len(items)} sequences but {len(advantages)} advantages")
    if not items:
        raise ValueError("empty batch")
    for i, (t, m, lp) in enumerate(items):
        if not len(t) == len(m) == len(lp):
            raise ValueError(
                f"sequence {i}: tokens, mask and logprobs differ in length "
                f"({len(t)}, {len(m)}, {len(lp)})"
            )
    b = round_batch(len(items))
    length = round_length(max(len(t) for t, _, _ in items))
    tokens = np.full((b, length), pad_id, np.int32)
    mask = np.zeros((b, length), np.float32)
    old_logp = np.zeros((b, length), np.float32)
    adv = np.zeros((b,), np.float32)
    for i, (t, m, lp) in enumerate(items):
        n = len(t)
        tokens[i, :n] = t
        mask[i, :n] = m
        # Where the mask is 0 the rollout log-prob means nothing; keep it at 0 as promised.
        old_logp[i, :n] = np.where(np.asarray(m) > 0, lp, 0.0)
        adv[i] = advantages[i]
    return Batch(tokens=tokens, mask=mask, old_logp=old_logp, advantages=adv)


def token_logprobs(
    params: Params, spec: ModelSpec, tokens: jax.Array | np.ndarray, temperature: float
) -> jax.Array:
    """[B, L] float32: out[:, t] = log softmax(logits[:, t-1] / temperature)[tokens[:, t]].

    out[:, 0] = 0 (the first token has no prediction). Over the full vocabulary (every
    embedding row, padding rows included), exactly the log-prob the engine reports for a
    sampled token. Under jit pass `spec` and `temperature` as static arguments.
    """
    logits = causal_logits(params, spec, tokens)[:, :-1]
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


class TrainStep:
    """The jitted `(state, batch) -> (state, metrics)`; `compile_count` counts traces.

    metrics (float32 scalars): loss, grad_norm (before clipping), clip_fraction,
    ratio_mean, num_tokens (mask sum).
    """

    def __init__(
        self,
        spec: ModelSpec,
        trainer_cfg: TrainerConfig,
        temperature: float,
        optimizer: optax.GradientTransformation,
    ) -> None:
        self.spec = spec
        self.loss_fn = LOSSES[trainer_cfg.loss]
        self.clip_epsilon = trainer_cfg.clip_epsilon
        self.temperature = temperature
        self.optimizer = optimizer
        self.compile_count = 0
        # Donating the old state halves peak memory on accelerators; XLA:CPU cannot reuse
        # donated buffers and warns, so donate only off the CPU.
        donate = (0,) if jax.default_backend() != "cpu" else ()
        self._step = jax.jit(self._train_step, donate_argnums=donate)

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        return self._step(state, batch)

    def _loss(self, params: Params, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp = token_logprobs(params, self.spec, jnp.asarray(batch.tokens), self.temperature)
        return self.loss_fn(
            logp,
            jnp.asarray(batch.old_logp),
            jnp.asarray(batch.advantages),
            jnp.asarray(batch.mask),
            self.clip_epsilon,
        )

    def _train_step(
        self, state: TrainState, batch: Batch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        self.compile_count += 1  # runs once per trace, i.e. once per compiled bucket
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        (loss, metrics), grads = grad_fn(state.params, batch)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        metrics = {
            **metrics,
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "num_tokens": jnp.sum(jnp.asarray(batch.mask)),
        }
        return new_state, metrics


def make_train_step(
    spec: ModelSpec,
    trainer_cfg: TrainerConfig,
    temperature: float,
    optimizer: optax.GradientTransformation,
) -> TrainStep:
    """The compiled train step for this model, loss (`trainer_cfg.loss`) and temperature."""
    return TrainStep(spec, trainer_cfg, temperature, optimizer)
