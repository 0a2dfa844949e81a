"""The local sandbox backend with real child processes."""

import sys
import time

from streamrl.tools.registry import CALCULATOR, run_call
from streamrl.tools.sandbox import SubprocessSandbox
from tests.helpers import live_in_group

PY = sys.executable


def test_runs_and_captures() -> None:
    r = SubprocessSandbox().exec(
        [PY, "-c", "import sys; print(sys.stdin.read()[::-1])"], b"abc", 5.0, 1024
    )
    assert r.exit_code == 0 and r.stdout == b"cba\n" and not r.timed_out


def test_infinite_loop_is_killed_at_the_limit() -> None:
    start = time.monotonic()
    r = SubprocessSandbox().exec([PY, "-c", "while True: pass"], b"", 0.5, 1024)
    assert r.timed_out and r.exit_code is not None and r.exit_code < 0
    assert time.monotonic() - start < 3


def test_flood_is_capped_and_stopped() -> None:
    r = SubprocessSandbox().exec([PY, "-c", "while True: print('x' * 1000)"], b"", 10.0, 5000)
    assert r.truncated and len(r.stdout) == 5000 and r.duration_s < 5


def test_children_are_killed_with_the_group() -> None:
    # The child forks a grandchild that sleeps and then writes its pid; it must die too.
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(30)\n"
    )
    r = SubprocessSandbox().exec([PY, "-c", code], b"", 0.5, 1024)
    assert r.timed_out
    leader = int(r.stdout.split()[0])
    # SIGKILL is sent to the group; a loaded machine may take a moment to tear a process
    # down. The grandchild would live 30 s if it had not been killed.
    deadline = time.monotonic() + 3
    while live_in_group(leader) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_in_group(leader) == []


def test_calculator_tool() -> None:
    sb = SubprocessSandbox()
    ok = run_call(sb, "calculator", '{"expression": "37+58"}', 5.0, 1024)
    assert ok.ok and ok.output == "95"
    bad = run_call(sb, "calculator", '{"expression": "__import__(\\"os\\")"}', 5.0, 1024)
    assert not bad.ok and "unsupported syntax" in bad.error
    nojson = run_call(sb, "calculator", '{"expression": ', 5.0, 1024)
    assert not nojson.ok and nojson.error.startswith("arguments are not valid JSON")
    wrong = run_call(sb, "calculator", '{"expr": "1"}', 5.0, 1024)
    assert wrong.error == "missing required argument `expression`"
    typed = run_call(sb, "calculator", '{"expression": 5}', 5.0, 1024)
    assert typed.error == "argument `expression` must be of type string"
    unknown = run_call(sb, "browser", "{}", 5.0, 1024)
    assert unknown.error.startswith("unknown tool `browser`")
    function = CALCULATOR.schema()["function"]
    assert isinstance(function, dict) and function["name"] == "calculator"
