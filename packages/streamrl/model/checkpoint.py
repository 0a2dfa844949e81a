"""Hugging Face checkpoint directories: load into `llm` parameters, export back.

A directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Tensors are read with safetensors' NumPy backend (bfloat16
arrives as an ml_dtypes array, which JAX takes as is), checked by name and shape against the
spec before any data is read, and mapped to parameter leaves by `hf_name`: HF linear
weights are [out, in], our kernels [in, out], so those are transposed on the way.

Every problem is a `CheckpointError` naming it: a missing config.json, a missing,
unexpected or wrongly shaped tensor, an index pointing at a missing shard.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from streamrl.model.llm import DType, Params, init_params, param_shapes
from streamrl.model.spec import ModelSpec, PyTree, SpecError

__all__ = [
    "CheckpointError",
    "build_tiny_checkpoint",
    "export_checkpoint",
    "hf_name",
    "load_checkpoint",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
_LAYER = re.compile(r"layers_(\d+)")
# Tensors some checkpoints carry that the model does not use: old Llama checkpoints saved
# the RoPE buffer; transformers ignores both on load, and so do we.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_METADATA = {"format": "pt"}
_EMBED = "model.embed_tokens.weight"
# safetensors dtype names this loader takes (NumPy gets bfloat16 from ml_dtypes, via JAX).
_DTYPES: dict[str, DType] = {
    "F32": jnp.float32,
    "BF16": jnp.bfloat16,
    "F16": jnp.float16,
}  # transformers refuses safetensors files without a known format


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded or written; the message names why."""


# `model.dtype` (config) -> the JAX dtype of the policy's params and compute.
_POLICY_DTYPES: dict[str, DType] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def policy_dtype(name: str) -> DType:
    """The JAX dtype a `model.dtype` of `name` loads and runs the policy in."""
    if name not in _POLICY_DTYPES:
        raise CheckpointError(f"model.dtype {name!r}: expected one of {', '.join(_POLICY_DTYPES)}")
    return _POLICY_DTYPES[name]


@dataclass(frozen=True)
class _Slot:
    """Where an HF tensor goes: the parameter path, the HF shape, and whether to transpose."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool


def hf_name(path: Iterable[str]) -> tuple[str, bool]:
    """(HF tensor name, transposed?) of a parameter path.

    ("model", "layers_3", "mlp", "up_proj", "kernel") -> ("model.layers.3.mlp.up_proj.weight",
    True); embeddings and norm weights keep their layout.
    """
    *scope, leaf = path
    parts = [_LAYER.sub(r"layers.\1", part) for part in scope]
    transpose = leaf == "kernel"
    name = "weight" if leaf in ("kernel", "embedding") else leaf
    return ".".join([*parts, name]), transpose


def _slots(spec: ModelSpec) -> dict[str, _Slot]:
    """Every tensor a checkpoint of `spec` must hold, by HF name."""
    slots = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(spec))[0]:
        path = tuple(str(k.key) for k in key_path)
        name, transpose = hf_name(path)
        shape = tuple(leaf.shape)
        slots[name] = _Slot(path, shape[::-1] if transpose else shape, transpose)
    return slots


# ---------------------------------------------------------------------------------------
# Loading.


def load_checkpoint(path: str | Path, dtype: DType | None = None) -> tuple[ModelSpec, Params]:
    """The spec and parameters of the HF checkpoint directory `path`.

    dtype: the parameters' dtype (and so the compute dtype); None keeps the checkpoint's
    own, that of its embedding. Raises CheckpointError naming the problem (a bad config
    too: its SpecError is the cause).
    """
    root = Path(path)
    if not (root / CONFIG).is_file():
        raise CheckpointError(f"{root}: missing {CONFIG}")
    try:
        spec = ModelSpec.from_dir(root)
    except SpecError as err:
        raise CheckpointError(str(err)) from err
    slots = _slots(spec)
    located = _locate(root, slots, spec)
    missing = sorted(set(slots) - set(located))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{root}: missing tensor {missing[0]}{more}")
    return spec, _read(located, slots, dtype)


def _tensor_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = root / INDEX
    if index.is_file():
        weight_map = _weight_map(index)
        files = []
        for name, file in weight_map.items():
            shard = root / file
            if not shard.is_file():
                raise CheckpointError(f"{index}: shard {file} (holding {name}) is missing")
            if shard not in files:
                files.append(shard)
        return files
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise CheckpointError(f"{root}: no {SINGLE} and no {INDEX}")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index}: not an index with a weight_map ({err})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(f, str) and "/" not in f for f in weight_map.values()
    ):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def _locate(root: Path, slots: Mapping[str, _Slot], spec: ModelSpec) -> dict[str, Path]:
    """Which file holds each expected tensor, with names and shapes checked (no data read)."""
    located: dict[str, Path] = {}
    for file in _tensor_files(root):
        with _open(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if _ignored(name, spec):
                    continue
                _check_tensor(file, name, f.get_slice(name), slots)
                if name in located:
                    raise CheckpointError(f"{file}: tensor {name} also in {located[name].name}")
                located[name] = file
    return located


@contextlib.contextmanager
def _open(file: Path) -> Iterator[safe_open]:
    """safe_open for reading, a damaged file (truncated, not safetensors) a CheckpointError."""
    try:
        with safe_open(file, framework="numpy") as f:
            yield f
    except SafetensorError as err:
        raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None


class _Slice(Protocol):
    """What safetensors' `get_slice` hands back (its stub leaves it untyped)."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...


def _check_tensor(file: Path, name: str, tensor: _Slice, slots: Mapping[str, _Slot]) -> None:
    """Raise unless `name` is an expected tensor of the expected shape and a float dtype."""
    shape = list(tensor.get_shape())
    if name not in slots:
        raise CheckpointError(f"{file}: unexpected tensor {name} {shape}")
    if shape != list(slots[name].shape):
        raise CheckpointError(
            f"{file}: tensor {name} has shape {shape}, expected {list(slots[name].shape)}"
        )
    if tensor.get_dtype() not in _DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name} has dtype {tensor.get_dtype()}, "
            f"expected one of {', '.join(_DTYPES)}"
        )


def _ignored(name: str, spec: ModelSpec) -> bool:
    # A tied checkpoint may still store the head; transformers ties it to the embedding.
    tied_head = spec.tie_word_embeddings and name == "lm_head.weight"
    return tied_head or _IGNORED.fullmatch(name) is not None


def _read(located: Mapping[str, Path], slots: Mapping[str, _Slot], dtype: DType | None) -> Params:
    """The parameter pytree, each tensor cast to `dtype` (None: the embedding's dtype).

    Tensors go to the device one at a time, so host memory holds one tensor, not a model.
    """
    if dtype is None:
        with _open(located[_EMBED]) as f:
            dtype = _DTYPES[f.get_slice(_EMBED).get_dtype()]
    target = np.dtype(dtype)
    by_file: dict[Path, list[str]] = {}
    for name, file in located.items():
        by_file.setdefault(file, []).append(name)
    params: dict[str, PyTree] = {}
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                slot = slots[name]
                value = f.get_tensor(name).astype(target, copy=False)
                _set(params, slot.path, jnp.asarray(value.T if slot.transpose else value))
    return params


def _set(tree: dict[str, PyTree], path: tuple[str, ...], value: jax.Array) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------------------------------
# Export.


def export_checkpoint(
    path: str | Path, spec: ModelSpec, params: Params, max_shard_bytes: int | None = None
) -> None:
    """Write `params` as an HF checkpoint directory that transformers loads.

    config.json plus model.safetensors, or, with max_shard_bytes, shards of at most that
    many bytes (a larger tensor gets a shard of its own) and model.safetensors.index.json.
    Checkpoint files already in the directory are replaced (stale shards removed).
    """
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    root = Path(path)
    tensors = _hf_tensors(spec, params)
    dtype = tensors[_EMBED].dtype
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        if old.name in (SINGLE, INDEX) or _SHARD.fullmatch(old.name):
            old.unlink()
    config = spec.to_config() | {"dtype": str(dtype)}
    (root / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if max_shard_bytes is None:
        save_file(tensors, str(root / SINGLE), metadata=_METADATA)
        return
    shards = _plan_shards(tensors, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(root / file), metadata=_METADATA)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _hf_tensors(spec: ModelSpec, params: Params) -> dict[str, np.ndarray]:
    """HF name -> contiguous host array; the parameter tree must be exactly the spec's."""
    slots = _slots(spec)
    by_path = {slot.path: name for name, slot in slots.items()}
    tensors: dict[str, np.ndarray] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(str(getattr(k, "key", k)) for k in key_path)
        if path not in by_path:
            raise CheckpointError(f"parameter {'/'.join(path)} is not part of this spec")
        name = by_path[path]
        array = np.asarray(leaf)
        array = array.T if slots[name].transpose else array
        if array.shape != slots[name].shape:
            raise CheckpointError(
                f"parameter {'/'.join(path)} gives {name} shape {list(array.shape)}, "
                f"expected {list(slots[name].shape)}"
            )
        tensors[name] = np.ascontiguousarray(array)
    missing = sorted(set(slots) - set(tensors))
    if missing:
        raise CheckpointError(f"parameters lack {'/'.join(slots[missing[0]].path)}")
    if len({t.dtype for t in tensors.values()}) > 1:
        raise CheckpointError("parameters mix dtypes; cast them to one first")
    return tensors


def _plan_shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most max_bytes each."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += array.nbytes
    return shards


def build_tiny_checkpoint(path: str | Path, spec: ModelSpec, seed: int) -> None:
    """Write a checkpoint of `spec` with random float32 weights (`llm.init_params`)."""
    export_checkpoint(path, spec, init_params(spec, seed))
