"""Trainer worker: consumes groups, trains, publishes weights, writes checkpoints, exports."""

from __future__ import annotations

import jax.numpy as jnp
import orbax.checkpoint as ocp

from streamrl.hfchat import HFChat
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.spec import ModelSpec
from streamrl.model.tiny import ensure_checkpoint
from streamrl.runtime import WorkerContext
from streamrl.trainer.loop import CheckpointHook, ExportHook, PublishHook, TrainerLoop
from streamrl.trainer.step import init_state, make_optimizer, make_train_step
from streamrl.trainer.warmstart import warmstart_params


def run(ctx: WorkerContext) -> int:
    cfg = ctx.cfg
    ckpt = ensure_checkpoint(cfg)
    chat = HFChat.from_dir(ckpt)
    if cfg.model.init == "warmstart":
        spec, params = ModelSpec.from_dir(ckpt), warmstart_params(cfg, ctx.log.info)
    else:
        dtype = jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32
        spec, params = load_checkpoint(ckpt, dtype)
    optimizer = make_optimizer(cfg.trainer)
    step_fn = make_train_step(spec, cfg.trainer, cfg.rollout.temperature, optimizer)
    manager = ocp.CheckpointManager(
        (ctx.run_dir / "checkpoints").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.trainer.keep_checkpoints, create=True),
    )
    loop = TrainerLoop(
        client=ctx.client(),
        keys=ctx.keys,
        cfg=cfg,
        state=init_state(params, optimizer),
        train_step=step_fn,
        log=ctx.log,
        stop=ctx.stop.is_set,
        pad_id=chat.pad_id,
        max_steps=ctx.max_steps or cfg.trainer.max_steps,
        hooks=[
            PublishHook(cfg.trainer.publish_every, ctx.run_dir / "weights"),
            CheckpointHook(cfg.trainer.checkpoint_every, manager),
            ExportHook(cfg.trainer.export_every, ctx.run_dir / "export", spec, ckpt),
        ],
    )
    try:
        loop.run()
    finally:
        manager.close()
    return 0
