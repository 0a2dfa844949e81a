"""Built-in task for measurement: an environment whose steps take a configured time.

Each episode takes `turns` environment steps; the last one ends it with a seeded random
reward (so groups have reward variance). A step's latency is drawn from the configured
distribution with a generator seeded by the run seed, the group, the member and the step,
so a run is repeatable and a replayed episode waits the same. A step either awaits
(`blocking = false`: a tool that yields, like a sandbox call) or blocks a thread
(`blocking = true`: a synchronous tool, run on the event loop's default executor).
With `latency = "tool"` each step is instead a real call of the tool `tool` (default the
`shell` tool running `tool_args`' `echo ok`) through the run's tool workers and their
sandboxes: the step takes what the call takes (ops/bench/stragglers.py `--tools`).

Pair it with the stub policy (`model.kind = "stub"`) and a whole `streamrl up` runs at the
speed of Redis and the orchestration alone (ops/bench/). `rollout.max_steps` must be at
least `turns`, or every episode ends truncated.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl.agents.base import Action, Environment, Reset, StepResult
from streamrl.agents.envs import ToolRecord
from streamrl.agents.tools import CallContext
from streamrl.jsontypes import JSONObject
from streamrl.tasks.base import EpisodeContext, Prompt, TaskDef, lognormal_s

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


class SyntheticOptions(BaseModel):
    """[task.options] of the synthetic task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    turns: int = Field(2, ge=1, le=10_000, description="Environment steps per episode.")
    latency: Literal["fixed", "mixture", "lognormal", "tool"] = Field(
        "fixed",
        description=(
            "Step latency: `fixed` (latency_s), `mixture` (one of `mixture`'s latencies by "
            "its probability), `lognormal` (median latency_s, log-std sigma, capped), `tool` "
            "(each step a real call of `tool` with `tool_args` through the tool workers)."
        ),
    )
    tool: str = Field("shell", min_length=1, description="The tool a `tool` step calls.")
    tool_args: dict[str, Any] = Field(
        default_factory=lambda: {"command": "echo ok"},
        description="The arguments of each `tool` step's call.",
    )
    latency_s: float = Field(0.05, ge=0, le=3600, description="Fixed latency; lognormal median.")
    mixture: list[tuple[float, float]] = Field(
        default_factory=lambda: [(0.9, 0.05), (0.1, 1.0)],
        description="(probability, seconds) pairs of latency `mixture`; probabilities sum to 1.",
    )
    sigma: float = Field(1.0, gt=0, le=10, description="Log-std of latency `lognormal`.")
    max_latency_s: float = Field(
        60.0, ge=0, le=3600, description="Cap of one step's latency (the lognormal tail)."
    )
    blocking: bool = Field(
        False, description="Block a thread for the latency (a synchronous tool) instead."
    )
    prompt_words: int = Field(8, ge=1, le=100_000, description="Words of each prompt.")

    @model_validator(mode="after")
    def _mixture(self) -> SyntheticOptions:
        if not self.mixture:
            raise ValueError("mixture needs at least one (probability, seconds) pair")
        for p, s in self.mixture:
            if not (0 <= p <= 1 and 0 <= s <= 3600):
                raise ValueError(f"mixture pair ({p}, {s}): probability in [0, 1], seconds >= 0")
        total = sum(p for p, _ in self.mixture)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"mixture probabilities sum to {total:g}, not 1")
        return self

    def draw(self, rng: random.Random) -> float:
        """One step's latency in seconds (0 for `tool`: the call takes what it takes)."""
        if self.latency == "tool":
            return 0.0
        if self.latency == "fixed":
            return self.latency_s
        if self.latency == "mixture":
            u, acc = rng.random(), 0.0
            for p, s in self.mixture:
                acc += p
                if u < acc:
                    return s
            return self.mixture[-1][1]
        return lognormal_s(rng, self.latency_s, self.sigma, self.max_latency_s)


class SyntheticEnvironment(Environment):
    """`turns` steps of a drawn latency; the last ends the episode with the reward."""

    def __init__(self, ctx: EpisodeContext, options: SyntheticOptions) -> None:
        self.ctx = ctx
        self.options = options
        self.steps = 0

    async def reset(self) -> Reset:
        return Reset(prompt=self.ctx.task.prompt)

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        if self.options.latency == "tool":
            return await self._tool_step(action, call_prefix)
        seconds = self.options.draw(self.ctx.rng("latency", self.steps))
        self.steps += 1
        if self.options.blocking:
            await asyncio.to_thread(time.sleep, seconds)
        elif seconds > 0:
            await asyncio.sleep(seconds)
        if self.steps < self.options.turns:
            return StepResult(observations=[f"step {self.steps} done"], done=False)
        reward = await self.ctx.score(action.answer, [], CallContext(f"{call_prefix}-score"))
        return StepResult(observations=[], done=True, reward=reward)

    async def _tool_step(self, action: Action, call_prefix: str) -> StepResult:
        """One real tool call (its id derived from the step, so a replayed step is the same
        call); a failed call is an observation, an infrastructure failure ends the episode
        as one (`ToolInfraError`)."""
        tool = self.ctx.sandbox_tool(self.options.tool)
        out = await tool.apply_async(
            self.options.tool_args, CallContext(f"{call_prefix}-step{self.steps}")
        )
        self.steps += 1
        if self.steps < self.options.turns:
            seen = out.output if out.ok else f"error: {out.error}"
            return StepResult(observations=[seen], done=False)
        reward = await self.ctx.score(action.answer, [], CallContext(f"{call_prefix}-score"))
        return StepResult(observations=[], done=True, reward=reward)

    def save_state(self) -> JSONObject | None:
        return {"steps": self.steps}

    def restore_state(self, state: JSONObject) -> None:
        steps = state["steps"]
        if not isinstance(steps, int | float | str):
            raise TypeError(f"a saved step count {steps!r}: not a number")
        self.steps = int(steps)


class SyntheticTask(TaskDef[SyntheticOptions]):
    """Prompts of `prompt_words` words; SyntheticEnvironment episodes; random rewards."""

    Options = SyntheticOptions

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:prompt:{index}")
        n = self.options.prompt_words
        return Prompt(" ".join(rng.choice(WORDS) for _ in range(n)), answer="")

    def environment(self, ctx: EpisodeContext) -> Environment:
        return SyntheticEnvironment(ctx, self.options)

    def reward(self, answer: str | None, calls: list[ToolRecord], ctx: EpisodeContext) -> float:
        return ctx.rng("reward").random()
