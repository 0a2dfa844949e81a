"""The rq worker of a tool worker, which runs the tool call and nothing else.

rq stores a job's function as a dotted name in the job's hash in Redis and imports it when
the job runs; its callbacks (success, failure, stopped) are names too, and its webhooks are
URLs the worker posts to. So whoever can write to Redis could make a tool worker, which holds
the container engine's socket, import and call any function on the host. Here the job
class resolves only `JOB_PATH`, to the function object itself (no import by name), and
has no callbacks and no webhooks, whatever the hash says; the worker logs every other job
at error level and fails it with the reason (no retry), then serves the next job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from rq import SimpleWorker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue

from streamrl.run.liveness import Liveness
from streamrl.tools import JOB_PATH
from streamrl.tools.jobs import run_tool_call

if TYPE_CHECKING:
    from redis.client import Pipeline


class RefusedJobError(RuntimeError):
    """A job whose function is not the tool call: it is failed, never imported or run."""


def refusal(job: Job) -> str | None:
    """Why `job` must not run in a tool worker, or None when it is a tool call."""
    func_name = job.func_name  # only decoded here: the JSON serializer imports nothing
    if func_name != JOB_PATH:
        return f"refused: a tool worker runs only {JOB_PATH}, not {func_name!r}"
    if job.instance is not None:
        return f"refused: {JOB_PATH} is called on no instance"
    return None


class ToolCallJob(Job):
    """A job that can only be the tool call: the stored name is checked, never imported."""

    @property
    def func(self) -> Callable[..., dict[str, object]]:
        reason = refusal(self)
        if reason is not None:
            raise RefusedJobError(reason)
        return run_tool_call

    @property
    def success_callback(self) -> None:
        return None

    @property
    def failure_callback(self) -> None:
        return None

    @property
    def stopped_callback(self) -> None:
        return None

    def send_webhooks(self, status: str | JobStatus, *, exc_string: str | None = None) -> None:
        """Never: a webhook is a request to a URL written in Redis."""


class ToolCallWorker(SimpleWorker):
    """An rq `SimpleWorker` of `ToolCallJob`s that refuses any other job, loudly.

    Queues given to it must be made with `job_class=ToolCallJob` too: their registries'
    cleanup fetches jobs (and runs failure callbacks) with the queue's class."""

    job_class = ToolCallJob

    def __init__(
        self,
        *args: Any,
        log: structlog.stdlib.BoundLogger,
        liveness: Liveness | None = None,
        call_limit_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.streamrl_log = log
        self.liveness = liveness or Liveness()
        self.call_limit_s = call_limit_s  # a job is a busy step this long

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        """rq's heartbeat, which its loop sends each time round (after each job, each
        dequeue timeout): the loop's liveness tick too (`streamrl.run.liveness`)."""
        self.liveness.tick()
        super().heartbeat(timeout, pipeline=pipeline)

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Run one job: a busy step for up to the call's own limit (`call_limit_s`), so a
        tool call longer than the liveness limit is not taken for a stuck worker."""
        with self.liveness.busy(self.call_limit_s):
            super().execute_job(job, queue)

    def perform_job(self, job: Job, queue: Queue, execution: Execution) -> bool:
        try:
            name: str | None = job.func_name
            reason = refusal(job)
        except Exception as err:  # an undecodable job hash; rq fails it below
            name, reason = None, f"refused: undecodable job: {type(err).__name__}: {err}"
        if reason is not None:
            self.streamrl_log.error("rq_job_refused", job_id=job.id, func=name, reason=reason)
            job.retries_left = None  # failed for good: a refusal is not transient
        # A refused job raises RefusedJobError from `func` inside rq's own handling, which
        # records it as failed with that reason and keeps the worker serving.
        return super().perform_job(job, queue, execution)

    def take_over_name(self) -> bool:
        """Retire a live-looking rq registration under this worker's name, if any; True
        when there was one. Only for a process that holds its identity (streamrl.run.identity,
        or the launcher's indices): such a registration is its predecessor's (a restarted
        container keeps its name), dead, and would block `register_birth` until it
        expires."""
        if not self.connection.exists(self.key) or self.connection.hexists(self.key, "death"):
            return False
        stale = SimpleWorker.find_by_key(
            self.key, connection=self.connection, serializer=self.serializer
        )
        if stale is None:
            return False
        self.streamrl_log.warning("rq_worker_name_taken_over", name=self.name)
        stale.register_death()
        return True
