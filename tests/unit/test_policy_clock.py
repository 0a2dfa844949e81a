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


def test_two_resumes_a_few_steps_apart_take_both_jumps_out() -> None:
    """As CI's fault run met it: resume 1 restored the state of step 33 (version 33) and
    published it as 37 (jump 4); step 37 trained a group sampled at version 34 (of the
    discarded lineage) at version 40, lag 40 - 4 - 34 = 2. Resume 2 restored step 36 (its
    version 40) as 42 (jump 2) and trained that group again: with the last jump only, it
    was 42 - 2 - 34 = 6 old and dropped as stale. Both jumps out: 2 again."""
    first = PolicyClock(0).resumed(37, 4)
    assert first == PolicyClock(37, 4, 37)
    assert PolicyClock(40, 4, 37).age(34) == 2
    second = policy_clock(b"40", first.encode()).resumed(42, 2)
    assert second == PolicyClock(42, 2, 42, earlier=((4, 37),))
    assert second.age(34) == 2  # as when first taken (it was 6 with one jump kept)
    assert second.age(41) == 0 and second.age(38) == 2  # the lineages after each resume
    assert policy_clock(b"42", second.encode()) == second  # as Redis holds it: "4:37,2:42"
    assert second.encode() == "4:37,2:42"
    # A restart that published nothing keeps its version: the same jump, not twice.
    assert policy_clock(b"42", second.encode()).resumed(42, 2) == second
