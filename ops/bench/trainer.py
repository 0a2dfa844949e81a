"""Trainer throughput against a bare forward, backward and AdamW step of the same model.

    .venv/bin/python ops/bench/trainer.py [--batch 16] [--length 256] [--repeats 7]

Model: the ~20 M parameter Qwen2-family model of ops/bench/decode.py, random weights. Batch:
`--batch` sequences of `--length` tokens, the second half of each "sampled" (mask 1), with
rollout log-probs and advantages. Measured side by side in one run (medians):

- bare:        jit(grad of the masked mean token log-prob) + optax.adamw, nothing else;
- trainer:     `TrainStep` as the trainer worker runs it, per loss (grpo, dapo, dr_grpo),
               with global-norm clipping and the LR schedule; and with 4 micro-batches;
               and with the KL penalty (kl_beta 0.1: one more forward, the reference's).

Tokens/s count every token of the batch (prompt and sampled). Ratio: trainer over bare.
Target of issue 5: at least 0.85.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from streamrl.config import TrainerConfig
from streamrl.model.llm import init_params
from streamrl.model.spec import ModelSpec
from streamrl.trainer.step import (
    TrainStep,
    build_batch,
    init_state,
    make_optimizer,
    standard_promotion,
    token_logprobs,
)

SPEC_CONFIG = {
    "model_type": "qwen2", "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 1024, "tie_word_embeddings": True,
}  # fmt: skip


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # compile and warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    spec = ModelSpec.from_config(SPEC_CONFIG)
    params = init_params(spec, 0)
    rng = np.random.default_rng(0)
    n = args.length
    items = [
        (
            rng.integers(1, spec.vocab_size, n).astype(np.int32),
            (np.arange(n) >= n // 2).astype(np.uint8),
            np.where(np.arange(n) >= n // 2, -8.3 + rng.normal(0, 0.05, n), 0.0),
        )
        for _ in range(args.batch)
    ]
    advantages = rng.normal(0, 1, args.batch).tolist()
    tokens = args.batch * n

    bare_tx = standard_promotion(optax.adamw(1e-5))

    def bare_loss(p: Any, toks: jax.Array, mask: jax.Array) -> jax.Array:
        logp = token_logprobs(p, spec, toks, 1.0)
        return -jnp.sum(logp * mask) / jnp.sum(mask)

    @jax.jit
    def bare_step(p: Any, opt: Any, toks: jax.Array, mask: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(bare_loss)(p, toks, mask)
        updates, opt = bare_tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt

    batch = build_batch(items, advantages, 0)
    toks, mask = jnp.asarray(batch.tokens), jnp.asarray(batch.mask)
    bare_state = (params, bare_tx.init(params))
    bare = median_time(lambda: bare_step(*bare_state, toks, mask), args.repeats)
    print(
        f"model {spec.num_params() / 1e6:.1f} M params; batch {args.batch} x {n} tokens; "
        f"jax {jax.__version__} on {jax.default_backend()}"
    )
    print(f"{'step':<26} {'ms':>8} {'tokens/s':>9} {'x bare':>7}")
    print(f"{'bare fwd+bwd+adamw':<26} {bare * 1e3:>8.1f} {tokens / bare:>9.0f} {1.0:>7.2f}")
    variants: list[tuple[str, TrainerConfig]] = [
        ("trainer grpo", TrainerConfig(loss="grpo")),
        ("trainer dapo", TrainerConfig(loss="dapo", clip_epsilon_high=0.28)),
        ("trainer dr_grpo", TrainerConfig(loss="dr_grpo")),
        ("trainer grpo 4 micro", TrainerConfig(loss="grpo", micro_batch_size=args.batch // 4)),
        ("trainer grpo kl 0.1", TrainerConfig(loss="grpo", kl_beta=0.1)),
    ]
    for name, cfg in variants:
        opt = make_optimizer(cfg)
        step = TrainStep(spec, cfg, 1.0, opt, max_tokens=n // 2)
        state = init_state(params, opt, with_reference=cfg.kl_beta > 0)
        b = build_batch(items, advantages, 0, step.row_multiple)
        t = median_time(functools.partial(step, state, b), args.repeats)
        print(f"{name:<26} {t * 1e3:>8.1f} {tokens / t:>9.0f} {bare / t:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
