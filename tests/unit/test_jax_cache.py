"""The tests' shared XLA compilation cache (tests/conftest.py): many processes read and
write it at once (two test processes, every worker a test starts, the prewarm)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache


def test_an_entry_read_half_written_is_compiled_again_not_a_test_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JAX writes a cache entry in place and takes no lock, so a process reading an entry
    another is writing gets it truncated (a CI run's collection failed on it: "Error -5
    while decompressing data"; a killed writer leaves one for good). JAX then warns and
    compiles the program itself; under the suite's warning filters (pyproject.toml) that
    warning is no error. Here every cache read fails as that one did."""

    def torn(*args: object, **kwargs: object) -> None:
        raise compilation_cache.zlib.error("Error -5 while decompressing data")

    monkeypatch.setattr(compilation_cache, "get_executable_and_time", torn)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # record what JAX warns, then apply the suite's
        out = jax.jit(lambda x: x * 3 + 1)(jnp.arange(4))
    assert out.tolist() == [1, 4, 7, 10]  # compiled and run all the same
    messages = [str(w.message) for w in seen]
    assert any("Error reading persistent compilation cache entry" in m for m in messages)
    for m in messages:  # the suite's filters (pytest's, from pyproject.toml) let it pass
        warnings.warn(m, UserWarning, stacklevel=1)
