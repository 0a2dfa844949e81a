"""`streamrl up`'s restart policy: how many restarts a window allows, and the backoff."""

from streamrl.config import MAX_BACKOFF_S
from streamrl.run.supervise import backoff_s, restart_decision


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
