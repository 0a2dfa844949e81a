"""Weight sync on the rollout side: follow `weights`, load each new version under a lock.

The lock (`SyncLock`) is an asyncio gate plus a count of running episodes: while a sync
holds it no new episode starts. What running episodes do meanwhile is the sync mode
(`rollout.sync_mode`):

- `continue`: they go on while the new version loads and switch to it at the engine's
  next decode chunk; a model turn sampled partly by each is tagged with the older.
- `finish`: they finish on the old version; the new one, loaded meanwhile, is swapped in
  once none is left (at once if none runs).
- `pause`: the engine stops at its next chunk boundary while the new version loads, then
  goes on with it; model calls made meanwhile wait and are sampled by the new version.

Loading (fetch, checksum, decode, LoRA merge: `streamrl.rollout.loader`, the transformer
policy's, apart so that the stub's worker needs no JAX) runs on threads, so the event loop stays
free. A version that is missing, truncated, fails its checksum or does not decode, or a
`dir` version whose path is not a regular file in the run's weights directory, is
refused with a logged reason (`weights_refused`) and the worker keeps serving the last
good version. A missing version that newer ones have superseded (the trainer prunes all but
`trainer.weights_keep`, and a fast trainer can prune one between its signal and its load)
is not refused but skipped (`weights_superseded`): the follower takes the newest next.

Versions below the policy floor (`Keys.policy_floor`, set when a trainer resumes from a
checkpoint) belong to a discarded trainer lineage: they are never loaded, and a worker
that starts waits for a version at or above the floor before its first episode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
import structlog

from streamrl.config import SyncMode
from streamrl.model.spec import PyTree
from streamrl.names import Keys
from streamrl.obs.tracing import Span, Tracer
from streamrl.rollout.episode import ModelServer
from streamrl.run.failpoints import WEIGHTS_LOAD, afailpoint
from streamrl.transport import aget_bytes, axrevrange_entries
from streamrl.weightsync import WeightsError, WeightsMissing
from streamrl.wire import Weights, WireError, decode


class SyncLock:
    """Episodes take it shared (`enter`/`leave`), a weight sync exclusively (`close`).
    A wait for it (`wait_open` given a trace track) is a `weights.lock_wait` span."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self.tracer = tracer or Tracer.disabled()
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.episodes = 0

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self, track: int = 0) -> None:
        """Return when no sync holds the lock; `enter` right after (no await between). Does
        not suspend when the lock is open; a wait is a span on `track` (0: none)."""
        if self._open.is_set():
            return
        start_ns = time.time_ns()
        try:
            while not self._open.is_set():  # closed again before this waiter ran: wait more
                await self._open.wait()
        finally:
            if track:
                self.tracer.span(track, Span.WEIGHTS_LOCK_WAIT, start_ns, time.time_ns())

    def enter(self) -> None:
        if not self._open.is_set():
            raise RuntimeError("an episode started while weights sync (wait_open first)")
        self.episodes += 1
        self._idle.clear()

    def leave(self) -> None:
        self.episodes -= 1
        if self.episodes == 0:
            self._idle.set()

    def close(self) -> None:
        self._open.clear()

    def reopen(self) -> None:
        self._open.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


Load = Callable[[Weights, Weights | None], PyTree]


class WeightFollower:
    """Follows `weights` and swaps each new version into the engine server; each load is
    a `weights.load` span (lock closed .. reopened) on the trace track ("weights", "sync")."""

    def __init__(
        self,
        aclient: aioredis.Redis,
        keys: Keys,
        server: ModelServer,
        load: Load,
        lock: SyncLock,
        log: structlog.stdlib.BoundLogger,
        mode: SyncMode = "continue",
        *,
        tracer: Tracer | None = None,
    ) -> None:
        self.aclient = aclient
        self.tracer = tracer or Tracer.disabled()
        self.keys = keys
        self.server = server
        self.load_params = load
        self.lock = lock
        self.log = log
        self.mode = mode
        self.last_id = "0-0"
        self.loaded_version = -1
        self.newest_version = -1  # the newest version seen published (loaded or not)
        self._fulls: dict[int, Weights] = {}  # the newest full versions seen (LoRA bases)
        self.syncs = 0
        self.sync_s = 0.0
        self.refused = 0
        self.superseded = 0  # missing versions skipped because newer ones exist

    async def wait_initial(self, stop: Callable[[], bool]) -> bool:
        """Load the latest published version (at or above the policy floor) before the
        first episode; False if stopped."""
        while not stop():
            if await self.poll(block_ms=500):
                return True
        return False

    async def floor(self) -> int:
        raw = await aget_bytes(self.aclient, self.keys.policy_floor)
        return int(raw) if raw is not None else 0

    async def poll(self, block_ms: int) -> bool:
        """Load the newest good version published since the last one seen; True if one
        loaded. From the stream's start (a worker that starts or restarts), that is the
        latest version."""
        resp: Any = await self.aclient.xread({self.keys.weights: self.last_id}, block=block_ms)
        if not resp:
            return False
        entries = resp[0][1]
        self.last_id = entries[-1][0].decode()
        msgs = []
        for entry_id, fields in entries:
            try:
                msgs.append(decode(fields, Weights))
            except WireError as err:
                self.log.error("weights_entry_bad", entry_id=entry_id.decode(), reason=str(err))
        for msg in msgs:
            self.newest_version = max(self.newest_version, msg.version)
            if msg.kind == "full":
                self._fulls[msg.version] = msg
        for old in sorted(self._fulls)[:-4]:
            del self._fulls[old]
        floor = await self.floor()
        msgs = [m for m in msgs if m.version >= floor]
        for msg in reversed(msgs):  # newest good one wins
            if msg.version <= self.loaded_version:
                return False
            if await self.load(msg):
                return True
        return False

    async def load(self, msg: Weights) -> bool:
        """Load and swap in one version under the lock; False if it was refused."""
        self.lock.close()
        if self.mode == "pause":
            self.server.hold()
        start = time.monotonic()
        start_ns = time.time_ns()
        swapped = False
        try:
            await afailpoint(WEIGHTS_LOAD, self.log)
            base = self._fulls.get(msg.base_version) if msg.kind == "lora" else None
            params = await asyncio.to_thread(self.load_params, msg, base)
            loaded_s = time.monotonic() - start
            if self.mode == "finish":
                await self.lock.wait_idle()
            await self.server.swap(params, msg.version)
            swapped = True
        except WeightsError as err:
            if isinstance(err, WeightsMissing) and await self._superseded(msg.version):
                self.superseded += 1
                self.log.info("weights_superseded", version=msg.version, reason=str(err))
                return False
            self.refused += 1
            self.log.error(
                "weights_refused",
                version=msg.version,
                channel=msg.channel,
                path=msg.path,
                reason=str(err),
                serving_version=self.loaded_version,
            )
            return False
        finally:
            if not swapped:
                self.server.release()
            self.lock.reopen()
            self.tracer.span(
                self.tracer.track("weights", "sync"),
                Span.WEIGHTS_LOAD,
                start_ns,
                time.time_ns(),
                args={"version": msg.version, "loaded": swapped},
            )
        self.loaded_version = msg.version
        elapsed = time.monotonic() - start
        self.syncs += 1
        self.sync_s += elapsed
        self.log.info(
            "weights_loaded",
            version=msg.version,
            step=msg.step,
            kind=msg.kind,
            channel=msg.channel,
            nbytes=msg.nbytes,
            load_s=round(loaded_s, 4),
            sync_s=round(elapsed, 4),
        )
        return True

    async def _superseded(self, version: int) -> bool:
        """Whether a newer version than `version` has been published (the weights stream's
        last entry: what the rollout role may read)."""
        last = await axrevrange_entries(self.aclient, self.keys.weights, count=1)
        try:
            return bool(last) and decode(last[0][1], Weights).version > version
        except WireError:
            return False

    async def follow(self, stop: Callable[[], bool]) -> None:
        while not stop():
            await self.poll(block_ms=500)
