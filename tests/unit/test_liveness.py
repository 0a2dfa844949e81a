"""A worker's liveness as its heartbeat reads it (streamrl.run.liveness): starting counts as
live, then a tick within the limit or a busy step within its own bound."""

import time

from streamrl.run.liveness import Liveness


def test_a_loop_that_stops_ticking_is_not_live() -> None:
    alive = Liveness()
    assert alive.live(0.05)  # starting: no tick yet
    alive.tick()
    assert alive.live(0.05)
    time.sleep(0.1)
    assert not alive.live(0.05)
    alive.tick()
    assert alive.live(0.05)


def test_a_busy_step_is_live_within_its_own_bound() -> None:
    alive = Liveness()
    alive.tick()
    with alive.busy():
        time.sleep(0.1)
        assert alive.live(0.05)  # a train step, a checkpoint: no bound
        with alive.busy(max_s=0.05):
            time.sleep(0.1)
            assert alive.live(0.05)  # the unbounded one still runs
    assert alive.live(0.05)  # it ticked at its end
    with alive.busy(max_s=0.05):  # a tool call past its own limit
        time.sleep(0.1)
        assert not alive.live(0.05)
