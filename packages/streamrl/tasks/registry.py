"""Tasks by name or import path: how the feeder (and a grouper's re-run) makes the task at a
cursor, and how a rollout worker makes the agent and environment of one episode.

`task.name` is a built-in name (`BUILTIN_TASKS`), a name an installed package registers in
the `streamrl.tasks` entry-point group, or `package.module:Name` of a `TaskDef` subclass;
`task.environment`, `task.agent` and `task.reward` replace the task's own parts. Everything
is loaded and checked at start (`check_plugins`): a path that does not import, options that
do not validate or a part of the wrong type is a config error that names the field.
"""

from __future__ import annotations

import functools
import inspect
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from streamrl.agents.agents import ModelAgent, ToolAgent
from streamrl.agents.base import Agent, Environment
from streamrl.agents.envs import ToolLimits
from streamrl.agents.flow import CircuitBreaker, RateLimiter
from streamrl.agents.tools import ToolCaller
from streamrl.config import OPENAI_AGENT, Config, TaskConfig, ToolsConfig
from streamrl.plugins import TASKS_GROUP, PluginError, load_object, resolve_ref, validate_options
from streamrl.tasks.base import (
    Demonstration,
    EpisodeContext,
    EpisodeServices,
    Prompt,
    Reward,
    TaskDef,
    build_task,
)
from streamrl.tasks.data import DataSource, open_rows
from streamrl.wire import Task

BUILTIN_TASKS = {
    "arithmetic": "streamrl.tasks.arithmetic:ArithmeticTask",
    "code": "streamrl.tasks.code:CodeTask",
    "synthetic": "streamrl.tasks.synthetic:SyntheticTask",
}

EnvironmentFactory = Callable[[EpisodeContext], Environment]
AgentFactory = Callable[[EpisodeContext], Agent]

BUILTIN_AGENTS: dict[str, AgentFactory] = {
    "tool": lambda _ctx: ToolAgent(),
    "model": lambda _ctx: ModelAgent(),
}


def load_taskdef(cfg: TaskConfig, seed: int) -> TaskDef:
    """The task `task.name` names, built with its validated `[task.options]`."""
    ref = resolve_ref(cfg.name, "task.name", BUILTIN_TASKS, TASKS_GROUP)
    cls = load_object(ref, "task.name")
    if not (inspect.isclass(cls) and issubclass(cls, TaskDef)):
        raise PluginError(
            f"field `task.name`: `{ref}` is {_what(cls)}, not a subclass of streamrl.api.TaskDef"
        )
    options = validate_options(cls.Options, cfg.options, "task.options")
    return cls(options, cfg, seed)


class TaskSource:
    """The task at each cursor: a generated prompt, or a dataset row (`task.dataset`)."""

    def __init__(self, cfg: TaskConfig, seed: int) -> None:
        self.cfg = cfg
        self.taskdef = load_taskdef(cfg, seed)
        self.data = (
            DataSource(open_rows(cfg), seed, cfg.shuffle, cfg.epochs) if cfg.dataset else None
        )

    @property
    def end(self) -> int | None:
        """The first cursor with no task (after `task.epochs` passes over the dataset, or
        over the `num_prompts` generated prompts), or None (`task.epochs = 0`)."""
        if self.data is not None:
            return self.data.end
        return self.cfg.epochs * self.cfg.num_prompts if self.cfg.epochs else None

    def prompt(self, cursor: int) -> Prompt:
        """The prompt at `cursor` (the same for ever)."""
        if self.data is not None:
            return self.taskdef.from_row(self.data.row(cursor))
        return self.taskdef.prompt(cursor % self.cfg.num_prompts)

    def task(self, cursor: int, num_generations: int) -> Task:
        """The task at `cursor` (the same for ever), labelled as the task is reported."""
        return build_task(self.cfg.label, self.prompt(cursor), cursor, num_generations)


@functools.lru_cache(maxsize=8)
def _cached_source(cfg_json: str, seed: int) -> TaskSource:
    return TaskSource(TaskConfig.model_validate_json(cfg_json), seed)


def task_source(cfg: TaskConfig, seed: int) -> TaskSource:
    """A TaskSource shared by the callers in this process with the same config."""
    return _cached_source(cfg.model_dump_json(), seed)


def make_task(cfg: TaskConfig, seed: int, cursor: int, num_generations: int) -> Task:
    """The task at a cursor of the configured data set (the same for ever)."""
    return task_source(cfg, seed).task(cursor, num_generations)


def demonstration(
    cfg: TaskConfig, seed: int, cursor: int, rng: random.Random, error_rate: float
) -> Demonstration:
    """The scripted episode of the task at `cursor`; `rng` decides whether it errs."""
    source = task_source(cfg, seed)
    return source.taskdef.demonstration(source.task(cursor, 2), rng, error_rate)


def tool_limits(cfg: ToolsConfig) -> ToolLimits:
    """A rollout worker's tool limits from its configuration."""
    return ToolLimits(
        max_sandbox_calls=cfg.max_parallel_calls,
        max_external_calls=cfg.max_external_calls,
        rates={
            name: RateLimiter(rate, burst=max(1, int(rate)))
            for name, rate in cfg.rate_limits.items()
        },
        breaker=CircuitBreaker(cfg.breaker_window_s, cfg.breaker_error_rate, cfg.breaker_min_calls),
    )


@dataclass(frozen=True)
class TaskEpisodes:
    """One task's episode factory: its (or the configured) environment, agent and reward,
    and what the episodes share."""

    environment: EnvironmentFactory
    agent: AgentFactory
    services: EpisodeServices

    def context(self, task: Task, member: int) -> EpisodeContext:
        return EpisodeContext(task, member, self.services)

    def make(self, task: Task, member: int) -> tuple[Agent, Environment]:
        """A fresh agent and environment for one episode of `task`."""
        ctx = self.context(task, member)
        return self.agent(ctx), self.environment(ctx)


@dataclass(frozen=True)
class Episodes:
    """A rollout worker's episode factory: each task of the run's mixture (by the label its
    tasks carry as `Task.kind`) with its parts."""

    tasks: Mapping[str, TaskEpisodes]
    # `task.agent = "openai:module:main"`: the agent's async function (its episodes are
    # played through the OpenAI-compatible endpoint, streamrl.endpoint.agent), else None
    openai: Callable[..., Awaitable[object]] | None = None

    def of(self, task: Task) -> TaskEpisodes:
        """The parts of `task`'s task. A run of one task plays every task with its parts
        (whatever label it carries); a mixture's task of no label of the mixture is an
        error (its episode ends `error`)."""
        parts = self.tasks.get(task.kind)
        if parts is not None:
            return parts
        if len(self.tasks) == 1:
            return next(iter(self.tasks.values()))
        raise PluginError(
            f"task {task.task_id} is of task {task.kind!r}, not one of the mixture's "
            f"{sorted(self.tasks)}"
        )

    def context(self, task: Task, member: int) -> EpisodeContext:
        return self.of(task).context(task, member)

    def make(self, task: Task, member: int) -> tuple[Agent, Environment]:
        """A fresh agent and environment for one episode of `task`."""
        return self.of(task).make(task, member)


def _part(ref: str, field: str, builtin: Mapping[str, object] | None = None) -> Any:
    obj = builtin[ref] if builtin and ref in builtin else load_object(ref, field)
    if not callable(obj):
        raise PluginError(f"field `{field}`: `{ref}` is {_what(obj)}, not callable")
    return obj


def load_episodes(cfg: Config, caller: ToolCaller, limits: ToolLimits | None = None) -> Episodes:
    """Every part of every task's episodes, loaded and checked (what the rollout worker
    runs). The tasks share the tool caller, the limits and the tools."""
    from streamrl.tools.registry import load_tools

    shared_limits = limits if limits is not None else tool_limits(cfg.tools)
    schemas = {name: tool.schema() for name, tool in load_tools(cfg.tools).items()}
    where = "task" if len(cfg.mixture) == 1 else "tasks[{}]"
    parts: dict[str, TaskEpisodes] = {}
    openai = None
    for i, t in enumerate(cfg.mixture):
        field = where.format(i)
        taskdef = task_source(t, cfg.run.seed).taskdef
        environment: EnvironmentFactory = (
            _part(t.environment, f"{field}.environment") if t.environment else taskdef.environment
        )
        if t.agent.startswith(OPENAI_AGENT):  # played through the endpoint, not an Agent
            from streamrl.endpoint.agent import load_agent

            openai = load_agent(t.agent)  # a single [task] only (Config._mixture)
            agent: AgentFactory = taskdef.agent
        else:
            agent = _part(t.agent, f"{field}.agent", BUILTIN_AGENTS) if t.agent else taskdef.agent
        reward: Reward = _part(t.reward, f"{field}.reward") if t.reward else taskdef.reward
        services = EpisodeServices(
            caller=caller,
            limits=shared_limits,
            tool_schemas=schemas,
            seed=cfg.run.seed,
            options=taskdef.options,
            reward=reward,
        )
        parts[t.label] = TaskEpisodes(environment, agent, services)
    return Episodes(parts, openai)


class _NoCaller:
    async def call(self, name: str, arguments: str, call_id: str) -> NoReturn:
        raise RuntimeError("no tool workers in a plug-in check")


def check_plugins(cfg: Config) -> None:
    """Load every plug-in the config names (task, its options and data, environment, agent,
    reward, extra tools) and raise PluginError (a ConfigError) for the first that fails.
    With `trainer.eval_every`, every task's held-out split of `trainer.eval_tasks` must be
    there too (HeldoutError): the evaluator would fail at its first evaluation."""
    from streamrl.tasks.heldout import heldout_tasks

    warm = (cfg.model_seed,) if cfg.model.init == "warmstart" else ()
    for i, t in enumerate(cfg.mixture):
        try:
            # a prompt can be built (or a row read)
            task_source(t, cfg.run.seed).task(0, cfg.rollout.num_generations)
            if cfg.trainer.eval_every:
                heldout_tasks(t, cfg.run.seed, cfg.trainer.eval_tasks, 1, warm)
        except PluginError as err:
            raise in_entry(err, i) if cfg.tasks else err from None
    load_episodes(cfg, _NoCaller())


_TASK_FIELD = re.compile(r"(?<![\w.\[])task\.(?=[a-z_])")


def in_entry(err: PluginError, i: int) -> PluginError:
    """`err` of the mixture's entry i: the `task.<field>` its message names (the task's code
    names fields as a single [task]'s) become `tasks[i].<field>`."""
    return type(err)(_TASK_FIELD.sub(f"tasks[{i}].", str(err)))


def _what(obj: object) -> str:
    return f"a {type(obj).__name__}" if not inspect.isclass(obj) else f"class {obj.__name__}"
