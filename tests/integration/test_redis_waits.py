"""Redis answers LOADING (a restart loading its data) or BUSY (a script past its time
limit): the workers' clients wait it out (`streamrl.transport.make_client`), and the
launcher's monitor does not die of it (review H2, L3)."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import ExponentialBackoff

from streamrl.config import Config
from streamrl.names import Keys
from streamrl.run.launcher import Launcher
from streamrl.run.redis_server import EmbeddedRedis
from streamrl.transport import WaitingRetry, make_async_client, make_client

# Spins until the server clock passes ARGV[1] seconds from now (TIME is allowed: effects
# are replicated, not the script).
_SPIN = """
local t = redis.call('TIME')
local stop = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1]) * 1000000
while true do
  t = redis.call('TIME')
  if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop then return 1 end
end
"""


@pytest.fixture
def busy_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A server of its own (its script time limit is lowered to 50 ms)."""
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False)
    with server:
        redis.Redis.from_url(server.url).config_set("lua-time-limit", 50)
        yield server


def _spin_in_background(url: str, seconds: float) -> threading.Thread:
    def spin() -> None:
        redis.Redis.from_url(url).eval(_SPIN, 0, seconds)

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.3)  # the script runs, and is past its time limit
    return thread


def test_busy_is_waited_out_and_real_errors_are_not_retried(busy_server: EmbeddedRedis) -> None:
    url = busy_server.url
    plain = redis.Redis.from_url(url)
    plain.hset("h", "a", 1)
    plain.set("s", "x")
    spin = _spin_in_background(url, 2.0)
    try:
        with pytest.raises(redis.ResponseError, match=r"^BUSY "):
            plain.hgetall("h")  # what a client without the wait gets
        client = make_client(url, retries=2)
        assert client.hgetall("h") == {b"a": b"1"}  # waited past 2 retries
    finally:
        spin.join()
    spin = _spin_in_background(url, 1.5)
    try:
        with client.pipeline(transaction=True) as pipe:  # a MULTI/EXEC, as the workers commit
            pipe.hincrby("h", "a", 1)
            pipe.set("t", "y")
            assert pipe.execute() == [2, True]
    finally:
        spin.join()
    started = time.monotonic()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        client.hgetall("s")
    assert time.monotonic() - started < 1.0  # not retried
    with pytest.raises(redis.ResponseError, match="BUSYGROUP"):  # not BUSY either
        client.xgroup_create("x", "g", mkstream=True)
        client.xgroup_create("x", "g")
    impatient = make_client(url, retries=50, busy_wait_s=0.5)
    spin = _spin_in_background(url, 2.5)
    try:
        with pytest.raises(redis.ResponseError, match=r"^BUSY "):
            impatient.get("s")  # past its busy_wait_s
    finally:
        spin.join()


def test_the_async_client_waits_out_busy(busy_server: EmbeddedRedis) -> None:
    url = busy_server.url
    redis.Redis.from_url(url).set("k", "v")
    spin = _spin_in_background(url, 1.5)

    async def read() -> Any:
        client = make_async_client(url)
        try:
            return await client.get("k")
        finally:
            await client.aclose()

    try:
        assert asyncio.run(read()) == b"v"
    finally:
        spin.join()


def test_loading_is_waited_out_past_the_retry_count() -> None:
    """LOADING (what a restarted Redis answers while it loads a large AOF) is waited out
    by time, not by the count of retries that bounds connection errors. (redis-server 6.2
    answers no command during a load in a test's reach, so the replies are raised here.)"""
    fast = ExponentialBackoff(cap=0.01, base=0.001)
    retry = WaitingRetry(fast, 2, busy_wait_s=30)
    replies = iter([redis.BusyLoadingError("Redis is loading the dataset in memory")] * 20)

    def do() -> str:
        err = next(replies, None)
        if err is not None:
            raise err
        return "ok"

    failed: list[int] = []
    assert retry.call_with_retry(do, lambda _e, n: failed.append(n), None, True) == "ok"
    assert len(failed) == 20
    drops = iter([redis.ConnectionError("reset")] * 3)

    def drop() -> str:
        raise next(drops)

    with pytest.raises(redis.ConnectionError):  # still 2 retries for a lost connection
        retry.call_with_retry(drop, lambda _e: None)
    assert next(drops, None) is None
    impatient = WaitingRetry(fast, 2, busy_wait_s=0.05)
    with pytest.raises(redis.BusyLoadingError):
        impatient.call_with_retry(_loading, lambda _e: None)


def _loading() -> str:
    raise redis.BusyLoadingError("Redis is loading the dataset in memory")


class _BusyStats:
    """A client whose every read answers BUSY, as Redis does during a long script."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.calls = 0

    def hgetall(self, _key: str) -> Any:
        self.calls += 1
        self.launcher._stop_signal = "SIGTERM"  # the monitor's next turn ends the run
        raise redis.ResponseError("BUSY Redis is busy running a script.")

    def __getattr__(self, _name: str) -> Any:
        raise redis.ResponseError("BUSY Redis is busy running a script.")


def test_the_launcher_monitor_rides_out_busy(tmp_path: Path) -> None:
    launcher = Launcher(Config(), "configs/stub.toml", [], tmp_path, 1)
    client = _BusyStats(launcher)
    log: Any = _NullLog()
    assert launcher._monitor(client, log) == ("stopped by SIGTERM", 0)  # type: ignore[arg-type]
    assert client.calls == 1


class _NullLog:
    def __getattr__(self, _name: str) -> Any:
        return lambda *a, **k: None


def test_the_launcher_reads_counters_that_are_not_whole(
    rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The stats hash holds whole counters and sums of seconds (HINCRBYFLOAT, as
    `episodes_resumed_saved_s`): the launcher's progress line and summary read both (a
    float made `_stats` raise, and the launcher died mid run with its workers)."""
    out = io.StringIO()
    launcher = Launcher(Config(), "configs/stub.toml", [], tmp_path, 1, out=out)
    launcher.keys = keys
    rclient.hincrby(keys.stats, "groups", 3)
    rclient.hincrbyfloat(keys.stats, "episodes_resumed_saved_s", 1.25)
    assert launcher._stats(rclient) == {"groups": 3, "episodes_resumed_saved_s": 1.25}
    launcher._progress(rclient)
    assert "step 0/1" in out.getvalue()
