"""The public API: what a task, environment, agent, reward or tool of your own may use.

Everything a plug-in needs is here; every other module of streamrl is internal and may
change between versions. A task package imports only this module:

    from streamrl import api

    class Options(pydantic.BaseModel): ...

    class MyTask(api.TaskDef):
        Options = Options
        def prompt(self, index: int) -> api.Prompt: ...
        def environment(self, ctx: api.EpisodeContext) -> api.Environment: ...
        def reward(self, answer, calls, ctx) -> float: ...

and is named in a run's config as `task.name = "my_package.module:MyTask"` (or by the name
it registers in the `streamrl.tasks` entry-point group). Which process runs what:

- feeder and grouper: `TaskDef.prompt` / `TaskDef.from_row` (the task at a cursor);
- rollout worker: `TaskDef.environment`, `TaskDef.agent`, the reward (and `task.environment`,
  `task.agent`, `task.reward` when set), and the agent-side `Tool`s they hold;
- tool workers: the `WorkerTool`s of `tools.extra` (trusted code that builds a command);
  the command, with whatever the policy wrote into the call, runs only in the sandbox;
- trainer: `TaskDef.demonstration` when `model.init = "warmstart"`.

Shapes: `Task.prompt`/`Task.answer` are text; `Task.data` holds the prompt's data row.
A reward returns a float (or a coroutine function returns one); anything else, NaN or an
infinity, ends that episode with status error, counted, and the run goes on.
"""

from __future__ import annotations

from streamrl.agents.agents import ModelAgent, ToolAgent
from streamrl.agents.base import Action, Agent, Environment, Reset, StepResult, ToolInfraError
from streamrl.agents.envs import TaskEnvironment, ToolEnvironment, ToolLimits, ToolRecord
from streamrl.agents.tools import (
    CallContext,
    FinishTool,
    FunctionTool,
    SandboxTool,
    Tool,
    ToolArgumentError,
    ToolOutput,
    parse_arguments,
)
from streamrl.chat.transcript import ToolCall, ToolCallError
from streamrl.tasks.base import (
    Demonstration,
    EpisodeContext,
    NoOptions,
    Prompt,
    Reward,
    RewardError,
    TaskDef,
)
from streamrl.tools.registry import Outcome, interpret, process_report, python_tool
from streamrl.tools.registry import Tool as WorkerTool
from streamrl.tools.sandbox import ExecResult
from streamrl.wire import Task

__all__ = [
    "Action",
    "Agent",
    "CallContext",
    "Demonstration",
    "Environment",
    "EpisodeContext",
    "ExecResult",
    "FinishTool",
    "FunctionTool",
    "ModelAgent",
    "NoOptions",
    "Outcome",
    "Prompt",
    "Reset",
    "Reward",
    "RewardError",
    "SandboxTool",
    "StepResult",
    "Task",
    "TaskDef",
    "TaskEnvironment",
    "Tool",
    "ToolAgent",
    "ToolArgumentError",
    "ToolCall",
    "ToolCallError",
    "ToolEnvironment",
    "ToolInfraError",
    "ToolLimits",
    "ToolOutput",
    "ToolRecord",
    "WorkerTool",
    "interpret",
    "parse_arguments",
    "process_report",
    "python_tool",
]
