"""The stub policy of the trainer side (`model.kind = "stub"`): no model, no optimizer.

The trainer loop runs as ever (groups batched `groups_per_step` at a time, versions
published, checkpoints with their queue snapshot, acknowledgement once a checkpoint is
durable, resume), but its step only sleeps `stub_train_step_s` and counts the step: the
parameters (one small array, so versions and checkpoints are real but cost nothing) stay
as they are. The rollout side's stub (`streamrl.rollout.stub`) serves whatever version
the trainer publishes.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from streamrl.trainer.step import Batch, StepMetrics, TrainState

__all__ = ["STUB_PAD_ID", "StubTrainStep", "stub_state"]

STUB_PAD_ID = 0  # batch padding; the stub's token ids are bytes, any id pads
STUB_PARAMS = 16  # float32 values of the stub's one parameter array


def stub_state() -> TrainState:
    """A fresh state: step 0, one zero array as the params, no optimizer state."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params={"stub": jnp.zeros((STUB_PARAMS,), jnp.float32)},
        opt_state=(),
    )


class StubTrainStep:
    """`(state, batch) -> (state, metrics)` that sleeps `step_s` seconds and advances the
    step count only. Metrics as the real step reports them: loss, grad_norm and
    clip_fraction 0, num_tokens the batch's mask sum (the policy's sampled tokens)."""

    row_multiple = 1  # batch rows need no multiple: nothing is split over devices

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
        time.sleep(self.step_s)
        metrics = {
            "loss": 0.0,
            "grad_norm": 0.0,
            "clip_fraction": 0.0,
            "num_tokens": float(np.sum(batch.mask)),
        }
        return state.replace(step=state.step + 1), metrics
