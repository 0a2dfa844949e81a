"""A worker's liveness as its heartbeat reads it (streamrl.liveness): starting counts as
live, then a tick within the limit or a busy step within its own bound."""

import time
from collections.abc import Iterator

import pytest

from streamrl import liveness


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    liveness.reset()
    yield
    liveness.reset()


def test_a_loop_that_stops_ticking_is_not_live() -> None:
    assert liveness.live(0.05)  # starting: no tick yet
    liveness.tick()
    assert liveness.live(0.05)
    time.sleep(0.1)
    assert not liveness.live(0.05)
    liveness.tick()
    assert liveness.live(0.05)


def test_a_busy_step_is_live_within_its_own_bound() -> None:
    liveness.tick()
    with liveness.busy():
        time.sleep(0.1)
        assert liveness.live(0.05)  # a train step, a checkpoint: no bound
        with liveness.busy(max_s=0.05):
            time.sleep(0.1)
            assert liveness.live(0.05)  # the unbounded one still runs
    assert liveness.live(0.05)  # it ticked at its end
    with liveness.busy(max_s=0.05):  # a tool call past its own limit
        time.sleep(0.1)
        assert not liveness.live(0.05)


def test_busy_decorates() -> None:
    @liveness.busy()
    def step() -> bool:
        time.sleep(0.1)
        return liveness.live(0.05)

    liveness.tick()
    assert step()
    assert step()  # a fresh context each call
