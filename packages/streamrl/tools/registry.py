"""Tools: a JSON schema for the agent plus how a tool worker runs a call in the sandbox.

This is trusted code in the tool worker. It validates the call's arguments, turns them into
a sandboxed command, and turns the command's result into what the agent sees. Bad input of
any kind becomes a tool error, never an exception.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from streamrl.agents.tools import (
    ToolArgumentError,
    check_schema,
    function_schema,
    parse_arguments,
)
from streamrl.config import ToolsConfig
from streamrl.jsontypes import JSONObject
from streamrl.plugins import PluginError, load_object
from streamrl.tools import harness
from streamrl.tools.sandbox import TRUNCATED, ExecResult, Sandbox

CALCULATOR_MAIN = str(Path(__file__).with_name("calculator_main.py"))


@dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str
    error: str = ""


@dataclass(frozen=True)
class Tool:
    """A tool as the agent sees it (`name`, `description`, JSON-schema `parameters`) and
    as the worker runs it (`command` builds argv and stdin from validated arguments;
    `report` turns the finished command into what the agent sees; default: `interpret`).

    `command` and `report` are trusted code that runs in the tool worker; the command they
    build runs in the sandbox. An argv starting with `sys.executable` means "the sandbox's
    Python": each backend maps it (`streamrl.tools.sandbox.portable_argv`). Exported by
    `streamrl.api` as `WorkerTool`; `python_tool` builds the common kind.

    `needs_isolation`: the command runs code the policy wrote (or could steer), so it runs
    only in an isolating sandbox (container or bwrap), never as a plain process unless
    `tools.sandbox = "subprocess"` says so. False only for a fixed program that parses its
    input and runs nothing from it (the calculator): on a host with no isolating sandbox it
    still runs, as a plain subprocess with rlimits."""

    name: str
    description: str
    parameters: JSONObject
    command: Callable[[JSONObject], tuple[list[str], bytes]]
    report: Callable[[ExecResult, float], Outcome] | None = None
    needs_isolation: bool = True

    def schema(self) -> JSONObject:
        return function_schema(self.name, self.description, self.parameters)


def _calculator_command(args: JSONObject) -> tuple[list[str], bytes]:
    # -I: isolated (no env vars, no user site); -S: no site import. Starts in ~10 ms.
    return [sys.executable, "-I", "-S", CALCULATOR_MAIN], str(args["expression"]).encode()


CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 37+58"}},
        "required": ["expression"],
    },
    command=_calculator_command,
    needs_isolation=False,  # a fixed parser (calculator_main.py) that evaluates no code
)


def _python_command(args: JSONObject) -> tuple[list[str], bytes]:
    # -I: no environment variables or user site; -S: the standard library only.
    return [sys.executable, "-I", "-S", "-c", str(args["code"])], b""


def _shell_command(args: JSONObject) -> tuple[list[str], bytes]:
    return ["/bin/sh", "-c", str(args["command"])], b""


def _run_tests_command(args: JSONObject) -> tuple[list[str], bytes]:
    return [sys.executable, "-I", "-S", "-c", harness.SOURCE], json.dumps(args).encode()


TIMED_OUT = "timed out after"  # how a call's error starts when it ran past its time limit


def process_report(r: ExecResult, time_limit_s: float) -> Outcome:
    """A program run as the agent sees it: its exit status, stdout and stderr. A non-zero
    status is a result, not a tool error; a time limit or the output cap is an error."""
    if r.timed_out:
        return Outcome(False, _text(r.stdout), f"{TIMED_OUT} {time_limit_s:g}s")
    if r.truncated:
        out = _text(r.stdout + TRUNCATED)
        return Outcome(False, out, "output exceeded the output cap and was cut")
    parts = [f"exit status: {r.exit_code}"]
    if r.stdout:
        parts.append("stdout:\n" + _text(r.stdout).rstrip("\n"))
    if r.stderr:
        parts.append("stderr:\n" + _text(r.stderr).rstrip("\n"))
    return Outcome(True, "\n".join(parts))


PYTHON = Tool(
    name="python",
    description="Run a Python 3 program (standard library only); returns its exit status, "
    "stdout and stderr.",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program's source."}},
        "required": ["code"],
    },
    command=_python_command,
    report=process_report,
)

SHELL = Tool(
    name="shell",
    description="Run a POSIX shell command; returns its exit status, stdout and stderr.",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string", "description": "e.g. ls -l /tmp"}},
        "required": ["command"],
    },
    command=_shell_command,
    report=process_report,
)

# Not offered to agents: the code task's reward runs the hidden tests with it.
RUN_TESTS = Tool(
    name="run_tests",
    description="Run a candidate function on test inputs (streamrl.tools.harness).",
    parameters={
        "type": "object",
        "properties": {
            "code": {"type": "string"},
            "entry": {"type": "string"},
            "inputs": {"type": "array"},
            "marker": {"type": "string"},
        },
        "required": ["code", "entry", "inputs", "marker"],
    },
    command=_run_tests_command,
)

TOOLS: dict[str, Tool] = {t.name: t for t in (CALCULATOR, PYTHON, SHELL, RUN_TESTS)}


def python_tool(
    name: str,
    description: str,
    parameters: JSONObject,
    source: str,
    report: Callable[[ExecResult, float], Outcome] | None = None,
    needs_isolation: bool = True,
) -> Tool:
    """A tool whose call runs the Python program `source` in the sandbox (isolated mode,
    standard library only) with the call's arguments as a JSON object on stdin; what it
    prints is the result (`report`, default `interpret`: a non-zero exit is a tool error).
    `needs_isolation`: see `Tool`; keep the default unless `source` only parses its input."""

    def command(args: JSONObject) -> tuple[list[str], bytes]:
        return [sys.executable, "-I", "-S", "-c", source], json.dumps(args).encode()

    return Tool(name, description, parameters, command, report, needs_isolation)


def load_tools(cfg: ToolsConfig) -> dict[str, Tool]:
    """The built-in tools plus `tools.extra` (each reference a Tool or a list of them),
    every schema checked and every name unique; `tools.non_idempotent` must name tools."""
    tools = dict(TOOLS)
    for ref in cfg.extra:
        obj = load_object(ref, "tools.extra")
        for tool in obj if isinstance(obj, list | tuple) else [obj]:
            if not isinstance(tool, Tool):
                raise PluginError(
                    f"field `tools.extra`: `{ref}` holds a {type(tool).__name__}, not a "
                    "streamrl.api.WorkerTool"
                )
            try:
                check_schema(tool.name, tool.description, tool.parameters)
            except ValueError as err:
                raise PluginError(f"field `tools.extra`: `{ref}`: {err}") from None
            if tool.name in tools:
                raise PluginError(
                    f"field `tools.extra`: `{ref}`: a tool named `{tool.name}` exists already"
                )
            tools[tool.name] = tool
    unknown = sorted(set(cfg.non_idempotent) - set(tools))
    if unknown:
        raise PluginError(
            f"field `tools.non_idempotent`: unknown tool `{unknown[0]}`; tools: {sorted(tools)}"
        )
    return tools


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def interpret(r: ExecResult, time_limit_s: float) -> Outcome:
    """What the agent sees of a finished command."""
    if r.timed_out:
        return Outcome(False, _text(r.stdout), f"tool timed out after {time_limit_s:g}s")
    out = _text(r.stdout + (TRUNCATED if r.truncated else b"")).strip()
    if r.truncated:
        return Outcome(False, out, "tool output exceeded the output cap and was cut")
    if r.exit_code != 0:
        err = _text(r.stderr).strip() or f"exit status {r.exit_code}"
        return Outcome(False, out, err)
    return Outcome(True, out)


@runtime_checkable
class SandboxPicker(Protocol):
    """Picks the sandbox of each call (`streamrl.tools.backends.WorkerSandbox`)."""

    def for_call(self, tool: str, needs_isolation: bool) -> Sandbox: ...


def run_call(
    sandbox: Sandbox | SandboxPicker,
    name: str,
    arguments: str,
    time_limit_s: float,
    output_cap: int,
    tools: dict[str, Tool] = TOOLS,
) -> Outcome:
    """Run one call of one of `tools` in `sandbox` (a picker chooses one per tool); every
    failure of the call's own making is a tool error. A picker's `SandboxUnavailableError`
    (no isolation for a tool that needs it) propagates: an infrastructure failure."""
    tool = tools.get(name)
    if tool is None:
        return Outcome(False, "", f"unknown tool `{name}`; available: {sorted(tools)}")
    try:
        args = parse_arguments(tool.parameters, arguments)
    except ToolArgumentError as err:
        return Outcome(False, "", str(err))
    if isinstance(sandbox, SandboxPicker):
        sandbox = sandbox.for_call(tool.name, tool.needs_isolation)
    argv, stdin = tool.command(args)
    report = tool.report or interpret
    return report(sandbox.exec(argv, stdin, time_limit_s, output_cap), time_limit_s)
