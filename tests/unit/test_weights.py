"""Weight files: round trip, and every kind of damage is a clear WeightsError."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from streamrl.model.llm import Params, init_params
from streamrl.model.spec import ModelSpec
from streamrl.model.weights import (
    WeightsError,
    params_from_bytes,
    params_to_bytes,
    read_weights,
    sha256_hex,
    write_weights,
)

SPEC = ModelSpec.from_config(
    {
        "model_type": "qwen2",
        "vocab_size": 20,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    }
)


@pytest.fixture(scope="module")
def params() -> Params:
    return init_params(SPEC, seed=1)


def _equal(a: Params, b: Params) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    same_tree = str(jax.tree.structure(a)) == str(jax.tree.structure(b))
    return same_tree and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def test_round_trip(params: Params, tmp_path: Path) -> None:
    assert _equal(params_from_bytes(params, params_to_bytes(params)), params)
    path = tmp_path / "v1" / "weights.msgpack"
    nbytes, digest = write_weights(path, params)
    assert nbytes == path.stat().st_size
    assert digest == sha256_hex(path.read_bytes())
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    template = jax.eval_shape(lambda: params)  # shapes only, as a reader that has no params
    assert _equal(read_weights(path, template, digest, nbytes), params)


def test_truncated_file(params: Params, tmp_path: Path) -> None:
    path = tmp_path / "w.msgpack"
    nbytes, digest = write_weights(path, params)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightsError, match=rf"has {nbytes - 10} bytes, expected {nbytes}"):
        read_weights(path, params, digest, nbytes)
    # Even announced with its own size and checksum, a truncated body does not decode.
    data = path.read_bytes()
    with pytest.raises(WeightsError, match="cannot decode weights"):
        read_weights(path, params, sha256_hex(data), len(data))


def test_flipped_byte(params: Params, tmp_path: Path) -> None:
    path = tmp_path / "w.msgpack"
    nbytes, digest = write_weights(path, params)
    data = bytearray(path.read_bytes())
    data[nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=rf"sha256 [0-9a-f]{{64}}, expected {digest}"):
        read_weights(path, params, digest, nbytes)


def test_missing_file_and_wrong_shapes(params: Params, tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="is missing"):
        read_weights(tmp_path / "nope", params, "0" * 64, 1)
    other = init_params(dataclasses.replace(SPEC, intermediate_size=64), seed=1)
    with pytest.raises(
        WeightsError,
        match=r"\['down_proj'\]\['kernel'\] are float32\[64, 16\], expected float32\[32, 16\]",
    ):
        params_from_bytes(params, params_to_bytes(other))
