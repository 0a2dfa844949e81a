"""Weights through a file: round trip, and every kind of damage is a clear WeightsError."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import msgspec
import numpy as np
import pytest

from streamrl.model.llm import Params, init_params
from streamrl.model.spec import ModelSpec
from streamrl.model.weights import (
    WeightsError,
    params_from_bytes,
    params_to_bytes,
    params_to_pieces,
)
from streamrl.names import Keys
from streamrl.weightsync import DirChannel, checksum, read_published
from streamrl.wire import Weights

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


def _publish(path: Path, params: Params, algorithm: str = "xxh3_128") -> Weights:
    """params written through a `dir` channel, announced as the trainer announces them."""
    pieces = params_to_pieces(params)
    where = DirChannel(path).write(1, pieces)
    nbytes = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
    return Weights(
        version=1, step=1, path=where.path, nbytes=nbytes, checksum=checksum(algorithm, *pieces)
    )


def _read(msg: Weights, template: Params) -> Params:
    """Read as a worker whose weights directory is the one `msg` was written to."""
    return params_from_bytes(template, read_published(msg, None, Keys("t"), Path(msg.path).parent))


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_round_trip(params: Params, tmp_path: Path, algorithm: str) -> None:
    assert _equal(params_from_bytes(params, params_to_bytes(params)), params)
    msg = _publish(tmp_path / "w", params, algorithm)
    path = Path(msg.path)
    assert msg.nbytes == path.stat().st_size and path.name == "v000001.weights"
    assert msg.checksum == checksum(algorithm, path.read_bytes())
    assert msg.checksum.startswith(f"{algorithm}:")
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    template = jax.eval_shape(lambda: params)  # shapes only, as a reader that has no params
    assert _equal(_read(msg, template), params)


def test_truncated_file(params: Params, tmp_path: Path) -> None:
    msg = _publish(tmp_path, params)
    path = Path(msg.path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightsError, match=rf"has {msg.nbytes - 10} bytes, expected {msg.nbytes}"):
        _read(msg, params)
    # Even announced with its own size and checksum, a truncated body does not decode.
    data = path.read_bytes()
    cut = msgspec.structs.replace(msg, nbytes=len(data), checksum=checksum("xxh3_128", data))
    with pytest.raises(WeightsError, match=r"cannot decode weights: .* past the end"):
        _read(cut, params)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_flipped_byte(params: Params, tmp_path: Path, algorithm: str) -> None:
    msg = _publish(tmp_path, params, algorithm)
    path = Path(msg.path)
    data = bytearray(path.read_bytes())
    data[msg.nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        WeightsError, match=rf"has checksum {algorithm}:[0-9a-f]+, expected {msg.checksum}"
    ):
        _read(msg, params)


def test_missing_file_and_wrong_shapes(params: Params, tmp_path: Path) -> None:
    msg = _publish(tmp_path, params)
    Path(msg.path).unlink()
    with pytest.raises(WeightsError, match=r"weights file .*v000001\.weights is missing"):
        _read(msg, params)
    other = init_params(dataclasses.replace(SPEC, intermediate_size=64), seed=1)
    with pytest.raises(
        WeightsError,
        match=r"\['down_proj'\]\['kernel'\] are float32\[64, 16\], expected float32\[32, 16\]",
    ):
        params_from_bytes(params, params_to_bytes(other))


def test_only_regular_files_in_the_weights_directory_are_read(
    params: Params, tmp_path: Path
) -> None:
    """Review L6: the signal's path is confined to the reader's weights directory, opened
    without blocking (a FIFO would hang the loader for ever) and must be a regular file;
    every failure is a WeightsError (the follower refuses it), not an OSError (a crash)."""
    weights = tmp_path / "weights"
    msg = _publish(weights, params)
    keys = Keys("t")
    assert read_published(msg, None, keys, weights).nbytes == msg.nbytes
    elsewhere = tmp_path / "elsewhere.weights"
    elsewhere.write_bytes(Path(msg.path).read_bytes())  # a good copy, but not where it may be
    escape = str(weights / ".." / "elsewhere.weights")
    link = weights / "v000009.weights"
    link.symlink_to(elsewhere)
    for path in (elsewhere, escape, link):
        moved = msgspec.structs.replace(msg, path=str(path))
        with pytest.raises(WeightsError, match="is not in the weights directory"):
            read_published(moved, None, keys, weights)
    fifo = weights / "v000010.weights"
    os.mkfifo(fifo)
    (weights / "sub").mkdir()
    for path in (weights, weights / "sub", fifo):
        moved = msgspec.structs.replace(msg, path=str(path))
        with pytest.raises(WeightsError, match="is not a regular file"):
            read_published(moved, None, keys, weights)
    with pytest.raises(WeightsError, match="this reader has no dir"):
        read_published(msg, None, keys, None)
