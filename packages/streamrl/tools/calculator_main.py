"""Calculator tool body: evaluates one arithmetic expression read from stdin.

Runs as its own process inside the sandbox (`python -I -S calculator_main.py`), so it
imports nothing from streamrl. Only numbers, + - * / // % ** (small exponents), unary
signs and parentheses are accepted; anything else is an error on stderr with exit code 2.
"""

import ast
import operator
import sys
from collections.abc import Callable

_BIN: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
MAX_EXPONENT = 64
MAX_LENGTH = 256


def evaluate(node: ast.AST) -> float:
    """The value of a parsed expression (an int or a float)."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and type(node.value) in (int, float)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        return _BIN[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](evaluate(node.operand))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def main() -> int:
    expr = sys.stdin.read(MAX_LENGTH + 1).strip()
    if len(expr) > MAX_LENGTH:
        print(f"expression longer than {MAX_LENGTH} characters", file=sys.stderr)
        return 2
    try:
        value = evaluate(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        print(f"cannot evaluate {expr!r}: {err}", file=sys.stderr)
        return 2
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
