"""An agent written against the `openai` client alone (it imports nothing of streamrl): the
calculator tool, run by the agent itself, until the model answers (issue 31).

streamrl calls `main` once per episode with the endpoint's base URL, the episode's API key,
the task's prompt and data; the value returned is the episode's answer, which the task's
reward scores. Any OpenAI-compatible server would serve it the same way.

One HTTP connection pool serves every episode of the event loop (`_http`): building an
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
from collections.abc import AsyncGenerator
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from .calculator import CALCULATOR, calculate

_POOLS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, tuple[DefaultAsyncHttpxClient, AsyncGenerator[None, None]]
] = weakref.WeakKeyDictionary()


async def _http() -> DefaultAsyncHttpxClient:
    """The running event loop's connection pool (an httpx client serves one loop), closed
    when that loop shuts down: `asyncio.run` (and so the rollout worker) finalizes the
    loop's live async generators before closing it, and `_closed_at_shutdown` is one. Left
    open, its sockets would outlive the loop and be reclaimed at some later moment."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        pool = DefaultAsyncHttpxClient()
        closer = _closed_at_shutdown(pool)
        await anext(closer)  # runs to its `yield` without suspending: no other episode between
        _POOLS[loop] = (pool, closer)
    return _POOLS[loop][0]


async def _closed_at_shutdown(pool: DefaultAsyncHttpxClient) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await pool.aclose()


async def main(base_url: str, api_key: str, prompt: str, data: dict[str, Any]) -> str | None:
    """Ask, run each calculator call, send the results back, until a turn calls nothing."""
    pool = await _http()
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=pool)
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
