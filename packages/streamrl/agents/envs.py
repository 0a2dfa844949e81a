"""Built-in environments: a task environment (one turn, final reward) and a tool
environment (tool calls, run in parallel, until `finish`, an answer or `max_steps`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from streamrl.agents.base import Action, Environment, Reset, StepResult, ToolInfraError
from streamrl.agents.flow import CircuitBreaker, RateLimiter
from streamrl.agents.tools import (
    CallContext,
    Tool,
    ToolArgumentError,
    ToolKind,
    ToolOutput,
    parse_arguments,
)
from streamrl.chat.transcript import ToolCall, ToolCallError
from streamrl.jsontypes import JSON, JSONObject
from streamrl.tools.ledger import AsyncToolLedger, ledger_key
from streamrl.wire import ToolResult


@dataclass(frozen=True)
class ToolRecord:
    """One call an episode made, with what came back."""

    name: str
    args: JSONObject
    output: ToolOutput


# A reward: the final answer (None when the agent gave none), the episode's calls, and the
# context of a call the scorer may make itself (running hidden tests, say).
Scorer = Callable[[str | None, list[ToolRecord], CallContext], Awaitable[float]]


class TaskEnvironment(Environment):
    """One turn: the agent answers, `score` rewards the answer, the episode ends."""

    def __init__(self, prompt: str, score: Scorer) -> None:
        self.prompt = prompt
        self.score = score

    async def reset(self) -> Reset:
        return Reset(prompt=self.prompt)

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        reward = await self.score(action.answer, [], CallContext(f"{call_prefix}-score"))
        return StepResult(observations=[], done=True, reward=reward)


@dataclass
class ToolLimits:
    """Limits shared by every episode of a rollout worker: concurrent calls per tool kind
    (sandbox, external; local calls are not limited), a rate limit per tool name and the
    circuit breaker for infrastructure errors."""

    max_sandbox_calls: int = 64
    max_external_calls: int = 16
    rates: dict[str, RateLimiter] = field(default_factory=dict)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)  # min_calls 0: never

    def __post_init__(self) -> None:
        self._slots: dict[ToolKind, asyncio.Semaphore] = {
            "sandbox": asyncio.Semaphore(self.max_sandbox_calls),
            "external": asyncio.Semaphore(self.max_external_calls),
        }

    async def run(self, tool: Tool, args: JSONObject, ctx: CallContext) -> ToolOutput:
        limiter = self.rates.get(tool.name)
        if limiter is not None:
            await limiter.acquire()
        slots = self._slots.get(tool.kind)
        try:
            if slots is None:
                out = await tool.apply_async(args, ctx)
            else:
                async with slots:
                    out = await tool.apply_async(args, ctx)
        except ToolInfraError as err:
            self.breaker.failure(str(err))  # raises CircuitOpenError when it trips
            raise
        if slots is not None:  # a local call's success says nothing of the tool workers
            self.breaker.success()
        return out


class ToolEnvironment(Environment):
    """Repeated tool calls until the agent calls `finish` (or, with `answer_ends`, answers
    without calling a tool); the runner's `max_steps` bounds the turns.

    The calls of one turn run in parallel and their results come back in call order. A turn
    that calls `finish` ends the episode with its answer; the turn's other calls are not run.
    A malformed call, an unknown tool or bad arguments is a tool error the agent sees; an
    infrastructure failure raises `ToolInfraError` (the episode ends with status error).

    With a `ledger`, a call to a tool whose `idempotent` is False runs once per idempotency
    key: a replayed episode's same call gets the recorded result, not a second side effect.
    """

    def __init__(
        self,
        prompt: str,
        tools: Sequence[Tool],
        score: Scorer,
        limits: ToolLimits,
        *,
        answer_ends: bool = True,
        ledger: AsyncToolLedger | None = None,
    ) -> None:
        self.prompt = prompt
        self.tools = {t.name: t for t in tools}
        self.score = score
        self.limits = limits
        self.answer_ends = answer_ends
        self.ledger = ledger
        self.records: list[ToolRecord] = []
        self.num_tool_calls = 0

    async def reset(self) -> Reset:
        self.records.clear()
        return Reset(prompt=self.prompt, tools=[t.schema() for t in self.tools.values()])

    async def step(self, action: Action, call_prefix: str) -> StepResult:
        finish = self._finish_answer(action.calls)
        if finish is not None:
            return await self._end(finish, call_prefix)
        if not action.calls:
            if self.answer_ends:
                return await self._end(action.answer, call_prefix)
            hint = "error: no tool call; call a tool, or `finish` with your answer"
            return StepResult(observations=[hint], done=False)
        results = await asyncio.gather(
            *(self._one(c, CallContext(f"{call_prefix}-{i}")) for i, c in enumerate(action.calls))
        )
        return StepResult(observations=[r.render() for r in results], done=False)

    def save_state(self) -> JSONObject | None:
        """The calls made so far, with their outputs (the scorer reads them)."""
        return {
            "records": [
                [r.name, r.args, r.output.ok, r.output.output, r.output.error] for r in self.records
            ]
        }

    def restore_state(self, state: JSONObject) -> None:
        records = state["records"]
        if not isinstance(records, list):
            raise TypeError(f"saved records {records!r}: not a list")
        self.records = [_record(r) for r in records]

    def _finish_answer(self, calls: list[ToolCall | ToolCallError]) -> str | None:
        finish = self.tools.get("finish")
        for c in calls:
            if isinstance(c, ToolCall) and c.name == "finish" and finish is not None:
                try:
                    return str(parse_arguments(finish.parameters, c.arguments)["answer"])
                except ToolArgumentError:
                    return None  # shown to the agent as a tool error by `_one`
        return None

    async def _end(self, answer: str | None, call_prefix: str) -> StepResult:
        try:
            reward = await self.score(answer, self.records, CallContext(f"{call_prefix}-score"))
        except ToolInfraError as err:
            self.limits.breaker.failure(str(err))
            raise
        return StepResult(observations=[], done=True, reward=reward)

    async def _one(self, call: ToolCall | ToolCallError, ctx: CallContext) -> ToolOutput:
        if isinstance(call, ToolCallError):
            return ToolOutput(False, "", call.message)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutput(
                False, "", f"unknown tool `{call.name}`; available: {sorted(self.tools)}"
            )
        try:
            args = parse_arguments(tool.parameters, call.arguments)
        except ToolArgumentError as err:
            return ToolOutput(False, "", f"{call.name}: {err}")
        self.num_tool_calls += 1
        if self.ledger is not None and not tool.idempotent:
            out = await self._once(self.ledger, tool, args, ctx)
        else:
            out = await self.limits.run(tool, args, ctx)
        self.records.append(ToolRecord(call.name, args, out))
        return out

    async def _once(
        self, ledger: AsyncToolLedger, tool: Tool, args: JSONObject, ctx: CallContext
    ) -> ToolOutput:
        """The call through the ledger: a ToolInfraError records nothing and propagates."""

        async def run() -> ToolResult:
            start = time.monotonic()
            out = await self.limits.run(tool, args, ctx)
            return ToolResult(
                call_id=ctx.call_id,
                ok=out.ok,
                output=out.output,
                error=out.error,
                duration_s=time.monotonic() - start,
            )

        result = await ledger.run_once(ledger_key(ctx.call_id, tool.name, args), ctx.call_id, run)
        return ToolOutput(result.ok, result.output, result.error)


def _record(saved: JSON) -> ToolRecord:
    """A `ToolRecord` of `ToolEnvironment.save_state`: [name, args, ok, output, error]."""
    if not isinstance(saved, list):
        raise TypeError(f"a saved record {saved!r}: not a list")
    name, args, ok, output, error = saved
    if not (
        isinstance(name, str)
        and isinstance(args, dict)
        and isinstance(ok, bool)
        and isinstance(output, str)
        and isinstance(error, str)
    ):
        raise TypeError(f"a saved record {saved!r}: not [name, args, ok, output, error]")
    return ToolRecord(name, args, ToolOutput(ok, output, error))
