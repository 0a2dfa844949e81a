"""One episode's conversation as the endpoint holds it: token-exact across calls (issue 31).

An agent of the OpenAI kind sends its whole conversation with every call. The session
keeps what it has seen and returned (`wire`: each message as the agent must send it back)
and the episode's tokens (`transcript`): the first prompt as the template renders it, each
sampled turn's ids exactly as sampled, and after each turn the continuation the template
renders for the new messages (`HFChat.continuation_ids`, the path the built-in agent's
dialogue takes). A call is served from the ids held, never from a re-tokenisation of the
agent's copy of the text, so the trajectory trains on what the policy sampled.

- The first call may hold system, developer and user messages only (an assistant turn the
  policy did not sample cannot be trained on as its own), and fixes the tools.
- A later call's messages must begin with everything sent and returned so far (an assistant
  message compared by its text and its calls: ids, names and arguments as JSON values),
  followed by new tool or user messages, and carry the same tools.
- A call that does not extend the conversation held (an edited, dropped or reordered
  message, other tools) is refused with `TranscriptEdited` (400, code `transcript_edited`;
  the caller counts it and marks the episode). The session is unchanged by a refusal or a
  failed model call: `prepare` computes a call's prompt, only `record` keeps it.

Text from the agent enters through `HFChat.as_text`, like tool results in the built-in
dialogue: it cannot forge a control token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from streamrl.agents.envs import ToolRecord
from streamrl.agents.tools import ToolOutput
from streamrl.chat.hf import ChatError, HFChat
from streamrl.chat.transcript import Transcript
from streamrl.endpoint.protocol import (
    ApiError,
    AssistantMessage,
    ChatRequest,
    Message,
    Role,
    assistant_message,
)
from streamrl.jsontypes import JSONObject

FIRST_ROLES = ("system", "developer", "user")
LATER_ROLES = ("tool", "user")


class TranscriptEdited(ApiError):
    """The request's messages do not extend the conversation the session holds."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message, param=param, code="transcript_edited")


class WireMessage(TypedDict):
    """A message as the agent must send it back (`normalise`)."""

    role: Role
    content: str
    name: NotRequired[str]
    tool_call_id: NotRequired[str]
    # each call as (id, name, arguments as a JSON value, or the text when it is no JSON)
    tool_calls: NotRequired[list[tuple[str, str, object]]]


@dataclass(frozen=True)
class Pending:
    """A call's prompt, computed and not yet kept (`EndpointSession.record` keeps it)."""

    prompt: list[int]  # the whole prompt to sample from
    added: list[int]  # its ids the session did not hold (template, not trained)
    wire: list[WireMessage]  # the request's messages new to the session, normalised
    template: list[JSONObject]  # the same as the template renders them
    tools: list[JSONObject] | None  # the request's tools (a first call fixes them)
    room: int  # tokens the conversation may still sample (a call samples at most these)


def _arguments(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def normalise(m: Message) -> WireMessage:
    """What of a message must be sent back unchanged: role, text, name, tool_call_id; an
    assistant message's calls as (id, name, arguments as a JSON value)."""
    out: WireMessage = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [
            (c.id, c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls
        ]
    return out


class EndpointSession:
    """The conversation of one episode's agent, as tokens and as the messages it sent."""

    def __init__(
        self, chat: HFChat, episode: str, max_context: int, max_prompt: int | None = None
    ) -> None:
        self.chat = chat
        self.episode = episode
        # the positions a conversation may fill (the built-in agent's limit: the first
        # prompt's and the response's lengths, within the engine's KV slot)
        self.max_context = max_context
        self.max_prompt = max_context if max_prompt is None else max_prompt
        self.transcript = Transcript()
        self.wire: list[WireMessage] = []
        self.template: list[JSONObject] = []
        self.tools: list[JSONObject] | None = None
        self.turns = 0  # sampled turns

    def prepare(self, req: ChatRequest) -> Pending:
        """The prompt of `req`, or ApiError (TranscriptEdited when it edits the history)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if req.messages[-1].role == "assistant":
            raise ApiError(
                "the last message is an assistant's: a call samples the next assistant turn "
                "(continuing a partial one is not supported)",
                param=f"messages[{len(req.messages) - 1}]",
            )
        if not self.turns:
            return self._first(req, tools)
        if tools != self.tools:
            raise TranscriptEdited("the tools differ from the conversation's first call", "tools")
        held = len(self.wire)
        if len(req.messages) <= held:
            raise TranscriptEdited(
                f"{len(req.messages)} messages: the conversation holds {held} (each call sends "
                "the whole conversation, the last answer included, then what is new)"
            )
        for i, (m, kept) in enumerate(zip(req.messages, self.wire, strict=False)):
            if normalise(m) != kept:
                what = "assistant turn sampled" if kept["role"] == "assistant" else "message sent"
                raise TranscriptEdited(
                    f"messages[{i}] ({m.role}) differs from the {what} then: the "
                    "history may only grow (a trajectory trains on the tokens sampled)",
                    f"messages[{i}]",
                )
        new = req.messages[held:]
        for i, m in enumerate(new, start=held):
            if m.role not in LATER_ROLES:
                raise ApiError(
                    f"messages[{i}] is a {m.role} message: after an assistant turn only tool "
                    "and user messages may follow",
                    param=f"messages[{i}]",
                )
        template = [self._template(m) for m in new]
        try:
            added = self.chat.continuation_ids(self.template, template, self.tools)
        except ChatError as err:
            raise ApiError(f"the chat template cannot continue the conversation: {err}") from None
        prompt = [*self.transcript.tokens, *added]
        return self._pending(req, prompt, added, new, template, self.tools)

    def _first(self, req: ChatRequest, tools: list[JSONObject] | None) -> Pending:
        for i, m in enumerate(req.messages):
            if m.role not in FIRST_ROLES:
                raise ApiError(
                    f"messages[{i}] is a {m.role} message in the conversation's first call: "
                    "an assistant turn or tool result the policy did not sample cannot be "
                    "trained on (send system, developer and user messages first)",
                    param=f"messages[{i}]",
                )
        template = [self._template(m) for m in req.messages]
        try:
            prompt = self.chat.prompt_ids(template, tools)
        except ChatError as err:
            raise ApiError(f"the chat template cannot render the conversation: {err}") from None
        if len(prompt) > self.max_prompt:
            raise ApiError(
                f"the first prompt is {len(prompt)} tokens: more than the "
                f"{self.max_prompt} of rollout.max_prompt_length",
                param="messages",
                code="context_length_exceeded",
            )
        return self._pending(req, prompt, prompt, req.messages, template, tools)

    def _pending(
        self,
        req: ChatRequest,
        prompt: list[int],
        added: list[int],
        new: list[Message],
        template: list[JSONObject],
        tools: list[JSONObject] | None,
    ) -> Pending:
        asked = req.token_limit or 1
        if len(prompt) + asked > self.max_context:
            raise ApiError(
                f"the prompt is {len(prompt)} tokens and the call may sample {asked}: more "
                f"than the {self.max_context} positions of a conversation",
                param="messages",
                code="context_length_exceeded",
            )
        room = self.max_context - len(prompt)
        return Pending(prompt, added, [normalise(m) for m in new], template, tools, room)

    def _template(self, m: Message) -> JSONObject:
        role = "system" if m.role == "developer" else m.role
        return {"role": role, "content": self.chat.as_text(m.text())}

    def record(
        self,
        pending: Pending,
        ids: list[int],
        logprobs: list[float],
        version: int,
        stops: list[str] | None = None,
    ) -> AssistantMessage:
        """Keep a served call: its new messages, the template's ids, the sampled `ids`
        (their log-probs, the policy `version`); the assistant message to return. With the
        request's `stops` (given when one of them cut the turn), `ids` are those `stop_cut`
        kept: the message's text ends before the first stop sequence, and a turn cut before
        the model's own end of turn is closed with the template's end marker (a template
        token, not trained), so that the next call continues a well-formed conversation."""
        self.transcript.add_template(pending.added)
        if not self.turns:  # the first call fixes the tools and the prompt's length
            self.tools = pending.tools
            self.transcript.prompt_len = len(pending.added)
        self.transcript.add_sampled(ids, logprobs, version)
        if stops and ids and ids[-1] not in self.chat.stop_ids:
            self.transcript.add_template([self.chat.turn_end_id])
        self.template.extend(pending.template)
        text = before_stop(self.chat.assistant_text(ids), stops or [])
        self.template.append(self.chat.assistant_message(ids))
        message = assistant_message(
            text, self.chat.parse(ids), self.episode, self.turns, pending.tools is not None
        )
        self.wire.extend(pending.wire)
        self.wire.append(normalise(Message.model_validate(message)))
        self.turns += 1
        return message

    def tool_records(self) -> list[ToolRecord]:
        """The calls the policy made and the results the agent sent back for them, as the
        built-in environments record them for a task's reward: each sampled call whose id a
        later tool message answers (arguments that are no JSON object count as none)."""
        results = {m["tool_call_id"]: m["content"] for m in self.wire if m["role"] == "tool"}
        records = []
        for m in self.wire:
            for cid, name, args in m.get("tool_calls", []):
                if cid in results:
                    kwargs = args if isinstance(args, dict) else {}
                    records.append(ToolRecord(name, kwargs, ToolOutput(True, results[cid])))
        return records


def stop_cut(chat: HFChat, ids: list[int], stops: list[str]) -> int | None:
    """How many of a sampled turn's `ids` a request's stop sequences keep: the shortest
    prefix whose text holds one of them (None: none occurs, keep all). The turn is
    sampled whole and cut here: the ids kept are exactly what the policy sampled (a token
    depends only on those before it), the rest is dropped unseen, and the next call
    continues from the cut (the engine reuses its KV up to the first token that differs).
    The stop sequence's own tokens are kept and trained; its text is not returned
    (`before_stop`), as OpenAI's API does."""
    if not stops or not _holds(chat.assistant_text(ids), stops):
        return None
    lo, hi = 1, len(ids)  # the text of ids[:hi] holds a stop sequence
    while lo < hi:
        mid = (lo + hi) // 2
        if _holds(chat.assistant_text(ids[:mid]), stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def before_stop(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any of `stops` (all of it when none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


def _holds(text: str, stops: list[str]) -> bool:
    return any(s in text for s in stops)
