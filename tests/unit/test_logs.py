"""Structured logs: one JSON object per line, ids bound, secrets never written."""

import io
import json

from streamrl.logs import configure_logging


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
