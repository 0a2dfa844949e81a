"""Built-in agents: a model agent for single-turn tasks and a tool agent for tool use."""

from __future__ import annotations

from streamrl.agents.base import Action, Agent
from streamrl.chat.transcript import parse_turn


class ModelAgent(Agent):
    """Single-turn: the whole turn is the answer (the text inside `<answer>` when present).
    Tool-call syntax is not interpreted."""

    def act(self, text: str) -> Action:
        parsed = parse_turn(text)
        answer = parsed.answer if parsed.answer is not None else text.strip()
        return Action(text=text, calls=[], answer=answer)


class ToolAgent(Agent):
    """Parses the Hermes/Qwen `<tool_call>{json}</tool_call>` blocks of a turn (a malformed
    one becomes a `ToolCallError` the agent is shown) and its `<answer>`, if any."""

    def __init__(self) -> None:
        self.turns = 0

    def act(self, text: str) -> Action:
        self.turns += 1
        parsed = parse_turn(text)
        return Action(text=text, calls=parsed.calls, answer=parsed.answer)
