"""The content hashes streamrl writes beside what it stores (a checkpoint's commit marker,
a weight version's checksum), by name: sha256, and xxh3_128 (about 10 GB/s on one core)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import xxhash

SHA256, XXH3 = "sha256", "xxh3_128"


class Hasher(Protocol):
    """What streamrl uses of a hash object (hashlib's and xxhash's alike)."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


HASHES: dict[str, Callable[[], Hasher]] = {SHA256: hashlib.sha256, XXH3: xxhash.xxh3_128}
