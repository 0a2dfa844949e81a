"""The tiny built-in policy the episode and weight-sync tests run, and a degenerate version
of it whose every greedy turn is one stop token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from streamrl.chat.hf import HFChat
from streamrl.config import Config, parse_config
from streamrl.model.checkpoint import load_checkpoint
from streamrl.model.spec import ModelSpec
from streamrl.model.tiny import ensure_checkpoint
from streamrl.wire import Task


def tiny_policy(cache_dir: Path) -> tuple[Config, HFChat, ModelSpec, Any]:
    """A one-layer built-in checkpoint (cached under `cache_dir`): config, chat, spec, params."""
    cfg = parse_config(
        {
            "model": {
                "cache_dir": str(cache_dir),
                "d_model": 32,
                "num_layers": 1,
                "num_heads": 2,
                "num_kv_heads": 1,
                "d_ff": 64,
            },
            "rollout": {"max_turn_tokens": 16, "max_steps": 2},
        }
    )
    ckpt = ensure_checkpoint(cfg)
    spec, params = load_checkpoint(ckpt)
    return cfg, HFChat.from_dir(ckpt), spec, params


def always_eos(params: Any, scale: float = 1.0) -> Any:
    """A degenerate but real model whose greedy choice is always id 1 (<|endoftext|>, a
    stop id), so each turn is one real stop token and every episode reaches its
    environment steps: every token embeds to u (id 1 to 2u), attention and MLP outputs are
    zeroed, so the final hidden state is u/rms(u) and, with tied embeddings, id 1 scores
    twice what every other id does. `scale` multiplies the other weights first, so that
    published versions differ without changing that. Returns a new tree."""
    params = jax.tree.map(lambda x: x * np.asarray(scale, x.dtype), params)
    emb = params["model"]["embed_tokens"]["embedding"]
    u = jnp.linspace(0.5, 1.5, emb.shape[1], dtype=emb.dtype)
    params["model"]["embed_tokens"]["embedding"] = jnp.tile(u, (emb.shape[0], 1)).at[1].set(2 * u)
    for name, layer in params["model"].items():
        if name.startswith("layers_"):
            layer["self_attn"]["o_proj"]["kernel"] = layer["self_attn"]["o_proj"]["kernel"] * 0
            layer["mlp"]["down_proj"]["kernel"] = layer["mlp"]["down_proj"]["kernel"] * 0
    return params


def scripted_task(i: int, kind: str) -> Task:
    """A one-member task whose environment the test supplies."""
    return Task(
        task_id=f"t{i}",
        group_id=f"g{i}",
        kind=kind,
        prompt="",
        answer="",
        num_generations=1,
        cursor=i,
    )
