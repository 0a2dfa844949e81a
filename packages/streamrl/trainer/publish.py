"""Publishing a policy version: serialize, write through a channel, signal on `weights`.

A version is either the full parameters or LoRA adapters only. Adapters are published
against a full base: the first version a publisher writes is always full, and every
adapter-only version names the full version it applies to (`base_version`), which is kept
until no kept version needs it. Older versions are deleted after each publish (all but the
newest `keep`), so a slow reader at worst finds its version gone and is refused, then
takes the next; so are their entries on `weights` (`trim`), which a worker that starts
reads from the beginning.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
import structlog

from streamrl import counters
from streamrl.model.lora import LoraConfig
from streamrl.model.spec import PyTree
from streamrl.model.weights import lora_info, params_to_pieces
from streamrl.names import Keys
from streamrl.run.failpoints import WEIGHTS_PUBLISH, failpoint
from streamrl.transport import as_str, entry_id_key, publish
from streamrl.weightsync import Checksum, WeightsChannel, checksum, overlapped
from streamrl.wire import Weights


@dataclass
class WeightPublisher:
    client: redis.Redis
    keys: Keys
    channel: WeightsChannel
    log: structlog.stdlib.BoundLogger
    keep: int = 2
    checksum: Checksum = "xxh3_128"
    trim: bool = True  # delete the `weights` entries of deleted versions
    base_version: int = -1  # the last full version published
    _bases: dict[int, int] = field(default_factory=dict)  # version -> full version it needs
    _entry_ids: dict[int, str] = field(default_factory=dict)  # version -> its `weights` entry
    _hasher: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))

    def publish(
        self, tree: PyTree, version: int, step: int, lora: LoraConfig | None = None
    ) -> Weights:
        """Publish `tree` (params, or adapters when `lora` is given) as `version`."""
        if lora is not None and self.base_version < 0:
            raise ValueError("adapters need a full version to apply to: publish one first")
        start = time.monotonic()
        pieces = params_to_pieces(tree)
        serialized_s = time.monotonic() - start
        nbytes = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        # Big versions are hashed while the channel writes (both leave the GIL).
        digest = overlapped(self._hasher, nbytes, checksum, self.checksum, *pieces)
        where = self.channel.write(version, pieces)
        failpoint(WEIGHTS_PUBLISH, self.log)  # written, not yet signalled
        msg = Weights(
            version=version,
            step=step,
            path=where.path,
            nbytes=nbytes,
            checksum=digest(),
            kind="full" if lora is None else "lora",
            channel=self.channel.name,
            chunks=where.chunks,
            lora=None if lora is None else lora_info(lora),
            base_version=self.base_version if lora is not None else -1,
        )
        pipe = self.client.pipeline(transaction=True)
        publish(pipe, self.keys.weights, msg)
        pipe.set(self.keys.policy_version, version)
        pipe.hset(self.keys.stats, counters.POLICY_VERSION, version)
        entry_id = as_str(pipe.execute()[0])
        if lora is None:
            self.base_version = version
        self._bases[version] = self.base_version
        self._entry_ids[version] = entry_id
        kept = self._kept()
        deleted = self.channel.prune(kept)
        if self.trim:
            self._trim(kept)
        self.log.info(
            "weights_published",
            version=version,
            step=step,
            kind=msg.kind,
            channel=msg.channel,
            nbytes=msg.nbytes,
            chunks=msg.chunks,
            serialize_s=round(serialized_s, 4),
            publish_s=round(time.monotonic() - start, 4),
            deleted=deleted,
        )
        return msg

    def _trim(self, kept: set[int]) -> None:
        """Delete the `weights` entries of versions no longer kept (a worker that starts
        reads the stream from its beginning): this publisher's by id, and everything older
        than its oldest kept version (earlier trainers' entries included)."""
        gone = [e for v, e in self._entry_ids.items() if v not in kept]
        self._entry_ids = {v: e for v, e in self._entry_ids.items() if v in kept}
        pipe = self.client.pipeline(transaction=False)
        if gone:
            pipe.xdel(self.keys.weights, *gone)
        if kept <= self._entry_ids.keys():
            oldest = min(self._entry_ids.values(), key=entry_id_key)
            pipe.xtrim(self.keys.weights, minid=oldest, approximate=False)
        pipe.execute()

    def _kept(self) -> set[int]:
        """The newest `keep` versions and the full versions they apply to."""
        newest = sorted(self._bases)[-self.keep :]
        kept = set(newest) | {self._bases[v] for v in newest}
        self._bases = {v: b for v, b in self._bases.items() if v in kept}
        return kept
