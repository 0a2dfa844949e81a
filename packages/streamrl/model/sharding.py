"""Device meshes for the policy: data and tensor axes, by configuration.

Tensor parallelism (Megatron style) splits attention by heads and the MLP by its inner
size: q/k/v and gate/up are sharded along their output features, o_proj and down_proj along
their input features, so each device computes its heads and its slice of the MLP and one
all-reduce per block joins them (XLA's SPMD partitioner inserts it). Embeddings and norms
are replicated. The KV-cache pool is sharded by slot over `data` and by key/value head over
`tensor`, so each device keeps the caches of its sequences and heads.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl.model.spec import ModelSpec, PyTree

DATA, TENSOR = "data", "tensor"

_OUT_SHARDED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_IN_SHARDED = ("o_proj", "down_proj")


class MeshError(ValueError):
    pass


def grid_mesh(
    axes: dict[str, int], devices: list[jax.Device] | None = None, what: str = "mesh"
) -> Mesh:
    """A mesh with these named axes and sizes over the first devices (all of them: local
    and, under jax.distributed, remote); `what` names it in the error."""
    devices = devices if devices is not None else jax.devices()
    need = int(np.prod(list(axes.values())))
    if need > len(devices):
        sizes = " x ".join(f"{name}={n}" for name, n in axes.items())
        raise MeshError(f"{what} {sizes} needs {need} devices; {len(devices)} available")
    return Mesh(np.asarray(devices[:need]).reshape(*axes.values()), tuple(axes))


def make_mesh(data: int, tensor: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A (data, tensor) mesh over the first data x tensor devices."""
    return grid_mesh({DATA: data, TENSOR: tensor}, devices)


def check_spec(spec: ModelSpec, mesh: Mesh) -> None:
    """The model's head counts and inner size must split evenly over the tensor axis."""
    t = mesh.shape[TENSOR]
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(spec, name) % t:
            raise MeshError(f"{name} ({getattr(spec, name)}) is not divisible by tensor={t}")


def _param_spec(path: jax.tree_util.KeyPath, leaf: object) -> PartitionSpec:
    names = [str(getattr(p, "key", p)) for p in path]
    module, kind = (names[-2], names[-1]) if len(names) >= 2 else ("", names[-1])
    # Attached LoRA adapters (x @ A @ B) follow their kernel: B [rank, out] split like an
    # output-sharded kernel, A [in, rank] like an input-sharded one, the rank replicated.
    if module in _OUT_SHARDED:
        if kind in ("kernel", "lora_b"):
            return PartitionSpec(None, TENSOR)
        return PartitionSpec() if kind == "lora_a" else PartitionSpec(TENSOR)
    if module in _IN_SHARDED and kind in ("kernel", "lora_a"):
        return PartitionSpec(TENSOR, None)
    return PartitionSpec()


def shard_params(params: PyTree, mesh: Mesh) -> PyTree:
    """Place params on the mesh (tensor-parallel layout above)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, _param_spec(path, x))), params
    )


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Each pool block, k [slots, kv_heads, head_dim, n] and v [slots, kv_heads, n,
    head_dim]: slots over data, heads over tensor."""
    return NamedSharding(mesh, PartitionSpec(DATA, TENSOR))


def shard_cache(cache: PyTree, mesh: Mesh) -> PyTree:
    return jax.tree.map(lambda x: jax.device_put(x, cache_sharding(mesh)), cache)
