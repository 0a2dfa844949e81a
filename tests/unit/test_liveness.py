"""A worker's liveness as its heartbeat reads it (streamrl.run.liveness): starting counts as
live, then a tick within the limit or a busy step within its own bound."""

import time

from streamrl.run.liveness import BeatClock, Liveness


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


def test_the_beat_clock_counts_silence_only_while_the_launcher_could_see_beats() -> None:
    """Limit 6 s: looks every second count silence from the beat's last change; a look 4 s
    after the last one (the launcher stopped, > 3 s), a read that took 2 s (> 1.5 s) and a
    read that failed each restart the clock at their end."""
    clock = BeatClock(limit_s=6.0)
    for t in range(11):  # looks at 0..10 s, each answered at once
        clock.looked(float(t), float(t))
    assert clock.silent_s(beat_changed_at=3.0, now=10.0) == 7.0  # hung: over 6 s
    # The launcher was stopped from 10 s to 14 s: the beats it did not watch do not count.
    clock.looked(14.0, 14.0)
    assert clock.silent_s(beat_changed_at=3.0, now=14.0) == 0.0
    clock.looked(15.0, 15.0)
    clock.looked(16.0, 16.0)
    assert clock.silent_s(beat_changed_at=3.0, now=16.0) == 2.0
    assert clock.silent_s(beat_changed_at=15.5, now=16.0) == 0.5
    # A read began at 17 s and answered at 19 s: the clock restarts at 19 s.
    clock.looked(17.0, 19.0)
    assert clock.silent_s(beat_changed_at=3.0, now=20.0) == 1.0
    # A read that took 1 s is no reason: the clock goes on.
    clock.looked(20.0, 21.0)
    clock.looked(21.0, 21.0)
    assert clock.silent_s(beat_changed_at=3.0, now=26.0) == 7.0
    # Redis did not answer at 27 s.
    clock.blind(27.0)
    assert clock.silent_s(beat_changed_at=3.0, now=30.0) == 3.0
