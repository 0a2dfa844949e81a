"""streamrl.rl.clock: policy age across a trainer resume (review N1), worked by hand."""

from streamrl.rl.clock import PolicyClock, clock_of, policy_clock


def test_the_resume_jump_is_no_age() -> None:
    # Checkpoint at version 5; the trainer had published up to 8 and died; the resume
    # publishes the restored state as 9 (since 9, offset 9 - 5 = 4). Two steps later the
    # trainer is at 11.
    clock = PolicyClock(version=11, offset=4, since=9)
    assert clock.age(10) == 1  # the current lineage: 11 - 10
    assert clock.age(9) == 2
    assert clock.age(5) == 2  # the restored state's own version: 11 - 4 - 5
    assert clock.age(3) == 4  # the common ancestry: its age against the restored state, +2
    assert clock.age(7) == 0  # a discarded lineage's version (6-8): as fresh as the state
    # Without a resume the clock is the plain difference.
    assert PolicyClock(11).age(3) == 8 and clock_of(11) == PolicyClock(11)


def test_the_clock_as_redis_holds_it() -> None:
    assert policy_clock(b"11", b"4:9") == PolicyClock(11, 4, 9)
    assert policy_clock(b"11", None) == PolicyClock(11)
    assert policy_clock(None, None) == PolicyClock(0)
    assert str(PolicyClock(11, 4, 9)) == "11 (4 jumped by a resume at 9)"
