"""Stopping asyncio tasks for good.

`cancel_and_wait` cancels tasks and waits until each has ended, cancelling again any that
went on. On Python 3.11, `asyncio.wait_for` returns the inner result when the inner future
finishes in the same loop turn as the cancellation, and the cancellation is lost
(CPython gh-86296, fixed in 3.12 by building `wait_for` on `asyncio.timeout`). redis-py's
asyncio client sends every command under `wait_for`, so a task cancelled inside a Redis
call can carry on as if nothing happened: a rollout worker's heartbeat did, and the
worker's stop, gathering its tasks after one `cancel()`, waited for ever (a CI run's
300 s test timeout; reproduced in tests/integration/test_cancel.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

# How long a cancelled task has to end before it is cancelled again: long enough for the
# cleanup a cancel starts (a commit's reply, a pool's release), short for a stop.
AGAIN_S = 1.0


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], again_s: float = AGAIN_S) -> int:
    """Cancel `tasks` and return once every one has ended (cancelled, failed or returned),
    each task's outcome retrieved (no "exception was never retrieved" at exit). A task that
    swallowed its cancellation is cancelled again every `again_s`; one that never ends
    holds this for ever, as a plain gather would. Returns how many tasks had to be
    cancelled more than once."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    again: set[asyncio.Task[object]] = set()
    first = True
    while pending:
        if not first:
            again |= pending
        first = False
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_s)
    await asyncio.gather(*tasks, return_exceptions=True)
    return len(again)
