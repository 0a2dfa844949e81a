"""The built-in tasks by name: how the feeder makes a task, and how a rollout worker makes
the agent and environment of one of its episodes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Agent, Environment
from streamrl.agents.envs import ToolEnvironment, ToolLimits, ToolRecord
from streamrl.agents.flow import CircuitBreaker, RateLimiter
from streamrl.agents.tools import CallContext, FinishTool, SandboxTool, Tool, ToolCaller
from streamrl.config import TaskConfig, ToolsConfig
from streamrl.tasks import arithmetic, code
from streamrl.tools.registry import TOOLS
from streamrl.wire import Task


def make_task(cfg: TaskConfig, seed: int, cursor: int, num_generations: int) -> Task:
    """The task at a cursor of the configured data set (the same for ever)."""
    if cfg.name == "code":
        return code.make_task(cfg, seed, cursor, num_generations)
    return arithmetic.make_task(cfg, seed, cursor, num_generations)


@dataclass(frozen=True)
class Demonstration:
    """A scripted episode of a task, for the warm start: the tools listed in its prompt,
    the assistant's turns and the tool results between them (len(turns) - 1 of them)."""

    task: Task
    tools: list[dict[str, Any]]
    turns: list[str]
    tool_results: list[str]


def demonstration(
    cfg: TaskConfig, seed: int, cursor: int, rng: random.Random, error_rate: float
) -> Demonstration:
    """The scripted episode of the task at `cursor`; `rng` decides whether it errs."""
    task = make_task(cfg, seed, cursor, 2)
    if task.kind == code.KIND:
        d = code.demonstration(cfg, seed, task, rng, error_rate)
        tools = [TOOLS["python"].schema(), FinishTool().schema()]
        return Demonstration(task, tools, d.turns, d.tool_results)
    a = arithmetic.demonstration(task, rng, error_rate)
    return Demonstration(task, [TOOLS["calculator"].schema()], a.turns, a.tool_results)


@dataclass
class EpisodeContext:
    """What a rollout worker shares among its episodes' environments."""

    caller: ToolCaller
    limits: ToolLimits


def tool_limits(cfg: ToolsConfig) -> ToolLimits:
    """A rollout worker's tool limits from its configuration."""
    return ToolLimits(
        max_sandbox_calls=cfg.max_parallel_calls,
        max_external_calls=cfg.max_external_calls,
        rates={
            name: RateLimiter(rate, burst=max(1, int(rate)))
            for name, rate in cfg.rate_limits.items()
        },
        breaker=CircuitBreaker(cfg.max_consecutive_tool_errors),
    )


def sandbox_tool(name: str, caller: ToolCaller) -> SandboxTool:
    """The agent-side face of a worker-side tool (same schema)."""
    t = TOOLS[name]
    return SandboxTool(t.name, t.description, t.parameters, caller)


def make_episode(task: Task, ctx: EpisodeContext) -> tuple[Agent, Environment]:
    """A fresh agent and environment for one episode of `task`."""
    if task.kind == arithmetic.KIND:

        async def arith_score(answer: str | None, calls: list[ToolRecord], _: CallContext) -> float:
            outputs = [c.output.output for c in calls if c.name == "calculator" and c.output.ok]
            return arithmetic.reward(answer, outputs, task.answer)

        tools: list[Tool] = [sandbox_tool("calculator", ctx.caller)]
        return ToolAgent(), ToolEnvironment(task.prompt, tools, arith_score, ctx.limits)
    if task.kind == code.KIND:

        async def code_score(answer: str | None, _: list[ToolRecord], cc: CallContext) -> float:
            return await code.run_hidden_tests(ctx.caller, task, answer, cc)

        tools = [sandbox_tool("python", ctx.caller), FinishTool()]
        return ToolAgent(), ToolEnvironment(task.prompt, tools, code_score, ctx.limits)
    raise ValueError(f"no environment for task kind {task.kind!r}")
