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
from typing import Any

from streamrl.tools.sandbox import TRUNCATED, ExecResult, Sandbox

CALCULATOR_MAIN = str(Path(__file__).with_name("calculator_main.py"))


class ToolInputError(ValueError):
    """Arguments a tool cannot accept; the message goes back to the agent."""


@dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str
    error: str = ""


@dataclass(frozen=True)
class Tool:
    """A tool as the agent sees it (`name`, `description`, JSON-schema `parameters`) and
    as the worker runs it (`command` builds argv and stdin from validated arguments)."""

    name: str
    description: str
    parameters: dict[str, Any]
    command: Callable[[dict[str, Any]], tuple[list[str], bytes]]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


def parse_arguments(tool: Tool, arguments: str) -> dict[str, Any]:
    """Decode and check a call's JSON arguments against the tool's (flat) schema."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise ToolInputError(f"arguments are not valid JSON: {err.msg} at char {err.pos}") from None
    if not isinstance(args, dict):
        raise ToolInputError("arguments must be a JSON object")
    props: dict[str, Any] = tool.parameters.get("properties", {})
    for name in tool.parameters.get("required", []):
        if name not in args:
            raise ToolInputError(f"missing required argument `{name}`")
    for name, value in args.items():
        if name not in props:
            raise ToolInputError(f"unknown argument `{name}`")
        want = _JSON_TYPES[props[name]["type"]]
        if not isinstance(value, want) or isinstance(value, bool) is not (want is bool):
            raise ToolInputError(f"argument `{name}` must be of type {props[name]['type']}")
    return args


def _calculator_command(args: dict[str, Any]) -> tuple[list[str], bytes]:
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
)

TOOLS: dict[str, Tool] = {t.name: t for t in (CALCULATOR,)}


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


def run_call(
    sandbox: Sandbox, name: str, arguments: str, time_limit_s: float, output_cap: int
) -> Outcome:
    """Run one call; every failure of the call's own making is a tool error."""
    tool = TOOLS.get(name)
    if tool is None:
        return Outcome(False, "", f"unknown tool `{name}`; available: {sorted(TOOLS)}")
    try:
        args = parse_arguments(tool, arguments)
    except ToolInputError as err:
        return Outcome(False, "", str(err))
    argv, stdin = tool.command(args)
    return interpret(sandbox.exec(argv, stdin, time_limit_s, output_cap), time_limit_s)
