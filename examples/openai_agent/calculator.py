"""The example agents' calculator: its tool schema and an evaluator of arithmetic that runs
no code (the standard library alone, so that the agent program's sandbox, which has only
the host's /usr, can import it too)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

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


MAX_EXPONENT = 64
MAX_LENGTH = 256


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or `error: ...` (no eval of code). Its text is
    the built-in calculator tool's, word for word, so that the same sampled call gets the
    same result under either agent (ops/bench/openai_agent.py compares them)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent above {MAX_EXPONENT}")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported syntax: {type(node).__name__}")

    expr = expression.strip()
    if len(expr) > MAX_LENGTH:
        return f"error: expression longer than {MAX_LENGTH} characters"
    try:
        result = value(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: cannot evaluate {expr!r}: {err}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)
