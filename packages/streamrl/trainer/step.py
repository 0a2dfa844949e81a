"""Immutable train state and the jitted policy-gradient step.

`train_step(state, batch) -> (state, metrics)` is pure and compiled once per batch bucket:
build_batch pads B up to a power of two (and a multiple of the micro-batch size and of the
mesh's batch devices) and L up to a multiple of 32, so steady-state training compiles
nothing new.

One step: the batch is cut into micro-batches of `micro_batch_size` rows; each one's
gradient is computed in turn (a `lax.scan`, so only one micro-batch's activations live at a
time) and accumulated with the weight its share of the loss's normaliser gives it, so the
accumulated gradient equals the whole batch's exactly; then one AdamW update (warmup, then
constant or cosine decay; global-norm clipping). With `kl_beta` > 0 the frozen reference
policy (the starting params, `TrainState.ref_params`) is run too; with 0 it is not.

On a mesh (`trainer.mesh_data` x `trainer.mesh_fsdp`), batch rows are split over both axes
and every parameter (and its optimizer state) is split over `fsdp` along its largest
divisible axis, replicated over `data` (FSDP / ZeRO-3 style): XLA's SPMD partitioner gathers
parameters for the forward and reduce-scatters gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl.config import TrainerConfig
from streamrl.model.llm import Params, causal_logits
from streamrl.model.lora import LoraConfig, apply_lora, init_lora
from streamrl.model.sharding import grid_mesh
from streamrl.model.spec import ModelSpec, PyTree
from streamrl.rl.losses import LOSS_AGGREGATION, LOSSES, LossConfig

__all__ = [
    "Batch",
    "StepFn",
    "TrainState",
    "TrainStep",
    "batch_sharding",
    "build_batch",
    "checkpoint_tree",
    "fsdp_spec",
    "init_state",
    "learning_rate_schedule",
    "lora_config",
    "loss_config",
    "make_optimizer",
    "make_train_mesh",
    "round_batch",
    "round_length",
    "shard_fsdp",
    "standard_promotion",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

LENGTH_BUCKET = 32  # sequence lengths round up to a multiple of this, so shapes repeat


def round_batch(n: int) -> int:
    """Batch bucket: n rounded up to a power of two (at least 1)."""
    return 1 << max(0, (n - 1).bit_length())


def round_length(n: int, bucket: int = LENGTH_BUCKET) -> int:
    """Length bucket: n rounded up to a multiple of `bucket` (at least one bucket)."""
    return max(1, -(-n // bucket)) * bucket


class TrainState(flax.struct.PyTreeNode):
    """step: int32 scalar (optimizer steps taken); params; opt_state (optax state);
    ref_params: the frozen reference policy for the KL penalty (None when kl_beta is 0;
    it is the starting params, so a restart rebuilds it rather than checkpointing it).
    With LoRA, `params` are the adapters (all the optimizer sees) and `base_params` the
    frozen base, which is also the reference."""

    step: jax.Array
    params: Params
    opt_state: PyTree
    ref_params: Params | None = None
    base_params: Params | None = None

    def policy_params(self, lora: LoraConfig | None) -> Params:
        """The policy as plain params: with LoRA (`params` are adapters on the frozen
        `base_params`), the adapters merged in; otherwise `params`."""
        if lora is None or self.base_params is None:
            return self.params
        return apply_lora(self.base_params, self.params, lora)

    def checkpoint_tree(self) -> dict[str, PyTree]:
        """What a checkpoint holds of the state (`checkpoint_tree`)."""
        return checkpoint_tree(self.params, self.opt_state, self.step)

    def from_checkpoint_tree(self, tree: dict[str, PyTree]) -> TrainState:
        """This state with a checkpoint's tree (`checkpoint_tree`) restored into it."""
        return self.replace(params=tree["params"], opt_state=tree["opt_state"], step=tree["step"])


def checkpoint_tree(params: PyTree, opt_state: PyTree, step: PyTree) -> dict[str, PyTree]:
    """The Orbax tree of a trainer checkpoint: the trained params (LoRA: the adapters), the
    optimizer state and the step. The reference policy and a LoRA base are the starting
    params, rebuilt from the starting checkpoint, never saved. Values or their abstract
    shapes (`jax.ShapeDtypeStruct`) alike."""
    return {"params": params, "opt_state": opt_state, "step": step}


# A step's metrics by name: scalars (jax arrays from the real step, floats from a stub).
StepMetrics = Mapping[str, jax.Array | float]


class StepFn(Protocol):
    """A train step as the loop calls it: `(state, batch) -> (state, metrics)`, with the
    multiple its batch rows must be padded to (`build_batch`)."""

    @property
    def row_multiple(self) -> int: ...

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]: ...


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


def learning_rate_schedule(cfg: TrainerConfig) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant, or cosine decay over
    `decay_steps` down to `learning_rate * min_lr_ratio` (and constant after)."""
    peak = cfg.learning_rate
    if cfg.lr_schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.min_lr_ratio)
    else:
        after = optax.constant_schedule(peak)
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW on the learning-rate schedule."""
    return standard_promotion(
        optax.chain(
            optax.clip_by_global_norm(cfg.max_grad_norm),
            optax.adamw(
                learning_rate_schedule(cfg),
                b1=cfg.b1,
                b2=cfg.b2,
                weight_decay=cfg.weight_decay,
            ),
        )
    )


def loss_config(cfg: TrainerConfig, max_tokens: int) -> LossConfig:
    """The loss settings of the trainer's config (`max_tokens`: Dr. GRPO's constant)."""
    return LossConfig(
        epsilon=cfg.clip_epsilon,
        epsilon_high=cfg.clip_epsilon_high or None,
        max_tokens=max_tokens,
        kl_beta=cfg.kl_beta,
        kl_estimator=cfg.kl_estimator,
        correction=cfg.importance_correction,
        correction_cap=cfg.importance_cap,
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
            out: tuple[optax.Updates, optax.OptState] = tx.update(updates, state, params)
            return out

    return optax.GradientTransformation(init, update)


def lora_config(cfg: TrainerConfig) -> LoraConfig | None:
    """The trainer's LoRA settings, or None when it trains every weight."""
    if cfg.lora_rank == 0:
        return None
    return LoraConfig(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets))


def init_state(
    params: Params,
    optimizer: optax.GradientTransformation,
    *,
    with_reference: bool = False,
    mesh: Mesh | None = None,
    lora: LoraConfig | None = None,
    seed: int = 0,
) -> TrainState:
    """A fresh state; `with_reference` keeps a copy of `params` as the frozen reference;
    with `lora`, fresh adapters (from `seed`) are what trains and `params` become the frozen
    base (and the reference: no copy); with a mesh, every leaf is placed fsdp-sharded."""
    if mesh is not None:
        params = shard_fsdp(params, mesh)
    base = None
    if lora is not None:
        base, params = params, init_lora(params, lora, seed)
    ref = jax.tree.map(jnp.copy, params) if with_reference and lora is None else None
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        ref_params=ref,
        base_params=base,
    )
    # Every leaf on the mesh (optimizer counts and the step replicated, moments like params).
    return shard_fsdp(state, mesh) if mesh is not None else state


DATA, FSDP = "data", "fsdp"


def make_train_mesh(data: int, fsdp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp) mesh over the first data x fsdp devices (MeshError, a ValueError,
    when there are fewer)."""
    return grid_mesh({DATA: data, FSDP: fsdp}, devices, what="trainer mesh")


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    """Shard the largest axis that `fsdp` divides; replicate small or indivisible leaves."""
    if fsdp == 1 or not shape:
        return PartitionSpec()
    axes = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in axes:
        if shape[i] % fsdp == 0 and shape[i] >= fsdp:
            return PartitionSpec(*[FSDP if j == i else None for j in range(len(shape))])
    return PartitionSpec()


def shard_fsdp(tree: PyTree, mesh: Mesh) -> PyTree:
    """Place every leaf of `tree` on the mesh, fsdp-sharded (`fsdp_spec`)."""
    f = mesh.shape[FSDP]
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(np.shape(x), f))), tree
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays: rows over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, PartitionSpec((DATA, FSDP)))


def padded_shape(lengths: list[int], row_multiple: int = 1) -> tuple[int, int]:
    """(rows, length) of the batch `build_batch` makes of rows of these lengths: rows to a
    power of two, then to a multiple of `row_multiple`; length to its bucket."""
    b = -(-round_batch(len(lengths)) // row_multiple) * row_multiple
    return b, round_length(max(lengths))


def padded_tokens(lengths: list[int], row_multiple: int = 1) -> int:
    """Tokens of the batch `build_batch` makes of rows of these lengths, padding
    included."""
    if not lengths:
        return 0
    b, length = padded_shape(lengths, row_multiple)
    return b * length


def build_batch(
    items: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    advantages: list[float],
    pad_id: int,
    row_multiple: int = 1,
) -> Batch:
    """Right-pad (tokens, mask, logprobs) sequences into a bucketed Batch.

    Each item is three aligned 1-D arrays of one transcript. L rounds up to a multiple of
    32, B to a power of two and then to a multiple of `row_multiple` (the micro-batch
    size, the mesh's batch devices); padding rows and columns have mask 0 and advantage 0.
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
    b, length = padded_shape([len(t) for t, _, _ in items], row_multiple)
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
    return token_logprobs_and_entropy(params, spec, tokens, temperature)[0]


def token_logprobs_and_entropy(
    params: Params, spec: ModelSpec, tokens: jax.Array | np.ndarray, temperature: float
) -> tuple[jax.Array, jax.Array]:
    """`token_logprobs` [B, L] and, from the same forward pass, entropy [B, L] float32:
    entropy[:, t] = -sum_v p_v log p_v (nats) of the distribution token t was drawn from,
    p = softmax(logits[:, t-1] / temperature); entropy[:, 0] = 0. The entropy carries no
    gradient (a metric, `TrainStep`); under jit an unused one costs nothing."""
    logits = causal_logits(params, spec, tokens)[:, :-1]
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    frozen = jax.lax.stop_gradient(logp)
    entropy = -jnp.sum(jnp.exp(frozen) * frozen, axis=-1)
    pad = ((0, 0), (1, 0))
    return jnp.pad(picked, pad), jnp.pad(entropy, pad)


class TrainStep:
    """The jitted `(state, batch) -> (state, metrics)`; `compile_count` counts traces.

    metrics (float32 scalars): loss, grad_norm (before clipping), clip_fraction,
    ratio_mean, kl, entropy (nats per trained token, `token_logprobs_and_entropy`),
    learning_rate, num_tokens (mask sum), and the loss's other metrics
    (the behaviour-policy mismatch against the batch's rollout log-probs among them).
    When the loss, the gradient or the update is not finite, the returned state is the
    old one (its step not advanced).

    One per model, loss (`trainer_cfg.loss`), temperature and (optionally) trainer mesh.
    `max_tokens`: the constant length normaliser of dr_grpo (the rollout's response budget;
    required for that loss).
    """

    def __init__(
        self,
        spec: ModelSpec,
        trainer_cfg: TrainerConfig,
        temperature: float,
        optimizer: optax.GradientTransformation,
        mesh: Mesh | None = None,
        max_tokens: int = 0,
    ) -> None:
        if trainer_cfg.loss == "dr_grpo" and max_tokens <= 0:
            raise ValueError("loss dr_grpo needs max_tokens > 0: its constant length normaliser")
        self.spec = spec
        self.cfg = trainer_cfg
        self.lora = lora_config(trainer_cfg)
        self.max_tokens = max_tokens
        self.loss_fn = LOSSES[trainer_cfg.loss]
        self.temperature = temperature
        self.optimizer = optimizer
        self.schedule = learning_rate_schedule(trainer_cfg)
        self.mesh = mesh
        self.compile_count = 0
        # Donating the old state halves peak memory on accelerators; XLA:CPU cannot reuse
        # donated buffers and warns, so donate only off the CPU.
        donate = (0,) if jax.default_backend() != "cpu" else ()
        self._step = jax.jit(self._train_step, donate_argnums=donate)
        self._mesh_step: (
            Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]] | None
        ) = None

    @property
    def row_multiple(self) -> int:
        """Batch rows must be a multiple of this (micro-batch size, mesh batch devices)."""
        devices = 1 if self.mesh is None else self.mesh.shape[DATA] * self.mesh.shape[FSDP]
        micro = self.cfg.micro_batch_size or 1
        return int(np.lcm(devices, micro))

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        out: tuple[TrainState, dict[str, jax.Array]]
        if self.mesh is None:
            out = self._step(state, batch)
            return out
        if self._mesh_step is None:
            # The new state keeps the layout of the old (params, optimizer state fsdp-sharded);
            # metrics come back replicated.
            layout = jax.tree.map(lambda x: x.sharding, state)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._mesh_step = jax.jit(self._train_step, out_shardings=(layout, replicated))
        out = self._mesh_step(state, jax.device_put(batch, batch_sharding(self.mesh)))
        return out

    def _micro_loss(
        self,
        params: Params,
        frozen: tuple[Params | None, Params | None],
        mb: Batch,
        max_tokens: int,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        ref_params, base = frozen
        tokens = jnp.asarray(mb.tokens)
        if self.lora is not None:
            # Unmerged LoRA: gradients reach the adapters only, through A @ B.
            assert base is not None, "LoRA training needs TrainState.base_params"
            ref_params = base
            policy = apply_lora(base, params, self.lora)
        else:
            policy = params
        logp, entropy = token_logprobs_and_entropy(policy, self.spec, tokens, self.temperature)
        # The ratio's denominator: the rollout's log-probs, or this policy's own before the
        # update (no gradient through it; the ratio starts at 1).
        old = (
            jnp.asarray(mb.old_logp) if self.cfg.use_rollout_logps else jax.lax.stop_gradient(logp)
        )
        ref = None
        if self.cfg.kl_beta > 0:
            assert ref_params is not None, "kl_beta > 0 needs TrainState.ref_params"
            ref = jax.lax.stop_gradient(
                token_logprobs(ref_params, self.spec, tokens, self.temperature)
            )
        mask = jnp.asarray(mb.mask)
        loss, metrics = self.loss_fn(
            logp,
            old,
            jnp.asarray(mb.advantages),
            mask,
            loss_config(self.cfg, max_tokens),
            ref_logp=ref,
            behav_logp=jnp.asarray(mb.old_logp),  # the rollout's: the mismatch metrics
        )
        # the policy's mean entropy on the tokens it trains on (issue 32's sinks)
        mean_entropy = jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return loss, {**metrics, "entropy": mean_entropy}

    def _weights(self, mask: jax.Array) -> jax.Array:
        """Each micro-batch's share [M] of the loss's normaliser (mask [M, b, L]): its
        per-micro-batch mean loss times this sums to the whole batch's loss exactly."""
        if LOSS_AGGREGATION[self.cfg.loss] == "token":  # normalised by tokens
            count = jnp.sum(mask, axis=(1, 2))
        else:  # sequence, constant: normalised by the rows that have tokens
            count = jnp.sum(jnp.any(mask > 0, axis=2), axis=1).astype(jnp.float32)
        return count / jnp.maximum(jnp.sum(count), 1.0)

    def _train_step(
        self, state: TrainState, batch: Batch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        self.compile_count += 1  # runs once per trace, i.e. once per compiled bucket
        b = np.shape(batch.tokens)[0]
        micro = self.cfg.micro_batch_size or b
        if b % micro:
            raise ValueError(f"batch of {b} rows is not a multiple of micro_batch_size {micro}")
        m = b // micro
        mbs = jax.tree.map(
            lambda x: jnp.reshape(jnp.asarray(x), (m, micro, *np.shape(x)[1:])), batch
        )
        weights = self._weights(mbs.mask)
        frozen = (state.ref_params, state.base_params)
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

        def body(acc: PyTree, xs: tuple[Batch, jax.Array]) -> tuple[PyTree, None]:
            mb, w = xs
            (loss, metrics), grads = grad_fn(state.params, frozen, mb, self.max_tokens)
            grads_acc, loss_acc, metrics_acc = acc
            grads_acc = jax.tree.map(lambda a, g: a + w * g, grads_acc, grads)
            metrics_acc = {k: metrics_acc[k] + w * v for k, v in metrics.items()}
            return (grads_acc, loss_acc + w * loss, metrics_acc), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        metric_shapes = jax.eval_shape(
            lambda: grad_fn(
                state.params, frozen, jax.tree.map(lambda x: x[0], mbs), self.max_tokens
            )
        )[0][1]
        init = (zeros, jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, metric_shapes))
        (grads, loss, metrics), _ = jax.lax.scan(body, init, (mbs, weights))
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        # A loss, gradient or update that is not finite would poison the weights (the clip
        # turns an infinite gradient into NaN): the step keeps the old state, step count
        # included, and the caller sees why in the metrics. Selected here, under jit, so
        # the old state may be donated all the same.
        finite = (
            jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
        )

        def keep(new: PyTree, old: PyTree) -> PyTree:
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_state = state.replace(
            step=jnp.where(finite, state.step + 1, state.step),
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
        )
        metrics = {
            **metrics,
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": jnp.asarray(self.schedule(state.step), jnp.float32),
            "num_tokens": jnp.sum(jnp.asarray(batch.mask)),
        }
        return new_state, metrics
