"""streamrl.rollout.admission: the adaptive episode limit, worked by hand."""

from dataclasses import dataclass

import pytest

from streamrl.rollout.admission import Admission, Occupancy


def occ(
    held: int, waiting: int = 0, evictions: int = 0, slots: int = 32, tokens: int | None = None
) -> Occupancy:
    return Occupancy(slots=slots, held=held, waiting=waiting, evictions=evictions, tokens=tokens)


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


@dataclass
class _Engine:
    """An engine sampling rate[limit] tokens a look of the worker (16 slots)."""

    rate: dict[int, int]
    tokens: int = 0


def _climb(a: Admission, engine: _Engine, looks: int) -> list[int]:
    """`looks` looks at `engine`, the limit binding (as many running as it allows, more
    waiting): the limits it moved through."""
    seen = [a.limit]
    for _ in range(looks):
        engine.tokens += engine.rate[a.limit]
        a.update(a.limit, 4, occ(a.limit, slots=16, tokens=engine.tokens))
        if a.limit != seen[-1]:
            seen.append(a.limit)
    return seen


def test_the_limit_climbs_to_the_most_tokens_per_second_and_stays_near_it() -> None:
    # A 16-slot pool, the limit from 16; tokens a look at each limit: most at 9. A window
    # after a change is 4 settling looks, one to start and 16 measured (21 looks); the next
    # at the same limit 16. Look 21: the first window at 16 (100 a look) ends: a step down
    # of 16 // 4 = 4 -> 12; look 42: 110 >= 0.95 x 100, kept: 12 // 4 = 3 -> 9; look 63: 120,
    # kept: 9 // 4 = 2 -> 7; look 84: 105 < 0.95 x 120 = 114, refused: back to 9, the
    # direction up, patience 2.
    engine = _Engine({16: 100, 12: 110, 9: 120, 7: 105, 11: 112})
    a = Admission(cap=64, auto=True, start=16)
    assert _climb(a, engine, 84) == [16, 12, 9, 7, 9]
    # two windows at 9 (looks 105 and 121), then 9 + 2 -> 11; look 142: 112 is not above
    # 1.05 x 120 = 126, refused: back to 9, the direction down, patience 4
    assert _climb(a, engine, 36) == [9]
    assert _climb(a, engine, 22) == [9, 11, 9]
    # four windows at 9 (looks 163, 179, 195, 211), 9 -> 7; look 232: refused, back to 9,
    # patience 8: eight windows (looks 253 ... 365) before the next step, up
    assert _climb(a, engine, 68) == [9]
    assert _climb(a, engine, 1) == [9, 7]
    assert _climb(a, engine, 21) == [7, 9]
    assert _climb(a, engine, 132) == [9]
    assert _climb(a, engine, 1) == [9, 11]
    assert (a.grows, a.lowers, a.trims) == (4, 5, 0)


def test_an_engine_that_gains_from_bigger_batches_keeps_the_limit_at_the_pool() -> None:
    # tokens a look rise with the limit (an accelerator): the step down loses (80 < 95) and
    # the limit goes back to 16, the pool; a step up finds no free slot, so the next step
    # goes down again, each after more windows at 16: 2, then 4, then 8
    engine = _Engine({16: 100, 12: 80})
    a = Admission(cap=64, auto=True, start=16)
    assert _climb(a, engine, 42) == [16, 12, 16]  # looks 21 and 42
    assert _climb(a, engine, 37) == [16, 12]  # windows at 16 end at looks 63 and 79
    assert _climb(a, engine, 21) == [12, 16]  # look 100, patience 4
    assert _climb(a, engine, 68) == [16]  # windows at looks 121, 137, 153 ...
    assert _climb(a, engine, 1) == [16, 12]  # ... and 169
    assert a.limit == 12 and a.grows == 2 and a.lowers == 3


def test_steps_that_each_lose_a_little_do_not_add_up() -> None:
    # Each step down loses 3 %: 16 (100) -> 12 (97 >= 0.95 x 100, the best: kept) -> 9 (94 <
    # 95: refused against the best, 16's, not 12's): back to 16, not to 12
    engine = _Engine({16: 100, 12: 97, 9: 94, 7: 91})
    a = Admission(cap=64, auto=True, start=16)
    assert _climb(a, engine, 63) == [16, 12, 9, 16]


def test_the_best_is_measured_again_at_its_limit() -> None:
    # 16 (100) -> 12 (110: the best) -> 9 (90: refused): back to 12, where the engine now
    # gives 80 (the machine slowed): that is 12's rate now, and the step up to 15 (12 + 3;
    # the direction turned; after two windows at 12, patience 2, looks 84 and 100) is
    # judged against it: 85 > 1.05 x 80, kept (look 121), the best; the next step up at once:
    # 15 + 3 = 18, but one slot is free: 16
    engine = _Engine({16: 100, 12: 110, 9: 90, 15: 85})
    a = Admission(cap=64, auto=True, start=16)
    assert _climb(a, engine, 63) == [16, 12, 9, 12]
    engine.rate[12] = 80
    assert _climb(a, engine, 58) == [12, 15, 16]
    assert a._probe.best == (15, 85.0)


def test_a_window_where_the_limit_does_not_bind_moves_nothing() -> None:
    # 16 allowed, 10 running, nothing waiting: the limit is not what holds the engine back
    a = Admission(cap=64, auto=True, start=16)
    tokens = 0
    for _ in range(21 * 3):
        tokens += 100
        assert a.update(10, 0, occ(10, slots=16, tokens=tokens)) == "hold"
    assert a.limit == 16


def test_a_trim_restarts_the_climb() -> None:
    a = Admission(cap=64, auto=True, start=16)
    engine = _Engine({16: 100, 12: 110})
    assert _climb(a, engine, 21) == [16, 12]
    # an eviction: 12 running x 0.9 = 10; then a fresh first window at 10, and a step down
    a.update(12, 4, occ(12, slots=16, evictions=1, tokens=engine.tokens))
    assert a.limit == 10 and a.trims == 1
    engine.rate = {10: 120, 8: 121}
    assert _climb(a, engine, 21) == [10, 8]
