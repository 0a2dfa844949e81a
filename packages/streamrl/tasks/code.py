"""Built-in task: write a small Python function; hidden unit tests in the sandbox reward it.

The agent may try code with the `python` tool and ends with `finish(answer=<code>)` or an
`<answer>` block. The reward is the fraction of hidden tests passed. The expected values
never enter the sandbox: the sandbox runs the candidate on the test inputs and prints what
it returned (`streamrl.tools.harness`), and the rollout side compares. So code that forges
the harness's output gains nothing it could not gain by solving the task.
"""

from __future__ import annotations

import json
import random
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from streamrl.agents.base import Environment, ToolInfraError
from streamrl.agents.envs import ToolEnvironment, ToolRecord
from streamrl.agents.tools import CallContext, FinishTool, ToolCaller
from streamrl.config import TaskConfig
from streamrl.jsontypes import JSON
from streamrl.tasks import base
from streamrl.tools.registry import PYTHON
from streamrl.wire import Task

KIND = "code"
ENTRY = "solve"
NUM_TESTS = 6


@dataclass(frozen=True)
class Problem:
    text: str
    inputs: Sequence[Sequence[object]]  # positional arguments of each hidden test (JSON values)
    expected: Sequence[object]  # what each returns (JSON values)
    solution: str  # a reference body of `solve(x)` (one return expression), for warm starts
    wrong: str  # a plausible wrong one


def _source(body: str) -> str:
    return f"def {ENTRY}(x):\n    return {body}\n"


def _linear(r: random.Random) -> Problem:
    a, b = r.randint(2, 9), r.randint(-9, 9)
    inputs = [[r.randint(-50, 50)] for _ in range(NUM_TESTS)]
    sign = "+" if b >= 0 else "-"
    expr = f"{a} * x {sign} {abs(b)}"
    return Problem(
        f"returns {expr} for an integer x",
        inputs,
        [a * x + b for [x] in inputs],
        expr,
        f"{a} * x",
    )


def _sum_above(r: random.Random) -> Problem:
    t = r.randint(0, 20)
    inputs = [[[r.randint(-10, 40) for _ in range(r.randint(0, 8))]] for _ in range(NUM_TESTS)]
    expected = [sum(v for v in xs if v > t) for [xs] in inputs]
    return Problem(
        f"returns the sum of the elements of the list x greater than {t}",
        inputs,
        expected,
        f"sum(v for v in x if v > {t})",
        f"sum(v for v in x if v >= {t})",
    )


def _count_char(r: random.Random) -> Problem:
    c = r.choice("abcde")
    words = [
        "".join(r.choice("abcdexyz") for _ in range(r.randint(0, 12))) for _ in range(NUM_TESTS)
    ]
    return Problem(
        f"returns how many times the character '{c}' occurs in the string x",
        [[w] for w in words],
        [w.count(c) for w in words],
        f"x.count('{c}')",
        "len(x)",
    )


def _multiples(r: random.Random) -> Problem:
    k = r.randint(2, 7)
    inputs = [[r.randint(0, 100)] for _ in range(NUM_TESTS)]
    return Problem(
        f"returns how many multiples of {k} lie between 1 and the integer x inclusive",
        inputs,
        [x // k for [x] in inputs],
        f"x // {k}",
        f"x // {k} + 1",
    )


def _reverse_repeat(r: random.Random) -> Problem:
    k = r.randint(1, 3)
    words = ["".join(r.choice("abcxyz") for _ in range(r.randint(0, 6))) for _ in range(NUM_TESTS)]
    return Problem(
        f"returns the string x reversed and repeated {k} times",
        [[w] for w in words],
        [w[::-1] * k for w in words],
        f"x[::-1] * {k}",
        f"x * {k}",
    )


FAMILIES: list[Callable[[random.Random], Problem]] = [
    _linear,
    _sum_above,
    _count_char,
    _multiples,
    _reverse_repeat,
]


def problem(seed: int, index: int) -> Problem:
    r = random.Random(seed * 1_000_003 + index)
    return r.choice(FAMILIES)(r)


class CodeTask(base.TaskDef[base.NoOptions]):
    """Write `solve(x)`; the fraction of hidden tests passed in the sandbox is the reward."""

    def prompt(self, index: int) -> base.Prompt:
        p = problem(self.seed, index)
        return base.Prompt(
            f"Write a Python function `{ENTRY}(x)` that {p.text}.",
            json.dumps({"inputs": p.inputs, "expected": p.expected}),
        )

    def environment(self, ctx: base.EpisodeContext) -> Environment:
        tools = [ctx.sandbox_tool(PYTHON.name), FinishTool()]
        return ToolEnvironment(ctx.task.prompt, tools, ctx.score, ctx.limits)

    async def reward(
        self, answer: str | None, calls: list[ToolRecord], ctx: base.EpisodeContext
    ) -> float:
        return await run_hidden_tests(
            ctx.caller, ctx.task, answer, CallContext(f"{ctx.traj_id}-score")
        )

    def demonstration(
        self, task: Task, rng: random.Random, error_rate: float
    ) -> base.Demonstration:
        d = demonstration(self.cfg, self.seed, task, rng, error_rate)
        tools = [PYTHON.schema(), FinishTool().schema()]
        return base.Demonstration(task, tools, d.turns, d.tool_results)


def make_task(cfg: TaskConfig, seed: int, cursor: int, num_generations: int) -> Task:
    prompt = CodeTask(base.NoOptions(), cfg, seed).prompt(cursor % cfg.num_prompts)
    return base.build_task(KIND, prompt, cursor, num_generations)


@dataclass(frozen=True)
class Script:
    """A scripted episode (for the warm start): half the time try the solution on the first
    test input with the python tool first; then `finish` with it. A fraction (error_rate)
    uses a wrong solution."""

    turns: list[str]
    tool_results: list[str]


def _call(name: str, **args: JSON) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def demonstration(
    cfg: TaskConfig, seed: int, task: Task, rng: random.Random, error_rate: float
) -> Script:
    p = problem(seed, task.cursor % cfg.num_prompts)
    body = p.wrong if rng.random() < error_rate else p.solution
    source = _source(body)
    if rng.random() < 0.5:
        return Script(turns=[_call("finish", answer=source)], tool_results=[])
    first = p.inputs[0][0]
    trial = f"{source}print(solve({first!r}))"
    ns: dict[str, object] = {}
    exec(compile(source, "<demo>", "exec"), ns)  # trusted: our own reference code
    solve = ns[ENTRY]
    assert callable(solve)  # `_source` defines it
    shown = f"exit status: 0\nstdout:\n{solve(first)}"
    return Script(
        turns=[_call("python", code=trial), _call("finish", answer=source)],
        tool_results=[shown],
    )


_FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(answer: str) -> str:
    """The code of an answer: the first fenced block if there is one, else the whole text."""
    m = _FENCE.search(answer)
    return (m.group(1) if m else answer).strip()


def tests_arguments(code: str, inputs: Sequence[Sequence[JSON]], marker: str) -> str:
    """Arguments of the worker-side `run_tests` tool."""
    return json.dumps({"code": code, "entry": ENTRY, "inputs": inputs, "marker": marker})


def passed_fraction(output: str, marker: str, expected: Sequence[JSON]) -> float:
    """Fraction of tests whose returned value equals the expected one (JSON-normalised).
    The last line carrying the marker counts; no such line: 0."""
    lines = [ln for ln in output.splitlines() if ln.startswith(marker)]
    if not lines:
        return 0.0
    try:
        results = json.loads(lines[-1][len(marker) :])
    except json.JSONDecodeError:
        return 0.0
    if not isinstance(results, list) or len(results) != len(expected):
        return 0.0
    want = json.loads(json.dumps(expected))
    good = sum(
        1
        for r, e in zip(results, want, strict=True)
        if isinstance(r, dict) and r.get("ok") is True and r.get("value") == e
    )
    return good / len(expected)


async def run_hidden_tests(
    caller: ToolCaller, task: Task, answer: str | None, ctx: CallContext
) -> float:
    """Reward of a final answer: run the hidden tests in the sandbox, compare here."""
    if not answer:
        return 0.0
    spec = json.loads(task.answer)
    marker = f"@@streamrl-{secrets.token_hex(8)}@@"
    result = await caller.call(
        "run_tests", tests_arguments(extract_code(answer), spec["inputs"], marker), ctx.call_id
    )
    if result.infra:
        raise ToolInfraError(f"hidden tests of {task.task_id}: {result.error}")
    return passed_fraction(result.output, marker, spec["expected"]) if result.ok else 0.0
