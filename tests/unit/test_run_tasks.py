"""cancel_and_wait: a task that swallows its cancellation (as Python 3.11's asyncio.wait_for
does when its inner future finishes in the same turn) is cancelled again until it ends."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.run.tasks import cancel_and_wait


async def _swallows_once(turns: list[str]) -> None:
    """Loops like a heartbeat; the first cancellation is lost, as in wait_for's race."""
    lost = False
    while True:
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True
            turns.append("lost")
            continue
        turns.append("turn")


def test_one_cancel_is_not_enough_for_a_task_that_swallows_it() -> None:
    """The failure this guards against: after a single cancel the task still runs."""

    async def main() -> bool:
        turns: list[str] = []
        t = asyncio.create_task(_swallows_once(turns))
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.wait([t], timeout=0.1)
        still_running = not t.done()
        await cancel_and_wait([t])
        return still_running

    assert asyncio.run(main())


def test_a_swallowed_cancel_is_repeated_until_the_task_ends() -> None:
    async def main() -> tuple[int, list[str], bool]:
        turns: list[str] = []
        t = asyncio.create_task(_swallows_once(turns))
        plain = asyncio.create_task(asyncio.sleep(10))
        await asyncio.sleep(0.01)
        again = await cancel_and_wait([t, plain], again_s=0.01)
        return again, turns, t.cancelled() and plain.cancelled()

    again, turns, cancelled = asyncio.run(main())
    assert again == 1  # only the swallowing task needed a second cancel
    assert turns.count("lost") == 1 and cancelled


def test_outcomes_are_retrieved_and_done_tasks_are_left_alone() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> tuple[int, asyncio.Task[None], asyncio.Task[int]]:
        bad = asyncio.create_task(fails())

        async def one() -> int:
            return 1

        done = asyncio.create_task(one())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return await cancel_and_wait([bad, done]), bad, done

    again, bad, done = asyncio.run(main())
    assert again == 0 and done.result() == 1
    with pytest.raises(ValueError, match="boom"):
        bad.result()


def test_the_engine_thread_is_joined_through_repeated_cancels() -> None:
    """A stop cancels again and again (cancel_and_wait); the model server's join of its
    engine thread is not cut short by that (an engine thread left inside XLA at exit
    aborts the process), and the cancel is re-raised once the thread is joined."""
    import threading
    import time

    from streamrl.rollout.engine_server import _join

    async def main() -> tuple[bool, bool]:
        thread = threading.Thread(target=time.sleep, args=(0.3,))
        thread.start()
        joining = asyncio.create_task(_join(thread, 10))
        await asyncio.sleep(0.01)
        await cancel_and_wait([joining], again_s=0.02)  # about 15 cancels
        return thread.is_alive(), joining.cancelled()

    alive, cancelled = asyncio.run(main())
    assert not alive and cancelled
