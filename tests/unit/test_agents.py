"""The agent/environment API: built-in agents, tool environment semantics, flow control."""

import asyncio
import json
from typing import Any

import pytest

from streamrl.agents.agents import ModelAgent, ToolAgent
from streamrl.agents.base import Action, StepResult, ToolInfraError
from streamrl.agents.envs import TaskEnvironment, ToolEnvironment, ToolLimits, ToolRecord
from streamrl.agents.flow import CircuitBreaker, CircuitOpenError, RateLimiter
from streamrl.agents.tools import (
    CallContext,
    FinishTool,
    FunctionTool,
    SandboxTool,
    Tool,
    ToolOutput,
)
from streamrl.chat.transcript import ToolCall
from streamrl.config import ToolsConfig
from streamrl.jsontypes import JSONObject
from streamrl.tasks.registry import tool_limits
from streamrl.wire import ToolResult

ECHO_PARAMS: JSONObject = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
}


def call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name, json.dumps(args))


class Barrier(Tool):
    """Returns only once `parties` calls are in flight at the same time."""

    name, description, parameters = "barrier", "waits for company", ECHO_PARAMS
    kind = "sandbox"

    def __init__(self, parties: int) -> None:
        self.parties, self.inside, self.most = parties, 0, 0
        self.event = asyncio.Event()

    async def apply_async(self, args: dict[str, Any], ctx: CallContext) -> ToolOutput:
        self.inside += 1
        self.most = max(self.most, self.inside)
        if self.inside >= self.parties:
            self.event.set()
        await self.event.wait()
        await asyncio.sleep(0)
        self.inside -= 1
        return ToolOutput(True, f"{args['text']}@{ctx.call_id}")


async def no_reward(answer: str | None, calls: list[ToolRecord], ctx: CallContext) -> float:
    return 0.5 if answer else 0.0


def test_calls_of_one_turn_run_in_parallel_and_answer_in_order() -> None:
    async def go() -> None:
        barrier = Barrier(parties=3)
        env = ToolEnvironment("p", [barrier], no_reward, ToolLimits())
        action = Action("", calls=[call("barrier", text=t) for t in "abc"])
        # Serial calls would wait for company forever.
        step = await asyncio.wait_for(env.step(action, "ep-0"), 5)
        assert step.observations == ["a@ep-0-0", "b@ep-0-1", "c@ep-0-2"]
        assert barrier.most == 3 and env.num_tool_calls == 3 and not step.done

    asyncio.run(go())


def test_sandbox_limit_caps_calls_in_flight() -> None:
    class Counting(Tool):
        name, description, parameters, kind = "count", "", ECHO_PARAMS, "sandbox"
        inside = most = 0

        async def apply_async(self, args: dict[str, Any], ctx: CallContext) -> ToolOutput:
            Counting.inside += 1
            Counting.most = max(Counting.most, Counting.inside)
            await asyncio.sleep(0.01)
            Counting.inside -= 1
            return ToolOutput(True, "")

    async def go() -> None:
        env = ToolEnvironment("p", [Counting()], no_reward, ToolLimits(max_sandbox_calls=2))
        await env.step(Action("", calls=[call("count", text="x")] * 7), "e")

    asyncio.run(go())
    assert Counting.most == 2


def test_finish_ends_the_episode_with_its_answer_and_skips_other_calls() -> None:
    ran: list[str] = []

    def echo_fn(text: str) -> str:
        ran.append(text)
        return text

    echo = FunctionTool("echo", "", ECHO_PARAMS, echo_fn)
    env = ToolEnvironment("p", [echo, FinishTool()], no_reward, ToolLimits())
    action = ToolAgent().act(
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
        '<tool_call>{"name": "finish", "arguments": {"answer": "42"}}</tool_call>'
    )
    step = asyncio.run(env.step(action, "e"))
    assert step.done and step.reward == 0.5 and ran == []


def test_answer_ends_or_is_asked_for_a_tool_call() -> None:
    lenient = ToolEnvironment("p", [FinishTool()], no_reward, ToolLimits())
    assert asyncio.run(lenient.step(Action("x", answer="7"), "e")).done
    strict = ToolEnvironment("p", [FinishTool()], no_reward, ToolLimits(), answer_ends=False)
    step = asyncio.run(strict.step(Action("x", answer="7"), "e"))
    assert not step.done and step.observations == [
        "error: no tool call; call a tool, or `finish` with your answer"
    ]


def test_function_tool_errors_and_unimplemented_tools() -> None:
    def boom(text: str) -> str:
        raise KeyError(text)

    env = ToolEnvironment(
        "p", [FunctionTool("boom", "", ECHO_PARAMS, boom)], no_reward, ToolLimits()
    )
    step = asyncio.run(env.step(Action("", calls=[call("boom", text="k")]), "e"))
    assert step.observations == ["error: KeyError: 'k'"]

    class Lazy(Tool):
        name, description, parameters = "lazy", "", ECHO_PARAMS

    with pytest.raises(NotImplementedError, match="Lazy implements neither apply nor apply_async"):
        asyncio.run(Lazy().apply_async({"text": ""}, CallContext("c")))


class FlakyCaller:
    """Tool client stand-in: infra errors until `heal`."""

    def __init__(self) -> None:
        self.healthy = False

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        if self.healthy:
            return ToolResult(call_id=call_id, ok=True, output="fine")
        return ToolResult(call_id=call_id, ok=False, output="", error="no worker", infra=True)


def test_infra_errors_end_episodes_and_trip_the_breaker() -> None:
    now = [0.0]
    caller = FlakyCaller()
    breaker = CircuitBreaker(window_s=10, error_rate=0.9, min_calls=3, clock=lambda: now[0])
    limits = ToolLimits(breaker=breaker)
    tool = SandboxTool("calc", "", ECHO_PARAMS, caller)

    def step() -> None:
        env = ToolEnvironment("p", [tool], no_reward, limits)
        asyncio.run(env.step(Action("", calls=[call("calc", text="1")]), "e"))

    for t in (0.0, 1.0):
        now[0] = t
        with pytest.raises(ToolInfraError, match="no worker"):
            step()
    caller.healthy = True
    now[0] = 2.5  # the last tenth of the window (1 s) holds only this success
    step()  # ends the failing spell
    assert breaker.failing_since is None
    caller.healthy = False
    for t in (3.0, 8.0, 12.9):
        now[0] = t
        with pytest.raises(ToolInfraError):
            step()
    now[0] = 13.0  # 10 s of errors, 4 calls, all failed
    with pytest.raises(
        CircuitOpenError, match=r"tool infrastructure errors for 10s: 4 of 4 calls failed"
    ):
        step()


def test_a_burst_of_infra_errors_does_not_trip_the_breaker() -> None:
    """Review M9: a few seconds of tool-worker restart fail every call in flight (64) at
    once; the calls after it succeed. The shipped breaker lets the run go on."""
    caller = FlakyCaller()
    limits = tool_limits(ToolsConfig())
    tool = SandboxTool("calc", "", ECHO_PARAMS, caller)

    async def episodes(n: int) -> list[Any]:
        envs = [ToolEnvironment("p", [tool], no_reward, limits) for _ in range(n)]
        steps = [
            e.step(Action("", calls=[call("calc", text="1")]), f"e{i}") for i, e in enumerate(envs)
        ]
        return await asyncio.gather(*steps, return_exceptions=True)

    failed = asyncio.run(episodes(64))
    assert [type(r) for r in failed] == [ToolInfraError] * 64
    caller.healthy = True
    assert all(isinstance(r, StepResult) for r in asyncio.run(episodes(64)))


def test_the_breaker_trips_only_on_errors_sustained_for_its_window() -> None:
    now = [0.0]

    def breaker(**kw: Any) -> CircuitBreaker:
        kw = {"window_s": 60.0, "error_rate": 0.9, "min_calls": 20} | kw
        return CircuitBreaker(**kw, clock=lambda: now[0])

    def fail(b: CircuitBreaker, at: float, n: int = 1) -> None:
        now[0] = at
        for _ in range(n):
            b.failure("no tool worker answered")

    def succeed(b: CircuitBreaker, at: float) -> None:
        now[0] = at
        b.success()

    # 64 calls fail within 3 s, then calls succeed again (one a second): a burst, no trip,
    # nor at a lone failure well after it
    burst = breaker()
    for i in range(64):
        fail(burst, i * 3 / 64)
    for t in range(4, 100):
        succeed(burst, t)
    fail(burst, 100)
    assert burst.failing_since == 100
    # every call failing, in waves of 64 every 16 s ((time_limit_s 5 + result_margin_s 3) x
    # 2 attempts): no trip before 60 s of it, a trip at the first wave after
    waves = breaker()
    for w in range(4):
        fail(waves, 200 + 16 * w, 64)  # at 200, 216, 232, 248
    with pytest.raises(CircuitOpenError) as tripped:
        fail(waves, 264)
    assert str(tripped.value) == (
        "tool infrastructure errors for 64s: 257 of 257 calls failed "
        "(tools.breaker_window_s = 60, tools.breaker_error_rate = 0.9); "
        "last: no tool worker answered"
    )
    # half the calls failing for minutes: below the rate, no trip
    half = breaker()
    for t in range(300):
        (fail if t % 2 else succeed)(half, 400 + t)
    # too few calls for a verdict: no trip
    few = breaker(min_calls=20)
    for t in range(0, 19 * 60, 60):
        fail(few, 1000 + t)
    # min_calls 0: never; window 0: at the first error
    never = breaker(min_calls=0)
    fail(never, 2000, 1000)
    fail(never, 3000, 1000)
    with pytest.raises(CircuitOpenError, match=r"for 0s: 1 of 1 calls failed"):
        fail(breaker(window_s=0, min_calls=1), 4000)


def test_rate_limiter_spaces_calls_by_its_rate() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=2, clock=lambda: now[0])
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    async def go() -> None:
        real = asyncio.sleep
        asyncio.sleep = fake_sleep  # type: ignore[assignment]
        try:
            for _ in range(4):
                await limiter.acquire()
        finally:
            asyncio.sleep = real

    asyncio.run(go())
    # A burst of 2 at once, then one every 1/rate = 0.5 s.
    assert slept == pytest.approx([0.5, 0.5]) and now[0] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        RateLimiter(rate=0)


def test_model_agent_and_task_environment() -> None:
    agent = ModelAgent()
    assert agent.act("so <answer> 12 </answer>").answer == "12"
    bare = agent.act('plain <tool_call>{"name": "x", "arguments": {}}</tool_call>')
    assert bare.calls == [] and bare.answer is not None and bare.answer.startswith("plain")

    async def exact(answer: str | None, calls: list[ToolRecord], ctx: CallContext) -> float:
        return float(answer == "12")

    env = TaskEnvironment("What is 3*4?", exact)
    assert asyncio.run(env.reset()).tools == []
    step = asyncio.run(env.step(agent.act("<answer>12</answer>"), "e"))
    assert step.done and step.reward == 1.0


def test_arithmetic_tool_latency_option_delays_each_calculator_call() -> None:
    import random
    import time

    from streamrl.config import TaskConfig
    from streamrl.tasks.arithmetic import ArithmeticOptions, ArithmeticTask, SlowTool
    from streamrl.tasks.base import EpisodeContext, EpisodeServices, build_task
    from streamrl.tools.registry import CALCULATOR

    class Caller:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str, str]] = []

        async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
            self.calls.append((name, arguments, call_id))
            return ToolResult(call_id=call_id, ok=True, output="7")

    # Fixed: the median itself; lognormal: drawn, capped, the same for the same generator.
    assert ArithmeticOptions(tool_latency_s=0.25).delay(random.Random(1)) == 0.25
    wide = ArithmeticOptions(tool_latency_s=1.0, tool_latency_sigma=3.0, tool_latency_max_s=2.0)
    draws = [wide.delay(random.Random(i)) for i in range(200)]
    assert max(draws) == 2.0 and min(draws) < 0.5 and len(set(draws)) > 50
    assert wide.delay(random.Random(5)) == wide.delay(random.Random(5))

    async def episode(options: ArithmeticOptions) -> tuple[float, Caller, Any]:
        caller = Caller()
        schemas = {CALCULATOR.name: CALCULATOR.schema()}
        services = EpisodeServices(caller, ToolLimits(), schemas, seed=3, options=options)
        taskdef = ArithmeticTask(options, TaskConfig(), 3)
        task = build_task("arithmetic", taskdef.prompt(0), 0, 2)
        env = taskdef.environment(EpisodeContext(task, 0, services))
        start = time.perf_counter()
        step = await env.step(Action("", calls=[call("calculator", expression="3+4")]), "ep")
        return time.perf_counter() - start, caller, step

    took, caller, step = asyncio.run(episode(ArithmeticOptions(tool_latency_s=0.3)))
    assert took >= 0.3 and step.observations == ["7"]
    assert caller.calls == [("calculator", '{"expression": "3+4"}', "ep-0")]
    plain = ArithmeticTask(ArithmeticOptions(), TaskConfig(), 3)
    services = EpisodeServices(Caller(), ToolLimits(), {CALCULATOR.name: CALCULATOR.schema()})
    ctx = EpisodeContext(build_task("arithmetic", plain.prompt(0), 0, 2), 0, services)
    env = plain.environment(ctx)
    assert isinstance(env, ToolEnvironment) and not isinstance(env.tools["calculator"], SlowTool)
