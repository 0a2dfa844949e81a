"""Review L11: a Redis that may evict keys would silently break exactly-once (the emitted
set, the member hashes, the ledger), so `streamrl up` refuses one, naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from streamrl.run.runtime import NoRedisError, refuse_eviction
from tests.helpers import REPO, TINY


@pytest.fixture
def evicting(rclient: redis.Redis) -> Iterator[redis.Redis]:
    """The session's Redis with an eviction policy, for one test."""
    before: Any = rclient.config_get("maxmemory-policy")["maxmemory-policy"]
    rclient.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield rclient
    finally:
        rclient.config_set("maxmemory-policy", before)


def test_noeviction_passes(rclient: redis.Redis) -> None:
    assert rclient.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    refuse_eviction(rclient)


def test_an_evicting_redis_is_refused(evicting: redis.Redis) -> None:
    with pytest.raises(NoRedisError, match=r"maxmemory-policy is allkeys-lru.*noeviction"):
        refuse_eviction(evicting)


def test_up_refuses_an_evicting_redis(
    evicting: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "streamrl_workers.cli", "up", "--config", str(TINY),
         "--run-dir", str(tmp_path / "run"), "--steps", "1"],
        cwd=REPO, env={**os.environ, "REDIS_URL": redis_url}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 2, p.stdout + p.stderr
    assert "maxmemory-policy" in p.stderr and "noeviction" in p.stderr
    assert not (tmp_path / "run" / "logs" / "trainer-0.log").exists()  # no worker started
