"""Environments: what the agent acts on. A tool environment runs the turn's tool calls (in
parallel) and returns their results; the episode ends when the agent answers.

Environment steps are coroutines so that a step that outlives its limit is cancelled, never
left running on a thread. Issue-level note: the full agent/environment API (model agent,
task environment, `finish` tool) comes with the sandbox work; this is its first shape.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamrl.chat import ParsedTurn, ToolCall, ToolCallError
from streamrl.tasks import arithmetic
from streamrl.tools.registry import CALCULATOR
from streamrl.wire import Task, ToolResult


class ToolCaller(Protocol):
    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult: ...


@dataclass(frozen=True)
class StepResult:
    """`observations` (tool results, in call order) continue the episode; `done` ends it."""

    observations: list[str]
    done: bool
    reward: float = 0.0


class Environment(Protocol):
    def prompt(self) -> str:
        """The user message that opens the episode."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools the agent may call (rendered by the chat template)."""
        ...

    async def step(self, turn: ParsedTurn, call_prefix: str) -> StepResult: ...

    async def close(self) -> None: ...


def render_result(r: ToolResult) -> str:
    """A tool result as the agent reads it."""
    return r.output if r.ok else f"error: {r.error}"


@dataclass
class ArithmeticEnv:
    """The built-in tool task: call the calculator, then answer with its result."""

    task: Task
    tool_client: ToolCaller
    tool_outputs: list[str] = field(default_factory=list)
    num_tool_calls: int = 0

    def prompt(self) -> str:
        return self.task.prompt

    def tools(self) -> list[dict[str, Any]]:
        return [CALCULATOR.schema()]

    async def step(self, turn: ParsedTurn, call_prefix: str) -> StepResult:
        if not turn.calls:
            r = arithmetic.reward(turn.answer, self.tool_outputs, self.task.answer)
            return StepResult(observations=[], done=True, reward=r)
        results = await asyncio.gather(
            *(self._one(c, f"{call_prefix}-{i}") for i, c in enumerate(turn.calls))
        )
        return StepResult(observations=list(results), done=False)

    async def _one(self, call: ToolCall | ToolCallError, call_id: str) -> str:
        if isinstance(call, ToolCallError):
            return f"error: {call.message}"
        self.num_tool_calls += 1
        result = await self.tool_client.call(call.name, call.arguments, call_id)
        if result.ok and call.name == "calculator":
            self.tool_outputs.append(result.output)
        return render_result(result)

    async def close(self) -> None:
        return None


def make_env(task: Task, tools: ToolCaller) -> ArithmeticEnv:
    if task.kind != arithmetic.KIND:
        raise ValueError(f"no environment for task kind {task.kind!r}")
    return ArithmeticEnv(task=task, tool_client=tools)
