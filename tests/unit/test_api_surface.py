"""The public plug-in API is pinned: its names, and each name is the very object its home
module defines, so a move of the package's modules (or a rename) cannot change what a user's
plug-in imports from `streamrl.api`."""

from __future__ import annotations

from streamrl import api, wire
from streamrl.agents import agents, base, envs, tools
from streamrl.chat.transcript import ToolCall, ToolCallError
from streamrl.tasks import base as tasks
from streamrl.tools import registry, sandbox

# name -> the object it is, at its home
SURFACE: dict[str, object] = {
    "Action": base.Action,
    "Agent": base.Agent,
    "CallContext": tools.CallContext,
    "Demonstration": tasks.Demonstration,
    "Environment": base.Environment,
    "EpisodeContext": tasks.EpisodeContext,
    "ExecResult": sandbox.ExecResult,
    "FinishTool": tools.FinishTool,
    "FunctionTool": tools.FunctionTool,
    "ModelAgent": agents.ModelAgent,
    "NoOptions": tasks.NoOptions,
    "Outcome": registry.Outcome,
    "Prompt": tasks.Prompt,
    "Reset": base.Reset,
    "Reward": tasks.Reward,
    "RewardError": tasks.RewardError,
    "SandboxTool": tools.SandboxTool,
    "StepResult": base.StepResult,
    "Task": wire.Task,
    "TaskDef": tasks.TaskDef,
    "TaskEnvironment": envs.TaskEnvironment,
    "Tool": tools.Tool,
    "ToolAgent": agents.ToolAgent,
    "ToolArgumentError": tools.ToolArgumentError,
    "ToolCall": ToolCall,
    "ToolCallError": ToolCallError,
    "ToolEnvironment": envs.ToolEnvironment,
    "ToolInfraError": base.ToolInfraError,
    "ToolLimits": envs.ToolLimits,
    "ToolOutput": tools.ToolOutput,
    "ToolRecord": envs.ToolRecord,
    "WorkerTool": registry.Tool,
    "interpret": registry.interpret,
    "parse_arguments": tools.parse_arguments,
    "process_report": registry.process_report,
    "python_tool": registry.python_tool,
}


def test_the_api_names_are_pinned() -> None:
    assert sorted(api.__all__) == sorted(SURFACE)


def test_each_api_name_is_its_home_object() -> None:
    for name, obj in SURFACE.items():
        assert getattr(api, name) is obj, name
