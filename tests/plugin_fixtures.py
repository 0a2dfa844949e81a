"""Plug-ins for the tests, loaded by import path (`tests.plugin_fixtures:Name`) like a
user's: good ones, and ones that are broken in each way the plug-in loader and the rollout
worker must survive. Written against streamrl.api only."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from streamrl import api


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    greeting: str = Field("hello", description="Prompt prefix.")
    repeat: int = Field(1, ge=1, le=10, description="Times the greeting is said.")


class EchoEnvironment(api.Environment):
    """One step: the episode ends with the task's reward."""

    def __init__(self, ctx: api.EpisodeContext) -> None:
        self.ctx = ctx

    async def reset(self) -> api.Reset:
        return api.Reset(prompt=self.ctx.task.prompt)

    async def step(self, action: api.Action, call_prefix: str) -> api.StepResult:
        reward = await self.ctx.score(action.answer, [], api.CallContext(call_prefix))
        return api.StepResult(observations=[], done=True, reward=reward)


class EchoTask(api.TaskDef[EchoOptions]):
    Options = EchoOptions

    def prompt(self, index: int) -> api.Prompt:
        return api.Prompt(" ".join([self.options.greeting] * self.options.repeat) + f" {index}")

    def environment(self, ctx: api.EpisodeContext) -> api.Environment:
        return EchoEnvironment(ctx)

    def reward(self, answer: str | None, calls: list[api.ToolRecord], ctx: api.EpisodeContext):
        return float(ctx.member)  # rewards differ within a group


class TiedTask(EchoTask):
    """Every third prompt (index 0, 3, 6, ...) gives all its members reward 1.0: a group
    of equal rewards, which `grouper.zero_variance = "drop"` drops; the others' rewards
    differ within a group."""

    def reward(self, answer: str | None, calls: list[api.ToolRecord], ctx: api.EpisodeContext):
        index = int(ctx.task.prompt.rsplit(" ", 1)[-1])
        return 1.0 if index % 3 == 0 else float(ctx.member)


class RaisingEnvironment(EchoEnvironment):
    async def step(self, action: api.Action, call_prefix: str) -> api.StepResult:
        raise RuntimeError("environment exploded")


class FlakyTask(EchoTask):
    """Member 0's environment raises in `step`; member 1's reward is NaN, member 2's a
    string; the others score normally."""

    def environment(self, ctx: api.EpisodeContext) -> api.Environment:
        return RaisingEnvironment(ctx) if ctx.member == 0 else EchoEnvironment(ctx)

    def reward(self, answer: str | None, calls: list[api.ToolRecord], ctx: api.EpisodeContext):
        if ctx.member == 1:
            return math.nan
        if ctx.member == 2:
            return "high"
        return float(ctx.member)


async def async_reward(answer: str | None, calls: list[api.ToolRecord], ctx: api.EpisodeContext):
    return 0.5


def string_reward(answer: str | None, calls: list[api.ToolRecord], ctx: api.EpisodeContext):
    return "1.0"


EFFECTS_ENV = "STREAMRL_TEST_EFFECTS"  # file the RecordingEnvironment appends its steps to
RECORDING_STEPS = 4
RECORDING_STEP_S = 0.5


class RecordingEnvironment(api.Environment):
    """`RECORDING_STEPS` slow steps, each a side effect: a line `<pid> <group> <member>
    <step>` appended to the file named by $STREAMRL_TEST_EFFECTS. Resumable: it saves the
    steps made, so a resumed episode makes only the steps still to come."""

    def __init__(self, ctx: api.EpisodeContext) -> None:
        self.ctx = ctx
        self.steps = 0

    async def reset(self) -> api.Reset:
        return api.Reset(prompt=self.ctx.task.prompt)

    async def step(self, action: api.Action, call_prefix: str) -> api.StepResult:
        await asyncio.sleep(RECORDING_STEP_S)
        line = f"{os.getpid()} {self.ctx.task.group_id} {self.ctx.member} {self.steps}\n"
        with open(os.environ[EFFECTS_ENV], "a") as out:
            out.write(line)
        self.steps += 1
        if self.steps < RECORDING_STEPS:
            return api.StepResult(observations=[f"step {self.steps} done"], done=False)
        return api.StepResult(observations=[], done=True, reward=float(self.ctx.member))

    def save_state(self) -> dict[str, Any] | None:
        return {"steps": self.steps}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class NotATask:
    pass


NOT_CALLABLE = 42

UPPER = api.python_tool(
    name="upper",
    description="Upper-case a text.",
    parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": []},
    source="import json, sys\nprint(json.load(sys.stdin).get('text', '').upper())",
)

BAD_SCHEMA = api.python_tool(
    name="bad",
    description="A tool whose schema requires a property it does not declare.",
    parameters={"type": "object", "properties": {}, "required": ["text"]},
    source="print(1)",
)

UNTYPED = api.python_tool(
    name="untyped",
    description="A property without a JSON type.",
    parameters={"type": "object", "properties": {"x": {"description": "no type"}}},
    source="print(1)",
)
