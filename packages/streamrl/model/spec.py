"""The architecture of a Hugging Face decoder checkpoint (Qwen2/Qwen2.5, Qwen3, Llama 3).

`ModelSpec` is parsed from a checkpoint's `config.json` and written back as one that
transformers 5 loads. Fields a config may omit take the defaults of transformers' own config
class for that family, so a spec means exactly the model transformers would build from the
same file. Anything this code base does not implement (sliding-window layers, MLP biases,
partial rotary dims, other RoPE types...) is a `SpecError` that names the field, never a
silently different model.

RoPE settings: transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", and the
type's own keys}); older checkpoints have top-level `rope_theta` and `rope_scaling`
({"type" or "rope_type", ...}). Both are read; `to_config` writes the transformers 5 layout.

This module imports no JAX: a bad config fails before the model stack loads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypedDict

__all__ = [
    "ROPE_TYPES",
    "SUPPORTED_FAMILIES",
    "Family",
    "ModelSpec",
    "PyTree",
    "RopeScaling",
    "SpecError",
]

# A JAX pytree: parameters, optimizer state, a KV cache, LoRA adapters: nested dicts (and
# lists, tuples) of arrays. JAX gives no static type for one, so this stays Any; the name
# says what a value is, where a bare Any would not.
PyTree = Any

Family = Literal["qwen2", "qwen3", "llama"]
SUPPORTED_FAMILIES: tuple[Family, ...] = ("qwen2", "qwen3", "llama")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # "default": no scaling

_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}


# Defaults of transformers' Qwen2Config / Qwen3Config / LlamaConfig (5.24) for the fields a
# config.json may leave out. The architecture sizes themselves have no default here: a
# checkpoint without them is broken, whatever transformers would guess.
class _Defaults(TypedDict, total=False):
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    head_dim: int


_FAMILY_DEFAULTS: dict[str, _Defaults] = {
    "qwen2": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None},
    "qwen3": {
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "head_dim": 128,
    },
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
}
_DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_DEFAULT_EPS = 1e-6


class SpecError(ValueError):
    """A config.json this code cannot model; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, with transformers' key names.

    rope_type "linear": positions divided by `factor`. "llama3": Llama 3.1 wavelength bands
    (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`).
    "yarn": YaRN (`factor`, `original_max_position_embeddings`, optional `attention_factor`,
    `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`, `truncate`); its attention factor
    scales cos and sin. None means "not set" (transformers' own default applies).
    """

    rope_type: Literal["linear", "llama3", "yarn"]
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def to_dict(self) -> dict[str, object]:
        """The set keys, as they appear in `rope_parameters`."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one decoder; hashable, so jit can take it as a static argument.

    head_dim: per-head size (Qwen3 states it; otherwise hidden_size / num_attention_heads).
    attention_bias: q/k/v projections have biases (always for Qwen2; for Qwen3 and Llama the
    config's flag, which there also gives o_proj a bias, see `o_proj_bias`).
    qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3, and only Qwen3).
    eos_token_ids: every end-of-sequence id (Llama 3 instruct configs list several).
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = _DEFAULT_EPS
    rope_theta: float = _DEFAULT_THETA
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise SpecError(_unsupported_family(self.family))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"`{name}` must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise SpecError(f"`head_dim` must be even for RoPE, got {self.head_dim}")
        if self.qk_norm != (self.family == "qwen3"):
            raise SpecError(f"`qk_norm` is {self.qk_norm}, but family {self.family} implies not")
        if self.family == "qwen2" and not self.attention_bias:
            raise SpecError("`attention_bias`: qwen2 always has q/k/v biases")

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: Qwen3 and Llama tie it to attention_bias; Qwen2 never."""
        return self.attention_bias and self.family != "qwen2"

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        """The spec of the checkpoint directory `path` (its config.json)."""
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise SpecError(f"{file}: missing config.json") from None
        except json.JSONDecodeError as err:
            raise SpecError(f"{file}: not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise SpecError(f"{file}: expected a JSON object")
        try:
            return cls.from_config(raw)
        except SpecError as err:
            raise SpecError(f"{file}: {err}") from None

    @classmethod
    def from_config(cls, cfg: Mapping[str, object]) -> ModelSpec:
        """The spec of a parsed config.json dict."""
        family = _family(cfg)
        _reject_unsupported(cfg)
        defaults = _FAMILY_DEFAULTS[family]
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        default_head_dim = defaults.get("head_dim", None) or hidden // heads
        max_pos = _int(cfg, "max_position_embeddings", defaults["max_position_embeddings"])
        theta, scaling = _rope(cfg, max_pos)
        return cls(
            family=family,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_hidden_layers=_int(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_int(cfg, "num_key_value_heads", heads),
            head_dim=_int(cfg, "head_dim", default_head_dim),
            rms_norm_eps=_float(cfg, "rms_norm_eps", _DEFAULT_EPS),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            # Qwen2 modeling code hard-wires the q/k/v biases and ignores any flag.
            attention_bias=family == "qwen2" or _bool(cfg, "attention_bias", False),
            qk_norm=family == "qwen3",
            max_position_embeddings=max_pos,
            bos_token_id=_token_id(cfg, "bos_token_id", defaults["bos_token_id"]),
            eos_token_ids=_eos_ids(cfg, defaults["eos_token_id"]),
        )

    def to_config(self) -> dict[str, object]:
        """A config.json dict (transformers 5 layout) that rebuilds this exact model."""
        rope: dict[str, object] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.to_dict())
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        cfg: dict[str, object] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if self.family != "qwen2":  # Qwen2Config has no such flag (its biases are fixed)
            cfg["attention_bias"] = self.attention_bias
        return cfg

    def num_params(self) -> int:
        """Number of parameters (a tied lm_head counted once)."""
        h, hd = self.hidden_size, self.head_dim
        q_out = self.num_attention_heads * hd
        kv_out = self.num_key_value_heads * hd
        attn = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head


def _unsupported_family(model_type: object) -> str:
    return f"unsupported `model_type` {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"


def _family(cfg: Mapping[str, object]) -> Family:
    if "model_type" not in cfg:
        raise SpecError("missing field `model_type`")
    model_type = cfg["model_type"]
    if model_type not in SUPPORTED_FAMILIES:
        raise SpecError(_unsupported_family(model_type))
    return model_type


def _reject_unsupported(cfg: Mapping[str, object]) -> None:
    """Raise on settings that change the model in ways this code does not implement."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"`hidden_act` {cfg['hidden_act']!r} unsupported (only 'silu')")
    if cfg.get("use_sliding_window", False):
        raise SpecError("`use_sliding_window` true: sliding-window attention is unsupported")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, Iterable):
        raise TypeError(f"`layer_types` {layer_types!r} is not a list")
    if any(kind != "full_attention" for kind in layer_types):
        raise SpecError(f"`layer_types` {layer_types!r}: only full_attention is supported")
    if cfg.get("mlp_bias", False):
        raise SpecError("`mlp_bias` true is unsupported")
    partial = cfg.get("partial_rotary_factor", 1.0)
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, Mapping):
        partial = rope.get("partial_rotary_factor", partial)
    if partial != 1.0:
        raise SpecError(f"`partial_rotary_factor` {partial!r} unsupported (only 1.0)")


def _missing(key: str) -> SpecError:
    return SpecError(f"missing field `{key}`")


_REQUIRED = object()


def _int(cfg: Mapping[str, object], key: str, default: object = _REQUIRED) -> int:
    value = cfg.get(key, default)
    if value is _REQUIRED:
        raise _missing(key)
    if value is None and default is not _REQUIRED:
        value = default  # transformers treats an explicit null like an absent key here
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(f"field `{key}` must be a positive integer, got {value!r}")
    return value


def _positive(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"field `{key}` must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise SpecError(f"field `{key}` must be a positive finite number, got {value!r}")
    return float(value)


def _float(cfg: Mapping[str, object], key: str, default: float) -> float:
    return _positive(cfg.get(key, default), key)


def _bool(cfg: Mapping[str, object], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"field `{key}` must be true or false, got {value!r}")
    return value


def _token_id(cfg: Mapping[str, object], key: str, default: int | None) -> int | None:
    value = cfg.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise SpecError(f"field `{key}` must be a token id or null, got {value!r}")
    return value


def _eos_ids(cfg: Mapping[str, object], default: int | None) -> tuple[int, ...]:
    value = cfg.get("eos_token_id", default)
    ids = value if isinstance(value, list) else [value]
    if value is None:
        return ()
    for one in ids:
        if not isinstance(one, int) or isinstance(one, bool) or one < 0:
            raise SpecError(f"field `eos_token_id` must be token ids or null, got {value!r}")
    return tuple(ids)


def _rope(cfg: Mapping[str, object], max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or the older keys."""
    params = cfg.get("rope_parameters")
    key = "rope_parameters"
    if not params:  # older layout; a rope_scaling dict never carries the theta
        params, key = cfg.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, Mapping):
        raise SpecError(f"field `{key}` must be an object or null, got {params!r}")
    params = dict(params)
    if isinstance(params.get("full_attention"), Mapping):
        raise SpecError(f"field `{key}`: per-layer-type RoPE is unsupported")
    raw_theta = params.get("rope_theta", cfg.get("rope_theta"))
    theta = _DEFAULT_THETA if raw_theta is None else _positive(raw_theta, "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise SpecError(
            f"field `{key}`: unsupported rope_type {rope_type!r}; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    return theta, _scaling(cfg, params, key, rope_type, max_pos)


def _scaling(
    cfg: Mapping[str, object], params: dict[str, object], key: str, rope_type: str, max_pos: int
) -> RopeScaling:
    def num(name: str, required: bool) -> float | None:
        if name not in params or params[name] is None:
            if required:
                raise SpecError(f"field `{key}.{name}` is required for rope_type {rope_type!r}")
            return None
        return _positive(params[name], f"{key}.{name}")

    factor = num("factor", required=True)
    assert factor is not None
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    # transformers' standardize_rope_params: a top-level original_max_position_embeddings
    # wins, then the dict's, then max_position_embeddings.
    if cfg.get("original_max_position_embeddings") is not None:
        original = _int(cfg, "original_max_position_embeddings")
    else:
        original = _int(params, "original_max_position_embeddings", max_pos)
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor,
            original_max_position_embeddings=original,
            low_freq_factor=num("low_freq_factor", required=True),
            high_freq_factor=num("high_freq_factor", required=True),
        )
    truncate = params.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise SpecError(f"field `{key}.truncate` must be true or false, got {truncate!r}")
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        attention_factor=num("attention_factor", required=False),
        beta_fast=num("beta_fast", required=False),
        beta_slow=num("beta_slow", required=False),
        mscale=num("mscale", required=False),
        mscale_all_dim=num("mscale_all_dim", required=False),
        truncate=truncate,
    )
