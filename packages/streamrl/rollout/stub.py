"""The stub policy of the rollout side (`model.kind = "stub"`): no model, no tokenizer.

It measures the orchestration alone (Redis, workers, grouping, weight sync): each model
call answers `stub_turn_tokens` tokens after `stub_latency_s` of `asyncio.sleep`, so
concurrent calls overlap as they would in a batched engine. Everything else is the real
path: the episode runner, the weight follower and its sync lock, the policy versions the
trainer publishes (the stub trainer publishes a tiny real version; `StubLoader` reads and
checks its bytes, `StubServer.swap` takes its version number), the trajectories.

Token ids are UTF-8 bytes (0-255) plus one stop id; an answer's tokens spell `STUB_REPLY`
(cycled to the turn's length) and end with the stop id. Every sampled token has the
log-prob `STUB_LOGPROB`: finite and nonzero, as the trainer requires of rollout log-probs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from streamrl.model.requests import GenRequest, GenResult
from streamrl.model.spec import PyTree
from streamrl.names import Keys
from streamrl.weightsync import WeightsError, read_published
from streamrl.wire import Weights

__all__ = ["STOP_ID", "STUB_LOGPROB", "STUB_REPLY", "StubDialogue", "StubLoader", "StubServer"]

STOP_ID = 256  # the one id past the bytes: ends a turn
STUB_REPLY = "stub reply. "  # what an answer's tokens spell (no tool call, no answer tag)
STUB_LOGPROB = -1.0


def reply_tokens(n: int, stopped: bool) -> list[int]:
    """`n` tokens spelling STUB_REPLY, cycled; the last is STOP_ID when `stopped`."""
    text = STUB_REPLY.encode()
    ids = [text[i % len(text)] for i in range(n - 1 if stopped else n)]
    return [*ids, STOP_ID] if stopped else ids


class StubServer:
    """Answers model calls after `latency_s` with `turn_tokens` tokens (fewer, and not
    stopped, when the request allows fewer), tagged with the version served when the call
    started. The interface of the engine server that the episode runner, the rollout
    worker and the weight follower use: `generate`, `serve`, `hold`, `release`, `swap`.

    `hold` and `release` may be called from another thread (the colocated worker's
    trainer): they take effect on the event loop, as the engine's take effect at its next
    chunk boundary.
    """

    def __init__(self, latency_s: float, turn_tokens: int, version: int = -1) -> None:
        self.latency_s = latency_s
        self.turn_tokens = turn_tokens
        self.version = version
        self._open = asyncio.Event()  # cleared while held: new calls wait
        self._open.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.steps = 0  # calls answered (the engine's decode steps, for the stop log)
        self.tokens_generated = 0
        self.in_flight = 0  # calls sleeping now (the stub's batch occupancy)
        self.swaps = 0
        self.stall_s = 0.0  # the stub never stalls on a sync: nothing to reload

    def occupancy(self) -> None:
        """No KV pool: adaptive admission grows to its cap."""
        return None

    def stalled_s(self) -> float:
        """0: the stub answers on the event loop, which the rollout's liveness watches."""
        return 0.0

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        self._bind()
        await self._open.wait()
        started_ns = time.time_ns()
        version = self.version
        self.in_flight += 1
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
        n = min(self.turn_tokens, request.max_new_tokens)
        stopped = n == self.turn_tokens
        tokens = reply_tokens(n, stopped)
        self.steps += 1
        self.tokens_generated += n
        result = GenResult(
            tokens=tokens, logprobs=[STUB_LOGPROB] * n, stopped=stopped, started_ns=started_ns
        )
        return result, version

    def end_session(self, session: str) -> None:
        """The stub keeps nothing between turns."""

    async def serve(self) -> None:
        """Nothing runs beside the calls: wait until cancelled."""
        self._bind()
        await asyncio.Event().wait()

    def hold(self) -> None:
        """New calls wait until `swap` or `release`; calls already sleeping finish."""
        self._on_loop(self._open.clear)

    def release(self) -> None:
        self._on_loop(self._open.set)

    async def swap(self, params: PyTree, version: int) -> None:
        """Serve `version` from now on (the stub has no params to use); releases a hold."""
        del params
        self.version = version
        self.swaps += 1
        self._open.set()

    def _bind(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()

    def _on_loop(self, fn: Callable[[], object]) -> None:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)


class StubLoader:
    """Published version -> nothing to serve, once its bytes are read and their size and
    checksum verified (WeightsError otherwise: the follower refuses it and logs why). The
    stub trainer publishes full versions only."""

    def __init__(self, client: redis.Redis | None, keys: Keys, weights_dir: Path | None) -> None:
        self.client = client
        self.keys = keys
        self.weights_dir = weights_dir

    def __call__(self, msg: Weights, base_msg: Weights | None) -> None:
        del base_msg
        if msg.kind != "full":
            raise WeightsError(f"version {msg.version}: the stub policy serves full versions only")
        read_published(msg, self.client, self.keys, self.weights_dir)


class StubDialogue:
    """The `streamrl.chat.hf.Dialogue` of the stub: UTF-8 bytes as token ids, no template.

    The prompt is the user text's bytes, tool results their bytes joined by newlines;
    an assistant turn decodes its byte ids (the stop id dropped) as text."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        del tools  # the stub lists no tools in its prompt: its answers call none

    def prompt(self, user_text: str) -> list[int]:
        return list(user_text.encode())

    def assistant(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < STOP_ID).decode(errors="replace")

    def tool_results(self, results: list[str]) -> list[int]:
        return list(("\n" + "\n".join(results) + "\n").encode())
