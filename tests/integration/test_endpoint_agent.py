"""An agent of the OpenAI kind played as a coroutine through the endpoint (issue 31 item 3):
the example agent (the `openai` client and nothing of streamrl) over a scripted model
service, and the ends an agent may meet: an answer, a hang, a crash, the call limit."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
import structlog
from openai import AsyncOpenAI

from examples.openai_agent.calculator import calculate
from streamrl.endpoint.agent import Outcome, load_agent, play
from streamrl.endpoint.server import Endpoint
from streamrl.model.sampling import GenRequest, GenResult
from streamrl.plugins import PluginError
from streamrl.tasks.arithmetic import calculator_call
from tests.policies import tiny_policy

EXAMPLE = "openai:examples.openai_agent.agent:main"


class Scripted:
    """Samples the given turns in order (a pure protocol double: no engine)."""

    def __init__(self, chat: Any, turns: list[str]) -> None:
        self.chat, self.turns = chat, list(turns)
        self.requests: list[GenRequest] = []
        self.ended: list[str] = []

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        self.requests.append(request)
        ids = self.chat.assistant_turn(self.turns.pop(0))
        return GenResult(ids, [-0.5] * len(ids), stopped=True), 2

    def end_session(self, session: str) -> None:
        self.ended.append(session)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_policy(tmp_path_factory.mktemp("cache"))


def episode(
    policy: Any,
    turns: list[str],
    main: Callable[..., Awaitable[object]],
    timeout_s: float = 10,
    max_calls: int = 4,
) -> tuple[Outcome, Scripted]:
    cfg, chat, _, _ = policy
    model = Scripted(chat, turns)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> Outcome:
        await endpoint.start()
        try:
            return await play(endpoint, main, "g4-m1", "Compute 2+3 with the calculator.",
                              {"answer": "5"}, lambda t: 7 + t, timeout_s, max_calls)  # fmt: skip
        finally:
            await endpoint.stop()

    return asyncio.run(body()), model


def _open_sockets() -> int:
    """asyncio socket transports not closed, of any event loop of this process."""
    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if type(o).__name__ == "_SelectorSocketTransport"
        and type(o).__module__ == "asyncio.selector_events"
        and not o.is_closing()
    )


def test_the_example_agent_calls_the_calculator_and_answers(policy: Any) -> None:
    main = load_agent(EXAMPLE)
    turns = [calculator_call("2+3"), "<answer>5</answer>"]
    before = _open_sockets()
    out, model = episode(policy, turns, main)
    # The agent's connection pool closed with the episode's event loop (left open, its
    # socket was reclaimed during some later test, which a ResourceWarning then failed).
    assert _open_sockets() == before
    assert (out.status, out.answer, out.error) == ("ok", "5", "")
    tr = out.episode.session.transcript
    assert out.episode.calls == 2 and tr.versions == [2, 2] and model.ended == ["g4-m1"]
    # the calculator's result went back as a tool response, rendered after the call
    _, chat, _, _ = policy
    assert "<tool_response>5</tool_response>" in chat.decode(model.requests[1].prompt)
    assert [r.seed for r in model.requests] == [7, 8]
    # the call and the result the agent sent back, as a built-in environment records them
    [record] = out.episode.session.tool_records()
    assert (record.name, record.args, record.output.output) == (
        "calculator",
        {"expression": "2+3"},
        "5",
    )
    assert calculate("2**3+1") == "9" and calculate("__import__('os')").startswith("error")


def test_the_ends_an_agent_may_meet(policy: Any) -> None:
    async def hangs(**kw: Any) -> str:
        await asyncio.sleep(60)
        return "never"

    out, _ = episode(policy, [], hangs, timeout_s=0.3)
    assert out.status == "timeout" and "episode_timeout_s" in out.error

    async def crashes(**kw: Any) -> str:
        raise RuntimeError("the agent fell over")

    out, _ = episode(policy, [], crashes)
    assert out.status == "error" and out.error == "RuntimeError: the agent fell over"

    async def chatty(base_url: str, api_key: str, prompt: str, data: dict[str, Any]) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": prompt}]
        try:
            while True:  # never answers: asks again and again
                out = await client.chat.completions.create(model="policy", messages=messages)
                messages.append(out.choices[0].message.model_dump(exclude_none=True))
                messages.append({"role": "user", "content": "more"})
        except openai.BadRequestError as err:
            assert err.code == "model_call_limit"
            return "gave up"
        finally:
            await client.close()

    out, model = episode(policy, ["thinking"] * 2, chatty, max_calls=2)
    assert (out.status, out.answer) == ("truncated", "gave up")
    assert out.episode.calls == 2 and len(model.requests) == 2 and out.episode.limited


def test_agent_references_are_checked() -> None:
    with pytest.raises(PluginError, match="openai:module:fn"):
        load_agent("examples.openai_agent.agent:main")
    with pytest.raises(PluginError, match="not an async function"):
        load_agent("openai:examples.openai_agent.agent:calculate")
    with pytest.raises(PluginError):
        load_agent("openai:examples.openai_agent.nope:main")


def test_a_model_call_past_its_limit_ends_the_episode_as_a_timeout(policy: Any) -> None:
    # the worker's ModelCalls serve the endpoint as they do the built-in runner: past
    # rollout.model_call_timeout_s the call is answered 504 and the episode is a timeout
    cfg, chat, _, _ = policy

    class Slow(Scripted):
        async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
            await asyncio.sleep(30)
            return await super().generate(request)

    rollout = cfg.rollout.model_copy(update={"model_call_timeout_s": 0.2})
    endpoint = Endpoint(Slow(chat, ["never"]), chat, rollout, structlog.get_logger())
    seen: list[Any] = []

    async def asks(base_url: str, api_key: str, prompt: str, data: dict[str, Any]) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": prompt}]
            )
        except openai.APIStatusError as err:
            seen.append((err.status_code, err.code))
            raise
        finally:
            await client.close()
        return "unreachable"

    async def body() -> Outcome:
        await endpoint.start()
        try:
            return await play(endpoint, asks, "g5-m0", "hi", {}, lambda t: t, 10, 4)
        finally:
            await endpoint.stop()

    out = asyncio.run(body())
    assert seen == [(504, "model_call_timeout")]
    assert out.status == "timeout" and "model_call_timeout_s" in out.error
    assert out.episode.calls == 0 and out.episode.timed_out
