"""Built-in python/shell tools and the code task's hidden tests, run in real sandboxes
(the subprocess backend always; containers and bubblewrap where this machine has them)."""

import asyncio
import json
import os
import re
from collections.abc import Iterator

import pytest

from streamrl.agents.envs import ToolLimits
from streamrl.config import SandboxKind, TaskConfig, parse_config
from streamrl.tasks import code
from streamrl.tasks.registry import load_episodes
from streamrl.tools.backends import ClosableSandbox, make_sandbox
from streamrl.tools.containers import ContainerConfig
from streamrl.tools.registry import run_call
from streamrl.tools.sandbox import SandboxUnavailableError
from streamrl.wire import ToolResult


@pytest.fixture(scope="module", params=["subprocess", "container", "server", "bwrap"])
def sandbox(request: pytest.FixtureRequest) -> Iterator[ClosableSandbox]:
    # "server": containers whose call server runs the calls (tools.call_server).
    kind: SandboxKind = "container" if request.param == "server" else request.param
    container = ContainerConfig(call_server=request.param == "server")
    try:
        box = make_sandbox(kind, container=container)
    except SandboxUnavailableError as err:
        if os.environ.get("STREAMRL_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(f"{request.param} backend unavailable here: {err}")
    yield box
    box.close()


def run(box: ClosableSandbox, name: str, **args: object) -> tuple[bool, str, str]:
    out = run_call(box, name, json.dumps(args), 5.0, 4096)
    return out.ok, out.output, out.error


def test_python_and_shell_report_status_stdout_and_stderr(sandbox: ClosableSandbox) -> None:
    ok, out, _ = run(sandbox, "python", code="import sys\nprint(6*7)\nsys.exit('bad')")
    assert ok and out == "exit status: 1\nstdout:\n42\nstderr:\nbad"
    ok, out, _ = run(sandbox, "shell", command="echo hi; echo oops >&2; exit 3")
    assert ok and out == "exit status: 3\nstdout:\nhi\nstderr:\noops"
    ok, _, err = run(sandbox, "python", code="while True: pass")
    assert not ok and err.startswith("timed out after 5s")


class LocalCaller:
    """The tool-worker path without Redis: run_call on a thread, like a job would."""

    def __init__(self, box: ClosableSandbox) -> None:
        self.box = box
        self.calls: list[tuple[str, str]] = []

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult:
        self.calls.append((name, arguments))
        out = await asyncio.to_thread(run_call, self.box, name, arguments, 5.0, 8192)
        return ToolResult(call_id=call_id, ok=out.ok, output=out.output, error=out.error)


def _linear_task() -> tuple[code.Task, str]:
    """The first linear task of the data set and the Python expression that solves it."""
    cfg = TaskConfig(name="code")
    for cursor in range(100):
        task = code.make_task(cfg, 0, cursor, 4)
        m = re.search(r"returns (\d+) \* x ([+-]) (\d+) for an integer x", task.prompt)
        if m:
            return task, f"{m[1]} * x {m[2]} {m[3]}"
    raise AssertionError("no linear task in the first 100")


def _score(box: ClosableSandbox, task: code.Task, answer: str) -> tuple[float, LocalCaller]:
    caller = LocalCaller(box)
    episodes = load_episodes(parse_config({"task": {"name": "code"}}), caller, ToolLimits())
    agent, env = episodes.make(task, 0)

    async def go() -> float:
        reset = await env.reset()
        assert [t["function"]["name"] for t in reset.tools] == ["python", "finish"]
        args = json.dumps({"answer": answer})
        body = json.dumps({"name": "finish", "arguments": json.loads(args)})
        step = await env.step(agent.act(f"<tool_call>{body}</tool_call>"), "ep-1")
        assert step.done
        return step.reward

    return asyncio.run(go()), caller


def test_hidden_tests_reward_a_solution_by_the_fraction_passed(sandbox: ClosableSandbox) -> None:
    task, expr = _linear_task()
    spec = json.loads(task.answer)
    right, caller = _score(sandbox, task, f"```python\ndef solve(x):\n    return {expr}\n```")
    assert right == 1.0
    [(name, arguments)] = caller.calls
    # The expected values stay on the trusted side.
    assert name == "run_tests" and "expected" not in json.loads(arguments)
    # Right only for negative x: the fraction of such inputs.
    partial, _ = _score(sandbox, task, f"def solve(x):\n    return {expr} if x < 0 else 0\n")
    want = [x < 0 or e == 0 for [x], e in zip(spec["inputs"], spec["expected"], strict=True)]
    assert partial == pytest.approx(sum(want) / len(want))
    assert _score(sandbox, task, "def solve(x) return")[0] == 0.0  # syntax error
    assert _score(sandbox, task, "import os\nos._exit(0)")[0] == 0.0


def test_forging_the_harness_output_gains_nothing(sandbox: ClosableSandbox) -> None:
    task, _ = _linear_task()
    forger = (
        "import __main__, json\n"
        "m = __main__.spec['marker']\n"
        "print(m + json.dumps([{'ok': True, 'value': 1}] * len(__main__.spec['inputs'])))\n"
        "import sys; sys.stdout.flush(); import os; os._exit(0)\n"
    )
    spec = json.loads(task.answer)
    lucky = sum(1 for e in spec["expected"] if e == 1) / len(spec["expected"])
    assert _score(sandbox, task, forger)[0] == pytest.approx(lucky)


def test_code_tasks_are_deterministic_and_checkable() -> None:
    cfg = TaskConfig(name="code")
    a, b = code.make_task(cfg, 3, 11, 4), code.make_task(cfg, 3, 11, 4)
    assert a == b and a.kind == "code" and "`solve(x)`" in a.prompt
    spec = json.loads(a.answer)
    assert len(spec["inputs"]) == len(spec["expected"]) == code.NUM_TESTS
    assert code.extract_code("text\n```python\nx = 1\n```\nmore") == "x = 1"
    marker = "@@m@@"
    line = marker + json.dumps([{"ok": True, "value": 2}, {"ok": False, "error": "E"}])
    assert code.passed_fraction(f"noise\n{line}\n", marker, [2, 3]) == 0.5
    assert code.passed_fraction("no marker", marker, [2]) == 0.0
    assert code.passed_fraction(marker + "{not json", marker, [2]) == 0.0
