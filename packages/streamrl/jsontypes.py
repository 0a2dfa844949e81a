"""JSON values as types: what `json.loads` returns and `json.dumps` takes, for code that
builds or reads JSON documents (the OpenAI-compatible endpoint's bodies, tool schemas,
meta files) without falling back to `Any`."""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = "bool | int | float | str | list[JSON] | dict[str, JSON] | None"
JSONObject: TypeAlias = "dict[str, JSON]"


def json_object(value: object) -> JSONObject:
    """`value`, a JSON object (TypeError for another value, as indexing it would)."""
    if isinstance(value, dict):
        return value
    raise TypeError(f"a JSON object was expected, not {type(value).__name__}")


def number(value: object) -> float:
    """`float(value)` of a JSON number or of its text (TypeError for another value)."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"a number was expected, not {type(value).__name__}")


def integer(value: object) -> int:
    """`int(value)` of a JSON number or of its text (TypeError for another value)."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"an integer was expected, not {type(value).__name__}")
