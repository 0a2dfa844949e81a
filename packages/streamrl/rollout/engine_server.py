"""The continuous-batching engine behind the rollout worker's event loop.

Episodes await `generate()` on the event loop; one dedicated thread owns the engine and
runs `step()` while there is work, so every concurrent episode shares one decode loop and
the event loop stays free for tool results and weight-sync signals.

New weights are swapped in by the engine thread between decode chunks (`swap`); each
result carries the lowest policy version that sampled any of its tokens. `hold` stops the
thread at the next chunk boundary until the swap (the `pause` sync mode): sequences in
flight wait, requests that arrive meanwhile are taken only after the swap, so they are
sampled by the new version alone. A swap also drops the engine's parked KV slots (see
`streamrl.model.engine`: the new params would not compute those keys/values);
`end_session` frees an episode's parked slot when it ends. The time the engine spent held
or swapping while it had work is counted (`stall_s`): the decode time weight sync cost.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TypeVar

import structlog

from streamrl.config import RolloutConfig
from streamrl.model.engine import Engine, EngineConfig
from streamrl.model.sampling import GenRequest, GenResult, SamplingParams
from streamrl.model.spec import PyTree
from streamrl.rollout.admission import Occupancy

T = TypeVar("T")


def engine_config(
    r: RolloutConfig,
    stop_ids: tuple[int, ...],
    pad_id: int,
    *,
    greedy: bool = False,
    num_slots: int | None = None,
) -> EngineConfig:
    """The engine a rollout worker (or the evaluator) runs for `rollout` settings: its
    slots (`max_batch_size`, unless `num_slots`), each turn's budget, the sampling (greedy:
    top-k 1 at temperature 1), and a prompt as long as a slot holds, for later turns carry
    the whole conversation so far."""
    sampling = (
        SamplingParams(temperature=1.0, top_p=1.0, top_k=1)
        if greedy
        else SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    )
    return EngineConfig(
        num_slots=r.max_batch_size if num_slots is None else num_slots,
        kv_cache_size=r.kv_cache_size,
        max_prompt_length=r.kv_cache_size - 1,
        max_new_tokens=r.max_turn_tokens,
        sampling=sampling,
        stop_ids=stop_ids,
        pad_id=pad_id,
        decode_chunk=r.decode_chunk,
        kv_reuse=r.kv_reuse,
    )


class EngineServerError(RuntimeError):
    """The engine failed too many steps in a row: the worker stops."""


@dataclass
class _Call:
    request: GenRequest
    future: asyncio.Future[tuple[GenResult, int]]
    loop: asyncio.AbstractEventLoop
    version: int = -1
    started_ns: int = 0  # when the engine thread took it (time.time_ns())


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
        # A call, a cancelled call's id, or a session that ended.
        self._inbox: queue.SimpleQueue[_Call | int | str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._weights: tuple[PyTree, int, Future[None]] | None = None
        self._held = threading.Event()
        self._lock = threading.Lock()  # pending weights vs the thread taking them
        self._running = False
        self._calls: dict[int, _Call] = {}
        self.steps = 0
        self._progress_at = time.monotonic()  # the last step done, or the last idle look
        self.swaps = 0
        self.stall_s = 0.0  # engine time lost to syncs: held or swapping with work pending

    # -- event-loop side -------------------------------------------------------------------

    def stalled_s(self) -> float:
        """How long the engine thread has had work and finished no step (about 0 while it
        steps, waits idle or is held for a weight sync): a thread wedged inside a step (a
        device hang, a dead collective) grows it without bound (review N9)."""
        return time.monotonic() - self._progress_at

    def occupancy(self) -> Occupancy:
        """One look at the engine's KV pool for adaptive admission (read from the event
        loop while the engine thread runs: ints and lengths, a moment's view)."""
        e = self.engine
        return Occupancy(
            slots=e.cfg.num_slots,
            held=e.active + e.parked,
            # requests the engine's last admission found no slot for (not its queue, which
            # between steps also holds next turns that take their parked slot back, nor the
            # inbox, which also carries session ends and cancels)
            waiting=e.unplaced,
            evictions=e.evictions,
            costs=dict(e.decode_costs),  # keys fixed, values replaced whole: a safe copy
        )

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

    def end_session(self, session: str) -> None:
        """The episode `session` made its last model call: free its KV slot, if parked
        (callable from any thread; applied by the engine thread after what came before)."""
        self._inbox.put(session)
        self._wake.set()

    def hold(self) -> None:
        """Stop decoding at the next chunk boundary until `swap` (or `release`)."""
        self._held.set()

    def release(self) -> None:
        """Decode again with the params held (a sync that failed)."""
        self._held.clear()
        self._wake.set()

    async def swap(self, params: PyTree, version: int) -> None:
        """Serve `params` as `version` from the next chunk on; returns once the engine
        thread has them, so every request submitted afterwards is tagged `version`.
        Releases a hold. Sequences in flight go on with the new params."""
        done: Future[None] = Future()
        with self._lock:
            if self._weights is not None:  # superseded before the thread took it
                self._weights[2].set_result(None)
            self._weights = (params, version, done)
            if not self._running:  # no engine thread (before `serve`): apply here
                self._take_weights()
        self._wake.set()
        await asyncio.wrap_future(done)

    async def serve(self) -> None:
        """Run the engine thread until cancelled; re-raises its failure."""
        thread_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        thread = threading.Thread(
            target=self._thread_main, args=(thread_done,), name="engine", daemon=True
        )
        with self._lock:
            self._running = True
        thread.start()
        try:
            await thread_done
        finally:
            self._stop.set()
            self._wake.set()
            await _join(thread, 10)
            with self._lock:
                self._running = False
                self._take_weights()  # a swap the thread never got to: apply it here

    # -- engine thread ---------------------------------------------------------------------

    def _thread_main(self, done: asyncio.Future[None]) -> None:
        loop = done.get_loop()
        try:
            self._run()
        except BaseException as err:
            loop.call_soon_threadsafe(_set_exception, done, err)
        else:
            loop.call_soon_threadsafe(_set_result, done)

    def _apply(self, params: PyTree, version: int) -> None:
        start = time.monotonic()
        self.engine.set_params(params)
        self.version = version
        self.swaps += 1
        if self._calls or not self._inbox.empty():
            self.stall_s += time.monotonic() - start

    def _take_weights(self) -> None:
        """Apply pending weights, if any, and wake their `swap` (caller holds _lock)."""
        if self._weights is None:
            return
        params, version, done = self._weights
        self._weights = None
        self._held.clear()
        try:
            self._apply(params, version)
        except BaseException as err:
            done.set_exception(err)
            raise
        done.set_result(None)

    def _run(self) -> None:
        failures = 0
        handles: dict[int, int] = {}  # id(call) -> engine handle
        while not self._stop.is_set():
            # Weights first, then new requests: a request is tagged with the version that
            # will sample it.
            with self._lock:
                self._take_weights()
            if self._held.is_set():
                self._progress_at = start = time.monotonic()
                self._wake.wait(0.05)
                self._wake.clear()
                if self._calls or not self._inbox.empty():
                    self.stall_s += time.monotonic() - start
                continue
            self._drain(handles)
            if not self.engine.has_work():
                self._progress_at = time.monotonic()
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
            self._progress_at = time.monotonic()
            for handle, result in finished:
                call = self._calls.pop(handle, None)
                if call is not None:
                    handles.pop(id(call), None)
                    _resolve(call, (replace(result, started_ns=call.started_ns), call.version))

    def _drain(self, handles: dict[int, int]) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):  # an ended session
                self.engine.end_session(item)
                continue
            if isinstance(item, int):  # a cancelled call
                handle = handles.pop(item, None)
                if handle is not None:
                    self.engine.cancel(handle)
                    self._calls.pop(handle, None)
                continue
            item.version = self.version
            item.started_ns = time.time_ns()
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


async def _join(thread: threading.Thread, timeout_s: float) -> None:
    """Join `thread` (at most `timeout_s`) without holding the event loop, to the end even
    when cancelled meanwhile: a stop cancels until its tasks end (`cancel_and_wait`), and
    an engine thread left inside XLA aborts the process at exit. A cancel that arrives
    here is re-raised once the join is over."""
    joined = asyncio.ensure_future(asyncio.to_thread(thread.join, timeout_s))
    cancelled = False
    while not joined.done():
        try:
            await asyncio.shield(joined)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[T], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def _resolve(call: _Call, value: tuple[GenResult, int]) -> None:
    def put() -> None:
        if not call.future.done():
            call.future.set_result(value)

    call.loop.call_soon_threadsafe(put)


def _reject(call: _Call, err: BaseException) -> None:
    call.loop.call_soon_threadsafe(_set_exception, call.future, err)
