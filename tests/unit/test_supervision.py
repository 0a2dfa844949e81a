"""`streamrl up`'s restart policy: how many restarts a window allows, and the backoff."""

from collections import deque

from streamrl.launcher import MAX_BACKOFF_S, backoff_s, restart_decision, window_rate


def test_restarts_within_the_window_are_counted() -> None:
    assert restart_decision([], 100.0, 3, 60.0) == 1
    assert restart_decision([50.0, 90.0], 100.0, 3, 60.0) == 3
    assert restart_decision([50.0, 90.0, 95.0], 100.0, 3, 60.0) is None  # used up
    # Restarts older than the window no longer count.
    assert restart_decision([10.0, 20.0, 95.0], 100.0, 3, 60.0) == 2
    assert restart_decision([], 100.0, 0, 60.0) is None  # max_restarts 0: never


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_s(n, 1.0) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_s(20, 1.0) == MAX_BACKOFF_S
    assert backoff_s(3, 0.0) == 0.0


def test_the_progress_rate_is_over_the_window_not_since_the_run_began() -> None:
    """A resumed run starts with the counts of the first (900 groups): its first minutes
    show the groups it made, not 900 over a few seconds (the line's old cumulative rate);
    samples older than the window drop out."""
    seen: deque[tuple[float, int | float]] = deque()
    assert window_rate(seen, 0.0, 900, 60.0) == 0.0  # one sample: no rate yet
    assert window_rate(seen, 10.0, 910, 60.0) == 1.0  # 10 groups in 10 s
    assert window_rate(seen, 60.0, 960, 60.0) == 1.0
    # The oldest sample kept is the newest one at least a window old (10 s at 100 s).
    assert window_rate(seen, 100.0, 1090, 60.0) == (1090 - 910) / 90
    assert [t for t, _ in seen] == [10.0, 60.0, 100.0]
    assert window_rate(seen, 130.0, 1090, 60.0) == (1090 - 960) / 70  # stalled: falls
    assert [t for t, _ in seen] == [60.0, 100.0, 130.0]
