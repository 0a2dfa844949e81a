"""One batched decode loop shared by every concurrent episode of a rollout worker.

Episodes await `generate()` on the event loop; the server gathers the calls that arrive
within `batch_wait_ms` (up to `max_batch_size`) into one device call, run on a single
dedicated thread so the event loop keeps serving tool results and weight-sync signals
meanwhile. Each result carries the policy version of the params it was sampled with.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from streamrl.model.generate import Generator, GenRequest, GenResult


@dataclass
class _Pending:
    request: GenRequest
    future: asyncio.Future[tuple[GenResult, int]]


class ModelServerError(RuntimeError):
    """The model fails every call: the worker stops rather than fail every episode."""


class ModelServer:
    """Batches model calls from many episodes into device calls on one thread.

    A failing device call fails only the episodes whose requests caused it (the batch is
    retried one request at a time). After `max_consecutive_failures` failed calls in a row
    the model itself is broken, and `serve()` raises ModelServerError.
    """

    def __init__(
        self,
        generator: Generator,
        params: Any,
        version: int,
        max_batch_size: int,
        batch_wait_ms: float,
        log: structlog.stdlib.BoundLogger,
        max_consecutive_failures: int = 16,
    ) -> None:
        self.generator = generator
        self._params = params
        self.version = version
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000
        self.log = log
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.batches = 0
        self.busy_s = 0.0
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0

    def set_weights(self, params: Any, version: int) -> None:
        """Swap the params; batches already running finish on the old version."""
        self._params = params
        self.version = version

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        """Sample one turn; returns the result and the policy version that produced it.

        A request the generator cannot take (too long, say) raises ValueError here, before it
        can fail a whole batch.
        """
        self.generator.check(request)
        fut: asyncio.Future[tuple[GenResult, int]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(request, fut))
        return await fut

    async def serve(self) -> None:
        """Run batches until cancelled."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                batch = await self._gather()
                if not batch:
                    continue
                await self._run_batch(loop, batch)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Pending]) -> None:
        params, version = self._params, self.version
        start = time.monotonic()
        try:
            results = await loop.run_in_executor(
                self._executor, self.generator.generate, params, [p.request for p in batch]
            )
        except Exception as err:  # fails the episodes that caused it, never the server
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(err)
                self.consecutive_failures += 1
                if self.consecutive_failures >= self.max_consecutive_failures:
                    raise ModelServerError(
                        f"{self.consecutive_failures} model calls failed in a row; last: "
                        f"{type(err).__name__}: {err}"
                    ) from err
                return
            # One bad request must not fail its batch-mates: run each alone to find it.
            self.log.exception("model_batch_failed", batch=len(batch))
            for p in batch:
                await self._run_batch(loop, [p])
            return
        self.busy_s += time.monotonic() - start
        self.batches += 1
        self.consecutive_failures = 0
        for p, r in zip(batch, results, strict=True):
            if not p.future.done():  # its episode may have been cancelled
                p.future.set_result((r, version))

    async def _gather(self) -> list[_Pending]:
        first = await self._queue.get()
        batch = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), left))
            except TimeoutError:
                break
        while len(batch) < self.max_batch_size and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return [p for p in batch if not p.future.cancelled()]
