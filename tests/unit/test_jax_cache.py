"""The tests' shared XLA compilation cache (tests/conftest.py): many processes read and
write it at once (two test processes, every worker a test starts, the prewarm)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax
import pytest
from jax._src.lru_cache import LRUCache


def test_a_reader_never_sees_an_entry_half_written(tmp_path: Path) -> None:
    """JAX writes a cache entry in place; without a size limit it takes no lock, and a
    process that reads the entry meanwhile gets a truncated one (a CI run's collection
    failed on it: "Error -5 while decompressing data"). The suite's size limit turns the
    cache's file lock on: a reader sees no entry or the whole one."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        pytest.skip("no shared compilation cache (STREAMRL_TEST_JAX_CACHE is empty)")
    limit = int(jax.config.jax_compilation_cache_max_size)  # type: ignore[attr-defined]
    assert limit > 0  # conftest's setting is in force in this process (and its children)
    value = os.urandom(96 << 20)  # long enough to write that a reader lands inside it
    writer, reader = (
        LRUCache(str(tmp_path), max_size=limit),
        LRUCache(str(tmp_path), max_size=limit),
    )
    put = threading.Thread(target=writer.put, args=("k", value))
    put.start()
    seen: list[int] = []
    while not seen:
        got = reader.get("k")
        if got is not None:
            seen.append(len(got))
    put.join()
    assert seen == [len(value)]
