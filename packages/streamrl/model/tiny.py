"""The built-in tiny policy, as a real Hugging Face checkpoint directory built locally.

With `model.checkpoint` empty, the policy is a small random model of `model.family` with the
sizes in `[model]`, plus the tiny BPE tokenizer and its ChatML tool template
(`streamrl.chat.tiny_tokenizer`), written to the cache once per content hash. Everything
downstream reads it through the same code path as a real Qwen or Llama checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from streamrl.chat.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from streamrl.config import Config, ModelConfig
from streamrl.model.checkpoint import build_tiny_checkpoint
from streamrl.model.spec import ModelSpec

# Bump when the built checkpoint would differ for the same config (init, tokenizer corpus).
TINY_VERSION = 1
VOCAB_MULTIPLE = 64  # embedding rows rounded up, as HF checkpoints do


def cache_root(cfg: ModelConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache/streamrl"


def builtin_spec(cfg: ModelConfig, vocab_size: int) -> ModelSpec:
    """The architecture of the built-in model for a tokenizer of `vocab_size` ids."""
    vocab = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return ModelSpec.from_config({
        "model_type": cfg.family,
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.d_model // cfg.num_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    })  # fmt: skip


def builtin_key(cfg: Config) -> str:
    m = cfg.model
    inputs = {
        "version": TINY_VERSION,
        "template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest(),
        "seed": cfg.model_seed,
        "model": m.model_dump(include={"family", "d_model", "num_layers", "num_heads",
                                       "num_kv_heads", "d_ff", "max_seq_len", "rope_theta"}),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def ensure_checkpoint(cfg: Config) -> Path:
    """The policy's checkpoint directory: `model.checkpoint`, or the built-in one (built now
    if the cache lacks it; concurrent builders race harmlessly to one atomic rename)."""
    if cfg.model.checkpoint:
        return Path(cfg.model.checkpoint).expanduser()
    target = cache_root(cfg.model) / f"tiny-{builtin_key(cfg)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_tiny_tokenizer(tmp)
        from transformers import AutoTokenizer  # only to count the ids it built

        vocab = len(AutoTokenizer.from_pretrained(tmp, local_files_only=True))
        build_tiny_checkpoint(tmp, builtin_spec(cfg.model, vocab), cfg.model_seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: theirs is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
