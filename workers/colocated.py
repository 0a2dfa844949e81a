"""Colocated worker: one process alternates rollout and training on the same devices.

For a single accelerator host: rather than splitting its devices between a rollout worker
and a trainer, one process holds both, on the same streams as ever (tasks in,
trajectories out to the grouper, groups in, weights out). The rollout side runs its event
loop in the main thread; the trainer's loop runs in a thread beside it. When the trainer
has a step's groups, it holds the engine (decoding stops at the next chunk boundary),
trains, publishes, and releases it: the two phases alternate instead of competing for the
devices. The published version reaches the engine through the usual weight follower, so
every turn is still tagged with the version that produced it.

The process exits 0 when the trainer has done its steps (then the run is over), and with
the trainer's error if it fails.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from streamrl.run.runtime import WorkerContext
from streamrl_workers import rollout, trainer

if TYPE_CHECKING:
    from streamrl.rollout.episode import ModelServer
    from streamrl.trainer.step import Batch, StepFn, StepMetrics, TrainState


class _Phased:
    """The train step, run with the engine held: the phases alternate on the devices."""

    def __init__(self) -> None:
        self.step: StepFn | None = None
        self.server: ModelServer | None = None
        self.phases = 0

    def wrap(self, step: StepFn) -> _Phased:
        self.step = step
        return self

    @property
    def row_multiple(self) -> int:
        assert self.step is not None
        return self.step.row_multiple

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
        assert self.step is not None
        server = self.server
        if server is not None:
            server.hold()
        try:
            return self.step(state, batch)
        finally:
            self.phases += 1
            if server is not None:
                server.release()


def run(ctx: WorkerContext) -> int:
    phased = _Phased()
    loop, manager = trainer.build_loop(ctx, wrap_step=phased.wrap)
    failure: list[BaseException] = []

    def train() -> None:
        try:
            loop.run()
        except BaseException as err:  # re-raised in the main thread
            failure.append(err)
        finally:
            manager.close()
            ctx.stop.set()  # the rollout side stops with the trainer

    def attach(server: ModelServer) -> None:
        phased.server = server

    thread = threading.Thread(target=train, name="trainer", daemon=True)
    thread.start()
    try:
        asyncio.run(rollout.serve(ctx, on_server=attach))
    finally:
        ctx.stop.set()
        thread.join()
    ctx.log.info("colocated_stop", training_phases=phased.phases, step=loop.step)
    if failure:
        raise failure[0]
    return 0
