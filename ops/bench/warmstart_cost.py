"""What a warm-start step costs, per config (issue 27 item 7: the warm starts are most of
CI's CPU now): the share of real tokens in the padded demonstration batches, the step's
FLOPs (XLA's cost analysis) and its wall and CPU time, its forward alone for comparison.

    .venv/bin/python -m ops.bench.warmstart_cost configs/tiny.toml configs/code.toml

The step is the warm start's own (`streamrl.trainer.warmstart`): value and gradient of
`demonstration_loss`, then the AdamW update, jitted; timed on the longest batch of the
first `--batches` drawn (compiled first, then `--repeats` runs). The baseline is the step's
forward: the table gives the step's time as a multiple of it. Nothing is cached or written
except the built-in checkpoint in `--cache` (its config's `model.cache_dir`).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import jax

from streamrl.chat.hf import HFChat
from streamrl.config import load_config
from streamrl.model.checkpoint import load_checkpoint, policy_dtype
from streamrl.model.tiny import ensure_checkpoint
from streamrl.trainer import warmstart as ws
from streamrl_workers.cli import keep_torch_out


def _timed(fn: Callable[..., Any], *args: Any, repeats: int) -> tuple[float, float]:
    """Mean wall and CPU ms of `repeats` runs of a compiled `fn` (one run first)."""
    jax.block_until_ready(fn(*args))
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (
        (time.perf_counter() - wall) / repeats * 1e3,
        (time.process_time() - cpu) / repeats * 1e3,
    )


def measure(config: str, cache: str, batches: int, repeats: int) -> dict[str, Any]:
    cfg = load_config(config, [f'model.cache_dir="{cache}"'])
    ckpt = ensure_checkpoint(cfg)
    spec, params = load_checkpoint(ckpt, policy_dtype(cfg.model.dtype))
    chat = HFChat.for_model(ckpt, cfg.model)
    rng = random.Random(cfg.model_seed)
    drawn = [
        ws.demonstration_batch(cfg, chat, rng, cfg.model.warmstart_batch) for _ in range(batches)
    ]
    real = sum(int((t != chat.pad_id).sum()) for t, _ in drawn)
    padded = sum(t.size for t, _ in drawn)
    tokens, mask = max(drawn, key=lambda b: b[0].shape[1])
    optimizer, step = ws.demonstration_step(cfg, spec)
    forward = jax.jit(lambda p, t, m: ws.demonstration_loss(p, spec, t, m))
    opt_state = optimizer.init(params)
    cost = step.lower(params, opt_state, tokens, mask).compile().cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    step_wall, step_cpu = _timed(step, params, opt_state, tokens, mask, repeats=repeats)
    fwd_wall, fwd_cpu = _timed(forward, params, tokens, mask, repeats=repeats)
    return {
        "config": config,
        "batch": f"[{tokens.shape[0]},{tokens.shape[1]}]",
        "real": real / padded,
        "gflop": float(cost.get("flops", 0.0)) / 1e9,
        "step_wall": step_wall,
        "step_cpu": step_cpu,
        "fwd_wall": fwd_wall,
        "fwd_cpu": fwd_cpu,
        "steps": cfg.model.warmstart_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--cache", default="build/model-cache")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    keep_torch_out()
    print(
        "| config | longest batch | real tokens of padded | step GFLOP | step wall ms "
        "| step CPU ms | forward wall ms | step / forward (wall) | config's steps x step CPU, s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for config in args.configs:
        r = measure(config, args.cache, args.batches, args.repeats)
        print(
            f"| {r['config']} | {r['batch']} | {r['real']:.3f} | {r['gflop']:.2f} "
            f"| {r['step_wall']:.1f} | {r['step_cpu']:.1f} | {r['fwd_wall']:.1f} "
            f"| {r['step_wall'] / r['fwd_wall']:.1f}x | {r['steps'] * r['step_cpu'] / 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
