"""Structured logs: one JSON object per line, ids bound, secrets never written."""

import io
import json
from pathlib import Path

from streamrl.run.logs import LogFile, configure_logging


def test_secrets_are_redacted_and_counts_kept() -> None:
    out = io.StringIO()
    log = configure_logging("tools", stream=out, worker_id="tools-0")
    log.info(
        "connect",
        password="hunter2",
        api_token="abc",
        tokens=512,
        url="redis://:s3cret@127.0.0.1:6379/0",
    )
    line = out.getvalue().strip()
    event = json.loads(line)
    assert event["event"] == "connect" and event["worker"] == "tools"
    assert event["worker_id"] == "tools-0" and event["tokens"] == 512
    assert event["password"] == "***" and event["api_token"] == "***"
    assert "hunter2" not in line and "s3cret" not in line and "abc" not in line


def test_nested_secrets_are_redacted() -> None:
    """Review L12: secrets inside dicts and lists are masked too (a field's items share its
    name: a list under a secret name is masked whole, a URL in any list loses its
    password), and numbers, booleans and None stay as they are."""
    out = io.StringIO()
    log = configure_logging("tools", stream=out)
    log.info(
        "skipped",
        skipped={"docker": {"url": "tcp://u:pw1@host:2376", "password": "pw2", "ok": False}},
        urls=["redis://:pw3@h/0", "plain"],
        secrets=["pw4", "pw5"],
        trajectories=[{"traj_id": "g1-m0", "tokens": 55, "error": None, "token": "pw6"}],
    )
    line = out.getvalue().strip()
    event = json.loads(line)
    assert event["skipped"]["docker"] == {
        "url": "tcp://***@host:2376",
        "password": "***",
        "ok": False,
    }
    assert event["urls"] == ["redis://***@h/0", "plain"] and event["secrets"] == "***"
    assert event["trajectories"] == [
        {"traj_id": "g1-m0", "tokens": 55, "error": None, "token": "***"}
    ]
    assert not any(f"pw{i}" in line for i in range(1, 7))


def test_a_log_file_rolls_over_by_size(tmp_path: Path) -> None:
    """Review M4 (logs): a worker's JSON log rolls over at `max_mb` into `.1`, `.2`,
    keeping `backups` of them; every line stays whole JSON."""
    path = tmp_path / "rollout-0.log"
    log = configure_logging("rollout", file=LogFile(path, max_mb=0.01, backups=2))
    for i in range(1000):  # about 100 KB: ten times the size
        log.info("trajectory_committed", n=i, pad="x" * 40)
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["rollout-0.log", "rollout-0.log.1", "rollout-0.log.2"]
    assert all(f.stat().st_size <= 0.01 * 2**20 for f in files)
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    assert max(e["n"] for e in lines) == 999 and len(lines) < 1000  # the oldest rolled off


def test_an_exception_python_cannot_raise_is_one_json_event() -> None:
    """CI saw a proxy log broken by the interpreter's plain "Exception ignored in: <coroutine
    object ...>" lines (a connection's task collected while suspended): such reports now
    come as one JSON event like every other line."""
    import gc
    import sys

    class Broken:
        def __del__(self) -> None:
            raise RuntimeError("closing failed")

    out = io.StringIO()
    before = sys.unraisablehook
    try:
        configure_logging("proxy", stream=out)
        Broken()
        gc.collect()
    finally:
        sys.unraisablehook = before
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    event = json.loads(lines[0])
    assert event["event"] == "unraisable_exception"
    assert event["worker"] == "proxy"
    assert "Broken.__del__" in event["object"]
    assert "RuntimeError: closing failed" in event["exception"]
