"""streamrl.endpoint.protocol: OpenAI's chat-completions shapes, checked by hand and against
the `openai` package's own response types (issue 31)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from streamrl.chat.transcript import parse_turn
from streamrl.endpoint.protocol import (
    ApiError,
    AssistantMessage,
    Reply,
    assistant_message,
    call_id,
    chunks,
    completion,
    parse_request,
)

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def body(**fields: Any) -> bytes:
    base: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "2+3?"}]}
    return json.dumps({**base, **fields}).encode()


def refused(raw: bytes | str) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(raw)
    assert info.value.status == 400
    return info.value


def test_a_tool_calling_conversation_as_the_client_sends_it_parses() -> None:
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_g1-m0_t0_0",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_g1-m0_t0_0", "content": "5"},
    ]
    req = parse_request(
        body(
            messages=messages,
            tools=[CALC],
            tool_choice="auto",
            temperature=1.0,
            max_completion_tokens=32,
            max_tokens=64,
            stop=["</answer>"],
            stream=True,
            stream_options={"include_usage": True},
            n=1,
            seed=7,
            parallel_tool_calls=True,
        )
    )
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[1].text() == "2+3?" and req.messages[2].text() == ""
    assert (
        req.messages[2].tool_calls and req.messages[2].tool_calls[0].function.name == "calculator"
    )
    assert req.tools and req.tools[0].function.name == "calculator"
    assert req.token_limit == 32  # max_completion_tokens wins over max_tokens
    assert req.stops == ["</answer>"] and req.stream
    assert req.stream_options and req.stream_options.include_usage
    assert parse_request(body(stop="x")).stops == ["x"] and parse_request(body()).stops == []


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"temprature": 1.0}, "temprature", "unknown field `temprature`"),
        (
            {"messages": [{"role": "user", "content": "hi", "reasoning": "x"}]},
            "messages[0].reasoning",
            "unknown field `messages[0].reasoning`",
        ),
        ({"n": 2}, "n", "only one choice a request"),
        ({"tool_choice": "required"}, "tool_choice", "only `auto` and `none`"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "calculator"}}},
            "tool_choice",
            "only `auto` and `none`",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"functions": []}, "functions", "send `tools`"),
        ({"top_logprobs": 3}, "top_logprobs", "not implemented"),
        ({"temperature": 3}, "temperature", "`temperature`"),
        ({"max_tokens": 0}, "max_tokens", "`max_tokens`"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop sequences"),
        ({"stop": ""}, "stop", "must not be empty"),
        ({"messages": []}, "messages", "`messages`"),
        ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role", "`messages[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "`messages[0].content",
        ),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0]", ""),
    ],
)
def test_what_the_endpoint_does_not_implement_is_refused_by_name(
    fields: dict[str, Any], param: str, words: str
) -> None:
    err = refused(body(**fields))
    assert err.param is not None and err.param.startswith(param), err.param
    assert words in err.message, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert err.body()["error"]["param"] == err.param


def test_a_body_that_is_no_json_object_is_refused() -> None:
    assert "not JSON" in refused(b"{model: x").message
    assert "not JSON" in refused(b"\xff\xfe").message
    assert "JSON object" in refused(b"[1, 2]").message
    assert "`model`" in refused(json.dumps({"messages": [{"role": "user"}]})).message


def test_other_statuses_have_openais_error_types() -> None:
    assert ApiError("no such episode", status=401).body()["error"]["type"] == (
        "authentication_error"
    )
    assert ApiError("not yours", status=403).body()["error"]["type"] == "permission_error"
    assert ApiError("engine gone", status=503).body()["error"]["type"] == "server_error"


def test_a_sampled_turn_becomes_content_and_tool_calls() -> None:
    first = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    second = '<tool_call>{"name": "calculator", "arguments": "{}"}</tool_call>'
    text = f"Let me compute. {first}\n{second}"
    msg = assistant_message(text, parse_turn(text), "g1-m0", 2, tools_offered=True)
    assert msg == {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {
                "id": "call_g1-m0_t2_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
            },
            {
                "id": "call_g1-m0_t2_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": "{}"},
            },
        ],
    }
    assert call_id("g1-m0", 2, 1) == "call_g1-m0_t2_1"
    # no tools offered: the blocks are text the agent reads
    plain = assistant_message(text, parse_turn(text), "g1-m0", 2, tools_offered=False)
    assert plain == {"role": "assistant", "content": text}
    # only calls: content None; a malformed block is text, not a call
    only = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    assert assistant_message(only, parse_turn(only), "e", 0, True)["content"] is None
    bad = "<tool_call>{not json}</tool_call>"
    assert assistant_message(bad, parse_turn(bad), "e", 0, True) == {
        "role": "assistant",
        "content": bad,
    }
    # beside a well-formed call, a malformed block stays in the text
    mixed = f"{bad} then {first}"
    out = assistant_message(mixed, parse_turn(mixed), "e", 0, True)
    assert out["content"] == f"{bad} then" and len(out["tool_calls"]) == 1


def test_a_whole_response_is_what_the_openai_client_reads() -> None:
    text = 'ok <tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    msg = assistant_message(text, parse_turn(text), "g1-m0", 0, True)
    out = completion(Reply("chatcmpl-1", "policy", 1_700_000_000, msg, "tool_calls", 12, 9))
    parsed = ChatCompletion.model_validate(out)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.id == "call_g1-m0_t0_0" and call.function.name == "calculator"  # type: ignore[union-attr]
    assert parsed.usage is not None and parsed.usage.total_tokens == 21
    hi = Reply("c", "policy", 0, {"role": "assistant", "content": "hi"}, "stop", 3, 2)
    with_lp = completion(hi, logprobs=[("h", -0.5), ("i", -1.25)])
    lp = ChatCompletion.model_validate(with_lp).choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert [(t.token, t.logprob) for t in lp.content] == [("h", -0.5), ("i", -1.25)]


def test_a_streamed_response_rebuilds_the_same_message() -> None:
    text = 'ok <tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    msg = assistant_message(text, parse_turn(text), "g1-m0", 0, True)
    events = list(
        chunks(Reply("chatcmpl-1", "policy", 0, msg, "tool_calls", 12, 9), include_usage=True)
    )
    assert events[-1] == "data: [DONE]\n\n"
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    parsed = [ChatCompletionChunk.model_validate_json(e[6:]) for e in events[:-1]]
    content, calls, finish = "", [], None
    for c in parsed[:-1]:
        delta = c.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = c.choices[0].finish_reason or finish
    assert content == "ok" and finish == "tool_calls"
    assert [(t.index, t.id, t.function.name if t.function else None) for t in calls] == [
        (0, "call_g1-m0_t0_0", "calculator")
    ]
    assert parsed[-1].choices == [] and parsed[-1].usage is not None
    assert parsed[-1].usage.completion_tokens == 9
    # without usage asked: no usage chunk; a text turn streams its text
    plain: AssistantMessage = {"role": "assistant", "content": "five"}
    events = list(chunks(Reply("c", "policy", 0, plain, "stop", 1, 1), include_usage=False))
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert [b["choices"][0]["delta"].get("content") for b in bodies] == ["", "five", None]
    assert bodies[-1]["choices"][0]["finish_reason"] == "stop"
