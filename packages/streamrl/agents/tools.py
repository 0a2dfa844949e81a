"""Tools as an environment offers them: a JSON schema plus `apply()` or `apply_async()`.

A tool's code runs in the rollout worker, so it must be trusted. Code the policy writes
(python, shell) never runs here: `SandboxTool` sends such a call to the tool workers, which
run it in a hardened sandbox. `FinishTool` is how a tool environment's agent ends its
episode. Every call gets a `CallContext` whose `call_id` is unique per call and the same when
an episode is replayed (the idempotency key of its side effects).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from streamrl.agents.base import ToolInfraError
from streamrl.jsontypes import JSON, JSONObject
from streamrl.wire import ToolResult

ToolKind = Literal["local", "sandbox", "external"]

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


class ToolArgumentError(ValueError):
    """Arguments a tool cannot accept; the message goes back to the agent."""


def parse_arguments(parameters: JSONObject, arguments: str) -> JSONObject:
    """Decode a call's JSON arguments and check them against a flat JSON-object schema
    (required names, no unknown names, JSON types of the values)."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as err:
        raise ToolArgumentError(
            f"arguments are not valid JSON: {err.msg} at char {err.pos}"
        ) from None
    if not isinstance(args, dict):
        raise ToolArgumentError("arguments must be a JSON object")
    props = parameters.get("properties", {})
    required = parameters.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        raise TypeError(f"not a JSON-object schema `check_schema` accepts: {parameters!r}")
    for name in required:
        if name not in args:
            raise ToolArgumentError(f"missing required argument `{name}`")
    for name, value in args.items():
        if name not in props:
            raise ToolArgumentError(f"unknown argument `{name}`")
        kind = _property_type(props[name])
        want = _JSON_TYPES[kind]
        if not isinstance(value, want) or isinstance(value, bool) is not (want is bool):
            raise ToolArgumentError(f"argument `{name}` must be of type {kind}")
    return args


def _property_type(spec: JSON) -> str:
    """The JSON type a property's schema names (one of `_JSON_TYPES`, as `check_schema`
    requires)."""
    kind = spec["type"] if isinstance(spec, dict) else None
    if not isinstance(kind, str):
        raise TypeError(f"a property schema without a JSON type: {spec!r}")
    return kind


_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


def check_schema(name: object, description: object, parameters: object) -> None:
    """Raise ValueError, saying what is wrong, unless this is a tool schema that
    `parse_arguments` can check calls against: a name, a description, and a JSON-object
    schema whose properties each have a JSON type and whose required names are properties."""
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r} must match {_TOOL_NAME.pattern}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError(f"tool `{name}`: description must be a non-empty string")
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ValueError(f'tool `{name}`: parameters must be a JSON schema {{"type": "object"}}')
    props = parameters.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"tool `{name}`: parameters.properties must be an object")
    for prop, spec in props.items():
        if not isinstance(spec, dict) or spec.get("type") not in _JSON_TYPES:
            raise ValueError(
                f"tool `{name}`: property `{prop}` needs a type among {sorted(_JSON_TYPES)}"
            )
    required = parameters.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ValueError(
            f"tool `{name}`: parameters.required {required!r} must list properties {sorted(props)}"
        )


def function_schema(name: str, description: str, parameters: JSONObject) -> JSONObject:
    """A tool as chat templates list it (OpenAI function format)."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


@dataclass(frozen=True)
class ToolOutput:
    ok: bool
    output: str
    error: str = ""

    def render(self) -> str:
        """The tool result as the agent reads it."""
        if self.ok:
            return self.output
        return f"error: {self.error}" + (f"\n{self.output}" if self.output else "")


@dataclass(frozen=True)
class CallContext:
    call_id: str


class Tool:
    """Subclass and override `apply` (blocking: run on a thread) or `apply_async`.

    `kind` picks the limit a call counts against: `local` (in-process, no limit),
    `sandbox` (the tool workers), `external` (a remote service).

    `idempotent` False: a call has side effects that must not repeat. A tool environment
    with a ledger (`streamrl.tools.ledger`) then runs each call once per idempotency key
    (call id + arguments); a replayed episode gets the recorded result.
    """

    name: str
    description: str
    parameters: JSONObject  # a JSON schema of type object
    kind: ToolKind = "local"
    idempotent: bool = True

    def schema(self) -> JSONObject:
        return function_schema(self.name, self.description, self.parameters)

    def apply(self, args: JSONObject, ctx: CallContext) -> ToolOutput:
        raise NotImplementedError(f"{type(self).__name__} implements neither apply nor apply_async")

    async def apply_async(self, args: JSONObject, ctx: CallContext) -> ToolOutput:
        return await asyncio.to_thread(self.apply, args, ctx)


@dataclass
class FunctionTool(Tool):
    """A trusted Python function as a tool: `fn(**args)` returns the output text; an
    exception it raises becomes a tool error."""

    name: str
    description: str
    parameters: JSONObject
    fn: Callable[..., str]
    kind: ToolKind = "local"
    idempotent: bool = True

    def apply(self, args: JSONObject, ctx: CallContext) -> ToolOutput:
        try:
            return ToolOutput(True, str(self.fn(**args)))
        except Exception as err:
            return ToolOutput(False, "", f"{type(err).__name__}: {err}")


class ToolCaller(Protocol):
    """The rollout side of the tool workers (`streamrl.tools.client.ToolClient`)."""

    async def call(self, name: str, arguments: str, call_id: str) -> ToolResult: ...


@dataclass
class SandboxTool(Tool):
    """A tool whose call runs on a tool worker, in its sandbox. An infrastructure failure
    (no worker answered, the sandbox is unavailable) raises `ToolInfraError`.

    It stays `idempotent` here even when its calls have side effects: the tool worker keeps
    their ledger (`tools.non_idempotent`), where a resent call is caught too."""

    name: str
    description: str
    parameters: JSONObject
    caller: ToolCaller
    kind: ToolKind = "sandbox"

    async def apply_async(self, args: JSONObject, ctx: CallContext) -> ToolOutput:
        result = await self.caller.call(self.name, json.dumps(args), ctx.call_id)
        if result.infra:
            raise ToolInfraError(f"tool `{self.name}` call {ctx.call_id}: {result.error}")
        return ToolOutput(result.ok, result.output, result.error)


@dataclass
class FinishTool(Tool):
    """`finish(answer)`: the agent's final answer; a tool environment ends the episode."""

    name: str = "finish"
    description: str = "Give your final answer and end the episode."
    parameters: JSONObject = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The final answer."}},
            "required": ["answer"],
        }
    )

    def apply(self, args: JSONObject, ctx: CallContext) -> ToolOutput:
        return ToolOutput(True, str(args["answer"]))
