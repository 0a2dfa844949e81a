"""OpenAI's chat-completions wire shapes, as the per-episode endpoint speaks them (issue 31).

An agent written against the `openai` client (or any framework built on it) talks to the
rollout worker through `POST /v1/chat/completions`. This module is the pure half of that
endpoint: the request, checked field by field, and the responses (whole and streamed),
built from what the policy sampled. No server, no engine, no tokenizer here.

What is accepted: `model`, `messages` (system, developer, user, assistant with
`tool_calls`, tool with `tool_call_id`; text content or text parts), `tools` (functions),
`tool_choice` (`auto`, `none`), `temperature`, `top_p`, `max_tokens` or
`max_completion_tokens`, `stop`, `n` = 1, `stream` (with `stream_options.include_usage`),
`seed`, `logprobs`, `top_logprobs` = 0, `parallel_tool_calls`, `user`. Everything else, and
an accepted field with a value the endpoint does not implement (`n` > 1, `tool_choice`
`required` or one named function, image parts, ...), is refused with status 400 and the
field named (`ApiError`): never ignored, since a silently ignored setting would train on
samples the agent did not ask for.

Tool calls travel as OpenAI `tool_calls` on the wire and as the policy's Hermes blocks
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, `streamrl.chat.transcript`)
in its tokens: `assistant_message` turns a sampled turn's text into the message the agent
receives, each call with an id that names the episode's turn and the call's place in it
(`call_id`), so the transcript the agent sends back can be matched to the tokens sampled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator

from streamrl.chat.transcript import ParsedTurn, ToolCall, parse_call
from streamrl.jsontypes import JSONObject

MAX_STOP = 4  # stop sequences a request may carry (OpenAI's own limit)
FinishReason = Literal["stop", "length", "tool_calls"]
Role = Literal["system", "developer", "user", "assistant", "tool"]

# Accepted fields whose value the endpoint does not implement: field -> why.
_UNSUPPORTED = {
    "frequency_penalty": "penalties change the sampling distribution the trainer corrects for",
    "presence_penalty": "penalties change the sampling distribution the trainer corrects for",
    "logit_bias": "a logit bias changes the sampling distribution the trainer corrects for",
    "response_format": "structured output is not implemented",
    "functions": "the legacy `functions` field: send `tools`",
    "function_call": "the legacy `function_call` field: send `tool_choice`",
    "audio": "audio output is not implemented",
    "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "reasoning effort is not implemented",
    "service_tier": "service tiers are not implemented",
    "store": "stored completions are not implemented",
    "metadata": "stored completions are not implemented",
    "web_search_options": "web search is not implemented",
}


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """OpenAI's error body."""

    error: ErrorDetail


class ApiError(Exception):
    """A request the endpoint refuses: HTTP `status`, OpenAI's error body (`body()`)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def body(self) -> ErrorBody:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status in (401, 403):
            kind = "authentication_error" if self.status == 401 else "permission_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(_Strict):
    """One call of an assistant message (what the endpoint returned, sent back)."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """One message of `messages`; `content` as text (parts joined)."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, JsonValue] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ChatRequest(_Strict):
    """A chat-completions request the endpoint serves (see the module's doc)."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: Literal[0] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(v)}")
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("a stop sequence must not be empty")
        return v

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def token_limit(self) -> int | None:
        """The request's limit on sampled tokens (`max_completion_tokens` wins)."""
        return self.max_completion_tokens or self.max_tokens


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "literal['auto','none']"):
            continue  # a union's branch name, not a field
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_request(body: bytes | str) -> ChatRequest:
    """The request of a POST body, or ApiError (400) naming the first field at fault."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(f"the body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object")
    for key in data:
        if key in _UNSUPPORTED:
            raise ApiError(f"`{key}` is not supported: {_UNSUPPORTED[key]}", param=key)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":
            raise ApiError(f"unknown field `{param}`", param=param) from None
        return _refuse(param, first["msg"], data)


def _refuse(param: str, msg: str, data: JSONObject) -> ChatRequest:
    """Say what is wrong with `param` in words a user acts on."""
    if param == "n":
        raise ApiError(f"`n` = {data.get('n')!r}: only one choice a request (n = 1)", param)
    if param == "tool_choice":
        raise ApiError(
            f"`tool_choice` = {json.dumps(data.get('tool_choice'))}: only `auto` and `none` are "
            "implemented (the policy chooses its calls)",
            param,
        )
    if param == "top_logprobs":
        raise ApiError("`top_logprobs` is not implemented (0 or absent)", param)
    raise ApiError(f"`{param}`: {msg}", param)


class FunctionOut(TypedDict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(TypedDict):
    """One call of an assistant message, as the endpoint returns it."""

    id: str
    type: Literal["function"]
    function: FunctionOut


class AssistantMessage(TypedDict):
    """The assistant message of a served call (`tool_calls` only when it made calls)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCallMessage]]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]  # always empty (`top_logprobs` = 0)


class Logprobs(TypedDict):
    content: list[TokenLogprob]
    refusal: None


class Choice(TypedDict):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: Logprobs | None


class Completion(TypedDict):
    """A whole (non-streamed) response."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


def call_id(episode: str, turn: int, index: int) -> str:
    """The id of call `index` of the episode's model turn `turn` (stable across a replay)."""
    return f"call_{episode}_t{turn}_{index}"


def assistant_message(
    text: str, parsed: ParsedTurn, episode: str, turn: int, tools_offered: bool
) -> AssistantMessage:
    """The assistant message of a sampled turn: its text without the `<tool_call>` blocks
    as `content`, its well-formed calls as `tool_calls` (when the request offered tools;
    else the blocks stay in the text). A malformed block stays in the text."""
    calls = [c for c in parsed.calls if isinstance(c, ToolCall)] if tools_offered else []
    content = text
    if calls:
        content = _strip_calls(text)
    message: AssistantMessage = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": call_id(episode, turn, i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ]
    return message


def _strip_calls(text: str) -> str:
    """`text` without its well-formed `<tool_call>...</tool_call>` blocks (a malformed one
    stays: the agent reads what went wrong), trimmed."""
    out, rest = [], text
    while "<tool_call>" in rest and "</tool_call>" in rest:
        head, _, tail = rest.partition("<tool_call>")
        inner, _, rest = tail.partition("</tool_call>")
        out.append(head)
        if not isinstance(parse_call(inner), ToolCall):
            out.append(f"<tool_call>{inner}</tool_call>")
    out.append(rest)
    return "".join(out).strip()


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Reply:
    """A served call, as both response shapes tell it: its id, model and time, the
    assistant message, why the turn ended, and the token counts."""

    rid: str
    model: str
    created: int
    message: AssistantMessage
    finish: FinishReason
    prompt_tokens: int
    completion_tokens: int


def completion(r: Reply, logprobs: list[tuple[str, float]] | None = None) -> Completion:
    """A whole (non-streamed) response: one choice. `logprobs`: (token text, log-prob)
    of each sampled token, when the request asked for them."""
    choice: Choice = {
        "index": 0,
        "message": r.message,
        "finish_reason": r.finish,
        "logprobs": None if logprobs is None else _logprobs(logprobs),
    }
    return {
        "id": r.rid,
        "object": "chat.completion",
        "created": r.created,
        "model": r.model,
        "choices": [choice],
        "usage": usage(r.prompt_tokens, r.completion_tokens),
    }


def _logprobs(pairs: list[tuple[str, float]]) -> Logprobs:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in pairs
        ],
        "refusal": None,
    }


def chunks(r: Reply, include_usage: bool) -> Iterator[str]:
    """A streamed response as server-sent events (`data: ...\\n\\n`, then `data: [DONE]`):
    the role, the content, each tool call whole, the finish reason, and with
    `include_usage` a last chunk of usage and no choices. The turn is sampled whole before
    it is streamed (the engine decodes a turn in chunks of its own), so streaming changes
    when the agent sees the text, not what is sampled."""
    message = r.message

    def event(choices: list[dict[str, object]], extra: dict[str, object] | None = None) -> str:
        obj = {
            "id": r.rid,
            "object": "chat.completion.chunk",
            "created": r.created,
            "model": r.model,
            "choices": choices,
            **(extra or {}),
        }
        return f"data: {json.dumps(obj)}\n\n"

    yield event(
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    )
    if message.get("content"):
        delta: dict[str, object] = {"content": message["content"]}
        yield event([{"index": 0, "delta": delta, "finish_reason": None}])
    for i, call in enumerate(message.get("tool_calls") or []):
        delta = {"tool_calls": [{"index": i, **call}]}
        yield event([{"index": 0, "delta": delta, "finish_reason": None}])
    yield event([{"index": 0, "delta": {}, "finish_reason": r.finish}])
    if include_usage:
        yield event([], {"usage": usage(r.prompt_tokens, r.completion_tokens)})
    yield "data: [DONE]\n\n"
