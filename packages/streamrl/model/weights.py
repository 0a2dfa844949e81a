"""Parameter bytes for weight sync: a flat, aligned layout of raw arrays, never pickle.

The trainer serializes a version's parameters (or LoRA adapters only), writes the bytes
through a channel (`streamrl.weightsync`) and announces byte count and checksum on the
`weights` stream; a reader checks size and checksum before decoding, so a torn, truncated
or damaged version is a clear `WeightsError`, never a half-loaded policy.

Layout (little-endian):

    0   magic b"SRLWTS01"
    8   u64 H, the header's length
    16  header: msgpack array of [path, dtype, shape, offset, nbytes] per leaf, in the
        order `jax.tree_util.tree_flatten_with_path` gives (path: `keystr`)
    D   data, D = 16 + H rounded up to ALIGN (64); each array's C-order bytes at
        D + offset, offsets multiples of ALIGN, zero padding between

Writing costs no copy of the arrays (the pieces are views of host arrays); reading costs
none either: decoded arrays are views of the reader's aligned buffer, which the CPU backend
serves from in place (`jax.device_put` copies nothing at 64-byte alignment), and which
accelerators copy to device memory once. A reader decodes only into the structure it
expects (`template`): every path, dtype and shape must match it, and only the template's
dtypes are ever constructed.
"""

from __future__ import annotations

import math
import struct

import jax
import msgspec
import numpy as np

from streamrl.model.lora import LoraConfig, LoraError, init_lora
from streamrl.model.spec import PyTree
from streamrl.weightsync import ALIGN, Buffer, WeightsError, as_aligned
from streamrl.wire import LoraInfo

__all__ = [
    "MAGIC",
    "WeightsError",
    "adapters_template",
    "lora_config",
    "lora_info",
    "params_from_bytes",
    "params_to_bytes",
    "params_to_pieces",
]

MAGIC = b"SRLWTS01"
_PREFIX = struct.Struct("<8sQ")


class _Leaf(msgspec.Struct, array_like=True, frozen=True):
    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


_HEADER = msgspec.msgpack.Decoder(list[_Leaf])


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def params_to_bytes(params: PyTree) -> bytes:
    """The bytes of a parameter pytree in this module's layout."""
    return b"".join(params_to_pieces(params))


def params_to_pieces(params: PyTree) -> list[Buffer]:
    """`params_to_bytes(params)` as consecutive pieces: prefix, header, padding, and views
    of the arrays themselves (host arrays are not copied), for a writer that needs no
    single buffer. Leaves must be arrays (or array-likes) of a plain numeric dtype."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    leaves: list[_Leaf] = []
    arrays: list[np.ndarray] = []
    offset = 0
    for path, leaf in flat:
        arr = np.asarray(leaf)  # a view of a host array, not a copy
        if arr.dtype.hasobject or arr.dtype.fields is not None:
            raise TypeError(f"{jax.tree_util.keystr(path)}: cannot publish dtype {arr.dtype}")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray makes a scalar 1-d)
        offset = _aligned(offset)
        leaves.append(
            _Leaf(jax.tree_util.keystr(path), arr.dtype.name, arr.shape, offset, arr.nbytes)
        )
        arrays.append(arr)
        offset += arr.nbytes
    header = msgspec.msgpack.encode(leaves)
    data_at = _aligned(_PREFIX.size + len(header))
    pieces: list[Buffer] = [
        _PREFIX.pack(MAGIC, len(header)),
        header,
        bytes(data_at - _PREFIX.size - len(header)),
    ]
    at = 0
    for leaf, arr in zip(leaves, arrays, strict=True):
        if leaf.offset > at:
            pieces.append(bytes(leaf.offset - at))
        pieces.append(arr.reshape(-1).view(np.uint8).data)
        at = leaf.offset + leaf.nbytes
    return pieces


def params_from_bytes(template: PyTree, data: Buffer | np.ndarray) -> PyTree:
    """Parameters decoded from `data` in the structure of `template`, as jax arrays.

    `template` may hold arrays or jax.ShapeDtypeStruct leaves; every decoded leaf must
    match its template leaf's path, shape and dtype. Raises WeightsError otherwise. An
    aligned uint8 buffer (`weightsync.fetch_published`) is used in place, and must not be
    written to afterwards; any other `data` is copied once into one.
    """
    buf = as_aligned(data)
    if buf.size < _PREFIX.size:
        raise WeightsError(f"cannot decode weights: {buf.size} bytes, not even a header")
    view = memoryview(buf.data)
    magic, hlen = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WeightsError(f"cannot decode weights: magic {magic!r}, expected {MAGIC!r}")
    if _PREFIX.size + hlen > buf.size:
        raise WeightsError(f"cannot decode weights: header of {hlen} bytes in {buf.size}")
    try:
        leaves = _HEADER.decode(view[_PREFIX.size : _PREFIX.size + hlen])
    except msgspec.MsgspecError as err:
        raise WeightsError(f"cannot decode weights: bad header: {err}") from None
    data_at = _aligned(_PREFIX.size + hlen)
    want, treedef = jax.tree_util.tree_flatten_with_path(template)
    if len(want) != len(leaves):
        raise WeightsError(f"weights have {len(leaves)} arrays, expected {len(want)}")
    arrays = []
    for (path, w), leaf in zip(want, leaves, strict=True):
        name = jax.tree_util.keystr(path)
        dtype, shape = np.dtype(w.dtype), tuple(w.shape)
        if leaf.path != name:
            raise WeightsError(f"weights hold {leaf.path} where {name} was expected")
        if leaf.dtype != dtype.name or leaf.shape != shape:
            raise WeightsError(
                f"weights {name} are {leaf.dtype}{list(leaf.shape)}, "
                f"expected {dtype.name}{list(shape)}"
            )
        count = math.prod(shape)
        end = data_at + leaf.offset + leaf.nbytes
        if leaf.nbytes != count * dtype.itemsize or leaf.offset % ALIGN or leaf.offset < 0:
            raise WeightsError(f"cannot decode weights: {name} has a bad offset or size")
        if end > buf.size:
            raise WeightsError(
                f"cannot decode weights: {name} ends at byte {end}, past the end ({buf.size})"
            )
        at = data_at + leaf.offset
        arrays.append(np.frombuffer(buf, dtype, count, at).reshape(shape))
    # One call for the tree; on the CPU backend the arrays stay where they are.
    return jax.device_put(jax.tree_util.tree_unflatten(treedef, arrays))


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


def adapters_template(base: PyTree, cfg: LoraConfig) -> PyTree:
    """Shapes and dtypes (no values) of the adapters `cfg` puts on `base`."""
    try:
        return jax.eval_shape(lambda: init_lora(base, cfg, seed=0))
    except LoraError as err:
        raise WeightsError(f"LoRA adapters do not fit this model: {err}") from None
