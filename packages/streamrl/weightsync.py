"""The channels published weights travel through, as bytes (no JAX here).

The trainer serializes a policy version (`streamrl.model.weights`' format, never pickle),
writes the bytes through a channel, then signals version, byte count and checksum on
`weights`. A reader fetches the bytes the signal points to into one 64-byte aligned buffer
(arrays decoded from it are used in place) and checks size and checksum before anything
decodes them, so a torn, truncated, damaged or deleted version is a clear `WeightsError`,
never a half-loaded policy.

Checksums (`trainer.weights_checksum`) are written `<algorithm>:<hex digest>`:
`xxh3_128` (the default: ~11 GB/s on one core, it detects corruption and truncation, not
a forger) or `sha256` (~1 GB/s, cryptographic: for a weights store that others can write).

- `dir`: one file per version in the run's weights directory, written to a temporary
  name, fsynced and renamed into place (readers see the whole file or none). A reader
  opens only a regular file inside its own weights directory (whatever path the signal
  names: symlinks resolved, no FIFO or device that would block it), and any error opening
  or reading it is a `WeightsError`.
- `redis`: the bytes split into string keys of at most `chunk_bytes` under the run
  namespace (each big array's bytes go to keys of their own, uncopied), written in one
  pipeline before the signal, read back in one pipeline. Nothing needs a shared
  file system, at the price of holding `keep` versions in Redis memory (and its AOF).

After each publish both channels delete all but the newest `keep` versions and the full
version those versions' adapters apply to (`WeightsChannel.prune`).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar, TypeVarTuple, get_args

import numpy as np
import redis

from streamrl.config import ChannelName, Checksum
from streamrl.hashing import HASHES
from streamrl.names import Keys, RunPaths
from streamrl.transport import hgetall_bytes, xrevrange_entries
from streamrl.wire import Weights, WireError, decode

__all__ = [
    "ALIGN",
    "CHECKSUMS",
    "HASH_ON_THREAD_BYTES",
    "WEIGHTS_DIR",
    "Buffer",
    "Checksum",
    "DirChannel",
    "RedisChannel",
    "WeightsChannel",
    "WeightsError",
    "WeightsMissing",
    "aligned_empty",
    "as_aligned",
    "check_checksum",
    "checksum",
    "describe",
    "fetch_published",
    "overlapped",
    "read_published",
    "split_chunks",
    "write_bytes_atomic",
]

# A piece of serialized weights: headers as bytes, arrays as views of their own memory.
Buffer = bytes | memoryview


class WeightsError(ValueError):
    """Published weights that cannot be used; the message says which and why."""


class WeightsMissing(WeightsError):
    """A version's file or chunks are gone: deleted (pruned once newer versions were
    published, `trainer.weights_keep`) or never written."""


@dataclass(frozen=True)
class Written:
    """Where a channel put a version's bytes: `path` (a file, or the chunk keys' prefix)
    and how many Redis keys hold them (0 for a file)."""

    path: str
    chunks: int


class WeightsChannel(Protocol):
    @property
    def name(self) -> ChannelName: ...

    def write(self, version: int, pieces: Sequence[Buffer]) -> Written:
        """Store the concatenation of `pieces` as `version`."""
        ...

    def prune(self, keep: set[int]) -> list[int]:
        """Delete every stored version not in `keep`; returns the versions deleted."""
        ...


CHECKSUMS: tuple[Checksum, ...] = get_args(Checksum)


# Versions at least this big are hashed on a second thread while they are written or
# decoded; smaller ones inline (a thread hand-off costs more than hashing them).
HASH_ON_THREAD_BYTES = 8 << 20

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def overlapped(pool: Executor, nbytes: int, fn: Callable[[*Ts], T], *args: *Ts) -> Callable[[], T]:
    """`fn(*args)` for a version of `nbytes`, run while the caller goes on: on `pool` from
    HASH_ON_THREAD_BYTES up, else at once. Call the result for fn's value (or its error)."""
    if nbytes >= HASH_ON_THREAD_BYTES:
        return pool.submit(fn, *args).result
    value = fn(*args)
    return lambda: value


# Arrays a reader decodes are views of its buffer; at this alignment the CPU backend uses
# them in place (no copy into device memory), and every array starts on a cache line.
ALIGN = 64


def checksum(algorithm: str, *pieces: Buffer) -> str:
    """`<algorithm>:<hex digest>` of the concatenation of `pieces`. Both hashes let other
    threads run meanwhile. Raises WeightsError for an algorithm not in CHECKSUMS."""
    if algorithm not in HASHES:
        raise WeightsError(f"unknown checksum algorithm {algorithm!r} (known: {CHECKSUMS})")
    h = HASHES[algorithm]()
    for p in pieces:
        h.update(p)
    return f"{algorithm}:{h.hexdigest()}"


def check_checksum(data: Buffer | np.ndarray, expected: str, where: str) -> None:
    """Raise WeightsError unless `data` has the checksum `expected` (`<algorithm>:<hex>`)."""
    algorithm = expected.partition(":")[0]
    digest = checksum(algorithm, data.data if isinstance(data, np.ndarray) else data)
    if digest != expected:
        raise WeightsError(f"{where} has checksum {digest}, expected {expected}")


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new uint8 buffer of `nbytes` that starts on an ALIGN-byte boundary."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


def as_aligned(data: Buffer | np.ndarray) -> np.ndarray:
    """`data` as an aligned uint8 array: itself if it is one, else an aligned copy."""
    if (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 1
        and data.flags.c_contiguous
        and data.ctypes.data % ALIGN == 0
    ):
        return data
    src = np.frombuffer(data, np.uint8)
    out = aligned_empty(src.size)
    out[:] = src
    return out


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


WEIGHTS_DIR = RunPaths.WEIGHTS  # the `dir` channel's directory in RUN_DIR, for all

_VERSION_FILE = re.compile(r"^v(\d{6,})\.weights$")


@dataclass
class DirChannel:
    """Versions as files `vNNNNNN.weights` in `directory` (shared by every worker)."""

    directory: Path
    name: ClassVar[ChannelName] = "dir"

    def path(self, version: int) -> Path:
        return self.directory / f"v{version:06d}.weights"

    def write(self, version: int, pieces: Sequence[Buffer]) -> Written:
        path = self.path(version)
        write_bytes_atomic(path, list(pieces))
        return Written(str(path.resolve()), 0)

    def prune(self, keep: set[int]) -> list[int]:
        # From the directory itself, not from memory: a restarted trainer cleans up too.
        deleted = []
        for p in self.directory.glob("v*.weights"):
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
    name: ClassVar[ChannelName] = "redis"

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, not {self.chunk_bytes}")

    def write(self, version: int, pieces: Sequence[Buffer]) -> Written:
        chunks = split_chunks(pieces, self.chunk_bytes)
        # Not a transaction: the version is not announced until the signal, written after
        # every chunk is stored, so a reader never sees part of it.
        pipe = self.client.pipeline(transaction=False)
        for i, chunk in enumerate(chunks):
            pipe.set(self.keys.weights_chunk(version, i), chunk)
        pipe.hset(self.keys.weights_chunks, str(version), len(chunks))
        pipe.execute()
        return Written(self.keys.weights_blob(version), len(chunks))

    def prune(self, keep: set[int]) -> list[int]:
        held = hgetall_bytes(self.client, self.keys.weights_chunks)
        stale = {int(v): int(n) for v, n in held.items() if int(v) not in keep}
        if not stale:
            return []
        pipe = self.client.pipeline(transaction=False)
        for version, chunks in stale.items():
            pipe.delete(*(self.keys.weights_chunk(version, i) for i in range(chunks)))
            pipe.hdel(self.keys.weights_chunks, str(version))
        pipe.execute()
        return sorted(stale)


def split_chunks(pieces: Sequence[Buffer], limit: int) -> list[Buffer]:
    """The concatenation of `pieces` as consecutive chunks of at most `limit` bytes, with
    few copies: a piece over `limit // 16` bytes (an array) becomes chunks of its own, views
    of its memory; smaller ones (headers, padding, small arrays) are joined into chunks."""
    out: list[Buffer] = []
    small: list[memoryview] = []
    size = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        n = len(view)
        if n <= limit // 16:
            if size + n > limit:
                out.append(b"".join(small))
                small, size = [], 0
            small.append(view)
            size += n
            continue
        if small:
            out.append(b"".join(small))
            small, size = [], 0
        out.extend(view[i : i + limit] for i in range(0, n, limit))
    if small or not out:
        out.append(b"".join(small))
    return out


def published_state_of(client: redis.Redis, keys: Keys, step: int) -> int | None:
    """The policy version published last when it holds the trainer's state at `step`: a
    full version published at that step and still the run's `policy:version` (None
    otherwise). A trainer restoring its checkpoint of `step` has that version's weights
    already, so it publishes nothing new (nor does `up --resume` raise the policy floor
    above it)."""
    published = client.get(keys.policy_version)
    last = xrevrange_entries(client, keys.weights, count=1)
    if published is None or not last:
        return None
    try:
        msg = decode(last[0][1], Weights)
    except WireError:
        return None
    if msg.version != int(published) or msg.step != step or msg.kind != "full":
        return None
    return msg.version


def describe(msg: Weights) -> str:
    """How errors name a published version's bytes."""
    if msg.channel == "dir":
        return f"weights file {msg.path}"
    return f"weights {msg.path}:0..{msg.chunks - 1} in Redis"


def read_published(
    msg: Weights, client: redis.Redis | None, keys: Keys, weights_dir: Path | None
) -> np.ndarray:
    """The bytes of a published version (an aligned buffer: `fetch_published`), checked
    against its size and checksum.

    Raises WeightsError on a missing file or chunk, or a size or checksum mismatch.
    """
    data = fetch_published(msg, client, keys, weights_dir)
    check_checksum(data, msg.checksum, describe(msg))
    return data


def fetch_published(
    msg: Weights, client: redis.Redis | None, keys: Keys, weights_dir: Path | None
) -> np.ndarray:
    """The bytes of a published version in a new ALIGN-byte aligned uint8 buffer (one
    copy from the file or the chunks), checked against its size only: the caller checks
    the checksum (`check_checksum`) before using them. A `dir` version is read only from
    a regular file in `weights_dir` (the run's weights directory).

    Raises WeightsError on a missing file or chunk, a file elsewhere or not regular, an
    error reading it, or a size mismatch.
    """
    if msg.channel == "dir":
        if weights_dir is None:
            raise WeightsError(f"version {msg.version} is a file, and this reader has no dir")
        return _read_file(msg, weights_dir)
    if client is None:
        raise WeightsError(f"version {msg.version} is in Redis, and this reader has none")
    pipe = client.pipeline(transaction=False)
    for i in range(msg.chunks):
        pipe.get(keys.weights_chunk(msg.version, i))
    parts: list[bytes | None] = pipe.execute()
    missing = [i for i, p in enumerate(parts) if p is None]
    if missing:
        raise WeightsMissing(
            f"{describe(msg)}: chunks {missing} are missing (deleted or never written)"
        )
    size = sum(len(p) for p in parts if p is not None)
    if size != msg.nbytes:
        raise WeightsError(f"{describe(msg)} has {size} bytes, expected {msg.nbytes}")
    data = aligned_empty(size)
    at = 0
    for p in parts:
        if p is not None:
            data[at : at + len(p)] = np.frombuffer(p, np.uint8)
            at += len(p)
    return data


def _open_confined(msg: Weights, weights_dir: Path) -> int:
    """A descriptor of the regular file `msg.path` names, once resolved inside
    `weights_dir`. O_NONBLOCK: opening a FIFO does not wait for a writer (the file type is
    checked before any read); O_NOFOLLOW: the resolved name is not a link put there since."""
    try:
        path = Path(msg.path).resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a link loop, a NUL in the path
        raise WeightsError(f"{describe(msg)} cannot be resolved: {err}") from None
    if not path.is_relative_to(weights_dir.resolve()):
        raise WeightsError(f"{describe(msg)} is not in the weights directory {weights_dir}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise WeightsMissing(f"{describe(msg)} is missing") from None
    except OSError as err:
        raise WeightsError(f"{describe(msg)} cannot be opened: {err.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise WeightsError(f"{describe(msg)} is not a regular file")
    return fd


def _read_file(msg: Weights, weights_dir: Path) -> np.ndarray:
    fd = _open_confined(msg, weights_dir)
    try:
        return _read_fd(msg, fd)
    except OSError as err:  # EIO, a file system gone: a refusal, not a crash
        raise WeightsError(f"{describe(msg)} cannot be read: {err.strerror}") from None


def _read_fd(msg: Weights, fd: int) -> np.ndarray:
    with open(fd, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != msg.nbytes:
            raise WeightsError(f"{describe(msg)} has {size} bytes, expected {msg.nbytes}")
        data = aligned_empty(size)
        view, at = data.data, 0
        while at < size:
            n = f.readinto(view[at:])
            if not n:  # cut short while being read
                raise WeightsError(f"{describe(msg)} has {at} bytes, expected {msg.nbytes}")
            at += n
    return data
