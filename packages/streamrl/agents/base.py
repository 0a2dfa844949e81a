"""The agent/environment protocol of an episode.

The episode runner (`streamrl.rollout.episode`) owns the tokens: it samples a model turn,
hands its text to the agent, which turns it into an `Action`; the environment applies the
action and answers with a `StepResult`, whose observations (tool results) the runner
renders through the chat template and appends as tokens. Nothing is ever re-rendered from
text, so the tokens trained on are exactly the tokens sampled.

    env.reset() -> Reset(prompt, tools)      agent.reset(reset)
    loop: text = model(...); action = agent.act(text)
          result = await env.step(action);   agent.observe(result)
          until result.done or max_steps
    env.close(); agent.close()

Subclass `Agent` and `Environment` for custom ones; `streamrl.agents.agents` and
`streamrl.agents.envs` hold the built-in model/tool agents and task/tool environments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from streamrl.chat.transcript import ToolCall, ToolCallError
from streamrl.jsontypes import JSONObject


class ToolInfraError(RuntimeError):
    """The tool infrastructure failed (no worker answered, the sandbox is down): not the
    agent's fault, so the episode ends with status `error` instead of showing it a result."""


@dataclass(frozen=True)
class Reset:
    """How an episode opens: the user message and the JSON schemas of the agent's tools."""

    prompt: str
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Action:
    """What the agent did in one turn: its text, the tool calls it made (in order; a call
    that failed to parse is a `ToolCallError`) and its final answer, if it gave one."""

    text: str
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)
    answer: str | None = None


@dataclass(frozen=True)
class StepResult:
    """`observations` (tool results, in call order) continue the episode; `done` ends it
    with `reward`. `info` carries counters for the trajectory (e.g. tests passed)."""

    observations: list[str]
    done: bool
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """What the agent acts on. `step` is a coroutine so that a step that outlives its limit
    is cancelled, never left running on a thread."""

    num_tool_calls: int = 0

    @abstractmethod
    async def reset(self) -> Reset:
        """Start the episode: the opening user message and the tools on offer."""

    @abstractmethod
    async def step(self, action: Action, call_prefix: str) -> StepResult:
        """Apply one action. `call_prefix` is unique per (episode, turn) and stable when an
        episode is replayed: tool calls derive their ids (idempotency keys) from it."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode held (called once, also after an error)."""

    def save_state(self) -> JSONObject | None:
        """What the environment keeps across turns, at a turn boundary (JSON-like values:
        msgpack-encoded into the episode's saved state), or None: it cannot be resumed, and
        an episode that loses its worker starts over (the default)."""
        return None

    def restore_state(self, state: JSONObject) -> None:
        """Take back a `save_state` result, after `reset` on a fresh environment: the
        episode goes on from that turn boundary without making its earlier steps again."""
        raise NotImplementedError(f"{type(self).__name__} saves a state it cannot restore")


class Agent(ABC):
    """Turns the model's text into actions and keeps what it needs across turns."""

    def reset(self, reset: Reset) -> None:  # noqa: B027 - optional hook
        """A new episode begins."""

    @abstractmethod
    def act(self, text: str) -> Action:
        """The action of one model turn."""

    def observe(self, result: StepResult) -> None:  # noqa: B027 - optional hook
        """The environment's answer to the last action."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The episode is over."""
