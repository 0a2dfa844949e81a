"""An agent written against the `openai` client alone (it imports nothing of streamrl): the
calculator tool, run by the agent itself, until the model answers (issue 31).

streamrl calls `main` once per episode with the endpoint's base URL, the episode's API key,
the task's prompt and data; the value returned is the episode's answer, which the task's
reward scores. Any OpenAI-compatible server would serve it the same way.

One HTTP connection pool serves every episode of the process (`_http`): building an
`AsyncOpenAI` client without one builds an httpx client, whose TLS context loads the CA
bundle (about 25 ms of CPU here, even for a plain-http URL), and at a few episodes a
second that was most of the rollout worker's event loop. Each episode still gets its own
`AsyncOpenAI` (its own API key) over the shared pool.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from .calculator import CALCULATOR, calculate

_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DefaultAsyncHttpxClient] = (
    weakref.WeakKeyDictionary()
)


def _http() -> DefaultAsyncHttpxClient:
    """The running event loop's connection pool (an httpx client serves one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS[loop] = DefaultAsyncHttpxClient()
    return _POOLS[loop]


async def main(base_url: str, api_key: str, prompt: str, data: dict[str, Any]) -> str | None:
    """Ask, run each calculator call, send the results back, until a turn calls nothing."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_http())
    messages: list[Any] = [{"role": "user", "content": prompt}]
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
