"""JSON values as types: what `json.loads` returns and `json.dumps` takes, for code that
builds or reads JSON documents (the OpenAI-compatible endpoint's bodies, tool schemas,
meta files) without falling back to `Any`."""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = "bool | int | float | str | list[JSON] | dict[str, JSON] | None"
JSONObject: TypeAlias = "dict[str, JSON]"
