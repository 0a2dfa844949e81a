"""Trainer worker: consumes groups, trains, publishes weights, writes checkpoints."""

from __future__ import annotations

import orbax.checkpoint as ocp

from streamrl.model.decoder import init_params
from streamrl.runtime import WorkerContext
from streamrl.tokenizer import CharTokenizer
from streamrl.trainer.loop import CheckpointHook, PublishHook, TrainerLoop
from streamrl.trainer.step import init_state, make_optimizer, make_train_step
from streamrl.trainer.warmstart import warmstart_params


def run(ctx: WorkerContext) -> int:
    cfg = ctx.cfg
    tok = CharTokenizer()
    if cfg.model.init == "warmstart":
        params = warmstart_params(cfg, ctx.log.info)
    else:
        params = init_params(cfg.model, tok.vocab_size, cfg.run.seed)
    optimizer = make_optimizer(cfg.trainer)
    step_fn = make_train_step(
        cfg.model, tok.vocab_size, cfg.trainer, cfg.rollout.temperature, optimizer
    )
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
        pad_id=tok.pad_id,
        max_steps=ctx.max_steps or cfg.trainer.max_steps,
        hooks=[
            PublishHook(cfg.trainer.publish_every, ctx.run_dir / "weights"),
            CheckpointHook(cfg.trainer.checkpoint_every, manager),
        ],
    )
    try:
        loop.run()
    finally:
        manager.close()
    return 0
