"""What a task is to streamrl: where its prompts come from and how one episode is played.

Subclass `TaskDef` (exported by `streamrl.api`) for a task of your own:

    class WordGame(TaskDef):
        Options = WordGameOptions               # validates [task.options]

        def prompt(self, index: int) -> Prompt:  # generated prompts (or set task.dataset)
            ...
        def environment(self, ctx: EpisodeContext) -> Environment:
            return ToolEnvironment(ctx.task.prompt, [ctx.sandbox_tool("lookup")], ctx.score,
                                   ctx.limits)
        def reward(self, answer, calls, ctx) -> float:
            ...

The feeder and the grouper (a re-run rebuilds its task from the cursor) build prompts; only
the rollout worker builds environments and agents and scores episodes. A reward is
`reward(answer, calls, ctx) -> float` (or a coroutine); `ctx.score` is the configured one,
checked: anything but a finite number makes that episode an error, counted, and the worker
goes on.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from streamrl.agents.agents import ToolAgent
from streamrl.agents.base import Agent, Environment
from streamrl.agents.envs import ToolLimits, ToolRecord
from streamrl.agents.tools import CallContext, SandboxTool, ToolCaller
from streamrl.config import TaskConfig
from streamrl.jsontypes import JSONObject
from streamrl.wire import Task


class NoOptions(BaseModel):
    """A task without options: [task.options] must be empty."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RewardError(RuntimeError):
    """A reward that did not give a finite number; the episode ends with status error."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task: the user message, the reference answer (may be empty) and any
    further fields of its data row (`Task.data`; JSON-like values)."""

    text: str
    answer: str = ""
    data: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Demonstration:
    """A scripted episode of a task, for the warm start: the tools listed in its prompt,
    the assistant's turns and the tool results between them (len(turns) - 1 of them)."""

    task: Task
    tools: list[JSONObject]
    turns: list[str]
    tool_results: list[str]


def build_task(kind: str, prompt: Prompt, cursor: int, num_generations: int) -> Task:
    """The task of `prompt` at `cursor`. Ids derive from the cursor: a re-sent task lands in
    the same group."""
    return Task(
        task_id=f"t{cursor:09d}",
        group_id=f"g{cursor:09d}",
        kind=kind,
        prompt=prompt.text,
        answer=prompt.answer,
        data=prompt.data,
        num_generations=num_generations,
        cursor=cursor,
    )


def group_cursor(group_id: str) -> int | None:
    """The data-set cursor a group id of `build_task` was made from (None: not one of
    them). Groups are numbered by the feeder's cursor, so their ids are ordered by it."""
    digits = group_id[1:]
    return int(digits) if group_id[:1] == "g" and digits.isdigit() else None


# reward(answer, calls, ctx) -> float, or a coroutine function returning one.
Reward = Callable[[str | None, list[ToolRecord], "EpisodeContext"], float | Awaitable[float]]


def lognormal_s(rng: random.Random, median_s: float, sigma: float, cap_s: float) -> float:
    """A latency in seconds: lognormal with this median and log-std, at most cap_s (the
    synthetic task's steps and the arithmetic task's slow calculator draw alike)."""
    if median_s == 0:
        return 0.0
    return min(cap_s, median_s * math.exp(sigma * rng.gauss()))


@dataclass
class EpisodeServices:
    """What a rollout worker shares among its episodes: the tool workers' client, the tool
    limits, the worker-side tools' schemas (built-in and tools.extra) by name, the run seed,
    the task's validated options and the configured reward."""

    caller: ToolCaller
    limits: ToolLimits
    tool_schemas: dict[str, JSONObject]
    seed: int = 0
    options: BaseModel = field(default_factory=NoOptions)
    reward: Reward | None = None


@dataclass(frozen=True)
class EpisodeContext:
    """One episode: its task and member index, the run seed, the task's options, and the
    worker's tools and reward."""

    task: Task
    member: int
    services: EpisodeServices

    @property
    def traj_id(self) -> str:
        """The episode's trajectory id: stable when the episode is replayed (derive the
        ids of calls a reward makes itself from it)."""
        return f"{self.task.group_id}-m{self.member}"

    @property
    def seed(self) -> int:
        return self.services.seed

    @property
    def options(self) -> Any:
        """The task's options, an instance of its `Options` model."""
        return self.services.options

    @property
    def limits(self) -> ToolLimits:
        return self.services.limits

    @property
    def caller(self) -> ToolCaller:
        return self.services.caller

    def rng(self, *salt: object) -> random.Random:
        """A generator seeded by the run seed, the group, the member and `salt`: the same
        when the episode is replayed."""
        return random.Random(f"{self.seed}:{self.task.group_id}:{self.member}:{salt}")

    def sandbox_tool(self, name: str) -> SandboxTool:
        """The agent-side face of a tool the tool workers run (built-in or tools.extra)."""
        schema = self.services.tool_schemas.get(name)
        if schema is None:
            raise KeyError(f"no tool `{name}`; tools: {sorted(self.services.tool_schemas)}")
        fn = schema["function"]
        if not isinstance(fn, dict):
            raise TypeError(f"tool `{name}`: a schema without a function: {schema!r}")
        called, description, parameters = fn["name"], fn["description"], fn["parameters"]
        if not (
            isinstance(called, str)
            and isinstance(description, str)
            and isinstance(parameters, dict)
        ):
            raise TypeError(f"tool `{name}`: not a function schema: {fn!r}")
        return SandboxTool(called, description, parameters, self.caller)

    async def score(self, answer: str | None, calls: list[ToolRecord], _: CallContext) -> float:
        """The configured reward of the episode's end (a `Scorer` for the built-in
        environments), checked to be a finite number."""
        reward = self.services.reward
        if reward is None:
            raise RewardError("no reward is configured")
        value = reward(answer, calls, self)
        if inspect.isawaitable(value):
            value = await value
        return checked_reward(value)


def checked_reward(value: object) -> float:
    """`value` as a float, or RewardError when it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"reward returned {type(value).__name__} {value!r}, not a number")
    if not math.isfinite(value):
        raise RewardError(f"reward returned {value!r}, not a finite number")
    return float(value)


OptionsT = TypeVar("OptionsT", bound=BaseModel)


class TaskDef(Generic[OptionsT]):
    """A task: prompts plus the environment, agent and reward of its episodes.

    `Options` is a pydantic model of the task's settings ([task.options]; forbid extra keys
    to catch typos); name it as the type parameter too (`class T(TaskDef[MyOptions])`) and
    `self.options` is typed. `__init__` receives the options validated, the task config and
    the run seed.
    """

    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: OptionsT, cfg: TaskConfig, seed: int) -> None:
        self.options = options
        self.cfg = cfg
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        """The generated prompt `index` (0 <= index < task.num_prompts); the same for ever."""
        raise NotImplementedError(
            f"task {type(self).__name__} generates no prompts: set task.dataset, or "
            "override TaskDef.prompt"
        )

    def from_row(self, row: dict[str, object]) -> Prompt:
        """The prompt of a dataset row: `task.prompt_field` (required), `task.answer_field`
        (optional) and the whole row as data."""
        return Prompt(
            text=str(row[self.cfg.prompt_field]),
            answer=str(row.get(self.cfg.answer_field, "")) if self.cfg.answer_field else "",
            data=row,
        )

    def environment(self, ctx: EpisodeContext) -> Environment:
        """A fresh environment for one episode."""
        raise NotImplementedError(f"task {type(self).__name__} defines no environment")

    def agent(self, ctx: EpisodeContext) -> Agent:
        """A fresh agent for one episode (default: tool calls and `<answer>` parsed)."""
        return ToolAgent()

    def reward(
        self, answer: str | None, calls: list[ToolRecord], ctx: EpisodeContext
    ) -> float | Awaitable[float]:
        """Default: 1.0 when the answer equals the task's reference answer, else 0.0."""
        return 1.0 if answer is not None and answer.strip() == ctx.task.answer.strip() else 0.0

    def demonstration(self, task: Task, rng: random.Random, error_rate: float) -> Demonstration:
        """A scripted episode for the warm start (`model.init = "warmstart"`)."""
        raise NotImplementedError(
            f"task {type(self).__name__} has no demonstrations for a warm start: use "
            'model.init = "checkpoint"'
        )
