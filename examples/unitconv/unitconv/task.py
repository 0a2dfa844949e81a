"""The unit-conversion task: prompts, a multi-turn environment of its own, a reward and the
scripted episodes a warm start learns the tool's format from."""

from __future__ import annotations

import json
import random

from pydantic import BaseModel, ConfigDict, Field, field_validator

from streamrl import api
from unitconv.tools import CONVERT, UNITS, convert


class ConversionOptions(BaseModel):
    """[task.options] of a unitconv run (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_value: int = Field(99, ge=1, le=1_000_000, description="Largest quantity asked about.")
    units: list[str] = Field(
        default_factory=lambda: ["m", "cm", "mm"], min_length=2, description="Units used."
    )
    tolerance: float = Field(0.01, ge=0, description="Absolute error an answer may have.")

    @field_validator("units")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = sorted(set(v) - set(UNITS))
        if unknown:
            raise ValueError(f"unknown units {unknown}; units: {list(UNITS)}")
        return v


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class ConversionEnvironment(api.Environment):
    """Each turn the agent's `convert` calls run (through the tool workers) and their results
    come back; a turn with an `<answer>` or without a call ends the episode."""

    def __init__(self, ctx: api.EpisodeContext) -> None:
        self.ctx = ctx
        self.tool = ctx.sandbox_tool(CONVERT.name)
        self.records: list[api.ToolRecord] = []

    async def reset(self) -> api.Reset:
        return api.Reset(prompt=self.ctx.task.prompt, tools=[self.tool.schema()])

    async def step(self, action: api.Action, call_prefix: str) -> api.StepResult:
        if action.answer is not None or not action.calls:
            score_call = api.CallContext(f"{call_prefix}-score")
            reward = await self.ctx.score(action.answer, self.records, score_call)
            return api.StepResult(observations=[], done=True, reward=reward)
        results = []
        for i, call in enumerate(action.calls):
            out = await self._run(call, api.CallContext(f"{call_prefix}-{i}"))
            results.append(out.render())
        return api.StepResult(observations=results, done=False)

    async def _run(
        self, call: api.ToolCall | api.ToolCallError, cc: api.CallContext
    ) -> api.ToolOutput:
        if isinstance(call, api.ToolCallError):
            return api.ToolOutput(False, "", call.message)
        if call.name != self.tool.name:
            return api.ToolOutput(False, "", f"unknown tool `{call.name}`; use `convert`")
        try:
            args = api.parse_arguments(self.tool.parameters, call.arguments)
        except api.ToolArgumentError as err:
            return api.ToolOutput(False, "", str(err))
        self.num_tool_calls += 1
        out = await self.ctx.limits.run(self.tool, args, cc)  # ToolInfraError propagates
        self.records.append(api.ToolRecord(call.name, args, out))
        return out


class UnitConversion(api.TaskDef[ConversionOptions]):
    """ "Convert 37 km to m." The reward is 1 for an answer within `tolerance` of the truth
    after at least one successful `convert` call, else 0."""

    Options = ConversionOptions

    def prompt(self, index: int) -> api.Prompt:
        opts = self.options
        rng = random.Random(f"{self.seed}:{index}")
        value = rng.randint(1, opts.max_value)
        src, dst = rng.sample(opts.units, 2)
        return api.Prompt(
            f"Convert {value} {src} to {dst}.",
            answer=str(convert(value, src, dst)),
            data={"value": value, "from_unit": src, "to_unit": dst},
        )

    def environment(self, ctx: api.EpisodeContext) -> api.Environment:
        return ConversionEnvironment(ctx)

    def reward(
        self, answer: str | None, calls: list[api.ToolRecord], ctx: api.EpisodeContext
    ) -> float:
        got, want = _number(answer), float(ctx.task.answer)
        used_tool = any(c.output.ok for c in calls)
        ok = got is not None and abs(got - want) <= self.options.tolerance
        return 1.0 if ok and used_tool else 0.0

    def demonstration(
        self, task: api.Task, rng: random.Random, error_rate: float
    ) -> api.Demonstration:
        args = {k: task.data[k] for k in ("value", "from_unit", "to_unit")}
        body = json.dumps({"name": CONVERT.name, "arguments": args}, separators=(",", ":"))
        answer = task.answer
        if rng.random() < error_rate:
            answer = str(round(float(answer) + rng.choice([-10, -1, 1, 10]), 2))
        return api.Demonstration(
            task=task,
            tools=[CONVERT.schema()],
            turns=[f"<tool_call>{body}</tool_call>", f"<answer>{answer}</answer>"],
            tool_results=[task.answer],
        )
