"""The continuous-batching engine behind the rollout worker's event loop.

Episodes await `generate()` on the event loop; one dedicated thread owns the engine and
runs `step()` while there is work, so every concurrent episode shares one decode loop and
the event loop stays free for tool results and weight-sync signals. New weights are applied
by the engine thread between steps; each result carries the lowest policy version that
sampled any of its tokens.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any

import structlog

from streamrl.model.engine import Engine
from streamrl.model.sampling import GenRequest, GenResult


class EngineServerError(RuntimeError):
    """The engine failed too many steps in a row: the worker stops."""


@dataclass
class _Call:
    request: GenRequest
    future: asyncio.Future[tuple[GenResult, int]]
    loop: asyncio.AbstractEventLoop
    version: int = -1


class EngineServer:
    def __init__(
        self,
        engine: Engine,
        version: int,
        log: structlog.stdlib.BoundLogger,
        max_consecutive_failures: int = 8,
    ) -> None:
        self.engine = engine
        self.version = version
        self.log = log
        self.max_consecutive_failures = max_consecutive_failures
        self._inbox: queue.SimpleQueue[_Call | int] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._weights: tuple[Any, int] | None = None
        self._calls: dict[int, _Call] = {}
        self.steps = 0

    # -- event-loop side -------------------------------------------------------------------

    async def generate(self, request: GenRequest) -> tuple[GenResult, int]:
        """Sample one turn; the result and the policy version that produced it.

        A request the engine cannot take raises ValueError here, naming the sizes.
        """
        self.engine.check(request)
        loop = asyncio.get_running_loop()
        call = _Call(request, loop.create_future(), loop)
        self._inbox.put(call)
        self._wake.set()
        try:
            return await call.future
        except asyncio.CancelledError:
            self._inbox.put(id(call))  # free its slot
            self._wake.set()
            raise

    def set_weights(self, params: Any, version: int) -> None:
        """New params for the next engine step; sequences in flight go on with them."""
        self._weights = (params, version)
        self._wake.set()

    async def serve(self) -> None:
        """Run the engine thread until cancelled; re-raises its failure."""
        thread_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        thread = threading.Thread(
            target=self._thread_main, args=(thread_done,), name="engine", daemon=True
        )
        thread.start()
        try:
            await thread_done
        finally:
            self._stop.set()
            self._wake.set()
            await asyncio.to_thread(thread.join, 10)

    # -- engine thread ---------------------------------------------------------------------

    def _thread_main(self, done: asyncio.Future[None]) -> None:
        loop = done.get_loop()
        try:
            self._run()
        except BaseException as err:
            loop.call_soon_threadsafe(_set_exception, done, err)
        else:
            loop.call_soon_threadsafe(_set_result, done)

    def _run(self) -> None:
        failures = 0
        handles: dict[int, int] = {}  # id(call) -> engine handle
        while not self._stop.is_set():
            self._drain(handles)
            if self._weights is not None:
                params, self.version = self._weights
                self._weights = None
                self.engine.set_params(params)
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                finished = self.engine.step()
            except Exception as err:
                failures += 1
                self._fail_all(err)
                if failures >= self.max_consecutive_failures:
                    raise EngineServerError(
                        f"{failures} engine steps failed in a row; last: "
                        f"{type(err).__name__}: {err}"
                    ) from err
                continue
            failures = 0
            self.steps += 1
            for handle, result in finished:
                call = self._calls.pop(handle, None)
                if call is not None:
                    handles.pop(id(call), None)
                    _resolve(call, (result, call.version))

    def _drain(self, handles: dict[int, int]) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, int):  # a cancelled call
                handle = handles.pop(item, None)
                if handle is not None:
                    self.engine.cancel(handle)
                    self._calls.pop(handle, None)
                continue
            item.version = self.version
            try:
                handle = self.engine.submit(item.request)
            except ValueError as err:
                _reject(item, err)
                continue
            self._calls[handle] = item
            handles[id(item)] = handle

    def _fail_all(self, err: Exception) -> None:
        self.log.error("engine_step_failed", error=f"{type(err).__name__}: {err}",
                       sequences=len(self._calls))  # fmt: skip
        for handle, call in list(self._calls.items()):
            self.engine.cancel(handle)
            _reject(call, err)
        self._calls.clear()


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[Any], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def _resolve(call: _Call, value: tuple[GenResult, int]) -> None:
    def put() -> None:
        if not call.future.done():
            call.future.set_result(value)

    call.loop.call_soon_threadsafe(put)


def _reject(call: _Call, err: BaseException) -> None:
    call.loop.call_soon_threadsafe(_set_exception, call.future, err)
