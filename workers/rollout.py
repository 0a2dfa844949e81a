"""Rollout worker: runs episodes with the policy and writes trajectories."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import jax.numpy as jnp

from streamrl.hfchat import HFChat
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.sampling import SamplingParams
from streamrl.model.sharding import make_mesh
from streamrl.model.tiny import ensure_checkpoint
from streamrl.rollout.engine_server import EngineServer
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.weights import SyncLock, WeightFollower, WeightLoader
from streamrl.rollout.worker import RolloutWorker
from streamrl.runtime import WorkerContext
from streamrl.tasks.registry import EpisodeContext, tool_limits
from streamrl.tools.client import ToolClient
from streamrl.transport import make_async_client


def build_engine(ctx: WorkerContext) -> tuple[HFChat, Engine]:
    cfg, r = ctx.cfg, ctx.cfg.rollout
    ckpt = ensure_checkpoint(cfg)
    chat = HFChat.for_model(ckpt, cfg.model)
    dtype = jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32
    # The checkpoint gives the structure published weights decode into; the values the
    # engine serves come from the trainer (version 0 onwards).
    spec, params = load_checkpoint(ckpt, dtype)
    engine_cfg = EngineConfig(
        num_slots=r.max_batch_size,
        kv_cache_size=r.kv_cache_size,
        max_prompt_length=r.kv_cache_size - 1,  # later turns: the whole conversation so far
        max_new_tokens=r.max_turn_tokens,
        sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        stop_ids=tuple(chat.stop_ids),
        pad_id=chat.pad_id,
        decode_chunk=r.decode_chunk,
    )
    mesh = make_mesh(r.mesh_data, r.mesh_tensor) if r.mesh_data * r.mesh_tensor > 1 else None
    return chat, Engine(spec, params, engine_cfg, dtype=dtype, mesh=mesh)


async def _main(ctx: WorkerContext) -> None:
    await serve(ctx)


async def serve(
    ctx: WorkerContext, on_server: Callable[[EngineServer], None] | None = None
) -> None:
    """Build the rollout worker and run it until stopped; `on_server` sees the engine
    server first (the colocated worker pauses it while it trains)."""
    cfg = ctx.cfg
    chat, engine = build_engine(ctx)
    server = EngineServer(engine, -1, ctx.log)
    if on_server is not None:
        on_server(server)
    aclient = make_async_client(ctx.redis_url)
    # The checkpoint's params: the structure versions decode into, and the base adapters
    # apply to until the trainer publishes a full version.
    loader = WeightLoader(
        ctx.client(), ctx.keys, engine.params, engine.params, cfg.rollout.lora_serving
    )
    follower = WeightFollower(
        aclient, ctx.keys, server, loader, SyncLock(), ctx.log, cfg.rollout.sync_mode
    )
    worker = RolloutWorker(
        client=ctx.client(),
        aclient=aclient,
        keys=ctx.keys,
        cfg=cfg,
        consumer=ctx.consumer,
        server=server,
        runner=EpisodeRunner(
            server, chat.dialogue, cfg.rollout, cfg.run.seed, ctx.worker_id, ctx.log
        ),
        episodes=EpisodeContext(
            caller=ToolClient(ctx.client(), aclient, ctx.keys, cfg.tools, ctx.log),
            limits=tool_limits(cfg.tools),
        ),
        follower=follower,
        log=ctx.log,
        stop=ctx.stop.is_set,
    )
    try:
        await worker.run()
    finally:
        ctx.log.info(
            "rollout_stop",
            episodes=worker.started,
            engine_steps=server.steps,
            tokens=engine.tokens_generated,
            weight_syncs=follower.syncs,
            weight_sync_s=round(follower.sync_s, 3),
            weight_stall_s=round(server.stall_s, 3),
            weights_refused=follower.refused,
        )
        await aclient.aclose()


def run(ctx: WorkerContext) -> int:
    asyncio.run(_main(ctx))
    return 0
