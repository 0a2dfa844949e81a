"""Parameter bytes for weight sync and caches: Flax msgpack, never pickle.

The trainer writes a version's parameters atomically and announces (path, byte count,
sha256) on the `weights` stream; a reader checks size and checksum before decoding, so a
torn, truncated or tampered file is a clear `WeightsError`, never a half-loaded policy.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp

__all__ = [
    "WeightsError",
    "params_from_bytes",
    "params_to_bytes",
    "read_weights",
    "sha256_hex",
    "write_weights",
]


class WeightsError(ValueError):
    """Published weights that cannot be used; the message says which file and why."""


def params_to_bytes(params: Any) -> bytes:
    """Msgpack bytes of a parameter pytree (arrays as raw little-endian buffers)."""
    return flax.serialization.to_bytes(params)


def params_from_bytes(template: Any, data: bytes) -> Any:
    """Parameters decoded from `data` in the structure of `template`, as jax arrays.

    `template` may hold arrays or jax.ShapeDtypeStruct leaves; every decoded leaf must
    match its template leaf's shape and dtype. Raises WeightsError otherwise.
    """
    try:
        state = flax.serialization.msgpack_restore(data)
        restored = flax.serialization.from_state_dict(template, state)
    # msgpack reports bad bytes through a zoo of exception types (ExtraData, ValueError,
    # TypeError, KeyError on a structure mismatch...): all mean "not these weights".
    except Exception as err:
        raise WeightsError(f"cannot decode weights: {type(err).__name__}: {err}") from None
    want = jax.tree_util.tree_leaves_with_path(template)
    got = jax.tree.leaves(restored)
    if len(want) != len(got):
        raise WeightsError(f"weights have {len(got)} arrays, expected {len(want)}")
    for (path, w), g in zip(want, got, strict=True):
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            raise WeightsError(
                f"weights {jax.tree_util.keystr(path)} are {g.dtype}{list(g.shape)}, "
                f"expected {w.dtype}{list(w.shape)}"
            )
    return jax.tree.map(jnp.asarray, restored)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write data so that readers see the old file or the whole new one, never a part.

    Temporary file in the same directory, fsync, rename over the target, fsync the
    directory (so the rename itself survives a crash).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
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


def write_weights(path: str | Path, params: Any) -> tuple[int, str]:
    """Write params atomically to path; returns (byte count, sha256 hex) to announce."""
    data = params_to_bytes(params)
    write_bytes_atomic(path, data)
    return len(data), sha256_hex(data)


def read_weights(path: str | Path, template: Any, sha256: str, nbytes: int) -> Any:
    """Parameters from a file written by write_weights, checked against size and sha256.

    Raises WeightsError on a missing file, a size or checksum mismatch, or bytes that do
    not decode into `template`'s structure.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise WeightsError(f"weights file {p} is missing") from None
    if len(data) != nbytes:
        raise WeightsError(f"weights file {p} has {len(data)} bytes, expected {nbytes}")
    digest = sha256_hex(data)
    if digest != sha256:
        raise WeightsError(f"weights file {p} has sha256 {digest}, expected {sha256}")
    try:
        return params_from_bytes(template, data)
    except WeightsError as err:
        raise WeightsError(f"weights file {p}: {err}") from None
