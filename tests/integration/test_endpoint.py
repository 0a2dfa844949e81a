"""The per-episode OpenAI-compatible endpoint (issue 31), driven by the real `openai` client:
on the real engine (the tiny model), the trajectory's sampled tokens are the engine's own;
and the refusals an agent meets, by status and field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import openai
import pytest
import structlog
from openai import AsyncOpenAI

from streamrl.chat.hf import HFChat
from streamrl.endpoint.server import Endpoint
from streamrl.endpoint.session import stop_cut
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.sampling import GenRequest, GenResult, SamplingParams
from streamrl.rollout.engine_server import EngineServer
from streamrl.tasks.arithmetic import calculator_call
from streamrl.tools.registry import CALCULATOR
from tests.policies import tiny_policy

GREEDY = SamplingParams(temperature=1.0, top_p=1.0, top_k=1)
TOOLS: list[Any] = [CALCULATOR.schema()]


class Recording:
    """The engine server, with every result it returned kept (the engine's own record)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.results: list[tuple[GenRequest, GenResult]] = []
        self.ended: list[str] = []

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        result, version = await self.server.generate(request)
        self.results.append((request, result))
        return result, version

    def end_session(self, session: str) -> None:
        self.ended.append(session)
        self.server.end_session(session)


class Scripted:
    """A model service that samples the turns it is given, in order (for the tool-call
    round trip; pure protocol, no engine)."""

    def __init__(self, chat: HFChat, turns: list[str]) -> None:
        self.chat = chat
        self.turns = list(turns)
        self.requests: list[GenRequest] = []

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        self.requests.append(request)
        ids = self.chat.assistant_turn(self.turns.pop(0))
        return GenResult(ids, [-0.5] * len(ids), stopped=True), 3

    def end_session(self, session: str) -> None:
        return None


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_policy(tmp_path_factory.mktemp("cache"))


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


def test_a_three_turn_conversation_trains_on_the_engines_own_tokens(policy: Any) -> None:
    cfg, chat, spec, params = policy
    engine = Engine(
        spec,
        params,
        EngineConfig(
            num_slots=2,
            kv_cache_size=512,
            max_prompt_length=511,
            max_new_tokens=16,
            sampling=GREEDY,
            stop_ids=tuple(chat.stop_ids),
            pad_id=chat.pad_id,
            decode_chunk=4,
        ),
    )
    server = EngineServer(engine, 5, structlog.get_logger())
    model = Recording(server)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> None:
        serving = asyncio.create_task(server.serve())
        base = await endpoint.start()
        key = endpoint.open("g3-m0", lambda turn: 100 + turn)
        client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            messages: list[Any] = [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Compute 2+3."},
            ]
            for turn in range(3):
                out = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=8
                )
                reply = out.choices[0].message
                assert out.usage is not None and out.usage.completion_tokens >= 1
                messages.append(reply.model_dump(exclude_none=True))
                messages.append({"role": "user", "content": f"Again, turn {turn + 1}."})
            ep = endpoint.close(key)
        finally:
            await client.close()
            await endpoint.stop()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        tr = ep.session.transcript
        # the sampled tokens, turn by turn, are exactly the engine's results
        sampled = [t for t, m in zip(tr.tokens, tr.mask, strict=True) if m]
        assert sampled == [t for _, r in model.results for t in r.tokens]
        lps = [lp for lp, m in zip(tr.logprobs, tr.mask, strict=True) if m]
        assert lps == [lp for _, r in model.results for lp in r.logprobs]
        assert tr.versions == [5, 5, 5] and ep.calls == 3 and ep.refused == 0
        # each call's prompt was the held ids: the last call's prompt is all but its turn
        last_request, last = model.results[-1]
        assert last_request.prompt == tr.tokens[: len(tr.tokens) - len(last.tokens)]
        assert [r.seed for r, _ in model.results] == [100, 101, 102]
        assert {r.session for r, _ in model.results} == {"g3-m0"} and model.ended == ["g3-m0"]
        # the engine reused the episode's KV cache across its turns
        assert engine.kv_stats()["reuse_hits"] >= 2

    run(body)


def test_tool_calls_round_trip_through_the_openai_client(policy: Any) -> None:
    cfg, chat, _, _ = policy
    turns = [calculator_call("2+3"), "<answer>5</answer>"]
    model = Scripted(chat, turns)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> None:
        base = await endpoint.start()
        key = endpoint.open("g1-m2", lambda turn: turn)
        client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            messages: list[Any] = [{"role": "user", "content": "Compute 2+3."}]
            first = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS
            )
            call = first.choices[0]
            assert call.finish_reason == "tool_calls" and call.message.tool_calls
            tc = call.message.tool_calls[0]
            assert tc.id == "call_g1-m2_t0_0"
            assert tc.function.name == "calculator"  # type: ignore[union-attr]
            assert json.loads(tc.function.arguments) == {"expression": "2+3"}  # type: ignore[union-attr]
            messages.append(call.message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": "5"})
            stream = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            assert text == "<answer>5</answer>" and finish == "stop"
            assert usage is not None and usage.completion_tokens == len(
                chat.assistant_turn(turns[1])
            )
            ep = endpoint.close(key)
        finally:
            await client.close()
            await endpoint.stop()
        assert ep.session.turns == 2 and ep.session.transcript.versions == [3, 3]
        # the second prompt extended the first call's prompt and its sampled turn
        first_prompt = model.requests[0].prompt
        held = [*first_prompt, *chat.assistant_turn(turns[0])]
        assert model.requests[1].prompt[: len(held)] == held
        assert "<tool_response>" in chat.decode(model.requests[1].prompt[len(held) :])

    run(body)


def test_bad_requests_get_the_documented_errors(policy: Any) -> None:
    cfg, chat, _, _ = policy
    model = Scripted(chat, ["<answer>1</answer>"] * 4)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> None:
        base = await endpoint.start()
        mine = endpoint.open("g1-m0", lambda turn: turn)
        other = endpoint.open("g1-m1", lambda turn: turn)
        client = AsyncOpenAI(base_url=base, api_key=mine, max_retries=0)
        stranger = AsyncOpenAI(base_url=base, api_key="sk-ep-guess", max_retries=0)
        user: Any = {"role": "user", "content": "hi"}
        try:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="policy", messages=[user], extra_body={"best_of": 2}
                )
            assert info.value.body["param"] == "best_of"  # type: ignore[index]
            assert "unknown field" in info.value.body["message"]  # type: ignore[index]
            with pytest.raises(openai.BadRequestError, match=r"rollout\.temperature"):
                await client.chat.completions.create(
                    model="policy", messages=[user], temperature=0.3
                )
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(model="policy", messages=[user])
            out = await client.chat.completions.create(model="policy", messages=[user])
            reply: Any = out.choices[0].message.model_dump(exclude_none=True)
            edited: Any = {**reply, "content": "<answer>2</answer>"}
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="policy", messages=[user, edited, {"role": "user", "content": "ok?"}]
                )
            assert info.value.body["code"] == "transcript_edited"  # type: ignore[index]
            big = AsyncOpenAI(base_url=base, api_key=endpoint.open("g1-m3", lambda t: t),
                              max_retries=0)  # fmt: skip
            with pytest.raises(openai.BadRequestError) as info:
                await big.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "x " * 600}]
                )
            await big.close()
            assert info.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
            # the other episode's conversation is untouched by any of it
            assert endpoint.episodes[other].session.turns == 0
            ep = endpoint.close(mine)
            with pytest.raises(openai.AuthenticationError):  # a closed episode's key is dead
                await client.chat.completions.create(model="policy", messages=[user])
        finally:
            await client.close()
            await stranger.close()
            await endpoint.stop()
        assert ep.calls == 1 and ep.refused == 3 and ep.edited == 1
        assert len(model.requests) == 1  # no refused call reached the model

    run(body)


def test_nothing_logged_holds_a_key(policy: Any, tmp_path: Path) -> None:
    """An episode's key is a secret: the refusal log names the episode, never the key."""
    cfg, chat, _, _ = policy
    endpoint = Endpoint(Scripted(chat, []), chat, cfg.rollout, structlog.get_logger())

    async def body() -> None:
        base = await endpoint.start()
        key = endpoint.open("g9-m0", lambda turn: turn)
        client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            with structlog.testing.capture_logs() as logs, pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], n=2
                )
        finally:
            await client.close()
            await endpoint.stop()
        assert logs and logs[0]["episode"] == "g9-m0" and logs[0]["param"] == "n"
        assert key not in json.dumps(logs)

    run(body)


class Slow(Scripted):
    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        await asyncio.sleep(0.3)
        return await super().generate(request)


def test_one_call_at_a_time_per_episode_and_the_model_list(policy: Any) -> None:
    """A second call of an episode while one is in flight gets 409 (a conversation has one
    next turn); another episode's call is served beside it; /v1/models lists the policy."""
    cfg, chat, _, _ = policy
    model = Slow(chat, ["<answer>1</answer>"] * 2)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> None:
        base = await endpoint.start()
        a = AsyncOpenAI(base_url=base, api_key=endpoint.open("g1-m0", lambda t: t), max_retries=0)
        b = AsyncOpenAI(base_url=base, api_key=endpoint.open("g1-m1", lambda t: t), max_retries=0)
        user: Any = [{"role": "user", "content": "hi"}]
        try:
            assert [m.id for m in (await a.models.list()).data] == ["policy"]
            results = await asyncio.gather(
                a.chat.completions.create(model="policy", messages=user),
                a.chat.completions.create(model="policy", messages=user),
                b.chat.completions.create(model="policy", messages=user),
                return_exceptions=True,
            )
        finally:
            await a.close()
            await b.close()
            await endpoint.stop()
        conflicts = [r for r in results if isinstance(r, openai.ConflictError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert len(conflicts) == 1 and len(served) == 2
        assert sorted(r.session for r in model.requests) == ["g1-m0", "g1-m1"]

    run(body)


def test_a_stop_sequence_ends_the_turn_through_the_openai_client(policy: Any) -> None:
    cfg, chat, _, _ = policy
    turns = ["Let me see. STOP and the rest", "<answer>5</answer>"]
    model = Scripted(chat, turns)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())
    sampled = chat.assistant_turn(turns[0])
    keep = stop_cut(chat, sampled, ["STOP"])
    assert keep is not None and keep < len(sampled)

    async def body() -> None:
        base = await endpoint.start()
        key = endpoint.open("g2-m0", lambda turn: turn)
        client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        try:
            messages: list[Any] = [{"role": "user", "content": "Compute 2+3."}]
            out = await client.chat.completions.create(
                model="policy", messages=messages, stop="STOP"
            )
            choice = out.choices[0]
            assert (choice.message.content, choice.finish_reason) == ("Let me see. ", "stop")
            assert out.usage is not None and out.usage.completion_tokens == keep
            messages += [choice.message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Go on."}]  # fmt: skip
            again = await client.chat.completions.create(model="policy", messages=messages)
            assert again.choices[0].message.content == "<answer>5</answer>"
            ep = endpoint.close(key)
        finally:
            await client.close()
            await endpoint.stop()
        # trained: the ids kept, as sampled; the next prompt continued them after the end
        # marker the cut turn lacked
        tr = ep.session.transcript
        first = model.requests[0].prompt
        assert tr.tokens[len(first) : len(first) + keep + 1] == [*sampled[:keep], chat.turn_end_id]
        assert (
            model.requests[1].prompt[: len(first) + keep + 1] == tr.tokens[: len(first) + keep + 1]
        )

    run(body)
