"""Our Flax decoders against transformers' PyTorch models, family by family.

Each case is a tiny random model built and saved by transformers itself (float32), loaded
with `load_checkpoint`; logits must agree to 1e-4 and greedy continuations (our jitted
KV-cache loop, rows at different lengths) must equal `generate`'s token for token.
Exported checkpoints must load back into transformers with the same logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from streamrl.model.checkpoint import export_checkpoint, load_checkpoint
from streamrl.model.llm import Params, causal_logits, forward, init_cache
from streamrl.model.spec import ModelSpec

VOCAB = 256
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the test's positions cross all three wavelength bands' boundaries.
    "original_max_position_embeddings": 16,
}
CASES: dict[str, Callable[[], transformers.PreTrainedConfig]] = {
    # q/k/v biases, tied head
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    # q/k norm, head_dim 32 != 64 / 4, untied
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, rms_norm_eps=1e-5),
    # Llama 3.1 RoPE scaling, untied, several eos ids
    "llama": lambda: transformers.LlamaConfig(
        **SMALL, rope_parameters=LLAMA3_ROPE, bos_token_id=1, eos_token_id=[2, 3]
    ),
    "qwen3_yarn": lambda: transformers.Qwen3Config(
        **SMALL,
        head_dim=32,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama_linear": lambda: transformers.LlamaConfig(
        **SMALL,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
}
FAMILIES = ("qwen2", "qwen3", "llama")
NEW_TOKENS = 32


def _randomise(model: torch.nn.Module) -> None:
    """Weights with some spread: norms around 1, nonzero biases, logits of order 1-10.

    The default init (norms 1, biases 0, tiny weights) would hide a swapped norm or a
    dropped bias behind nearly uniform logits.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 1.5 / p.shape[1] ** 0.5)


class Case:
    """One reference model, saved by transformers and loaded by us."""

    def __init__(self, name: str, root: Path) -> None:
        torch.manual_seed(0)
        config = CASES[name]()
        self.torch_model = transformers.AutoModelForCausalLM.from_config(config).eval()
        _randomise(self.torch_model)
        self.dir = root / name
        self.torch_model.save_pretrained(self.dir)
        self.spec, self.params = load_checkpoint(self.dir)
        # generate() fills a None eos_token_id of the GenerationConfig it is given from the
        # model's own generation_config; only clearing it there lets it run all its steps.
        self.torch_model.generation_config.eos_token_id = None

    def torch_logits(self, tokens: np.ndarray, model: Any = None) -> np.ndarray:
        with torch.no_grad():
            out = (model or self.torch_model)(torch.tensor(tokens, dtype=torch.long))
        return out.logits.float().numpy()


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Case]]:
    """Case by name, built on first use and shared by every test of this module."""
    root = tmp_path_factory.mktemp("hf")
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            built[name] = Case(name, root)
        return built[name]

    transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
    yield get
    transformers.utils.logging.enable_progress_bar()


def _tokens(batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


_jit_causal = jax.jit(causal_logits, static_argnums=1)


def _ours(params: Params, spec: ModelSpec, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_jit_causal(params, spec, jnp.asarray(tokens, jnp.int32)))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name: str, cases: Callable[[str], Case]) -> None:
    case = cases(name)
    tokens = _tokens(2, 20, seed=1)
    ref = case.torch_logits(tokens)
    ours = _ours(case.params, case.spec, tokens)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_specs_read_from_saved_configs(cases: Callable[[str], Case]) -> None:
    qwen2 = cases("qwen2").spec
    assert (qwen2.family, qwen2.attention_bias, qwen2.tie_word_embeddings) == ("qwen2", True, True)
    qwen3 = cases("qwen3").spec
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.rms_norm_eps) == (True, 32, 1e-5)
    llama = cases("llama").spec
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert (llama.rope_theta, llama.bos_token_id, llama.eos_token_ids) == (500000.0, 1, (2, 3))
    for name in CASES:
        spec = cases(name).spec
        assert spec.num_params() == cases(name).torch_model.num_parameters()


def _greedy(params: Params, spec: ModelSpec, prompts: list[list[int]], steps: int) -> np.ndarray:
    """[B, steps] greedy tokens, all rows decoded together, each at its own length.

    Prefill writes each prompt's keys at slots 0..len-1 (pads at slot S: dropped); each
    decode step writes row b's token at slot len_b + step and lets it see slots 0..itself.
    """
    batch, width = len(prompts), max(len(p) for p in prompts)
    slots = width + steps
    lengths = np.array([len(p) for p in prompts])
    tokens = np.zeros((batch, width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    step = jax.jit(
        lambda p, t, pos, w, m, c: forward(p, spec, t, pos, cache=c, write_pos=w, attn_mask=m)
    )
    cols = np.arange(width)
    positions = np.broadcast_to(cols, (batch, width)).astype(np.int32)
    write_pos = np.where(cols < lengths[:, None], cols, slots).astype(np.int32)
    seen = (np.arange(slots) <= cols[:, None])[None] & (np.arange(slots) < lengths[:, None, None])
    cache = init_cache(spec, batch, slots)
    logits, cache = step(params, tokens, positions, write_pos, seen, cache)
    nxt = np.asarray(logits)[np.arange(batch), lengths - 1].argmax(-1)
    out, pos = [nxt], lengths.copy()
    for _ in range(steps - 1):
        now = pos[:, None].astype(np.int32)
        mask = np.arange(slots)[None, None, :] <= pos[:, None, None]
        logits, cache = step(params, nxt[:, None].astype(np.int32), now, now, mask, cache)
        nxt = np.asarray(logits)[:, 0].argmax(-1)
        out.append(nxt)
        pos += 1
    return np.stack(out, axis=1)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_generate(name: str, cases: Callable[[str], Case]) -> None:
    case = cases(name)
    prompts = [_tokens(1, 16, seed=2)[0].tolist(), _tokens(1, 11, seed=3)[0].tolist()]
    ours = _greedy(case.params, case.spec, prompts, NEW_TOKENS)
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = case.torch_model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=gen
            )
        ref = out[0, len(prompt) :].tolist()
        assert len(ref) == NEW_TOKENS
        assert ours[row].tolist() == ref, f"row {row}"


def _from_pretrained(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_in_transformers(
    name: str, cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases(name)
    export_checkpoint(tmp_path, case.spec, case.params)
    reloaded = _from_pretrained(tmp_path)
    assert type(reloaded) is type(case.torch_model)
    tokens = _tokens(2, 16, seed=4)
    # Same weights, same torch code: the logits are identical, not merely close.
    np.testing.assert_array_equal(case.torch_logits(tokens, reloaded), case.torch_logits(tokens))
    assert ModelSpec.from_dir(tmp_path) == case.spec


def test_sharded_export_round_trip(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("llama")
    export_checkpoint(tmp_path, case.spec, case.params, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((tmp_path / s).is_file() for s in shards)
    assert not (tmp_path / "model.safetensors").exists()
    tokens = _tokens(2, 16, seed=5)
    np.testing.assert_array_equal(
        case.torch_logits(tokens, _from_pretrained(tmp_path)), case.torch_logits(tokens)
    )
    spec, params = load_checkpoint(tmp_path)
    assert spec == case.spec
    np.testing.assert_array_equal(
        _ours(params, spec, tokens), _ours(case.params, case.spec, tokens)
    )


def test_loads_transformers_sharded_save(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("qwen3")
    case.torch_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    spec, params = load_checkpoint(tmp_path)
    tokens = _tokens(2, 12, seed=6)
    np.testing.assert_allclose(
        _ours(params, spec, tokens), case.torch_logits(tokens), rtol=0, atol=1e-4
    )


def test_bfloat16_checkpoint(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("qwen2")
    model = case.torch_model.to(torch.bfloat16)
    try:
        model.save_pretrained(tmp_path)
        tokens = _tokens(2, 16, seed=7)
        ref = case.torch_logits(tokens, model)
    finally:
        case.torch_model.to(torch.float32)
    spec, params = load_checkpoint(tmp_path)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    ours = _ours(params, spec, tokens)
    assert ours.dtype == np.float32
    # bf16 keeps ~3 significant digits, and the two stacks round at different places.
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() < 0.05 * scale
    # Loading the same file as float32 gives the float32 model of the rounded weights.
    _, params32 = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params32))
    assert np.abs(_ours(params32, spec, tokens) - ref).max() < 0.05 * scale
