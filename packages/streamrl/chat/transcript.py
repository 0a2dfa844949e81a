"""An episode's transcript in token ids, and parsing of the policy's turns.

Episodes are token-in, token-out: a conversation is kept as token ids and extended turn by
turn, never re-rendered from text, so the tokens trained on are exactly the tokens sampled
(the chat template's pieces come from `streamrl.chat.hf`). Tool calls use the Hermes/Qwen
form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the final answer is
`<answer>...</answer>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `arguments` is JSON text, checked against the tool's schema later."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallError:
    """A `<tool_call>` block that could not be parsed; the agent sees `message`."""

    message: str


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall | ToolCallError]
    answer: str | None


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_call(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCallError(f"tool call is not valid JSON: {err.msg} at char {err.pos}")
    if not isinstance(obj, dict):
        return ToolCallError("tool call must be a JSON object with `name` and `arguments`")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("tool call has no string `name`")
    args = obj.get("arguments", {})
    if isinstance(args, dict):
        return ToolCall(name=name, arguments=json.dumps(args))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        return ToolCall(name=name, arguments=args)
    return ToolCallError("tool call `arguments` must be an object")


def parse_turn(text: str) -> ParsedTurn:
    """Tool calls and final answer of one assistant turn's text."""
    calls = [parse_call(m.group(1)) for m in _CALL.finditer(text)]
    if "<tool_call>" in text and not calls:
        calls = [ToolCallError("unterminated <tool_call> block")]
    m = _ANSWER.search(text)
    return ParsedTurn(calls=calls, answer=m.group(1).strip() if m else None)


@dataclass
class Transcript:
    """Token ids of an episode with the aligned loss mask and rollout log-probs."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0

    def add_template(self, ids: list[int]) -> None:
        self.tokens.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    def add_sampled(self, ids: list[int], logprobs: list[float], version: int) -> None:
        if len(ids) != len(logprobs):
            raise ValueError("sampled ids and log-probs differ in length")
        self.tokens.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.append(version)

    def __len__(self) -> int:
        return len(self.tokens)
