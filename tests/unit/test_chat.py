import asyncio
import random

from streamrl.agents.envs import ToolLimits
from streamrl.chat.transcript import ToolCall, ToolCallError, parse_turn
from streamrl.config import TaskConfig, parse_config
from streamrl.tasks import arithmetic
from streamrl.tasks.registry import load_episodes
from streamrl.wire import ToolResult


def test_parse_turn() -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    t = parse_turn(call)
    assert t.calls == [ToolCall("calculator", '{"expression": "1+2"}')] and t.answer is None
    assert parse_turn("<answer> 42 </answer>").answer == "42"
    [bad] = parse_turn('<tool_call>{"name": "calculator", "arguments": </tool_call>').calls
    assert isinstance(bad, ToolCallError) and bad.message.startswith("tool call is not valid JSON")
    [unterminated] = parse_turn('<tool_call>{"name"').calls
    assert unterminated == ToolCallError("unterminated <tool_call> block")
    [noname] = parse_turn('<tool_call>{"arguments": {}}</tool_call>').calls
    assert noname == ToolCallError("tool call has no string `name`")
    # arguments as a JSON string pass through raw; the tool worker validates them
    [raw] = parse_turn('<tool_call>{"name": "c", "arguments": "{oops"}</tool_call>').calls
    assert raw == ToolCall("c", "{oops")


class StubTools:
    """Pure-logic stand-in for the tool client (the real one is tested with rq workers)."""

    def __init__(self, output: str = "3") -> None:
        self.output = output
        self.calls: list[tuple[str, str]] = []

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        self.calls.append((name, arguments))
        if arguments.startswith("{oops"):
            return ToolResult(
                call_id=call_id,
                ok=False,
                output="",
                error="arguments are not valid JSON: Expecting value at char 1",
            )
        return ToolResult(call_id=call_id, ok=True, output=self.output)


def _play(task_answer_from_tool: str, answer: str) -> float:
    task = arithmetic.make_task(TaskConfig(), 0, 5, 4)

    async def play() -> float:
        episodes = load_episodes(parse_config({}), StubTools(task_answer_from_tool), ToolLimits())
        agent, env = episodes.make(task, 0)
        reset = await env.reset()
        assert reset.tools[0]["function"]["name"] == "calculator"
        call = await env.step(agent.act(arithmetic.calculator_call("x")), "c")
        assert call.observations == [task_answer_from_tool] and not call.done
        final = await env.step(agent.act(f"<answer>{answer}</answer>"), "c")
        assert final.done and env.num_tool_calls == 1
        return final.reward

    return asyncio.run(play())


def test_arithmetic_env_rewards_copying_the_tool_result() -> None:
    right = arithmetic.make_task(TaskConfig(), 0, 5, 4).answer
    assert _play(right, right) == 1.0  # called the calculator and copied its result
    assert _play(right, right + "0") == 0.0  # wrong answer
    assert _play("-1", right) == 0.0  # right answer the calculator never gave
    assert arithmetic.reward(None, ["1"], "1") == 0.0  # no answer at all


def test_bad_tool_calls_reach_the_agent_as_tool_errors() -> None:
    task = arithmetic.make_task(TaskConfig(), 0, 1, 4)
    tools = StubTools()
    agent, env = load_episodes(parse_config({}), tools, ToolLimits()).make(task, 0)
    action = agent.act(
        '<tool_call>{"name": "calculator", "arguments": </tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>'
        '<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
    )
    step = asyncio.run(env.step(action, "c"))
    assert step.observations[0].startswith("error: tool call is not valid JSON")
    assert step.observations[1] == (
        "error: calculator: arguments are not valid JSON: "
        "Expecting property name enclosed in double quotes at char 1"
    )
    assert step.observations[2] == "error: unknown tool `shell`; available: ['calculator']"
    assert step.observations[3] == "error: calculator: missing required argument `expression`"
    assert tools.calls == [] and not step.done  # no bad call left the rollout worker


def test_tasks_are_deterministic_and_demonstrations_vary() -> None:
    cfg = TaskConfig()
    a, b = arithmetic.make_task(cfg, 0, 7, 4), arithmetic.make_task(cfg, 0, 7, 4)
    assert a == b and a.group_id == "g000000007"
    expr, value = arithmetic.expression(cfg, 0, 7)
    assert str(value) == a.answer and expr in a.prompt
    rng = random.Random(0)
    demos = [arithmetic.demonstration(a, rng, 0.5) for _ in range(50)]
    answers = {d.turns[1] for d in demos}
    assert f"<answer>{a.answer}</answer>" in answers and len(answers) > 1
