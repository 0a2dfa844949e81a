"""Parameter bytes for weight sync and caches: Flax msgpack, never pickle.

The trainer serializes a version's parameters (or LoRA adapters only), writes the bytes
through a channel (`streamrl.weightsync`) and announces byte count and sha256 on the
`weights` stream; a reader checks size and checksum before decoding, so a torn, truncated
or tampered version is a clear `WeightsError`, never a half-loaded policy.

`params_to_bytes` writes exactly the bytes `flax.serialization.to_bytes` writes, with one
copy of the array data instead of four (host copy, `tobytes`, inner and outer msgpack
buffers): at 20 M parameters that is most of a publish's time on a CPU host.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import msgspec
import numpy as np

from streamrl.model.lora import LoraConfig, LoraError, apply_lora, init_lora
from streamrl.weightsync import Buffer, WeightsError, sha256_hex, verify, write_bytes_atomic
from streamrl.wire import LoraInfo

__all__ = [
    "WeightsError",
    "adapters_template",
    "decode_adapters",
    "lora_config",
    "lora_info",
    "merge_lora",
    "params_from_bytes",
    "params_to_bytes",
    "params_to_pieces",
    "read_weights",
    "sha256_hex",
    "write_weights",
]

_EXT_NDARRAY = 1  # flax.serialization._MsgpackExtType.ndarray
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


class _Unsupported(Exception):
    """A tree the fast writer does not handle: flax writes it instead."""


def params_to_bytes(params: Any) -> bytes:
    """Msgpack bytes of a parameter pytree (arrays as raw little-endian buffers), exactly
    those of `flax.serialization.to_bytes(params)`."""
    return b"".join(params_to_pieces(params))


def params_to_pieces(params: Any) -> list[Buffer]:
    """`params_to_bytes(params)` as consecutive pieces: msgpack headers and views of the
    arrays themselves (host arrays are not copied), for a writer that needs no single
    buffer (a file: one copy fewer)."""
    state = flax.serialization.to_state_dict(params)
    pieces: list[Buffer] = []
    try:
        _pack(state, pieces)
    except _Unsupported:
        return [flax.serialization.to_bytes(params)]
    return pieces


def _pack(obj: Any, out: list[Buffer]) -> None:
    if isinstance(obj, dict):
        n = len(obj)
        if n < 16:
            out.append(bytes([0x80 | n]))
        elif n < 2**16:
            out.append(struct.pack(">BH", 0xDE, n))
        else:
            out.append(struct.pack(">BI", 0xDF, n))
        for k, v in obj.items():
            if not isinstance(k, str):
                raise _Unsupported
            out.append(msgspec.msgpack.encode(k))
            _pack(v, out)
    elif isinstance(obj, np.ndarray | jax.Array):
        _pack_array(np.asarray(obj), out)  # a view of a host array, not a copy
    else:
        raise _Unsupported


def _pack_array(arr: np.ndarray, out: list[Buffer]) -> None:
    """flax's ext 1: msgpack of (shape, dtype name, C-order bytes), the bytes as `bin`."""
    dt = arr.dtype
    if dt.hasobject or dt.isalignedstruct or dt.byteorder == ">" or arr.nbytes >= 2**30:
        raise _Unsupported  # flax refuses, or chunks these (> its MAX_CHUNK_SIZE)
    body = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    head = bytearray(msgspec.msgpack.encode((arr.shape, dt.name)))
    head[0] = 0x93  # (shape, name) is a fixarray of 2; the bytes make it 3
    n = body.nbytes
    if n < 2**8:
        head += struct.pack(">BB", 0xC4, n)
    elif n < 2**16:
        head += struct.pack(">BH", 0xC5, n)
    else:
        head += struct.pack(">BI", 0xC6, n)
    size = len(head) + n
    if size in _FIXEXT:
        out.append(struct.pack(">BB", _FIXEXT[size], _EXT_NDARRAY))
    elif size < 2**8:
        out.append(struct.pack(">BBB", 0xC7, size, _EXT_NDARRAY))
    elif size < 2**16:
        out.append(struct.pack(">BHB", 0xC8, size, _EXT_NDARRAY))
    else:
        out.append(struct.pack(">BIB", 0xC9, size, _EXT_NDARRAY))
    out.append(bytes(head))
    out.append(body.data)  # a memoryview of the array's own bytes


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
    return jax.device_put(restored)  # one call for the tree: faster than leaf by leaf


# -- LoRA adapters ------------------------------------------------------------------------


def lora_info(cfg: LoraConfig) -> LoraInfo:
    return LoraInfo(rank=cfg.rank, alpha=cfg.alpha, targets=tuple(cfg.targets))


def lora_config(info: LoraInfo | None) -> LoraConfig:
    """The adapters' config from a `weights` message; WeightsError if absent or invalid."""
    if info is None:
        raise WeightsError("adapter-only weights without their LoRA config (rank, alpha)")
    try:
        return LoraConfig(rank=info.rank, alpha=info.alpha, targets=tuple(info.targets))
    except LoraError as err:
        raise WeightsError(f"bad LoRA config in weights: {err}") from None


def adapters_template(base: Any, cfg: LoraConfig) -> Any:
    """Shapes and dtypes (no values) of the adapters `cfg` puts on `base`."""
    try:
        return jax.eval_shape(lambda: init_lora(base, cfg, seed=0))
    except LoraError as err:
        raise WeightsError(f"LoRA adapters do not fit this model: {err}") from None


# One XLA program for every kernel's `W + scale * A @ B` (compiled once per model and
# config): 2x faster than op by op, and bit for bit the same.
merge_lora = jax.jit(apply_lora, static_argnums=2)


def decode_adapters(template: Any, data: bytes) -> Any:
    """Adapters decoded from `data` (`template`: see adapters_template)."""
    return params_from_bytes(template, data)


# -- files (caches, tests) ----------------------------------------------------------------


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
    verify(data, nbytes, sha256, f"weights file {p}")
    try:
        return params_from_bytes(template, data)
    except WeightsError as err:
        raise WeightsError(f"weights file {p}: {err}") from None
