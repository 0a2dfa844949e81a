"""LoRA adapters on the policy's dense layers: `W + (alpha / rank) * A @ B`.

Adapters live in their own pytree, mirroring the base params' paths down to each targeted
`Linear` (`{"model": {"layers_0": {"self_attn": {"q_proj": {"lora_a", "lora_b"}}}}}`), so
the base stays frozen and only adapter bytes need to travel. `A` [in, rank] starts small and
random, `B` [rank, out] at zero, so a fresh adapter leaves the model unchanged (PEFT's
initialisation).

Unmerged use: `apply_lora(params, adapters, cfg)` inside the jitted function folds the
adapters into the kernels on the fly, so gradients reach `A` and `B` only through the
product (exactly LoRA's) while `params` stay untouched. Merged use: the same function once,
outside, gives plain params for serving and export. Attached use (`attach_lora`): the
adapters sit beside the kernels and the model's `Linear` adds `(x @ A) @ B`, so a rollout
worker can take a new adapter version without rewriting the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from streamrl.config import LORA_TARGETS
from streamrl.model.spec import PyTree

Params = PyTree

TARGETS = LORA_TARGETS


class LoraError(ValueError):
    pass


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise LoraError(f"LoRA rank {self.rank} must be at least 1")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise LoraError(f"LoRA targets {unknown or '[]'} not among {list(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _targets(params: Params, cfg: LoraConfig) -> list[tuple[tuple[str, ...], jax.Array]]:
    """(path of the Linear module, its kernel) for every targeted layer."""
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = tuple(str(getattr(p, "key", p)) for p in path)
        if names[-1] == "kernel" and len(names) >= 2 and names[-2] in cfg.targets:
            found.append((names[:-1], leaf))
    if not found:
        raise LoraError(f"no layer of the model matches the LoRA targets {list(cfg.targets)}")
    return found


def _set(tree: dict[str, PyTree], path: tuple[str, ...], value: jax.Array) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _get(tree: PyTree, path: tuple[str, ...]) -> PyTree:
    for name in path:
        tree = tree[name]
    return tree


def init_lora(params: Params, cfg: LoraConfig, seed: int) -> Params:
    """Fresh adapters for the targeted layers (A ~ N(0, 1/in), B = 0)."""
    adapters: dict[str, PyTree] = {}
    for i, (path, kernel) in enumerate(_targets(params, cfg)):
        fan_in, fan_out = kernel.shape
        rng = np.random.default_rng([seed, i])
        a = rng.standard_normal((fan_in, cfg.rank)) / np.sqrt(fan_in)
        _set(adapters, (*path, "lora_a"), jnp.asarray(a, kernel.dtype))
        _set(adapters, (*path, "lora_b"), jnp.zeros((cfg.rank, fan_out), kernel.dtype))
    return adapters


def apply_lora(params: Params, adapters: Params, cfg: LoraConfig) -> Params:
    """Params with every adapter folded in: kernel + scale * A @ B (a new tree)."""
    merged = jax.tree.map(lambda x: x, params)  # copy the containers, share the leaves
    for path, kernel in _targets(params, cfg):
        module = _get(adapters, path)
        delta = (module["lora_a"] @ module["lora_b"]) * jnp.asarray(cfg.scale, kernel.dtype)
        _set(merged, (*path, "kernel"), kernel + delta.astype(kernel.dtype))
    return merged


def merge_lora(params: Params, adapters: Params, cfg: LoraConfig) -> Params:
    """`apply_lora` for serving, outside any jit: one XLA program folds every targeted
    kernel (compiled once per model and config, 2x faster than op by op and bit for bit
    `jax.jit(apply_lora)`'s kernels); untargeted leaves are shared, not copied."""
    targets = _targets(params, cfg)
    modules = [_get(adapters, path) for path, _ in targets]
    kernels = _fold(
        [k for _, k in targets],
        [m["lora_a"] for m in modules],
        [m["lora_b"] for m in modules],
        cfg.scale,
    )
    merged = jax.tree.map(lambda x: x, params)  # copy the containers, share the leaves
    for (path, _), kernel in zip(targets, kernels, strict=True):
        _set(merged, (*path, "kernel"), kernel)
    return merged


@partial(jax.jit, static_argnums=3)
def _fold(
    kernels: list[jax.Array], a: list[jax.Array], b: list[jax.Array], scale: float
) -> list[jax.Array]:
    return [
        k + ((x @ y) * jnp.asarray(scale, k.dtype)).astype(k.dtype)
        for k, x, y in zip(kernels, a, b, strict=True)
    ]


def attach_lora(params: Params, adapters: Params, cfg: LoraConfig) -> Params:
    """Params with every adapter beside its kernel, unmerged: `lora_a` and `scale *
    lora_b` next to `kernel` (a new tree; kernels, `A` and untargeted leaves shared),
    which `Linear` applies as `x @ kernel + (x @ A) @ B`. Serving this costs two thin
    matmuls per adapted layer and step instead of rewriting every adapted kernel per
    version (`merge_lora`)."""
    targets = _targets(params, cfg)
    modules = [_get(adapters, path) for path, _ in targets]
    scaled = _scale([m["lora_b"] for m in modules], cfg.scale)
    out = jax.tree.map(lambda x: x, params)
    for (path, kernel), module, b in zip(targets, modules, scaled, strict=True):
        _set(out, (*path, "lora_a"), module["lora_a"])
        _set(out, (*path, "lora_b"), b.astype(kernel.dtype))
    return out


@partial(jax.jit, static_argnums=1)
def _scale(bs: list[jax.Array], scale: float) -> list[jax.Array]:
    return [b * jnp.asarray(scale, b.dtype) for b in bs]


def num_adapter_params(adapters: Params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
