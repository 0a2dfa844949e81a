"""An agent written against the `openai` client alone (it imports nothing of streamrl): the
calculator tool, run by the agent itself, until the model answers (issue 31).

streamrl calls `main` once per episode with the endpoint's base URL, the episode's API key,
the task's prompt and data; the value returned is the episode's answer, which the task's
reward scores. Any OpenAI-compatible server would serve it the same way.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37+58"}},
            "required": ["expression"],
        },
    },
}
_OPS: dict[type[ast.AST], Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error message (no eval of code)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as err:
        return f"error: {err}"


async def main(base_url: str, api_key: str, prompt: str, data: dict[str, Any]) -> str | None:
    """Ask, run each calculator call, send the results back, until a turn calls nothing."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": prompt}]
    try:
        while True:
            out = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[CALCULATOR],  # type: ignore[list-item]
            )
            reply = out.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                text = reply.content or ""
                found = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
                return found.group(1).strip() if found else text.strip() or None
            for call in reply.tool_calls:
                try:
                    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
                    result = calculate(str(args.get("expression", "")))
                except (ValueError, AttributeError) as err:
                    result = f"error: {err}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
