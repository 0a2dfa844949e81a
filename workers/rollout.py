"""Rollout worker: runs episodes with the policy and writes trajectories."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from streamrl.chat import ChatFormat
from streamrl.model.decoder import init_params
from streamrl.model.generate import Generator, SamplingParams
from streamrl.model.weights import read_weights
from streamrl.rollout.episode import EpisodeRunner
from streamrl.rollout.server import ModelServer
from streamrl.rollout.weights import WeightFollower
from streamrl.rollout.worker import RolloutWorker
from streamrl.runtime import WorkerContext
from streamrl.tokenizer import CharTokenizer
from streamrl.tools.client import ToolClient
from streamrl.wire import Weights

MIN_BATCH = 8


async def _main(ctx: WorkerContext) -> None:
    cfg, r = ctx.cfg, ctx.cfg.rollout
    tok = CharTokenizer()
    chat = ChatFormat(tok)
    # The structure published weights are decoded into; the values come from the trainer.
    template = init_params(cfg.model, tok.vocab_size, cfg.run.seed)
    generator = Generator(
        cfg.model,
        tok.vocab_size,
        chat.stop_ids,
        tok.pad_id,
        r.max_turn_tokens,
        SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        # Fewer batch buckets, fewer compiles (~2.5 s each on a CPU); small batches pad up.
        min_batch=min(MIN_BATCH, r.max_batch_size),
    )
    server = ModelServer(generator, template, -1, r.max_batch_size, r.batch_wait_ms, ctx.log)
    aclient = aioredis.Redis.from_url(ctx.redis_url)

    def load(msg: Weights) -> object:
        return read_weights(msg.path, template, msg.sha256, msg.nbytes)

    follower = WeightFollower(aclient, ctx.keys, server, load, asyncio.Event(), ctx.log)
    worker = RolloutWorker(
        client=ctx.client(),
        aclient=aclient,
        keys=ctx.keys,
        cfg=cfg,
        consumer=ctx.consumer,
        server=server,
        runner=EpisodeRunner(server, tok, r, cfg.run.seed, ctx.worker_id, ctx.log),
        tools=ToolClient(ctx.client(), aclient, ctx.keys, cfg.tools, ctx.log),
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
            batches=server.batches,
            weight_syncs=follower.syncs,
            weights_refused=follower.refused,
        )
        await aclient.aclose()


def run(ctx: WorkerContext) -> int:
    asyncio.run(_main(ctx))
    return 0
