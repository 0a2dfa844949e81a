"""A tool worker runs the tool call and no other rq job, whatever Redis says (review H4).

Jobs are written the way anyone with write access to Redis could: a plain rq Queue with the
JSON serializer on the run's tool queue, naming any function. The worker must fail them
with the reason, never import or call what they name, and keep serving real calls."""

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import structlog
from rq import Callback, Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from streamrl.config import ToolsConfig
from streamrl.names import Keys
from streamrl.tools import JOB_PATH
from streamrl.tools.client import ToolClient
from streamrl.tools.rqguard import ToolCallWorker
from streamrl.transport import make_async_client, make_client
from streamrl.wire import ToolResult
from tests.helpers import spawn_worker, stop, wait_for_rq_worker

# The calculator needs no isolation: the plain backend keeps this test off the engine.
SUBPROCESS = 'tools.sandbox="subprocess"'


def mark_path(job_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"streamrl-rq-guard-{job_id}"


def mark(job: Job, *args: Any) -> None:
    """What a hostile job names as a callback: leaves a file if it is ever called."""
    mark_path(job.id).touch()


def wait_done(job: Job, timeout_s: float = 20) -> JobStatus | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = job.get_status(refresh=True)
        if status in (JobStatus.FINISHED, JobStatus.FAILED):
            return status
        time.sleep(0.05)
    return job.get_status(refresh=True)


async def calculator(url: str, keys: Keys, expression: str) -> ToolResult:
    aclient = make_async_client(url)
    client = ToolClient(make_client(url), aclient, keys, ToolsConfig(), structlog.get_logger())
    try:
        args = json.dumps({"expression": expression})
        return await client.call("calculator", args, f"c-{time.monotonic_ns()}")
    finally:
        await aclient.aclose()


def test_other_jobs_are_refused_and_the_worker_keeps_serving(
    redis_url: str, rclient: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    system_mark = tmp_path / "system-ran"
    hostile = Queue(keys.tool_queue, connection=rclient, serializer=JSONSerializer)
    getpid = hostile.enqueue_call("os.getpid")
    system = hostile.enqueue_call("os.system", args=[f"touch {system_mark}"])
    # A name that is the tool call's module but another function, and callbacks by name.
    sneaky = hostile.enqueue_call(
        "streamrl.tools.jobs.install",
        args=[{}],
        on_failure=Callback(f"{__name__}.mark"),
        on_success=Callback(f"{__name__}.mark"),
    )
    callback_job = hostile.enqueue_call(
        JOB_PATH, kwargs={"bad": 1}, on_failure=Callback(f"{__name__}.mark")
    )
    w = spawn_worker("tools", redis_url, keys.ns, tmp_path, SUBPROCESS)
    try:
        wait_for_rq_worker(rclient, keys.tool_queue)
        for job, name in ((getpid, "os.getpid"), (system, "os.system"),
                          (sneaky, "streamrl.tools.jobs.install")):  # fmt: skip
            assert wait_done(job) == JobStatus.FAILED, name
            result = job.latest_result()
            assert result is not None and result.exc_string is not None
            assert f"refused: a tool worker runs only {JOB_PATH}, not {name!r}" in result.exc_string
        # The tool call's own path with bad arguments fails as a call, its callback unrun.
        assert wait_done(callback_job) == JobStatus.FAILED
        assert not system_mark.exists()
        assert not any(mark_path(j.id).exists() for j in (sneaky, callback_job))
        # The worker is alive and serves a real call.
        answer = asyncio.run(calculator(redis_url, keys, "6*7"))
        assert answer.ok and answer.output == "42"
        assert w.poll() is None
    finally:
        assert stop(w) == 0
    events = [
        json.loads(line)
        for line in (tmp_path / "tools-0.log").read_text().splitlines()
        if line.startswith("{")
    ]
    refused = [e for e in events if e.get("event") == "rq_job_refused"]
    assert {(e["job_id"], e["func"]) for e in refused} == {
        (getpid.id, "os.getpid"),
        (system.id, "os.system"),
        (sneaky.id, "streamrl.tools.jobs.install"),
    }
    assert all(e["level"] == "error" for e in refused)


def test_a_restarted_worker_takes_over_its_name(rclient: redis.Redis, keys: Keys) -> None:
    """A restarted container runs the same identity and pid, so the same rq name: the dead
    predecessor's registration must not block it until it expires."""
    queue = Queue(keys.tool_queue, connection=rclient, serializer=JSONSerializer)
    log = structlog.get_logger()

    def worker() -> ToolCallWorker:
        return ToolCallWorker([queue], connection=rclient, name=f"{keys.ns}-tools-0-7", log=log)

    first = worker()
    first.register_birth()  # then the container is killed: no death registered
    second = worker()
    try:
        second.register_birth()
        raise AssertionError("rq accepted a second live worker of one name")
    except ValueError as err:
        assert "There exists an active worker" in str(err)
    assert second.take_over_name()
    second.register_birth()  # takes the name at once
    second.register_death()
    assert not worker().take_over_name()  # a dead registration needs no take-over
