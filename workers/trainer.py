"""Trainer worker: consumes groups, trains, publishes weights, writes checkpoints, exports."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import orbax.checkpoint as ocp

from streamrl.evaluation import watch as evalrun
from streamrl.names import RunPaths
from streamrl.run.runtime import NONBLOCKING_TIMEOUT_S, WorkerContext
from streamrl.trainer.cluster import init_distributed
from streamrl.trainer.hooks import (
    CheckpointHook,
    EvalSnapshotHook,
    ExportHook,
    Hook,
    PublishHook,
    remove_partial_writes,
)
from streamrl.trainer.loop import TrainerLoop
from streamrl.trainer.publish import WeightPublisher
from streamrl.trainer.step import StepFn, TrainState, lora_config
from streamrl.weightsync import WEIGHTS_DIR, DirChannel, RedisChannel, WeightsChannel


def publish_hook(ctx: WorkerContext) -> PublishHook:
    """Weights published every `publish_every` steps through the configured channel."""
    t = ctx.cfg.trainer
    client = ctx.client()
    channel: WeightsChannel
    if t.weights_channel == "redis":
        channel = RedisChannel(client, ctx.keys, t.weights_chunk_mb << 20)
    else:
        channel = DirChannel(ctx.run_dir / WEIGHTS_DIR)
    publisher = WeightPublisher(
        client,
        ctx.keys,
        channel,
        ctx.log,
        t.weights_keep,
        checksum=t.weights_checksum,
        trim=t.trim_streams,
    )
    lora = lora_config(t)
    if t.publish == "lora" and lora is not None:
        return PublishHook(t.publish_every, publisher, adapters=lambda st: (st.params, lora))
    return PublishHook(t.publish_every, publisher)


@dataclass(frozen=True)
class Policy:
    """What the loop trains: its fresh state, its step, the batch padding id, and the
    hooks only a real model has (export)."""

    state: TrainState
    step: StepFn
    pad_id: int
    hooks: list[Hook]


def stub_policy(ctx: WorkerContext) -> Policy:
    """`model.kind = "stub"`: a step that sleeps, one small array as the params."""
    from streamrl.trainer.stub import STUB_PAD_ID, StubTrainStep, stub_state

    return Policy(stub_state(), StubTrainStep(ctx.cfg.model.stub_train_step_s), STUB_PAD_ID, [])


def transformer_policy(ctx: WorkerContext) -> Policy:
    """The JAX policy from its checkpoint (or warm start) and its jitted step."""
    from streamrl.model.policy import starting_policy
    from streamrl.trainer.step import TrainStep, init_state, make_optimizer, make_train_mesh

    cfg = ctx.cfg
    start = starting_policy(cfg, warm=True, info=ctx.log.info)
    ckpt, spec, params = start.source_dir, start.spec, start.params
    optimizer = make_optimizer(cfg.trainer)
    tcfg = cfg.trainer
    mesh = None
    if tcfg.mesh_data * tcfg.mesh_fsdp > 1:
        mesh = make_train_mesh(tcfg.mesh_data, tcfg.mesh_fsdp)
    step_fn = TrainStep(
        spec, tcfg, cfg.rollout.temperature, optimizer, mesh, cfg.rollout.max_response_length
    )
    state = init_state(
        params,
        optimizer,
        with_reference=tcfg.kl_beta > 0,
        mesh=mesh,
        lora=step_fn.lora,
        seed=cfg.run.seed,
    )
    export = ExportHook(
        cfg.trainer.export_every,
        RunPaths(ctx.run_dir).export,
        spec,
        ckpt,
        lora=step_fn.lora,
    )
    hooks: list[Hook] = [export]
    if cfg.trainer.eval_every:
        root = evalrun.eval_dir(ctx.run_dir)
        t = cfg.trainer
        hooks.append(EvalSnapshotHook(t.eval_every, root, spec, ckpt, step_fn.lora, t.eval_all))
    return Policy(state, step_fn, start.chat.pad_id, hooks)


def build_loop(
    ctx: WorkerContext, wrap_step: Callable[[StepFn], StepFn] | None = None
) -> tuple[TrainerLoop, ocp.StandardCheckpointer]:
    """The trainer's loop with its hooks, resumed from the run's newest complete checkpoint
    when there is one, and the checkpointer to close after it. `wrap_step`: what the loop
    calls instead of the policy's step (the colocated worker holds the engine around it)."""
    cfg = ctx.cfg
    init_distributed(cfg.trainer.num_processes, ctx.index)  # before JAX touches a device
    if cfg.trainer.num_processes > 1:
        ctx.log.info("trainer_process", index=ctx.index, count=cfg.trainer.num_processes)
    if ctx.index == 0:  # the leader: nothing of its own is being written yet
        remove_partial_writes(ctx.run_dir, ctx.log)
    publish = publish_hook(ctx)  # before the model loads: a bad setting fails at once
    policy = stub_policy(ctx) if cfg.model.kind == "stub" else transformer_policy(ctx)
    checkpointer = ocp.StandardCheckpointer()
    root = RunPaths(ctx.run_dir).checkpoints.resolve()
    loop = TrainerLoop(
        client=ctx.client(),
        keys=ctx.keys,
        cfg=cfg,
        state=policy.state,
        train_step=policy.step if wrap_step is None else wrap_step(policy.step),
        log=ctx.log,
        stop=ctx.stop.is_set,
        pad_id=policy.pad_id,
        max_steps=ctx.max_steps or cfg.trainer.max_steps,
        liveness=ctx.liveness,
        metrics=ctx.metrics,
        tracer=ctx.tracer,
        fence=functools.partial(ctx.holds_identity, ctx.client(NONBLOCKING_TIMEOUT_S)),
        hooks=[
            publish,
            CheckpointHook(
                cfg.trainer.checkpoint_every,
                root,
                cfg.trainer.keep_checkpoints,
                checkpointer,
                trim=cfg.trainer.trim_streams,
            ),
            *policy.hooks,
        ],
    )
    loop.resume(root, checkpointer)
    ctx.run_id = loop.run_id  # its heartbeat and fence compare it from now on
    ctx.metrics.probe(loop.probe)
    return loop, checkpointer


def run(ctx: WorkerContext) -> int:
    loop, manager = build_loop(ctx)
    try:
        loop.run()
    finally:
        manager.close()
    return 0
