"""The policy a run starts from, loaded one way for the trainer, the rollout worker and the
evaluator: its checkpoint directory (`model.checkpoint`, or the built-in tiny one), its chat
(tokenizer and template), its model spec and its params in `model.dtype`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.config import Config
from streamrl.model.checkpoint import load_checkpoint, policy_dtype
from streamrl.model.spec import ModelSpec, PyTree
from streamrl.model.tiny import ensure_checkpoint

if TYPE_CHECKING:
    from streamrl.chat.hf import HFChat


@dataclass(frozen=True)
class StartingPolicy:
    """`source_dir`: the checkpoint directory (its tokenizer files go into exports)."""

    source_dir: Path
    chat: HFChat
    spec: ModelSpec
    params: PyTree


def starting_policy(
    cfg: Config, *, warm: bool, info: Callable[..., object] | None = None
) -> StartingPolicy:
    """The run's starting policy. With `warm` and `model.init = "warmstart"`, its params are
    the warm start's (trained once and cached; `info` logs its progress); otherwise the
    checkpoint's, which is what the rollout worker wants: the structure published versions
    decode into, the trainer's own values coming with version 0."""
    from streamrl.chat.hf import HFChat

    ckpt = ensure_checkpoint(cfg)
    chat = HFChat.for_model(ckpt, cfg.model)
    if warm and cfg.model.init == "warmstart":
        from streamrl.trainer.warmstart import warmstart_params

        return StartingPolicy(ckpt, chat, ModelSpec.from_dir(ckpt), warmstart_params(cfg, info))
    spec, params = load_checkpoint(ckpt, policy_dtype(cfg.model.dtype))
    return StartingPolicy(ckpt, chat, spec, params)
