"""Rollout worker: runs episodes with the policy and writes trajectories."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamrl.obs.metrics import ENGINE_BATCH_OCCUPANCY, TOKENS
from streamrl.plugins import PluginError
from streamrl.rollout.episode import EpisodeRunner, NewDialogue, Runner
from streamrl.rollout.weights import Load, SyncLock, WeightFollower
from streamrl.rollout.worker import RolloutWorker
from streamrl.run.runtime import WorkerContext
from streamrl.tasks.registry import Episodes, load_episodes
from streamrl.tools.client import ToolClient
from streamrl.transport import make_async_client
from streamrl.weightsync import WEIGHTS_DIR

if TYPE_CHECKING:
    from streamrl.chat.hf import HFChat
    from streamrl.endpoint.server import Endpoint
    from streamrl.model.engine import Engine
    from streamrl.rollout.episode import ModelServer


def build_engine(ctx: WorkerContext) -> tuple[HFChat, Engine]:
    # The model stack loads here: the stub policy needs no tokenizer and no checkpoint.
    from streamrl.model.engine import Engine
    from streamrl.model.policy import starting_policy
    from streamrl.model.sharding import make_mesh
    from streamrl.rollout.engine_server import engine_config

    r = ctx.cfg.rollout
    # The checkpoint gives the structure published weights decode into; the values the
    # engine serves come from the trainer (version 0 onwards).
    p = starting_policy(ctx.cfg, warm=False)
    engine_cfg = engine_config(r, tuple(p.chat.stop_ids), p.chat.pad_id)
    mesh = make_mesh(r.mesh_data, r.mesh_tensor) if r.mesh_data * r.mesh_tensor > 1 else None
    return p.chat, Engine(p.spec, p.params, engine_cfg, mesh=mesh)


@dataclass(frozen=True)
class Policy:
    """What serves the episodes' model calls: the server, how a published version loads
    into it, each episode's dialogue, and the tokens it has answered so far."""

    server: ModelServer
    load: Load
    dialogue: NewDialogue
    tokens: Callable[[], int]
    occupancy: Callable[[], float]  # busy batch slots over all (0..1)
    kv: Callable[[], dict[str, int]]  # the engine's prefill and KV-reuse counters
    chat: HFChat | None = None  # the model's chat (None: the stub policy has none)


def transformer_policy(ctx: WorkerContext) -> Policy:
    """The JAX engine behind the continuous-batching server."""
    from streamrl.rollout.engine_server import EngineServer
    from streamrl.rollout.loader import WeightLoader

    chat, engine = build_engine(ctx)
    # The checkpoint's params: the structure versions decode into, and the base adapters
    # apply to until the trainer publishes a full version.
    loader = WeightLoader(
        ctx.client(),
        ctx.keys,
        engine.params,
        engine.params,
        ctx.cfg.rollout.lora_serving,
        weights_dir=ctx.run_dir / WEIGHTS_DIR,
    )
    server = EngineServer(engine, -1, ctx.log)
    slots = engine.cfg.num_slots
    return Policy(
        server,
        loader,
        chat.dialogue,
        lambda: engine.tokens_generated,
        lambda: engine.active / slots,
        engine.kv_stats,
        chat,
    )


def stub_policy(ctx: WorkerContext) -> Policy:
    """`model.kind = "stub"`: answers after a fixed latency, no model, no tokenizer."""
    from streamrl.rollout.stub import StubDialogue, StubLoader, StubServer

    m = ctx.cfg.model
    stub = StubServer(m.stub_latency_s, m.stub_turn_tokens)
    loader = StubLoader(ctx.client(), ctx.keys, ctx.run_dir / WEIGHTS_DIR)
    slots = ctx.cfg.rollout.max_batch_size
    return Policy(
        stub,
        loader,
        StubDialogue,
        lambda: stub.tokens_generated,
        lambda: min(1.0, stub.in_flight / slots),
        dict,
    )


async def _main(ctx: WorkerContext) -> None:
    await serve(ctx)


async def _runner(
    ctx: WorkerContext, episodes: Episodes, policy: Policy
) -> tuple[Runner, Endpoint | None]:
    """The episodes' runner: the built-in one (an Agent on an Environment), or for
    `task.agent = "openai:..."` and `task.agent_command` the endpoint's (started here; the
    caller stops it)."""
    cfg = ctx.cfg
    if episodes.openai is None and not cfg.task.agent_command:
        runner = EpisodeRunner(policy.server, policy.dialogue, cfg.rollout, cfg.run.seed,
                               ctx.worker_id, ctx.log, tracer=ctx.tracer)  # fmt: skip
        return runner, None
    from streamrl.endpoint.agent import start_runner

    if policy.chat is None:
        which = (
            "task.agent_command" if cfg.task.agent_command else f"task.agent = {cfg.task.agent!r}"
        )
        raise PluginError(
            f"{which} needs the model's chat template: the stub policy (model.kind = stub) has none"
        )
    return await start_runner(cfg, policy.server, policy.chat, episodes, ctx.worker_id, ctx.log,
                              ctx.tracer)  # fmt: skip


def _log_stop(
    ctx: WorkerContext, worker: RolloutWorker, policy: Policy, follower: WeightFollower
) -> None:
    server = policy.server
    occupancy = server.occupancy()
    ctx.log.info(
        "rollout_stop",
        episodes=worker.started,
        engine_steps=server.steps,
        tokens=policy.tokens(),
        kv=policy.kv(),
        weight_syncs=follower.syncs,
        weight_sync_s=round(follower.sync_s, 3),
        weight_stall_s=round(server.stall_s, 3),
        weights_refused=follower.refused,
        weights_superseded=follower.superseded,
        episode_s_run=round(worker.active_s, 3),
        task_reads=worker.reads,
        tasks_read=worker.read_tasks,
        empty_reads=worker.empty_reads,
        paused_reads=worker.paused_reads,
        admission=worker.cfg.rollout.admission,
        admission_limit=worker.admission.limit,
        admission_grows=worker.admission.grows,
        admission_trims=worker.admission.trims,
        admission_ceiling=worker.admission.ceiling,
        # decode calls by rows: [calls, active rows, seconds] (admission's latency term)
        decode_costs={
            n: [c.calls, c.active, round(c.seconds, 3)]
            for n, c in (occupancy.costs if occupancy else {}).items()
            if c.calls
        },
    )


async def serve(ctx: WorkerContext, on_server: Callable[[ModelServer], None] | None = None) -> None:
    """Build the rollout worker and run it until stopped; `on_server` sees the engine
    server first (the colocated worker pauses it while it trains)."""
    cfg = ctx.cfg
    aclient = make_async_client(
        ctx.redis_url, cluster=cfg.redis.cluster, busy_wait_s=cfg.redis.busy_wait_s
    )
    # The task's parts first: a plug-in that does not load fails before the model does.
    tools = ToolClient(
        ctx.client(), aclient, ctx.keys, cfg.tools, ctx.log, metrics=ctx.metrics, tracer=ctx.tracer
    )
    episodes = load_episodes(cfg, tools)
    policy = stub_policy(ctx) if cfg.model.kind == "stub" else transformer_policy(ctx)
    server = policy.server
    if on_server is not None:
        on_server(server)
    follower = WeightFollower(
        aclient,
        ctx.keys,
        server,
        policy.load,
        SyncLock(ctx.tracer),
        ctx.log,
        cfg.rollout.sync_mode,
        tracer=ctx.tracer,
    )
    runner, endpoint = await _runner(ctx, episodes, policy)
    worker = RolloutWorker(
        client=ctx.client(),
        aclient=aclient,
        keys=ctx.keys,
        cfg=cfg,
        consumer=ctx.consumer,
        server=server,
        runner=runner,
        episodes=episodes,
        follower=follower,
        log=ctx.log,
        stop=ctx.stop.is_set,
        liveness=ctx.liveness,
        metrics=ctx.metrics,
        tracer=ctx.tracer,
    )
    ctx.metrics.count_from(TOKENS, policy.tokens)
    ctx.metrics.probe(worker.probe)
    ctx.metrics.probe(lambda: {ENGINE_BATCH_OCCUPANCY: policy.occupancy()})
    try:
        await worker.run()
    finally:
        _log_stop(ctx, worker, policy, follower)
        if endpoint is not None:
            await endpoint.stop()
        await aclient.aclose()


def run(ctx: WorkerContext) -> int:
    asyncio.run(_main(ctx))
    return 0
