"""An agent as an external program in a sandbox (issue 31 item 3, `task.agent_command`):
the example program (the standard library alone) under bubblewrap, its network reaching
the endpoint and nothing else, and the ends a program may meet: an exit status, a hang,
a flood. A scripted model service samples the turns (the engine's own tokens are the
subject of tests/integration/test_endpoint.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import structlog

from streamrl.endpoint.agent import Outcome, play
from streamrl.endpoint.command import MEMORY_BYTES, CommandAgent
from streamrl.endpoint.server import Endpoint
from streamrl.model.sampling import GenRequest, GenResult
from streamrl.tasks.arithmetic import calculator_call
from streamrl.tools.bwrap import BubblewrapConfig, BubblewrapSandbox
from tests.integration.test_endpoint_agent import Scripted
from tests.policies import tiny_policy

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "openai_agent"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_policy(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def box() -> BubblewrapSandbox:
    return BubblewrapSandbox(BubblewrapConfig(memory_bytes=MEMORY_BYTES, call_server=False))


def program(
    policy: Any,
    turns: list[str],
    argv: list[str],
    box: BubblewrapSandbox | None,
    agent_dir: str = "",
    timeout_s: float = 20,
) -> tuple[Outcome, Scripted, Endpoint]:
    """One episode of the program `argv` against a scripted model."""
    cfg, chat, _, _ = policy
    model = Scripted(chat, turns)
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> Outcome:
        await endpoint.start(unix=True)
        try:
            main = CommandAgent(argv, agent_dir, endpoint.socket_path, box, timeout_s)
            return await play(endpoint, main, "g4-m1", "Compute 2+3 with the calculator.",
                              {"answer": "5"}, lambda t: 7 + t, timeout_s, 4)  # fmt: skip
        finally:
            await endpoint.stop()

    return asyncio.run(body()), model, endpoint


def python(source: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(source)]


@needs_bwrap
def test_the_example_program_plays_an_episode_in_bubblewrap(
    policy: Any, box: BubblewrapSandbox
) -> None:
    turns = [calculator_call("2+3"), "<answer>5</answer>"]
    out, model, endpoint = program(
        policy, turns, ["python3", "program.py"], box, agent_dir=str(EXAMPLE_DIR)
    )
    assert (out.status, out.answer, out.error) == ("ok", "5", "")
    assert out.episode.calls == 2 and model.ended == ["g4-m1"]
    _, chat, _, _ = policy
    assert "<tool_response>5</tool_response>" in chat.decode(model.requests[1].prompt)
    [record] = out.episode.session.tool_records()
    assert (record.name, record.args, record.output.output) == (
        "calculator",
        {"expression": "2+3"},
        "5",
    )
    assert not Path(endpoint.socket_path or "/nonexistent").exists()  # stop removed it


@needs_bwrap
def test_the_program_reaches_the_endpoint_and_nothing_else(
    policy: Any, box: BubblewrapSandbox
) -> None:
    # inside: the task on stdin, the two variables and no other of the worker's, no route
    # out (the endpoint's own TCP port on the host's loopback is not this loopback), the
    # relay's port answering as the endpoint does
    probe = python("""
        import json, os, socket, sys, urllib.request
        task = json.load(sys.stdin)
        port = int(sys.argv[1])
        def tcp(host, p):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect((host, p))
                return "connected"
            except OSError as err:
                return type(err).__name__
        models = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
        listed = json.load(urllib.request.urlopen(models))["data"][0]["id"]
        print(json.dumps({"task": task, "env": sorted(os.environ), "models": listed,
              "host_port": tcp("127.0.0.1", port), "outside": tcp("1.1.1.1", 80)}))
    """)
    cfg, chat, _, _ = policy
    model = Scripted(chat, [])
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())

    async def body() -> Outcome:
        await endpoint.start(unix=True)
        try:
            main = CommandAgent([*probe, str(endpoint.port)], "", endpoint.socket_path, box, 20)
            return await play(endpoint, main, "g1-m0", "the prompt", {"answer": "7"},
                              lambda t: t, 20, 4)  # fmt: skip
        finally:
            await endpoint.stop()

    out = asyncio.run(body())
    assert out.status == "ok", out.error
    seen = json.loads(out.answer or "{}")
    assert seen["task"] == {"prompt": "the prompt", "data": {"answer": "7"}}
    assert seen["env"] == ["HOME", "LANG", "OPENAI_API_KEY", "OPENAI_BASE_URL", "PATH", "PWD"]
    assert seen["host_port"] == "ConnectionRefusedError"
    assert seen["outside"] in ("OSError", "ConnectionRefusedError", "TimeoutError")
    assert seen["models"] == "policy"


@needs_bwrap
def test_the_ends_a_program_may_meet(policy: Any, box: BubblewrapSandbox) -> None:
    out, _, _ = program(
        policy, [], python("import sys; sys.stderr.write('boom'); sys.exit(3)"), box
    )
    assert out.status == "error" and out.error.endswith("status 3: boom"), out.error

    out, _, _ = program(policy, [], python("import time; time.sleep(60)"), box, timeout_s=1.0)
    assert out.status == "timeout" and "episode_timeout_s" in out.error

    flood = python("import sys\nwhile True: sys.stdout.write('x' * 65536)")
    out, _, _ = program(policy, [], flood, box)
    assert out.status == "error" and "flooded" in out.error

    out, _, _ = program(policy, [], ["no-such-program"], box)
    assert out.status == "error" and "status 127" in out.error


def test_without_isolation_the_program_gets_the_tcp_endpoint(policy: Any) -> None:
    # tools.sandbox = "subprocess": no namespaces, the endpoint's TCP address itself
    probe = [sys.executable, "-c", "import os; print(os.environ['OPENAI_BASE_URL'])"]
    out, _, endpoint = program(policy, [], probe, None)
    assert out.status == "ok" and out.answer == endpoint.base_url


@needs_bwrap
def test_many_programs_side_by_side(policy: Any, box: BubblewrapSandbox) -> None:
    # as root each program runs as a uid of its own: side by side under one shared uid,
    # each met the others' tasks in its process limit and its relay could not start a
    # thread (most of 48 episodes failed before)
    cfg, chat, _, _ = policy

    class Instant(Scripted):
        async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
            await asyncio.sleep(0.05)
            text = calculator_call("2+3") if request.seed % 2 == 0 else "<answer>5</answer>"
            ids = self.chat.assistant_turn(text)
            return GenResult(ids, [-0.5] * len(ids), stopped=True), 0

    endpoint = Endpoint(Instant(chat, []), chat, cfg.rollout, structlog.get_logger())

    async def body() -> list[Outcome]:
        await endpoint.start(unix=True)
        try:
            main = CommandAgent(["python3", "program.py"], str(EXAMPLE_DIR),
                                endpoint.socket_path, box, 60)  # fmt: skip
            return await asyncio.gather(
                *(play(endpoint, main, f"g{i}-m0", "Compute 2+3.", {}, lambda t: t, 60, 4)
                  for i in range(32))
            )  # fmt: skip
        finally:
            await endpoint.stop()

    outs = asyncio.run(body())
    assert [(o.status, o.answer) for o in outs] == [("ok", "5")] * 32, [
        o.error for o in outs if o.status != "ok"
    ][:2]
