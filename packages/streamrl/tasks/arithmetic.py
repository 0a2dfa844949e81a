"""Built-in task: arithmetic questions that reward using the calculator tool.

Reward 1 when the episode called the calculator and its final answer equals both the true
result and a result the calculator returned; 0 otherwise. The data set is generated from the
run seed, so a cursor names one prompt for ever.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from streamrl.agents.base import Environment
from streamrl.agents.envs import ToolEnvironment, ToolRecord
from streamrl.agents.tools import CallContext, SandboxTool, Tool, ToolOutput
from streamrl.config import TaskConfig
from streamrl.jsontypes import JSONObject
from streamrl.tasks.base import (
    Demonstration,
    EpisodeContext,
    Prompt,
    TaskDef,
    build_task,
    lognormal_s,
)
from streamrl.tools.registry import CALCULATOR
from streamrl.wire import Task

KIND = "arithmetic"


def _rng(seed: int, index: int) -> random.Random:
    return random.Random(seed * 1_000_003 + index)


def expression(cfg: TaskConfig, seed: int, index: int) -> tuple[str, int]:
    """Question `index` and its value. Training takes indices below `num_prompts` (a
    cursor cycles over them); the held-out split (`streamrl.tasks.heldout`) those above."""
    r = _rng(seed, index)
    a = r.randint(0, cfg.max_operand)
    b = r.randint(0, cfg.max_operand)
    op = r.choice(cfg.operators)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a}{op}{b}", value


DemoError = Literal["answer", "no_tool"]


class ArithmeticOptions(BaseModel):
    """[task.options] of the arithmetic task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    demo_error: DemoError = Field(
        "answer",
        description=(
            "How the warm start's erring demonstrations (model.warmstart_error_rate of them) "
            "err: `answer` calls the calculator, then answers a nearby wrong number; "
            "`no_tool` gives up at once, a single turn `<answer>?</answer>` without a "
            "call. With `no_tool` the warm policy knows the whole procedure (sampling finds "
            "it) but prefers giving up (greedy rarely calls the tool): the gap RL closes."
        ),
    )
    tool_latency_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description=(
            "Extra seconds each calculator call takes, as the agent sees it (a slow tool, "
            "for measuring what asynchronous rollout overlaps; ops/bench/learning.py "
            "--tool-latency). With tool_latency_sigma > 0 it is the median of a lognormal."
        ),
    )
    tool_latency_sigma: float = Field(
        0.0, ge=0, le=5, description="Log-std of the calculator's extra latency; 0: fixed."
    )
    tool_latency_max_s: float = Field(
        60.0, gt=0, le=3600, description="Cap of one call's extra latency (the lognormal tail)."
    )

    def delay(self, rng: random.Random) -> float:
        """One calculator call's extra latency in seconds."""
        if self.tool_latency_sigma == 0:
            return self.tool_latency_s
        return lognormal_s(
            rng, self.tool_latency_s, self.tool_latency_sigma, self.tool_latency_max_s
        )


class ArithmeticTask(TaskDef[ArithmeticOptions]):
    """`a op b` questions (task.num_prompts, max_operand, operators); the calculator tool."""

    Options = ArithmeticOptions

    def prompt(self, index: int) -> Prompt:
        expr, value = expression(self.cfg, self.seed, index)
        return Prompt(f"Compute {expr} with the calculator.", str(value))

    def environment(self, ctx: EpisodeContext) -> Environment:
        calculator = ctx.sandbox_tool(CALCULATOR.name)
        tool: Tool = calculator
        if self.options.tool_latency_s > 0:
            tool = SlowTool(calculator, ctx, self.options)
        return ToolEnvironment(ctx.task.prompt, [tool], ctx.score, ctx.limits)

    def reward(self, answer: str | None, calls: list[ToolRecord], ctx: EpisodeContext) -> float:
        outputs = [c.output.output for c in calls if c.name == CALCULATOR.name and c.output.ok]
        return reward(answer, outputs, ctx.task.answer)

    def demonstration(self, task: Task, rng: random.Random, error_rate: float) -> Demonstration:
        d = demonstration(task, rng, error_rate, self.options.demo_error)
        return Demonstration(task, [CALCULATOR.schema()], d.turns, d.tool_results)


class SlowTool(Tool):
    """A sandbox tool whose every call first waits `options.delay` seconds (drawn from the
    episode's generator salted with the call id: a replayed call waits the same)."""

    def __init__(self, inner: SandboxTool, ctx: EpisodeContext, options: ArithmeticOptions):
        self.inner = inner
        self.ctx = ctx
        self.options = options
        self.name = inner.name
        self.description = inner.description
        self.parameters = inner.parameters
        self.kind = inner.kind

    async def apply_async(self, args: JSONObject, ctx: CallContext) -> ToolOutput:
        await asyncio.sleep(self.options.delay(self.ctx.rng("tool_latency", ctx.call_id)))
        return await self.inner.apply_async(args, ctx)


def make_task(cfg: TaskConfig, seed: int, cursor: int, num_generations: int) -> Task:
    prompt = ArithmeticTask(ArithmeticOptions(), cfg, seed).prompt(cursor % cfg.num_prompts)
    return build_task(KIND, prompt, cursor, num_generations)


def calculator_call(expr: str) -> str:
    """The assistant text of a well-formed calculator call."""
    body = json.dumps(
        {"name": "calculator", "arguments": {"expression": expr}}, separators=(",", ":")
    )
    return f"<tool_call>{body}</tool_call>"


def task_expression(task: Task) -> str:
    return task.prompt.removeprefix("Compute ").removesuffix(" with the calculator.")


@dataclass(frozen=True)
class Script:
    """Assistant turns and tool results of a scripted episode (for the warm start)."""

    turns: list[str]
    tool_results: list[str]


GIVE_UP = "<answer>?</answer>"


def demonstration(
    task: Task, rng: random.Random, error_rate: float, error: DemoError = "answer"
) -> Script:
    """Call the calculator, then answer with its result; a fraction `error_rate` errs as
    `error` says (ArithmeticOptions.demo_error)."""
    answer = task.answer
    if rng.random() < error_rate:
        if error == "no_tool":
            return Script(turns=[GIVE_UP], tool_results=[])
        answer = str(int(answer) + rng.choice([-10, -2, -1, 1, 2, 10]))
    return Script(
        turns=[calculator_call(task_expression(task)), f"<answer>{answer}</answer>"],
        tool_results=[task.answer],
    )


def reward(answer: str | None, tool_outputs: list[str], expected: str) -> float:
    """1.0 when the answer equals the true value and a calculator result; else 0.0."""
    if answer is None:
        return 0.0
    a = answer.strip()
    return 1.0 if a == expected and a in {o.strip() for o in tool_outputs} else 0.0
