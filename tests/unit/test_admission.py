"""streamrl.rollout.admission: the adaptive episode limit, worked by hand."""

import pytest

from streamrl.model.engine import DecodeCost
from streamrl.rollout.admission import Admission, Occupancy, batch_ceiling


def occ(
    held: int,
    waiting: int = 0,
    evictions: int = 0,
    slots: int = 32,
    costs: dict[int, DecodeCost] | None = None,
) -> Occupancy:
    return Occupancy(slots, held, waiting, evictions, costs or {})


def ms(per_row: dict[int, float], calls: int = 100) -> dict[int, DecodeCost]:
    """Decode costs of `calls` calls a bucket, every row active, at `per_row` ms a row."""
    return {n: DecodeCost(calls, calls * n, calls * n * m / 1000) for n, m in per_row.items()}


def test_a_fixed_limit_never_moves() -> None:
    a = Admission(cap=64, auto=False, start=8)
    assert a.limit == 64
    assert a.update(64, 10, occ(32, waiting=40, evictions=5)) == "fixed" and a.limit == 64


def test_grows_while_slots_are_free_and_the_limit_binds() -> None:
    # a 32-slot pool, limit 8 (trimmed earlier): 8 running, more waiting to start, 8 held:
    # free = 32 - max(8, 8) = 24: + min(24, max(1, 8 // 8)) = 9; then 10; not when nothing
    # waits to start, nor when fewer run than the limit allows.
    a = Admission(cap=256, auto=True, start=8)
    assert a.update(8, 4, occ(8)) == "grow" and a.limit == 9
    assert a.update(9, 4, occ(9)) == "grow" and a.limit == 10
    assert a.update(10, 0, occ(10)) == "hold" and a.limit == 10  # nothing waits to start
    assert a.update(7, 4, occ(7)) == "hold" and a.limit == 10  # it does not bind
    # 16 running: + 16 // 8 = 2
    a.limit = 16
    assert a.update(16, 4, occ(16)) == "grow" and a.limit == 18
    # 30 running, 31 held (one slot held by something else): free 1: + min(1, 3) = 31
    a.limit = 30
    assert a.update(30, 4, occ(31)) == "grow" and a.limit == 31
    # 31 running, 31 held, one request found no slot: free 32 - 32 = 0: hold
    assert a.update(31, 4, occ(31, waiting=1)) == "hold" and a.limit == 31
    # the episodes running count even where they hold no slot yet (between two turns
    # after a weight swap dropped the parked slots): 32 running, 20 held: free 0: hold
    a.limit = 32
    assert a.update(32, 4, occ(20)) == "hold" and a.limit == 32
    assert a.grows == 4


def test_the_limit_never_passes_the_pool_from_its_start() -> None:
    # started at the pool (the worker does): it binds, but no slot is free: it holds.
    a = Admission(cap=64, auto=True, start=32)
    assert [a.update(32, 8, occ(32)) for _ in range(3)] == ["hold"] * 3 and a.limit == 32


def test_an_eviction_or_an_overflowing_pool_trims_to_nine_tenths_of_the_running() -> None:
    a = Admission(cap=256, auto=True, start=40)
    # first look: the eviction count is a baseline; held 30 of 32, none lacking a slot:
    # no overflow; 40 running: free < 0: hold
    assert a.update(40, 4, occ(30, evictions=3)) == "hold" and a.limit == 40
    # 3 -> 5 evictions since the last look: 40 running x 0.9 = 36
    assert a.update(40, 4, occ(30, evictions=5)) == "trim" and a.limit == 36
    # still 40 running (none preempted), no new eviction, no overflow: hold at 36
    assert a.update(40, 4, occ(30, evictions=5)) == "hold" and a.limit == 36
    # no new eviction, but 8 requests found no slot: (32 + 8) / 32 > 1: 38 x 0.9 = 34
    assert a.update(38, 0, occ(32, waiting=8, evictions=5)) == "trim" and a.limit == 34
    # still overflowing with 35 running: 35 x 0.9 = 31
    assert a.update(35, 0, occ(32, waiting=4, evictions=5)) == "trim" and a.limit == 31
    # 31 running, 27 held: free 1, but it does not bind with nothing waiting: hold
    assert a.update(31, 0, occ(27, evictions=5)) == "hold" and a.limit == 31
    assert a.trims == 3
    # one running: the limit stays at least 1
    b = Admission(cap=8, auto=True, start=2)
    b.update(1, 1, occ(1, evictions=0))
    assert b.update(1, 1, occ(4, waiting=4, evictions=1, slots=4)) == "trim" and b.limit == 1


def test_without_a_kv_pool_it_grows_to_the_cap() -> None:
    a = Admission(cap=20, auto=True, start=16)
    assert [a.update(a.limit, 4, None) for _ in range(3)] == ["grow", "grow", "hold"]
    assert a.limit == 20  # 16 + 16 // 8 = 18, 18 + 18 // 8 = 20, the cap


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="start 0"):
        Admission(cap=8, auto=True, start=0)
    with pytest.raises(ValueError, match="cap 8"):
        Admission(cap=8, auto=True, start=9)


def test_the_batch_ceiling_is_the_largest_bucket_within_the_margin_of_the_cheapest() -> None:
    # ms a row: 1: 10, 2: 6, 4: 4.0 (cheapest), 8: 4.1 (within 5 %: <= 4.2), 16: 5.0
    # (dearer): a decode call of 16 rows makes each token cost 22 % more than one of 8:
    # the ceiling is 8.
    assert batch_ceiling(ms({1: 10, 2: 6, 4: 4.0, 8: 4.1, 16: 5.0})) == 8
    # memory-bound (an accelerator): twice the rows cost about one call more: the largest
    # bucket is the cheapest a token: nothing capped
    assert batch_ceiling(ms({1: 10, 2: 5, 4: 2.5, 8: 1.3, 16: 0.7})) is None
    # compute-bound but flat (4.0, 4.1, 4.15: all within 5 %): nothing capped
    assert batch_ceiling(ms({4: 4.0, 8: 4.1, 16: 4.15})) is None
    # a bucket with fewer than MIN_CALLS (64) calls is not judged: 16 (63 calls) aside,
    # 8 costs 25 % more than 4: the ceiling is 4
    costs = ms({4: 4.0, 8: 5.0}) | ms({16: 1.0}, calls=63)
    assert batch_ceiling(costs) == 4
    assert batch_ceiling(ms({16: 1.0}, calls=63)) is None  # nothing judged
    assert batch_ceiling({}) is None
    # padding counts: bucket 8's calls decoded 6 active rows each: 8 rows' time over 6
    # tokens: 3.6 ms x 8 / 6 = 4.8 ms a token against bucket 4's 4.0: the ceiling is 4
    padded = ms({4: 4.0}) | {8: DecodeCost(100, 600, 100 * 8 * 3.6 / 1000)}
    assert batch_ceiling(padded) == 4
    assert batch_ceiling(padded, margin=0.25) is None  # 4.8 <= 4.0 x 1.25


def test_the_latency_ceiling_trims_to_it_and_stops_growth_until_it_lifts() -> None:
    a = Admission(cap=64, auto=True, start=16)
    # no bucket judged yet: hold at the pool
    assert a.update(16, 4, occ(16, slots=16)) == "hold" and a.ceiling is None
    # 16-row calls cost 25 % more a token than 8-row ones: trim to 8 (none preempted)
    dear = ms({4: 4.2, 8: 4.0, 16: 5.0})
    assert a.update(16, 4, occ(16, slots=16, costs=dear)) == "trim"
    assert a.limit == 8 and a.ceiling == 8 and a.trims == 1
    # 12 still running, 4 waiting to start, slots free: the limit binds but the ceiling
    # holds it
    assert a.update(12, 4, occ(12, slots=16, costs=dear)) == "hold" and a.limit == 8
    assert a.update(8, 4, occ(8, slots=16, costs=dear)) == "hold" and a.limit == 8
    # an eviction (0 -> 2 since the first look) still trims below it: 9/10 of 8 running: 7
    assert a.update(8, 4, occ(8, slots=16, evictions=2, costs=dear)) == "trim" and a.limit == 7
    # growth within the ceiling: 7 -> 8, then held
    assert a.update(7, 4, occ(7, slots=16, evictions=2, costs=dear)) == "grow" and a.limit == 8
    assert a.update(8, 4, occ(8, slots=16, evictions=2, costs=dear)) == "hold"
    # the 8-row calls grew dearer (the machine's load moved): 16 is within 5 % of the
    # cheapest again: the ceiling lifts and the limit grows into the free slots
    even = ms({4: 4.9, 8: 4.8, 16: 5.0})
    assert a.update(8, 4, occ(8, slots=16, evictions=2, costs=even)) == "grow"
    assert a.ceiling is None and a.limit == 9
    assert a.trims == 2 and a.grows == 2
