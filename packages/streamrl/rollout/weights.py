"""Weight sync on the rollout side: follow `weights`, load each new version under a lock.

The lock is an asyncio gate: while it is closed no new episode starts; episodes already
running go on, and each model turn is tagged with the version that produced it. Loading
(read, checksum, decode) runs on a thread, so waiting for the lock never blocks the event
loop. A version whose file is missing, truncated or fails its checksum is refused with a
logged reason and the worker keeps serving the last good version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
import structlog

from streamrl.model.weights import WeightsError
from streamrl.names import Keys
from streamrl.rollout.engine_server import EngineServer
from streamrl.wire import Weights, WireError, decode


class WeightFollower:
    def __init__(
        self,
        aclient: aioredis.Redis,
        keys: Keys,
        server: EngineServer,
        load: Callable[[Weights], Any],
        gate: asyncio.Event,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.aclient = aclient
        self.keys = keys
        self.server = server
        self.load_params = load
        self.gate = gate
        self.log = log
        self.last_id = "0-0"
        self.loaded_version = -1
        self.syncs = 0
        self.sync_s = 0.0
        self.refused = 0

    async def wait_initial(self, stop: Callable[[], bool]) -> bool:
        """Load the latest published version before the first episode; False if stopped."""
        while not stop():
            if await self.poll(block_ms=500):
                return True
        return False

    async def poll(self, block_ms: int) -> bool:
        """Load the newest version published since the last one seen; True if one loaded."""
        resp: Any = await self.aclient.xread({self.keys.weights: self.last_id}, block=block_ms)
        if not resp:
            return False
        entries = resp[0][1]
        self.last_id = entries[-1][0].decode()
        for entry_id, fields in reversed(entries):  # newest good one wins
            try:
                msg = decode(fields, Weights)
            except WireError as err:
                self.log.error("weights_entry_bad", entry_id=entry_id.decode(), reason=str(err))
                continue
            if msg.version <= self.loaded_version:
                return False
            return await self.load(msg)
        return False

    async def load(self, msg: Weights) -> bool:
        self.gate.clear()
        start = time.monotonic()
        try:
            params = await asyncio.to_thread(self.load_params, msg)
            self.server.set_weights(params, msg.version)
        except WeightsError as err:
            self.refused += 1
            self.log.error(
                "weights_refused",
                version=msg.version,
                path=msg.path,
                reason=str(err),
                serving_version=self.loaded_version,
            )
            return False
        finally:
            self.gate.set()
        self.loaded_version = msg.version
        elapsed = time.monotonic() - start
        self.syncs += 1
        self.sync_s += elapsed
        self.log.info(
            "weights_loaded",
            version=msg.version,
            step=msg.step,
            nbytes=msg.nbytes,
            sync_s=round(elapsed, 4),
        )
        return True

    async def follow(self, stop: Callable[[], bool]) -> None:
        while not stop():
            await self.poll(block_ms=500)
