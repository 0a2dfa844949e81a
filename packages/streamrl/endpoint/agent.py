"""An agent of the OpenAI kind as a coroutine: one episode played through the endpoint
(issue 31 item 3, the coroutine half).

`task.agent = "openai:package.module:main"` names an async function called once per episode
as `main(base_url=..., api_key=..., prompt=..., data=...)`: it talks to the endpoint with
any OpenAI-style client (the key is the episode's, the base URL the worker's endpoint) and
returns its answer (a string, or None), which the task's reward scores as the built-in
agent's `<answer>`. `play` runs it under the episode's limits:

- `timeout_s` (rollout.episode_timeout_s): past it the coroutine is cancelled, status
  `timeout`;
- `max_calls` (rollout.max_steps): the endpoint refuses a call past it (400,
  `model_call_limit`); an agent that then returns ends `truncated`, as does one whose last
  call ran out of tokens (`finish_reason` `length`);
- an exception out of the agent ends the episode `error` with its message; the worker goes
  on.

Whatever ends it, the episode's key dies and its KV slot is freed (`Endpoint.close`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from streamrl.endpoint.server import Endpoint, Episode
from streamrl.plugins import PluginError, load_object
from streamrl.wire import Status

PREFIX = "openai:"
AgentMain = Callable[..., Awaitable[object]]


def is_openai_agent(ref: str) -> bool:
    return ref.startswith(PREFIX)


def load_agent(ref: str, field: str = "task.agent") -> AgentMain:
    """The async function `openai:package.module:main` names, or PluginError."""
    if not is_openai_agent(ref):
        raise PluginError(f"{field} = {ref!r}: an agent of the OpenAI kind is `openai:module:fn`")
    fn = load_object(ref.removeprefix(PREFIX), field)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(
            f"{field} = {ref!r}: {fn!r} is not an async function (`async def main(base_url, "
            "api_key, prompt, data)`)"
        )
    return fn  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Outcome:
    """How an agent's episode ended: what the endpoint holds, the status, the answer."""

    episode: Episode
    status: Status
    answer: str | None
    error: str


async def play(
    endpoint: Endpoint,
    main: AgentMain,
    episode: str,
    prompt: str,
    data: dict[str, Any],
    seed: Callable[[int], int],
    timeout_s: float,
    max_calls: int,
) -> Outcome:
    """Play one episode of the agent `main` (see the module's doc); never raises for the
    agent's own failures."""
    key = endpoint.open(episode, seed, max_calls=max_calls)
    status: Status = "ok"
    answer: str | None = None
    error = ""
    try:
        async with asyncio.timeout(timeout_s):
            result = await main(base_url=endpoint.base_url, api_key=key, prompt=prompt, data=data)
        answer = None if result is None else str(result)
    except TimeoutError:
        status, error = "timeout", f"the agent ran past episode_timeout_s ({timeout_s:g}s)"
    except Exception as err:  # the agent's own failure ends its episode, not the worker
        status, error = "error", f"{type(err).__name__}: {err}"
    finally:
        ep = endpoint.close(key)
    if status == "ok" and (ep.limited or ep.last_finish == "length"):
        status = "truncated"
    return Outcome(ep, status, answer, error)
