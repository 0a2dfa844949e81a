"""What a model call through the OpenAI-compatible endpoint costs, against a direct call
(issue 31).

    .venv/bin/python -m ops.bench.endpoint_call                # 400 calls, 16 at once

One process, the tiny model's chat template and tokenizer, and a model service that
answers at once with a fixed turn (`<answer>5</answer>`), so each row measures the path of
a call and nothing of a model. Each call is a one-turn episode's first call on a fresh
conversation (system-free user prompt, the calculator tool offered). Rows:

- direct: what the built-in agent does per call, the prompt rendered with the chat
  template and the call made through the worker's `ModelCalls` (the baseline);
- endpoint, raw HTTP: the same call as an HTTP request to the endpoint with a plain aiohttp
  client (the endpoint's own cost: HTTP, the request's validation, the session, the
  template, the response);
- endpoint, openai client: the example agent's client (`AsyncOpenAI` over one shared
  connection pool), what an unchanged agent pays.

Figures: calls/s and CPU ms a call (the process's CPU time over the calls), medians of
`--repeats` runs after one warm-up run; ratios against the direct row.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import structlog
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from streamrl.chat.hf import HFChat
from streamrl.config import load_config
from streamrl.endpoint.server import Endpoint
from streamrl.model.sampling import GenRequest, GenResult
from streamrl.model.tiny import ensure_checkpoint
from streamrl.obs.tracing import Tracer
from streamrl.rollout.episode import ModelCalls
from streamrl.tools.registry import CALCULATOR

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Compute 37+58 with the calculator."
TOOLS = [CALCULATOR.schema()]


class Instant:
    """A model service that answers every request at once with the same whole turn."""

    def __init__(self, chat: HFChat) -> None:
        self.ids = chat.assistant_turn("<answer>95</answer>")

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        return GenResult(list(self.ids), [-0.5] * len(self.ids), stopped=True), 0

    def end_session(self, session: str) -> None:
        pass


Call = Callable[[int], Awaitable[None]]


async def timed(calls: int, at_once: int, call: Call) -> tuple[float, float]:
    """`calls` calls, `at_once` in flight: (calls/s, CPU ms a call)."""
    gate = asyncio.Semaphore(at_once)

    async def one(i: int) -> None:
        async with gate:
            await call(i)

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(calls)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return calls / wall, cpu / calls * 1000


async def rows(chat: HFChat, calls: int, at_once: int, repeats: int) -> dict[str, list[float]]:
    cfg = load_config(REPO / "configs" / "tiny.toml")
    model = Instant(chat)
    direct_calls = ModelCalls(model, cfg.rollout, Tracer.disabled())
    endpoint = Endpoint(model, chat, cfg.rollout, structlog.get_logger())
    base = await endpoint.start()
    raw = aiohttp.ClientSession()
    pool = DefaultAsyncHttpxClient()
    body = {"model": "policy", "messages": [{"role": "user", "content": PROMPT}], "tools": TOOLS}

    async def direct(i: int) -> None:
        prompt = chat.dialogue(TOOLS).prompt(PROMPT)
        await direct_calls(GenRequest(prompt, 48, i, session=f"d{i}"), 0)

    async def raw_http(i: int) -> None:
        key = endpoint.open(f"r{i}", lambda t: t)
        headers = {"Authorization": f"Bearer {key}"}
        async with raw.post(f"{base}/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.read()
        endpoint.close(key)

    async def openai_client(i: int) -> None:
        key = endpoint.open(f"o{i}", lambda t: t)
        client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0, http_client=pool)
        out = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": PROMPT}],
            tools=TOOLS,  # type: ignore[arg-type]
        )
        assert out.choices[0].message.content
        endpoint.close(key)

    paths: dict[str, Call] = {
        "direct": direct,
        "endpoint, raw HTTP": raw_http,
        "endpoint, openai client": openai_client,
    }
    out: dict[str, list[float]] = {f"{n}/{k}": [] for n in paths for k in ("rate", "cpu")}
    try:
        for r in range(-1, repeats):  # round -1 warms every path up, not counted
            for name, call in paths.items():
                rate, cpu_ms = await timed(calls, at_once, call)
                if r >= 0:
                    out[f"{name}/rate"].append(rate)
                    out[f"{name}/cpu"].append(cpu_ms)
    finally:
        await raw.close()
        await pool.aclose()
        await endpoint.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--at-once", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    with tempfile.TemporaryDirectory(prefix="endpoint-call-") as tmp:
        cfg = load_config(REPO / "configs" / "tiny.toml", [f'model.cache_dir="{tmp}"'])
        chat = HFChat.from_dir(ensure_checkpoint(cfg))
        figures = asyncio.run(rows(chat, args.calls, args.at_once, args.repeats))
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"\n### a model call's path: {args.calls} calls, {args.at_once} at once, median of "
          f"{args.repeats} runs after a warm-up (an instant model)\n")  # fmt: skip
    print("| path | calls/s | of direct | CPU ms a call | CPU ms over direct |")
    print("|---|---:|---:|---:|---:|")
    for name in ("direct", "endpoint, raw HTTP", "endpoint, openai client"):
        rate, cpu = med[f"{name}/rate"], med[f"{name}/cpu"]
        print(f"| {name} | {rate:.0f} | {rate / med['direct/rate']:.2f} | {cpu:.2f} "
              f"| {cpu - med['direct/cpu']:+.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
