"""The channels published weights travel through, as bytes (no JAX here).

The trainer serializes a policy version (Flax msgpack, never pickle), writes the bytes
through a channel, then signals version, byte count and sha256 on `weights`. A reader
fetches the bytes the signal points to and checks size and checksum before anything
decodes them, so a torn, truncated, tampered or deleted version is a clear
`WeightsError`, never a half-loaded policy.

- `dir`: one file per version in the run's weights directory, written to a temporary
  name, fsynced and renamed into place (readers see the whole file or none).
- `redis`: the bytes split into `chunk_bytes` string keys under the run namespace, written
  in one pipeline before the signal, read back in one pipeline. Nothing needs a shared
  file system, at the price of holding `keep` versions in Redis memory (and its AOF).

After each publish both channels delete all but the newest `keep` versions and the full
version those versions' adapters apply to (`WeightsChannel.prune`).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import redis

from streamrl.names import Keys
from streamrl.wire import Weights

__all__ = [
    "Buffer",
    "DirChannel",
    "RedisChannel",
    "WeightsChannel",
    "WeightsError",
    "check_sha256",
    "describe",
    "fetch_published",
    "read_published",
    "sha256_hex",
    "verify",
    "write_bytes_atomic",
]

# A piece of serialized weights: headers as bytes, arrays as views of their own memory.
Buffer = bytes | memoryview


class WeightsError(ValueError):
    """Published weights that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Written:
    """Where a channel put a version's bytes: `path` (a file, or the chunk keys' prefix)
    and how many Redis keys hold them (0 for a file)."""

    path: str
    chunks: int


class WeightsChannel(Protocol):
    @property
    def name(self) -> Literal["dir", "redis"]: ...

    def write(self, version: int, pieces: Sequence[Buffer]) -> Written:
        """Store the concatenation of `pieces` as `version`."""
        ...

    def prune(self, keep: set[int]) -> list[int]:
        """Delete every stored version not in `keep`; returns the versions deleted."""
        ...


def sha256_hex(*pieces: Buffer) -> str:
    """sha256 of the concatenation of `pieces` (hashlib lets other threads run meanwhile)."""
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)
    return h.hexdigest()


def check_sha256(data: bytes, sha256: str, where: str) -> None:
    digest = sha256_hex(data)
    if digest != sha256:
        raise WeightsError(f"{where} has sha256 {digest}, expected {sha256}")


def verify(data: bytes, nbytes: int, sha256: str, where: str) -> None:
    """Raise WeightsError unless `data` has the announced size and checksum."""
    if len(data) != nbytes:
        raise WeightsError(f"{where} has {len(data)} bytes, expected {nbytes}")
    check_sha256(data, sha256, where)


def write_bytes_atomic(path: str | Path, data: Buffer | list[Buffer]) -> None:
    """Write data so that readers see the old file or the whole new one, never a part.

    Temporary file in the same directory, fsync, rename over the target, fsync the
    directory (so the rename itself survives a crash). `data` may come in pieces.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    pieces = data if isinstance(data, list) else [data]
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_VERSION_FILE = re.compile(r"^v(\d{6,})\.msgpack$")


@dataclass
class DirChannel:
    """Versions as files `vNNNNNN.msgpack` in `directory` (shared by every worker)."""

    directory: Path
    name: ClassVar[Literal["dir", "redis"]] = "dir"

    def path(self, version: int) -> Path:
        return self.directory / f"v{version:06d}.msgpack"

    def write(self, version: int, pieces: Sequence[Buffer]) -> Written:
        path = self.path(version)
        write_bytes_atomic(path, list(pieces))
        return Written(str(path.resolve()), 0)

    def prune(self, keep: set[int]) -> list[int]:
        # From the directory itself, not from memory: a restarted trainer cleans up too.
        deleted = []
        for p in self.directory.glob("v*.msgpack"):
            m = _VERSION_FILE.match(p.name)
            if m and int(m.group(1)) not in keep:
                p.unlink(missing_ok=True)
                deleted.append(int(m.group(1)))
        return sorted(deleted)


@dataclass
class RedisChannel:
    """Versions as `chunk_bytes`-sized string keys (`Keys.weights_chunk`), indexed by the
    hash `Keys.weights_chunks` (version -> chunk count) so that any later publisher, a
    restarted trainer included, knows what to delete."""

    client: redis.Redis
    keys: Keys
    chunk_bytes: int
    name: ClassVar[Literal["dir", "redis"]] = "redis"

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, not {self.chunk_bytes}")

    def write(self, version: int, pieces: Sequence[Buffer]) -> Written:
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        view = memoryview(data).cast("B")  # slices of a view are not copies
        chunks = max(1, -(-len(data) // self.chunk_bytes))
        # Not a transaction: the version is not announced until the signal, written after
        # every chunk is stored, so a reader never sees part of it.
        pipe = self.client.pipeline(transaction=False)
        for i in range(chunks):
            chunk = view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]
            pipe.set(self.keys.weights_chunk(version, i), chunk)
        pipe.hset(self.keys.weights_chunks, str(version), chunks)
        pipe.execute()
        return Written(self.keys.weights_blob(version), chunks)

    def prune(self, keep: set[int]) -> list[int]:
        held: Any = self.client.hgetall(self.keys.weights_chunks)
        stale = {int(v): int(n) for v, n in held.items() if int(v) not in keep}
        if not stale:
            return []
        pipe = self.client.pipeline(transaction=False)
        for version, chunks in stale.items():
            pipe.delete(*(self.keys.weights_chunk(version, i) for i in range(chunks)))
            pipe.hdel(self.keys.weights_chunks, str(version))
        pipe.execute()
        return sorted(stale)


def describe(msg: Weights) -> str:
    """How errors name a published version's bytes."""
    if msg.channel == "dir":
        return f"weights file {msg.path}"
    return f"weights {msg.path}:0..{msg.chunks - 1} in Redis"


def read_published(msg: Weights, client: redis.Redis | None, keys: Keys) -> bytes:
    """The bytes of a published version, checked against its size and sha256.

    Raises WeightsError on a missing file or chunk, or a size or checksum mismatch.
    """
    data = fetch_published(msg, client, keys)
    check_sha256(data, msg.sha256, describe(msg))
    return data


def fetch_published(msg: Weights, client: redis.Redis | None, keys: Keys) -> bytes:
    """The bytes of a published version, checked against its size only: the caller
    checks the sha256 (`check_sha256`) before using them.

    Raises WeightsError on a missing file or chunk, or a size mismatch.
    """
    if msg.channel == "dir":
        try:
            data = Path(msg.path).read_bytes()
        except FileNotFoundError:
            raise WeightsError(f"{describe(msg)} is missing") from None
    else:
        if client is None:
            raise WeightsError(f"version {msg.version} is in Redis, and this reader has none")
        pipe = client.pipeline(transaction=False)
        for i in range(msg.chunks):
            pipe.get(keys.weights_chunk(msg.version, i))
        parts: list[bytes | None] = pipe.execute()
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise WeightsError(
                f"{describe(msg)}: chunks {missing} are missing (deleted or never written)"
            )
        data = b"".join(p for p in parts if p is not None)
    if len(data) != msg.nbytes:
        raise WeightsError(f"{describe(msg)} has {len(data)} bytes, expected {msg.nbytes}")
    return data
